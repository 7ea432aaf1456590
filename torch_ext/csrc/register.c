/* register.c - libprecis_torch.so's entry points: finds libtorch in the
 * process, registers the precis:: ops with its dispatcher, and loads
 * libprecis_cuda.so at the first CUDA call. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "glue.h"

pr_torch_api_t pr_torch;

static pthread_mutex_t pr_init_lock = PTHREAD_MUTEX_INITIALIZER;
static int pr_initialized;         /* 1 once registration succeeded (or was found done) */
static int pr_has_cuda;            /* CUDA kernels registered */
static char pr_init_note[1024];    /* why init failed, or how it succeeded */
/* Kept for the life of the process: deleting a library object deregisters its ops. */
static TorchLibraryHandle pr_libraries[3];

static precis_status_t pr_init_fail(precis_status_t status, const char* fmt, ...)
    PR_GLUE_PRINTF(2, 3);

static precis_status_t pr_init_fail(precis_status_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pr_init_note, sizeof pr_init_note, fmt, ap);
  va_end(ap);
  return status;
}

/* A function of a loaded library: from its handle, else from the global scope. */
static void* pr_lookup(void* handle, const char* name) {
  void* fn = handle ? dlsym(handle, name) : NULL;
  return fn ? fn : dlsym(RTLD_DEFAULT, name);
}

/* *slot = symbol, for a function-pointer slot (POSIX: the same size as void*;
 * ISO C has no cast between the two). */
static bool pr_store(void* slot, void* symbol) {
  memcpy(slot, &symbol, sizeof symbol);
  return symbol != NULL;
}

static precis_status_t pr_resolve_torch(void) {
  /* RTLD_NOLOAD: only a libtorch the process has loaded already (Python's
   * `import torch`, or a C++ program linked with libtorch). */
  void* cpu = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  const char* missing = NULL;
#define PR_RESOLVE(name, ret, params) \
  if (!pr_store(&pr_torch.name, pr_lookup(cpu, #name)) && !missing) missing = #name;
  PR_TORCH_CPU_FUNCTIONS(PR_RESOLVE)
  if (missing && !cpu && !pr_lookup(NULL, "aoti_torch_abi_version")) {
    return pr_init_fail(PRECIS_ERR_UNSUPPORTED,
                        "libtorch is not loaded in this process: import torch (or link "
                        "libtorch) before loading libprecis_torch.so");
  }
  if (missing) {
    return pr_init_fail(PRECIS_ERR_UNSUPPORTED,
                        "the loaded libtorch has no %s; precis needs torch 2.10 or newer",
                        missing);
  }
  uint64_t abi = pr_torch.aoti_torch_abi_version();
  if (abi < PR_TORCH_ABI_2_10) {
    return pr_init_fail(PRECIS_ERR_UNSUPPORTED,
                        "the loaded libtorch is version %u.%u; precis needs torch 2.10 or newer",
                        (unsigned)(abi >> 56), (unsigned)(abi >> 48 & 0xff));
  }
  void* cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  int cuda_ok = cuda != NULL;
#define PR_RESOLVE_CUDA(name, ret, params) \
  if (!pr_store(&pr_torch.name, cuda ? dlsym(cuda, #name) : NULL)) cuda_ok = 0;
  PR_TORCH_CUDA_FUNCTIONS(PR_RESOLVE_CUDA)
  pr_has_cuda = cuda_ok;
  /* Handles of RTLD_NOLOAD opens only hold a reference; the libraries stay. */
  pr_torch.dtype_float32 = pr_torch.aoti_torch_dtype_float32();
  pr_torch.dtype_float16 = pr_torch.aoti_torch_dtype_float16();
  pr_torch.dtype_bfloat16 = pr_torch.aoti_torch_dtype_bfloat16();
  pr_torch.dtype_float64 = pr_torch.aoti_torch_dtype_float64();
  pr_torch.dtype_uint8 = pr_torch.aoti_torch_dtype_uint8();
  pr_torch.dtype_int16 = pr_torch.aoti_torch_dtype_int16();
  pr_torch.dtype_int32 = pr_torch.aoti_torch_dtype_int32();
  pr_torch.dtype_int64 = pr_torch.aoti_torch_dtype_int64();
  pr_torch.device_cpu = pr_torch.aoti_torch_device_type_cpu();
  pr_torch.device_cuda = pr_torch.aoti_torch_device_type_cuda();
  /* Only libtorch_cpu's own MKL: another one in the process may differ. */
  pr_store(&pr_torch.mkl_vms_sqrt, cpu ? dlsym(cpu, "vmsSqrt_64") : NULL);
  /* at::get_num_threads(): a C++ function of no arguments returning int. */
  pr_store(&pr_torch.get_num_threads, cpu ? dlsym(cpu, "_ZN2at15get_num_threadsEv") : NULL);
  /* Python's C API, in the process's global scope when it runs Python: all four or none */
  if (!pr_store(&pr_torch.py_is_initialized, dlsym(RTLD_DEFAULT, "Py_IsInitialized")) ||
      !pr_store(&pr_torch.py_gil_check, dlsym(RTLD_DEFAULT, "PyGILState_Check")) ||
      !pr_store(&pr_torch.py_gil_ensure, dlsym(RTLD_DEFAULT, "PyGILState_Ensure")) ||
      !pr_store(&pr_torch.py_gil_release, dlsym(RTLD_DEFAULT, "PyGILState_Release"))) {
    pr_torch.py_is_initialized = NULL;
  }
  return PRECIS_OK;
}

int pr_python_hold(void) {
  /* (torch's own decref does nothing once Python is finalized: neither do we) */
  if (!pr_torch.py_is_initialized || !pr_torch.py_is_initialized() || pr_torch.py_gil_check()) {
    return -1;
  }
  return pr_torch.py_gil_ensure();
}

void pr_python_release(int held) {
  if (held >= 0) pr_torch.py_gil_release(held);
}

/* ATen's vml.h computes float sqrt with vmsSqrt(n, in, out, VML_HA |
 * VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE) when torch has MKL. */
#define PR_VML_HA 0x2
#define PR_VML_FTZDAZ_OFF 0x140000
#define PR_VML_ERRMODE_IGNORE 0x100

static void pr_mkl_sqrt(const float* in, float* out, int64_t n) {
  pr_torch.mkl_vms_sqrt(n, in, out, PR_VML_HA | PR_VML_FTZDAZ_OFF | PR_VML_ERRMODE_IGNORE);
}

int32_t pr_torch_num_threads(void) {
  return pr_torch.get_num_threads != NULL ? (int32_t)pr_torch.get_num_threads() : 0;
}

precis_sqrt_fn_t pr_torch_cpu_sqrt(void) {
  /* PRECIS_CPU_SQRT=ieee: IEEE sqrt, the CUDA kernels' bits (read per call). */
  const char* env = getenv("PRECIS_CPU_SQRT");
  if (env != NULL && strcmp(env, "ieee") == 0) return NULL;
  return pr_torch.mkl_vms_sqrt != NULL ? pr_mkl_sqrt : NULL;
}

static const struct {
  const pr_op_kernels_t* ops;
  const size_t* count;
} pr_op_tables[] = {{pr_step_ops, &pr_step_op_count},
                     {pr_step_flat_ops, &pr_step_flat_op_count},
                     {pr_bucket_ops, &pr_bucket_op_count},
                     {pr_held_ops, &pr_held_op_count}};
enum { PR_OP_TABLE_COUNT = sizeof pr_op_tables / sizeof pr_op_tables[0] };

static precis_status_t pr_register_kernels(const char* key, int cuda, TorchLibraryHandle* out) {
  if (pr_torch.aoti_torch_library_init_impl("precis", key, __FILE__, __LINE__, out)) {
    return pr_init_fail(PRECIS_ERR_UNSUPPORTED, "torch refused a %s library for precis", key);
  }
  for (int t = 0; t < PR_OP_TABLE_COUNT; t++) {
    for (size_t i = 0; i < *pr_op_tables[t].count; i++) {
      const pr_op_kernels_t* op = &pr_op_tables[t].ops[i];
      if (pr_torch.torch_library_impl(*out, op->name, cuda ? op->cuda : op->cpu,
                                      PR_TORCH_ABI_2_10)) {
        return pr_init_fail(PRECIS_ERR_UNSUPPORTED, "torch refused the %s kernel of precis::%s",
                            key, op->name);
      }
    }
  }
  return PRECIS_OK;
}

static precis_status_t pr_register(void) {
  TorchLibraryHandle fragment = NULL;
  if (pr_torch.aoti_torch_library_init_fragment("precis", __FILE__, __LINE__, &fragment)) {
    return pr_init_fail(PRECIS_ERR_UNSUPPORTED, "torch refused a library fragment for precis");
  }
  for (int t = 0; t < PR_OP_TABLE_COUNT; t++) {
    for (size_t i = 0; i < *pr_op_tables[t].count; i++) {
      const pr_op_kernels_t* op = &pr_op_tables[t].ops[i];
      if (pr_torch.aoti_torch_library_def(fragment, op->schema) == 0) continue;
      if (t == 0 && i == 0) {
        /* The first schema is taken: another copy of this library (another
         * path) registered the ops already. Register nothing twice. */
        pr_torch.aoti_torch_delete_library_object(fragment);
        snprintf(pr_init_note, sizeof pr_init_note,
                 "precis::%s was already defined (by another copy of libprecis_torch.so?); "
                 "this copy registered nothing",
                 op->name);
        pr_has_cuda = 0;
        return PRECIS_OK;
      }
      return pr_init_fail(PRECIS_ERR_UNSUPPORTED, "torch refused the schema of precis::%s",
                          op->name);
    }
  }
  pr_libraries[0] = fragment;
  precis_status_t status = pr_register_kernels("CPU", 0, &pr_libraries[1]);
  if (status == PRECIS_OK && pr_has_cuda) {
    status = pr_register_kernels("CUDA", 1, &pr_libraries[2]);
  }
  if (status == PRECIS_OK) {
    uint64_t abi = pr_torch.aoti_torch_abi_version();
    snprintf(pr_init_note, sizeof pr_init_note,
             "registered precis:: ops (CPU%s) with torch %u.%u's dispatcher",
             pr_has_cuda ? " and CUDA" : "", (unsigned)(abi >> 56), (unsigned)(abi >> 48 & 0xff));
  }
  return status;
}

PRECIS_API precis_status_t precis_torch_init(void) {
  pthread_mutex_lock(&pr_init_lock);
  precis_status_t status = PRECIS_OK;
  if (!pr_initialized) {
    status = pr_resolve_torch();
    if (status == PRECIS_OK) status = pr_register();
    pr_initialized = status == PRECIS_OK;
  }
  pthread_mutex_unlock(&pr_init_lock);
  return status;
}

PRECIS_API const char* precis_torch_init_message(void) { return pr_init_note; }

PRECIS_API int precis_torch_has_cuda(void) { return pr_has_cuda; }

/* Loading the library registers the ops, as torch.ops.load_library expects. */
__attribute__((constructor)) static void pr_on_load(void) { (void)precis_torch_init(); }

/* ---- libprecis_cuda.so --------------------------------------------------------- */

static pthread_once_t pr_cuda_once = PTHREAD_ONCE_INIT;
static pr_cuda_api_t pr_cuda;
static const pr_cuda_api_t* pr_cuda_loaded;
static char pr_cuda_why[8192];
static const char pr_cuda_anchor = 0; /* an address inside this library, for dladdr */

/* libprecis_cuda.so beside this library, unless $PRECIS_CUDA_LIBRARY names another: a
 * path, or a file name beside this library (libprecis_cuda12.so: the kernels for every
 * driver from R530 on, which check the driver and the GPU themselves at their first launch). */
static void pr_cuda_path(char* out, size_t cap) {
  const char* env = getenv("PRECIS_CUDA_LIBRARY");
  const char* name = env && *env ? env : "libprecis_cuda.so";
  if (strchr(name, '/')) {
    snprintf(out, cap, "%s", name);
    return;
  }
  Dl_info info;
  const char* self = dladdr(&pr_cuda_anchor, &info) && info.dli_fname ? info.dli_fname : "";
  const char* slash = strrchr(self, '/');
  int dir = slash ? (int)(slash - self) : 0;
  snprintf(out, cap, "%.*s%s%s", dir, self, slash ? "/" : "", name);
}

/* 0 when the driver torch loaded is older than PR_CUDA_BUILT_FOR, with why set: one
 * line instead of "driver version is insufficient" at the first kernel launch. Only for
 * libprecis_cuda.so (CUDA 13's runtime linked in): libprecis_cuda12.so checks its own. */
static int pr_cuda_driver_ok(const char* path) {
  if (strstr(path, "libprecis_cuda12")) return 1;
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD); /* never loads it itself */
  int (*driver_version)(int*) = NULL;
  int version = 0;
  int ok = !cuda || !pr_store(&driver_version, dlsym(cuda, "cuDriverGetVersion")) ||
           driver_version(&version) != 0 || version >= PR_CUDA_BUILT_FOR;
  if (cuda) dlclose(cuda);
  if (!ok) {
    snprintf(pr_cuda_why, sizeof pr_cuda_why,
             "precis's CUDA kernels (%s) need an NVIDIA driver for CUDA %d.%d or newer (%s); "
             "this driver supports CUDA %d.%d: update the driver, or keep precis's tensors "
             "on the CPU", path, PR_CUDA_BUILT_FOR / 1000, PR_CUDA_BUILT_FOR % 1000 / 10,
             PR_CUDA_MIN_DRIVER, version / 1000, version % 1000 / 10);
  }
  return ok;
}

static void pr_cuda_load(void) {
  char path[4096];
  pr_cuda_path(path, sizeof path);
  if (!pr_cuda_driver_ok(path)) return;
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(pr_cuda_why, sizeof pr_cuda_why, "cannot load the CUDA kernels (%s): %s", path,
             dlerror());
    return;
  }
  int (*version)(void) = NULL;
  pr_store(&version, dlsym(h, "precis_version"));
  if (!version || version() / 10000 != PRECIS_VERSION_MAJOR) {
    snprintf(pr_cuda_why, sizeof pr_cuda_why, "%s is not a precis %d.x CUDA library", path,
             PRECIS_VERSION_MAJOR);
    return;
  }
  const char* missing = NULL;
#define PR_CUDA_SYMBOL(field, name) \
  if (!pr_store(&pr_cuda.field, dlsym(h, name)) && !missing) missing = name;
  PR_CUDA_SYMBOL(last_error, "precis_last_error")
  PR_CUDA_SYMBOL(step, "precis_cuda_step")
  PR_CUDA_SYMBOL(check_finite, "precis_cuda_step_check_finite")
  PR_CUDA_SYMBOL(accumulate, "precis_cuda_accumulate")
  PR_CUDA_SYMBOL(cast, "precis_cuda_cast")
  PR_CUDA_SYMBOL(scale, "precis_cuda_scale")
  PR_CUDA_SYMBOL(count_nonfinite, "precis_cuda_count_nonfinite")
  PR_CUDA_SYMBOL(fingerprint, "precis_cuda_fingerprint")
  PR_CUDA_SYMBOL(fingerprint_blocks, "precis_cuda_fingerprint_blocks")
  PR_CUDA_SYMBOL(resync_masters, "precis_cuda_resync_masters")
  PR_CUDA_SYMBOL(resync_compared, "precis_cuda_resync_compared")
  PR_CUDA_SYMBOL(compare_params, "precis_cuda_compare_params")
#undef PR_CUDA_SYMBOL
  if (missing) {
    snprintf(pr_cuda_why, sizeof pr_cuda_why, "%s has no %s; rebuild it with this library",
             path, missing);
    return;
  }
  pr_cuda_loaded = &pr_cuda;
}

const pr_cuda_api_t* pr_cuda_api(const char** why) {
  pthread_once(&pr_cuda_once, pr_cuda_load);
  if (!pr_cuda_loaded) *why = pr_cuda_why;
  return pr_cuda_loaded;
}
