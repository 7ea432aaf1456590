/* dtype.c - dtype names and aliases; sizes from precis_elem_size (precis_convert.h). */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "precis_convert.h"

/* The one table of names. The first entry of each dtype is its canonical name. */
static const struct {
  const char* name;
  precis_dtype_t dtype;
} pr_dtype_aliases[] = {
    {"fp32", PRECIS_DTYPE_FP32},     {"float32", PRECIS_DTYPE_FP32},
    {"float", PRECIS_DTYPE_FP32},    {"fp16", PRECIS_DTYPE_FP16},
    {"float16", PRECIS_DTYPE_FP16},  {"half", PRECIS_DTYPE_FP16},
    {"bf16", PRECIS_DTYPE_BF16},     {"bfloat16", PRECIS_DTYPE_BF16},
    {"fp8", PRECIS_DTYPE_FP8_E4M3},  {"float8", PRECIS_DTYPE_FP8_E4M3},
    {"fp8_e4m3", PRECIS_DTYPE_FP8_E4M3}, {"e4m3", PRECIS_DTYPE_FP8_E4M3},
    {"uint8", PRECIS_DTYPE_FP8_E4M3}, {"int16", PRECIS_DTYPE_INT16},
};
enum { PR_ALIAS_COUNT = sizeof pr_dtype_aliases / sizeof pr_dtype_aliases[0] };

int pr_dtype_valid(int dtype) { return dtype >= 0 && dtype < PRECIS_DTYPE_COUNT; }

const char* pr_dtype_label(int dtype) {
  /* A few rotating buffers, so one message can name two invalid dtypes. */
  static _Thread_local char labels[4][32];
  static _Thread_local unsigned next;
  char* label;
  int i;
  if (pr_dtype_valid(dtype)) {
    for (i = 0; i < PR_ALIAS_COUNT; ++i) {
      if ((int)pr_dtype_aliases[i].dtype == dtype) return pr_dtype_aliases[i].name;
    }
  }
  label = labels[next++ % 4u];
  snprintf(label, sizeof labels[0], "<invalid dtype %d>", dtype);
  return label;
}

int pr_normalize(const char* src, char* dst, size_t cap) {
  const char* end;
  size_t len, i;
  while (*src != '\0' && isspace((unsigned char)*src)) ++src;
  end = src + strlen(src);
  while (end > src && isspace((unsigned char)end[-1])) --end;
  len = (size_t)(end - src);
  if (len >= cap) return 0;
  for (i = 0; i < len; ++i) dst[i] = (char)tolower((unsigned char)src[i]);
  dst[len] = '\0';
  return 1;
}

/* pr_check_aligned's failure, apart: its buffer for the name is no cost of the check
 * (a step checks every buffer of every tensor: ~1,000 calls for 129 params). */
static __attribute__((noinline)) precis_status_t pr_misaligned(const char* fn, const char* name,
                                                               long long index, const void* ptr,
                                                               int dtype, int w) {
  char label[64];
  if (index < 0) {
    snprintf(label, sizeof label, "%s", name);
  } else {
    snprintf(label, sizeof label, "%s[%lld]", name, index);
  }
  return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: %s (%p) is not aligned to its %d-byte %s elements",
                 fn, label, ptr, w, pr_dtype_label(dtype));
}

precis_status_t pr_check_aligned(const char* fn, const char* name, long long index,
                                 const void* ptr, int dtype) {
  const int w = precis_elem_size(dtype);
  if (w <= 1 || (uintptr_t)ptr % (uintptr_t)w == 0) return PRECIS_OK;
  return pr_misaligned(fn, name, index, ptr, dtype, w);
}

PRECIS_API precis_status_t precis_dtype_from_name(const char* name, precis_dtype_t* out) {
  char key[32];
  size_t i;
  char accepted[256];
  pr_clear_error();
  if (name == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "dtype: name is NULL");
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "dtype: out is NULL");

  /* Trimmed, lowercased, and without a "torch." prefix, so str(torch.bfloat16) works. */
  if (pr_normalize(name, key, sizeof key)) {
    const char* bare = strncmp(key, "torch.", 6) == 0 ? key + 6 : key;
    for (i = 0; i < PR_ALIAS_COUNT; ++i) {
      if (strcmp(bare, pr_dtype_aliases[i].name) == 0) {
        *out = pr_dtype_aliases[i].dtype;
        return PRECIS_OK;
      }
    }
  }

  pr_dtype_names(~0u, accepted, sizeof accepted);
  return pr_fail(PRECIS_ERR_INVALID_DTYPE, "dtype: '%.64s' is not a dtype; accepted: %s", name,
                 accepted);
}

void pr_dtype_names(uint32_t mask, char* buf, size_t cap) {
  size_t i;
  buf[0] = '\0';
  for (i = 0; i < PR_ALIAS_COUNT; ++i) {
    if (!(mask >> (unsigned)pr_dtype_aliases[i].dtype & 1u)) continue;
    if (buf[0] != '\0') strncat(buf, ", ", cap - strlen(buf) - 1);
    strncat(buf, pr_dtype_aliases[i].name, cap - strlen(buf) - 1);
  }
}

PRECIS_API precis_status_t precis_dtype_name(precis_dtype_t dtype, const char** out) {
  pr_clear_error();
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_dtype_name: out is NULL");
  if (!pr_dtype_valid((int)dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE, "precis_dtype_name: %d is not a dtype code",
                   (int)dtype);
  }
  *out = pr_dtype_label((int)dtype);
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_dtype_size(precis_dtype_t dtype, size_t* out) {
  pr_clear_error();
  if (out == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_dtype_size: out is NULL");
  if (!pr_dtype_valid((int)dtype)) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE, "precis_dtype_size: %d is not a dtype code",
                   (int)dtype);
  }
  *out = (size_t)precis_elem_size((int)dtype);
  return PRECIS_OK;
}
