/*
 * bucket_ops.c - libFuzzer harness of precis_accumulate, precis_cast,
 * precis_scale and precis_count_nonfinite: their argument checks
 * (csrc/bucket_args.h) and their results.
 *
 * The input picks the op, dtype codes, numel (including negative and huge
 * counts), a factor (NaN, Inf, ...), and dst/src pointers into two arena
 * regions: NULL, either region at a 0-3 byte offset (misaligned for 2- and
 * 4-byte dtypes), overlapping the other pointer, or the same pointer. The
 * regions are exact-size heap blocks, so AddressSanitizer reports any access
 * past them. Invariants:
 *  - the status is OK exactly when a reference written here from precis.h's
 *    contract says the call is valid (a huge numel only where the call must
 *    fail, or the kernel would rightly run off the regions);
 *  - a failing call changes no byte and not *out_count;
 *  - a successful one writes dst (buf) only, and each element is what the
 *    scalar conversions of precis_convert.h give (NaN for NaN: payloads may
 *    differ); a same-dtype cast copies bits; count_nonfinite counts exactly.
 */
#include "fuzz.h"
#include "precis_convert.h"

enum { FZ_ACCUMULATE, FZ_CAST, FZ_SCALE, FZ_COUNT, FZ_OPS };
static const char* const fz_ops[FZ_OPS] = {"precis_accumulate", "precis_cast", "precis_scale",
                                           "precis_count_nonfinite"};
enum { FZ_REGION = 4 * 1100 + 3 };

static int fz_ok_dtype(int d) { return d >= 0 && d <= 2; }
static size_t fz_size(int d) { return d == PRECIS_DTYPE_FP32 ? 4 : 2; }

static float fz_load(const uint8_t* p, int d, int64_t i) {
  uint32_t u32;
  uint16_t u16;
  if (d == PRECIS_DTYPE_FP32) {
    memcpy(&u32, p + 4 * i, 4);
    return precis_bits_f32(u32);
  }
  memcpy(&u16, p + 2 * i, 2);
  return d == PRECIS_DTYPE_FP16 ? precis_f16_to_f32(u16) : precis_bf16_to_f32(u16);
}

static uint32_t fz_bits(const uint8_t* p, int d, int64_t i) {
  uint32_t u32;
  uint16_t u16;
  if (d == PRECIS_DTYPE_FP32) return memcpy(&u32, p + 4 * i, 4), u32;
  return memcpy(&u16, p + 2 * i, 2), u16;
}

static uint32_t fz_round(float x, int d) {
  return d == PRECIS_DTYPE_FP32   ? precis_f32_bits(x)
         : d == PRECIS_DTYPE_FP16 ? precis_f32_to_f16_rn(x)
                                  : precis_f32_to_bf16_rn(x);
}

static int fz_is_nan(uint32_t bits, int d) {
  return d == PRECIS_DTYPE_FP32   ? (bits & 0x7FFFFFFFu) > 0x7F800000u
         : d == PRECIS_DTYPE_FP16 ? (bits & 0x7FFFu) > 0x7C00u
                                  : (bits & 0x7FFFu) > 0x7F80u;
}

static int fz_nonfinite(uint32_t bits, int d) {
  const uint32_t e = d == PRECIS_DTYPE_FP32 ? 0x7F800000u : d == PRECIS_DTYPE_FP16 ? 0x7C00u : 0x7F80u;
  return (bits & e) == e;
}

/* numel elements of dtype d at p would run past the end of memory. */
static int fz_wraps(const void* p, int d, int64_t numel) {
  return (uintptr_t)numel > (UINTPTR_MAX - (uintptr_t)p) / fz_size(d);
}

/* The op's contract on these arguments. */
static int fz_valid(int op, const void* dst, int dd, const void* src, int sd, int64_t numel,
                    float factor, int count_null) {
  if (op == FZ_COUNT && count_null) return 0;
  if (numel < 0 || !fz_ok_dtype(dd)) return 0;
  if (op <= FZ_CAST && !fz_ok_dtype(sd)) return 0;
  if (op == FZ_SCALE && !isfinite(factor)) return 0;
  if (numel == 0) return 1;
  if (dst == NULL || (uintptr_t)dst % fz_size(dd) != 0) return 0;
  if (op >= FZ_SCALE) return 1;
  if (src == NULL || (uintptr_t)src % fz_size(sd) != 0) return 0;
  if (dst == src && dd == sd) return 1;
  if (fz_wraps(dst, dd, numel) || fz_wraps(src, sd, numel)) return 0;
  return !((uintptr_t)dst < (uintptr_t)src + (uintptr_t)numel * fz_size(sd) &&
           (uintptr_t)src < (uintptr_t)dst + (uintptr_t)numel * fz_size(dd));
}

static int64_t fz_numel(fz_reader_t* r) {
  static const int64_t special[] = {0,  1,         255,       256,           257,
                                    1000, 1100,    -1,        INT64_MIN,     INT64_MAX,
                                    (int64_t)1 << 62, (int64_t)1 << 61, INT64_MAX / 2 + 2};
  uint8_t b = fz_u8(r);
  return b < 0xC0 ? b % 70 : special[b % (sizeof special / sizeof special[0])];
}

/* A pointer into region a or b, NULL, or at/near the other pointer. */
static uint8_t* fz_pointer(fz_reader_t* r, uint8_t* a, uint8_t* b, uint8_t* other) {
  uint8_t x = fz_u8(r);
  size_t off = (x & 0x30) == 0x30 ? 1 + x % 3 : 0;
  if (x >= 0xF0) return NULL;
  if (x >= 0xE0 && other != NULL) return other;
  if (x >= 0xC0 && other != NULL) return other + (x & 0xF) * 2 + off; /* overlaps other */
  return ((x & 1) ? b : a) + off;
}

/* The region (a or b) p points into. */
static uint8_t* fz_base(const uint8_t* p, uint8_t* a, uint8_t* b) {
  return (uintptr_t)p >= (uintptr_t)b && (uintptr_t)p < (uintptr_t)b + FZ_REGION ? b : a;
}

/* Elements of dtype d that fit from p to the end of its region. */
static int64_t fz_room(const uint8_t* p, int d, uint8_t* a, uint8_t* b) {
  return (int64_t)((size_t)(fz_base(p, a, b) + FZ_REGION - p) / fz_size(d));
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fz_reader_t r = {data, size};
  uint8_t* a = fz_alloc(FZ_REGION);
  uint8_t* b = fz_alloc(FZ_REGION);
  static uint8_t before_a[FZ_REGION], before_b[FZ_REGION];
  const int op = fz_u8(&r) % FZ_OPS;
  const int dd = fz_dtype(&r), sd = fz_dtype(&r);
  int64_t numel = fz_numel(&r), count = -77, want_count = 0, i;
  const float factor = (float)fz_double(&r, 0.75);
  const int count_null = fz_u8(&r) == 0xFF;
  uint8_t* const dst = fz_pointer(&r, a, b, NULL);
  uint8_t* const src = fz_pointer(&r, a, b, dst);
  uint64_t seed = fz_u64(&r);
  const uint8_t *dst_before, *src_before;
  precis_status_t st;
  int valid;
  size_t j;

  for (j = 0; j < FZ_REGION; ++j) { /* raw bits: NaN and Inf included */
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    a[j] = (uint8_t)(seed >> 56);
    b[j] = (uint8_t)(seed >> 48);
  }
  valid = fz_valid(op, dst, dd, src, sd, numel, factor, count_null);
  if (valid && numel > 0) { /* a valid call must stay inside the regions */
    int64_t fit = fz_room(dst, dd, a, b);
    if (op <= FZ_CAST && fz_room(src, sd, a, b) < fit) fit = fz_room(src, sd, a, b);
    if (numel > fit) numel = fit;
    valid = fz_valid(op, dst, dd, src, sd, numel, factor, count_null);
  }
  memcpy(before_a, a, FZ_REGION);
  memcpy(before_b, b, FZ_REGION);
  /* The inputs as they were, for the reference results. */
  dst_before = dst == NULL ? NULL : (fz_base(dst, a, b) == b ? before_b : before_a) + (dst - fz_base(dst, a, b));
  src_before = src == NULL ? NULL : (fz_base(src, a, b) == b ? before_b : before_a) + (src - fz_base(src, a, b));

  switch (op) {
    case FZ_ACCUMULATE:
      st = precis_accumulate(dst, (precis_dtype_t)dd, src, (precis_dtype_t)sd, numel);
      break;
    case FZ_CAST:
      st = precis_cast(dst, (precis_dtype_t)dd, src, (precis_dtype_t)sd, numel);
      break;
    case FZ_SCALE:
      st = precis_scale(dst, (precis_dtype_t)dd, factor, numel);
      break;
    default:
      st = precis_count_nonfinite(dst, (precis_dtype_t)dd, numel, count_null ? NULL : &count);
      break;
  }
  fz_check_status(st, fz_ops[op], fz_ops[op]);
  FZ_CHECK((st == PRECIS_OK) == valid, "%s(dst %p %d, src %p %d, numel %lld): status %d, want %s",
           fz_ops[op], (void*)dst, dd, (void*)src, sd, (long long)numel, (int)st,
           valid ? "OK" : "a failure");
  if (st != PRECIS_OK || op == FZ_COUNT || numel == 0) {
    FZ_CHECK(memcmp(a, before_a, FZ_REGION) == 0 && memcmp(b, before_b, FZ_REGION) == 0,
             "%s wrote memory (status %d)", fz_ops[op], (int)st);
  }
  if (op == FZ_COUNT) {
    if (st == PRECIS_OK) {
      for (i = 0; i < numel; ++i) want_count += fz_nonfinite(fz_bits(dst_before, dd, i), dd);
    }
    FZ_CHECK(count == (st == PRECIS_OK ? want_count : -77), "count %lld, want %lld",
             (long long)count, (long long)want_count);
  } else if (st == PRECIS_OK && numel > 0) {
    /* Every element, and nothing outside dst. */
    const size_t dst_bytes = (size_t)numel * fz_size(dd);
    for (i = 0; i < numel; ++i) {
      const uint32_t got = fz_bits(dst, dd, i);
      const float x = fz_load(dst_before, dd, i);
      uint32_t want;
      if (op == FZ_SCALE) {
        want = factor == 1.0f ? fz_bits(dst_before, dd, i) : fz_round(x * factor, dd);
      } else if (op == FZ_CAST) {
        want = dd == sd ? fz_bits(src_before, sd, i) : fz_round(fz_load(src_before, sd, i), dd);
      } else {
        want = fz_round(x + fz_load(src_before, sd, i), dd);
      }
      FZ_CHECK(got == want || (fz_is_nan(got, dd) && fz_is_nan(want, dd)),
               "%s element %lld: %#x, want %#x", fz_ops[op], (long long)i, got, want);
    }
    for (j = 0; j < FZ_REGION; ++j) {
      const uint8_t* dst_region = fz_base(dst, a, b);
      const size_t lo = (size_t)(dst - dst_region), hi = lo + dst_bytes;
      FZ_CHECK((dst_region == a && j >= lo && j < hi) || a[j] == before_a[j], "a[%zu] written", j);
      FZ_CHECK((dst_region == b && j >= lo && j < hi) || b[j] == before_b[j], "b[%zu] written", j);
    }
  }
  free(a);
  free(b);
  return 0;
}
