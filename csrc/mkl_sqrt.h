/*
 * mkl_sqrt.h - MKL's fp32 square root, rebuilt from its instructions.
 *
 * torch 2.13's CPU sqrt (the for-loop Adam's exp_avg_sq.sqrt()) is MKL's
 * vmsSqrt in VML_HA mode; on an AVX-512 CPU MKL runs its kernel
 * mkl_vml_kernel_sSqrt_Z0HAynn, which is a few instructions per 16 floats:
 *
 *   r = rsqrt14(x)            14-bit estimate of 1/sqrt(x)
 *   y = r * x,  h = r * 0.5
 *   y + (x - y*y) * h         one Newton correction, both steps fused (FMA)
 *
 * with x scaled by 2^78 (y by 2^39, h by 2^-78) in the correction when
 * r > 2^39 (x < ~2^-78: no underflow in x - y*y), NaN, +-0 and +inf through
 * sqrt, and +NaN (0x7FC00000) for a negative x. The result is within an ulp,
 * never above the IEEE sqrt and below it for about 0.6% of inputs.
 *
 * precis_mkl_sqrt_avx512 reproduces MKL bit for bit on every one of the 2^32
 * fp32 inputs on the CPU it was checked on (tools/mkl_sqrt_check.c runs the
 * exhaustive comparison). rsqrt14's estimate is exact per Intel's definition
 * but another vendor's, or another MKL kernel, may differ: step_cpu.c takes it
 * in place of the caller's cpu_sqrt only after comparing both on a sample.
 *
 * On an AMD CPU MKL runs none of its AVX kernels but its generic SSE one,
 * mkl_vml_kernel_sSqrt_EXHAynn (gdb on an EPYC Zen 3; the issue saw another
 * kernel on a Zen 4 too), with no FMA and every operation rounded:
 *
 *   r = rsqrtps(x)            12-bit estimate, from the CPU's own table
 *   y = x * r,  h = r * 0.5,  t = 0.5 - y*h
 *   y = y*t + y,  h = t*h + h
 *   y + (x - y*y) * h
 *
 * for x positive, normal and at most 0x7F7FF000's bits; every other input
 * (zeros, subnormals, the top 4095 floats, inf, NaN) its IEEE sqrt, and a
 * negative non-NaN +NaN (0x7FC00000). precis_mkl_sqrt_avx2 computes it 8 lanes
 * at a time: VRSQRTPS on ymm gives the table of the xmm form on the same CPU.
 * rsqrtps's table differs between vendors and generations, so the sample check
 * of step_cpu.c decides here too.
 */
#ifndef PRECIS_MKL_SQRT_H_
#define PRECIS_MKL_SQRT_H_

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PRECIS_MKL_SQRT_TARGET __attribute__((target("avx512f,fma")))

static inline PRECIS_MKL_SQRT_TARGET __m512 precis_mkl_sqrt_ps(__m512 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 r = _mm512_rsqrt14_ps(x);
  const __m512 y = _mm512_mul_ps(r, x);
  const __m512 h = _mm512_mul_ps(r, _mm512_set1_ps(0.5f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_set1_ps(0x1p39f), r, _CMP_LT_OQ);
  const __m512 xs = _mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p78f));
  const __m512 ys = _mm512_mask_mul_ps(y, tiny, y, _mm512_set1_ps(0x1p39f));
  const __m512 hs = _mm512_mask_mul_ps(h, tiny, h, _mm512_set1_ps(0x1p-78f));
  const __m512 out = _mm512_fmadd_ps(_mm512_fnmadd_ps(ys, ys, xs), hs, y);
  /* 0 < x < inf takes the estimate; NaN, +-0, +inf their sqrt, which is x + x
   * (the NaN quieted, as sqrt does) without the divider's sqrt; x < 0 MKL's NaN. */
  const __mmask16 finite_pos = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ) &
                               _mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  __m512 res = _mm512_mask_mov_ps(_mm512_add_ps(x, x), finite_pos, out);
  return _mm512_mask_mov_ps(res, negative, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

/* out[0..n) = MKL's sqrt of in[0..n); the tail through masked loads. */
static inline PRECIS_MKL_SQRT_TARGET void precis_mkl_sqrt_avx512(const float* in, float* out,
                                                                 int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, precis_mkl_sqrt_ps(_mm512_loadu_ps(in + j)));
  if (j < n) {
    __mmask16 k = (__mmask16)((1u << (n - j)) - 1u);
    _mm512_mask_storeu_ps(out + j, k, precis_mkl_sqrt_ps(_mm512_maskz_loadu_ps(k, in + j)));
  }
}

#define PRECIS_MKL_SQRT_AVX2_TARGET __attribute__((target("avx2")))

static inline PRECIS_MKL_SQRT_AVX2_TARGET __m256 precis_mkl_sqrt_ex_ps(__m256 x) {
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 r = _mm256_rsqrt_ps(x);
  const __m256 y = _mm256_mul_ps(x, r);
  const __m256 h = _mm256_mul_ps(r, half);
  const __m256 t = _mm256_sub_ps(half, _mm256_mul_ps(y, h));
  const __m256 y1 = _mm256_add_ps(_mm256_mul_ps(y, t), y);
  const __m256 h1 = _mm256_add_ps(_mm256_mul_ps(t, h), h);
  const __m256 out = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_mul_ps(y1, y1)), h1), y1);
  /* MKL's test, as integers: bits + 0x7F800000 > 0xFEFFF000 (signed) is every x
   * but a positive normal up to 0x7F7FF000 */
  const __m256i u = _mm256_castps_si256(x);
  const __m256i other = _mm256_cmpgt_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7F800000)),
                                           _mm256_set1_epi32((int)0xFEFFF000u));
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 res = out;
  /* The divider's sqrt only for a vector with such an input (rare in Adam's v):
   * taken for every vector, it would add the IEEE loop's whole sqrt to the
   * emulation's 13 operations. */
  if (_mm256_movemask_ps(_mm256_castsi256_ps(other)) != 0) {
    res = _mm256_blendv_ps(out, _mm256_sqrt_ps(x), _mm256_castsi256_ps(other));
  }
  return _mm256_blendv_ps(res, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), negative);
}

/* out[0..n) = MKL's generic-kernel sqrt of in[0..n); the tail through masked loads. */
static inline PRECIS_MKL_SQRT_AVX2_TARGET void precis_mkl_sqrt_avx2(const float* in, float* out,
                                                                    int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, precis_mkl_sqrt_ex_ps(_mm256_loadu_ps(in + j)));
  if (j < n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane);
    _mm256_maskstore_ps(out + j, k, precis_mkl_sqrt_ex_ps(_mm256_maskload_ps(in + j, k)));
  }
}
#endif

#endif /* PRECIS_MKL_SQRT_H_ */
