/* arm_instructions.c - the step bench/arm_instructions.py counts under qemu: one
 * tensor of NUMEL elements in one of the fused kernels' layouts (index of
 * pr_fused_layouts in csrc/step_cpu.c, bench/policies.py's order), STEPS steps,
 * one thread, on the path precis_cpu_isa() names (PRECIS_CPU_ISA picks it).
 *
 *   arm_instructions LAYOUT NUMEL STEPS
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "precis/precis.h"

static uint16_t bf16_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (uint16_t)(u >> 16);
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s LAYOUT(0-5) NUMEL STEPS\n", argv[0]);
    return 2;
  }
  const int layout = atoi(argv[1]), steps = atoi(argv[3]);
  const int64_t n = atoll(argv[2]);
  if (layout < 0 || layout > 5 || n < 1 || steps < 1) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  /* fp32; bf16 default; remainders; fp8 moments; fp8 + remainders; fp16 moments */
  const int fp32 = layout == 0, remainders = layout == 2 || layout == 4;
  const precis_dtype_t param = fp32 ? PRECIS_DTYPE_FP32 : PRECIS_DTYPE_BF16;
  const precis_dtype_t master = fp32 ? PRECIS_DTYPE_FP32
                                     : remainders ? PRECIS_DTYPE_INT16 : PRECIS_DTYPE_FP32;
  const precis_dtype_t moment = fp32                          ? PRECIS_DTYPE_FP32
                                : layout == 3 || layout == 4 ? PRECIS_DTYPE_FP8_E4M3
                                : layout == 5                ? PRECIS_DTYPE_FP16
                                                             : PRECIS_DTYPE_BF16;
  const size_t psize = fp32 ? 4 : 2;
  const size_t msize = moment == PRECIS_DTYPE_FP32 ? 4 : moment == PRECIS_DTYPE_FP8_E4M3 ? 1 : 2;
  const int scaled = moment == PRECIS_DTYPE_FP8_E4M3 || moment == PRECIS_DTYPE_FP16;
  void* p = calloc(n, psize);
  void* g = calloc(n, psize);
  void* mst = calloc(n, 4);
  void* m = calloc(n, msize);
  void* v = calloc(n, msize);
  float* m_scales = calloc(n / 128 + 1, 4);
  float* v_scales = calloc(n / 128 + 1, 4);
  if (!p || !g || !mst || !m || !v || !m_scales || !v_scales) return 1;
  for (int64_t i = 0; i < n; i++) { /* gradients within +-1e-3, params within +-0.02 */
    const uint32_t h = (uint32_t)i * 2654435761u;
    const float gv = (float)(int32_t)h * 4.6e-13f;
    const float pv = (float)(int32_t)(h ^ 0x5bd1e995u) * 9.3e-12f;
    if (fp32) {
      ((float*)g)[i] = gv;
      ((float*)p)[i] = pv;
    } else {
      ((uint16_t*)g)[i] = bf16_bits(gv);
      ((uint16_t*)p)[i] = bf16_bits(pv);
      if (!remainders) ((float*)mst)[i] = pv;
    }
  }
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.num_threads = 1;
  cfg.weight_decay = 0.01;
  precis_step_tensors_t t = PRECIS_STEP_TENSORS_INIT;
  void* params[1] = {p};
  const void* grads[1] = {g};
  void* masters[1] = {mst};
  void* exp_avgs[1] = {m};
  void* exp_avg_sqs[1] = {v};
  float* exp_avg_scales[1] = {m_scales};
  float* exp_avg_sq_scales[1] = {v_scales};
  int64_t numels[1] = {n}, step[1];
  t.count = 1;
  t.param_dtype = t.grad_dtype = param;
  t.master_dtype = master;
  t.exp_avg_dtype = t.exp_avg_sq_dtype = moment;
  t.params = params;
  t.grads = grads;
  t.masters = fp32 ? NULL : masters;
  t.exp_avgs = exp_avgs;
  t.exp_avg_sqs = exp_avg_sqs;
  t.exp_avg_scales = scaled ? exp_avg_scales : NULL;
  t.exp_avg_sq_scales = scaled ? exp_avg_sq_scales : NULL;
  t.numels = numels;
  t.steps = step;
  for (int s = 1; s <= steps; s++) {
    step[0] = s;
    if (precis_step(&cfg, &t, NULL) != PRECIS_OK) {
      fprintf(stderr, "precis_step: %s\n", precis_last_error());
      return 1;
    }
  }
  const char* isa = NULL;
  precis_cpu_isa(&isa);
  printf("%s\n", isa);
  return 0;
}
