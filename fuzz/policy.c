/*
 * policy.c - libFuzzer harness of every entry point of csrc/policy.c that takes
 * strings: precis_policy_set, precis_policy_resolve and
 * precis_policy_legal_dtypes, with precis_policy_defaults and
 * precis_policy_validate around them.
 *
 * Input: one byte for the model dtype code, then lines "field=value" (a line
 * without '=' is a field with an empty value; bytes after a NUL in a line are
 * what a C caller never passes, so each string ends at its first NUL).
 * Invariants:
 *  - resolve succeeds exactly when no field is named twice (case and blanks aside)
 *    and defaults, every set in order and validate do, and then gives their policy;
 *    a field named twice fails with PRECIS_ERR_INVALID_ARGUMENT; on failure *out is
 *    untouched;
 *  - a failing set leaves the policy untouched; a successful one marks its field
 *    explicit and stores the value's dtype, which is in the field's legal set;
 *  - with every field given once, the overrides give the same policy in reverse
 *    order ("whatever the order of the calls", precis.h);
 *  - a validated policy obeys the combination rules of precis.h;
 *  - validate on an arbitrary struct never crashes and passes only legal codes;
 *  - a struct from before momentum_dtype validates as the whole one with its
 *    momentum_dtype following exp_avg_dtype; one byte shorter is refused.
 */
#include "fuzz.h"

enum { FZ_MAX_LINES = 12 };

static const char* const fz_fields[] = {"main_params_dtype", "main_grads_dtype", "grad_comm_dtype",
                                        "exp_avg_dtype", "exp_avg_sq_dtype",
                                        "store_param_remainders", "grad_reduce_in_fp32",
                                        "grad_sum_dtype", "param_remainder_bits",
                                        "momentum_dtype"};
enum { FZ_FIELDS = (int)(sizeof fz_fields / sizeof fz_fields[0]) };

/* name trimmed of C-locale whitespace and lowercased into key; 0 if too long. */
static int fz_normalize(const char* name, char* key, size_t cap) {
  size_t len = strlen(name), start = 0, i;
  while (start < len && (name[start] == ' ' || (name[start] >= '\t' && name[start] <= '\r'))) {
    ++start;
  }
  while (len > start && (name[len - 1] == ' ' || (name[len - 1] >= '\t' && name[len - 1] <= '\r'))) {
    --len;
  }
  if (len - start >= cap) return 0;
  for (i = start; i < len; ++i) {
    char c = name[i];
    key[i - start] = (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  }
  key[len - start] = '\0';
  return 1;
}

/* The override field a name is, or -1. */
static int fz_field_index(const char* name) {
  char key[64];
  int k;
  if (!fz_normalize(name, key, sizeof key)) return -1;
  for (k = 0; k < FZ_FIELDS; ++k) {
    if (strcmp(key, fz_fields[k]) == 0) return k;
  }
  return -1;
}

static int fz_dtype_member(const precis_policy_t* p, int field) {
  switch (field) {
    case 0: return (int)p->main_params_dtype;
    case 1: return (int)p->main_grads_dtype;
    case 2: return (int)p->grad_comm_dtype;
    case 3: return (int)p->exp_avg_dtype;
    case 4: return (int)p->exp_avg_sq_dtype;
    case 7: return (int)p->grad_sum_dtype;
    case 9: return (int)p->momentum_dtype;
    default: return -1;
  }
}

/* Member by member: the struct has tail padding, which copies need not keep. */
static int fz_same(const precis_policy_t* a, const precis_policy_t* b) {
  return a->size == b->size && a->param_dtype == b->param_dtype &&
         a->main_params_dtype == b->main_params_dtype &&
         a->main_grads_dtype == b->main_grads_dtype && a->grad_comm_dtype == b->grad_comm_dtype &&
         a->exp_avg_dtype == b->exp_avg_dtype && a->exp_avg_sq_dtype == b->exp_avg_sq_dtype &&
         a->store_param_remainders == b->store_param_remainders &&
         a->explicit_fields == b->explicit_fields && a->grad_sum_dtype == b->grad_sum_dtype &&
         a->param_remainder_bits == b->param_remainder_bits &&
         a->momentum_dtype == b->momentum_dtype;
}

static int fz_size(int dtype) { return dtype == 0 ? 4 : dtype == 3 ? 1 : 2; }

/* The combination rules of precis_policy_validate's comment, on a policy it passed. */
static void fz_check_valid(const precis_policy_t* p) {
  int f;
  FZ_CHECK((int)p->param_dtype >= 0 && (int)p->param_dtype <= 2, "param_dtype %d",
           (int)p->param_dtype);
  for (f = 0; f < FZ_FIELDS; ++f) {
    uint32_t mask = 0;
    if (fz_dtype_member(p, f) < 0) continue; /* a boolean field */
    FZ_CHECK(precis_policy_legal_dtypes(fz_fields[f], &mask) == PRECIS_OK, "legal %d", f);
    FZ_CHECK((mask >> fz_dtype_member(p, f)) & 1u, "%s %d outside its legal set", fz_fields[f],
             fz_dtype_member(p, f));
  }
  FZ_CHECK(p->store_param_remainders == 0 || p->store_param_remainders == 1, "remainders flag");
  FZ_CHECK(fz_size((int)p->main_params_dtype) >= fz_size((int)p->param_dtype),
           "master narrower than the param");
  FZ_CHECK(p->param_dtype != PRECIS_DTYPE_FP32 || p->main_params_dtype == PRECIS_DTYPE_FP32,
           "separate master for an fp32 model");
  FZ_CHECK(p->main_params_dtype != PRECIS_DTYPE_BF16 || p->param_dtype == PRECIS_DTYPE_BF16,
           "bf16 master for a non-bf16 model");
  FZ_CHECK(!p->store_param_remainders ||
               (p->param_dtype == PRECIS_DTYPE_BF16 && p->main_params_dtype == PRECIS_DTYPE_FP32),
           "remainders without bf16 params and an fp32 master");
  FZ_CHECK(p->grad_sum_dtype == p->grad_comm_dtype || p->grad_sum_dtype == PRECIS_DTYPE_FP32,
           "sums in %d with the wire in %d", (int)p->grad_sum_dtype, (int)p->grad_comm_dtype);
  FZ_CHECK(p->param_remainder_bits == 16 || (p->param_remainder_bits == 8 && p->store_param_remainders),
           "param_remainder_bits %d (remainders %d)", (int)p->param_remainder_bits,
           (int)p->store_param_remainders);
}

/* Applies the overrides one by one from defaults; returns the first failing
 * status (PRECIS_OK if none), checking each set's invariants. */
static precis_status_t fz_apply(int model, char** fields, char** values, int n, int reverse,
                                precis_policy_t* p) {
  precis_status_t st;
  int k;
  st = precis_policy_defaults((precis_dtype_t)model, p);
  fz_check_status(st, "precis_policy_defaults", NULL);
  FZ_CHECK((st == PRECIS_OK) == (model >= 0 && model <= 2), "defaults for model %d: %d", model,
           (int)st);
  if (st != PRECIS_OK) return st;
  FZ_CHECK(precis_policy_validate(p) == PRECIS_OK, "defaults of %d invalid", model);
  for (k = 0; k < n; ++k) {
    const int i = reverse ? n - 1 - k : k;
    const int field = fz_field_index(fields[i]);
    precis_policy_t before = *p;
    uint32_t mask = 0;
    st = precis_policy_set(p, fields[i], values[i]);
    fz_check_status(st, "precis_policy_set", NULL);
    if (st != PRECIS_OK) {
      FZ_CHECK(fz_same(&before, p), "failed set of '%s' changed the policy",
               fields[i]);
      return st;
    }
    FZ_CHECK(field >= 0, "'%s' accepted as a field", fields[i]);
    FZ_CHECK(p->explicit_fields == (before.explicit_fields | (1u << field)), "explicit bits");
    FZ_CHECK(p->param_dtype == before.param_dtype && p->size == before.size, "param_dtype/size");
    if (fz_dtype_member(p, field) >= 0) {
      precis_dtype_t d;
      FZ_CHECK(precis_dtype_from_name(values[i], &d) == PRECIS_OK, "'%s' accepted as a dtype",
               values[i]);
      FZ_CHECK(fz_dtype_member(p, field) == (int)d, "'%s' not stored", fields[i]);
      FZ_CHECK(precis_policy_legal_dtypes(fields[i], &mask) == PRECIS_OK && ((mask >> d) & 1u),
               "'%s'='%s' outside the legal set", fields[i], values[i]);
    }
    if (!(p->explicit_fields & (1u << PRECIS_FIELD_GRAD_COMM_DTYPE))) {
      FZ_CHECK(p->grad_comm_dtype == p->main_grads_dtype, "grad_comm_dtype does not follow");
    }
    if (!(p->explicit_fields & (1u << PRECIS_FIELD_GRAD_SUM_DTYPE))) {
      FZ_CHECK(p->grad_sum_dtype == p->grad_comm_dtype, "grad_sum_dtype does not follow");
    }
    if (!(p->explicit_fields & (1u << PRECIS_FIELD_MOMENTUM_DTYPE))) {
      FZ_CHECK(p->momentum_dtype == p->exp_avg_dtype, "momentum_dtype does not follow");
    }
  }
  st = precis_policy_validate(p);
  fz_check_status(st, "precis_policy_validate", NULL);
  if (st == PRECIS_OK) fz_check_valid(p);
  return st;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fz_reader_t r = {data, size};
  const int model = fz_dtype(&r);
  char* text = (char*)malloc(r.size + 1);
  char* fields[FZ_MAX_LINES];
  char* values[FZ_MAX_LINES];
  precis_policy_t stepwise = PRECIS_POLICY_INIT, reversed = PRECIS_POLICY_INIT;
  precis_policy_t out, sentinel, raw, old;
  precis_status_t st, st_steps;
  char* line;
  int n = 0, k, distinct;
  uint32_t mask = 0;

  /* Lines of field=value. */
  memcpy(text, r.data, r.size);
  text[r.size] = '\0';
  for (line = text; n < FZ_MAX_LINES && line != NULL;) {
    char* next = strchr(line, '\n');
    char* eq;
    if (next != NULL) *next++ = '\0';
    eq = strchr(line, '=');
    fields[n] = line;
    values[n] = eq != NULL ? (*eq = '\0', eq + 1) : line + strlen(line);
    ++n;
    line = next;
  }
  if (n == 1 && fields[0][0] == '\0') n = 0;

  memset(&out, 0xA5, sizeof out);
  out.size = sizeof out;
  sentinel = out;
  st = precis_policy_resolve((precis_dtype_t)model, (const char* const*)fields,
                             (const char* const*)values, (size_t)n, &out);
  fz_check_status(st, "precis_policy_resolve", NULL);
  st_steps = fz_apply(model, fields, values, n, 0, &stepwise);
  /* Each field at most once (lines that name no field aside: set refuses them). */
  distinct = 1;
  for (k = 0; k < n && distinct; ++k) {
    int j;
    for (j = 0; j < k; ++j) {
      if (fz_field_index(fields[k]) >= 0 && fz_field_index(fields[j]) == fz_field_index(fields[k])) {
        distinct = 0;
      }
    }
  }
  FZ_CHECK((st == PRECIS_OK) == (distinct && st_steps == PRECIS_OK),
           "resolve %d, step by step %d, fields distinct %d", (int)st, (int)st_steps, distinct);
  FZ_CHECK(distinct || st == PRECIS_ERR_INVALID_ARGUMENT, "a field named twice: resolve %d",
           (int)st);
  if (st == PRECIS_OK) {
    FZ_CHECK(fz_same(&out, &stepwise), "resolve differs from step by step");
  } else {
    FZ_CHECK(fz_same(&out, &sentinel), "failed resolve wrote *out");
  }

  /* Each field at most once: the order does not matter. */
  if (st == PRECIS_OK && distinct) {
    st = fz_apply(model, fields, values, n, 1, &reversed);
    FZ_CHECK(st == PRECIS_OK && fz_same(&reversed, &stepwise),
             "overrides in reverse order give status %d or another policy", (int)st);
  }

  /* legal_dtypes of each field name. */
  for (k = 0; k < n; ++k) {
    const int field = fz_field_index(fields[k]);
    char key[64];
    const int is_param = fz_normalize(fields[k], key, sizeof key) && strcmp(key, "param_dtype") == 0;
    mask = 0xDEAD;
    st = precis_policy_legal_dtypes(fields[k], &mask);
    fz_check_status(st, "precis_policy_legal_dtypes", NULL);
    if (field >= 0 && fz_dtype_member(&stepwise, field) >= 0) { /* a dtype field */
      FZ_CHECK(st == PRECIS_OK && mask != 0 && (mask & ~0x1Fu) == 0, "mask of '%s'", fields[k]);
    } else if (is_param) {
      FZ_CHECK(st == PRECIS_OK && mask == 0x7u, "param_dtype mask %#x", mask);
    } else {
      FZ_CHECK(mask == 0xDEAD, "failed legal_dtypes wrote its mask");
    }
  }

  /* validate on whatever the bytes say; the struct's size must hold. */
  memset(&raw, 0, sizeof raw);
  raw.size = sizeof raw;
  raw.param_dtype = (precis_dtype_t)fz_dtype(&r);
  raw.main_params_dtype = (precis_dtype_t)(size > 1 ? data[size - 1] % 6 : 0);
  raw.main_grads_dtype = (precis_dtype_t)(size > 2 ? data[size - 2] % 6 : 0);
  raw.grad_comm_dtype = (precis_dtype_t)(size > 3 ? data[size - 3] % 6 : 0);
  raw.exp_avg_dtype = (precis_dtype_t)(size > 4 ? data[size - 4] % 6 : 0);
  raw.exp_avg_sq_dtype = (precis_dtype_t)(size > 5 ? data[size - 5] % 6 : 0);
  raw.store_param_remainders = size > 6 ? data[size - 6] % 3 : 0;
  raw.grad_sum_dtype = (precis_dtype_t)(size > 7 ? data[size - 7] % 6 : 0);
  raw.param_remainder_bits = size > 8 ? (int32_t)data[size - 8] % 20 : 16;
  raw.momentum_dtype = (precis_dtype_t)(size > 9 ? data[size - 9] % 6 : 0);
  st = precis_policy_validate(&raw);
  fz_check_status(st, "precis_policy_validate", NULL);
  if (st == PRECIS_OK) fz_check_valid(&raw);
  /* A caller's struct from before momentum_dtype: read as if it followed exp_avg_dtype. */
  old = raw;
  old.momentum_dtype = old.exp_avg_dtype;
  st = precis_policy_validate(&old);
  raw.size = offsetof(precis_policy_t, momentum_dtype);
  FZ_CHECK(precis_policy_validate(&raw) == st, "older struct: %d, as the whole one: %d",
           (int)precis_policy_validate(&raw), (int)st);
  raw.size = offsetof(precis_policy_t, momentum_dtype) - 1;
  FZ_CHECK(precis_policy_validate(&raw) == PRECIS_ERR_SIZE_MISMATCH, "short struct accepted");
  free(text);
  return 0;
}
