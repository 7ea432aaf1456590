/* fingerprint.c - precis_fingerprint: a 64-bit fingerprint of each of a list of byte
 * ranges, so that the optimizer can tell whether a param still holds what its last
 * step wrote (a load that moves no version counter: torch.distributed.checkpoint,
 * FSDP2's load_state_dict, writes through param.data). The arithmetic is
 * fingerprint.h's. Not cryptographic: it detects writes, it does not resist crafted ones. */
#include <stdlib.h>

#include "fingerprint.h"

#define PR_FP_CHUNK ((int64_t)1 << 15) /* words a thread takes at a time (256 KiB) */

/* A range of more than one chunk, its chunks split among the threads. */
static uint64_t pr_fp_range(const unsigned char* buf, int64_t nbytes) {
  const int64_t words = nbytes / 8, chunks = (words + PR_FP_CHUNK - 1) / PR_FP_CHUNK;
  uint64_t sum = 0;
  int64_t c;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) reduction(+ : sum)
#endif
  for (c = 0; c < chunks; ++c) {
    const int64_t begin = c * PR_FP_CHUNK;
    const int64_t end = begin + PR_FP_CHUNK < words ? begin + PR_FP_CHUNK : words;
    sum += pr_fp_words(buf, begin, end);
  }
  return sum + pr_fp_tail(buf, nbytes);
}

static int pr_fp_small(int64_t nbytes) { return nbytes / 8 <= PR_FP_CHUNK; }

PRECIS_API precis_status_t precis_fingerprint(const void* const* bufs, const int64_t* nbytes,
                                              int64_t count, uint64_t* out) {
  static const char fn[] = "precis_fingerprint";
  int64_t i;
  precis_status_t st;
  pr_clear_error();
  st = pr_fp_check_args(fn, bufs, nbytes, count, out);
  if (st != PRECIS_OK) return st;
  /* Ranges of one chunk or less split among the threads a range each (a parallel region
   * per range cost ~1 us each: 2,000 small params took 1.7 ms), larger ones a chunk each. */
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 64) if (count > 64)
#endif
  for (i = 0; i < count; ++i) {
    if (pr_fp_small(nbytes[i])) {
      const unsigned char* buf = (const unsigned char*)bufs[i];
      out[i] = nbytes[i] > 0 ? pr_fp_words(buf, 0, nbytes[i] / 8) + pr_fp_tail(buf, nbytes[i])
                             : 0;
    }
  }
  for (i = 0; i < count; ++i) {
    if (!pr_fp_small(nbytes[i])) out[i] = pr_fp_range((const unsigned char*)bufs[i], nbytes[i]);
  }
  return PRECIS_OK;
}

/* The blocks of one range into out (pr_fp_block_count(nbytes, block) entries), split
 * among the threads when `split` (a few large ranges), else one thread's. */
static void pr_fp_range_blocks(const unsigned char* buf, int64_t nbytes, int64_t block,
                               uint64_t* out, int split) {
  const int64_t blocks = pr_fp_block_count(nbytes, block), words = nbytes / 8;
  int64_t b;
  (void)split;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (split && blocks > 16)
#endif
  for (b = 0; b < blocks; ++b) {
    const int64_t begin = b * (block / 8);
    const int64_t end = begin + block / 8 < words ? begin + block / 8 : words;
    out[b] = begin < end ? pr_fp_words(buf, begin, end) : 0;
  }
  if (nbytes % 8 != 0) out[blocks - 1] += pr_fp_tail_word(buf, nbytes);
}

PRECIS_API precis_status_t precis_fingerprint_blocks(const void* const* bufs,
                                                     const int64_t* nbytes, int64_t count,
                                                     int64_t block, uint64_t* out) {
  static const char fn[] = "precis_fingerprint_blocks";
  int64_t i, at = 0;
  int64_t* first;
  precis_status_t st;
  pr_clear_error();
  st = pr_fp_check_blocks(fn, bufs, nbytes, count, block, out);
  if (st != PRECIS_OK) return st;
  if (count <= 64) { /* a range at a time, its blocks split among the threads */
    for (i = 0; i < count; ++i) {
      pr_fp_range_blocks((const unsigned char*)bufs[i], nbytes[i], block, out + at, 1);
      at += pr_fp_block_count(nbytes[i], block);
    }
    return PRECIS_OK;
  }
  /* Many ranges (a model's params): split among the threads a range each, as
   * precis_fingerprint splits them (a parallel region per range cost ~1 us each). */
  first = (int64_t*)malloc((size_t)count * sizeof *first);
  if (first == NULL) {
    return pr_fail(PRECIS_ERR_OUT_OF_MEMORY, "%s: out of memory for %lld ranges", fn,
                   (long long)count);
  }
  for (i = 0; i < count; ++i) {
    first[i] = at;
    at += pr_fp_block_count(nbytes[i], block);
  }
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 16)
#endif
  for (i = 0; i < count; ++i) {
    pr_fp_range_blocks((const unsigned char*)bufs[i], nbytes[i], block, out + first[i], 0);
  }
  free(first);
  return PRECIS_OK;
}
