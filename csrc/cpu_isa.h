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

/* The attributes each path's functions are compiled with. aarch64's baseline has
 * Advanced SIMD, which GCC vectorizes with: the neon path is the loops as they are; the
 * scalar one, the reference the others are checked against, is kept scalar. The sve
 * path has the same loops, which GCC vectorizes vector-length-agnostic (whilelo
 * predicates govern every iteration, the tail included; one binary for any vector
 * length, 128 bits on Grace), not for a fixed width. */
#define PR_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PR_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define PR_TARGET_SVE __attribute__((target("+sve")))
#if PR_ARM
#define PR_SCALAR_ATTRS __attribute__((optimize("no-tree-vectorize")))
#else
#define PR_SCALAR_ATTRS
#endif

/* A kernel file's functions for each path this build compiles: PR_EACH_ISA(X) expands
 * X(suffix, path, attributes) once per path; PR_ISA_TABLE(T) is the initializer of an
 * array indexed by PR_ISA_INDEX(path), T(suffix) its entries (a path this build has
 * not compiled gets the scalar one's, or neon's: never picked). */
#if PR_X86
#define PR_EACH_ISA(X) \
  X(scalar, PR_ISA_SCALAR, PR_SCALAR_ATTRS) \
  X(avx2, PR_ISA_AVX2, PR_TARGET_AVX2) X(avx512, PR_ISA_AVX512, PR_TARGET_AVX512)
#define PR_ISA_TABLE(T) {T(scalar), T(avx2), T(avx512)}
#elif PR_ARM && PR_SVE
#define PR_EACH_ISA(X) \
  X(scalar, PR_ISA_SCALAR, PR_SCALAR_ATTRS) X(neon, PR_ISA_NEON, ) X(sve, PR_ISA_SVE, PR_TARGET_SVE)
#define PR_ISA_TABLE(T) {T(scalar), T(scalar), T(scalar), T(neon), T(sve)}
#elif PR_ARM
#define PR_EACH_ISA(X) X(scalar, PR_ISA_SCALAR, PR_SCALAR_ATTRS) X(neon, PR_ISA_NEON, )
#define PR_ISA_TABLE(T) {T(scalar), T(scalar), T(scalar), T(neon), T(neon)}
#else
#define PR_EACH_ISA(X) X(scalar, PR_ISA_SCALAR, PR_SCALAR_ATTRS)
#define PR_ISA_TABLE(T) {T(scalar)}
#endif
#define PR_ISA_INDEX(isa) (PR_X86 || PR_ARM ? (isa) : PR_ISA_SCALAR)

/* The path the kernels take: chosen at load time (CPU features, then PRECIS_CPU_ISA),
 * or as pr_cpu_isa_force (step_cpu.h) last set it. */
int pr_isa(void);

/* The best path this CPU runs, whatever PRECIS_CPU_ISA asks for. */
int pr_isa_hardware(void);

#endif /* PRECIS_CPU_ISA_H_ */
