/* cpu_isa.h - which SIMD path the CPU kernels take (cpu_isa.c): the paths, the
 * architecture macros the kernels are compiled by, and the chosen path. Internal. */
#ifndef PRECIS_CPU_ISA_H_
#define PRECIS_CPU_ISA_H_

#if defined(__x86_64__) || defined(__i386__)
#define PR_X86 1
#else
#define PR_X86 0
#endif
#if defined(__aarch64__)
#define PR_ARM 1
#else
#define PR_ARM 0
#endif
/* The sve path needs GCC's target("+sve") (clang's aarch64 target attribute
 * differs) and Linux's hardware capabilities to tell whether the CPU has SVE. */
#if PR_ARM && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define PR_SVE 1
#else
#define PR_SVE 0
#endif

/* x86 runs scalar < avx2 < avx512, aarch64 scalar < neon (Advanced SIMD, which
 * every aarch64 CPU has) < sve (where the CPU has SVE). */
enum {
  PR_ISA_SCALAR = 0,
  PR_ISA_AVX2 = 1,
  PR_ISA_AVX512 = 2,
  PR_ISA_NEON = 3,
  PR_ISA_SVE = 4,
  PR_ISA_COUNT = 5
};

/* The path the kernels take: chosen at load time (CPU features, then PRECIS_CPU_ISA),
 * or as pr_cpu_isa_force (step_cpu.h) last set it. */
int pr_isa(void);

/* The best path this CPU runs, whatever PRECIS_CPU_ISA asks for. */
int pr_isa_hardware(void);

#endif /* PRECIS_CPU_ISA_H_ */
