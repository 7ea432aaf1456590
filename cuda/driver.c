/* driver.c - libprecis_cuda12.so's launches through the CUDA driver API (driver.h).
 *
 * libcuda.so.1 is opened at the first launch, never at load: a machine without a driver
 * loads the library, and its CPU tensors never reach here. Each GPU (a device ordinal
 * of the current context, torch's primary context) gets the modules once, the cubin of
 * its architecture or else the PTX, and every kernel's function handle with them; a
 * launch then reads that table without a lock. The driver's declarations are ours (a
 * handful, the types as opaque pointers): the library needs no CUDA header or library
 * to build beyond NVRTC's output. */
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "internal.h"

typedef int CUresult; /* CUDA_SUCCESS 0 */
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
enum { PR_CU_MAJOR = 75, PR_CU_MINOR = 76 }; /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_* */

/* The driver's entry points, all present since CUDA 4.0 (the _v2 names: since 4.0 too). */
static struct {
  CUresult (*init)(unsigned);
  CUresult (*driver_version)(int*);
  CUresult (*ctx_current)(CUcontext*);
  CUresult (*ctx_device)(CUdevice*);
  CUresult (*attribute)(int*, int, CUdevice);
  CUresult (*device_name)(char*, int, CUdevice);
  CUresult (*load)(CUmodule*, const void*);
  CUresult (*function)(CUfunction*, CUmodule, const char*);
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     unsigned, CUstream, void**, void**);
  CUresult (*memset8)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*memcpy)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*error_string)(CUresult, const char**);
} cu;

static pthread_once_t pr_open_once = PTHREAD_ONCE_INIT;
static char pr_open_error[512]; /* "" once the driver is open and new enough */

static void pr_open(void) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(pr_open_error, sizeof pr_open_error,
             "precis's CUDA kernels need the NVIDIA driver (libcuda.so.1, %s or newer), which "
             "cannot be loaded: %s", PR_DRIVER_MIN_RELEASE, dlerror());
    return;
  }
  const char* missing = NULL;
#define PR_CU(field, name) \
  if (!(*(void**)&cu.field = dlsym(h, name)) && !missing) missing = name;
  PR_CU(init, "cuInit")
  PR_CU(driver_version, "cuDriverGetVersion")
  PR_CU(ctx_current, "cuCtxGetCurrent")
  PR_CU(ctx_device, "cuCtxGetDevice")
  PR_CU(attribute, "cuDeviceGetAttribute")
  PR_CU(device_name, "cuDeviceGetName")
  PR_CU(load, "cuModuleLoadData")
  PR_CU(function, "cuModuleGetFunction")
  PR_CU(launch, "cuLaunchKernel")
  PR_CU(memset8, "cuMemsetD8Async")
  PR_CU(memcpy, "cuMemcpyAsync")
  PR_CU(error_string, "cuGetErrorString")
#undef PR_CU
  int version = 0;
  if (missing) {
    snprintf(pr_open_error, sizeof pr_open_error,
             "the NVIDIA driver's libcuda.so.1 has no %s; precis's CUDA kernels need a driver "
             "%s or newer", missing, PR_DRIVER_MIN_RELEASE);
  } else if (cu.init(0) != 0 || cu.driver_version(&version) != 0) {
    snprintf(pr_open_error, sizeof pr_open_error,
             "the NVIDIA driver (libcuda.so.1) cannot be initialized: is a GPU visible?");
  } else if (version < PR_DRIVER_MIN_CUDA) {
    snprintf(pr_open_error, sizeof pr_open_error,
             "precis's CUDA kernels need an NVIDIA driver for CUDA %d.%d (%s) or newer; this "
             "driver supports CUDA %d.%d: update the driver, or keep precis's tensors on the CPU",
             PR_DRIVER_MIN_CUDA / 1000, PR_DRIVER_MIN_CUDA % 1000 / 10, PR_DRIVER_MIN_RELEASE,
             version / 1000, version % 1000 / 10);
  }
}

static const char* pr_cu_error(CUresult r) {
  const char* s = NULL;
  return cu.error_string && cu.error_string(r, &s) == 0 && s ? s : "unknown CUDA error";
}

/* ---- each GPU's modules and functions ---------------------------------------------- */

enum { PR_MAX_DEVICES = 64 };

typedef struct pr_device {
  CUcontext ctx;            /* the context the modules were loaded in */
  CUfunction* functions;    /* pr_driver_kernels' handles, in its order */
  char error[512];          /* "" when loaded */
} pr_device_t;

static _Atomic(pr_device_t*) pr_devices[PR_MAX_DEVICES];
static pthread_mutex_t pr_load_lock = PTHREAD_MUTEX_INITIALIZER;

/* The image of module m for a GPU of architecture sm: the cubin of the same major with
 * the highest minor not above sm's (a cubin runs on the later minors of its major), or
 * else the PTX; NULL if neither. */
static const pr_driver_image_t* pr_pick_image(int m, int sm) {
  const pr_driver_image_t* best = NULL;
  const pr_driver_image_t* ptx = NULL;
  for (int i = 0; i < pr_driver_image_count; ++i) {
    const pr_driver_image_t* img = &pr_driver_images[i];
    if (img->module != m) continue;
    if (img->sm == 0) {
      ptx = img;
    } else if (img->sm / 10 == sm / 10 && img->sm <= sm && (!best || img->sm > best->sm)) {
      best = img;
    }
  }
  return best ? best : ptx;
}

/* Loads every module into ctx (device dev) and resolves every kernel; d->error says why not. */
static void pr_load_device(pr_device_t* d, CUcontext ctx, CUdevice dev) {
  int major = 0, minor = 0;
  char name[256] = "?";
  d->ctx = ctx;
  if (cu.attribute(&major, PR_CU_MAJOR, dev) != 0 || cu.attribute(&minor, PR_CU_MINOR, dev) != 0) {
    snprintf(d->error, sizeof d->error, "cannot read the compute capability of cuda:%d", dev);
    return;
  }
  (void)cu.device_name(name, (int)sizeof name, dev);
  const int sm = 10 * major + minor;
  if (sm < PR_DRIVER_MIN_SM) {
    snprintf(d->error, sizeof d->error,
             "precis's CUDA kernels need a GPU of compute capability %d.%d (A100) or newer; "
             "cuda:%d (%s) is %d.%d: keep precis's tensors on the CPU there",
             PR_DRIVER_MIN_SM / 10, PR_DRIVER_MIN_SM % 10, dev, name, major, minor);
    return;
  }
  CUmodule modules[8] = {0};
  for (int m = 0; m < pr_driver_module_count && m < 8; ++m) {
    const pr_driver_image_t* img = pr_pick_image(m, sm);
    CUresult r = img ? cu.load(&modules[m], img->data) : 1;
    if (r != 0) {
      snprintf(d->error, sizeof d->error,
               "cannot load precis's kernels of %s (%s) on cuda:%d (%s, compute capability "
               "%d.%d): %s", pr_driver_modules[m], img && img->sm ? "cubin" : "PTX", dev, name,
               major, minor, img ? pr_cu_error(r) : "no image");
      return;
    }
  }
  d->functions = (CUfunction*)calloc((size_t)pr_driver_kernel_count + 1, sizeof(CUfunction));
  if (!d->functions) {
    snprintf(d->error, sizeof d->error, "out of host memory");
    return;
  }
  for (int k = 0; k < pr_driver_kernel_count; ++k) {
    const pr_driver_kernel_t* kernel = &pr_driver_kernels[k];
    CUresult r = cu.function(&d->functions[k], modules[kernel->module], kernel->symbol);
    if (r != 0) {
      snprintf(d->error, sizeof d->error, "kernel %s (%s) not found in %s: %s", kernel->name,
               kernel->symbol, pr_driver_modules[kernel->module], pr_cu_error(r));
      return;
    }
  }
  d->error[0] = '\0';
}

/* The current context's GPU with its modules, or NULL with *why set. */
static const pr_device_t* pr_current_device(const char** why) {
  pthread_once(&pr_open_once, pr_open);
  if (pr_open_error[0]) {
    *why = pr_open_error;
    return NULL;
  }
  CUcontext ctx = NULL;
  CUdevice dev = 0;
  if (cu.ctx_current(&ctx) != 0 || !ctx || cu.ctx_device(&dev) != 0) {
    *why = "no current CUDA context (torch makes one at a tensor's first use of its GPU)";
    return NULL;
  }
  if (dev < 0 || dev >= PR_MAX_DEVICES) {
    *why = "more GPUs than precis's CUDA kernels track (64)";
    return NULL;
  }
  pr_device_t* d = atomic_load_explicit(&pr_devices[dev], memory_order_acquire);
  if (!d) {
    pthread_mutex_lock(&pr_load_lock);
    d = atomic_load_explicit(&pr_devices[dev], memory_order_relaxed);
    if (!d && (d = (pr_device_t*)calloc(1, sizeof *d)) != NULL) {
      pr_load_device(d, ctx, dev);
      atomic_store_explicit(&pr_devices[dev], d, memory_order_release);
    }
    pthread_mutex_unlock(&pr_load_lock);
    if (!d) {
      *why = "out of host memory";
      return NULL;
    }
  }
  if (d->error[0]) {
    *why = d->error;
    return NULL;
  }
  if (d->ctx != ctx) {
    *why = "precis's kernels were loaded in another CUDA context of this GPU (torch's primary "
           "context); launch them there";
    return NULL;
  }
  return d;
}

/* ---- launches ----------------------------------------------------------------------- */

/* The first failure since pr_driver_take_error, per thread, as cudaGetLastError's. */
static _Thread_local char pr_pending[640];

static void pr_keep(const char* fmt, const char* a, const char* b) {
  if (!pr_pending[0]) snprintf(pr_pending, sizeof pr_pending, fmt, a, b);
}

int pr_driver_kernel_index(const char* name) {
  for (int k = 0; k < pr_driver_kernel_count; ++k) {
    if (strcmp(pr_driver_kernels[k].name, name) == 0) return k;
  }
  return -1;
}

void pr_driver_launch(int k, const char* name, unsigned grid, unsigned block, void* stream,
                      void** params) {
  if (pr_pending[0]) return; /* an earlier launch of this call failed */
  if (k < 0 || k >= pr_driver_kernel_count) {
    pr_keep("kernel %s%s is not in this library (rebuild it: tools/build_cuda12.py)", name, "");
    return;
  }
  const char* why = NULL;
  const pr_device_t* d = pr_current_device(&why);
  if (!d) {
    pr_keep("%s%s", why, "");
    return;
  }
  CUresult r = cu.launch(d->functions[k], grid, 1, 1, block, 1, 1, 0, (CUstream)stream, params,
                         NULL);
  if (r != 0) pr_keep("kernel launch failed (%s): %s", name, pr_cu_error(r));
}

precis_status_t pr_driver_take_error(const char* fn) {
  if (!pr_pending[0]) return PRECIS_OK;
  precis_status_t st = pr_fail(PRECIS_ERR_CUDA, "%s: %s", fn, pr_pending);
  pr_pending[0] = '\0';
  return st;
}

precis_status_t pr_driver_memset(const char* fn, const char* what, void* dst, size_t bytes,
                                 void* stream) {
  const char* why = NULL;
  if (!pr_current_device(&why)) return pr_fail(PRECIS_ERR_CUDA, "%s: %s", fn, why);
  CUresult r = cu.memset8((CUdeviceptr)(uintptr_t)dst, 0, bytes, (CUstream)stream);
  if (r != 0) {
    return pr_fail(PRECIS_ERR_CUDA, "%s: cuMemsetD8Async of %s failed: %s", fn, what,
                   pr_cu_error(r));
  }
  return PRECIS_OK;
}

precis_status_t pr_driver_memcpy(const char* fn, void* dst, const void* src, size_t bytes,
                                 void* stream) {
  const char* why = NULL;
  if (!pr_current_device(&why)) return pr_fail(PRECIS_ERR_CUDA, "%s: %s", fn, why);
  CUresult r = cu.memcpy((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes,
                         (CUstream)stream);
  if (r != 0) return pr_fail(PRECIS_ERR_CUDA, "%s: cuMemcpyAsync failed: %s", fn, pr_cu_error(r));
  return PRECIS_OK;
}

/* ---- for the tests ------------------------------------------------------------------ */

PRECIS_API int precis_cuda12_image_count(void) { return pr_driver_image_count; }

PRECIS_API int precis_cuda12_image(int i, int* module, int* sm, const void** data,
                                   size_t* size) {
  if (i < 0 || i >= pr_driver_image_count) return 0;
  *module = pr_driver_images[i].module;
  *sm = pr_driver_images[i].sm;
  *data = pr_driver_images[i].data;
  *size = pr_driver_images[i].size;
  return 1;
}

PRECIS_API int precis_cuda12_kernel_count(void) { return pr_driver_kernel_count; }

PRECIS_API const char* precis_cuda12_kernel(int i, const char** symbol) {
  if (i < 0 || i >= pr_driver_kernel_count) return NULL;
  *symbol = pr_driver_kernels[i].symbol;
  return pr_driver_kernels[i].name;
}

PRECIS_API precis_status_t precis_cuda12_check(void) {
  const char* why = NULL;
  pr_clear_error();
  return pr_current_device(&why) ? PRECIS_OK : pr_fail(PRECIS_ERR_CUDA, "%s", why);
}
