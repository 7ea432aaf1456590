/* fingerprint_speed.c - is a fingerprint pass (csrc/fingerprint.c's arithmetic: each
 * 8-byte word times an odd weight, summed mod 2^64) slower than a plain read of the
 * same bytes? Times, on one thread, the pass as csrc/fingerprint.c writes it, the same
 * sum with four accumulators, and a loop that only reads the words (xor), over 120 MB
 * (a 60M-param bf16 tensor); best of 7. Asserts nothing.
 *
 *   gcc -O3 -march=native -o /tmp/fingerprint_speed bench/fingerprint_speed.c && \
 *       /tmp/fingerprint_speed
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BYTES 120000000LL

static uint64_t weight_of(int64_t word) { return 2 * (uint64_t)word + 1; }

__attribute__((noinline)) static uint64_t as_precis(const unsigned char* buf, int64_t words) {
  uint64_t sum = 0, weight = weight_of(0);
  int64_t i;
  for (i = 0; i < words; ++i, weight += 2) {
    uint64_t word;
    memcpy(&word, buf + 8 * i, 8);
    sum += word * weight;
  }
  return sum;
}

__attribute__((noinline)) static uint64_t four_sums(const unsigned char* buf, int64_t words) {
  uint64_t s[4] = {0, 0, 0, 0}, weight = weight_of(0);
  int64_t i = 0;
  int k;
  for (; i + 4 <= words; i += 4, weight += 8) {
    for (k = 0; k < 4; ++k) {
      uint64_t word;
      memcpy(&word, buf + 8 * (i + k), 8);
      s[k] += word * (weight + 2 * (uint64_t)k);
    }
  }
  for (; i < words; ++i, weight += 2) {
    uint64_t word;
    memcpy(&word, buf + 8 * i, 8);
    s[0] += word * weight;
  }
  return s[0] + s[1] + s[2] + s[3];
}

__attribute__((noinline)) static uint64_t read_only(const unsigned char* buf, int64_t words) {
  uint64_t x = 0;
  int64_t i;
  for (i = 0; i < words; ++i) {
    uint64_t word;
    memcpy(&word, buf + 8 * i, 8);
    x ^= word;
  }
  return x;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(void) {
  typedef uint64_t (*pass_fn)(const unsigned char*, int64_t);
  static const char* names[3] = {"fingerprint (as csrc/fingerprint.c)", "fingerprint, 4 sums",
                                 "read only (xor)"};
  pass_fn passes[3] = {as_precis, four_sums, read_only};
  unsigned char* buf = malloc(BYTES);
  double best[3] = {1e9, 1e9, 1e9};
  uint64_t out[3] = {0, 0, 0};
  int64_t i;
  int rep, p;
  if (buf == NULL) return 1;
  for (i = 0; i < BYTES; ++i) buf[i] = (unsigned char)(i * 7 + 3);
  for (rep = 0; rep < 7; ++rep) {
    for (p = 0; p < 3; ++p) {
      double t = seconds();
      out[p] = passes[p](buf, BYTES / 8);
      t = seconds() - t;
      if (t < best[p]) best[p] = t;
    }
  }
  for (p = 0; p < 3; ++p) {
    printf("%-36s %7.2f ms  %5.1f GB/s\n", names[p], best[p] * 1e3, BYTES / best[p] / 1e9);
  }
  printf("the two fingerprints agree: %s (checksum %llu)\n", out[0] == out[1] ? "yes" : "NO",
         (unsigned long long)out[2]);
  free(buf);
  return out[0] == out[1] ? 0 : 1;
}
