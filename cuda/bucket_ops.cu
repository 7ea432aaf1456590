// bucket_ops.cu - accumulate, cast, scale and NaN/Inf count on the GPU, the CUDA
// twins of csrc/accumulate.c and csrc/bucket_ops.c: the same conversions, the
// same rounding, the same argument checks (csrc/bucket_args.h, shared with them).
#include "common.cuh"
// After common.cuh, which declares internal.h's helpers with C linkage.
#include "bucket_args.h"
#include "fingerprint.h"

// A named namespace, not an anonymous one: NVRTC names an anonymous namespace after its
// process, and a kernel's symbol must be the same in every image (tools/build_cuda12.py).
namespace precis {
namespace bucket_ops_cu {

const int kThreads = 256;

// The unsigned word of an element of BYTES bytes (count_kernel reads its bits).
template <int BYTES> struct Bits;
template <> struct Bits<4> { typedef uint32_t T; };
template <> struct Bits<2> { typedef uint16_t T; };

// The fingerprint's launches:
constexpr int kFpTensors = 512;  // tensors per launch (FpArgs < 16 KiB: CUDA 12.1 takes
                                 // 32,764 bytes of parameters): a model's params, one launch
constexpr int64_t kFpBlockWords = (int64_t)kThreads * 16;  // words one block sums (32 KiB)

// One launch's tensors, by value (as the Adam kernels take theirs): tensor k has blocks
// [first_block[k], first_block[k + 1]), at least one (its tail and length terms). Its
// values go to out[first_out[k] ...]: one (precis_cuda_fingerprint: block_words 0), or
// one per block of block_words words (precis_cuda_fingerprint_blocks), each summed by
// units_per CUDA blocks of at most kFpBlockWords words.
struct FpArgs {
  const unsigned char* bufs[kFpTensors];
  int64_t nbytes[kFpTensors];
  uint32_t first_block[kFpTensors + 1];
  uint32_t first_out[kFpTensors];
  int64_t block_words;
  int64_t units_per;
  int count;
};
static_assert(sizeof(FpArgs) <= 16384, "FpArgs must fit in 16 KiB of kernel parameters");

#ifdef __CUDACC__
// ---- accumulate and cast ---------------------------------------------------------

// dst += src, the sum formed in fp32 and rounded once. No __restrict__: dst == src
// (doubling a buffer) is a valid call, as on the CPU.
template <int DST, int SRC>
__global__ void accumulate_kernel(typename Elem<DST>::T* dst, const typename Elem<SRC>::T* src,
                                  int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    dst[i] = Elem<DST>::store(Elem<DST>::load(dst[i]) + Elem<SRC>::load(src[i]));
  }
}

// dst = src converted (precis_cuda_cast rejects overlapping buffers).
template <int DST, int SRC>
__global__ void cast_kernel(typename Elem<DST>::T* __restrict__ dst,
                            const typename Elem<SRC>::T* __restrict__ src, int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    dst[i] = Elem<DST>::store(Elem<SRC>::load(src[i]));
  }
}

// ---- scale -----------------------------------------------------------------

template <int D>
__global__ void scale_kernel(typename Elem<D>::T* __restrict__ buf, float factor, int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    buf[i] = Elem<D>::store(Elem<D>::load(buf[i]) * factor);
  }
}

// ---- count_nonfinite ---------------------------------------------------------

// Exponent bits all ones <=> NaN or Inf, as on the CPU.
template <typename T>
__device__ __forceinline__ unsigned nonfinite(T bits, T exp_mask) {
  return (bits & exp_mask) == exp_mask ? 1u : 0u;
}

// Each block counts its elements, reduces in shared memory, and adds its total to
// *out with one atomic: no host synchronization.
template <int BYTES>
__global__ void count_kernel(const typename Bits<BYTES>::T* __restrict__ buf,
                             typename Bits<BYTES>::T exp_mask, int64_t numel,
                             unsigned long long* out) {
  __shared__ unsigned long long partial[kThreads];
  unsigned long long count = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    count += nonfinite(buf[i], exp_mask);
  }
  partial[threadIdx.x] = count;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0 && partial[0] != 0) atomicAdd(out, partial[0]);
}

// ---- fingerprint ---------------------------------------------------------------

__global__ void fingerprint_zero_kernel(unsigned long long* out, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) out[i] = 0;
}

// fingerprint.h's terms of kFpBlockWords words per block, reduced in shared memory and
// added to the tensor's out entry, or its block's, with one atomic (a sum mod 2^64: any
// order gives it); a tensor's first CUDA block adds its tail's term (to its last block's
// entry) and, for the whole tensor's value, its length's.
__global__ void fingerprint_kernel(FpArgs args, unsigned long long* out) {
  __shared__ unsigned long long partial[kThreads];
  int k = 0, hi = args.count - 1;  // the block's tensor: a binary search over first_block
  while (k < hi) {
    const int mid = (k + hi + 1) / 2;
    if (args.first_block[mid] <= blockIdx.x) k = mid; else hi = mid - 1;
  }
  const unsigned char* buf = args.bufs[k];
  const int64_t words = args.nbytes[k] / 8;
  const int64_t unit = (int64_t)(blockIdx.x - args.first_block[k]);
  int64_t begin = unit * kFpBlockWords, limit = words, at = 0;
  if (args.block_words > 0) {  // unit (at, c): words [c kFpBlockWords, ...) of block at
    at = unit / args.units_per;
    begin = at * args.block_words + (unit % args.units_per) * kFpBlockWords;
    limit = (at + 1) * args.block_words < words ? (at + 1) * args.block_words : words;
  }
  const int64_t end = begin + kFpBlockWords < limit ? begin + kFpBlockWords : limit;
  const bool aligned = ((uintptr_t)buf & 7) == 0;
  unsigned long long total = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    total += pr_fp_word(buf, i, aligned) * pr_fp_weight(i);
  }
  if (unit == 0 && threadIdx.x == 0) {
    if (args.block_words == 0) {
      total += pr_fp_tail(buf, args.nbytes[k]);
    } else if (args.nbytes[k] % 8 != 0) {  // (the last block's: another entry)
      const int64_t last = pr_fp_block_count(args.nbytes[k], 8 * args.block_words) - 1;
      atomicAdd(&out[args.first_out[k] + last],
                (unsigned long long)pr_fp_tail_word(buf, args.nbytes[k]));
    }
  }
  partial[threadIdx.x] = total;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0 && partial[0] != 0) atomicAdd(&out[args.first_out[k] + at], partial[0]);
}

// Every kernel the host launches, instantiated here: NVRTC reads no host code that would.
#define PR_INSTANTIATE_PAIR(D, S)                                        \
  template __global__ void accumulate_kernel<D, S>(typename Elem<D>::T*, \
                                                   const typename Elem<S>::T*, int64_t);
#define PR_INSTANTIATE_DST(D)                                     \
  PR_INSTANTIATE_PAIR(D, PRECIS_DTYPE_FP32)                       \
  PR_INSTANTIATE_PAIR(D, PRECIS_DTYPE_FP16)                       \
  PR_INSTANTIATE_PAIR(D, PRECIS_DTYPE_BF16)                       \
  template __global__ void scale_kernel<D>(typename Elem<D>::T*, float, int64_t);
PR_INSTANTIATE_DST(PRECIS_DTYPE_FP32)
PR_INSTANTIATE_DST(PRECIS_DTYPE_FP16)
PR_INSTANTIATE_DST(PRECIS_DTYPE_BF16)
#undef PR_INSTANTIATE_DST
#undef PR_INSTANTIATE_PAIR
#define PR_INSTANTIATE_CAST(D, S)                                                            \
  template __global__ void cast_kernel<D, S>(typename Elem<D>::T*, const typename Elem<S>::T*, \
                                             int64_t);
PR_INSTANTIATE_CAST(PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16)
PR_INSTANTIATE_CAST(PRECIS_DTYPE_FP32, PRECIS_DTYPE_BF16)
PR_INSTANTIATE_CAST(PRECIS_DTYPE_FP16, PRECIS_DTYPE_FP32)
PR_INSTANTIATE_CAST(PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16)
PR_INSTANTIATE_CAST(PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP32)
PR_INSTANTIATE_CAST(PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP16)
#undef PR_INSTANTIATE_CAST
template __global__ void count_kernel<4>(const uint32_t*, uint32_t, int64_t, unsigned long long*);
template __global__ void count_kernel<2>(const uint16_t*, uint16_t, int64_t, unsigned long long*);
#endif  // __CUDACC__

}  // namespace bucket_ops_cu
}  // namespace precis

#ifndef __CUDACC_RTC__
namespace precis {
namespace bucket_ops_cu {

// ---- the launches --------------------------------------------------------------

enum PairOp { kAccumulate, kCast };

template <PairOp OP, int DST, int SRC>
void launch_pair(void* dst, const void* src, int64_t numel, cudaStream_t stream) {
  typename Elem<DST>::T* d = static_cast<typename Elem<DST>::T*>(dst);
  const typename Elem<SRC>::T* s = static_cast<const typename Elem<SRC>::T*>(src);
  if constexpr (OP == kAccumulate) {
    PR_LAUNCH_T(accumulate_kernel, (DST, SRC), grid_for(numel, kThreads), kThreads, stream, d, s,
                numel);
  } else if constexpr (DST != SRC) {  // a cast to the same dtype is a copy, no kernel
    PR_LAUNCH_T(cast_kernel, (DST, SRC), grid_for(numel, kThreads), kThreads, stream, d, s,
                numel);
  }
}

template <PairOp OP, int DST>
void launch_pair_for_src(int src_dtype, void* dst, const void* src, int64_t numel,
                         cudaStream_t stream) {
  switch (src_dtype) {
    case PRECIS_DTYPE_FP32: launch_pair<OP, DST, PRECIS_DTYPE_FP32>(dst, src, numel, stream); break;
    case PRECIS_DTYPE_FP16: launch_pair<OP, DST, PRECIS_DTYPE_FP16>(dst, src, numel, stream); break;
    default: launch_pair<OP, DST, PRECIS_DTYPE_BF16>(dst, src, numel, stream); break;
  }
}

// The kernel of OP for the (checked) dtypes; the launch status.
template <PairOp OP>
precis_status_t run_pair(const char* fn, void* dst, int dst_dtype, const void* src, int src_dtype,
                         int64_t numel, cudaStream_t stream) {
  switch (dst_dtype) {
    case PRECIS_DTYPE_FP32:
      launch_pair_for_src<OP, PRECIS_DTYPE_FP32>(src_dtype, dst, src, numel, stream);
      break;
    case PRECIS_DTYPE_FP16:
      launch_pair_for_src<OP, PRECIS_DTYPE_FP16>(src_dtype, dst, src, numel, stream);
      break;
    default:
      launch_pair_for_src<OP, PRECIS_DTYPE_BF16>(src_dtype, dst, src, numel, stream);
      break;
  }
  return check_launch(fn);
}

// ---- scale -----------------------------------------------------------------

template <int D>
void launch_scale(void* buf, float factor, int64_t numel, cudaStream_t stream) {
  typename Elem<D>::T* b = static_cast<typename Elem<D>::T*>(buf);
  PR_LAUNCH_T(scale_kernel, (D), grid_for(numel, kThreads), kThreads, stream, b, factor, numel);
}

// ---- count_nonfinite ---------------------------------------------------------

template <int BYTES>
void launch_count(const void* buf, typename Bits<BYTES>::T exp_mask, int64_t numel, int64_t* out,
                  cudaStream_t stream) {
  const typename Bits<BYTES>::T* b = static_cast<const typename Bits<BYTES>::T*>(buf);
  // int64_t and unsigned long long have the same size; the count never gets near 2^63.
  unsigned long long* o = reinterpret_cast<unsigned long long*>(out);
  PR_LAUNCH_T(count_kernel, (BYTES), grid_for(numel, kThreads), kThreads, stream, b, exp_mask,
              numel, o);
}


// The fingerprints of count ranges (block 0: one value a range, with its length's term;
// else one a block of `block` bytes): out zeroed, then launches of up to kFpTensors
// ranges and fewer than 2^31 CUDA blocks.
precis_status_t launch_fingerprints(const char* fn, const void* const* bufs,
                                    const int64_t* nbytes, int64_t count, int64_t block,
                                    uint64_t* out, cudaStream_t s) {
  // CUDA blocks a block: its words', but no more than the longest range's (a block past
  // every range's length adds no work).
  const int64_t block_words = block / 8;
  int64_t longest = 0;
  for (int64_t i = 0; i < count; ++i) longest = nbytes[i] / 8 > longest ? nbytes[i] / 8 : longest;
  const int64_t span = block_words < longest ? block_words : longest;
  const int64_t units_per = span > kFpBlockWords ? (span + kFpBlockWords - 1) / kFpBlockWords : 1;
  int64_t entries = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t words = nbytes[i] / 8;
    const int64_t units = block_words > 0 ? pr_fp_block_count(nbytes[i], block) * units_per
                                          : words > 0 ? (words + kFpBlockWords - 1) / kFpBlockWords
                                                      : 1;
    if (units >= (int64_t)1 << 31) {
      return pr_fail(PRECIS_ERR_UNSUPPORTED, "%s: nbytes[%lld] is %lld: blocks of %lld bytes "
                     "make more than 2^31 CUDA blocks of it", fn, (long long)i,
                     (long long)nbytes[i], (long long)block);
    }
    entries += block_words > 0 ? pr_fp_block_count(nbytes[i], block) : 1;
  }
  if (entries >= (int64_t)1 << 31) {
    return pr_fail(PRECIS_ERR_UNSUPPORTED, "%s: %lld values, at most 2^31 - 1", fn,
                   (long long)entries);
  }
  unsigned long long* sums = reinterpret_cast<unsigned long long*>(out);
  PR_LAUNCH(fingerprint_zero_kernel, 1, kThreads, s, sums, (int)entries);
  int64_t at = 0;  // the launch's first value
  for (int64_t first = 0; first < count;) {
    FpArgs args;
    uint64_t blocks = 0;
    uint32_t values = 0;
    args.count = 0;
    args.first_block[0] = 0;
    args.block_words = block_words;
    args.units_per = units_per;
    while (first + args.count < count && args.count < kFpTensors) {
      const int64_t n = nbytes[first + args.count], words = n / 8;
      const uint64_t mine = block_words > 0 ? (uint64_t)(pr_fp_block_count(n, block) * units_per)
                            : words > 0 ? (uint64_t)((words + kFpBlockWords - 1) / kFpBlockWords)
                                        : 1;
      if (args.count > 0 && blocks + mine >= (uint64_t)1 << 31) break;
      args.bufs[args.count] = static_cast<const unsigned char*>(bufs[first + args.count]);
      args.nbytes[args.count] = n;
      args.first_out[args.count] = values;
      values += block_words > 0 ? (uint32_t)pr_fp_block_count(n, block) : 1;
      blocks += mine;
      args.first_block[++args.count] = (uint32_t)blocks;
    }
    PR_LAUNCH(fingerprint_kernel, (unsigned)blocks, kThreads, s, args, sums + at);
    first += args.count;
    at += values;
  }
  return check_launch(fn);
}

}  // namespace bucket_ops_cu
}  // namespace precis

extern "C" PRECIS_API precis_status_t precis_cuda_accumulate(void* dst, precis_dtype_t dst_dtype,
                                                             const void* src,
                                                             precis_dtype_t src_dtype,
                                                             int64_t numel, void* stream) {
  using namespace precis;
  using namespace precis::bucket_ops_cu;
  static const char fn[] = "precis_cuda_accumulate";
  pr_clear_error();
  precis_status_t st = pr_bucket_check_disjoint_pair(fn, dst, dst_dtype, src, src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  return run_pair<kAccumulate>(fn, dst, dst_dtype, src, src_dtype, numel,
                               static_cast<cudaStream_t>(stream));
}

extern "C" PRECIS_API precis_status_t precis_cuda_cast(void* dst, precis_dtype_t dst_dtype,
                                                       const void* src, precis_dtype_t src_dtype,
                                                       int64_t numel, void* stream) {
  using namespace precis;
  using namespace precis::bucket_ops_cu;
  static const char fn[] = "precis_cuda_cast";
  pr_clear_error();
  precis_status_t st = pr_bucket_check_disjoint_pair(fn, dst, dst_dtype, src, src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  if (dst == src && dst_dtype == src_dtype) return PRECIS_OK;  // a cast onto itself
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dst_dtype == src_dtype) {
    return memcpy_async(fn, dst, src, (size_t)(numel * precis_elem_size(dst_dtype)), s);
  }
  return run_pair<kCast>(fn, dst, dst_dtype, src, src_dtype, numel, s);
}

extern "C" PRECIS_API precis_status_t precis_cuda_scale(void* buf, precis_dtype_t dtype,
                                                        float factor, int64_t numel,
                                                        void* stream) {
  using namespace precis;
  using namespace precis::bucket_ops_cu;
  static const char fn[] = "precis_cuda_scale";
  pr_clear_error();
  precis_status_t st = pr_bucket_check_scale(fn, buf, dtype, factor, numel);
  if (st != PRECIS_OK || numel == 0 || factor == 1.0f) return st;  // factor 1: exact no-op
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case PRECIS_DTYPE_FP32: launch_scale<PRECIS_DTYPE_FP32>(buf, factor, numel, s); break;
    case PRECIS_DTYPE_FP16: launch_scale<PRECIS_DTYPE_FP16>(buf, factor, numel, s); break;
    default: launch_scale<PRECIS_DTYPE_BF16>(buf, factor, numel, s); break;
  }
  return check_launch(fn);
}

extern "C" PRECIS_API precis_status_t precis_cuda_count_nonfinite(const void* buf,
                                                                  precis_dtype_t dtype,
                                                                  int64_t numel,
                                                                  int64_t* out_count,
                                                                  void* stream) {
  using namespace precis;
  using namespace precis::bucket_ops_cu;
  static const char fn[] = "precis_cuda_count_nonfinite";
  pr_clear_error();
  precis_status_t st = pr_bucket_check_count_nonfinite(fn, buf, dtype, numel, out_count);
  if (st != PRECIS_OK || numel == 0) return st;  // numel 0 adds nothing
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case PRECIS_DTYPE_FP32: launch_count<4>(buf, 0x7F800000u, numel, out_count, s); break;
    case PRECIS_DTYPE_FP16: launch_count<2>(buf, 0x7C00u, numel, out_count, s); break;
    default: launch_count<2>(buf, 0x7F80u, numel, out_count, s); break;
  }
  return check_launch(fn);
}

extern "C" PRECIS_API precis_status_t precis_cuda_fingerprint(const void* const* bufs,
                                                              const int64_t* nbytes,
                                                              int64_t count, uint64_t* out,
                                                              void* stream) {
  using namespace precis;
  using namespace precis::bucket_ops_cu;
  static const char fn[] = "precis_cuda_fingerprint";
  pr_clear_error();
  precis_status_t st = pr_fp_check_args(fn, bufs, nbytes, count, out);
  if (st != PRECIS_OK || count == 0) return st;
  return launch_fingerprints(fn, bufs, nbytes, count, 0, out, static_cast<cudaStream_t>(stream));
}

extern "C" PRECIS_API precis_status_t precis_cuda_fingerprint_blocks(const void* const* bufs,
                                                                     const int64_t* nbytes,
                                                                     int64_t count, int64_t block,
                                                                     uint64_t* out,
                                                                     void* stream) {
  using namespace precis;
  using namespace precis::bucket_ops_cu;
  static const char fn[] = "precis_cuda_fingerprint_blocks";
  pr_clear_error();
  precis_status_t st = pr_fp_check_blocks(fn, bufs, nbytes, count, block, out);
  if (st != PRECIS_OK || count == 0) return st;
  if (((uintptr_t)out & 7) != 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: out (%p) is not 8-byte aligned", fn,
                   (void*)out);
  }
  return launch_fingerprints(fn, bufs, nbytes, count, block, out,
                             static_cast<cudaStream_t>(stream));
}
#endif  // !__CUDACC_RTC__
