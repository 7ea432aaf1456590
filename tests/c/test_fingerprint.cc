// precis_fingerprint: against a plain reference written from its definition
// (csrc/fingerprint.h: each 8-byte word times 2 * index + 1, summed mod 2^64, the
// zero-padded tail likewise, plus the length times 0x9E3779B97F4A7C15), at
// lengths across the tail (0-7 bytes) and the OpenMP chunks, at unaligned addresses,
// with any thread count; a change to any byte changes it; argument checks.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "precis/precis.h"

namespace {

uint64_t Reference(const unsigned char* buf, int64_t nbytes) {
  uint64_t sum = 0;
  for (int64_t w = 0; 8 * w < nbytes; ++w) {
    uint64_t word = 0;
    for (int64_t b = 0; b < 8 && 8 * w + b < nbytes; ++b) {
      word |= (uint64_t)buf[8 * w + b] << (8 * b);
    }
    sum += word * (2 * (uint64_t)w + 1);
  }
  return sum + (uint64_t)nbytes * 0x9E3779B97F4A7C15ull;
}

uint64_t One(const void* buf, int64_t nbytes) {
  uint64_t out = 0;
  EXPECT_EQ(precis_fingerprint(&buf, &nbytes, 1, &out), PRECIS_OK) << precis_last_error();
  return out;
}

std::vector<unsigned char> RandomBytes(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = (unsigned char)gen();
  return v;
}

// 0-15 bytes (every tail), a 2-byte element count, one 256 KiB chunk of words and
// several with a tail (the threads split there).
const int64_t kLengths[] = {0, 1, 2, 3, 7, 8, 9, 15, 254, 2 * 127, 8 * 4097,
                            (int64_t)8 * (1 << 15), (int64_t)8 * 3 * (1 << 15) + 13};

TEST(Fingerprint, MatchesTheReferenceAtEveryLengthAndAlignment) {
  for (int64_t n : kLengths) {
    for (int offset : {0, 1, 2, 6}) {  // a bf16 view's shard is 2-byte aligned at best
      auto bytes = RandomBytes((size_t)n + 8, (unsigned)n + offset);
      const unsigned char* p = bytes.data() + offset;
      EXPECT_EQ(One(p, n), Reference(p, n)) << "nbytes " << n << ", offset " << offset;
    }
  }
}

// A long range's 256 KiB chunks are split among the threads (csrc/fingerprint.c), a
// last part chunk and a tail at every thread count.
TEST(Fingerprint, TheSameAtEveryThreadCount) {
  const int saved = omp_get_max_threads();
  const int64_t lengths[] = {8 * (int64_t)100003 + 5, 8 * (int64_t)(3 * (1 << 15) + 17) + 7,
                             8 * (int64_t)(1 << 15) + 8};
  for (int64_t n : lengths) {
    auto bytes = RandomBytes((size_t)n, (unsigned)n);
    const uint64_t expected = Reference(bytes.data(), n);
    for (int threads : {1, 2, 3, 5}) {
      omp_set_num_threads(threads);
      EXPECT_EQ(One(bytes.data(), n), expected) << "nbytes " << n << ", threads " << threads;
    }
  }
  omp_set_num_threads(saved);
}

TEST(Fingerprint, ListGivesEachRangeItsOwn) {
  auto a = RandomBytes(1000, 1), b = RandomBytes(8 * 4097 + 3, 2);
  const void* bufs[] = {a.data(), nullptr, b.data()};
  const int64_t nbytes[] = {1000, 0, 8 * 4097 + 3};
  uint64_t out[3] = {0, 0, 0};
  ASSERT_EQ(precis_fingerprint(bufs, nbytes, 3, out), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(out[0], Reference(a.data(), 1000));
  EXPECT_EQ(out[1], Reference(nullptr, 0));
  EXPECT_EQ(out[2], Reference(b.data(), 8 * 4097 + 3));
}

TEST(Fingerprint, EveryChangedOrMovedByteChangesIt) {
  const int64_t n = 8 * 127 + 5;
  auto bytes = RandomBytes((size_t)n, 7);
  const uint64_t before = One(bytes.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    for (unsigned char flip : {(unsigned char)1, (unsigned char)0x80}) {
      bytes[(size_t)i] ^= flip;
      EXPECT_NE(One(bytes.data(), n), before) << "byte " << i << " ^ " << (int)flip;
      bytes[(size_t)i] ^= flip;
    }
  }
  // two 2-byte elements swapped (a permutation keeps a plain sum)
  std::swap(bytes[0], bytes[10]);
  std::swap(bytes[1], bytes[11]);
  EXPECT_NE(One(bytes.data(), n), before);
  std::swap(bytes[0], bytes[10]);
  std::swap(bytes[1], bytes[11]);
  EXPECT_EQ(One(bytes.data(), n), before);
  EXPECT_NE(One(bytes.data(), n - 1), before);  // another length, the same leading bytes
}

TEST(Fingerprint, BadArgumentsWriteNothing) {
  unsigned char byte = 1;
  const void* good[] = {&byte, nullptr};
  int64_t lengths[] = {1, 5};  // the second range has no memory
  uint64_t out[2] = {11, 22};
  EXPECT_EQ(precis_fingerprint(good, lengths, 2, out), PRECIS_ERR_NULL_POINTER);
  EXPECT_NE(std::string(precis_last_error()).find("bufs[1] is NULL"), std::string::npos)
      << precis_last_error();
  EXPECT_EQ(out[0], 11u);  // the first range was checked, not written
  lengths[1] = -1;
  good[1] = &byte;
  EXPECT_EQ(precis_fingerprint(good, lengths, 2, out), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out[0], 11u);
  EXPECT_EQ(precis_fingerprint(good, lengths, -1, out), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_fingerprint(nullptr, lengths, 1, out), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_fingerprint(good, nullptr, 1, out), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_fingerprint(good, lengths, 1, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_fingerprint(nullptr, nullptr, 0, nullptr), PRECIS_OK);  // nothing to do
}

}  // namespace
