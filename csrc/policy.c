/* policy.c - the precision policy: defaults by model dtype, legal sets,
 * overrides and combination rules (docs/design.md section 3). This is the single home
 * of those rules; the Python layer asks here and never re-implements them. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "precis_convert.h"

#define PR_BIT(field) (1u << (unsigned)(field))

/* The size-versioned struct: what a caller built against the header before
 * momentum_dtype passes at least, and whether *p reaches past momentum_dtype. */
#define PR_POLICY_MIN_SIZE offsetof(precis_policy_t, momentum_dtype)
#define PR_POLICY_HAS_MOMENTUM(p) \
  ((p)->size >= offsetof(precis_policy_t, momentum_dtype) + sizeof (p)->momentum_dtype)

/* One row per override key. Dtype fields carry their legal set, in the order
 * messages list it; boolean fields have n_legal == 0. */
typedef struct {
  const char* name;
  precis_policy_field_t field;
  int n_legal;
  precis_dtype_t legal[4];
} pr_field_info;

static const pr_field_info pr_fields[PRECIS_FIELD_COUNT] = {
    {"main_params_dtype", PRECIS_FIELD_MAIN_PARAMS_DTYPE, 3,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16}},
    {"main_grads_dtype", PRECIS_FIELD_MAIN_GRADS_DTYPE, 3,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP16}},
    {"grad_comm_dtype", PRECIS_FIELD_GRAD_COMM_DTYPE, 3,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP16}},
    {"exp_avg_dtype", PRECIS_FIELD_EXP_AVG_DTYPE, 4,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP8_E4M3}},
    {"exp_avg_sq_dtype", PRECIS_FIELD_EXP_AVG_SQ_DTYPE, 4,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP8_E4M3}},
    {"store_param_remainders", PRECIS_FIELD_STORE_PARAM_REMAINDERS, 0, {PRECIS_DTYPE_FP32}},
    {"grad_reduce_in_fp32", PRECIS_FIELD_GRAD_REDUCE_IN_FP32, 0, {PRECIS_DTYPE_FP32}},
    {"grad_sum_dtype", PRECIS_FIELD_GRAD_SUM_DTYPE, 3,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP16}},
    {"param_remainder_bits", PRECIS_FIELD_PARAM_REMAINDER_BITS, 0, {PRECIS_DTYPE_FP32}},
    {"momentum_dtype", PRECIS_FIELD_MOMENTUM_DTYPE, 4,
     {PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16, PRECIS_DTYPE_FP8_E4M3}},
};

/* The model (param) dtype is not an override key, but has a legal set too. */
static const pr_field_info pr_param_field = {
    "param_dtype", PRECIS_FIELD_COUNT, 3,
    {PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16}};

static const char pr_field_list[] =
    "main_params_dtype, main_grads_dtype, grad_comm_dtype, exp_avg_dtype, exp_avg_sq_dtype, "
    "store_param_remainders, grad_reduce_in_fp32, grad_sum_dtype, param_remainder_bits, "
    "momentum_dtype";

/* ---- small helpers ------------------------------------------------------ */

static int pr_parse_bool(const char* text, int* out) {
  static const char* const truthy[] = {"true", "1", "yes", "on"};
  static const char* const falsy[] = {"false", "0", "no", "off"};
  char key[16];
  int i;
  if (!pr_normalize(text, key, sizeof key)) return 0;
  for (i = 0; i < 4; ++i) {
    if (strcmp(key, truthy[i]) == 0) return *out = 1, 1;
    if (strcmp(key, falsy[i]) == 0) return *out = 0, 1;
  }
  return 0;
}

static uint32_t pr_legal_mask(const pr_field_info* info) {
  uint32_t mask = 0;
  int i;
  for (i = 0; i < info->n_legal; ++i) mask |= PR_BIT(info->legal[i]);
  return mask;
}

static void pr_legal_list(const pr_field_info* info, char* buf, size_t cap) {
  int i;
  buf[0] = '\0';
  for (i = 0; i < info->n_legal; ++i) {
    if (i > 0) strncat(buf, ", ", cap - strlen(buf) - 1);
    strncat(buf, pr_dtype_label((int)info->legal[i]), cap - strlen(buf) - 1);
  }
}

/* The dtype member a field names (NULL for the boolean fields). */
static precis_dtype_t* pr_field_dtype(precis_policy_t* p, precis_policy_field_t field) {
  switch (field) {
    case PRECIS_FIELD_MAIN_PARAMS_DTYPE: return &p->main_params_dtype;
    case PRECIS_FIELD_MAIN_GRADS_DTYPE: return &p->main_grads_dtype;
    case PRECIS_FIELD_GRAD_COMM_DTYPE: return &p->grad_comm_dtype;
    case PRECIS_FIELD_GRAD_SUM_DTYPE: return &p->grad_sum_dtype;
    case PRECIS_FIELD_EXP_AVG_DTYPE: return &p->exp_avg_dtype;
    case PRECIS_FIELD_EXP_AVG_SQ_DTYPE: return &p->exp_avg_sq_dtype;
    case PRECIS_FIELD_MOMENTUM_DTYPE: return &p->momentum_dtype;
    default: return NULL;
  }
}

/* Check dtype against a field's legal set. `given` is the user's text, or NULL. */
static precis_status_t pr_check_legal(const pr_field_info* info, int dtype, const char* given) {
  char legal[64], norm[32];
  const char* name;
  if (!pr_dtype_valid(dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE, "%s: %s is not a dtype code", info->name,
                   pr_dtype_label(dtype));
  }
  if (pr_legal_mask(info) & PR_BIT(dtype)) return PRECIS_OK;
  pr_legal_list(info, legal, sizeof legal);
  name = pr_dtype_label(dtype);
  /* Show the user's spelling too when it was an alias ("uint8" for fp8). */
  if (given != NULL && !(pr_normalize(given, norm, sizeof norm) && strcmp(norm, name) == 0)) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY, "%s: %s (given as '%.64s') is not allowed; legal: %s",
                   info->name, name, given, legal);
  }
  return pr_fail(PRECIS_ERR_INVALID_POLICY, "%s: %s is not allowed; legal: %s", info->name, name,
                 legal);
}

/* The struct argument `arg` (its name in fn's signature): present and large enough. */
static precis_status_t pr_check_struct(const precis_policy_t* policy, const char* fn,
                                       const char* arg) {
  if (policy == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s is NULL", fn, arg);
  if (policy->size < PR_POLICY_MIN_SIZE) {
    return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                   "%s: %s->size is %zu, expected at least %zu (use PRECIS_POLICY_INIT)", fn,
                   arg, policy->size, (size_t)PR_POLICY_MIN_SIZE);
  }
  return PRECIS_OK;
}

/* The bytes of the caller's struct *p that this library reads and writes: an older
 * struct's (up to param_remainder_bits), else up to its size or ours. */
static size_t pr_policy_bytes(const precis_policy_t* p) {
  if (!PR_POLICY_HAS_MOMENTUM(p)) return PR_POLICY_MIN_SIZE;
  return p->size < sizeof(precis_policy_t) ? p->size : sizeof(precis_policy_t);
}

/* *src, of the caller's size, as a whole struct: a member an older struct lacks
 * takes what it follows (momentum_dtype: exp_avg_dtype). */
static void pr_load(const precis_policy_t* src, precis_policy_t* dst) {
  precis_policy_t w = PRECIS_POLICY_INIT;
  memcpy(&w, src, pr_policy_bytes(src));
  if (!PR_POLICY_HAS_MOMENTUM(src)) w.momentum_dtype = w.exp_avg_dtype;
  *dst = w;
}

/* The members of *w the caller's struct *dst has; dst->size stays. */
static void pr_store(precis_policy_t* dst, const precis_policy_t* w) {
  const size_t size = dst->size;
  memcpy(dst, w, pr_policy_bytes(dst));
  dst->size = size;
}

/* The override key field names (case and surrounding blanks aside), or NULL. */
static const pr_field_info* pr_lookup_field(const char* field) {
  char key[32];
  int i;
  if (!pr_normalize(field, key, sizeof key)) return NULL;
  for (i = 0; i < PRECIS_FIELD_COUNT; ++i) {
    if (strcmp(key, pr_fields[i].name) == 0) return &pr_fields[i];
  }
  return NULL;
}

/* Look up an override key; NULL (with the error set) if it is not one. */
static const pr_field_info* pr_find_field(const char* field, const char* fn) {
  char key[32];
  const pr_field_info* info = pr_lookup_field(field);
  if (info != NULL) return info;
  if (pr_normalize(field, key, sizeof key) && strcmp(key, "param_dtype") == 0) {
    pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
            "%s: param_dtype cannot be overridden; the model dtype is given separately "
            "(precis_policy_defaults / precis_policy_resolve)",
            fn);
    return NULL;
  }
  pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: '%.64s' is not a policy field; accepted: %s", fn, field,
          pr_field_list);
  return NULL;
}

static void pr_fill_defaults(precis_dtype_t model, precis_policy_t* p) {
  /* bf16 models keep bf16 moments and grads; fp16 and fp32 models keep fp32 state. */
  precis_dtype_t state = model == PRECIS_DTYPE_BF16 ? PRECIS_DTYPE_BF16 : PRECIS_DTYPE_FP32;
  p->param_dtype = model;
  p->main_params_dtype = PRECIS_DTYPE_FP32; /* for an fp32 model: the param itself */
  p->main_grads_dtype = state;
  p->grad_comm_dtype = state;
  p->grad_sum_dtype = state;
  p->exp_avg_dtype = state;
  p->exp_avg_sq_dtype = state;
  p->momentum_dtype = state; /* follows exp_avg_dtype */
  p->store_param_remainders = 0;
  p->param_remainder_bits = 16;
  p->explicit_fields = 0u;
}

/* ---- public API --------------------------------------------------------- */

PRECIS_API precis_status_t precis_policy_defaults(precis_dtype_t model_dtype,
                                                  precis_policy_t* policy) {
  precis_policy_t work = PRECIS_POLICY_INIT;
  precis_status_t st;
  pr_clear_error();
  st = pr_check_struct(policy, "precis_policy_defaults", "policy");
  if (st != PRECIS_OK) return st;
  st = pr_check_legal(&pr_param_field, (int)model_dtype, NULL);
  if (st != PRECIS_OK) return st;
  pr_fill_defaults(model_dtype, &work);
  pr_store(policy, &work);
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_policy_set(precis_policy_t* policy, const char* field,
                                             const char* value) {
  static const char fn[] = "precis_policy_set";
  const pr_field_info* info;
  precis_policy_t work;
  precis_dtype_t* slot;
  precis_dtype_t dtype;
  precis_status_t st;
  int flag;
  pr_clear_error();
  st = pr_check_struct(policy, fn, "policy");
  if (st != PRECIS_OK) return st;
  if (field == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: field is NULL", fn);
  if (value == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: value for '%.64s' is NULL", fn, field);
  }
  /* grad_reduce_in_fp32=false needs a sane model dtype to follow. */
  st = pr_check_legal(&pr_param_field, (int)policy->param_dtype, NULL);
  if (st != PRECIS_OK) return st;
  info = pr_find_field(field, fn);
  if (info == NULL) return PRECIS_ERR_INVALID_ARGUMENT;
  if (info->field == PRECIS_FIELD_MOMENTUM_DTYPE && !PR_POLICY_HAS_MOMENTUM(policy)) {
    return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                   "%s: momentum_dtype needs policy->size >= %zu, got %zu (a struct from "
                   "before momentum_dtype; use PRECIS_POLICY_INIT)",
                   fn, (size_t)(PR_POLICY_MIN_SIZE + sizeof policy->momentum_dtype), policy->size);
  }

  pr_load(policy, &work); /* change a copy: *policy stays untouched on any failure */
  slot = pr_field_dtype(&work, info->field);
  if (slot != NULL) {
    st = precis_dtype_from_name(value, &dtype);
    if (st != PRECIS_OK) { /* the names this field takes, not every dtype's */
      char accepted[256];
      pr_dtype_names(pr_legal_mask(info), accepted, sizeof accepted);
      return pr_fail(st, "%s: '%.64s' is not a dtype; accepted: %s", info->name, value, accepted);
    }
    st = pr_check_legal(info, (int)dtype, value);
    if (st != PRECIS_OK) return st;
    /* An explicit grad_reduce_in_fp32 left main_grads_dtype at the dtype it implies. */
    if (info->field == PRECIS_FIELD_MAIN_GRADS_DTYPE &&
        (work.explicit_fields & PR_BIT(PRECIS_FIELD_GRAD_REDUCE_IN_FP32)) &&
        dtype != work.main_grads_dtype) {
      return pr_fail(PRECIS_ERR_INVALID_POLICY,
                     "main_grads_dtype: %s conflicts with grad_reduce_in_fp32, which was set "
                     "explicitly and makes main_grads_dtype %s",
                     pr_dtype_label((int)dtype), pr_dtype_label((int)work.main_grads_dtype));
    }
    *slot = dtype;
  } else if (info->field == PRECIS_FIELD_PARAM_REMAINDER_BITS) {
    char key[8];
    if (!pr_normalize(value, key, sizeof key) || (strcmp(key, "16") != 0 && strcmp(key, "8") != 0)) {
      return pr_fail(PRECIS_ERR_INVALID_POLICY, "%s: '%.64s' is not allowed; legal: 16, 8",
                     info->name, value);
    }
    work.param_remainder_bits = key[0] == '8' ? 8 : 16;
  } else if (!pr_parse_bool(value, &flag)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: '%.64s' is not a boolean; accepted: true, false, 1, 0, yes, no, on, off",
                   info->name, value);
  } else if (info->field == PRECIS_FIELD_STORE_PARAM_REMAINDERS) {
    work.store_param_remainders = flag;
  } else { /* grad_reduce_in_fp32 */
    dtype = flag ? PRECIS_DTYPE_FP32 : work.param_dtype;
    if ((work.explicit_fields & PR_BIT(PRECIS_FIELD_MAIN_GRADS_DTYPE)) &&
        dtype != work.main_grads_dtype) {
      return pr_fail(PRECIS_ERR_INVALID_POLICY,
                     "grad_reduce_in_fp32: '%.64s' (main grads in %s) conflicts with "
                     "main_grads_dtype %s, which was set explicitly",
                     value, pr_dtype_label((int)dtype), pr_dtype_label((int)work.main_grads_dtype));
    }
    work.main_grads_dtype = dtype;
  }
  work.explicit_fields |= PR_BIT(info->field);

  /* Dependents that were not set explicitly follow: the wire dtype defaults to
   * the accumulation dtype, the sums' dtype to the wire's, the one-state
   * optimizers' momentum to Adam's first moment. Derived from the final state, so
   * order does not matter. */
  if (!(work.explicit_fields & PR_BIT(PRECIS_FIELD_GRAD_COMM_DTYPE))) {
    work.grad_comm_dtype = work.main_grads_dtype;
  }
  if (!(work.explicit_fields & PR_BIT(PRECIS_FIELD_GRAD_SUM_DTYPE))) {
    work.grad_sum_dtype = work.grad_comm_dtype;
  }
  if (!(work.explicit_fields & PR_BIT(PRECIS_FIELD_MOMENTUM_DTYPE))) {
    work.momentum_dtype = work.exp_avg_dtype;
  }
  pr_store(policy, &work);
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_policy_validate(const precis_policy_t* policy) {
  precis_policy_t p;
  precis_status_t st;
  int i;
  pr_clear_error();
  st = pr_check_struct(policy, "precis_policy_validate", "policy");
  if (st != PRECIS_OK) return st;
  pr_load(policy, &p); /* an older struct's momentum_dtype: its exp_avg_dtype */

  st = pr_check_legal(&pr_param_field, (int)p.param_dtype, NULL);
  for (i = 0; st == PRECIS_OK && i < PRECIS_FIELD_COUNT; ++i) {
    const precis_dtype_t* slot = pr_field_dtype(&p, pr_fields[i].field);
    if (slot != NULL) st = pr_check_legal(&pr_fields[i], (int)*slot, NULL);
  }
  if (st != PRECIS_OK) return st;
  if (p.store_param_remainders != 0 && p.store_param_remainders != 1) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY, "store_param_remainders: %d is not 0 or 1",
                   (int)p.store_param_remainders);
  }
  if (p.param_remainder_bits != 16 && p.param_remainder_bits != 8) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY, "param_remainder_bits: %d is not 16 or 8",
                   (int)p.param_remainder_bits);
  }

  /* Combination rules. */
  if (p.param_dtype == PRECIS_DTYPE_FP32 && p.main_params_dtype != PRECIS_DTYPE_FP32) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "main_params_dtype: %s with param_dtype fp32; an fp32 model keeps no separate "
                   "master, main_params_dtype must be fp32",
                   pr_dtype_label((int)p.main_params_dtype));
  }
  if (precis_elem_size((int)p.main_params_dtype) < precis_elem_size((int)p.param_dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "main_params_dtype: %s is narrower than param_dtype %s; the master must be at "
                   "least as wide as the param",
                   pr_dtype_label((int)p.main_params_dtype), pr_dtype_label((int)p.param_dtype));
  }
  if (p.main_params_dtype == PRECIS_DTYPE_BF16 && p.param_dtype != PRECIS_DTYPE_BF16) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "main_params_dtype: bf16 with param_dtype %s; a bf16 master is legal only for "
                   "a bf16 model (it means no master, stochastic rounding)",
                   pr_dtype_label((int)p.param_dtype));
  }
  if (p.store_param_remainders &&
      (p.param_dtype != PRECIS_DTYPE_BF16 || p.main_params_dtype != PRECIS_DTYPE_FP32)) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "store_param_remainders: needs param_dtype bf16 and main_params_dtype fp32, "
                   "got param_dtype %s and main_params_dtype %s",
                   pr_dtype_label((int)p.param_dtype), pr_dtype_label((int)p.main_params_dtype));
  }
  if (p.param_remainder_bits == 8 && !p.store_param_remainders) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "param_remainder_bits: 8 without store_param_remainders; the bits are those "
                   "of the remainder kept beside each bf16 param");
  }
  /* Adding a 16-bit wire's values in another 16-bit type only loses bits. */
  if (p.grad_sum_dtype != p.grad_comm_dtype && p.grad_sum_dtype != PRECIS_DTYPE_FP32) {
    return pr_fail(PRECIS_ERR_INVALID_POLICY,
                   "grad_sum_dtype: %s with grad_comm_dtype %s; the sums are in the wire's dtype "
                   "or in fp32",
                   pr_dtype_label((int)p.grad_sum_dtype), pr_dtype_label((int)p.grad_comm_dtype));
  }
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_policy_resolve(precis_dtype_t model_dtype,
                                                 const char* const* fields,
                                                 const char* const* values, size_t count,
                                                 precis_policy_t* out) {
  static const char fn[] = "precis_policy_resolve";
  precis_policy_t work = PRECIS_POLICY_INIT;
  precis_status_t st;
  size_t i, first[PRECIS_FIELD_COUNT];
  pr_clear_error();
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: out is NULL", fn);
  st = pr_check_struct(out, fn, "out");
  if (st != PRECIS_OK) return st;
  if (count > 0 && (fields == NULL || values == NULL)) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s is NULL", fn, fields ? "values" : "fields");
  }
  for (i = 0; i < count; ++i) {
    if (fields[i] == NULL || values[i] == NULL) {
      return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s[%zu] is NULL", fn,
                     fields[i] ? "values" : "fields", i);
    }
  }

  /* One key twice ("exp_avg_dtype" and "EXP_AVG_DTYPE" in one YAML mapping) has no
   * order a caller can rely on: refused, not last-wins. */
  for (i = 0; i < PRECIS_FIELD_COUNT; ++i) first[i] = count;
  for (i = 0; i < count; ++i) {
    const pr_field_info* info = pr_lookup_field(fields[i]);
    if (info == NULL) continue; /* set names it below */
    if (first[info->field] < count) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                     "%s: fields[%zu] '%.64s' and fields[%zu] '%.64s' both name %s; give it once",
                     fn, first[info->field], fields[first[info->field]], i, fields[i], info->name);
    }
    first[info->field] = i;
  }

  st = precis_policy_defaults(model_dtype, &work);
  for (i = 0; st == PRECIS_OK && i < count; ++i) {
    st = precis_policy_set(&work, fields[i], values[i]);
    if (st != PRECIS_OK && strncmp(precis_last_error(), "precis_policy_set: ", 19) == 0) {
      char why[768]; /* (set's words about its arguments: this call's, by index) */
      snprintf(why, sizeof why, "%s", precis_last_error() + 19);
      return pr_fail(st, "%s: fields[%zu]: %s", fn, i, why);
    }
  }
  if (st == PRECIS_OK) st = precis_policy_validate(&work);
  if (st != PRECIS_OK) return st;
  if ((work.explicit_fields & PR_BIT(PRECIS_FIELD_MOMENTUM_DTYPE)) &&
      !PR_POLICY_HAS_MOMENTUM(out)) {
    return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                   "%s: momentum_dtype needs out->size >= %zu, got %zu (a struct from "
                   "before momentum_dtype; use PRECIS_POLICY_INIT)",
                   fn, (size_t)(PR_POLICY_MIN_SIZE + sizeof out->momentum_dtype), out->size);
  }
  pr_store(out, &work); /* a caller's larger struct keeps its own size and tail */
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_policy_legal_dtypes(const char* field, uint32_t* out_mask) {
  static const char fn[] = "precis_policy_legal_dtypes";
  char key[32];
  const pr_field_info* info;
  pr_clear_error();
  if (field == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: field is NULL", fn);
  if (out_mask == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: out_mask is NULL", fn);
  /* The model dtype's legal set is asked for too, although it is not an override key. */
  if (pr_normalize(field, key, sizeof key) && strcmp(key, "param_dtype") == 0) {
    *out_mask = pr_legal_mask(&pr_param_field);
    return PRECIS_OK;
  }
  info = pr_find_field(field, fn);
  if (info == NULL) return PRECIS_ERR_INVALID_ARGUMENT;
  if (info->n_legal == 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: %s %s, not a dtype field", fn, info->name,
                   strcmp(info->name, "param_remainder_bits") == 0 ? "takes 16 or 8"
                                                                   : "is a boolean");
  }
  *out_mask = pr_legal_mask(info);
  return PRECIS_OK;
}
