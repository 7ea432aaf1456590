/* accumulate.c - dst += src over fp32/fp16/bf16 buffers (gradient buckets). */

/* GCC will not if-convert the selects of the fp16 conversions while it assumes
 * float ops may trap, and leaves those loops scalar. Nothing here reads the FP
 * exception flags, so tell it they do not matter (results are unchanged). Set for
 * the whole file, before the includes, so the inline conversions still inline. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "bucket_args.h"
#include "elementwise.h"

/* One loop per (dst, src) pair, so the dtype dispatch happens once per chunk and
 * each loop body is straight-line code the compiler can vectorize. The sum is
 * formed in fp32 and rounded once into dst's dtype. */
#define PR_ACC_LOOP(name, dst_t, dst_load, dst_store, src_t, src_load, src_store_unused) \
  static void name(void* dst_, const void* src_, int64_t n) {                            \
    dst_t* dst = (dst_t*)dst_;                                                           \
    const src_t* src = (const src_t*)src_;                                               \
    int64_t i;                                                                           \
    for (i = 0; i < n; ++i) dst[i] = dst_store(dst_load(dst[i]) + src_load(src[i]));     \
  }

PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f32_f32, PR_EW_F32, PR_EW_F32)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f16_f16, PR_EW_F16, PR_EW_F16)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_bf16_bf16, PR_EW_BF16, PR_EW_BF16)
PR_EW_PAIR_TABLE(pr_acc_table, PR_ACC_LOOP, pr_acc, pr_acc_f32_f32, pr_acc_f16_f16,
                 pr_acc_bf16_bf16)

PRECIS_API precis_status_t precis_accumulate(void* dst, precis_dtype_t dst_dtype, const void* src,
                                             precis_dtype_t src_dtype, int64_t numel) {
  static const char fn[] = "precis_accumulate";
  precis_status_t st;
  pr_clear_error();
  st = pr_bucket_check_disjoint_pair(fn, dst, (int)dst_dtype, src, (int)src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  pr_ew_run_pair(pr_acc_table[dst_dtype][src_dtype], dst, dst_dtype, src, src_dtype, numel);
  return PRECIS_OK;
}
