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
  return 0;
}
