// bucket_ops.cu - accumulate, cast, scale and NaN/Inf count on the GPU, the CUDA
// twins of csrc/accumulate.c and csrc/bucket_ops.c: the same conversions, the
// same rounding, the same argument checks in the same order and words.
#include "common.cuh"

namespace precis {
namespace {

const int kThreads = 256;

// ---- argument checks (csrc/elementwise.h's pr_ew_check_*) ---------------------

precis_status_t check_numel(const char* fn, int64_t numel) {
  if (numel >= 0) return PRECIS_OK;
  return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: numel is %lld, must be >= 0", fn,
                 (long long)numel);
}

// fp32, fp16 and bf16 are accepted.
precis_status_t check_dtype(const char* fn, const char* arg, int dtype) {
  if (dtype == PRECIS_DTYPE_FP32 || dtype == PRECIS_DTYPE_FP16 || dtype == PRECIS_DTYPE_BF16) {
    return PRECIS_OK;
  }
  return pr_fail(PRECIS_ERR_INVALID_DTYPE, "%s: %s %s is not supported; accepted: fp32, fp16, bf16",
                 fn, arg, pr_dtype_label(dtype));
}

// accumulate and cast: numel, dst_dtype, src_dtype, then (numel > 0) the pointers.
precis_status_t check_pair(const char* fn, const void* dst, int dst_dtype, const void* src,
                           int src_dtype, int64_t numel) {
  precis_status_t st;
  if ((st = check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = check_dtype(fn, "dst_dtype", dst_dtype)) != PRECIS_OK) return st;
  if ((st = check_dtype(fn, "src_dtype", src_dtype)) != PRECIS_OK) return st;
  if (numel == 0) return PRECIS_OK;
  if (dst == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dst is NULL", fn);
  if (src == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: src is NULL", fn);
  return PRECIS_OK;
}

int64_t elem_size(int dtype) { return dtype == PRECIS_DTYPE_FP32 ? 4 : 2; }

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

enum PairOp { kAccumulate, kCast };

template <PairOp OP, int DST, int SRC>
void launch_pair(void* dst, const void* src, int64_t numel, cudaStream_t stream) {
  typename Elem<DST>::T* d = static_cast<typename Elem<DST>::T*>(dst);
  const typename Elem<SRC>::T* s = static_cast<const typename Elem<SRC>::T*>(src);
  if constexpr (OP == kAccumulate) {
    accumulate_kernel<DST, SRC><<<grid_for(numel, kThreads), kThreads, 0, stream>>>(d, s, numel);
  } else if constexpr (DST != SRC) {  // a cast to the same dtype is a copy, no kernel
    cast_kernel<DST, SRC><<<grid_for(numel, kThreads), kThreads, 0, stream>>>(d, s, numel);
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
__global__ void scale_kernel(typename Elem<D>::T* __restrict__ buf, float factor, int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    buf[i] = Elem<D>::store(Elem<D>::load(buf[i]) * factor);
  }
}

template <int D>
void launch_scale(void* buf, float factor, int64_t numel, cudaStream_t stream) {
  scale_kernel<D><<<grid_for(numel, kThreads), kThreads, 0, stream>>>(
      static_cast<typename Elem<D>::T*>(buf), factor, numel);
}

// ---- count_nonfinite ---------------------------------------------------------

// Exponent bits all ones <=> NaN or Inf, as on the CPU.
template <typename T>
__device__ __forceinline__ unsigned nonfinite(T bits, T exp_mask) {
  return (bits & exp_mask) == exp_mask ? 1u : 0u;
}

// Each block counts its elements, reduces in shared memory, and adds its total to
// *out with one atomic: no host synchronization.
template <typename T>
__global__ void count_kernel(const T* __restrict__ buf, T exp_mask, int64_t numel,
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

template <typename T>
void launch_count(const void* buf, T exp_mask, int64_t numel, int64_t* out, cudaStream_t stream) {
  // int64_t and unsigned long long have the same size; the count never gets near 2^63.
  count_kernel<T><<<grid_for(numel, kThreads), kThreads, 0, stream>>>(
      static_cast<const T*>(buf), exp_mask, numel, reinterpret_cast<unsigned long long*>(out));
}

}  // namespace
}  // namespace precis

extern "C" PRECIS_API precis_status_t precis_cuda_accumulate(void* dst, precis_dtype_t dst_dtype,
                                                             const void* src,
                                                             precis_dtype_t src_dtype,
                                                             int64_t numel, void* stream) {
  using namespace precis;
  static const char fn[] = "precis_cuda_accumulate";
  pr_clear_error();
  precis_status_t st = check_pair(fn, dst, dst_dtype, src, src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  return run_pair<kAccumulate>(fn, dst, dst_dtype, src, src_dtype, numel,
                               static_cast<cudaStream_t>(stream));
}

extern "C" PRECIS_API precis_status_t precis_cuda_cast(void* dst, precis_dtype_t dst_dtype,
                                                       const void* src, precis_dtype_t src_dtype,
                                                       int64_t numel, void* stream) {
  using namespace precis;
  static const char fn[] = "precis_cuda_cast";
  pr_clear_error();
  precis_status_t st = check_pair(fn, dst, dst_dtype, src, src_dtype, numel);
  if (st != PRECIS_OK || numel == 0) return st;
  if (dst == src && dst_dtype == src_dtype) return PRECIS_OK;
  // Threads run in any order, so any other overlap would read converted values.
  uintptr_t d0 = (uintptr_t)dst, d1 = d0 + (uintptr_t)(numel * elem_size(dst_dtype));
  uintptr_t s0 = (uintptr_t)src, s1 = s0 + (uintptr_t)(numel * elem_size(src_dtype));
  if (d0 < s1 && s0 < d1) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: dst and src overlap (only the same buffer "
                   "with the same dtype may be passed as both)", fn);
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dst_dtype == src_dtype) {
    cudaError_t err = cudaMemcpyAsync(dst, src, (size_t)(numel * elem_size(dst_dtype)),
                                      cudaMemcpyDeviceToDevice, s);
    if (err != cudaSuccess) {
      return pr_fail(PRECIS_ERR_CUDA, "%s: cudaMemcpyAsync failed: %s", fn,
                     cudaGetErrorString(err));
    }
    return PRECIS_OK;
  }
  return run_pair<kCast>(fn, dst, dst_dtype, src, src_dtype, numel, s);
}

extern "C" PRECIS_API precis_status_t precis_cuda_scale(void* buf, precis_dtype_t dtype,
                                                        float factor, int64_t numel,
                                                        void* stream) {
  using namespace precis;
  static const char fn[] = "precis_cuda_scale";
  precis_status_t st;
  pr_clear_error();
  if ((st = check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = check_dtype(fn, "dtype", dtype)) != PRECIS_OK) return st;
  if (!isfinite(factor)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: factor is %g, must be finite", fn,
                   (double)factor);
  }
  if (numel == 0) return PRECIS_OK;
  if (buf == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: buf is NULL", fn);
  if (factor == 1.0f) return PRECIS_OK;
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
  static const char fn[] = "precis_cuda_count_nonfinite";
  precis_status_t st;
  pr_clear_error();
  if (out_count == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: out_count is NULL", fn);
  if ((st = check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = check_dtype(fn, "dtype", dtype)) != PRECIS_OK) return st;
  if (numel == 0) return PRECIS_OK;  // adds nothing
  if (buf == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: buf is NULL", fn);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case PRECIS_DTYPE_FP32: launch_count<uint32_t>(buf, 0x7F800000u, numel, out_count, s); break;
    case PRECIS_DTYPE_FP16: launch_count<uint16_t>(buf, 0x7C00u, numel, out_count, s); break;
    default: launch_count<uint16_t>(buf, 0x7F80u, numel, out_count, s); break;
  }
  return check_launch(fn);
}
