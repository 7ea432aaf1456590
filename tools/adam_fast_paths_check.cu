// adam_fast_paths_check: cuda/common.cuh's fast paths of sqrt.rn and div.rn
// (PR_SQRT_RN_FAST, PR_DIV_RN_FAST: nvcc's own sequences without their guards, which
// cuda/step.cu's fp8 Adam kernels take under one guard for a thread's eight elements,
// adam_tail_group) against the GPU's sqrt.rn and div.rn, bit for bit: the square root for
// every float of the guard's range of v ([2^-101, 2^80]), the division for 2^32 operand
// pairs drawn from its box (d in [2^-60, 2^61), |a| in [2^-64, 2^60), mantissas at random
// or next to a power of two) and for zeros of either sign. The emulated tests cannot
// check these (the emulator runs sqrtf and the division). `tools/gpu_check.sh cuda-tests`
// builds and runs it on a GPU; CI only compiles it (//:adam_fast_paths_check). Prints the
// mismatches found (at most 10) and exits 1 on any.
#include <cstdio>
#include <cstdlib>

#include "common.cuh"


__device__ unsigned long long mismatches;
__device__ uint32_t found[10][4];  // what, first operand, fast, want

__device__ void record(uint32_t what, uint32_t operand, float fast, float want) {
  const unsigned long long k = atomicAdd(&mismatches, 1ull);
  if (k < 10) {
    found[k][0] = what;
    found[k][1] = operand;
    found[k][2] = precis_f32_bits(fast);
    found[k][3] = precis_f32_bits(want);
  }
}

__global__ void roots(uint32_t first, uint32_t count) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += gridDim.x * blockDim.x) {
    const float x = precis_bits_f32(first + i);
    float fast;
    PR_SQRT_RN_FAST(fast, x);
    const float want = __fsqrt_rn(x);
    if (precis_f32_bits(fast) != precis_f32_bits(want)) record(0, first + i, fast, want);
  }
}

__device__ uint32_t next(uint64_t& s) {  // xorshift64
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return (uint32_t)(s >> 32);
}

// A mantissa: at random, or within 64 of 0 or of 2^23 (next to a power of two).
__device__ uint32_t mantissa(uint64_t& s) {
  const uint32_t r = next(s), kind = r & 7u;
  return kind == 0 ? (r >> 8) & 63u : kind == 1 ? 0x7FFFFFu - ((r >> 8) & 63u) : r >> 9;
}

__global__ void quotients(uint64_t seed, uint32_t per_thread) {
  const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t s = seed ^ (0x9E3779B97F4A7C15ull * (t + 1));
  for (uint32_t i = 0; i < per_thread; ++i) {
    const uint32_t r = next(s);
    const uint32_t ea = 63u + r % 124u;          // |a| in [2^-64, 2^60)
    const uint32_t ed = 67u + (r >> 8) % 121u;   // d in [2^-60, 2^61)
    uint32_t abits = (r & 0x80000000u) | ea << 23 | mantissa(s);
    if ((r & 0x7F0000u) == 0) abits &= 0x80000000u;  // a zero of either sign, 1 in 128
    const float a = precis_bits_f32(abits), d = precis_bits_f32(ed << 23 | mantissa(s));
    float fast;
    PR_DIV_RN_FAST(fast, a, d);
    const float want = __fdiv_rn(a, d);
    if (precis_f32_bits(fast) != precis_f32_bits(want)) record(1, abits, fast, want);
  }
}

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

int main() {
  const uint32_t first = 0x0D000000u, last = 0x67800000u;  // v in [2^-101, 2^80]
  roots<<<4096, 256>>>(first, last - first + 1);
  check(cudaGetLastError(), "roots");
  quotients<<<4096, 256>>>(0x5DEECE66Dull, 4096);  // 2^32 pairs
  check(cudaGetLastError(), "quotients");
  check(cudaDeviceSynchronize(), "the checks");
  unsigned long long n = 0;
  uint32_t rows[10][4];
  check(cudaMemcpyFromSymbol(&n, mismatches, sizeof n), "cudaMemcpyFromSymbol");
  check(cudaMemcpyFromSymbol(rows, found, sizeof rows), "cudaMemcpyFromSymbol");
  for (unsigned long long k = 0; k < n && k < 10; ++k) {
    std::printf("%s of %08x: fast %08x, IEEE %08x\n", rows[k][0] ? "quotient (a)" : "root",
                rows[k][1], rows[k][2], rows[k][3]);
  }
  std::printf("adam_fast_paths_check: %llu mismatches (%u roots, 2^32 quotients)\n", n,
              last - first + 1);
  return n == 0 ? 0 : 1;
}
