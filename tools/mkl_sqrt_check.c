/* mkl_sqrt_check - compares precis_mkl_sqrt_avx512 (csrc/mkl_sqrt.h) with
 * MKL's vmsSqrt, the fp32 sqrt of torch's CPU kernels, bit for bit on all 2^32
 * float bit patterns (NaN payloads included). Exits 0 when every one matches.
 *
 *   bazel build //tools:mkl_sqrt_check
 *   bazel-bin/tools/mkl_sqrt_check \
 *     $(.venv/bin/python -c "import torch, os; print(os.path.dirname(torch.__file__))")/lib/libtorch_cpu.so
 *
 * Needs an AVX-512 CPU (the emulation's and MKL's kernel). About a minute of
 * CPU time; OpenMP threads split it. */
#include <dlfcn.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mkl_sqrt.h"

/* The mode ATen's vml.h passes: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE. */
#define VML_MODE (0x2 | 0x140000 | 0x100)
#define BLOCK (1 << 16)

typedef void (*vms_sqrt_fn)(int64_t n, const float* in, float* out, int64_t mode);

int main(int argc, char** argv) {
  void* lib;
  vms_sqrt_fn vms;
  uint64_t differ = 0, first_bad = 0;
  int64_t block;
  if (argc != 2) {
    fprintf(stderr, "usage: %s path/to/libtorch_cpu.so\n", argv[0]);
    return 2;
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    fprintf(stderr, "mkl_sqrt_check: this CPU has no AVX-512\n");
    return 2;
  }
  lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  vms = lib != NULL ? (vms_sqrt_fn)dlsym(lib, "vmsSqrt_64") : NULL;
  if (vms == NULL) {
    fprintf(stderr, "mkl_sqrt_check: no vmsSqrt_64 in %s: %s\n", argv[1], dlerror());
    return 2;
  }
#pragma omp parallel for schedule(dynamic, 64) reduction(+ : differ) reduction(max : first_bad)
  for (block = 0; block < ((int64_t)1 << 32) / BLOCK; ++block) {
    static _Thread_local float in[BLOCK], want[BLOCK], got[BLOCK];
    uint32_t i;
    for (i = 0; i < BLOCK; ++i) {
      uint32_t bits = (uint32_t)block * BLOCK + i;
      memcpy(&in[i], &bits, sizeof bits);
    }
    vms(BLOCK, in, want, VML_MODE);
    precis_mkl_sqrt_avx512(in, got, BLOCK);
    for (i = 0; i < BLOCK; ++i) {
      if (memcmp(&want[i], &got[i], sizeof(float)) != 0) {
        ++differ;
        if (differ == 1) first_bad = (uint64_t)block * BLOCK + i + 1; /* 0: none */
      }
    }
  }
  if (differ != 0) {
    printf("mkl_sqrt_check: %" PRIu64 " of 2^32 inputs differ (e.g. bits 0x%08" PRIx64 ")\n",
           differ, first_bad - 1);
    return 1;
  }
  printf("mkl_sqrt_check: all 2^32 inputs give MKL's bits\n");
  return 0;
}
