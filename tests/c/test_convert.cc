// Exhaustive and randomized tests of csrc/precis_convert.h (bf16, fp16, fp8 E4M3fn).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "precis_convert.h"

namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Independent reference: round x (finite) to a binary format with `mant` stored
// mantissa bits, minimum normal exponent `emin`, using double arithmetic and
// nearbyint (round half to even). Returns the rounded value as a double; the
// caller handles overflow.
double RoundToFormat(double x, int mant, int emin) {
  if (x == 0) return x;
  int e;
  std::frexp(std::fabs(x), &e);  // |x| = f * 2^e, f in [0.5, 1)
  int exp = e - 1;               // |x| = 1.xxx * 2^exp
  if (exp < emin) exp = emin;    // subnormal: fixed quantum
  double quantum = std::ldexp(1.0, exp - mant);
  return std::nearbyint(x / quantum) * quantum;
}

std::mt19937_64& Rng() {
  static std::mt19937_64 rng(12345);
  return rng;
}

// Random floats covering every exponent, both signs, plus some near-ties.
float RandomFloat() {
  uint32_t u = static_cast<uint32_t>(Rng()());
  switch (u % 4) {
    case 0:  // any bit pattern
      return FromBits(static_cast<uint32_t>(Rng()()));
    case 1: {  // exact tie for fp16/bf16 patterns: low bits 1000...
      uint32_t v = static_cast<uint32_t>(Rng()());
      int shift = (u >> 8) % 2 ? 13 : 16;
      v = (v & ~((1u << shift) - 1)) | (1u << (shift - 1));
      return FromBits(v);
    }
    default: {  // magnitudes in the fp16/fp8 range
      std::uniform_real_distribution<double> d(-30.0, 17.0);
      double m = std::exp2(d(Rng()));
      return static_cast<float>((u & 1) ? -m : m);
    }
  }
}

// ---- bf16 ------------------------------------------------------------------

TEST(ConvertBf16, AllCodesRoundTrip) {
  for (uint32_t c = 0; c < 65536; ++c) {
    float f = precis_bf16_to_f32(static_cast<uint16_t>(c));
    EXPECT_EQ(Bits(f), c << 16);
    uint16_t back = precis_f32_to_bf16_rn(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(precis_bf16_to_f32(back))) << c;
      EXPECT_EQ(back & 0x8000, c & 0x8000) << c;
    } else {
      EXPECT_EQ(back, c) << c;
    }
  }
}

uint16_t RefBf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  if (std::isinf(f)) return static_cast<uint16_t>(Bits(f) >> 16);
  double r = RoundToFormat(f, 7, -126);
  if (std::fabs(r) > 3.3895313892515355e38) return static_cast<uint16_t>((Bits(f) >> 16 & 0x8000) | 0x7F80);
  float rf = static_cast<float>(r);  // exact: r is a bf16 value
  uint32_t b = Bits(rf);
  EXPECT_EQ(b & 0xFFFF, 0u);
  return static_cast<uint16_t>(b >> 16);
}

// 2M random floats: encode(f) is ref(f), and a NaN stays a NaN (payloads aside).
void ExpectRandomMatches(uint16_t (*encode)(float), float (*decode)(uint16_t),
                         uint16_t (*ref)(float)) {
  for (int i = 0; i < 2000000; ++i) {
    float f = RandomFloat();
    uint16_t got = encode(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(decode(got)));
      continue;
    }
    ASSERT_EQ(got, ref(f)) << "f=" << f << " bits=" << std::hex << Bits(f);
  }
}

TEST(ConvertBf16, RandomMatchesReference) {
  ExpectRandomMatches(precis_f32_to_bf16_rn, precis_bf16_to_f32, RefBf16);
}

TEST(ConvertBf16, TiesToEven) {
  // 1 + 2^-8 is half-way between 1 and 1 + 2^-7: even is 1.
  EXPECT_EQ(precis_f32_to_bf16_rn(FromBits(0x3F808000u)), 0x3F80);
  // 1 + 3*2^-8: half-way between 1+2^-7 (odd) and 1+2^-6 (even).
  EXPECT_EQ(precis_f32_to_bf16_rn(FromBits(0x3F818000u)), 0x3F82);
  EXPECT_EQ(precis_f32_to_bf16_rn(FromBits(0x3F808001u)), 0x3F81);
  // Largest finite rounds to inf past the half-way point.
  EXPECT_EQ(precis_f32_to_bf16_rn(FromBits(0x7F7F8000u)), 0x7F80);
  EXPECT_EQ(precis_f32_to_bf16_rn(FromBits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(precis_f32_to_bf16_rn(-0.0f), 0x8000);
}

TEST(ConvertBf16, NanStaysQuietNan) {
  // A NaN whose payload lives only in the low 16 bits must not become inf.
  for (uint32_t u : {0x7F800001u, 0x7F80FFFFu, 0xFF800001u, 0x7FFFFFFFu, 0x7FC00000u}) {
    uint16_t b = precis_f32_to_bf16_rn(FromBits(u));
    EXPECT_TRUE(std::isnan(precis_bf16_to_f32(b))) << std::hex << u;
    EXPECT_TRUE(b & 0x0040) << std::hex << u;  // quiet bit
    EXPECT_EQ(b & 0x8000, (u >> 16) & 0x8000);
  }
}

// precis_f32_to_bf16_rn as first written, on integers alone: a NaN keeps its top
// bits with the quiet bit set, anything else rounds to nearest even by adding
// 0x7FFF plus the lowest kept bit. The header's form (shaped so GCC keeps 32-bit
// lanes in AVX-512 loops) must give these bits for every one of the 2^32 inputs.
uint16_t Bf16ByIntegers(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

TEST(ConvertBf16, EveryInputMatchesIntegerDefinition) {
  uint64_t mismatches = 0;
  uint32_t first_bad = 0;
  uint32_t u = 0;
  do {
    if (precis_f32_to_bf16_rn(FromBits(u)) != Bf16ByIntegers(u)) {
      if (mismatches++ == 0) first_bad = u;
    }
  } while (++u != 0);
  EXPECT_EQ(mismatches, 0u) << "first at bits " << std::hex << first_bad;
}

// ---- fp16 ------------------------------------------------------------------

double Fp16Value(uint32_t c) {  // by definition
  int s = (c >> 15) & 1, e = (c >> 10) & 31, m = c & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  return s ? -v : v;
}

TEST(ConvertFp16, AllCodesDecodeAndRoundTrip) {
  for (uint32_t c = 0; c < 65536; ++c) {
    float f = precis_f16_to_f32(static_cast<uint16_t>(c));
    double want = Fp16Value(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(Bits(f) >> 31, c >> 15) << c;
      EXPECT_TRUE(std::isnan(precis_f16_to_f32(precis_f32_to_f16_rn(f)))) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(f), want) << c;
    EXPECT_EQ(std::signbit(f), (c >> 15) != 0) << c;
    EXPECT_EQ(precis_f32_to_f16_rn(f), c) << c;
  }
}

uint16_t RefF16(float f) {
  uint16_t sign = static_cast<uint16_t>((Bits(f) >> 16) & 0x8000);
  if (std::isnan(f)) return 0x7E00;
  double r = RoundToFormat(f, 10, -14);
  if (std::fabs(r) > 65504.0 || std::isinf(f)) return sign | 0x7C00;
  // Find the code: encode r exactly.
  double a = std::fabs(r);
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);
  int exp = e - 1;
  if (exp < -14) return static_cast<uint16_t>(sign | static_cast<uint16_t>(a / std::ldexp(1.0, -24)));
  uint32_t mant = static_cast<uint32_t>(a / std::ldexp(1.0, exp - 10)) - 1024;
  return static_cast<uint16_t>(sign | ((exp + 15) << 10) | mant);
}

TEST(ConvertFp16, RandomMatchesReference) {
  ExpectRandomMatches(precis_f32_to_f16_rn, precis_f16_to_f32, RefF16);
}

// The compiler's own half type: aarch64's __fp16 (FCVT; G++ 12 has no
// _Float16 in C++ there), else _Float16 where the compiler has it.
#if defined(__aarch64__)
using CompilerHalf = __fp16;
#define PR_HAS_COMPILER_HALF 1
#elif defined(__FLT16_MAX__)
using CompilerHalf = _Float16;
#define PR_HAS_COMPILER_HALF 1
#endif

#if defined(PR_HAS_COMPILER_HALF)
// The compiler's own conversion (F16C, FCVT or libgcc soft-float), a third opinion.
TEST(ConvertFp16, MatchesCompilerFloat16) {
  for (int i = 0; i < 2000000; ++i) {
    float f = RandomFloat();
    CompilerHalf h = static_cast<CompilerHalf>(f);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    uint16_t got = precis_f32_to_f16_rn(f);
    ASSERT_EQ(got, hb) << "f=" << f << " bits=" << std::hex << Bits(f);  // NaNs too
  }
  for (uint32_t c = 0; c < 65536; ++c) {
    uint16_t cc = static_cast<uint16_t>(c);
    CompilerHalf h;
    std::memcpy(&h, &cc, 2);
    float want = static_cast<float>(h);
    EXPECT_EQ(Bits(precis_f16_to_f32(cc)), Bits(want)) << c;
  }
}
#endif

#if defined(__x86_64__)
// The F16C instructions the avx2/avx512 kernels use must agree bit for bit with
// the portable conversions the scalar path and the GPU use, NaNs included.
__attribute__((target("avx,f16c"))) uint16_t F16cEncode(float f) {
  return static_cast<uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}
__attribute__((target("avx,f16c"))) float F16cDecode(uint16_t h) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

TEST(ConvertFp16, MatchesF16cInstructions) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t c = 0; c < 65536; ++c) {
    uint16_t h = static_cast<uint16_t>(c);
    ASSERT_EQ(Bits(precis_f16_to_f32(h)), Bits(F16cDecode(h))) << c;
  }
  for (int i = 0; i < 2000000; ++i) {
    float f = RandomFloat();
    ASSERT_EQ(precis_f32_to_f16_rn(f), F16cEncode(f)) << "bits=" << std::hex << Bits(f);
  }
  for (uint32_t u : {0x7F800001u, 0xFF800001u, 0x7FC00000u, 0x7FFFFFFFu, 0x7FA02000u}) {
    EXPECT_EQ(precis_f32_to_f16_rn(FromBits(u)), F16cEncode(FromBits(u))) << std::hex << u;
  }
}
#endif

TEST(ConvertFp16, TiesSubnormalsOverflow) {
  // 1 + 2^-11: tie between 1 and 1+2^-10 -> 1 (even).
  EXPECT_EQ(precis_f32_to_f16_rn(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3*2^-11: tie -> 1 + 2^-9 (even mantissa 2).
  EXPECT_EQ(precis_f32_to_f16_rn(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Smallest subnormal 2^-24; half of it ties to 0; a bit more rounds up.
  EXPECT_EQ(precis_f32_to_f16_rn(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(precis_f32_to_f16_rn(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(precis_f32_to_f16_rn(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  EXPECT_EQ(precis_f32_to_f16_rn(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 ulp -> 2
  EXPECT_EQ(precis_f32_to_f16_rn(-std::ldexp(1.0f, -26)), 0x8000);
  // Largest subnormal rounding into the smallest normal.
  EXPECT_EQ(precis_f32_to_f16_rn(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)), 0x0400);
  // Overflow: 65504 max; 65519.99 -> max; 65520 -> inf.
  EXPECT_EQ(precis_f32_to_f16_rn(65504.0f), 0x7BFF);
  EXPECT_EQ(precis_f32_to_f16_rn(65519.996f), 0x7BFF);
  EXPECT_EQ(precis_f32_to_f16_rn(65520.0f), 0x7C00);
  EXPECT_EQ(precis_f32_to_f16_rn(-1e30f), 0xFC00);
  EXPECT_EQ(precis_f32_to_f16_rn(INFINITY), 0x7C00);
  EXPECT_EQ(precis_f32_to_f16_rn(-INFINITY), 0xFC00);
  EXPECT_TRUE(std::isnan(precis_f16_to_f32(precis_f32_to_f16_rn(NAN))));
  EXPECT_EQ(precis_f32_to_f16_rn(1e-30f), 0x0000);
}

// ---- fp8 E4M3fn ------------------------------------------------------------

double Fp8Value(uint32_t c) {  // by definition (OCP E4M3, "fn")
  int s = (c >> 7) & 1, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -v : v;
}

TEST(ConvertFp8, AllCodes) {
  for (uint32_t c = 0; c < 256; ++c) {
    float f = precis_fp8_to_f32(static_cast<uint8_t>(c));
    double want = Fp8Value(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(precis_f32_to_fp8_rn(f) & 0x7F, 0x7F) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(f), want) << c;
    EXPECT_EQ(std::signbit(f), (c >> 7) != 0) << c;
    EXPECT_EQ(precis_f32_to_fp8_rn(f), c) << c;
  }
  EXPECT_EQ(precis_fp8_to_f32(0x7E), 448.0f);
  EXPECT_EQ(precis_fp8_to_f32(0xFE), -448.0f);
  EXPECT_EQ(precis_fp8_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(precis_fp8_to_f32(0x08), std::ldexp(1.0f, -6));
}

// Brute force: nearest finite code, ties to the even code (even mantissa).
uint8_t RefFp8(float f) {
  if (std::isnan(f)) return 0x7F;
  double a = std::fabs(static_cast<double>(f));
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (a >= 448.0) return sign | 0x7E;  // saturate (incl. inf)
  uint8_t best = 0;
  double best_d = INFINITY;
  for (uint32_t c = 0; c <= 0x7E; ++c) {
    double d = std::fabs(Fp8Value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best_d = d;
      best = static_cast<uint8_t>(c);
    }
  }
  return sign | best;
}

TEST(ConvertFp8, RandomMatchesBruteForce) {
  std::uniform_real_distribution<double> d(-12.0, 10.0);
  for (int i = 0; i < 300000; ++i) {
    float f;
    if (i % 3 == 0) {
      f = RandomFloat();
    } else {
      f = static_cast<float>(std::exp2(d(Rng())));
      if (i & 1) f = -f;
    }
    ASSERT_EQ(precis_f32_to_fp8_rn(f), RefFp8(f)) << "f=" << f;
  }
  // Every exact midpoint between adjacent codes ties to even.
  for (uint32_t c = 0; c < 0x7E; ++c) {
    float mid = static_cast<float>((Fp8Value(c) + Fp8Value(c + 1)) / 2);
    uint8_t want = (c & 1) ? static_cast<uint8_t>(c + 1) : static_cast<uint8_t>(c);
    EXPECT_EQ(precis_f32_to_fp8_rn(mid), want) << c;
    EXPECT_EQ(precis_f32_to_fp8_rn(-mid), want | 0x80) << c;
  }
}

TEST(ConvertFp8, SaturationAndSpecials) {
  EXPECT_EQ(precis_f32_to_fp8_rn(448.0f), 0x7E);
  EXPECT_EQ(precis_f32_to_fp8_rn(464.0f), 0x7E);  // tie with 480 (not a value) -> 448
  EXPECT_EQ(precis_f32_to_fp8_rn(500.0f), 0x7E);
  EXPECT_EQ(precis_f32_to_fp8_rn(1e38f), 0x7E);
  EXPECT_EQ(precis_f32_to_fp8_rn(-1e38f), 0xFE);
  EXPECT_EQ(precis_f32_to_fp8_rn(INFINITY), 0x7E);
  EXPECT_EQ(precis_f32_to_fp8_rn(-INFINITY), 0xFE);
  EXPECT_EQ(precis_f32_to_fp8_rn(NAN), 0x7F);
  EXPECT_EQ(precis_f32_to_fp8_rn(-NAN), 0x7F);
  EXPECT_EQ(precis_f32_to_fp8_rn(std::ldexp(1.0f, -10)), 0x00);          // tie to 0
  EXPECT_EQ(precis_f32_to_fp8_rn(std::ldexp(1.0f, -10) * 1.01f), 0x01);  // above tie
  EXPECT_EQ(precis_f32_to_fp8_rn(3 * std::ldexp(1.0f, -10)), 0x02);      // 1.5 ulp -> 2
  EXPECT_EQ(precis_f32_to_fp8_rn(-0.0f), 0x80);
  EXPECT_EQ(precis_f32_to_fp8_rn(1e-30f), 0x00);
  EXPECT_EQ(precis_f32_to_fp8_rn(1.0f), 0x38);
}

}  // namespace
