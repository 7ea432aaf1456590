// The moment stores of csrc/stores.h: the m8 and v8 codes of fp8 moments,
// round to nearest and stochastic rounding into unsigned minifloat codes, the
// Weyl-sequence random numbers, and which stores round stochastically.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "stores.h"
#include "precis_convert.h"

namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The formats the stores use: (mantissa bits, bias, largest code).
struct Format {
  const char* name;
  int mb, bias;
  uint32_t max_code;
};
const Format kFormats[] = {{"v8", PRECIS_V8_MBITS, PRECIS_V8_BIAS, PRECIS_V8_MAX_CODE},
                           {"m8", PRECIS_M8_MBITS, PRECIS_M8_BIAS, PRECIS_M8_MAX_CODE},
                           {"fp16", 10, 15, 0x7BFF}};

double Decode(const Format& f, uint32_t code) {
  return precis_ufloat_to_f32(code, f.mb, f.bias);
}

// Independent reference: the two codes around a (0 <= a <= max value), by search
// over the decoded table (which must be increasing).
void Neighbours(const Format& f, double a, uint32_t* lo, uint32_t* hi) {
  uint32_t l = 0, h = f.max_code;
  while (h - l > 1) {
    uint32_t mid = (l + h) / 2;
    if (Decode(f, mid) <= a) {
      l = mid;
    } else {
      h = mid;
    }
  }
  *lo = l;
  *hi = Decode(f, l) == a ? l : h;
}

TEST(V8Code, DecodeTable) {
  EXPECT_EQ(precis_v8_to_f32(0), 0.0f);
  EXPECT_EQ(precis_v8_to_f32(0xFF), PRECIS_V8_MAX);
  EXPECT_EQ(precis_moment_max(1, 1), PRECIS_V8_MAX);
  EXPECT_EQ(precis_moment_max(1, 0), PRECIS_M8_MAX);
  for (int c = 0; c < 256; ++c) {
    int e = c >> 5, m = c & 31;
    double want = e == 0 ? m / 32.0 : std::ldexp(1.0 + m / 32.0, e - 1);
    EXPECT_EQ(precis_v8_to_f32(static_cast<uint8_t>(c)), want) << c;
    if (c > 0) {
      EXPECT_LT(precis_v8_to_f32(static_cast<uint8_t>(c - 1)), precis_v8_to_f32(static_cast<uint8_t>(c)));
    }
  }
  for (const Format& f : kFormats) {
    for (uint32_t c = 1; c <= f.max_code; ++c) ASSERT_LT(Decode(f, c - 1), Decode(f, c)) << f.name << c;
  }
}

// m8, signed E2M5 with bias 1: every one of the 256 codes by definition, -0
// included; the magnitudes increase with the code.
TEST(M8Code, DecodeTable) {
  EXPECT_EQ(precis_m8_to_f32(0x7F), 7.875f);
  EXPECT_EQ(precis_m8_to_f32(0xFF), -7.875f);
  EXPECT_EQ(PRECIS_M8_MAX, 7.875f);
  for (int c = 0; c < 256; ++c) {
    int e = (c >> 5) & 3, m = c & 31;
    double mag = e == 0 ? m / 32.0 : std::ldexp(1.0 + m / 32.0, e - 1);
    double want = (c & 0x80) ? -mag : mag;
    float got = precis_m8_to_f32(static_cast<uint8_t>(c));
    EXPECT_EQ(got, want) << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;
    EXPECT_EQ(precis_moment_code_f32(PRECIS_DTYPE_FP8_E4M3, 0, static_cast<uint32_t>(c)), got) << c;
    if ((c & 0x7F) > 0) {
      EXPECT_LT(std::fabs(precis_m8_to_f32(static_cast<uint8_t>(c - 1))), std::fabs(got)) << c;
    }
  }
}

// m8 round to nearest (precis_moment_q_fp8), against a brute-force search over
// all 256 codes: the nearest value, ties to the even code, the sign kept (-0
// too), saturating at +-7.875 (inf too); NaN takes the largest magnitude.
TEST(M8Code, RoundToNearestAgainstAllCodes) {
  std::mt19937 rng(5);
  auto brute = [](float q) {
    if (std::fabs(q) > 7.875f) return static_cast<uint8_t>(std::signbit(q) ? 0xFF : 0x7F);
    int best = -1;
    double best_d = 0;
    for (int c = 0; c < 256; ++c) {
      float v = precis_m8_to_f32(static_cast<uint8_t>(c));
      if (std::signbit(v) != std::signbit(q)) continue;
      double d = std::fabs(static_cast<double>(v) - q);
      if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
        best = c;
        best_d = d;
      }
    }
    return static_cast<uint8_t>(best);
  };
  std::vector<float> qs = {0.0f, -0.0f, 7.875f, -7.875f, 7.9f, 100.0f, -1e30f, INFINITY, -INFINITY,
                           1e-30f, -1e-30f, 1.0f / 64, 3.0f / 64, -1.0f / 64};
  for (int c = 0; c < 256; ++c) {  // every code and every midpoint (the ties)
    float v = precis_m8_to_f32(static_cast<uint8_t>(c));
    qs.push_back(v);
    if ((c & 0x7F) < 0x7F) qs.push_back(0.5f * (v + precis_m8_to_f32(static_cast<uint8_t>(c + 1))));
  }
  for (int k = 0; k < 100000; ++k) {
    float mag = static_cast<float>(std::ldexp(1.0 + (rng() % 100000) / 100000.0,
                                              static_cast<int>(rng() % 14) - 10));
    qs.push_back(rng() & 1 ? -mag : mag);
  }
  for (float q : qs) ASSERT_EQ(precis_moment_q_fp8(q, 1.0f, 0), brute(q)) << q;
  EXPECT_EQ(precis_moment_q_fp8(NAN, 1.0f, 0), PRECIS_M8_MAX_CODE);
  EXPECT_EQ(precis_moment_q_fp8(-NAN, 1.0f, 0), PRECIS_M8_MAX_CODE);
}

// m8 stochastic rounding (precis_moment_sr_fp8) of signed values is unbiased:
// over the 2^16 values of m's half of the hash the mean decoded value is the
// input within spacing / 4096, for inputs between every pair of neighbouring
// codes, either sign.
TEST(M8Code, StochasticRoundingUnbiased) {
  const double kFractions[] = {0.0, 1e-6, 0.3, 0.5, 0.77, 0.999};
  for (int c = 0; c < 0x7F; ++c) {
    const double lo = precis_m8_to_f32(static_cast<uint8_t>(c));
    const double hi = precis_m8_to_f32(static_cast<uint8_t>(c + 1));
    for (double fr : kFractions) {
      for (int sign : {1, -1}) {
        const float q = static_cast<float>(sign * (lo + fr * (hi - lo)));
        double sum = 0;
        for (uint32_t half = 0; half < 65536u; ++half) {
          sum += precis_m8_to_f32(precis_moment_sr_fp8(q, 1.0f, 0, precis_moment_rand(half, 0, 3)));
        }
        ASSERT_NEAR(sum / 65536.0, q, (hi - lo) / 4096.0) << "code " << c << " + " << fr;
      }
    }
  }
}

// Round to nearest, ties to even code, saturating: against the table.
TEST(UfloatCodes, RoundToNearestIsNearest) {
  std::mt19937 rng(7);
  for (const Format& f : kFormats) {
    const double top = Decode(f, f.max_code);
    for (int k = 0; k < 400000; ++k) {
      // uniform over the exponents the format covers, and a few past its top
      float a = FromBits(rng() % 0x7F800000u);
      if (a > 4 * top || a < std::ldexp(1.0, -f.bias - f.mb - 4)) {
        a = static_cast<float>(std::ldexp(1.0 + (rng() % 1024) / 1024.0,
                                          static_cast<int>(rng() % 40) - 20 + (f.mb > 5 ? 0 : -2)));
      }
      uint32_t code = precis_f32_to_ufloat_rn(a, f.mb, f.bias, f.max_code);
      uint32_t lo, hi;
      if (a >= top) {
        ASSERT_EQ(code, f.max_code) << f.name << " " << a;
        continue;
      }
      Neighbours(f, a, &lo, &hi);
      double dl = a - Decode(f, lo), dh = Decode(f, hi) - a;
      uint32_t want = dl < dh ? lo : (dh < dl ? hi : ((lo & 1) ? hi : lo));
      ASSERT_EQ(code, want) << f.name << " " << a;
    }
    EXPECT_EQ(precis_f32_to_ufloat_rn(INFINITY, f.mb, f.bias, f.max_code), f.max_code);
    EXPECT_EQ(precis_f32_to_ufloat_rn(NAN, f.mb, f.bias, f.max_code), f.max_code);
  }
}

// Stochastic rounding lands on one of the two neighbours, keeps representable
// values, floors with r = 0 and ceils with r = 2^32 - 1.
TEST(UfloatCodes, StochasticRoundingPicksANeighbour) {
  std::mt19937 rng(11);
  for (const Format& f : kFormats) {
    const double top = Decode(f, f.max_code);
    for (int k = 0; k < 200000; ++k) {
      double a = top * std::ldexp(1.0, -static_cast<int>(rng() % 12)) * ((rng() % 100000) / 100000.0);
      float af = static_cast<float>(a);
      uint32_t lo, hi;
      Neighbours(f, af, &lo, &hi);
      uint32_t r = rng();
      uint32_t code = precis_f32_to_ufloat_sr(af, r, f.mb, f.bias, f.max_code);
      ASSERT_TRUE(code == lo || code == hi) << f.name << " " << af << " r " << r;
      ASSERT_EQ(precis_f32_to_ufloat_sr(af, 0u, f.mb, f.bias, f.max_code), lo) << f.name << " " << af;
      ASSERT_EQ(precis_f32_to_ufloat_sr(af, 0xFFFFFFFFu, f.mb, f.bias, f.max_code), hi)
          << f.name << " " << af;
    }
    for (uint32_t c = 0; c <= f.max_code; c += 7) {
      float x = static_cast<float>(Decode(f, c));
      EXPECT_EQ(precis_f32_to_ufloat_sr(x, rng(), f.mb, f.bias, f.max_code), c) << f.name << c;
    }
    EXPECT_EQ(precis_f32_to_ufloat_sr(INFINITY, rng(), f.mb, f.bias, f.max_code), f.max_code);
    EXPECT_EQ(precis_f32_to_ufloat_sr(NAN, rng(), f.mb, f.bias, f.max_code), f.max_code);
    EXPECT_EQ(precis_f32_to_ufloat_sr(static_cast<float>(4 * top), rng(), f.mb, f.bias, f.max_code),
              f.max_code);
  }
}

// Unbiased: over an even grid of K random numbers the mean of the decoded codes
// is the input, to within the grid's resolution (spacing / K).
TEST(UfloatCodes, StochasticRoundingIsUnbiased) {
  const int kGrid = 4096;
  std::mt19937 rng(13);
  for (const Format& f : kFormats) {
    const double top = Decode(f, f.max_code);
    for (int k = 0; k < 300; ++k) {
      // normal and subnormal inputs alike
      double a = top * std::ldexp(1.0, -static_cast<int>(rng() % (f.mb > 5 ? 30 : 14))) *
                 ((rng() % 100000) / 100000.0);
      float af = static_cast<float>(a);
      uint32_t lo, hi;
      Neighbours(f, af, &lo, &hi);
      double sum = 0;
      for (int i = 0; i < kGrid; ++i) {
        uint32_t r = static_cast<uint32_t>(i) * (0x100000000ull / kGrid);
        sum += Decode(f, precis_f32_to_ufloat_sr(af, r, f.mb, f.bias, f.max_code));
      }
      double spacing = Decode(f, hi) - Decode(f, lo);
      ASSERT_NEAR(sum / kGrid, af, spacing / kGrid * 1.01 + 1e-30) << f.name << " " << af;
    }
  }
}

// Unbiased with precis_moment_rand's r, whose 16 random bits are all the
// normal range's drop of 18 (m8, v8), 13 (fp16) and the subnormal
// range's get: for every code of the fp8 formats (every 64th of fp16) and
// points between it and the next, subnormals included, the mean over all 2^16
// values of the moment's half of the hash is the input within spacing / 4096,
// for either moment and at steps whose Weyl term leaves different low bits.
TEST(MomentRand, SixteenBitsRoundEveryCodeUnbiased) {
  const double kFractions[] = {0.0, 1e-6, 0.3, 0.5, 0.77, 0.999};
  for (const Format& f : kFormats) {
    const uint32_t stride = f.mb > 5 ? 64u : 1u;
    for (uint32_t c = 0; c < f.max_code; c += stride) {
      const double lo = Decode(f, c), hi = Decode(f, c + 1);
      for (double fr : kFractions) {
        const float a = static_cast<float>(lo + fr * (hi - lo));
        for (int second = 0; second < 2; ++second) {
          for (int64_t step : {1, 6}) {
            double sum = 0;
            for (uint32_t half = 0; half < 65536u; ++half) {
              const uint32_t hash = second ? half << 16 : half;
              const uint32_t r = precis_moment_rand(hash, second, step);
              sum += Decode(f, precis_f32_to_ufloat_sr(a, r, f.mb, f.bias, f.max_code));
            }
            ASSERT_NEAR(sum / 65536.0, a, (hi - lo) / 4096.0)
                << f.name << " code " << c << " + " << fr << " moment " << second;
          }
        }
      }
    }
  }
}

// Signed stores: the sign is kept and the magnitude rounded as above; NaN takes
// a fixed code; a positive second moment never rounds to zero.
TEST(MomentStores, SignNanAndNeverZero) {
  std::mt19937 rng(17);
  for (int k = 0; k < 10000; ++k) {
    float x = static_cast<float>((rng() % 100000) / 10000.0);
    uint32_t r = rng();
    uint8_t pos = precis_moment_sr_fp8(x, 1.0f, 0, r), neg = precis_moment_sr_fp8(-x, 1.0f, 0, r);
    ASSERT_EQ(neg, pos | 0x80) << x;
    uint16_t hp = precis_moment_sr_f16(x, 1.0f, 0, r), hn = precis_moment_sr_f16(-x, 1.0f, 0, r);
    ASSERT_EQ(hn, hp | 0x8000) << x;
  }
  EXPECT_EQ(precis_moment_sr_fp8(NAN, 1.0f, 0, 123u), 0x7F);  // m8's largest magnitude
  EXPECT_EQ(precis_moment_sr_f16(NAN, 1.0f, 1, 123u), precis_f32_to_f16_rn(NAN));
  EXPECT_EQ(precis_moment_sr_fp8(1000.0f, 1.0f, 0, 0xFFFFFFFFu), 0x7F);  // saturates at 7.875
  EXPECT_EQ(precis_moment_sr_fp8(-INFINITY, 1.0f, 0, 0u), 0xFF);
  EXPECT_EQ(precis_moment_sr_fp8(-0.0f, 1.0f, 0, 0xFFFFFFFFu), 0x80);  // -0 stays -0
  // The smallest positive v8 step is 2^-5: far below it still stores code 1.
  EXPECT_EQ(precis_moment_sr_fp8(1e-12f, 1.0f, 1, 0u), 1);
  EXPECT_EQ(precis_moment_q_fp8(1e-12f, 1.0f, 1), 1);
  EXPECT_EQ(precis_moment_sr_f16(1e-12f, 1.0f, 1, 0u), 1);
  EXPECT_EQ(precis_moment_sr_fp8(-0.0f, 1.0f, 1, 0u), 0);
}

// The random numbers: one hash per element and step for both moments, each
// moment's r a Weyl sequence over the steps of one element with its 16 bits of
// the hash on top; a key per param stream and seed, apart from the params'.
TEST(MomentRand, WeylSequenceAndStreams) {
  precis_sr_key_t k = precis_moment_key(42, 3);
  for (uint32_t i = 0; i < 1000; ++i) {
    const uint32_t h = precis_moment_hash(k, i);
    for (int second = 0; second < 2; ++second) {
      for (int64_t s = 1; s < 50; s += 7) {
        ASSERT_EQ(precis_moment_rand(h, second, s + 1) - precis_moment_rand(h, second, s),
                  PRECIS_WEYL32);
      }
    }
    // The step adds to bits below the moment's 16: at step 0 r is those bits alone.
    ASSERT_EQ(precis_moment_rand(h, 0, 0), h << 16);
    ASSERT_EQ(precis_moment_rand(h, 1, 0), h & 0xFFFF0000u);
  }
  precis_sr_key_t t = precis_moment_key(42, 4);
  precis_sr_key_t s = precis_moment_key(43, 3);
  precis_sr_key_t p = precis_sr_key(42, 3, 1);  // the param's own rounding
  for (const precis_sr_key_t& other : {t, s, p}) {
    EXPECT_FALSE(other.k0 == k.k0 && other.k1 == k.k1);
  }
}

// Each moment's 16 bits are uniform across the elements of a step (chi-square
// over 256 buckets of the top 8 bits, and over the 16 values of the bottom 4),
// and the two moments' bits are independent (chi-square over the 16 x 16 pairs
// of their top 4 bits).
TEST(MomentRand, HalvesUniformAndIndependent) {
  const int n = 1 << 18;
  const precis_sr_key_t k = precis_moment_key(7, 11);
  std::vector<int> top_m(256), top_v(256), low_m(16), low_v(16), pair(256);
  for (uint32_t i = 0; i < static_cast<uint32_t>(n); ++i) {
    const uint32_t h = precis_moment_hash(k, i + 12345u);
    const uint32_t rm = precis_moment_rand(h, 0, 5), rv = precis_moment_rand(h, 1, 5);
    ++top_m[rm >> 24];
    ++top_v[rv >> 24];
    ++low_m[(h >> 0) & 15u];   // m's lowest 4 of its 16
    ++low_v[(h >> 16) & 15u];  // v's
    ++pair[((rm >> 28) << 4) | (rv >> 28)];
  }
  auto chi2 = [](const std::vector<int>& hist, double n) {
    const double e = n / static_cast<double>(hist.size());
    double c = 0.0;
    for (int h : hist) c += (h - e) * (h - e) / e;
    return c;
  };
  // 255 degrees of freedom: mean 255, sd 22.6, so 400 is above 6 sd; 15: mean
  // 15, sd 5.5, so 50 is above 6 sd.
  EXPECT_LT(chi2(top_m, n), 400.0);
  EXPECT_LT(chi2(top_v, n), 400.0);
  EXPECT_LT(chi2(pair, n), 400.0);
  EXPECT_LT(chi2(low_m, n), 50.0);
  EXPECT_LT(chi2(low_v, n), 50.0);
}

// Which stores round stochastically (docs/design.md section 4): Adam's v and fp8 m,
// and a one-state rule's momentum in every dtype but fp32.
TEST(MomentStores, WhichRoundStochastically) {
  const int adam = PRECIS_RULE_ADAM;
  EXPECT_FALSE(precis_moment_store_sr(PRECIS_DTYPE_FP32, 0, adam));
  EXPECT_FALSE(precis_moment_store_sr(PRECIS_DTYPE_FP32, 1, adam));
  EXPECT_FALSE(precis_moment_store_sr(PRECIS_DTYPE_BF16, 0, adam));
  EXPECT_FALSE(precis_moment_store_sr(PRECIS_DTYPE_FP16, 0, adam));
  EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_FP8_E4M3, 0, adam));
  EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_BF16, 1, adam));
  EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_FP16, 1, adam));
  EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_FP8_E4M3, 1, adam));
  for (int rule : {PRECIS_RULE_SGD, PRECIS_RULE_LION, PRECIS_RULE_MUON_MOMENTUM}) {
    EXPECT_FALSE(precis_moment_store_sr(PRECIS_DTYPE_FP32, 0, rule)) << rule;
    EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_BF16, 0, rule)) << rule;
    EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_FP16, 0, rule)) << rule;
    EXPECT_TRUE(precis_moment_store_sr(PRECIS_DTYPE_FP8_E4M3, 0, rule)) << rule;
  }
}

}  // namespace
