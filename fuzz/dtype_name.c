/*
 * dtype_name.c - libFuzzer harness of precis_dtype_from_name, precis_dtype_name
 * and precis_dtype_size.
 *
 * The input is a name (the C string up to its first NUL, as a C caller passes
 * it; the Python layer refuses NUL bytes before calling). A reference written
 * here from precis.h's contract (trim whitespace, ignore case, an optional
 * "torch." prefix, the alias list) says whether it names a dtype; the library
 * must agree, and a failure must leave *out alone. The byte after the NUL, if
 * any, is a dtype code for precis_dtype_name / _size.
 */
#include <ctype.h>

#include "fuzz.h"

static const struct {
  const char* name;
  int dtype;
} fz_aliases[] = {
    {"fp32", 0},     {"float32", 0}, {"float", 0}, {"fp16", 1},     {"float16", 1},
    {"half", 1},     {"bf16", 2},    {"bfloat16", 2}, {"fp8", 3},   {"float8", 3},
    {"fp8_e4m3", 3}, {"e4m3", 3},    {"uint8", 3},    {"int16", 4},
};
enum { FZ_ALIASES = sizeof fz_aliases / sizeof fz_aliases[0] };
static const char* const fz_canonical[] = {"fp32", "fp16", "bf16", "fp8", "int16"};
static const size_t fz_sizes[] = {4, 2, 2, 1, 2};

/* The dtype name names under the contract, or -1. */
static int fz_reference(const char* name) {
  size_t len = strlen(name), start = 0, i;
  char* key = (char*)malloc(len + 1);
  const char* bare;
  int dtype = -1;
  while (start < len && isspace((unsigned char)name[start])) ++start;
  while (len > start && isspace((unsigned char)name[len - 1])) --len;
  for (i = start; i < len; ++i) key[i - start] = (char)tolower((unsigned char)name[i]);
  key[len - start] = '\0';
  bare = strncmp(key, "torch.", 6) == 0 ? key + 6 : key;
  for (i = 0; i < FZ_ALIASES; ++i) {
    if (strcmp(bare, fz_aliases[i].name) == 0) dtype = fz_aliases[i].dtype;
  }
  free(key);
  return dtype;
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  char* name = (char*)malloc(size + 1);
  const uint8_t* nul = (const uint8_t*)memchr(data, 0, size);
  const size_t len = nul != NULL ? (size_t)(nul - data) : size;
  precis_dtype_t out = (precis_dtype_t)-7;
  precis_status_t st;
  const char* canonical = NULL;
  size_t bytes = 99;
  int want, code;

  memcpy(name, data, size);
  name[size] = '\0';
  want = fz_reference(name);
  st = precis_dtype_from_name(name, &out);
  if (want >= 0) {
    FZ_CHECK(st == PRECIS_OK && (int)out == want, "'%s': status %d, dtype %d, want %d", name,
             (int)st, (int)out, want);
    FZ_CHECK(precis_last_error()[0] == '\0', "'%s': OK with a message", name);
    /* The canonical name maps back. */
    FZ_CHECK(precis_dtype_name(out, &canonical) == PRECIS_OK &&
                 strcmp(canonical, fz_canonical[want]) == 0,
             "'%s' -> %d -> '%s'", name, want, canonical ? canonical : "(null)");
  } else {
    FZ_CHECK(st == PRECIS_ERR_INVALID_DTYPE, "'%s' accepted as %d (status %d)", name, (int)out,
             (int)st);
    FZ_CHECK((int)out == -7, "'%s': *out written on failure", name);
    FZ_CHECK(strncmp(precis_last_error(), "dtype: '", 8) == 0, "'%s': message", name);
  }
  FZ_CHECK(precis_dtype_from_name(NULL, &out) == PRECIS_ERR_NULL_POINTER, "NULL name");
  FZ_CHECK(precis_dtype_from_name(name, NULL) == PRECIS_ERR_NULL_POINTER, "NULL out");

  /* A dtype code from the byte after the name's NUL (or the first byte). */
  code = len + 1 < size ? (int)(int8_t)data[len + 1] : size > 0 ? data[0] % 8 : 0;
  canonical = NULL;
  st = precis_dtype_name((precis_dtype_t)code, &canonical);
  fz_check_status(st, "precis_dtype_name", "precis_dtype_name");
  FZ_CHECK((st == PRECIS_OK) == (code >= 0 && code < 5), "name of code %d: status %d", code,
           (int)st);
  FZ_CHECK(st == PRECIS_OK ? strcmp(canonical, fz_canonical[code]) == 0 : canonical == NULL,
           "name of code %d", code);
  st = precis_dtype_size((precis_dtype_t)code, &bytes);
  fz_check_status(st, "precis_dtype_size", "precis_dtype_size");
  FZ_CHECK((st == PRECIS_OK) == (code >= 0 && code < 5), "size of code %d", code);
  if (st == PRECIS_OK) {
    precis_dtype_t back;
    FZ_CHECK(precis_dtype_from_name(fz_canonical[code], &back) == PRECIS_OK && (int)back == code,
             "canonical name of %d", code);
    FZ_CHECK(bytes == fz_sizes[code], "size of %d is %zu", code, bytes);
  } else {
    FZ_CHECK(bytes == 99, "size written for code %d", code);
  }
  free(name);
  return 0;
}
