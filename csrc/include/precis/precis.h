/*
 * precis.h - the whole public C ABI of precis.
 *
 * Conventions (see docs/design.md section 2):
 *  - every entry point returns precis_status_t (PRECIS_OK == 0); nothing aborts,
 *    exits or throws on bad input; precis_last_error() gives a thread-local message;
 *  - handles and calls never own tensor memory: the caller passes pointers,
 *    element counts and dtype codes; every buffer must be aligned to its element
 *    size (a misaligned one fails with PRECIS_ERR_INVALID_ARGUMENT naming it);
 *  - structs that may grow carry a `size` field: initialise them with the
 *    matching ..._INIT macro;
 *  - CUDA entry points (libprecis_cuda.so) take the stream, as a void*, last.
 *
 * The header is C11 and C++ clean and needs only <stddef.h> and <stdint.h>.
 */
#ifndef PRECIS_PRECIS_H_
#define PRECIS_PRECIS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PRECIS_VERSION_MAJOR 0
#define PRECIS_VERSION_MINOR 2
#define PRECIS_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, as returned by precis_version(). */
#define PRECIS_VERSION_CODE \
  (PRECIS_VERSION_MAJOR * 10000 + PRECIS_VERSION_MINOR * 100 + PRECIS_VERSION_PATCH)

#if defined(__GNUC__)
#define PRECIS_API __attribute__((visibility("default")))
#else
#define PRECIS_API
#endif

/* ------------------------------------------------------------------------ */
/* Status and errors                                                         */
/* ------------------------------------------------------------------------ */

typedef enum precis_status {
  PRECIS_OK = 0,
  PRECIS_ERR_NULL_POINTER = 1,     /* a required pointer argument was NULL */
  PRECIS_ERR_INVALID_ARGUMENT = 2, /* a value out of range, an unknown field name */
  PRECIS_ERR_INVALID_DTYPE = 3,    /* an unknown dtype code or name */
  PRECIS_ERR_INVALID_POLICY = 4,   /* a dtype outside a field's legal set, a bad combination */
  PRECIS_ERR_SIZE_MISMATCH = 5,    /* buffers or counts that do not agree */
  PRECIS_ERR_UNSUPPORTED = 6,      /* a legal request this build cannot serve */
  PRECIS_ERR_CUDA = 7,             /* a CUDA runtime error (message has the detail) */
  PRECIS_ERR_OUT_OF_MEMORY = 8,
  PRECIS_STATUS_COUNT
} precis_status_t;

/* A fixed, static description of a status code ("unknown status" if out of range). */
PRECIS_API const char* precis_status_string(precis_status_t status);

/* The detailed message of the last failing call on this thread ("" if none).
 * Valid until the next precis call on the same thread. */
PRECIS_API const char* precis_last_error(void);

/* PRECIS_VERSION_CODE of the loaded library. */
PRECIS_API int precis_version(void);

/* ------------------------------------------------------------------------ */
/* Dtypes                                                                    */
/* ------------------------------------------------------------------------ */

typedef enum precis_dtype {
  PRECIS_DTYPE_FP32 = 0,
  PRECIS_DTYPE_FP16 = 1,
  PRECIS_DTYPE_BF16 = 2,
  PRECIS_DTYPE_FP8_E4M3 = 3, /* stored as uint8 bytes */
  PRECIS_DTYPE_INT16 = 4,    /* param remainders */
  PRECIS_DTYPE_COUNT
} precis_dtype_t;

/* Name -> dtype. Case- and whitespace-insensitive; aliases:
 * fp32 float32 float | fp16 float16 half | bf16 bfloat16 |
 * fp8 float8 fp8_e4m3 e4m3 uint8 | int16 */
PRECIS_API precis_status_t precis_dtype_from_name(const char* name, precis_dtype_t* out);
/* dtype -> canonical name ("fp32", "fp16", "bf16", "fp8", "int16"); static storage. */
PRECIS_API precis_status_t precis_dtype_name(precis_dtype_t dtype, const char** out);
/* Bytes per element. */
PRECIS_API precis_status_t precis_dtype_size(precis_dtype_t dtype, size_t* out);

/* ------------------------------------------------------------------------ */
/* Precision policy (docs/design.md section 3)                                    */
/* ------------------------------------------------------------------------ */

/* Bits of precis_policy_t.explicit_fields: which fields were set by an override
 * (the rest follow the defaults of the model dtype). */
typedef enum precis_policy_field {
  PRECIS_FIELD_MAIN_PARAMS_DTYPE = 0,
  PRECIS_FIELD_MAIN_GRADS_DTYPE = 1,
  PRECIS_FIELD_GRAD_COMM_DTYPE = 2,
  PRECIS_FIELD_EXP_AVG_DTYPE = 3,
  PRECIS_FIELD_EXP_AVG_SQ_DTYPE = 4,
  PRECIS_FIELD_STORE_PARAM_REMAINDERS = 5,
  PRECIS_FIELD_GRAD_REDUCE_IN_FP32 = 6,
  PRECIS_FIELD_GRAD_SUM_DTYPE = 7,
  PRECIS_FIELD_PARAM_REMAINDER_BITS = 8,
  PRECIS_FIELD_MOMENTUM_DTYPE = 9,
  PRECIS_FIELD_COUNT
} precis_policy_field_t;

typedef struct precis_policy {
  /* sizeof(precis_policy_t); set by PRECIS_POLICY_INIT. A caller built before
   * momentum_dtype passes its smaller struct (size up to param_remainder_bits):
   * accepted, the missing member neither read nor written (it follows
   * exp_avg_dtype); only an override of momentum_dtype needs the member. */
  size_t size;
  precis_dtype_t param_dtype;       /* the model's dtype */
  precis_dtype_t main_params_dtype; /* master weights; == param_dtype: the param is its own master */
  precis_dtype_t main_grads_dtype;  /* gradient accumulation buffer */
  precis_dtype_t grad_comm_dtype;   /* dtype on the wire */
  precis_dtype_t exp_avg_dtype;
  precis_dtype_t exp_avg_sq_dtype;
  int32_t store_param_remainders; /* 0 or 1 */
  uint32_t explicit_fields;       /* bit (1u << precis_policy_field_t) per overridden field */
  /* the dtype the ranks' gradients are added in: grad_comm_dtype (the sums in the
   * wire's dtype, as an all-reduce adds) or fp32 with a 16-bit wire (each rank adds
   * the 16-bit chunks it receives in fp32: the wire's bytes, one rounding). Last, so
   * the fields before it keep their offsets. */
  precis_dtype_t grad_sum_dtype;
  /* with store_param_remainders: 16 (an int16 remainder: the fp32 master exactly) or
   * 8 (one byte: a 24-bit master, bf16 + 8 bits, rounded to nearest after each step;
   * the byte is stored as uint8, dtype code PRECIS_DTYPE_FP8_E4M3's size). */
  int32_t param_remainder_bits;
  /* the one state buffer of SGD, Lion and Muon (the momentum), in place of Adam's
   * exp_avg / exp_avg_sq: follows exp_avg_dtype unless set. Last, as above. */
  precis_dtype_t momentum_dtype;
} precis_policy_t;

#define PRECIS_POLICY_INIT \
  { sizeof(precis_policy_t), PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, \
    PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, 0, 0u, PRECIS_DTYPE_FP32, 16, \
    PRECIS_DTYPE_FP32 }

/* Fill *policy with the defaults for a model dtype (fp32, fp16 or bf16).
 * policy->size must be set (PRECIS_POLICY_INIT); a struct from before momentum_dtype
 * gets every member it has. */
PRECIS_API precis_status_t precis_policy_defaults(precis_dtype_t model_dtype,
                                                  precis_policy_t* policy);

/* Apply one override. field: "main_params_dtype", "main_grads_dtype",
 * "grad_comm_dtype", "grad_sum_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
 * "momentum_dtype", "store_param_remainders" (true/false/1/0/yes/no/on/off),
 * "param_remainder_bits" (16 or 8) or "grad_reduce_in_fp32"
 * (true: main grads fp32, false: main grads in the model dtype). Fields that were
 * not overridden follow the overridden ones where the defaults say so
 * (grad_comm_dtype follows main_grads_dtype, grad_sum_dtype follows
 * grad_comm_dtype, momentum_dtype follows exp_avg_dtype), whatever the order of
 * the calls.
 * Fails, leaving *policy unchanged, on an unknown field, an unknown value, a value
 * outside the field's legal set, a grad_reduce_in_fp32 that contradicts an
 * explicit main_grads_dtype, or momentum_dtype on a struct from before it
 * (PRECIS_ERR_SIZE_MISMATCH). Combination rules are checked by
 * precis_policy_validate once all overrides are in. */
PRECIS_API precis_status_t precis_policy_set(precis_policy_t* policy, const char* field,
                                             const char* value);

/* Check legal sets (momentum_dtype's where the struct has it) and combination rules:
 *  - master at least as wide as the param; an fp32 model keeps no separate master;
 *    a bf16 master (no master for a bf16 model) means stochastic rounding;
 *  - remainders need bf16 params and an fp32 master;
 *  - grad_sum_dtype is grad_comm_dtype or fp32;
 *  - param_remainder_bits is 16 or 8, and 8 only with remainders. */
PRECIS_API precis_status_t precis_policy_validate(const precis_policy_t* policy);

/* Defaults for model_dtype, then every (fields[i], values[i]) override, then
 * validation, in one call; *out is written only on success. A field named twice (in
 * any case: "exp_avg_dtype", "EXP_AVG_DTYPE") fails, PRECIS_ERR_INVALID_ARGUMENT,
 * naming both indices. An *out from before
 * momentum_dtype gets the members it has; a momentum_dtype override then fails
 * (PRECIS_ERR_SIZE_MISMATCH). */
PRECIS_API precis_status_t precis_policy_resolve(precis_dtype_t model_dtype,
                                                 const char* const* fields,
                                                 const char* const* values, size_t count,
                                                 precis_policy_t* out);

/* The dtypes a field accepts, as a bit set (1u << precis_dtype_t). */
PRECIS_API precis_status_t precis_policy_legal_dtypes(const char* field, uint32_t* out_mask);

/* ------------------------------------------------------------------------ */
/* Element-wise bucket ops (CPU: libprecis.so)                               */
/* ------------------------------------------------------------------------ */

/* dst[i] += src[i] for numel elements; dst and src each fp32, fp16 or bf16, the
 * same buffer or not overlapping.
 * The sum is formed in fp32 and rounded to nearest even into dst's dtype. */
PRECIS_API precis_status_t precis_accumulate(void* dst, precis_dtype_t dst_dtype,
                                             const void* src, precis_dtype_t src_dtype,
                                             int64_t numel);

/* dst[i] = src[i] converted (fp32, fp16, bf16 each way; rounding to nearest even).
 * dst and src must not overlap unless they are the same buffer of the same dtype. */
PRECIS_API precis_status_t precis_cast(void* dst, precis_dtype_t dst_dtype, const void* src,
                                       precis_dtype_t src_dtype, int64_t numel);

/* buf[i] *= factor, in fp32, rounded back to buf's dtype (fp32, fp16, bf16). */
PRECIS_API precis_status_t precis_scale(void* buf, precis_dtype_t dtype, float factor,
                                        int64_t numel);

/* *out_count = number of NaN/Inf elements of buf (fp32, fp16, bf16). */
PRECIS_API precis_status_t precis_count_nonfinite(const void* buf, precis_dtype_t dtype,
                                                  int64_t numel, int64_t* out_count);

/* out[i] = a 64-bit fingerprint of the nbytes[i] bytes at bufs[i], for i < count: a
 * change within one 8-byte word always changes it, changes to several words or bytes
 * moved with probability 1 - 2^-64 (not cryptographic: it detects writes, it does not
 * resist crafted ones). The same bytes give the same value on every CPU and thread
 * count. Every range is checked before anything is written. */
PRECIS_API precis_status_t precis_fingerprint(const void* const* bufs, const int64_t* nbytes,
                                              int64_t count, uint64_t* out);

/* Elements of a block of precis_fingerprint_blocks' callers: the block record a step
 * writes (precis_step_tensors_t.param_block_fingerprints) is of blocks of this many
 * elements of the param's dtype. */
#define PRECIS_FINGERPRINT_BLOCK 16384

/* The blocks of block bytes of each of count byte ranges (the last of a range shorter;
 * one, of nothing, for an empty range), one after another in out: range i's first at
 * the sum of the earlier ranges' counts, max(1, ceil(nbytes[i] / block)) each. A block's
 * value is its words' terms at their place in its range, without the length term
 * precis_fingerprint adds: a range's blocks summed, plus nbytes[i] *
 * 0x9E3779B97F4A7C15 (mod 2^64), are its precis_fingerprint; a change within one word of
 * a block always changes the block's value. block > 0, a multiple of 8. So a write into
 * part of a tensor is found block by block (the optimizer keeps remainders of the blocks
 * not written), and a step records its params' blocks as it writes them. */
PRECIS_API precis_status_t precis_fingerprint_blocks(const void* const* bufs,
                                                     const int64_t* nbytes, int64_t count,
                                                     int64_t block, uint64_t* out);

/* The masters (or remainders) of count params written behind the optimizer's back,
 * resynced from the params (docs/design.md section 6). For each i with stale[i] != 0:
 *  - master_dtype fp32 or fp16 (a master of a bf16 or fp16 param): each element whose
 *    master, rounded to nearest even to param_dtype, is not the param's value takes the
 *    param's value (rounded to nearest even into an fp16 master; a partial write keeps
 *    the other elements' masters), and every element does when at most
 *    max(1, numels[i] / 64) elements, and not all, still round to it (a whole load);
 *    kept[i] = the elements that still rounded;
 *  - master_dtype int16 or fp8 (the bytes of 16- or 8-bit remainders, which cannot tell
 *    a written element): zeroed whole, so the master is the param; kept[i] = 0.
 * For stale[i] == 0 nothing is read or written and kept[i] = numels[i]. masters[i] and
 * params[i] hold numels[i] elements each; no master may overlap another tensor of the
 * call (not checked: the GPU counts the tensors of a launch before it writes any, the
 * CPU one tensor at a time); every argument is checked first. */
PRECIS_API precis_status_t precis_resync_masters(void* const* masters,
                                                 precis_dtype_t master_dtype,
                                                 const void* const* params,
                                                 precis_dtype_t param_dtype,
                                                 const int64_t* numels, const uint8_t* stale,
                                                 int64_t* kept, int64_t count);

/* precis_resync_masters after its compare: on entry kept[i] holds params[i]'s
 * fingerprint now (precis_fingerprint of its bytes) and records[i] the one it had when
 * recorded (the optimizer's last step); stale[i] is set to whether they differ, then
 * the masters are resynced as precis_resync_masters does with those flags (kept as
 * there). One call for a step's compare and resync, in stream order on a GPU. */
PRECIS_API precis_status_t precis_resync_changed(void* const* masters,
                                                 precis_dtype_t master_dtype,
                                                 const void* const* params,
                                                 precis_dtype_t param_dtype,
                                                 const int64_t* numels, const int64_t* records,
                                                 uint8_t* stale, int64_t* kept, int64_t count);

/* ------------------------------------------------------------------------ */
/* Fused Adam / AdamW (CPU: libprecis.so)                                    */
/* ------------------------------------------------------------------------ */

/* fp16 and fp8 moments are stored scaled, one fp32 scale per block of
 * PRECIS_SCALE_BLOCK elements (blocks never span two tensors):
 *   exp_avg:    stored = m / s,        s = amax(|m| over the block) / max_representable
 *   exp_avg_sq: stored = sqrt(v) / s,  s = amax(sqrt(v) over the block) / max_representable
 * (the square-root domain halves v's dynamic range; a non-zero sqrt(v) is never
 * rounded to zero). An all-zero block has s = 0 and stores zeros. fp8 moments
 * are bytes of precis's own codes (not E4M3): m in "m8", signed E2M5, bias 1,
 * max 7.875; sqrt(v) in "v8", unsigned E3M5, bias 1, max 126 (docs/design.md
 * section 4). fp32 and bf16 moments are stored as plain m and v with no scales. */
#define PRECIS_SCALE_BLOCK 128

/* The square root the CPU kernel takes of the second moment, n values at a time
 * (out[i] = sqrt(in[i])); see precis_step_config_t.cpu_sqrt. */
typedef void (*precis_sqrt_fn_t)(const float* in, float* out, int64_t n);

/* The slots of precis_step_config_t.rule_hyper. */
#define PRECIS_RULE_HYPER_MAX 4

/* Hyperparameters are doubles, as torch's Python floats: the per-step constants
 * (1 - beta, lr / (1 - beta1^step), ...) are derived in double as torch.optim
 * derives them, then rounded to float where torch's kernels round them. */
typedef struct precis_step_config {
  size_t size;  /* sizeof(precis_step_config_t); set by PRECIS_STEP_CONFIG_INIT */
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int32_t decoupled_weight_decay; /* 1: AdamW (p -= lr*wd*p), 0: Adam (g += wd*p) */
  int32_t maximize;               /* 1: ascend the gradient */
  float inv_grad_scale;           /* each gradient is multiplied by this first (1 = none) */
  int32_t check_finite;           /* 1: if any gradient is NaN/Inf, modify nothing and
                                     set *found_inf = 1 */
  uint64_t seed;                  /* stochastic rounding of bf16 params with no master */
  int32_t lr_float32;             /* 1: lr is a float32 value (torch: a float32 tensor lr),
                                     and 1 - lr*wd and lr / (1 - beta1^step) are computed
                                     in float32 as torch's tensor arithmetic does */
  precis_sqrt_fn_t cpu_sqrt;      /* NULL: IEEE sqrt (correctly rounded). Else the CPU
                                     kernel takes every sqrt(v) through it, e.g. the MKL
                                     vmsSqrt torch's CPU sqrt uses (the glue passes it, so
                                     fp32 steps equal torch.optim's bit for bit). The CUDA
                                     kernels ignore it: torch's CUDA sqrt is IEEE's */
  int32_t num_threads;            /* threads of the CPU step (>= 0); 0: OpenMP's default
                                     (omp_get_max_threads()); more than the larger of
                                     that and the processors are that many. The glue
                                     passes torch's at::get_num_threads() */
  int32_t amsgrad;                /* 1: AMSGrad, the denominator from the running max of v
                                     (tensors->max_exp_avg_sqs; see precis_step_tensors_t).
                                     It fills what was tail padding, so sizeof did not grow:
                                     callers of an older header must zero the struct */
  /* The update rule (precis_rule_t) and the one-state rules' hyperparameters. Read
   * only when size covers all four: an older caller's smaller struct means Adam. What
   * a rule does not use is not checked (beta1, beta2, eps for SGD and Muon; momentum,
   * dampening for Adam and Lion); amsgrad is Adam's only. */
  int32_t rule;                   /* PRECIS_RULE_*; 0 (ADAM) by default */
  int32_t nesterov;               /* SGD, Muon: 1 for Nesterov momentum (SGD: needs
                                     momentum > 0 and dampening 0, as torch); Adam and
                                     Lion: 0 */
  double momentum;                /* SGD (finite, >= 0), Muon (in [0, 1)) */
  double dampening;               /* SGD (finite): the buffer adds (1 - dampening) * g */
  /* A rule's own hyperparameters beyond the fields above, in the order the rule table
   * gives them (csrc/rules.h; today's rules take none). An entry past those the rule
   * takes must be 0. Read only when size covers all of them: an older caller's smaller
   * struct gives zeros. So a new rule needs no new field, nor the torch glue a new op. */
  double rule_hyper[PRECIS_RULE_HYPER_MAX];
} precis_step_config_t;

#define PRECIS_STEP_CONFIG_INIT \
  { sizeof(precis_step_config_t), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0, 1.0f, 0, 0u, 0, NULL, 0, 0, \
    0, 0, 0.0, 0.0, { 0.0, 0.0, 0.0, 0.0 } }

/* The update rules of the one engine (precis_step_config_t.rule). Every rule reads and
 * writes the same element stores: the param and its master (separate, remainders, or
 * stochastic rounding of a bf16 param), exp_avg in any moment dtype with its block
 * scales and stochastic rounding, and for Adam exp_avg_sq. The one-state rules keep
 * their state in exp_avgs (exp_avg_dtype) and read no exp_avg_sqs (they may be NULL).
 * g below is the gradient times inv_grad_scale, negated when maximizing.
 *  - ADAM: torch.optim.Adam / AdamW (decoupled_weight_decay).
 *  - SGD: torch.optim.SGD: g += wd*p (decoupled_weight_decay: p *= 1 - lr*wd instead);
 *    with momentum > 0, buf = g at step 1 (torch's first step: keep the step of a loaded
 *    buffer above 1), else buf = momentum*buf + (1 - dampening)*g;
 *    d = nesterov ? g + momentum*buf : buf (buf: exp_avg; momentum 0: d = g, exp_avgs
 *    may be NULL); p -= lr*d, lr being cfg->lr * tensors->lr_scales[i] where given.
 *  - LION (Chen et al. 2023, betas in [0, 1]): p *= 1 - lr*wd;
 *    p -= lr*sign(beta1*m + (1 - beta1)*g)
 *    (lr: cfg->lr * tensors->lr_scales[i] where given, the decay's still cfg->lr);
 *    m = beta2*m + (1 - beta2)*g. sign(NaN) is NaN.
 *  - MUON_MOMENTUM, the elementwise first half of torch.optim.Muon: m = lerp(m, g,
 *    1 - momentum); outputs[i] = nesterov ? lerp(g, m, momentum) : m, in output_dtype.
 *    Params and masters are neither read nor written (params are still checked as for
 *    every rule: dtype, non-NULL and aligned; masters may be NULL). Muon's second half
 *    (after the Newton-Schulz orthogonalization) is SGD with momentum 0, decoupled
 *    weight decay and tensors->lr_scales each matrix's ratio of its adjusted lr to lr. */
typedef enum precis_rule {
  PRECIS_RULE_ADAM = 0,
  PRECIS_RULE_SGD = 1,
  PRECIS_RULE_LION = 2,
  PRECIS_RULE_MUON_MOMENTUM = 3,
  PRECIS_RULE_COUNT
} precis_rule_t;

/* The name of a rule ("adam", "sgd", "lion", "muon_momentum"), static storage;
 * PRECIS_ERR_INVALID_ARGUMENT for a value outside precis_rule_t. */
PRECIS_API precis_status_t precis_rule_name(int32_t rule, const char** out);

/* A list of tensors updated by one call; all share the dtypes below.
 * master_dtype: FP32 or FP16 for a separate master copy; equal to param_dtype when
 * the param is its own master (masters may then be NULL; a BF16 param is then
 * written with stochastic rounding); INT16 for bf16 params with int16 remainders
 * (masters[i] points at the remainders, the master is param:remainder); FP8_E4M3
 * for bf16 params with 8-bit remainders (uint8 bytes; a 24-bit master, rounded to
 * nearest after each step: precis_remainder8_split).
 *
 * AMSGrad (cfg->amsgrad): max_exp_avg_sqs[i] holds the running max of v in
 * exp_avg_sq_dtype and its encoding (own block scales in max_exp_avg_sq_scales
 * for fp16/fp8; NULL tables otherwise). After v is updated and stored, the new
 * max is maximum(decoded stored max, decoded stored v) (NaN propagates, as
 * torch.maximum), stored in its dtype, and the denominator is
 * sqrt(max) / sqrt(1 - beta2^step) + eps. For fp32 state the stored values are
 * the values, so this is torch's amsgrad bit for bit; for bf16 the max is one of
 * two bf16 values (stored exactly); fp16/fp8 re-encode it with its own scales.
 * The two tables are read only when size covers them and cfg->amsgrad is 1. */
typedef struct precis_step_tensors {
  size_t size;  /* sizeof(precis_step_tensors_t); set by PRECIS_STEP_TENSORS_INIT */
  size_t count; /* number of tensors */
  precis_dtype_t param_dtype;      /* FP32, FP16, BF16 */
  precis_dtype_t grad_dtype;       /* FP32, FP16, BF16 */
  precis_dtype_t master_dtype;     /* see above */
  precis_dtype_t exp_avg_dtype;    /* FP32, FP16, BF16, FP8_E4M3 */
  precis_dtype_t exp_avg_sq_dtype; /* FP32, FP16, BF16, FP8_E4M3 */
  void* const* params;
  const void* const* grads;
  void* const* masters;
  void* const* exp_avgs;
  void* const* exp_avg_sqs;
  float* const* exp_avg_scales;    /* per-block scales when exp_avg is FP16/FP8, else NULL */
  float* const* exp_avg_sq_scales; /* same for exp_avg_sq */
  const int64_t* numels;           /* elements of tensor i */
  const int64_t* steps;            /* step number of tensor i after this update (>= 1) */
  void* const* max_exp_avg_sqs;    /* AMSGrad: running max of v, in exp_avg_sq_dtype */
  float* const* max_exp_avg_sq_scales; /* its block scales when exp_avg_sq is FP16/FP8 */
  /* What each tensor's elements are, for stochastic rounding (stores.h): the
   * random number of an element depends on (cfg->seed, streams[i], step, the low
   * 32 bits of element_offsets[i] + its index in tensor i), so a slice of a param
   * stepped with its offset into the whole param, and the param's stream, gets the
   * bits of the whole. NULL streams: stream i (the tensor's index in this list);
   * NULL element_offsets: 0. Any values are valid. Read only when size covers them. */
  const uint64_t* streams;         /* a stable id of the param tensor i belongs to */
  const int64_t* element_offsets;  /* index of tensor i's first element in that param */
  /* The rules' extra tables (precis_rule_t), read only when size covers them. */
  void* const* outputs;            /* MUON_MOMENTUM: tensor i's direction, numels[i]
                                      elements; other rules ignore it and output_dtype */
  precis_dtype_t output_dtype;     /* FP32, FP16, BF16 */
  const double* lr_scales;         /* SGD, LION: NULL, or tensor i's step lr as a multiple of
                                      the lr (cfg->lr or the device's): p -= (lr*scale)*d,
                                      the product in double (in float with lr_float32), as
                                      torch's `lr * ratio` of Muon's adjusted lr; the
                                      decoupled weight decay still takes lr. Finite, >= 0 */
  /* Out: NULL, or count entries, param_fingerprints[i] = precis_fingerprint of tensor
   * i's param (numels[i] elements of param_dtype) as the step leaves it, its terms added
   * as the kernel writes each tile (no pass over the params of its own: the record a
   * caller keeps to see writes behind its back). precis_step: host memory, untouched
   * when the step writes nothing (found_inf). precis_cuda_step: device memory,
   * 8-byte aligned, zeroed in stream order by the call itself, then added to atomically
   * by the update kernels (precis_cuda_fingerprint's values, read after the stream
   * reaches them); a step skipped on the device (found_inf) records the params as they
   * are. NULL with rule muon_momentum, which writes no params. Must not overlap any
   * buffer of the list. Read only when size covers it. */
  uint64_t* param_fingerprints;
  /* precis_step only (precis_cuda_step refuses it): NULL, or count entries, with a
   * separate master (master_dtype FP32 or FP16): the step sees writes into the params
   * itself, with no record to compare. Each element whose param is no longer its
   * master's rounding (written since the last step: a load, a mask) takes the param as
   * its master before it is stepped (csrc/resync.h's rule); a tensor whose first
   * elements (at most 1,024) show such a write is first resynced as precis_resync_masters
   * does (a whole load, at most 1 element in 64 still rounding, takes the whole param).
   * param_kept[i] = the elements of tensor i that still rounded (numels[i]: none
   * written); untouched when the step writes nothing (found_inf). Must not overlap any
   * buffer of the list. Read only when size covers it. */
  int64_t* param_kept;
  /* Out: NULL, or the blocks of PRECIS_FINGERPRINT_BLOCK elements of each param as the
   * step leaves it, one after another: tensor i's max(1, ceil(numels[i] /
   * PRECIS_FINGERPRINT_BLOCK)) entries from the sum of the earlier tensors' counts,
   * precis_fingerprint_blocks of its numels[i] * the param's element size bytes with
   * block PRECIS_FINGERPRINT_BLOCK elements' bytes. Summed as the kernel writes each
   * tile, as param_fingerprints (no pass over the params of its own: the record of a
   * param whose remainders a partial write costs only the blocks it touched). Host or
   * device memory, untouched or recorded as found on a skip, NULL with muon_momentum,
   * and no overlap, as param_fingerprints. Read only when size covers it. */
  uint64_t* param_block_fingerprints;
  /* In: NULL, or with remainders (master_dtype INT16 or FP8_E4M3 beside bf16 params) each
   * param's blocks as a step left them (param_block_fingerprints' layout and values: the
   * last step's record): before a block is stepped, its params' fingerprint now is
   * compared with its entry, and a block written since (a load, a mask) has its
   * remainders zeroed (the param is then its master: csrc/resync.h's rule), a skipped
   * step's too. The step's own compare, a block at a time as it reaches it (no pass over
   * the params before the step). Host or device memory as param_block_fingerprints, and
   * sharing no memory with it or with any buffer of the list. Read only when size covers
   * it. */
  const uint64_t* param_block_records;
  /* Out, with param_block_records: NULL, or count entries, param_blocks_kept[i] the
   * elements of tensor i in the blocks that matched their record (numels[i]: none
   * written, 0: every block written), a skipped step's too. precis_step: host memory;
   * precis_cuda_step: device memory, 8-byte aligned, zeroed in stream order by the call
   * and added to by the kernels. Sharing no memory with any other buffer of the call.
   * Read only when size covers it. */
  int64_t* param_blocks_kept;
} precis_step_tensors_t;

#define PRECIS_STEP_TENSORS_INIT \
  { sizeof(precis_step_tensors_t), 0, PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, \
    PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, NULL, NULL, NULL, NULL, \
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, PRECIS_DTYPE_FP32, NULL, NULL, \
    NULL, NULL, NULL, NULL }

/* The SIMD code path the CPU kernels use on this machine: "avx512", "avx2",
 * "sve", "neon" (aarch64) or "scalar" (static storage). Chosen at load time from
 * the CPU's features: the best path it runs, but neon where SVE's vectors are 128
 * bits (the vector length of the thread that loads the library). The environment variable PRECIS_CPU_ISA (one of those names) can force
 * any other path the CPU runs: a lower one of the same architecture, "scalar",
 * or "sve" on a 128-bit SVE CPU. */
PRECIS_API precis_status_t precis_cpu_isa(const char** out);

/* Number of per-block scales a tensor of numel elements needs (0 for numel 0). */
PRECIS_API precis_status_t precis_scale_count(int64_t numel, int64_t* out);

/* One step of cfg->rule (Adam/AdamW, SGD, Lion, Muon's momentum) over every tensor of
 * the list, one pass per element.
 * All arguments are checked before any memory is written. found_inf may be NULL
 * unless cfg->check_finite; it is set to 1 when the step was skipped, else 0.
 * The buffers the step writes must not overlap each other or a gradient: this
 * is not checked here (the torch op checks it across the whole call). */
PRECIS_API precis_status_t precis_step(const precis_step_config_t* cfg,
                                       const precis_step_tensors_t* tensors, int32_t* found_inf);

/* Sets *found_inf to 1 when it is 0 and a gradient of the list is NaN or Inf;
 * leaves it unchanged otherwise. Reads only count, grad_dtype, grads and numels
 * of tensors. With several lists (one per dtype combination), zero one flag,
 * check every list, then step every list with check_finite 0 unless the flag
 * is set: all of them or none. */
PRECIS_API precis_status_t precis_step_check_finite(const precis_step_tensors_t* tensors,
                                                    int32_t* found_inf);

/* What precis_step does to a list when it skips the step (found_inf): only the blocks'
 * compare of tensors->param_block_records (with remainders: the blocks written since
 * their record have their remainders zeroed, param_blocks_kept counted), nothing stepped
 * or recorded; nothing at all without param_block_records. For a caller that decided to
 * skip before stepping (a found_inf it was given, or a NaN in another of several lists:
 * precis_step_check_finite). Checks what precis_step checks (cfg->check_finite aside). */
PRECIS_API precis_status_t precis_step_skipped(const precis_step_config_t* cfg,
                                               const precis_step_tensors_t* tensors);

/* fp32 moment values <-> their stored form (dtype FP32/FP16/BF16/FP8_E4M3; scales
 * needed for FP16/FP8, precis_scale_count(numel) of them). second_moment selects
 * the exp_avg_sq encoding. Used to convert checkpoints and to inspect state. */
PRECIS_API precis_status_t precis_moment_encode(const float* src, int64_t numel,
                                                int32_t second_moment, void* dst,
                                                precis_dtype_t dtype, float* scales);
PRECIS_API precis_status_t precis_moment_decode(const void* src, const float* scales,
                                                int64_t numel, int32_t second_moment,
                                                precis_dtype_t dtype, float* dst);

/* fp32 master <-> bf16 param + int16 remainder (DESIGN section 4); exact both ways. */
PRECIS_API precis_status_t precis_remainder_split(const float* master, int64_t numel,
                                                  uint16_t* param_bf16, int16_t* remainder);
PRECIS_API precis_status_t precis_remainder_join(const uint16_t* param_bf16,
                                                 const int16_t* remainder, int64_t numel,
                                                 float* master);

/* fp32 master <-> bf16 param + 8-bit remainder (param_remainder_bits 8): split rounds
 * the master to nearest even at 24 bits (bf16 + 8 bits of mantissa), then splits as
 * above one byte lower (param = the 24-bit value's bf16 rounded to nearest, remainder
 * = its low byte read as int8, stored as uint8); join gives that 24-bit value exactly. */
PRECIS_API precis_status_t precis_remainder8_split(const float* master, int64_t numel,
                                                   uint16_t* param_bf16, uint8_t* remainder);
PRECIS_API precis_status_t precis_remainder8_join(const uint16_t* param_bf16,
                                                  const uint8_t* remainder, int64_t numel,
                                                  float* master);

/* ------------------------------------------------------------------------ */
/* CUDA twins (libprecis_cuda.so). stream is a cudaStream_t, NULL = default.  */
/* ------------------------------------------------------------------------ */

PRECIS_API precis_status_t precis_cuda_accumulate(void* dst, precis_dtype_t dst_dtype,
                                                  const void* src, precis_dtype_t src_dtype,
                                                  int64_t numel, void* stream);

PRECIS_API precis_status_t precis_cuda_cast(void* dst, precis_dtype_t dst_dtype,
                                            const void* src, precis_dtype_t src_dtype,
                                            int64_t numel, void* stream);
PRECIS_API precis_status_t precis_cuda_scale(void* buf, precis_dtype_t dtype, float factor,
                                             int64_t numel, void* stream);
/* out_count points to device memory; the count is added to it (zero it first),
 * so no device synchronization is needed. */
PRECIS_API precis_status_t precis_cuda_count_nonfinite(const void* buf, precis_dtype_t dtype,
                                                       int64_t numel, int64_t* out_count,
                                                       void* stream);

/* precis_fingerprint of count byte ranges of device memory (bufs, nbytes: host arrays),
 * written to out[0 .. count) (device memory) on stream, the same values the CPU function
 * gives for the same bytes; every range checked before anything is launched. */
PRECIS_API precis_status_t precis_cuda_fingerprint(const void* const* bufs, const int64_t* nbytes,
                                                   int64_t count, uint64_t* out, void* stream);

/* precis_fingerprint_blocks of count byte ranges of device memory (bufs, nbytes: host
 * arrays), written to out (device memory, 8-byte aligned) on stream: the CPU's values. */
PRECIS_API precis_status_t precis_cuda_fingerprint_blocks(const void* const* bufs,
                                                          const int64_t* nbytes, int64_t count,
                                                          int64_t block, uint64_t* out,
                                                          void* stream);

/* precis_resync_masters on the GPU, on stream: masters, params and numels are host
 * arrays (of device pointers), stale and kept device memory (count entries each), so
 * that a step resyncs what its compare flagged without reading the flags back; a
 * tensor not flagged costs its blocks a read of its flag. The same bits as the CPU's. */
PRECIS_API precis_status_t precis_cuda_resync_masters(void* const* masters,
                                                      precis_dtype_t master_dtype,
                                                      const void* const* params,
                                                      precis_dtype_t param_dtype,
                                                      const int64_t* numels,
                                                      const uint8_t* stale, int64_t* kept,
                                                      int64_t count, void* stream);

/* precis_resync_changed on the GPU, on stream: records, stale and kept device memory;
 * the compare made by the kernels, nothing read back. */
PRECIS_API precis_status_t precis_cuda_resync_changed(void* const* masters,
                                                      precis_dtype_t master_dtype,
                                                      const void* const* params,
                                                      precis_dtype_t param_dtype,
                                                      const int64_t* numels,
                                                      const int64_t* records, uint8_t* stale,
                                                      int64_t* kept, int64_t count,
                                                      void* stream);

/* precis_cuda_fingerprint of the params, then precis_cuda_resync_changed, on stream,
 * the fingerprint and the compare in one launch: records, stale, kept and sums device
 * memory, nothing read back; stale and kept as precis_resync_changed's. sums: 2 * count
 * entries, zero on entry, left zero (each param's fingerprint and chunks counted while
 * the launch runs; the block that counts a param's last chunk compares it). zeroed: NULL,
 * or count entries set to 0 in stream order (the record of the update that follows,
 * which then needs no memset: precis_cuda_step_device_args_t.fingerprints_zeroed).
 * records, kept, sums and zeroed 8-byte aligned, and no two of the five sharing memory.
 * Up to 512 params: 3 launches (2 with remainders), against 5 (4) for the two calls. */
PRECIS_API precis_status_t precis_cuda_resync_compared(void* const* masters,
                                                       precis_dtype_t master_dtype,
                                                       const void* const* params,
                                                       precis_dtype_t param_dtype,
                                                       const int64_t* numels,
                                                       const int64_t* records, uint8_t* stale,
                                                       int64_t* kept, uint64_t* sums,
                                                       uint64_t* zeroed, int64_t count,
                                                       void* stream);

/* precis_cuda_resync_compared without its last launch: the flags and kept set as there
 * (for a flagged master, kept counts its elements that still round to the param), the
 * masters and remainders left as they are, for the update that follows to resync each
 * flagged param's elements as it steps them (precis_cuda_step_device_args_t's stale and
 * kept): 2 launches (1 with remainders) before the update, against 3 (2). */
PRECIS_API precis_status_t precis_cuda_compare_params(void* const* masters,
                                                      precis_dtype_t master_dtype,
                                                      const void* const* params,
                                                      precis_dtype_t param_dtype,
                                                      const int64_t* numels,
                                                      const int64_t* records, uint8_t* stale,
                                                      int64_t* kept, uint64_t* sums,
                                                      uint64_t* zeroed, int64_t count,
                                                      void* stream);

/* Fused Adam/AdamW on the GPU: precis_step's semantics element for element
 * (the math of rules.h and stores.h, the same per-block scales, the same stochastic
 * rounding keyed on seed, stream, step and element index), so with the
 * same inputs it writes the CPU kernel's bits.
 *
 * precis_step_tensors_t is as for the CPU, except that every pointer held in its
 * tables (params[i], grads[i], ...) is a device pointer; the tables themselves,
 * numels and steps are host arrays, read during the call only. Each buffer must
 * be aligned to its element size; when all of a tensor's buffers are 16-byte
 * aligned (8 for fp8) it takes the vectorized path, else an element-wise one.
 * Any number of tensors per call, of any size (64-bit indexing).
 *
 * Optional device arguments (dev may be NULL). Each pointer given is read in
 * device memory by the kernels when they run, instead of the host value, so a
 * CUDA graph captured once can be replayed with a changing lr and step count: */
typedef struct precis_cuda_step_device_args {
  size_t size;                 /* sizeof(precis_cuda_step_device_args_t); ..._INIT sets it */
  const void* lr;              /* NULL: cfg->lr. A double (a float when cfg->lr_float32),
                                  used exactly as cfg->lr would be */
  const float* inv_grad_scale; /* NULL: cfg->inv_grad_scale (finite and > 0: unchecked) */
  const int64_t* const* steps;  /* NULL: tensors->steps. Else a host array of tensors->count
                                  device pointers, each to the int64 step number (after this
                                  update; values below 1 count as 1) of its tensor; one
                                  pointer may serve many tensors. tensors->steps may then be
                                  NULL. The kernels never write them: increment before the
                                  call (in a graph, capture the increment too) */
  float* found_inf;            /* NULL, or one float in device memory that the caller
                                  zeroes: if it is nonzero when the update kernel runs,
                                  nothing is modified (as with a GradScaler's found_inf);
                                  cfg->check_finite first sets a zero flag to 1.0f when a
                                  gradient of the call is NaN/Inf (a nonzero flag is left as
                                  it is). Never cleared. Required by cfg->check_finite. */
  int32_t fingerprints_zeroed; /* 1: tensors->param_fingerprints were set to 0 in stream
                                  order before the call (precis_cuda_resync_compared's
                                  zeroed), so the call adds to them without zeroing them
                                  first (one memset less); 0: the call zeroes them. Read
                                  only when size covers it. */
  const uint8_t* stale;        /* NULL, or tensors->count flags in device memory (any
                                  nonzero byte: flagged), with kept: each flagged tensor's
                                  master or remainders resynced from its param before it is
                                  stepped, as precis_cuda_resync_masters does with these
                                  flags and counts (precis_cuda_compare_params makes
                                  them), a skipped step's too. Needs a rule that writes
                                  the params (not MUON_MOMENTUM) with a master or
                                  remainders; neither may share memory with the record.
                                  Read only when size covers it. */
  const int64_t* kept;         /* with stale: tensors->count counts (8-byte aligned), a
                                  flagged master's elements that still round to the param */
} precis_cuda_step_device_args_t;

#define PRECIS_CUDA_STEP_DEVICE_ARGS_INIT \
  { sizeof(precis_cuda_step_device_args_t), NULL, NULL, NULL, NULL, 0, NULL, NULL }

/* One step of cfg->rule over every tensor of the list on stream. All arguments
 * are checked on the host before anything is launched; never synchronizes; no
 * allocation, so it can be captured in a CUDA graph. With cfg->check_finite a
 * first kernel scans every gradient of the call and the update kernels skip
 * when dev->found_inf is set: an all-or-nothing step without a host round trip.
 * Launch failures are reported (PRECIS_ERR_CUDA), execution errors surface at
 * the next synchronization, as for any CUDA work. */
PRECIS_API precis_status_t precis_cuda_step(const precis_step_config_t* cfg,
                                            const precis_step_tensors_t* tensors,
                                            const precis_cuda_step_device_args_t* dev,
                                            void* stream);

/* Sets *found_inf (one float in device memory) to 1.0f when it is zero and a
 * gradient of the list is NaN or Inf; leaves it unchanged otherwise. Reads only count,
 * grad_dtype, grads and numels of tensors. With several lists (one per dtype
 * combination), zero one flag, check every list, then step every list with
 * check_finite 0 and dev->found_inf set to that flag: all of them or none. */
PRECIS_API precis_status_t precis_cuda_step_check_finite(const precis_step_tensors_t* tensors,
                                                         float* found_inf, void* stream);

/* ------------------------------------------------------------------------ */
/* The names before issue #66, when the engine was Adam's (0.x callers)      */
/* ------------------------------------------------------------------------ */

/* The same types and initializers under their old names, and the old functions still
 * exported: each is its new namesake, its error messages naming the old name. */
#define precis_adam_config precis_step_config /* the struct tags too */
#define precis_adam_tensors precis_step_tensors
#define precis_cuda_adam_device_args precis_cuda_step_device_args
typedef precis_step_config_t precis_adam_config_t;
typedef precis_step_tensors_t precis_adam_tensors_t;
typedef precis_cuda_step_device_args_t precis_cuda_adam_device_args_t;
#define PRECIS_ADAM_CONFIG_INIT PRECIS_STEP_CONFIG_INIT
#define PRECIS_ADAM_TENSORS_INIT PRECIS_STEP_TENSORS_INIT
#define PRECIS_CUDA_ADAM_DEVICE_ARGS_INIT PRECIS_CUDA_STEP_DEVICE_ARGS_INIT

PRECIS_API precis_status_t precis_adam_step(const precis_step_config_t* cfg,
                                            const precis_step_tensors_t* tensors,
                                            int32_t* found_inf);
PRECIS_API precis_status_t precis_adam_check_finite(const precis_step_tensors_t* tensors,
                                                    int32_t* found_inf);
PRECIS_API precis_status_t precis_cuda_adam_step(const precis_step_config_t* cfg,
                                                 const precis_step_tensors_t* tensors,
                                                 const precis_cuda_step_device_args_t* dev,
                                                 void* stream);
PRECIS_API precis_status_t precis_cuda_adam_check_finite(const precis_step_tensors_t* tensors,
                                                         float* found_inf, void* stream);

/* ------------------------------------------------------------------------ */
/* The torch glue (libprecis_torch.so)                                       */
/* ------------------------------------------------------------------------ */

/* Registers the precis:: ops (adam_step_, check_finite_, accumulate_, cast_,
 * scale_, count_nonfinite) with the dispatcher of the libtorch loaded in this
 * process, through its stable C ABI (torch >= 2.10): CPU kernels, and CUDA
 * kernels when torch's CUDA library is loaded. Loading the library calls it;
 * later calls return the first successful result at once (a failure, e.g. torch
 * not loaded yet, is retried). When another copy of the library registered the
 * ops first, nothing is registered again and PRECIS_OK is returned; see
 * precis_torch_init_message(). */
PRECIS_API precis_status_t precis_torch_init(void);

/* Why precis_torch_init failed, or a note on how it succeeded (static storage). */
PRECIS_API const char* precis_torch_init_message(void);

/* 1 when this library registered CUDA kernels, else 0. */
PRECIS_API int precis_torch_has_cuda(void);

/* Lets go of the call precis::hold_step held as `held` (its id): its tensor handles freed
 * now, or when the precis::held_step_ calls running it end. An id not held (dropped
 * already, or never returned) is ignored. */
PRECIS_API void precis_torch_drop_held(int64_t held);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PRECIS_PRECIS_H_ */
