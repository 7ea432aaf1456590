// accumulate.cu - dst += src with dtype conversion on the GPU, the CUDA twin of
// csrc/accumulate.c: the sum is formed in fp32 and rounded to nearest even.
#include "common.cuh"

namespace precis {
namespace {

// No __restrict__: dst == src (doubling a buffer) is a valid call, as on the CPU.
template <int DST, int SRC>
__global__ void accumulate_kernel(typename Elem<DST>::T* dst, const typename Elem<SRC>::T* src,
                                  int64_t numel) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    dst[i] = Elem<DST>::store(Elem<DST>::load(dst[i]) + Elem<SRC>::load(src[i]));
  }
}

template <int DST, int SRC>
void launch(void* dst, const void* src, int64_t numel, cudaStream_t stream) {
  const int threads = 256;
  accumulate_kernel<DST, SRC><<<grid_for(numel, threads), threads, 0, stream>>>(
      static_cast<typename Elem<DST>::T*>(dst),
      static_cast<const typename Elem<SRC>::T*>(src), numel);
}

template <int DST>
void launch_for_src(int src_dtype, void* dst, const void* src, int64_t numel,
                    cudaStream_t stream) {
  switch (src_dtype) {
    case PRECIS_DTYPE_FP32: launch<DST, PRECIS_DTYPE_FP32>(dst, src, numel, stream); break;
    case PRECIS_DTYPE_FP16: launch<DST, PRECIS_DTYPE_FP16>(dst, src, numel, stream); break;
    default: launch<DST, PRECIS_DTYPE_BF16>(dst, src, numel, stream); break;
  }
}

}  // namespace
}  // namespace precis

extern "C" PRECIS_API precis_status_t precis_cuda_accumulate(void* dst, precis_dtype_t dst_dtype,
                                                             const void* src,
                                                             precis_dtype_t src_dtype,
                                                             int64_t numel, void* stream) {
  using namespace precis;
  static const char fn[] = "precis_cuda_accumulate";
  precis_status_t st;
  pr_clear_error();
  if ((st = check_numel(fn, numel)) != PRECIS_OK) return st;
  if ((st = check_dtype(fn, "dst_dtype", dst_dtype)) != PRECIS_OK) return st;
  if ((st = check_dtype(fn, "src_dtype", src_dtype)) != PRECIS_OK) return st;
  if (numel == 0) return PRECIS_OK;
  if (dst == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dst is NULL", fn);
  if (src == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: src is NULL", fn);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dst_dtype) {
    case PRECIS_DTYPE_FP32: launch_for_src<PRECIS_DTYPE_FP32>(src_dtype, dst, src, numel, s); break;
    case PRECIS_DTYPE_FP16: launch_for_src<PRECIS_DTYPE_FP16>(src_dtype, dst, src, numel, s); break;
    default: launch_for_src<PRECIS_DTYPE_BF16>(src_dtype, dst, src, numel, s); break;
  }
  return check_launch(fn);
}
