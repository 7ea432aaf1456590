// precis_resync_masters against a plain reference written from its contract
// (precis.h): for a stale tensor with an fp32 master, an element whose master,
// rounded to nearest even to the param dtype, is not the param's bits takes the
// param's value; every element does when kept (the elements that still round) is
// at most max(1, n / 64) and not n (a whole load); int16 / fp8 (8-bit remainder
// bytes) masters are zeroed whole with kept 0; a tensor not stale is neither read
// nor written and gets kept = numel. An fp16 master follows the same rule with its
// value (exact in fp32) as the master's, and a rewrite stores the param's value
// rounded to nearest even into fp16. The reference rounds in double arithmetic
// from the formats' definitions, not with precis_convert.h. Random data at sizes 0,
// 1, 127, 4097 and 1000003 (and small ones around the steps of n / 64), bf16 and fp16
// params; the whole-load boundary exactly;
// several tensors with mixed flags; and each bad argument's status with nothing
// written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "precis/precis.h"

namespace {

constexpr precis_dtype_t F32 = PRECIS_DTYPE_FP32;
constexpr precis_dtype_t F16 = PRECIS_DTYPE_FP16;
constexpr precis_dtype_t B16 = PRECIS_DTYPE_BF16;
constexpr precis_dtype_t F8 = PRECIS_DTYPE_FP8_E4M3;
constexpr precis_dtype_t I16 = PRECIS_DTYPE_INT16;

const int64_t kSizes[] = {0, 1, 127, 4097, 1000003};

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

// ---- the formats, from their definitions --------------------------------------------

struct Format {
  int man;   // stored mantissa bits
  int bias;  // exponent bias
  int exp;   // exponent bits
};
const Format kBf16 = {7, 127, 8};
const Format kFp16 = {10, 15, 5};
const Format& Fmt(precis_dtype_t pd) { return pd == B16 ? kBf16 : kFp16; }

// x rounded to nearest, ties to even, into the format (as bits). NaN: a quiet NaN
// of x's sign keeping x's top payload bits.
uint16_t RefRound(float x, precis_dtype_t pd) {
  const Format& f = Fmt(pd);
  const uint32_t u = Bits(x);
  const uint16_t sign = (uint16_t)((u >> 31) << (f.man + f.exp));
  const uint16_t inf = (uint16_t)(((1u << f.exp) - 1) << f.man);
  if (std::isnan(x)) {
    const uint16_t payload = (uint16_t)((u & 0x7FFFFFu) >> (23 - f.man));
    return (uint16_t)(sign | inf | (1u << (f.man - 1)) | payload);
  }
  const double a = std::fabs((double)x);
  if (std::isinf(a)) return (uint16_t)(sign | inf);
  if (a == 0.0) return sign;
  const int emin = 1 - f.bias, emax = (1 << f.exp) - 2 - f.bias;
  int k;
  std::frexp(a, &k);  // a = m * 2^k, m in [0.5, 1)
  const int e = k - 1 < emin ? emin : k - 1;
  const double q = std::ldexp(1.0, e - f.man);  // the quantum at a's exponent
  const double r = std::nearbyint(a / q) * q;   // the default mode: ties to even
  const double max = std::ldexp(2.0 - std::ldexp(1.0, -f.man), emax);
  if (r > max) return (uint16_t)(sign | inf);
  if (r < std::ldexp(1.0, emin)) {  // subnormal (or zero)
    return (uint16_t)(sign | (uint16_t)(r / std::ldexp(1.0, emin - f.man)));
  }
  int k2;
  std::frexp(r, &k2);
  const int e2 = k2 - 1;
  const uint32_t mant = (uint32_t)(r / std::ldexp(1.0, e2 - f.man)) - (1u << f.man);
  return (uint16_t)(sign | (uint16_t)((e2 + f.bias) << f.man) | mant);
}

// The param's value as fp32 (exact). NaN: bf16's bits are fp32's top half; an fp16
// NaN is widened quiet, keeping its payload.
float RefValue(uint16_t p, precis_dtype_t pd) {
  const Format& f = Fmt(pd);
  if (pd == B16) return FromBits((uint32_t)p << 16);
  const uint32_t sign = (uint32_t)(p >> 15) << 31;
  const int e = (p >> f.man) & ((1 << f.exp) - 1);
  const uint32_t m = p & ((1u << f.man) - 1);
  if (e == (1 << f.exp) - 1) {
    return FromBits(sign | 0x7F800000u | (m << (23 - f.man)) | (m ? 0x400000u : 0u));
  }
  const double v = e == 0 ? std::ldexp((double)m, 1 - f.bias - f.man)
                          : std::ldexp((double)(m | (1u << f.man)), e - f.bias - f.man);
  return FromBits(sign | Bits((float)v));
}

bool RefRounds(float master, uint16_t p, precis_dtype_t pd) { return RefRound(master, pd) == p; }

// The contract for one fp32-master tensor: returns kept, rewrites master.
int64_t RefResync(std::vector<float>& master, const std::vector<uint16_t>& param,
                  precis_dtype_t pd, bool stale) {
  const int64_t n = (int64_t)param.size();
  if (!stale) return n;
  int64_t kept = 0;
  for (int64_t j = 0; j < n; ++j) kept += RefRounds(master[j], param[j], pd);
  const int64_t few = n / 64 > 1 ? n / 64 : 1;
  const bool whole = kept != n && kept <= few;
  for (int64_t j = 0; j < n; ++j) {
    if (whole || !RefRounds(master[j], param[j], pd)) master[j] = RefValue(param[j], pd);
  }
  return kept;
}

// ---- the reference itself, on known values --------------------------------------------

TEST(ResyncReference, RoundsAsTheFormatsDefine) {
  EXPECT_EQ(RefRound(1.0f, B16), 0x3F80);
  EXPECT_EQ(RefRound(1.0f, F16), 0x3C00);
  EXPECT_EQ(RefRound(FromBits(0x3F808000u), B16), 0x3F80);  // tie -> even
  EXPECT_EQ(RefRound(FromBits(0x3F818000u), B16), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(RefRound(FromBits(0x3F808001u), B16), 0x3F81);
  EXPECT_EQ(RefRound(65504.0f, F16), 0x7BFF);
  EXPECT_EQ(RefRound(65519.0f, F16), 0x7BFF);
  EXPECT_EQ(RefRound(65520.0f, F16), 0x7C00);
  EXPECT_EQ(RefRound(-65520.0f, F16), 0xFC00);
  EXPECT_EQ(RefRound(0x1p-24f, F16), 0x0001);
  EXPECT_EQ(RefRound(0x1p-25f, F16), 0x0000);  // tie -> even (zero)
  EXPECT_EQ(RefRound(0x1.8p-24f, F16), 0x0002);
  EXPECT_EQ(RefRound(-0.0f, F16), 0x8000);
  EXPECT_EQ(RefRound(FromBits(0x7F7FFFFFu), B16), 0x7F80);  // fp32 max -> inf
  EXPECT_EQ(RefRound(FromBits(0x00000001u), B16), 0x0000);
  EXPECT_EQ(RefRound(std::numeric_limits<float>::infinity(), B16), 0x7F80);
  EXPECT_EQ(RefValue(0x3C00, F16), 1.0f);
  EXPECT_EQ(RefValue(0x0001, F16), 0x1p-24f);
  EXPECT_EQ(RefValue(0x7BFF, F16), 65504.0f);
  EXPECT_EQ(RefValue(0xC000, B16), -2.0f);
  for (uint32_t p = 0; p < 0x10000; ++p) {  // every finite value rounds to itself
    for (precis_dtype_t pd : {B16, F16}) {
      const float v = RefValue((uint16_t)p, pd);
      if (!std::isnan(v)) {
        ASSERT_EQ(RefRound(v, pd), p) << std::hex << p;
      }
    }
  }
}

// ---- data -----------------------------------------------------------------------------

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x51ED2701ull) {}
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// A finite fp32 value over the binades of both formats: subnormals of fp16 and
// values past its range included (they round to 0 / inf, which is fine).
float RandomMaster(Rng& r) {
  const uint64_t x = r.Next();
  if (x % 61 == 0) return (x >> 8) % 2 ? 0.0f : -0.0f;
  const uint32_t e = (uint32_t)((x >> 8) % 60) + 127 - 36;  // 2^-36 .. 2^23
  return FromBits((uint32_t)(x >> 63) << 31 | e << 23 | ((uint32_t)(x >> 20) & 0x7FFFFFu));
}

// A master that rounds to param p: its value plus less than half a quantum (for a
// finite p with finite neighbours), or exactly its value.
float NearMaster(Rng& r, uint16_t p, precis_dtype_t pd) {
  const float v = RefValue(p, pd);
  if (!std::isfinite(v)) return v;
  const uint64_t x = r.Next();
  const float w = v + (float)((int64_t)(x % 2001) - 1000) * 1e-4f * std::fabs(v) * 0x1p-12f;
  return RefRounds(w, p, pd) ? w : v;
}

// Random param bits, finite (no NaN, no inf), different from `not_this`.
uint16_t RandomParam(Rng& r, precis_dtype_t pd, int32_t not_this = -1) {
  for (;;) {
    const uint16_t p = RefRound(RandomMaster(r), pd);
    if (std::isfinite(RefValue(p, pd)) && (int32_t)p != not_this) return p;
  }
}

struct Tensor {
  std::vector<float> master;
  std::vector<uint16_t> param;
};

// n elements, each master rounding to its param (kept == n).
Tensor InSync(int64_t n, precis_dtype_t pd, uint64_t seed) {
  Rng r(seed);
  Tensor t;
  t.master.resize(n);
  t.param.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    t.master[j] = RandomMaster(r);
    t.param[j] = RefRound(t.master[j], pd);
    if (!std::isfinite(RefValue(t.param[j], pd))) {  // fp16 overflow: a finite one instead
      t.param[j] = RandomParam(r, pd);
      t.master[j] = NearMaster(r, t.param[j], pd);
    }
  }
  return t;
}

// Element j's param written with a value its master does not round to.
void Spoil(Tensor& t, int64_t j, precis_dtype_t pd, Rng& r) {
  t.param[j] = RandomParam(r, pd, RefRound(t.master[j], pd));
}

int64_t CountRounding(const Tensor& t, precis_dtype_t pd) {
  int64_t k = 0;
  for (size_t j = 0; j < t.param.size(); ++j) k += RefRounds(t.master[j], t.param[j], pd);
  return k;
}

// One tensor through precis_resync_masters; the kept it gave.
int64_t RunOne(Tensor& t, precis_dtype_t pd, uint8_t stale) {
  void* m = t.master.data();
  const void* p = t.param.data();
  const int64_t n = (int64_t)t.param.size();
  int64_t kept = -12345;
  EXPECT_EQ(precis_resync_masters(&m, F32, &p, pd, &n, &stale, &kept, 1), PRECIS_OK)
      << precis_last_error();
  return kept;
}

::testing::AssertionResult SameMasters(const std::vector<float>& want,
                                       const std::vector<float>& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "sizes differ";
  int64_t differ = 0;
  std::string shown;
  for (size_t j = 0; j < want.size(); ++j) {
    if (Bits(want[j]) == Bits(got[j])) continue;
    if (differ++ < 4) {
      char b[120];
      snprintf(b, sizeof b, " [%zu] want 0x%08x (%.9g) got 0x%08x (%.9g);", j, Bits(want[j]),
               (double)want[j], Bits(got[j]), (double)got[j]);
      shown += b;
    }
  }
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differ << " of " << want.size() << " masters differ:"
                                       << shown;
}

// t through the library and through the reference: the same masters and kept; the
// params untouched. Returns kept.
int64_t CheckOne(Tensor t, precis_dtype_t pd, uint8_t stale, const std::string& what) {
  SCOPED_TRACE(what);
  std::vector<float> want = t.master;
  const int64_t want_kept = RefResync(want, t.param, pd, stale != 0);
  const std::vector<uint16_t> params_before = t.param;
  const int64_t kept = RunOne(t, pd, stale);
  EXPECT_EQ(kept, want_kept);
  EXPECT_TRUE(SameMasters(want, t.master));
  EXPECT_TRUE(t.param == params_before) << "params written";
  return kept;
}

std::string Name(precis_dtype_t pd, int64_t n) {
  return std::string(pd == B16 ? "bf16" : "fp16") + " params, numel " + std::to_string(n);
}

// ---- fp32 masters -------------------------------------------------------------------

class ResyncSizes : public ::testing::TestWithParam<std::tuple<precis_dtype_t, int64_t>> {};

TEST_P(ResyncSizes, NotStaleIsUntouchedAndKeepsNumel) {
  const auto [pd, n] = GetParam();
  Tensor t = InSync(n, pd, 1 + n);
  Rng r(7 + n);
  for (int64_t j = 0; j < n; j += 3) Spoil(t, j, pd, r);  // would be rewritten if read
  const Tensor before = t;
  EXPECT_EQ(RunOne(t, pd, 0), n);
  EXPECT_TRUE(SameMasters(before.master, t.master));
  EXPECT_TRUE(t.param == before.param);
}

TEST_P(ResyncSizes, InSyncIsUntouchedAndKeepsAll) {
  const auto [pd, n] = GetParam();
  Tensor t = InSync(n, pd, 2 + n);
  ASSERT_EQ(CountRounding(t, pd), n);
  const Tensor before = t;
  EXPECT_EQ(CheckOne(t, pd, 1, Name(pd, n)), n);
  EXPECT_EQ(RunOne(t, pd, 1), n);
  EXPECT_TRUE(SameMasters(before.master, t.master));
}

TEST_P(ResyncSizes, PartialWriteRewritesOnlyTheWrittenElements) {
  const auto [pd, n] = GetParam();
  if (n < 3) GTEST_SKIP() << "a partial write keeps more than one element and not all";
  Tensor t = InSync(n, pd, 3 + n);
  Rng r(11 + n);
  std::vector<bool> written(n, false);
  for (int64_t j = 0; j < n; ++j) {
    if (j == 0 || (n >= 10 && r.Next() % 5 == 0)) {  // a fifth: more than a whole load's
      Spoil(t, j, pd, r);
      written[j] = true;
    }
  }
  const int64_t rounding = CountRounding(t, pd);
  ASSERT_GT(rounding, (n / 64 > 1 ? n / 64 : 1)) << "the test's data: not a partial write";
  ASSERT_LT(rounding, n);
  const Tensor before = t;
  EXPECT_EQ(CheckOne(t, pd, 1, Name(pd, n)), rounding);
  // Directly from the contract, too: the written elements hold the param's value,
  // the others their own master's bits.
  RunOne(t, pd, 1);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t want =
        written[j] ? Bits(RefValue(t.param[j], pd)) : Bits(before.master[j]);
    ASSERT_EQ(Bits(t.master[j]), want) << "element " << j << (written[j] ? " (written)" : "");
  }
}

TEST_P(ResyncSizes, WholeLoadRewritesEveryElement) {
  const auto [pd, n] = GetParam();
  if (n == 0) GTEST_SKIP();
  Tensor t = InSync(n, pd, 4 + n);
  Rng r(13 + n);
  for (int64_t j = 0; j < n; ++j) Spoil(t, j, pd, r);  // new random weights
  // A few elements that still round to their new param: a load keeps some values.
  for (int64_t j = 0; j < n / 200; ++j) t.master[j * 199] = RefValue(t.param[j * 199], pd) * 1.0f;
  const int64_t rounding = CountRounding(t, pd);
  ASSERT_LE(rounding, (n / 64 > 1 ? n / 64 : 1)) << "the test's data: not a whole load";
  ASSERT_NE(rounding, n);
  // Masters that round: made slightly off the param's value, so that a whole load
  // (which rewrites them too) is seen.
  for (int64_t j = 0; j < n; ++j) {
    if (RefRounds(t.master[j], t.param[j], pd)) {
      const float off = FromBits(Bits(t.master[j]) + 1);
      if (RefRounds(off, t.param[j], pd)) t.master[j] = off;
    }
  }
  const int64_t kept = CheckOne(t, pd, 1, Name(pd, n));
  EXPECT_EQ(kept, CountRounding(t, pd));
  RunOne(t, pd, 1);
  for (int64_t j = 0; j < n; ++j) {
    ASSERT_EQ(Bits(t.master[j]), Bits(RefValue(t.param[j], pd))) << "element " << j;
  }
}

// kept == max(1, n/64): whole; one more: partial; kept == n: nothing written.
TEST_P(ResyncSizes, TheWholeLoadBoundaryExactly) {
  const auto [pd, n] = GetParam();
  const int64_t few = n / 64 > 1 ? n / 64 : 1;
  for (int64_t keep : {(int64_t)0, few - 1, few, few + 1, n - 1, n}) {
    if (keep < 0 || keep > n) continue;
    Tensor t = InSync(n, pd, 5 + n + keep);
    Rng r(17 + n + keep);
    // keep elements spread over the tensor still round; the others are written.
    std::vector<bool> keeps(n, false);
    for (int64_t k = 0; k < keep; ++k) keeps[(k * 7919) % n] = true;
    int64_t marked = 0;
    for (int64_t j = 0; j < n; ++j) marked += keeps[j];
    for (int64_t j = 0; marked < keep; ++j) {  // 7919 shares a factor with n: fill up
      if (!keeps[j]) keeps[j] = true, ++marked;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (keeps[j]) {
        // off the param's value where possible, so a rewrite shows
        const float off = FromBits(Bits(RefValue(t.param[j], pd)) + 1);
        t.master[j] = RefRounds(off, t.param[j], pd) ? off : t.master[j];
      } else {
        Spoil(t, j, pd, r);
      }
    }
    ASSERT_EQ(CountRounding(t, pd), keep);
    const bool whole = keep != n && keep <= few;
    const Tensor before = t;
    const std::string what = Name(pd, n) + ", kept " + std::to_string(keep);
    EXPECT_EQ(CheckOne(t, pd, 1, what), keep);
    RunOne(t, pd, 1);
    int64_t rewritten_kept = 0;  // of the keeping elements, those given the param's value
    for (int64_t j = 0; j < n; ++j) {
      if (!keeps[j]) {
        ASSERT_EQ(Bits(t.master[j]), Bits(RefValue(t.param[j], pd))) << what << " [" << j << "]";
      } else {
        const bool changed = Bits(t.master[j]) != Bits(before.master[j]);
        if (changed) {
          ASSERT_EQ(Bits(t.master[j]), Bits(RefValue(t.param[j], pd))) << what;
          ++rewritten_kept;
        }
        if (!whole) {
          ASSERT_FALSE(changed) << what << ": a master that rounds was rewritten";
        }
      }
    }
    if (whole && keep > 0) {
      EXPECT_GT(rewritten_kept, 0) << what << ": a whole load left the masters that round";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ResyncSizes, ::testing::Combine(::testing::Values(B16, F16), ::testing::ValuesIn(kSizes)),
    [](const ::testing::TestParamInfo<ResyncSizes::ParamType>& info) {
      return std::string(std::get<0>(info.param) == B16 ? "bf16" : "fp16") + "_n" +
             std::to_string(std::get<1>(info.param));
    });

// Below 128 elements n / 64 is 0 or 1: max(1, n / 64) makes one element still rounding
// a whole load there too (n = 2: exactly one of the two); and 64 / 65 / 128 / 129
// around the steps of n / 64.
INSTANTIATE_TEST_SUITE_P(
    Small, ResyncSizes,
    ::testing::Combine(::testing::Values(B16, F16),
                       ::testing::Values(2, 3, 63, 64, 65, 128, 129)),
    [](const ::testing::TestParamInfo<ResyncSizes::ParamType>& info) {
      return std::string(std::get<0>(info.param) == B16 ? "bf16" : "fp16") + "_n" +
             std::to_string(std::get<1>(info.param));
    });

// Edge values: zeros of both signs, infinities, subnormals, the largest finite
// values and the ties of the rounding; masters that round to them or not.
TEST(Resync, EdgeValuesMatchTheReference) {
  for (precis_dtype_t pd : {B16, F16}) {
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> masters = {0.0f,     -0.0f,      inf,          -inf,       0x1p-24f,
                                  0x1p-25f, 0x1.8p-24f, 65504.0f,     65520.0f,   65519.0f,
                                  1.0f,     FromBits(0x3F808000u), FromBits(0x3F818000u),
                                  FromBits(0x3F801000u), FromBits(0x3F803000u), 0x1p-140f,
                                  FromBits(0x7F7FFFFFu), -1e-30f};
    Tensor t;
    Rng r(99);
    for (float m : masters) {
      for (int variant = 0; variant < 3; ++variant) {
        t.master.push_back(m);
        uint16_t p = RefRound(m, pd);
        if (variant == 1) p = (uint16_t)(p ^ 1);       // the next value: written
        if (variant == 2) p = (uint16_t)(p ^ 0x8000);  // the sign flipped
        t.param.push_back(p);
      }
    }
    (void)r;
    CheckOne(t, pd, 1, pd == B16 ? "bf16 edges" : "fp16 edges");
  }
}

// Any nonzero flag is stale.
TEST(Resync, AnyNonzeroFlagIsStale) {
  for (uint8_t flag : {1, 2, 0x80, 0xFF}) {
    Tensor t = InSync(300, B16, flag);
    Rng r(flag);
    for (int64_t j = 0; j < 300; j += 2) Spoil(t, j, B16, r);
    EXPECT_EQ(CheckOne(t, B16, flag, "flag " + std::to_string(flag)), 150);
  }
}

// ---- fp16 masters (of bf16 or fp16 params) --------------------------------------------
// The same rule with an fp16 master: an element still rounds when the master's value
// (exact as fp32) rounded to nearest even to the param dtype is the param's bits; a
// rewritten element takes the param's value rounded to nearest even into fp16 (as
// torch's param.to(torch.float16): a bf16 value past fp16's range becomes an infinity,
// a tiny one an fp16 subnormal or zero).

uint16_t RefMaster16Of(uint16_t p, precis_dtype_t pd) { return RefRound(RefValue(p, pd), F16); }

bool RefRounds16(uint16_t master, uint16_t p, precis_dtype_t pd) {
  return RefRounds(RefValue(master, F16), p, pd);
}

// The contract for one fp16-master tensor: returns kept, rewrites master.
int64_t RefResync16(std::vector<uint16_t>& master, const std::vector<uint16_t>& param,
                    precis_dtype_t pd, bool stale) {
  const int64_t n = (int64_t)param.size();
  if (!stale) return n;
  int64_t kept = 0;
  for (int64_t j = 0; j < n; ++j) kept += RefRounds16(master[j], param[j], pd);
  const int64_t few = n / 64 > 1 ? n / 64 : 1;
  const bool whole = kept != n && kept <= few;
  for (int64_t j = 0; j < n; ++j) {
    if (whole || !RefRounds16(master[j], param[j], pd)) master[j] = RefMaster16Of(param[j], pd);
  }
  return kept;
}

TEST(ResyncReference, Fp16MastersOnKnownValues) {
  // bf16 params: the master's three extra mantissa bits round to nearest even.
  EXPECT_TRUE(RefRounds16(0x3C00, 0x3F80, B16));   // 1.0
  EXPECT_TRUE(RefRounds16(0x3C04, 0x3F80, B16));   // 1 + 2^-8: a tie, to even (1.0)
  EXPECT_FALSE(RefRounds16(0x3C04, 0x3F81, B16));
  EXPECT_TRUE(RefRounds16(0x3C0C, 0x3F82, B16));   // 1 + 3 * 2^-8: a tie, to even (up)
  EXPECT_TRUE(RefRounds16(0x3C05, 0x3F81, B16));   // past the tie
  EXPECT_TRUE(RefRounds16(0x7C00, 0x7F80, B16));   // inf
  EXPECT_TRUE(RefRounds16(0x0001, 0x3380, B16));   // 2^-24
  EXPECT_TRUE(RefRounds16(0x3C01, 0x3C01, F16));   // fp16 params: equal bits only
  EXPECT_FALSE(RefRounds16(0x3C01, 0x3C00, F16));
  // The rewrite: bf16 -> fp16, to nearest even.
  EXPECT_EQ(RefMaster16Of(0x3F81, B16), 0x3C08);   // exact
  EXPECT_EQ(RefMaster16Of(0x4780, B16), 0x7C00);   // 65536: fp16 inf
  EXPECT_EQ(RefMaster16Of(0xC780, B16), 0xFC00);
  EXPECT_EQ(RefMaster16Of(0x477F, B16), 0x7BF8);   // 65280: exact
  EXPECT_EQ(RefMaster16Of(0x3300, B16), 0x0000);   // 2^-25: a tie, to even (zero)
  EXPECT_EQ(RefMaster16Of(0x3340, B16), 0x0001);   // 1.5 * 2^-25
  EXPECT_EQ(RefMaster16Of(0x33C0, B16), 0x0002);   // 3 * 2^-25: a tie, to even (up)
  EXPECT_EQ(RefMaster16Of(0x3440, B16), 0x0003);   // 3 * 2^-24: exact
  EXPECT_EQ(RefMaster16Of(0x8001, B16), 0x8000);   // a bf16 subnormal: -0
  EXPECT_EQ(RefMaster16Of(0x3C01, F16), 0x3C01);
}

struct Tensor16 {
  std::vector<uint16_t> master;  // fp16 bits
  std::vector<uint16_t> param;
};

// A finite fp16 master's bits: every binade of fp16 alike (subnormals, zeros of both
// signs included).
uint16_t RandomMaster16(Rng& r) {
  const uint64_t x = r.Next();
  if (x % 61 == 0) return (x >> 8) % 2 ? 0x0000 : 0x8000;
  const uint32_t e = (uint32_t)((x >> 8) % 31);  // 0 (subnormal) .. 30
  return (uint16_t)((uint32_t)(x >> 63) << 15 | e << 10 | ((uint32_t)(x >> 20) & 0x3FFu));
}

// n elements, each master rounding to its param (kept == n).
Tensor16 InSync16(int64_t n, precis_dtype_t pd, uint64_t seed) {
  Rng r(seed);
  Tensor16 t;
  t.master.resize(n);
  t.param.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    t.master[j] = RandomMaster16(r);
    t.param[j] = RefRound(RefValue(t.master[j], F16), pd);
  }
  return t;
}

// Element j's param written with a finite value its master does not round to (a bf16
// one possibly past fp16's range, or below its subnormals).
void Spoil16(Tensor16& t, int64_t j, precis_dtype_t pd, Rng& r) {
  t.param[j] = RandomParam(r, pd, RefRound(RefValue(t.master[j], F16), pd));
}

int64_t CountRounding16(const Tensor16& t, precis_dtype_t pd) {
  int64_t k = 0;
  for (size_t j = 0; j < t.param.size(); ++j) k += RefRounds16(t.master[j], t.param[j], pd);
  return k;
}

// A master for element j that still rounds to its param but is not the param's value
// rounded into fp16, where there is one (bf16 params: the fp16 value next to it), so
// that a rewrite of it shows; else the param's value.
uint16_t OffMaster16(uint16_t p, precis_dtype_t pd) {
  const uint16_t at = RefMaster16Of(p, pd);
  for (uint16_t off : {(uint16_t)(at + 1), (uint16_t)(at - 1)}) {
    if (std::isfinite(RefValue(off, F16)) && (off & 0x7FFF) != 0 && RefRounds16(off, p, pd)) {
      return off;
    }
  }
  return at;
}

int64_t RunOne16(Tensor16& t, precis_dtype_t pd, uint8_t stale) {
  void* m = t.master.data();
  const void* p = t.param.data();
  const int64_t n = (int64_t)t.param.size();
  int64_t kept = -12345;
  EXPECT_EQ(precis_resync_masters(&m, F16, &p, pd, &n, &stale, &kept, 1), PRECIS_OK)
      << precis_last_error();
  return kept;
}

::testing::AssertionResult SameMasters16(const std::vector<uint16_t>& want,
                                         const std::vector<uint16_t>& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "sizes differ";
  int64_t differ = 0;
  std::string shown;
  for (size_t j = 0; j < want.size(); ++j) {
    if (want[j] == got[j]) continue;
    if (differ++ < 4) {
      char b[120];
      snprintf(b, sizeof b, " [%zu] want 0x%04x (%.9g) got 0x%04x (%.9g);", j, want[j],
               (double)RefValue(want[j], F16), got[j], (double)RefValue(got[j], F16));
      shown += b;
    }
  }
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differ << " of " << want.size()
                                       << " fp16 masters differ:" << shown;
}

int64_t CheckOne16(Tensor16 t, precis_dtype_t pd, uint8_t stale, const std::string& what) {
  SCOPED_TRACE(what + ", fp16 masters");
  std::vector<uint16_t> want = t.master;
  const int64_t want_kept = RefResync16(want, t.param, pd, stale != 0);
  const std::vector<uint16_t> params_before = t.param;
  const int64_t kept = RunOne16(t, pd, stale);
  EXPECT_EQ(kept, want_kept);
  EXPECT_TRUE(SameMasters16(want, t.master));
  EXPECT_TRUE(t.param == params_before) << "params written";
  return kept;
}

class ResyncF16MasterSizes : public ResyncSizes {};

TEST_P(ResyncF16MasterSizes, NotStaleIsUntouchedAndKeepsNumel) {
  const auto [pd, n] = GetParam();
  Tensor16 t = InSync16(n, pd, 21 + n);
  Rng r(27 + n);
  for (int64_t j = 0; j < n; j += 3) Spoil16(t, j, pd, r);  // would be rewritten if read
  const Tensor16 before = t;
  EXPECT_EQ(RunOne16(t, pd, 0), n);
  EXPECT_TRUE(SameMasters16(before.master, t.master));
  EXPECT_TRUE(t.param == before.param);
}

TEST_P(ResyncF16MasterSizes, InSyncIsUntouchedAndKeepsAll) {
  const auto [pd, n] = GetParam();
  Tensor16 t = InSync16(n, pd, 22 + n);
  ASSERT_EQ(CountRounding16(t, pd), n);
  const Tensor16 before = t;
  EXPECT_EQ(CheckOne16(t, pd, 1, Name(pd, n)), n);
  EXPECT_EQ(RunOne16(t, pd, 1), n);
  EXPECT_TRUE(SameMasters16(before.master, t.master));
}

TEST_P(ResyncF16MasterSizes, PartialWriteRewritesOnlyTheWrittenElements) {
  const auto [pd, n] = GetParam();
  if (n < 3) GTEST_SKIP() << "a partial write keeps more than one element and not all";
  Tensor16 t = InSync16(n, pd, 23 + n);
  Rng r(31 + n);
  std::vector<bool> written(n, false);
  for (int64_t j = 0; j < n; ++j) {
    if (j == 0 || (n >= 10 && r.Next() % 5 == 0)) {
      Spoil16(t, j, pd, r);
      written[j] = true;
    }
  }
  const int64_t rounding = CountRounding16(t, pd);
  ASSERT_GT(rounding, (n / 64 > 1 ? n / 64 : 1)) << "the test's data: not a partial write";
  ASSERT_LT(rounding, n);
  const Tensor16 before = t;
  EXPECT_EQ(CheckOne16(t, pd, 1, Name(pd, n)), rounding);
  RunOne16(t, pd, 1);
  int64_t moved = 0;  // written elements whose master changed (bf16: nearly all)
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t want = written[j] ? RefMaster16Of(t.param[j], pd) : before.master[j];
    ASSERT_EQ(t.master[j], want) << "element " << j << (written[j] ? " (written)" : "");
    moved += written[j] && t.master[j] != before.master[j];
  }
  EXPECT_GT(moved, 0) << "the test's data";
}

TEST_P(ResyncF16MasterSizes, WholeLoadRewritesEveryElement) {
  const auto [pd, n] = GetParam();
  if (n == 0) GTEST_SKIP();
  Tensor16 t = InSync16(n, pd, 24 + n);
  Rng r(33 + n);
  for (int64_t j = 0; j < n; ++j) Spoil16(t, j, pd, r);  // new random weights
  // A few elements still round to their new param (where an fp16 master can).
  for (int64_t j = 0; j < n / 200; ++j) {
    const uint16_t m = OffMaster16(t.param[j * 199], pd);
    if (RefRounds16(m, t.param[j * 199], pd)) t.master[j * 199] = m;
  }
  const int64_t rounding = CountRounding16(t, pd);
  ASSERT_LE(rounding, (n / 64 > 1 ? n / 64 : 1)) << "the test's data: not a whole load";
  ASSERT_NE(rounding, n);
  if (n >= 400) {
    ASSERT_GT(rounding, 0) << "the test's data: nothing kept";
  }
  const int64_t kept = CheckOne16(t, pd, 1, Name(pd, n));
  EXPECT_EQ(kept, rounding);
  RunOne16(t, pd, 1);
  for (int64_t j = 0; j < n; ++j) {
    ASSERT_EQ(t.master[j], RefMaster16Of(t.param[j], pd)) << "element " << j;
  }
}

TEST_P(ResyncF16MasterSizes, TheWholeLoadBoundaryExactly) {
  const auto [pd, n] = GetParam();
  const int64_t few = n / 64 > 1 ? n / 64 : 1;
  for (int64_t keep : {(int64_t)0, few - 1, few, few + 1, n - 1, n}) {
    if (keep < 0 || keep > n) continue;
    Tensor16 t = InSync16(n, pd, 25 + n + keep);
    Rng r(37 + n + keep);
    std::vector<bool> keeps(n, false);
    for (int64_t k = 0; k < keep; ++k) keeps[(k * 7919) % n] = true;
    int64_t marked = 0;
    for (int64_t j = 0; j < n; ++j) marked += keeps[j];
    for (int64_t j = 0; marked < keep; ++j) {
      if (!keeps[j]) keeps[j] = true, ++marked;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (keeps[j]) {
        // bf16 params: one with an fp16 master off its value that rounds to it (a
        // subnormal fp16 master may have none), so that a rewrite shows
        while (pd == B16 && OffMaster16(t.param[j], pd) == RefMaster16Of(t.param[j], pd)) {
          t.param[j] = RefRound(RefValue(RandomMaster16(r), F16), pd);
        }
        t.master[j] = OffMaster16(t.param[j], pd);
      } else {
        Spoil16(t, j, pd, r);
      }
    }
    ASSERT_EQ(CountRounding16(t, pd), keep);
    const bool whole = keep != n && keep <= few;
    const Tensor16 before = t;
    const std::string what = Name(pd, n) + ", kept " + std::to_string(keep);
    EXPECT_EQ(CheckOne16(t, pd, 1, what), keep);
    RunOne16(t, pd, 1);
    int64_t rewritten_kept = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (!keeps[j]) {
        ASSERT_EQ(t.master[j], RefMaster16Of(t.param[j], pd)) << what << " [" << j << "]";
      } else {
        const bool changed = t.master[j] != before.master[j];
        if (changed) {
          ASSERT_EQ(t.master[j], RefMaster16Of(t.param[j], pd)) << what;
          ++rewritten_kept;
        }
        if (!whole) {
          ASSERT_FALSE(changed) << what << ": a master that rounds was rewritten";
        }
      }
    }
    if (whole && keep > 0 && pd == B16) {  // fp16 params: a kept master is the param
      EXPECT_GT(rewritten_kept, 0) << what << ": a whole load left the masters that round";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ResyncF16MasterSizes,
    ::testing::Combine(::testing::Values(B16, F16), ::testing::ValuesIn(kSizes)),
    [](const ::testing::TestParamInfo<ResyncF16MasterSizes::ParamType>& info) {
      return std::string(std::get<0>(info.param) == B16 ? "bf16" : "fp16") + "_n" +
             std::to_string(std::get<1>(info.param));
    });

INSTANTIATE_TEST_SUITE_P(
    Small, ResyncF16MasterSizes,
    ::testing::Combine(::testing::Values(B16, F16),
                       ::testing::Values(2, 3, 63, 64, 65, 128, 129)),
    [](const ::testing::TestParamInfo<ResyncF16MasterSizes::ParamType>& info) {
      return std::string(std::get<0>(info.param) == B16 ? "bf16" : "fp16") + "_n" +
             std::to_string(std::get<1>(info.param));
    });

// Edge values of fp16 masters (zeros, infinities, subnormals, the largest finite, the
// ties of rounding to bf16), with params they round to or not; and bf16 params whose
// rewrite into fp16 overflows, underflows or ties.
TEST(Resync, Fp16MasterEdgeValuesMatchTheReference) {
  for (precis_dtype_t pd : {B16, F16}) {
    const uint16_t masters[] = {0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x03FF,
                                0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x3C04, 0x3C0C, 0x3C05,
                                0x3C03, 0x7BFC, 0x7BF4};
    Tensor16 t;
    for (uint16_t m : masters) {
      for (int variant = 0; variant < 3; ++variant) {
        t.master.push_back(m);
        uint16_t p = RefRound(RefValue(m, F16), pd);
        if (variant == 1) p = (uint16_t)(p ^ 1);
        if (variant == 2) p = (uint16_t)(p ^ 0x8000);
        t.param.push_back(p);
      }
    }
    if (pd == B16) {
      for (uint16_t p : {0x4780, 0xC780, 0x477F, 0x7F7F, 0x3300, 0x3340, 0x3440, 0x33C0, 0x0001,
                         0x8001, 0x3381, 0x387F}) {
        t.master.push_back(0x3555);  // rounds to none of them
        t.param.push_back(p);
      }
    }
    ASSERT_GT(CountRounding16(t, pd), 1) << "the test's data: a partial write";
    CheckOne16(t, pd, 1, pd == B16 ? "bf16 edges" : "fp16 edges");
  }
}

// Several fp16-master tensors in one call, with mixed flags.
TEST(Resync, SeveralFp16MasterTensorsWithMixedFlags) {
  for (precis_dtype_t pd : {B16, F16}) {
    const int64_t sizes[] = {127, 0, 4097, 1, 64 * 5, 1000003, 2, 129, 4097};
    const int count = sizeof sizes / sizeof sizes[0];
    const uint8_t stale[] = {1, 1, 0, 1, 1, 1, 0, 1, 1};
    std::vector<Tensor16> ts;
    Rng r(pd + 40);
    for (int i = 0; i < count; ++i) {
      Tensor16 t = InSync16(sizes[i], pd, 200 + i);
      const int64_t n = sizes[i];
      switch (i % 3) {
        case 0:
          for (int64_t j = 0; j < n; j += 4) Spoil16(t, j, pd, r);
          break;
        case 1:
          for (int64_t j = 0; j < n; ++j) Spoil16(t, j, pd, r);
          if (n > 64) t.master[n / 2] = OffMaster16(t.param[n / 2], pd);
          break;
        default:
          for (int64_t j = 1; j < n; ++j) Spoil16(t, j, pd, r);
          break;
      }
      ts.push_back(std::move(t));
    }
    std::vector<Tensor16> want = ts;
    std::vector<int64_t> want_kept(count);
    for (int i = 0; i < count; ++i) {
      want_kept[i] = RefResync16(want[i].master, want[i].param, pd, stale[i] != 0);
    }
    std::vector<void*> ms(count);
    std::vector<const void*> ps(count);
    for (int i = 0; i < count; ++i) {
      ms[i] = sizes[i] ? ts[i].master.data() : nullptr;
      ps[i] = sizes[i] ? ts[i].param.data() : nullptr;
    }
    std::vector<int64_t> kept(count, -1);
    ASSERT_EQ(precis_resync_masters(ms.data(), F16, ps.data(), pd, sizes, stale, kept.data(),
                                    count),
              PRECIS_OK)
        << precis_last_error();
    int64_t rewrites = 0;
    for (int i = 0; i < count; ++i) {
      SCOPED_TRACE(Name(pd, sizes[i]) + ", fp16 masters, tensor " + std::to_string(i));
      EXPECT_EQ(kept[i], want_kept[i]);
      EXPECT_TRUE(SameMasters16(want[i].master, ts[i].master));
      if (!stale[i]) {
        EXPECT_EQ(kept[i], sizes[i]);
      }
      rewrites += want_kept[i] != sizes[i];
    }
    EXPECT_GT(rewrites, 3) << "the test's data: too few tensors rewritten";
  }
}

// ---- remainders ----------------------------------------------------------------------

TEST(Resync, RemaindersAreZeroedWholeOnlyWhereStale) {
  struct Case {
    precis_dtype_t md, pd;
  };
  for (Case c : {Case{I16, B16}, Case{I16, F16}, Case{F8, B16}}) {
    const size_t es = c.md == I16 ? 2 : 1;
    const int64_t sizes[] = {0, 1, 127, 4097, 1000003, 5};
    const uint8_t stale[] = {1, 1, 0, 1, 1, 0};
    const int count = 6;
    std::vector<std::vector<uint8_t>> rem(count);
    std::vector<std::vector<uint16_t>> par(count);
    std::vector<void*> ms(count);
    std::vector<const void*> ps(count);
    Rng r(c.md * 10 + c.pd);
    for (int i = 0; i < count; ++i) {
      rem[i].resize(sizes[i] * es);
      for (auto& b : rem[i]) b = (uint8_t)(r.Next() | 1);  // nonzero bytes
      par[i].resize(sizes[i]);
      for (auto& p : par[i]) p = (uint16_t)r.Next();
      ms[i] = sizes[i] ? rem[i].data() : nullptr;
      ps[i] = sizes[i] ? par[i].data() : nullptr;
    }
    const auto rem_before = rem;
    const auto par_before = par;
    std::vector<int64_t> kept(count, -7);
    ASSERT_EQ(precis_resync_masters(ms.data(), c.md, ps.data(), c.pd, sizes, stale, kept.data(),
                                    count),
              PRECIS_OK)
        << precis_last_error();
    for (int i = 0; i < count; ++i) {
      SCOPED_TRACE("master " + std::to_string(c.md) + " param " + std::to_string(c.pd) +
                   " tensor " + std::to_string(i));
      EXPECT_EQ(kept[i], stale[i] ? 0 : sizes[i]);
      if (stale[i]) {
        EXPECT_TRUE(rem[i] == std::vector<uint8_t>(rem[i].size(), 0)) << "not zeroed";
      } else {
        EXPECT_TRUE(rem[i] == rem_before[i]) << "written though not stale";
      }
      EXPECT_TRUE(par[i] == par_before[i]) << "params written";
    }
  }
}

// ---- several tensors -----------------------------------------------------------------

TEST(Resync, SeveralTensorsWithMixedFlags) {
  for (precis_dtype_t pd : {B16, F16}) {
    const int64_t sizes[] = {127, 0, 4097, 1, 64 * 5, 1000003, 2, 129, 4097};
    const int count = sizeof sizes / sizeof sizes[0];
    const uint8_t stale[] = {1, 1, 0, 1, 1, 1, 0, 1, 1};
    std::vector<Tensor> ts;
    Rng r(pd);
    for (int i = 0; i < count; ++i) {
      Tensor t = InSync(sizes[i], pd, 100 + i);
      const int64_t n = sizes[i];
      switch (i % 3) {
        case 0:  // partial
          for (int64_t j = 0; j < n; j += 4) Spoil(t, j, pd, r);
          break;
        case 1:  // whole load
          for (int64_t j = 0; j < n; ++j) Spoil(t, j, pd, r);
          if (n > 64) t.master[n / 2] = RefValue(t.param[n / 2], pd);  // one still rounds
          break;
        default:  // written everywhere but a few: not stale -> untouched anyway
          for (int64_t j = 1; j < n; ++j) Spoil(t, j, pd, r);
          break;
      }
      ts.push_back(std::move(t));
    }
    std::vector<Tensor> want = ts;
    std::vector<int64_t> want_kept(count);
    for (int i = 0; i < count; ++i) {
      want_kept[i] = RefResync(want[i].master, want[i].param, pd, stale[i] != 0);
    }
    std::vector<void*> ms(count);
    std::vector<const void*> ps(count);
    for (int i = 0; i < count; ++i) {
      ms[i] = sizes[i] ? ts[i].master.data() : nullptr;  // NULL with numel 0 is fine
      ps[i] = sizes[i] ? ts[i].param.data() : nullptr;
    }
    std::vector<int64_t> kept(count, -1);
    ASSERT_EQ(precis_resync_masters(ms.data(), F32, ps.data(), pd, sizes, stale, kept.data(),
                                    count),
              PRECIS_OK)
        << precis_last_error();
    int64_t rewrites = 0;
    for (int i = 0; i < count; ++i) {
      SCOPED_TRACE(Name(pd, sizes[i]) + ", tensor " + std::to_string(i));
      EXPECT_EQ(kept[i], want_kept[i]);
      EXPECT_TRUE(SameMasters(want[i].master, ts[i].master));
      if (!stale[i]) {
        EXPECT_EQ(kept[i], sizes[i]);
      }
      rewrites += want_kept[i] != sizes[i];
    }
    EXPECT_GT(rewrites, 3) << "the test's data: too few tensors rewritten";
  }
}

// ---- argument checks -----------------------------------------------------------------

// Two tensors, the first stale and written everywhere (a call that went ahead would
// rewrite it), the second what each case spoils; the status, a message naming the
// function, and nothing written (masters and kept).
struct BadCall {
  Tensor a = InSync(100, B16, 1), b = InSync(50, B16, 2);
  std::vector<void*> ms;
  std::vector<const void*> ps;
  std::vector<int64_t> numels = {100, 50};
  std::vector<uint8_t> stale = {1, 1};
  std::vector<int64_t> kept = {-3, -4};
  precis_dtype_t md = F32, pd = B16;
  int64_t count = 2;
  void* const* masters;
  const void* const* params;
  const int64_t* numels_p;
  const uint8_t* stale_p;
  int64_t* kept_p;

  BadCall() {
    Rng r(3);
    for (int64_t j = 0; j < 100; ++j) Spoil(a, j, B16, r);
    for (int64_t j = 0; j < 50; ++j) Spoil(b, j, B16, r);
    ms = {a.master.data(), b.master.data()};
    ps = {a.param.data(), b.param.data()};
    masters = ms.data();
    params = ps.data();
    numels_p = numels.data();
    stale_p = stale.data();
    kept_p = kept.data();
  }
  void Expect(precis_status_t want, const std::string& what) {
    SCOPED_TRACE(what);
    const Tensor a0 = a, b0 = b;
    const precis_status_t st =
        precis_resync_masters(masters, md, params, pd, numels_p, stale_p, kept_p, count);
    EXPECT_EQ(st, want);
    if (want != PRECIS_OK) {
      EXPECT_NE(std::string(precis_last_error()).find("precis_resync_masters"), std::string::npos)
          << precis_last_error();
    }
    EXPECT_TRUE(SameMasters(a0.master, a.master)) << "written on a rejected call";
    EXPECT_TRUE(SameMasters(b0.master, b.master)) << "written on a rejected call";
    EXPECT_EQ(kept[0], -3);
    EXPECT_EQ(kept[1], -4);
  }
};

TEST(ResyncArgs, AGoodCallWritesWhatTheBadOnesMustNot) {  // the harness can fail
  BadCall c;
  const precis_status_t st = precis_resync_masters(c.masters, c.md, c.params, c.pd, c.numels_p,
                                                   c.stale_p, c.kept_p, c.count);
  ASSERT_EQ(st, PRECIS_OK) << precis_last_error();
  EXPECT_EQ(c.kept[0], 0);
  EXPECT_EQ(Bits(c.a.master[0]), Bits(RefValue(c.a.param[0], B16)));
}

TEST(ResyncArgs, NegativeCount) {
  BadCall c;
  c.count = -1;
  c.Expect(PRECIS_ERR_INVALID_ARGUMENT, "count -1");
}

TEST(ResyncArgs, NullTables) {
  {
    BadCall c;
    c.masters = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "masters NULL");
  }
  {
    BadCall c;
    c.params = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "params NULL");
  }
  {
    BadCall c;
    c.numels_p = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "numels NULL");
  }
  {
    BadCall c;
    c.stale_p = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "stale NULL");
  }
  {
    BadCall c;
    c.kept_p = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "kept NULL");
  }
}

TEST(ResyncArgs, CountZeroNeedsNoTables) {
  EXPECT_EQ(precis_resync_masters(nullptr, F32, nullptr, B16, nullptr, nullptr, nullptr, 0),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(precis_resync_masters(nullptr, F16, nullptr, B16, nullptr, nullptr, nullptr, 0),
            PRECIS_OK)  // an fp16 master (of bf16 params) is a master too
      << precis_last_error();
  // but the dtypes are checked all the same
  EXPECT_EQ(precis_resync_masters(nullptr, B16, nullptr, B16, nullptr, nullptr, nullptr, 0),
            PRECIS_ERR_INVALID_DTYPE);
}

TEST(ResyncArgs, BadDtypes) {
  for (precis_dtype_t md : {B16, (precis_dtype_t)-1, (precis_dtype_t)99}) {  // fp16: a master
    BadCall c;
    c.md = md;
    c.Expect(PRECIS_ERR_INVALID_DTYPE, "master dtype " + std::to_string((int)md));
  }
  for (precis_dtype_t pd : {F32, F8, I16, (precis_dtype_t)-1, (precis_dtype_t)99}) {
    BadCall c;
    c.pd = pd;
    c.Expect(PRECIS_ERR_INVALID_DTYPE, "param dtype " + std::to_string((int)pd));
  }
  {
    BadCall c;  // fp8 (8-bit remainders) are of bf16 params only
    c.md = F8;
    c.pd = F16;
    c.Expect(PRECIS_ERR_INVALID_DTYPE, "fp8 master, fp16 params");
  }
}

TEST(ResyncArgs, NumelsOutOfRange) {
  for (int64_t bad : {(int64_t)-1, ((int64_t)1 << 42) + 1, INT64_MIN, INT64_MAX}) {
    BadCall c;
    c.numels[1] = bad;  // the second: the first must not be written before it is seen
    c.Expect(PRECIS_ERR_INVALID_ARGUMENT, "numels[1] " + std::to_string(bad));
  }
}

TEST(ResyncArgs, NullTensorWithElements) {
  {
    BadCall c;
    c.ms[1] = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "masters[1] NULL");
  }
  {
    BadCall c;
    c.ps[1] = nullptr;
    c.Expect(PRECIS_ERR_NULL_POINTER, "params[1] NULL");
  }
  {
    BadCall c;  // NULL with numel 0 is fine (and the first tensor is written)
    c.ms[1] = nullptr;
    c.ps[1] = nullptr;
    c.numels[1] = 0;
    ASSERT_EQ(precis_resync_masters(c.masters, c.md, c.params, c.pd, c.numels_p, c.stale_p,
                                    c.kept_p, c.count),
              PRECIS_OK)
        << precis_last_error();
    EXPECT_EQ(c.kept[1], 0);
    EXPECT_EQ(c.kept[0], 0);
  }
}

}  // namespace
