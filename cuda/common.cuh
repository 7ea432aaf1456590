// common.cuh - helpers shared by the CUDA kernels: typed element access built on
// the same conversions the CPU uses (csrc/precis_convert.h), launches and their checks.
//
// Each .cu file is read three ways (docs/architecture.md, "The two CUDA libraries"):
//  * by nvcc, whole (libprecis_cuda.so: CUDA 13's runtime, kernel<<<...>>> launches);
//  * by NVRTC, its device code only (libprecis_cuda12.so's kernels: __CUDACC_RTC__,
//    which hides every host part, here and in csrc's headers);
//  * by g++, its host code only (libprecis_cuda12.so's launches through the driver API,
//    PRECIS_CUDA_DRIVER: no __CUDACC__, so `#ifdef __CUDACC__` hides the device code).
// A launch is written PR_LAUNCH(kernel, grid, block, stream, args...) or, for a template,
// PR_LAUNCH_T(kernel, (template args), grid, block, stream, args...), which each reading
// turns into its own form; the arguments must have the kernel's parameter types exactly
// (the driver API copies each parameter's bytes from the value given).
#ifndef PRECIS_CUDA_COMMON_CUH_
#define PRECIS_CUDA_COMMON_CUH_

#if defined(PRECIS_CUDA_DRIVER)
#include "driver_launch.h"
#elif !defined(__CUDACC_RTC__)
#include <cuda_runtime.h>
#endif
#include <stdint.h>

extern "C" {
#include "internal.h"
}
#include "precis_convert.h"
#include "rules.h"
#include "stores.h"

namespace precis {

#define PR_UNPAREN(...) __VA_ARGS__
#if !defined(PRECIS_CUDA_DRIVER) && !defined(PR_LAUNCH)  // (the emulator defines its own)
#define PR_LAUNCH(k, grid, block, stream, ...) k<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#define PR_LAUNCH_T(k, targs, grid, block, stream, ...) \
  k<PR_UNPAREN targs><<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

// Element storage types by dtype code; load() widens to fp32, store() rounds to
// nearest even, exactly as the CPU kernels do.
template <int DTYPE> struct Elem;
template <> struct Elem<PRECIS_DTYPE_FP32> {
  typedef float T;
  static __device__ __forceinline__ float load(T x) { return x; }
  static __device__ __forceinline__ T store(float x) { return x; }
};
template <> struct Elem<PRECIS_DTYPE_FP16> {
  typedef uint16_t T;
  static __device__ __forceinline__ float load(T x) { return precis_f16_to_f32(x); }
  static __device__ __forceinline__ T store(float x) { return precis_f32_to_f16_rn(x); }
};
template <> struct Elem<PRECIS_DTYPE_BF16> {
  typedef uint16_t T;
  static __device__ __forceinline__ float load(T x) { return precis_bf16_to_f32(x); }
  static __device__ __forceinline__ T store(float x) { return precis_f32_to_bf16_rn(x); }
};

#ifdef __CUDACC__
// ---- exact device forms of conversions and codes --------------------------------
// precis_convert.h's, rules.h's and stores.h's functions, the same bits for every input
// (tests/c/cuda_emu/test_adam_emulated.cc checks them against the CPU forms), in
// fewer instructions and without branches: in the Adam kernels' hot loop each
// instruction counts (tools/sass_budget.py), and nvcc branches around a CPU form's
// int-to-float conversion of a subnormal. They take fp32 subnormals as operands and
// results, which is exact on the GPU: nvcc compiles without -ftz
// (tools/build_cuda.sh, no --use_fast_math). The CPU forms keep away from fp32
// subnormals, so that a CPU thread in flush-to-zero mode cannot change them.

// 2^e for an fp32 exponent field e in [1, 254], as a float.
__device__ __forceinline__ float pow2_field(uint32_t e) { return precis_bits_f32(e << 23); }

// precis_ufloat_to_f32: the code in fp32 place, read as an fp32 (a subnormal when
// the code's exponent is 0), times 2^(127 - bias): exactly the code's value, normal
// or subnormal (a power-of-two scaling into the normal range rounds nothing).
__device__ __forceinline__ float ufloat_to_f32(uint32_t code, int mb, int bias) {
  return __fmul_rn(precis_bits_f32(code << (23 - mb)), pow2_field((uint32_t)(254 - bias)));
}

// precis_f16_to_f32: zeros, subnormals and normals as a code of 10 mantissa bits and
// bias 15; inf and NaN (quieted) as the CPU form makes them.
__device__ __forceinline__ float f16_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t em = (h & 0x7FFFu) << 13;
  const uint32_t finite = precis_f32_bits(ufloat_to_f32(h & 0x7FFFu, 10, 15));
  const uint32_t infnan = em | 0x7F800000u | ((em & 0x007FFFFFu) ? 0x00400000u : 0u);
  return precis_bits_f32((em >= 0x0F800000u ? infnan : finite) | sign);
}

// precis_m8_to_f32 and precis_v8_to_f32.
__device__ __forceinline__ float m8_to_f32(uint32_t code) {
  const float a = ufloat_to_f32(code & 0x7Fu, PRECIS_M8_MBITS, PRECIS_M8_BIAS);
  return precis_bits_f32(precis_f32_bits(a) | ((code & 0x80u) << 24));
}

__device__ __forceinline__ float v8_to_f32(uint32_t code) {
  return ufloat_to_f32(code & 0xFFu, PRECIS_V8_MBITS, PRECIS_V8_BIAS);
}

// precis_f32_to_ufloat_sr (a >= 0; inf and NaN saturate as there). a * 2^(bias - 127)
// is the CPU form's fixed-point value in fp32 bits: a normal product (a at least the
// code's smallest normal) is exactly its rebased bits; a subnormal one is a rounded to
// nearest even on the grid of 2^-drop of a subnormal step, which the CPU form gets by
// adding the smallest normal (and a rounding up to the smallest normal is its bits in
// both). bias is in [1, 127].
__device__ __forceinline__ uint32_t f32_to_ufloat_sr(float a, uint32_t r, int mb, int bias,
                                                     uint32_t max_code) {
  const int drop = 23 - mb;
  const uint32_t fixed = precis_f32_bits(__fmul_rn(a, pow2_field((uint32_t)bias)));
  const uint32_t code = (fixed + (r >> (32 - drop))) >> drop;
  return code > max_code ? max_code : code;
}

// precis_moment_sr_f16 and precis_moment_sr_fp8, through f32_to_ufloat_sr.
__device__ __forceinline__ uint16_t moment_sr_f16(float x, float multiplier, int second,
                                                  uint32_t r) {
  const float q = __fmul_rn(x, multiplier);
  const uint32_t u = precis_f32_bits(q);
  const uint32_t mag = f32_to_ufloat_sr(precis_bits_f32(u & 0x7FFFFFFFu), r, 10, 15, 0x7BFFu);
  // a NaN q: precis_f32_to_f16_rn's code of it (its sign, quiet, the top payload bits)
  const uint32_t nan = 0x7E00u | ((u >> 13) & 0x3FFu);
  const uint16_t code =
      (uint16_t)(((u >> 16) & 0x8000u) | ((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : mag));
  return precis_moment_keep_f16(code, q, second);
}

__device__ __forceinline__ uint8_t moment_sr_fp8(float x, float multiplier, int second,
                                                 uint32_t r) {
  const float q = __fmul_rn(x, multiplier);
  const float a = precis_bits_f32(precis_f32_bits(q) & 0x7FFFFFFFu);
  const uint8_t code =
      second ? (uint8_t)f32_to_ufloat_sr(a, r, PRECIS_V8_MBITS, PRECIS_V8_BIAS, PRECIS_V8_MAX_CODE)
             : precis_m8_code(q, f32_to_ufloat_sr(a, r, PRECIS_M8_MBITS, PRECIS_M8_BIAS,
                                                  PRECIS_M8_MAX_CODE));
  return precis_moment_keep_fp8(code, q, second);
}

// ---- the hot loop's byte codes, packed and unpacked a word at a time ---------------
// The fp8 kernels' moments and 8-bit remainders as whole 32-bit words of four codes,
// where the forms above take one code at a time: the same bits, in fewer instructions
// (tools/sass_budget.py; tests/c/cuda_emu/test_device_forms.cc checks each against the
// CPU form it stands for).

// PTX's prmt.b32 (one PRMT): result byte n is byte (s >> 4n) & 7 of the pair b:a (a's
// bytes 0-3, b's 4-7), or, where (s >> 4n) & 8 is set, that byte's top bit repeated.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__) && !defined(PRECIS_CUDA_EMULATED)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
#else
  const uint64_t x = (uint64_t)b << 32 | a;
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t sel = (s >> (4 * n)) & 0xFu;
    uint32_t byte = (uint32_t)(x >> (8 * (sel & 7u))) & 0xFFu;
    if (sel & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * n);
  }
  return d;
#endif
}

// The bits of a where mask has ones, of b elsewhere: one LOP3 (written as C, the
// compiler makes an AND and a LOP3 of it).
__device__ __forceinline__ uint32_t bit_select(uint32_t mask, uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && !defined(PRECIS_CUDA_EMULATED)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(mask));
  return d;
#else
  return (a & mask) | (b & ~mask);
#endif
}

// The top bytes of a, b, c, d as one word (a's lowest): four codes made by the *_top
// forms below.
__device__ __forceinline__ uint32_t pack_top_bytes(uint32_t a, uint32_t b, uint32_t c,
                                                   uint32_t d) {
  return prmt(prmt(a, b, 0x0073u), prmt(c, d, 0x7300u), 0x7610u);
}

// Byte 1 of a, b, c, d as one word (a's lowest).
__device__ __forceinline__ uint32_t pack_byte1(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return prmt(prmt(a, b, 0x0051u), prmt(c, d, 0x5100u), 0x7610u);
}

// precis_m8_to_f32 of byte k (0-3) of word w: the byte moved to the top, shifted down
// with its sign (arithmetically) so that its magnitude lands in fp32 place, the bits
// between cleared, then scaled as ufloat_to_f32 (exact: a power of two).
__device__ __forceinline__ float m8_byte_to_f32(uint32_t w, int k) {
  const int32_t top = (int32_t)(k == 3 ? w : w << (24 - 8 * k));
  const uint32_t bits = (uint32_t)(top >> 6) & (0x80000000u | (PRECIS_M8_MAX_CODE << 18));
  return __fmul_rn(precis_bits_f32(bits), pow2_field((uint32_t)(254 - PRECIS_M8_BIAS)));
}

// precis_moment_sr_fp8 of the first moment (m8), its code in the top byte (the lower
// bytes: any bits). q clamped to +-7.875 in fp32 (a NaN q to +7.875: fminf and fmaxf
// drop a NaN operand) gives m8_code's saturation and its NaN code 0x7F; the fixed point
// keeps q's sign bit on top (the magnitude, below 2^25 with the random bits added, never
// carries into it), and one shift and select move the magnitude under it.
__device__ __forceinline__ uint32_t m8_sr_top(float x, float multiplier, uint32_t r) {
  static_assert(PRECIS_M8_MBITS == 5 && PRECIS_M8_MAX_CODE == 0x7Fu, "m8 is E2M5");
  const float q = __fmul_rn(x, multiplier);
  const float c = fmaxf(fminf(q, PRECIS_M8_MAX), -PRECIS_M8_MAX);
  const uint32_t t =
      precis_f32_bits(__fmul_rn(c, pow2_field((uint32_t)PRECIS_M8_BIAS))) + (r >> 14);
  return bit_select(0x7F000000u, t << 6, t);
}

// precis_moment_sr_fp8 of the second moment (v8), its code in the top byte (the lower
// bytes: any bits): |q| clamped to 126 (NaN and inf too: v8's saturation), the code
// shifted to the top, a positive q kept off code 0 (precis_moment_keep_fp8).
__device__ __forceinline__ uint32_t v8_sr_top(float x, float multiplier, uint32_t r) {
  static_assert(PRECIS_V8_MBITS == 5 && PRECIS_V8_MAX_CODE == 0xFFu, "v8 is unsigned E3M5");
  const float q = __fmul_rn(x, multiplier);
  const float c = fminf(fabsf(q), PRECIS_V8_MAX);
  const uint32_t t =
      (precis_f32_bits(__fmul_rn(c, pow2_field((uint32_t)PRECIS_V8_BIAS))) + (r >> 14)) << 6;
#if defined(__CUDA_ARCH__) && !defined(PRECIS_CUDA_EMULATED)
  // (a predicated max: a select of the keep's bit and a max cost one more)
  uint32_t out = t;
  asm("{ .reg .pred p; setp.gt.f32 p, %1, 0f00000000; @p max.u32 %0, %0, 0x1000000; }"
      : "+r"(out) : "f"(q));
  return out;
#else
  return q > 0.0f ? max(t, 1u << 24) : t;
#endif
}

// The 24-bit master of precis_master24_bits (its bytes 1-3; byte 0: any bits): the fp32
// master rounded to nearest even at bit 8, a NaN quieted. precis_remainder8_param is
// bytes 2-3 of it plus 0x8000 (rounding its byte 1 to nearest), precis_remainder8_low
// its byte 1.
__device__ __forceinline__ uint32_t master24_word(float master) {
  const uint32_t u = precis_f32_bits(master);
  return master != master ? u | 0x00400000u : u + 0x7Fu + ((u >> 8) & 1u);
}

// precis_remainder8_master of the bf16 param in half h (0, 1) of word p and the int8
// remainder in byte k of word x: (param << 16) + remainder * 256, the remainder
// sign-extended by one PRMT (the high half's borrow of a negative remainder, as the CPU
// form subtracts it).
__device__ __forceinline__ float remainder8_master_word(uint32_t p, int h, uint32_t x, int k) {
  const uint32_t s = 0x4u | (uint32_t)k << 4 | (uint32_t)(8 | k) << 8 | (uint32_t)(8 | k) << 12;
  const uint32_t low = prmt(x, 0u, s);  // int8 remainder << 8
  return precis_bits_f32((h ? p & 0xFFFF0000u : p << 16) + low);
}

// ---- nvcc's own fast paths of sqrt.rn and div.rn, without their guards ----------------
// For cuda/step.cu's adam_tail_group, which guards eight elements at once (its comment
// says where each gives the IEEE result); tools/adam_fast_paths_check.cu checks them on a
// GPU against sqrt.rn and div.rn. PTX: GPU code only (the emulator runs sqrtf and the
// division instead).

// out = sqrt.rn(x) for x in [2^-101, FLT_MAX] (bits 0x0D000000-0x7F7FFFFF): MUFU.RSQ,
// two FMULs, two FMAs. (Macros, not functions: the hot loop's statements as they are, in
// which order nvcc schedules them best.)
#define PR_SQRT_RN_FAST(out, x)                                                  \
  do {                                                                           \
    const float x_ = (x);                                                        \
    float r_, y_, h_;                                                            \
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r_) : "f"(x_));                    \
    asm("mul.ftz.f32 %0, %1, %2;" : "=f"(y_) : "f"(x_), "f"(r_));                \
    asm("mul.ftz.f32 %0, %1, 0f3F000000;" : "=f"(h_) : "f"(r_));                 \
    (out) = __fmaf_rn(__fmaf_rn(-y_, y_, x_), h_, y_);                           \
  } while (0)

// out = a / d rounded to nearest, a evaluated after the reciprocal, for d in
// [2^-60, 2^61) and a zero or |a| in [2^-64, 2^60]: MUFU.RCP, a Newton step of the
// reciprocal, the quotient corrected by its exact residual (negated, so that a zero a
// keeps its sign).
#define PR_DIV_RN_FAST(out, a, d)                                                \
  do {                                                                           \
    const float d_ = (d);                                                        \
    float r0_;                                                                   \
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0_) : "f"(d_));                     \
    const float r1_ = __fmaf_rn(r0_, __fmaf_rn(-d_, r0_, 1.0f), r0_);            \
    const float a_ = (a);                                                        \
    const float q0_ = __fmul_rn(a_, r1_);                                        \
    (out) = __fmaf_rn(-__fmaf_rn(d_, q0_, -a_), r1_, q0_);                       \
  } while (0)

#endif  // __CUDACC__

#ifndef __CUDACC_RTC__
// Grid size for a grid-stride loop over n elements: enough blocks to fill the
// GPU, never more than the elements need.
inline unsigned grid_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = 65535;
  return (unsigned)(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

#ifndef PRECIS_CUDA_DRIVER
// Turns the state after a launch into a status; never synchronizes.
inline precis_status_t check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return pr_fail(PRECIS_ERR_CUDA, "%s: kernel launch failed: %s", what,
                   cudaGetErrorString(err));
  }
  return PRECIS_OK;
}

// bytes of zeros at dst in stream order (what names dst in the message).
inline precis_status_t memset_async(const char* fn, const char* what, void* dst, size_t bytes,
                                    cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(dst, 0, bytes, stream);
  if (err != cudaSuccess) {
    return pr_fail(PRECIS_ERR_CUDA, "%s: cudaMemsetAsync of %s failed: %s", fn, what,
                   cudaGetErrorString(err));
  }
  return PRECIS_OK;
}

// A device-to-device copy of bytes in stream order.
inline precis_status_t memcpy_async(const char* fn, void* dst, const void* src, size_t bytes,
                                    cudaStream_t stream) {
  const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) {
    return pr_fail(PRECIS_ERR_CUDA, "%s: cudaMemcpyAsync failed: %s", fn,
                   cudaGetErrorString(err));
  }
  return PRECIS_OK;
}
#endif  // !PRECIS_CUDA_DRIVER
#endif  // !__CUDACC_RTC__

}  // namespace precis

#endif  // PRECIS_CUDA_COMMON_CUH_
