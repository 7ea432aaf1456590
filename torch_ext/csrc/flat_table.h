/* flat_table.h - the table of precis::adam_step_flat_ (step_flat.c): one row per
 * param of where its state lies in the flat buffers, its stream, step and element
 * offset. Torch-free and header-only, so that step_flat.c reads tables with it and
 * fuzz/flat_table.c drives it on its own. */
#ifndef PRECIS_TORCH_FLAT_TABLE_H_
#define PRECIS_TORCH_FLAT_TABLE_H_

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "precis/precis.h"
#include "precis_convert.h" /* precis_scale_blocks */

/* The table's columns. The stream and the element offset (of the tensor's first
 * element in its whole param) key its stochastic rounding; the shape key
 * (pr_shape_key) and the data address are those of the param the row was made
 * for. */
enum {
  PR_ROW_OFFSET,
  PR_ROW_SCALE_OFFSET,
  PR_ROW_NUMEL,
  PR_ROW_STREAM,
  PR_ROW_STEP,
  PR_ROW_ELEMENT_OFFSET,
  PR_ROW_SHAPE_KEY,
  PR_ROW_DATA,
  PR_ROW_WIDTH
};

/* A shape as one int64: FNV-1a over 64-bit words, the dim then each size (Python's
 * precis.ops.shape_key computes the same), so that a param given another shape of
 * its size (p.data = p.data.reshape(...)) no longer matches its row. */
static inline int64_t pr_shape_key(int64_t dim, const int64_t* sizes) {
  uint64_t h = 14695981039346656037ull;
  h = (h ^ (uint64_t)dim) * 1099511628211ull;
  for (int64_t d = 0; d < dim; d++) h = (h ^ (uint64_t)sizes[d]) * 1099511628211ull;
  return (int64_t)h;
}

/* What pr_flat_row_range finds wrong with a row. */
enum { PR_ROW_OK, PR_ROW_BAD_NUMEL, PR_ROW_OUTSIDE };

/* The elements [*first, *first + *count) of a buffer of buffer_numel elements that
 * `row` names for a param of param_numel elements: the element columns, or for a
 * scale buffer (scales != 0) the scale column and the param's count of blocks
 * (precis_scale_count). PR_ROW_BAD_NUMEL when the row's numel is not the
 * param's; PR_ROW_OUTSIDE when the range does not lie inside the buffer. No int64
 * input overflows. */
static inline int pr_flat_row_range(const int64_t* row, int64_t param_numel, int scales,
                                    int64_t buffer_numel, int64_t* first, int64_t* count) {
  int64_t numel = row[PR_ROW_NUMEL];
  *first = *count = 0;
  if (numel < 0 || numel != param_numel) return PR_ROW_BAD_NUMEL;
  *first = row[scales ? PR_ROW_SCALE_OFFSET : PR_ROW_OFFSET];
  *count = numel;
  if (scales) *count = precis_scale_blocks(numel); /* (numel >= 0 here) */
  if (*first < 0 || *count > buffer_numel || *first > buffer_numel - *count) return PR_ROW_OUTSIDE;
  return PR_ROW_OK;
}

/* A row's range [lo, hi) in one column: the element buffers' (offset, numel) or
 * the scale buffers' (scale offset, blocks). */
typedef struct pr_span {
  int64_t lo, hi;
  size_t row;
} pr_span_t;

/* Row i's span; its range was accepted by pr_flat_row_range (an empty span
 * otherwise). */
static inline pr_span_t pr_row_span(const int64_t* rows, size_t i, int scales) {
  int64_t first, count;
  const int64_t* row = &rows[i * PR_ROW_WIDTH];
  if (pr_flat_row_range(row, row[PR_ROW_NUMEL], scales, INT64_MAX, &first, &count) != PR_ROW_OK) {
    first = count = 0;
  }
  return (pr_span_t){first, first + count, i};
}

static inline int pr_span_order(const void* x, const void* y) {
  const pr_span_t *a = (const pr_span_t*)x, *b = (const pr_span_t*)y;
  if (a->lo != b->lo) return a->lo < b->lo ? -1 : 1;
  return a->row < b->row ? -1 : a->row > b->row;
}

/* 1 when the n rows' spans in the column are in ascending order without overlap
 * (empty spans aside), as precis.optim makes tables: one pass, no memory. */
static inline int pr_flat_rows_ascending(const int64_t* rows, size_t n, int scales) {
  int64_t reach = INT64_MIN;
  for (size_t i = 0; i < n; i++) {
    pr_span_t s = pr_row_span(rows, i, scales);
    if (s.lo == s.hi) continue;
    if (s.lo < reach) return 0;
    reach = s.hi;
  }
  return 1;
}

/* 1 when two of the n rows' spans in the column overlap (two params would step the
 * same state), with *a and *b two such rows; 0 when none do. spans: room for n
 * (sorted by start: an overlap, if any, is then between neighbours). */
static inline int pr_flat_rows_overlap(const int64_t* rows, size_t n, int scales,
                                       pr_span_t* spans, size_t* a, size_t* b) {
  size_t count = 0;
  for (size_t i = 0; i < n; i++) {
    pr_span_t s = pr_row_span(rows, i, scales);
    if (s.lo != s.hi) spans[count++] = s;
  }
  qsort(spans, count, sizeof *spans, pr_span_order);
  for (size_t k = 1; k < count; k++) {
    if (spans[k].lo < spans[k - 1].hi) {
      *a = spans[k - 1].row;
      *b = spans[k].row;
      return 1;
    }
  }
  return 0;
}

#endif /* PRECIS_TORCH_FLAT_TABLE_H_ */
