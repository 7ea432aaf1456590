/* fingerprint.h - precis_fingerprint's arithmetic (fingerprint.c), shared with its
 * CUDA twin (cuda/bucket_ops.cu) so that both give the same value for the same bytes.
 *
 * Each 8-byte word times an odd weight (2 * its index + 1), summed mod 2^64: a changed
 * word always changes the sum (an odd weight is invertible mod 2^64), several changed
 * words leave it as it was only with probability 2^-64 unless crafted, and the sum is
 * the same for any split among threads or blocks (so a GPU adds its blocks' parts with
 * atomics). Two adds per 8 bytes (pr_fp_words) keep a pass at the memory's speed (a
 * mixing hash per word ran at 1.6x a plain read on a Zen 3). The last 0-7 bytes are one more word,
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
 * (the adam step's, a tile at a time). The sum of word_i * (2i + 1) is 2 (begin S + J)
 * + S, S the words' sum and J the sum of (i - begin) word_i, and J needs no multiply
 * per word: word k * PR_FP_LANES + l goes to lane l, whose running sum a[l] and sum of
 * running sums b[l] give the sum over its words of k word = rounds a[l] - b[l]. Two adds
 * a word, which vectorize (a 64-bit multiply is three on AVX2, and cost a step's
 * in-kernel record 0.6 ms per 8M bf16 params on a Zen 3); the same value mod 2^64. */
#define PR_FP_LANES 8
static inline uint64_t pr_fp_words(const unsigned char* buf, int64_t begin, int64_t end) {
  uint64_t a[PR_FP_LANES] = {0}, b[PR_FP_LANES] = {0}, s = 0, j = 0;
  const int64_t n = end - begin, rounds = n / PR_FP_LANES;
  const unsigned char* p = buf + 8 * begin;
  int64_t k;
  int l;
  for (k = 0; k < rounds; ++k) {
    for (l = 0; l < PR_FP_LANES; ++l) {
      uint64_t word;
      memcpy(&word, p + 8 * (k * PR_FP_LANES + l), 8);
      a[l] += word;
      b[l] += a[l];
    }
  }
  for (l = 0; l < PR_FP_LANES; ++l) {
    s += a[l];
    j += PR_FP_LANES * ((uint64_t)rounds * a[l] - b[l]) + (uint64_t)l * a[l];
  }
  for (k = rounds * PR_FP_LANES; k < n; ++k) {
    uint64_t word;
    memcpy(&word, p + 8 * k, 8);
    s += word;
    j += (uint64_t)k * word;
  }
  return 2 * ((uint64_t)begin * s + j) + s;
}

/* Word i of buf, as the GPU's kernels load it: one load where buf is 8-byte aligned, else
 * bytewise (a bf16 tensor, a view's shard). */
static inline PRECIS_HD uint64_t pr_fp_word(const unsigned char* buf, int64_t i, int aligned) {
  uint64_t word = 0;
  int b;
  if (aligned) return ((const uint64_t*)buf)[i];
  for (b = 0; b < 8; ++b) word |= (uint64_t)buf[8 * i + b] << (8 * b);
  return word;
}

/* The length's term. */
static inline PRECIS_HD uint64_t pr_fp_length(int64_t nbytes) {
  return (uint64_t)nbytes * 0x9E3779B97F4A7C15ull;
}

/* The term of bits, the bytes of a range from byte offset `at` on, within one word
 * (at % 8 + their size <= 8): their word's term is the sum of its bytes' (a word is
 * the sum of its bytes shifted, its term linear in it), the zero-padded last word's
 * too. So the terms of every element of a range, summed, give its fingerprint less
 * pr_fp_length: the CUDA step's record, summed from the elements it stores. */
static inline PRECIS_HD uint64_t pr_fp_bytes(uint64_t bits, int64_t at) {
  return (bits << (8 * (at & 7))) * pr_fp_weight(at >> 3);
}

/* The terms besides the whole words': bytes [8 * (nbytes / 8), nbytes) of buf as one
 * zero-padded word, and the length. */
static inline PRECIS_HD uint64_t pr_fp_tail(const unsigned char* buf, int64_t nbytes) {
  const int64_t words = nbytes / 8;
  uint64_t tail = 0;
  int64_t b;
  for (b = 8 * words; b < nbytes; ++b) tail |= (uint64_t)buf[b] << (8 * (b - 8 * words));
  return tail * pr_fp_weight(words) + pr_fp_length(nbytes);
}

/* The arguments of precis_fingerprint and its CUDA twin, every range checked before
 * anything is read or launched. A range is at most 2^45 bytes (32 TiB): under 2^30 of the
 * CUDA kernel's 32 KiB blocks, so one launch stays within a grid. */
/* The tail's term alone (pr_fp_tail less the length's): a range's last block's share of
 * it in precis_fingerprint_blocks, whose values carry no length term. */
static inline PRECIS_HD uint64_t pr_fp_tail_word(const unsigned char* buf, int64_t nbytes) {
  return pr_fp_tail(buf, nbytes) - pr_fp_length(nbytes);
}

/* A range's block count in precis_fingerprint_blocks (one, of nothing, for an empty one). */
static inline PRECIS_HD int64_t pr_fp_block_count(int64_t nbytes, int64_t block) {
  return nbytes > 0 ? (nbytes - 1) / block + 1 : 1;
}

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

/* pr_fp_check_args, and block > 0 a multiple of 8 (precis_fingerprint_blocks). */
static inline precis_status_t pr_fp_check_blocks(const char* fn, const void* const* bufs,
                                                 const int64_t* nbytes, int64_t count,
                                                 int64_t block, const uint64_t* out) {
  const precis_status_t st = pr_fp_check_args(fn, bufs, nbytes, count, out);
  if (st != PRECIS_OK) return st;
  if (block <= 0 || block % 8 != 0) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: block is %lld bytes, must be > 0 and a multiple of 8", fn,
                   (long long)block);
  }
  return PRECIS_OK;
}

#endif /* PRECIS_FINGERPRINT_H_ */
