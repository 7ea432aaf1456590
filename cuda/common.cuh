// common.cuh - helpers shared by the CUDA kernels: typed element access built on
// the same conversions the CPU uses (csrc/precis_convert.h), launch checks.
#ifndef PRECIS_CUDA_COMMON_CUH_
#define PRECIS_CUDA_COMMON_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "internal.h"
}
#include "precis_convert.h"

namespace precis {

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

// Grid size for a grid-stride loop over n elements: enough blocks to fill the
// GPU, never more than the elements need.
inline unsigned grid_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = 65535;
  return (unsigned)(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

// Turns the state after a launch into a status; never synchronizes.
inline precis_status_t check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return pr_fail(PRECIS_ERR_CUDA, "%s: kernel launch failed: %s", what,
                   cudaGetErrorString(err));
  }
  return PRECIS_OK;
}

}  // namespace precis

#endif  // PRECIS_CUDA_COMMON_CUH_
