// The CUDA Adam/AdamW kernels of cuda/step.cu, run on the CPU by the emulator
// of cuda_emu.h (see tests/BUILD), against the CPU kernel: from the same state,
// precis_cuda_step must write exactly the bits precis_step writes, for
// every dtype combination with and without amsgrad, on the vector path (16-byte
// aligned buffers) and the element-wise one (buffers one element off), with host
// or device arguments,
// and must write nothing when a gradient is NaN/Inf or found_inf is set; the record
// it keeps (param_fingerprints) must be precis_fingerprint of the params it leaves, and
// its block record (param_block_fingerprints) precis_fingerprint_blocks of them.
// "Device pointers" are host pointers here.
//
// What the emulation cannot see: where IEEE-754 leaves a GPU room to differ
// from x86 (NaN payloads: a GPU's NaNs are canonical; CUDA's pow, which makes
// the step constants on the device when lr or the step is read from device
// memory, is within 2 ulp rather than glibc's), and blocks running at the
// same time (they run one after another here).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "rules.h"
#include "stores.h"
#include "cuda_emu.h"
#include "precis/precis.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

// ---- a list of tensors with their state -----------------------------------------------

// Buffer roles, in precis_step_tensors_t order; the last two with amsgrad only.
enum Role { kParam, kGrad, kMaster, kM, kV, kMScale, kVScale, kVMax, kVMaxScale, kRoles };
const char* const kRoleNames[kRoles] = {
    "params",         "grads",           "masters",        "exp_avgs",
    "exp_avg_sqs",    "exp_avg_scales",  "exp_avg_sq_scales", "max_exp_avg_sqs",
    "max_exp_avg_sq_scales"};

// Which buffers start one element past a 64-byte boundary.
enum class Layout {
  kAligned,  // none: the vector path for every whole 256-element group
  kOffset,   // all: the element-wise path everywhere
  kOneOff,   // one role of the tensors of 256+ elements: element-wise there only
};

bool Present(const Combo& c, int r, bool ams = false) {
  if (r == kMaster) return ModeOf(c) != kNone;
  if (r == kMScale) return Scaled(c.ed);
  if (r == kVScale) return Scaled(c.sd);
  if (r == kVMax) return ams;
  if (r == kVMaxScale) return ams && Scaled(c.sd);
  return true;
}

bool IsScaleRole(int r) { return r == kMScale || r == kVScale || r == kVMaxScale; }

struct Tensor {
  int64_t n = 0;
  int64_t done = 0;  // steps done
  Buf b[kRoles];
};

// The pointer tables (AdamTables) are handed to the kernels.
struct State : AdamTables {
  Combo c{};
  bool ams = false;  // AMSGrad: a running max of v
  std::vector<Tensor> ts;
  std::vector<uint64_t> streams;  // empty: the defaults (stream i, offset 0)
  std::vector<int64_t> offsets;

  State(const Combo& combo, const std::vector<int64_t>& sizes, Layout layout, int off_role,
        bool amsgrad = false)
      : c(combo), ams(amsgrad) {
    for (int64_t n : sizes) {
      Tensor t;
      t.n = n;
      for (int r = 0; r < kRoles; ++r) {
        if (!Present(r)) continue;
        const size_t es = ElemSize(r);
        const bool off = layout == Layout::kOffset ||
                         (layout == Layout::kOneOff && n >= 256 && r == off_role);
        const size_t count = IsScaleRole(r) ? (size_t)Blocks(n) : (size_t)n;
        t.b[r] = Buf(count * es, off ? es : 0);
      }
      ts.push_back(std::move(t));
    }
  }

  bool Present(int r) const { return ::Present(c, r, ams); }
  precis_dtype_t Dtype(int r) const {
    const precis_dtype_t d[kRoles] = {c.pd, c.gd, c.md, c.ed, c.sd, F32, F32, c.sd, F32};
    return d[r];
  }
  size_t ElemSize(int r) const { return DSize(Dtype(r)); }

  precis_step_tensors_t Desc() {
    Clear();
    for (Tensor& t : ts) {
      Add(t.b[kParam].data(), t.b[kGrad].data(), t.b[kMaster].data(), t.b[kM].data(),
          t.b[kV].data(), reinterpret_cast<float*>(t.b[kMScale].data()),
          reinterpret_cast<float*>(t.b[kVScale].data()), t.n, t.done + 1);
      if (ams) AddMax(t.b[kVMax].data(), reinterpret_cast<float*>(t.b[kVMaxScale].data()));
    }
    precis_step_tensors_t d = Describe(c);
    if (!streams.empty()) d.streams = streams.data();
    if (!offsets.empty()) d.element_offsets = offsets.data();
    return d;
  }

  void Advance() {
    for (Tensor& t : ts) ++t.done;
  }

  // A non-zero state: masters in [-1, 1], moments of a few steps, and one
  // all-zero scale block (elements 256..383) where there is room for one.
  void Fill(std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t k = 0; k < ts.size(); ++k) {
      Tensor& t = ts[k];
      t.done = 2 * (int64_t)k;  // tensor 0 takes step 1, the others later ones
      std::vector<float> x(t.n), m(t.n), v(t.n), vmax(t.n);
      for (int64_t i = 0; i < t.n; ++i) {
        x[i] = u(rng);
        const bool zero = i >= 256 && i < 384 && t.n > 512;
        m[i] = zero ? 0.0f : 0.01f * nd(rng);
        const float r = 0.03f * nd(rng);
        v[i] = zero ? 0.0f : r * r + 1e-6f;
        // A running max above v for some elements, below (as after a load) for others.
        vmax[i] = zero ? 0.0f : v[i] * (0.5f + 1.5f * std::fabs(u(rng)));
      }
      if (ams) {
        ASSERT_EQ(precis_moment_encode(vmax.data(), t.n, 1, t.b[kVMax].data(), c.sd,
                                       reinterpret_cast<float*>(t.b[kVMaxScale].data())),
                  PRECIS_OK);
      }
      SetMasters(t, x);
      ASSERT_EQ(precis_moment_encode(m.data(), t.n, 0, t.b[kM].data(), c.ed,
                                     reinterpret_cast<float*>(t.b[kMScale].data())),
                PRECIS_OK);
      ASSERT_EQ(precis_moment_encode(v.data(), t.n, 1, t.b[kV].data(), c.sd,
                                     reinterpret_cast<float*>(t.b[kVScale].data())),
                PRECIS_OK);
    }
  }

  void SetMasters(Tensor& t, const std::vector<float>& x) {
    switch (ModeOf(c)) {
      case kNone:
        for (int64_t i = 0; i < t.n; ++i) Encode(t.b[kParam], c.pd, i, x[i]);
        break;
      case kSeparate:  // the param is the rounding of the master as stored
        for (int64_t i = 0; i < t.n; ++i) {
          Encode(t.b[kMaster], c.md, i, x[i]);
          Encode(t.b[kParam], c.pd, i, Decode(t.b[kMaster], c.md, i));
        }
        break;
      case kRemainder:
        ASSERT_EQ(precis_remainder_split(x.data(), t.n,
                                         reinterpret_cast<uint16_t*>(t.b[kParam].data()),
                                         reinterpret_cast<int16_t*>(t.b[kMaster].data())),
                  PRECIS_OK);
        break;
      case kRemainder8:
        ASSERT_EQ(precis_remainder8_split(x.data(), t.n,
                                          reinterpret_cast<uint16_t*>(t.b[kParam].data()),
                                          t.b[kMaster].data()),
                  PRECIS_OK);
        break;
    }
  }

  // Gradients ~ N(0, 0.1) * scale with outliers (x30) and exact zeros, zero in
  // the zero block so that it stays zero for a step.
  void NewGrads(std::mt19937_64& rng, float scale) {
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (Tensor& t : ts) {
      for (int64_t i = 0; i < t.n; ++i) {
        float g = nd(rng) * scale;
        if (i % 37 == 5) g *= 30.0f;
        if (i % 53 == 7 || (i >= 256 && i < 384 && t.n > 512)) g = 0.0f;
        Encode(t.b[kGrad], c.gd, i, g);
      }
    }
  }

  void CopyGradsFrom(const State& o) {
    for (size_t k = 0; k < ts.size(); ++k) {
      if (ts[k].b[kGrad].bytes() > 0)
        std::memcpy(ts[k].b[kGrad].data(), o.ts[k].b[kGrad].data(), ts[k].b[kGrad].bytes());
    }
  }
};

// Every buffer of a and b holds the same bytes (and no write strayed outside).
// Reports the first few differing elements.
::testing::AssertionResult SameBits(const State& a, const State& b) {
  for (size_t k = 0; k < a.ts.size(); ++k) {
    for (int r = 0; r < kRoles; ++r) {
      if (!a.Present(r)) continue;
      const std::string what = "tensor " + std::to_string(k) + " (numel " +
                               std::to_string(a.ts[k].n) + ") " + kRoleNames[r];
      const ::testing::AssertionResult same = SameBuf(what, a.ts[k].b[r], b.ts[k].b[r],
                                                      a.Dtype(r));
      if (!same) return same;
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- steps ----------------------------------------------------------------------------

// Device arguments of a step over many tensors: check_finite's flag (clear) and the lr
// read on the device (cfg's), as a captured step takes them.
struct FlagAndLr {
  float found = 0.0f;
  double lr;
  precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
  explicit FlagAndLr(const precis_step_config_t& cfg) : lr(cfg.lr) {
    dev.found_inf = &found;
    dev.lr = &lr;
  }
  FlagAndLr(const FlagAndLr&) = delete;  // (dev points into it)
};

// Three different steps: AdamW; Adam with L2, maximize and gradient unscaling;
// odd betas, eps and a float32 lr (torch's float32 tensor lr).
struct StepKind {
  precis_step_config_t cfg;
  float grad_scale;  // the gradients are generated this much larger
};

StepKind Kind(int s) {
  precis_step_config_t c = PRECIS_STEP_CONFIG_INIT;
  float grad_scale = 1.0f;
  switch (s % 3) {
    case 0:
      c.lr = 1e-3, c.weight_decay = 0.01, c.decoupled_weight_decay = 1, c.seed = 0x1234;
      break;
    case 1:
      c.lr = 2e-3, c.weight_decay = 0.1, c.decoupled_weight_decay = 0, c.maximize = 1;
      c.inv_grad_scale = 1.0f / 1024, c.seed = 99;
      grad_scale = 1024.0f;
      break;
    default:
      c.lr = 3.3e-4, c.beta1 = 0.8765432109, c.beta2 = 0.95, c.eps = 1e-7, c.weight_decay = 0.0123;
      c.lr_float32 = 1, c.seed = 7;
      break;
  }
  return {c, grad_scale};
}

// One step of both kernels on their own copy of the state; the GPU call gets
// dev (NULL: host values) and its own cfg.
::testing::AssertionResult StepBoth(State& cpu, State& gpu, const precis_step_config_t& cfg,
                                    const precis_step_config_t& gpu_cfg,
                                    const precis_cuda_step_device_args_t* dev,
                                    bool gpu_host_steps = true) {
  precis_step_tensors_t dc = cpu.Desc();
  int32_t found = 0;
  precis_status_t st = precis_step(&cfg, &dc, &found);
  if (st != PRECIS_OK) return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  precis_step_tensors_t dg = gpu.Desc();
  if (!gpu_host_steps) dg.steps = nullptr;
  st = precis_cuda_step(&gpu_cfg, &dg, dev, nullptr);
  if (st != PRECIS_OK) return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  const std::string errors = cuda_emu::TakeErrors();
  if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
  cpu.Advance();
  gpu.Advance();
  return SameBits(cpu, gpu);
}

// The sizes of most tests: one element, a partial group, an empty tensor (it
// keeps its index: by default the stochastic-rounding stream), and 16 whole groups
// plus a one-element tail.
const std::vector<int64_t> kSizes = {1, 127, 0, 4097};

const char* LayoutName(Layout l) {
  return l == Layout::kAligned ? "aligned" : l == Layout::kOffset ? "offset" : "one_offset";
}

// ---- every combination ----------------------------------------------------------------

class CudaAdamCombo : public ::testing::TestWithParam<Combo> {};

TEST_P(CudaAdamCombo, MatchesCpuBitForBit) {
  const Combo c = GetParam();
  const Layout layouts[] = {Layout::kAligned, Layout::kOffset, Layout::kOneOff};
  // kOneOff misaligns one buffer role, a different one for each combination.
  const std::vector<Combo> all = AllCombos();
  int index = 0;
  while (std::memcmp(&all[index], &c, sizeof c) != 0) ++index;
  for (bool ams : {false, true}) {
    std::vector<int> vector_roles;
    for (int r : {kParam, kGrad, kMaster, kM, kV, kVMax})
      if (Present(c, r, ams)) vector_roles.push_back(r);
    const int off_role = vector_roles[index % vector_roles.size()];
    for (Layout layout : layouts) {
      std::mt19937_64 rng(1000 + index * 3 + (int)layout);
      State cpu(c, kSizes, layout, off_role, ams);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu;
      const State initial = cpu;
      std::string where = LayoutName(layout);
      if (layout == Layout::kOneOff) where += std::string(" ") + kRoleNames[off_role];
      if (ams) where += " amsgrad";
      for (int s = 0; s < 3; ++s) {
        StepKind k = Kind(s);
        k.cfg.amsgrad = ams;
        cpu.NewGrads(rng, k.grad_scale);
        gpu.CopyGradsFrom(cpu);
        ASSERT_TRUE(StepBoth(cpu, gpu, k.cfg, k.cfg, nullptr)) << where << ", step " << s + 1;
      }
      // Equal, and not because neither moved.
      EXPECT_FALSE(initial.ts[3].b[kParam] == gpu.ts[3].b[kParam]);
      EXPECT_FALSE(initial.ts[3].b[ams ? kVMax : kV] == gpu.ts[3].b[ams ? kVMax : kV]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CudaAdamCombo, ::testing::ValuesIn(AllCombos()),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           return ComboName(info.param);
                         });

// The names before issue #66 stay exported: precis_cuda_adam_step and
// precis_cuda_adam_check_finite are precis_cuda_step and its check, bit for bit, their
// errors naming the function called.
TEST(CudaAdam, OldNamesAreTheNewOnes) {
  std::mt19937_64 rng(66);
  State a({B16, B16, F32, F8, F16}, kSizes, Layout::kAligned, kParam);
  a.Fill(rng);
  State b = a;
  const State initial = a;
  precis_cuda_adam_device_args_t dev = PRECIS_CUDA_ADAM_DEVICE_ARGS_INIT;
  EXPECT_EQ(dev.size, sizeof(precis_cuda_step_device_args_t));
  for (int s = 0; s < 2; ++s) {
    const StepKind k = Kind(s);
    a.NewGrads(rng, k.grad_scale);
    b.CopyGradsFrom(a);
    precis_adam_tensors_t da = a.Desc(), db = b.Desc();
    ASSERT_EQ(precis_cuda_step(&k.cfg, &da, &dev, nullptr), PRECIS_OK) << precis_last_error();
    ASSERT_EQ(precis_cuda_adam_step(&k.cfg, &db, &dev, nullptr), PRECIS_OK)
        << precis_last_error();
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    a.Advance();
    b.Advance();
  }
  EXPECT_TRUE(SameBits(a, b));
  EXPECT_FALSE(initial.ts[3].b[kParam] == a.ts[3].b[kParam]);
  precis_adam_tensors_t d = b.Desc();
  EXPECT_EQ(precis_cuda_adam_check_finite(&d, nullptr, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(std::string(precis_last_error()).rfind("precis_cuda_adam_check_finite: ", 0), 0u)
      << precis_last_error();
  precis_adam_config_t bad = Kind(0).cfg;
  bad.beta1 = 1.0;
  EXPECT_EQ(precis_cuda_adam_step(&bad, &d, &dev, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(precis_last_error()).rfind("precis_cuda_adam_step: cfg->beta1", 0), 0u)
      << precis_last_error();
}

// The fp8 stores of every input (Fp8StoreGrads: every m8 code and midpoint,
// both signs, zeros, a subnormal, a NaN block) give the CPU's bits.
TEST(CudaAdam, Fp8StoresOfEveryCodeMatchCpuBitForBit) {
  std::vector<float> inputs;
  const std::vector<float> grads = Fp8StoreGrads(4, &inputs);
  const int64_t n = static_cast<int64_t>(grads.size());
  State cpu({B16, B16, F32, F8, F8}, {n}, Layout::kAligned, kParam);
  std::mt19937_64 rng(5);
  cpu.Fill(rng);
  if (HasFatalFailure()) return;
  for (int64_t i = 0; i < n; ++i) Encode(cpu.ts[0].b[kGrad], B16, i, grads[i]);
  State gpu = cpu;
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.beta1 = 0.0;
  cfg.beta2 = 0.0;
  cfg.lr = 1e-6;
  cfg.seed = 31;
  ASSERT_TRUE(StepBoth(cpu, gpu, cfg, cfg, nullptr));
}

// A few combinations for the tests below: the specialized kernels and the
// generic one, each master mode, scaled moments.
const Combo kSome[] = {
    {F32, F32, F32, F32, F32},  // fp32 model (specialized)
    {B16, B16, F32, B16, B16},  // bf16 default policy (specialized)
    {B16, B16, I16, B16, B16},  // remainders (specialized)
    {B16, B16, F32, F8, F8},    // fp8 moments (specialized)
    {B16, B16, F8, F8, F8},     // fp8 moments + 8-bit remainders (specialized)
    {F16, F16, F32, F32, F32},  // fp16 default policy (specialized)
    {B16, F32, B16, F16, F8},   // stochastic rounding, scaled moments (generic)
    {F16, B16, F16, F8, B16},   // fp16 own master (generic)
    {B16, F16, F16, F32, F16},  // fp16 master of bf16 params (generic)
};

// ---- AMSGrad ---------------------------------------------------------------------------

TEST(CudaAdam, AmsgradWithDeviceArgumentsMatchesCpuBitForBit) {
  // Every exp_avg_sq dtype (kSome has them all), each layout, host and device
  // constants (lr from device memory on the last step); CudaAdamCombo covers
  // every combination with host constants.
  for (const Combo& c : kSome) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset, Layout::kOneOff}) {
      SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout));
      std::mt19937_64 rng(31 + (int)layout);
      State cpu(c, kSizes, layout, kVMax, true);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu;
      const State initial = cpu;
      for (int s = 0; s < 3; ++s) {
        StepKind k = Kind(s);
        k.cfg.amsgrad = 1;
        cpu.NewGrads(rng, k.grad_scale);
        gpu.CopyGradsFrom(cpu);
        const double lr = k.cfg.lr;
        const float lr32 = static_cast<float>(k.cfg.lr);
        precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
        dev.lr = k.cfg.lr_float32 ? static_cast<const void*>(&lr32) : &lr;
        ASSERT_TRUE(StepBoth(cpu, gpu, k.cfg, k.cfg, s == 2 ? &dev : nullptr))
            << "step " << s + 1;
      }
      EXPECT_FALSE(initial.ts[3].b[kVMax] == gpu.ts[3].b[kVMax]);
      EXPECT_FALSE(initial.ts[3].b[kParam] == gpu.ts[3].b[kParam]);
    }
  }
}

// ---- many tensors, several chunks -----------------------------------------------------

TEST(CudaAdam, ManyTensorsAndSeveralChunksPerTensor) {
  // 162 tensors, 139 of them not empty: more than one launch holds (128), empty ones in
  // between, and tensors of one chunk exactly (16384) and of three chunks.
  std::mt19937_64 size_rng(5);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 160; ++i) sizes.push_back(i % 7 == 3 ? 0 : (int64_t)(size_rng() % 600));
  sizes.insert(sizes.begin() + 20, 16384);
  sizes.push_back(2 * 16384 + 1000);
  const uint64_t launches_before = cuda_emu::GetStats().launches;
  int calls = 0;
  for (const Combo& c : kSome) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout));
      std::mt19937_64 rng(77);
      State cpu(c, sizes, layout, 0);
      cpu.Fill(rng);
      State gpu = cpu;
      for (int s = 0; s < 2; ++s) {
        const StepKind k = Kind(s);
        cpu.NewGrads(rng, k.grad_scale);
        gpu.CopyGradsFrom(cpu);
        ASSERT_TRUE(StepBoth(cpu, gpu, k.cfg, k.cfg, nullptr)) << "step " << s + 1;
        ++calls;
      }
    }
  }
  EXPECT_EQ(cuda_emu::GetStats().launches - launches_before, 2u * calls) << "two launches a call";
}

// Stochastic rounding keyed by each tensor's stream and element offset, as the
// CPU's: offsets at and above 2^32, one that puts a 2^32 boundary inside a chunk,
// and streams beyond 32 bits, for every moment dtype and a bf16 param without master.
TEST(CudaAdam, StreamsAndElementOffsetsAsTheCpu) {
  const Combo combos[] = {{B16, B16, B16, B16, B16}, {B16, F32, I16, F8, F8},
                          {F32, F32, F32, F16, F16}};
  const std::vector<int64_t> sizes = {1, 127, 4097, 20000};
  const int64_t big = int64_t{1} << 32;
  for (const Combo& c : combos) {
    SCOPED_TRACE(ComboName(c));
    std::mt19937_64 rng(123);
    State cpu(c, sizes, Layout::kAligned, 0);
    cpu.Fill(rng);
    cpu.streams = {7, 0xFFFFFFFF00000003ull, 7, 1ull << 40};
    cpu.offsets = {big + 5, 0, big - 1000, 3 * big + 12345};
    State gpu = cpu;
    State defaults = cpu;  // the same data with stream i, offset 0: other bits
    defaults.streams.clear();
    defaults.offsets.clear();
    for (int s = 0; s < 2; ++s) {
      const StepKind k = Kind(s);
      cpu.NewGrads(rng, k.grad_scale);
      gpu.CopyGradsFrom(cpu);
      defaults.CopyGradsFrom(cpu);
      ASSERT_TRUE(StepBoth(cpu, gpu, k.cfg, k.cfg, nullptr)) << "step " << s + 1;
      precis_step_tensors_t d = defaults.Desc();
      ASSERT_EQ(precis_step(&k.cfg, &d, nullptr), PRECIS_OK);
      defaults.Advance();
    }
    EXPECT_FALSE(SameBits(cpu, defaults));
  }
}

// ---- device arguments -----------------------------------------------------------------

TEST(CudaAdam, DeviceArgumentsGiveTheHostValuesBits) {
  // Tensors k share the step pointer k % 2 (so steps alternate 4, 7, ...).
  const std::vector<int64_t> sizes = {1, 127, 0, 4097, 300};
  for (const Combo& c : kSome) {
    // Each subset of {lr, inv_grad_scale, steps} from device memory.
    for (int which = 1; which < 8; ++which) {
      const bool dev_lr = which & 1, dev_igs = which & 2, dev_steps = which & 4;
      SCOPED_TRACE(ComboName(c) + (dev_lr ? " lr" : "") + (dev_igs ? " inv_grad_scale" : "") +
                   (dev_steps ? " steps" : ""));
      std::mt19937_64 rng(which);
      State cpu(c, sizes, Layout::kAligned, 0);
      cpu.Fill(rng);
      for (size_t k = 0; k < cpu.ts.size(); ++k) cpu.ts[k].done = k % 2 ? 6 : 3;
      State gpu = cpu;
      for (int s = 0; s < 3; ++s) {
        const StepKind k = Kind(s);
        cpu.NewGrads(rng, k.grad_scale);
        gpu.CopyGradsFrom(cpu);
        // Device values; the host ones are then wrong on purpose (but valid).
        precis_step_config_t gcfg = k.cfg;
        const double lr = k.cfg.lr;
        const float lr32 = static_cast<float>(k.cfg.lr);  // read when cfg.lr_float32
        const float igs = k.cfg.inv_grad_scale;
        int64_t steps[2] = {cpu.ts[0].done + 1, cpu.ts[1].done + 1};
        std::vector<const int64_t*> step_ptrs;
        for (size_t t = 0; t < gpu.ts.size(); ++t) step_ptrs.push_back(&steps[t % 2]);
        precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
        if (dev_lr) dev.lr = k.cfg.lr_float32 ? static_cast<const void*>(&lr32) : &lr, gcfg.lr = 0.5;
        if (dev_igs) dev.inv_grad_scale = &igs, gcfg.inv_grad_scale = 3.0f;
        if (dev_steps) dev.steps = step_ptrs.data();
        ASSERT_TRUE(StepBoth(cpu, gpu, k.cfg, gcfg, &dev, !dev_steps)) << "step " << s + 1;
      }
    }
  }
}

TEST(CudaAdam, DeviceStepsBelowOneCountAsOne) {
  for (const Combo& c : kSome) {
    SCOPED_TRACE(ComboName(c));
    std::mt19937_64 rng(3);
    State cpu(c, kSizes, Layout::kAligned, 0);
    cpu.Fill(rng);
    for (Tensor& t : cpu.ts) t.done = 0;  // the CPU takes step 1
    State gpu = cpu;
    cpu.NewGrads(rng, 1.0f);
    gpu.CopyGradsFrom(cpu);
    const int64_t steps[2] = {0, -5};
    std::vector<const int64_t*> step_ptrs;
    for (size_t t = 0; t < gpu.ts.size(); ++t) step_ptrs.push_back(&steps[t % 2]);
    precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
    dev.steps = step_ptrs.data();
    const precis_step_config_t cfg = Kind(0).cfg;
    ASSERT_TRUE(StepBoth(cpu, gpu, cfg, cfg, &dev, false));
  }
}

// ---- non-finite gradients and found_inf -----------------------------------------------

TEST(CudaAdam, CheckFiniteWithANonFiniteGradientSetsFoundInfAndWritesNothing) {
  const float bad_values[] = {NAN, INFINITY, -INFINITY};
  struct Where {
    size_t tensor;
    int64_t elem;
  };
  // In a vector group, in the one-element tail, in a one-element tensor.
  const Where wheres[] = {{3, 1000}, {3, 4096}, {0, 0}};
  for (precis_dtype_t gd : {F32, F16, B16}) {
    const Combo c = {B16, gd, F32, F8, F16};
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      for (float bad : bad_values) {
        for (const Where& w : wheres) {
          SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout) + " bad " + std::to_string(bad) +
                       " at tensor " + std::to_string(w.tensor) + "[" + std::to_string(w.elem) +
                       "]");
          std::mt19937_64 rng(11);
          State cpu(c, kSizes, layout, 0);
          cpu.Fill(rng);
          cpu.NewGrads(rng, 1.0f);
          Encode(cpu.ts[w.tensor].b[kGrad], gd, w.elem, bad);
          State gpu = cpu;
          const State before = cpu;
          precis_step_config_t cfg = Kind(0).cfg;
          cfg.check_finite = 1;

          int32_t cpu_found = 0;
          precis_step_tensors_t dc = cpu.Desc();
          ASSERT_EQ(precis_step(&cfg, &dc, &cpu_found), PRECIS_OK) << precis_last_error();
          EXPECT_EQ(cpu_found, 1);

          float found = 0.0f;
          precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
          dev.found_inf = &found;
          precis_step_tensors_t dg = gpu.Desc();
          const uint64_t launches = cuda_emu::GetStats().launches;
          ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK)
              << precis_last_error();
          EXPECT_EQ(cuda_emu::TakeErrors(), "");
          EXPECT_EQ(cuda_emu::GetStats().launches - launches, 2u) << "check, then update";
          EXPECT_EQ(found, 1.0f);
          EXPECT_TRUE(SameBits(before, gpu));
          EXPECT_TRUE(SameBits(before, cpu));

          // The entry point of its own: 0 becomes 1; a flag already raised
          // (any nonzero value) is left as it is.
          precis_step_tensors_t dg2 = gpu.Desc();
          for (float start : {0.0f, 0.25f}) {
            found = start;
            ASSERT_EQ(precis_cuda_step_check_finite(&dg2, &found, nullptr), PRECIS_OK)
                << precis_last_error();
            EXPECT_EQ(found, start == 0.0f ? 1.0f : start);
          }
          EXPECT_EQ(cuda_emu::TakeErrors(), "");
        }
      }
    }
  }
}

TEST(CudaAdam, CheckFiniteWithFiniteGradientsStepsAndLeavesFoundInf) {
  for (const Combo& c : kSome) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout));
      std::mt19937_64 rng(12);
      State cpu(c, kSizes, layout, 0);
      cpu.Fill(rng);
      State gpu = cpu;
      cpu.NewGrads(rng, 1.0f);
      gpu.CopyGradsFrom(cpu);
      precis_step_config_t cfg = Kind(0).cfg;
      cfg.check_finite = 1;
      float found = 0.0f;
      precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
      dev.found_inf = &found;
      ASSERT_TRUE(StepBoth(cpu, gpu, cfg, cfg, &dev));
      EXPECT_EQ(found, 0.0f);

      precis_step_tensors_t dg = gpu.Desc();
      for (float start : {0.0f, 0.25f}) {
        found = start;
        ASSERT_EQ(precis_cuda_step_check_finite(&dg, &found, nullptr), PRECIS_OK);
        EXPECT_EQ(found, start);
      }
    }
  }
}

TEST(CudaAdam, FoundInfAlreadySetSkipsEverything) {
  for (const Combo& c : kSome) {
    for (float flag : {1.0f, -2.0f, NAN}) {
      for (int check : {0, 1}) {
        SCOPED_TRACE(ComboName(c) + " found_inf " + std::to_string(flag) + " check_finite " +
                     std::to_string(check));
        std::mt19937_64 rng(13);
        State gpu(c, kSizes, Layout::kAligned, 0);
        gpu.Fill(rng);
        gpu.NewGrads(rng, 1.0f);
        const State before = gpu;
        precis_step_config_t cfg = Kind(0).cfg;
        cfg.check_finite = check;
        float found = flag;
        precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
        dev.found_inf = &found;
        precis_step_tensors_t dg = gpu.Desc();
        ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK)
            << precis_last_error();
        EXPECT_EQ(cuda_emu::TakeErrors(), "");
        EXPECT_TRUE(SameBits(before, gpu));
        // Never cleared, never rewritten.
        uint32_t a, b;
        std::memcpy(&a, &found, 4);
        std::memcpy(&b, &flag, 4);
        EXPECT_EQ(a, b);
      }
    }
  }
}

// ---- the record: the fingerprints of the params the step writes ----------------------

// precis_fingerprint of each tensor's param as it is now.
std::vector<uint64_t> ParamFingerprints(const State& s) {
  std::vector<const void*> bufs;
  std::vector<int64_t> nbytes;
  for (const Tensor& t : s.ts) {
    bufs.push_back(t.b[kParam].data());
    nbytes.push_back(t.n * (int64_t)s.ElemSize(kParam));
  }
  std::vector<uint64_t> out(bufs.size(), 0xDEADu);
  EXPECT_EQ(precis_fingerprint(bufs.data(), nbytes.data(), (int64_t)bufs.size(), out.data()),
            PRECIS_OK);
  return out;
}

// One step of both kernels, each keeping its record (stale values in it: the step zeroes
// it); both records must be precis_fingerprint of the params after the step.
::testing::AssertionResult StepBothRecorded(State& cpu, State& gpu,
                                            const precis_step_config_t& cfg,
                                            const precis_cuda_step_device_args_t* dev = nullptr) {
  std::vector<uint64_t> cpu_fp(cpu.ts.size(), 0xBADu), gpu_fp(gpu.ts.size(), 0xBADu);
  precis_step_tensors_t dc = cpu.Desc();
  dc.param_fingerprints = cpu_fp.data();
  int32_t found = 0;
  if (precis_step(&cfg, &dc, &found) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  }
  precis_step_tensors_t dg = gpu.Desc();
  dg.param_fingerprints = gpu_fp.data();
  if (precis_cuda_step(&cfg, &dg, dev, nullptr) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  }
  const std::string errors = cuda_emu::TakeErrors();
  if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
  cpu.Advance();
  gpu.Advance();
  const ::testing::AssertionResult same = SameBits(cpu, gpu);
  if (!same) return same;
  const std::vector<uint64_t> now = ParamFingerprints(gpu);
  for (size_t k = 0; k < now.size(); ++k) {
    if (gpu_fp[k] != now[k] || cpu_fp[k] != now[k]) {
      return ::testing::AssertionFailure()
             << "tensor " << k << " (numel " << gpu.ts[k].n << "): CUDA record " << std::hex
             << gpu_fp[k] << ", CPU record " << cpu_fp[k] << ", precis_fingerprint " << now[k];
    }
  }
  return ::testing::AssertionSuccess();
}

// Every dtype combination (the specialized kernels and the generic one), the vector
// path and the element-wise one (odd byte offsets: fp16/bf16 params one element off),
// sizes 1, 127, 4097 and one of three CUDA blocks, an empty tensor among them, all in
// one launch; AMSGrad (the general loop only) too.
TEST(CudaAdamRecord, EqualsTheFingerprintOfTheParamsAfterTheStep) {
  const std::vector<int64_t> sizes = {1, 127, 0, 4097, 2 * 16384 + 1001};
  int index = 0;
  for (const Combo& c : AllCombos()) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      const bool ams = index++ % 3 == 0;
      SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout) + (ams ? " amsgrad" : ""));
      std::mt19937_64 rng(400 + index);
      State cpu(c, sizes, layout, 0, ams);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu;
      StepKind k = Kind(index);
      k.cfg.amsgrad = ams;
      cpu.NewGrads(rng, k.grad_scale);
      gpu.CopyGradsFrom(cpu);
      ASSERT_TRUE(StepBothRecorded(cpu, gpu, k.cfg));
    }
  }
}

// More tensors than a launch holds, empty ones in between: each launch adds into its
// own tensors' entries; with device arguments and check_finite (a finite step).
TEST(CudaAdamRecord, ManyTensorsAcrossLaunches) {
  std::mt19937_64 size_rng(8);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 160; ++i) sizes.push_back(i % 7 == 3 ? 0 : (int64_t)(size_rng() % 600));
  sizes.insert(sizes.begin() + 20, 16384);
  sizes.push_back(2 * 16384 + 1000);
  for (const Combo& c : kSome) {
    SCOPED_TRACE(ComboName(c));
    std::mt19937_64 rng(78);
    State cpu(c, sizes, Layout::kAligned, 0);
    cpu.Fill(rng);
    State gpu = cpu;
    precis_step_config_t cfg = Kind(0).cfg;
    cfg.check_finite = 1;
    FlagAndLr args(cfg);
    cpu.NewGrads(rng, 1.0f);
    gpu.CopyGradsFrom(cpu);
    ASSERT_TRUE(StepBothRecorded(cpu, gpu, cfg, &args.dev));
    EXPECT_EQ(args.found, 0.0f);
  }
}

// A skipped step (a NaN gradient under check_finite, or found_inf already set) writes no
// param, and its record is still the params' fingerprint: the host does not know it
// skipped.
TEST(CudaAdamRecord, ASkippedStepRecordsTheParamsAsTheyAre) {
  const std::vector<int64_t> sizes = {1, 127, 0, 4097, 2 * 16384 + 1001};
  for (const Combo& c : kSome) {
    for (int check : {0, 1}) {
      SCOPED_TRACE(ComboName(c) + " check_finite " + std::to_string(check));
      std::mt19937_64 rng(19);
      State gpu(c, sizes, Layout::kOffset, 0);
      gpu.Fill(rng);
      gpu.NewGrads(rng, 1.0f);
      Encode(gpu.ts[3].b[kGrad], c.gd, 1000, NAN);
      const State before = gpu;
      precis_step_config_t cfg = Kind(0).cfg;
      cfg.check_finite = check;
      float found = check ? 0.0f : 1.0f;
      precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
      dev.found_inf = &found;
      precis_step_tensors_t dg = gpu.Desc();
      std::vector<uint64_t> record(dg.count, 0xBADu);
      dg.param_fingerprints = record.data();
      ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK)
          << precis_last_error();
      EXPECT_EQ(cuda_emu::TakeErrors(), "");
      EXPECT_EQ(found, 1.0f);
      EXPECT_TRUE(SameBits(before, gpu));
      EXPECT_EQ(record, ParamFingerprints(before));
    }
  }
}

// dev->fingerprints_zeroed: the step adds to the record as it finds it (the caller zeroed
// it: precis_cuda_resync_compared's zeroed), no memset first, so a record of 0 ends as the
// fingerprints and one of 0xBAD as 0xBAD more (an empty tensor's, which no block adds to,
// stays 0xBAD); without it, or with a device-args struct of the size before the field
// (which the call still takes, not reading the field), the call zeroes it first.
TEST(CudaAdamRecord, ARecordZeroedByTheCallerGetsNoMemset) {
  const std::vector<int64_t> sizes = {1, 127, 0, 4097, 2 * 16384 + 1001};
  for (int how = 0; how < 4; ++how) {  // zeroed + 0, zeroed + 0xBAD, flag 0, old size
    SCOPED_TRACE("case " + std::to_string(how));
    std::mt19937_64 rng(23);
    State gpu(kSome[0], sizes, Layout::kAligned, 0);
    gpu.Fill(rng);
    gpu.NewGrads(rng, 1.0f);
    const precis_step_config_t cfg = Kind(0).cfg;
    precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
    dev.fingerprints_zeroed = how != 2;
    if (how == 3) dev.size = offsetof(precis_cuda_step_device_args_t, fingerprints_zeroed);
    precis_step_tensors_t dg = gpu.Desc();
    const uint64_t start = how == 0 ? 0 : 0xBADu;
    std::vector<uint64_t> record(dg.count, start);
    dg.param_fingerprints = record.data();
    ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK) << precis_last_error();
    EXPECT_EQ(cuda_emu::TakeErrors(), "");
    const std::vector<uint64_t> now = ParamFingerprints(gpu);
    for (size_t k = 0; k < now.size(); ++k) {
      const uint64_t added = how == 1 ? 0xBADu : 0;
      EXPECT_EQ(record[k], sizes[k] == 0 ? start * (how <= 1) : now[k] + added)
          << "tensor " << k;
    }
  }
}

// A record not aligned for its 64-bit atomics is refused before anything is written or
// launched.
TEST(CudaAdamRecord, BadRecordsAreRefusedAndNothingIsWritten) {
  std::mt19937_64 rng(17);
  State gpu(kSome[0], kSizes, Layout::kAligned, 0);
  gpu.Fill(rng);
  gpu.NewGrads(rng, 1.0f);
  const State before = gpu;
  const precis_step_config_t cfg = Kind(0).cfg;
  precis_step_tensors_t dg = gpu.Desc();
  std::vector<uint64_t> out(dg.count + 1, 0xDEADu);
  dg.param_fingerprints = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(out.data()) + 4);
  const uint64_t launches = cuda_emu::GetStats().launches;
  EXPECT_EQ(precis_cuda_step(&cfg, &dg, nullptr, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("param_fingerprints"), std::string::npos)
      << precis_last_error();
  EXPECT_NE(std::string(precis_last_error()).find("8-byte aligned"), std::string::npos)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::GetStats().launches, launches);
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_TRUE(SameBits(before, gpu));
  EXPECT_EQ(out, std::vector<uint64_t>(dg.count + 1, 0xDEADu));
}

// ---- the block record: the blocks of the params the step writes ----------------------

// tensors->param_block_fingerprints: tensor i's max(1, ceil(numels[i] /
// PRECIS_FINGERPRINT_BLOCK)) entries, from the sum of the earlier tensors' counts, are
// precis_fingerprint_blocks of its param as the step leaves it (blocks of
// PRECIS_FINGERPRINT_BLOCK elements' bytes): the CPU's record and the CUDA one.

constexpr uint64_t kStaleEntry = 0xB10C5E7ull;  // a record entry no step should leave
// One element; a partial block; one block; an empty tensor; one block and one element;
// three blocks and 5 elements.
const std::vector<int64_t> kBlockSizes = {1, 127, PRECIS_FINGERPRINT_BLOCK, 0,
                                          PRECIS_FINGERPRINT_BLOCK + 1,
                                          3 * PRECIS_FINGERPRINT_BLOCK + 5};

int64_t BlockCount(int64_t n) {
  return n == 0 ? 1 : (n + PRECIS_FINGERPRINT_BLOCK - 1) / PRECIS_FINGERPRINT_BLOCK;
}

size_t RecordSize(const State& s) {
  size_t total = 0;
  for (const Tensor& t : s.ts) total += (size_t)BlockCount(t.n);
  return total;
}

// precis_fingerprint_blocks (the CPU function) of each tensor's param as it is now.
std::vector<uint64_t> ParamBlocks(const State& s) {
  std::vector<const void*> bufs;
  std::vector<int64_t> nbytes;
  for (const Tensor& t : s.ts) {
    bufs.push_back(t.b[kParam].data());
    nbytes.push_back(t.n * (int64_t)s.ElemSize(kParam));
  }
  std::vector<uint64_t> out(RecordSize(s), 0xDEADu);
  EXPECT_EQ(precis_fingerprint_blocks(bufs.data(), nbytes.data(), (int64_t)bufs.size(),
                                      PRECIS_FINGERPRINT_BLOCK * (int64_t)s.ElemSize(kParam),
                                      out.data()),
            PRECIS_OK)
      << precis_last_error();
  return out;
}

// got (the record `who` kept) equals want entry for entry; else the first few differing
// entries, named by tensor and block.
::testing::AssertionResult SameRecord(const char* who, const State& s,
                                      const std::vector<uint64_t>& got,
                                      const std::vector<uint64_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << who << ": " << got.size() << " entries, want "
                                         << want.size();
  }
  auto f = ::testing::AssertionFailure();
  f << who << " record:";
  int differing = 0;
  size_t at = 0;
  for (size_t k = 0; k < s.ts.size(); ++k) {
    for (int64_t b = 0; b < BlockCount(s.ts[k].n); ++b, ++at) {
      if (got[at] == want[at]) continue;
      if (differing++ < 4) {
        f << " tensor " << k << " (numel " << s.ts[k].n << ") block " << b << " (entry " << at
          << "): 0x" << std::hex << got[at] << ", want 0x" << want[at] << std::dec << ";";
      }
    }
  }
  if (differing == 0) return ::testing::AssertionSuccess();
  return f << " " << differing << " of " << got.size() << " entries differ";
}

// Each tensor's blocks summed, plus its bytes * 0x9E3779B97F4A7C15, are its
// param_fingerprints entry.
::testing::AssertionResult BlocksSumToFingerprints(const State& s,
                                                   const std::vector<uint64_t>& record,
                                                   const std::vector<uint64_t>& fingerprints) {
  size_t at = 0;
  for (size_t k = 0; k < s.ts.size(); ++k) {
    uint64_t sum = (uint64_t)(s.ts[k].n * (int64_t)s.ElemSize(kParam)) * 0x9E3779B97F4A7C15ull;
    for (int64_t b = 0; b < BlockCount(s.ts[k].n); ++b) sum += record[at++];
    if (sum != fingerprints[k]) {
      return ::testing::AssertionFailure()
             << "tensor " << k << " (numel " << s.ts[k].n << "): blocks + length term 0x"
             << std::hex << sum << ", param_fingerprints 0x" << fingerprints[k];
    }
  }
  return ::testing::AssertionSuccess();
}

// The rule's tables: the one-state rules read no exp_avg_sqs (NULL here).
precis_step_tensors_t DescFor(State& s, const precis_step_config_t& cfg) {
  precis_step_tensors_t d = s.Desc();
  if (cfg.rule != PRECIS_RULE_ADAM) d.exp_avg_sqs = nullptr, d.exp_avg_sq_scales = nullptr;
  return d;
}

// One step of both kernels, each keeping a block record (stale entries in it) and, with
// `fingerprints`, param_fingerprints: the same bits, both records the blocks of the params
// after the step, and each tensor's blocks summing to its param_fingerprints entry.
::testing::AssertionResult StepBothBlockRecorded(
    State& cpu, State& gpu, const precis_step_config_t& cfg, bool fingerprints,
    const precis_cuda_step_device_args_t* dev = nullptr) {
  const std::vector<uint64_t> before = ParamBlocks(gpu);
  std::vector<uint64_t> cpu_rec(RecordSize(cpu), kStaleEntry), gpu_rec(cpu_rec);
  std::vector<uint64_t> cpu_fp(cpu.ts.size(), kStaleEntry), gpu_fp(cpu_fp);
  precis_step_tensors_t dc = DescFor(cpu, cfg);
  dc.param_block_fingerprints = cpu_rec.data();
  if (fingerprints) dc.param_fingerprints = cpu_fp.data();
  int32_t found = 0;
  if (precis_step(&cfg, &dc, &found) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  }
  precis_step_tensors_t dg = DescFor(gpu, cfg);
  dg.param_block_fingerprints = gpu_rec.data();
  if (fingerprints) dg.param_fingerprints = gpu_fp.data();
  if (precis_cuda_step(&cfg, &dg, dev, nullptr) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  }
  const std::string errors = cuda_emu::TakeErrors();
  if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
  cpu.Advance();
  gpu.Advance();
  ::testing::AssertionResult ok = SameBits(cpu, gpu);
  if (!ok) return ok;
  const std::vector<uint64_t> now = ParamBlocks(gpu);
  if (now == before) return ::testing::AssertionFailure() << "the step wrote no param";
  if (!(ok = SameRecord("CUDA", gpu, gpu_rec, now))) return ok;
  if (!(ok = SameRecord("CPU", cpu, cpu_rec, now))) return ok;
  if (fingerprints) {
    const std::vector<uint64_t> whole = ParamFingerprints(gpu);
    if (gpu_fp != whole || cpu_fp != whole) {
      return ::testing::AssertionFailure() << "param_fingerprints beside the block record "
                                              "are not the params' fingerprints";
    }
    if (!(ok = BlocksSumToFingerprints(gpu, gpu_rec, gpu_fp))) return ok;
  }
  return ::testing::AssertionSuccess();
}

// The combinations of kSome (each master mode, the specialized kernels and the generic
// one), the vector path and the element-wise one (params one element off), with
// param_fingerprints and alone, two steps each (the second's record stale with the
// first's values).
TEST(CudaStepBlockRecord, EqualsTheBlocksOfTheParamsAfterTheStep) {
  int index = 0;
  for (const Combo& c : kSome) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      const bool fingerprints = index++ % 2 == 0;
      SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout) +
                   (fingerprints ? " with param_fingerprints" : " alone"));
      std::mt19937_64 rng(500 + index);
      State cpu(c, kBlockSizes, layout, 0);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu;
      for (int s = 0; s < 2; ++s) {
        const StepKind k = Kind(index + s);
        cpu.NewGrads(rng, k.grad_scale);
        gpu.CopyGradsFrom(cpu);
        ASSERT_TRUE(StepBothBlockRecorded(cpu, gpu, k.cfg, fingerprints)) << "step " << s + 1;
      }
    }
  }
}

// SGD (with momentum) and Lion, which write params as Adam does: fp32 params, bf16 with an
// fp32 master, int16 and 8-bit remainders.
TEST(CudaStepBlockRecord, SgdAndLionToo) {
  const Combo combos[] = {{F32, F32, F32, F32, F32}, {B16, B16, F32, B16, B16},
                          {B16, B16, I16, B16, B16}, {B16, B16, F8, F8, F8}};
  int index = 0;
  for (const Combo& c : combos) {
    for (int rule : {PRECIS_RULE_SGD, PRECIS_RULE_LION}) {
      const bool fingerprints = index++ % 2 == 0;
      SCOPED_TRACE(ComboName(c) + (rule == PRECIS_RULE_SGD ? " sgd" : " lion"));
      std::mt19937_64 rng(600 + index);
      State cpu(c, kBlockSizes, Layout::kAligned, 0);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu;
      precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
      cfg.rule = rule;
      cfg.lr = rule == PRECIS_RULE_SGD ? 1e-2 : 1e-3;
      cfg.momentum = rule == PRECIS_RULE_SGD ? 0.9 : 0.0;
      cfg.beta1 = 0.9, cfg.beta2 = 0.99, cfg.weight_decay = 0.01, cfg.seed = 5;
      cpu.NewGrads(rng, 1.0f);
      gpu.CopyGradsFrom(cpu);
      ASSERT_TRUE(StepBothBlockRecorded(cpu, gpu, cfg, fingerprints));
    }
  }
}

// More tensors than a launch holds (128), with empty ones in between or none, tensors of
// one block and of several among them: each launch writes its own tensors' entries; with
// device arguments and check_finite (a finite step).
TEST(CudaStepBlockRecord, ManyTensorsAcrossLaunches) {
  std::mt19937_64 size_rng(9);
  std::vector<int64_t> with_empties, without;
  for (int i = 0; i < 160; ++i) {
    with_empties.push_back(i % 7 == 3 ? 0 : (int64_t)(size_rng() % 600));
  }
  for (int i = 0; i < 300; ++i) without.push_back(1 + (int64_t)(size_rng() % 600));
  for (auto* sizes : {&with_empties, &without}) {
    sizes->insert(sizes->begin() + 20, PRECIS_FINGERPRINT_BLOCK);
    // (without empties, the 128th tensor: the last of the first launch)
    sizes->insert(sizes->begin() + 127, PRECIS_FINGERPRINT_BLOCK + 1);
    sizes->push_back(3 * PRECIS_FINGERPRINT_BLOCK + 5);
  }
  for (const auto& [c, sizes] : {std::make_pair(kSome[1], with_empties),
                                 std::make_pair(kSome[4], with_empties),
                                 std::make_pair(kSome[1], without)}) {
    SCOPED_TRACE(ComboName(c) + (sizes == without ? " no empty tensor" : " empty tensors"));
    std::mt19937_64 rng(79);
    State cpu(c, sizes, Layout::kAligned, 0);
    cpu.Fill(rng);
    State gpu = cpu;
    precis_step_config_t cfg = Kind(0).cfg;
    cfg.check_finite = 1;
    FlagAndLr args(cfg);
    cpu.NewGrads(rng, 1.0f);
    gpu.CopyGradsFrom(cpu);
    ASSERT_TRUE(StepBothBlockRecorded(cpu, gpu, cfg, true, &args.dev));
    EXPECT_EQ(args.found, 0.0f);
  }
}

// Empty tensors (one entry each, 0) first, last and one after another, between tensors
// of one element and of two blocks.
TEST(CudaStepBlockRecord, EmptyTensorsAnywhere) {
  const std::vector<int64_t> sizes = {0, 0, 1, 0, 0, PRECIS_FINGERPRINT_BLOCK + 1, 0};
  for (const Combo& c : {kSome[0], kSome[2]}) {
    SCOPED_TRACE(ComboName(c));
    std::mt19937_64 rng(80);
    State cpu(c, sizes, Layout::kAligned, 0);
    cpu.Fill(rng);
    State gpu = cpu;
    const precis_step_config_t cfg = Kind(0).cfg;
    cpu.NewGrads(rng, 1.0f);
    gpu.CopyGradsFrom(cpu);
    ASSERT_TRUE(StepBothBlockRecorded(cpu, gpu, cfg, true));
  }
}

// dev->fingerprints_zeroed says param_fingerprints were zeroed by the caller; the block
// record is the call's own to write: a stale one still ends as the params' blocks.
TEST(CudaStepBlockRecord, FingerprintsZeroedLeavesTheBlockRecordToTheCall) {
  std::mt19937_64 rng(24);
  State gpu(kSome[1], kBlockSizes, Layout::kAligned, 0);
  gpu.Fill(rng);
  gpu.NewGrads(rng, 1.0f);
  const precis_step_config_t cfg = Kind(0).cfg;
  precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
  dev.fingerprints_zeroed = 1;
  precis_step_tensors_t dg = gpu.Desc();
  std::vector<uint64_t> fingerprints(dg.count, 0), record(RecordSize(gpu), kStaleEntry);
  dg.param_fingerprints = fingerprints.data();
  dg.param_block_fingerprints = record.data();
  ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_EQ(fingerprints, ParamFingerprints(gpu));
  EXPECT_TRUE(SameRecord("CUDA", gpu, record, ParamBlocks(gpu)));
}

// A step skipped on the device (a NaN gradient under check_finite, or found_inf already
// set) writes no param, and its block record (and param_fingerprints beside it) is that of
// the params as they are: the host does not know it skipped.
TEST(CudaStepBlockRecord, ASkippedStepRecordsTheParamsAsTheyAre) {
  for (const Combo& c : kSome) {
    for (int check : {0, 1}) {
      SCOPED_TRACE(ComboName(c) + " check_finite " + std::to_string(check));
      std::mt19937_64 rng(29);
      State gpu(c, kBlockSizes, Layout::kOffset, 0);
      gpu.Fill(rng);
      gpu.NewGrads(rng, 1.0f);
      Encode(gpu.ts[5].b[kGrad], c.gd, 2 * PRECIS_FINGERPRINT_BLOCK + 17, NAN);
      const State before = gpu;
      precis_step_config_t cfg = Kind(0).cfg;
      cfg.check_finite = check;
      float found = check ? 0.0f : 1.0f;
      precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
      dev.found_inf = &found;
      precis_step_tensors_t dg = gpu.Desc();
      std::vector<uint64_t> record(RecordSize(gpu), kStaleEntry);
      std::vector<uint64_t> fingerprints(dg.count, kStaleEntry);
      dg.param_block_fingerprints = record.data();
      dg.param_fingerprints = fingerprints.data();
      ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK) << precis_last_error();
      EXPECT_EQ(cuda_emu::TakeErrors(), "");
      EXPECT_EQ(found, 1.0f);
      EXPECT_TRUE(SameBits(before, gpu));
      EXPECT_TRUE(SameRecord("CUDA", gpu, record, ParamBlocks(before)));
      EXPECT_EQ(fingerprints, ParamFingerprints(before));
    }
  }
}

// A block record not aligned for its 64-bit atomics is refused, as param_fingerprints is,
// before anything is written or launched.
TEST(CudaStepBlockRecord, AMisalignedRecordIsRefusedAndNothingIsWritten) {
  std::mt19937_64 rng(18);
  State gpu(kSome[1], kBlockSizes, Layout::kAligned, 0);
  gpu.Fill(rng);
  gpu.NewGrads(rng, 1.0f);
  const State before = gpu;
  const precis_step_config_t cfg = Kind(0).cfg;
  precis_step_tensors_t dg = gpu.Desc();
  std::vector<uint64_t> out(RecordSize(gpu) + 1, kStaleEntry);
  dg.param_block_fingerprints =
      reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(out.data()) + 4);
  const uint64_t launches = cuda_emu::GetStats().launches;
  EXPECT_EQ(precis_cuda_step(&cfg, &dg, nullptr, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("param_block_fingerprints"),
            std::string::npos)
      << precis_last_error();
  EXPECT_EQ(cuda_emu::GetStats().launches, launches);
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_TRUE(SameBits(before, gpu));
  EXPECT_EQ(out, std::vector<uint64_t>(out.size(), kStaleEntry));
}

// ---- the blocks' compare: a block written since its record resynced in the step ----

// Element i of tensor k's bf16 param one ulp up (a write behind the step), in both.
void WriteParam(State& s, size_t k, int64_t i) {
  uint16_t bits;
  unsigned char* p = s.ts[k].b[kParam].data();
  std::memcpy(&bits, p + 2 * i, 2);
  bits = (uint16_t)(bits + 1);
  std::memcpy(p + 2 * i, &bits, 2);
}

// The writes into kBlockSizes' tensors: the 127-element one's element 3, the 3-block one's
// second block and its 5-element last block, the 1-block-and-1 one's lone last element.
void WriteBehind(State& s) {
  WriteParam(s, 1, 3);
  WriteParam(s, 5, PRECIS_FINGERPRINT_BLOCK + 77);
  WriteParam(s, 5, 3 * PRECIS_FINGERPRINT_BLOCK + 4);
  WriteParam(s, 4, PRECIS_FINGERPRINT_BLOCK);
}

// One step of both kernels given the same record of the params' blocks (taken before the
// writes) and each its own kept and block record out: the same bits, kept counts and
// records.
::testing::AssertionResult StepBothCompared(State& cpu, State& gpu,
                                            const std::vector<uint64_t>& record,
                                            const precis_step_config_t& cfg,
                                            const precis_cuda_step_device_args_t* dev,
                                            std::vector<int64_t>* kept_out) {
  std::vector<uint64_t> cpu_rec(record.size(), kStaleEntry), gpu_rec(cpu_rec);
  std::vector<int64_t> cpu_kept(cpu.ts.size(), -1), gpu_kept(cpu_kept);
  int32_t found = 0;
  precis_step_tensors_t dc = DescFor(cpu, cfg);
  dc.param_block_records = record.data();
  dc.param_blocks_kept = cpu_kept.data();
  dc.param_block_fingerprints = cpu_rec.data();
  if (precis_step(&cfg, &dc, &found) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  }
  precis_step_tensors_t dg = DescFor(gpu, cfg);
  dg.param_block_records = record.data();
  dg.param_blocks_kept = gpu_kept.data();
  dg.param_block_fingerprints = gpu_rec.data();
  if (precis_cuda_step(&cfg, &dg, dev, nullptr) != PRECIS_OK) {
    return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  }
  const std::string errors = cuda_emu::TakeErrors();
  if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
  ::testing::AssertionResult ok = SameBits(cpu, gpu);
  if (!ok) return ok;
  if (cpu_kept != gpu_kept) return ::testing::AssertionFailure() << "kept differs";
  if (found == 0 && !(ok = SameRecord("CUDA", gpu, gpu_rec, cpu_rec))) return ok;
  *kept_out = gpu_kept;
  return ::testing::AssertionSuccess();
}

// Both remainders, the vector path and the element-wise one (params one element off: the
// compare's words loaded bytewise), Adam and SGD: the written blocks' remainders zeroed
// before their step as the CPU's compare zeroes them, the others kept and counted.
TEST(CudaStepBlockCompare, ResyncsTheWrittenBlocksAsTheCpu) {
  int index = 0;
  for (const Combo& c : {Combo{B16, B16, I16, B16, B16}, Combo{B16, B16, F8, F8, F8}}) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      for (int rule : {PRECIS_RULE_ADAM, PRECIS_RULE_SGD}) {
        SCOPED_TRACE(ComboName(c) + " " + LayoutName(layout) +
                     (rule == PRECIS_RULE_SGD ? " sgd" : " adam"));
        std::mt19937_64 rng(700 + index++);
        State cpu(c, kBlockSizes, layout, 0);
        cpu.Fill(rng);
        if (HasFatalFailure()) return;
        precis_step_config_t cfg = Kind(index).cfg;
        cfg.rule = rule;
        if (rule == PRECIS_RULE_SGD) cfg.momentum = 0.9;
        const std::vector<uint64_t> record = ParamBlocks(cpu);
        WriteBehind(cpu);
        cpu.NewGrads(rng, 1.0f);
        State gpu = cpu;
        std::vector<int64_t> kept;
        ASSERT_TRUE(StepBothCompared(cpu, gpu, record, cfg, nullptr, &kept));
        // tensor 1 and 4 each one written block, tensor 5 two; the others none
        const std::vector<int64_t> want = {1, 0, PRECIS_FINGERPRINT_BLOCK, 0,
                                           PRECIS_FINGERPRINT_BLOCK,
                                           PRECIS_FINGERPRINT_BLOCK * 2};
        EXPECT_EQ(kept, want);
      }
    }
  }
}

// A step skipped on the device (dev->found_inf set) still resyncs the written blocks, as
// the CPU's skipped step (check_finite, a NaN gradient) does, and counts kept.
TEST(CudaStepBlockCompare, ASkippedStepStillResyncs) {
  std::mt19937_64 rng(711);
  State cpu(Combo{B16, B16, F8, F8, F8}, kBlockSizes, Layout::kAligned, 0);
  cpu.Fill(rng);
  const std::vector<uint64_t> record = ParamBlocks(cpu);
  WriteBehind(cpu);
  cpu.NewGrads(rng, 1.0f);
  Encode(cpu.ts[5].b[kGrad], cpu.c.gd, 17, NAN);
  State gpu = cpu;
  const State before = cpu;
  precis_step_config_t cfg = Kind(0).cfg;
  cfg.check_finite = 1;
  precis_step_config_t gpu_cfg = cfg;
  gpu_cfg.check_finite = 0;
  float found = 1.0f;  // (skipped by the caller's flag)
  precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
  dev.found_inf = &found;
  // (each kernel its own cfg: the CPU's finds the NaN, the CUDA one is told)
  std::vector<int64_t> cpu_kept(cpu.ts.size(), -1), gpu_kept(cpu_kept);
  int32_t cpu_found = 0;
  precis_step_tensors_t dc = DescFor(cpu, cfg);
  dc.param_block_records = record.data();
  dc.param_blocks_kept = cpu_kept.data();
  ASSERT_EQ(precis_step(&cfg, &dc, &cpu_found), PRECIS_OK) << precis_last_error();
  ASSERT_EQ(cpu_found, 1);
  precis_step_tensors_t dg = DescFor(gpu, gpu_cfg);
  dg.param_block_records = record.data();
  dg.param_blocks_kept = gpu_kept.data();
  ASSERT_EQ(precis_cuda_step(&gpu_cfg, &dg, &dev, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_TRUE(SameBits(cpu, gpu));
  EXPECT_EQ(cpu_kept, gpu_kept);
  EXPECT_FALSE(SameBits(before, gpu)) << "nothing resynced";
  for (size_t k = 0; k < gpu.ts.size(); ++k) {  // only remainders written
    for (int r : {kParam, kM, kV, kMScale, kVScale}) {
      if (!gpu.Present(r) || gpu.ts[k].b[r].bytes() == 0) continue;
      EXPECT_EQ(std::memcmp(gpu.ts[k].b[r].data(), before.ts[k].b[r].data(),
                            gpu.ts[k].b[r].bytes()), 0)
          << "a skipped step wrote role " << r << " of tensor " << k;
    }
  }
}

// Over launches (more than 128 tensors, empty ones between), with device arguments and
// check_finite: each launch compares its own tensors' blocks with their own entries.
TEST(CudaStepBlockCompare, ManyTensorsAcrossLaunches) {
  std::mt19937_64 size_rng(19);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 170; ++i) sizes.push_back(i % 7 == 3 ? 0 : (int64_t)(size_rng() % 600));
  sizes.push_back(3 * PRECIS_FINGERPRINT_BLOCK + 5);
  std::mt19937_64 rng(83);
  State cpu(Combo{B16, B16, I16, B16, B16}, sizes, Layout::kAligned, 0);
  cpu.Fill(rng);
  const std::vector<uint64_t> record = ParamBlocks(cpu);
  std::vector<size_t> written;
  for (size_t k = 0; k < sizes.size(); k += 11) {
    if (sizes[k] == 0) continue;
    WriteParam(cpu, k, sizes[k] / 2);
    written.push_back(k);
  }
  WriteParam(cpu, sizes.size() - 1, 2 * PRECIS_FINGERPRINT_BLOCK + 1);
  cpu.NewGrads(rng, 1.0f);
  State gpu = cpu;
  precis_step_config_t cfg = Kind(0).cfg;
  cfg.check_finite = 1;
  FlagAndLr args(cfg);
  std::vector<int64_t> kept;
  ASSERT_TRUE(StepBothCompared(cpu, gpu, record, cfg, &args.dev, &kept));
  EXPECT_EQ(args.found, 0.0f);
  for (size_t k : written) EXPECT_EQ(kept[k], 0) << "tensor " << k;
  EXPECT_EQ(kept.back(), 3 * PRECIS_FINGERPRINT_BLOCK + 5 - PRECIS_FINGERPRINT_BLOCK);
}

// A misaligned kept or records is refused, naming it, before anything is written.
TEST(CudaStepBlockCompare, AMisalignedKeptIsRefused) {
  std::mt19937_64 rng(97);
  State gpu(Combo{B16, B16, I16, B16, B16}, kBlockSizes, Layout::kAligned, 0);
  gpu.Fill(rng);
  gpu.NewGrads(rng, 1.0f);
  const State before = gpu;
  std::vector<uint64_t> record = ParamBlocks(gpu);
  std::vector<int64_t> kept(gpu.ts.size() + 1, -1);
  precis_step_config_t cfg = Kind(0).cfg;
  precis_step_tensors_t dg = DescFor(gpu, cfg);
  dg.param_block_records = record.data();
  dg.param_blocks_kept = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(kept.data()) + 4);
  EXPECT_EQ(precis_cuda_step(&cfg, &dg, nullptr, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("param_blocks_kept"), std::string::npos)
      << precis_last_error();
  EXPECT_TRUE(SameBits(before, gpu));
  EXPECT_EQ(kept, std::vector<int64_t>(kept.size(), -1));
}

// ---- a step that resyncs what its compare flagged (dev->stale, dev->kept) ---------------

// Every kind of master a resync rewrites: fp32 masters of bf16 and fp16 params, an fp16
// master of bf16 params (the generic kernel), int16 and 8-bit remainders.
const Combo kResynced[] = {
    {B16, B16, F32, B16, B16}, {F16, F16, F32, F32, F32}, {B16, F16, F16, F32, F16},
    {B16, B16, I16, B16, B16}, {B16, B16, F8, F8, F8},
};

// The writes behind the step's back, tensor k's by k % 4: none, one element changed,
// every eighth element changed (a partial write), every element new but one in a hundred
// (a whole load: the master of those few is reread too).
const char* const kWriteNames[] = {"not written", "one element", "an eighth", "a whole load"};

void WriteParams(State& s, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (size_t k = 0; k < s.ts.size(); ++k) {
    Tensor& t = s.ts[k];
    uint16_t* p = reinterpret_cast<uint16_t*>(t.b[kParam].data());
    for (int64_t i = 0; i < t.n; ++i) {
      const int kind = (int)(k % 4);
      if (kind == 3 && i % 100 != 99) {
        Encode(t.b[kParam], s.c.pd, i, u(rng));
      } else if ((kind == 1 && i == t.n / 2) || (kind == 2 && i % 8 == 0)) {
        p[i] ^= 1;  // a value the master no longer rounds to
      }
    }
  }
}

struct Tables {
  std::vector<void*> masters;
  std::vector<const void*> params;
  std::vector<int64_t> numels;
};
Tables TablesOf(const State& s) {
  Tables t;
  for (const Tensor& x : s.ts) {
    t.masters.push_back(x.b[kMaster].data());
    t.params.push_back(x.b[kParam].data());
    t.numels.push_back(x.n);
  }
  return t;
}

// From the same state, params written since `records`: the CPU's resync
// (precis_resync_changed) then its step (none when skip), against
// precis_cuda_compare_params then the CUDA step given its flags and counts
// (dev->stale, dev->kept; dev->found_inf set when skip; the step keeping its record unless
// !recorded, when a skipped step returns before its record). The same bits, flags and counts;
// the compare's launches (2 with a master, 1 with remainders) and the update's (one per
// 128 tensors), nothing copied back, the record the params' fingerprint. Returns the CUDA
// step's state.
State ExpectResyncedStepIsTheCpus(const State& written, const std::vector<uint64_t>& records,
                                  const precis_step_config_t& cfg, bool skip,
                                  bool recorded = true) {
  const Combo c = written.c;
  const int64_t n = (int64_t)written.ts.size();
  const std::vector<int64_t> rec(records.begin(), records.end());
  State cpu = written, gpu = written;
  // The CPU: the compare, the resync, the step.
  std::vector<uint8_t> cpu_stale(n, 0xCC);
  const std::vector<uint64_t> now = ParamFingerprints(cpu);
  std::vector<int64_t> cpu_kept(now.begin(), now.end());
  Tables tc = TablesOf(cpu);
  EXPECT_EQ(precis_resync_changed(tc.masters.data(), c.md, tc.params.data(), c.pd,
                                  tc.numels.data(), rec.data(), cpu_stale.data(),
                                  cpu_kept.data(), n),
            PRECIS_OK)
      << precis_last_error();
  if (!skip) {
    precis_step_tensors_t dc = cpu.Desc();
    int32_t found = 0;
    EXPECT_EQ(precis_step(&cfg, &dc, &found), PRECIS_OK) << precis_last_error();
    cpu.Advance();
  }
  // The GPU: the compare (no write), then the step that resyncs.
  const cuda_emu::Stats s0 = cuda_emu::GetStats();
  std::vector<uint8_t> stale(n, 0xCC);
  std::vector<int64_t> kept(n, -77);
  std::vector<uint64_t> sums(2 * n, 0), record(n, 0xDEADu);
  Tables tg = TablesOf(gpu);
  EXPECT_EQ(precis_cuda_compare_params(tg.masters.data(), c.md, tg.params.data(), c.pd,
                                       tg.numels.data(), rec.data(), stale.data(), kept.data(),
                                       sums.data(), record.data(), n, nullptr),
            PRECIS_OK)
      << precis_last_error();
  const uint64_t compare_launches = cuda_emu::GetStats().launches - s0.launches;
  EXPECT_EQ(compare_launches, ModeOf(c) == kSeparate ? 2u : 1u) << "the compare's launches";
  float found = skip ? 1.0f : 0.0f;
  precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
  dev.found_inf = &found;
  dev.fingerprints_zeroed = 1;
  dev.stale = stale.data();
  dev.kept = kept.data();
  dev.fingerprints_zeroed = recorded;
  precis_step_tensors_t dg = gpu.Desc();
  dg.param_fingerprints = recorded ? record.data() : nullptr;
  EXPECT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  int64_t tensors = 0;
  for (const Tensor& t : written.ts) tensors += t.n > 0;
  EXPECT_EQ(cuda_emu::GetStats().launches - s0.launches,
            compare_launches + (uint64_t)(tensors + 127) / 128)
      << "the update's launches";
  EXPECT_EQ(cuda_emu::GetStats().memcpys, s0.memcpys) << "something copied back";
  if (!skip) gpu.Advance();
  EXPECT_TRUE(SameBits(cpu, gpu));
  EXPECT_EQ(stale, cpu_stale);
  EXPECT_EQ(kept, cpu_kept);
  EXPECT_EQ(sums, std::vector<uint64_t>(2 * n, 0)) << "sums not left zero";
  if (recorded) EXPECT_EQ(record, ParamFingerprints(gpu));
  return gpu;
}

// Each kind of master, each write (none, one element, a partial write, a whole load) at
// sizes 1, 127, 0, 4097 and 70001 (five blocks of the update, flagged ones each resyncing
// its own chunk), stepped and skipped (with the step's record and without): the CPU's
// resync and step, bit for bit. A step of the same state that is not told the flags
// differs (the test sees the resync).
TEST(CudaAdamResync, AStepResyncsWhatItsCompareFlaggedAsTheCpu) {
  std::vector<int64_t> sizes;
  for (int64_t size : {1, 127, 0, 4097, 70001}) sizes.insert(sizes.end(), 4, size);
  int index = 0;
  for (const Combo& c : kResynced) {
    for (int how = 0; how < 3; ++how) {  // stepped, skipped, skipped without a record
      const bool skip = how > 0;
      SCOPED_TRACE(ComboName(c) + (how == 0   ? " stepped"
                                   : how == 1 ? " skipped"
                                              : " skipped, no record"));
      std::mt19937_64 rng(600 + index++);
      State state(c, sizes, Layout::kAligned, 0);
      state.Fill(rng);
      if (HasFatalFailure()) return;
      state.NewGrads(rng, 1.0f);
      const std::vector<uint64_t> records = ParamFingerprints(state);
      State written = state;
      WriteParams(written, rng);
      const precis_step_config_t cfg = Kind(index).cfg;
      const State got = ExpectResyncedStepIsTheCpus(written, records, cfg, skip, how < 2);
      if (HasFailure()) return;
      // Without the flags: the same step leaves a written tensor's master unsynced.
      State blind = written;
      float found = skip ? 1.0f : 0.0f;
      precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
      dev.found_inf = &found;
      precis_step_tensors_t db = blind.Desc();
      ASSERT_EQ(precis_cuda_step(&cfg, &db, &dev, nullptr), PRECIS_OK);
      for (size_t k = 0; k < sizes.size(); ++k) {
        const bool differs = !(blind.ts[k].b[kMaster] == got.ts[k].b[kMaster]);
        EXPECT_EQ(differs, k % 4 != 0 && sizes[k] > 0)
            << "tensor " << k << " (numel " << sizes[k] << ", " << kWriteNames[k % 4] << ")";
      }
    }
  }
}

// More tensors than a launch holds (the second launch's flags and counts start at its
// first tensor), one in three written; the second launch's tensor 7 (135, 196 elements) a
// whole load that leaves element 99 still rounding, the first launch's tensor 7 a
// partial write, so that reading the other's count turns the whole load partial.
TEST(CudaAdamResync, SecondLaunchReadsItsOwnFlags) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 150; ++i) sizes.push_back(1 + (i * 37) % 300);
  ASSERT_EQ(sizes[135], 196);
  for (const Combo& c : {kResynced[0], kResynced[3]}) {
    SCOPED_TRACE(ComboName(c));
    std::mt19937_64 rng(61);
    State state(c, sizes, Layout::kOffset, 0);
    state.Fill(rng);
    state.NewGrads(rng, 1.0f);
    const std::vector<uint64_t> records = ParamFingerprints(state);
    State written = state;
    for (size_t k = 0; k < sizes.size(); k += 3) {
      reinterpret_cast<uint16_t*>(written.ts[k].b[kParam].data())[0] ^= 1;
    }
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (int64_t i = 0; i < sizes[135]; ++i) {
      if (i != 99) Encode(written.ts[135].b[kParam], c.pd, i, u(rng));
    }
    for (int64_t i = 0; i < sizes[7]; i += 8) {
      reinterpret_cast<uint16_t*>(written.ts[7].b[kParam].data())[i] ^= 1;
    }
    ExpectResyncedStepIsTheCpus(written, records, Kind(0).cfg, false);
  }
}

// Bad flags or counts are refused before anything is launched or written, each failure
// naming what was wrong; a device-args struct of the size before the fields is taken
// without them (no resync).
TEST(CudaAdamResync, BadFlagsOrCountsAreRefusedAndNothingIsWritten) {
  const std::vector<int64_t> sizes = {1, 127, 4097};
  std::vector<uint8_t> stale(sizes.size(), 1);
  std::vector<int64_t> kept(sizes.size() + 1, 0);
  std::vector<uint64_t> record(sizes.size(), 0);
  struct Case {
    Combo c;
    const uint8_t* stale;
    const int64_t* kept;
    const uint64_t* record;
    precis_status_t want;
    const char* says;
  };
  const int64_t* misaligned =
      reinterpret_cast<const int64_t*>(reinterpret_cast<const char*>(kept.data()) + 4);
  const Case cases[] = {
      {kResynced[0], stale.data(), nullptr, nullptr, PRECIS_ERR_NULL_POINTER, "dev->kept is NULL"},
      {kResynced[0], nullptr, kept.data(), nullptr, PRECIS_ERR_NULL_POINTER, "dev->stale is NULL"},
      {kResynced[0], stale.data(), misaligned, nullptr, PRECIS_ERR_INVALID_ARGUMENT,
       "8-byte aligned"},
      {kSome[0], stale.data(), kept.data(), nullptr, PRECIS_ERR_INVALID_ARGUMENT,
       "no master or remainders"},
      {kResynced[3], stale.data(), reinterpret_cast<const int64_t*>(record.data()),
       record.data(), PRECIS_ERR_INVALID_ARGUMENT, "share memory"},
      // Muon's momentum: masters of the dtypes, but a rule that writes no param
      {kResynced[0], stale.data(), kept.data(), nullptr, PRECIS_ERR_INVALID_ARGUMENT,
       "its rule writes no param"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(ComboName(k.c)) + ": " + k.says);
    std::mt19937_64 rng(62);
    State gpu(k.c, sizes, Layout::kAligned, 0);
    gpu.Fill(rng);
    gpu.NewGrads(rng, 1.0f);
    const State before = gpu;
    precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
    dev.stale = k.stale;
    dev.kept = k.kept;
    precis_step_tensors_t dg = gpu.Desc();
    dg.param_fingerprints = const_cast<uint64_t*>(k.record);
    const uint64_t launches = cuda_emu::GetStats().launches;
    precis_step_config_t cfg = Kind(0).cfg;
    std::vector<Buf> outs;
    std::vector<void*> out_ptrs;
    if (std::string(k.says) == "its rule writes no param") {
      cfg.rule = PRECIS_RULE_MUON_MOMENTUM;
      for (const Tensor& t : gpu.ts) outs.emplace_back((size_t)t.n * 2, 0);
      for (Buf& o : outs) out_ptrs.push_back(o.data());
      dg.outputs = out_ptrs.data();
      dg.output_dtype = B16;
    }
    EXPECT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), k.want);
    EXPECT_NE(std::string(precis_last_error()).find(k.says), std::string::npos)
        << precis_last_error();
    EXPECT_EQ(cuda_emu::GetStats().launches, launches);
    EXPECT_TRUE(SameBits(before, gpu));
  }
  // Flags in memory the step writes (tensor 2's exp_avgs), which could change under the
  // blocks that branch on them: refused, nothing written.
  {
    std::mt19937_64 rng(64);
    State gpu(kResynced[3], sizes, Layout::kAligned, 0);
    gpu.Fill(rng);
    gpu.NewGrads(rng, 1.0f);
    const State before = gpu;
    precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
    dev.stale = gpu.ts[2].b[kM].data() + 2;
    dev.kept = kept.data();
    precis_step_tensors_t dg = gpu.Desc();
    const precis_step_config_t cfg = Kind(0).cfg;
    EXPECT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("exp_avgs[2], which the step writes"),
              std::string::npos)
        << precis_last_error();
    EXPECT_TRUE(SameBits(before, gpu));
  }
  // The size before stale and kept: they are not read, the step runs without a resync.
  std::mt19937_64 rng(63);
  State state(kResynced[0], sizes, Layout::kAligned, 0);
  state.Fill(rng);
  state.NewGrads(rng, 1.0f);
  State written = state;
  WriteParams(written, rng);
  State old = written;
  precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
  dev.size = offsetof(precis_cuda_step_device_args_t, stale);
  dev.stale = stale.data();
  dev.kept = kept.data();
  const precis_step_config_t cfg = Kind(0).cfg;
  precis_step_tensors_t dg = written.Desc();
  ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK) << precis_last_error();
  precis_step_tensors_t dn = old.Desc();
  ASSERT_EQ(precis_cuda_step(&cfg, &dn, nullptr, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_TRUE(SameBits(written, old));
}

// ---- the emulation itself -------------------------------------------------------------

}  // namespace

// emulator_selftest.cu: launch, return the launch error (0: success).
extern "C" int emu_selftest_shuffles(unsigned* out, unsigned blocks, unsigned threads);
extern "C" int emu_selftest_barriers(int* out, unsigned blocks, unsigned threads, int who);
extern "C" int emu_selftest_divergent_vote(int* out);

namespace {

TEST(CudaEmulator, WarpShufflesAndVotesFollowCuda) {
  const unsigned blocks = 2, threads = 96;
  std::vector<unsigned> out(blocks * threads * 5, 0xDEADu);
  ASSERT_EQ(emu_selftest_shuffles(out.data(), blocks, threads), 0);
  ASSERT_EQ(cuda_emu::TakeErrors(), "");
  for (unsigned t = 0; t < blocks * threads; ++t) {
    const unsigned lane = t % 32, warp0 = t - lane, tid = t % threads;
    auto v = [](unsigned u) { return u * 7u + 1u; };
    unsigned ballot = 0, m = 0;
    for (unsigned l = 0; l < 32; ++l) {
      if (l % 3 == 0 || (tid - lane + l) == 40) ballot |= 1u << l;
      m = std::max(m, ((warp0 + l) * 2654435761u) >> 7);
    }
    SCOPED_TRACE("thread " + std::to_string(t));
    EXPECT_EQ(out[t * 5 + 0], v(warp0 + (lane ^ 5u)));
    EXPECT_EQ(out[t * 5 + 1], v(lane + 3 < 32 ? t + 3 : t));
    EXPECT_EQ(out[t * 5 + 2], v(warp0 + 9));
    EXPECT_EQ(out[t * 5 + 3], ballot);
    EXPECT_EQ(out[t * 5 + 4], m);
  }
}

TEST(CudaEmulator, BlockBarriersReduceOverTheBlock) {
  const unsigned blocks = 3, threads = 256;
  for (int who : {-1, 0, 200}) {
    std::vector<int> out(blocks * threads * 3, -7);
    ASSERT_EQ(emu_selftest_barriers(out.data(), blocks, threads, who), 0);
    ASSERT_EQ(cuda_emu::TakeErrors(), "");
    for (unsigned t = 0; t < blocks * threads; ++t) {
      EXPECT_EQ(out[t * 3 + 0], who >= 0 ? 1 : 0) << t;
      EXPECT_EQ(out[t * 3 + 1], who >= 0 ? 0 : 1) << t;
      EXPECT_EQ(out[t * 3 + 2], who >= 0 ? 1 : 0) << t;
    }
  }
}

TEST(CudaEmulator, ReportsWhatWouldHangOrFailToLaunch) {
  std::vector<int> out(64, 0);
  ASSERT_EQ(emu_selftest_divergent_vote(out.data()), 0);  // launched fine...
  const std::string errors = cuda_emu::TakeErrors();      // ...but would hang
  EXPECT_NE(errors.find("would hang"), std::string::npos) << errors;
  // The emulator goes on after an abandoned block.
  std::vector<unsigned> shfl(32 * 5);
  ASSERT_EQ(emu_selftest_shuffles(shfl.data(), 1, 32), 0);
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  // Launches a GPU rejects: no blocks, too many threads (cudaErrorInvalidConfiguration).
  EXPECT_EQ(emu_selftest_shuffles(shfl.data(), 0, 32), 9);
  EXPECT_EQ(emu_selftest_shuffles(shfl.data(), 1, 2048), 9);
  EXPECT_EQ(emu_selftest_shuffles(shfl.data(), 1, 32), 0) << "the error is cleared once read";
}

TEST(CudaEmulator, DoesNotContractMultiplyAdd) {
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11: unfused gives 0,
  // an FMA 2^-24.
  const float a = 1.0f + std::ldexp(1.0f, -12);
  EXPECT_EQ(cuda_emu::ProbeMulAdd(a, a, -(1.0f + std::ldexp(1.0f, -11))), 0.0f);
}

}  // namespace
