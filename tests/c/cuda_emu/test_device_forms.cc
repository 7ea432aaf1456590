// The exact device forms of cuda/common.cuh (fp16 loads, the fp8 moments' m8 / v8
// decodes and stochastic-rounding encodes) against the CPU forms of precis_convert.h
// and rules.h / stores.h they stand for: the same bits for every input, or, where the inputs
// are 2^32 x 2^32, for a dense sample and every boundary. The device forms multiply by
// powers of two through fp32 subnormals, exact without flush-to-zero: nvcc's default
// and this test's (x86 SSE, MXCSR untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "rules.h"
#include "stores.h"
#include "common.cuh"  // the emulator's cuda_runtime.h first on the include path

namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

TEST(DeviceForms, F16ToF32EveryInput) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    ASSERT_EQ(Bits(precis::f16_to_f32(h)), Bits(precis_f16_to_f32((uint16_t)h))) << std::hex << h;
  }
}

TEST(DeviceForms, FP8MomentDecodesEveryCode) {
  for (uint32_t c = 0; c < 256u; ++c) {
    ASSERT_EQ(Bits(precis::m8_to_f32(c)), Bits(precis_m8_to_f32((uint8_t)c))) << c;
    ASSERT_EQ(Bits(precis::v8_to_f32(c)), Bits(precis_v8_to_f32((uint8_t)c))) << c;
  }
}

// Calls f(u) for non-negative float bit patterns u: a stride through all of them,
// every pattern within 2^12 of each power of two (the rounding boundaries of both
// formats' subnormal and normal ranges lie there), zero, inf and NaNs.
template <typename F>
void ForEachMagnitude(uint32_t stride, F f) {
  for (uint64_t u = 0; u <= 0x7F800000u; u += stride) f((uint32_t)u);
  for (uint32_t e = 0; e < 255u; ++e) {
    const int64_t p = (int64_t)e << 23;
    for (int64_t d = -4096; d <= 4096; ++d) {
      if (p + d >= 0 && p + d <= 0x7F800000) f((uint32_t)(p + d));
    }
  }
  for (uint32_t nan : {0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0x7FA00000u}) f(nan);
}

// One r of every kind per input: none, all ones, a half, and a random one.
uint32_t RFor(size_t i, std::mt19937& rng) {
  switch (i % 4) {
    case 0: return 0u;
    case 1: return 0xFFFFFFFFu;
    case 2: return 0x80000000u;
    default: return (uint32_t)rng();
  }
}

TEST(DeviceForms, UfloatSrMatchesForBothFormats) {
  std::mt19937 rng(7);
  size_t i = 0, bad = 0;
  ForEachMagnitude(61, [&](uint32_t u) {
    float a;
    std::memcpy(&a, &u, sizeof a);
    for (int k = 0; k < 2; ++k) {
      const uint32_t r = RFor(i++, rng);
      // fp8 moments (m8's and v8's magnitudes: 5 mantissa bits, bias 1) and fp16.
      const bool same =
          precis::f32_to_ufloat_sr(a, r, 5, 1, PRECIS_V8_MAX_CODE) ==
              precis_f32_to_ufloat_sr(a, r, 5, 1, PRECIS_V8_MAX_CODE) &&
          precis::f32_to_ufloat_sr(a, r, 10, 15, 0x7BFFu) ==
              precis_f32_to_ufloat_sr(a, r, 10, 15, 0x7BFFu);
      if (!same && bad++ < 10) ADD_FAILURE() << std::hex << u << " r " << r;
    }
  });
  EXPECT_EQ(bad, 0u);
}

// The whole stores: values of either sign times block multipliers of every size, as
// store_moment quantizes them (NaNs and infinities included).
TEST(DeviceForms, MomentSrStoresMatch) {
  std::mt19937 rng(11);
  const float multipliers[] = {0.0f, 1.0f, 7.875f / 3e-4f, 126.0f / 0.02f, 65504.0f / 9.5f,
                               1e30f, 3e-12f};
  size_t i = 0, bad = 0;
  ForEachMagnitude(367, [&](uint32_t mag) {
    float x;
    const uint32_t u = mag | ((i & 8) ? 0x80000000u : 0u);
    std::memcpy(&x, &u, sizeof x);
    const float mul = multipliers[i % 7];
    const uint32_t r = RFor(i++, rng);
    for (int second = 0; second < 2; ++second) {
      const bool same =
          precis::moment_sr_fp8(x, mul, second, r) == precis_moment_sr_fp8(x, mul, second, r) &&
          precis::moment_sr_f16(x, mul, second, r) == precis_moment_sr_f16(x, mul, second, r);
      if (!same && bad++ < 10) {
        ADD_FAILURE() << std::hex << u << " mul " << mul << " r " << r << " second " << second;
      }
    }
  });
  EXPECT_EQ(bad, 0u);
}

}  // namespace
