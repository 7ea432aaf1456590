/*
 * step_args.h - the argument checks of the fused Adam/AdamW step, shared by
 * precis_step (step_cpu.c) and precis_cuda_step (cuda/step.cu), so
 * both reject the same input with the same message (fn names the entry point).
 *
 * Plain C11 / C++ host code (static inline: a translation unit that uses none
 * of it pays nothing). Needs internal.h (pr_fail, pr_dtype_label, ...), which
 * C++ callers include inside extern "C".
 */
#ifndef PRECIS_STEP_ARGS_H_
#define PRECIS_STEP_ARGS_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "rules.h" /* precis_step_config_has_rule, pr_rule_use */
#include "internal.h"
#include "precis/precis.h"
#include "precis_convert.h"
#include "fingerprint.h" /* pr_fp_block_count */

/* The size-versioned structs: what a caller built against an older header
 * passes at least (before the AMSGrad fields), and whether cfg has amsgrad. */
#define PR_STEP_CONFIG_MIN_SIZE offsetof(precis_step_config_t, amsgrad)
#define PR_STEP_TENSORS_MIN_SIZE offsetof(precis_step_tensors_t, max_exp_avg_sqs)

#define PR_STEP_TENSORS_AMSGRAD_SIZE offsetof(precis_step_tensors_t, streams)

/* Whether the size-versioned struct *s (of type T) reaches past its `field`. */
#define PR_HAS_FIELD(s, T, field) ((s)->size >= offsetof(T, field) + sizeof (s)->field)

/* Where the fp32 master value of an element lives. */
enum {
  PR_MASTER_NONE = 0,     /* the param is its own master (bf16: stochastic rounding) */
  PR_MASTER_SEPARATE = 1, /* masters[i], fp32 or fp16; the param is its rounding */
  PR_MASTER_REMAINDER = 2, /* bf16 param + int16 remainder */
  PR_MASTER_REMAINDER8 = 3 /* bf16 param + 8-bit remainder (uint8 bytes, the fp8 code) */
};

/* The rest: host code, which NVRTC (device code only, no C library: tools/build_cuda12.py)
 * does not see. */
#ifndef __CUDACC_RTC__
/* Tensor i's stream and the index of its first element in its param, for the
 * stochastic-rounding keys (precis.h: defaults where the struct or table lacks them). */
static inline uint64_t pr_step_stream(const precis_step_tensors_t* t, size_t i) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, streams) && t->streams != NULL ? t->streams[i]
                                                                             : (uint64_t)i;
}

static inline int64_t pr_step_element_offset(const precis_step_tensors_t* t, size_t i) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, element_offsets) && t->element_offsets != NULL
             ? t->element_offsets[i]
             : 0;
}

/* tensors->param_kept where the struct has it, else NULL. */
static inline int64_t* pr_step_param_kept(const precis_step_tensors_t* t) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, param_kept) ? t->param_kept : NULL;
}

/* tensors->param_fingerprints where the struct has it, else NULL. */
static inline uint64_t* pr_step_param_fingerprints(const precis_step_tensors_t* t) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, param_fingerprints) ? t->param_fingerprints
                                                                     : NULL;
}

/* tensors->param_block_fingerprints where the struct has it, else NULL. */
static inline uint64_t* pr_step_param_block_fingerprints(const precis_step_tensors_t* t) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, param_block_fingerprints)
             ? t->param_block_fingerprints
             : NULL;
}

/* tensors->param_block_records where the struct has it, else NULL. */
static inline const uint64_t* pr_step_param_block_records(const precis_step_tensors_t* t) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, param_block_records) ? t->param_block_records
                                                                      : NULL;
}

/* tensors->param_blocks_kept where the struct has it, else NULL. */
static inline int64_t* pr_step_param_blocks_kept(const precis_step_tensors_t* t) {
  return PR_HAS_FIELD(t, precis_step_tensors_t, param_blocks_kept) ? t->param_blocks_kept
                                                                    : NULL;
}

static inline int pr_adam_config_has_amsgrad(const precis_step_config_t* cfg) {
  return PR_HAS_FIELD(cfg, precis_step_config_t, amsgrad);
}

/* cfg->amsgrad where the struct has it, else 0 (after pr_step_check_args: 0 or 1). */
static inline int pr_adam_amsgrad(const precis_step_config_t* cfg) {
  return pr_adam_config_has_amsgrad(cfg) && cfg->amsgrad != 0;
}

static inline int pr_step_param_dtype_ok(int d) {
  return d == PRECIS_DTYPE_FP32 || d == PRECIS_DTYPE_FP16 || d == PRECIS_DTYPE_BF16;
}

static inline int pr_step_moment_dtype_ok(int d) {
  return pr_step_param_dtype_ok(d) || d == PRECIS_DTYPE_FP8_E4M3;
}

/* fp16 and fp8 moments carry per-block scales. */
static inline int pr_is_scaled(int d) {
  return d == PRECIS_DTYPE_FP16 || d == PRECIS_DTYPE_FP8_E4M3;
}

/* An unknown code is INVALID_DTYPE; a real dtype outside the role's set is
 * INVALID_POLICY. */
static inline precis_status_t pr_step_check_dtype(const char* fn, const char* field, int dtype,
                                                  int legal, const char* accepted) {
  if (!pr_dtype_valid(dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE, "%s: %s is %s; accepted: %s", fn, field,
                   pr_dtype_label(dtype), accepted);
  }
  if (!legal) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY, "%s: %s %s is not supported; accepted: %s", fn,
                   field, pr_dtype_label(dtype), accepted);
  }
  return PRECIS_OK;
}

/* A double hyperparameter: not NaN, finite, at least lo (> lo when open), and
 * below hi when hi is given (hi > lo). */
/* x finite, lo <= x (lo < x: open) and, where hi > lo, x < hi (x <= hi: closed). */
static inline precis_status_t pr_step_check_double(const char* fn, const char* name, double x,
                                                   double lo, int open, double hi, int closed,
                                                   const char* accepted) {
  /* Written as !(ok) so that NaN fails every test. */
  if (!(isfinite(x) && (open ? x > lo : x >= lo) && (hi > lo ? (closed ? x <= hi : x < hi) : 1))) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: cfg->%s is %.17g; must be %s", fn, name, x,
                   accepted);
  }
  return PRECIS_OK;
}

static inline precis_status_t pr_step_check_flag(const char* fn, const char* name, int32_t x) {
  if (x != 0 && x != 1) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: cfg->%s is %d; must be 0 or 1", fn, name,
                   (int)x);
  }
  return PRECIS_OK;
}

/* The rule and the hyperparameters only it reads (Adam's betas and eps, SGD's momentum,
 * dampening and Nesterov, Lion's betas, Muon's momentum). */
static inline precis_status_t pr_step_check_rule(const char* fn, const precis_step_config_t* cfg) {
  const int rule = pr_step_rule(cfg);
  const int has_rule = precis_step_config_has_rule(cfg);
  const pr_rule_info_t* info;
  const pr_hyper_range_t* r;
  precis_status_t st;
  int k;
  if (has_rule) {
    if (rule < 0 || rule >= PRECIS_RULE_COUNT) {
      char rules[256];
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: cfg->rule is %d; accepted: %s", fn,
                     (int)rule, pr_rule_list(rules, sizeof rules));
    }
    if ((st = pr_step_check_flag(fn, "nesterov", cfg->nesterov))) return st;
  }
  info = &pr_rules[rule];
  if (pr_adam_amsgrad(cfg) && !info->amsgrad) { /* its flag was checked before */
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: cfg->amsgrad is 1 with rule %s; only adam has it", fn, info->name);
  }
  for (r = info->ranges; r->name != NULL; ++r) {
    /* (a field past an older caller's smaller struct: its default, 0) */
    const double x = r->offset + sizeof(double) <= cfg->size
                         ? *(const double*)((const char*)cfg + r->offset)
                         : 0.0;
    if ((st = pr_step_check_double(fn, r->name, x, r->lo, r->lo_open, r->hi, r->hi_closed,
                                   r->accepted))) {
      return st;
    }
  }
  for (k = info->rule_hyper; k < PRECIS_RULE_HYPER_MAX && precis_step_config_has_rule_hyper(cfg);
       ++k) {
    if (cfg->rule_hyper[k] != 0.0) { /* (NaN too) */
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                     "%s: cfg->rule_hyper[%d] is %.17g; rule %s takes %d of them (the rest 0)",
                     fn, k, cfg->rule_hyper[k], info->name, info->rule_hyper);
    }
  }
  if (!has_rule || !cfg->nesterov) return PRECIS_OK;
  if (!info->nesterov) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: cfg->nesterov is 1; the %s rule has none",
                   fn, info->name);
  }
  /* torch.optim.SGD's rule for Nesterov */
  if (info->nesterov == PR_NESTEROV_TORCH_SGD && (cfg->momentum <= 0.0 || cfg->dampening != 0.0)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: cfg->nesterov is 1 with momentum %.17g and dampening %.17g; Nesterov "
                   "momentum requires a momentum and zero dampening",
                   fn, cfg->momentum, cfg->dampening);
  }
  return PRECIS_OK;
}

static inline precis_status_t pr_step_check_hyper(const char* fn,
                                                  const precis_step_config_t* cfg) {
  precis_status_t st;
  if ((st = pr_step_check_double(fn, "lr", cfg->lr, 0.0, 0, 0.0, 0, "finite and >= 0")) ||
      (st = pr_step_check_double(fn, "weight_decay", cfg->weight_decay, 0.0, 0, 0.0, 0,
                                 "finite and >= 0")) ||
      (st = pr_step_check_double(fn, "inv_grad_scale", (double)cfg->inv_grad_scale, 0.0, 1, 0.0,
                                 0, "finite and > 0")) ||
      (st = pr_step_check_flag(fn, "decoupled_weight_decay", cfg->decoupled_weight_decay)) ||
      (st = pr_step_check_flag(fn, "maximize", cfg->maximize)) ||
      (st = pr_step_check_flag(fn, "check_finite", cfg->check_finite)) ||
      (st = pr_step_check_flag(fn, "lr_float32", cfg->lr_float32)) ||
      (pr_adam_config_has_amsgrad(cfg) &&
       (st = pr_step_check_flag(fn, "amsgrad", cfg->amsgrad))) ||
      (st = pr_step_check_rule(fn, cfg))) {
    return st;
  }
  if (cfg->num_threads < 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: cfg->num_threads is %d; must be >= 0", fn,
                   (int)cfg->num_threads);
  }
  if (cfg->lr_float32 && !isfinite((float)cfg->lr)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: cfg->lr is %.17g, beyond float32's range, with cfg->lr_float32 1", fn,
                   cfg->lr);
  }
  return PRECIS_OK;
}

/* The master/param combination -> PR_MASTER_*, or a failure. */
static inline precis_status_t pr_step_check_master(const char* fn,
                                                   const precis_step_tensors_t* t, int* mode) {
  precis_dtype_t pd = t->param_dtype, md = t->master_dtype;
  if (!pr_dtype_valid((int)md)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE,
                   "%s: tensors->master_dtype is %s; accepted: fp32, fp16, int16, fp8 (uint8 "
                   "bytes: 8-bit remainders) or param_dtype",
                   fn, pr_dtype_label((int)md));
  }
  if (md == pd) {
    *mode = PR_MASTER_NONE;
  } else if (md == PRECIS_DTYPE_INT16 && pd == PRECIS_DTYPE_BF16) {
    *mode = PR_MASTER_REMAINDER;
  } else if (md == PRECIS_DTYPE_FP8_E4M3 && pd == PRECIS_DTYPE_BF16) {
    *mode = PR_MASTER_REMAINDER8;
  } else if (md == PRECIS_DTYPE_FP32 || (md == PRECIS_DTYPE_FP16 && pd == PRECIS_DTYPE_BF16)) {
    *mode = PR_MASTER_SEPARATE;
  } else {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "%s: tensors->master_dtype %s with param_dtype %s is not supported; the "
                   "master is fp32, fp16 (bf16 params), int16 or 8-bit (fp8 code: uint8 bytes) "
                   "remainders (bf16 params), or param_dtype itself (no separate master)",
                   fn, pr_dtype_label((int)md), pr_dtype_label((int)pd));
  }
  return PRECIS_OK;
}

/* A per-tensor pointer array: non-NULL, and each entry non-NULL where numel > 0. */
static inline precis_status_t pr_step_check_ptrs(const char* fn, const precis_step_tensors_t* t,
                                                 const void* const* ptrs, const char* name) {
  size_t i;
  if (ptrs == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: tensors->%s is NULL", fn, name);
  }
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] > 0 && ptrs[i] == NULL) {
      return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s[%zu] is NULL (numel %lld)", fn, name, i,
                     (long long)t->numels[i]);
    }
  }
  return PRECIS_OK;
}

/* Scales: present (with entries) iff the moment dtype is fp16 or fp8. */
static inline precis_status_t pr_step_check_scales(const char* fn,
                                                   const precis_step_tensors_t* t,
                                                   float* const* scales, precis_dtype_t dtype,
                                                   const char* name, const char* dtype_field) {
  if (pr_is_scaled((int)dtype)) {
    return pr_step_check_ptrs(fn, t, (const void* const*)scales, name);
  }
  if (scales != NULL) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->%s must be NULL: %s %s is not block-scaled (only fp16 and fp8 "
                   "moments are)",
                   fn, name, dtype_field, pr_dtype_label((int)dtype));
  }
  return PRECIS_OK;
}

/* The dtype fields of a tensor list, and its master mode. */
static inline precis_status_t pr_step_check_dtypes(const char* fn, const precis_step_tensors_t* t,
                                                   pr_rule_use_t u, int* master_mode) {
  precis_status_t st;
  if (u.output) {
    if (!PR_HAS_FIELD(t, precis_step_tensors_t, lr_scales)) {
      return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                     "%s: tensors->size is %zu, expected at least %zu with rule %s "
                     "(use PRECIS_STEP_TENSORS_INIT)",
                     fn, t->size, sizeof(precis_step_tensors_t), pr_rule_name(u.rule));
    }
    if ((st = pr_step_check_dtype(fn, "tensors->output_dtype", (int)t->output_dtype,
                                  pr_step_param_dtype_ok((int)t->output_dtype),
                                  "fp32, fp16, bf16"))) {
      return st;
    }
  }
  if ((st = pr_step_check_dtype(fn, "tensors->param_dtype", (int)t->param_dtype,
                                pr_step_param_dtype_ok((int)t->param_dtype),
                                "fp32, fp16, bf16")) ||
      (st = pr_step_check_dtype(fn, "tensors->grad_dtype", (int)t->grad_dtype,
                                pr_step_param_dtype_ok((int)t->grad_dtype), "fp32, fp16, bf16")) ||
      (u.m && (st = pr_step_check_dtype(fn, "tensors->exp_avg_dtype", (int)t->exp_avg_dtype,
                                        pr_step_moment_dtype_ok((int)t->exp_avg_dtype),
                                        "fp32, fp16, bf16, fp8"))) ||
      (u.v && (st = pr_step_check_dtype(fn, "tensors->exp_avg_sq_dtype",
                                        (int)t->exp_avg_sq_dtype,
                                        pr_step_moment_dtype_ok((int)t->exp_avg_sq_dtype),
                                        "fp32, fp16, bf16, fp8"))) ||
      (st = pr_step_check_master(fn, t, master_mode))) {
    return st;
  }
  return PRECIS_OK;
}

/* The buffers of tensor i of a checked list: masters where master_mode has
 * them, scales where the moment dtype is scaled. */
typedef struct pr_step_buffer {
  const void* ptr;
  int dtype;
  const char* name;
  int vector; /* the CUDA vector path reads it 8 elements at a time (not the scales) */
} pr_step_buffer_t;

enum { PR_STEP_MAX_BUFFERS = 9 };

/* Tensor i's buffers the rule u reads or writes (params always: they are checked,
 * even where muon_momentum leaves them). */
static inline int pr_step_buffers(const precis_step_tensors_t* t, size_t i, int master_mode,
                                  int amsgrad, pr_rule_use_t u,
                                  pr_step_buffer_t bufs[PR_STEP_MAX_BUFFERS]) {
  int n = 0;
  bufs[n].ptr = t->params[i], bufs[n].dtype = (int)t->param_dtype;
  bufs[n].name = "params", bufs[n++].vector = 1;
  bufs[n].ptr = t->grads[i], bufs[n].dtype = (int)t->grad_dtype;
  bufs[n].name = "grads", bufs[n++].vector = 1;
  if (master_mode != PR_MASTER_NONE && u.param) {
    bufs[n].ptr = t->masters[i], bufs[n].dtype = (int)t->master_dtype;
    bufs[n].name = "masters", bufs[n++].vector = 1;
  }
  if (u.m) {
    bufs[n].ptr = t->exp_avgs[i], bufs[n].dtype = (int)t->exp_avg_dtype;
    bufs[n].name = "exp_avgs", bufs[n++].vector = 1;
  }
  if (u.v) {
    bufs[n].ptr = t->exp_avg_sqs[i], bufs[n].dtype = (int)t->exp_avg_sq_dtype;
    bufs[n].name = "exp_avg_sqs", bufs[n++].vector = 1;
  }
  if (u.output) {
    bufs[n].ptr = t->outputs[i], bufs[n].dtype = (int)t->output_dtype;
    bufs[n].name = "outputs", bufs[n++].vector = 1;
  }
  if (u.m && pr_is_scaled((int)t->exp_avg_dtype)) {
    bufs[n].ptr = t->exp_avg_scales[i], bufs[n].dtype = PRECIS_DTYPE_FP32;
    bufs[n].name = "exp_avg_scales", bufs[n++].vector = 0;
  }
  if (u.v && pr_is_scaled((int)t->exp_avg_sq_dtype)) {
    bufs[n].ptr = t->exp_avg_sq_scales[i], bufs[n].dtype = PRECIS_DTYPE_FP32;
    bufs[n].name = "exp_avg_sq_scales", bufs[n++].vector = 0;
  }
  if (amsgrad) {
    bufs[n].ptr = t->max_exp_avg_sqs[i], bufs[n].dtype = (int)t->exp_avg_sq_dtype;
    bufs[n].name = "max_exp_avg_sqs", bufs[n++].vector = 1;
    if (pr_is_scaled((int)t->exp_avg_sq_dtype)) {
      bufs[n].ptr = t->max_exp_avg_sq_scales[i], bufs[n].dtype = PRECIS_DTYPE_FP32;
      bufs[n].name = "max_exp_avg_sq_scales", bufs[n++].vector = 0;
    }
  }
  return n;
}

/* A buffer's bytes in a tensor of numel elements: a float a scale block for the scales
 * (the buffers the vector path does not read), an element each for the others. */
static inline size_t pr_step_buffer_bytes(const pr_step_buffer_t* b, int64_t numel) {
  const size_t n = (size_t)numel;
  return b->vector ? n * (size_t)precis_elem_size(b->dtype)
                   : (size_t)precis_scale_blocks(numel) * sizeof(float);
}

/* Every buffer of every non-empty tensor aligned to its elements. */
static inline precis_status_t pr_step_check_alignment(const char* fn,
                                                      const precis_step_tensors_t* t,
                                                      int master_mode, int amsgrad,
                                                      pr_rule_use_t u) {
  pr_step_buffer_t bufs[PR_STEP_MAX_BUFFERS];
  precis_status_t st;
  size_t i;
  int k, n;
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] == 0) continue;
    n = pr_step_buffers(t, i, master_mode, amsgrad, u, bufs);
    for (k = 0; k < n; ++k) {
      st = pr_check_aligned(fn, bufs[k].name, (long long)i, bufs[k].ptr, bufs[k].dtype);
      if (st != PRECIS_OK) return st;
    }
  }
  return PRECIS_OK;
}

/* The numels table of a list with count > 0: present, every entry >= 0. First
 * of the table checks: pr_step_check_ptrs reads numels. */
static inline precis_status_t pr_step_check_numels(const char* fn, const precis_step_tensors_t* t) {
  size_t i;
  int64_t total = 0;
  if (t->numels == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: tensors->numels is NULL", fn);
  if (t->count > SIZE_MAX / sizeof(int64_t) - 1) { /* (no table of it fits in memory) */
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: tensors->count %zu is too large", fn,
                   t->count);
  }
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] < 0) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: numels[%zu] is %lld; must be >= 0", fn, i,
                     (long long)t->numels[i]);
    }
    if (t->numels[i] > INT64_MAX - total) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                     "%s: numels[0..%zu] add up past 2^63 - 1 elements", fn, i);
    }
    total += t->numels[i];
  }
  return PRECIS_OK;
}

/* AMSGrad: max_exp_avg_sqs[i] and its scales, which the step writes, share no
 * byte with one another or with another buffer of tensor i (pr_step_buffers' list, in
 * which they come last). */
static inline precis_status_t pr_step_check_max_aliasing(const char* fn,
                                                         const precis_step_tensors_t* t,
                                                         int master_mode, pr_rule_use_t u) {
  pr_step_buffer_t bufs[PR_STEP_MAX_BUFFERS];
  size_t i;
  int n, first, w, k;
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] == 0) continue;
    n = pr_step_buffers(t, i, master_mode, 1, u, bufs);
    first = pr_is_scaled((int)t->exp_avg_sq_dtype) ? n - 2 : n - 1;
    for (w = first; w < n; ++w) {
      for (k = 0; k < n; ++k) {
        if (k == w || (k >= first && k < w)) continue; /* itself; the pair of them once */
        if (pr_overlap(bufs[w].ptr, pr_step_buffer_bytes(&bufs[w], t->numels[i]), bufs[k].ptr,
                       pr_step_buffer_bytes(&bufs[k], t->numels[i]))) {
          return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                         "%s: %s[%zu] and %s[%zu] share memory; the step writes the running "
                         "max of amsgrad into its own buffer",
                         fn, bufs[w].name, i, bufs[k].name, i);
        }
      }
    }
  }
  return PRECIS_OK;
}

/* The blocks' compare (param_block_records, param_blocks_kept): only with remainders
 * and a rule that writes the params, kept only beside records (where they lie:
 * pr_step_check_side_tables). */
static inline precis_status_t pr_step_check_block_compare(const char* fn,
                                                          const precis_step_tensors_t* t,
                                                          int master_mode, pr_rule_use_t u) {
  const uint64_t* records = pr_step_param_block_records(t);
  const int64_t* kept = pr_step_param_blocks_kept(t);
  if (records == NULL && kept == NULL) return PRECIS_OK;
  if (records == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER,
                   "%s: tensors->param_blocks_kept is given but param_block_records is NULL",
                   fn);
  }
  if (!u.param ||
      (master_mode != PR_MASTER_REMAINDER && master_mode != PR_MASTER_REMAINDER8)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_block_records needs remainders (master_dtype int16 or "
                   "fp8_e4m3 beside bf16 params) and a rule that writes the params%s",
                   fn, u.param ? "" : " (rule muon_momentum writes none)");
  }
  return PRECIS_OK;
}

/* The tables the step writes or compares beside the list: param_fingerprints,
 * param_kept and param_blocks_kept (an entry a tensor), param_block_fingerprints and
 * param_block_records (an entry a fingerprint block): each 8-byte aligned, sharing no
 * byte with another or with a buffer of the list (a write into one would change what
 * the checks passed). */
static inline precis_status_t pr_step_check_side_tables(const char* fn,
                                                        const precis_step_tensors_t* t,
                                                        int master_mode, int amsgrad,
                                                        pr_rule_use_t u) {
  struct {
    const char* name;
    const void* ptr;
    size_t bytes;
  } side[5];
  pr_step_buffer_t bufs[PR_STEP_MAX_BUFFERS];
  size_t i, entries = 0;
  int j, k, n, any = 0;
  for (i = 0; i < t->count; ++i) {
    entries += (size_t)pr_fp_block_count(t->numels[i], PRECIS_FINGERPRINT_BLOCK);
  }
  side[0].name = "param_fingerprints", side[0].ptr = pr_step_param_fingerprints(t);
  side[1].name = "param_kept", side[1].ptr = pr_step_param_kept(t);
  side[2].name = "param_blocks_kept", side[2].ptr = pr_step_param_blocks_kept(t);
  side[3].name = "param_block_fingerprints", side[3].ptr = pr_step_param_block_fingerprints(t);
  side[4].name = "param_block_records", side[4].ptr = pr_step_param_block_records(t);
  for (j = 0; j < 5; ++j) {
    side[j].bytes = (j < 3 ? t->count : entries) * sizeof(uint64_t);
    if (side[j].ptr == NULL) continue;
    any = 1;
    if ((uintptr_t)side[j].ptr % sizeof(uint64_t) != 0) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: tensors->%s (%p) is not 8-byte aligned",
                     fn, side[j].name, side[j].ptr);
    }
    for (k = 0; k < j; ++k) {
      if (pr_overlap(side[j].ptr, side[j].bytes, side[k].ptr, side[k].bytes)) {
        return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: tensors->%s and %s share memory", fn,
                       side[k].name, side[j].name);
      }
    }
  }
  for (i = 0; any && i < t->count; ++i) {
    if (t->numels[i] == 0) continue;
    n = pr_step_buffers(t, i, master_mode, amsgrad, u, bufs);
    for (k = 0; k < n; ++k) {
      const size_t bytes = pr_step_buffer_bytes(&bufs[k], t->numels[i]);
      for (j = 0; j < 5; ++j) {
        if (pr_overlap(side[j].ptr, side[j].bytes, bufs[k].ptr, bytes)) {
          return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: tensors->%s shares memory with %s[%zu]",
                         fn, side[j].name, bufs[k].name, i);
        }
      }
    }
  }
  return PRECIS_OK;
}

/* numels (and steps, unless steps_needed is 0: the caller takes the step from
 * elsewhere) and every pointer table, for a list with count > 0. */
static inline precis_status_t pr_step_check_tables(const char* fn, const precis_step_tensors_t* t,
                                                   int steps_needed, int master_mode,
                                                   int amsgrad, pr_rule_use_t u) {
  precis_status_t st;
  size_t i;
  if ((st = pr_step_check_numels(fn, t)) != PRECIS_OK) return st;
  if (steps_needed) {
    if (t->steps == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: tensors->steps is NULL", fn);
    for (i = 0; i < t->count; ++i) {
      if (t->steps[i] < 1) {
        return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                       "%s: steps[%zu] is %lld; must be >= 1 (the step number after this update)",
                       fn, i, (long long)t->steps[i]);
      }
    }
  }
  if ((st = pr_step_check_ptrs(fn, t, (const void* const*)t->params, "params")) ||
      (st = pr_step_check_ptrs(fn, t, (const void* const*)t->grads, "grads")) ||
      (u.m && (st = pr_step_check_ptrs(fn, t, (const void* const*)t->exp_avgs, "exp_avgs"))) ||
      (u.v &&
       (st = pr_step_check_ptrs(fn, t, (const void* const*)t->exp_avg_sqs, "exp_avg_sqs"))) ||
      (u.m && (st = pr_step_check_scales(fn, t, t->exp_avg_scales, t->exp_avg_dtype,
                                         "exp_avg_scales", "exp_avg_dtype"))) ||
      (u.v && (st = pr_step_check_scales(fn, t, t->exp_avg_sq_scales, t->exp_avg_sq_dtype,
                                         "exp_avg_sq_scales", "exp_avg_sq_dtype"))) ||
      (u.output &&
       (st = pr_step_check_ptrs(fn, t, (const void* const*)t->outputs, "outputs")))) {
    return st;
  }
  if (master_mode != PR_MASTER_NONE && u.param &&
      (st = pr_step_check_ptrs(fn, t, (const void* const*)t->masters, "masters"))) {
    return st;
  }
  if (PR_HAS_FIELD(t, precis_step_tensors_t, lr_scales) && t->lr_scales != NULL) {
    if (!u.lr_scales) {
      char names[256];
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                     "%s: tensors->lr_scales must be NULL with rule %s (only %s take them)", fn,
                     pr_rule_name(u.rule),
                     pr_rule_names_with(offsetof(pr_rule_info_t, lr_scales), 1, names,
                                        sizeof names));
    }
    for (i = 0; i < t->count; ++i) {
      if (!(isfinite(t->lr_scales[i]) && t->lr_scales[i] >= 0.0)) {
        return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                       "%s: lr_scales[%zu] is %.17g; must be finite and >= 0", fn, i,
                       t->lr_scales[i]);
      }
    }
  }
  if (pr_step_param_fingerprints(t) != NULL && !u.param) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_fingerprints must be NULL with rule %s, which writes no "
                   "params", fn, pr_rule_name(u.rule));
  }
  if (pr_step_param_block_fingerprints(t) != NULL && !u.param) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_block_fingerprints must be NULL with rule %s, which "
                   "writes no params", fn, pr_rule_name(u.rule));
  }
  if ((st = pr_step_check_block_compare(fn, t, master_mode, u)) != PRECIS_OK) {
    return st;
  }
  if (pr_step_param_kept(t) != NULL && (master_mode != PR_MASTER_SEPARATE || !u.param)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_kept must be NULL without a separate master "
                   "(master_dtype fp32 or fp16 beside bf16 or fp16 params) or with rule %s, "
                   "which writes no params", fn, pr_rule_name(u.rule));
  }
  if (amsgrad &&
      ((st = pr_step_check_ptrs(fn, t, (const void* const*)t->max_exp_avg_sqs,
                                "max_exp_avg_sqs")) ||
       (st = pr_step_check_scales(fn, t, t->max_exp_avg_sq_scales, t->exp_avg_sq_dtype,
                                  "max_exp_avg_sq_scales", "exp_avg_sq_dtype")) ||
       (st = pr_step_check_max_aliasing(fn, t, master_mode, u)))) {
    return st;
  }
  if ((st = pr_step_check_side_tables(fn, t, master_mode, amsgrad, u)) != PRECIS_OK) return st;
  return pr_step_check_alignment(fn, t, master_mode, amsgrad, u);
}

/* tensors itself: non-NULL, and at least as large as the struct without the
 * AMSGrad tables (an older header's), or this header's with amsgrad. */
static inline precis_status_t pr_step_check_tensors_struct(const char* fn,
                                                           const precis_step_tensors_t* t,
                                                           int amsgrad) {
  size_t need = amsgrad ? PR_STEP_TENSORS_AMSGRAD_SIZE : PR_STEP_TENSORS_MIN_SIZE;
  if (t == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: tensors is NULL", fn);
  if (t->size < need) {
    return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                   "%s: tensors->size is %zu, expected at least %zu%s (use "
                   "PRECIS_STEP_TENSORS_INIT)",
                   fn, t->size, need, amsgrad ? " with cfg->amsgrad" : "");
  }
  return PRECIS_OK;
}

/* What a NaN/Inf check over a list reads, after pr_step_check_tensors_struct:
 * grad_dtype, and for count > 0 numels and grads, each aligned (precis_step_check_finite;
 * precis_cuda_step_check_finite checks the same, in the same order). */
static inline precis_status_t pr_step_check_grads(const char* fn, const precis_step_tensors_t* t) {
  size_t i;
  precis_status_t st = pr_step_check_dtype(fn, "tensors->grad_dtype", (int)t->grad_dtype,
                                           pr_step_param_dtype_ok((int)t->grad_dtype),
                                           "fp32, fp16, bf16");
  if (st != PRECIS_OK || t->count == 0) return st;
  if ((st = pr_step_check_numels(fn, t)) != PRECIS_OK) return st;
  if ((st = pr_step_check_ptrs(fn, t, (const void* const*)t->grads, "grads"))) return st;
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] == 0) continue;
    if ((st = pr_check_aligned(fn, "grads", (long long)i, t->grads[i], (int)t->grad_dtype))) {
      return st;
    }
  }
  return PRECIS_OK;
}

/* Everything precis_step checks, in its order, before any memory is
 * written. found_inf_given: whether the caller has somewhere to report a
 * non-finite gradient (found_inf_name names it in the message); steps_needed: 0
 * when the step numbers come from elsewhere than tensors->steps. */
static inline precis_status_t pr_step_check_args(const char* fn, const precis_step_config_t* cfg,
                                                 const precis_step_tensors_t* t,
                                                 int found_inf_given, const char* found_inf_name,
                                                 int steps_needed, int* master_mode) {
  precis_status_t st;
  if (cfg == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: cfg is NULL", fn);
  if ((st = pr_step_check_tensors_struct(fn, t, 0)) != PRECIS_OK) return st;
  if (cfg->size < PR_STEP_CONFIG_MIN_SIZE) {
    return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                   "%s: cfg->size is %zu, expected at least %zu (use PRECIS_STEP_CONFIG_INIT)",
                   fn, cfg->size, (size_t)PR_STEP_CONFIG_MIN_SIZE);
  }
  if ((st = pr_step_check_hyper(fn, cfg)) != PRECIS_OK) return st;
  if (pr_adam_amsgrad(cfg) && (st = pr_step_check_tensors_struct(fn, t, 1)) != PRECIS_OK) {
    return st;
  }
  if (cfg->check_finite && !found_inf_given) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s is NULL but cfg->check_finite is 1", fn,
                   found_inf_name);
  }
  if ((st = pr_step_check_dtypes(fn, t, pr_rule_use(cfg), master_mode)) != PRECIS_OK) return st;
  if (t->count == 0) return PRECIS_OK;
  return pr_step_check_tables(fn, t, steps_needed, *master_mode, pr_adam_amsgrad(cfg),
                              pr_rule_use(cfg));
}
#endif /* !__CUDACC_RTC__ */

#endif /* PRECIS_STEP_ARGS_H_ */
