/* resync.h - the rule by which a step of precis.optim resyncs the master of a param
 * written behind its back (a load, a clamp, a mask: docs/design.md section 6), for
 * csrc/resync.c and its CUDA twin (cuda/resync.cu): static inline, so both compile
 * the same comparisons. Nothing here rounds: the result is a choice between two stored
 * values, so the CPU and the GPU give the same bits. */
#ifndef PRECIS_RESYNC_H_
#define PRECIS_RESYNC_H_

#include "internal.h"        /* pr_fail */
#include "precis_convert.h" /* PRECIS_HD, the conversions */

/* A write that leaves at most max(1, numel / PR_WHOLE_LOAD) elements (and not all)
 * still rounding from their master is a whole load: the whole master is reread.
 * precis/optim_state.py words the warning with the same number (WHOLE_LOAD). */
#define PR_WHOLE_LOAD 64

/* Whether element bits `param` (fp16 or bf16, param_dtype) is what master rounds to,
 * to nearest even, as a step writes it: the master still stands for the param. */
static inline PRECIS_HD int pr_rounds_to(float master, uint16_t param, int param_dtype) {
  return (param_dtype == PRECIS_DTYPE_BF16 ? precis_f32_to_bf16_rn(master)
                                           : precis_f32_to_f16_rn(master)) == param;
}

/* Whether a stale tensor of numel elements, kept of which still round to the param,
 * is reread whole (a whole load) rather than where it was written. */
static inline PRECIS_HD int pr_resync_whole(int64_t kept, int64_t numel) {
  const int64_t few = numel / PR_WHOLE_LOAD > 1 ? numel / PR_WHOLE_LOAD : 1;
  return kept != numel && kept <= few;
}

/* The param's value as an fp32 master (exact: fp16 and bf16 are subsets of fp32). */
static inline PRECIS_HD float pr_param_value(uint16_t param, int param_dtype) {
  return param_dtype == PRECIS_DTYPE_BF16 ? precis_bf16_to_f32(param) : precis_f16_to_f32(param);
}

/* Element j of an fp32 or fp16 master, as fp32 (exact). */
static inline PRECIS_HD float pr_master_value(const void* master, int64_t j, int master_dtype) {
  return master_dtype == PRECIS_DTYPE_FP32 ? ((const float*)master)[j]
                                           : precis_f16_to_f32(((const uint16_t*)master)[j]);
}

/* Element j of an fp32 or fp16 master set to value (rounded to nearest even into fp16,
 * as torch's param.to(master.dtype)). */
static inline PRECIS_HD void pr_master_set(void* master, int64_t j, int master_dtype,
                                           float value) {
  if (master_dtype == PRECIS_DTYPE_FP32) {
    ((float*)master)[j] = value;
  } else {
    ((uint16_t*)master)[j] = precis_f32_to_f16_rn(value);
  }
}

/* Whether master_dtype is a master's (fp32 or fp16) rather than remainders' bytes. */
static inline PRECIS_HD int pr_is_master(int master_dtype) {
  return master_dtype == PRECIS_DTYPE_FP32 || master_dtype == PRECIS_DTYPE_FP16;
}

/* Element j of a flagged param's master resynced by the rule: a master set to the param
 * where it no longer rounds to it (everywhere for a whole load), a remainder zeroed (the
 * master is then the param). The CPU's loop, the GPU's resync kernel and the GPU's update
 * (which resyncs its own chunk of a flagged param) all write it so. */
static inline PRECIS_HD void pr_resync_element(void* master, int master_dtype,
                                               const uint16_t* param, int param_dtype,
                                               int64_t j, int whole) {
  if (master_dtype == PRECIS_DTYPE_INT16) {
    ((uint16_t*)master)[j] = 0;
  } else if (master_dtype == PRECIS_DTYPE_FP8_E4M3) {
    ((uint8_t*)master)[j] = 0;
  } else if (whole ||
             !pr_rounds_to(pr_master_value(master, j, master_dtype), param[j], param_dtype)) {
    pr_master_set(master, j, master_dtype, pr_param_value(param[j], param_dtype));
  }
}

/* The arguments' checks, shared by both (the pointers are not dereferenced: on the
 * GPU they are device pointers). */
static inline precis_status_t pr_resync_check_args(const char* fn, void* const* masters,
                                                   precis_dtype_t master_dtype,
                                                   const void* const* params,
                                                   precis_dtype_t param_dtype,
                                                   const int64_t* numels, const uint8_t* stale,
                                                   const int64_t* kept, int64_t count) {
  int64_t i;
  if (count < 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: count is %lld, must be >= 0", fn,
                   (long long)count);
  }
  if (!pr_is_master(master_dtype) && master_dtype != PRECIS_DTYPE_INT16 &&
      master_dtype != PRECIS_DTYPE_FP8_E4M3) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE,
                   "%s: master_dtype is %d; must be fp32 or fp16 (a master), int16 or fp8 "
                   "(the bytes of 16- or 8-bit remainders)", fn, (int)master_dtype);
  }
  if (param_dtype != PRECIS_DTYPE_BF16 && param_dtype != PRECIS_DTYPE_FP16) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE, "%s: param_dtype is %d; must be bf16 or fp16",
                   fn, (int)param_dtype);
  }
  if (master_dtype == PRECIS_DTYPE_FP8_E4M3 && param_dtype != PRECIS_DTYPE_BF16) {
    return pr_fail(PRECIS_ERR_INVALID_DTYPE, "%s: 8-bit remainders are of bf16 params, "
                   "not fp16", fn);
  }
  if (count == 0) return PRECIS_OK;
  if (masters == NULL || params == NULL || numels == NULL || stale == NULL || kept == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s is NULL", fn,
                   masters == NULL  ? "masters"
                   : params == NULL ? "params"
                   : numels == NULL ? "numels"
                   : stale == NULL  ? "stale"
                                    : "kept");
  }
  for (i = 0; i < count; ++i) {
    if (numels[i] < 0 || numels[i] > ((int64_t)1 << 42)) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: numels[%lld] is %lld, must be in "
                     "[0, 2^42]", fn, (long long)i, (long long)numels[i]);
    }
    if (numels[i] > 0 && (masters[i] == NULL || params[i] == NULL)) {
      return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s[%lld] is NULL with numel %lld", fn,
                     masters[i] == NULL ? "masters" : "params", (long long)i,
                     (long long)numels[i]);
    }
  }
  return PRECIS_OK;
}

/* precis_resync_changed's records (and its CUDA twin's), beside pr_resync_check_args. */
static inline precis_status_t pr_resync_check_records(const char* fn, const int64_t* records,
                                                      int64_t count) {
  if (count > 0 && records == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: records is NULL", fn);
  }
  return PRECIS_OK;
}

/* precis_cuda_resync_compared's buffers beside pr_resync_check_args' and the records':
 * sums given, records, kept, sums and zeroed 8-byte aligned (their 64-bit atomics and
 * stores), and no two of the five (stale too) sharing memory (zeroed is the update's
 * record, a buffer of its own: set to 0 while records are read, it would flag every
 * param). */
static inline precis_status_t pr_resync_check_compared(const char* fn, const int64_t* records,
                                                       const uint8_t* stale, const int64_t* kept,
                                                       const uint64_t* sums,
                                                       const uint64_t* zeroed, int64_t count) {
  static const char* const names[] = {"records", "stale", "kept", "sums", "zeroed"};
  const void* const bufs[] = {records, stale, kept, sums, zeroed};
  const size_t bytes[] = {8, 1, 8, 16, 8}; /* an entry's, count entries each */
  int a, b;
  if (count == 0) return PRECIS_OK;
  if (sums == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: sums is NULL", fn);
  for (a = 0; a < 5; ++a) {
    if (bytes[a] > 1 && (uintptr_t)bufs[a] % 8 != 0) { /* (all but the flags) */
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: %s (%p) is not 8-byte aligned", fn,
                     names[a], bufs[a]);
    }
    for (b = 0; b < a; ++b) {
      if (pr_overlap(bufs[b], bytes[b] * (size_t)count, bufs[a], bytes[a] * (size_t)count)) {
        return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: %s and %s share memory", fn, names[b],
                       names[a]);
      }
    }
  }
  return PRECIS_OK;
}

#endif /* PRECIS_RESYNC_H_ */
