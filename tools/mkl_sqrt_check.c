/* mkl_sqrt_check - compares an emulation of csrc/mkl_sqrt.h with MKL's
 * vmsSqrt, the fp32 sqrt of torch's CPU kernels, bit for bit on all 2^32 float
 * bit patterns (NaN payloads included). Exits 0 when every one matches.
 *
 *   bazel build //tools:mkl_sqrt_check
 *   bazel-bin/tools/mkl_sqrt_check \
 *     $(.venv/bin/python -c "import torch, os; print(os.path.dirname(torch.__file__))")/lib/libtorch_cpu.so \
 *     [avx512|avx2]
 *
 * avx512 (the default): precis_mkl_sqrt_avx512, MKL's AVX-512 kernel (Intel);
 * avx2: precis_mkl_sqrt_avx2, MKL's generic kernel (what it runs on AMD). Needs
 * a CPU with that ISA. A few minutes of CPU time; OpenMP threads split it. */
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
typedef void (*emulation_fn)(const float* in, float* out, int64_t n);

static void avx512(const float* in, float* out, int64_t n) { precis_mkl_sqrt_avx512(in, out, n); }
static void avx2(const float* in, float* out, int64_t n) { precis_mkl_sqrt_avx2(in, out, n); }

int main(int argc, char** argv) {
  void* lib;
  vms_sqrt_fn vms;
  uint64_t differ = 0, first_bad = 0;
  int64_t block;
  const char* isa = argc == 3 ? argv[2] : "avx512";
  emulation_fn emulate = strcmp(isa, "avx2") == 0 ? avx2 : strcmp(isa, "avx512") == 0 ? avx512 : NULL;
  if ((argc != 2 && argc != 3) || emulate == NULL) {
    fprintf(stderr, "usage: %s path/to/libtorch_cpu.so [avx512|avx2]\n", argv[0]);
    return 2;
  }
  __builtin_cpu_init();
  if (emulate == avx2 ? !__builtin_cpu_supports("avx2") : !__builtin_cpu_supports("avx512f")) {
    fprintf(stderr, "mkl_sqrt_check: this CPU has no %s\n", isa);
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
    emulate(in, got, BLOCK);
    for (i = 0; i < BLOCK; ++i) {
      if (memcmp(&want[i], &got[i], sizeof(float)) != 0) {
        ++differ;
        if (differ == 1) first_bad = (uint64_t)block * BLOCK + i + 1; /* 0: none */
      }
    }
  }
  if (differ != 0) {
    printf("mkl_sqrt_check: %s: %" PRIu64 " of 2^32 inputs differ (e.g. bits 0x%08" PRIx64 ")\n",
           isa, differ, first_bad - 1);
    return 1;
  }
  printf("mkl_sqrt_check: %s: all 2^32 inputs give MKL's bits\n", isa);
  return 0;
}
