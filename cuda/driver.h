/* driver.h - libprecis_cuda12.so's launches through the CUDA driver API (driver.c): the
 * kernels are NVRTC's cubins for each architecture and one PTX (tools/build_cuda12.py),
 * loaded into each GPU's context at its first launch; libcuda.so.1 is opened then, so
 * the library links no CUDA runtime and loads on a machine without a driver. C, for the
 * host code of the .cu files (driver_launch.h) and the tests. */
#ifndef PRECIS_CUDA_DRIVER_H_
#define PRECIS_CUDA_DRIVER_H_

#include <stddef.h>
#include <stdint.h>

#include "precis/precis.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The oldest driver the kernels load on: CUDA 12.0 (R525), by the PTX ISA version and
 * the cubins' format (tools/build_cuda12.py); and the oldest GPU: compute capability 8.0. */
#define PR_DRIVER_MIN_CUDA 12010
#define PR_DRIVER_MIN_RELEASE "R530"
#define PR_DRIVER_MIN_SM 80

/* ---- what tools/build_cuda12.py generates (cuda12_images.c) -------------------- */

/* One image of a module: a cubin for one architecture (sm = 10 * major + minor), or the
 * PTX (sm = 0) that the driver compiles for a GPU with no cubin here. */
typedef struct pr_driver_image {
  int module; /* index in pr_driver_modules */
  int sm;
  const unsigned char* data;
  size_t size;
} pr_driver_image_t;

/* A kernel by the name the host code gives it (driver_launch.h: "adam_kernel<2,2,1,0,2,2>",
 * "one_state_kernel") and by its symbol in the module's images. */
typedef struct pr_driver_kernel {
  int module;
  const char* name;
  const char* symbol;
} pr_driver_kernel_t;

extern const char* const pr_driver_modules[];  /* the .cu files, by name */
extern const int pr_driver_module_count;
extern const pr_driver_image_t pr_driver_images[];
extern const int pr_driver_image_count;
extern const pr_driver_kernel_t pr_driver_kernels[];
extern const int pr_driver_kernel_count;

/* ---- launches ----------------------------------------------------------------------- */

/* The index of the kernel named name in pr_driver_kernels, or -1. */
int pr_driver_kernel_index(const char* name);

/* Launches kernel k (an index; -1: an unknown name, refused) on the current context's
 * GPU, loading the modules there first, on stream (a CUstream: torch's current stream).
 * params: a pointer to each argument, as cuLaunchKernel takes them. A failure is kept for
 * pr_driver_take_error (the launches' status, as cudaGetLastError's), and the launches
 * after it are skipped until then. */
void pr_driver_launch(int k, const char* name, unsigned grid, unsigned block, void* stream,
                      void** params);

/* PRECIS_OK, or PRECIS_ERR_CUDA with pr_fail's message "<fn>: <what failed>": the first
 * failure since the last call, which it clears. */
precis_status_t pr_driver_take_error(const char* fn);

/* bytes of zeros at dst, and a device-to-device copy, in stream order (what: the buffer's
 * name in the message). */
precis_status_t pr_driver_memset(const char* fn, const char* what, void* dst, size_t bytes,
                                 void* stream);
precis_status_t pr_driver_memcpy(const char* fn, void* dst, const void* src, size_t bytes,
                                 void* stream);

/* Exported for the tests (tests/py/tools/test_cuda12_library.py): the images and
 * kernels built in, and whether this process can launch them on the current context's GPU
 * (PRECIS_OK, or the one-line reason: no driver, a driver too old, a GPU too old). */
PRECIS_API int precis_cuda12_image_count(void);
PRECIS_API int precis_cuda12_image(int i, int* module, int* sm, const void** data,
                                   size_t* size);
PRECIS_API int precis_cuda12_kernel_count(void);
PRECIS_API const char* precis_cuda12_kernel(int i, const char** symbol);
PRECIS_API precis_status_t precis_cuda12_check(void);

#ifdef __cplusplus
}
#endif

#endif /* PRECIS_CUDA_DRIVER_H_ */
