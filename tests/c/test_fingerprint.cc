// precis_fingerprint: against a plain reference written from its definition
// (csrc/fingerprint.h: each 8-byte word times 2 * index + 1, summed mod 2^64, the
// zero-padded tail likewise, plus the length times 0x9E3779B97F4A7C15), at
// lengths across the tail (0-7 bytes) and the OpenMP chunks, at unaligned addresses,
// with any thread count; a change to any byte changes it; argument checks.
// precis_fingerprint_blocks likewise: against its definition (the same terms, each in
// the block of its word, no length term), its blocks summed with the length term being
// precis_fingerprint, a changed byte changing its own block alone, lists, argument checks.
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

// ---- precis_fingerprint_blocks ------------------------------------------------------

constexpr uint64_t kLengthWeight = 0x9E3779B97F4A7C15ull;  // precis_fingerprint's length term
constexpr uint64_t kSentinel = 0x5E7715E7ull;               // an entry no call should write

// From the definition: max(1, ceil(nbytes / block)) blocks; word w (the zero-padded
// last 0-7 bytes one more word) adds word * (2w + 1), w its index in the whole range, to
// the block that holds it (block is a multiple of 8, so a word never spans two blocks and
// the padded tail word lies in the last block); no length term.
std::vector<uint64_t> BlocksReference(const unsigned char* buf, int64_t nbytes, int64_t block) {
  std::vector<uint64_t> out(nbytes == 0 ? 1 : (size_t)((nbytes + block - 1) / block), 0);
  for (int64_t w = 0; 8 * w < nbytes; ++w) {
    uint64_t word = 0;
    for (int64_t b = 0; b < 8 && 8 * w + b < nbytes; ++b) {
      word |= (uint64_t)buf[8 * w + b] << (8 * b);
    }
    out[(size_t)(8 * w / block)] += word * (2 * (uint64_t)w + 1);
  }
  return out;
}

// precis_fingerprint_blocks of one range, into `expected_count` entries of a table one
// entry longer (prefilled with kSentinel): the entry past them must stay kSentinel.
std::vector<uint64_t> Blocks(const void* buf, int64_t nbytes, int64_t block,
                             size_t expected_count) {
  std::vector<uint64_t> out(expected_count + 1, kSentinel);
  EXPECT_EQ(precis_fingerprint_blocks(&buf, &nbytes, 1, block, out.data()), PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(out.back(), kSentinel) << "written past the range's " << expected_count
                                   << " blocks (nbytes " << nbytes << ", block " << block << ")";
  out.pop_back();
  return out;
}

// Block sizes: one word, three words (no power of two), 64 bytes, a bf16 step record's
// 32 KiB, and one word past precis_fingerprint's 256 KiB chunk.
const int64_t kBlockSizes[] = {8, 24, 64, 32768, 8 * (1 << 15) + 8};

// Lengths around a block of `block` bytes: empty, one word's tail cases, and around
// one and three blocks.
std::vector<int64_t> LengthsAround(int64_t block) {
  return {0, 1, 7, 8, 9, 127, block - 1, block, block + 1, 3 * block + 5};
}

TEST(FingerprintBlocks, MatchTheDefinitionAtEveryLengthAndAlignment) {
  for (int64_t block : kBlockSizes) {
    for (int64_t n : LengthsAround(block)) {
      for (int offset : {0, 2, 5}) {
        auto bytes = RandomBytes((size_t)n + 8, (unsigned)(n * 31 + block + offset));
        const unsigned char* p = bytes.data() + offset;
        const std::vector<uint64_t> want = BlocksReference(p, n, block);
        EXPECT_EQ(Blocks(p, n, block, want.size()), want)
            << "nbytes " << n << ", block " << block << ", offset " << offset;
      }
    }
  }
}

// A range's blocks summed, plus nbytes * 0x9E3779B97F4A7C15, are its precis_fingerprint.
TEST(FingerprintBlocks, SummedWithTheLengthTermAreTheFingerprint) {
  for (int64_t block : kBlockSizes) {
    for (int64_t n : LengthsAround(block)) {
      auto bytes = RandomBytes((size_t)n, (unsigned)(n * 17 + block));
      const std::vector<uint64_t> blocks =
          Blocks(bytes.data(), n, block, n == 0 ? 1 : (size_t)((n + block - 1) / block));
      uint64_t sum = (uint64_t)n * kLengthWeight;
      for (uint64_t b : blocks) sum += b;
      EXPECT_EQ(sum, One(bytes.data(), n)) << "nbytes " << n << ", block " << block;
    }
  }
}

// The threads split a long range's blocks (and precis_fingerprint its 256 KiB chunks):
// the same values at every thread count, for blocks that divide a chunk and blocks that
// do not.
TEST(FingerprintBlocks, TheSameAtEveryThreadCount) {
  const int saved = omp_get_max_threads();
  const int64_t n = 8 * (int64_t)(3 * (1 << 15) + 17) + 7;
  auto bytes = RandomBytes((size_t)n, 99);
  for (int64_t block : {(int64_t)24, (int64_t)32768, (int64_t)8 * (1 << 15) + 8}) {
    const std::vector<uint64_t> want = BlocksReference(bytes.data(), n, block);
    for (int threads : {1, 2, 3, 5}) {
      omp_set_num_threads(threads);
      EXPECT_EQ(Blocks(bytes.data(), n, block, want.size()), want)
          << "block " << block << ", threads " << threads;
    }
  }
  omp_set_num_threads(saved);
}

// Several ranges in one call: range i's blocks start at the sum of the earlier ranges'
// counts (an empty range takes one entry, 0); lists of a few ranges and of more than 64.
TEST(FingerprintBlocks, ListPutsEachRangesBlocksAfterTheEarlierOnes) {
  for (int64_t block : {(int64_t)64, (int64_t)32768}) {
    std::vector<int64_t> lengths = {3 * block + 5, 0, 1, block, block + 1, 0, 7};
    for (int i = 0; i < 200; ++i) lengths.push_back((i * 37) % (3 * block + 11));
    std::vector<std::vector<unsigned char>> store;
    std::vector<const void*> bufs;
    std::vector<uint64_t> want;
    for (size_t i = 0; i < lengths.size(); ++i) {
      store.push_back(RandomBytes((size_t)lengths[i], (unsigned)(1000 + i)));
      bufs.push_back(lengths[i] == 0 ? nullptr : store.back().data());  // NULL: no memory
      const std::vector<uint64_t> blocks = BlocksReference(store.back().data(), lengths[i], block);
      want.insert(want.end(), blocks.begin(), blocks.end());
    }
    std::vector<uint64_t> got(want.size() + 1, kSentinel);
    ASSERT_EQ(precis_fingerprint_blocks(bufs.data(), lengths.data(), (int64_t)lengths.size(),
                                        block, got.data()),
              PRECIS_OK)
        << precis_last_error();
    EXPECT_EQ(got.back(), kSentinel) << "written past the last range's blocks";
    got.pop_back();
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(got[k], want[k]) << "entry " << k << ", block " << block;
    }
    EXPECT_EQ(got[4], 0u);  // the empty second range's one entry, after the first's 4
  }
}

// A changed byte changes its own block's value and no other: at every byte of a range of
// three blocks and a 5-byte tail, both ends of a byte's bits.
TEST(FingerprintBlocks, AChangedByteChangesItsBlockAlone) {
  for (int64_t block : {(int64_t)8, (int64_t)64}) {
    const int64_t n = 3 * block + 5;
    auto bytes = RandomBytes((size_t)n, 5);
    const std::vector<uint64_t> before = Blocks(bytes.data(), n, block, 4);
    for (int64_t i = 0; i < n; ++i) {
      for (unsigned char flip : {(unsigned char)1, (unsigned char)0x80}) {
        bytes[(size_t)i] ^= flip;
        const std::vector<uint64_t> after = Blocks(bytes.data(), n, block, 4);
        bytes[(size_t)i] ^= flip;
        for (int64_t k = 0; k < 4; ++k) {
          if (k == i / block) {
            EXPECT_NE(after[(size_t)k], before[(size_t)k])
                << "byte " << i << " ^ " << (int)flip << ", block " << block;
          } else {
            EXPECT_EQ(after[(size_t)k], before[(size_t)k])
                << "byte " << i << " ^ " << (int)flip << " changed block " << k << " of "
                << block << " bytes";
          }
        }
      }
    }
    EXPECT_EQ(Blocks(bytes.data(), n, block, 4), before);  // every byte restored
  }
  // A step record's block size, at its blocks' first and last bytes and in the tail.
  const int64_t block = 32768, n = 3 * block + 5;
  auto bytes = RandomBytes((size_t)n, 6);
  const std::vector<uint64_t> before = Blocks(bytes.data(), n, block, 4);
  for (int64_t i : {(int64_t)0, block - 1, block, 2 * block + 100, 3 * block - 1, 3 * block,
                    n - 1}) {
    bytes[(size_t)i] ^= 0x40;
    std::vector<uint64_t> want = before;
    const std::vector<uint64_t> after = Blocks(bytes.data(), n, block, 4);
    bytes[(size_t)i] ^= 0x40;
    EXPECT_NE(after[(size_t)(i / block)], before[(size_t)(i / block)]) << "byte " << i;
    want[(size_t)(i / block)] = after[(size_t)(i / block)];
    EXPECT_EQ(after, want) << "byte " << i << " changed another block";
  }
}

// Bad arguments: refused with an error naming the function, and nothing written (every
// range and the block size checked before the first entry).
TEST(FingerprintBlocks, BadArgumentsWriteNothing) {
  auto bytes = RandomBytes(100, 8);
  const void* bufs[] = {bytes.data(), bytes.data()};
  int64_t lengths[] = {100, 20};
  std::vector<uint64_t> out(8, kSentinel);
  const std::vector<uint64_t> untouched = out;
  auto call = [&](const void* const* b, const int64_t* n, int64_t count, int64_t block,
                  uint64_t* o) {
    const precis_status_t st = precis_fingerprint_blocks(b, n, count, block, o);
    if (st != PRECIS_OK) {
      EXPECT_NE(std::string(precis_last_error()).find("precis_fingerprint_blocks"),
                std::string::npos)
          << precis_last_error();
    }
    return st;
  };
  for (int64_t block : {(int64_t)0, (int64_t)-8, (int64_t)4, (int64_t)12, (int64_t)65537}) {
    EXPECT_EQ(call(bufs, lengths, 2, block, out.data()), PRECIS_ERR_INVALID_ARGUMENT)
        << "block " << block;
    EXPECT_NE(std::string(precis_last_error()).find("block"), std::string::npos)
        << precis_last_error();
    EXPECT_EQ(out, untouched) << "block " << block;
  }
  EXPECT_EQ(call(bufs, lengths, 2, 64, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(call(nullptr, lengths, 2, 64, out.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(call(bufs, nullptr, 2, 64, out.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(out, untouched);
  bufs[1] = nullptr;  // the second range has no memory: the first is not written either
  EXPECT_EQ(call(bufs, lengths, 2, 64, out.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_NE(std::string(precis_last_error()).find("bufs[1]"), std::string::npos)
      << precis_last_error();
  EXPECT_EQ(out, untouched);
  bufs[1] = bytes.data();
  lengths[1] = -1;
  EXPECT_EQ(call(bufs, lengths, 2, 64, out.data()), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, untouched);
  lengths[1] = 20;
  EXPECT_EQ(call(bufs, lengths, -1, 64, out.data()), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, untouched);
  // and the same arguments, put right, are taken: 2 + 1 entries
  ASSERT_EQ(call(bufs, lengths, 2, 64, out.data()), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(out[3], kSentinel);
  EXPECT_EQ(precis_fingerprint_blocks(nullptr, nullptr, 0, 8, nullptr), PRECIS_OK);  // nothing
}

}  // namespace
