/*
 * fuzz.h - what the libFuzzer harnesses of fuzz/ share: a reader that decodes
 * the fuzzer's bytes into values (running out of input gives zeros, so every
 * input decodes), special values for numbers, and FZ_CHECK, which aborts on a
 * broken invariant so that libFuzzer reports the input. tools/fuzz.sh builds
 * and runs them.
 */
#ifndef PRECIS_FUZZ_FUZZ_H_
#define PRECIS_FUZZ_FUZZ_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "precis/precis.h"

#define FZ_CHECK(cond, ...)                                                          \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "fuzz invariant broken at %s:%d: %s\n  ", __FILE__, __LINE__, \
              #cond);                                                                \
      fprintf(stderr, __VA_ARGS__);                                                  \
      fprintf(stderr, "\n  precis_last_error: %s\n", precis_last_error());           \
      abort();                                                                       \
    }                                                                                \
  } while (0)

/* Checks every call shares: a known status; a failure leaves a message (which
 * starts with prefix, when one is given), a success none. */
static inline void fz_check_status(precis_status_t st, const char* what, const char* prefix) {
  const char* msg = precis_last_error();
  FZ_CHECK((int)st >= 0 && (int)st < (int)PRECIS_STATUS_COUNT, "%s: status %d", what, (int)st);
  if (st == PRECIS_OK) {
    FZ_CHECK(msg[0] == '\0', "%s: OK with a message", what);
  } else {
    FZ_CHECK(msg[0] != '\0', "%s: status %d without a message", what, (int)st);
    FZ_CHECK(prefix == NULL || strncmp(msg, prefix, strlen(prefix)) == 0,
             "%s: status %d, the message does not start with '%s'", what, (int)st, prefix);
  }
}

typedef struct fz_reader {
  const uint8_t* data;
  size_t size;
} fz_reader_t;

static inline uint8_t fz_u8(fz_reader_t* r) {
  uint8_t b = 0;
  if (r->size > 0) b = *r->data++, r->size--;
  return b;
}

static inline uint64_t fz_u64(fz_reader_t* r) {
  uint64_t x = 0;
  int i;
  for (i = 0; i < 8; ++i) x |= (uint64_t)fz_u8(r) << (8 * i);
  return x;
}

static inline uint32_t fz_u32(fz_reader_t* r) { return (uint32_t)fz_u64(r); }

/* A dtype code: mostly the five dtypes, sometimes codes that are none. */
static inline int fz_dtype(fz_reader_t* r) {
  static const int codes[] = {0, 1, 2, 3, 4, -1, 5, 1000, (int)0x80000000u};
  uint8_t b = fz_u8(r);
  return b < 0xF0 ? b % 5 : codes[b % (sizeof codes / sizeof codes[0])];
}

/* A double: usually a plausible hyperparameter, often a special value. */
static inline double fz_double(fz_reader_t* r, double usual) {
  uint8_t b = fz_u8(r);
  uint64_t bits;
  double x;
  switch (b % 16) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -INFINITY;
    case 3: return 0.0;
    case 4: return -0.0;
    case 5: return 1.0;
    case 6: return 1e300;
    case 7: return -1e-3;
    case 8: return 4e38; /* beyond float32 */
    case 9: return 1e-50; /* below float32's subnormals */
    case 10: return nextafter(1.0, 0.0);
    case 11:
      bits = fz_u64(r);
      memcpy(&x, &bits, sizeof x);
      return x;
    default: return usual * (1.0 + (double)(b >> 4) / 16.0);
  }
}

/* A 0/1 flag that is sometimes neither. */
static inline int32_t fz_flag(fz_reader_t* r) {
  uint8_t b = fz_u8(r);
  return b < 0xF8 ? (int32_t)(b & 1) : (int32_t)(b - 0xF6) * (b & 1 ? -1 : 1);
}

/* A float from raw bits or a nice value (many inputs must be finite and
 * ordinary for a kernel to compute anything worth checking). */
static inline float fz_float(fz_reader_t* r) {
  uint8_t b = fz_u8(r);
  uint32_t bits;
  float x;
  if (b < 0x40) {
    bits = fz_u32(r);
    memcpy(&x, &bits, sizeof x);
    return x;
  }
  return ((float)(int8_t)fz_u8(r) + (float)b / 256.0f) * ldexpf(1.0f, (int)(b % 40) - 20);
}

/* Memory the harnesses point buffers into: an exact-size heap block, so that
 * AddressSanitizer reports any access past it; 16-byte aligned, so offsets
 * from it decide each buffer's alignment. */
static inline uint8_t* fz_alloc(size_t bytes) {
  uint8_t* p = (uint8_t*)malloc(bytes > 0 ? bytes : 1);
  FZ_CHECK(p != NULL && (uintptr_t)p % 16 == 0, "malloc(%zu)", bytes);
  return p;
}

#endif /* PRECIS_FUZZ_FUZZ_H_ */
