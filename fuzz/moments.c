/*
 * moments.c - libFuzzer harness of precis_moment_encode / _decode and
 * precis_remainder_split / _join, and their argument checks.
 *
 * The input gives the dtype code, which moment, numel, whether a pointer is
 * NULL or off its alignment, and the fp32 values (raw bits or ordinary
 * numbers). Buffers are exact-size heap blocks (AddressSanitizer reports any
 * access past them). Invariants:
 *  - the status is OK exactly when a reference of precis.h's contract says the
 *    call is valid; a failing call writes nothing;
 *  - encode writes exactly its stored values and precis_scale_count(numel)
 *    scales; decode(encode(x)) is x for fp32, x rounded to nearest even for
 *    bf16, and within the block's quantization error for fp16 / fp8 (relative
 *    to the block's largest value; a positive second moment is never stored as 0);
 *  - split then join gives every fp32 bit pattern back, and join then split
 *    every (bf16, int16) pair ("exact both ways").
 */
#include "fuzz.h"
#include "precis_convert.h"

enum { FZ_MAX = 700, FZ_BLOCK = 128 };

static int fz_size(int d) { return d == PRECIS_DTYPE_FP32 ? 4 : d == PRECIS_DTYPE_FP8_E4M3 ? 1 : 2; }
static int fz_scaled(int d) { return d == PRECIS_DTYPE_FP16 || d == PRECIS_DTYPE_FP8_E4M3; }

/* Copies of n bytes at an offset of 0-3 bytes into an exact-size block. */
typedef struct fz_buf {
  uint8_t* block;
  uint8_t* p;
  size_t bytes;
} fz_buf_t;

static fz_buf_t fz_buf(size_t bytes, size_t off, int null) {
  fz_buf_t b;
  b.block = fz_alloc(bytes + off);
  memset(b.block, 0xC3, bytes + off);
  b.p = null ? NULL : b.block + off;
  b.bytes = bytes + off;
  return b;
}

/* A buffer's bytes are all still 0xC3. */
static int fz_untouched(const fz_buf_t* b) {
  size_t j;
  for (j = 0; j < b->bytes; ++j) {
    if (b->block[j] != 0xC3) return 0;
  }
  return 1;
}

static void fz_check_remainders(fz_reader_t* r, const float* x, int64_t n) {
  const uint8_t mode = fz_u8(r);
  const size_t off = (mode & 0x30) == 0x30 ? 1 + mode % 3 : 0; /* misaligns one buffer */
  const int which = (mode >> 2) % 3; /* master, param_bf16, remainder */
  fz_buf_t master = fz_buf((size_t)n * 4, which == 0 ? off : 0, mode == 0xF0);
  fz_buf_t param = fz_buf((size_t)n * 2, which == 1 ? off : 0, mode == 0xF1);
  fz_buf_t rem = fz_buf((size_t)n * 2, which == 2 ? off : 0, mode == 0xF2);
  const int valid = n == 0 || (master.p != NULL && param.p != NULL && rem.p != NULL &&
                               (uintptr_t)master.p % 4 == 0 && (uintptr_t)param.p % 2 == 0 &&
                               (uintptr_t)rem.p % 2 == 0);
  precis_status_t st;
  int64_t i;

  if (master.p != NULL) memcpy(master.p, x, (size_t)n * 4);
  st = precis_remainder_split((const float*)master.p, n, (uint16_t*)param.p, (int16_t*)rem.p);
  fz_check_status(st, "precis_remainder_split", "precis_remainder_split");
  FZ_CHECK((st == PRECIS_OK) == valid, "split: status %d", (int)st);
  if (st != PRECIS_OK || n == 0) {
    FZ_CHECK(fz_untouched(&param) && fz_untouched(&rem), "failed split wrote");
  } else {
    /* join(split(x)) == x, every bit; and join(split) on what split made. */
    float* back = (float*)fz_alloc((size_t)n * 4);
    uint16_t* p2 = (uint16_t*)fz_alloc((size_t)n * 2);
    int16_t* r2 = (int16_t*)fz_alloc((size_t)n * 2);
    FZ_CHECK(precis_remainder_join((const uint16_t*)param.p, (const int16_t*)rem.p, n, back) ==
                 PRECIS_OK, "join");
    FZ_CHECK(memcmp(back, x, (size_t)n * 4) == 0, "join(split(x)) != x");
    /* Any (bf16, int16) pair: join then split gives it back. */
    for (i = 0; i < n; ++i) {
      uint32_t u = precis_f32_bits(x[i]);
      ((uint16_t*)param.p)[i] = (uint16_t)(u ^ (u >> 16));
      ((int16_t*)rem.p)[i] = (int16_t)(uint16_t)(u >> 7);
    }
    FZ_CHECK(precis_remainder_join((const uint16_t*)param.p, (const int16_t*)rem.p, n, back) ==
                 PRECIS_OK, "join");
    FZ_CHECK(precis_remainder_split(back, n, p2, r2) == PRECIS_OK, "split");
    FZ_CHECK(memcmp(p2, param.p, (size_t)n * 2) == 0 && memcmp(r2, rem.p, (size_t)n * 2) == 0,
             "split(join(p, r)) != (p, r)");
    free(back);
    free(p2);
    free(r2);
  }
  free(master.block);
  free(param.block);
  free(rem.block);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fz_reader_t r = {data, size};
  const int dtype = fz_dtype(&r);
  const int32_t second = fz_flag(&r);
  const uint8_t shape = fz_u8(&r);
  const int64_t n = shape < 0xF8 ? (int64_t)(shape % 8) * 97 % FZ_MAX + fz_u8(&r) % 100
                                 : shape == 0xF8 ? -1 : shape == 0xF9 ? INT64_MIN : 0;
  const uint8_t mode = fz_u8(&r); /* NULLs and misalignment */
  const int valid_dtype = dtype >= 0 && dtype <= 3;
  const size_t width = valid_dtype ? (size_t)fz_size(dtype) : 1;
  const int64_t nn = n > 0 ? n : 0;
  int64_t scales_n = 0, i;
  float* x = (float*)fz_alloc((size_t)nn * 4 + 4);
  fz_buf_t src, dst, scales, back;
  int negative = 0, valid;
  precis_status_t st;

  for (i = 0; i < nn; ++i) x[i] = fz_float(&r);
  if (second) { /* mostly what a second moment is: non-negative */
    for (i = 0; i < nn && (mode & 0x40); ++i) x[i] = fabsf(x[i]);
    for (i = 0; i < nn; ++i) negative |= x[i] < 0.0f;
  }
  FZ_CHECK(precis_scale_count(n, &scales_n) == (n >= 0 ? PRECIS_OK : PRECIS_ERR_INVALID_ARGUMENT),
           "scale_count(%lld)", (long long)n);
  if (n >= 0) FZ_CHECK(scales_n == (n + FZ_BLOCK - 1) / FZ_BLOCK, "scale_count(%lld)", (long long)n);

  /* encode: x -> stored + scales */
  src = fz_buf((size_t)nn * 4, (mode & 3) == 1 ? 2 : 0, mode == 0xF0);
  dst = fz_buf((size_t)nn * width, (mode & 3) == 2 ? 1 : 0, mode == 0xF1);
  scales = fz_buf((size_t)scales_n * 4, (mode & 3) == 3 ? 1 : 0, mode == 0xF2);
  if (src.p != NULL) memcpy(src.p, x, (size_t)nn * 4);
  valid = n >= 0 && (second == 0 || second == 1) && valid_dtype &&
          (n == 0 || (src.p != NULL && dst.p != NULL && (uintptr_t)src.p % 4 == 0 &&
                      (uintptr_t)dst.p % width == 0 &&
                      (!fz_scaled(dtype) || (scales.p != NULL && (uintptr_t)scales.p % 4 == 0)) &&
                      !(second && negative)));
  st = precis_moment_encode((const float*)src.p, n, second, dst.p, (precis_dtype_t)dtype,
                            (float*)scales.p);
  fz_check_status(st, "precis_moment_encode", "precis_moment_encode");
  FZ_CHECK((st == PRECIS_OK) == valid, "encode dtype %d second %d n %lld mode %#x: status %d",
           dtype, (int)second, (long long)n, mode, (int)st);
  if (st != PRECIS_OK || n == 0) {
    FZ_CHECK(fz_untouched(&dst) && fz_untouched(&scales), "failed encode wrote");
  } else {
    /* decode and compare with what encode promises. */
    float* y;
    back = fz_buf((size_t)n * 4, 0, 0);
    y = (float*)back.p;
    FZ_CHECK(fz_scaled(dtype) || fz_untouched(&scales), "scales written for dtype %d", dtype);
    st = precis_moment_decode(dst.p, fz_scaled(dtype) ? (const float*)scales.p : NULL, n, second,
                              (precis_dtype_t)dtype, y);
    FZ_CHECK(st == PRECIS_OK, "decode of an encoding");
    for (i = 0; i < n; ++i) {
      const float xi = x[i];
      if (dtype == PRECIS_DTYPE_FP32) {
        FZ_CHECK(memcmp(&y[i], &xi, 4) == 0, "fp32 [%lld]", (long long)i);
      } else if (dtype == PRECIS_DTYPE_BF16) {
        FZ_CHECK(precis_f32_bits(y[i]) == (precis_f32_bits(precis_bf16_to_f32(precis_f32_to_bf16_rn(xi)))),
                 "bf16 [%lld]: %a from %a", (long long)i, (double)y[i], (double)xi);
      } else {
        /* The block's amax bounds the error: half a step of the top binade
         * (2^-11 fp16, 2^-4 fp8), doubled for v = root^2 (plus its square). */
        const int64_t lo = i / FZ_BLOCK * FZ_BLOCK, hi = lo + FZ_BLOCK < n ? lo + FZ_BLOCK : n;
        const double e = dtype == PRECIS_DTYPE_FP16 ? 1.0 / 2048 : 1.0 / 16;
        double amax = 0, bound;
        int finite = 1;
        int64_t k;
        for (k = lo; k < hi; ++k) {
          const double m = second ? sqrt((double)x[k]) : fabs((double)x[k]);
          finite &= isfinite(x[k]) != 0;
          amax = m > amax ? m : amax;
        }
        /* Extremes, where the products over- or underflow, are not bounded here. */
        if (!finite || (second ? amax * amax : amax) > 1e37 || amax < 1e-25) continue;
        /* + the spacing of fp32 subnormals: the decoded product may be one. */
        bound = (second ? amax * amax * (3 * e) : amax * e) + 0x1p-149;
        FZ_CHECK(fabs((double)y[i] - (double)xi) <= bound * 1.0001,
                 "dtype %d second %d [%lld]: %a from %a, amax %a", dtype, (int)second,
                 (long long)i, (double)y[i], (double)xi, amax);
        if (second && xi > 0.0f) { /* "a non-zero sqrt(v) is never rounded to zero" */
          const uint32_t code = dtype == PRECIS_DTYPE_FP16 ? ((const uint16_t*)dst.p)[i]
                                                           : ((const uint8_t*)dst.p)[i];
          FZ_CHECK(code != 0, "positive v [%lld] %a stored as 0", (long long)i, (double)xi);
        }
      }
    }
    free(back.block);
  }

  /* decode's own checks, on the stored bytes as they are (any bits). */
  if (n >= 0) {
    back = fz_buf((size_t)nn * 4, (mode & 0x0C) == 0x0C ? 2 : 0, mode == 0xF3);
    valid = (second == 0 || second == 1) && valid_dtype &&
            (n == 0 || (dst.p != NULL && back.p != NULL && (uintptr_t)back.p % 4 == 0 &&
                        (uintptr_t)dst.p % width == 0 &&
                        (!fz_scaled(dtype) || (scales.p != NULL && (uintptr_t)scales.p % 4 == 0))));
    st = precis_moment_decode(dst.p, (const float*)scales.p, n, second, (precis_dtype_t)dtype,
                              (float*)back.p);
    fz_check_status(st, "precis_moment_decode", "precis_moment_decode");
    FZ_CHECK((st == PRECIS_OK) == valid, "decode: status %d", (int)st);
    if (st != PRECIS_OK || n == 0) FZ_CHECK(fz_untouched(&back), "failed decode wrote");
    free(back.block);
  }
  fz_check_remainders(&r, x, nn);
  free(src.block);
  free(dst.block);
  free(scales.block);
  free(x);
  return 0;
}
