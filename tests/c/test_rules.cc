// Tests of the update engine's one-state rules on the CPU (precis_step with
// cfg->rule SGD, LION or MUON_MOMENTUM; precis.h, precis_rule_t): a double-precision
// reference written here (not through rules.h), every SIMD path against the
// scalar one for every moment dtype and master layout, pieces, per-tensor lr_scales,
// check_finite, and bad input refused before anything is written. Adam's own tests
// are test_adam.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "step_cpu.h"
#include "rules.h"
#include "precis/precis.h"
#include "precis_convert.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

constexpr int kAdam = PRECIS_RULE_ADAM;
constexpr int kSgd = PRECIS_RULE_SGD;
constexpr int kLion = PRECIS_RULE_LION;
constexpr int kMuon = PRECIS_RULE_MUON_MOMENTUM;

// ---- a rule and its hyperparameters -------------------------------------------------

struct Rule {
  std::string name;
  int rule;
  double lr, beta1, beta2, wd, momentum, dampening;
  bool nesterov, decoupled, maximize;
  double inv_grad_scale;

  precis_step_config_t Config() const {
    precis_step_config_t c = PRECIS_STEP_CONFIG_INIT;
    c.rule = rule;
    c.lr = lr;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.weight_decay = wd;
    c.momentum = momentum;
    c.dampening = dampening;
    c.nesterov = nesterov;
    c.decoupled_weight_decay = decoupled;
    c.maximize = maximize;
    c.inv_grad_scale = static_cast<float>(inv_grad_scale);
    c.seed = 1234;
    return c;
  }
  // What the rule reads beyond grads (precis.h): m, and whether it writes params.
  bool HasM() const { return rule != kSgd || momentum != 0.0; }
  bool WritesParams() const { return rule != kMuon; }
};

Rule Sgd(const std::string& name, double lr, double momentum, double dampening, bool nesterov,
         double wd, bool decoupled, bool maximize, double inv_grad_scale = 1.0) {
  return {name, kSgd, lr, 0.9, 0.999, wd, momentum, dampening, nesterov, decoupled, maximize,
          inv_grad_scale};
}
Rule Lion(const std::string& name, double lr, double beta1, double beta2, double wd,
          bool maximize, double inv_grad_scale = 1.0) {
  return {name, kLion, lr, beta1, beta2, wd, 0.0, 0.0, false, true, maximize, inv_grad_scale};
}
Rule Muon(const std::string& name, double momentum, bool nesterov, bool maximize,
          double inv_grad_scale = 1.0) {
  return {name, kMuon, 0.02, 0.9, 0.999, 0.0, momentum, 0.0, nesterov, true, maximize,
          inv_grad_scale};
}

// SGD: momentum 0 and 0.9, dampening 0 and 0.3, Nesterov, weight decay as L2 and
// decoupled, maximize, gradient unscaling.
const Rule kSgdRules[] = {
    Sgd("sgd", 1e-2, 0.0, 0.0, false, 0.0, false, false),
    Sgd("sgd_l2_dampening_unused", 1e-2, 0.0, 0.3, false, 0.01, false, false),
    Sgd("sgd_decoupled_maximize", 1e-2, 0.0, 0.0, false, 0.1, true, true),
    Sgd("momentum_l2", 1e-2, 0.9, 0.0, false, 0.01, false, false),
    Sgd("momentum_dampening_decoupled_maximize", 5e-3, 0.9, 0.3, false, 0.1, true, true),
    Sgd("momentum_dampening_unscale", 1e-2, 0.9, 0.3, false, 0.0, false, false, 1.0 / 1024),
    Sgd("nesterov_l2_unscale", 1e-2, 0.9, 0.0, true, 0.01, false, false, 1.0 / 1024),
    Sgd("nesterov_decoupled_maximize", 1e-2, 0.9, 0.0, true, 0.1, true, true),
};
// Lion: weight decay (always decoupled), maximize, unscaling.
const Rule kLionRules[] = {
    Lion("lion", 1e-3, 0.9, 0.99, 0.1, false),
    Lion("lion_maximize_unscale", 3e-4, 0.95, 0.98, 0.0, true, 1.0 / 1024),
};
// Muon's momentum: Nesterov on and off; momentum 0.95 (both lerps from their start)
// and 0.3 (both from their end point).
const Rule kMuonRules[] = {
    Muon("muon", 0.95, false, false),
    Muon("muon_nesterov", 0.95, true, false),
    Muon("muon_low_momentum_nesterov_maximize", 0.3, true, true),
    Muon("muon_low_momentum_unscale", 0.3, false, false, 1.0 / 1024),
};

std::vector<Rule> AllRules() {
  std::vector<Rule> out(std::begin(kSgdRules), std::end(kSgdRules));
  out.insert(out.end(), std::begin(kLionRules), std::end(kLionRules));
  out.insert(out.end(), std::begin(kMuonRules), std::end(kMuonRules));
  return out;
}

// ---- a list of tensors and their state ---------------------------------------------

// The dtypes of a list: params, grads, master (== pd: none), m (exp_avg), and Muon's
// output.
struct Layout {
  precis_dtype_t pd, gd, md, ed, od;
};

Mode ModeOfLayout(const Layout& L) { return ModeOf(Combo{L.pd, L.gd, L.md, L.ed, F32}); }

std::string LayoutName(const Layout& L) {
  const std::string master = L.md == L.pd ? "none" : DName(L.md);
  return "p_" + DName(L.pd) + "_g_" + DName(L.gd) + "_master_" + master + "_m_" + DName(L.ed) +
         "_out_" + DName(L.od);
}

// The master layouts: fp32 params; bf16 params with an fp32 master, int16 remainders,
// 8-bit remainders (master_dtype fp8), an fp16 master; bf16 params of their own
// (stochastic rounding).
const precis_dtype_t kMasterLayouts[][2] = {
    {F32, F32}, {B16, F32}, {B16, I16}, {B16, F8}, {B16, F16}, {B16, B16}};

struct RTensor {
  int64_t n = 0;
  int64_t step = 0;  // steps done so far
  std::vector<uint8_t> param, grad, master, m, v, out;  // v: the Adam rule's only
  std::vector<float> m_scales;
};

// The pointer tables of one call, an entry a tensor (or a piece of one).
struct Tables {
  std::vector<void*> params, masters, ms, vs, outs;
  std::vector<const void*> grads;
  std::vector<float*> m_scales;
  std::vector<int64_t> numels, steps, offsets;
  std::vector<uint64_t> streams;
  std::vector<double> lr_scales;
};

struct RProblem {
  Layout L{};
  std::vector<RTensor> ts;
  std::vector<double> lr_scales;  // per-tensor lr_scales (SGD, Lion) where not empty

  RProblem(const Layout& layout, const std::vector<int64_t>& sizes) : L(layout) {
    for (int64_t n : sizes) {
      RTensor t;
      t.n = n;
      t.param.assign(n * DSize(L.pd), 0);
      t.grad.assign(n * DSize(L.gd), 0);
      if (ModeOfLayout(L) != kNone) t.master.assign(n * DSize(L.md), 0);
      t.m.assign(n * DSize(L.ed), 0);
      t.v.assign(n * 4, 0);
      t.out.assign(n * DSize(L.od), 0x5A);  // never read: every element is written
      if (Scaled(L.ed)) t.m_scales.assign(Blocks(n), 0.0f);
      ts.push_back(std::move(t));
    }
  }

  // Elements [begin, end) of tensor k into the tables.
  void Add(Tables& tb, size_t k, int64_t begin, int64_t end) {
    RTensor& t = ts[k];
    auto at = [](std::vector<uint8_t>& b, precis_dtype_t d, int64_t i) -> void* {
      return b.empty() ? nullptr : b.data() + i * DSize(d);
    };
    tb.params.push_back(at(t.param, L.pd, begin));
    tb.grads.push_back(at(t.grad, L.gd, begin));
    tb.masters.push_back(at(t.master, L.md, begin));
    tb.ms.push_back(at(t.m, L.ed, begin));
    tb.vs.push_back(at(t.v, F32, begin));
    tb.outs.push_back(at(t.out, L.od, begin));
    tb.m_scales.push_back(t.m_scales.empty() ? nullptr
                                             : t.m_scales.data() + begin / PRECIS_SCALE_BLOCK);
    tb.numels.push_back(end - begin);
    tb.steps.push_back(t.step + 1);
  }

  Tables Whole() {
    Tables tb;
    for (size_t k = 0; k < ts.size(); ++k) Add(tb, k, 0, ts[k].n);
    tb.lr_scales = lr_scales;
    return tb;
  }

  // The descriptor of the tables for cfg's rule: only the tables the rule reads
  // (no exp_avg_sqs but for Adam, no exp_avgs for SGD without momentum, outputs
  // for Muon only).
  precis_step_tensors_t Desc(const precis_step_config_t& cfg, Tables& tb) const {
    const bool has_m = cfg.rule != kSgd || cfg.momentum != 0.0;
    precis_step_tensors_t d = PRECIS_STEP_TENSORS_INIT;
    d.count = tb.params.size();
    d.param_dtype = L.pd;
    d.grad_dtype = L.gd;
    d.master_dtype = L.md;
    d.exp_avg_dtype = L.ed;
    d.exp_avg_sq_dtype = F32;
    d.params = tb.params.data();
    d.grads = tb.grads.data();
    d.masters = ModeOfLayout(L) == kNone ? nullptr : tb.masters.data();
    d.exp_avgs = has_m ? tb.ms.data() : nullptr;
    d.exp_avg_scales = has_m && Scaled(L.ed) ? tb.m_scales.data() : nullptr;
    d.exp_avg_sqs = cfg.rule == kAdam ? tb.vs.data() : nullptr;
    d.numels = tb.numels.data();
    d.steps = tb.steps.data();
    if (!tb.streams.empty()) d.streams = tb.streams.data();
    if (!tb.offsets.empty()) d.element_offsets = tb.offsets.data();
    if (cfg.rule == kMuon) {
      d.outputs = tb.outs.data();
      d.output_dtype = L.od;
    }
    if (!tb.lr_scales.empty()) d.lr_scales = tb.lr_scales.data();
    return d;
  }

  precis_status_t Step(const precis_step_config_t& cfg, int32_t* found_inf = nullptr) {
    Tables tb = Whole();
    precis_step_tensors_t d = Desc(cfg, tb);
    const precis_status_t st = precis_step(&cfg, &d, found_inf);
    if (st == PRECIS_OK && !(found_inf != nullptr && *found_inf))
      for (RTensor& t : ts) ++t.step;
    return st;
  }

  float Master(const RTensor& t, int64_t i) const {
    return MasterValue(t.param, t.master, ModeOfLayout(L), L.pd, L.md, i);
  }

  void SetMaster(RTensor& t, int64_t i, float x) {
    SetMasterValue(t.param, t.master, ModeOfLayout(L), L.pd, L.md, i, x);
  }

  std::vector<float> Moment(const RTensor& t) const {
    std::vector<float> out(t.n);
    EXPECT_EQ(precis_moment_decode(t.m.data(), t.m_scales.data(), t.n, 0, L.ed, out.data()),
              PRECIS_OK);
    return out;
  }

  void SetMoment(RTensor& t, const std::vector<float>& x) {
    ASSERT_EQ(precis_moment_encode(x.data(), t.n, 0, t.m.data(), L.ed, t.m_scales.data()),
              PRECIS_OK);
  }

  // Params in [-1, 1), m of 0.05, gradients of 0.1 (never 0), from an integer hash
  // of (seed, element) only; tensor k has done k % 3 steps (0: SGD's buffer starts
  // from g at the first step).
  void Init(uint32_t seed) {
    uint32_t k = seed;
    auto u = [&k]() {  // uniform in [-1, 1), exactly
      k = precis_hash32(k + 0x9E3779B9u);
      return static_cast<float>(static_cast<int32_t>(k >> 8) - (1 << 23)) * 0x1p-23f;
    };
    for (size_t ti = 0; ti < ts.size(); ++ti) {
      RTensor& t = ts[ti];
      t.step = static_cast<int64_t>(ti % 3);
      std::vector<float> m(t.n);
      for (int64_t i = 0; i < t.n; ++i) {
        SetMaster(t, i, u());
        m[i] = t.step == 0 ? 0.0f : 0.05f * u();
        const float g = 0.1f * u();
        Encode(t.grad, L.gd, i, g == 0.0f ? 1e-3f : g);
      }
      SetMoment(t, m);
    }
  }

  // New gradients (the state stays), from the hash as Init.
  void NewGrads(uint32_t seed) {
    uint32_t k = seed;
    for (RTensor& t : ts)
      for (int64_t i = 0; i < t.n; ++i) {
        k = precis_hash32(k + 0x9E3779B9u);
        const float g = 0.1f * static_cast<float>(static_cast<int32_t>(k >> 8) - (1 << 23)) *
                        0x1p-23f;
        Encode(t.grad, L.gd, i, g == 0.0f ? 1e-3f : g);
      }
  }

  // Every buffer's bytes.
  std::vector<std::vector<uint8_t>> Snapshot() const {
    std::vector<std::vector<uint8_t>> s;
    for (const RTensor& t : ts) {
      std::vector<uint8_t> scales(t.m_scales.size() * 4);
      if (!scales.empty()) std::memcpy(scales.data(), t.m_scales.data(), scales.size());
      s.push_back(t.param), s.push_back(t.grad), s.push_back(t.master), s.push_back(t.m);
      s.push_back(t.v), s.push_back(t.out), s.push_back(scales);
    }
    return s;
  }
};

// ---- the double-precision reference --------------------------------------------------

// One element's step in double, and the magnitudes of the terms summed into each
// result (fp32 arithmetic is within kArith of them).
struct Ref {
  double p, m, out;
  double p_terms, m_terms, out_terms;
  double p_alt[2];  // Lion where sign(u) is within rounding of 0: the other signs' p
  bool ambiguous;
};

// lr_i: the step's lr (r.lr * tensors->lr_scales[i] where given); r.lr the weight decay's.
Ref Reference(const Rule& r, double lr_i, bool first_step, double p, double m, double g) {
  Ref x{};
  g *= r.inv_grad_scale;
  if (r.maximize) g = -g;
  double g_terms = std::fabs(g);
  if (r.rule == kMuon) {  // m = lerp(m, g, 1 - momentum); the direction
    x.m = r.momentum * m + (1 - r.momentum) * g;
    x.m_terms = std::fabs(m) + std::fabs(g);
    x.out = r.nesterov ? r.momentum * x.m + (1 - r.momentum) * g : x.m;
    x.out_terms = x.m_terms + std::fabs(x.m) + std::fabs(g);
    x.p = p;
    return x;
  }
  const bool decoupled = r.decoupled || r.rule == kLion;
  const double decayed = decoupled ? p * (1 - r.lr * r.wd) : p;
  if (r.rule == kLion) {
    const double u = r.beta1 * m + (1 - r.beta1) * g;
    const double u_terms = r.beta1 * std::fabs(m) + (1 - r.beta1) * g_terms;
    const double sign = u > 0 ? 1.0 : u < 0 ? -1.0 : 0.0;
    x.m = r.beta2 * m + (1 - r.beta2) * g;
    x.m_terms = r.beta2 * std::fabs(m) + (1 - r.beta2) * g_terms;
    x.p = decayed - lr_i * sign;
    x.p_terms = std::fabs(decayed) + lr_i;
    // fp32's u may have the other sign or be 0 where u is within its rounding
    x.ambiguous = std::fabs(u) <= 1e-6 * u_terms;
    x.p_alt[0] = decayed - lr_i * (sign == 0 ? 1.0 : 0.0);
    x.p_alt[1] = decayed + lr_i * (sign == 0 ? 1.0 : sign);
    return x;
  }
  // SGD
  if (!decoupled) {
    g += r.wd * p;
    g_terms += std::fabs(r.wd * p);
  }
  double d = g, d_terms = g_terms;
  if (r.momentum != 0.0) {
    x.m = first_step ? g : r.momentum * m + (1 - r.dampening) * g;
    x.m_terms = first_step ? g_terms : r.momentum * std::fabs(m) + (1 - r.dampening) * g_terms;
    d = r.nesterov ? g + r.momentum * x.m : x.m;
    d_terms = r.nesterov ? g_terms + r.momentum * x.m_terms : x.m_terms;
  }
  x.p = decayed - lr_i * d;
  x.p_terms = std::fabs(decayed) + lr_i * d_terms;
  return x;
}

// fp32 arithmetic: a few roundings of 2^-24 of the summed terms each (the constants'
// roundings to float, each product and fused add): 6e-7 is 10 of them.
const double kArith = 6e-7;

// How far a stored value may be from the fp32 value stored (relative to it, plus
// an absolute floor where subnormals or block scales reach).
double StoreTol(precis_dtype_t d, bool stochastic, double x) {
  const int half = stochastic ? 0 : 1;
  switch (d) {
    case F32:
      return 0;
    case B16:
      return x * std::ldexp(1.0, -7 - half) + 1e-38;
    case F16:
      return x * std::ldexp(1.0, -10 - half) + std::ldexp(1.0, -24 - half);
    default:
      return 0;
  }
}

// The momentum as stored (exp_avg_dtype, its block of amax): bf16, fp16 of amax / 65504
// and fp8 (m8, E2M5 of amax / 7.875), each stochastically (a one-state rule's).
double MomentTol(precis_dtype_t d, double x, double amax) {
  const bool sr = precis_moment_store_sr(d, 0, PRECIS_RULE_SGD) != 0;
  const int half = sr ? 0 : 1;
  switch (d) {
    case F32:
      return 0;
    case B16:
      return x * std::ldexp(1.0, -7 - half);
    case F16:
      return x * std::ldexp(1.0, -10 - half) +
             amax / 65504.0 * std::ldexp(1.0, sr ? -24 : -25);
    case F8:
      return x * std::ldexp(1.0, -5 - half) +
             amax / PRECIS_M8_MAX * std::ldexp(1.0, sr ? -5 : -6);
    default:
      return 0;
  }
}

// The master's storage: fp32 (none, separate, int16 remainders) exact; an fp16 master
// to nearest; 8-bit remainders to 24 bits (half a spacing of 15 mantissa bits); a bf16
// param of its own stochastically (a whole bf16 spacing).
double MasterTol(const Layout& L, double x) {
  switch (ModeOfLayout(L)) {
    case kNone:
      return StoreTol(L.pd, true, x);
    case kSeparate:
      return StoreTol(L.md, false, x);
    case kRemainder:
      return 0;
    case kRemainder8:
      return x * std::ldexp(1.0, -16);
  }
  return 0;
}

// One step of pb under rule r, every element of every tensor checked against the
// reference from the kernel's own state before the step (decoded as it reads it).
void CheckStep(RProblem& pb, const Rule& r, const std::string& what) {
  struct Before {
    std::vector<float> p, m, g;
    std::vector<uint8_t> param, master;
  };
  const Layout& L = pb.L;
  std::vector<Before> before;
  for (const RTensor& t : pb.ts) {
    Before b;
    b.m = pb.Moment(t);
    for (int64_t i = 0; i < t.n; ++i) {
      b.p.push_back(pb.Master(t, i));
      b.g.push_back(Decode(t.grad, L.gd, i));
    }
    b.param = t.param;
    b.master = t.master;
    before.push_back(std::move(b));
  }
  ASSERT_EQ(pb.Step(r.Config()), PRECIS_OK) << what << ": " << precis_last_error();
  for (size_t k = 0; k < pb.ts.size(); ++k) {
    const RTensor& t = pb.ts[k];
    const Before& b = before[k];
    const double lr_i = pb.lr_scales.empty() ? r.lr : r.lr * pb.lr_scales[k];
    const bool first = t.step == 1;
    const std::vector<float> m = pb.Moment(t);
    std::vector<Ref> ref(t.n);
    std::vector<double> amax(Blocks(t.n), 0.0);
    for (int64_t i = 0; i < t.n; ++i) {
      ref[i] = Reference(r, lr_i, first, b.p[i], b.m[i], b.g[i]);
      double& a = amax[i / PRECIS_SCALE_BLOCK];
      a = std::max(a, std::fabs(ref[i].m));
    }
    if (!r.WritesParams()) {  // Muon: params and masters neither read nor written
      EXPECT_TRUE(t.param == b.param && t.master == b.master) << what << ": params written";
    }
    if (!r.HasM()) {  // SGD without momentum: no buffer (passed NULL)
      EXPECT_EQ(m, b.m) << what;
    }
    int failures = 0;
    for (int64_t i = 0; i < t.n && failures < 5; ++i) {
      const Ref& x = ref[i];
      auto at = [&]() {  // built only for a failure's message
        return what + " " + LayoutName(L) + " tensor " + std::to_string(k) + " element " +
               std::to_string(i) + " step " + std::to_string(t.step);
      };
      if (r.WritesParams()) {
        const double p = pb.Master(t, i);
        const double tol = kArith * x.p_terms + MasterTol(L, std::fabs(x.p) + kArith * x.p_terms);
        bool ok = std::fabs(p - x.p) <= tol;
        if (x.ambiguous) {
          for (double alt : x.p_alt) ok = ok || std::fabs(p - alt) <= tol;
        }
        if (!ok) {
          ++failures;
          ADD_FAILURE() << at() << ": p " << p << " want " << x.p << " tol " << tol;
        }
        if (ModeOfLayout(L) == kSeparate) {  // the param: the master rounded to nearest
          std::vector<uint8_t> want(DSize(L.pd));
          Encode(want, L.pd, 0, static_cast<float>(p));
          EXPECT_EQ(0, std::memcmp(want.data(), &t.param[i * DSize(L.pd)], want.size())) << at();
        }
      }
      if (r.HasM()) {
        const double tol = kArith * x.m_terms +
                           MomentTol(L.ed, std::fabs(x.m) + kArith * x.m_terms,
                                     amax[i / PRECIS_SCALE_BLOCK]);
        if (!(std::fabs(m[i] - x.m) <= tol)) {
          ++failures;
          ADD_FAILURE() << at() << ": m " << m[i] << " want " << x.m << " tol " << tol;
        }
      }
      if (r.rule == kMuon) {
        const double out = Decode(t.out, L.od, i);
        const double tol = kArith * x.out_terms +
                           StoreTol(L.od, false, std::fabs(x.out) + kArith * x.out_terms);
        if (!(std::fabs(out - x.out) <= tol)) {
          ++failures;
          ADD_FAILURE() << at() << ": out " << out << " want " << x.out << " tol " << tol;
        }
      }
    }
  }
}

// ---- (a) the reference, fp32 state and params ------------------------------------------

const Layout kFp32 = {F32, F32, F32, F32, F32};

// Three steps over tensors of 1, 127 and 4097 elements (which start at steps 0, 1
// and 2: SGD's first step starts the buffer from g), with new gradients each step:
// every result within kArith (6e-7) of the summed magnitudes of its terms.
TEST(Rules, Fp32MatchesDoubleReference) {
  for (const Rule& r : AllRules()) {
    RProblem pb(kFp32, {1, 127, 4097});
    pb.Init(11);
    for (int s = 0; s < 3; ++s) {
      CheckStep(pb, r, r.name);
      if (HasFatalFailure()) return;
      pb.NewGrads(100 + s);
    }
  }
}

// 1,000,003 elements (many chunks, a partial tile and scale block), fp32 and one
// low-precision layout (bf16 params with an fp32 master, bf16 grads, fp8 m, bf16
// output), two steps of one rule each way.
TEST(Rules, LargeTensorMatchesDoubleReference) {
  const Rule rules[] = {kSgdRules[0], kSgdRules[6], kLionRules[0], kMuonRules[1]};
  for (const Layout& L : {kFp32, Layout{B16, B16, F32, F8, B16}}) {
    for (const Rule& r : rules) {
      RProblem pb(L, {1000003});
      pb.Init(12);
      pb.ts[0].step = 0;
      for (int s = 0; s < 2; ++s) {
        CheckStep(pb, r, r.name + " 1000003");
        if (HasFatalFailure()) return;
        pb.NewGrads(200 + s);
      }
    }
  }
}

// The stored state of every moment dtype and master layout within its rounding of
// the reference (bf16 / fp16 m to nearest, fp8 m stochastically in its block
// scales; fp16 masters, 8-bit remainders, bf16 params of their own stochastically;
// Muon's output to nearest in fp16 / bf16).
TEST(Rules, EveryLayoutWithinItsRoundingOfTheReference) {
  const precis_dtype_t grads[] = {F32, B16, F16};
  const precis_dtype_t outs[] = {F32, F16, B16};
  int k = 0;
  for (const Rule& r : {kSgdRules[1], kSgdRules[4], kSgdRules[7], kLionRules[0], kMuonRules[0],
                        kMuonRules[2]}) {
    for (const auto& ml : kMasterLayouts) {
      for (precis_dtype_t ed : {F32, F16, B16, F8}) {
        const Layout L = {ml[0], grads[k % 3], ml[1], ed, outs[k % 3]};
        ++k;
        RProblem pb(L, {127, 4097});
        pb.Init(13 + k);
        for (int s = 0; s < 2; ++s) {
          CheckStep(pb, r, r.name);
          if (HasFatalFailure()) return;
          pb.NewGrads(300 + s);
        }
      }
    }
  }
}

// The decoupled weight decay takes cfg->lr, the step cfg->lr * tensors->lr_scales[i]
// (SGD, Lion).
TEST(Rules, PerTensorLrsInTheReference) {
  for (const Rule& r : {kSgdRules[2], kSgdRules[7], kLionRules[0]}) {
    RProblem pb(kFp32, {1, 127, 4097});
    pb.Init(14);
    pb.lr_scales = {1.0, 0.2 * std::sqrt(127.0), 0.0};
    for (int s = 0; s < 2; ++s) {
      CheckStep(pb, r, r.name + " lr_scales");
      if (HasFatalFailure()) return;
      pb.NewGrads(400 + s);
    }
  }
}

// ---- (b) SIMD paths ----------------------------------------------------------------

const char* const kAllPaths[] = {"scalar", "avx2", "avx512", "neon", "sve"};

// The SIMD paths this CPU can run, scalar first (the reference of the others).
std::vector<std::string> RunnablePaths() {
  std::vector<std::string> paths;
  for (const char* p : kAllPaths)
    if (pr_cpu_isa_force(p) == 0) paths.push_back(p);
  EXPECT_EQ(pr_cpu_isa_force(nullptr), 0);
  return paths;
}

// `steps` steps of rule r on layout L on every path: each path's bits (params,
// masters, m and its scales, outputs) are the scalar path's.
void ExpectPathsAgree(const std::vector<std::string>& paths, const Rule& r, const Layout& L,
                      const std::vector<int64_t>& sizes, int steps) {
  std::vector<std::vector<std::vector<uint8_t>>> results;
  for (const std::string& p : paths) {
    ASSERT_EQ(pr_cpu_isa_force(p.c_str()), 0);
    RProblem pb(L, sizes);
    pb.Init(21);
    for (int s = 0; s < steps; ++s) {
      ASSERT_EQ(pb.Step(r.Config()), PRECIS_OK) << precis_last_error();
      pb.NewGrads(500 + s);
    }
    results.push_back(pb.Snapshot());
  }
  for (size_t i = 1; i < results.size(); ++i)
    ASSERT_TRUE(results[i] == results[0])
        << r.name << " " << LayoutName(L) << " " << paths[i] << " vs scalar";
}

// Every rule (SGD, Lion, Muon each way), every moment dtype, every master layout:
// three steps at odd sizes on every path give the scalar path's bits.
TEST(Rules, SimdPathsAgreeBitForBit) {
  const std::vector<std::string> paths = RunnablePaths();
  if (paths.size() == 1) GTEST_SKIP() << "only the scalar path runs on this CPU";
  const precis_dtype_t grads[] = {F32, B16, F16};
  const precis_dtype_t outs[] = {F32, F16, B16};
  int k = 0;
  for (const Rule& r : AllRules()) {
    for (const auto& ml : kMasterLayouts) {
      for (precis_dtype_t ed : {F32, F16, B16, F8}) {
        const Layout L = {ml[0], grads[k % 3], ml[1], ed, outs[(k / 3) % 3]};
        ++k;
        ExpectPathsAgree(paths, r, L, {1, 127, 4097, 33}, 3);
        if (HasFatalFailure()) return;
      }
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// 1,000,003 elements: fp32, and bf16 params + fp32 master with fp8 m (block scales,
// stochastic rounding), two steps.
TEST(Rules, SimdPathsAgreeAtLargeOddSizes) {
  const std::vector<std::string> paths = RunnablePaths();
  if (paths.size() == 1) GTEST_SKIP() << "only the scalar path runs on this CPU";
  for (const Layout& L : {kFp32, Layout{B16, B16, F32, F8, B16}}) {
    for (const Rule& r : {kSgdRules[7], kLionRules[0], kMuonRules[2]}) {
      ExpectPathsAgree(paths, r, L, {1000003, 5}, 2);
      if (HasFatalFailure()) return;
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// The one-state rules' fused kernels (step_cpu.c's pr_fused_layouts for them: fp32; bf16 params
// with an fp32 master and bf16 m; 8-bit remainders with fp8 m; Muon's momentum on bf16
// grads with fp32, bf16 or fp8 m and a bf16 direction, and its apply on each of those
// params) give the generic kernel's bits (pr_cpu_generic_force), on every path: every
// rule on each layout (where a layout has no loops for a rule, both run the generic
// one), three steps at odd sizes (a partial scale block, tile and chunk), the element
// offsets crossing 2^32 in a tile.
TEST(Rules, FusedKernelsGiveTheGenericKernelsBits) {
  const Layout layouts[] = {kFp32,
                            {F32, B16, F32, F32, B16},
                            {B16, B16, F32, B16, B16},
                            {B16, B16, F32, F32, B16},
                            {B16, B16, F8, F8, B16},
                            {B16, B16, F8, F32, B16},
                            {B16, B16, B16, F8, F32}};  // Muon: a direction not bf16
  const std::vector<int64_t> sizes = {1, 127, 4097, 70001};
  for (const std::string& p : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(p.c_str()), 0);
    for (const Rule& r : AllRules()) {
      for (const Layout& L : layouts) {
        std::vector<std::vector<std::vector<uint8_t>>> results;
        for (int generic : {0, 1}) {
          ASSERT_EQ(pr_cpu_generic_force(generic), 0);
          RProblem pb(L, sizes);
          pb.Init(61);
          const precis_step_config_t cfg = r.Config();
          for (int s = 0; s < 3; ++s) {
            Tables tb = pb.Whole();
            tb.streams = {5, 6, 7, 8};
            tb.offsets = {0, 7, (int64_t{1} << 32) - 1000, 3};
            precis_step_tensors_t d = pb.Desc(cfg, tb);
            ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
            for (RTensor& t : pb.ts) ++t.step;
            pb.NewGrads(800 + s);
          }
          results.push_back(pb.Snapshot());
        }
        ASSERT_EQ(pr_cpu_generic_force(0), 0);
        ASSERT_TRUE(results[0] == results[1])
            << r.name << " " << LayoutName(L) << " on " << p << ": fused vs generic";
      }
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// Two steps of every rule, master layout and moment dtype (every grad and output
// dtype among them, odd sizes), hashed (FNV-1a over every buffer): the digest
// recorded from x86's scalar path. Every path of every architecture must give it
// (tools/cross_test.sh runs this test on aarch64 under qemu).
TEST(RulesGolden, EveryPathGivesTheRecordedBits) {
  const uint64_t kGolden = 0x14cc5c8b666035a9ull;
  const precis_dtype_t grads[] = {F32, B16, F16};
  const precis_dtype_t outs[] = {F32, F16, B16};
  for (const std::string& p : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(p.c_str()), 0);
    uint64_t h = 0xCBF29CE484222325ull;
    uint32_t k = 0;
    for (const Rule& r : AllRules()) {
      for (const auto& ml : kMasterLayouts) {
        for (precis_dtype_t ed : {F32, F16, B16, F8}) {
          const Layout L = {ml[0], grads[k % 3], ml[1], ed, outs[(k / 3) % 3]};
          RProblem pb(L, {1, 130, 2049});
          pb.Init(k++);
          for (int s = 0; s < 2; ++s) {
            ASSERT_EQ(pb.Step(r.Config()), PRECIS_OK) << precis_last_error();
            pb.NewGrads(700 + s);
          }
          for (const std::vector<uint8_t>& b : pb.Snapshot())
            for (uint8_t byte : b) h = (h ^ byte) * 0x100000001B3ull;
        }
      }
    }
    EXPECT_EQ(h, kGolden) << p << " digest 0x" << std::hex << h;
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// ---- (c) pieces ----------------------------------------------------------------------

struct Piece {
  int64_t begin, end;
};

// One step of tensor 0 of pb handed as pieces, each with the stream and its element
// offset in the whole param.
void StepPieces(RProblem& pb, const std::vector<Piece>& pieces, uint64_t stream, int64_t base,
                const precis_step_config_t& cfg) {
  Tables tb;
  for (const Piece& pc : pieces) {
    pb.Add(tb, 0, pc.begin, pc.end);
    tb.streams.push_back(stream);
    tb.offsets.push_back(base + pc.begin);
  }
  precis_step_tensors_t d = pb.Desc(cfg, tb);
  ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
  ++pb.ts[0].step;
}

// A tensor stepped in pieces (cut at scale blocks), each with its stream and element
// offset, gives the bits of it stepped whole: the random numbers of fp8 m and of a
// bf16 param without master follow the element; another stream gives other bits.
TEST(Rules, PiecesGiveTheBitsOfTheWhole) {
  const Layout layouts[] = {{B16, B16, B16, F8, F32},   // SR param, fp8 m
                            {B16, F32, F32, F8, B16},   // fp8 m, an fp32 master
                            {B16, B16, F8, B16, F16},   // 8-bit remainders, bf16 m
                            {F32, F32, F32, F16, F32}}; // fp16 m (scaled, nearest)
  const int64_t n = 128 * 37 + 5;
  for (const Rule& r : {kSgdRules[4], kLionRules[0], kMuonRules[1]}) {
    for (const Layout& L : layouts) {
      for (int64_t base : {int64_t{0}, (int64_t{1} << 32) - 300}) {
        RProblem whole(L, {n});
        whole.Init(31);
        const RProblem start = whole;
        const precis_step_config_t cfg = r.Config();
        for (int s = 0; s < 3; ++s) StepPieces(whole, {{0, n}}, 9, base, cfg);
        for (const std::vector<Piece>& split :
             {std::vector<Piece>{{0, 128 * 19}, {128 * 19, n}},
              std::vector<Piece>{{0, 128}, {128, 2048}, {2048, 4096}, {4096, n}}}) {
          RProblem pieces = start;
          for (int s = 0; s < 3; ++s) StepPieces(pieces, split, 9, base, cfg);
          EXPECT_TRUE(pieces.Snapshot() == whole.Snapshot())
              << r.name << " " << LayoutName(L) << " base " << base << ", " << split.size()
              << " pieces";
        }
        const bool random = L.ed == F8 || (L.pd == B16 && L.md == B16 && r.WritesParams());
        if (random) {  // another stream rounds otherwise: the check above can fail
          RProblem other = start;
          for (int s = 0; s < 3; ++s) StepPieces(other, {{0, n}}, 10, base, cfg);
          EXPECT_FALSE(other.Snapshot() == whole.Snapshot()) << r.name << " " << LayoutName(L);
        }
      }
    }
  }
}

// ---- (d) per-tensor lr scales ----------------------------------------------------------

// With weight_decay 0, one call with lr_scales equals a call per tensor with cfg->lr =
// its lr * lr_scales[i] (0.5: the products are exact in double and in float; streams
// given: the random numbers are the tensor's in both).
TEST(Rules, PerTensorLrsEqualSeparateCalls) {
  const Layout layouts[] = {kFp32, {B16, B16, B16, F8, F32}, {B16, F32, I16, B16, F32}};
  const std::vector<double> lr_scales = {2e-3, 6e-4, 0.0, 0.2};
  for (Rule r : {kSgdRules[0], kSgdRules[3], kSgdRules[6], kLionRules[1]}) {
    r.wd = 0.0;
    for (int lr_float32 : {0, 1}) {
      for (const Layout& L : layouts) {
        RProblem together(L, {1, 127, 4097, 300});
        together.Init(41);
        RProblem apart = together;
        precis_step_config_t cfg = r.Config();
        cfg.lr = 0.5;  // not any tensor's
        cfg.lr_float32 = lr_float32;
        for (int s = 0; s < 2; ++s) {
          Tables tb = together.Whole();
          tb.lr_scales = lr_scales;
          tb.streams = {0, 1, 2, 3};
          precis_step_tensors_t d = together.Desc(cfg, tb);
          ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
          for (RTensor& t : together.ts) ++t.step;
          for (size_t k = 0; k < apart.ts.size(); ++k) {
            precis_step_config_t one = cfg;
            one.lr = cfg.lr * lr_scales[k];
            Tables tk;
            apart.Add(tk, k, 0, apart.ts[k].n);
            tk.streams = {k};
            precis_step_tensors_t dk = apart.Desc(one, tk);
            ASSERT_EQ(precis_step(&one, &dk, nullptr), PRECIS_OK) << precis_last_error();
            ++apart.ts[k].step;
          }
          together.NewGrads(600 + s);
          apart.NewGrads(600 + s);
        }
        EXPECT_TRUE(together.Snapshot() == apart.Snapshot())
            << r.name << " " << LayoutName(L) << " lr_float32 " << lr_float32;
        // And the lr_scales mattered: tensors 0 and 1 moved differently from a call at 0.5.
        RProblem plain(L, {1, 127, 4097, 300});
        plain.Init(41);
        ASSERT_EQ(plain.Step(cfg), PRECIS_OK);
        EXPECT_FALSE(plain.ts[1].param == together.ts[1].param) << r.name;
      }
    }
  }
}

// ---- check_finite ------------------------------------------------------------------------

// A NaN or inf gradient with check_finite: found_inf 1 and nothing written, whatever
// the rule; without it the step runs.
TEST(Rules, NonFiniteGradientSkipsTheStepAndWritesNothing) {
  for (const Rule& r : {kSgdRules[0], kSgdRules[5], kLionRules[0], kMuonRules[1]}) {
    for (float bad : {NAN, INFINITY}) {
      RProblem pb({B16, F16, F32, F8, B16}, {300, 70000});
      pb.Init(51);
      Encode(pb.ts[1].grad, F16, 69999, bad);
      const auto before = pb.Snapshot();
      precis_step_config_t cfg = r.Config();
      cfg.check_finite = 1;
      int32_t found = 77;
      ASSERT_EQ(pb.Step(cfg, &found), PRECIS_OK) << precis_last_error();
      EXPECT_EQ(found, 1) << r.name;
      EXPECT_TRUE(pb.Snapshot() == before) << r.name;
      Encode(pb.ts[1].grad, F16, 69999, 0.5f);
      found = 77;
      ASSERT_EQ(pb.Step(cfg, &found), PRECIS_OK) << precis_last_error();
      EXPECT_EQ(found, 0) << r.name;
      EXPECT_FALSE(pb.Snapshot() == before) << r.name;
    }
  }
}

// tensors->param_fingerprints with the one-state rules: after an SGD or Lion step each
// entry is precis_fingerprint of the tensor's param as written (each master layout, the
// fused and the generic kernels, 2 threads); Muon's momentum writes no params, so it is
// refused there, before anything is written.
TEST(Rules, ParamFingerprintsAreThoseOfTheWrittenParams) {
  auto written = [](const RProblem& pb) {
    std::vector<const void*> bufs;
    std::vector<int64_t> nbytes;
    for (const RTensor& t : pb.ts) {
      bufs.push_back(t.param.data());
      nbytes.push_back(t.n * DSize(pb.L.pd));
    }
    return Fingerprints(bufs, nbytes);
  };
  for (const Rule& r : {kSgdRules[0], kSgdRules[5], kSgdRules[7], kLionRules[0]}) {
    for (const auto& ml : kMasterLayouts) {
      for (precis_dtype_t ed : {F32, B16, F8}) {
        for (int generic : {0, 1}) {
          ASSERT_EQ(pr_cpu_generic_force(generic), 0);
          const Layout L = {ml[0], B16, ml[1], ed, F32};
          RProblem pb(L, {1, 127, 70001});
          pb.Init(71);
          precis_step_config_t cfg = r.Config();
          cfg.num_threads = 2;
          Tables tb = pb.Whole();
          precis_step_tensors_t d = pb.Desc(cfg, tb);
          std::vector<uint64_t> got(d.count, 0xDEADu);
          d.param_fingerprints = got.data();
          ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
          ASSERT_EQ(got, written(pb)) << r.name << " " << LayoutName(L)
                                      << (generic ? " (generic)" : "");
        }
      }
    }
  }
  ASSERT_EQ(pr_cpu_generic_force(0), 0);

  RProblem pb({B16, B16, F32, B16, B16}, {300});
  pb.Init(72);
  const auto before = pb.Snapshot();
  const precis_step_config_t cfg = kMuonRules[0].Config();
  Tables tb = pb.Whole();
  precis_step_tensors_t d = pb.Desc(cfg, tb);
  std::vector<uint64_t> got(d.count, 0xDEADu);
  d.param_fingerprints = got.data();
  EXPECT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("param_fingerprints"), std::string::npos)
      << precis_last_error();
  EXPECT_TRUE(pb.Snapshot() == before);
  EXPECT_EQ(got, std::vector<uint64_t>(d.count, 0xDEADu));
}

// ---- (e) bad input -----------------------------------------------------------------------

struct BadCase {
  std::string name;
  precis_status_t want;
  std::string message;  // a substring of precis_last_error()
  std::function<void(precis_step_config_t&, precis_step_tensors_t&, Tables&)> mutate;
};

// One bad case on a list of rule `base` with an empty tensor (NULL pointers are fine
// there): the status, the message naming the field, and nothing written.
void ExpectRefused(const Rule& base, const BadCase& bc) {
  RProblem pb({B16, B16, F32, F16, F32}, {300, 0, 4000});
  pb.Init(61);
  const auto before = pb.Snapshot();
  precis_step_config_t cfg = base.Config();
  Tables tb = pb.Whole();
  tb.params[1] = tb.masters[1] = tb.ms[1] = tb.vs[1] = tb.outs[1] = nullptr;
  tb.grads[1] = nullptr;
  precis_step_tensors_t t = pb.Desc(cfg, tb);
  bc.mutate(cfg, t, tb);
  int32_t found = 77;
  EXPECT_EQ(precis_step(&cfg, &t, &found), bc.want) << bc.name << ": " << precis_last_error();
  const std::string err = precis_last_error();
  EXPECT_NE(err.find(bc.message), std::string::npos) << bc.name << ": " << err;
  EXPECT_NE(err.find("precis_step"), std::string::npos) << bc.name;
  EXPECT_EQ(found, 77) << bc.name;
  EXPECT_TRUE(pb.Snapshot() == before) << bc.name;
}

TEST(Rules, BadInputsFailNamingTheFieldAndWriteNothing) {
  using C = precis_step_config_t;
  using T = precis_step_tensors_t;
  static double bad_lrs[3] = {1e-3, -1e-3, 1e-3};
  static double nan_lrs[3] = {NAN, 1e-3, 1e-3};
  static double good_lrs[3] = {1e-3, 1e-3, 1e-3};
  const Rule& sgd = kSgdRules[3];
  const Rule& lion = kLionRules[0];
  const Rule& muon = kMuonRules[1];
  const std::vector<std::pair<Rule, BadCase>> cases = {
      {sgd, {"rule 7", PRECIS_ERR_INVALID_ARGUMENT, "cfg->rule is 7", [](C& c, T&, Tables&) { c.rule = 7; }}},
      {sgd, {"rule -1", PRECIS_ERR_INVALID_ARGUMENT, "cfg->rule is -1", [](C& c, T&, Tables&) { c.rule = -1; }}},
      {sgd, {"amsgrad with sgd", PRECIS_ERR_INVALID_ARGUMENT, "cfg->amsgrad is 1 with rule sgd", [](C& c, T&, Tables&) { c.amsgrad = 1; }}},
      {lion, {"amsgrad with lion", PRECIS_ERR_INVALID_ARGUMENT, "cfg->amsgrad is 1 with rule lion", [](C& c, T&, Tables&) { c.amsgrad = 1; }}},
      {sgd, {"nesterov with dampening", PRECIS_ERR_INVALID_ARGUMENT, "cfg->nesterov is 1 with momentum 0.9", [](C& c, T&, Tables&) { c.nesterov = 1, c.dampening = 0.3; }}},
      {sgd, {"nesterov with momentum 0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->nesterov is 1 with momentum 0", [](C& c, T&, Tables&) { c.nesterov = 1, c.momentum = 0.0; }}},
      {sgd, {"nesterov 2", PRECIS_ERR_INVALID_ARGUMENT, "cfg->nesterov is 2", [](C& c, T&, Tables&) { c.nesterov = 2; }}},
      {sgd, {"momentum < 0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->momentum", [](C& c, T&, Tables&) { c.momentum = -0.1; }}},
      {sgd, {"momentum nan", PRECIS_ERR_INVALID_ARGUMENT, "cfg->momentum", [](C& c, T&, Tables&) { c.momentum = NAN; }}},
      {sgd, {"dampening inf", PRECIS_ERR_INVALID_ARGUMENT, "cfg->dampening", [](C& c, T&, Tables&) { c.dampening = INFINITY; }}},
      {sgd, {"lr < 0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->lr", [](C& c, T&, Tables&) { c.lr = -1.0; }}},
      {sgd, {"exp_avgs NULL with momentum", PRECIS_ERR_NULL_POINTER, "tensors->exp_avgs is NULL", [](C&, T& t, Tables&) { t.exp_avgs = nullptr; }}},
      {sgd, {"exp_avgs[2] NULL", PRECIS_ERR_NULL_POINTER, "exp_avgs[2] is NULL", [](C&, T&, Tables& tb) { tb.ms[2] = nullptr; }}},
      {sgd, {"exp_avg dtype int16", PRECIS_ERR_INVALID_POLICY, "exp_avg_dtype", [](C&, T& t, Tables&) { t.exp_avg_dtype = I16; }}},
      {sgd, {"exp_avg scales NULL", PRECIS_ERR_NULL_POINTER, "exp_avg_scales", [](C&, T& t, Tables&) { t.exp_avg_scales = nullptr; }}},
      {sgd, {"masters NULL", PRECIS_ERR_NULL_POINTER, "tensors->masters is NULL", [](C&, T& t, Tables&) { t.masters = nullptr; }}},
      {sgd, {"params[2] NULL", PRECIS_ERR_NULL_POINTER, "params[2] is NULL", [](C&, T&, Tables& tb) { tb.params[2] = nullptr; }}},
      {sgd, {"lr_scales with adam", PRECIS_ERR_INVALID_ARGUMENT, "tensors->lr_scales must be NULL with rule adam", [](C& c, T& t, Tables&) {
         c.rule = kAdam, c.momentum = 0.0, c.nesterov = 0;
         t.exp_avg_sqs = t.exp_avgs, t.exp_avg_sq_dtype = t.exp_avg_dtype, t.exp_avg_sq_scales = t.exp_avg_scales;
         t.lr_scales = good_lrs; }}},
      {muon, {"lr_scales with muon", PRECIS_ERR_INVALID_ARGUMENT, "tensors->lr_scales must be NULL with rule muon_momentum", [](C&, T& t, Tables&) { t.lr_scales = good_lrs; }}},
      {sgd, {"negative lr_scales entry", PRECIS_ERR_INVALID_ARGUMENT, "lr_scales[1] is -0.001", [](C&, T& t, Tables&) { t.lr_scales = bad_lrs; }}},
      {lion, {"nan lr_scales entry", PRECIS_ERR_INVALID_ARGUMENT, "lr_scales[0] is nan", [](C&, T& t, Tables&) { t.lr_scales = nan_lrs; }}},
      {muon, {"outputs NULL", PRECIS_ERR_NULL_POINTER, "tensors->outputs is NULL", [](C&, T& t, Tables&) { t.outputs = nullptr; }}},
      {muon, {"outputs[2] NULL", PRECIS_ERR_NULL_POINTER, "outputs[2] is NULL", [](C&, T&, Tables& tb) { tb.outs[2] = nullptr; }}},
      {muon, {"output dtype fp8", PRECIS_ERR_INVALID_POLICY, "tensors->output_dtype", [](C&, T& t, Tables&) { t.output_dtype = F8; }}},
      {muon, {"output dtype code", PRECIS_ERR_INVALID_DTYPE, "tensors->output_dtype", [](C&, T& t, Tables&) { t.output_dtype = static_cast<precis_dtype_t>(42); }}},
      {muon, {"tensors too small for muon", PRECIS_ERR_SIZE_MISMATCH, "with rule muon_momentum", [](C&, T& t, Tables&) { t.size = offsetof(precis_step_tensors_t, outputs); }}},
      {muon, {"output misaligned", PRECIS_ERR_INVALID_ARGUMENT, "outputs[0]", [](C&, T&, Tables& tb) { tb.outs[0] = static_cast<uint8_t*>(tb.outs[0]) + 2; }}},
      {muon, {"momentum 1 for muon", PRECIS_ERR_INVALID_ARGUMENT, "cfg->momentum is 1", [](C& c, T&, Tables&) { c.momentum = 1.0; }}},
      {muon, {"momentum < 0 for muon", PRECIS_ERR_INVALID_ARGUMENT, "cfg->momentum", [](C& c, T&, Tables&) { c.momentum = -0.5; }}},
      {lion, {"beta1 1.5 for lion", PRECIS_ERR_INVALID_ARGUMENT, "cfg->beta1 is 1.5", [](C& c, T&, Tables&) { c.beta1 = 1.5; }}},
      {lion, {"beta2 nan for lion", PRECIS_ERR_INVALID_ARGUMENT, "cfg->beta2", [](C& c, T&, Tables&) { c.beta2 = NAN; }}},
      {lion, {"nesterov with lion", PRECIS_ERR_INVALID_ARGUMENT, "cfg->nesterov is 1; the lion rule", [](C& c, T&, Tables&) { c.nesterov = 1; }}},
      {lion, {"exp_avgs NULL for lion", PRECIS_ERR_NULL_POINTER, "tensors->exp_avgs is NULL", [](C&, T& t, Tables&) { t.exp_avgs = nullptr; }}},
  };
  for (const auto& rc : cases) ExpectRefused(rc.first, rc.second);
}

// What the rules do not read may be NULL (or any dtype code): exp_avg_sqs for every
// rule but Adam; exp_avgs for SGD without momentum; params' masters for Muon.
TEST(Rules, BuffersARuleDoesNotReadMayBeNull) {
  for (const Rule& r : AllRules()) {
    RProblem pb({B16, B16, F32, F16, F32}, {300, 0, 4000});
    pb.Init(71);
    const auto before = pb.Snapshot();
    precis_step_config_t cfg = r.Config();
    Tables tb = pb.Whole();
    precis_step_tensors_t t = pb.Desc(cfg, tb);
    ASSERT_EQ(t.exp_avg_sqs, nullptr);
    t.exp_avg_sq_dtype = static_cast<precis_dtype_t>(42);  // unread
    if (!r.HasM()) {
      ASSERT_EQ(t.exp_avgs, nullptr);
      t.exp_avg_dtype = I16;  // unread
    }
    if (!r.WritesParams()) t.masters = nullptr;
    EXPECT_EQ(precis_step(&cfg, &t, nullptr), PRECIS_OK) << r.name << ": " << precis_last_error();
    EXPECT_STREQ(precis_last_error(), "");
    EXPECT_FALSE(pb.Snapshot() == before) << r.name;
  }
}

// SGD without momentum neither reads nor writes exp_avgs when they are given.
TEST(Rules, SgdWithoutMomentumLeavesExpAvgsAlone) {
  RProblem pb({B16, B16, F32, F8, F32}, {300, 4000});
  pb.Init(72);
  const RProblem start = pb;
  precis_step_config_t cfg = kSgdRules[1].Config();
  Tables tb = pb.Whole();
  precis_step_tensors_t t = pb.Desc(cfg, tb);
  t.exp_avgs = tb.ms.data();
  t.exp_avg_scales = tb.m_scales.data();
  ASSERT_EQ(precis_step(&cfg, &t, nullptr), PRECIS_OK) << precis_last_error();
  RProblem without = start;
  ASSERT_EQ(without.Step(cfg), PRECIS_OK) << precis_last_error();
  for (size_t k = 0; k < pb.ts.size(); ++k) {
    EXPECT_EQ(pb.ts[k].m, start.ts[k].m);
    EXPECT_EQ(pb.ts[k].m_scales, start.ts[k].m_scales);
  }
  EXPECT_TRUE(pb.Snapshot() == without.Snapshot());
}

// ---- (f) Adam -------------------------------------------------------------------------------

// A config whose size ends before `rule` (an older caller's) is Adam whatever the
// bytes there; rule 0 is Adam.
TEST(Rules, AnOlderConfigIsAdam) {
  RProblem a({B16, B16, F32, B16, F32}, {127, 4097});
  a.Init(81);
  RProblem b = a;
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.weight_decay = 0.01;
  ASSERT_EQ(a.Step(cfg), PRECIS_OK) << precis_last_error();
  precis_step_config_t old = cfg;
  old.size = offsetof(precis_step_config_t, rule);
  old.rule = kSgd;  // not covered by size: never read
  old.nesterov = 5;
  Tables tb = b.Whole();
  precis_step_tensors_t t = b.Desc(cfg, tb);  // with exp_avg_sqs, as Adam's
  ASSERT_EQ(precis_step(&old, &t, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_TRUE(a.Snapshot() == b.Snapshot());
  EXPECT_FALSE(a.ts[0].v == std::vector<uint8_t>(a.ts[0].v.size(), 0));  // v moved: Adam
}

// A NaN or Inf element of a param (a step lost it) where no L2 term is taken (weight
// decay 0, or decoupled): torch adds none, so m (and Adam's v) stay finite on every path
// and layout, and the other elements step as without the lost ones. They were NaN
// (g + 0 * NaN): a param whose lost elements are set again could not step on.
TEST(Rules, ALostParamLeavesItsStateFiniteOnEveryPath) {
  const Rule sgd = Sgd("momentum_no_wd", 1e-2, 0.9, 0.0, false, 0.0, false, false);
  const Rule sgdw = Sgd("momentum_decoupled", 1e-2, 0.9, 0.0, true, 0.1, true, false);
  Rule adamw = sgdw;  // (betas 0.9, 0.999)
  adamw.name = "adamw";
  adamw.rule = kAdam;
  adamw.momentum = 0.0;
  adamw.nesterov = false;
  const float lost[] = {NAN, INFINITY, -INFINITY};
  for (const std::string& path : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    for (const Layout& L : {kFp32, Layout{B16, B16, F32, F8, B16}, Layout{B16, B16, I16, B16, B16}})
      for (const Rule& r : {sgd, sgdw, adamw}) {
        RProblem pb(L, {1, 127, 4097}), clean(L, {1, 127, 4097});
        pb.Init(91);
        clean.Init(91);
        for (RTensor& t : pb.ts)
          for (int64_t i = 0; i < t.n; i += 61) pb.SetMaster(t, i, lost[(i / 61) % 3]);
        for (int step = 0; step < 2; ++step) {
          pb.NewGrads(92 + step);
          clean.NewGrads(92 + step);
          ASSERT_EQ(pb.Step(r.Config()), PRECIS_OK) << precis_last_error();
          ASSERT_EQ(clean.Step(r.Config()), PRECIS_OK) << precis_last_error();
        }
        for (size_t k = 0; k < pb.ts.size(); ++k) {
          const std::string what = path + " " + r.name + " " + LayoutName(L) + " tensor " +
                                   std::to_string(k);
          EXPECT_EQ(pb.ts[k].m, clean.ts[k].m) << what;  // (m never reads the param)
          EXPECT_EQ(pb.ts[k].m_scales, clean.ts[k].m_scales) << what;
          EXPECT_EQ(pb.ts[k].v, clean.ts[k].v) << what;
          for (int64_t i = 0; i < pb.ts[k].n; ++i) {
            if (i % 61 == 0) {
              EXPECT_FALSE(std::isfinite(pb.Master(pb.ts[k], i))) << what << " element " << i;
            } else {
              ASSERT_EQ(precis_f32_bits(pb.Master(pb.ts[k], i)),
                        precis_f32_bits(clean.Master(clean.ts[k], i)))
                  << what << " element " << i;
            }
          }
        }
      }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// The rule table (rules.h, pr_rules) names the rules, and every message that lists them
// is built from it; a range closed at its end (Lion's betas, [0, 1]) takes that end.
TEST(RuleTable, NamesAndTheMessagesThatListRulesComeFromIt) {
  const char* const names[] = {"adam", "sgd", "lion", "muon_momentum"};
  static_assert(sizeof names / sizeof names[0] == PRECIS_RULE_COUNT, "a rule without a name");
  for (int r = 0; r < PRECIS_RULE_COUNT; ++r) {
    const char* name = nullptr;
    ASSERT_EQ(precis_rule_name(r, &name), PRECIS_OK) << precis_last_error();
    EXPECT_STREQ(name, names[r]);
  }
  const char* name = nullptr;
  EXPECT_EQ(precis_rule_name(PRECIS_RULE_COUNT, &name), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(precis_last_error(),
               "precis_rule_name: rule is 4; accepted: 0 (adam), 1 (sgd), 2 (lion), 3 "
               "(muon_momentum)");
  EXPECT_EQ(precis_rule_name(0, nullptr), PRECIS_ERR_NULL_POINTER);

  precis_step_tensors_t empty = PRECIS_STEP_TENSORS_INIT;
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.rule = 9;
  EXPECT_EQ(precis_step(&cfg, &empty, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(precis_last_error(),
               "precis_step: cfg->rule is 9; accepted: 0 (adam), 1 (sgd), 2 (lion), 3 "
               "(muon_momentum)");
  cfg.rule = PRECIS_RULE_LION;
  cfg.beta1 = cfg.beta2 = 1.0;  // closed: taken
  EXPECT_EQ(precis_step(&cfg, &empty, nullptr), PRECIS_OK) << precis_last_error();
  cfg.beta2 = std::nextafter(1.0, 2.0);
  EXPECT_EQ(precis_step(&cfg, &empty, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(precis_last_error(),
               "precis_step: cfg->beta2 is 1.0000000000000002; must be in [0, 1]");
  cfg.rule = PRECIS_RULE_ADAM;
  cfg.beta2 = 0.999;  // beta1 1: open for Adam
  EXPECT_EQ(precis_step(&cfg, &empty, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(precis_last_error(), "precis_step: cfg->beta1 is 1; must be in [0, 1)");
  cfg.rule = PRECIS_RULE_SGD;
  cfg.beta1 = 0.9;
  cfg.dampening = -HUGE_VAL;  // any finite dampening: not this
  EXPECT_EQ(precis_step(&cfg, &empty, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(precis_last_error(), "precis_step: cfg->dampening is -inf; must be finite");
  cfg.dampening = -3.5;
  EXPECT_EQ(precis_step(&cfg, &empty, nullptr), PRECIS_OK) << precis_last_error();
}

// A rule's own hyperparameters (cfg->rule_hyper) reach its constants rounded to float,
// as the config's other fields do; a rule refuses an entry past those it takes (the
// table's count: muon_momentum takes one, its momentum form; the others none), NaN too;
// a config too small to hold them (an older caller's) gives zeros, and its bytes past its
// size are never read.
TEST(RuleTable, RuleHyperReachesTheConstantsAndARuleRefusesWhatItDoesNotTake) {
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.rule = PRECIS_RULE_LION;
  cfg.rule_hyper[0] = 0.1;
  cfg.rule_hyper[3] = -2.5;
  const precis_step_hyper_t h = precis_step_hyper_from_config(&cfg);
  EXPECT_EQ(h.rule_hyper[0], 0.1);
  EXPECT_EQ(h.rule_hyper[3], -2.5);
  const precis_step_consts_t c = precis_step_consts_make(&h, 3);
  EXPECT_EQ(c.rule_consts[0], 0.1f);
  EXPECT_EQ(c.rule_consts[1], 0.0f);
  EXPECT_EQ(c.rule_consts[3], -2.5f);

  precis_step_tensors_t empty = PRECIS_STEP_TENSORS_INIT;
  for (int rule = 0; rule < PRECIS_RULE_COUNT; ++rule) {
    precis_step_config_t r = PRECIS_STEP_CONFIG_INIT;
    r.rule = rule;
    r.momentum = rule == PRECIS_RULE_SGD || rule == PRECIS_RULE_MUON_MOMENTUM ? 0.5 : 0.0;
    EXPECT_EQ(precis_step(&r, &empty, nullptr), PRECIS_OK) << precis_last_error();
    r.rule_hyper[2] = NAN;
    EXPECT_EQ(precis_step(&r, &empty, nullptr), PRECIS_ERR_INVALID_ARGUMENT) << rule;
    const int takes = rule == PRECIS_RULE_MUON_MOMENTUM ? 1 : 0;
    EXPECT_EQ(pr_rules[rule].rule_hyper, takes) << rule;
    const std::string want = std::string("precis_step: cfg->rule_hyper[2] is nan; rule ") +
                             pr_rule_name(rule) + " takes " + std::to_string(takes) +
                             " of them (the rest 0)";
    EXPECT_EQ(precis_last_error(), want);
  }

  // An older caller's struct, which ends before rule_hyper: what lies past its size is
  // garbage the step must not read.
  struct Older {
    precis_step_config_t cfg;
  } older;
  std::memset(&older, 0x7f, sizeof older);  // rule_hyper: huge values
  older.cfg = PRECIS_STEP_CONFIG_INIT;
  std::memset(older.cfg.rule_hyper, 0x7f, sizeof older.cfg.rule_hyper);
  older.cfg.size = offsetof(precis_step_config_t, rule_hyper);
  older.cfg.rule = PRECIS_RULE_LION;
  EXPECT_EQ(precis_step(&older.cfg, &empty, nullptr), PRECIS_OK) << precis_last_error();
  const precis_step_hyper_t ho = precis_step_hyper_from_config(&older.cfg);
  for (double x : ho.rule_hyper) EXPECT_EQ(x, 0.0);
}

}  // namespace
