/*
 * adam_math.h - the Adam/AdamW element math shared by the CPU kernel
 * (adam_cpu.c) and the CUDA kernels: the one place where the update is written.
 *
 * Everything here is static inline and usable from C11 and CUDA (PRECIS_HD),
 * except precis_adam_hyper_from_config, which is host code.
 * precis_adam_consts_make runs on the host once per tensor, and on the GPU
 * where lr and the step live in device memory (CUDA graphs).
 *
 * The update follows torch 2.13's torch.optim.Adam / AdamW on the CPU in its
 * default mode (foreach and fused off: _single_tensor_adam) operation by
 * operation, in fp32:
 *
 *   g  = grad * inv_grad_scale            (negated when maximizing)
 *   Adam:  g = fma(wd, p, g)              grad.add(param, alpha=wd)
 *   AdamW: p = p * (1 - lr * wd)          param.mul_(1 - lr * wd)
 *   m  = fma(w, g - m, m)                 exp_avg.lerp_(grad, w = 1 - beta1),
 *        fma(w - 1, g - m, g) if w >= 0.5   torch's lerp from the nearer end
 *   v  = fma((1 - beta2) * g, g, v * beta2)   .mul_(b2).addcmul_(g, g, 1-b2)
 *   AMSGrad: vmax = maximum(vmax, v)      torch.maximum(max_exp_avg_sq, exp_avg_sq)
 *   denom = sqrt(v or vmax) / sqrt(1 - beta2^step) + eps
 *   p  = p + (-lr / (1 - beta1^step)) * m / denom   param.addcdiv_(m, denom, -step_size)
 *
 * except the denominator where m or v is stored in fewer bits than fp32, which cannot
 * give torch's bits: fma(sqrt(v), 1 / sqrt(1 - beta2^step), eps), one division
 * (precis_adam_param). The FMAs above are where torch's CPU kernels fuse (their AVX2/AVX512 vectors and,
 * compiled with contraction, their scalar tails alike); everything else is
 * rounded op by op. torch's fp32 sqrt on x86 is MKL's vmsSqrt, within an ulp
 * but not always correctly rounded: the CPU kernel can take it as
 * precis_adam_config_t.cpu_sqrt (the glue does); with it, fp32 results are
 * torch's bits. Every other a*b+c must stay unfused: GCC does not contract in
 * ISO C mode (-std=c11 implies -ffp-contract=off); nvcc contracts by default,
 * so tools/build_cuda.sh passes -fmad=false (which covers the products of the
 * conversions too, e.g. a dequantized q * s), the products here go through
 * PRECIS_FMUL / PRECIS_DMUL, which device code computes with __fmul_rn /
 * __dmul_rn (never contracted, whatever the flags), and the fused ones through
 * PRECIS_FMA: the GPU gives the CPU's bits (with IEEE sqrt). (On an
 * x86 CPU without FMA the scalar path pays for a libm fmaf; still exact.)
 */
#ifndef PRECIS_ADAM_MATH_H_
#define PRECIS_ADAM_MATH_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "precis/precis.h"
#include "precis_convert.h"

/* a * b, rounded, never fused with a following add (see above); a * b + c
 * rounded once. */
#if defined(__CUDA_ARCH__)
#define PRECIS_FMUL(a, b) __fmul_rn((a), (b))
#define PRECIS_DMUL(a, b) __dmul_rn((a), (b))
#define PRECIS_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define PRECIS_FMUL(a, b) ((a) * (b))
#define PRECIS_DMUL(a, b) ((a) * (b))
#define PRECIS_FMA(a, b, c) fmaf((a), (b), (c))
#endif

/* The one-state rules' element functions (below) are always inlined on the CPU: GCC 12
 * left precis_sgd_update out of a one-pass loop, as a call per element to a clone that
 * calls libm's fmaf (the CPU kernels' fused rule tiles, adam_cpu.c). The CUDA
 * compilers (nvcc, and the CPU emulator's C++) decide as before. Inlining changes no
 * bits. */
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__cplusplus)
#define PRECIS_CPU_INLINE __attribute__((always_inline))
#else
#define PRECIS_CPU_INLINE
#endif

/* ---- per-step constants ------------------------------------------------ */

/* The hyperparameters of one call, as torch holds them (Python floats). */
typedef struct precis_adam_hyper {
  double lr, beta1, beta2, eps, weight_decay;
  float inv_grad_scale;
  int decoupled, maximize, lr_float32;
  int rule, nesterov; /* precis_rule_t; the one-state rules' fields below */
  double momentum, dampening;
} precis_adam_hyper_t;

/* cfg->rule and the fields after it where cfg's size covers them, else Adam's. */
static inline int precis_adam_config_has_rule(const precis_adam_config_t* cfg) {
  return cfg->size >= offsetof(precis_adam_config_t, dampening) + sizeof cfg->dampening;
}

static inline precis_adam_hyper_t precis_adam_hyper_from_config(const precis_adam_config_t* cfg) {
  precis_adam_hyper_t h;
  h.lr = cfg->lr;
  h.beta1 = cfg->beta1;
  h.beta2 = cfg->beta2;
  h.eps = cfg->eps;
  h.weight_decay = cfg->weight_decay;
  h.inv_grad_scale = cfg->inv_grad_scale;
  h.decoupled = cfg->decoupled_weight_decay != 0;
  h.maximize = cfg->maximize != 0;
  h.lr_float32 = cfg->lr_float32 != 0;
  h.rule = PRECIS_RULE_ADAM;
  h.nesterov = 0;
  h.momentum = 0.0;
  h.dampening = 0.0;
  if (precis_adam_config_has_rule(cfg)) {
    h.rule = cfg->rule;
    h.nesterov = cfg->nesterov != 0;
    h.momentum = cfg->momentum;
    h.dampening = cfg->dampening;
  }
  return h;
}

/* What a step's rule reads beyond params and grads (precis.h, precis_rule_t), from a
 * checked config: m (exp_avgs), v (exp_avg_sqs), the master (the rules that write the
 * param), an output table, per-tensor lr scales. Host code: the CPU and CUDA checks and the
 * glue's (torch_ext/csrc) read this one copy. */
typedef struct pr_rule_use {
  int rule, m, v, param, output, lr_scales;
} pr_rule_use_t;

static inline int pr_adam_rule(const precis_adam_config_t* cfg) {
  return precis_adam_config_has_rule(cfg) ? cfg->rule : PRECIS_RULE_ADAM;
}

static inline pr_rule_use_t pr_rule_use(const precis_adam_config_t* cfg) {
  pr_rule_use_t u;
  u.rule = pr_adam_rule(cfg);
  u.m = u.rule != PRECIS_RULE_SGD || cfg->momentum != 0.0;
  u.v = u.rule == PRECIS_RULE_ADAM;
  u.param = u.rule != PRECIS_RULE_MUON_MOMENTUM;
  u.output = u.rule == PRECIS_RULE_MUON_MOMENTUM;
  u.lr_scales = u.rule == PRECIS_RULE_SGD || u.rule == PRECIS_RULE_LION;
  return u;
}

static inline const char* pr_rule_name(int rule) {
  static const char* const names[PRECIS_RULE_COUNT] = {"adam", "sgd", "lion", "muon_momentum"};
  return rule >= 0 && rule < PRECIS_RULE_COUNT ? names[rule] : "unknown";
}

/* Per-tensor constants of one step, each rounded to float where torch rounds
 * its Python-float scalars. Plain data: pass it to a CUDA kernel by value. */
typedef struct precis_adam_consts {
  float grad_mul;        /* inv_grad_scale, negated when maximizing (exact) */
  float wd_adam;         /* the L2 coefficient (Adam, SGD); 0 when decoupled */
  float decay;           /* decoupled decay 1 - lr*wd (AdamW, SGDW, Lion); else 1 */
  float lerp_coef;       /* lerp weight w = 1 - beta1, or w - 1 when lerping from g */
  int32_t lerp_from_g;   /* torch's lerp: |w| >= 0.5 starts from the end point g */
  float beta2, one_minus_beta2;
  float bias2_sqrt;      /* (1 - beta2^step) ** 0.5 */
  float inv_bias2_sqrt;  /* 1 / bias2_sqrt, in float (precis_adam_param's one-division form) */
  float neg_step_size;   /* -(lr / (1 - beta1^step)); the one-state rules: -lr */
  float eps;
  /* The one-state rules (precis_rule_t); Adam reads none of these. */
  int32_t rule;
  int32_t nesterov;
  int32_t first_step;    /* SGD: step 1 starts the buffer from g */
  float momentum;        /* SGD's momentum */
  float one_minus_dampening;
  float beta1, one_minus_beta1; /* Lion */
  float out_lerp_coef;   /* Muon's Nesterov lerp(g, m, momentum), as lerp_coef */
  int32_t out_lerp_from_m;
} precis_adam_consts_t;

/* Tensor i's own step lr for SGD and Lion, lr * scale (precis_adam_tensors_t.lr_scales):
 * torch's `lr * ratio` of Muon's adjusted lr, in double (a float32 tensor lr: in float,
 * as a float32 tensor times a Python float), then -lr rounded to float, as torch's
 * add_(d, alpha=-lr). lr is the step's (the host's, or the device's). */
static inline PRECIS_HD void precis_rule_consts_lr(precis_adam_consts_t* c, double lr,
                                                   double scale, int lr_float32) {
  c->neg_step_size = lr_float32 ? -((float)lr * (float)scale) : (float)-(lr * scale);
}

/* torch derives these in Python: 1 - beta ** step with float step (libm pow),
 * bias_correction2 ** 0.5 (pow again), lr / bias_correction1. A float32 tensor
 * lr makes lr * wd, 1 - lr * wd and lr / bias_correction1 float32 tensor ops. */
static inline PRECIS_HD precis_adam_consts_t precis_adam_consts_make(const precis_adam_hyper_t* h,
                                                                     int64_t step) {
  precis_adam_consts_t c;
  double bias1 = 1.0 - pow(h->beta1, (double)step);
  double bias2 = 1.0 - pow(h->beta2, (double)step);
  float w = (float)(1.0 - h->beta1);
  /* Lion's weight decay is always AdamW's; Muon's momentum half has none. */
  const int decoupled = h->decoupled || h->rule == PRECIS_RULE_LION;
  c.grad_mul = h->maximize ? -h->inv_grad_scale : h->inv_grad_scale;
  /* With the unused term at 0 or 1 the update stays branch-free and exact:
   * g + 0*p == g and p*1 == p for finite p. */
  c.wd_adam = decoupled ? 0.0f : (float)h->weight_decay;
  if (h->lr_float32) {
    float lr = (float)h->lr;
    c.decay = decoupled ? 1.0f - PRECIS_FMUL(lr, (float)h->weight_decay) : 1.0f;
    c.neg_step_size = -(lr / (float)bias1);
  } else {
    c.decay = decoupled ? (float)(1.0 - PRECIS_DMUL(h->lr, h->weight_decay)) : 1.0f;
    c.neg_step_size = (float)-(h->lr / bias1);
  }
  c.lerp_from_g = !(fabsf(w) < 0.5f);
  c.lerp_coef = c.lerp_from_g ? w - 1.0f : w; /* exact: w is in [0.5, 1] there */
  c.beta2 = (float)h->beta2;
  c.one_minus_beta2 = (float)(1.0 - h->beta2);
  c.bias2_sqrt = (float)pow(bias2, 0.5);
  c.inv_bias2_sqrt = 1.0f / c.bias2_sqrt;
  c.eps = (float)h->eps;
  c.rule = h->rule;
  c.nesterov = h->nesterov;
  c.first_step = step <= 1;
  c.momentum = (float)h->momentum;
  c.one_minus_dampening = (float)(1.0 - h->dampening);
  c.beta1 = (float)h->beta1;
  c.one_minus_beta1 = (float)(1.0 - h->beta1);
  c.out_lerp_coef = 0.0f;
  c.out_lerp_from_m = 0;
  if (h->rule == PRECIS_RULE_SGD || h->rule == PRECIS_RULE_LION) {
    /* torch.optim.SGD: param.add_(d, alpha=-lr), the Python float rounded to float;
     * decoupled decay (SGDW, Lion, Muon's second half) as AdamW's. */
    precis_rule_consts_lr(&c, h->lr, 1.0, h->lr_float32);
  } else if (h->rule == PRECIS_RULE_MUON_MOMENTUM) {
    /* buf.lerp_(g, 1 - momentum), then grad.lerp(buf, momentum) for Nesterov. */
    float w = (float)(1.0 - h->momentum), wn = (float)h->momentum;
    c.lerp_from_g = !(fabsf(w) < 0.5f);
    c.lerp_coef = c.lerp_from_g ? w - 1.0f : w;
    c.out_lerp_from_m = !(fabsf(wn) < 0.5f);
    c.out_lerp_coef = c.out_lerp_from_m ? wn - 1.0f : wn;
    c.wd_adam = 0.0f;
    c.decay = 1.0f;
  }
  return c;
}


/* ---- the element update ------------------------------------------------ */

/* Split in two so a CPU loop can take the square roots of a whole tile at once
 * in between (one vector instruction, or the caller's cpu_sqrt). */

/* Weight decay and the moments; *p gets AdamW's decay. g is the raw gradient. */
static inline PRECIS_HD void precis_adam_moments(const precis_adam_consts_t* c, float g,
                                                 float* p, float* m, float* v) {
  g = PRECIS_FMUL(g, c->grad_mul);
  g = PRECIS_FMA(c->wd_adam, *p, g);
  *p = PRECIS_FMUL(*p, c->decay);
  *m = PRECIS_FMA(c->lerp_coef, g - *m, c->lerp_from_g ? g : *m);
  *v = PRECIS_FMA(PRECIS_FMUL(c->one_minus_beta2, g), g, PRECIS_FMUL(*v, c->beta2));
}

/* Whether a layout's param step takes torch's form: m and v in fp32, whose steps give
 * torch's bits. Moments stored in fewer bits cannot, and take the cheaper form. */
static inline PRECIS_HD int precis_adam_torch_form(int m_dtype, int v_dtype) {
  return m_dtype == PRECIS_DTYPE_FP32 && v_dtype == PRECIS_DTYPE_FP32;
}

/* The param step, given the new m and sqrt of the new v. torch_form
 * (precis_adam_torch_form): torch's two divisions, sqrt_v / bias2_sqrt + eps, then
 * the step over it. Else one division: the denominator sqrt_v * (1 / bias2_sqrt) +
 * eps, fused (within an ulp of torch's; a division costs about 10 SASS
 * instructions an element in the CUDA kernels, and 5% of a bf16 default or fp8
 * step on an AMD EPYC Zen 4, bench/RESULTS.md). */
static inline PRECIS_HD float precis_adam_param(const precis_adam_consts_t* c, int torch_form,
                                                float p, float m, float sqrt_v) {
  float denom = torch_form ? sqrt_v / c->bias2_sqrt + c->eps
                           : PRECIS_FMA(sqrt_v, c->inv_bias2_sqrt, c->eps);
  return p + PRECIS_FMUL(c->neg_step_size, m) / denom;
}

/* AMSGrad's running max of v, as torch.maximum: the larger, NaN when either
 * is NaN (a lost state shows). */
static inline PRECIS_HD float precis_adam_max(float max_v, float v) {
  return (v > max_v || v != v) ? v : max_v;
}

/* ---- the one-state rules (precis.h, precis_rule_t) ----------------------- */

/* SGD, torch.optim.SGD's single-tensor path op by op: grad.add(param, alpha=wd)
 * and buf.mul_(momentum).add_(g, alpha=1 - dampening) fused as torch's CPU add
 * fuses, param.add_(d, alpha=-lr). *m is the momentum buffer, untouched when
 * has_momentum is 0. */
static inline PRECIS_CPU_INLINE PRECIS_HD void precis_sgd_update(const precis_adam_consts_t* c,
                                                                 int has_momentum, float g,
                                                                 float* p, float* m) {
  float d;
  g = PRECIS_FMUL(g, c->grad_mul);
  g = PRECIS_FMA(c->wd_adam, *p, g);
  d = g;
  if (has_momentum) {
    *m = c->first_step ? g : PRECIS_FMA(c->one_minus_dampening, g, PRECIS_FMUL(*m, c->momentum));
    d = c->nesterov ? PRECIS_FMA(c->momentum, *m, g) : *m;
  }
  *p = PRECIS_FMA(c->neg_step_size, d, PRECIS_FMUL(*p, c->decay));
}

/* sign(x): +-1, 0 for +-0, NaN for NaN (a lost state shows). */
static inline PRECIS_CPU_INLINE PRECIS_HD float precis_sign(float x) {
  return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x == 0.0f ? 0.0f : x;
}

/* Lion: the update's sign from the beta1 interpolation, m from beta2's. */
static inline PRECIS_CPU_INLINE PRECIS_HD void precis_lion_update(const precis_adam_consts_t* c,
                                                                  float g, float* p, float* m) {
  float u;
  g = PRECIS_FMUL(g, c->grad_mul);
  u = PRECIS_FMA(c->one_minus_beta1, g, PRECIS_FMUL(c->beta1, *m));
  *p = PRECIS_FMA(c->neg_step_size, precis_sign(u), PRECIS_FMUL(*p, c->decay));
  *m = PRECIS_FMA(c->one_minus_beta2, g, PRECIS_FMUL(c->beta2, *m));
}

/* Muon's momentum: m = lerp(m, g, 1 - momentum) as torch's lerp; the returned
 * direction is m, or lerp(g, m, momentum) with Nesterov. */
static inline PRECIS_CPU_INLINE PRECIS_HD float precis_muon_momentum(const precis_adam_consts_t* c,
                                                                     float g, float* m) {
  g = PRECIS_FMUL(g, c->grad_mul);
  *m = PRECIS_FMA(c->lerp_coef, g - *m, c->lerp_from_g ? g : *m);
  if (!c->nesterov) return *m;
  return PRECIS_FMA(c->out_lerp_coef, *m - g, c->out_lerp_from_m ? *m : g);
}

/* ---- param remainders (docs/design.md section 4) ----------------------------- */

/* fp32 master bits hi:lo -> bf16 param = hi rounded to nearest (plus one when
 * lo, read as int16, is negative) and remainder = lo as int16. Exact both ways. */
static inline PRECIS_HD uint16_t precis_remainder_param(float master) {
  uint32_t u = precis_f32_bits(master);
  return (uint16_t)((u >> 16) + ((u >> 15) & 1u));
}

static inline PRECIS_HD int16_t precis_remainder_low(float master) {
  uint32_t lo = precis_f32_bits(master) & 0xFFFFu;
  return (int16_t)((int32_t)(lo ^ 0x8000u) - 0x8000); /* two's complement, no UB */
}

static inline PRECIS_HD float precis_remainder_master(uint16_t param, int16_t remainder) {
  uint32_t hi = (uint32_t)(uint16_t)(param - (remainder < 0 ? 1u : 0u));
  uint32_t lo = (uint32_t)(uint16_t)remainder;
  return precis_bits_f32((hi << 16) | lo);
}

/* 8-bit remainders (a 24-bit master: the bf16 param and one more byte of mantissa).
 * The fp32 master rounds to nearest even at bit 8 first (a NaN stays a quiet NaN,
 * never a carry into the sign); then the same split as above, one byte lower:
 * param = the 24-bit value's high half rounded to nearest, remainder = its low byte
 * as int8. Exact both ways for the 24-bit value. */
static inline PRECIS_HD uint32_t precis_master24_bits(float master) {
  uint32_t u = precis_f32_bits(master);
  uint32_t rounded = u + 0x7Fu + ((u >> 8) & 1u);
  return (master != master ? u | 0x00400000u : rounded) & 0xFFFFFF00u;
}

static inline PRECIS_HD uint16_t precis_remainder8_param(float master) {
  uint32_t u = precis_master24_bits(master);
  return (uint16_t)((u >> 16) + ((u >> 15) & 1u));
}

static inline PRECIS_HD int8_t precis_remainder8_low(float master) {
  uint32_t lo = (precis_master24_bits(master) >> 8) & 0xFFu;
  return (int8_t)((int32_t)(lo ^ 0x80u) - 0x80); /* two's complement, no UB */
}

static inline PRECIS_HD float precis_remainder8_master(uint16_t param, int8_t remainder) {
  uint32_t hi = (uint32_t)(uint16_t)(param - (remainder < 0 ? 1u : 0u));
  uint32_t lo = (uint32_t)(uint8_t)remainder;
  return precis_bits_f32((hi << 16) | (lo << 8));
}

/* ---- stochastic rounding fp32 -> bf16 ----------------------------------- */

/* A counter-based generator: the random number of an element depends only on
 * what the element is, never on how a call, thread or chunk reaches it: (seed,
 * the stream of its param, step, its index in the whole, unsharded param). So a
 * param stepped whole, in pieces (CPU offload), as an FSDP2 shard at any world
 * size, or as a slice with its global offset gets the same bits (docs/design.md
 * section 4). precis_sr_key mixes the seed, the stream and the step (host or
 * device, once per tensor); precis_sr_rand16 hashes in the low 32 bits of the
 * element's index with 32-bit integer ops only, which vectorize. The index's
 * high bits are in no key: elements 2^32 apart in one param share their random
 * numbers, which biases nothing (each rounding is unbiased on its own) and lets
 * a piece start anywhere, a 2^32 boundary inside a tile included. */
typedef struct precis_sr_key {
  uint32_t k0, k1;
} precis_sr_key_t;

static inline PRECIS_HD uint64_t precis_mix64(uint64_t x) { /* splitmix64 finalizer */
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

static inline PRECIS_HD uint32_t precis_hash32(uint32_t x) { /* "lowbias32", a bijection */
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

static inline PRECIS_HD precis_sr_key_t precis_sr_key(uint64_t seed, uint64_t stream,
                                                      int64_t step) {
  precis_sr_key_t k;
  uint64_t h = precis_mix64(seed + 0x9E3779B97F4A7C15ull);
  h = precis_mix64(h ^ stream);
  h = precis_mix64(h ^ (uint64_t)step);
  k.k0 = (uint32_t)h;
  k.k1 = (uint32_t)(h >> 32);
  return k;
}

/* Uniform in [0, 65535] for element index (low 32 bits) i. */
static inline PRECIS_HD uint32_t precis_sr_rand16(precis_sr_key_t k, uint32_t i) {
  return precis_hash32(precis_hash32(i + k.k0) ^ k.k1) >> 16;
}

/* Add the random 16 bits below the kept ones and truncate: rounds up with
 * probability (dropped bits) / 2^16, so E[result] = x within a binade. Inf
 * stays inf; NaN gets round-to-nearest's code (its sign and top payload bits,
 * quiet), never a carry into the sign bit. Written as precis_f32_to_bf16_rn's
 * select: one compare and one select per vector, where the round-to-nearest
 * path computed in full cost a vector loop five more operations. */
static inline PRECIS_HD uint16_t precis_f32_to_bf16_sr(float x, uint32_t rand16) {
  uint32_t u = precis_f32_bits(x);
  uint32_t r = x != x ? u | 0x00400000u : u + rand16;
  return (uint16_t)(r >> 16);
}

/* ---- unbiased moment stores (docs/design.md section 4) ------------------- */

/* A moment whose format cannot hold one step's change is stored with stochastic
 * rounding, so that its expected value is AdamW's: v always (its decay by
 * 1 - beta2 per step is below half a bf16 / fp16 / fp8 spacing, and rounding to
 * nearest would keep v from decaying), m in fp8 (m8's neighbours are 1.6-3.1%
 * apart, and a step, 10% of the gap to g, is below half of that wherever g is
 * within 8-16% of m: rounding to nearest would drop it). Adam's bf16 and fp16 m
 * round to nearest (the step moves m by 10% of the gap to g, many spacings), and so
 * do AMSGrad's max (a max, not an average) and precis_moment_encode (one store).
 * The one-state rules' momentum (rule not Adam) rounds stochastically in every
 * dtype but fp32: Lion's moves by 1% of the gap to g (beta2 0.99), Muon's by 5%,
 * SGD's settles at g / (1 - momentum), and on a steady gradient rounding to nearest
 * left bf16 momentum 0.785x (Lion), 0.950x (Muon), 0.976x (SGD) of fp32's
 * (bench/momentum_fidelity.py, docs/design.md section 4). */
static inline PRECIS_HD int precis_moment_store_sr(int dtype, int second, int rule) {
  if (dtype == PRECIS_DTYPE_FP32) return 0;
  return rule != PRECIS_RULE_ADAM || second || dtype == PRECIS_DTYPE_FP8_E4M3;
}

/* The moments' random stream, apart from the params' (precis_sr_key). */
enum { PRECIS_STREAM_MOMENTS = 1 };

/* The moments' key of the param of stream `stream`. The step is not in it
 * (precis_moment_rand adds it): its slot holds -PRECIS_STREAM_MOMENTS, which no
 * step (>= 1) takes, so it differs from the params' keys for every stream,
 * whatever its bits. */
static inline PRECIS_HD precis_sr_key_t precis_moment_key(uint64_t seed, uint64_t stream) {
  return precis_sr_key(seed, stream, -(int64_t)PRECIS_STREAM_MOMENTS);
}

#define PRECIS_WEYL32 0x9E3779B9u /* 2^32 / golden ratio */

/* The one hash of element i (low 32 bits of its index) per step, which feeds
 * both moments' roundings: m takes its low 16 bits, v its high 16 (one hash per
 * moment was most of an fp8 step's arithmetic). The hash is a bijection of i, so
 * over 2^32 elements every pair of halves comes once: the halves are independent
 * and uniform, and m's rounding is uncorrelated with v's (docs/design.md
 * section 4). */
static inline PRECIS_HD uint32_t precis_moment_hash(precis_sr_key_t k, uint32_t i) {
  return precis_hash32(i + k.k0) ^ k.k1;
}

/* The r (uniform in [0, 2^32)) of moment `second` (0: m, 1: v) at step: its 16
 * bits of the element's hash on top, plus step * 2^32/golden ratio (a Weyl
 * sequence). At every step the top 16 bits are uniform across elements and the
 * low 16 a constant of the step, so a rounding that drops more than 16 bits is
 * biased by at most 2^-16 of a spacing (m8 and v8 drop 18), and not at all
 * over the steps; bf16 and fp16 drop 16 and 13. Over
 * one element's steps r is evenly spread rather than independent, so the
 * rounding errors of successive stores partly cancel instead of adding up like a
 * random walk: the spread of fp8 sqrt(v) around AdamW's shrinks by a fifth
 * (docs/design.md section 4). */
static inline PRECIS_HD uint32_t precis_moment_rand(uint32_t hash, int second, int64_t step) {
  uint32_t half = second ? hash & 0xFFFF0000u : hash << 16;
  return half + (uint32_t)step * PRECIS_WEYL32;
}

/* ---- unsigned minifloat codes ------------------------------------------- */

/* code = e << mb | mantissa with exponent bias `bias`; e = 0 is subnormal
 * (mantissa * 2^(1 - bias - mb)); no inf, no NaN. Used for the magnitudes of
 * fp16 and fp8 E4M3 and for the fp8 moments' own codes (below). */
static inline PRECIS_HD float precis_ufloat_to_f32(uint32_t code, int mb, int bias) {
  float sub = (float)(int32_t)(code & ((1u << mb) - 1u)) *
              precis_bits_f32((uint32_t)(127 + 1 - bias - mb) << 23);
  uint32_t normal = (code << (23 - mb)) + ((uint32_t)(127 - bias) << 23);
  /* A mask, not a select: gcc vectorizes this form in every loop it is inlined
   * into (a ternary kept bench/adam_reference_loop.c's fp8 loop scalar, 2.5x slower),
   * and the int32 conversion is AVX2's (no unsigned one before AVX-512). */
  uint32_t is_sub = 0u - (uint32_t)((code >> mb) == 0);
  return precis_bits_f32((precis_f32_bits(sub) & is_sub) | (normal & ~is_sub));
}

/* a >= 0 -> code rounded to nearest even, saturating at max_code (so do inf
 * and NaN: a NaN moment shows through its block's NaN scale). */
static inline PRECIS_HD uint32_t precis_f32_to_ufloat_rn(float a, int mb, int bias,
                                                          uint32_t max_code) {
  const int drop = 23 - mb;
  uint32_t u = precis_f32_bits(a);
  uint32_t normal =
      (u - ((uint32_t)(127 - bias) << 23) + ((1u << (drop - 1)) - 1u) + ((u >> drop) & 1u)) >> drop;
  /* subnormal: adding 2^(24 - bias - mb), whose ulp is the subnormal step, makes
   * the FPU round to nearest even */
  float magic = precis_bits_f32((uint32_t)(127 + 24 - bias - mb) << 23);
  uint32_t sub = precis_f32_bits(a + magic) - precis_f32_bits(magic);
  uint32_t is_sub = 0u - (uint32_t)(u < ((uint32_t)(128 - bias) << 23)); /* a mask: see above */
  uint32_t code = (sub & is_sub) | (normal & ~is_sub);
  return code > max_code ? max_code : code;
}

/* a >= 0 -> code rounded up with probability (a - lo) / (hi - lo) for r
 * uniform in [0, 2^32): E[decoded code] = a below max_code, which saturates
 * (so do inf and NaN). a is written in fixed point with `drop` bits below the
 * code's last place, r's top `drop` bits are added, and the fraction is
 * truncated: integer ops only, which vectorize. Normals are their bits less the
 * bias; subnormals the bits that adding the smallest normal 2^(1 - bias) gains
 * (its ulp is 2^-drop of a subnormal step, so the FPU rounds a onto that grid:
 * a bias of at most 2^-(drop + 1) of a step, far below precis_moment_rand's
 * 2^-16). */
static inline PRECIS_HD uint32_t precis_f32_to_ufloat_sr(float a, uint32_t r, int mb, int bias,
                                                          uint32_t max_code) {
  const int drop = 23 - mb;
  const uint32_t min_normal = (uint32_t)(128 - bias) << 23;
  uint32_t u = precis_f32_bits(a);
  uint32_t normal = u - ((uint32_t)(127 - bias) << 23);
  uint32_t sub = precis_f32_bits(a + precis_bits_f32(min_normal)) - min_normal;
  uint32_t below = 0u - (uint32_t)(u < min_normal); /* a mask: see precis_ufloat_to_f32 */
  uint32_t fixed = (sub & below) | (normal & ~below);
  uint32_t code = (fixed + (r >> (32 - drop))) >> drop;
  return code > max_code ? max_code : code;
}

/* ---- block-scaled moments (fp16, fp8) ----------------------------------- */

#define PRECIS_FP16_MAX 65504.0f

/* fp8 second moments are stored as sqrt(v) / s in a code of their own, "v8":
 * unsigned E3M5 (v is never negative: E4M3's sign bit would be wasted), bias 1,
 * so 5 mantissa bits (neighbours 1.6-3.1% apart, against E4M3's 6-12%) over
 * 7 binades (126 down to 1) plus 31 subnormal steps of 2^-5. With stochastic
 * rounding E4M3 left sqrt(v) 0.79-1.20x of AdamW's (p10-p90), v8 0.91-1.09x
 * (docs/design.md section 4). */
#define PRECIS_V8_MBITS 5
#define PRECIS_V8_BIAS 1
#define PRECIS_V8_MAX 126.0f
#define PRECIS_V8_MAX_CODE 0xFFu

static inline PRECIS_HD float precis_v8_to_f32(uint8_t code) {
  return precis_ufloat_to_f32(code, PRECIS_V8_MBITS, PRECIS_V8_BIAS);
}

/* fp8 first moments are stored as m / s in "m8": signed E2M5 (a sign bit and
 * v8's magnitudes less its top binade), bias 1, max 7.875, subnormals, no inf
 * or NaN codes. Its 5 mantissa bits (neighbours 1.6-3.1% apart) cut E4M3's
 * median relative error on real gradients from 5.6% to 1.68%; its 3 binades
 * plus subnormals (2^-5 of s) cover what a 128-element block of m spans
 * (docs/design.md section 4). */
#define PRECIS_M8_MBITS 5
#define PRECIS_M8_BIAS 1
#define PRECIS_M8_MAX 7.875f
#define PRECIS_M8_MAX_CODE 0x7Fu /* of the magnitude */

static inline PRECIS_HD float precis_m8_to_f32(uint8_t code) {
  float a = precis_ufloat_to_f32(code & 0x7Fu, PRECIS_M8_MBITS, PRECIS_M8_BIAS);
  return precis_bits_f32(precis_f32_bits(a) | ((uint32_t)(code & 0x80u) << 24));
}

/* m8's code of q = m / s, by its magnitude's code mag (rounded either way): the
 * sign of q on top, so -0 stays -0; a NaN q takes the largest magnitude (the
 * moment shows through its block's NaN scale). */
static inline PRECIS_HD uint8_t precis_m8_code(float q, uint32_t mag) {
  uint32_t u = precis_f32_bits(q);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint8_t)PRECIS_M8_MAX_CODE
                                         : (uint8_t)(((u >> 24) & 0x80u) | mag);
}

/* Stored bits of dtype -> fp32; for a moment, before its block scale: fp8 is
 * m8 (m) or v8 (second). The CUDA kernels' one conversion on load. */
static inline PRECIS_HD float precis_moment_code_f32(int dtype, int second, uint32_t bits) {
  switch (dtype) {
    case PRECIS_DTYPE_FP32: return precis_bits_f32(bits);
    case PRECIS_DTYPE_FP16: return precis_f16_to_f32((uint16_t)bits);
    case PRECIS_DTYPE_BF16: return precis_bf16_to_f32((uint16_t)bits);
    default:
      return second ? precis_v8_to_f32((uint8_t)bits) : precis_m8_to_f32((uint8_t)bits);
  }
}

/* Largest finite value of a scaled moment's code. */
static inline PRECIS_HD float precis_moment_max(int is_fp8, int second) {
  return is_fp8 ? (second ? PRECIS_V8_MAX : PRECIS_M8_MAX) : PRECIS_FP16_MAX;
}

/* Blocks whose amax is below this are stored as zeros with s = 0, so that
 * max_representable / amax below stays finite. Only a first moment can be that
 * small: a non-zero fp32 v is >= 2^-149, so sqrt(v) >= 2^-74.5. */
#define PRECIS_MOMENT_AMAX_MIN 7.88860905221011805e-31f /* 2^-100 */

/* s = amax / max_representable; amax is max |m| or max sqrt(v) of the block.
 * An all-zero block gives s = 0; a NaN amax gives a NaN s (the state is lost,
 * and says so rather than turning into zeros). */
static inline PRECIS_HD float precis_block_scale(float amax, int is_fp8, int second) {
  return !(amax < PRECIS_MOMENT_AMAX_MIN) ? amax / precis_moment_max(is_fp8, second) : 0.0f;
}

/* What quantizing multiplies by: max_representable / amax (one division per
 * block instead of one per element), or 0 for a zero block, whose values are
 * all 0 (or below 2^-100) and must come out as 0, never 0 * inf = NaN. */
static inline PRECIS_HD float precis_block_multiplier(float amax, int is_fp8, int second) {
  return !(amax < PRECIS_MOMENT_AMAX_MIN) ? precis_moment_max(is_fp8, second) / amax : 0.0f;
}

/* For the second moment (x = sqrt(v) >= 0) a positive value never becomes
 * zero: it rounds up to the smallest subnormal code, so m / (sqrt(v) + eps)
 * stays bounded. q is the value before rounding, code its rounding. */
static inline PRECIS_HD uint16_t precis_moment_keep_f16(uint16_t code, float q, int second) {
  return ((second != 0) & (q > 0.0f) & (code == 0)) ? (uint16_t)1 : code; /* &: vectorizes */
}

static inline PRECIS_HD uint8_t precis_moment_keep_fp8(uint8_t code, float q, int second) {
  return ((second != 0) & (q > 0.0f) & (code == 0)) ? (uint8_t)1 : code; /* &: vectorizes */
}

/* Quantize one value to nearest: x * multiplier (~ x / s), rounded to nearest
 * even; fp8 m to m8, fp8 v to v8. */
static inline PRECIS_HD uint16_t precis_moment_q_f16(float x, float multiplier, int second) {
  float q = x * multiplier;
  return precis_moment_keep_f16(precis_f32_to_f16_rn(q), q, second);
}

static inline PRECIS_HD uint8_t precis_moment_q_fp8(float x, float multiplier, int second) {
  float q = x * multiplier;
  /* v8 takes |q|: sqrt(v) may be -0 */
  float a = precis_bits_f32(precis_f32_bits(q) & 0x7FFFFFFFu);
  uint8_t code = second ? (uint8_t)precis_f32_to_ufloat_rn(a, PRECIS_V8_MBITS, PRECIS_V8_BIAS,
                                                           PRECIS_V8_MAX_CODE)
                        : precis_m8_code(q, precis_f32_to_ufloat_rn(a, PRECIS_M8_MBITS,
                                                                    PRECIS_M8_BIAS,
                                                                    PRECIS_M8_MAX_CODE));
  return precis_moment_keep_fp8(code, q, second);
}

/* The same with stochastic rounding (precis_f32_to_ufloat_sr on the magnitude;
 * r from precis_moment_rand). NaN takes the round-to-nearest code. */
static inline PRECIS_HD uint16_t precis_moment_sr_f16(float x, float multiplier, int second,
                                                      uint32_t r) {
  float q = x * multiplier;
  uint32_t u = precis_f32_bits(q);
  uint32_t mag = precis_f32_to_ufloat_sr(precis_bits_f32(u & 0x7FFFFFFFu), r, 10, 15, 0x7BFFu);
  uint16_t code = (u & 0x7FFFFFFFu) > 0x7F800000u ? precis_f32_to_f16_rn(q)
                                                   : (uint16_t)(((u >> 16) & 0x8000u) | mag);
  return precis_moment_keep_f16(code, q, second);
}

static inline PRECIS_HD uint8_t precis_moment_sr_fp8(float x, float multiplier, int second,
                                                     uint32_t r) {
  float q = x * multiplier;
  float a = precis_bits_f32(precis_f32_bits(q) & 0x7FFFFFFFu);
  uint8_t code = second ? (uint8_t)precis_f32_to_ufloat_sr(a, r, PRECIS_V8_MBITS, PRECIS_V8_BIAS,
                                                           PRECIS_V8_MAX_CODE)
                        : precis_m8_code(q, precis_f32_to_ufloat_sr(a, r, PRECIS_M8_MBITS,
                                                                    PRECIS_M8_BIAS,
                                                                    PRECIS_M8_MAX_CODE));
  return precis_moment_keep_fp8(code, q, second);
}

/* Dequantize: m = q * s; v = (q * s)^2 for the second moment. */
static inline PRECIS_HD float precis_moment_dq(float q, float scale, int second) {
  float x = q * scale;
  return second ? x * x : x;
}

#endif /* PRECIS_ADAM_MATH_H_ */
