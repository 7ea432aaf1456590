/*
 * bucket_args.h - the argument checks of the element-wise bucket ops, shared by
 * precis_accumulate (accumulate.c), precis_cast, precis_scale,
 * precis_count_nonfinite (bucket_ops.c) and their CUDA twins
 * (cuda/bucket_ops.cu), so both reject the same input with the same status and
 * the same message (fn names the entry point). One function per op, checking
 * in that op's order; it returns PRECIS_OK for a call with nothing to do too
 * (numel 0, ...), which the caller then skips.
 *
 * Plain C11 / C++ host code (static inline: a translation unit that uses none
 * of it pays nothing). Needs internal.h (pr_fail, pr_dtype_label), which C++
 * callers include inside extern "C".
 */
#ifndef PRECIS_BUCKET_ARGS_H_
#define PRECIS_BUCKET_ARGS_H_

#include <math.h>
#include <stdint.h>

#include "internal.h"
#include "precis/precis.h"
#include "precis_convert.h"

/* 1 for the dtypes the bucket ops accept (fp32, fp16, bf16). These are codes
 * 0..2, so the CPU kernels index their [3] / [3][3] loop tables with them. */
static inline int pr_bucket_dtype_ok(int d) {
  return d == PRECIS_DTYPE_FP32 || d == PRECIS_DTYPE_FP16 || d == PRECIS_DTYPE_BF16;
}

static inline precis_status_t pr_bucket_check_numel(const char* fn, int64_t numel) {
  if (numel >= 0) return PRECIS_OK;
  return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: numel is %lld, must be >= 0", fn,
                 (long long)numel);
}

static inline precis_status_t pr_bucket_check_dtype(const char* fn, const char* arg, int d) {
  if (pr_bucket_dtype_ok(d)) return PRECIS_OK;
  return pr_fail(PRECIS_ERR_INVALID_DTYPE,
                 "%s: %s %s is not supported; accepted: fp32, fp16, bf16", fn, arg,
                 pr_dtype_label(d));
}

/* The first checks of accumulate and cast: numel, dst_dtype, src_dtype, then
 * for numel > 0 the pointers (non-NULL, aligned to their elements). */
static inline precis_status_t pr_bucket_check_pair(const char* fn, const void* dst,
                                                   int dst_dtype, const void* src,
                                                   int src_dtype, int64_t numel) {
  precis_status_t st;
  if ((st = pr_bucket_check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = pr_bucket_check_dtype(fn, "dst_dtype", dst_dtype)) != PRECIS_OK) return st;
  if ((st = pr_bucket_check_dtype(fn, "src_dtype", src_dtype)) != PRECIS_OK) return st;
  if (numel == 0) return PRECIS_OK;
  if (dst == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dst is NULL", fn);
  if (src == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: src is NULL", fn);
  if ((st = pr_check_aligned(fn, "dst", -1, dst, dst_dtype)) != PRECIS_OK) return st;
  return pr_check_aligned(fn, "src", -1, src, src_dtype);
}

/* *end = the address one past numel elements of dtype at buf; a numel that
 * would run past the end of the address space is no buffer at all. */
static inline precis_status_t pr_bucket_check_end(const char* fn, const char* arg,
                                                  const void* buf, int dtype, int64_t numel,
                                                  uintptr_t* end) {
  const uintptr_t size = (uintptr_t)precis_elem_size(dtype);
  if ((uintptr_t)numel > (UINTPTR_MAX - (uintptr_t)buf) / size) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: numel %lld: %s elements from %s would run past the end of memory", fn,
                   (long long)numel, pr_dtype_label(dtype), arg);
  }
  *end = (uintptr_t)buf + (uintptr_t)numel * size;
  return PRECIS_OK;
}

/* accumulate and cast: pr_bucket_check_pair's checks, then no overlap of dst
 * and src unless they are the same buffer with the same dtype (x += x; a cast
 * onto itself, nothing to do). The elements are processed in parallel (OpenMP
 * chunks, CUDA threads in any order), so any other overlap would read values
 * already written. */
static inline precis_status_t pr_bucket_check_disjoint_pair(const char* fn, const void* dst,
                                                            int dst_dtype, const void* src,
                                                            int src_dtype, int64_t numel) {
  uintptr_t d0, d1 = 0, s0, s1 = 0;
  precis_status_t st = pr_bucket_check_pair(fn, dst, dst_dtype, src, src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  if (dst == src && dst_dtype == src_dtype) return PRECIS_OK;
  if ((st = pr_bucket_check_end(fn, "dst", dst, dst_dtype, numel, &d1)) != PRECIS_OK ||
      (st = pr_bucket_check_end(fn, "src", src, src_dtype, numel, &s1)) != PRECIS_OK) {
    return st;
  }
  d0 = (uintptr_t)dst;
  s0 = (uintptr_t)src;
  if (d0 < s1 && s0 < d1) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: dst and src overlap (only the same buffer with the same dtype may be "
                   "passed as both)",
                   fn);
  }
  return PRECIS_OK;
}

/* scale: numel, dtype, factor, then for numel > 0 buf (non-NULL, aligned). */
static inline precis_status_t pr_bucket_check_scale(const char* fn, const void* buf, int dtype,
                                                    float factor, int64_t numel) {
  precis_status_t st;
  if ((st = pr_bucket_check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = pr_bucket_check_dtype(fn, "dtype", dtype)) != PRECIS_OK) return st;
  /* A NaN or Inf factor is always a caller's bug (it would poison every gradient). */
  if (!isfinite(factor)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: factor is %g, must be finite", fn,
                   (double)factor);
  }
  if (numel == 0) return PRECIS_OK;
  if (buf == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: buf is NULL", fn);
  return pr_check_aligned(fn, "buf", -1, buf, dtype);
}

/* count_nonfinite: out_count, numel, dtype, then for numel > 0 buf (non-NULL, aligned). */
static inline precis_status_t pr_bucket_check_count_nonfinite(const char* fn, const void* buf,
                                                              int dtype, int64_t numel,
                                                              const int64_t* out_count) {
  precis_status_t st;
  if (out_count == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: out_count is NULL", fn);
  if ((st = pr_bucket_check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = pr_bucket_check_dtype(fn, "dtype", dtype)) != PRECIS_OK) return st;
  if (numel == 0) return PRECIS_OK;
  if (buf == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: buf is NULL", fn);
  return pr_check_aligned(fn, "buf", -1, buf, dtype);
}

#endif /* PRECIS_BUCKET_ARGS_H_ */
