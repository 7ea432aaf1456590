// resync.cu - precis_cuda_resync_masters and precis_cuda_resync_changed, the CUDA twins of
// csrc/resync.c: the masters or remainders of the params a step's compare flagged (stale,
// on the device; or set here from the fingerprints), resynced by resync.h's rule without
// reading the flags back. Three launches for any number of tensors up to kTensors: the
// counts set, the kept elements counted, the masters rewritten, the last two over at most
// kGrid blocks that pass over the tensors not flagged. precis_cuda_resync_compared takes
// the fingerprints itself: its first launch fingerprints the params, compares and sets
// the counts in one kernel (in place of the fingerprint's two launches and the counts').
// precis_cuda_compare_params is that call without its last launch: the update that
// follows rewrites each flagged chunk as it steps it (cuda/step.cu).
#ifndef __CUDACC_RTC__
#include <cstring>
#endif

#include "common.cuh"
// After common.cuh, which declares internal.h's helpers with C linkage.
#include "fingerprint.h"
#include "resync.h"

// A named namespace, not an anonymous one: NVRTC names an anonymous namespace after its
// process, and a kernel's symbol must be the same in every image (tools/build_cuda12.py).
namespace precis {
namespace resync_cu {

const int kThreads = 256;
const int64_t kBlockElems = (int64_t)kThreads * 16;  // elements of a chunk (a block's share)
const int kTensors = 512;  // tensors per launch: ResyncArgs < 16 KiB (CUDA 12.1's limit:
                           // 32,764 bytes), so that a model's params are one launch

// One launch's tensors, by value: tensor k has the chunks of kBlockElems elements
// [first_block[k], first_block[k + 1]) of the launch's.
struct ResyncArgs {
  void* masters[kTensors];
  const uint16_t* params[kTensors];
  int64_t numels[kTensors];
  uint32_t first_block[kTensors + 1];
  int count;
};
static_assert(sizeof(ResyncArgs) <= 16384, "ResyncArgs must fit in 16 KiB of kernel parameters");


// Elements of a chunk of the compare (32 KiB of bf16: a block's share of a pass, as the
// fingerprint kernel's), kBlockElems' multiple.
const int64_t kCompareElems = 4 * kBlockElems;

#ifdef __CUDACC__
// kept[k] = 0 for a flagged tensor (the count kernel adds to it), its numel otherwise;
// with records, the flags set first: stale[k] = whether kept[k] (the fingerprint now)
// is not records[k].
__global__ void resync_init_kernel(ResyncArgs args, const int64_t* records, uint8_t* stale,
                                   unsigned long long* kept) {
  for (int k = threadIdx.x; k < args.count; k += blockDim.x) {
    if (records != nullptr) stale[k] = kept[k] != (unsigned long long)records[k];
    kept[k] = stale[k] ? 0ull : (unsigned long long)args.numels[k];
  }
}

// Tensor k's first chunk of this block (its chunks c0, c0 + gridDim.x, ...).
__device__ __forceinline__ int64_t first_chunk(const ResyncArgs& a, int k) {
  return (int64_t)((blockIdx.x + gridDim.x - a.first_block[k] % gridDim.x) % gridDim.x);
}

// A flagged master's elements that still round to the param: each chunk's share added
// to kept[k] with one atomic.
__global__ void resync_count_kernel(ResyncArgs args, int master_dtype, int param_dtype,
                                    const uint8_t* stale, unsigned long long* kept) {
  __shared__ unsigned long long partial[kThreads];
  for (int k = 0; k < args.count; ++k) {
    if (!stale[k]) continue;  // (uniform over the block)
    const void* master = args.masters[k];
    const uint16_t* param = args.params[k];
    const int64_t n = args.numels[k];
    for (int64_t begin = first_chunk(args, k) * kBlockElems; begin < n;
         begin += (int64_t)gridDim.x * kBlockElems) {
      const int64_t end = begin + kBlockElems < n ? begin + kBlockElems : n;
      unsigned long long mine = 0;
      for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
        mine += pr_rounds_to(pr_master_value(master, j, master_dtype), param[j], param_dtype);
      }
      partial[threadIdx.x] = mine;
      __syncthreads();
      for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
      }
      if (threadIdx.x == 0 && partial[0] != 0) atomicAdd(&kept[k], partial[0]);
      __syncthreads();  // (partial is reused by the next chunk)
    }
  }
}

// A flagged tensor's chunk [begin, end) rewritten (resync.h's pr_resync_element): a master
// where it no longer rounds to the param (whole for a whole load), remainders zeroed.
__device__ void write_chunk(const ResyncArgs& args, int k, int64_t begin, int64_t end,
                            int master_dtype, int param_dtype, bool whole) {
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    pr_resync_element(args.masters[k], master_dtype, args.params[k], param_dtype, j, whole);
  }
}

__global__ void resync_write_kernel(ResyncArgs args, int master_dtype, int param_dtype,
                                    const uint8_t* stale, const unsigned long long* kept) {
  for (int k = 0; k < args.count; ++k) {
    if (!stale[k]) continue;
    const int64_t n = args.numels[k];
    const bool whole = pr_resync_whole((int64_t)kept[k], n);
    for (int64_t begin = first_chunk(args, k) * kBlockElems; begin < n;
         begin += (int64_t)gridDim.x * kBlockElems) {
      write_chunk(args, k, begin, begin + kBlockElems < n ? begin + kBlockElems : n,
                  master_dtype, param_dtype, whole);
    }
  }
}

// ---- the fingerprint and compare in one launch (precis_cuda_resync_compared) ---------

// The block's tensor for chunk c of a launch: the last k with first_block[k] <= c (every
// tensor has at least one chunk here, so first_block is strictly increasing).
__device__ __forceinline__ int tensor_of(const ResyncArgs& a, uint32_t c) {
  int lo = 0, hi = a.count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a.first_block[mid] <= c) lo = mid; else hi = mid;
  }
  return lo;
}


// The sum of v over the block (every thread gets it): each warp's by shuffles, then the
// warps' through warp_sums (kThreads / 32 entries).
__device__ __forceinline__ unsigned long long block_sum(unsigned long long* warp_sums,
                                                       unsigned long long v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  if ((threadIdx.x & 31u) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned long long total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  __syncthreads();  // (warp_sums is reused)
  return total;
}

// Tensor k's fingerprint is whole in sums[2k] (thread 0 of the block that counted its
// last chunk): compared with records[k] into stale[k], kept[k] set as
// resync_init_kernel sets it (0 for a written param, for the count kernel to add to; its
// numel otherwise), sums left zero for the next call.
__device__ __forceinline__ void decide_tensor(const ResyncArgs& a, int k, const int64_t* records,
                                              uint8_t* stale, unsigned long long* kept,
                                              unsigned long long* sums) {
  const unsigned long long now = atomicExch(&sums[2 * k], 0ull);
  sums[2 * k + 1] = 0;  // (every chunk of k has counted itself: no other block writes it)
  stale[k] = now != (unsigned long long)records[k];
  kept[k] = stale[k] ? 0ull : (unsigned long long)a.numels[k];
}

// Each chunk of kCompareElems param elements adds its fingerprint terms (fingerprint.h's:
// the sum of each 2-byte element's pr_fp_bytes, the tensor's first chunk its length
// term) to sums[2k] and counts itself in sums[2k + 1]; the block that counts a tensor's
// last chunk decides it (decide_tensor), so that the count and write kernels after it
// resync what was written over the whole grid (a mask applied after every step writes
// a param every step). At most kGrid blocks, taking the chunks in turns. zeroed (NULL:
// none): each tensor's entry set to 0 (the update's record, which its kernels then add
// to).
__global__ void compare_kernel(ResyncArgs args, const int64_t* records, uint8_t* stale,
                               unsigned long long* kept, unsigned long long* sums,
                               unsigned long long* zeroed) {
  __shared__ unsigned long long warp_sums[kThreads / 32];
  const uint32_t chunks = args.first_block[args.count];
  for (uint32_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int k = tensor_of(args, c);
    const int64_t n = args.numels[k];
    const int64_t begin = (int64_t)(c - args.first_block[k]) * kCompareElems;
    const int64_t end = begin + kCompareElems < n ? begin + kCompareElems : n;
    const uint16_t* param = args.params[k];
    unsigned long long mine = 0;
    if (((uintptr_t)param & 7) == 0) {  // whole words (a chunk starts on one), then the tail
      const int64_t words = end / 4;
      const uint64_t* w = reinterpret_cast<const uint64_t*>(param);
      for (int64_t i = begin / 4 + threadIdx.x; i < words; i += blockDim.x) {
        mine += w[i] * pr_fp_weight(i);
      }
      for (int64_t j = 4 * words + threadIdx.x; j < end; j += blockDim.x) {
        mine += pr_fp_bytes(param[j], 2 * j);
      }
    } else {
      for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
        mine += pr_fp_bytes(param[j], 2 * j);
      }
    }
    if (begin == 0 && threadIdx.x == 0) mine += pr_fp_length(2 * n);
    const unsigned long long sum = block_sum(warp_sums, mine);
    if (threadIdx.x == 0) {
      if (sum != 0) atomicAdd(&sums[2 * k], sum);
      if (zeroed != nullptr && begin == 0) zeroed[k] = 0;
      __threadfence();  // (the sum lands before the count that may finish the tensor)
      const unsigned long long before = atomicAdd(&sums[2 * k + 1], 1ull);
      if (before == (unsigned long long)(args.first_block[k + 1] - args.first_block[k] - 1)) {
        __threadfence();
        decide_tensor(args, k, records, stale, kept, sums);
      }
    }
  }
}

#endif  // __CUDACC__

}  // namespace resync_cu
}  // namespace precis

#ifndef __CUDACC_RTC__
namespace precis {
namespace resync_cu {

// The count and write kernels' grid: at most kGrid blocks, each taking the chunks of
// kBlockElems elements c of a flagged tensor with (first_block[k] + c) % gridDim.x ==
// blockIdx.x, so that a step with nothing flagged costs each block a read of the flags
// (a block a chunk cost 30,000 blocks at 125M params, 60 us of the step), and a whole
// load still fills the GPU (1,024 blocks of 256 threads).
const unsigned kGrid = 1024;

// The entry points' launches, after their checks: records NULL (the flags given), or
// the flags set from kept (the fingerprints now), or with sums the compare's own
// fingerprints in its first launch (precis_cuda_resync_compared, zeroed as it says).
static precis_status_t resync(const char* fn, void* const* masters, precis_dtype_t master_dtype,
                              const void* const* params, precis_dtype_t param_dtype,
                              const int64_t* numels, const int64_t* records, uint8_t* stale,
                              int64_t* kept, int64_t count, cudaStream_t s,
                              uint64_t* sums = nullptr, uint64_t* zeroed = nullptr,
                              bool write = true) {
  unsigned long long* counts = reinterpret_cast<unsigned long long*>(kept);
  // Launches of up to kTensors tensors and fewer than 2^31 blocks (a tensor of at most
  // 2^42 elements has at most 2^30: pr_resync_check_args); the compare's chunks (each
  // tensor at least one: its length term and its flag) are fewer.
  for (int64_t first = 0; first < count;) {
    ResyncArgs args, chunked;
    uint64_t blocks = 0, chunks = 0;
    args.count = 0;
    args.first_block[0] = chunked.first_block[0] = 0;
    while (first + args.count < count && args.count < kTensors) {
      const int64_t n = numels[first + args.count];
      const uint64_t mine = (uint64_t)((n + kBlockElems - 1) / kBlockElems);
      if (args.count > 0 && blocks + mine >= (uint64_t)1 << 31) break;
      args.masters[args.count] = masters[first + args.count];
      args.params[args.count] = static_cast<const uint16_t*>(params[first + args.count]);
      args.numels[args.count] = n;
      blocks += mine;
      chunks += n > 0 ? (uint64_t)((n + kCompareElems - 1) / kCompareElems) : 1;
      chunked.first_block[args.count + 1] = (uint32_t)chunks;
      args.first_block[++args.count] = (uint32_t)blocks;
    }
    if (sums != nullptr) {
      std::memcpy(chunked.masters, args.masters, sizeof args.masters);
      std::memcpy(chunked.params, args.params, sizeof args.params);
      std::memcpy(chunked.numels, args.numels, sizeof args.numels);
      chunked.count = args.count;
      const int64_t* records_first = records + first;
      uint8_t* stale_first = stale + first;
      unsigned long long* counts_first = counts + first;
      unsigned long long* sums_first = reinterpret_cast<unsigned long long*>(sums + 2 * first);
      unsigned long long* zeroed_first =
          zeroed ? reinterpret_cast<unsigned long long*>(zeroed + first) : nullptr;
      PR_LAUNCH(compare_kernel, chunks < kGrid ? (unsigned)chunks : kGrid, kThreads, s, chunked,
                records_first, stale_first, counts_first, sums_first, zeroed_first);
    } else {
      const int64_t* records_first = records ? records + first : nullptr;
      uint8_t* stale_first = stale + first;
      unsigned long long* counts_first = counts + first;
      PR_LAUNCH(resync_init_kernel, 1, kThreads, s, args, records_first, stale_first,
                counts_first);
    }
    const unsigned grid = blocks < kGrid ? (unsigned)blocks : kGrid;
    const int mdt = (int)master_dtype, pdt = (int)param_dtype;
    const uint8_t* stale_first = stale + first;
    unsigned long long* counts_first = counts + first;
    if (blocks > 0 && pr_is_master(master_dtype)) {
      PR_LAUNCH(resync_count_kernel, grid, kThreads, s, args, mdt, pdt, stale_first,
                counts_first);
    }
    if (blocks > 0 && write) {
      PR_LAUNCH(resync_write_kernel, grid, kThreads, s, args, mdt, pdt, stale_first,
                counts_first);
    }
    first += args.count;
  }
  return check_launch(fn);
}

}  // namespace resync_cu
}  // namespace precis

extern "C" PRECIS_API precis_status_t precis_cuda_resync_masters(
    void* const* masters, precis_dtype_t master_dtype, const void* const* params,
    precis_dtype_t param_dtype, const int64_t* numels, const uint8_t* stale, int64_t* kept,
    int64_t count, void* stream) {
  static const char fn[] = "precis_cuda_resync_masters";
  pr_clear_error();
  precis_status_t st = pr_resync_check_args(fn, masters, master_dtype, params, param_dtype,
                                            numels, stale, kept, count);
  if (st != PRECIS_OK) return st;
  // (the flags only read: records NULL)
  return precis::resync_cu::resync(fn, masters, master_dtype, params, param_dtype, numels,
                                   nullptr, const_cast<uint8_t*>(stale), kept, count,
                                   static_cast<cudaStream_t>(stream));
}

extern "C" PRECIS_API precis_status_t precis_cuda_resync_changed(
    void* const* masters, precis_dtype_t master_dtype, const void* const* params,
    precis_dtype_t param_dtype, const int64_t* numels, const int64_t* records, uint8_t* stale,
    int64_t* kept, int64_t count, void* stream) {
  static const char fn[] = "precis_cuda_resync_changed";
  pr_clear_error();
  precis_status_t st = pr_resync_check_args(fn, masters, master_dtype, params, param_dtype,
                                            numels, stale, kept, count);
  if (st == PRECIS_OK) st = pr_resync_check_records(fn, records, count);
  if (st != PRECIS_OK) return st;
  return precis::resync_cu::resync(fn, masters, master_dtype, params, param_dtype, numels,
                                   records, stale, kept, count, static_cast<cudaStream_t>(stream));
}

namespace precis {
namespace resync_cu {

// precis_cuda_resync_compared (write) or precis_cuda_compare_params (!write).
precis_status_t compared(const char* fn, void* const* masters, precis_dtype_t master_dtype,
                         const void* const* params, precis_dtype_t param_dtype,
                         const int64_t* numels, const int64_t* records, uint8_t* stale,
                         int64_t* kept, uint64_t* sums, uint64_t* zeroed, int64_t count,
                         void* stream, bool write) {
  pr_clear_error();
  precis_status_t st = pr_resync_check_args(fn, masters, master_dtype, params, param_dtype,
                                            numels, stale, kept, count);
  if (st == PRECIS_OK) st = pr_resync_check_records(fn, records, count);
  if (st == PRECIS_OK) st = pr_resync_check_compared(fn, records, stale, kept, sums, zeroed, count);
  if (st != PRECIS_OK || count == 0) return st;
  return resync(fn, masters, master_dtype, params, param_dtype, numels, records, stale, kept,
                count, static_cast<cudaStream_t>(stream), sums, zeroed, write);
}

}  // namespace resync_cu
}  // namespace precis

extern "C" PRECIS_API precis_status_t precis_cuda_resync_compared(
    void* const* masters, precis_dtype_t master_dtype, const void* const* params,
    precis_dtype_t param_dtype, const int64_t* numels, const int64_t* records, uint8_t* stale,
    int64_t* kept, uint64_t* sums, uint64_t* zeroed, int64_t count, void* stream) {
  return precis::resync_cu::compared("precis_cuda_resync_compared", masters, master_dtype,
                                     params, param_dtype, numels, records, stale, kept, sums,
                                     zeroed, count, stream, true);
}

extern "C" PRECIS_API precis_status_t precis_cuda_compare_params(
    void* const* masters, precis_dtype_t master_dtype, const void* const* params,
    precis_dtype_t param_dtype, const int64_t* numels, const int64_t* records, uint8_t* stale,
    int64_t* kept, uint64_t* sums, uint64_t* zeroed, int64_t count, void* stream) {
  return precis::resync_cu::compared("precis_cuda_compare_params", masters, master_dtype,
                                     params, param_dtype, numels, records, stale, kept, sums,
                                     zeroed, count, stream, false);
}
#endif  // !__CUDACC_RTC__
