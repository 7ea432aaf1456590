/*
 * precis_convert.h - scalar dtype conversions shared by the C kernels and the
 * CUDA kernels (docs/design.md section 2: one header of static inline math, so the
 * CPU tests also check what the GPU runs).
 *
 * Plain C11 / C++ / CUDA; bit manipulation only (no _Float16, no intrinsics; the one
 * exception is the fp8 pair in sm_89+ device code, below), and written branch-light
 * (selects rather than early returns) so loops over these functions auto-vectorize.
 *
 *   bf16  : 1-8-7,  round to nearest even; NaN stays a (quiet) NaN.
 *   fp16  : 1-5-10 IEEE half, RNE including subnormals, overflow -> inf.
 *   fp8   : E4M3 "fn" (OCP, as torch.float8_e4m3fn): bias 7, max 448, no inf,
 *           0x7F / 0xFF are NaN, subnormals down to 2^-9. f32 -> fp8 rounds to
 *           nearest even and saturates (OCP "SAT" mode): finite overflow and
 *           +-inf become +-448; NaN becomes 0x7F.
 *
 * precis_elem_size is the one table of element sizes (precis_dtype_size, the
 * bucket ops and the CUDA kernels, host and device, all read it).
 */
#ifndef PRECIS_CONVERT_H_
#define PRECIS_CONVERT_H_

#include <stdint.h>
#if !defined(__CUDA_ARCH__)
#include <string.h>
#endif

#include "precis/precis.h"

#ifndef PRECIS_HD
#if defined(__CUDACC__)
#define PRECIS_HD __host__ __device__
#else
#define PRECIS_HD
#endif
#endif

/* ---- element sizes ----------------------------------------------------- */

/* Bytes of one element of dtype (a precis_dtype_t code); 0 for a code that is
 * no dtype. */
static inline PRECIS_HD int precis_elem_size(int dtype) {
  switch (dtype) {
    case PRECIS_DTYPE_FP32: return 4;
    case PRECIS_DTYPE_FP16: return 2;
    case PRECIS_DTYPE_BF16: return 2;
    case PRECIS_DTYPE_FP8_E4M3: return 1; /* stored as uint8 bytes */
    case PRECIS_DTYPE_INT16: return 2;
    default: return 0;
  }
}

/* The block scales of a tensor of numel >= 0 elements, a float per PRECIS_SCALE_BLOCK
 * (precis_scale_count's answer, inline for the checks that count them per tensor). */
static inline PRECIS_HD int64_t precis_scale_blocks(int64_t numel) {
  return numel / PRECIS_SCALE_BLOCK + (numel % PRECIS_SCALE_BLOCK != 0);
}

/* ---- raw bits ---------------------------------------------------------- */

static inline PRECIS_HD uint32_t precis_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

static inline PRECIS_HD float precis_bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* ---- bf16 -------------------------------------------------------------- */

static inline PRECIS_HD float precis_bf16_to_f32(uint16_t h) {
  return precis_bits_f32((uint32_t)h << 16);
}

static inline PRECIS_HD uint16_t precis_f32_to_bf16_rn(float f) {
  uint32_t u = precis_f32_bits(f);
  /* RNE: add 0x7FFF plus the lowest kept bit, truncate. Overflow carries into
   * the exponent and gives inf, as it should. */
  uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  /* NaN: keep sign and payload top bits, force the quiet bit (rounding could
   * otherwise turn a NaN into inf). Tested as f != f and selected before the
   * shift: GCC then keeps 32-bit lanes in AVX-512 loops (with a 16-bit select
   * it packed, widened and packed again); the bits are those of the integer
   * form, for all 2^32 inputs (tests/c/test_convert.cc). */
  uint32_t r = f != f ? u | 0x00400000u : rounded;
  return (uint16_t)(r >> 16);
}

/* ---- fp16 -------------------------------------------------------------- */

static inline PRECIS_HD float precis_f16_to_f32(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t em = ((uint32_t)h & 0x7FFFu) << 13; /* exponent+mantissa in f32 place */
  uint32_t exp = em & 0x0F800000u;
  /* normal: rebias 15 -> 127 */
  uint32_t normal = em + ((127u - 15u) << 23);
  /* inf / NaN: exponent all ones; quiet a signalling NaN like the hardware does */
  uint32_t infnan = em | 0x7F800000u | ((em & 0x007FFFFFu) ? 0x00400000u : 0u);
  /* zero / subnormal: mantissa * 2^-24, exact in f32 */
  float sub = (float)(h & 0x03FFu) * 5.9604644775390625e-8f; /* 2^-24 */
  uint32_t out = exp == 0x0F800000u ? infnan : (exp == 0 ? precis_f32_bits(sub) : normal);
  return precis_bits_f32(out | sign);
}

static inline PRECIS_HD uint16_t precis_f32_to_f16_rn(float f) {
  uint32_t u = precis_f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  /* |f| >= 65520 (half-way between max half 65504 and 2^16) -> inf; NaN -> quiet
   * NaN keeping the top payload bits, as the F16C instruction does */
  uint32_t big = a > 0x7F800000u ? (0x7E00u | ((a >> 13) & 0x3FFu)) : 0x7C00u;
  /* normal half (|f| >= 2^-14): rebias and round 13 mantissa bits to nearest even */
  uint32_t normal = (a - ((127u - 15u) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  /* subnormal half: adding 0.5 (ulp 2^-24) makes the FPU do the RNE for us */
  float s = precis_bits_f32(a) + 0.5f;
  uint32_t sub = precis_f32_bits(s) - 0x3F000000u; /* bits of 0.5f */
  uint32_t out = a >= 0x477FF000u ? big : (a < 0x38800000u ? sub : normal);
  return (uint16_t)(out | sign);
}

/* ---- fp8 E4M3 (fn) ----------------------------------------------------- */

#define PRECIS_FP8_MAX 448.0f

/* Compiled for sm_89 or newer (tools/build_cuda.sh builds sm_90; an sm_89 GPU runs
 * the sm_80 code and the software forms), the conversions are one cvt instruction
 * each (the CUDA fp8-moment step ran 9-10% faster on an H100 than with the software
 * forms). NaN is selected as in the software forms, which give every other input's
 * bits too: on an H100, tools/fp8_cuda_check.cu found no difference over all 2^32
 * inputs and 256 codes. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define PRECIS_FP8_CVT 1
#endif

static inline PRECIS_HD float precis_fp8_to_f32(uint8_t x) {
#ifdef PRECIS_FP8_CVT
  uint32_t pair;
  float f;
  asm("{ .reg .b16 a; cvt.u16.u32 a, %1; cvt.rn.f16x2.e4m3x2 %0, a; }" : "=r"(pair) : "r"((uint32_t)x));
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(pair));
  return ((uint32_t)x & 0x7Fu) == 0x7Fu ? precis_bits_f32(0x7FC00000u | (((uint32_t)x & 0x80u) << 24)) : f;
#else
  uint32_t sign = ((uint32_t)x & 0x80u) << 24;
  uint32_t em = (uint32_t)x & 0x7Fu;
  uint32_t exp = em >> 3;
  /* normal: rebias 7 -> 127, 3 mantissa bits -> top of the f32 mantissa */
  uint32_t normal = (em << 20) + ((127u - 7u) << 23);
  /* subnormal: m * 2^-9 */
  float sub = (float)(em & 7u) * 0.001953125f; /* 2^-9 */
  uint32_t out = exp == 0 ? precis_f32_bits(sub) : normal;
  out = em == 0x7Fu ? 0x7FC00000u : out; /* the only NaN code (per sign) */
  return precis_bits_f32(out | sign);
#endif
}

static inline PRECIS_HD uint8_t precis_f32_to_fp8_rn(float f) {
#ifdef PRECIS_FP8_CVT
  uint32_t pair; /* the upper byte converts 0 */
  asm("{ .reg .b16 r; cvt.rn.satfinite.e4m3x2.f32 r, %1, %2; cvt.u32.u16 %0, r; }" : "=r"(pair) : "f"(0.0f), "f"(f));
  return f != f ? (uint8_t)0x7Fu : (uint8_t)(pair & 0xFFu);
#else
  uint32_t u = precis_f32_bits(f);
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7FFFFFFFu;
  /* normal (|f| >= 2^-6): rebias and round 20 mantissa bits to nearest even */
  uint32_t normal = (a - ((127u - 7u) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  normal = normal > 0x7Eu ? 0x7Eu : normal; /* saturate to 448 (covers inf too) */
  /* subnormal: adding 2^14 (ulp 2^-9) makes the FPU do the RNE; may give 8 = 2^-6 */
  float s = precis_bits_f32(a) + 16384.0f;
  uint32_t sub = precis_f32_bits(s) - 0x46800000u; /* bits of 16384.0f */
  /* huge inputs (>= 2^127) would wrap in the normal path: saturate them directly */
  uint32_t out = a < 0x3C800000u ? sub : (a >= 0x43F00000u ? 0x7Eu : normal);
  out = a > 0x7F800000u ? 0x7Fu : (out | sign);
  return (uint8_t)out;
#endif
}

#endif /* PRECIS_CONVERT_H_ */
