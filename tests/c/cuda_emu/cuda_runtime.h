// cuda_runtime.h - stand-in for the CUDA runtime header, so that host g++
// (C++17) compiles a .cu file into code that runs its kernels on the emulator
// of cuda_emu.h. Put this directory on the include path ahead of any real CUDA
// headers, and rewrite each launch first (tests/BUILD does it with sed):
//
//     kernel<<<grid, block, smem, stream>>>(args)
//  -> kernel ^ cuda_emu::launch_config(grid, block, smem, stream)(args)
//
// Compile with -ffp-contract=off: the device code this emulates rounds every
// operation it does not fuse explicitly, and the comparisons are bit for bit.
// Only what precis's kernels use is here (and a few collectives that
// emulator_selftest.cu checks); add more as kernels need it.
#ifndef PRECIS_TESTS_CUDA_EMU_CUDA_RUNTIME_H_
#define PRECIS_TESTS_CUDA_EMU_CUDA_RUNTIME_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_emu.h"

// PR_LAUNCH and PR_LAUNCH_T (cuda/common.cuh) in the emulator's form, arguments checked.
#define PR_LAUNCH(k, grid, block, stream, ...) \
  cuda_emu::exact(k) ^ cuda_emu::launch_config((grid), (block), 0, (stream))(__VA_ARGS__)
#define PR_LAUNCH_T(k, targs, grid, block, stream, ...)                                 \
  cuda_emu::exact(k<PR_UNPAREN targs>) ^                                                \
      cuda_emu::launch_config((grid), (block), 0, (stream))(__VA_ARGS__)

// The whole file is "device code": shared headers take their device branch
// (__fmul_rn & co. instead of plain operators), as nvcc's device pass does.
// Host code of the file sees it too, which only matters where a header's host
// and device branches would differ in result: in precis they do not.
#define __CUDACC__
#define __CUDA_ARCH__ 800
// What has no C++ form here (inline PTX: cuda/step.cu's asynchronous copies) takes its
// plain form where the sources test this.
#define PRECIS_CUDA_EMULATED 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__ __restrict
// Shared memory: one object per host thread, which every CUDA thread of the
// running block sees (blocks run one after another, so each has it alone).
// Unlike on a GPU it is zeroed once (per host thread) and keeps its contents
// from block to block: a kernel that reads shared memory it did not write
// reads stale values here, not garbage. (extern __shared__, dynamic shared
// memory, is not emulated.)
#define __shared__ static thread_local

// ---- built-in types and variables ----------------------------------------------

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

// CUDA's vector types are aligned to their size, so a misaligned vector access
// is as wrong here as on the GPU (UBSan's alignment check reports it).
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
static inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}

static inline uint3 cuda_emu_uint3(cuda_emu::Dim d) { return uint3{d.x, d.y, d.z}; }
static inline dim3 cuda_emu_dim3(cuda_emu::Dim d) { return dim3(d.x, d.y, d.z); }
// Per thread (per fiber) values, so they are read anew each time.
#define threadIdx (cuda_emu_uint3(::cuda_emu::ThreadIdx()))
#define blockIdx (cuda_emu_uint3(::cuda_emu::BlockIdx()))
#define blockDim (cuda_emu_dim3(::cuda_emu::BlockDim()))
#define gridDim (cuda_emu_dim3(::cuda_emu::GridDim()))

// ---- runtime API --------------------------------------------------------------

typedef struct CUstream_st* cudaStream_t;

// The real codes of the errors the emulator reports.
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
};
typedef enum cudaError cudaError_t;

static inline cudaError_t cudaGetLastError(void) {
  return static_cast<cudaError_t>(cuda_emu::TakeLaunchError());
}
static inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  }
  return "unknown error";
}

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

// Device memory is host memory: every kind is a memcpy, done at once (the one
// in-order queue), and counted in cuda_emu::GetStats().memcpys.
static inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count,
                                          enum cudaMemcpyKind kind, cudaStream_t stream = nullptr) {
  (void)stream;
  if ((unsigned)kind > (unsigned)cudaMemcpyDefault) return cudaErrorInvalidValue;
  cuda_emu::Memcpy(dst, src, count);
  return cudaSuccess;
}

// Done at once, as the copies.
static inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t count,
                                          cudaStream_t stream = nullptr) {
  (void)stream;
  memset(dst, value, count);
  return cudaSuccess;
}

// ---- launches -------------------------------------------------------------------

namespace cuda_emu {

template <class... A>
struct BoundLaunch {
  dim3 grid, block;
  std::tuple<A...> args;
};

struct LaunchConfig {
  dim3 grid, block;
  template <class... A>
  BoundLaunch<std::decay_t<A>...> operator()(A&&... args) const {
    return {grid, block, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

// Dynamic shared memory is not emulated (precis's kernels use none).
inline LaunchConfig launch_config(dim3 grid, dim3 block, size_t smem = 0,
                                  cudaStream_t stream = nullptr) {
  (void)stream;  // one in-order queue: launches run at once, in call order
  if (smem != 0) SetLaunchError(cudaErrorInvalidValue);
  return LaunchConfig{grid, block};
}

// kernel ^ launch_config(...)(args): the arguments are converted to the
// kernel's parameter types once (as cudaLaunchKernel copies them), then every
// thread gets the kernel called on its own copy.
template <class... P, class... A>
void operator^(void (*kernel)(P...), BoundLaunch<A...>&& launch) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
  std::tuple<std::decay_t<P>...> params = std::make_from_tuple<std::tuple<std::decay_t<P>...>>(
      std::move(launch.args));
  const Dim grid{launch.grid.x, launch.grid.y, launch.grid.z};
  const Dim block{launch.block.x, launch.block.y, launch.block.z};
  if (!RunGrid(grid, block, [&] { std::apply(kernel, params); })) {
    SetLaunchError(cudaErrorInvalidConfiguration);
  }
}

// PR_LAUNCH's form (cuda/common.cuh): as above, and each argument must already have its
// parameter's type (a pointer: any pointer), as libprecis_cuda12.so's launches through the
// driver API need (cuLaunchKernel copies each parameter's bytes from the value given).
template <class F>
struct Exact {
  F kernel;
};
template <class F>
Exact<F> exact(F kernel) {
  return {kernel};
}
template <class P, class A>
constexpr bool same_parameter() {
  using DP = std::decay_t<P>;
  using DA = std::decay_t<A>;
  return std::is_same<DP, DA>::value ||
         (std::is_pointer<DP>::value && (std::is_pointer<DA>::value ||
                                         std::is_same<DA, std::nullptr_t>::value));
}
template <class... P, class... A>
void operator^(Exact<void (*)(P...)> k, BoundLaunch<A...>&& launch) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel argument count");
  static_assert((same_parameter<P, A>() && ...),
                "a launch argument's type is not its parameter's (the driver API copies its bytes)");
  k.kernel ^ std::move(launch);
}

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof v);
  return u;
}

template <class T>
inline T from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof v);
  return v;
}

}  // namespace cuda_emu

// ---- warp and block collectives ------------------------------------------------

template <class T>
static inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  const uint64_t* all = cuda_emu::WarpExchange(cuda_emu::kShfl, mask, cuda_emu::to_bits(var));
  const int lane = (int)cuda_emu::LaneId();
  const int base = lane & ~(width - 1);
  return cuda_emu::from_bits<T>(all[base + (src_lane & (width - 1))]);
}

template <class T>
static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const uint64_t* all = cuda_emu::WarpExchange(cuda_emu::kShfl, mask, cuda_emu::to_bits(var));
  const int lane = (int)cuda_emu::LaneId();
  // A source outside the lane's width-segment keeps the lane's own value.
  const int src = lane ^ lane_mask;
  const bool same_segment = (src & ~(width - 1)) == (lane & ~(width - 1));
  return same_segment ? cuda_emu::from_bits<T>(all[src]) : var;
}

template <class T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const uint64_t* all = cuda_emu::WarpExchange(cuda_emu::kShfl, mask, cuda_emu::to_bits(var));
  const int lane = (int)cuda_emu::LaneId();
  return (lane & (width - 1)) + (int)delta < width ? cuda_emu::from_bits<T>(all[lane + (int)delta])
                                                   : var;
}

static inline unsigned __ballot_sync(unsigned mask, int pred) {
  const uint64_t* all = cuda_emu::WarpExchange(cuda_emu::kVote, mask, pred != 0);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= (all[l] != 0 ? 1u : 0u) << l;
  return bits & mask;
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }

static inline void __syncthreads(void) { cuda_emu::BlockBarrier(cuda_emu::kSync, 0); }
static inline int __syncthreads_or(int pred) {
  return cuda_emu::BlockBarrier(cuda_emu::kOr, pred != 0);
}
static inline int __syncthreads_and(int pred) {
  return cuda_emu::BlockBarrier(cuda_emu::kAnd, pred != 0);
}
static inline int __syncthreads_count(int pred) {
  return cuda_emu::BlockBarrier(cuda_emu::kCount, pred != 0);
}

// ---- atomics ------------------------------------------------------------------------
// The threads of a launch are fibers of one host thread that switch only at
// collectives, so a plain read-modify-write is atomic. Return the old value.

static inline unsigned int atomicAdd(unsigned int* address, unsigned int val) {
  const unsigned int old = *address;
  *address = old + val;
  return old;
}
static inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long val) {
  const unsigned long long old = *address;
  *address = old + val;
  return old;
}
static inline unsigned long long atomicExch(unsigned long long* address, unsigned long long val) {
  const unsigned long long old = *address;
  *address = val;
  return old;
}
// A fence orders a thread's writes for the other blocks; blocks run one after another
// here, so every write is seen in order already.
static inline void __threadfence(void) {}

// ---- loads and integer helpers ----------------------------------------------------

// The read-only cache path: an ordinary load (the kernel must not write what it
// reads this way during the launch; the emulator cannot check that).
template <class T>
static inline T __ldg(const T* p) {
  return *p;
}

// CUDA's unsigned max (device code calls it unqualified).
static inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }

// ---- floating-point intrinsics -----------------------------------------------------
// IEEE-754 binary32/binary64, round to nearest even, subnormals kept (nvcc's
// defaults without --use_fast_math; x86-64 SSE without FTZ/DAZ gives the same).
// Plain operators are exact equivalents once -ffp-contract=off stops GCC fusing
// them with neighbours; fmaf is correctly rounded in glibc.

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dmul_rn(double a, double b) { return a * b; }

static inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static inline float __uint_as_float(unsigned int u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

#endif  // PRECIS_TESTS_CUDA_EMU_CUDA_RUNTIME_H_
