/*
 * adam_step.c - libFuzzer harness of the argument checks of precis_step
 * and precis_step_check_finite (csrc/step_args.h), and of the CPU kernel on
 * whatever they let through.
 *
 * The input decodes into a config (hyperparameters often NaN, Inf, huge, out of
 * range; flags, amsgrad among them, sometimes neither 0 nor 1; the update rule,
 * mostly a legal one, with momentum, dampening and nesterov drawn the same way),
 * a tensor list (struct sizes, older headers' without the AMSGrad tables or
 * without the rules' tables among them; up to FZ_TENSORS tensors, dtype codes,
 * output_dtype too, numels, steps, tables that may be NULL, per-tensor lr_scales
 * sometimes NaN, Inf or negative) and for every buffer a pointer: NULL, its own
 * region of the arena, or any region (aliasing), at an offset of 0-3 bytes
 * (misaligned for 2- and 4-byte dtypes). Each region holds the largest buffer
 * that may point at it, and the gaps between regions are poisoned, so
 * AddressSanitizer reports any access outside them. A struct whose size field
 * is below sizeof is passed in a heap block of that size, so reading a field it
 * lacks is reported too. The AMSGrad fields are decoded after the others, and
 * the rule's fields (rule, momentum, dampening, nesterov, outputs, lr_scales) last: an
 * input that ends before them runs with amsgrad 0, or Adam without lr_scales. Invariants:
 *  - the status is OK exactly when a reference written here from precis.h's
 *    contract (each rule's, fz_step_valid) says the call is valid;
 *  - a failing call, and a step skipped for a non-finite gradient, leave every
 *    arena byte and *found_inf as they were;
 *  - a successful step changes no byte outside the buffers its rule writes, of
 *    non-empty tensors: params and masters (not muon_momentum), exp_avgs and
 *    their scales (not SGD with momentum 0), Adam's exp_avg_sqs and their
 *    scales, with amsgrad the running max and its scales, muon_momentum's
 *    outputs; grads are read only;
 *  - found_inf reports exactly whether a gradient is NaN/Inf (a reference scan);
 *  - param_fingerprints (where drawn) is left as it was unless the step wrote, and
 *    then holds each tensor's precis_fingerprint of its params as they are after it
 *    (where no other buffer the step writes shares their bytes).
 */
#include <sanitizer/asan_interface.h>

#include "step_cpu.h"
#include "fuzz.h"

enum {
  FZ_TENSORS = 4,
  FZ_ROLES = 10, /* params, grads, masters, exp_avgs, exp_avg_sqs, amsgrad's max,
                    muon_momentum's outputs, three scales */
  FZ_GAP = 32,   /* poisoned bytes after every region */
  FZ_BLOCK = 128 /* PRECIS_SCALE_BLOCK */
};
/* The scales last: a role >= R_M_SCALES holds one float per block. */
enum { R_PARAM, R_GRAD, R_MASTER, R_M, R_V, R_MAX, R_OUT, R_M_SCALES, R_V_SCALES, R_MAX_SCALES };
#define FZ_SENTINEL 0xA5A5A5A5A5A5A5A5ull /* param_fingerprints' entries before a call */
static const char* const fz_roles[FZ_ROLES] = {
    "params",         "grads",          "masters",           "exp_avgs",
    "exp_avg_sqs",    "max_exp_avg_sqs", "outputs",          "exp_avg_scales",
    "exp_avg_sq_scales", "max_exp_avg_sq_scales"};

typedef struct fz_case {
  precis_step_config_t cfg;
  precis_step_tensors_t t;
  int cfg_null, tensors_null, found_null;
  int64_t numels[FZ_TENSORS], steps[FZ_TENSORS], offsets[FZ_TENSORS];
  uint64_t streams[FZ_TENSORS];
  double lr_scales[FZ_TENSORS];
  void* ptrs[FZ_ROLES][FZ_TENSORS];
  int table_null[FZ_ROLES], numels_null, steps_null;
  uint64_t* fingerprints; /* tensors->param_fingerprints where drawn: FZ_TENSORS entries */
  uint8_t* arena;
  size_t arena_bytes;
  size_t region_at[FZ_TENSORS][FZ_ROLES], region_bytes[FZ_TENSORS][FZ_ROLES];
} fz_case_t;

static int fz_size(int dtype) {
  return dtype == PRECIS_DTYPE_FP32 ? 4 : dtype == PRECIS_DTYPE_FP8_E4M3 ? 1 : 2;
}
static int fz_scaled(int d) { return d == PRECIS_DTYPE_FP16 || d == PRECIS_DTYPE_FP8_E4M3; }
static int64_t fz_scale_count(int64_t n) { return (n + FZ_BLOCK - 1) / FZ_BLOCK; }

static int64_t fz_numel(fz_reader_t* r) {
  static const int64_t special[] = {0, 1, 127, 128, 129, 511, 512, 513, 1025, -1, INT64_MIN};
  uint8_t b = fz_u8(r);
  return b < 0xC0 ? b % 40 : special[b % (sizeof special / sizeof special[0])];
}

static int64_t fz_step(fz_reader_t* r) {
  static const int64_t special[] = {1, 2, 3, 1000, INT64_MAX, 0, -1, INT64_MIN};
  uint8_t b = fz_u8(r);
  return b < 0xE0 ? 1 + b % 20 : special[b % (sizeof special / sizeof special[0])];
}

/* A per-tensor lr: mostly a plausible one, else fz_double's specials (NaN, Inf,
 * negative, huge). */
static double fz_lr(fz_reader_t* r) {
  uint8_t b = fz_u8(r);
  return b < 0x80 ? 1e-3 * (1 + b % 16) : fz_double(r, 1e-2);
}

/* Simple deterministic bits for the buffer contents (splitmix64). */
static uint64_t fz_next(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The element of a role in its dtype, for the buffer sizes. */
static int fz_role_dtype(const precis_step_tensors_t* t, int role) {
  switch (role) {
    case R_PARAM: return (int)t->param_dtype;
    case R_GRAD: return (int)t->grad_dtype;
    case R_MASTER: return (int)t->master_dtype;
    case R_M: return (int)t->exp_avg_dtype;
    case R_V:
    case R_MAX: return (int)t->exp_avg_sq_dtype;
    case R_OUT: return (int)t->output_dtype;
    default: return PRECIS_DTYPE_FP32;
  }
}

/* Bytes a buffer of role for numel elements spans (scales: one float per block). */
static size_t fz_span(const precis_step_tensors_t* t, int role, int64_t numel) {
  if (numel <= 0) return 0;
  if (role >= R_M_SCALES) return (size_t)fz_scale_count(numel) * 4;
  return (size_t)numel * (size_t)fz_size(fz_role_dtype(t, role));
}

/* The pointer of role k of tensor i: its own region (aligned or not), another
 * region (aliasing), or NULL. */
static void fz_pointer(fz_reader_t* r, fz_case_t* c, int i, int k) {
  const size_t need = fz_span(&c->t, k, c->numels[i]);
  const uint8_t b = fz_u8(r);
  int ti = i, tk = k;
  size_t off = 0;
  if (b >= 0xF0) {
    c->ptrs[k][i] = NULL;
    return;
  }
  if (b >= 0xC0) { /* some region, e.g. another buffer's: aliasing */
    ti = (b >> 3) % FZ_TENSORS;
    tk = b % FZ_ROLES;
  }
  if ((b & 0x30) == 0x30) off = 1 + b % 3; /* misaligned for 2- and 4-byte elements */
  if (c->region_bytes[ti][tk] < need + off) ti = i, tk = k; /* keep it inside a region */
  c->ptrs[k][i] = c->arena + c->region_at[ti][tk] + off;
}

/* A table of role k, or NULL where the input says so. */
static void* const* fz_table_of(const fz_case_t* c, int k) {
  return c->table_null[k] ? NULL : (void* const*)c->ptrs[k];
}

/* A scale table where the moment dtype is scaled, but not always (both ways are
 * errors): flip inverts the choice. */
static float* const* fz_scales_of(const fz_case_t* c, int k, int dtype, int flip) {
  return fz_scaled(dtype) ^ flip ? (float* const*)fz_table_of(c, k) : NULL;
}

static void fz_decode(fz_reader_t* r, fz_case_t* c) {
  /* x86's paths: the fuzzers run on x86 (aarch64's neon and sve: tools/cross_test.sh). */
  static const char* const isas[] = {"scalar", "avx2", "avx512"};
  /* The tables that this byte may make NULL (R_MAX's is decided below). */
  static const int nullable[8] = {R_PARAM, R_GRAD, R_MASTER, R_M, R_V, R_MAX, R_M_SCALES,
                                  R_V_SCALES};
  static const int32_t rule_codes[4] = {-1, PRECIS_RULE_COUNT, 1000, INT32_MIN};
  /* tensors->size: 0, part of the plain tables (16, and all but their last field),
   * an older header's (before the AMSGrad tables; before the streams), part of the
   * AMSGrad tables, part of the key tables (streams but no element offsets), larger
   * than this header's. */
  static const size_t sizes[8] = {0, 16,
                                  offsetof(precis_step_tensors_t, max_exp_avg_sqs) - 8,
                                  offsetof(precis_step_tensors_t, max_exp_avg_sqs),
                                  offsetof(precis_step_tensors_t, max_exp_avg_sq_scales),
                                  offsetof(precis_step_tensors_t, streams),
                                  offsetof(precis_step_tensors_t, element_offsets),
                                  sizeof(precis_step_tensors_t) + 16};
  /* tensors->size without the rules' tables (the header before them), with outputs
   * only, without lr_scales, half of lr_scales. */
  static const size_t rule_sizes[4] = {offsetof(precis_step_tensors_t, outputs),
                                       offsetof(precis_step_tensors_t, output_dtype),
                                       offsetof(precis_step_tensors_t, lr_scales),
                                       offsetof(precis_step_tensors_t, lr_scales) + 4};
  precis_step_config_t* cfg = &c->cfg;
  precis_step_tensors_t* t = &c->t;
  size_t at = 0;
  uint64_t seed;
  uint8_t b;
  int i, k;

  pr_cpu_isa_force(isas[fz_u8(r) % 3]); /* -1 (unchanged) where the CPU lacks it */
  *cfg = (precis_step_config_t)PRECIS_STEP_CONFIG_INIT;
  b = fz_u8(r); /* 0xFF: an older header's size, without amsgrad */
  cfg->size = b < 0xF0 ? sizeof *cfg
              : b == 0xFF ? offsetof(precis_step_config_t, amsgrad) : (size_t)(b & 0xF) * 8;
  cfg->lr = fz_double(r, 1e-3);
  cfg->beta1 = fz_double(r, 0.5);
  cfg->beta2 = fz_double(r, 0.6);
  cfg->eps = fz_double(r, 1e-8);
  cfg->weight_decay = fz_double(r, 1e-2);
  cfg->inv_grad_scale = (float)fz_double(r, 0.5);
  cfg->decoupled_weight_decay = fz_flag(r);
  cfg->maximize = fz_flag(r);
  cfg->check_finite = fz_flag(r);
  cfg->lr_float32 = fz_flag(r);
  cfg->seed = fz_u64(r);
  b = fz_u8(r);
  cfg->num_threads = b == 0xFF ? INT32_MIN : (int32_t)(b % 4) - 1;
  b = fz_u8(r);
  c->cfg_null = b == 0xFF;
  c->tensors_null = b == 0xFE;
  c->found_null = (b & 0x70) == 0x70;

  *t = (precis_step_tensors_t)PRECIS_STEP_TENSORS_INIT;
  b = fz_u8(r); /* rarely a size other than sizeof: an older header's, too small, larger */
  t->size = b < 0xF8 ? sizeof *t : sizes[b & 7];
  t->count = (size_t)(b % (FZ_TENSORS + 1));
  t->param_dtype = (precis_dtype_t)fz_dtype(r);
  t->grad_dtype = (precis_dtype_t)fz_dtype(r);
  b = fz_u8(r); /* the master: mostly a legal one for the param */
  t->master_dtype = (precis_dtype_t)(b < 0x80 ? (int)t->param_dtype
                                              : b < 0x90 ? PRECIS_DTYPE_INT16
                                              : b < 0xA0 ? PRECIS_DTYPE_FP8_E4M3
                                              : b < 0xE0 ? PRECIS_DTYPE_FP32 : fz_dtype(r));
  t->exp_avg_dtype = (precis_dtype_t)fz_dtype(r);
  t->exp_avg_sq_dtype = (precis_dtype_t)fz_dtype(r);
  b = fz_u8(r); /* rarely a NULL table (the max's and the outputs': below) */
  if (b >= 0xF0) c->table_null[nullable[b & 7]] = 1;
  c->numels_null = b == 0xEF;
  c->steps_null = b == 0xEE;
  for (i = 0; i < FZ_TENSORS; ++i) {
    c->numels[i] = fz_numel(r);
    c->steps[i] = fz_step(r);
  }

  /* One region per (tensor, role), big enough for any dtype of any role at
   * that numel plus a 3-byte offset, 64-byte aligned, then a gap. */
  for (i = 0; i < FZ_TENSORS; ++i) {
    const int64_t n = c->numels[i] > 0 ? c->numels[i] : 0;
    for (k = 0; k < FZ_ROLES; ++k) {
      c->region_at[i][k] = at;
      c->region_bytes[i][k] = (size_t)n * 4 + 3;
      at += (c->region_bytes[i][k] + FZ_GAP + 63) / 64 * 64;
    }
  }
  c->arena_bytes = at;
  c->arena = fz_alloc(at);

  /* Contents: small finite values, or raw bits, and maybe a few NaN/Inf. */
  seed = fz_u64(r);
  b = fz_u8(r);
  for (i = 0; i < FZ_TENSORS; ++i) {
    for (k = 0; k < FZ_ROLES; ++k) {
      uint8_t* p = c->arena + c->region_at[i][k];
      size_t j;
      for (j = 0; j < c->region_bytes[i][k]; ++j) {
        uint64_t x = fz_next(&seed);
        /* (b & 1): raw bits; else bytes whose 16- and 32-bit words are finite. */
        p[j] = (b & 1) ? (uint8_t)x : (j % 2 == 1 ? (uint8_t)(x & 0x3F) : (uint8_t)x);
      }
      if ((b & 6) && c->region_bytes[i][k] > 4) { /* a NaN or Inf somewhere */
        size_t j0 = (size_t)(fz_next(&seed) % (c->region_bytes[i][k] - 4));
        p[j0 + 1] |= 0x7F, p[j0 + 2] |= 0x80 | 0x7F, p[j0 + 3] = 0x7F;
      }
    }
  }
  for (i = 0; i < FZ_TENSORS; ++i) {
    for (k = 0; k < FZ_ROLES; ++k) {
      if (k != R_MAX && k != R_MAX_SCALES && k != R_OUT) fz_pointer(r, c, i, k);
    }
  }
  t->numels = c->numels_null ? NULL : c->numels;
  t->steps = c->steps_null ? NULL : c->steps;
  t->params = fz_table_of(c, R_PARAM);
  t->grads = (const void* const*)fz_table_of(c, R_GRAD);
  t->masters = fz_table_of(c, R_MASTER);
  t->exp_avgs = fz_table_of(c, R_M);
  t->exp_avg_sqs = fz_table_of(c, R_V);
  b = fz_u8(r);
  t->exp_avg_scales = fz_scales_of(c, R_M_SCALES, (int)t->exp_avg_dtype, b == 0xFF);
  t->exp_avg_sq_scales = fz_scales_of(c, R_V_SCALES, (int)t->exp_avg_sq_dtype, b == 0xFE);

  /* AMSGrad, last: the flag, the max and its scales (NULL tables rarely). */
  cfg->amsgrad = fz_flag(r);
  for (i = 0; i < FZ_TENSORS; ++i) {
    fz_pointer(r, c, i, R_MAX);
    fz_pointer(r, c, i, R_MAX_SCALES);
  }
  b = fz_u8(r);
  c->table_null[R_MAX] = b == 0xFE;
  c->table_null[R_MAX_SCALES] = b == 0xFD;
  t->max_exp_avg_sqs = fz_table_of(c, R_MAX);
  t->max_exp_avg_sq_scales =
      fz_scales_of(c, R_MAX_SCALES, (int)t->exp_avg_sq_dtype, b == 0xFF);

  /* Stochastic rounding's streams and element offsets: any values (offsets near
   * INT64_MIN / MAX too), or NULL tables (the defaults). */
  b = fz_u8(r);
  for (i = 0; i < FZ_TENSORS; ++i) {
    c->streams[i] = fz_u64(r);
    c->offsets[i] = (int64_t)fz_u64(r);
  }
  t->streams = (b & 1) ? NULL : c->streams;
  t->element_offsets = (b & 2) ? NULL : c->offsets;

  /* The update rule, last: mostly a legal one, sometimes a code that is none;
   * nesterov a flag; momentum (usually in [0.5, 1)) and dampening (usually 0) as the
   * other hyperparameters. cfg->size above draws the sizes from before these
   * fields, or covering part of them, too (96, 104, 112). */
  b = fz_u8(r);
  cfg->rule = b < 0xF0 ? b % PRECIS_RULE_COUNT : rule_codes[b % 4];
  cfg->nesterov = fz_flag(r);
  cfg->momentum = fz_double(r, 0.5);
  cfg->dampening = fz_double(r, 0.0);

  /* muon_momentum's outputs (mostly a legal output_dtype, the table rarely NULL)
   * and the per-tensor lr_scales of SGD and Lion: NULL or a table, of lr_scales mostly valid. */
  b = fz_u8(r);
  t->output_dtype = (precis_dtype_t)(b < 0xC0 ? b % 3 : fz_dtype(r));
  for (i = 0; i < FZ_TENSORS; ++i) fz_pointer(r, c, i, R_OUT);
  b = fz_u8(r);
  c->table_null[R_OUT] = b == 0xFF;
  t->outputs = fz_table_of(c, R_OUT);
  for (i = 0; i < FZ_TENSORS; ++i) c->lr_scales[i] = fz_lr(r);
  t->lr_scales = (b & 1) ? c->lr_scales : NULL;
  b = fz_u8(r); /* rarely a tensors->size from before the rules' tables, or within them */
  if (b >= 0xFC && t->size == sizeof *t) t->size = rule_sizes[b & 3];
  /* param_fingerprints: mostly asked for (an array of sentinels off the arena, so a
   * write past its entries is reported), under every rule, muon_momentum's too. */
  c->fingerprints = (uint64_t*)fz_alloc(FZ_TENSORS * sizeof(uint64_t));
  for (i = 0; i < FZ_TENSORS; ++i) c->fingerprints[i] = FZ_SENTINEL;
  t->param_fingerprints = (fz_u8(r) & 3) ? c->fingerprints : NULL;
}

/* Where the master lives: 0 none, 1 separate, 2 remainders (int16 or 8-bit); -1 invalid. */
static int fz_master_mode(const precis_step_tensors_t* t) {
  const int p = (int)t->param_dtype, m = (int)t->master_dtype;
  if (m < 0 || m >= PRECIS_DTYPE_COUNT) return -1;
  if (m == p) return 0;
  if ((m == PRECIS_DTYPE_INT16 || m == PRECIS_DTYPE_FP8_E4M3) && p == PRECIS_DTYPE_BF16) return 2;
  if (m == PRECIS_DTYPE_FP32 || (m == PRECIS_DTYPE_FP16 && p == PRECIS_DTYPE_BF16)) return 1;
  return -1;
}

static int fz_param_dtype(int d) { return d >= 0 && d <= 2; }
static int fz_moment_dtype(int d) { return d >= 0 && d <= 3; }

/* cfg's size covers amsgrad (precis.h: the field is read only then). */
static int fz_amsgrad_covered(const precis_step_config_t* cfg) {
  return cfg->size >= offsetof(precis_step_config_t, amsgrad) + sizeof cfg->amsgrad;
}

static int fz_amsgrad(const precis_step_config_t* cfg) {
  return fz_amsgrad_covered(cfg) && cfg->amsgrad != 0;
}

/* cfg's size covers the rule fields, all four (precis.h: "read only when size covers
 * them: an older caller's smaller struct means Adam"). */
static int fz_rule_covered(const precis_step_config_t* cfg) {
  return cfg->size >= offsetof(precis_step_config_t, dampening) + sizeof cfg->dampening;
}

/* tensors' size covers the rules' tables, outputs, output_dtype and lr_scales ("read only
 * when size covers them", as the AMSGrad pair: all of them). */
static int fz_rule_tables_covered(const precis_step_tensors_t* t) {
  return t->size >= offsetof(precis_step_tensors_t, lr_scales) + sizeof t->lr_scales;
}

/* What the step reads and writes beyond params and grads, by precis.h's precis_rule_t:
 * m: exp_avgs (+ scales): every rule's state but SGD's without momentum ("momentum 0:
 * d = g, exp_avgs may be NULL"); v: exp_avg_sqs (+ scales), Adam's alone ("The
 * one-state rules ... read no exp_avg_sqs"); param: the param and its master are
 * written (not muon_momentum: "Params and masters are neither read nor written");
 * out: outputs (muon_momentum); lr_scales: tensors->lr_scales taken (SGD, Lion); amsgrad: the
 * running max (+ scales). */
typedef struct fz_use {
  int rule, m, v, param, out, lr_scales, amsgrad;
} fz_use_t;

static fz_use_t fz_use_of(const precis_step_config_t* cfg) {
  fz_use_t u;
  u.rule = fz_rule_covered(cfg) ? cfg->rule : PRECIS_RULE_ADAM;
  u.m = u.rule != PRECIS_RULE_SGD || cfg->momentum > 0;
  u.v = u.rule == PRECIS_RULE_ADAM;
  u.param = u.rule != PRECIS_RULE_MUON_MOMENTUM;
  u.out = u.rule == PRECIS_RULE_MUON_MOMENTUM;
  u.lr_scales = u.rule == PRECIS_RULE_SGD || u.rule == PRECIS_RULE_LION;
  u.amsgrad = fz_amsgrad(cfg);
  return u;
}

/* Role k of tensor list t is used (read or written) by the step of u, so checked:
 * the table given, its entries of non-empty tensors non-NULL and aligned. Params are
 * checked under every rule, muon_momentum's too, which leaves them (step_args.h;
 * precis.h only says they are neither read nor written). */
static int fz_role_used(const precis_step_tensors_t* t, int k, int mode, fz_use_t u) {
  switch (k) {
    case R_MASTER: return mode != 0 && u.param;
    case R_M: return u.m;
    case R_V: return u.v;
    case R_MAX: return u.amsgrad;
    case R_OUT: return u.out;
    case R_M_SCALES: return u.m && fz_scaled((int)t->exp_avg_dtype);
    case R_V_SCALES: return u.v && fz_scaled((int)t->exp_avg_sq_dtype);
    case R_MAX_SCALES: return u.amsgrad && fz_scaled((int)t->exp_avg_sq_dtype);
    default: return 1; /* params, grads */
  }
}

/* Role k is written by a successful step of u: every used role but the grads, and
 * the params only where the rule steps them. */
static int fz_role_written(const precis_step_tensors_t* t, int k, int mode, fz_use_t u) {
  return k != R_GRAD && (k != R_PARAM || u.param) && fz_role_used(t, k, mode, u);
}

/* Scale role k belongs to a moment the step keeps (its table is then given exactly
 * when that moment's dtype is scaled, and must be NULL otherwise). */
static int fz_scales_kept(int k, fz_use_t u) {
  return k == R_M_SCALES ? u.m : k == R_V_SCALES ? u.v : k == R_MAX_SCALES && u.amsgrad;
}

static const void* const* fz_table(const precis_step_tensors_t* t, int k) {
  switch (k) {
    case R_PARAM: return (const void* const*)t->params;
    case R_GRAD: return t->grads;
    case R_MASTER: return (const void* const*)t->masters;
    case R_M: return (const void* const*)t->exp_avgs;
    case R_V: return (const void* const*)t->exp_avg_sqs;
    case R_MAX: return (const void* const*)t->max_exp_avg_sqs;
    case R_OUT: return (const void* const*)t->outputs;
    case R_M_SCALES: return (const void* const*)t->exp_avg_scales;
    case R_V_SCALES: return (const void* const*)t->exp_avg_sq_scales;
    default: return (const void* const*)t->max_exp_avg_sq_scales;
  }
}

static int fz_aligned(const void* p, int dtype) {
  return (uintptr_t)p % (uintptr_t)fz_size(dtype) == 0;
}

/* The grads of the list: count, numels, grads table and entries valid. */
static int fz_grads_valid(const precis_step_tensors_t* t) {
  size_t i;
  if (!fz_param_dtype((int)t->grad_dtype)) return 0;
  if (t->count == 0) return 1;
  if (t->numels == NULL || t->grads == NULL) return 0;
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] < 0) return 0;
  }
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] > 0 && (t->grads[i] == NULL || !fz_aligned(t->grads[i], (int)t->grad_dtype))) {
      return 0;
    }
  }
  return 1;
}

static int fz_finite(double x) { return x == x && x - x == 0.0; }

/* AMSGrad: the max or its scales of a non-empty tensor share a byte with
 * another buffer of the same tensor the step uses (refused: the step writes the
 * max into its own memory). Other aliasing is the caller's business. */
static int fz_max_aliased(const precis_step_tensors_t* t, int mode, fz_use_t u) {
  static const int written[] = {R_MAX, R_MAX_SCALES};
  size_t i;
  int j, k;
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] == 0) continue;
    for (j = 0; j < 2; ++j) {
      const int w = written[j];
      uintptr_t a;
      size_t na;
      if (!fz_role_used(t, w, mode, u)) continue;
      a = (uintptr_t)fz_table(t, w)[i];
      na = fz_span(t, w, t->numels[i]);
      for (k = 0; k < FZ_ROLES; ++k) {
        uintptr_t b;
        if (k == w || !fz_role_used(t, k, mode, u)) continue;
        b = (uintptr_t)fz_table(t, k)[i];
        if (a < b + fz_span(t, k, t->numels[i]) && b < a + na) return 1;
      }
    }
  }
  return 0;
}

/* The rule and the hyperparameters only it reads (precis_step_config_t, precis_rule_t).
 * precis.h gives momentum's ranges; what it leaves unsaid is step_args.h's: each rule's
 * betas and eps (Adam's betas in [0, 1) and eps finite and >= 0, Lion's betas in [0, 1],
 * none for SGD and muon_momentum), momentum and dampening finite, nesterov 0 or 1 and
 * 0 under Adam and Lion, torch.optim.SGD's Nesterov (a momentum, zero dampening),
 * amsgrad only with Adam. */
static int fz_rule_valid(const precis_step_config_t* cfg, fz_use_t u) {
  const int covered = fz_rule_covered(cfg), nesterov = covered ? cfg->nesterov : 0;
  if (covered && (u.rule < 0 || u.rule >= PRECIS_RULE_COUNT || (uint32_t)nesterov > 1)) {
    return 0;
  }
  if (u.rule != PRECIS_RULE_ADAM && u.amsgrad) return 0;
  switch (u.rule) {
    case PRECIS_RULE_ADAM:
      return cfg->beta1 >= 0 && cfg->beta1 < 1 && cfg->beta2 >= 0 && cfg->beta2 < 1 &&
             fz_finite(cfg->eps) && cfg->eps >= 0 && !nesterov;
    case PRECIS_RULE_SGD: /* precis.h: momentum >= 0 (and finite: step_args.h) */
      return fz_finite(cfg->momentum) && cfg->momentum >= 0 && fz_finite(cfg->dampening) &&
             (!nesterov || (cfg->momentum > 0 && cfg->dampening == 0));
    case PRECIS_RULE_LION:
      return cfg->beta1 >= 0 && cfg->beta1 <= 1 && cfg->beta2 >= 0 && cfg->beta2 <= 1 &&
             !nesterov;
    case PRECIS_RULE_MUON_MOMENTUM: /* precis.h: momentum in [0, 1) */
      return cfg->momentum >= 0 && cfg->momentum < 1;
    default: /* a rule this model does not know yet: give it its case */
      return 0;
  }
}

/* The dtypes the step of u reads: params' and grads' always, the master's (its
 * combination with the param; muon_momentum's too, as the params), the moments' it
 * keeps, the outputs' of muon_momentum. */
static int fz_dtypes_valid(const precis_step_tensors_t* t, fz_use_t u) {
  if (!fz_param_dtype((int)t->param_dtype) || !fz_param_dtype((int)t->grad_dtype)) return 0;
  if (u.m && !fz_moment_dtype((int)t->exp_avg_dtype)) return 0;
  if (u.v && !fz_moment_dtype((int)t->exp_avg_sq_dtype)) return 0;
  if (u.out && !fz_param_dtype((int)t->output_dtype)) return 0;
  return fz_master_mode(t) >= 0;
}

/* tensors->param_fingerprints where the struct reaches past it, else NULL. */
static uint64_t* fz_fingerprints_of(const precis_step_tensors_t* t) {
  return t->size >= offsetof(precis_step_tensors_t, param_fingerprints) + sizeof(uint64_t*)
             ? t->param_fingerprints
             : NULL;
}

/* precis_step's contract, independently of step_args.h. */
static int fz_step_valid(const precis_step_config_t* cfg,
                         const precis_step_tensors_t* t, const int32_t* found) {
  fz_use_t u;
  int mode, k;
  size_t i;
  if (cfg == NULL || t == NULL) return 0;
  /* The structs of an older header (before amsgrad) pass, without amsgrad; a config
   * from before the rule fields means Adam. */
  if (cfg->size < offsetof(precis_step_config_t, amsgrad)) return 0;
  u = fz_use_of(cfg);
  if (t->size < (u.amsgrad ? offsetof(precis_step_tensors_t, streams)
                           : offsetof(precis_step_tensors_t, max_exp_avg_sqs))) {
    return 0;
  }
  /* muon_momentum writes outputs: a tensors struct without them cannot serve it. */
  if (u.out && !fz_rule_tables_covered(t)) return 0;
  if (fz_amsgrad_covered(cfg) && (uint32_t)cfg->amsgrad > 1) return 0;
  if (!(fz_finite(cfg->lr) && cfg->lr >= 0) ||
      !(fz_finite(cfg->weight_decay) && cfg->weight_decay >= 0) ||
      !(fz_finite(cfg->inv_grad_scale) && cfg->inv_grad_scale > 0)) {
    return 0;
  }
  if ((uint32_t)cfg->decoupled_weight_decay > 1 || (uint32_t)cfg->maximize > 1 ||
      (uint32_t)cfg->check_finite > 1 || (uint32_t)cfg->lr_float32 > 1 || cfg->num_threads < 0) {
    return 0;
  }
  if (!fz_rule_valid(cfg, u)) return 0;
  if (cfg->lr_float32 && !fz_finite((float)cfg->lr)) return 0;
  if (cfg->check_finite && found == NULL) return 0;
  if (!fz_dtypes_valid(t, u)) return 0;
  mode = fz_master_mode(t);
  if (t->count == 0) return 1;
  if (t->numels == NULL || t->steps == NULL) return 0;
  for (i = 0; i < t->count; ++i) {
    if (t->numels[i] < 0 || t->steps[i] < 1) return 0;
  }
  for (k = 0; k < FZ_ROLES; ++k) {
    const void* const* table = fz_table(t, k);
    if (!fz_role_used(t, k, mode, u)) {
      /* Scales of a kept moment whose dtype is not scaled; a moment the rule does not
       * keep (the max without amsgrad) leaves its scales unread. */
      if (k >= R_M_SCALES && fz_scales_kept(k, u) && table != NULL) return 0;
      continue;
    }
    if (table == NULL) return 0;
    for (i = 0; i < t->count; ++i) {
      if (t->numels[i] == 0) continue;
      if (table[i] == NULL || !fz_aligned(table[i], fz_role_dtype(t, k))) {
        return 0;
      }
    }
  }
  /* lr_scales, where the struct has it: NULL, or SGD's and Lion's (precis.h: "SGD, LION:
   * NULL, or tensor i's lr"; refused under Adam and muon_momentum: step_args.h), each
   * finite and >= 0. */
  if (fz_rule_tables_covered(t) && t->lr_scales != NULL) {
    if (!u.lr_scales) return 0;
    for (i = 0; i < t->count; ++i) {
      if (!(fz_finite(t->lr_scales[i]) && t->lr_scales[i] >= 0)) return 0;
    }
  }
  /* param_fingerprints, where the struct has it: NULL, or a rule that writes params. */
  if (fz_fingerprints_of(t) != NULL && !u.param) return 0;
  return !u.amsgrad || !fz_max_aliased(t, mode, u);
}

/* 1 if a gradient of the list is NaN or Inf (the list is valid for it). */
static int fz_grads_nonfinite(const precis_step_tensors_t* t) {
  size_t i;
  int64_t j;
  for (i = 0; i < t->count; ++i) {
    for (j = 0; j < t->numels[i]; ++j) {
      const uint8_t* g = (const uint8_t*)t->grads[i];
      if (t->grad_dtype == PRECIS_DTYPE_FP32) {
        uint32_t u;
        memcpy(&u, g + 4 * j, 4);
        if ((u & 0x7F800000u) == 0x7F800000u) return 1;
      } else {
        uint16_t u;
        memcpy(&u, g + 2 * j, 2);
        if ((u & (t->grad_dtype == PRECIS_DTYPE_FP16 ? 0x7C00u : 0x7F80u)) ==
            (t->grad_dtype == PRECIS_DTYPE_FP16 ? 0x7C00u : 0x7F80u)) {
          return 1;
        }
      }
    }
  }
  return 0;
}

/* Marks in mask the bytes a successful step may write. */
static void fz_mark_written(const fz_case_t* c, uint8_t* mask) {
  const precis_step_tensors_t* t = &c->t;
  const int mode = fz_master_mode(t);
  const fz_use_t u = fz_use_of(&c->cfg);
  size_t i;
  int k;
  for (i = 0; i < t->count; ++i) {
    for (k = 0; k < FZ_ROLES; ++k) {
      if (!fz_role_written(t, k, mode, u) || t->numels[i] == 0) continue;
      memset(mask + ((const uint8_t*)fz_table(t, k)[i] - c->arena), 1,
             fz_span(t, k, t->numels[i]));
    }
  }
}

/* Whether tensor i's params share no byte with a buffer the step writes but them: its
 * fingerprint is then that of the bytes the step left (a caller's aliasing makes it
 * whatever the later writes leave, which precis.h forbids but the C side cannot see). */
static int fz_params_alone(const fz_case_t* c, size_t i) {
  const precis_step_tensors_t* t = &c->t;
  const int mode = fz_master_mode(t);
  const fz_use_t u = fz_use_of(&c->cfg);
  const uint8_t* lo = (const uint8_t*)t->params[i];
  const uint8_t* hi = lo + fz_span(t, R_PARAM, t->numels[i]);
  size_t j;
  int k;
  for (j = 0; j < t->count; ++j) {
    for (k = 0; k < FZ_ROLES; ++k) {
      const uint8_t* b;
      if ((j == i && k == R_PARAM) || !fz_role_written(t, k, mode, u) || t->numels[j] == 0) {
        continue;
      }
      b = (const uint8_t*)fz_table(t, k)[j];
      if (b < hi && lo < b + fz_span(t, k, t->numels[j])) return 0;
    }
  }
  return 1;
}

/* The region arena byte j is in, for messages ("gap" between regions). */
static const char* fz_region_of(const fz_case_t* c, size_t j, int* tensor) {
  int i, k;
  for (i = 0; i < FZ_TENSORS; ++i) {
    for (k = 0; k < FZ_ROLES; ++k) {
      if (j >= c->region_at[i][k] && j < c->region_at[i][k] + c->region_bytes[i][k]) {
        *tensor = i;
        return fz_roles[k];
      }
    }
  }
  *tensor = -1;
  return "gap";
}

static void fz_poison_gaps(const fz_case_t* c, int poison) {
  int i, k;
  for (i = 0; i < FZ_TENSORS; ++i) {
    for (k = 0; k < FZ_ROLES; ++k) {
      const size_t end = c->region_at[i][k] + c->region_bytes[i][k];
      const size_t next = (c->region_bytes[i][k] + FZ_GAP + 63) / 64 * 64 + c->region_at[i][k];
      if (poison) {
        ASAN_POISON_MEMORY_REGION(c->arena + end, next - end);
      } else {
        ASAN_UNPOISON_MEMORY_REGION(c->arena + end, next - end);
      }
    }
  }
}

/* A struct as the caller of a header whose struct is size bytes passes it: a
 * heap block of that size (at least the size field; zeros past full), so that
 * AddressSanitizer reports a read of a field that caller's struct lacks. */
static void* fz_struct_block(const void* s, size_t size, size_t full) {
  const size_t bytes = size < sizeof(size_t) ? sizeof(size_t) : size;
  uint8_t* p = fz_alloc(bytes);
  memcpy(p, s, bytes < full ? bytes : full);
  if (bytes > full) memset(p + full, 0, bytes - full);
  return p;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fz_reader_t r = {data, size};
  fz_case_t c;
  uint8_t *before, *mask;
  const precis_step_config_t* cfg; /* the decoded structs, for the reference */
  const precis_step_tensors_t* t;
  precis_step_config_t* cfg_block; /* what the calls get */
  precis_step_tensors_t* t_block;
  int32_t found, found_before;
  int valid, grads_valid, nonfinite = -1;
  precis_status_t st;
  size_t j;

  memset(&c, 0, sizeof c);
  fz_decode(&r, &c);
  cfg = c.cfg_null ? NULL : &c.cfg;
  t = c.tensors_null ? NULL : &c.t;
  cfg_block = (precis_step_config_t*)fz_struct_block(&c.cfg, c.cfg.size, sizeof c.cfg);
  t_block = (precis_step_tensors_t*)fz_struct_block(&c.t, c.t.size, sizeof c.t);
  before = (uint8_t*)malloc(c.arena_bytes + 1);
  mask = (uint8_t*)calloc(c.arena_bytes + 1, 1);
  memcpy(before, c.arena, c.arena_bytes);
  valid = fz_step_valid(cfg, t, c.found_null ? NULL : &found);
  grads_valid = t != NULL && t->size >= offsetof(precis_step_tensors_t, max_exp_avg_sqs) &&
                fz_grads_valid(t);
  if (grads_valid) nonfinite = fz_grads_nonfinite(t);
  fz_poison_gaps(&c, 1);

  /* check_finite: reads the grads, writes only the flag. */
  found_before = found = (int32_t)(fz_u8(&r) & 1);
  st = precis_step_check_finite(t ? t_block : NULL, c.found_null ? NULL : &found);
  fz_check_status(st, "precis_step_check_finite", "precis_step_check_finite: ");
  FZ_CHECK((st == PRECIS_OK) == (grads_valid && !c.found_null), "check_finite: status %d, want %s",
           (int)st, grads_valid && !c.found_null ? "OK" : "a failure");
  FZ_CHECK(found == (st == PRECIS_OK && found_before == 0 ? nonfinite : found_before),
           "check_finite: found_inf %d (was %d), nonfinite %d", (int)found, (int)found_before,
           nonfinite);

  /* The step. */
  found = 77;
  st = precis_step(cfg ? cfg_block : NULL, t ? t_block : NULL,
                   c.found_null ? NULL : &found);
  fz_poison_gaps(&c, 0);
  fz_check_status(st, "precis_step", "precis_step: ");
  FZ_CHECK((st == PRECIS_OK) == valid, "step: status %d, want %s", (int)st,
           valid ? "OK" : "a failure");
  if (st != PRECIS_OK) {
    FZ_CHECK(found == 77, "failed step wrote found_inf");
  } else if (!c.found_null) {
    const int skipped = c.cfg.check_finite && t->count > 0 && nonfinite;
    FZ_CHECK(found == skipped, "found_inf %d, want %d", (int)found, skipped);
  }
  if (st == PRECIS_OK && found != 1) fz_mark_written(&c, mask);
  /* param_fingerprints: untouched unless the step wrote; then each tensor's is its
   * params' precis_fingerprint (an empty one's 0) wherever nothing else wrote them. */
  if (t != NULL && fz_fingerprints_of(t) != NULL) {
    const int wrote = st == PRECIS_OK && found != 1 && t->count > 0;
    for (j = 0; j < (wrote ? t->count : FZ_TENSORS); ++j) {
      uint64_t want = FZ_SENTINEL;
      if (wrote) {
        const void* buf = t->params[j];
        const int64_t nbytes = (int64_t)fz_span(t, R_PARAM, t->numels[j]);
        if (nbytes > 0 && !fz_params_alone(&c, j)) continue;
        FZ_CHECK(precis_fingerprint(&buf, &nbytes, 1, &want) == PRECIS_OK, "fingerprint: %s",
                 precis_last_error());
      }
      FZ_CHECK(c.fingerprints[j] == want, "param_fingerprints[%zu] %llx, want %llx (status %d, "
               "found_inf %d)", j, (unsigned long long)c.fingerprints[j],
               (unsigned long long)want, (int)st, (int)found);
    }
  }
  for (j = 0; j < c.arena_bytes; ++j) {
    int tensor;
    const char* region = mask[j] || c.arena[j] == before[j] ? "" : fz_region_of(&c, j, &tensor);
    FZ_CHECK(region[0] == '\0',
             "arena byte %zu (region %s of tensor %d) changed (status %d, found_inf %d), not in "
             "a buffer the step writes", j, region, tensor, (int)st, (int)found);
  }
  free(c.arena);
  free(c.fingerprints);
  free(cfg_block);
  free(t_block);
  free(before);
  free(mask);
  return 0;
}
