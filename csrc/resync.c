/* resync.c - precis_resync_masters: the masters or remainders of params written behind
 * the optimizer's back, resynced by resync.h's rule. Off the step's hot path: a step
 * calls it with its compare's verdicts (on a GPU as device flags, read by the kernels
 * there), and a tensor not flagged is not read. precis_resync_changed makes the
 * compare itself (the params' fingerprints now against their records). */
#include "resync.h"

/* The elements of a master that still round to their param. */
static int64_t pr_count_kept(const void* master, int master_dtype, const uint16_t* param,
                             int param_dtype, int64_t numel) {
  int64_t kept = 0, j;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) reduction(+ : kept) if (numel > (1 << 18))
#endif
  for (j = 0; j < numel; ++j) {
    kept += pr_rounds_to(pr_master_value(master, j, master_dtype), param[j], param_dtype);
  }
  return kept;
}

PRECIS_API precis_status_t precis_resync_masters(void* const* masters,
                                                 precis_dtype_t master_dtype,
                                                 const void* const* params,
                                                 precis_dtype_t param_dtype,
                                                 const int64_t* numels, const uint8_t* stale,
                                                 int64_t* kept, int64_t count) {
  static const char fn[] = "precis_resync_masters";
  int64_t i, j;
  precis_status_t st;
  pr_clear_error();
  st = pr_resync_check_args(fn, masters, master_dtype, params, param_dtype, numels, stale, kept,
                            count);
  if (st != PRECIS_OK) return st;
  for (i = 0; i < count; ++i) {
    const int64_t n = numels[i];
    if (!stale[i]) {
      kept[i] = n;
      continue;
    }
    if (!pr_is_master(master_dtype)) { /* remainders: the master is the param */
      kept[i] = 0;
      if (n > 0) memset(masters[i], 0, (size_t)n * (master_dtype == PRECIS_DTYPE_INT16 ? 2 : 1));
      continue;
    }
    {
      void* master = masters[i];
      const uint16_t* param = (const uint16_t*)params[i];
      const int whole =
          pr_resync_whole(kept[i] = pr_count_kept(master, master_dtype, param, param_dtype, n), n);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n > (1 << 18))
#endif
      for (j = 0; j < n; ++j) {
        pr_resync_element(master, master_dtype, param, param_dtype, j, whole);
      }
    }
  }
  return PRECIS_OK;
}

PRECIS_API precis_status_t precis_resync_changed(void* const* masters,
                                                 precis_dtype_t master_dtype,
                                                 const void* const* params,
                                                 precis_dtype_t param_dtype,
                                                 const int64_t* numels, const int64_t* records,
                                                 uint8_t* stale, int64_t* kept, int64_t count) {
  static const char fn[] = "precis_resync_changed";
  int64_t i;
  precis_status_t st;
  pr_clear_error();
  st = pr_resync_check_args(fn, masters, master_dtype, params, param_dtype, numels, stale, kept,
                            count);
  if (st == PRECIS_OK) st = pr_resync_check_records(fn, records, count);
  if (st != PRECIS_OK) return st;
  for (i = 0; i < count; ++i) stale[i] = kept[i] != records[i];
  return precis_resync_masters(masters, master_dtype, params, param_dtype, numels, stale, kept,
                               count);
}
