// driver_launch.h - PR_LAUNCH and PR_LAUNCH_T of libprecis_cuda12.so's host code (the .cu
// files read by g++ with PRECIS_CUDA_DRIVER, common.cuh): a launch by the kernel's name,
// through the driver API (driver.h). The name of a template kernel is its name and
// template arguments as numbers, "adam_kernel<2,2,1,0,2,2>", the form
// tools/build_cuda12.py gives the kernels it finds in the PTX; each launch site looks its
// kernel up once.
#ifndef PRECIS_CUDA_DRIVER_LAUNCH_H_
#define PRECIS_CUDA_DRIVER_LAUNCH_H_

#include <stddef.h>
#include <stdint.h>

#include <string>

#include "driver.h"

typedef struct CUstream_st* cudaStream_t;  // the driver's CUstream, torch's stream handle

// The few device annotations of code that both sides read (Elem's conversions in
// common.cuh: host functions here, never called).
#define __host__
#define __device__
#define __forceinline__ inline

namespace precis {

// "name<a,b,...>" of a template kernel's arguments A.
template <int... A>
std::string kernel_name(const char* name) {
  std::string s = name;
  const char* sep = "<";
  for (int a : {A...}) {
    s += sep;
    s += std::to_string(a);
    sep = ",";
  }
  return s + ">";
}

// One launch: a pointer to each argument, which must have the kernel's parameter type.
template <typename... Args>
void driver_launch(int k, const char* name, unsigned grid, unsigned block, cudaStream_t stream,
                   const Args&... args) {
  void* params[] = {const_cast<void*>(static_cast<const void*>(&args))...};
  pr_driver_launch(k, name, grid, block, stream, params);
}

inline precis_status_t check_launch(const char* what) { return pr_driver_take_error(what); }

inline precis_status_t memset_async(const char* fn, const char* what, void* dst, size_t bytes,
                                    cudaStream_t stream) {
  return pr_driver_memset(fn, what, dst, bytes, stream);
}

inline precis_status_t memcpy_async(const char* fn, void* dst, const void* src, size_t bytes,
                                    cudaStream_t stream) {
  return pr_driver_memcpy(fn, dst, src, bytes, stream);
}

}  // namespace precis

#define PR_LAUNCH(k, grid, block, stream, ...)                                           \
  do {                                                                                   \
    static const int pr_kernel_ = pr_driver_kernel_index(#k);                            \
    ::precis::driver_launch(pr_kernel_, #k, (grid), (block), (stream), __VA_ARGS__);     \
  } while (0)
#define PR_LAUNCH_T(k, targs, grid, block, stream, ...)                                  \
  do {                                                                                   \
    static const std::string pr_name_ = ::precis::kernel_name<PR_UNPAREN targs>(#k);     \
    static const int pr_kernel_ = pr_driver_kernel_index(pr_name_.c_str());              \
    ::precis::driver_launch(pr_kernel_, pr_name_.c_str(), (grid), (block), (stream),     \
                            __VA_ARGS__);                                                \
  } while (0)

#endif  // PRECIS_CUDA_DRIVER_LAUNCH_H_
