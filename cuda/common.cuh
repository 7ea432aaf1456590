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
