// The CUDA bucket ops of cuda/bucket_ops.cu, run on the CPU by the emulator of
// cuda_emu.h (see tests/BUILD), against their CPU twins of csrc/accumulate.c
// and csrc/bucket_ops.c: from the same inputs,
// precis_cuda_accumulate / _cast / _scale / _count_nonfinite must write exactly
// the bits (the count) precis_accumulate / _cast / _scale / _count_nonfinite
// write, for every dtype (pair), at sizes of one element, one partial block,
// several blocks with a one-element tail, and one past the largest grid (so
// that the grid-stride loops take a second turn), with buffers 64-byte aligned
// or one element off; and bad arguments must give the CPU's status before
// anything is launched or copied. "Device pointers" are host pointers here.
//
// These kernels have one code path each: a grid-stride loop of 256-thread
// blocks over at most grid_for()'s 65535 blocks (no vector loads, so alignment
// and tails change nothing in the kernels; the one-element offsets check that
// no alignment is assumed all the same). count_nonfinite adds a shared-memory
// tree reduction per block and one atomicAdd per block with a nonzero count.
//
// What the emulation cannot see: NaN payloads. Where the kernels make a NaN by
// arithmetic (accumulate's sum, scale's product: NaN + x, Inf - Inf, Inf * 0),
// a GPU returns the canonical NaN 0x7FFFFFFF while x86 propagates an operand's
// payload or returns the negative default NaN 0xFFC00000, and the store into
// fp16/bf16 keeps sign and top payload bits. Both are legitimate IEEE-754
// results (on x86 alone, the CPU twin's vectorized sum already keeps the other
// one of two NaN operands than the emulated scalar code does, for a few
// elements), so there only NaN-ness is compared; every other element (NaNs that
// cast converts, which is integer bit manipulation on both sides, included) is
// compared bit for bit. Nor can it see blocks running at the same time (they
// run one after another here, so count_nonfinite's atomicAdd is not raced).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "precis/precis.h"
#include "precis_convert.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

const precis_dtype_t kFloats[] = {F32, F16, B16};

// The kernels' launch geometry (cuda/bucket_ops.cu kThreads, cuda/common.cuh
// grid_for's cap).
constexpr int64_t kBlockThreads = 256;
constexpr int64_t kMaxBlocks = 65535;
constexpr int64_t kGridThreads = kBlockThreads * kMaxBlocks;  // 16776960

// One element; one partial block; 16 whole blocks and a one-element 17th.
const int64_t kSizes[] = {1, 127, 4097};
// The whole grid once, then 1000 more elements for the first threads (blocks
// 0 to 3, the last one partly) on the loops' second turn.
constexpr int64_t kBigSize = kGridThreads + 1000;

int64_t GridBlocks(int64_t n) {
  const int64_t b = (n + kBlockThreads - 1) / kBlockThreads;
  return b < kMaxBlocks ? b : kMaxBlocks;
}

// ---- buffers --------------------------------------------------------------------------

// A buffer of n elements of d, aligned or one element past a 64-byte boundary.
Buf Make(precis_dtype_t d, int64_t n, bool off) {
  return Buf((size_t)n * DSize(d), off ? DSize(d) : 0);
}

uint32_t GetBits(const Buf& b, precis_dtype_t d, int64_t i) {
  uint32_t u = 0;
  std::memcpy(&u, b.data() + i * DSize(d), DSize(d));
  return u;
}
void SetBits(const Buf& b, precis_dtype_t d, int64_t i, uint32_t u) {
  std::memcpy(b.data() + i * DSize(d), &u, DSize(d));
}
// x rounded to nearest even into d, as bits.
uint32_t RoundBits(precis_dtype_t d, float x) {
  return d == F32 ? precis_f32_bits(x) : d == F16 ? precis_f32_to_f16_rn(x)
                                                  : precis_f32_to_bf16_rn(x);
}
float BitsValue(precis_dtype_t d, uint32_t u) {
  return d == F32 ? precis_bits_f32(u) : d == F16 ? precis_f16_to_f32((uint16_t)u)
                                                  : precis_bf16_to_f32((uint16_t)u);
}
bool IsNan(precis_dtype_t d, uint32_t u) {
  switch (d) {
    case F32: return (u & 0x7FFFFFFFu) > 0x7F800000u;
    case F16: return (u & 0x7FFFu) > 0x7C00u;
    default: return (u & 0x7FFFu) > 0x7F80u;
  }
}
bool IsNonFinite(precis_dtype_t d, uint32_t u) {
  const uint32_t e = d == F32 ? 0x7F800000u : d == F16 ? 0x7C00u : 0x7F80u;
  return (u & e) == e;
}

// ---- values ---------------------------------------------------------------------------

// splitmix64: fast enough for the 16.8M-element buffers under ASan too.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// fp32 values at the edges of every dtype: zeros, infinities, quiet and
// signalling NaNs of both signs, fp32 extremes, fp16's largest finite value
// and its rounding edge (65520 -> inf), fp16 subnormals and their ties, and
// fp16/bf16 ties to even at 1.
const uint32_t kSpecialF32[] = {
    0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u,
    0x7F800001u, 0xFFBFFFFFu, 0x7FFFFFFFu, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x00000001u,
    0x80800000u, 0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0xC77FF000u, 0x33800000u,
    0x33000000u, 0x33000001u, 0xB3C00000u, 0x387FC000u, 0x38800000u, 0x3F800000u,
    0xBF800000u, 0x3F808000u, 0x3F818000u, 0x3F801000u, 0xBF803000u,
};
// The same for the 16-bit dtypes as stored bits: +-0, +-inf, NaNs (signalling
// 0x7C01 / 0x7F81 included), largest finite, smallest subnormal and normal.
const uint16_t kSpecialF16[] = {0x0000, 0x8000, 0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFFFF,
                                0x7BFF, 0xFBFF, 0x0001, 0x83FF, 0x0400, 0x3C00, 0x3C01};
const uint16_t kSpecialB16[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7F81, 0x7FC0, 0xFFFF,
                                0x7F7F, 0xFF7F, 0x0001, 0x807F, 0x0080, 0x3F80, 0x3F81};

// A value over many binades: sign * [1, 2) * 2^e, e in [-32, 21], which takes
// in fp16 subnormals (and values that round to zero) and fp16 overflow.
float Binades(Rng& r) {
  const uint64_t x = r.Next();
  const uint32_t e = (uint32_t)(x % 54) + 127 - 32;
  return precis_bits_f32((uint32_t)(x >> 63) << 31 | e << 23 | ((uint32_t)(x >> 8) & 0x7FFFFFu));
}

// Bits of a random element of d: mostly Binades, with raw bit patterns (every
// exponent and NaN payload of d), edge values and exact ties of fp16/bf16
// rounding mixed in.
uint32_t RandomBits(Rng& r, precis_dtype_t d) {
  const uint64_t x = r.Next();
  switch (x % 16) {
    case 0:
    case 1:
      return d == F32 ? (uint32_t)(x >> 32) : (uint32_t)(x >> 48);
    case 2:
      if (d == F32) return kSpecialF32[(x >> 8) % (sizeof kSpecialF32 / 4)];
      if (d == F16) return kSpecialF16[(x >> 8) % (sizeof kSpecialF16 / 2)];
      return kSpecialB16[(x >> 8) % (sizeof kSpecialB16 / 2)];
    case 3:  // a tie of fp32 -> fp16 rounding (13 bits dropped)
      return RoundBits(d, precis_bits_f32((precis_f32_bits(Binades(r)) & ~0x1FFFu) | 0x1000u));
    case 4:  // a tie of fp32 -> bf16 rounding (16 bits dropped)
      return RoundBits(d, precis_bits_f32((precis_f32_bits(Binades(r)) & ~0xFFFFu) | 0x8000u));
    default:
      return RoundBits(d, Binades(r));
  }
}

void FillRandom(const Buf& b, precis_dtype_t d, int64_t n, uint64_t seed) {
  Rng r(seed);
  for (int64_t i = 0; i < n; ++i) SetBits(b, d, i, RandomBits(r, d));
}

// Finite values in (-2, 2) as bf16, which read as fp32 or fp16 are finite too.
void FillFinite(const Buf& b, int64_t n16, uint64_t seed) {
  Rng r(seed);
  for (int64_t i = 0; i < n16; ++i) {
    SetBits(b, B16, i, precis_f32_to_bf16_rn((float)((int64_t)(r.Next() >> 41) - (1 << 22)) *
                                             0x1p-22f * 1.5f));
  }
}

// accumulate's src: random, or made from dst's element so that the sum rounds:
// dst times -1 - tiny (cancellation) or times 2^-k, k in 1..24 (fractions of an
// ulp of dst in the 16-bit dtypes, exact ties among them).
void FillAddend(const Buf& src, precis_dtype_t sd, const Buf& dst, precis_dtype_t dd, int64_t n,
                uint64_t seed) {
  Rng r(seed);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t x = r.Next();
    const float v = BitsValue(dd, GetBits(dst, dd, i));
    uint32_t u;
    switch (x % 4) {
      case 0: u = RoundBits(sd, -v * (1.0f + (float)((x >> 8) % 64) * 0x1p-20f)); break;
      case 1: u = RoundBits(sd, std::ldexp(v, -(int)(1 + (x >> 8) % 24))); break;
      default: u = RandomBits(r, sd); break;
    }
    SetBits(src, sd, i, u);
  }
}

// ---- comparisons ----------------------------------------------------------------------

// want (the CPU's) and got (the emulated GPU's) hold the same n elements of d,
// and neither was written outside. nan_any_bits: where want is a NaN made by
// arithmetic, any NaN in got will do (see the top of the file).
::testing::AssertionResult SameElements(const Buf& want, const Buf& got, precis_dtype_t d,
                                        int64_t n, bool nan_any_bits) {
  if (!want.CanaryIntact() || !got.CanaryIntact()) {
    return ::testing::AssertionFailure() << "a write outside the buffer";
  }
  int64_t differing = 0, nans = 0;
  std::string shown;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t w = GetBits(want, d, i), g = GetBits(got, d, i);
    if (w == g) continue;
    if (nan_any_bits && IsNan(d, w) && IsNan(d, g)) {
      ++nans;
      continue;
    }
    if (differing++ < 4) {
      char buf[128];
      snprintf(buf, sizeof buf, " [%lld] cpu 0x%x (%.9g) vs cuda 0x%x (%.9g);", (long long)i, w,
               (double)BitsValue(d, w), g, (double)BitsValue(d, g));
      shown += buf;
    }
  }
  if (differing == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << DName(d) << " elements differ:" << shown << " "
                                       << differing << " of " << n << " (" << nans
                                       << " NaNs with other payloads not counted)";
}

// What a call launched and copied, and the execution errors it left.
struct Activity {
  cuda_emu::Stats before = cuda_emu::GetStats();
  uint64_t Launches() const { return cuda_emu::GetStats().launches - before.launches; }
  uint64_t Blocks() const { return cuda_emu::GetStats().blocks - before.blocks; }
  uint64_t Memcpys() const { return cuda_emu::GetStats().memcpys - before.memcpys; }
  bool None() const { return Launches() == 0 && Memcpys() == 0; }
};

// One launch of grid_for(n) blocks, and no execution error.
::testing::AssertionResult OneGridLaunch(const Activity& a, int64_t n) {
  const std::string errors = cuda_emu::TakeErrors();
  if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
  if (a.Launches() != 1 || a.Blocks() != (uint64_t)GridBlocks(n) || a.Memcpys() != 0) {
    return ::testing::AssertionFailure()
           << a.Launches() << " launches of " << a.Blocks() << " blocks in all and "
           << a.Memcpys() << " copies; expected one launch of " << GridBlocks(n) << " blocks";
  }
  return ::testing::AssertionSuccess();
}

std::string Where(int64_t n, bool dst_off, bool src_off) {
  return "numel " + std::to_string(n) + (dst_off ? ", dst" : "") + (src_off ? ", src" : "") +
         (dst_off || src_off ? " one element off" : ", aligned");
}

// ---- accumulate and cast --------------------------------------------------------------

struct Pair {
  precis_dtype_t dst, src;
};
std::vector<Pair> AllPairs() {
  std::vector<Pair> out;
  for (precis_dtype_t d : kFloats)
    for (precis_dtype_t s : kFloats) out.push_back({d, s});
  return out;
}
void PrintTo(const Pair& p, std::ostream* os) {
  *os << "dst " << DName(p.dst) << ", src " << DName(p.src);
}
std::string PairName(const ::testing::TestParamInfo<Pair>& info) {
  return "dst_" + DName(info.param.dst) + "_src_" + DName(info.param.src);
}

// accumulate or cast: the CPU twin and the CUDA entry point.
struct PairOp {
  const char* name;
  precis_status_t (*cpu)(void*, precis_dtype_t, const void*, precis_dtype_t, int64_t);
  precis_status_t (*cuda)(void*, precis_dtype_t, const void*, precis_dtype_t, int64_t, void*);
  bool same_dtype_copies;  // dst_dtype == src_dtype: a device-to-device copy, no kernel
};
const PairOp kAccumulateOp = {"accumulate", precis_accumulate, precis_cuda_accumulate, false};
const PairOp kCastOp = {"cast", precis_cast, precis_cuda_cast, true};

// One call of op on dst `cpu` (the CPU twin) and on a copy of it (CUDA), with the
// same src, which must come back untouched; then the same elements (nan_any_bits
// as for SameElements). From element `changing` on, the caller's data is such
// that every element of dst changes, so that one the kernel skips cannot go
// unseen.
::testing::AssertionResult PairBoth(const PairOp& op, Buf& cpu, precis_dtype_t dd, const Buf& src,
                                    precis_dtype_t sd, int64_t n, int64_t changing,
                                    bool nan_any_bits) {
  Buf gpu = cpu;
  const Buf src_before = src;
  if (op.cpu(cpu.data(), dd, src.data(), sd, n) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  }
  for (int64_t i = changing; i < n; ++i) {
    if (GetBits(cpu, dd, i) == GetBits(gpu, dd, i)) {
      return ::testing::AssertionFailure() << "the test's data: element " << i << " unchanged";
    }
  }
  const Activity a;
  if (op.cuda(gpu.data(), dd, src.data(), sd, n, nullptr) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  }
  if (op.same_dtype_copies && dd == sd) {
    const std::string errors = cuda_emu::TakeErrors();
    if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
    if (a.Launches() != 0 || a.Memcpys() != 1) {
      return ::testing::AssertionFailure() << a.Launches() << " launches and " << a.Memcpys()
                                           << " copies; expected one copy";
    }
  } else {
    ::testing::AssertionResult r = OneGridLaunch(a, n);
    if (!r) return r;
  }
  if (!(src == src_before) || !src.CanaryIntact()) {
    return ::testing::AssertionFailure() << "src was written";
  }
  return SameElements(cpu, gpu, dd, n, nan_any_bits);
}

// A finite, nonzero value of moderate size (|x| in [2^-10, 2^11)) for element
// i, which x * 3 or x + 0.75 x cannot leave unchanged in any dtype.
float Moderate(int64_t i) {
  const float m = 1.0f + (float)(i % 97) / 128.0f;
  return std::ldexp(i % 2 ? -m : m, (int)(i % 21) - 10);
}

// accumulate from random dst and FillAddend's src; from element `changing` on,
// moderate values whose sum changes dst.
::testing::AssertionResult AccumulateBoth(precis_dtype_t dd, precis_dtype_t sd, int64_t n,
                                          bool dst_off, bool src_off, uint64_t seed,
                                          int64_t changing = INT64_MAX) {
  Buf cpu = Make(dd, n, dst_off), src = Make(sd, n, src_off);
  FillRandom(cpu, dd, n, seed);
  FillAddend(src, sd, cpu, dd, n, seed + 1);
  for (int64_t i = changing; i < n; ++i) {
    SetBits(cpu, dd, i, RoundBits(dd, Moderate(i)));
    SetBits(src, sd, i, RoundBits(sd, 0.75f * Moderate(i)));
  }
  return PairBoth(kAccumulateOp, cpu, dd, src, sd, n, changing, /*nan_any_bits=*/true);
}

// cast of random src into random dst (overwritten entirely). Conversions are
// integer bit manipulation (and an exact fp32 add for fp16 subnormals), NaNs
// included: the GPU must give the same bits.
::testing::AssertionResult CastBoth(precis_dtype_t dd, precis_dtype_t sd, int64_t n,
                                    bool dst_off, bool src_off, uint64_t seed) {
  Buf src = Make(sd, n, src_off), cpu = Make(dd, n, dst_off);
  FillRandom(src, sd, n, seed);
  FillRandom(cpu, dd, n, seed + 1);
  return PairBoth(kCastOp, cpu, dd, src, sd, n, INT64_MAX, /*nan_any_bits=*/false);
}

class CudaAccumulate : public ::testing::TestWithParam<Pair> {};

TEST_P(CudaAccumulate, MatchesCpuBitForBit) {
  const Pair p = GetParam();
  uint64_t seed = 100 + 10 * (uint64_t)p.dst + (uint64_t)p.src;
  for (int64_t n : kSizes) {
    for (int layout = 0; layout < 4; ++layout) {
      const bool dst_off = layout & 1, src_off = layout & 2;
      EXPECT_TRUE(AccumulateBoth(p.dst, p.src, n, dst_off, src_off, seed += 7))
          << Where(n, dst_off, src_off);
    }
  }
}

// As on the CPU. (The kernel's dst and src are not __restrict__, and each
// element is read, then written, by one thread.)
TEST_P(CudaAccumulate, DstMayBeSrc) {
  const Pair p = GetParam();
  if (p.dst != p.src) GTEST_SKIP() << "one buffer has one dtype";
  const int64_t n = 4097;
  Buf cpu = Make(p.dst, n, false);
  FillRandom(cpu, p.dst, n, 5);
  Buf gpu = cpu;
  ASSERT_EQ(precis_accumulate(cpu.data(), p.dst, cpu.data(), p.src, n), PRECIS_OK);
  const Activity a;
  ASSERT_EQ(precis_cuda_accumulate(gpu.data(), p.dst, gpu.data(), p.src, n, nullptr), PRECIS_OK)
      << precis_last_error();
  ASSERT_TRUE(OneGridLaunch(a, n));
  EXPECT_TRUE(SameElements(cpu, gpu, p.dst, n, true));
}

INSTANTIATE_TEST_SUITE_P(AllPairs, CudaAccumulate, ::testing::ValuesIn(AllPairs()), PairName);

class CudaCast : public ::testing::TestWithParam<Pair> {};

TEST_P(CudaCast, MatchesCpuBitForBit) {
  const Pair p = GetParam();
  uint64_t seed = 200 + 10 * (uint64_t)p.dst + (uint64_t)p.src;
  for (int64_t n : kSizes) {
    for (int layout = 0; layout < 4; ++layout) {
      const bool dst_off = layout & 1, src_off = layout & 2;
      EXPECT_TRUE(CastBoth(p.dst, p.src, n, dst_off, src_off, seed += 7))
          << Where(n, dst_off, src_off);
    }
  }
}

TEST_P(CudaCast, EverySourceBitPattern) {  // 16-bit sources: all 65536 of them
  const Pair p = GetParam();
  if (p.src == F32) GTEST_SKIP() << "fp32 sources: too many patterns";
  const int64_t n = 65536;
  Buf src = Make(p.src, n, false), cpu = Make(p.dst, n, true);
  for (int64_t i = 0; i < n; ++i) SetBits(src, p.src, i, (uint32_t)i);
  Buf gpu = cpu;
  ASSERT_EQ(precis_cast(cpu.data(), p.dst, src.data(), p.src, n), PRECIS_OK);
  ASSERT_EQ(precis_cuda_cast(gpu.data(), p.dst, src.data(), p.src, n, nullptr), PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_TRUE(SameElements(cpu, gpu, p.dst, n, false));
}

INSTANTIATE_TEST_SUITE_P(AllPairs, CudaCast, ::testing::ValuesIn(AllPairs()), PairName);

TEST(CudaCastOverlap, SameStatusAsCpuAndNothingWrittenWhenRejected) {
  // dst and src of 16 elements in one 512-byte arena, src at byte 192 and dst
  // around it, in steps of its element size: just apart, ends touching, one
  // element of overlap, the same start (same buffer) and one element off.
  const int64_t n = 16;
  const int64_t src_at = 192;
  int rejected = 0, cast = 0;
  for (precis_dtype_t dd : kFloats) {
    for (precis_dtype_t sd : kFloats) {
      const int64_t ed = (int64_t)DSize(dd), dst_bytes = n * ed, src_bytes = n * (int64_t)DSize(sd);
      const int64_t shifts[] = {-dst_bytes - ed, -dst_bytes, -dst_bytes + ed, -ed, 0, ed,
                                src_bytes - ed,  src_bytes,  src_bytes + ed};
      for (int64_t shift : shifts) {
        const int64_t dst_at = src_at + shift;
        SCOPED_TRACE("dst " + DName(dd) + " at byte " + std::to_string(dst_at) + ", src " +
                     DName(sd) + " at byte " + std::to_string(src_at));
        Buf cpu(512, 0);
        FillRandom(cpu, B16, 256, 17);
        Buf gpu = cpu;
        const Buf before = cpu;
        const precis_status_t want =
            precis_cast(cpu.data() + dst_at, dd, cpu.data() + src_at, sd, n);
        const Activity a;
        const precis_status_t got =
            precis_cuda_cast(gpu.data() + dst_at, dd, gpu.data() + src_at, sd, n, nullptr);
        ASSERT_EQ(got, want) << precis_last_error();
        EXPECT_EQ(cuda_emu::TakeErrors(), "");
        if (got != PRECIS_OK) {
          EXPECT_TRUE(a.None());
          EXPECT_TRUE(gpu == before);
          EXPECT_NE(std::string(precis_last_error()).find("overlap"), std::string::npos)
              << precis_last_error();
          ++rejected;
        } else if (dd == sd && shift == 0) {
          EXPECT_TRUE(a.None()) << "a cast onto itself does nothing";
        } else {
          ++cast;
        }
        EXPECT_TRUE(SameElements(cpu, gpu, B16, 256, false));
      }
    }
  }
  // Five shifts of each pair overlap (the same buffer with the same dtype: a
  // no-op), four do not.
  EXPECT_EQ(rejected, 9 * 5 - 3);
  EXPECT_EQ(cast, 9 * 4);
}

// ---- scale ----------------------------------------------------------------------------

class CudaScale : public ::testing::TestWithParam<precis_dtype_t> {};

std::string DtypeName(const ::testing::TestParamInfo<precis_dtype_t>& info) {
  return DName(info.param);
}

// Factors that round, flip signs, zero (Inf * 0 is NaN), overflow fp16/bf16
// and push into fp16 subnormals; 1 is a no-op without a launch.
const float kFactors[] = {0.5f,    3.0f,    -1.5f,        0.1f, 1e-3f,     0.0f,
                          -0.0f,   1024.0f, 65536.0f,     1e30f, 0x1p-20f, -0x1p-126f,
                          0x1p-149f, 1.0f};

TEST_P(CudaScale, MatchesCpuBitForBit) {
  const precis_dtype_t d = GetParam();
  uint64_t seed = 300 + (uint64_t)d;
  for (float factor : kFactors) {
    for (int64_t n : kSizes) {
      for (bool off : {false, true}) {
        SCOPED_TRACE("factor " + std::to_string(factor) + ", " + Where(n, off, false));
        Buf cpu = Make(d, n, off);
        FillRandom(cpu, d, n, seed += 7);
        Buf gpu = cpu;
        const Buf before = cpu;
        ASSERT_EQ(precis_scale(cpu.data(), d, factor, n), PRECIS_OK) << precis_last_error();
        const Activity a;
        ASSERT_EQ(precis_cuda_scale(gpu.data(), d, factor, n, nullptr), PRECIS_OK)
            << precis_last_error();
        if (factor == 1.0f) {  // exact no-op: NaN payloads untouched too
          EXPECT_EQ(cuda_emu::TakeErrors(), "");
          EXPECT_TRUE(a.None());
          EXPECT_TRUE(gpu == before);
        } else {
          EXPECT_TRUE(OneGridLaunch(a, n));
        }
        EXPECT_TRUE(SameElements(cpu, gpu, d, n, /*nan_any_bits=*/true));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CudaScale, ::testing::ValuesIn(kFloats), DtypeName);

// ---- count_nonfinite ------------------------------------------------------------------

class CudaCountNonfinite : public ::testing::TestWithParam<precis_dtype_t> {};

// Counts of both; the GPU's *out_count starts at `start` and gets the count added.
::testing::AssertionResult CountBoth(const Buf& b, precis_dtype_t d, int64_t n, int64_t start,
                                     int64_t* count) {
  int64_t want = -12345;
  if (precis_count_nonfinite(b.data(), d, n, &want) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  }
  const Buf before = b;
  int64_t got = start;
  const Activity a;
  if (precis_cuda_count_nonfinite(b.data(), d, n, &got, nullptr) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  }
  ::testing::AssertionResult r = OneGridLaunch(a, n);
  if (!r) return r;
  if (!(b == before)) return ::testing::AssertionFailure() << "buf was written";
  if (got - start != want) {
    return ::testing::AssertionFailure() << "cpu counts " << want << ", cuda adds "
                                         << got - start << " to " << start;
  }
  *count = want;
  return ::testing::AssertionSuccess();
}

// Non-finite elements at the edges of threads, warps, blocks and the tail.
void PlantNonfinite(const Buf& b, precis_dtype_t d, int64_t n, uint64_t seed) {
  const uint32_t nonfinite[3][4] = {{0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFF800001u},
                                    {0x7C00u, 0xFC00u, 0x7E00u, 0xFC01u},
                                    {0x7F80u, 0xFF80u, 0x7FC0u, 0xFF81u}};
  const int64_t at[] = {0, 1, 31, 32, 255, 256, 257, 4095, 4096, n / 2, n - 2, n - 1};
  Rng r(seed);
  for (int64_t i : at) {
    if (i >= 0 && i < n) SetBits(b, d, i, nonfinite[d][r.Next() % 4]);
  }
}

TEST_P(CudaCountNonfinite, MatchesCpu) {
  const precis_dtype_t d = GetParam();
  uint64_t seed = 400 + (uint64_t)d;
  for (int64_t n : kSizes) {
    for (bool off : {false, true}) {
      SCOPED_TRACE(Where(n, off, false));
      Buf b = Make(d, n, off);
      // Random (NaN and Inf among them), planted ones, all finite, all not.
      FillRandom(b, d, n, seed += 7);
      PlantNonfinite(b, d, n, seed);
      int64_t count = 0;
      ASSERT_TRUE(CountBoth(b, d, n, 0, &count));
      EXPECT_GT(count, 0);
      for (int64_t i = 0; i < n; ++i) {
        if (IsNonFinite(d, GetBits(b, d, i))) SetBits(b, d, i, RoundBits(d, 1.0f));
      }
      // The largest finite values and subnormals are finite.
      if (n > 2) {
        SetBits(b, d, 0, d == F32 ? 0x7F7FFFFFu : d == F16 ? 0xFBFFu : 0x7F7Fu);
        SetBits(b, d, 1, 1u);
      }
      ASSERT_TRUE(CountBoth(b, d, n, 0, &count));
      EXPECT_EQ(count, 0);
      for (int64_t i = 0; i < n; ++i) {
        SetBits(b, d, i, (d == F32 ? 0x7F800000u : d == F16 ? 0x7C00u : 0x7F80u) + (i % 3));
      }
      ASSERT_TRUE(CountBoth(b, d, n, 0, &count));
      EXPECT_EQ(count, n);
    }
  }
}

TEST_P(CudaCountNonfinite, AddsToOutCount) {
  // precis.h: "out_count points to device memory; the count is added to it
  // (zero it first)". The CPU twin sets it instead.
  const precis_dtype_t d = GetParam();
  const int64_t n = 4097;
  Buf b = Make(d, n, false);
  FillRandom(b, d, n, 41);
  PlantNonfinite(b, d, n, 41);
  int64_t count = 0;
  ASSERT_TRUE(CountBoth(b, d, n, 0, &count));
  int64_t out = 1000;
  ASSERT_EQ(precis_cuda_count_nonfinite(b.data(), d, n, &out, nullptr), PRECIS_OK);
  ASSERT_EQ(precis_cuda_count_nonfinite(b.data(), d, n, &out, nullptr), PRECIS_OK);
  EXPECT_EQ(out, 1000 + 2 * count) << "two calls add twice";
  // No non-finite element: the kernel runs and adds nothing.
  for (int64_t i = 0; i < n; ++i) SetBits(b, d, i, 0u);
  ASSERT_TRUE(CountBoth(b, d, n, 77, &count));
  EXPECT_EQ(count, 0);
  // Zero elements: nothing launched, *out_count untouched (the CPU writes 0),
  // and buf may be NULL.
  int64_t cpu_out = 5, gpu_out = 5;
  const Activity a;
  EXPECT_EQ(precis_cuda_count_nonfinite(nullptr, d, 0, &gpu_out, nullptr), PRECIS_OK);
  EXPECT_EQ(precis_count_nonfinite(nullptr, d, 0, &cpu_out), PRECIS_OK);
  EXPECT_TRUE(a.None());
  EXPECT_EQ(gpu_out, 5);
  EXPECT_EQ(cpu_out, 0);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CudaCountNonfinite, ::testing::ValuesIn(kFloats),
                         DtypeName);

// ---- past one grid: the grid-stride loops' second turn ----------------------------------

// kBigSize elements: 65535 blocks of 256 threads, each thread two elements for
// the first 1000 threads and one for the rest. Each 16.8M-thread launch takes
// about a second (several under ASan), so one dtype pair per op here, each with
// a conversion in it; the other pairs take the same loop.
TEST(CudaBucketOpsPastOneGrid, EveryOpMatchesCpu) {
  const int64_t n = kBigSize;
  // Random data, but every element from the last threads of the first turn on
  // changes (is counted), so that one the loops skip cannot go unseen.
  const int64_t changing = kGridThreads - 64;
  {
    SCOPED_TRACE("accumulate bf16 += fp32");
    EXPECT_TRUE(AccumulateBoth(B16, F32, n, true, false, 501, changing));
  }
  {
    SCOPED_TRACE("cast fp32 -> fp16");
    EXPECT_TRUE(CastBoth(F16, F32, n, false, true, 502));
  }
  {
    SCOPED_TRACE("scale fp16 by 3");
    Buf cpu = Make(F16, n, false);
    FillRandom(cpu, F16, n, 503);
    for (int64_t i = changing; i < n; ++i) SetBits(cpu, F16, i, RoundBits(F16, Moderate(i)));
    Buf gpu = cpu;
    ASSERT_EQ(precis_scale(cpu.data(), F16, 3.0f, n), PRECIS_OK);
    for (int64_t i = changing; i < n; ++i) {
      ASSERT_NE(GetBits(cpu, F16, i), GetBits(gpu, F16, i)) << "the test's data: " << i;
    }
    const Activity a;
    ASSERT_EQ(precis_cuda_scale(gpu.data(), F16, 3.0f, n, nullptr), PRECIS_OK);
    EXPECT_TRUE(OneGridLaunch(a, n));
    EXPECT_TRUE(SameElements(cpu, gpu, F16, n, true));
  }
  {
    SCOPED_TRACE("count_nonfinite bf16");
    Buf b = Make(B16, n, true);
    FillRandom(b, B16, n, 504);
    for (int64_t i = 0; i < n; ++i) {  // only the planted ones count
      if (IsNonFinite(B16, GetBits(b, B16, i))) SetBits(b, B16, i, 0x3F80u);
    }
    for (int64_t i = changing; i < n; ++i) SetBits(b, B16, i, i % 2 ? 0xFF80u : 0x7FC1u);
    PlantNonfinite(b, B16, n, 504);
    int64_t count = 0;
    ASSERT_TRUE(CountBoth(b, B16, n, 0, &count));
    EXPECT_EQ(count, 10 + 1064);  // planted below `changing` (0 .. 4096, n / 2), all from it on
  }
}

// ---- argument errors ------------------------------------------------------------------

// Dtype codes: the three accepted, fp8 and int16 (valid codes, not accepted),
// and codes that are no dtype.
const int kDtypeCodes[] = {F32, F16, B16, PRECIS_DTYPE_FP8_E4M3, PRECIS_DTYPE_INT16,
                           PRECIS_DTYPE_COUNT, -1, 99};
const int64_t kNumels[] = {INT64_MIN, -1, 0, 5};

// The call, for messages.
std::string Args(const char* fn, bool p1, int d1, bool p2, int d2, int64_t n) {
  return std::string(fn) + "(" + (p1 ? "buf" : "NULL") + ", " + std::to_string(d1) + ", " +
         (p2 ? "buf" : "NULL") + ", " + std::to_string(d2) + ", " + std::to_string(n) + ")";
}

// A CUDA entry point's message as its CPU twin words it: the checks are shared
// (csrc/bucket_args.h), only the function name differs.
std::string AsCpuMessage(std::string msg) {
  const std::string cuda = "precis_cuda_";
  if (msg.compare(0, cuda.size(), cuda) == 0) msg.replace(0, cuda.size(), "precis_");
  return msg;
}

class ArgumentErrors : public ::testing::Test {
 protected:
  // Two buffers of 8 fp32 / 16 16-bit elements per side.
  Buf a_cpu_{32, 0}, b_cpu_{32, 0};
  Buf a_gpu_{32, 0}, b_gpu_{32, 0};

  void SetUp() override {
    // Finite: NaN payloads of sums may differ (see the top of the file).
    FillFinite(a_cpu_, 16, 1);
    FillFinite(b_cpu_, 16, 2);
    a_gpu_ = Buf(a_cpu_);
    b_gpu_ = Buf(b_cpu_);
  }

  // Runs both with the same arguments: the same status and message; a failing
  // GPU call launched and copied nothing, wrote nothing, and said why.
  template <class CpuCall, class GpuCall>
  void Both(const std::string& what, CpuCall cpu_call, GpuCall gpu_call) {
    SCOPED_TRACE(what);
    const Buf a_before = a_gpu_, b_before = b_gpu_;
    const precis_status_t want = cpu_call();
    const std::string cpu_error = precis_last_error();
    const Activity act;
    const precis_status_t got = gpu_call();
    const std::string gpu_error = precis_last_error();
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    EXPECT_EQ(got, want) << "cpu: \"" << cpu_error << "\", cuda: \"" << gpu_error << "\"";
    EXPECT_EQ(AsCpuMessage(gpu_error), cpu_error);
    if (got != PRECIS_OK) {
      EXPECT_TRUE(act.None()) << act.Launches() << " launches, " << act.Memcpys() << " copies";
      EXPECT_TRUE(a_gpu_ == a_before && b_gpu_ == b_before) << "written";
      EXPECT_NE(gpu_error, "");
    } else {
      EXPECT_EQ(gpu_error, "") << "success clears the last error";
    }
    if (got == PRECIS_OK && want == PRECIS_OK) {
      EXPECT_TRUE(a_cpu_ == a_gpu_ && b_cpu_ == b_gpu_) << "different results";
    }
    // Start the next call from equal buffers again.
    a_gpu_ = Buf(a_cpu_);
    b_gpu_ = Buf(b_cpu_);
  }

  // Every combination of dtype codes, numel and NULL pointers, so that the
  // order of the checks shows too (numel, dst_dtype, src_dtype, the pointers).
  void EveryPairCombination(const PairOp& op) {
    for (bool dst_ok : {true, false})
      for (bool src_ok : {true, false})
        for (int dd : kDtypeCodes)
          for (int sd : kDtypeCodes)
            for (int64_t n : kNumels) {
              auto cpu = [&] {
                return op.cpu(dst_ok ? a_cpu_.data() : nullptr, (precis_dtype_t)dd,
                              src_ok ? b_cpu_.data() : nullptr, (precis_dtype_t)sd, n);
              };
              auto gpu = [&] {
                return op.cuda(dst_ok ? a_gpu_.data() : nullptr, (precis_dtype_t)dd,
                               src_ok ? b_gpu_.data() : nullptr, (precis_dtype_t)sd, n, nullptr);
              };
              Both(Args(op.name, dst_ok, dd, src_ok, sd, n), cpu, gpu);
            }
  }
};

TEST_F(ArgumentErrors, AccumulateSameStatusAsCpu) { EveryPairCombination(kAccumulateOp); }

TEST_F(ArgumentErrors, CastSameStatusAsCpu) { EveryPairCombination(kCastOp); }

TEST_F(ArgumentErrors, ScaleSameStatusAsCpu) {
  const float factors[] = {0.5f, 1.0f, NAN, -NAN, INFINITY, -INFINITY};
  for (bool buf_ok : {true, false})
    for (int d : kDtypeCodes)
      for (float factor : factors)
        for (int64_t n : kNumels) {
          auto cpu = [&] {
            return precis_scale(buf_ok ? a_cpu_.data() : nullptr, (precis_dtype_t)d, factor, n);
          };
          auto gpu = [&] {
            return precis_cuda_scale(buf_ok ? a_gpu_.data() : nullptr, (precis_dtype_t)d,
                                     factor, n, nullptr);
          };
          Both(Args("scale", buf_ok, d, false, 0, n) + " factor " + std::to_string(factor), cpu,
               gpu);
        }
}

TEST_F(ArgumentErrors, CountNonfiniteSameStatusAsCpu) {
  for (bool buf_ok : {true, false})
    for (bool out_ok : {true, false})
      for (int d : kDtypeCodes)
        for (int64_t n : kNumels) {
          int64_t cpu_out = 0, gpu_out = 0;
          auto cpu = [&] {
            return precis_count_nonfinite(buf_ok ? a_cpu_.data() : nullptr, (precis_dtype_t)d, n,
                                          out_ok ? &cpu_out : nullptr);
          };
          auto gpu = [&] {
            return precis_cuda_count_nonfinite(buf_ok ? a_gpu_.data() : nullptr,
                                               (precis_dtype_t)d, n,
                                               out_ok ? &gpu_out : nullptr, nullptr);
          };
          Both(Args("count_nonfinite", buf_ok, d, out_ok, 0, n), cpu, gpu);
          EXPECT_EQ(gpu_out, cpu_out) << Args("count_nonfinite", buf_ok, d, out_ok, 0, n);
        }
}

// ---- the emulation of what these kernels add to step.cu's ----------------------------

}  // namespace

namespace {

// precis_cuda_fingerprint against precis_fingerprint (csrc/fingerprint.c): the same
// values for the same bytes, at every tail length (0-7 bytes), at 8-byte aligned and
// unaligned addresses (the bytewise loads), past one block's words, for lists longer
// than one launch takes (512 tensors), and changed by a changed byte; bad arguments
// launch nothing.
std::vector<uint64_t> CudaFingerprints(const std::vector<const void*>& bufs,
                                       const std::vector<int64_t>& nbytes) {
  std::vector<uint64_t> out(bufs.size(), 0xDEADu);
  EXPECT_EQ(precis_cuda_fingerprint(bufs.data(), nbytes.data(), (int64_t)bufs.size(), out.data(),
                                    nullptr),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  return out;
}

std::vector<uint64_t> CpuFingerprints(const std::vector<const void*>& bufs,
                                      const std::vector<int64_t>& nbytes) {
  std::vector<uint64_t> out(bufs.size(), 0);
  EXPECT_EQ(precis_fingerprint(bufs.data(), nbytes.data(), (int64_t)bufs.size(), out.data()),
            PRECIS_OK)
      << precis_last_error();
  return out;
}

TEST(CudaFingerprint, MatchesCpu) {
  // tails of 0-7 bytes, one block's words (256 x 16) and one word more, and 1030 ranges
  // more: 3 launches (512, 512, 14)
  std::vector<int64_t> lengths = {0, 1, 7, 8, 9, 2 * 127, 8 * 4096, 8 * 4097 + 3};
  for (int i = 0; i < 1030; ++i) lengths.push_back(1 + 37 * (i % 70));
  Rng rng(600);
  std::vector<std::vector<unsigned char>> store;
  std::vector<const void*> bufs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    store.emplace_back((size_t)lengths[i] + 16);
    for (auto& b : store.back()) b = (unsigned char)rng.Next();
    unsigned char* p = store.back().data();
    p += (8 - (uintptr_t)p % 8) % 8 + (i % 2 ? 2 : 0);  // 8-byte aligned, or 2 bytes off
    bufs.push_back(p);
  }
  const std::vector<uint64_t> want = CpuFingerprints(bufs, lengths);
  EXPECT_EQ(CudaFingerprints(bufs, lengths), want);
  for (size_t i : {(size_t)1, (size_t)7, lengths.size() - 1}) {
    unsigned char* p = (unsigned char*)bufs[i];
    p[lengths[i] - 1] ^= 0x10;  // in the tail, or the last word
    EXPECT_NE(CudaFingerprints(bufs, lengths)[i], want[i]) << "range " << i;
    p[lengths[i] - 1] ^= 0x10;
  }
  uint64_t out = 0;
  int64_t bad[] = {3};
  const void* none[] = {nullptr};
  const uint64_t launches = cuda_emu::GetStats().launches;
  EXPECT_EQ(precis_cuda_fingerprint(none, bad, 1, &out, nullptr), PRECIS_ERR_NULL_POINTER);
  bad[0] = -1;
  EXPECT_EQ(precis_cuda_fingerprint(bufs.data(), bad, 1, &out, nullptr),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_cuda_fingerprint(bufs.data(), lengths.data(), 1, nullptr, nullptr),
            PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(cuda_emu::GetStats().launches, launches);  // bad arguments launch nothing
}

TEST(CudaFingerprint, PastOneGridOfThreads) {  // a block per 4096 words: thousands of blocks
  const int64_t n = 8 * (kGridThreads / 16) + 5;
  std::vector<unsigned char> bytes((size_t)n);
  Rng rng(601);
  for (auto& b : bytes) b = (unsigned char)rng.Next();
  std::vector<const void*> bufs = {bytes.data()};
  std::vector<int64_t> lengths = {n};
  EXPECT_EQ(CudaFingerprints(bufs, lengths), CpuFingerprints(bufs, lengths));
}

// precis_cuda_fingerprint_blocks against precis_fingerprint_blocks (csrc/fingerprint.c):
// the same entries for the same bytes, with blocks of one word, three words, a bf16 step
// record's 32 KiB and one word past a 256 KiB CPU chunk; ranges empty, of a tail alone,
// around one block and over three, 8-byte aligned or 2 bytes off, lists longer than one
// launch takes; a changed byte changes its block's entry alone; the whole out written (a
// stale out gives the same entries) and nothing past it; bad arguments launch nothing
// and write nothing.
constexpr uint64_t kStale = 0x5E7715E7ull;

// Entries of the ranges' blocks (max(1, ceil(nbytes / block)) each).
size_t BlockEntries(const std::vector<int64_t>& nbytes, int64_t block) {
  size_t total = 0;
  for (int64_t n : nbytes) total += n == 0 ? 1 : (size_t)((n + block - 1) / block);
  return total;
}

// The CUDA call's entries, out prefilled with kStale and one entry longer (which must
// stay kStale).
std::vector<uint64_t> CudaBlocks(const std::vector<const void*>& bufs,
                                 const std::vector<int64_t>& nbytes, int64_t block) {
  std::vector<uint64_t> out(BlockEntries(nbytes, block) + 1, kStale);
  EXPECT_EQ(precis_cuda_fingerprint_blocks(bufs.data(), nbytes.data(), (int64_t)bufs.size(),
                                           block, out.data(), nullptr),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_EQ(out.back(), kStale) << "written past the last range's blocks (block " << block
                                << ")";
  out.pop_back();
  return out;
}

std::vector<uint64_t> CpuBlocks(const std::vector<const void*>& bufs,
                                const std::vector<int64_t>& nbytes, int64_t block) {
  std::vector<uint64_t> out(BlockEntries(nbytes, block), 0);
  EXPECT_EQ(precis_fingerprint_blocks(bufs.data(), nbytes.data(), (int64_t)bufs.size(), block,
                                      out.data()),
            PRECIS_OK)
      << precis_last_error();
  return out;
}

// Random bytes for each length, at 8-byte aligned addresses (odd i: 2 bytes off).
struct Ranges {
  std::vector<std::vector<unsigned char>> store;
  std::vector<const void*> bufs;
  Ranges(const std::vector<int64_t>& lengths, uint64_t seed) {
    Rng rng(seed);
    for (size_t i = 0; i < lengths.size(); ++i) {
      store.emplace_back((size_t)lengths[i] + 16);
      for (auto& b : store.back()) b = (unsigned char)rng.Next();
      unsigned char* p = store.back().data();
      p += (8 - (uintptr_t)p % 8) % 8 + (i % 2 ? 2 : 0);
      bufs.push_back(p);
    }
  }
};

TEST(CudaFingerprintBlocks, MatchCpu) {
  for (int64_t block : {(int64_t)8, (int64_t)24, (int64_t)32768, (int64_t)8 * (1 << 15) + 8}) {
    SCOPED_TRACE("block " + std::to_string(block));
    std::vector<int64_t> lengths = {0, 1, 7, 8, 9, 127, block - 1, block, block + 1, 0,
                                    3 * block + 5};
    Ranges r(lengths, 700 + (uint64_t)block);
    const std::vector<uint64_t> want = CpuBlocks(r.bufs, lengths, block);
    EXPECT_EQ(CudaBlocks(r.bufs, lengths, block), want);
    // one range at a time: each its own launch, its entries from 0
    size_t at = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const std::vector<uint64_t> one = CudaBlocks({r.bufs[i]}, {lengths[i]}, block);
      EXPECT_EQ(one, std::vector<uint64_t>(want.begin() + at, want.begin() + at + one.size()))
          << "range " << i << " alone (nbytes " << lengths[i] << ")";
      at += one.size();
    }
  }
}

TEST(CudaFingerprintBlocks, ListsLongerThanOneLaunch) {
  // 1030 ranges of 1-2554 bytes (as CudaFingerprint.MatchesCpu's: 3 launches of its
  // 512 ranges), empty ones among them, and a range of many blocks last.
  std::vector<int64_t> lengths;
  for (int i = 0; i < 1030; ++i) lengths.push_back(i % 11 == 4 ? 0 : 1 + 37 * (i % 70));
  lengths.push_back(8 * 4097 + 3);
  Ranges r(lengths, 701);
  for (int64_t block : {(int64_t)64, (int64_t)32768}) {
    EXPECT_EQ(CudaBlocks(r.bufs, lengths, block), CpuBlocks(r.bufs, lengths, block))
        << "block " << block;
  }
}

TEST(CudaFingerprintBlocks, AChangedByteChangesItsBlockAlone) {
  const int64_t block = 32768, n = 3 * block + 5;
  Ranges r({n}, 702);
  const std::vector<uint64_t> before = CudaBlocks(r.bufs, {n}, block);
  ASSERT_EQ(before, CpuBlocks(r.bufs, {n}, block));
  unsigned char* p = (unsigned char*)r.bufs[0];
  for (int64_t i : {(int64_t)0, block - 1, block, 2 * block + 100, 3 * block, n - 1}) {
    p[i] ^= 0x10;
    const std::vector<uint64_t> after = CudaBlocks(r.bufs, {n}, block);
    p[i] ^= 0x10;
    std::vector<uint64_t> want = before;
    EXPECT_NE(after[(size_t)(i / block)], before[(size_t)(i / block)]) << "byte " << i;
    want[(size_t)(i / block)] = after[(size_t)(i / block)];
    EXPECT_EQ(after, want) << "byte " << i << " changed another block";
  }
}

TEST(CudaFingerprintBlocks, PastOneGridOfThreads) {  // as CudaFingerprint's, in blocks
  const int64_t n = 8 * (kGridThreads / 16) + 5;
  Ranges r({n}, 703);
  EXPECT_EQ(CudaBlocks(r.bufs, {n}, 32768), CpuBlocks(r.bufs, {n}, 32768));
}

TEST(CudaFingerprintBlocks, BadArgumentsLaunchNothingAndWriteNothing) {
  Ranges r({100, 20}, 704);
  std::vector<const void*> bufs = r.bufs;
  std::vector<int64_t> lengths = {100, 20};
  std::vector<uint64_t> out(8, kStale);
  const std::vector<uint64_t> untouched = out;
  const uint64_t launches = cuda_emu::GetStats().launches, memcpys = cuda_emu::GetStats().memcpys;
  auto call = [&](const void* const* b, const int64_t* n, int64_t count, int64_t block,
                  uint64_t* o) {
    return precis_cuda_fingerprint_blocks(b, n, count, block, o, nullptr);
  };
  for (int64_t block : {(int64_t)0, (int64_t)-8, (int64_t)4, (int64_t)12}) {
    EXPECT_EQ(call(bufs.data(), lengths.data(), 2, block, out.data()),
              PRECIS_ERR_INVALID_ARGUMENT)
        << "block " << block;
    EXPECT_NE(std::string(precis_last_error()).find("block"), std::string::npos)
        << precis_last_error();
  }
  EXPECT_EQ(call(bufs.data(), lengths.data(), 2, 64, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(call(nullptr, lengths.data(), 2, 64, out.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(call(bufs.data(), nullptr, 2, 64, out.data()), PRECIS_ERR_NULL_POINTER);
  bufs[1] = nullptr;
  EXPECT_EQ(call(bufs.data(), lengths.data(), 2, 64, out.data()), PRECIS_ERR_NULL_POINTER);
  bufs[1] = r.bufs[1];
  lengths[1] = -1;
  EXPECT_EQ(call(bufs.data(), lengths.data(), 2, 64, out.data()), PRECIS_ERR_INVALID_ARGUMENT);
  lengths[1] = 20;
  EXPECT_EQ(call(bufs.data(), lengths.data(), -1, 64, out.data()), PRECIS_ERR_INVALID_ARGUMENT);
  // out must be 8-byte aligned (precis.h)
  uint64_t* misaligned = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(out.data()) + 4);
  EXPECT_EQ(call(bufs.data(), lengths.data(), 2, 64, misaligned), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(cuda_emu::GetStats().launches, launches);  // bad arguments launch nothing
  EXPECT_EQ(cuda_emu::GetStats().memcpys, memcpys);
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_EQ(out, untouched);
  // and the same arguments, put right, are taken
  EXPECT_EQ(CudaBlocks(bufs, lengths, 64), CpuBlocks(bufs, lengths, 64));
}

}  // namespace

// emulator_selftest.cu: launch (or copy), return the CUDA error (0: success).
extern "C" int emu_selftest_shared_and_atomics(unsigned* seen, unsigned long long* total,
                                               unsigned blocks, unsigned threads);
extern "C" int emu_selftest_memcpy(void* dst, const void* src, size_t n);

namespace {

TEST(CudaEmulator, SharedMemoryIsPerBlockAndAtomicAddsAdd) {
  const unsigned blocks = 5, threads = 48;
  std::vector<unsigned> seen(blocks * threads, 0xDEADu);
  unsigned long long total = 1000;
  ASSERT_EQ(emu_selftest_shared_and_atomics(seen.data(), &total, blocks, threads), 0);
  ASSERT_EQ(cuda_emu::TakeErrors(), "");
  unsigned long long want_total = 1000;
  for (unsigned b = 0; b < blocks; ++b) {
    const unsigned sum = 3u * threads * (threads - 1) / 2 + b * threads;
    want_total += sum;
    for (unsigned t = 0; t < threads; ++t) EXPECT_EQ(seen[b * threads + t], sum) << b << " " << t;
  }
  EXPECT_EQ(total, want_total);
}

TEST(CudaEmulator, MemcpyCopiesCountsAndReportsOverlap) {
  uint8_t buf[64];
  for (int i = 0; i < 64; ++i) buf[i] = (uint8_t)i;
  const uint64_t before = cuda_emu::GetStats().memcpys;
  ASSERT_EQ(emu_selftest_memcpy(buf + 32, buf, 16), 0);
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  for (int i = 0; i < 16; ++i) EXPECT_EQ(buf[32 + i], i);
  ASSERT_EQ(emu_selftest_memcpy(buf + 1, buf, 16), 0);  // undefined in CUDA: reported
  const std::string errors = cuda_emu::TakeErrors();
  EXPECT_NE(errors.find("overlap"), std::string::npos) << errors;
  EXPECT_EQ(cuda_emu::GetStats().memcpys - before, 2u);
}

}  // namespace
