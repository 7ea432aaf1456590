// precis_cuda_resync_masters (cuda/resync.cu), run on the CPU by the emulator of
// cuda_emu.h (see tests/BUILD), against its CPU twin precis_resync_masters
// (csrc/resync.c): from the same masters, params and flags, the CUDA entry point
// must write exactly the masters' bits and the kept counts the CPU writes, and
// leave the params and the flags as they were. Covered: fp32 and fp16 masters of
// bf16 and fp16 params in sync, written in part, loaded whole, and on both sides of the
// whole-load boundary (kept == max(1, n/64) and one more); int16 and fp8 remainders;
// tensors of 0 elements among others, of one partial 4096-element block and of
// several blocks (the count kernel's per-block sums added with atomicAdd); calls of
// more than 512 tensors (several launches of each kernel); mixed flags (any
// nonzero byte is stale); and bad arguments giving the CPU's status before anything
// is launched or written. precis_resync_changed and its CUDA twin (the compare of
// fingerprints now against records made by the callee) against precis_resync_masters
// given the flags fingerprint != record: the same masters, kept and flags; records
// NULL rejected with nothing written. precis_cuda_resync_compared (the fingerprint, the
// compare and the resync in one launch, each tensor finished by the block that counts
// its last chunk) against the same: the same masters and kept, its sums left zero, its
// zeroed set to 0, one launch per 512 tensors. "Device pointers" are host pointers here.
//
// What the emulation cannot see: blocks running at the same time (they run one after
// another here, so the count kernel's atomicAdd is not raced, and the block that finishes
// a tensor in precis_cuda_resync_compared is its last chunk's in grid order), and the
// launches' order on a real stream (here each runs at once, in call order).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "precis/precis.h"
#include "precis_convert.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

// cuda/resync.cu's geometry: 256 threads x 16 elements a block, 512 tensors a launch.
constexpr int64_t kBlockElems = 4096;
constexpr int64_t kTensors = 512;
constexpr uint64_t kGrid = 1024;  // cuda/resync.cu's: the count and write kernels' most blocks

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x2545F491ull) {}
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

uint16_t Round(float x, precis_dtype_t pd) {
  return pd == B16 ? precis_f32_to_bf16_rn(x) : precis_f32_to_f16_rn(x);
}

// An fp32 master: mostly values over many binades, sometimes raw bits (NaNs, infs,
// subnormals of every payload).
float RandomMaster(Rng& r) {
  const uint64_t x = r.Next();
  if (x % 23 == 0) return precis_bits_f32((uint32_t)(x >> 32));
  const uint32_t e = (uint32_t)((x >> 8) % 60) + 127 - 36;
  return precis_bits_f32((uint32_t)(x >> 63) << 31 | e << 23 | ((uint32_t)(x >> 20) & 0x7FFFFFu));
}

// How a stale tensor's params were written relative to its masters.
enum Write { kNone, kPartial, kWhole, kBoundaryWhole, kBoundaryPartial, kRandomBits };
const char* WriteName(Write w) {
  switch (w) {
    case kNone: return "in sync";
    case kPartial: return "partial write";
    case kWhole: return "whole load";
    case kBoundaryWhole: return "kept == max(1, n/64)";
    case kBoundaryPartial: return "kept == max(1, n/64) + 1";
    case kRandomBits: return "random bits";
  }
  return "?";
}

// One tensor's buffers: master bytes (fp32, int16 or fp8 bytes) and param bits.
struct Tensor {
  std::vector<uint8_t> master;
  std::vector<uint16_t> param;
  int64_t n = 0;
};

// An fp16 master's bits: mostly values over every binade of fp16, sometimes raw bits
// (NaNs, infs).
uint16_t RandomMaster16(Rng& r) {
  const uint64_t x = r.Next();
  if (x % 23 == 0) return (uint16_t)(x >> 40);
  const uint32_t e = (uint32_t)((x >> 8) % 31);
  return (uint16_t)((uint32_t)(x >> 63) << 15 | e << 10 | ((uint32_t)(x >> 20) & 0x3FFu));
}

// A master tensor (fp32, or fp16 when md is F16) of n elements written as w says.
Tensor MakeFp32(int64_t n, precis_dtype_t pd, Write w, uint64_t seed, precis_dtype_t md = F32) {
  Rng r(seed);
  Tensor t;
  t.n = n;
  t.master.resize((size_t)n * DSize(md));
  t.param.resize((size_t)n);
  std::vector<float> m((size_t)n);
  std::vector<uint16_t> h(md == F16 ? (size_t)n : 0);
  for (int64_t j = 0; j < n; ++j) {
    if (md == F16) {
      h[j] = RandomMaster16(r);
      m[j] = precis_f16_to_f32(h[j]);  // exact
    } else {
      m[j] = RandomMaster(r);
    }
    t.param[j] = Round(m[j], pd);
  }
  const int64_t few = n / 64 > 1 ? n / 64 : 1;
  auto spoil = [&](int64_t j) {  // a param its master does not round to
    uint16_t p;
    do p = (uint16_t)r.Next(); while (p == Round(m[j], pd));
    t.param[j] = p;
  };
  switch (w) {
    case kNone:
      break;
    case kPartial:
      for (int64_t j = 0; j < n; ++j)
        if (r.Next() % 4 == 0) spoil(j);
      break;
    case kWhole:
      for (int64_t j = 0; j < n; ++j)
        if (r.Next() % 500 != 0) spoil(j);
      break;
    case kBoundaryWhole:
    case kBoundaryPartial: {
      const int64_t keep = std::min(n, w == kBoundaryWhole ? few : few + 1);
      // keep elements, spread from the last one back, still round; the others not
      std::vector<bool> keeps((size_t)n, false);
      const int64_t stride = keep > 0 ? n / keep : 1;
      for (int64_t k = 0; k < keep; ++k) keeps[(size_t)(n - 1 - k * stride)] = true;
      for (int64_t j = 0; j < n; ++j)
        if (!keeps[j]) spoil(j);
      break;
    }
    case kRandomBits:
      for (int64_t j = 0; j < n; ++j) t.param[j] = (uint16_t)r.Next();
      break;
  }
  if (n > 0) {
    std::memcpy(t.master.data(), md == F16 ? (const void*)h.data() : (const void*)m.data(),
                (size_t)n * DSize(md));
  }
  return t;
}

Tensor MakeRemainder(int64_t n, precis_dtype_t md, uint64_t seed) {
  Rng r(seed);
  Tensor t;
  t.n = n;
  t.master.resize((size_t)n * DSize(md));
  for (auto& b : t.master) b = (uint8_t)(r.Next() | 0x11);  // no zero byte
  t.param.resize((size_t)n);
  for (auto& p : t.param) p = (uint16_t)r.Next();
  return t;
}

// The elements that round (for the tests' own checks of their data).
int64_t Rounding(const Tensor& t, precis_dtype_t pd, precis_dtype_t md = F32) {
  int64_t k = 0;
  for (int64_t j = 0; j < t.n; ++j) {
    float f;
    if (md == F16) {
      uint16_t h;
      std::memcpy(&h, &t.master[j * 2], 2);
      f = precis_f16_to_f32(h);
    } else {
      std::memcpy(&f, &t.master[j * 4], 4);
    }
    k += Round(f, pd) == t.param[j];
  }
  return k;
}

struct Call {
  precis_dtype_t md, pd;
  std::vector<Tensor> tensors;
  std::vector<uint8_t> stale;
};

struct Result {
  precis_status_t status;
  std::vector<Tensor> tensors;
  std::vector<int64_t> kept;
  std::string error;
};

// The tables of c's tensors (a NULL pointer for an empty one, allowed).
void Tables(std::vector<Tensor>& ts, std::vector<void*>* ms, std::vector<const void*>* ps,
            std::vector<int64_t>* numels) {
  for (auto& t : ts) {
    ms->push_back(t.n ? (void*)t.master.data() : nullptr);
    ps->push_back(t.n ? (const void*)t.param.data() : nullptr);
    numels->push_back(t.n);
  }
}

Result Run(const Call& c, bool cuda) {
  Result res;
  res.tensors = c.tensors;
  res.kept.assign(c.tensors.size(), -77);
  std::vector<void*> ms;
  std::vector<const void*> ps;
  std::vector<int64_t> numels;
  Tables(res.tensors, &ms, &ps, &numels);
  std::vector<uint8_t> stale = c.stale;
  const int64_t count = (int64_t)c.tensors.size();
  res.status = cuda ? precis_cuda_resync_masters(ms.data(), c.md, ps.data(), c.pd, numels.data(),
                                                 stale.data(), res.kept.data(), count, nullptr)
                    : precis_resync_masters(ms.data(), c.md, ps.data(), c.pd, numels.data(),
                                            stale.data(), res.kept.data(), count);
  res.error = res.status == PRECIS_OK ? "" : precis_last_error();
  EXPECT_TRUE(stale == c.stale) << "the flags were written";
  return res;
}

// The launches a call of these tensors makes, and their blocks.
void ExpectedLaunches(const Call& c, uint64_t* launches, uint64_t* blocks) {
  *launches = *blocks = 0;
  for (size_t first = 0; first < c.tensors.size(); first += kTensors) {
    uint64_t b = 0;
    for (size_t i = first; i < c.tensors.size() && i < first + kTensors; ++i) {
      b += (uint64_t)((c.tensors[i].n + kBlockElems - 1) / kBlockElems);
    }
    const bool master = c.md == F32 || c.md == F16;  // count + write; remainders: zero
    *launches += 1 + (b > 0 ? (master ? 2 : 1) : 0);
    const uint64_t grid = b < kGrid ? b : kGrid;  // the count and write kernels' blocks
    *blocks += 1 + (b > 0 ? (master ? 2 : 1) * grid : 0);
  }
}

std::string ShowDiff(const Tensor& want, const Tensor& got, size_t es) {
  std::string s;
  int shown = 0;
  int64_t differ = 0;
  for (int64_t j = 0; j < want.n; ++j) {
    if (std::memcmp(&want.master[j * es], &got.master[j * es], es) == 0) continue;
    if (shown++ < 4) {
      uint32_t w = 0, g = 0;
      std::memcpy(&w, &want.master[j * es], es);
      std::memcpy(&g, &got.master[j * es], es);
      char b[96];
      snprintf(b, sizeof b, " [%lld] cpu 0x%x vs cuda 0x%x;", (long long)j, w, g);
      s += b;
    }
    ++differ;
  }
  return s + " " + std::to_string(differ) + " of " + std::to_string(want.n) + " differ";
}

// c on the CPU and on the emulated GPU: OK both, the same masters and kept, params
// untouched, the expected launches, no execution error. Returns the CPU's result.
Result Both(const Call& c, const std::string& what) {
  SCOPED_TRACE(what);
  const Result cpu = Run(c, false);
  EXPECT_EQ(cpu.status, PRECIS_OK) << cpu.error;
  const uint64_t l0 = cuda_emu::GetStats().launches, b0 = cuda_emu::GetStats().blocks;
  const Result gpu = Run(c, true);
  EXPECT_EQ(gpu.status, PRECIS_OK) << gpu.error;
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  uint64_t launches, blocks;
  ExpectedLaunches(c, &launches, &blocks);
  EXPECT_EQ(cuda_emu::GetStats().launches - l0, launches);
  EXPECT_EQ(cuda_emu::GetStats().blocks - b0, blocks);
  const size_t es = DSize(c.md);
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    EXPECT_EQ(gpu.kept[i], cpu.kept[i]) << "kept[" << i << "], numel " << c.tensors[i].n;
    EXPECT_TRUE(gpu.tensors[i].master == cpu.tensors[i].master)
        << "masters[" << i << "], numel " << c.tensors[i].n << ":"
        << ShowDiff(cpu.tensors[i], gpu.tensors[i], es);
    EXPECT_TRUE(gpu.tensors[i].param == c.tensors[i].param) << "params[" << i << "] written";
    EXPECT_TRUE(cpu.tensors[i].param == c.tensors[i].param) << "params[" << i << "] written";
  }
  return cpu;
}

const int64_t kSizes[] = {0, 1, 127, 4096, 4097, 3 * 4096 + 5, 1000003};
const Write kWrites[] = {kNone, kPartial, kWhole, kBoundaryWhole, kBoundaryPartial, kRandomBits};

TEST(CudaResync, OneTensorEverySizeAndWriteMatchesCpu) {
  for (precis_dtype_t pd : {B16, F16}) {
    for (int64_t n : kSizes) {
      for (Write w : kWrites) {
        for (uint8_t flag : {0, 1}) {
          Call c{F32, pd, {MakeFp32(n, pd, w, (uint64_t)n * 7 + w)}, {flag}};
          const std::string what = std::string(pd == B16 ? "bf16" : "fp16") + ", numel " +
                                   std::to_string(n) + ", " + WriteName(w) +
                                   (flag ? ", stale" : ", not stale");
          const Result cpu = Both(c, what);
          // The data is what it says (so the comparison covers each branch).
          const int64_t few = n / 64 > 1 ? n / 64 : 1;
          if (flag && n > 1) {
            const int64_t k = Rounding(c.tensors[0], pd);
            EXPECT_EQ(cpu.kept[0], k) << what;
            EXPECT_TRUE(w != kNone || k == n) << what << ": kept " << k;
            EXPECT_TRUE(w != kBoundaryWhole || k == few) << what << ": kept " << k;
            EXPECT_TRUE(w != kBoundaryPartial || few + 1 >= n || k == few + 1)
                << what << ": kept " << k;
            EXPECT_TRUE(w != kPartial || (k > few && k < n)) << what << ": kept " << k;
            EXPECT_TRUE(w != kWhole || n <= 64 || k <= few) << what << ": kept " << k;
          }
          EXPECT_TRUE(flag || cpu.kept[0] == n) << what;
        }
      }
    }
  }
}

// 2 * kTensors + 44 tensors: three launches (kTensors, kTensors, 44) of each kernel; empty
// tensors, one-block
// and several-block ones, every kind of write, flags 0, 1, 2 and 255.
TEST(CudaResync, ThreeLaunchesOfMixedTensorsMatchCpu) {
  for (precis_dtype_t pd : {B16, F16}) {
    Call c{F32, pd, {}, {}};
    Rng r(pd + 5);
    for (int i = 0; i < 2 * kTensors + 44; ++i) {
      const uint64_t x = r.Next();
      int64_t n;
      switch (x % 7) {
        case 0: n = 0; break;
        case 1: n = 1; break;
        case 2: n = 2 * kBlockElems + (int64_t)((x >> 8) % 3) - 1; break;
        case 3: n = 64 * (1 + (int64_t)((x >> 8) % 8)); break;
        default: n = 1 + (int64_t)((x >> 8) % 3000); break;
      }
      if (i == kTensors - 1 || i == kTensors) n = 5 * kBlockElems + 17;  // the seam
      c.tensors.push_back(MakeFp32(n, pd, kWrites[(x >> 16) % 6], x));
      const uint8_t flags[] = {0, 1, 1, 2, 255};
      c.stale.push_back(flags[(x >> 24) % 5]);
    }
    c.stale[kTensors - 1] = 1;
    c.stale[kTensors] = 1;
    const Result cpu = Both(c, pd == B16 ? "many tensors, bf16" : "many tensors, fp16");
    int64_t rewritten = 0, skipped = 0;
    for (size_t i = 0; i < c.tensors.size(); ++i) {
      rewritten += c.stale[i] && cpu.kept[i] != c.tensors[i].n;
      skipped += !c.stale[i] && c.tensors[i].n > 0;
    }
    EXPECT_GT(rewritten, 200) << "the test's data";
    EXPECT_GT(skipped, 80) << "the test's data";
  }
}

// fp16 masters (of bf16 params, a legal policy's, and of fp16 ones): every size and
// write, the CPU's bits and kept.
TEST(CudaResync, Fp16MastersEverySizeAndWriteMatchCpu) {
  for (precis_dtype_t pd : {B16, F16}) {
    for (int64_t n : kSizes) {
      for (Write w : kWrites) {
        for (uint8_t flag : {0, 1}) {
          Call c{F16, pd, {MakeFp32(n, pd, w, (uint64_t)n * 11 + w, F16)}, {flag}};
          const std::string what = std::string("fp16 masters, ") + (pd == B16 ? "bf16" : "fp16") +
                                   " params, numel " + std::to_string(n) + ", " + WriteName(w) +
                                   (flag ? ", stale" : ", not stale");
          const Result cpu = Both(c, what);
          const int64_t few = n / 64 > 1 ? n / 64 : 1;
          if (flag && n > 1) {
            const int64_t k = Rounding(c.tensors[0], pd, F16);
            EXPECT_EQ(cpu.kept[0], k) << what;
            EXPECT_TRUE(w != kNone || n - k <= n / 16) << what << ": kept " << k;  // NaNs
            EXPECT_TRUE(w != kBoundaryWhole || k == few) << what << ": kept " << k;
            EXPECT_TRUE(w != kBoundaryPartial || few + 1 >= n || k == few + 1)
                << what << ": kept " << k;
            EXPECT_TRUE(w != kPartial || n < 64 || (k > few && k < n)) << what << ": kept " << k;
            EXPECT_TRUE(w != kWhole || n <= 64 || k <= few) << what << ": kept " << k;
          }
          EXPECT_TRUE(flag || cpu.kept[0] == n) << what;
          if (flag && n > 1 && w != kNone) {  // a rewrite happened, and is seen
            EXPECT_FALSE(cpu.tensors[0].master == c.tensors[0].master) << what;
          }
        }
      }
    }
  }
}

// 2 * kTensors + 44 fp16-master tensors: three launches of each kernel, as above.
TEST(CudaResync, ThreeLaunchesOfMixedFp16MasterTensorsMatchCpu) {
  for (precis_dtype_t pd : {B16, F16}) {
    Call c{F16, pd, {}, {}};
    Rng r(pd + 50);
    for (int i = 0; i < 2 * kTensors + 44; ++i) {
      const uint64_t x = r.Next();
      int64_t n;
      switch (x % 7) {
        case 0: n = 0; break;
        case 1: n = 1; break;
        case 2: n = 2 * kBlockElems + (int64_t)((x >> 8) % 3) - 1; break;
        case 3: n = 64 * (1 + (int64_t)((x >> 8) % 8)); break;
        default: n = 1 + (int64_t)((x >> 8) % 3000); break;
      }
      if (i == kTensors - 1 || i == kTensors) n = 5 * kBlockElems + 17;  // the seam
      c.tensors.push_back(MakeFp32(n, pd, kWrites[(x >> 16) % 6], x, F16));
      const uint8_t flags[] = {0, 1, 1, 2, 255};
      c.stale.push_back(flags[(x >> 24) % 5]);
    }
    c.stale[kTensors - 1] = 1;
    c.stale[kTensors] = 1;
    const Result cpu =
        Both(c, pd == B16 ? "many tensors, fp16 masters, bf16" : "many tensors, fp16 masters, fp16");
    int64_t rewritten = 0, skipped = 0;
    for (size_t i = 0; i < c.tensors.size(); ++i) {
      rewritten += c.stale[i] && cpu.kept[i] != c.tensors[i].n;
      skipped += !c.stale[i] && c.tensors[i].n > 0;
    }
    EXPECT_GT(rewritten, 200) << "the test's data";
    EXPECT_GT(skipped, 80) << "the test's data";
  }
}

// Exactly kTensors + 1 tensors: a second launch of one tensor (and kTensors: one launch).
TEST(CudaResync, OneMoreThanALaunchHolds) {
  for (int count : {(int)kTensors, (int)kTensors + 1}) {
    Call c{F32, B16, {}, {}};
    for (int i = 0; i < count; ++i) {
      c.tensors.push_back(MakeFp32(i == count - 1 ? 4097 : 33, B16, kPartial, 1000 + i));
      c.stale.push_back(1);
    }
    Both(c, std::to_string(count) + " tensors");
  }
}

TEST(CudaResync, RemaindersMatchCpu) {
  struct Case {
    precis_dtype_t md, pd;
  };
  for (Case k : {Case{I16, B16}, Case{I16, F16}, Case{F8, B16}}) {
    Call c{k.md, k.pd, {}, {}};
    Rng r(k.md * 3 + k.pd);
    for (int i = 0; i < kTensors + 12; ++i) {  // two launches
      const uint64_t x = r.Next();
      int64_t n = i % 9 == 0 ? 0 : i % 5 == 0 ? 3 * kBlockElems + 1 : (int64_t)(x % 700);
      if (i == 3) n = 1000003;
      c.tensors.push_back(MakeRemainder(n, k.md, x));
      c.stale.push_back((uint8_t)(i % 3 != 1));
    }
    const Result cpu = Both(c, "remainders " + DName(k.md) + " of " + DName(k.pd));
    for (size_t i = 0; i < c.tensors.size(); ++i) {  // and what they are
      EXPECT_EQ(cpu.kept[i], c.stale[i] ? 0 : c.tensors[i].n);
      const bool zero = cpu.tensors[i].master == std::vector<uint8_t>(c.tensors[i].master.size());
      if (c.stale[i]) {
        EXPECT_TRUE(zero) << i;
      } else {
        EXPECT_TRUE(cpu.tensors[i].master == c.tensors[i].master) << i;
      }
    }
  }
}

// More chunks than the count and write kernels' grid: each block takes several chunks
// of a large tensor (a partial write, counted and rewritten across them; its kept is
// the sum of every chunk's), and the tensors after it start their chunks on blocks past
// the grid's end (a whole load of a small tensor, remainders after a tensor not flagged).
TEST(CudaResync, MoreChunksThanTheGridTakeTurns) {
  const int64_t large = (int64_t)(kGrid + 3) * kBlockElems + 5;
  Call c{F32, B16,
         {MakeFp32(large, B16, kPartial, 11), MakeFp32(4097, B16, kNone, 12),
          MakeFp32(127, B16, kWhole, 13), MakeFp32(3 * kBlockElems, B16, kPartial, 14)},
         {1, 0, 1, 1}};
  const Result cpu = Both(c, "more chunks than the grid");
  EXPECT_GT(cpu.kept[0], large / 64);  // a partial write: some masters rewritten, not all
  EXPECT_LT(cpu.kept[0], large);
  EXPECT_EQ(cpu.kept[1], 4097);
  EXPECT_TRUE(cpu.tensors[1].master == c.tensors[1].master);
  Call r{PRECIS_DTYPE_INT16, B16,
         {MakeRemainder(large, PRECIS_DTYPE_INT16, 15), MakeRemainder(300, PRECIS_DTYPE_INT16, 16),
          MakeRemainder(5000, PRECIS_DTYPE_INT16, 17)},
         {0, 1, 1}};
  const Result rem = Both(r, "remainders, more chunks than the grid");
  EXPECT_TRUE(rem.tensors[0].master == r.tensors[0].master);
  EXPECT_TRUE(rem.tensors[2].master == std::vector<uint8_t>(r.tensors[2].master.size()));
}

// The count kernel's block sums: a tensor of 64 blocks whose kept elements fill one
// block (and one more element), or are spread over all, on both sides of the boundary.
TEST(CudaResync, KeptSpreadOverBlocksCountsOnce) {
  const int64_t n = 64 * kBlockElems;  // few = 4096: a block's worth
  for (int64_t keep : {(int64_t)4096, (int64_t)4097}) {
    for (bool one_block : {true, false}) {
      Tensor t = MakeFp32(n, B16, kNone, keep + one_block);
      Rng r(keep);
      std::vector<bool> keeps((size_t)n, false);
      for (int64_t k = 0; k < keep; ++k) {
        keeps[(size_t)(one_block ? 5 * kBlockElems + k : (k * 61) % n)] = true;
      }
      for (int64_t j = 0; j < n; ++j) {
        if (keeps[j]) continue;
        float f;
        std::memcpy(&f, &t.master[j * 4], 4);
        uint16_t p;
        do p = (uint16_t)r.Next(); while (p == Round(f, B16));
        t.param[j] = p;
      }
      Call c{F32, B16, {t}, {1}};
      ASSERT_EQ(Rounding(c.tensors[0], B16), keep);
      const Result cpu = Both(c, "kept " + std::to_string(keep) + (one_block ? " in one block"
                                                                             : " spread"));
      EXPECT_EQ(cpu.kept[0], keep);
    }
  }
}

// ---- precis_resync_changed: the compare made by the callee ----------------------------

// precis_fingerprint (the CPU's) of each tensor's param bytes, as the int64 a record
// and kept hold.
std::vector<int64_t> Fingerprints(const std::vector<Tensor>& ts) {
  std::vector<const void*> bufs;
  std::vector<int64_t> nbytes;
  for (const Tensor& t : ts) {
    bufs.push_back(t.n ? (const void*)t.param.data() : nullptr);
    nbytes.push_back(t.n * 2);
  }
  std::vector<uint64_t> out(ts.size());
  EXPECT_EQ(precis_fingerprint(bufs.data(), nbytes.data(), (int64_t)ts.size(), out.data()),
            PRECIS_OK)
      << precis_last_error();
  return std::vector<int64_t>(out.begin(), out.end());
}

// Tensors each with the record of its params before a write (or of the params as
// they are: not written), and whether the write changed them (the flag the compare
// must give).
struct Changed {
  precis_dtype_t md, pd;
  std::vector<Tensor> tensors;
  std::vector<int64_t> records;
  std::vector<uint8_t> written;
  std::vector<std::string> names;
};

// t, whose params were `before` when recorded.
void Add(Changed* c, Tensor t, const std::vector<uint16_t>& before, const std::string& name) {
  const std::vector<Tensor> was = {Tensor{{}, before, t.n}};
  c->records.push_back(Fingerprints(was)[0]);
  c->written.push_back(t.param != before);
  c->names.push_back(name + ", numel " + std::to_string(t.n));
  c->tensors.push_back(std::move(t));
}

// The same tensor with element j of its params changed (a bit flipped: a value its
// master no longer rounds to).
Tensor OneChanged(Tensor t, int64_t j) {
  t.param[(size_t)j] ^= 1;
  return t;
}

// precis_resync_changed, its CUDA twin or precis_cuda_resync_compared (`how`) on c: kept
// in = the fingerprints now (compared: garbage, the call takes them itself), stale in =
// garbage, sums in = 0, zeroed in = garbage; the masters, kept, stale, sums and zeroed
// out (sums and zeroed: compared only).
enum How { kCpuChanged, kCudaChanged, kCompared };
struct ChangedResult {
  Result r;
  std::vector<uint8_t> stale;
  std::vector<uint64_t> sums, zeroed;
};
ChangedResult RunChanged(const Changed& c, How how) {
  ChangedResult out;
  Result& res = out.r;
  res.tensors = c.tensors;
  res.kept = how == kCompared ? std::vector<int64_t>(c.tensors.size(), -77)
                              : Fingerprints(c.tensors);
  std::vector<void*> ms;
  std::vector<const void*> ps;
  std::vector<int64_t> numels;
  Tables(res.tensors, &ms, &ps, &numels);
  out.stale.assign(c.tensors.size(), 0xCC);  // neither 0 nor 1: each must be written
  std::vector<int64_t> records = c.records;
  const int64_t count = (int64_t)c.tensors.size();
  if (how == kCompared) {
    out.sums.assign(2 * c.tensors.size(), 0);
    out.zeroed.assign(c.tensors.size(), 0xDEADull);
    res.status = precis_cuda_resync_compared(ms.data(), c.md, ps.data(), c.pd, numels.data(),
                                             records.data(), out.stale.data(), res.kept.data(),
                                             out.sums.data(), out.zeroed.data(), count, nullptr);
  } else if (how == kCudaChanged) {
    res.status = precis_cuda_resync_changed(ms.data(), c.md, ps.data(), c.pd, numels.data(),
                                            records.data(), out.stale.data(), res.kept.data(),
                                            count, nullptr);
  } else {
    res.status = precis_resync_changed(ms.data(), c.md, ps.data(), c.pd, numels.data(),
                                       records.data(), out.stale.data(), res.kept.data(), count);
  }
  res.error = res.status == PRECIS_OK ? "" : precis_last_error();
  EXPECT_TRUE(records == c.records) << "the records were written";
  return out;
}

// got, a call's result on c, against want (precis_resync_masters given the flags the
// writes set): its flags the writes, the same kept and masters, the params untouched.
void ExpectSameAs(const Changed& c, const Result& want, const ChangedResult& got) {
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    EXPECT_EQ(got.stale[i], c.written[i]) << "stale[" << i << "], " << c.names[i];
    EXPECT_EQ(got.r.kept[i], want.kept[i]) << "kept[" << i << "], " << c.names[i];
    EXPECT_TRUE(got.r.tensors[i].master == want.tensors[i].master)
        << "masters[" << i << "], " << c.names[i] << ":"
        << ShowDiff(want.tensors[i], got.r.tensors[i], DSize(c.md));
    EXPECT_TRUE(got.r.tensors[i].param == c.tensors[i].param) << "params[" << i << "] written";
  }
}

// c through both entry points against precis_resync_masters given the flags
// fingerprint != record: the same masters' bits, kept and flags, the flags the writes
// set, params untouched; on the GPU the expected launches and nothing copied back.
void ExpectChangedIsResyncOfTheCompare(const Changed& c, const std::string& what) {
  SCOPED_TRACE(what);
  const std::vector<int64_t> now = Fingerprints(c.tensors);
  Call ref{c.md, c.pd, c.tensors, {}};
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    ref.stale.push_back(now[i] != c.records[i]);
    // The test's data: a write is seen by the fingerprint, no write is not.
    ASSERT_EQ(ref.stale[i], c.written[i]) << c.names[i];
  }
  const Result want = Run(ref, false);
  ASSERT_EQ(want.status, PRECIS_OK) << want.error;
  for (bool cuda : {false, true}) {
    SCOPED_TRACE(cuda ? "precis_cuda_resync_changed" : "precis_resync_changed");
    const cuda_emu::Stats s0 = cuda_emu::GetStats();
    const ChangedResult got = RunChanged(c, cuda ? kCudaChanged : kCpuChanged);
    ASSERT_EQ(got.r.status, PRECIS_OK) << got.r.error;
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    uint64_t launches = 0, blocks = 0;
    if (cuda) ExpectedLaunches(ref, &launches, &blocks);
    EXPECT_EQ(cuda_emu::GetStats().launches - s0.launches, launches);
    EXPECT_EQ(cuda_emu::GetStats().memcpys - s0.memcpys, 0u) << "something read back";
    ExpectSameAs(c, want, got);
  }
  {
    SCOPED_TRACE("precis_cuda_resync_compared");
    const cuda_emu::Stats s0 = cuda_emu::GetStats();
    const ChangedResult got = RunChanged(c, kCompared);
    ASSERT_EQ(got.r.status, PRECIS_OK) << got.r.error;
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    // the resync's launches, the compare in the first (no fingerprint launches before)
    uint64_t launches = 0, blocks = 0;
    ExpectedLaunches(ref, &launches, &blocks);
    EXPECT_EQ(cuda_emu::GetStats().launches - s0.launches, launches);
    EXPECT_EQ(cuda_emu::GetStats().memcpys - s0.memcpys, 0u) << "something read back";
    EXPECT_TRUE(got.sums == std::vector<uint64_t>(2 * c.tensors.size(), 0))
        << "sums not left zero";
    EXPECT_TRUE(got.zeroed == std::vector<uint64_t>(c.tensors.size(), 0)) << "zeroed not 0";
    ExpectSameAs(c, want, got);
  }
  // The data covers what it says: some flagged tensor rewritten, some left unread.
  int64_t rewritten = 0, skipped = 0;
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    rewritten += c.written[i] && want.tensors[i].master != c.tensors[i].master;
    skipped += !c.written[i] && c.tensors[i].n > 0;
  }
  EXPECT_GT(rewritten, 0);
  EXPECT_GT(skipped, 0);
}

const int64_t kChangedSizes[] = {1, 127, 4097, 70001};  // 70001: 18 blocks

// fp32 and fp16 masters of bf16 and fp16 params, at odd sizes: params not written
// (in sync, or out of sync but unchanged since the record: not flagged, so not read),
// one element changed, many (a partial write), nearly all (a whole load); and an empty
// param, its record matching or not.
TEST(CudaResyncChanged, MastersAreResyncOfTheCompare) {
  for (precis_dtype_t md : {F32, F16}) {
    for (precis_dtype_t pd : {B16, F16}) {
      Changed c{md, pd, {}, {}, {}, {}};
      uint64_t seed = md * 100 + pd;
      for (int64_t n : kChangedSizes) {
        // Same seed, same masters: `in sync` is the params before each write.
        const Tensor in_sync = MakeFp32(n, pd, kNone, ++seed, md);
        Add(&c, in_sync, in_sync.param, "not written");
        Add(&c, OneChanged(in_sync, n / 2), in_sync.param, "one element changed");
        Add(&c, MakeFp32(n, pd, kPartial, seed, md), in_sync.param, "many changed");
        Add(&c, MakeFp32(n, pd, kWhole, seed, md), in_sync.param, "a whole load");
        const Tensor random = MakeFp32(n, pd, kRandomBits, ++seed, md);
        Add(&c, random, random.param, "out of sync, not written since the record");
      }
      Tensor empty;
      Add(&c, empty, {}, "empty");
      c.records.back() ^= 1;  // a record that no longer matches: flagged, nothing to do
      c.written.back() = 1;
      Add(&c, empty, {}, "empty, record matching");
      ExpectChangedIsResyncOfTheCompare(
          c, DName(md) + " masters of " + DName(pd) + " params");
    }
  }
}

// int16 and fp8 remainders: a param written (one element or all) has them zeroed.
TEST(CudaResyncChanged, RemaindersAreResyncOfTheCompare) {
  struct Case {
    precis_dtype_t md, pd;
  };
  for (Case k : {Case{I16, B16}, Case{I16, F16}, Case{F8, B16}}) {
    Changed c{k.md, k.pd, {}, {}, {}, {}};
    uint64_t seed = k.md * 10 + k.pd;
    for (int64_t n : kChangedSizes) {
      const Tensor t = MakeRemainder(n, k.md, ++seed);
      Add(&c, t, t.param, "not written");
      Add(&c, OneChanged(t, n - 1), t.param, "one element changed");
      Tensor loaded = t;
      loaded.param = MakeRemainder(n, k.md, seed + 1000).param;
      Add(&c, loaded, t.param, "loaded");
    }
    Tensor empty;
    Add(&c, empty, {}, "empty");
    ExpectChangedIsResyncOfTheCompare(c, "remainders " + DName(k.md) + " of " + DName(k.pd));
  }
}

// kTensors + 40 tensors: a second launch, whose records and flags start at kTensors.
TEST(CudaResyncChanged, TwoLaunchesReadTheirOwnRecords) {
  Changed c{F32, B16, {}, {}, {}, {}};
  for (int i = 0; i < kTensors + 40; ++i) {
    const Tensor t = MakeFp32(1 + i % 50, B16, kNone, 3000 + i);
    if (i % 3 == 0) {
      Add(&c, OneChanged(t, 0), t.param, "written, tensor " + std::to_string(i));
    } else {
      Add(&c, t, t.param, "not written, tensor " + std::to_string(i));
    }
  }
  ExpectChangedIsResyncOfTheCompare(c, "two launches");
}

// The bad-argument tests' call: two params written since their records (a whole load
// and one element), which a call that went ahead would resync.
Changed TwoWritten() {
  Changed c{F32, B16, {}, {}, {}, {}};
  const Tensor t = MakeFp32(5000, B16, kNone, 7);
  Add(&c, MakeFp32(5000, B16, kRandomBits, 7), t.param, "written");
  Add(&c, OneChanged(t, 3), t.param, "written");
  return c;
}

// The checks: records NULL (count > 0) named, with precis_resync_masters's others
// named for the new function; nothing launched, copied or written (masters, kept,
// stale as they were).
TEST(CudaResyncChanged, BadArgumentsWriteNothing) {
  struct Bad {
    const char* what;
    precis_status_t want;
    const char* named;
  };
  for (bool cuda : {false, true}) {
    const char* fn = cuda ? "precis_cuda_resync_changed" : "precis_resync_changed";
    for (Bad b : {Bad{"records NULL", PRECIS_ERR_NULL_POINTER, "records"},
                  Bad{"masters NULL", PRECIS_ERR_NULL_POINTER, "masters"},
                  Bad{"stale NULL", PRECIS_ERR_NULL_POINTER, "stale"},
                  Bad{"count -1", PRECIS_ERR_INVALID_ARGUMENT, "count"}}) {
      SCOPED_TRACE(std::string(fn) + ", " + b.what);
      const Changed c = TwoWritten();
      std::vector<Tensor> ts = c.tensors;
      std::vector<void*> ms;
      std::vector<const void*> ps;
      std::vector<int64_t> numels;
      Tables(ts, &ms, &ps, &numels);
      const std::vector<int64_t> now = Fingerprints(ts);
      std::vector<int64_t> kept = now;
      std::vector<uint8_t> stale = {0xCC, 0xCC};
      const std::string what = b.what;
      void* const* masters = what == "masters NULL" ? nullptr : ms.data();
      const int64_t* records = what == "records NULL" ? nullptr : c.records.data();
      uint8_t* stale_p = what == "stale NULL" ? nullptr : stale.data();
      const int64_t count = what == "count -1" ? -1 : 2;
      const cuda_emu::Stats s0 = cuda_emu::GetStats();
      const precis_status_t st =
          cuda ? precis_cuda_resync_changed(masters, F32, ps.data(), B16, numels.data(), records,
                                            stale_p, kept.data(), count, nullptr)
               : precis_resync_changed(masters, F32, ps.data(), B16, numels.data(), records,
                                       stale_p, kept.data(), count);
      EXPECT_EQ(st, b.want);
      const std::string err = st == PRECIS_OK ? "" : precis_last_error();
      EXPECT_NE(err.find(fn), std::string::npos) << err;
      EXPECT_NE(err.find(b.named), std::string::npos) << err;
      EXPECT_EQ(cuda_emu::GetStats().launches - s0.launches, 0u);
      EXPECT_EQ(cuda_emu::GetStats().memcpys - s0.memcpys, 0u);
      EXPECT_EQ(cuda_emu::TakeErrors(), "");
      for (size_t i = 0; i < ts.size(); ++i) {
        EXPECT_TRUE(ts[i].master == c.tensors[i].master) << "masters[" << i << "] written";
        EXPECT_EQ(kept[i], now[i]) << "kept[" << i << "] written";
        EXPECT_EQ(stale[i], 0xCC) << "stale[" << i << "] written";
      }
    }
  }
}

// count 0: every pointer may be NULL, records too; nothing launched.
TEST(CudaResyncChanged, CountZeroWithNullsIsOk) {
  const uint64_t l0 = cuda_emu::GetStats().launches;
  EXPECT_EQ(precis_resync_changed(nullptr, F32, nullptr, B16, nullptr, nullptr, nullptr, nullptr,
                                  0),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(precis_cuda_resync_changed(nullptr, F32, nullptr, B16, nullptr, nullptr, nullptr,
                                       nullptr, 0, nullptr),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::GetStats().launches, l0);
}

constexpr int64_t kCompareElems = 4 * kBlockElems;  // cuda/resync.cu's compare chunk

// More chunks than the grid's 1,024 blocks (each block takes chunks of 16,384 elements
// in turns, and the block that counts a tensor's last chunk decides it: tensor 341's
// three chunks, 1,023 to 1,025, are counted by blocks 1,023, 0 and 1), params at an
// address that is not 8-byte aligned (the element-wise terms, not whole words), and
// sizes whose last word is partial: against the compare made apart.
TEST(CudaResyncCompared, MoreChunksThanTheGridAndUnalignedParams) {
  Changed c{F32, B16, {}, {}, {}, {}};
  for (int i = 0; i < 400; ++i) {  // 400 x 3 chunks: 1,200
    const int64_t n = 2 * kCompareElems + 1 + i % 7;
    const Tensor t = MakeFp32(n, B16, kNone, 5000 + i);
    if (i % 4 == 0) {
      Add(&c, MakeFp32(n, B16, kPartial, 5000 + i), t.param, "written, tensor " +
                                                              std::to_string(i));
    } else {
      Add(&c, t, t.param, "not written, tensor " + std::to_string(i));
    }
  }
  ExpectChangedIsResyncOfTheCompare(c, "1,200 chunks");
  // An unaligned param: its bytes from the second element of a buffer.
  Changed u{F32, B16, {}, {}, {}, {}};
  for (int64_t n : {(int64_t)1, (int64_t)3, (int64_t)4097, (int64_t)9000}) {
    Tensor t = MakeFp32(n, B16, kNone, 77 + n);
    Add(&u, OneChanged(t, n - 1), t.param, "written");
    Add(&u, t, t.param, "not written");
  }
  std::vector<std::vector<uint16_t>> shifted;
  std::vector<void*> ms;
  std::vector<const void*> ps;
  std::vector<int64_t> numels;
  std::vector<Tensor> ts = u.tensors;
  Tables(ts, &ms, &ps, &numels);
  for (size_t i = 0; i < ts.size(); ++i) {
    shifted.emplace_back(ts[i].param.size() + 1, 0);
    std::copy(ts[i].param.begin(), ts[i].param.end(), shifted.back().begin() + 1);
    ps[i] = shifted.back().data() + 1;
    ASSERT_NE(reinterpret_cast<uintptr_t>(ps[i]) & 7, 0u);
  }
  std::vector<int64_t> kept(ts.size(), -77);
  std::vector<uint8_t> stale(ts.size(), 0xCC);
  std::vector<uint64_t> sums(2 * ts.size(), 0);
  ASSERT_EQ(precis_cuda_resync_compared(ms.data(), F32, ps.data(), B16, numels.data(),
                                        u.records.data(), stale.data(), kept.data(), sums.data(),
                                        nullptr, (int64_t)ts.size(), nullptr),
            PRECIS_OK)
      << precis_last_error();
  const ChangedResult aligned = RunChanged(u, kCompared);
  ASSERT_EQ(aligned.r.status, PRECIS_OK) << aligned.r.error;
  EXPECT_TRUE(kept == aligned.r.kept);
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(ts[i].master == aligned.r.tensors[i].master) << "masters[" << i << "]";
    EXPECT_EQ(kept[i] != (int64_t)ts[i].n, (bool)u.written[i]) << u.names[i];
    EXPECT_EQ(stale[i], u.written[i]) << u.names[i];
  }
  EXPECT_TRUE(sums == std::vector<uint64_t>(sums.size(), 0));
}

// Every size to 80 elements and the chunk edges, at 2, 4 and 6 bytes past an 8-byte
// boundary and at one: the compare's fingerprint is precis_fingerprint's (int16
// remainders, which a false flag zeroes: a param not written keeps them and its numel,
// one written has them zeroed), one chunk or several.
TEST(CudaResyncCompared, TheFingerprintIsTheCPUsAtEverySizeAndOffset) {
  std::vector<int64_t> sizes;
  for (int64_t n = 0; n <= 80; ++n) sizes.push_back(n);
  for (int64_t edge : {kCompareElems, 2 * kCompareElems}) {
    for (int64_t d = -2; d <= 2; ++d) sizes.push_back(edge + d);
  }
  for (int offset = 0; offset < 4; ++offset) {  // elements past an 8-byte boundary
    for (bool write : {false, true}) {
      SCOPED_TRACE("offset " + std::to_string(2 * offset) + " bytes, " +
                   (write ? "written" : "not written"));
      std::vector<Tensor> ts;
      std::vector<std::vector<uint16_t>> held;  // each param's bytes from `offset` on
      std::vector<const void*> ps, bufs;
      std::vector<void*> ms;
      std::vector<int64_t> numels, nbytes;
      for (int64_t n : sizes) {
        ts.push_back(MakeRemainder(n, I16, 900 + n));
        held.emplace_back(ts.back().param.size() + 4, 0);
      }
      for (size_t i = 0; i < ts.size(); ++i) {
        uint16_t* p = held[i].data();
        while ((reinterpret_cast<uintptr_t>(p) & 7) != 0) ++p;  // an 8-byte boundary
        p += offset;
        std::copy(ts[i].param.begin(), ts[i].param.end(), p);
        ps.push_back(p);
        bufs.push_back(p);
        ms.push_back(ts[i].n ? (void*)ts[i].master.data() : nullptr);
        numels.push_back(ts[i].n);
        nbytes.push_back(2 * ts[i].n);
      }
      std::vector<uint64_t> fp(ts.size());
      ASSERT_EQ(precis_fingerprint(bufs.data(), nbytes.data(), (int64_t)ts.size(), fp.data()),
                PRECIS_OK);
      std::vector<int64_t> records(fp.begin(), fp.end());
      for (size_t i = 0; write && i < ts.size(); ++i) {
        if (ts[i].n) const_cast<uint16_t*>(static_cast<const uint16_t*>(ps[i]))[ts[i].n - 1] ^= 1;
      }
      std::vector<uint8_t> stale(ts.size(), 0xCC);
      std::vector<int64_t> kept(ts.size(), -77);
      std::vector<uint64_t> sums(2 * ts.size(), 0), zeroed(ts.size(), 9);
      const std::vector<Tensor> before = ts;
      ASSERT_EQ(precis_cuda_resync_compared(ms.data(), I16, ps.data(), B16, numels.data(),
                                            records.data(), stale.data(), kept.data(),
                                            sums.data(), zeroed.data(), (int64_t)ts.size(),
                                            nullptr),
                PRECIS_OK)
          << precis_last_error();
      EXPECT_EQ(cuda_emu::TakeErrors(), "");
      for (size_t i = 0; i < ts.size(); ++i) {
        const bool flagged = write && ts[i].n > 0;
        EXPECT_EQ(stale[i], flagged) << "numel " << ts[i].n;
        EXPECT_EQ(kept[i], flagged ? 0 : ts[i].n) << "numel " << ts[i].n;
        EXPECT_TRUE(flagged ? ts[i].master == std::vector<uint8_t>(ts[i].master.size(), 0)
                            : ts[i].master == before[i].master)
            << "remainders, numel " << ts[i].n;
      }
      EXPECT_TRUE(sums == std::vector<uint64_t>(sums.size(), 0));
      EXPECT_TRUE(zeroed == std::vector<uint64_t>(zeroed.size(), 0));
    }
  }
}

// The checks: stale, kept, sums, records or masters NULL, count -1, a buffer not 8-byte
// aligned, and two buffers sharing memory (zeroed over records: the update's record and
// the one compared) named; nothing launched, copied or written (masters, stale, kept,
// sums, zeroed as they were). count 0: any NULL.
TEST(CudaResyncCompared, BadArgumentsWriteNothing) {
  struct Bad {
    const char* what;
    precis_status_t want;
    const char* named;
  };
  for (Bad b : {Bad{"stale NULL", PRECIS_ERR_NULL_POINTER, "stale"},
                Bad{"kept NULL", PRECIS_ERR_NULL_POINTER, "kept"},
                Bad{"sums NULL", PRECIS_ERR_NULL_POINTER, "sums"},
                Bad{"records NULL", PRECIS_ERR_NULL_POINTER, "records"},
                Bad{"masters NULL", PRECIS_ERR_NULL_POINTER, "masters"},
                Bad{"count -1", PRECIS_ERR_INVALID_ARGUMENT, "count"},
                Bad{"sums unaligned", PRECIS_ERR_INVALID_ARGUMENT, "sums"},
                Bad{"kept unaligned", PRECIS_ERR_INVALID_ARGUMENT, "kept"},
                Bad{"zeroed over records", PRECIS_ERR_INVALID_ARGUMENT, "records and zeroed"},
                Bad{"sums over kept", PRECIS_ERR_INVALID_ARGUMENT, "kept and sums"}}) {
    const std::string what = b.what;
    SCOPED_TRACE(what);
    const Changed c = TwoWritten();
    std::vector<Tensor> ts = c.tensors;
    std::vector<void*> ms;
    std::vector<const void*> ps;
    std::vector<int64_t> numels;
    Tables(ts, &ms, &ps, &numels);
    // kept's two entries, then sums' four, in one buffer (with room to misalign them)
    std::vector<uint64_t> room(8, 0);
    std::vector<uint8_t> stale = {0xCC, 0xCC};
    std::vector<int64_t> records = c.records;
    int64_t* kept = reinterpret_cast<int64_t*>(room.data());
    uint64_t* sums = room.data() + 2;
    kept[0] = kept[1] = -77;
    std::vector<uint64_t> zeroed = {5, 5};
    uint64_t* zeroed_p = zeroed.data();
    if (what == "sums unaligned") sums = reinterpret_cast<uint64_t*>(
        reinterpret_cast<char*>(room.data() + 3) + 4);
    if (what == "kept unaligned") kept = reinterpret_cast<int64_t*>(
        reinterpret_cast<char*>(room.data()) + 4);
    if (what == "zeroed over records") zeroed_p = reinterpret_cast<uint64_t*>(records.data());
    if (what == "sums over kept") sums = room.data() + 1;
    const std::vector<uint64_t> room_before = room;
    const std::vector<int64_t> records_before = records;
    const cuda_emu::Stats s0 = cuda_emu::GetStats();
    const precis_status_t st = precis_cuda_resync_compared(
        what == "masters NULL" ? nullptr : ms.data(), F32, ps.data(), B16, numels.data(),
        what == "records NULL" ? nullptr : records.data(),
        what == "stale NULL" ? nullptr : stale.data(), what == "kept NULL" ? nullptr : kept,
        what == "sums NULL" ? nullptr : sums, zeroed_p, what == "count -1" ? -1 : 2, nullptr);
    EXPECT_EQ(st, b.want);
    const std::string err = st == PRECIS_OK ? "" : precis_last_error();
    EXPECT_NE(err.find("precis_cuda_resync_compared"), std::string::npos) << err;
    EXPECT_NE(err.find(b.named), std::string::npos) << err;
    EXPECT_EQ(cuda_emu::GetStats().launches - s0.launches, 0u);
    EXPECT_EQ(cuda_emu::GetStats().memcpys - s0.memcpys, 0u);
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    for (size_t i = 0; i < ts.size(); ++i) {
      EXPECT_TRUE(ts[i].master == c.tensors[i].master) << "masters[" << i << "] written";
    }
    EXPECT_TRUE(stale == std::vector<uint8_t>({0xCC, 0xCC}));
    EXPECT_TRUE(room == room_before) << "kept or sums written";
    EXPECT_TRUE(records == records_before);
    EXPECT_TRUE(zeroed == std::vector<uint64_t>({5, 5}));
  }
  const uint64_t l0 = cuda_emu::GetStats().launches;
  EXPECT_EQ(precis_cuda_resync_compared(nullptr, F32, nullptr, B16, nullptr, nullptr, nullptr,
                                        nullptr, nullptr, nullptr, 0, nullptr),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::GetStats().launches, l0);
}

// ---- argument checks ---------------------------------------------------------------

// A valid two-tensor call, stale and written (one that went ahead would rewrite
// them), spoiled by `spoil`: the CUDA entry point gives the CPU's status and
// launches and writes nothing; the CPU writes nothing either.
template <class Spoil>
void ExpectRejected(precis_status_t want, const std::string& what, Spoil spoil) {
  SCOPED_TRACE(what);
  for (bool cuda : {false, true}) {
    std::vector<Tensor> ts = {MakeFp32(5000, B16, kRandomBits, 1),
                              MakeFp32(100, B16, kRandomBits, 2)};
    const std::vector<Tensor> before = ts;
    std::vector<void*> ms;
    std::vector<const void*> ps;
    std::vector<int64_t> numels;
    Tables(ts, &ms, &ps, &numels);
    std::vector<uint8_t> stale = {1, 1};
    std::vector<int64_t> kept = {-5, -6};
    struct Args {
      void* const* masters;
      precis_dtype_t md;
      const void* const* params;
      precis_dtype_t pd;
      const int64_t* numels;
      const uint8_t* stale;
      int64_t* kept;
      int64_t count;
    } a = {ms.data(), F32, ps.data(), B16, numels.data(), stale.data(), kept.data(), 2};
    spoil(a, ms, ps, numels);
    const uint64_t l0 = cuda_emu::GetStats().launches, c0 = cuda_emu::GetStats().memcpys;
    const precis_status_t st =
        cuda ? precis_cuda_resync_masters(a.masters, a.md, a.params, a.pd, a.numels, a.stale,
                                          a.kept, a.count, nullptr)
             : precis_resync_masters(a.masters, a.md, a.params, a.pd, a.numels, a.stale, a.kept,
                                     a.count);
    EXPECT_EQ(st, want) << (cuda ? "cuda" : "cpu");
    if (st != PRECIS_OK) {
      EXPECT_NE(std::string(precis_last_error())
                    .find(cuda ? "precis_cuda_resync_masters" : "precis_resync_masters"),
                std::string::npos)
          << precis_last_error();
    }
    EXPECT_EQ(cuda_emu::GetStats().memcpys - c0, 0u);
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    if (want == PRECIS_OK) {  // the harness itself: the unspoiled call writes both
      EXPECT_EQ(cuda_emu::GetStats().launches - l0, cuda ? 3u : 0u);
      EXPECT_FALSE(ts[0].master == before[0].master || ts[1].master == before[1].master);
      EXPECT_NE(kept[0], -5);
      EXPECT_NE(kept[1], -6);
      continue;
    }
    EXPECT_EQ(cuda_emu::GetStats().launches - l0, 0u) << (cuda ? "cuda" : "cpu");
    EXPECT_TRUE(ts[0].master == before[0].master && ts[1].master == before[1].master)
        << (cuda ? "cuda" : "cpu") << ": masters written";
    EXPECT_EQ(kept[0], -5);
    EXPECT_EQ(kept[1], -6);
  }
}

using Ms = std::vector<void*>;
using Ps = std::vector<const void*>;
using Ns = std::vector<int64_t>;

TEST(CudaResyncArgs, TheCpusStatusAndNothingLaunched) {
  ExpectRejected(PRECIS_OK, "the harness: a good call is accepted", [](auto&, Ms&, Ps&, Ns&) {});
  ExpectRejected(PRECIS_ERR_INVALID_ARGUMENT, "count -1",
                 [](auto& a, Ms&, Ps&, Ns&) { a.count = -1; });
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "masters NULL",
                 [](auto& a, Ms&, Ps&, Ns&) { a.masters = nullptr; });
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "params NULL",
                 [](auto& a, Ms&, Ps&, Ns&) { a.params = nullptr; });
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "numels NULL",
                 [](auto& a, Ms&, Ps&, Ns&) { a.numels = nullptr; });
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "stale NULL",
                 [](auto& a, Ms&, Ps&, Ns&) { a.stale = nullptr; });
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "kept NULL",
                 [](auto& a, Ms&, Ps&, Ns&) { a.kept = nullptr; });
  ExpectRejected(PRECIS_OK, "the harness: an fp16 master is accepted (and written)",
                 [](auto& a, Ms&, Ps&, Ns&) { a.md = F16; });
  for (int md : {(int)B16, -1, 99}) {  // fp16: a master
    ExpectRejected(PRECIS_ERR_INVALID_DTYPE, "master dtype " + std::to_string(md),
                   [md](auto& a, Ms&, Ps&, Ns&) { a.md = (precis_dtype_t)md; });
  }
  for (int pd : {(int)F32, (int)F8, (int)I16, -1, 99}) {
    ExpectRejected(PRECIS_ERR_INVALID_DTYPE, "param dtype " + std::to_string(pd),
                   [pd](auto& a, Ms&, Ps&, Ns&) { a.pd = (precis_dtype_t)pd; });
  }
  ExpectRejected(PRECIS_ERR_INVALID_DTYPE, "fp8 master, fp16 params",
                 [](auto& a, Ms&, Ps&, Ns&) { a.md = F8, a.pd = F16; });
  for (int64_t bad : {(int64_t)-1, ((int64_t)1 << 42) + 1}) {
    ExpectRejected(PRECIS_ERR_INVALID_ARGUMENT, "numels[1] " + std::to_string(bad),
                   [bad](auto&, Ms&, Ps&, Ns& n) { n[1] = bad; });
  }
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "masters[1] NULL",
                 [](auto&, Ms& m, Ps&, Ns&) { m[1] = nullptr; });
  ExpectRejected(PRECIS_ERR_NULL_POINTER, "params[1] NULL",
                 [](auto&, Ms&, Ps& p, Ns&) { p[1] = nullptr; });
}

TEST(CudaResyncArgs, CountZeroLaunchesNothing) {
  const uint64_t l0 = cuda_emu::GetStats().launches;
  EXPECT_EQ(precis_cuda_resync_masters(nullptr, F32, nullptr, B16, nullptr, nullptr, nullptr, 0,
                                       nullptr),
            PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::GetStats().launches, l0);
}

}  // namespace
