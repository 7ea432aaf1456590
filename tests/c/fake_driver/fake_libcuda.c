/* fake_libcuda.c - a stand-in NVIDIA driver (libcuda.so.1) for the tests of
 * libprecis_cuda12.so's launches on a machine without a GPU
 * (tests/py/tools/test_cuda12_library.py): the entry points cuda/driver.c opens, which
 * run nothing and write what they were asked to $FAKE_CUDA_LOG, one line each:
 *   load <image>          cuModuleLoadData: "sm_90" (a cubin's architecture) or "ptx"
 *   launch <symbol> <grid> <block> <first 8 bytes of the first argument, hex>
 *   memset <bytes> / memcpy <bytes>
 * $FAKE_CUDA_DRIVER (a CUDA version, 12090 by default) and $FAKE_CUDA_SM (the GPU's
 * compute capability as 10 * major + minor, 90 by default) say what it reports;
 * $FAKE_CUDA_NO_CONTEXT=1: no current context. */
#define _POSIX_C_SOURCE 200809L /* strdup */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;

static int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

static void log_line(const char* fmt, const char* s, unsigned long long a, unsigned long long b,
                     unsigned long long c) {
  const char* path = getenv("FAKE_CUDA_LOG");
  if (!path) return;
  FILE* f = fopen(path, "a");
  if (!f) return;
  fprintf(f, fmt, s, a, b, c);
  fclose(f);
}

CUresult cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }

CUresult cuDriverGetVersion(int* version) {
  *version = env_int("FAKE_CUDA_DRIVER", 12090);
  return 0;
}

CUresult cuCtxGetCurrent(void** ctx) {
  static int the_context;
  *ctx = env_int("FAKE_CUDA_NO_CONTEXT", 0) ? NULL : &the_context;
  return 0;
}

CUresult cuCtxGetDevice(int* device) {
  *device = 0;
  return 0;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
  const int sm = env_int("FAKE_CUDA_SM", 90);
  if (device != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
  if (attribute == 75) *value = sm / 10; /* COMPUTE_CAPABILITY_MAJOR */
  else if (attribute == 76) *value = sm % 10;
  else return 1;
  return 0;
}

CUresult cuDeviceGetName(char* name, int len, int device) {
  (void)device;
  snprintf(name, (size_t)len, "Fake GPU");
  return 0;
}

/* A cubin's architecture from its ELF header (e_flags: the low byte before CUDA 12.8's
 * ABI 0x41, the second byte from it), or "ptx". */
CUresult cuModuleLoadData(void** module, const void* image) {
  const unsigned char* b = (const unsigned char*)image;
  char what[32] = "ptx";
  if (memcmp(b, "\177ELF", 4) == 0) {
    uint32_t flags;
    memcpy(&flags, b + 0x30, sizeof flags);
    snprintf(what, sizeof what, "sm_%u", b[7] == 0x41 ? (flags >> 8) & 0xFFu : flags & 0xFFu);
  } else if (strncmp((const char*)b, "//", 2) != 0 && strstr((const char*)b, ".version") == NULL) {
    return 200; /* CUDA_ERROR_INVALID_IMAGE */
  }
  log_line("load %s\n", what, 0, 0, 0);
  *module = (void*)image;
  return 0;
}

CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
  (void)module;
  *function = strdup(name);
  return *function ? 0 : 2;
}

CUresult cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void* stream, void** params,
                        void** extra) {
  (void)gy, (void)gz, (void)by, (void)bz, (void)shared, (void)stream, (void)extra;
  unsigned long long first = 0;
  if (params && params[0]) memcpy(&first, params[0], sizeof first);
  log_line("launch %s %llu %llu %016llx\n", (const char*)function, gx, bx, first);
  return 0;
}

CUresult cuMemsetD8Async(unsigned long long dst, unsigned char value, size_t n, void* stream) {
  (void)dst, (void)value, (void)stream;
  log_line("memset%s %llu\n", "", n, 0, 0);
  return 0;
}

CUresult cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t n, void* stream) {
  (void)dst, (void)src, (void)stream;
  log_line("memcpy%s %llu\n", "", n, 0, 0);
  return 0;
}

CUresult cuGetErrorString(CUresult error, const char** s) {
  (void)error;
  *s = "fake driver error";
  return 0;
}
