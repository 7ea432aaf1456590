/* tile_io.h - a CPU tile's loads and stores (step_cpu.c, convert_cpu.c): elements and
 * tiles of every stored dtype to and from fp32, moments with their block scales and
 * stochastic rounding, fp16 a block at a time with F16C where there is one. The element
 * codecs are stores.h's; this file loops them over a tile so that the compiler
 * vectorizes each loop (a dtype a constant folds its switch away). Internal. */
#ifndef PRECIS_TILE_IO_H_
#define PRECIS_TILE_IO_H_

#include <stdint.h>

#include "cpu_isa.h"
#include "step_args.h" /* pr_is_scaled */
#include "stores.h"
#if PR_X86
#include <immintrin.h>
#endif

#define PR_INLINE static inline __attribute__((always_inline))

/* Elements per tile: 16 scale blocks; each fp32 tile array is 8 KiB. */
#define PR_TILE 2048
/* A tile of any element size is a whole number of 8-byte words (its fingerprint terms). */
_Static_assert(PR_TILE % 8 == 0, "PR_TILE must be a multiple of 8 elements");
_Static_assert(PR_TILE % PRECIS_SCALE_BLOCK == 0, "a tile holds whole scale blocks");

/* F16C's fp32 -> fp16 rounding, for encoding fp16 moment blocks (the compiler
 * does not find it on its own). IEEE-exact like precis_f32_to_f16_rn, so
 * every path gives the same bits. One call per scale block. */
#if PR_X86
#define PR_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

PR_TARGET_AVX512 static inline void pr_f16_store_avx512(uint16_t* restrict out,
                                                        const float* restrict in, int n) {
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    _mm256_storeu_si256((__m256i*)(out + j), _mm512_cvtps_ph(_mm512_loadu_ps(in + j), PR_F16_RNE));
  }
  for (; j < n; ++j) out[j] = precis_f32_to_f16_rn(in[j]);
}

PR_TARGET_AVX2 static inline void pr_f16_store_avx2(uint16_t* restrict out,
                                                    const float* restrict in, int n) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm_storeu_si128((__m128i*)(out + j), _mm256_cvtps_ph(_mm256_loadu_ps(in + j), PR_F16_RNE));
  }
  for (; j < n; ++j) out[j] = precis_f32_to_f16_rn(in[j]);
}
#endif

static inline void pr_f16_store_portable(uint16_t* restrict out, const float* restrict in,
                                         int n) {
  int j;
  for (j = 0; j < n; ++j) out[j] = precis_f32_to_f16_rn(in[j]);
}

PR_INLINE void pr_f16_store(int isa, uint16_t* restrict out, const float* restrict in, int n) {
#if PR_X86
  if (isa == PR_ISA_AVX512) {
    pr_f16_store_avx512(out, in, n);
  } else if (isa == PR_ISA_AVX2) {
    pr_f16_store_avx2(out, in, n);
  } else {
    pr_f16_store_portable(out, in, n);
  }
#else
  (void)isa;
  pr_f16_store_portable(out, in, n);
#endif
}

/* ------------------------------------------------------------------------ */
/* Element and tile load / store                                             */
/* ------------------------------------------------------------------------ */

/* base[i] converted to fp32. With a constant dtype the switch folds away and
 * the fused loops below vectorize. */
PR_INLINE float pr_ld(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case PRECIS_DTYPE_FP32: return ((const float*)base)[i];
    case PRECIS_DTYPE_FP16: return precis_f16_to_f32(((const uint16_t*)base)[i]);
    case PRECIS_DTYPE_BF16: return precis_bf16_to_f32(((const uint16_t*)base)[i]);
    default: return precis_fp8_to_f32(((const uint8_t*)base)[i]);
  }
}

/* A moment's base[i] converted to fp32, before its block scale: fp8 m is m8,
 * fp8 v v8 (stores.h), everything else as pr_ld. */
PR_INLINE float pr_ld_moment(const void* base, int dtype, int second, int64_t i) {
  if (dtype == PRECIS_DTYPE_FP8_E4M3) {
    uint8_t code = ((const uint8_t*)base)[i];
    return second ? precis_v8_to_f32(code) : precis_m8_to_f32(code);
  }
  return pr_ld(base, dtype, i);
}

/* base[i] = x rounded to nearest even in dtype (fp32, fp16, bf16). */
PR_INLINE void pr_st(void* base, int dtype, int64_t i, float x) {
  switch (dtype) {
    case PRECIS_DTYPE_FP32: ((float*)base)[i] = x; break;
    case PRECIS_DTYPE_FP16: ((uint16_t*)base)[i] = precis_f32_to_f16_rn(x); break;
    default: ((uint16_t*)base)[i] = precis_f32_to_bf16_rn(x); break;
  }
}

/* base[off..off+n) = x rounded to nearest even in dtype (fp32, fp16, bf16). A
 * loop per dtype: a dtype known only at run time (the generic kernel) still
 * gets vector loops. */
PR_INLINE void pr_store_tile(int isa, void* base, precis_dtype_t dtype, int64_t off,
                             const float* restrict x, int n) {
  int j;
  if (dtype == PRECIS_DTYPE_FP16) {
    pr_f16_store(isa, (uint16_t*)base + off, x, n);
  } else if (dtype == PRECIS_DTYPE_FP32) {
    for (j = 0; j < n; ++j) pr_st(base, PRECIS_DTYPE_FP32, off + j, x[j]);
  } else {
    for (j = 0; j < n; ++j) pr_st(base, PRECIS_DTYPE_BF16, off + j, x[j]);
  }
}

/* x[0..n) = base[off..off+n) in fp32 (pr_ld_moment: an fp8 moment is m8 or v8,
 * before its scale), a loop per dtype as pr_store_tile. */
PR_INLINE void pr_load_tile(float* restrict x, const void* base, int dtype, int second,
                            int64_t off, int n) {
  int j;
  switch (dtype) {
    case PRECIS_DTYPE_FP32:
      for (j = 0; j < n; ++j) x[j] = pr_ld(base, PRECIS_DTYPE_FP32, off + j);
      break;
    case PRECIS_DTYPE_FP16:
      for (j = 0; j < n; ++j) x[j] = pr_ld(base, PRECIS_DTYPE_FP16, off + j);
      break;
    case PRECIS_DTYPE_BF16:
      for (j = 0; j < n; ++j) x[j] = pr_ld(base, PRECIS_DTYPE_BF16, off + j);
      break;
    default:
      if (second) {
        for (j = 0; j < n; ++j) x[j] = pr_ld_moment(base, PRECIS_DTYPE_FP8_E4M3, 1, off + j);
      } else {
        for (j = 0; j < n; ++j) x[j] = pr_ld_moment(base, PRECIS_DTYPE_FP8_E4M3, 0, off + j);
      }
      break;
  }
}

/* max |x| over n values. Compares bit patterns with the sign cleared: the same
 * order as the floats, as an integer max that vectorizes (a NaN wins). */
PR_INLINE float pr_amax(const float* restrict x, int n) {
  uint32_t a = 0;
  int j;
  for (j = 0; j < n; ++j) {
    uint32_t u = precis_f32_bits(x[j]) & 0x7FFFFFFFu;
    a = u > a ? u : a;
  }
  return precis_bits_f32(a);
}

/* Decode n moment values from element off (a multiple of the scale block):
 * m, or v (second) = (stored * s)^2 for scaled dtypes. */
PR_INLINE void pr_load_moment(float* restrict x, const void* base, const float* scales,
                              precis_dtype_t dtype, int second, int64_t off, int n) {
  int lo, j;
  pr_load_tile(x, base, (int)dtype, second, off, n);
  if (!pr_is_scaled((int)dtype)) return;
  scales += off / PRECIS_SCALE_BLOCK;
  for (lo = 0; lo < n; lo += PRECIS_SCALE_BLOCK) {
    int hi = n - lo < PRECIS_SCALE_BLOCK ? n : lo + PRECIS_SCALE_BLOCK;
    float s = scales[lo / PRECIS_SCALE_BLOCK];
    for (j = lo; j < hi; ++j) x[j] = precis_moment_dq(x[j], s, second);
  }
}

/* The stochastic rounding of a tile's moment stores: the moments' key and the
 * step (precis_moment_hash, _rand), the element index of the tile's first
 * element, and the tile's hashes (pr_moment_hashes), which both moments read. */
typedef struct pr_sr {
  precis_sr_key_t key;
  int64_t step;
  uint32_t index0;     /* the low 32 bits are all the random numbers use */
  const uint32_t* hash; /* the tile's precis_moment_hash per element */
} pr_sr_t;

/* hash[j] = precis_moment_hash of the tile's element j, j < n: one hash per
 * element and step, however many moments round stochastically. */
PR_INLINE void pr_moment_hashes(uint32_t* restrict hash, const pr_sr_t* sr, int n) {
  int j;
  for (j = 0; j < n; ++j) hash[j] = precis_moment_hash(sr->key, sr->index0 + (uint32_t)j);
}

/* The r of the tile's element j for moment `second`. */
PR_INLINE uint32_t pr_sr_rand(const pr_sr_t* sr, int j, int second) {
  return precis_moment_rand(sr->hash[j], second, sr->step);
}

/* Encode n moment values at element off. x holds m or v; for a scaled second
 * moment root holds sqrt(v), which is what gets stored. Each block gets a new
 * scale from its own amax. Rounds stochastically where precis_moment_store_sr
 * says so and sr (the tile's, whose first element is base[off]) is given
 * (precis_moment_sr_f16 / _fp8, bf16 SR); else to nearest (precis_moment_q_f16 /
 * _fp8 per element, the fp16 rounding done a block at a time with F16C where
 * there is one). */
PR_INLINE void pr_store_moment(int isa, void* base, float* scales, precis_dtype_t dtype,
                               int second, int rule, int64_t off, const float* restrict x,
                               const float* restrict root, int n, const pr_sr_t* sr) {
  const float* r = second ? root : x;
  int fp8 = dtype == PRECIS_DTYPE_FP8_E4M3;
  int lo, j;
  if (!precis_moment_store_sr((int)dtype, second, rule)) sr = NULL;
  if (!pr_is_scaled((int)dtype)) {
    if (sr != NULL) { /* bf16 v, a one-state rule's bf16 momentum */
      uint16_t* d = (uint16_t*)base + off;
      for (j = 0; j < n; ++j) {
        d[j] = precis_f32_to_bf16_sr(x[j], pr_sr_rand(sr, j, second) >> 16);
      }
      return;
    }
    pr_store_tile(isa, base, dtype, off, x, n);
    return;
  }
  scales += off / PRECIS_SCALE_BLOCK;
  for (lo = 0; lo < n; lo += PRECIS_SCALE_BLOCK) {
    int hi = n - lo < PRECIS_SCALE_BLOCK ? n : lo + PRECIS_SCALE_BLOCK;
    float amax = pr_amax(r + lo, hi - lo);
    float mul = precis_block_multiplier(amax, fp8, second);
    scales[lo / PRECIS_SCALE_BLOCK] = precis_block_scale(amax, fp8, second);
    if (sr != NULL && fp8) {
      uint8_t* d = (uint8_t*)base + off;
      for (j = lo; j < hi; ++j) {
        d[j] = precis_moment_sr_fp8(r[j], mul, second, pr_sr_rand(sr, j, second));
      }
    } else if (sr != NULL) {
      uint16_t* d = (uint16_t*)base + off;
      for (j = lo; j < hi; ++j) {
        d[j] = precis_moment_sr_f16(r[j], mul, second, pr_sr_rand(sr, j, second));
      }
    } else if (fp8) {
      uint8_t* d = (uint8_t*)base + off;
      for (j = lo; j < hi; ++j) d[j] = precis_moment_q_fp8(r[j], mul, second);
    } else {
      _Alignas(64) float q[PRECIS_SCALE_BLOCK];
      uint16_t* d = (uint16_t*)base + off + lo;
      for (j = 0; j < hi - lo; ++j) q[j] = r[lo + j] * mul;
      pr_f16_store(isa, d, q, hi - lo);
      if (second) {
        for (j = 0; j < hi - lo; ++j) d[j] = precis_moment_keep_f16(d[j], q[j], 1);
      }
    }
  }
}

#endif /* PRECIS_TILE_IO_H_ */
