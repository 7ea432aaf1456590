// resync.cu - precis_cuda_resync_masters and precis_cuda_resync_changed, the CUDA twins of
// csrc/resync.c: the masters or remainders of the params a step's compare flagged (stale,
// on the device; or set here from the fingerprints), resynced by resync.h's rule without
// reading the flags back. Three launches for any number of tensors up to kTensors: the
// counts set, the kept elements counted, the masters rewritten, the last two over at most
// kGrid blocks that pass over the tensors not flagged.
#include "common.cuh"
// After common.cuh, which declares internal.h's helpers with C linkage.
#include "resync.h"

namespace precis {
namespace {

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

// The count and write kernels' grid: at most kGrid blocks, each taking the chunks of
// kBlockElems elements c of a flagged tensor with (first_block[k] + c) % gridDim.x ==
// blockIdx.x, so that a step with nothing flagged costs each block a read of the flags
// (a block a chunk cost 30,000 blocks at 125M params, 60 us of the step), and a whole
// load still fills the GPU (1,024 blocks of 256 threads).
const unsigned kGrid = 1024;

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

// A flagged tensor's chunk [begin, end) rewritten: a master where it no longer rounds
// to the param (whole for a whole load), remainders zeroed.
__device__ void write_chunk(const ResyncArgs& args, int k, int64_t begin, int64_t end,
                            int master_dtype, int param_dtype, bool whole) {
  if (master_dtype == PRECIS_DTYPE_INT16) {
    uint16_t* rem = static_cast<uint16_t*>(args.masters[k]);
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) rem[j] = 0;
    return;
  }
  if (master_dtype == PRECIS_DTYPE_FP8_E4M3) {
    uint8_t* rem = static_cast<uint8_t*>(args.masters[k]);
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) rem[j] = 0;
    return;
  }
  void* master = args.masters[k];
  const uint16_t* param = args.params[k];
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    if (whole || !pr_rounds_to(pr_master_value(master, j, master_dtype), param[j], param_dtype)) {
      pr_master_set(master, j, master_dtype, pr_param_value(param[j], param_dtype));
    }
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

// Both entry points' launches, after their checks: records NULL (the flags given) or
// not (the flags set from kept, the fingerprints now).
static precis_status_t resync(const char* fn, void* const* masters, precis_dtype_t master_dtype,
                              const void* const* params, precis_dtype_t param_dtype,
                              const int64_t* numels, const int64_t* records, uint8_t* stale,
                              int64_t* kept, int64_t count, cudaStream_t s) {
  unsigned long long* counts = reinterpret_cast<unsigned long long*>(kept);
  // Launches of up to kTensors tensors and fewer than 2^31 blocks (a tensor of at most
  // 2^42 elements has at most 2^30: pr_resync_check_args).
  for (int64_t first = 0; first < count;) {
    ResyncArgs args;
    uint64_t blocks = 0;
    args.count = 0;
    args.first_block[0] = 0;
    while (first + args.count < count && args.count < kTensors) {
      const int64_t n = numels[first + args.count];
      const uint64_t mine = (uint64_t)((n + kBlockElems - 1) / kBlockElems);
      if (args.count > 0 && blocks + mine >= (uint64_t)1 << 31) break;
      args.masters[args.count] = masters[first + args.count];
      args.params[args.count] = static_cast<const uint16_t*>(params[first + args.count]);
      args.numels[args.count] = n;
      blocks += mine;
      args.first_block[++args.count] = (uint32_t)blocks;
    }
    resync_init_kernel<<<1, kThreads, 0, s>>>(args, records ? records + first : nullptr,
                                              stale + first, counts + first);
    const unsigned grid = blocks < kGrid ? (unsigned)blocks : kGrid;
    if (blocks > 0 && pr_is_master(master_dtype)) {
      resync_count_kernel<<<grid, kThreads, 0, s>>>(args, (int)master_dtype, (int)param_dtype,
                                                    stale + first, counts + first);
    }
    if (blocks > 0) {
      resync_write_kernel<<<grid, kThreads, 0, s>>>(args, (int)master_dtype, (int)param_dtype,
                                                    stale + first, counts + first);
    }
    first += args.count;
  }
  return check_launch(fn);
}

}  // namespace
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
  return precis::resync(fn, masters, master_dtype, params, param_dtype, numels, nullptr,
                        const_cast<uint8_t*>(stale), kept, count,
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
  return precis::resync(fn, masters, master_dtype, params, param_dtype, numels, records, stale,
                        kept, count, static_cast<cudaStream_t>(stream));
}
