/* flat_table.h - the table of precis::adam_step_flat_ (adam_flat.c): one row per
 * param of where its state lies in the flat buffers, its stream, step and element
 * offset. Torch-free and header-only, so that adam_flat.c reads tables with it and
 * fuzz/flat_table.c drives it on its own. */
#ifndef PRECIS_TORCH_FLAT_TABLE_H_
#define PRECIS_TORCH_FLAT_TABLE_H_

#include <stdint.h>

#include "precis/precis.h"

/* The table's columns. The stream and the element offset (of the tensor's first
 * element in its whole param) key its stochastic rounding; the shape key
 * (pr_shape_key) is that of the param the row was made for. */
enum {
  PR_ROW_OFFSET,
  PR_ROW_SCALE_OFFSET,
  PR_ROW_NUMEL,
  PR_ROW_STREAM,
  PR_ROW_STEP,
  PR_ROW_ELEMENT_OFFSET,
  PR_ROW_SHAPE_KEY,
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
  if (scales && precis_scale_count(numel, count) != PRECIS_OK) return PR_ROW_BAD_NUMEL;
  if (*first < 0 || *count > buffer_numel || *first > buffer_numel - *count) return PR_ROW_OUTSIDE;
  return PR_ROW_OK;
}

#endif /* PRECIS_TORCH_FLAT_TABLE_H_ */
