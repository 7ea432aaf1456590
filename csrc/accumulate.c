/* accumulate.c - dst += src over fp32/fp16/bf16 buffers (gradient buckets). */

/* GCC will not if-convert the selects of the fp16 conversions while it assumes
 * float ops may trap, and leaves those loops scalar. Nothing here reads the FP
 * exception flags, so tell it they do not matter (results are unchanged). Set for
 * the whole file, before the includes, so the inline conversions still inline. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "elementwise.h"

typedef void (*pr_acc_fn)(void* dst, const void* src, int64_t n);

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
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f32_f16, PR_EW_F32, PR_EW_F16)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f32_bf16, PR_EW_F32, PR_EW_BF16)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f16_f32, PR_EW_F16, PR_EW_F32)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f16_f16, PR_EW_F16, PR_EW_F16)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_f16_bf16, PR_EW_F16, PR_EW_BF16)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_bf16_f32, PR_EW_BF16, PR_EW_F32)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_bf16_f16, PR_EW_BF16, PR_EW_F16)
PR_EW_APPLY(PR_ACC_LOOP, pr_acc_bf16_bf16, PR_EW_BF16, PR_EW_BF16)

/* Indexed [dst_dtype][src_dtype]; FP32 = 0, FP16 = 1, BF16 = 2. */
static const pr_acc_fn pr_acc_table[3][3] = {
    {pr_acc_f32_f32, pr_acc_f32_f16, pr_acc_f32_bf16},
    {pr_acc_f16_f32, pr_acc_f16_f16, pr_acc_f16_bf16},
    {pr_acc_bf16_f32, pr_acc_bf16_f16, pr_acc_bf16_bf16},
};

PRECIS_API precis_status_t precis_accumulate(void* dst, precis_dtype_t dst_dtype, const void* src,
                                             precis_dtype_t src_dtype, int64_t numel) {
  static const char fn[] = "precis_accumulate";
  pr_acc_fn loop;
  int64_t dst_size, src_size, chunks, c;
  pr_clear_error();
  if (numel < 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: numel is %lld, must be >= 0", fn,
                   (long long)numel);
  }
  if (!pr_ew_dtype_ok(dst_dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE,
                   "%s: dst_dtype %s is not supported; accepted: fp32, fp16, bf16", fn,
                   pr_dtype_label((int)dst_dtype));
  }
  if (!pr_ew_dtype_ok(src_dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE,
                   "%s: src_dtype %s is not supported; accepted: fp32, fp16, bf16", fn,
                   pr_dtype_label((int)src_dtype));
  }
  if (numel == 0) return PRECIS_OK;
  if (dst == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dst is NULL", fn);
  if (src == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: src is NULL", fn);

  loop = pr_acc_table[dst_dtype][src_dtype];
  dst_size = pr_ew_elem_size(dst_dtype);
  src_size = pr_ew_elem_size(src_dtype);
  chunks = pr_ew_chunks(numel);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (chunks > 1)
#endif
  for (c = 0; c < chunks; ++c) {
    int64_t begin = c * PR_EW_CHUNK;
    loop((char*)dst + begin * dst_size, (const char*)src + begin * src_size,
         pr_ew_chunk_len(numel, c));
  }
  return PRECIS_OK;
}
