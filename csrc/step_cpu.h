/* step_cpu.h - internal hooks of the CPU step (step_cpu.c, cpu_isa.c) for the C tests;
 * not public ABI.
 * Default visibility so that a test linked against the core library (Bazel links
 * cc_tests dynamically) finds them; exports.lds keeps them out of libprecis.so. */
#ifndef PRECIS_STEP_CPU_H_
#define PRECIS_STEP_CPU_H_

#ifdef __cplusplus
extern "C" {
#endif

/* Force the SIMD path of the CPU kernels: "scalar", "avx2", "avx512", or NULL to
 * choose again as at load time (CPU features, then PRECIS_CPU_ISA, read anew).
 * Returns 0, or -1 (nothing changed) for an unknown name or a path this CPU
 * cannot run. Not thread-safe: for tests. */
#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
int pr_cpu_isa_force(const char* name);

/* 1: every step runs the generic kernel (the staged tiles), whatever its layout; 0:
 * the fused kernels where a layout has one (the default). Returns 0. Not thread-safe:
 * for tests (the fused kernels must give the generic one's bits). */
#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
int pr_cpu_generic_force(int generic);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PRECIS_STEP_CPU_H_ */
