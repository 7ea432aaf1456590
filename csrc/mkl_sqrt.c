/* mkl_sqrt.c - pr_mkl_sqrt1, the per-element form of precis_mkl_sqrt_ps that
 * adam_cpu.c's AVX-512 loops call (declared there with "omp declare simd"):
 * the 16-lane variant under its vector-ABI name, and the scalar one for loop
 * tails. AVX-512 only; compiled here, away from the pragma, so GCC adds no
 * clones of its own. */
#include "mkl_sqrt.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(_OPENMP)
float pr_mkl_sqrt1(float x);
__m512 _ZGVeN16v_pr_mkl_sqrt1(__m512 x);

PRECIS_MKL_SQRT_TARGET __m512 _ZGVeN16v_pr_mkl_sqrt1(__m512 x) { return precis_mkl_sqrt_ps(x); }

PRECIS_MKL_SQRT_TARGET float pr_mkl_sqrt1(float x) {
  return _mm512_cvtss_f32(precis_mkl_sqrt_ps(_mm512_set1_ps(x)));
}
#endif
