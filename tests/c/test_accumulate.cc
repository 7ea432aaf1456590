// precis_accumulate: dst += src for every pair of fp32/fp16/bf16, checked
// element by element against an independent double-precision reference.
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "precis/precis.h"

namespace {

constexpr precis_dtype_t FP32 = PRECIS_DTYPE_FP32;
constexpr precis_dtype_t FP16 = PRECIS_DTYPE_FP16;
constexpr precis_dtype_t BF16 = PRECIS_DTYPE_BF16;

// ---- reference arithmetic (doubles, no bit tricks shared with the library) ----

struct Format {
  int precision;  // significand bits, including the implicit one
  int emin, emax;
};
constexpr Format kHalf{11, -14, 15};
constexpr Format kBfloat{8, -126, 127};

// Round x to the nearest value of `f`, ties to even, with subnormals and overflow
// to infinity, as IEEE 754 says. Scaling by powers of two is exact in double.
double RoundTo(double x, Format f) {
  if (std::isnan(x) || std::isinf(x) || x == 0.0) return x;
  int e;
  std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  int exponent = std::max(e - 1, f.emin);
  double quantum = std::ldexp(1.0, exponent - (f.precision - 1));
  double r = std::nearbyint(x / quantum) * quantum;  // default mode: nearest even
  if (std::fabs(r) >= std::ldexp(1.0, f.emax + 1)) return std::copysign(INFINITY, x);
  return r;
}

double HalfToDouble(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  double v;
  if (exp == 0x1F) {
    v = mant ? NAN : INFINITY;
  } else if (exp == 0) {
    v = std::ldexp(mant, -24);
  } else {
    v = std::ldexp(1024 + mant, exp - 25);
  }
  return sign ? -v : v;
}

double BfloatToDouble(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Encodes a double that is exactly representable in the format (or inf/NaN).
uint16_t DoubleToHalfExact(double v) {
  uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  double a = std::fabs(v);
  if (std::isnan(v)) return sign | 0x7E00;
  if (std::isinf(v)) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(std::ldexp(a, 24));
  int e;
  double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  return sign | static_cast<uint16_t>((e + 14) << 10) |
         static_cast<uint16_t>(std::ldexp(m, 11) - 1024);
}

uint16_t DoubleToBfloatExact(double v) {
  float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Buffers of any of the three dtypes, read and written as doubles.
struct Buffer {
  precis_dtype_t dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;

  Buffer(precis_dtype_t d, size_t n) : dtype(d) {
    if (d == FP32)
      f32.resize(n);
    else
      u16.resize(n);
  }
  void* data() { return dtype == FP32 ? static_cast<void*>(f32.data()) : u16.data(); }
  double Get(size_t i) const {
    if (dtype == FP32) return f32[i];
    return dtype == FP16 ? HalfToDouble(u16[i]) : BfloatToDouble(u16[i]);
  }
  // v must be exactly representable.
  void Set(size_t i, double v) {
    if (dtype == FP32)
      f32[i] = static_cast<float>(v);
    else
      u16[i] = dtype == FP16 ? DoubleToHalfExact(v) : DoubleToBfloatExact(v);
  }
};

double RoundToDtype(double v, precis_dtype_t d) {
  if (d == FP32) return static_cast<float>(v);
  return RoundTo(v, d == FP16 ? kHalf : kBfloat);
}

// What dst[i] must become: the two values added in double (exact for these
// inputs up to one rounding), rounded once to fp32 -- double-then-float gives the
// correctly rounded fp32 sum -- and that fp32 sum rounded to the dst dtype.
double Expected(double dst, double src, precis_dtype_t dst_dtype) {
  double fp32_sum = static_cast<float>(dst + src);
  return RoundToDtype(fp32_sum, dst_dtype);
}

bool SameValue(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

// Random non-zero values spread over many binades, rounded to the dtype.
void FillRandom(Buffer* b, size_t n, std::mt19937_64* rng, int min_exp, int max_exp) {
  std::uniform_int_distribution<int> exp(min_exp, max_exp);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  for (size_t i = 0; i < n; ++i) {
    double v = 0.0;
    while (v == 0.0 || std::isinf(v)) {  // fp16 rounds the top binade's end to inf
      v = RoundToDtype(std::ldexp(mant(*rng), exp(*rng)), b->dtype);
      if ((*rng)() & 1) v = -v;
    }
    b->Set(i, v);
  }
}

std::string DtypeName(precis_dtype_t d) { return d == FP32 ? "fp32" : d == FP16 ? "fp16" : "bf16"; }

// ---- the reference itself -------------------------------------------------------

TEST(AccumulateReference, RoundToKnownValues) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  // ties to even
  EXPECT_EQ(RoundTo(1.0 + std::ldexp(1.0, -8), kBfloat), 1.0);
  EXPECT_EQ(RoundTo(1.0 + 3 * std::ldexp(1.0, -8), kBfloat), 1.0 + std::ldexp(1.0, -6));
  EXPECT_EQ(RoundTo(1.0 + std::ldexp(1.0, -11), kHalf), 1.0);
  EXPECT_EQ(RoundTo(2049.0, kHalf), 2048.0);
  EXPECT_EQ(RoundTo(2051.0, kHalf), 2052.0);
  // half: overflow threshold is the midpoint 65520
  EXPECT_EQ(RoundTo(65519.0, kHalf), 65504.0);
  EXPECT_TRUE(std::isinf(RoundTo(65520.0, kHalf)));
  EXPECT_TRUE(std::isinf(RoundTo(-1e6, kHalf)) && RoundTo(-1e6, kHalf) < 0);
  // half subnormals: 2^-25 ties to 0, 3 * 2^-26 goes up to 2^-24
  EXPECT_EQ(RoundTo(std::ldexp(1.0, -25), kHalf), 0.0);
  EXPECT_EQ(RoundTo(3 * std::ldexp(1.0, -26), kHalf), std::ldexp(1.0, -24));
  EXPECT_TRUE(std::signbit(RoundTo(-std::ldexp(1.0, -26), kHalf)));
  // encoders agree with the decoders
  EXPECT_EQ(DoubleToHalfExact(65504.0), 0x7BFF);
  EXPECT_EQ(DoubleToHalfExact(std::ldexp(1.0, -24)), 0x0001);
  EXPECT_EQ(DoubleToHalfExact(-1.0), 0xBC00);
  EXPECT_EQ(HalfToDouble(0x3555), RoundTo(1.0 / 3.0, kHalf));
  EXPECT_EQ(DoubleToBfloatExact(1.0), 0x3F80);
}

// ---- all nine pairs, several sizes ------------------------------------------------

class AccumulatePairs
    : public ::testing::TestWithParam<std::tuple<precis_dtype_t, precis_dtype_t, int64_t>> {};

TEST_P(AccumulatePairs, MatchesReference) {
  const auto [dst_dtype, src_dtype, numel] = GetParam();
  const size_t n = static_cast<size_t>(numel);
  std::mt19937_64 rng(1234 + 31 * dst_dtype + 7 * src_dtype + numel);
  Buffer dst(dst_dtype, n), src(src_dtype, n);
  // Magnitudes from fp16 subnormals to near fp16's max: exercises every rounding case
  // (ties included, since the inputs have few bits) and fp16 overflow to inf.
  FillRandom(&dst, n, &rng, -26, 15);
  FillRandom(&src, n, &rng, -26, 15);
  std::vector<double> before(n);
  for (size_t i = 0; i < n; ++i) before[i] = dst.Get(i);

  ASSERT_EQ(precis_accumulate(dst.data(), dst_dtype, src.data(), src_dtype, numel), PRECIS_OK)
      << precis_last_error();

  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    double want = Expected(before[i], src.Get(i), dst_dtype);
    if (!SameValue(dst.Get(i), want)) {
      if (++bad <= 5) {
        ADD_FAILURE() << "element " << i << ": " << before[i] << " + " << src.Get(i) << " gave "
                      << dst.Get(i) << ", want " << want;
      }
    }
  }
  EXPECT_EQ(bad, 0u);
}

INSTANTIATE_TEST_SUITE_P(AllPairs, AccumulatePairs,
                         ::testing::Combine(::testing::Values(FP32, FP16, BF16),
                                            ::testing::Values(FP32, FP16, BF16),
                                            ::testing::Values<int64_t>(1, 127, 4097, 1000003)),
                         [](const auto& info) {
                           return DtypeName(std::get<0>(info.param)) + "_plus_" +
                                  DtypeName(std::get<1>(info.param)) + "_n" +
                                  std::to_string(std::get<2>(info.param));
                         });

// ---- special values -----------------------------------------------------------------

// dst[i] += src[i] for one pair of values given as doubles (exact in their dtypes).
double AddOne(precis_dtype_t dst_dtype, double d, precis_dtype_t src_dtype, double s) {
  Buffer dst(dst_dtype, 1), src(src_dtype, 1);
  dst.Set(0, d);
  src.Set(0, s);
  EXPECT_EQ(precis_accumulate(dst.data(), dst_dtype, src.data(), src_dtype, 1), PRECIS_OK);
  return dst.Get(0);
}

TEST(Accumulate, SpecialValuesAllPairs) {
  const double specials[] = {0.0,
                             -0.0,
                             1.0,
                             -2.5,
                             INFINITY,
                             -INFINITY,
                             NAN,
                             65504.0,
                             -65504.0,
                             std::ldexp(1.0, -24),
                             -std::ldexp(1.0, -14),
                             3.0e38,
                             -3.0e38};
  for (precis_dtype_t dd : {FP32, FP16, BF16}) {
    for (precis_dtype_t sd : {FP32, FP16, BF16}) {
      for (double a : specials) {
        for (double b : specials) {
          double ra = RoundToDtype(a, dd), rb = RoundToDtype(b, sd);
          double got = AddOne(dd, ra, sd, rb);
          EXPECT_TRUE(SameValue(got, Expected(ra, rb, dd)))
              << DtypeName(dd) << " " << ra << " + " << DtypeName(sd) << " " << rb << " = " << got;
        }
      }
    }
  }
}

TEST(Accumulate, RoundingCornerCases) {
  // bf16: a tie rounds to even, both ways
  EXPECT_EQ(AddOne(BF16, 1.0, FP32, std::ldexp(1.0, -8)), 1.0);
  EXPECT_EQ(AddOne(BF16, 1.0 + std::ldexp(1.0, -7), FP32, std::ldexp(1.0, -8)),
            1.0 + std::ldexp(1.0, -6));
  // bf16 overflow to inf, NaN stays NaN
  EXPECT_TRUE(std::isinf(AddOne(BF16, 3.3895313892515355e38, BF16, 3.3895313892515355e38)));
  EXPECT_TRUE(std::isnan(AddOne(BF16, NAN, FP32, 1.0)));
  EXPECT_TRUE(std::isnan(AddOne(BF16, INFINITY, BF16, -INFINITY)));
  // fp16: 65504 + 16 is the midpoint to 2^16 and rounds (to even) to inf; + 15 does not
  EXPECT_TRUE(std::isinf(AddOne(FP16, 65504.0, FP32, 16.0)));
  EXPECT_EQ(AddOne(FP16, 65504.0, FP32, 15.0), 65504.0);
  // fp16 subnormals
  EXPECT_EQ(AddOne(FP16, std::ldexp(1.0, -24), FP16, std::ldexp(1.0, -24)), std::ldexp(1.0, -23));
  EXPECT_EQ(AddOne(FP16, 0.0, FP32, std::ldexp(1.0, -25)), 0.0);
  EXPECT_EQ(AddOne(FP16, 0.0, FP32, 3 * std::ldexp(1.0, -26)), std::ldexp(1.0, -24));
  // signed zeros
  EXPECT_TRUE(std::signbit(AddOne(FP16, -0.0, BF16, -0.0)));
  EXPECT_FALSE(std::signbit(AddOne(BF16, 0.0, FP16, -0.0)));
  // the sum is formed in fp32 before rounding: 1 + 2^-24 is lost in fp32 for an fp32 dst
  EXPECT_EQ(AddOne(FP32, 1.0, FP32, std::ldexp(1.0, -24)), 1.0);
}

TEST(Accumulate, DstMayBeSrc) {
  for (precis_dtype_t d : {FP32, FP16, BF16}) {
    const size_t n = 200000;  // more than one parallel chunk
    Buffer buf(d, n);
    for (size_t i = 0; i < n; ++i)
      buf.Set(i, RoundToDtype(static_cast<double>(i % 1000) - 500.25, d));
    std::vector<double> before(n);
    for (size_t i = 0; i < n; ++i) before[i] = buf.Get(i);
    ASSERT_EQ(precis_accumulate(buf.data(), d, buf.data(), d, static_cast<int64_t>(n)), PRECIS_OK);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(buf.Get(i), 2 * before[i]) << i;
  }
}

// ---- errors --------------------------------------------------------------------------

TEST(Accumulate, ZeroElementsIsANoOp) {
  EXPECT_EQ(precis_accumulate(nullptr, FP32, nullptr, BF16, 0), PRECIS_OK);
  float x = 1.0f, y = 2.0f;
  EXPECT_EQ(precis_accumulate(&x, FP32, &y, FP32, 0), PRECIS_OK);
  EXPECT_EQ(x, 1.0f);
  EXPECT_STREQ(precis_last_error(), "");
}

TEST(Accumulate, Errors) {
  float dst[4] = {1, 2, 3, 4};
  const float src[4] = {1, 1, 1, 1};
  auto check = [&](precis_status_t got, precis_status_t want, const char* mention) {
    EXPECT_EQ(got, want) << mention;
    EXPECT_NE(std::string(precis_last_error()).find(mention), std::string::npos)
        << precis_last_error();
    EXPECT_EQ(dst[0], 1.0f);
  };
  check(precis_accumulate(dst, FP32, src, FP32, -1), PRECIS_ERR_INVALID_ARGUMENT, "-1");
  check(precis_accumulate(dst, FP32, src, FP32, INT64_MIN), PRECIS_ERR_INVALID_ARGUMENT, "numel");
  check(precis_accumulate(nullptr, FP32, src, FP32, 4), PRECIS_ERR_NULL_POINTER, "dst");
  check(precis_accumulate(dst, FP32, nullptr, FP32, 4), PRECIS_ERR_NULL_POINTER, "src");
  for (int bad : {3, 4, 5, 99, -1}) {
    auto d = static_cast<precis_dtype_t>(bad);
    const std::string which = bad == 3 ? "fp8" : bad == 4 ? "int16" : std::to_string(bad);
    check(precis_accumulate(dst, d, src, FP32, 4), PRECIS_ERR_INVALID_DTYPE, which.c_str());
    check(precis_accumulate(dst, FP32, src, d, 4), PRECIS_ERR_INVALID_DTYPE, which.c_str());
    check(precis_accumulate(dst, d, src, FP32, 0), PRECIS_ERR_INVALID_DTYPE, "dst_dtype");
    check(precis_accumulate(dst, FP32, src, d, 0), PRECIS_ERR_INVALID_DTYPE, "src_dtype");
  }
}

}  // namespace

// Chunks run in parallel: a dst that overlaps src without being it would read
// sums already written. Refused before anything is written.
TEST(Accumulate, PartialOverlapIsRefused) {
  std::vector<float> buf(64);
  for (size_t i = 0; i < buf.size(); i++) buf[i] = static_cast<float>(i) + 0.5f;
  const std::vector<float> before = buf;
  EXPECT_EQ(precis_accumulate(buf.data() + 1, PRECIS_DTYPE_FP32, buf.data(), PRECIS_DTYPE_FP32, 32),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("overlap"), std::string::npos)
      << precis_last_error();
  // The same bytes read as another dtype are not "the same buffer" either.
  EXPECT_EQ(precis_accumulate(buf.data(), PRECIS_DTYPE_FP32, buf.data(), PRECIS_DTYPE_BF16, 16),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(buf, before);
}
