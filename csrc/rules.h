/*
 * rules.h - the update rules' element math shared by the CPU kernel (step_cpu.c)
 * and the CUDA kernels: the one place where each rule's update is written (Adam /
 * AdamW below; SGD, Lion and Muon's momentum after it). How the values are stored
 * (remainders, stochastic rounding, block-scaled fp16 / fp8 codes) is stores.h's.
 *
 * Everything here is static inline and usable from C11 and CUDA (PRECIS_HD),
 * except precis_step_hyper_from_config and the rule table (pr_rules and its helpers:
 * pr_rule_use, pr_rule_name, pr_rule_list, pr_rule_names_with), which are host code.
 * precis_step_consts_make runs on the host once per tensor, and on the GPU
 * where lr and the step live in device memory (CUDA graphs).
 *
 * The update follows torch 2.13's torch.optim.Adam / AdamW on the CPU in its
 * default mode (foreach and fused off: _single_tensor_adam) operation by
 * operation, in fp32:
 *
 *   g  = grad * inv_grad_scale            (negated when maximizing)
 *   Adam:  g = fma(wd, p, g)              grad.add(param, alpha=wd), if wd != 0
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
 * precis_step_config_t.cpu_sqrt (the glue does); with it, fp32 results are
 * torch's bits. Every other a*b+c must stay unfused: GCC does not contract in
 * ISO C mode (-std=c11 implies -ffp-contract=off); nvcc contracts by default,
 * so tools/build_cuda.sh passes -fmad=false (which covers the products of the
 * conversions too, e.g. a dequantized q * s), the products here go through
 * PRECIS_FMUL / PRECIS_DMUL, which device code computes with __fmul_rn /
 * __dmul_rn (never contracted, whatever the flags), and the fused ones through
 * PRECIS_FMA: the GPU gives the CPU's bits (with IEEE sqrt). (On an
 * x86 CPU without FMA the scalar path pays for a libm fmaf; still exact.)
 */
#ifndef PRECIS_RULES_H_
#define PRECIS_RULES_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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

/* g + wd * p rounded once where wd is not 0, else g: torch adds an L2 term only when
 * its weight decay is not 0, so a NaN or Inf param (0 * p is NaN) or a -0.0 gradient
 * (-0 + 0 * p is +0 where p >= 0) leaves the moments as torch's (a param whose lost
 * elements are set again steps on). wd is the decay rounded to float: one below the
 * smallest float (2^-150) is taken as none, where torch adds 0 * p. One select per
 * element (tools/sass_budget.py: about one SASS instruction; a predicated FMA by inline
 * PTX was one more in the fp8 kernels: ptxas set its predicate at every element). */
static inline PRECIS_HD float precis_l2(float wd, float p, float g) {
  return wd != 0.0f ? PRECIS_FMA(wd, p, g) : g;
}

/* The one-state rules' element functions (below) are always inlined on the CPU: GCC 12
 * left precis_sgd_update out of a one-pass loop, as a call per element to a clone that
 * calls libm's fmaf (the CPU kernels' fused rule tiles, step_cpu.c). The CUDA
 * compilers (nvcc, and the CPU emulator's C++) decide as before. Inlining changes no
 * bits. */
#if defined(__GNUC__) && !defined(__CUDACC__) && !defined(__cplusplus)
#define PRECIS_CPU_INLINE __attribute__((always_inline))
#else
#define PRECIS_CPU_INLINE
#endif

/* ---- per-step constants ------------------------------------------------ */

/* The hyperparameters of one call, as torch holds them (Python floats). */
typedef struct precis_step_hyper {
  double lr, beta1, beta2, eps, weight_decay;
  float inv_grad_scale;
  int decoupled, maximize, lr_float32;
  int rule, nesterov; /* precis_rule_t; the one-state rules' fields below */
  double momentum, dampening;
  double rule_hyper[PRECIS_RULE_HYPER_MAX]; /* cfg->rule_hyper, or zeros */
} precis_step_hyper_t;

/* From here to pr_rule_use: host code, which NVRTC (reading device code only, with no C
 * library: tools/build_cuda12.py) does not see. */
#ifndef __CUDACC_RTC__
/* cfg->rule and the fields after it where cfg's size covers them, else Adam's. */
static inline int precis_step_config_has_rule(const precis_step_config_t* cfg) {
  return cfg->size >= offsetof(precis_step_config_t, dampening) + sizeof cfg->dampening;
}

/* cfg->rule_hyper, where cfg's size covers it. */
static inline int precis_step_config_has_rule_hyper(const precis_step_config_t* cfg) {
  return cfg->size >= offsetof(precis_step_config_t, rule_hyper) + sizeof cfg->rule_hyper;
}

static inline precis_step_hyper_t precis_step_hyper_from_config(const precis_step_config_t* cfg) {
  precis_step_hyper_t h;
  int k;
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
  if (precis_step_config_has_rule(cfg)) {
    h.rule = cfg->rule;
    h.nesterov = cfg->nesterov != 0;
    h.momentum = cfg->momentum;
    h.dampening = cfg->dampening;
  }
  for (k = 0; k < PRECIS_RULE_HYPER_MAX; ++k) {
    h.rule_hyper[k] = precis_step_config_has_rule_hyper(cfg) ? cfg->rule_hyper[k] : 0.0;
  }
  return h;
}

/* ---- the rule table ---------------------------------------------------------
 *
 * What each rule (precis.h, precis_rule_t) keeps, writes and accepts: the one
 * description that the checks (step_args.h, the glue's step_checks.c), the CPU loops
 * (step_cpu.c) and the CUDA kernel (cuda/step.cu) read. A new elementwise rule is a
 * precis_rule_t value, a row of pr_rules, its constants in precis_step_consts_make
 * and its element update in precis_rule_update (below). step_cpu.c's fused loops for
 * it (a bit in pr_fused_layouts' masks) are a speed-up, not a need: without them its tiles run the
 * staged loop. Host code. */

/* A hyperparameter's accepted values: finite, lo <= x (lo < x: lo_open) and, where
 * hi > lo, x < hi (x <= hi: hi_closed); "must be <accepted>" when not. */
typedef struct pr_hyper_range {
  const char* name; /* the field of precis_step_config_t (a double); NULL ends the list */
  size_t offset;    /* offsetof(precis_step_config_t, name) */
  double lo, hi;
  int lo_open, hi_closed;
  const char* accepted;
} pr_hyper_range_t;

#define PR_RANGE(field, lo, lo_open, hi, hi_closed, accepted) \
  { #field, offsetof(precis_step_config_t, field), lo, hi, lo_open, hi_closed, accepted }
#define PR_RANGES_END { NULL, 0, 0.0, 0.0, 0, 0, NULL }

/* How a rule keeps exp_avgs, and takes cfg->nesterov. */
enum { PR_M_ALWAYS = 1, PR_M_WITH_MOMENTUM = 2 }; /* the latter: cfg->momentum != 0 */
enum { PR_NESTEROV_ANY = 1, PR_NESTEROV_TORCH_SGD = 2 }; /* the latter: with a momentum, no dampening */

typedef struct pr_rule_info {
  const char* name;
  int m;         /* 0, PR_M_ALWAYS or PR_M_WITH_MOMENTUM: keeps exp_avgs */
  int v;         /* keeps exp_avg_sqs */
  int amsgrad;   /* takes cfg->amsgrad (a running max of v) */
  int param;     /* writes the params (and masters); else the outputs table */
  int lr_scales; /* takes tensors->lr_scales (an lr per tensor) */
  int nesterov;  /* 0, PR_NESTEROV_ANY or PR_NESTEROV_TORCH_SGD */
  int rule_hyper; /* how many of cfg->rule_hyper it reads (the rest must be 0) */
  pr_hyper_range_t ranges[4]; /* checked in order, after the rule and before nesterov;
                                 its rule_hyper entries' too: PR_RANGE(rule_hyper[0], ...) */
} pr_rule_info_t;

/* Indexed by precis_rule_t (in its order). */
static const pr_rule_info_t pr_rules[PRECIS_RULE_COUNT] = {
    {"adam", PR_M_ALWAYS, 1, 1, 1, 0, 0, 0,
     {PR_RANGE(beta1, 0.0, 0, 1.0, 0, "in [0, 1)"), PR_RANGE(beta2, 0.0, 0, 1.0, 0, "in [0, 1)"),
      PR_RANGE(eps, 0.0, 0, 0.0, 0, "finite and >= 0"), PR_RANGES_END}},
    {"sgd", PR_M_WITH_MOMENTUM, 0, 0, 1, 1, PR_NESTEROV_TORCH_SGD, 0,
     {PR_RANGE(momentum, 0.0, 0, 0.0, 0, "finite and >= 0"),
      PR_RANGE(dampening, -HUGE_VAL, 0, -HUGE_VAL, 0, "finite"), PR_RANGES_END}},
    {"lion", PR_M_ALWAYS, 0, 0, 1, 1, 0, 0,
     {PR_RANGE(beta1, 0.0, 0, 1.0, 1, "in [0, 1]"), PR_RANGE(beta2, 0.0, 0, 1.0, 1, "in [0, 1]"),
      PR_RANGES_END}},
    /* rule_hyper[0]: the momentum's form, 0 torch.optim.Muon's (an average), 1 dion's (a
     * sum): precis_muon_momentum */
    {"muon_momentum", PR_M_ALWAYS, 0, 0, 0, 0, PR_NESTEROV_ANY, 1,
     {PR_RANGE(momentum, 0.0, 0, 1.0, 0, "in [0, 1)"),
      PR_RANGE(rule_hyper[0], 0.0, 0, 1.0, 1, "in [0, 1] (0: torch's average, else dion's sum)"),
      PR_RANGES_END}},
};

/* The one-state rules (every rule but Adam), for the CPU loops that specialize on each
 * (step_cpu.c): X(rule) for each. */
#define PRECIS_ONE_STATE_RULES(X) X(PRECIS_RULE_SGD) X(PRECIS_RULE_LION) X(PRECIS_RULE_MUON_MOMENTUM)

static inline int pr_step_rule(const precis_step_config_t* cfg) {
  return precis_step_config_has_rule(cfg) ? cfg->rule : PRECIS_RULE_ADAM;
}

static inline const char* pr_rule_name(int rule) {
  return rule >= 0 && rule < PRECIS_RULE_COUNT ? pr_rules[rule].name : "unknown";
}

/* Every rule, "0 (adam), 1 (sgd), ...", into buf (for the messages that list them). */
static inline const char* pr_rule_list(char* buf, size_t size) {
  size_t used = 0;
  int r;
  buf[0] = '\0';
  for (r = 0; r < PRECIS_RULE_COUNT && used < size; ++r) {
    int n = snprintf(buf + used, size - used, "%s%d (%s)", r ? ", " : "", r, pr_rules[r].name);
    if (n < 0) break;
    used += (size_t)n;
  }
  return buf;
}

/* The names of the rules whose int field at `field` (offsetof(pr_rule_info_t, ...)) is
 * nonzero (set) or zero (!set): "a", "a and b", "a, b and c", into buf. */
static inline int pr_rule_has(int rule, size_t field, int set) {
  return (*(const int*)((const char*)&pr_rules[rule] + field) != 0) == (set != 0);
}

static inline const char* pr_rule_names_with(size_t field, int set, char* buf, size_t size) {
  int r, count = 0, total = 0;
  size_t used = 0;
  for (r = 0; r < PRECIS_RULE_COUNT; ++r) total += pr_rule_has(r, field, set);
  buf[0] = '\0';
  for (r = 0; r < PRECIS_RULE_COUNT && used < size; ++r) {
    int n;
    if (!pr_rule_has(r, field, set)) continue;
    ++count;
    n = snprintf(buf + used, size - used, "%s%s",
                 count == 1 ? "" : count == total ? " and " : ", ", pr_rules[r].name);
    if (n < 0) break;
    used += (size_t)n;
  }
  return buf;
}

/* What a step's rule reads beyond params and grads, from a checked config (a known
 * rule): m (exp_avgs), v (exp_avg_sqs), the master (the rules that write the param), an
 * output table, per-tensor lr scales. The CPU and CUDA checks, the loops and the glue
 * (torch_ext/csrc) read this one copy. */
typedef struct pr_rule_use {
  int rule, m, v, param, output, lr_scales;
} pr_rule_use_t;

static inline pr_rule_use_t pr_rule_use(const precis_step_config_t* cfg) {
  pr_rule_use_t u;
  const pr_rule_info_t* r;
  u.rule = pr_step_rule(cfg);
  r = &pr_rules[u.rule >= 0 && u.rule < PRECIS_RULE_COUNT ? u.rule : PRECIS_RULE_ADAM];
  u.m = r->m == PR_M_ALWAYS || (r->m == PR_M_WITH_MOMENTUM && cfg->momentum != 0.0);
  u.v = r->v;
  u.param = r->param;
  u.output = !r->param;
  u.lr_scales = r->lr_scales;
  return u;
}
#endif /* !__CUDACC_RTC__ */

/* Per-tensor constants of one step, each rounded to float where torch rounds
 * its Python-float scalars. Plain data: pass it to a CUDA kernel by value. */
typedef struct precis_step_consts {
  float grad_mul;        /* inv_grad_scale, negated when maximizing (exact) */
  float wd_adam;         /* the L2 coefficient (Adam, SGD); 0 when decoupled (none: precis_l2) */
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
  float rule_consts[PRECIS_RULE_HYPER_MAX]; /* a rule's own: its rule_hyper rounded, or
                                               what precis_step_consts_make derives */
} precis_step_consts_t;

/* Tensor i's own step lr for SGD and Lion, lr * scale (precis_step_tensors_t.lr_scales):
 * torch's `lr * ratio` of Muon's adjusted lr, in double (a float32 tensor lr: in float,
 * as a float32 tensor times a Python float), then -lr rounded to float, as torch's
 * add_(d, alpha=-lr). lr is the step's (the host's, or the device's). */
static inline PRECIS_HD void precis_rule_consts_lr(precis_step_consts_t* c, double lr,
                                                   double scale, int lr_float32) {
  c->neg_step_size = lr_float32 ? -((float)lr * (float)scale) : (float)-(lr * scale);
}

/* torch derives these in Python: 1 - beta ** step with float step (libm pow),
 * bias_correction2 ** 0.5 (pow again), lr / bias_correction1. A float32 tensor
 * lr makes lr * wd, 1 - lr * wd and lr / bias_correction1 float32 tensor ops. */
static inline PRECIS_HD precis_step_consts_t precis_step_consts_make(const precis_step_hyper_t* h,
                                                                     int64_t step) {
  precis_step_consts_t c;
  int k;
  double bias1 = 1.0 - pow(h->beta1, (double)step);
  double bias2 = 1.0 - pow(h->beta2, (double)step);
  float w = (float)(1.0 - h->beta1);
  /* Lion's weight decay is always AdamW's; Muon's momentum half has none. */
  const int decoupled = h->decoupled || h->rule == PRECIS_RULE_LION;
  c.grad_mul = h->maximize ? -h->inv_grad_scale : h->inv_grad_scale;
  /* The unused L2 term is 0 (not taken: precis_l2), the unused decay 1 (p*1 == p). */
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
  for (k = 0; k < PRECIS_RULE_HYPER_MAX; ++k) c.rule_consts[k] = (float)h->rule_hyper[k];
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
static inline PRECIS_HD void precis_adam_moments(const precis_step_consts_t* c, float g,
                                                 float* p, float* m, float* v) {
  g = PRECIS_FMUL(g, c->grad_mul);
  g = precis_l2(c->wd_adam, *p, g);
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
static inline PRECIS_HD float precis_adam_param(const precis_step_consts_t* c, int torch_form,
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
static inline PRECIS_CPU_INLINE PRECIS_HD void precis_sgd_update(const precis_step_consts_t* c,
                                                                 int has_momentum, float g,
                                                                 float* p, float* m) {
  float d;
  g = PRECIS_FMUL(g, c->grad_mul);
  g = precis_l2(c->wd_adam, *p, g);
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
static inline PRECIS_CPU_INLINE PRECIS_HD void precis_lion_update(const precis_step_consts_t* c,
                                                                  float g, float* p, float* m) {
  float u;
  g = PRECIS_FMUL(g, c->grad_mul);
  u = PRECIS_FMA(c->one_minus_beta1, g, PRECIS_FMUL(c->beta1, *m));
  *p = PRECIS_FMA(c->neg_step_size, precis_sign(u), PRECIS_FMUL(*p, c->decay));
  *m = PRECIS_FMA(c->one_minus_beta2, g, PRECIS_FMUL(c->beta2, *m));
}

/* Muon's momentum: m = lerp(m, g, 1 - momentum) as torch's lerp; the returned
 * direction is m, or lerp(g, m, momentum) with Nesterov. With rule_consts[0] set
 * (rule_hyper[0]), dion's sum instead: m = momentum * m + g, the direction m or
 * g + momentum * m, each a product then a sum (its _foreach_mul_ then _foreach_add_). */
static inline PRECIS_CPU_INLINE PRECIS_HD float precis_muon_momentum(const precis_step_consts_t* c,
                                                                     float g, float* m) {
  g = PRECIS_FMUL(g, c->grad_mul);
  if (c->rule_consts[0] != 0.0f) {
    *m = PRECIS_FMUL(*m, c->momentum) + g;
    return c->nesterov ? PRECIS_FMUL(*m, c->momentum) + g : *m;
  }
  *m = PRECIS_FMA(c->lerp_coef, g - *m, c->lerp_from_g ? g : *m);
  if (!c->nesterov) return *m;
  return PRECIS_FMA(c->out_lerp_coef, *m - g, c->out_lerp_from_m ? *m : g);
}

/* One element of a one-state rule (the rules but Adam, whose update is split in two
 * above): the new param and m in *p and *m (has_m: the rule keeps m; SGD without
 * momentum keeps none), and the direction it returns where the rule writes outputs
 * instead of params (Muon's momentum; else 0). The CPU loops (with rule a constant)
 * and the CUDA kernel call this one switch. */
static inline PRECIS_CPU_INLINE PRECIS_HD float precis_rule_update(const precis_step_consts_t* c,
                                                                   int rule, int has_m, float g,
                                                                   float* p, float* m) {
  switch (rule) {
    case PRECIS_RULE_SGD:
      precis_sgd_update(c, has_m, g, p, m);
      return 0.0f;
    case PRECIS_RULE_LION:
      precis_lion_update(c, g, p, m);
      return 0.0f;
    case PRECIS_RULE_MUON_MOMENTUM:
      return precis_muon_momentum(c, g, m);
    default:
      return 0.0f;
  }
}

#endif /* PRECIS_RULES_H_ */
