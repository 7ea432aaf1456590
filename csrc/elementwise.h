/*
 * elementwise.h - what the element-wise CPU bucket kernels (accumulate, cast,
 * scale, count_nonfinite) share: per-dtype load/store triples and the chunking
 * used for OpenMP (their argument checks, shared with the CUDA twins, are in
 * bucket_args.h). Not part of the public ABI.
 *
 * A kernel is written once as a macro over (storage type, load to fp32, store from
 * fp32 with RNE) triples and instantiated per dtype, so the dtype dispatch happens
 * once per chunk and each loop body is straight-line code the compiler vectorizes.
 *
 * Files including this should first set, as accumulate.c does,
 *   #pragma GCC optimize("no-trapping-math")
 * or GCC leaves the fp16 conversion loops scalar.
 */
#ifndef PRECIS_ELEMENTWISE_H_
#define PRECIS_ELEMENTWISE_H_

#include "precis/precis.h"
#include "precis_convert.h"

/* Elements per OpenMP work item; below one chunk the threads cost more than they save. */
#define PR_EW_CHUNK ((int64_t)1 << 16)

static inline float pr_ew_f32_load(float x) { return x; }
static inline float pr_ew_f32_store(float x) { return x; }

/* (storage type, load to fp32, store from fp32 rounding to nearest even) per dtype. */
#define PR_EW_F32 float, pr_ew_f32_load, pr_ew_f32_store
#define PR_EW_F16 uint16_t, precis_f16_to_f32, precis_f32_to_f16_rn
#define PR_EW_BF16 uint16_t, precis_bf16_to_f32, precis_f32_to_bf16_rn

/* Calls macro with the triples expanded into separate arguments:
 * PR_EW_APPLY(MY_LOOP, name, PR_EW_F32, PR_EW_BF16) is MY_LOOP with 7 arguments. */
#define PR_EW_APPLY(macro, ...) macro(__VA_ARGS__)

static inline int64_t pr_ew_chunks(int64_t numel) {
  return (numel + PR_EW_CHUNK - 1) / PR_EW_CHUNK;
}

/* Elements of chunk c (the last one may be short). */
static inline int64_t pr_ew_chunk_len(int64_t numel, int64_t c) {
  int64_t left = numel - c * PR_EW_CHUNK;
  return left < PR_EW_CHUNK ? left : PR_EW_CHUNK;
}

/* A loop over n elements of dst and src (accumulate, cast). */
typedef void (*pr_ew_pair_fn)(void* dst, const void* src, int64_t n);

/* A pair kernel's loop table, indexed [dst_dtype][src_dtype] (FP32 = 0, FP16 = 1,
 * BF16 = 2: the codes pr_bucket_dtype_ok accepts): defines prefix##_<dst>_<src>
 * for the six mixed pairs by PR_EW_APPLY(loop, name, dst triple, src triple),
 * and `table` from those and the three same-dtype loops given. */
#define PR_EW_PAIR_TABLE(table, loop, prefix, same_f32, same_f16, same_bf16)     \
  PR_EW_APPLY(loop, prefix##_f32_f16, PR_EW_F32, PR_EW_F16)                      \
  PR_EW_APPLY(loop, prefix##_f32_bf16, PR_EW_F32, PR_EW_BF16)                    \
  PR_EW_APPLY(loop, prefix##_f16_f32, PR_EW_F16, PR_EW_F32)                      \
  PR_EW_APPLY(loop, prefix##_f16_bf16, PR_EW_F16, PR_EW_BF16)                    \
  PR_EW_APPLY(loop, prefix##_bf16_f32, PR_EW_BF16, PR_EW_F32)                    \
  PR_EW_APPLY(loop, prefix##_bf16_f16, PR_EW_BF16, PR_EW_F16)                    \
  static const pr_ew_pair_fn table[3][3] = {                                     \
      {same_f32, prefix##_f32_f16, prefix##_f32_bf16},                           \
      {prefix##_f16_f32, same_f16, prefix##_f16_bf16},                           \
      {prefix##_bf16_f32, prefix##_bf16_f16, same_bf16},                         \
  };

/* Runs loop over numel elements, chunk by chunk on the OpenMP threads. */
static inline void pr_ew_run_pair(pr_ew_pair_fn loop, void* dst, precis_dtype_t dst_dtype,
                                  const void* src, precis_dtype_t src_dtype, int64_t numel) {
  const int64_t dst_size = precis_elem_size((int)dst_dtype);
  const int64_t src_size = precis_elem_size((int)src_dtype);
  const int64_t chunks = pr_ew_chunks(numel);
  int64_t c;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (chunks > 1)
#endif
  for (c = 0; c < chunks; ++c) {
    const int64_t begin = c * PR_EW_CHUNK;
    loop((char*)dst + begin * dst_size, (const char*)src + begin * src_size,
         pr_ew_chunk_len(numel, c));
  }
}

#endif /* PRECIS_ELEMENTWISE_H_ */
