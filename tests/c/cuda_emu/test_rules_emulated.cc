// The one-state rules of cuda/step.cu (precis_rule_t: SGD, Lion, MUON_MOMENTUM), run
// on the CPU by the emulator of cuda_emu.h (see tests/BUILD), against the CPU step:
// from the same state, precis_cuda_step must write exactly the bits
// precis_step writes (cpu_sqrt NULL), and both the bits of the contract written
// out here element by element with rules.h's and stores.h's functions (Reference below), for
// every moment dtype and master layout, on the vector path and the element-wise one,
// with host or device arguments, several tensors per call, per-tensor lr_scales; and must
// refuse bad input as the CPU does, launching nothing.
// "Device pointers" are host pointers here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
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

// ---- what a list holds ----------------------------------------------------------------

// Buffer roles, in precis_step_tensors_t order.
enum Role { kParam, kGrad, kMaster, kM, kMScale, kOut, kRoles };
const char* const kRoleNames[kRoles] = {"params",   "grads",          "masters",
                                        "exp_avgs", "exp_avg_scales", "outputs"};

// One configuration of a rule.
struct Rule {
  std::string name;
  precis_step_config_t cfg;
  bool lr_scales = false;                   // per-tensor lr_scales (SGD, Lion)
  precis_dtype_t out = F32;           // MUON_MOMENTUM's output dtype
  float grad_scale = 1.0f;            // the gradients are generated this much larger
  bool HasM() const { return cfg.rule != PRECIS_RULE_SGD || cfg.momentum != 0.0; }
  bool Muon() const { return cfg.rule == PRECIS_RULE_MUON_MOMENTUM; }
};

// gtest names a failing case by its rule.
void PrintTo(const Rule& r, std::ostream* os) { *os << r.name; }

precis_step_config_t Cfg(int rule) {
  precis_step_config_t c = PRECIS_STEP_CONFIG_INIT;
  c.rule = rule;
  c.seed = 0x5EED + (uint64_t)rule;
  return c;
}

std::vector<Rule> Rules() {
  std::vector<Rule> out;
  Rule r;
  // SGD: plain (no momentum buffer: exp_avgs NULL), L2 decay.
  r = Rule{"sgd_plain_l2", Cfg(PRECIS_RULE_SGD)};
  r.cfg.lr = 0.05, r.cfg.weight_decay = 0.01, r.cfg.decoupled_weight_decay = 0;
  out.push_back(r);
  // Momentum with dampening, L2 decay, maximize, an unscaled gradient.
  r = Rule{"sgd_momentum_dampening_maximize", Cfg(PRECIS_RULE_SGD)};
  r.cfg.lr = 0.02, r.cfg.momentum = 0.9, r.cfg.dampening = 0.1, r.cfg.weight_decay = 1e-3;
  r.cfg.decoupled_weight_decay = 0, r.cfg.maximize = 1, r.cfg.inv_grad_scale = 1.0f / 1024;
  r.grad_scale = 1024.0f;
  out.push_back(r);
  // Nesterov, decoupled decay (SGDW), per-tensor lr_scales.
  r = Rule{"sgd_nesterov_decoupled_lrs", Cfg(PRECIS_RULE_SGD)};
  r.cfg.lr = 0.01, r.cfg.momentum = 0.9, r.cfg.nesterov = 1, r.cfg.weight_decay = 0.1;
  r.cfg.decoupled_weight_decay = 1, r.lr_scales = true;
  out.push_back(r);
  // No momentum, decoupled decay, lr_scales, a float32 lr: Muon's second half.
  r = Rule{"sgd_plain_decoupled_lrs_lr_float32", Cfg(PRECIS_RULE_SGD)};
  r.cfg.lr = 0.02, r.cfg.weight_decay = 0.05, r.cfg.decoupled_weight_decay = 1;
  r.cfg.lr_float32 = 1, r.lr_scales = true;
  out.push_back(r);
  // Lion.
  r = Rule{"lion", Cfg(PRECIS_RULE_LION)};
  r.cfg.lr = 1e-4, r.cfg.beta1 = 0.9, r.cfg.beta2 = 0.99, r.cfg.weight_decay = 0.1;
  out.push_back(r);
  r = Rule{"lion_lrs_maximize_lr_float32", Cfg(PRECIS_RULE_LION)};
  r.cfg.lr = 3e-4, r.cfg.beta1 = 0.95, r.cfg.beta2 = 0.98, r.cfg.weight_decay = 0.01;
  r.cfg.maximize = 1, r.cfg.lr_float32 = 1, r.lr_scales = true;
  out.push_back(r);
  // Muon's momentum: lerp from m (momentum 0.95) or from g (0.3), each output dtype.
  r = Rule{"muon_nesterov_fp32_out", Cfg(PRECIS_RULE_MUON_MOMENTUM)};
  r.cfg.momentum = 0.95, r.cfg.nesterov = 1, r.out = F32;
  out.push_back(r);
  r = Rule{"muon_bf16_out", Cfg(PRECIS_RULE_MUON_MOMENTUM)};
  r.cfg.momentum = 0.95, r.cfg.nesterov = 0, r.out = B16, r.cfg.inv_grad_scale = 0.25f;
  r.grad_scale = 4.0f;
  out.push_back(r);
  r = Rule{"muon_nesterov_bf16_out_momentum_0_3", Cfg(PRECIS_RULE_MUON_MOMENTUM)};
  r.cfg.momentum = 0.3, r.cfg.nesterov = 1, r.out = B16, r.cfg.maximize = 1;
  out.push_back(r);
  r = Rule{"muon_fp16_out", Cfg(PRECIS_RULE_MUON_MOMENTUM)};
  r.cfg.momentum = 0.9, r.out = F16;
  out.push_back(r);
  return out;
}

// Params, grads and where the master lives.
struct Masters {
  const char* name;
  precis_dtype_t pd, gd, md;
};
const Masters kMasters[] = {
    {"fp32", F32, F32, F32},                  // the param is its own master
    {"bf16_master_fp32", B16, B16, F32},      // a separate master
    {"bf16_remainders", B16, B16, I16},       // int16 remainders
    {"bf16_remainders8", B16, F32, F8},       // 8-bit remainders
    {"bf16_no_master", B16, F16, B16},        // stochastic rounding
};
const precis_dtype_t kMoments[] = {F32, F16, B16, F8};

Mode ModeOfMasters(const Masters& ms) { return ModeOf(Combo{ms.pd, ms.gd, ms.md, F32, F32}); }

// Which buffers start one element past a 64-byte boundary.
enum class Layout {
  kAligned,  // none: the vector path for every whole 256-element group
  kOffset,   // all: the element-wise path everywhere
  kOneOff,   // one role of the tensors of 256+ elements: element-wise there only
};

const char* LayoutName(Layout l) {
  return l == Layout::kAligned ? "aligned" : l == Layout::kOffset ? "offset" : "one_offset";
}

struct Tensor {
  int64_t n = 0;
  int64_t done = 0;  // steps done
  Buf b[kRoles];
};

struct State {
  Rule rule;
  Masters ms;
  precis_dtype_t ed;
  std::vector<Tensor> ts;
  std::vector<double> lr_scales;  // per tensor, when rule.lr_scales
  std::vector<uint64_t> streams;
  std::vector<int64_t> offsets;
  // The tables of the last Desc().
  std::vector<void*> params, masters, ms_, outs;
  std::vector<const void*> grads;
  std::vector<float*> mscales;
  std::vector<int64_t> numels, steps;

  State(const Rule& r, const Masters& m, precis_dtype_t moment, const std::vector<int64_t>& sizes,
        Layout layout, int off_role)
      : rule(r), ms(m), ed(moment) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      Tensor t;
      t.n = sizes[k];
      for (int role = 0; role < kRoles; ++role) {
        if (!Present(role)) continue;
        const size_t es = DSize(Dtype(role));
        const bool off = layout == Layout::kOffset ||
                         (layout == Layout::kOneOff && t.n >= 256 && role == off_role);
        const size_t count = role == kMScale ? (size_t)Blocks(t.n) : (size_t)t.n;
        t.b[role] = Buf(count * es, off ? es : 0);
      }
      ts.push_back(std::move(t));
      lr_scales.push_back(0.2 * std::sqrt(3.0 + (double)k));  // a different lr per tensor
    }
  }

  bool Present(int role) const {
    switch (role) {
      case kMaster: return ModeOfMasters(ms) != kNone;
      case kM: return rule.HasM();
      case kMScale: return rule.HasM() && Scaled(ed);
      case kOut: return rule.Muon();
      default: return true;
    }
  }
  precis_dtype_t Dtype(int role) const {
    const precis_dtype_t d[kRoles] = {ms.pd, ms.gd, ms.md, ed, F32, rule.out};
    return d[role];
  }

  precis_step_tensors_t Desc() {
    params.clear(), masters.clear(), ms_.clear(), outs.clear(), grads.clear();
    mscales.clear(), numels.clear(), steps.clear();
    for (Tensor& t : ts) {
      params.push_back(t.b[kParam].data());
      grads.push_back(t.b[kGrad].data());
      masters.push_back(t.b[kMaster].data());
      ms_.push_back(t.b[kM].data());
      mscales.push_back(reinterpret_cast<float*>(t.b[kMScale].data()));
      outs.push_back(t.b[kOut].data());
      numels.push_back(t.n);
      steps.push_back(t.done + 1);
    }
    precis_step_tensors_t d = PRECIS_STEP_TENSORS_INIT;
    d.count = ts.size();
    d.param_dtype = ms.pd;
    d.grad_dtype = ms.gd;
    d.master_dtype = ms.md;
    d.exp_avg_dtype = ed;
    d.exp_avg_sq_dtype = F32;  // not read; exp_avg_sqs stay NULL
    d.params = params.data();
    d.grads = grads.data();
    d.masters = Present(kMaster) ? masters.data() : nullptr;
    d.exp_avgs = rule.HasM() ? ms_.data() : nullptr;
    d.exp_avg_scales = Present(kMScale) ? mscales.data() : nullptr;
    d.numels = numels.data();
    d.steps = steps.data();
    if (!streams.empty()) d.streams = streams.data();
    if (!offsets.empty()) d.element_offsets = offsets.data();
    if (rule.Muon()) d.outputs = outs.data(), d.output_dtype = rule.out;
    if (rule.lr_scales) d.lr_scales = lr_scales.data();
    return d;
  }

  void Advance() {
    for (Tensor& t : ts) ++t.done;
  }

  // Masters in [-1, 1], m of a few steps with one all-zero scale block (elements
  // 256..383) where there is room; outputs hold a pattern (every bit written?).
  void Fill(std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t k = 0; k < ts.size(); ++k) {
      Tensor& t = ts[k];
      t.done = 2 * (int64_t)k;  // tensor 0 takes step 1 (SGD: m = g), the others later ones
      std::vector<float> x(t.n), m(t.n);
      for (int64_t i = 0; i < t.n; ++i) {
        x[i] = u(rng);
        m[i] = i >= 256 && i < 384 && t.n > 512 ? 0.0f : 0.01f * nd(rng);
      }
      SetMasters(t, x);
      if (rule.HasM()) {
        ASSERT_EQ(precis_moment_encode(m.data(), t.n, 0, t.b[kM].data(), ed,
                                       reinterpret_cast<float*>(t.b[kMScale].data())),
                  PRECIS_OK);
      }
      if (rule.Muon() && t.n > 0) std::memset(t.b[kOut].data(), 0x5A, t.b[kOut].bytes());
    }
  }

  void SetMasters(Tensor& t, const std::vector<float>& x) {
    switch (ModeOfMasters(ms)) {
      case kNone:
        for (int64_t i = 0; i < t.n; ++i) Encode(t.b[kParam], ms.pd, i, x[i]);
        break;
      case kSeparate:
        for (int64_t i = 0; i < t.n; ++i) {
          Encode(t.b[kMaster], ms.md, i, x[i]);
          Encode(t.b[kParam], ms.pd, i, Decode(t.b[kMaster], ms.md, i));
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

  // Gradients ~ N(0, 0.1) * scale with outliers (x30) and exact zeros, zero in the
  // zero block.
  void NewGrads(std::mt19937_64& rng) {
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (Tensor& t : ts) {
      for (int64_t i = 0; i < t.n; ++i) {
        float g = nd(rng) * rule.grad_scale;
        if (i % 37 == 5) g *= 30.0f;
        if (i % 53 == 7 || (i >= 256 && i < 384 && t.n > 512)) g = 0.0f;
        Encode(t.b[kGrad], ms.gd, i, g);
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

std::string Name(const State& s) {
  return s.rule.name + " " + s.ms.name + " m_" + DName(s.ed);
}

// Every buffer of a and b holds the same bytes (and no write strayed outside).
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

// ---- the contract, element by element -------------------------------------------------

uint32_t Bits(const Buf& b, precis_dtype_t d, int64_t i) {
  uint32_t u = 0;
  std::memcpy(&u, b.data() + i * DSize(d), DSize(d));
  return u;
}

void SetBits(Buf& b, precis_dtype_t d, int64_t i, uint32_t u) {
  std::memcpy(b.data() + i * DSize(d), &u, DSize(d));
}

uint32_t RoundNearest(precis_dtype_t d, float x) {
  if (d == F32) return precis_f32_bits(x);
  return d == F16 ? precis_f32_to_f16_rn(x) : precis_f32_to_bf16_rn(x);
}

// One step of state s as precis.h's precis_rule_t describes it, with rules.h's
// functions, one element at a time: decode, the rule's function, and the stores
// (the momentum stochastically in every dtype but fp32, from m's half of the moment
// hash, with block scales per 128 elements for fp16 and fp8; the bf16 param without
// a master stochastically; a separate master and the param its rounding; remainders).
void Reference(State& s) {
  const precis_step_hyper_t h = precis_step_hyper_from_config(&s.rule.cfg);
  const Mode mode = ModeOfMasters(s.ms);
  for (size_t i = 0; i < s.ts.size(); ++i) {
    Tensor& t = s.ts[i];
    const int64_t step = t.done + 1;
    precis_step_consts_t c = precis_step_consts_make(&h, step);
    if (s.rule.lr_scales) precis_rule_consts_lr(&c, h.lr, s.lr_scales[i], h.lr_float32);
    const uint64_t stream = s.streams.empty() ? (uint64_t)i : s.streams[i];
    const uint32_t index0 = s.offsets.empty() ? 0u : (uint32_t)(uint64_t)s.offsets[i];
    const precis_sr_key_t p_key = precis_sr_key(s.rule.cfg.seed, stream, step);
    const precis_sr_key_t m_key = precis_moment_key(s.rule.cfg.seed, stream);
    std::vector<float> m(t.n);
    for (int64_t e = 0; e < t.n; ++e) {
      const float g = Decode(t.b[kGrad], s.ms.gd, e);
      float p = 0.0f, mf = 0.0f;
      if (!s.rule.Muon()) {
        switch (mode) {
          case kNone: p = Decode(t.b[kParam], s.ms.pd, e); break;
          case kSeparate: p = Decode(t.b[kMaster], s.ms.md, e); break;
          case kRemainder:
            p = precis_remainder_master((uint16_t)Bits(t.b[kParam], B16, e),
                                        (int16_t)(uint16_t)Bits(t.b[kMaster], I16, e));
            break;
          case kRemainder8:
            p = precis_remainder8_master((uint16_t)Bits(t.b[kParam], B16, e),
                                         (int8_t)(uint8_t)Bits(t.b[kMaster], F8, e));
            break;
        }
      }
      if (s.rule.HasM()) {
        mf = precis_moment_code_f32(s.ed, 0, Bits(t.b[kM], s.ed, e));
        if (Scaled(s.ed)) {
          mf = precis_moment_dq(mf, reinterpret_cast<const float*>(t.b[kMScale].data())[e / 128],
                                0);
        }
      }
      switch (s.rule.cfg.rule) {
        case PRECIS_RULE_SGD: precis_sgd_update(&c, s.rule.HasM(), g, &p, &mf); break;
        case PRECIS_RULE_LION: precis_lion_update(&c, g, &p, &mf); break;
        default: {
          const float o = precis_muon_momentum(&c, g, &mf);
          SetBits(t.b[kOut], s.rule.out, e, RoundNearest(s.rule.out, o));
        }
      }
      m[e] = mf;
      if (s.rule.Muon()) continue;
      const uint32_t idx = index0 + (uint32_t)e;
      switch (mode) {
        case kNone:
          SetBits(t.b[kParam], s.ms.pd, e,
                  s.ms.pd == B16 ? precis_f32_to_bf16_sr(p, precis_sr_rand16(p_key, idx))
                                 : RoundNearest(s.ms.pd, p));
          break;
        case kSeparate: {
          const float x = s.ms.md == F16 ? precis_f16_to_f32(precis_f32_to_f16_rn(p)) : p;
          SetBits(t.b[kMaster], s.ms.md, e, RoundNearest(s.ms.md, x));
          SetBits(t.b[kParam], s.ms.pd, e, RoundNearest(s.ms.pd, x));
          break;
        }
        case kRemainder:
          SetBits(t.b[kParam], B16, e, precis_remainder_param(p));
          SetBits(t.b[kMaster], I16, e, (uint16_t)precis_remainder_low(p));
          break;
        case kRemainder8:
          SetBits(t.b[kParam], B16, e, precis_remainder8_param(p));
          SetBits(t.b[kMaster], F8, e, (uint8_t)precis_remainder8_low(p));
          break;
      }
    }
    if (!s.rule.HasM()) continue;
    auto rand = [&](int64_t e) {
      return precis_moment_rand(precis_moment_hash(m_key, index0 + (uint32_t)e), 0, step);
    };
    if (!Scaled(s.ed)) {
      for (int64_t e = 0; e < t.n; ++e) {
        SetBits(t.b[kM], s.ed, e,
                s.ed == B16 ? precis_f32_to_bf16_sr(m[e], rand(e) >> 16)
                            : RoundNearest(s.ed, m[e]));  // fp32
      }
      continue;
    }
    const int fp8 = s.ed == F8;
    float* scales = reinterpret_cast<float*>(t.b[kMScale].data());
    for (int64_t b0 = 0; b0 < t.n; b0 += 128) {
      const int64_t b1 = std::min<int64_t>(b0 + 128, t.n);
      uint32_t amax_bits = 0;  // the float order of |m|: a NaN wins
      for (int64_t e = b0; e < b1; ++e)
        amax_bits = std::max(amax_bits, precis_f32_bits(m[e]) & 0x7FFFFFFFu);
      const float amax = precis_bits_f32(amax_bits);
      const float mul = precis_block_multiplier(amax, fp8, 0);
      scales[b0 / 128] = precis_block_scale(amax, fp8, 0);
      for (int64_t e = b0; e < b1; ++e) {
        SetBits(t.b[kM], s.ed, e,
                fp8 ? precis_moment_sr_fp8(m[e], mul, 0, rand(e))
                    : precis_moment_sr_f16(m[e], mul, 0, rand(e)));
      }
    }
  }
  s.Advance();
}

// ---- steps ----------------------------------------------------------------------------

// One step of the CPU, the emulated GPU and the reference, each on its own copy of
// the state; the GPU gets dev (NULL: host values) and its own cfg; all three must
// then hold the same bits.
::testing::AssertionResult StepAll(State& cpu, State& gpu, State& ref,
                                   const precis_step_config_t& gpu_cfg,
                                   const precis_cuda_step_device_args_t* dev,
                                   bool gpu_host_steps = true) {
  precis_step_tensors_t dc = cpu.Desc();
  int32_t found = 0;
  precis_status_t st = precis_step(&cpu.rule.cfg, &dc, &found);
  if (st != PRECIS_OK) return ::testing::AssertionFailure() << "CPU: " << precis_last_error();
  precis_step_tensors_t dg = gpu.Desc();
  if (!gpu_host_steps) dg.steps = nullptr;
  st = precis_cuda_step(&gpu_cfg, &dg, dev, nullptr);
  if (st != PRECIS_OK) return ::testing::AssertionFailure() << "CUDA: " << precis_last_error();
  const std::string errors = cuda_emu::TakeErrors();
  if (!errors.empty()) return ::testing::AssertionFailure() << "CUDA execution: " << errors;
  cpu.Advance();
  gpu.Advance();
  Reference(ref);
  ::testing::AssertionResult r = SameBits(ref, gpu);
  if (!r) return r << " (reference vs CUDA)";
  r = SameBits(cpu, gpu);
  if (!r) return r << " (CPU vs CUDA)";
  return r;
}

// Moved, and not because nothing ran: the state a rule writes differs from before.
void ExpectMoved(const State& before, const State& after, size_t k) {
  if (after.rule.Muon()) {
    EXPECT_FALSE(before.ts[k].b[kOut] == after.ts[k].b[kOut]);
    // Muon's momentum neither reads nor writes params and masters.
    EXPECT_TRUE(before.ts[k].b[kParam] == after.ts[k].b[kParam]);
    if (after.Present(kMaster)) {
      EXPECT_TRUE(before.ts[k].b[kMaster] == after.ts[k].b[kMaster]);
    }
  } else {
    EXPECT_FALSE(before.ts[k].b[kParam] == after.ts[k].b[kParam]);
  }
  if (after.rule.HasM()) {
    EXPECT_FALSE(before.ts[k].b[kM] == after.ts[k].b[kM]);
  }
}

// One element, a partial group, an empty tensor, 16 whole groups plus a one-element
// tail.
const std::vector<int64_t> kSizes = {1, 127, 0, 4097};

// ---- every rule x master layout x moment dtype x layout -------------------------------

class CudaRules : public ::testing::TestWithParam<Rule> {};

TEST_P(CudaRules, MatchesCpuBitForBit) {
  const Rule rule = GetParam();
  int index = 0;
  for (const Masters& ms : kMasters) {
    for (precis_dtype_t ed : kMoments) {
      ++index;
      std::vector<int> vector_roles;
      {
        State probe(rule, ms, ed, {}, Layout::kAligned, 0);
        for (int r : {kParam, kGrad, kMaster, kM, kOut})
          if (probe.Present(r)) vector_roles.push_back(r);
      }
      const int off_role = vector_roles[index % vector_roles.size()];
      for (Layout layout : {Layout::kAligned, Layout::kOffset, Layout::kOneOff}) {
        std::mt19937_64 rng(7000 + index * 3 + (int)layout);
        State cpu(rule, ms, ed, kSizes, layout, off_role);
        cpu.Fill(rng);
        if (HasFatalFailure()) return;
        State gpu = cpu, ref = cpu;
        const State initial = cpu;
        std::string where = Name(cpu) + " " + LayoutName(layout);
        if (layout == Layout::kOneOff) where += std::string(" ") + kRoleNames[off_role];
        for (int s = 0; s < 3; ++s) {
          cpu.NewGrads(rng);
          gpu.CopyGradsFrom(cpu);
          ref.CopyGradsFrom(cpu);
          ASSERT_TRUE(StepAll(cpu, gpu, ref, rule.cfg, nullptr)) << where << ", step " << s + 1;
        }
        SCOPED_TRACE(where);
        ExpectMoved(initial, gpu, 3);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllRules, CudaRules, ::testing::ValuesIn(Rules()),
                         [](const ::testing::TestParamInfo<Rule>& info) {
                           return info.param.name;
                         });

// The record (param_fingerprints) of one_state_kernel: every rule that writes params
// (SGD, Lion), every master layout and moment dtype, the vector path and the element-wise
// one, sizes 1, 127, 4097 and one of three CUDA blocks beside an empty tensor, in one
// launch: equal to precis_fingerprint of the params after the step, and to the CPU's.
TEST(CudaRulesRecord, EqualsTheFingerprintOfTheParamsAfterTheStep) {
  const std::vector<int64_t> sizes = {1, 127, 0, 4097, 2 * 16384 + 1001};
  int index = 0;
  for (const Rule& rule : Rules()) {
    if (rule.Muon()) continue;  // writes no params: refused with a record (step_args.h)
    for (const Masters& ms : kMasters) {
      for (precis_dtype_t ed : kMoments) {
        const Layout layout = ++index % 2 ? Layout::kAligned : Layout::kOffset;
        SCOPED_TRACE(rule.name + " " + ms.name + " m_" + DName(ed) + " " + LayoutName(layout));
        std::mt19937_64 rng(300 + index);
        State cpu(rule, ms, ed, sizes, layout, 0);
        cpu.Fill(rng);
        if (HasFatalFailure()) return;
        State gpu = cpu;
        cpu.NewGrads(rng);
        gpu.CopyGradsFrom(cpu);
        std::vector<uint64_t> cpu_fp(sizes.size(), 0xBADu), gpu_fp(sizes.size(), 0xBADu);
        precis_step_tensors_t dc = cpu.Desc();
        dc.param_fingerprints = cpu_fp.data();
        ASSERT_EQ(precis_step(&rule.cfg, &dc, nullptr), PRECIS_OK) << precis_last_error();
        precis_step_tensors_t dg = gpu.Desc();
        dg.param_fingerprints = gpu_fp.data();
        ASSERT_EQ(precis_cuda_step(&rule.cfg, &dg, nullptr, nullptr), PRECIS_OK)
            << precis_last_error();
        ASSERT_EQ(cuda_emu::TakeErrors(), "");
        ASSERT_TRUE(SameBits(cpu, gpu));
        std::vector<const void*> bufs;
        std::vector<int64_t> nbytes;
        for (const Tensor& t : gpu.ts) {
          bufs.push_back(t.b[kParam].data());
          nbytes.push_back(t.n * (int64_t)DSize(ms.pd));
        }
        std::vector<uint64_t> now(sizes.size(), 0);
        ASSERT_EQ(precis_fingerprint(bufs.data(), nbytes.data(), (int64_t)bufs.size(), now.data()),
                  PRECIS_OK);
        EXPECT_EQ(gpu_fp, now);
        EXPECT_EQ(cpu_fp, now);
      }
    }
  }
}

// A larger tensor (several chunks, a partial last group) beside small ones, streams
// and element offsets of the stochastic-rounding keys, each rule once.
TEST(CudaRulesLarge, SeveralChunksStreamsAndOffsets) {
  const std::vector<int64_t> sizes = {100003, 3, 4097};
  const std::vector<Rule> rules = Rules();
  const struct {
    size_t rule;
    Masters ms;
    precis_dtype_t ed;
  } cases[] = {
      {1, kMasters[3], F8},   // SGD momentum, 8-bit remainders, fp8 m
      {2, kMasters[4], F16},  // SGD Nesterov, lr_scales, stochastic rounding, fp16 m
      {5, kMasters[2], F8},   // Lion, lr_scales, int16 remainders, fp8 m
      {4, kMasters[0], B16},  // Lion, fp32
      {6, kMasters[1], F8},   // Muon, fp32 output, fp8 m
      {7, kMasters[1], F16},  // Muon, bf16 output, fp16 m
  };
  for (const auto& cs : cases) {
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      const Rule& rule = rules[cs.rule];
      std::mt19937_64 rng(99 + cs.rule);
      State cpu(rule, cs.ms, cs.ed, sizes, layout, 0);
      cpu.streams = {7, 0xFFFFFFFF00000003ull, 1ull << 40};
      cpu.offsets = {(int64_t{1} << 32) - 50000, 12345, 3 * (int64_t{1} << 32) + 1};
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu, ref = cpu;
      const State initial = cpu;
      SCOPED_TRACE(Name(cpu) + " " + LayoutName(layout));
      for (int s = 0; s < 2; ++s) {
        cpu.NewGrads(rng);
        gpu.CopyGradsFrom(cpu);
        ref.CopyGradsFrom(cpu);
        ASSERT_TRUE(StepAll(cpu, gpu, ref, rule.cfg, nullptr)) << "step " << s + 1;
      }
      ExpectMoved(initial, gpu, 0);
    }
  }
}

// More tensors than one launch holds (128), empty ones in between, each with its own
// lr (SGD, Lion) or output (Muon): lr_scales[i] and outputs[i] must reach tensor i in
// whichever launch it lands.
TEST(CudaRulesMany, TensorsAcrossLaunchesWithTheirOwnLrs) {
  std::mt19937_64 size_rng(5);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 160; ++i) sizes.push_back(i % 7 == 3 ? 0 : (int64_t)(size_rng() % 600));
  sizes.insert(sizes.begin() + 20, 16384);
  sizes.push_back(2 * 16384 + 1000);
  const uint64_t launches = cuda_emu::GetStats().launches;
  int calls = 0;
  for (const Rule& rule : Rules()) {
    if (!rule.lr_scales && !rule.Muon()) continue;
    for (Layout layout : {Layout::kAligned, Layout::kOffset}) {
      std::mt19937_64 rng(77);
      State cpu(rule, kMasters[1], F8, sizes, layout, 0);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      State gpu = cpu, ref = cpu;
      SCOPED_TRACE(Name(cpu) + " " + LayoutName(layout));
      for (int s = 0; s < 2; ++s) {
        cpu.NewGrads(rng);
        gpu.CopyGradsFrom(cpu);
        ref.CopyGradsFrom(cpu);
        ASSERT_TRUE(StepAll(cpu, gpu, ref, rule.cfg, nullptr)) << "step " << s + 1;
        ++calls;
      }
    }
  }
  EXPECT_EQ(cuda_emu::GetStats().launches - launches, 2u * calls) << "two launches a call";
}

// ---- device arguments -----------------------------------------------------------------

// lr, inv_grad_scale and the steps from device memory (the host values then wrong on
// purpose): the host values' bits, for each rule; per-tensor lr_scales still apply (from the
// host), the decoupled decay from the device lr.
TEST(CudaRulesDevice, DeviceArgumentsGiveTheHostValuesBits) {
  const std::vector<int64_t> sizes = {1, 127, 0, 4097, 300};
  int index = 0;
  for (const Rule& rule : Rules()) {
    ++index;
    const Masters& ms = kMasters[index % 5];
    const precis_dtype_t ed = kMoments[index % 4];
    for (int which = 1; which < 8; ++which) {
      const bool dev_lr = which & 1, dev_igs = which & 2, dev_steps = which & 4;
      std::mt19937_64 rng(which + 10 * index);
      State cpu(rule, ms, ed, sizes, Layout::kAligned, 0);
      cpu.Fill(rng);
      if (HasFatalFailure()) return;
      // Tensors k share the step pointer k % 2; tensor 0's first step is 1 (SGD: m = g).
      for (size_t k = 0; k < cpu.ts.size(); ++k) cpu.ts[k].done = k % 2 ? 6 : 0;
      State gpu = cpu, ref = cpu;
      SCOPED_TRACE(Name(cpu) + (dev_lr ? " lr" : "") + (dev_igs ? " inv_grad_scale" : "") +
                   (dev_steps ? " steps" : ""));
      for (int s = 0; s < 3; ++s) {
        cpu.NewGrads(rng);
        gpu.CopyGradsFrom(cpu);
        ref.CopyGradsFrom(cpu);
        precis_step_config_t gcfg = rule.cfg;
        const double lr = rule.cfg.lr;
        const float lr32 = static_cast<float>(rule.cfg.lr);  // read when cfg.lr_float32
        const float igs = rule.cfg.inv_grad_scale;
        int64_t steps[2] = {cpu.ts[0].done + 1, cpu.ts[1].done + 1};
        std::vector<const int64_t*> step_ptrs;
        for (size_t t = 0; t < gpu.ts.size(); ++t) step_ptrs.push_back(&steps[t % 2]);
        precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
        if (dev_lr) dev.lr = rule.cfg.lr_float32 ? static_cast<const void*>(&lr32) : &lr;
        if (dev_lr) gcfg.lr = 0.5;
        if (dev_igs) dev.inv_grad_scale = &igs, gcfg.inv_grad_scale = 3.0f;
        if (dev_steps) dev.steps = step_ptrs.data();
        ASSERT_TRUE(StepAll(cpu, gpu, ref, gcfg, &dev, !dev_steps)) << "step " << s + 1;
      }
    }
  }
}

// ---- check_finite and found_inf -------------------------------------------------------

TEST(CudaRulesFinite, ANonFiniteGradientOrARaisedFlagWritesNothing) {
  for (const Rule& rule : Rules()) {
    for (int check : {1, 0}) {
      SCOPED_TRACE(rule.name + (check ? " check_finite" : " found_inf already set"));
      std::mt19937_64 rng(13);
      State gpu(rule, kMasters[2], F8, kSizes, Layout::kAligned, 0);
      gpu.Fill(rng);
      if (HasFatalFailure()) return;
      gpu.NewGrads(rng);
      if (check) Encode(gpu.ts[3].b[kGrad], gpu.ms.gd, 1000, NAN);
      const State before = gpu;
      precis_step_config_t cfg = rule.cfg;
      cfg.check_finite = check;
      float found = check ? 0.0f : 1.0f;
      precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
      dev.found_inf = &found;
      precis_step_tensors_t dg = gpu.Desc();
      ASSERT_EQ(precis_cuda_step(&cfg, &dg, &dev, nullptr), PRECIS_OK)
          << precis_last_error();
      EXPECT_EQ(cuda_emu::TakeErrors(), "");
      EXPECT_EQ(found, 1.0f);
      EXPECT_TRUE(SameBits(before, gpu));
    }
  }
}

// ---- bad input ------------------------------------------------------------------------

// The CPU's status and message (its function name replaced), nothing launched,
// nothing written.
void ExpectRefusedAsTheCpu(State& s, const precis_step_config_t& cfg,
                           precis_step_tensors_t cpu_desc, precis_step_tensors_t gpu_desc,
                           precis_status_t want) {
  const State before = s;
  const precis_status_t cpu_st = precis_step(&cfg, &cpu_desc, nullptr);
  std::string cpu_msg = precis_last_error();
  const uint64_t launches = cuda_emu::GetStats().launches;
  const precis_status_t gpu_st = precis_cuda_step(&cfg, &gpu_desc, nullptr, nullptr);
  const std::string gpu_msg = precis_last_error();
  EXPECT_EQ(cuda_emu::GetStats().launches, launches) << "nothing launched";
  EXPECT_EQ(cuda_emu::TakeErrors(), "");
  EXPECT_EQ(gpu_st, want) << gpu_msg;
  EXPECT_EQ(cpu_st, gpu_st) << cpu_msg;
  const std::string cpu_fn = "precis_step", gpu_fn = "precis_cuda_step";
  ASSERT_EQ(cpu_msg.compare(0, cpu_fn.size(), cpu_fn), 0) << cpu_msg;
  cpu_msg.replace(0, cpu_fn.size(), gpu_fn);
  EXPECT_EQ(cpu_msg, gpu_msg);
  EXPECT_TRUE(SameBits(before, s));
}

TEST(CudaRulesBadInput, RefusedAsTheCpuWithNothingLaunched) {
  const std::vector<Rule> rules = Rules();
  std::mt19937_64 rng(3);
  {
    SCOPED_TRACE("muon_momentum without outputs");
    State s(rules[6], kMasters[1], F16, kSizes, Layout::kAligned, 0);
    s.Fill(rng);
    s.NewGrads(rng);
    precis_step_tensors_t d = s.Desc();
    d.outputs = nullptr;
    ExpectRefusedAsTheCpu(s, s.rule.cfg, d, d, PRECIS_ERR_NULL_POINTER);
    EXPECT_NE(std::string(precis_last_error()).find("outputs"), std::string::npos)
        << precis_last_error();
  }
  {
    SCOPED_TRACE("muon_momentum, one output NULL");
    State s(rules[7], kMasters[0], B16, kSizes, Layout::kAligned, 0);
    s.Fill(rng);
    precis_step_tensors_t d = s.Desc();
    s.outs[3] = nullptr;
    ExpectRefusedAsTheCpu(s, s.rule.cfg, d, d, PRECIS_ERR_NULL_POINTER);
  }
  {
    SCOPED_TRACE("sgd with amsgrad");
    State s(rules[1], kMasters[1], F32, kSizes, Layout::kAligned, 0);
    s.Fill(rng);
    precis_step_tensors_t d = s.Desc();
    precis_step_config_t cfg = s.rule.cfg;
    cfg.amsgrad = 1;
    ExpectRefusedAsTheCpu(s, cfg, d, d, PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("amsgrad"), std::string::npos)
        << precis_last_error();
  }
  {
    SCOPED_TRACE("lr_scales with lion's rule but a negative entry");
    State s(rules[5], kMasters[0], F32, kSizes, Layout::kAligned, 0);
    s.Fill(rng);
    s.lr_scales[2] = -1.0;
    precis_step_tensors_t d = s.Desc();
    ExpectRefusedAsTheCpu(s, s.rule.cfg, d, d, PRECIS_ERR_INVALID_ARGUMENT);
  }
  {
    SCOPED_TRACE("muon output misaligned");
    State s(rules[6], kMasters[0], F32, kSizes, Layout::kAligned, 0);
    s.Fill(rng);
    precis_step_tensors_t d = s.Desc();
    s.outs[3] = static_cast<uint8_t*>(s.outs[3]) + 1;
    ExpectRefusedAsTheCpu(s, s.rule.cfg, d, d, PRECIS_ERR_INVALID_ARGUMENT);
  }
  {
    SCOPED_TRACE("nesterov with dampening");
    State s(rules[2], kMasters[0], F32, kSizes, Layout::kAligned, 0);
    s.Fill(rng);
    precis_step_tensors_t d = s.Desc();
    precis_step_config_t cfg = s.rule.cfg;
    cfg.dampening = 0.5;
    ExpectRefusedAsTheCpu(s, cfg, d, d, PRECIS_ERR_INVALID_ARGUMENT);
  }
}

}  // namespace
