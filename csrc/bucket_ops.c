/* bucket_ops.c - cast, scale and NaN/Inf count over fp32/fp16/bf16 buffers: what a
 * gradient bucket needs around a collective (docs/design.md section 5). */

/* See accumulate.c: lets GCC vectorize the fp16 conversion selects. Before the
 * includes, so the inline conversions get it too. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <stdint.h>
#include <string.h>

#include "bucket_args.h"
#include "elementwise.h"

/* ---- cast --------------------------------------------------------------- */

#define PR_CAST_LOOP(name, dst_t, dst_load_unused, dst_store, src_t, src_load, src_store_unused) \
  static void name(void* dst_, const void* src_, int64_t n) {                                    \
    dst_t* dst = (dst_t*)dst_;                                                                   \
    const src_t* src = (const src_t*)src_;                                                       \
    int64_t i;                                                                                   \
    for (i = 0; i < n; ++i) dst[i] = dst_store(src_load(src[i]));                                \
  }

/* Same dtype: a copy (a round trip through fp32 would quiet signalling NaNs). */
static void pr_cast_copy4(void* dst, const void* src, int64_t n) {
  memcpy(dst, src, (size_t)n * 4);
}
static void pr_cast_copy2(void* dst, const void* src, int64_t n) {
  memcpy(dst, src, (size_t)n * 2);
}

PR_EW_PAIR_TABLE(pr_cast_table, PR_CAST_LOOP, pr_cast, pr_cast_copy4, pr_cast_copy2, pr_cast_copy2)

PRECIS_API precis_status_t precis_cast(void* dst, precis_dtype_t dst_dtype, const void* src,
                                       precis_dtype_t src_dtype, int64_t numel) {
  static const char fn[] = "precis_cast";
  precis_status_t st;
  pr_clear_error();
  st = pr_bucket_check_disjoint_pair(fn, dst, (int)dst_dtype, src, (int)src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  if (dst == src && dst_dtype == src_dtype) return PRECIS_OK; /* a cast onto itself */
  pr_ew_run_pair(pr_cast_table[dst_dtype][src_dtype], dst, dst_dtype, src, src_dtype, numel);
  return PRECIS_OK;
}

/* ---- scale -------------------------------------------------------------- */

typedef void (*pr_scale_fn)(void* buf, float factor, int64_t n);

#define PR_SCALE_LOOP(name, t, load, store)                   \
  static void name(void* buf_, float factor, int64_t n) {     \
    t* buf = (t*)buf_;                                        \
    int64_t i;                                                \
    for (i = 0; i < n; ++i) buf[i] = store(load(buf[i]) * factor); \
  }

PR_EW_APPLY(PR_SCALE_LOOP, pr_scale_f32, PR_EW_F32)
PR_EW_APPLY(PR_SCALE_LOOP, pr_scale_f16, PR_EW_F16)
PR_EW_APPLY(PR_SCALE_LOOP, pr_scale_bf16, PR_EW_BF16)

static const pr_scale_fn pr_scale_table[3] = {pr_scale_f32, pr_scale_f16, pr_scale_bf16};

PRECIS_API precis_status_t precis_scale(void* buf, precis_dtype_t dtype, float factor,
                                        int64_t numel) {
  static const char fn[] = "precis_scale";
  precis_status_t st;
  pr_scale_fn loop;
  int64_t size, chunks, c;
  pr_clear_error();
  st = pr_bucket_check_scale(fn, buf, (int)dtype, factor, numel);
  /* factor 1: an exact no-op; also leaves NaN payloads alone. */
  if (st != PRECIS_OK || numel == 0 || factor == 1.0f) return st;

  loop = pr_scale_table[dtype];
  size = precis_elem_size((int)dtype);
  chunks = pr_ew_chunks(numel);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (chunks > 1)
#endif
  for (c = 0; c < chunks; ++c) {
    loop((char*)buf + c * PR_EW_CHUNK * size, factor, pr_ew_chunk_len(numel, c));
  }
  return PRECIS_OK;
}

/* ---- count_nonfinite ---------------------------------------------------- */

/* NaN and Inf are exactly the values whose exponent bits are all ones; an integer
 * test on the bits vectorizes and needs no float compares. */
typedef int64_t (*pr_count_fn)(const void* buf, int64_t n);

#define PR_COUNT_LOOP(name, t, exp_mask)                    \
  static int64_t name(const void* buf_, int64_t n) {        \
    const t* buf = (const t*)buf_;                          \
    int64_t i, count = 0;                                   \
    for (i = 0; i < n; ++i) count += (buf[i] & (exp_mask)) == (exp_mask); \
    return count;                                           \
  }

PR_COUNT_LOOP(pr_count_f32, uint32_t, 0x7F800000u)
PR_COUNT_LOOP(pr_count_f16, uint16_t, 0x7C00u)
PR_COUNT_LOOP(pr_count_bf16, uint16_t, 0x7F80u)

/* Indexed by dtype code; pr_bucket_check_count_nonfinite admits only the first three. */
static const pr_count_fn pr_count_table[PRECIS_DTYPE_COUNT] = {pr_count_f32, pr_count_f16,
                                                                pr_count_bf16, NULL, NULL};

PRECIS_API precis_status_t precis_count_nonfinite(const void* buf, precis_dtype_t dtype,
                                                  int64_t numel, int64_t* out_count) {
  static const char fn[] = "precis_count_nonfinite";
  precis_status_t st;
  pr_count_fn loop;
  int64_t size, chunks, c, total = 0;
  pr_clear_error();
  st = pr_bucket_check_count_nonfinite(fn, buf, (int)dtype, numel, out_count);
  if (st != PRECIS_OK) return st;

  loop = pr_count_table[dtype];
  size = precis_elem_size((int)dtype);
  chunks = pr_ew_chunks(numel);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) reduction(+ : total) if (chunks > 1)
#endif
  for (c = 0; c < chunks; ++c) {
    total += loop((const char*)buf + c * PR_EW_CHUNK * size, pr_ew_chunk_len(numel, c));
  }
  *out_count = total;
  return PRECIS_OK;
}
