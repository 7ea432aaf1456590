// fp8_cuda_check: the GPU's fp8 conversions (precis_convert.h; one cvt instruction
// each when compiled for sm_89+) against the software forms the CPU runs, for all
// 2^32 floats (f32 -> fp8) and all 256 codes (fp8 -> f32). `tools/gpu_check.sh cuda-tests`
// builds and runs it on a GPU; CI only compiles it (//:fp8_cuda_check). Prints the
// mismatches found (at most 10) and exits 1 on any.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "precis_convert.h"

// The device pass must compile the hardware forms, else this compares the software
// forms with themselves.
#if defined(__CUDA_ARCH__) && !defined(PRECIS_FP8_CVT)
#error "build for sm_89 or newer (-arch=sm_90): the hardware fp8 conversions are not compiled"
#endif

__global__ void encode(uint32_t first, uint32_t count, uint8_t* out) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    out[i] = precis_f32_to_fp8_rn(precis_bits_f32(first + i));
  }
}

__global__ void decode(uint32_t* out) {
  out[threadIdx.x] = precis_f32_bits(precis_fp8_to_f32((uint8_t)threadIdx.x));
}

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

int main() {
  const uint32_t chunk = 1u << 28;
  uint8_t* dev = nullptr;
  check(cudaMalloc(&dev, chunk), "cudaMalloc");
  std::vector<uint8_t> host(chunk);
  uint64_t bad = 0;
  for (uint64_t first = 0; first < (1ull << 32); first += chunk) {
    encode<<<4096, 256>>>((uint32_t)first, chunk, dev);
    check(cudaGetLastError(), "encode launch");
    check(cudaMemcpy(host.data(), dev, chunk, cudaMemcpyDeviceToHost), "encode copy");
    for (uint32_t i = 0; i < chunk; ++i) {
      const uint32_t u = (uint32_t)first + i;
      const uint8_t want = precis_f32_to_fp8_rn(precis_bits_f32(u));
      if (host[i] != want && bad++ < 10) {
        std::printf("f32 -> fp8: 0x%08x gives 0x%02x on the GPU, 0x%02x on the CPU\n", u, host[i], want);
      }
    }
  }
  uint32_t* codes = nullptr;
  check(cudaMalloc(&codes, 256 * sizeof(uint32_t)), "cudaMalloc");
  decode<<<1, 256>>>(codes);
  check(cudaGetLastError(), "decode launch");
  uint32_t got[256];
  check(cudaMemcpy(got, codes, sizeof got, cudaMemcpyDeviceToHost), "decode copy");
  for (int x = 0; x < 256; ++x) {
    const uint32_t want = precis_f32_bits(precis_fp8_to_f32((uint8_t)x));
    if (got[x] != want && bad++ < 10) {
      std::printf("fp8 -> f32: 0x%02x gives 0x%08x on the GPU, 0x%08x on the CPU\n", x, got[x], want);
    }
  }
  std::printf("fp8_cuda_check: %llu mismatches (2^32 encodings, 256 decodings)\n",
              (unsigned long long)bad);
  return bad ? 1 : 0;
}
