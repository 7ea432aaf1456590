// precis_cast, precis_scale, precis_count_nonfinite: results against the scalar
// conversions of precis_convert.h (themselves checked exhaustively in
// test_convert.cc), special values, sizes across OpenMP chunks, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "precis/precis.h"
#include "precis_convert.h"

namespace {

const precis_dtype_t kFloatDtypes[] = {PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, PRECIS_DTYPE_BF16};
// 0 and 1, one partial chunk, and several 64K-element chunks with a short tail.
const int64_t kSizes[] = {0, 1, 1000, (int64_t)3 * 65536 + 17};

// A buffer of n elements of a dtype, as raw bytes, with typed access through fp32.
struct Buf {
  precis_dtype_t dtype;
  std::vector<uint32_t> f32;
  std::vector<uint16_t> h16;

  Buf(precis_dtype_t d, int64_t n) : dtype(d) {
    if (d == PRECIS_DTYPE_FP32) f32.assign((size_t)n, 0); else h16.assign((size_t)n, 0);
  }
  void* data() { return dtype == PRECIS_DTYPE_FP32 ? (void*)f32.data() : (void*)h16.data(); }
  uint32_t bits(size_t i) const { return dtype == PRECIS_DTYPE_FP32 ? f32[i] : h16[i]; }
  float get(size_t i) const {
    switch (dtype) {
      case PRECIS_DTYPE_FP32: return precis_bits_f32(f32[i]);
      case PRECIS_DTYPE_FP16: return precis_f16_to_f32(h16[i]);
      default: return precis_bf16_to_f32(h16[i]);
    }
  }
  void set(size_t i, float x) {  // rounds to nearest even, like the kernels
    switch (dtype) {
      case PRECIS_DTYPE_FP32: f32[i] = precis_f32_bits(x); break;
      case PRECIS_DTYPE_FP16: h16[i] = precis_f32_to_f16_rn(x); break;
      default: h16[i] = precis_f32_to_bf16_rn(x); break;
    }
  }
  size_t size() const { return dtype == PRECIS_DTYPE_FP32 ? f32.size() : h16.size(); }
};

// x rounded to nearest even into dtype d, as raw bits (no allocation: used per element).
uint32_t RoundBits(precis_dtype_t d, float x) {
  switch (d) {
    case PRECIS_DTYPE_FP32: return precis_f32_bits(x);
    case PRECIS_DTYPE_FP16: return precis_f32_to_f16_rn(x);
    default: return precis_f32_to_bf16_rn(x);
  }
}

float BitsValue(precis_dtype_t d, uint32_t bits) {
  switch (d) {
    case PRECIS_DTYPE_FP32: return precis_bits_f32(bits);
    case PRECIS_DTYPE_FP16: return precis_f16_to_f32((uint16_t)bits);
    default: return precis_bf16_to_f32((uint16_t)bits);
  }
}

std::string Name(precis_dtype_t d) {
  const char* s = "?";
  precis_dtype_name(d, &s);
  return s;
}

// Values over many binades (fp16 subnormals and overflow included), exact ties,
// and a sprinkling of NaN / +-Inf.
Buf Random(precis_dtype_t d, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exp(-28, 18);
  Buf b(d, n);
  for (int64_t i = 0; i < n; ++i) {
    float x = std::ldexp(normal(rng), exp(rng));
    switch (rng() % 64) {
      case 0: x = std::numeric_limits<float>::quiet_NaN(); break;
      case 1: x = std::numeric_limits<float>::infinity(); break;
      case 2: x = -std::numeric_limits<float>::infinity(); break;
      case 3: x = precis_bits_f32((precis_f32_bits(x) & ~0xFFFFu) | 0x8000u); break;  // bf16 tie
      case 4: x = precis_bits_f32((precis_f32_bits(x) & ~0x1FFFu) | 0x1000u); break;  // fp16 tie
      default: break;
    }
    b.set((size_t)i, x);
  }
  return b;
}

// Same value, NaN equal to NaN (payloads may differ across dtypes).
void ExpectSameValue(float want, float got, const std::string& where) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << where;
  } else {
    EXPECT_EQ(precis_f32_bits(want), precis_f32_bits(got)) << where << ": " << want << " vs " << got;
  }
}

std::string LastError() { return precis_last_error(); }

// ---- cast ------------------------------------------------------------------

TEST(Cast, EveryPairMatchesTheScalarConversions) {
  for (precis_dtype_t dd : kFloatDtypes) {
    for (precis_dtype_t sd : kFloatDtypes) {
      for (int64_t n : kSizes) {
        Buf src = Random(sd, n, 7 + (uint64_t)n);
        Buf dst(dd, n);
        ASSERT_EQ(precis_cast(dst.data(), dd, src.data(), sd, n), PRECIS_OK) << LastError();
        std::string where = Name(dd) + " <- " + Name(sd) + " n=" + std::to_string(n);
        for (int64_t i = 0; i < n; ++i) {
          uint32_t want = RoundBits(dd, src.get((size_t)i));  // widen exactly, round once
          if (dd == sd) {
            ASSERT_EQ(dst.bits((size_t)i), src.bits((size_t)i)) << where << " i=" << i;
          } else if (std::isnan(BitsValue(dd, want))) {
            ASSERT_TRUE(std::isnan(dst.get((size_t)i))) << where << " i=" << i;
          } else {
            ASSERT_EQ(dst.bits((size_t)i), want) << where << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(Cast, RoundsToNearestEven) {
  // fp32 -> bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins (1).
  // 1 + 3 * 2^-8 ties between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
  // 1 + 2^-8 + 2^-20 is above the tie: rounds up.
  const float in[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -1.0f - 0x1p-8f};
  const float want[] = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -1.0f};
  uint16_t out[4];
  ASSERT_EQ(precis_cast(out, PRECIS_DTYPE_BF16, in, PRECIS_DTYPE_FP32, 4), PRECIS_OK);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(precis_bf16_to_f32(out[i]), want[i]) << i;
  // fp32 -> fp16: 65520 and above overflow to inf, 65519 rounds to the max 65504;
  // 2^-25 ties between 0 and the smallest subnormal 2^-24: rounds to 0.
  const float in16[] = {65520.0f, 65519.0f, 0x1p-25f, 0x1.8p-24f};
  const float want16[] = {INFINITY, 65504.0f, 0.0f, 0x1p-23f};
  uint16_t out16[4];
  ASSERT_EQ(precis_cast(out16, PRECIS_DTYPE_FP16, in16, PRECIS_DTYPE_FP32, 4), PRECIS_OK);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(precis_f16_to_f32(out16[i]), want16[i]) << i;
}

TEST(Cast, SpecialValues) {
  const float in[] = {NAN, INFINITY, -INFINITY, -0.0f, 3.0e38f};
  uint16_t bf[5], h[5];
  ASSERT_EQ(precis_cast(bf, PRECIS_DTYPE_BF16, in, PRECIS_DTYPE_FP32, 5), PRECIS_OK);
  ASSERT_EQ(precis_cast(h, PRECIS_DTYPE_FP16, in, PRECIS_DTYPE_FP32, 5), PRECIS_OK);
  EXPECT_TRUE(std::isnan(precis_bf16_to_f32(bf[0])));
  EXPECT_TRUE(std::isnan(precis_f16_to_f32(h[0])));
  EXPECT_EQ(precis_bf16_to_f32(bf[1]), INFINITY);
  EXPECT_EQ(precis_f16_to_f32(h[2]), -INFINITY);
  EXPECT_EQ(bf[3], 0x8000u);  // the sign of zero survives
  EXPECT_EQ(h[3], 0x8000u);
  EXPECT_EQ(precis_f16_to_f32(h[4]), INFINITY);  // out of fp16 range
  EXPECT_TRUE(std::isfinite(precis_bf16_to_f32(bf[4])));
}

TEST(Cast, SameBufferSameDtypeIsANoOp) {
  Buf b = Random(PRECIS_DTYPE_BF16, 100, 3);
  Buf copy = b;
  ASSERT_EQ(precis_cast(b.data(), PRECIS_DTYPE_BF16, b.data(), PRECIS_DTYPE_BF16, 100), PRECIS_OK);
  EXPECT_EQ(b.h16, copy.h16);
}

TEST(Cast, OverlapIsRejectedAndNothingIsWritten) {
  std::vector<uint16_t> buf(300, 0x3F80u);  // bf16 1.0
  std::vector<uint16_t> before = buf;
  // bf16 -> fp16 into the same bytes (same buffer, other dtype).
  EXPECT_EQ(precis_cast(buf.data(), PRECIS_DTYPE_FP16, buf.data(), PRECIS_DTYPE_BF16, 100),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(LastError().find("overlap"), std::string::npos) << LastError();
  // Same dtype, shifted by one element.
  EXPECT_EQ(precis_cast(buf.data() + 1, PRECIS_DTYPE_BF16, buf.data(), PRECIS_DTYPE_BF16, 100),
            PRECIS_ERR_INVALID_ARGUMENT);
  // fp32 destination over the tail of a bf16 source.
  EXPECT_EQ(precis_cast(buf.data() + 50, PRECIS_DTYPE_FP32, buf.data(), PRECIS_DTYPE_BF16, 60),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(buf, before);
  // Adjacent, not overlapping: fine.
  EXPECT_EQ(precis_cast(buf.data() + 100, PRECIS_DTYPE_FP16, buf.data(), PRECIS_DTYPE_BF16, 100),
            PRECIS_OK)
      << LastError();
  EXPECT_EQ(precis_f16_to_f32(buf[150]), 1.0f);
}

TEST(Cast, ArgumentChecks) {
  float f[4] = {1, 2, 3, 4};
  uint16_t h[4] = {0, 0, 0, 0};
  EXPECT_EQ(precis_cast(h, PRECIS_DTYPE_BF16, f, PRECIS_DTYPE_FP32, -1), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(LastError().find("precis_cast: numel is -1"), std::string::npos) << LastError();
  EXPECT_EQ(precis_cast(h, PRECIS_DTYPE_FP8_E4M3, f, PRECIS_DTYPE_FP32, 4), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_NE(LastError().find("dst_dtype"), std::string::npos) << LastError();
  EXPECT_EQ(precis_cast(h, PRECIS_DTYPE_BF16, f, PRECIS_DTYPE_INT16, 4), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_NE(LastError().find("src_dtype"), std::string::npos) << LastError();
  EXPECT_EQ(precis_cast(h, (precis_dtype_t)99, f, PRECIS_DTYPE_FP32, 4), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(precis_cast(nullptr, PRECIS_DTYPE_BF16, f, PRECIS_DTYPE_FP32, 4), PRECIS_ERR_NULL_POINTER);
  EXPECT_NE(LastError().find("dst is NULL"), std::string::npos) << LastError();
  EXPECT_EQ(precis_cast(h, PRECIS_DTYPE_BF16, nullptr, PRECIS_DTYPE_FP32, 4), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(h[0], 0u);  // nothing written by any failing call
  // Zero elements: pointers are not needed; success clears the last error.
  EXPECT_EQ(precis_cast(nullptr, PRECIS_DTYPE_BF16, nullptr, PRECIS_DTYPE_FP32, 0), PRECIS_OK);
  EXPECT_EQ(LastError(), "");
}

// ---- scale -----------------------------------------------------------------

TEST(Scale, EveryDtypeMatchesFp32ProductRoundedOnce) {
  const float factors[] = {0.5f, 1.0f / 3.0f, -2.5f, 0.0f};
  for (precis_dtype_t d : kFloatDtypes) {
    for (int64_t n : kSizes) {
      for (float factor : factors) {
        Buf b = Random(d, n, 11 + (uint64_t)n);
        Buf orig = b;
        ASSERT_EQ(precis_scale(b.data(), d, factor, n), PRECIS_OK) << LastError();
        for (int64_t i = 0; i < n; ++i) {
          float want = BitsValue(d, RoundBits(d, orig.get((size_t)i) * factor));
          float got = b.get((size_t)i);
          if (std::isnan(want) ? !std::isnan(got) : precis_f32_bits(want) != precis_f32_bits(got)) {
            ExpectSameValue(want, got, Name(d) + " n=" + std::to_string(n) + " f=" +
                                           std::to_string(factor) + " i=" + std::to_string(i));
            return;
          }
        }
      }
    }
  }
}

TEST(Scale, FactorOneLeavesBitsAlone) {
  Buf b = Random(PRECIS_DTYPE_FP16, 5000, 5);
  Buf orig = b;
  ASSERT_EQ(precis_scale(b.data(), PRECIS_DTYPE_FP16, 1.0f, 5000), PRECIS_OK);
  EXPECT_EQ(b.h16, orig.h16);
}

TEST(Scale, ArgumentChecks) {
  float f[3] = {1, 2, 3};
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    EXPECT_EQ(precis_scale(f, PRECIS_DTYPE_FP32, bad, 3), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(LastError().find("factor"), std::string::npos) << LastError();
  }
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(precis_scale(f, PRECIS_DTYPE_FP8_E4M3, 2.0f, 3), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_NE(LastError().find("precis_scale: dtype"), std::string::npos) << LastError();
  EXPECT_EQ(precis_scale(f, PRECIS_DTYPE_FP32, 2.0f, -3), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_scale(nullptr, PRECIS_DTYPE_FP32, 2.0f, 3), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_scale(nullptr, PRECIS_DTYPE_FP32, 2.0f, 0), PRECIS_OK);
  EXPECT_EQ(f[2], 3.0f);
}

// ---- count_nonfinite ---------------------------------------------------------

TEST(CountNonfinite, CountsNanAndInfOnly) {
  for (precis_dtype_t d : kFloatDtypes) {
    for (int64_t n : kSizes) {
      Buf b = Random(d, n, 13 + (uint64_t)n);
      int64_t want = 0;
      for (int64_t i = 0; i < n; ++i) want += !std::isfinite(b.get((size_t)i));
      int64_t got = -1;
      ASSERT_EQ(precis_count_nonfinite(b.data(), d, n, &got), PRECIS_OK) << LastError();
      EXPECT_EQ(got, want) << Name(d) << " n=" << n;
    }
  }
}

TEST(CountNonfinite, LargestFiniteAndSubnormalsAreFinite) {
  const float vals[] = {3.4028235e38f, -3.4028235e38f, 1e-45f, 0.0f, -0.0f};
  int64_t count = -1;
  ASSERT_EQ(precis_count_nonfinite(vals, PRECIS_DTYPE_FP32, 5, &count), PRECIS_OK);
  EXPECT_EQ(count, 0);
  const uint16_t h[] = {0x7BFFu /* 65504 */, 0x0001u, 0x7C00u /* inf */, 0xFE00u /* nan */};
  ASSERT_EQ(precis_count_nonfinite(h, PRECIS_DTYPE_FP16, 4, &count), PRECIS_OK);
  EXPECT_EQ(count, 2);
  const uint16_t bf[] = {0x7F7Fu /* max */, 0xFF80u /* -inf */, 0x7FC1u /* nan */, 0x0001u};
  ASSERT_EQ(precis_count_nonfinite(bf, PRECIS_DTYPE_BF16, 4, &count), PRECIS_OK);
  EXPECT_EQ(count, 2);
}

TEST(CountNonfinite, OneNanInTheLastChunk) {
  const int64_t n = (int64_t)5 * 65536 + 3;
  std::vector<uint16_t> bf(n, 0x3F80u);
  bf[n - 1] = 0x7FC0u;
  int64_t count = -1;
  ASSERT_EQ(precis_count_nonfinite(bf.data(), PRECIS_DTYPE_BF16, n, &count), PRECIS_OK);
  EXPECT_EQ(count, 1);
}

TEST(CountNonfinite, ArgumentChecks) {
  float f[2] = {1, NAN};
  int64_t count = 42;
  EXPECT_EQ(precis_count_nonfinite(f, PRECIS_DTYPE_FP32, 2, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_NE(LastError().find("out_count"), std::string::npos) << LastError();
  EXPECT_EQ(precis_count_nonfinite(nullptr, PRECIS_DTYPE_FP32, 2, &count), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_count_nonfinite(f, PRECIS_DTYPE_INT16, 2, &count), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(precis_count_nonfinite(f, PRECIS_DTYPE_FP32, -2, &count), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(count, 42);  // untouched by failures
  EXPECT_EQ(precis_count_nonfinite(nullptr, PRECIS_DTYPE_FP32, 0, &count), PRECIS_OK);
  EXPECT_EQ(count, 0);
}

}  // namespace

namespace {

// Buffers one byte off their element alignment are refused before anything is
// written, naming the argument; fp32 and 16-bit alike.
TEST(BucketOps, MisalignedBuffersAreRefused) {
  alignas(16) uint8_t a[64], b[64];
  std::memset(a, 0x11, sizeof a);
  std::memset(b, 0x22, sizeof b);
  const std::vector<uint8_t> a0(a, a + 64), b0(b, b + 64);
  int64_t count = -5;
  for (precis_dtype_t d : kFloatDtypes) {
    EXPECT_EQ(precis_accumulate(a + 1, d, b, PRECIS_DTYPE_FP32, 4), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("dst"), std::string::npos) << precis_last_error();
    EXPECT_NE(std::string(precis_last_error()).find("not aligned"), std::string::npos);
    EXPECT_EQ(precis_cast(a, PRECIS_DTYPE_FP32, b + 1, d, 4), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("src"), std::string::npos) << precis_last_error();
    EXPECT_EQ(precis_scale(a + 1, d, 2.0f, 4), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("buf"), std::string::npos) << precis_last_error();
    EXPECT_EQ(precis_count_nonfinite(b + 1, d, 4, &count), PRECIS_ERR_INVALID_ARGUMENT);
  }
  // fp32 wants 4 bytes: 2 off is misaligned for it, fine for 16-bit dtypes.
  EXPECT_EQ(precis_scale(a + 2, PRECIS_DTYPE_FP32, 2.0f, 4), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::vector<uint8_t>(a, a + 64), a0);
  EXPECT_EQ(std::vector<uint8_t>(b, b + 64), b0);
  EXPECT_EQ(count, -5);
  EXPECT_EQ(precis_scale(a + 2, PRECIS_DTYPE_BF16, 1.0f, 4), PRECIS_OK);
  // numel 0 touches nothing: no alignment needed.
  EXPECT_EQ(precis_cast(a + 1, PRECIS_DTYPE_FP32, b + 1, PRECIS_DTYPE_FP16, 0), PRECIS_OK);
}

// A numel no buffer can hold is refused (it once overflowed int64 in the overlap
// check, undefined behaviour), and a range that reaches another is an overlap.
TEST(BucketOps, NumelBeyondMemoryIsRefused) {
  alignas(16) uint8_t a[64] = {}, b[64] = {};
  const int64_t huge = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(precis_accumulate(a, PRECIS_DTYPE_FP32, b, PRECIS_DTYPE_FP16, huge),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("past the end of memory"), std::string::npos)
      << precis_last_error();
  EXPECT_EQ(precis_cast(a, PRECIS_DTYPE_BF16, b, PRECIS_DTYPE_FP16, huge / 2 + 1),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_cast(a, PRECIS_DTYPE_BF16, a + 2, PRECIS_DTYPE_FP16, 1 << 20),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("overlap"), std::string::npos);
}

}  // namespace
