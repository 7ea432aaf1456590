/* cpu_isa.c - which SIMD path the CPU kernels take: the CPU's features, PRECIS_CPU_ISA,
 * the tests' forcing (pr_cpu_isa_force) and precis_cpu_isa. */

#include <stdlib.h>
#include <string.h>

#include "cpu_isa.h"
#include "internal.h"
#include "precis/precis.h"
#include "step_cpu.h"

#if PR_X86
#include <cpuid.h>
#endif
#if PR_SVE
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef HWCAP_SVE
#define HWCAP_SVE (1UL << 22) /* the kernel's ABI value; glibc < 2.27 lacks the name */
#endif
#ifndef PR_SVE_GET_VL /* the kernel's ABI values (Linux 4.15, with HWCAP_SVE) */
#define PR_SVE_GET_VL 51
#define PR_SVE_VL_LEN_MASK 0xffff
#endif
#endif

static const char* const pr_isa_names[PR_ISA_COUNT] = {"scalar", "avx2", "avx512", "neon", "sve"};
/* The architecture of each path (0: every one's), so that no CPU takes another's. */
static const unsigned char pr_isa_arch[PR_ISA_COUNT] = {0, 1, 1, 2, 2};

#if PR_X86
/* F16C through CPUID: not every compiler's __builtin_cpu_supports knows it
 * (clang 14, which builds the fuzzers, does not). */
static int pr_cpu_has_f16c(void) {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif

int pr_isa_hardware(void) {
  int hw = PR_ARM ? PR_ISA_NEON : PR_ISA_SCALAR;
#if PR_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && pr_cpu_has_f16c()) {
    hw = PR_ISA_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      hw = PR_ISA_AVX512;
    }
  }
#endif
#if PR_SVE
  if ((getauxval(AT_HWCAP) & HWCAP_SVE) != 0) hw = PR_ISA_SVE;
#endif
  return hw;
}

static int pr_isa_lookup(const char* name) {
  char norm[16]; /* case and surrounding spaces ignored, as in dtype names */
  int i;
  if (!pr_normalize(name, norm, sizeof norm)) return -1;
  for (i = 0; i < PR_ISA_COUNT; ++i) {
    if (strcmp(norm, pr_isa_names[i]) == 0) return i;
  }
  return -1;
}

/* 1 if this CPU (best path hw) runs path level: scalar, or a path of its own
 * architecture up to hw. */
static int pr_isa_runs(int level, int hw) {
  return level == PR_ISA_SCALAR || (level <= hw && pr_isa_arch[level] == pr_isa_arch[hw]);
}

/* The path taken by default: the best the CPU runs, except neon rather than sve
 * where SVE's vectors are 128 bits (NVIDIA Grace, AWS Graviton4), as wide as
 * NEON's: there GCC's sve loops execute 4-22% more instructions per element than
 * the neon ones; with 256-bit vectors, about half as many as with 128 (qemu's
 * count, bench/RESULTS.md, "sve or neon"). */
static int pr_isa_default(int hw) {
#if PR_SVE
  /* this thread's vector length in bytes; threads inherit it */
  if (hw == PR_ISA_SVE && (prctl(PR_SVE_GET_VL) & PR_SVE_VL_LEN_MASK) == 16) return PR_ISA_NEON;
#endif
  return hw;
}

/* The default path, or another the CPU runs that PRECIS_CPU_ISA asks for (a
 * foreign, higher or unknown name is ignored: the kernels must run on this CPU). */
static int pr_isa_detect(void) {
  int hw = pr_isa_hardware();
  const char* env = getenv("PRECIS_CPU_ISA");
  int want = env != NULL ? pr_isa_lookup(env) : -1;
  return want >= 0 && pr_isa_runs(want, hw) ? want : pr_isa_default(hw);
}

/* Computed once; a race only computes the same value twice. */
static int pr_isa_level = -1;

int pr_isa(void) {
  int level = __atomic_load_n(&pr_isa_level, __ATOMIC_RELAXED);
  if (level < 0) {
    level = pr_isa_detect();
    __atomic_store_n(&pr_isa_level, level, __ATOMIC_RELAXED);
  }
  return level;
}

/* "Chosen at load time" (precis.h): read PRECIS_CPU_ISA when the library loads. */
__attribute__((constructor)) static void pr_isa_at_load(void) { (void)pr_isa(); }

int pr_cpu_isa_force(const char* name) {
  int level = name == NULL ? pr_isa_detect() : pr_isa_lookup(name);
  if (level < 0 || !pr_isa_runs(level, pr_isa_hardware())) return -1;
  __atomic_store_n(&pr_isa_level, level, __ATOMIC_RELAXED);
  return 0;
}

PRECIS_API precis_status_t precis_cpu_isa(const char** out) {
  pr_clear_error();
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_cpu_isa: out is NULL");
  *out = pr_isa_names[pr_isa()];
  return PRECIS_OK;
}
