/*
 * flat_table.c - libFuzzer harness of the table precis::adam_step_flat_ reads
 * (torch_ext/csrc/flat_table.h's pr_flat_row_range: where a param's state lies in
 * a flat buffer), on any int64 values: the glue turns each accepted range into a
 * view of the buffer, so an accepted range outside it would be an out-of-bounds
 * write of the step.
 *
 * The input gives a row's columns and the param's and buffer's sizes, each an
 * edge value (0, 1, -1, the int64 ends, block edges) or raw bits. Invariants:
 *  - the row is accepted exactly when an independent check in 128-bit
 *    arithmetic says its range lies inside the buffer and its numel is the
 *    param's;
 *  - an accepted range is the element columns for an element buffer and the
 *    scale column with the param's count of 128-element blocks for a scale one.
 * Then a table of up to 8 rows whose ranges are accepted (offsets mostly at,
 * just before or past the previous row's end): pr_flat_rows_overlap finds two
 * overlapping rows exactly when a check of every pair does, and the two it names
 * overlap; pr_flat_rows_ascending says so only of tables without overlap.
 */
#include "fuzz.h"
#include "../torch_ext/csrc/flat_table.h"

/* An int64: mostly an edge value, sometimes raw bits. */
static int64_t fz_i64(fz_reader_t* r) {
  static const int64_t edges[] = {0, 1, -1, 127, 128, 129, 4097, INT64_MAX, INT64_MIN,
                                  INT64_MAX - 1, INT64_MAX / 128, ((int64_t)1 << 62),
                                  ((int64_t)1 << 32), -((int64_t)1 << 32)};
  uint8_t b = fz_u8(r);
  if (b < 0x80) return edges[b % (sizeof edges / sizeof edges[0])];
  return (int64_t)fz_u64(r);
}

/* The rows of fz_table: each range the op would accept (else the op refuses the
 * table before it looks for overlaps), mostly near the previous row's end. */
static size_t fz_rows(fz_reader_t* r, int64_t* rows, int scales) {
  size_t n = fz_u8(r) % 9;
  int64_t end = 0;
  for (size_t i = 0; i < n; i++) {
    int64_t* row = &rows[i * PR_ROW_WIDTH];
    uint8_t how = fz_u8(r);
    row[PR_ROW_NUMEL] = how & 1 ? fz_i64(r) : fz_u8(r);
    int64_t shift = (int64_t)(how >> 6) - (int64_t)(fz_u8(r) % 4); /* -3 .. 3 */
    int64_t at = how & 2 ? fz_i64(r) : shift > 0 && end > INT64_MAX - shift ? end : end + shift;
    row[scales ? PR_ROW_SCALE_OFFSET : PR_ROW_OFFSET] = at;
    int64_t first, count;
    if (pr_flat_row_range(row, row[PR_ROW_NUMEL], scales, INT64_MAX, &first, &count) != PR_ROW_OK) {
      return 0;
    }
    end = first + count;
  }
  return n;
}

static void fz_table(fz_reader_t* r) {
  int64_t rows[8 * PR_ROW_WIDTH] = {0};
  int scales = fz_u8(r) & 1;
  size_t n = fz_rows(r, rows, scales);
  /* Every pair, in 128-bit arithmetic of its own: [offset, + numel) or
   * [scale offset, + ceil(numel / 128)). */
  __int128 lo[8], hi[8];
  for (size_t i = 0; i < n; i++) {
    const int64_t* row = &rows[i * PR_ROW_WIDTH];
    __int128 numel = row[PR_ROW_NUMEL];
    lo[i] = scales ? row[PR_ROW_SCALE_OFFSET] : row[PR_ROW_OFFSET];
    hi[i] = lo[i] + (scales ? (numel + 127) / 128 : numel);
  }
  int want = 0;
  for (size_t i = 0; i < n; i++) {
    for (size_t j = i + 1; j < n; j++) {
      want |= lo[i] < hi[i] && lo[j] < hi[j] && lo[i] < hi[j] && lo[j] < hi[i];
    }
  }
  pr_span_t spans[8];
  size_t a = 0, b = 0;
  int got = pr_flat_rows_overlap(rows, n, scales, spans, &a, &b);
  FZ_CHECK(got == want, "%zu rows (scales %d): overlap %d, by every pair %d", n, scales, got,
           want);
  if (got) {
    FZ_CHECK(a != b && a < n && b < n && lo[a] < hi[b] && lo[b] < hi[a],
             "rows %zu and %zu named as overlapping", a, b);
  }
  FZ_CHECK(!(want && pr_flat_rows_ascending(rows, n, scales)),
           "%zu rows (scales %d) with an overlap called ascending", n, scales);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fz_reader_t r = {data, size};
  int64_t row[PR_ROW_WIDTH];
  int k;
  for (k = 0; k < PR_ROW_WIDTH; ++k) row[k] = fz_i64(&r);
  int64_t param_numel = fz_u8(&r) & 1 ? row[PR_ROW_NUMEL] : fz_i64(&r);
  int64_t buffer_numel = fz_i64(&r);
  int scales = fz_u8(&r) & 1;

  int64_t first, count;
  int status = pr_flat_row_range(row, param_numel, scales, buffer_numel, &first, &count);

  int64_t numel = row[PR_ROW_NUMEL];
  int numel_ok = numel >= 0 && numel == param_numel;
  __int128 want_first = scales ? row[PR_ROW_SCALE_OFFSET] : row[PR_ROW_OFFSET];
  __int128 want_count = scales ? ((__int128)numel + 127) / 128 : numel;
  int inside = want_first >= 0 && want_first + want_count <= (__int128)buffer_numel;
  FZ_CHECK(status == PR_ROW_OK || status == PR_ROW_BAD_NUMEL || status == PR_ROW_OUTSIDE,
           "status %d", status);
  FZ_CHECK((status == PR_ROW_BAD_NUMEL) == !numel_ok, "numel %lld, param %lld: status %d",
           (long long)numel, (long long)param_numel, status);
  if (numel_ok) {
    FZ_CHECK((status == PR_ROW_OK) == inside,
             "first %lld, count %lld, buffer %lld (scales %d): status %d", (long long)want_first,
             (long long)want_count, (long long)buffer_numel, scales, status);
  }
  if (status == PR_ROW_OK) {
    FZ_CHECK(first == want_first && count == want_count && first >= 0 && count >= 0 &&
                 first + count <= buffer_numel,
             "accepted [%lld, +%lld) of %lld", (long long)first, (long long)count,
             (long long)buffer_numel);
  }
  fz_table(&r);
  return 0;
}
