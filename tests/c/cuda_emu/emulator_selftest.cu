// emulator_selftest.cu - kernels that check the CUDA emulator itself (written
// as CUDA, rewritten and compiled like cuda/step.cu; never built by nvcc).
// test_adam_emulated.cc calls the host functions below and checks the results
// against what CUDA specifies.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// Per thread: shfl_xor 5, shfl_down 3, shfl from lane 9, ballot, and a warp
// max by xor butterfly (as step.cu's warp_max2).
__global__ void shuffles(unsigned* out) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned v = t * 7u + 1u;
  unsigned m = (t * 2654435761u) >> 7;
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  out[t * 5 + 0] = __shfl_xor_sync(0xFFFFFFFFu, v, 5);
  out[t * 5 + 1] = __shfl_down_sync(0xFFFFFFFFu, v, 3);
  out[t * 5 + 2] = __shfl_sync(0xFFFFFFFFu, v, 9);
  out[t * 5 + 3] = __ballot_sync(0xFFFFFFFFu, lane % 3 == 0 || threadIdx.x == 40);
  out[t * 5 + 4] = m;
}

// Per thread: __syncthreads_or/_and/_count of "thread == who".
__global__ void barriers(int* out, int who) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int pred = (int)threadIdx.x == who;
  out[t * 3 + 0] = __syncthreads_or(pred);
  out[t * 3 + 1] = __syncthreads_and(!pred);
  out[t * 3 + 2] = __syncthreads_count(pred);
}

// Half of each warp leaves before a vote the whole mask waits for: hangs on a GPU.
__global__ void divergent_vote(int* out) {
  if ((threadIdx.x & 31u) < 16u) out[threadIdx.x] = __any_sync(0xFFFFFFFFu, 1);
}

// Per block of up to 64 threads: thread 0 zeroes a shared sum, every thread
// writes a shared slot, then adds its neighbour's slot to the sum atomically;
// every thread reports the block's sum, and thread 0 adds it to *total.
// (Shared memory is seen by the whole block, and each block starts from its
// own thread 0's writes, not the previous block's.)
__global__ void shared_and_atomics(unsigned* seen, unsigned long long* total) {
  __shared__ unsigned sum;
  __shared__ unsigned slots[64];
  if (threadIdx.x == 0) sum = 0;
  slots[threadIdx.x] = threadIdx.x * 3u + blockIdx.x;
  __syncthreads();
  atomicAdd(&sum, slots[(threadIdx.x + 1) % blockDim.x]);
  __syncthreads();
  seen[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) atomicAdd(total, (unsigned long long)sum);
}

}  // namespace

// Host side: launch, return the launch error (cudaError_t as int).
extern "C" int emu_selftest_shuffles(unsigned* out, unsigned blocks, unsigned threads) {
  shuffles<<<blocks, threads, 0, nullptr>>>(out);
  return cudaGetLastError();
}

extern "C" int emu_selftest_barriers(int* out, unsigned blocks, unsigned threads, int who) {
  barriers<<<blocks, threads>>>(out, who);
  return cudaGetLastError();
}

extern "C" int emu_selftest_divergent_vote(int* out) {
  divergent_vote<<<1, 64>>>(out);
  return cudaGetLastError();
}

extern "C" int emu_selftest_shared_and_atomics(unsigned* seen, unsigned long long* total,
                                               unsigned blocks, unsigned threads) {
  shared_and_atomics<<<blocks, threads>>>(seen, total);
  return cudaGetLastError();
}

// cudaMemcpyAsync of n bytes from src to dst (the launch-error code as int).
extern "C" int emu_selftest_memcpy(void* dst, const void* src, size_t n) {
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, nullptr);
}
