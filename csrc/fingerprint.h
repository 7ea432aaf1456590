/* fingerprint.h - precis_fingerprint's arithmetic (fingerprint.c), shared with its
 * CUDA twin (cuda/bucket_ops.cu) so that both give the same value for the same bytes.
 *
 * Each 8-byte word times an odd weight (2 * its index + 1), summed mod 2^64: a changed
 * word always changes the sum (an odd weight is invertible mod 2^64), several changed
 * words leave it as it was only with probability 2^-64 unless crafted, and the sum is
 * the same for any split among threads or blocks (so a GPU adds its blocks' parts with
 * atomics). One multiply per 8 bytes keeps a pass at the memory's speed (a mixing hash
 * per word ran at 1.6x a plain read on a Zen 3). The last 0-7 bytes are one more word,
 * zero-padded, and the length adds a term of its own (ranges of other lengths differ). */
#ifndef PRECIS_FINGERPRINT_H_
#define PRECIS_FINGERPRINT_H_

#include <string.h>

#include "internal.h"        /* pr_fail */
#include "precis_convert.h" /* PRECIS_HD, stdint */

static inline PRECIS_HD uint64_t pr_fp_weight(int64_t word_index) {
  return 2 * (uint64_t)word_index + 1;
}

/* The terms of words [begin, end) of buf (loaded with memcpy: a bf16 tensor is only
 * 2-byte aligned): the whole words' part of a range's fingerprint, or of a piece of it
 * (the adam step's, a tile at a time). */
static inline uint64_t pr_fp_words(const unsigned char* buf, int64_t begin, int64_t end) {
  uint64_t sum = 0, weight = pr_fp_weight(begin);
  int64_t i;
  for (i = begin; i < end; ++i, weight += 2) {
    uint64_t word;
    memcpy(&word, buf + 8 * i, 8);
    sum += word * weight;
  }
  return sum;
}

/* The terms besides the whole words': bytes [8 * (nbytes / 8), nbytes) of buf as one
 * zero-padded word, and the length. */
static inline PRECIS_HD uint64_t pr_fp_tail(const unsigned char* buf, int64_t nbytes) {
  const int64_t words = nbytes / 8;
  uint64_t tail = 0;
  int64_t b;
  for (b = 8 * words; b < nbytes; ++b) tail |= (uint64_t)buf[b] << (8 * (b - 8 * words));
  return tail * pr_fp_weight(words) + (uint64_t)nbytes * 0x9E3779B97F4A7C15ull;
}

/* The arguments of precis_fingerprint and its CUDA twin, every range checked before
 * anything is read or launched. A range is at most 2^45 bytes (32 TiB): under 2^30 of the
 * CUDA kernel's 32 KiB blocks, so one launch stays within a grid. */
static inline precis_status_t pr_fp_check_args(const char* fn, const void* const* bufs,
                                               const int64_t* nbytes, int64_t count,
                                               const uint64_t* out) {
  int64_t i;
  if (count < 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: count is %lld, must be >= 0", fn,
                   (long long)count);
  }
  if (count > 0 && (bufs == NULL || nbytes == NULL || out == NULL)) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: %s is NULL", fn,
                   bufs == NULL ? "bufs" : nbytes == NULL ? "nbytes" : "out");
  }
  for (i = 0; i < count; ++i) {
    if (nbytes[i] < 0 || nbytes[i] > ((int64_t)1 << 45)) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                     "%s: nbytes[%lld] is %lld, must be in [0, 2^45]", fn, (long long)i,
                     (long long)nbytes[i]);
    }
    if (nbytes[i] > 0 && bufs[i] == NULL) {
      return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: bufs[%lld] is NULL with nbytes %lld", fn,
                     (long long)i, (long long)nbytes[i]);
    }
  }
  return PRECIS_OK;
}

#endif /* PRECIS_FINGERPRINT_H_ */
