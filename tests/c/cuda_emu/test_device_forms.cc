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

// The hot loop's word forms (common.cuh): each code as the CPU form makes it.
TEST(DeviceForms, MomentSrTopBytesMatch) {
  std::mt19937 rng(13);
  const float multipliers[] = {0.0f, 1.0f, 7.875f / 3e-4f, 126.0f / 0.02f, 65504.0f / 9.5f,
                               1e30f, 3e-12f, 7.875f / 7.875f, 126.0f / 126.0f};
  size_t i = 0, bad = 0;
  ForEachMagnitude(367, [&](uint32_t mag) {
    for (int sign = 0; sign < 2; ++sign) {
      float x;
      const uint32_t u = mag | (sign ? 0x80000000u : 0u);
      std::memcpy(&x, &u, sizeof x);
      const float mul = multipliers[i % 9];
      const uint32_t r = RFor(i++, rng);
      const uint32_t m = precis::m8_sr_top(x, mul, r) >> 24;
      const uint32_t v = precis::v8_sr_top(x, mul, r) >> 24;
      if ((m != precis_moment_sr_fp8(x, mul, 0, r) || v != precis_moment_sr_fp8(x, mul, 1, r)) &&
          bad++ < 10) {
        ADD_FAILURE() << std::hex << u << " mul " << mul << " r " << r << ": " << m << " " << v;
      }
    }
  });
  EXPECT_EQ(bad, 0u);
}

TEST(DeviceForms, WordDecodesEveryCode) {
  for (uint32_t c = 0; c < 256u; ++c) {
    for (int k = 0; k < 4; ++k) {
      const uint32_t w = (c << (8 * k)) | (0xA5u << (8 * ((k + 1) & 3)));  // other bytes set
      ASSERT_EQ(Bits(precis::m8_byte_to_f32(w, k)), Bits(precis_m8_to_f32((uint8_t)c))) << c;
    }
  }
  for (uint32_t param = 0; param < 0x10000u; param += 7) {
    for (uint32_t rem = 0; rem < 256u; ++rem) {
      const float want = precis_remainder8_master((uint16_t)param, (int8_t)(uint8_t)rem);
      const int k = (int)((param + rem) & 3), h = (int)(rem & 1);
      const uint32_t p = h ? param << 16 | 0x5A5Au : param | 0xC3C30000u;
      const uint32_t x = rem << (8 * k) | (0x81u << (8 * ((k + 2) & 3)));
      ASSERT_EQ(Bits(precis::remainder8_master_word(p, h, x, k)), Bits(want))
          << param << " " << rem;
    }
  }
}

// The 24-bit master's word: the param (bytes 2-3 after + 0x8000) and the remainder (byte
// 1), over a stride of every float and each power of two's neighbours, NaNs included.
TEST(DeviceForms, Master24WordMatches) {
  size_t bad = 0;
  auto check = [&](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    const uint32_t w = precis::master24_word(f);
    const uint32_t param = precis::prmt(w + 0x8000u, 0u, 0x4432u);
    const uint32_t low = precis::pack_byte1(w, 0u, 0u, 0u);
    if ((param != precis_remainder8_param(f) ||
         low != (uint32_t)(uint8_t)precis_remainder8_low(f)) && bad++ < 10) {
      ADD_FAILURE() << std::hex << u << ": " << param << " " << low;
    }
  };
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 97) check((uint32_t)u);
  for (uint32_t e = 0; e < 256u; ++e) {
    for (uint32_t s = 0; s < 2; ++s) {
      for (uint32_t m = 0; m < 0x800000u; m += (m < 0x1000u || m > 0x7FF000u) ? 1 : 0x7F) {
        check(s << 31 | e << 23 | m);
      }
    }
  }
  EXPECT_EQ(bad, 0u);
}

TEST(DeviceForms, PackTopBytes) {
  EXPECT_EQ(precis::pack_top_bytes(0x11FFFFFFu, 0x22000000u, 0x33ABCDEFu, 0x44123456u),
            0x44332211u);
  EXPECT_EQ(precis::pack_byte1(0xFFFF11FFu, 0x00002200u, 0xABCD33EFu, 0x12344456u), 0x44332211u);
  EXPECT_EQ(precis::prmt(0x000080FFu, 0u, 0x8914u), 0xFFFF8000u);  // sign-replicated bytes
}

}  // namespace
