// accumulate.cu - dst += src with dtype conversion on the GPU, the CUDA twin of
// csrc/accumulate.c: the sum is formed in fp32 and rounded to nearest even.
#include "common.cuh"

namespace precis {
namespace {

template <int DST, int SRC>
__global__ void accumulate_kernel(typename Elem<DST>::T* __restrict__ dst,
                                  const typename Elem<SRC>::T* __restrict__ src,
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
  pr_clear_error();
  if (!is_float_dtype(dst_dtype) || !is_float_dtype(src_dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE,
                   "precis_cuda_accumulate: dst dtype %s and src dtype %s; each must be "
                   "fp32, fp16 or bf16",
                   pr_dtype_label(dst_dtype), pr_dtype_label(src_dtype));
  }
  if (numel < 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "precis_cuda_accumulate: numel is %lld (< 0)",
                   (long long)numel);
  }
  if (numel == 0) return PRECIS_OK;
  if (dst == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_cuda_accumulate: dst is NULL");
  if (src == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_cuda_accumulate: src is NULL");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dst_dtype) {
    case PRECIS_DTYPE_FP32: launch_for_src<PRECIS_DTYPE_FP32>(src_dtype, dst, src, numel, s); break;
    case PRECIS_DTYPE_FP16: launch_for_src<PRECIS_DTYPE_FP16>(src_dtype, dst, src, numel, s); break;
    default: launch_for_src<PRECIS_DTYPE_BF16>(src_dtype, dst, src, numel, s); break;
  }
  return check_launch("precis_cuda_accumulate");
}
