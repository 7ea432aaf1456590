// Tests of the fused CPU Adam/AdamW (precis_step) and its helpers:
// every dtype combination against a double-precision reference, remainders,
// stochastic rounding, found-inf skips and precis_step_check_finite, scaled
// moments, SIMD paths, bad inputs.
#include <gtest/gtest.h>
#include <omp.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef PR_SVE_GET_VL  // the kernel's ABI values (Linux 4.15)
#define PR_SVE_GET_VL 51
#define PR_SVE_VL_LEN_MASK 0xffff
#endif
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "step_cpu.h"
#include "rules.h"
#include "stores.h"
#include "mkl_sqrt.h"
#include "precis/precis.h"
#include "precis_convert.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

float FromBits(uint32_t u) { return precis_bits_f32(u); }
uint32_t Bits(float f) { return precis_f32_bits(f); }

// ---- one problem: a list of tensors and their state ------------------------

struct Tensor {
  int64_t n = 0;
  int64_t step = 0;  // steps done so far
  std::vector<uint8_t> param, grad, master, m, v, vmax;  // vmax: AMSGrad's running max
  std::vector<float> m_scales, v_scales, vmax_scales;
};

// The pointer tables (AdamTables) are handed to the kernel.
struct Problem : AdamTables {
  Combo c{};
  bool ams = false;  // AMSGrad: tensors carry a running max of v
  std::vector<Tensor> ts;

  Problem(const Combo& combo, const std::vector<int64_t>& sizes, bool amsgrad = false)
      : c(combo), ams(amsgrad) {
    for (int64_t n : sizes) {
      Tensor t;
      t.n = n;
      t.param.assign(n * DSize(c.pd), 0);
      t.grad.assign(n * DSize(c.gd), 0);
      if (ModeOf(c) != kNone) t.master.assign(n * DSize(c.md), 0);
      t.m.assign(n * DSize(c.ed), 0);
      t.v.assign(n * DSize(c.sd), 0);
      if (Scaled(c.ed)) t.m_scales.assign(Blocks(n), 0.0f);
      if (Scaled(c.sd)) t.v_scales.assign(Blocks(n), 0.0f);
      if (ams) t.vmax.assign(n * DSize(c.sd), 0);
      if (ams && Scaled(c.sd)) t.vmax_scales.assign(Blocks(n), 0.0f);
      ts.push_back(std::move(t));
    }
  }

  precis_step_tensors_t Desc() {
    Clear();
    for (Tensor& t : ts) {
      Add(t.param.data(), t.grad.data(), t.master.empty() ? nullptr : t.master.data(), t.m.data(),
          t.v.data(), t.m_scales.empty() ? nullptr : t.m_scales.data(),
          t.v_scales.empty() ? nullptr : t.v_scales.data(), t.n, t.step + 1);
      if (ams) AddMax(t.vmax.data(), t.vmax_scales.empty() ? nullptr : t.vmax_scales.data());
    }
    return Describe(c);
  }

  precis_status_t Step(const precis_step_config_t& cfg, int32_t* found_inf = nullptr) {
    precis_step_tensors_t d = Desc();
    precis_status_t st = precis_step(&cfg, &d, found_inf);
    bool skipped = found_inf != nullptr && *found_inf;
    if (st == PRECIS_OK && !skipped)
      for (Tensor& t : ts) ++t.step;
    return st;
  }

  // The fp32 master value of element i of tensor k.
  float Master(const Tensor& t, int64_t i) const {
    return MasterValue(t.param, t.master, ModeOf(c), c.pd, c.md, i);
  }

  void SetMaster(Tensor& t, int64_t i, float x) {
    SetMasterValue(t.param, t.master, ModeOf(c), c.pd, c.md, i, x);
  }

  // Moment `which` (0: m, 1: v, 2: AMSGrad's max of v) of t, decoded.
  std::vector<float> Moment(const Tensor& t, int which) const {
    const uint8_t* stored[3] = {t.m.data(), t.v.data(), t.vmax.data()};
    const float* scales[3] = {t.m_scales.data(), t.v_scales.data(), t.vmax_scales.data()};
    std::vector<float> out(t.n);
    EXPECT_EQ(precis_moment_decode(stored[which], scales[which], t.n, which != 0,
                                   which ? c.sd : c.ed, out.data()),
              PRECIS_OK);
    return out;
  }

  void SetMoment(Tensor& t, int which, const std::vector<float>& x) {
    uint8_t* stored[3] = {t.m.data(), t.v.data(), t.vmax.data()};
    float* scales[3] = {t.m_scales.data(), t.v_scales.data(), t.vmax_scales.data()};
    ASSERT_EQ(precis_moment_encode(x.data(), t.n, which != 0, stored[which], which ? c.sd : c.ed,
                                   scales[which]),
              PRECIS_OK);
  }

  void SetGrads(std::mt19937_64& rng, float scale) {
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (Tensor& t : ts)
      for (int64_t i = 0; i < t.n; ++i) {
        float g = nd(rng);
        if (std::fabs(g) < 1e-3f) g = 1e-3f;  // non-zero
        Encode(t.grad, c.gd, i, g * scale);
      }
  }

  void Init(std::mt19937_64& rng, float grad_scale = 1.0f) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> st(0, 9);
    for (Tensor& t : ts) {
      t.step = st(rng);
      std::vector<float> m(t.n), v(t.n), vmax(t.n);
      for (int64_t i = 0; i < t.n; ++i) {
        SetMaster(t, i, u(rng));
        m[i] = 0.01f * nd(rng);
        float r = 0.03f * nd(rng);
        v[i] = r * r + 1e-6f;
        vmax[i] = v[i] * (0.5f + 1.5f * std::fabs(u(rng)));  // above v or (as loaded) below
      }
      if (t.step == 0) {
        for (auto* x : {&m, &v, &vmax}) std::fill(x->begin(), x->end(), 0.0f);
      }
      SetMoment(t, 0, m);
      SetMoment(t, 1, v);
      if (ams) SetMoment(t, 2, vmax);
    }
    SetGrads(rng, grad_scale);
  }

  // As Init, from an integer hash of (seed, element) only: no libm, no <random>
  // distributions, so every architecture starts from the same bits.
  void InitHashed(uint32_t seed) {
    uint32_t k = seed;
    auto u = [&k]() {  // uniform in [-1, 1), exactly
      k = precis_hash32(k + 0x9E3779B9u);
      return static_cast<float>(static_cast<int32_t>(k >> 8) - (1 << 23)) * 0x1p-23f;
    };
    for (Tensor& t : ts) {
      t.step = static_cast<int64_t>(precis_hash32(k++) % 10);
      std::vector<float> m(t.n), v(t.n), vmax(t.n);
      for (int64_t i = 0; i < t.n; ++i) {
        SetMaster(t, i, u());
        m[i] = 0.01f * u();
        float r = 0.03f * u();
        v[i] = r * r + 1e-6f;
        vmax[i] = v[i] * (0.5f + 1.5f * std::fabs(u()));
        float g = 0.1f * u();
        Encode(t.grad, c.gd, i, g == 0.0f ? 1e-3f : g);
      }
      if (t.step == 0) {
        for (auto* x : {&m, &v, &vmax}) std::fill(x->begin(), x->end(), 0.0f);
      }
      SetMoment(t, 0, m);
      SetMoment(t, 1, v);
      if (ams) SetMoment(t, 2, vmax);
    }
  }

  std::vector<std::vector<uint8_t>> Snapshot() const {
    std::vector<std::vector<uint8_t>> s;
    auto f = [](const std::vector<float>& x) {
      std::vector<uint8_t> b(x.size() * 4);
      if (!x.empty()) std::memcpy(b.data(), x.data(), b.size());
      return b;
    };
    for (const Tensor& t : ts) {
      s.push_back(t.param), s.push_back(t.grad), s.push_back(t.master);
      s.push_back(t.m), s.push_back(t.v), s.push_back(f(t.m_scales)), s.push_back(f(t.v_scales));
      s.push_back(t.vmax), s.push_back(f(t.vmax_scales));
    }
    return s;
  }
};

// ---- the double-precision reference and tolerances -------------------------

struct Hyper {
  double lr, beta1, beta2, eps, wd;
  bool decoupled, maximize;
  double inv_grad_scale;
  precis_step_config_t Config() const {
    precis_step_config_t c = PRECIS_STEP_CONFIG_INIT;
    c.lr = lr;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.eps = eps;
    c.weight_decay = wd;
    c.decoupled_weight_decay = decoupled;
    c.maximize = maximize;
    c.inv_grad_scale = static_cast<float>(inv_grad_scale);
    return c;
  }
};

const Hyper kHypers[] = {
    {1e-3, 0.9, 0.999, 1e-8, 0.01, true, false, 1.0},         // AdamW
    {2e-3, 0.9, 0.999, 1e-8, 0.1, false, true, 1.0},          // Adam + L2, maximize
    {1e-2, 0.9, 0.999, 1e-8, 0.0, true, false, 1.0 / 1024},   // unscaling
    {1e-3, 0.8, 0.95, 1e-6, 0.0, false, false, 1.0},          // other betas
};

struct Ref {
  double p, m, v, upd;
  double m_terms, v_terms;  // magnitudes of the summed terms, for fp32 rounding slack
};

Ref Reference(const Hyper& h, int64_t step, double p, double m, double v, double g) {
  Ref r{};
  g *= h.inv_grad_scale;
  if (h.maximize) g = -g;
  double g_terms = std::fabs(g);  // before any cancellation with the L2 term
  if (h.decoupled) {
    p *= 1.0 - h.lr * h.wd;
  } else {
    g += h.wd * p;
    g_terms += std::fabs(h.wd * p);
  }
  r.m_terms = std::fabs(h.beta1 * m) + (1 - h.beta1) * g_terms;
  r.v_terms = std::fabs(h.beta2 * v) + (1 - h.beta2) * g_terms * g_terms;
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  double denom = std::sqrt(v) / std::sqrt(bc2) + h.eps;
  r.upd = h.lr / bc1 * m / denom;
  r.p = p - r.upd;
  r.m = m;
  r.v = v;
  return r;
}

// AMSGrad: r's update again, with the denominator from vmax (the running max).
void AmsgradReference(const Hyper& h, int64_t step, double vmax, Ref* r) {
  double bc1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  double bc2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  double decayed = r->p + r->upd;
  r->upd = h.lr / bc1 * r->m / (std::sqrt(vmax) / std::sqrt(bc2) + h.eps);
  r->p = decayed - r->upd;
}

double Ulp(double x, int mant_bits) {  // spacing of a float format with mant_bits stored bits
  int e;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);
  return std::ldexp(1.0, e - 1 - mant_bits);
}

// Storage error of a moment value (x = |m| or v; for scaled second moments the
// comparison is in the sqrt domain, x = sqrt(v)) in a block whose amax is amax.
// How far a stored moment may be from the value it stores: half a spacing when
// rounded to nearest, a whole one when rounded stochastically (either
// neighbour); sr is precis_moment_store_sr's answer for the store.
double MomentTol(precis_dtype_t d, bool second, double x, double amax, bool sr) {
  const int half = sr ? 0 : 1;  // extra halving of a spacing for round to nearest
  switch (d) {
    case F32:
      return 0;
    case B16:
      return x * std::ldexp(1.0, -7 - half);
    case F16:  // 11 bits; subnormal step 2^-24 of s; never-zero rounds up a step
      return x * std::ldexp(1.0, -10 - half) +
             amax / 65504.0 * std::ldexp(1.0, second || sr ? -24 : -25);
    case F8:
      if (second) {  // v8: 6 bits; subnormal step 2^-5 of s = amax / 126
        return x * std::ldexp(1.0, -5 - half) + amax / PRECIS_V8_MAX * std::ldexp(1.0, -5);
      }
      // m8 (E2M5): 6 bits; subnormal step 2^-5 of s = amax / 7.875
      return x * std::ldexp(1.0, -5 - half) + amax / PRECIS_M8_MAX * std::ldexp(1.0, sr ? -5 : -6);
    default:
      return 0;
  }
}

// precis_moment_store_sr for the test's dtype codes.
bool StoreSr(precis_dtype_t d, bool second) {
  return precis_moment_store_sr(d, second ? 1 : 0, PRECIS_RULE_ADAM) != 0;
}

const double kArith = 4e-7;  // fp32 arithmetic slack, relative to the summed terms

// One step of p on every tensor, each element checked against the reference
// computed from the kernel's own state before the step. With AMSGrad the new
// max is the max of the stored v (checked against the reference first) and the
// stored max before the step (precis.h), and the update takes its denominator.
void CheckOneStep(Problem& pb, const Hyper& h, const std::string& what) {
  struct Before {
    std::vector<float> p, m, v, vmax, g;
  };
  std::vector<Before> before;
  for (const Tensor& t : pb.ts) {
    Before b;
    b.m = pb.Moment(t, 0);
    b.v = pb.Moment(t, 1);
    if (pb.ams) b.vmax = pb.Moment(t, 2);
    for (int64_t i = 0; i < t.n; ++i) {
      b.p.push_back(pb.Master(t, i));
      b.g.push_back(static_cast<float>(Decode(t.grad, pb.c.gd, i)));
    }
    before.push_back(std::move(b));
  }
  precis_step_config_t cfg = h.Config();
  cfg.seed = 1234;
  cfg.amsgrad = pb.ams;
  ASSERT_EQ(pb.Step(cfg), PRECIS_OK) << precis_last_error();

  const Combo& c = pb.c;
  for (size_t k = 0; k < pb.ts.size(); ++k) {
    const Tensor& t = pb.ts[k];
    const Before& b = before[k];
    std::vector<float> m = pb.Moment(t, 0), v = pb.Moment(t, 1);
    std::vector<float> vmax = pb.ams ? pb.Moment(t, 2) : std::vector<float>();
    std::vector<Ref> ref(t.n);
    std::vector<double> want_max(pb.ams ? t.n : 0);
    // amax per block: of |m|, sqrt(v), sqrt(max)
    std::vector<double> block_m(Blocks(t.n), 0.0), block_r(Blocks(t.n), 0.0),
        block_x(Blocks(t.n), 0.0);
    for (int64_t i = 0; i < t.n; ++i) {
      ref[i] = Reference(h, t.step, b.p[i], b.m[i], b.v[i], b.g[i]);
      if (pb.ams) {
        want_max[i] = std::max<double>(b.vmax[i], v[i]);
        AmsgradReference(h, t.step, want_max[i], &ref[i]);
        double& ax = block_x[i / PRECIS_SCALE_BLOCK];
        ax = std::max(ax, std::sqrt(want_max[i]));
      }
      double& am = block_m[i / PRECIS_SCALE_BLOCK];
      double& ar = block_r[i / PRECIS_SCALE_BLOCK];
      am = std::max(am, std::fabs(ref[i].m));
      ar = std::max(ar, std::sqrt(ref[i].v));
    }
    int failures = 0;
    for (int64_t i = 0; i < t.n && failures < 5; ++i) {
      const Ref& r = ref[i];
      double amax_m = block_m[i / PRECIS_SCALE_BLOCK], amax_r = block_r[i / PRECIS_SCALE_BLOCK];
      // master / param
      double p = pb.Master(t, i);
      double tol_p = 2 * Ulp(b.p[i], 23) + 1e-5 * std::fabs(r.upd);
      Mode mode = ModeOf(c);
      precis_dtype_t stored = mode == kSeparate ? c.md : c.pd;
      if (mode != kRemainder && mode != kRemainder8 && stored == F16) {
        tol_p += Ulp(r.p, 10) / 2 + std::ldexp(1.0, -25);
      }
      if (mode == kRemainder8) tol_p += Ulp(r.p, 15) / 2;  // a 24-bit master, to nearest
      if (mode == kNone && stored == B16) tol_p += Ulp(r.p, 7);  // stochastic: either neighbour
      bool ok = std::fabs(p - r.p) <= tol_p;
      // first moment
      double tol_m = kArith * r.m_terms + MomentTol(c.ed, false, std::fabs(r.m), amax_m, StoreSr(c.ed, false)) * 1.01;
      ok = ok && std::fabs(m[i] - r.m) <= tol_m;
      // second moment (sqrt domain when scaled)
      if (Scaled(c.sd)) {
        double tol_r = kArith * std::sqrt(r.v_terms) + MomentTol(c.sd, true, std::sqrt(r.v), amax_r, true) * 1.01;
        ok = ok && std::fabs(std::sqrt(static_cast<double>(v[i])) - std::sqrt(r.v)) <= tol_r;
      } else {
        double tol_v = kArith * r.v_terms + MomentTol(c.sd, true, r.v, 0, true) * 1.01;
        ok = ok && std::fabs(v[i] - r.v) <= tol_v;
      }
      // AMSGrad's max: exactly one of the two stored values, or re-encoded in its scales
      if (pb.ams && Scaled(c.sd)) {
        double x = std::sqrt(want_max[i]);
        double tol_x = MomentTol(c.sd, true, x, block_x[i / PRECIS_SCALE_BLOCK], false) * 1.01;
        ok = ok && std::fabs(std::sqrt(static_cast<double>(vmax[i])) - x) <= tol_x;
      } else if (pb.ams) {
        ok = ok && vmax[i] == want_max[i];
      }
      // the param is the rounding of the master
      if (mode == kSeparate) {
        std::vector<uint8_t> want(DSize(c.pd));
        Encode(want, c.pd, 0, static_cast<float>(p));
        ok = ok && std::memcmp(want.data(), &t.param[i * DSize(c.pd)], want.size()) == 0;
      }
      if (!ok) {
        ++failures;
        ADD_FAILURE() << what << " tensor " << k << " element " << i << " step " << t.step
                      << ": p " << p << " want " << r.p << " (tol " << tol_p << ", p_in " << b.p[i]
                      << ") m " << m[i] << " want " << r.m << " (tol " << tol_m << ") v " << v[i]
                      << " want " << r.v << " g " << b.g[i]
                      << (pb.ams ? " max " + std::to_string(vmax[i]) + " want " +
                                       std::to_string(want_max[i])
                                 : std::string());
      }
    }
  }
}

// ---- every dtype combination ----------------------------------------------

class AdamCombo : public ::testing::TestWithParam<Combo> {};

TEST_P(AdamCombo, MatchesDoubleReference) {
  const Combo c = GetParam();
  // Two of the four hyperparameter sets per combination, rotating, so that
  // every set meets every dtype in some combination.
  const std::vector<Combo> all = AllCombos();
  size_t index = 0;
  while (index < all.size() && std::memcmp(&all[index], &c, sizeof c) != 0) ++index;
  for (size_t hi : {index % 4, (index + 1) % 4}) {
    const Hyper& h = kHypers[hi];
    std::mt19937_64 rng(1000 + hi);
    Problem pb(c, {1, 127, 4097});
    float gscale = static_cast<float>(1.0 / h.inv_grad_scale);
    pb.Init(rng, gscale);
    for (int s = 0; s < 3; ++s) {
      CheckOneStep(pb, h, ComboName(c) + " hyper " + std::to_string(hi));
      if (HasFailure()) return;
      pb.SetGrads(rng, gscale);
    }
  }
}

TEST_P(AdamCombo, AmsgradMatchesDoubleReference) {
  const Combo c = GetParam();
  const std::vector<Combo> all = AllCombos();
  size_t index = 0;
  while (index < all.size() && std::memcmp(&all[index], &c, sizeof c) != 0) ++index;
  const Hyper& h = kHypers[index % 4];
  std::mt19937_64 rng(2000 + index);
  Problem pb(c, {1, 127, 4097}, true);
  float gscale = static_cast<float>(1.0 / h.inv_grad_scale);
  pb.Init(rng, gscale);
  Tensor& t = pb.ts[2];
  if (t.step == 0) {  // mid-training instead (Init gives step 0 zero moments)
    t.step = 3;
    std::vector<float> m(t.n, 1e-3f), v(t.n, 1e-4f), vmax(t.n);
    for (int64_t i = 0; i < t.n; ++i) vmax[i] = i % 3 ? 2e-4f : 5e-5f;
    pb.SetMoment(t, 0, m);
    pb.SetMoment(t, 1, v);
    pb.SetMoment(t, 2, vmax);
  }
  // Then small gradients: v decays below the max, which sets the denominator.
  for (int s = 0; s < 4; ++s) {
    CheckOneStep(pb, h, ComboName(c) + " amsgrad hyper " + std::to_string(index % 4));
    if (HasFailure()) return;
    pb.SetGrads(rng, gscale * 0.01f);
  }
  // The max is not v after all: it kept larger values.
  std::vector<float> v = pb.Moment(t, 1), vmax = pb.Moment(t, 2);
  int64_t above = 0;
  for (int64_t i = 0; i < t.n; ++i) above += vmax[i] > v[i];
  EXPECT_GT(above, t.n / 2);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AdamCombo, ::testing::ValuesIn(AllCombos()),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           return ComboName(info.param);
                         });

TEST(Adam, LargeFp32AndScaledTensors) {
  const Combo combos[] = {{F32, F32, F32, F32, F32}, {B16, B16, F32, F8, F16}};
  for (const Combo& c : combos) {
    std::mt19937_64 rng(7);
    Problem pb(c, {1000003, 3000});
    pb.Init(rng);
    for (int s = 0; s < 2; ++s) {
      CheckOneStep(pb, kHypers[0], ComboName(c) + " large");
      pb.SetGrads(rng, 1.0f);
    }
  }
}

// The fp32 path repeats torch 2.13's CPU operations exactly (_single_tensor_adam
// with Python-float hyperparameters, AVX2/AVX512 kernels and their contracted
// scalar tails), so a float re-enactment of them must agree bit for bit over
// many steps. sqrt_fn: the square root both sides take (NULL: IEEE).
void CheckBitExactWithTorchOrder(double lr, double b1, double b2, double eps, double wd,
                                 bool lr_float32, precis_sqrt_fn_t sqrt_fn) {
  const int n = 5000;
  for (int decoupled = 0; decoupled <= 1; ++decoupled) {
    SCOPED_TRACE("decoupled " + std::to_string(decoupled) + " beta1 " + std::to_string(b1) +
                 (lr_float32 ? " float32 lr" : ""));
    std::mt19937_64 rng(3);
    Problem pb({F32, F32, F32, F32, F32}, {n});
    pb.Init(rng);
    for (Tensor& t : pb.ts) t.step = 0;
    std::vector<float> zero(n, 0.0f);
    pb.SetMoment(pb.ts[0], false, zero);
    pb.SetMoment(pb.ts[0], true, zero);
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), root(n);
    for (int i = 0; i < n; ++i) p[i] = pb.Master(pb.ts[0], i);
    precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
    cfg.lr = lr, cfg.beta1 = b1, cfg.beta2 = b2, cfg.eps = eps, cfg.weight_decay = wd;
    cfg.decoupled_weight_decay = decoupled;
    cfg.lr_float32 = lr_float32;
    cfg.cpu_sqrt = sqrt_fn;
    const float w = static_cast<float>(1 - b1);  // exp_avg.lerp_(grad, 1 - beta1)
    for (int step = 1; step <= 20; ++step) {
      pb.SetGrads(rng, 1.0f);
      std::vector<float> g(n);
      for (int i = 0; i < n; ++i) g[i] = static_cast<float>(Decode(pb.ts[0].grad, F32, i));
      ASSERT_EQ(pb.Step(cfg), PRECIS_OK);
      // Python: bias corrections with ** (libm pow), then float32 where torch rounds.
      const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
      const float bc2s = static_cast<float>(std::pow(1 - std::pow(b2, static_cast<double>(step)), 0.5));
      float decay = static_cast<float>(1 - lr * wd), neg_step = static_cast<float>(-(lr / bc1));
      if (lr_float32) {  // lr a float32 tensor: tensor arithmetic in float32
        const float lr32 = static_cast<float>(lr), wd32 = static_cast<float>(wd);
        const float lr_wd = lr32 * wd32;
        decay = 1.0f - lr_wd;
        neg_step = -(lr32 / static_cast<float>(bc1));
      }
      for (int i = 0; i < n; ++i) {
        float gi = g[i];
        if (decoupled) {
          p[i] = p[i] * decay;                                          // param.mul_(1 - lr*wd)
        } else {
          gi = std::fma(static_cast<float>(wd), p[i], gi);             // grad.add(param, alpha=wd)
        }
        const float d = gi - m[i];                                      // exp_avg.lerp_(g, w):
        m[i] = std::fabs(w) < 0.5f ? std::fma(w, d, m[i])               //   from m when w < 0.5,
                                   : std::fma(w - 1.0f, d, gi);         //   else from g
        const float vb = v[i] * static_cast<float>(b2);                 // exp_avg_sq.mul_(beta2)
        v[i] = std::fma(static_cast<float>(1 - b2) * gi, gi, vb);       //   .addcmul_(g, g, 1-b2)
      }
      if (sqrt_fn != nullptr) {
        sqrt_fn(v.data(), root.data(), n);
      } else {
        for (int i = 0; i < n; ++i) root[i] = std::sqrt(v[i]);
      }
      for (int i = 0; i < n; ++i) {
        const float denom = root[i] / bc2s + static_cast<float>(eps);  // (sqrt / bc2s).add_(eps)
        p[i] = p[i] + neg_step * m[i] / denom;                          // addcdiv_(m, denom, -step)
      }
      std::vector<float> km = pb.Moment(pb.ts[0], 0), kv = pb.Moment(pb.ts[0], 1);
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(pb.Master(pb.ts[0], i)), Bits(p[i])) << "step " << step << " i " << i;
        ASSERT_EQ(Bits(km[i]), Bits(m[i])) << "step " << step << " i " << i;
        ASSERT_EQ(Bits(kv[i]), Bits(v[i])) << "step " << step << " i " << i;
      }
    }
  }
}

TEST(Adam, Fp32BitExactWithTorchOrder) {
  CheckBitExactWithTorchOrder(1e-3, 0.9, 0.999, 1e-8, 0.01, false, nullptr);
  // Odd doubles (not float32 values), and a beta1 < 0.5: torch lerps from g.
  CheckBitExactWithTorchOrder(3.3e-4, 0.8765432109, 0.99912345678, 1e-7, 0.0123, false, nullptr);
  CheckBitExactWithTorchOrder(1.234567e-2, 0.3, 0.95, 1e-6, 0.05, false, nullptr);
  CheckBitExactWithTorchOrder(3.3e-4, 0.8765432109, 0.999, 1e-8, 0.0123, true, nullptr);
}

// A square root that is not IEEE's (one ulp low where the bits are odd), so
// that taking it or not shows.
void OddSqrt(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = Bits(std::sqrt(in[i]));
    out[i] = FromBits(u > 0 && u < 0x7F800000u ? u - (u & 1u) : u);
  }
}

TEST(Adam, CpuSqrtIsTakenForEverySquareRoot) {
  CheckBitExactWithTorchOrder(3.3e-4, 0.8765432109, 0.999, 1e-8, 0.0123, false, OddSqrt);
}

#if defined(__x86_64__)
// MKL's sqrt as csrc/mkl_sqrt.h rebuilds it (its AVX-512 kernel, or the generic
// one MKL runs on AMD), counting its calls: on a path that can run the
// emulation, the kernel sees (on its sample) that it gives the emulation's
// bits, then computes them inline and never calls it again.
int64_t mkl_like_calls = 0;
void MklZ0Sqrt(const float* in, float* out, int64_t n) {
  ++mkl_like_calls;
  precis_mkl_sqrt_avx512(in, out, n);
}
void MklExSqrt(const float* in, float* out, int64_t n) {
  ++mkl_like_calls;
  precis_mkl_sqrt_avx2(in, out, n);
}

struct MklKernel {
  const char* name;
  precis_sqrt_fn_t fn;
  const char* isa;  // the lowest path that runs it inline
};
const MklKernel kMklKernels[] = {{"z0", MklZ0Sqrt, "avx512"}, {"ex", MklExSqrt, "avx2"}};

class CpuSqrtMkl : public ::testing::TestWithParam<MklKernel> {};

TEST_P(CpuSqrtMkl, RunsInlineWithTheCalledBits) {
  const MklKernel k = GetParam();
  if (pr_cpu_isa_force(k.isa) != 0) GTEST_SKIP() << "no " << k.isa << " path on this CPU";
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
  mkl_like_calls = 0;
  CheckBitExactWithTorchOrder(3.3e-4, 0.8765432109, 0.999, 1e-8, 0.0123, false, k.fn);
  // 2 x 20 steps of the kernel, 2 x 20 reference calls, 1 sample check.
  EXPECT_EQ(mkl_like_calls, 2 * 20 + 1);
  // Every fused layout of Adam's (the rows of pr_fused_layouts with Adam's bit) takes it
  // inline too, in groups of 64 elements (no scaled moments, no amsgrad) or a tile at a
  // time (scaled moments, amsgrad), with the bits of the scalar path, which calls it once
  // per tile. The sizes leave groups and tiles part-full.
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.cpu_sqrt = k.fn;
  cfg.weight_decay = 0.0123;
  cfg.lr = 0.5;  // steps as large as the params: an ulp of sqrt(v) shows in the masters
  for (const Combo& c : {Combo{B16, B16, F32, B16, B16}, Combo{B16, B16, I16, B16, B16},
                         Combo{B16, B16, I16, F8, F8}, Combo{F32, F32, F32, F32, F32}}) {
    for (bool ams : {false, true}) {
      std::vector<std::vector<std::vector<uint8_t>>> results;
      cfg.amsgrad = ams;
      for (const char* path : {k.isa, "scalar"}) {
        ASSERT_EQ(pr_cpu_isa_force(path), 0);
        std::mt19937_64 rng(11);
        Problem pb(c, {1, 127, 4097, 2063}, ams);
        pb.Init(rng);
        mkl_like_calls = 0;
        ASSERT_EQ(pb.Step(cfg), PRECIS_OK);
        ASSERT_EQ(pb.Step(cfg), PRECIS_OK);
        if (std::string(path) == "scalar") {
          EXPECT_GT(mkl_like_calls, 0) << ComboName(c);
        } else {
          EXPECT_EQ(mkl_like_calls, 0) << ComboName(c);
        }
        results.push_back(pb.Snapshot());
      }
      EXPECT_TRUE(results[0] == results[1]) << ComboName(c) << (ams ? " amsgrad" : "");
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

INSTANTIATE_TEST_SUITE_P(Kernels, CpuSqrtMkl, ::testing::ValuesIn(kMklKernels),
                         [](const ::testing::TestParamInfo<MklKernel>& info) {
                           return std::string(info.param.name);
                         });
#endif

TEST(Adam, ConstantsAsTorchDerivesThem) {
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.lr = 3.3e-4, cfg.beta1 = 0.8765432109, cfg.beta2 = 0.99912345678, cfg.weight_decay = 0.0123;
  precis_step_hyper_t h = precis_step_hyper_from_config(&cfg);
  const precis_step_hyper_t h0 = h;
  EXPECT_EQ(h.beta2, 0.99912345678);  // doubles, as given
  precis_step_consts_t c = precis_step_consts_make(&h, 7);
  EXPECT_EQ(c.one_minus_beta2, static_cast<float>(1 - 0.99912345678));
  EXPECT_EQ(c.lerp_coef, static_cast<float>(1 - 0.8765432109));
  EXPECT_EQ(c.lerp_from_g, 0);
  EXPECT_EQ(c.decay, static_cast<float>(1 - 3.3e-4 * 0.0123));
  EXPECT_EQ(c.neg_step_size, static_cast<float>(-(3.3e-4 / (1 - std::pow(0.8765432109, 7.0)))));
  EXPECT_EQ(c.bias2_sqrt, static_cast<float>(std::pow(1 - std::pow(0.99912345678, 7.0), 0.5)));
  // the one-division form's reciprocal: of the float bias2_sqrt, in float
  EXPECT_EQ(c.inv_bias2_sqrt, 1.0f / c.bias2_sqrt);
  EXPECT_TRUE(precis_adam_torch_form(F32, F32));
  EXPECT_FALSE(precis_adam_torch_form(B16, F32));
  EXPECT_FALSE(precis_adam_torch_form(F32, F8));
  // The float32 path differs from the double one for this lr (so the flag matters).
  cfg.lr_float32 = 1;
  h = precis_step_hyper_from_config(&cfg);
  precis_step_consts_t c32 = precis_step_consts_make(&h, 5);
  c = precis_step_consts_make(&h0, 5);
  EXPECT_EQ(c32.neg_step_size, -(3.3e-4f / static_cast<float>(1 - std::pow(0.8765432109, 5.0))));
  EXPECT_NE(c32.neg_step_size, c.neg_step_size);
  // beta1 < 0.5: lerp from the end point with weight w - 1
  cfg.beta1 = 0.3;
  h = precis_step_hyper_from_config(&cfg);
  c = precis_step_consts_make(&h, 1);
  EXPECT_EQ(c.lerp_from_g, 1);
  EXPECT_EQ(c.lerp_coef, static_cast<float>(1 - 0.3) - 1.0f);
}

// ---- remainders --------------------------------------------------------------

TEST(Adam, RemaindersReproduceFp32MasterBitForBit) {
  std::mt19937_64 rng(11);
  Problem rem({B16, B16, I16, F32, F32}, {3000, 129});
  Problem sep({B16, B16, F32, F32, F32}, {3000, 129});
  Problem f32({F32, B16, F32, F32, F32}, {3000, 129});
  rem.Init(rng);
  for (size_t k = 0; k < rem.ts.size(); ++k) {
    for (Problem* q : {&sep, &f32}) {
      q->ts[k].step = rem.ts[k].step;
      q->ts[k].grad = rem.ts[k].grad;
      q->ts[k].m = rem.ts[k].m;
      q->ts[k].v = rem.ts[k].v;
      for (int64_t i = 0; i < rem.ts[k].n; ++i) q->SetMaster(q->ts[k], i, rem.Master(rem.ts[k], i));
    }
  }
  for (int s = 0; s < 10; ++s) {
    precis_step_config_t cfg = kHypers[s % 2].Config();
    ASSERT_EQ(rem.Step(cfg), PRECIS_OK);
    ASSERT_EQ(sep.Step(cfg), PRECIS_OK);
    ASSERT_EQ(f32.Step(cfg), PRECIS_OK);
    for (size_t k = 0; k < rem.ts.size(); ++k) {
      for (int64_t i = 0; i < rem.ts[k].n; ++i) {
        float want = f32.Master(f32.ts[k], i);
        ASSERT_EQ(Bits(rem.Master(rem.ts[k], i)), Bits(want)) << "step " << s << " i " << i;
        ASSERT_EQ(Bits(sep.Master(sep.ts[k], i)), Bits(want)) << "step " << s << " i " << i;
        // The bf16 param is the high half rounded by the low half's sign bit.
        uint16_t p;
        std::memcpy(&p, &rem.ts[k].param[i * 2], 2);
        EXPECT_EQ(p, static_cast<uint16_t>((Bits(want) >> 16) + ((Bits(want) >> 15) & 1)));
        EXPECT_LE(std::fabs(precis_bf16_to_f32(p) - want), Ulp(want, 7) / 2);
      }
    }
    for (Problem* q : {&rem, &sep, &f32}) {
      for (Tensor& t : q->ts) t.grad = rem.ts[0].n == t.n ? rem.ts[0].grad : rem.ts[1].grad;
    }
    rem.SetGrads(rng, 1.0f);
    for (size_t k = 0; k < rem.ts.size(); ++k) sep.ts[k].grad = f32.ts[k].grad = rem.ts[k].grad;
  }
}

TEST(Remainder, SplitJoinExactForAllPatterns) {
  // Every high half with a spread of low halves, incl. 0x0000, 0x7FFF, 0x8000, 0xFFFF.
  std::vector<float> master;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, (hi * 2654435761u) & 0xFFFFu})
      master.push_back(FromBits(hi << 16 | lo));
  int64_t n = static_cast<int64_t>(master.size());
  std::vector<uint16_t> p(n);
  std::vector<int16_t> r(n);
  std::vector<float> back(n);
  ASSERT_EQ(precis_remainder_split(master.data(), n, p.data(), r.data()), PRECIS_OK);
  ASSERT_EQ(precis_remainder_join(p.data(), r.data(), n, back.data()), PRECIS_OK);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = Bits(master[i]);
    ASSERT_EQ(Bits(back[i]), u) << i;
    ASSERT_EQ(p[i], static_cast<uint16_t>((u >> 16) + ((u & 0x8000u) ? 1 : 0))) << i;
    ASSERT_EQ(static_cast<uint16_t>(r[i]), u & 0xFFFFu) << i;
  }
}

TEST(Adam, EightBitRemaindersRoundTheFp32StepTo24Bits) {
  // From the same 24-bit master, a step with 8-bit remainders stores the fp32 master's
  // step rounded to nearest even at bit 8, and the param that value's bf16.
  std::mt19937_64 rng(12);
  Problem rem8({B16, B16, F8, F32, F32}, {3000, 129});
  Problem f32({F32, B16, F32, F32, F32}, {3000, 129});
  rem8.Init(rng);
  for (int s = 0; s < 10; ++s) {
    for (size_t k = 0; k < rem8.ts.size(); ++k) {
      Tensor& t = f32.ts[k];
      t.step = rem8.ts[k].step;
      t.grad = rem8.ts[k].grad;
      t.m = rem8.ts[k].m;
      t.v = rem8.ts[k].v;
      for (int64_t i = 0; i < t.n; ++i) f32.SetMaster(t, i, rem8.Master(rem8.ts[k], i));
    }
    precis_step_config_t cfg = kHypers[s % 2].Config();
    ASSERT_EQ(rem8.Step(cfg), PRECIS_OK);
    ASSERT_EQ(f32.Step(cfg), PRECIS_OK);
    for (size_t k = 0; k < rem8.ts.size(); ++k) {
      for (int64_t i = 0; i < rem8.ts[k].n; ++i) {
        const uint32_t u = Bits(f32.Master(f32.ts[k], i));
        const uint32_t want = (u + 0x7Fu + ((u >> 8) & 1u)) & 0xFFFFFF00u;
        ASSERT_EQ(Bits(rem8.Master(rem8.ts[k], i)), want) << "step " << s << " i " << i;
        uint16_t p;
        std::memcpy(&p, &rem8.ts[k].param[i * 2], 2);
        EXPECT_EQ(p, static_cast<uint16_t>((want >> 16) + ((want >> 15) & 1)));
      }
    }
    rem8.SetGrads(rng, 1.0f);
  }
}

TEST(Remainder, EightBitSplitRoundsTo24BitsAndJoinsExactly) {
  // Every high half with low halves around the rounding boundaries (ties to even both
  // ways, the carry into the high half and into the exponent), and NaN, inf, zero.
  std::vector<float> master;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x007Fu, 0x0080u, 0x0180u, 0x7F80u, 0x7FFFu, 0x8000u, 0xFF7Fu,
                        0xFF80u, 0xFFFFu, (hi * 2654435761u) & 0xFFFFu})
      master.push_back(FromBits(hi << 16 | lo));
  const int64_t n = static_cast<int64_t>(master.size());
  std::vector<uint16_t> p(n);
  std::vector<uint8_t> r(n);
  std::vector<float> back(n);
  ASSERT_EQ(precis_remainder8_split(master.data(), n, p.data(), r.data()), PRECIS_OK);
  ASSERT_EQ(precis_remainder8_join(p.data(), r.data(), n, back.data()), PRECIS_OK);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = Bits(master[i]);
    if (std::isnan(master[i])) {  // a quiet NaN of the same sign, never a carry
      ASSERT_TRUE(std::isnan(back[i])) << i;
      ASSERT_EQ(Bits(back[i]) >> 31, u >> 31) << i;
      continue;
    }
    const uint32_t want = (u + 0x7Fu + ((u >> 8) & 1u)) & 0xFFFFFF00u;  // to nearest even
    ASSERT_EQ(Bits(back[i]), want) << std::hex << u;
    ASSERT_EQ(p[i], static_cast<uint16_t>((want >> 16) + ((want >> 15) & 1))) << std::hex << u;
    ASSERT_EQ(r[i], (want >> 8) & 0xFFu) << std::hex << u;
    // Within half a 24-bit spacing of the master (finite and not rounded to inf).
    if (std::isfinite(back[i]) && std::fabs(master[i]) >= FLT_MIN) {
      ASSERT_LE(std::fabs(static_cast<double>(back[i]) - master[i]),
                std::ldexp(std::fabs(static_cast<double>(master[i])), -16)) << std::hex << u;
    }
  }
  // Bad arguments fail before anything is written.
  std::vector<uint16_t> p4(4, 7);
  std::vector<uint8_t> r4(4, 7);
  std::vector<float> f4(4, 1.0f);
  EXPECT_EQ(precis_remainder8_split(nullptr, 4, p4.data(), r4.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_STREQ(precis_last_error(), "precis_remainder8_split: master is NULL");
  EXPECT_EQ(precis_remainder8_split(f4.data(), -1, p4.data(), r4.data()),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_remainder8_join(p4.data(), nullptr, 4, f4.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_STREQ(precis_last_error(), "precis_remainder8_join: remainder is NULL");
  EXPECT_EQ(precis_remainder8_join(p4.data(), r4.data(), 4, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(p4, std::vector<uint16_t>(4, 7));
  EXPECT_EQ(r4, std::vector<uint8_t>(4, 7));
  EXPECT_EQ(f4, std::vector<float>(4, 1.0f));
}

// ---- stochastic rounding -------------------------------------------------------

Problem SrProblem(const std::vector<int64_t>& sizes, uint64_t seed_data) {
  std::mt19937_64 rng(seed_data);
  Problem pb({B16, B16, B16, F32, F32}, sizes);
  pb.Init(rng);
  return pb;
}

TEST(StochasticRounding, ReproducibleForASeedAndSeedMatters) {
  Problem a = SrProblem({100000, 3000}, 5), b = SrProblem({100000, 3000}, 5),
          c = SrProblem({100000, 3000}, 5);
  precis_step_config_t cfg = kHypers[0].Config();
  cfg.seed = 42;
  ASSERT_EQ(a.Step(cfg), PRECIS_OK);
  ASSERT_EQ(b.Step(cfg), PRECIS_OK);
  cfg.seed = 43;
  ASSERT_EQ(c.Step(cfg), PRECIS_OK);
  EXPECT_TRUE(a.Snapshot() == b.Snapshot());
  EXPECT_TRUE(a.ts[0].param != c.ts[0].param);
}

TEST(StochasticRounding, IndependentOfThreadCount) {
  int saved = omp_get_max_threads();
  std::vector<std::vector<std::vector<uint8_t>>> results;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    Problem pb = SrProblem({140001, 65536, 7, 70000}, 9);
    precis_step_config_t cfg = kHypers[0].Config();
    cfg.seed = 77;
    for (int s = 0; s < 3; ++s) ASSERT_EQ(pb.Step(cfg), PRECIS_OK);
    results.push_back(pb.Snapshot());
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < results.size(); ++i) EXPECT_TRUE(results[i] == results[0]) << i;
}

// An element's random numbers follow what it is (its param's stream, its index in
// the whole param), not how a call reaches it: the param stepped whole and cut
// into pieces, each handed with its stream and element offset, give the same bits.
// Pieces of scaled (fp16 / fp8) moments are cut at scale blocks, which follow the
// tensor handed in. A base offset of 2^32 - 300 puts a 2^32 boundary inside a
// tile; elements 2^32 apart share their numbers (the index's high bits are in
// no key), so a whole param at offset 2^32 rounds as one at offset 0.
struct Piece {
  int64_t begin, end;
};

void StepPieces(Problem& pb, const std::vector<Piece>& pieces, uint64_t stream, int64_t base,
                const precis_step_config_t& cfg) {
  const Combo& c = pb.c;
  Tensor& t = pb.ts[0];
  auto at = [](std::vector<uint8_t>& b, precis_dtype_t d, int64_t i) -> void* {
    return b.empty() ? nullptr : b.data() + i * DSize(d);
  };
  pb.Clear();
  std::vector<uint64_t> streams;
  std::vector<int64_t> offsets;
  for (const Piece& pc : pieces) {
    ASSERT_TRUE(!(Scaled(c.ed) || Scaled(c.sd)) || pc.begin % PRECIS_SCALE_BLOCK == 0);
    pb.Add(at(t.param, c.pd, pc.begin), at(t.grad, c.gd, pc.begin),
           at(t.master, c.md, pc.begin), at(t.m, c.ed, pc.begin), at(t.v, c.sd, pc.begin),
           t.m_scales.empty() ? nullptr : t.m_scales.data() + pc.begin / PRECIS_SCALE_BLOCK,
           t.v_scales.empty() ? nullptr : t.v_scales.data() + pc.begin / PRECIS_SCALE_BLOCK,
           pc.end - pc.begin, t.step + 1);
    streams.push_back(stream);
    offsets.push_back(base + pc.begin);
  }
  precis_step_tensors_t d = pb.Describe(c);
  d.streams = streams.data();
  d.element_offsets = offsets.data();
  ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
  ++t.step;
}

TEST(StochasticRounding, PiecesGiveTheBitsOfTheWhole) {
  const Combo combos[] = {{B16, B16, B16, B16, B16},  // bf16 param, no master: SR param
                          {B16, B16, F32, B16, B16},  // bf16 v
                          {B16, F32, I16, F8, F8},    // fp8 m and v, remainders
                          {F32, F32, F32, F16, F16}}; // fp16 v
  const int64_t n = 128 * 37 + 5;  // scale blocks: 38, the last ragged
  for (const Combo& c : combos) {
    const bool scaled = Scaled(c.ed) || Scaled(c.sd);
    const std::vector<std::vector<Piece>> splits = {
        {{0, 128 * 19}, {128 * 19, n}},
        {{0, 128}, {128, 128 * 30}, {128 * 30, n}},
        scaled ? std::vector<Piece>{{0, 128}, {128, 256}, {256, 1024}, {1024, 1152},
                                    {1152, 2048}, {2048, 4096}, {4096, n}}
               : std::vector<Piece>{{0, 1}, {1, 300}, {300, 301}, {301, 1777}, {1777, 4000},
                                    {4000, 4001}, {4001, n}}};
    for (int64_t base : {int64_t{0}, (int64_t{1} << 32) - 300}) {
      std::mt19937_64 rng(71);
      Problem whole(c, {n});
      whole.Init(rng);
      Problem start = whole;
      precis_step_config_t cfg = kHypers[0].Config();
      cfg.seed = 1234;
      for (int s = 0; s < 3; ++s) StepPieces(whole, {{0, n}}, 9, base, cfg);
      for (const auto& split : splits) {
        Problem pieces = start;
        for (int s = 0; s < 3; ++s) StepPieces(pieces, split, 9, base, cfg);
        EXPECT_TRUE(pieces.Snapshot() == whole.Snapshot())
            << DName(c.pd) << "/" << DName(c.md) << "/" << DName(c.sd) << " base " << base
            << ", " << split.size() << " pieces";
      }
      // Another stream rounds otherwise (the check above can fail).
      Problem other = start;
      for (int s = 0; s < 3; ++s) StepPieces(other, {{0, n}}, 10, base, cfg);
      EXPECT_FALSE(other.Snapshot() == whole.Snapshot()) << DName(c.sd);
      if (base == 0) {
        Problem far = start;  // 2^32 elements further into the param: the same numbers
        for (int s = 0; s < 3; ++s) StepPieces(far, {{0, n}}, 9, int64_t{1} << 32, cfg);
        EXPECT_TRUE(far.Snapshot() == whole.Snapshot()) << DName(c.sd);
      }
    }
  }
}

TEST(StochasticRounding, UnbiasedAndFreshEachStep) {
  // 256K copies of p = 1 with g = 1: each step moves p by lr, 1/20 of a bf16 ulp
  // (2^-8 below 1). Round-to-nearest would never move; SR must track the fp32
  // trajectory on average, and with fresh random bits each step every element
  // stays near it (a random walk of ~1.4 ulp after 40 steps). Reusing one step's
  // bits would send 5% of the elements down one ulp per step.
  const int64_t n = 1 << 18;
  const double ulp = std::ldexp(1.0, -8);
  Problem sr({B16, F32, B16, F32, F32}, {n});
  Problem exact({F32, F32, F32, F32, F32}, {1});
  for (int64_t i = 0; i < n; ++i) {
    sr.SetMaster(sr.ts[0], i, 1.0f);
    Encode(sr.ts[0].grad, F32, i, 1.0f);
  }
  exact.SetMaster(exact.ts[0], 0, 1.0f);
  Encode(exact.ts[0].grad, F32, 0, 1.0f);
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.lr = 2e-4f;
  cfg.weight_decay = 0.0f;
  cfg.seed = 2024;
  for (int s = 1; s <= 40; ++s) {
    ASSERT_EQ(sr.Step(cfg), PRECIS_OK);
    ASSERT_EQ(exact.Step(cfg), PRECIS_OK);
    if (s % 10 && s != 1) continue;
    double truth = exact.Master(exact.ts[0], 0), sum = 0, worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      double p = sr.Master(sr.ts[0], i);
      sum += p;
      worst = std::max(worst, std::fabs(p - truth));
    }
    // Standard error of the mean: the walk's spread (<= ulp/2 per step) / sqrt(n).
    double sigma = ulp * 0.5 * std::sqrt(static_cast<double>(s) / n);
    EXPECT_NEAR(sum / n, truth, 6 * sigma) << "step " << s;
    EXPECT_LT(worst, 12 * ulp) << "step " << s;
    EXPECT_NEAR(truth, 1.0 - s * 2e-4, 1e-5);
  }
}

TEST(StochasticRounding, ElementRoundingIsUnbiased) {
  // The helper itself: many random numbers for one value.
  const float xs[] = {1.0f + 0.3f * std::ldexp(1.0f, -7), -3.7e-5f, 123.456f, 1e30f, 0.5f};
  for (float x : xs) {
    precis_sr_key_t key = precis_sr_key(99, 3, 17);
    double sum = 0;
    const int n = 1 << 20;
    uint16_t lo = static_cast<uint16_t>(Bits(x) >> 16), hi = static_cast<uint16_t>(lo + 1);
    for (int i = 0; i < n; ++i) {
      uint16_t b = precis_f32_to_bf16_sr(x, precis_sr_rand16(key, static_cast<uint32_t>(i)));
      ASSERT_TRUE(b == lo || b == hi || (Bits(x) & 0xFFFF) == 0) << x;
      sum += precis_bf16_to_f32(b);
    }
    double ulp = std::fabs(static_cast<double>(precis_bf16_to_f32(hi)) - precis_bf16_to_f32(lo));
    EXPECT_NEAR(sum / n, x, 6 * ulp * 0.5 / std::sqrt(static_cast<double>(n))) << x;
  }
  // Exact bf16 values never move; inf stays inf; NaN stays NaN.
  for (uint32_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(precis_f32_to_bf16_sr(1.5f, i * 65u), precis_f32_to_bf16_rn(1.5f));
    EXPECT_EQ(precis_f32_to_bf16_sr(INFINITY, i * 65u), 0x7F80);
    EXPECT_TRUE(std::isnan(precis_bf16_to_f32(precis_f32_to_bf16_sr(FromBits(0x7FFFFFFFu), 65535u))));
  }
  // Every NaN (both signs, every payload), whatever the random bits: round to
  // nearest's code, quiet, never a carry into inf or the sign bit.
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t mant = 1; mant < (1u << 23); ++mant) {
      const float nan = FromBits(sign | 0x7F800000u | mant);
      const uint16_t want = precis_f32_to_bf16_rn(nan);
      ASSERT_EQ(precis_f32_to_bf16_sr(nan, 0u), want) << mant;
      ASSERT_EQ(precis_f32_to_bf16_sr(nan, 0xFFFFu), want) << mant;
      ASSERT_EQ(want & 0xFFC0u, (sign >> 16) | 0x7FC0u) << mant;
    }
  }
}

TEST(StochasticRounding, RandomBitsLookUniform) {
  precis_sr_key_t key = precis_sr_key(1, 0, 1);
  std::vector<int> hist(16, 0);
  const int n = 1 << 20;
  for (int i = 0; i < n; ++i) ++hist[precis_sr_rand16(key, static_cast<uint32_t>(i)) >> 12];
  for (int h : hist) EXPECT_NEAR(h, n / 16, 6 * std::sqrt(n / 16.0));
  // Neighbouring seeds, streams, steps give unrelated numbers.
  precis_sr_key_t k2 = precis_sr_key(2, 0, 1), k3 = precis_sr_key(1, 1, 1),
                  k4 = precis_sr_key(1, 0, 2);
  int same = 0;
  for (uint32_t i = 0; i < 4096; ++i) {
    uint32_t r = precis_sr_rand16(key, i);
    same += r == precis_sr_rand16(k2, i);
    same += r == precis_sr_rand16(k3, i);
    same += r == precis_sr_rand16(k4, i);
  }
  EXPECT_LT(same, 10);
}

// ---- found_inf -------------------------------------------------------------------

TEST(Adam, NonFiniteGradientSkipsStepAndWritesNothing) {
  const precis_dtype_t grads[] = {F32, F16, B16};
  for (precis_dtype_t gd : grads) {
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      std::mt19937_64 rng(13);
      Problem pb({B16, gd, F32, F8, F16}, {70000, 5, 300});
      pb.Init(rng);
      Encode(pb.ts[2].grad, gd, 299, bad);
      auto before = pb.Snapshot();
      precis_step_config_t cfg = kHypers[0].Config();
      cfg.check_finite = 1;
      int32_t found = -1;
      ASSERT_EQ(pb.Step(cfg, &found), PRECIS_OK);
      EXPECT_EQ(found, 1) << DName(gd) << " " << bad;
      EXPECT_TRUE(pb.Snapshot() == before) << DName(gd) << " " << bad;
      // Fix the gradient: the step happens, found_inf = 0.
      Encode(pb.ts[2].grad, gd, 299, 0.5f);
      ASSERT_EQ(pb.Step(cfg, &found), PRECIS_OK);
      EXPECT_EQ(found, 0);
      EXPECT_TRUE(pb.Snapshot() != before);
    }
  }
  // fp16 max (finite) is not flagged.
  Problem pb({F32, F16, F32, F32, F32}, {10});
  std::mt19937_64 rng(1);
  pb.Init(rng);
  Encode(pb.ts[0].grad, F16, 3, 65504.0f);
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.check_finite = 1;
  int32_t found = -1;
  ASSERT_EQ(pb.Step(cfg, &found), PRECIS_OK);
  EXPECT_EQ(found, 0);
}

// ---- precis_step_check_finite ------------------------------------------------------

// A list with only what precis_step_check_finite reads: count, grad_dtype,
// grads, numels. The other dtypes are invalid codes, to show they are not read.
precis_step_tensors_t GradList(precis_dtype_t gd, const std::vector<const void*>& grads,
                               const std::vector<int64_t>& numels) {
  precis_step_tensors_t t = PRECIS_STEP_TENSORS_INIT;
  t.count = grads.size();
  t.param_dtype = t.master_dtype = t.exp_avg_dtype = t.exp_avg_sq_dtype =
      static_cast<precis_dtype_t>(42);
  t.grad_dtype = gd;
  t.grads = grads.data();
  t.numels = numels.data();
  return t;
}

// Element i of b (dtype d) set to the raw bit pattern bits.
void SetBits(std::vector<uint8_t>& b, precis_dtype_t d, int64_t i, uint32_t bits) {
  if (d == F32) {
    std::memcpy(&b[i * 4], &bits, 4);
  } else {
    const uint16_t h = static_cast<uint16_t>(bits);
    std::memcpy(&b[i * 2], &h, 2);
  }
}

// Every SIMD path precis_cpu_isa() may name, scalar first.
const char* const kAllPaths[] = {"scalar", "avx2", "avx512", "neon", "sve"};

// The SIMD paths this CPU can run, scalar first (the reference of the others).
std::vector<std::string> RunnablePaths() {
  std::vector<std::string> paths;
  for (const char* p : kAllPaths)
    if (pr_cpu_isa_force(p) == 0) paths.push_back(p);
  EXPECT_EQ(pr_cpu_isa_force(nullptr), 0);
  return paths;
}

TEST(AdamCheckFinite, FindsNanAndInfAnywhereOnEverySimdPath) {
  const std::vector<std::string> paths = RunnablePaths();
  // Chunks are 16,384-65,536 elements (by the thread count): the first and last
  // tensors span several; the empty one has a NULL pointer.
  const std::vector<int64_t> numels = {70000, 0, 5, 140001};
  struct Special {
    precis_dtype_t d;
    uint32_t largest;            // the largest finite value: not flagged
    std::vector<uint32_t> bad;   // +inf, -inf, a quiet NaN, the smallest NaN, a negative NaN
  };
  const Special specials[] = {
      {F32, 0x7F7FFFFFu, {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFC00000u}},
      {F16, 0x7BFFu, {0x7C00u, 0xFC00u, 0x7E00u, 0x7C01u, 0xFE00u}},
      {B16, 0x7F7Fu, {0x7F80u, 0xFF80u, 0x7FC0u, 0x7F81u, 0xFFC0u}},
  };
  for (const std::string& path : paths) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    for (const Special& sp : specials) {
      const precis_dtype_t gd = sp.d;
      std::vector<std::vector<uint8_t>> bufs;
      std::vector<const void*> grads;
      for (int64_t n : numels) {
        bufs.emplace_back(n * DSize(gd));
        for (int64_t i = 0; i < n; ++i) Encode(bufs.back(), gd, i, 0.25f * static_cast<float>(i % 9 - 4));
        if (n > 3) SetBits(bufs.back(), gd, 3, sp.largest);
        grads.push_back(n == 0 ? nullptr : bufs.back().data());
      }
      const precis_step_tensors_t t = GradList(gd, grads, numels);
      const std::string what = path + " " + DName(gd);
      int32_t found = 0;
      ASSERT_EQ(precis_step_check_finite(&t, &found), PRECIS_OK) << what << ": " << precis_last_error();
      EXPECT_EQ(found, 0) << what;
      EXPECT_STREQ(precis_last_error(), "");

      std::vector<uint8_t>& last = bufs.back();
      const int64_t n = numels.back();
      for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
        for (uint32_t bits : sp.bad) {
          const std::vector<uint8_t> keep = last;
          SetBits(last, gd, at, bits);
          found = 0;
          ASSERT_EQ(precis_step_check_finite(&t, &found), PRECIS_OK) << what << ": " << precis_last_error();
          EXPECT_EQ(found, 1) << what << " bits " << std::hex << bits << std::dec << " at " << at;
          found = 7;  // a flag already set is left as it is
          ASSERT_EQ(precis_step_check_finite(&t, &found), PRECIS_OK);
          EXPECT_EQ(found, 7) << what;
          std::copy(keep.begin(), keep.end(), last.begin());
        }
      }
      found = -3;  // finite gradients leave any flag alone
      ASSERT_EQ(precis_step_check_finite(&t, &found), PRECIS_OK);
      EXPECT_EQ(found, -3) << what;
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

TEST(AdamCheckFinite, EmptyListsAndEmptyTensors) {
  int32_t found = 0;
  precis_step_tensors_t empty = PRECIS_STEP_TENSORS_INIT;  // count 0, every table NULL
  EXPECT_EQ(precis_step_check_finite(&empty, &found), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(found, 0);
  found = 5;
  EXPECT_EQ(precis_step_check_finite(&empty, &found), PRECIS_OK);
  EXPECT_EQ(found, 5);
  // numel-0 tensors need no pointer.
  const std::vector<const void*> grads = {nullptr, nullptr};
  const std::vector<int64_t> numels = {0, 0};
  const precis_step_tensors_t t = GradList(B16, grads, numels);
  found = 0;
  EXPECT_EQ(precis_step_check_finite(&t, &found), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(found, 0);
}

TEST(AdamCheckFinite, BadArgumentsFailAndNameTheArgument) {
  using T = precis_step_tensors_t;
  struct Case {
    std::string name;
    precis_status_t want;
    std::string message;  // a substring of precis_last_error()
    std::function<void(T&, std::vector<const void*>&, std::vector<int64_t>&, int32_t*&)> mutate;
  };
  using G = std::vector<const void*>;
  using N = std::vector<int64_t>;
  const std::vector<Case> cases = {
      {"tensors size", PRECIS_ERR_SIZE_MISMATCH, "tensors->size", [](T& t, G&, N&, int32_t*&) { t.size = 8; }},
      {"found_inf NULL", PRECIS_ERR_NULL_POINTER, "found_inf is NULL", [](T&, G&, N&, int32_t*& f) { f = nullptr; }},
      {"grad fp8", PRECIS_ERR_INVALID_POLICY, "tensors->grad_dtype fp8", [](T& t, G&, N&, int32_t*&) { t.grad_dtype = F8; }},
      {"grad int16", PRECIS_ERR_INVALID_POLICY, "tensors->grad_dtype int16", [](T& t, G&, N&, int32_t*&) { t.grad_dtype = I16; }},
      {"grad code", PRECIS_ERR_INVALID_DTYPE, "tensors->grad_dtype is <invalid dtype 42>", [](T& t, G&, N&, int32_t*&) { t.grad_dtype = static_cast<precis_dtype_t>(42); }},
      {"grad code, empty list", PRECIS_ERR_INVALID_DTYPE, "tensors->grad_dtype", [](T& t, G&, N&, int32_t*&) { t.grad_dtype = static_cast<precis_dtype_t>(-1); t.count = 0; }},
      {"numels NULL", PRECIS_ERR_NULL_POINTER, "tensors->numels is NULL", [](T& t, G&, N&, int32_t*&) { t.numels = nullptr; }},
      {"numel<0", PRECIS_ERR_INVALID_ARGUMENT, "numels[1] is -3", [](T&, G&, N& n, int32_t*&) { n[1] = -3; }},
      {"grads NULL", PRECIS_ERR_NULL_POINTER, "tensors->grads is NULL", [](T& t, G&, N&, int32_t*&) { t.grads = nullptr; }},
      {"grads[2] NULL", PRECIS_ERR_NULL_POINTER, "grads[2] is NULL", [](T&, G& g, N&, int32_t*&) { g[2] = nullptr; }},
  };
  std::vector<uint8_t> a(300 * 2), c(4000 * 2);
  Encode(a, B16, 17, NAN);  // a call that got through would set the flag
  for (const Case& bc : cases) {
    G grads = {a.data(), nullptr, c.data()};
    N numels = {300, 0, 4000};
    T t = GradList(B16, grads, numels);
    int32_t found = 0;
    int32_t* found_ptr = &found;
    bc.mutate(t, grads, numels, found_ptr);
    EXPECT_EQ(precis_step_check_finite(&t, found_ptr), bc.want) << bc.name << ": " << precis_last_error();
    const std::string msg = precis_last_error();
    EXPECT_NE(msg.find(bc.message), std::string::npos) << bc.name << ": " << msg;
    EXPECT_EQ(msg.rfind("precis_step_check_finite: ", 0), 0u) << bc.name << ": " << msg;
    EXPECT_EQ(found, 0) << bc.name;
  }
  int32_t found = 0;
  EXPECT_EQ(precis_step_check_finite(nullptr, &found), PRECIS_ERR_NULL_POINTER);
  EXPECT_STREQ(precis_last_error(), "precis_step_check_finite: tensors is NULL");
  EXPECT_EQ(found, 0);
}

// ---- scaled moments ---------------------------------------------------------------

TEST(ScaledMoments, SecondMomentNeverFlushesToZero) {
  // One large gradient and many tiny ones in each block. Without the
  // never-zero rule the tiny v would be stored as 0 and, once their gradients
  // stop, m / (sqrt(0) + eps) would blow the update up by ~1e3 x lr.
  for (precis_dtype_t sd : {F16, F8}) {
    for (precis_dtype_t ed : {F32, F16, F8, B16}) {
      const int64_t n = 3 * PRECIS_SCALE_BLOCK + 17;
      Problem pb({F32, F32, F32, ed, sd}, {n});
      Tensor& t = pb.ts[0];
      // sqrt(v) spans 1e13 in a block: more than fp16 (1e12) or fp8 (2e5) hold.
      for (int64_t i = 0; i < n; ++i) Encode(t.grad, F32, i, i % PRECIS_SCALE_BLOCK == 0 ? 1e7f : 1e-6f);
      precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
      cfg.weight_decay = 0;
      for (int s = 0; s < 6; ++s) {
        std::vector<float> p0(n);
        for (int64_t i = 0; i < n; ++i) p0[i] = pb.Master(t, i);
        ASSERT_EQ(pb.Step(cfg), PRECIS_OK);
        std::vector<float> v = pb.Moment(t, 1);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_GT(v[i], 0.0f) << DName(sd) << " step " << s << " i " << i;
          // |m_hat / sqrt(v_hat)| <= (1-b1)/sqrt(1-b2) ~ 3.2 for any gradient history
          ASSERT_LE(std::fabs(pb.Master(t, i) - p0[i]), 4 * cfg.lr) << DName(sd) << " step " << s;
        }
        if (s == 0) {  // then the small gradients stop
          for (int64_t i = 0; i < n; ++i)
            if (i % PRECIS_SCALE_BLOCK) Encode(t.grad, F32, i, 0.0f);
        }
      }
    }
  }
}

TEST(ScaledMoments, EncodeDecodeRoundTrip) {
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<double> e(-12, 2);
  const int64_t n = 1000;  // 7 full blocks and a partial one
  for (precis_dtype_t d : {F32, B16, F16, F8}) {
    for (int second = 0; second <= 1; ++second) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) {
        double mag = std::pow(10.0, e(rng));
        x[i] = static_cast<float>(second ? mag : (i % 3 ? mag : -mag));
      }
      for (int64_t i = 256; i < 384; ++i) x[i] = 0.0f;  // an all-zero block
      std::vector<uint8_t> codes(n * DSize(d), 0xAB);
      std::vector<float> scales(Blocks(n), -1.0f), y(n, -1.0f);
      float* sp = Scaled(d) ? scales.data() : nullptr;
      ASSERT_EQ(precis_moment_encode(x.data(), n, second, codes.data(), d, sp), PRECIS_OK);
      ASSERT_EQ(precis_moment_decode(codes.data(), sp, n, second, d, y.data()), PRECIS_OK);
      if (Scaled(d)) {
        EXPECT_EQ(scales[2], 0.0f);
      }
      for (int64_t i = 0; i < n; ++i) {
        int64_t lo = i / PRECIS_SCALE_BLOCK * PRECIS_SCALE_BLOCK, hi = std::min(n, lo + PRECIS_SCALE_BLOCK);
        double amax = 0;
        for (int64_t j = lo; j < hi; ++j)
          amax = std::max(amax, second && Scaled(d) ? std::sqrt(static_cast<double>(x[j])) : std::fabs(x[j]));
        if (x[i] == 0.0f) {
          ASSERT_EQ(y[i], 0.0f) << DName(d) << " " << i;
          continue;
        }
        if (second && Scaled(d)) {
          ASSERT_GT(y[i], 0.0f) << DName(d) << " " << i;
          double tol = MomentTol(d, true, std::sqrt(x[i]), amax, false) * 1.01 + 1e-7 * std::sqrt(x[i]);
          ASSERT_NEAR(std::sqrt(static_cast<double>(y[i])), std::sqrt(static_cast<double>(x[i])), tol)
              << DName(d) << " " << i;
        } else {
          double tol = MomentTol(d, second, std::fabs(x[i]), amax, false) * 1.01 + 1e-7 * std::fabs(x[i]);
          ASSERT_NEAR(y[i], x[i], tol) << DName(d) << " second " << second << " " << i;
        }
        if (d == B16) {
          ASSERT_EQ(y[i], precis_bf16_to_f32(precis_f32_to_bf16_rn(x[i])));
        }
        if (d == F32) {
          ASSERT_EQ(Bits(y[i]), Bits(x[i]));
        }
      }
      if (Scaled(d)) {  // the block max lands on the top of the format
        std::vector<float> q(n);
        for (int64_t i = 0; i < n; ++i) {
          q[i] = d == F8 ? precis_moment_code_f32(d, second, codes[i]) : static_cast<float>(Decode(codes, d, i));
        }
        float top = *std::max_element(q.begin(), q.begin() + PRECIS_SCALE_BLOCK, [](float a, float b) {
          return std::fabs(a) < std::fabs(b);
        });
        EXPECT_EQ(std::fabs(top), precis_moment_max(d == F8, second));
      }
    }
  }
}

TEST(ScaledMoments, ZeroBlocksAndEdgeCasesGiveNoNaN) {
  for (precis_dtype_t d : {F16, F8}) {
    for (int second = 0; second <= 1; ++second) {
      // Block 0 all zero; block 1 holds one tiny value: a first moment below
      // 2^-100 is stored as a zero block, a second moment that small is not.
      std::vector<float> x(130, 0.0f);
      x[129] = second ? FromBits(1) : 1e-35f;
      std::vector<uint8_t> codes(130 * DSize(d), 0xFF);
      std::vector<float> scales(2, -1.0f), y(130, -1.0f);
      ASSERT_EQ(precis_moment_encode(x.data(), 130, second, codes.data(), d, scales.data()), PRECIS_OK);
      EXPECT_EQ(scales[0], 0.0f);
      ASSERT_EQ(precis_moment_decode(codes.data(), scales.data(), 130, second, d, y.data()), PRECIS_OK);
      for (int i = 0; i < 129; ++i) EXPECT_EQ(y[i], 0.0f) << i;
      if (second) {
        EXPECT_GT(scales[1], 0.0f);
        EXPECT_GT(y[129], 0.0f);  // the smallest non-zero fp32 v survives
      } else {
        EXPECT_EQ(scales[1], 0.0f);
        EXPECT_EQ(y[129], 0.0f);
      }
    }
  }
  int64_t count = -1;
  EXPECT_EQ(precis_scale_count(0, &count), PRECIS_OK);
  EXPECT_EQ(count, 0);
  EXPECT_EQ(precis_scale_count(1, &count), PRECIS_OK);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(precis_scale_count(128, &count), PRECIS_OK);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(precis_scale_count(129, &count), PRECIS_OK);
  EXPECT_EQ(count, 2);
  EXPECT_EQ(precis_scale_count(-1, &count), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_scale_count(5, nullptr), PRECIS_ERR_NULL_POINTER);
}

// ---- SIMD paths ------------------------------------------------------------------

// `steps` steps (the second reads back the first's encodings) of combination c
// (amsgrad or not) over tensors of the given sizes on every path; each path's
// bits must be the scalar path's. The scalar path is checked against the double
// reference above (MatchesDoubleReference).
void ExpectPathsAgree(const std::vector<std::string>& paths, const Combo& c, bool ams,
                      const std::vector<int64_t>& sizes, int hyper, int steps = 2) {
  std::vector<std::vector<std::vector<uint8_t>>> results;
  for (const std::string& p : paths) {
    ASSERT_EQ(pr_cpu_isa_force(p.c_str()), 0);
    std::mt19937_64 rng(21);
    Problem pb(c, sizes, ams);
    pb.Init(rng);
    precis_step_config_t cfg = kHypers[hyper % 4].Config();
    cfg.seed = 5;
    cfg.amsgrad = ams;
    for (int s = 0; s < steps; ++s) ASSERT_EQ(pb.Step(cfg), PRECIS_OK) << precis_last_error();
    results.push_back(pb.Snapshot());
  }
  for (size_t i = 1; i < results.size(); ++i)
    ASSERT_TRUE(results[i] == results[0])
        << ComboName(c) << (ams ? " amsgrad " : " ") << paths[i] << " vs scalar";
}

TEST(Adam, SimdPathsAgreeBitForBit) {
  const char* got = nullptr;
  ASSERT_EQ(precis_cpu_isa(&got), PRECIS_OK);
  const std::vector<std::string> paths = RunnablePaths();
  EXPECT_NE(std::find(paths.begin(), paths.end(), got), paths.end()) << got;
  if (paths.size() == 1) GTEST_SKIP() << "only the scalar path runs on this CPU";
  int checked = 0;
  for (const Combo& c : AllCombos()) {
    for (bool ams : {false, true}) {
      ExpectPathsAgree(paths, c, ams, {1, 127, 4097, 33}, checked);
      if (HasFatalFailure()) return;
      ++checked;
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
  EXPECT_EQ(pr_cpu_isa_force("avx9000"), -1);
}

// The fused step's fp8 stores of every input (Fp8StoreGrads), through the
// shared hash: every path stores the scalar path's bytes; each input's mean
// stored code is its value within 6 standard errors, for m and v alike.
TEST(StochasticRounding, Fp8StoresOfEveryCodeOnEveryPath) {
  const int kCopies = 64;
  std::vector<float> inputs;
  const std::vector<float> grads = Fp8StoreGrads(kCopies, &inputs);
  const int64_t n = static_cast<int64_t>(grads.size());
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.beta1 = 0.0;
  cfg.beta2 = 0.0;
  cfg.lr = 1e-6;
  cfg.seed = 31;
  std::vector<Problem> done;
  for (const std::string& path : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    Problem pb({B16, B16, F32, F8, F8}, {n});
    for (int64_t i = 0; i < n; ++i) Encode(pb.ts[0].grad, B16, i, grads[i]);
    ASSERT_EQ(pb.Step(cfg), PRECIS_OK) << precis_last_error();
    done.push_back(pb);
    const Tensor& t = pb.ts[0];
    EXPECT_TRUE(t.m == done[0].ts[0].m && t.v == done[0].ts[0].v) << path << " vs scalar";
    const Tensor& t0 = done[0].ts[0];  // the scales hold NaN: bytes, not ==
    EXPECT_EQ(0, std::memcmp(t.m_scales.data(), t0.m_scales.data(), t0.m_scales.size() * 4))
        << path << " vs scalar";
    EXPECT_EQ(0, std::memcmp(t.v_scales.data(), t0.v_scales.data(), t0.v_scales.size() * 4))
        << path << " vs scalar";
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
  // The values each input's copies stored, as codes: m in m8 (multiplier 1),
  // sqrt(v) in v8 (multiplier 16).
  const Tensor& t = done[0].ts[0];
  std::vector<double> sum_m(inputs.size()), sum_v(inputs.size());
  int64_t e = 0;
  for (int k = 0; k < kCopies; ++k) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (e % PRECIS_SCALE_BLOCK == 0) {
        ASSERT_EQ(t.m_scales[e / PRECIS_SCALE_BLOCK], 1.0f);
        ++e;
      }
      sum_m[i] += precis_m8_to_f32(t.m[e]);
      sum_v[i] += precis_v8_to_f32(t.v[e]);
      ++e;
    }
  }
  // The gap between the codes around y: the floor's (r = 0) and the next one's.
  auto gap = [](float y, int mb, int bias, uint32_t max_code) {
    const uint32_t lo = std::min(precis_f32_to_ufloat_sr(y, 0u, mb, bias, max_code), max_code - 1);
    return static_cast<double>(precis_ufloat_to_f32(lo + 1, mb, bias)) -
           precis_ufloat_to_f32(lo, mb, bias);
  };
  const double se = 6.0 * 0.5 / std::sqrt(static_cast<double>(kCopies));
  for (size_t i = 0; i < inputs.size(); ++i) {
    const float x = inputs[i];
    const float q = std::sqrt(x * x) * 16.0f;  // as the kernel: g * g underflows to 0
    EXPECT_NEAR(sum_m[i] / kCopies, x,
                gap(std::fabs(x), PRECIS_M8_MBITS, PRECIS_M8_BIAS, PRECIS_M8_MAX_CODE) * se)
        << "m of " << x;
    // v's smallest positive value stores code 1, never 0 (sqrt(v) stays bounded)
    const double want_v = q > 0.0f && q < precis_v8_to_f32(1) ? precis_v8_to_f32(1) : q;
    EXPECT_NEAR(sum_v[i] / kCopies, want_v,
                gap(q, PRECIS_V8_MBITS, PRECIS_V8_BIAS, PRECIS_V8_MAX_CODE) * se)
        << "v of " << x;
  }
  // The NaN block: its state is lost and says so (NaN scales), on every path alike.
  const int64_t nan_block = (n - 1) / PRECIS_SCALE_BLOCK;
  EXPECT_TRUE(std::isnan(t.m_scales[nan_block]));
  EXPECT_TRUE(std::isnan(t.v_scales[nan_block]));
}

// precis_moment_encode / _decode on every path give the scalar path's codes,
// scales and values, for every moment dtype, both moments, at odd sizes
// (values over 14 decades, zeros, an all-zero block, subnormal fp16/fp8 codes).
TEST(ScaledMoments, EncodeDecodeAgreeOnEveryPath) {
  const std::vector<std::string> paths = RunnablePaths();
  if (paths.size() == 1) GTEST_SKIP() << "only the scalar path runs on this CPU";
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<double> e(-12, 2);
  for (int64_t n : {int64_t{1}, int64_t{127}, int64_t{4097}, int64_t{1000003}}) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(std::pow(10.0, e(rng)));
    for (int64_t i = 256; i < std::min<int64_t>(n, 384); ++i) x[i] = 0.0f;
    for (precis_dtype_t d : {F32, B16, F16, F8}) {
      for (int second = 0; second <= 1; ++second) {
        std::vector<float> src = x;
        if (!second)
          for (int64_t i = 0; i < n; i += 3) src[i] = -src[i];
        std::vector<std::vector<uint8_t>> codes;
        std::vector<std::vector<float>> scales, values;
        for (const std::string& p : paths) {
          ASSERT_EQ(pr_cpu_isa_force(p.c_str()), 0);
          codes.emplace_back(n * DSize(d), 0xAB);
          scales.emplace_back(Blocks(n), -1.0f);
          values.emplace_back(n, -1.0f);
          float* sp = Scaled(d) ? scales.back().data() : nullptr;
          ASSERT_EQ(precis_moment_encode(src.data(), n, second, codes.back().data(), d, sp),
                    PRECIS_OK);
          ASSERT_EQ(precis_moment_decode(codes.back().data(), sp, n, second, d,
                                         values.back().data()),
                    PRECIS_OK);
        }
        for (size_t i = 1; i < paths.size(); ++i) {
          const std::string what = DName(d) + (second ? " v " : " m ") + std::to_string(n) +
                                   " " + paths[i] + " vs scalar";
          EXPECT_TRUE(codes[i] == codes[0]) << what;
          EXPECT_EQ(0, std::memcmp(scales[i].data(), scales[0].data(), scales[0].size() * 4))
              << what;
          EXPECT_EQ(0, std::memcmp(values[i].data(), values[0].data(), values[0].size() * 4))
              << what;
        }
      }
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// Each README policy's fused kernel (scaled moments: a scale block at a time in two
// loops) against the generic kernel (the tile's passes, one buffer at a time), on
// every path, at sizes that end mid-block and span tiles: two steps with a block of m
// below 2^-100 (stored as zeros with a zero scale) and a first step (zero state); and
// one step with a NaN and infinite gradients (check_finite off: they reach the state,
// NaN block scales included). Not a second step on NaN state: a product of two NaNs
// keeps the first operand's on x86, and the compiler may commute it, so a NaN's sign
// may differ between kernels (as between paths; a GPU's NaNs are canonical).
TEST(Adam, FusedKernelsGiveTheGenericKernelsBits) {
  const Combo readme[] = {{F32, F32, F32, F32, F32}, {B16, B16, F32, B16, B16},
                          {B16, B16, I16, B16, B16}, {B16, B16, F32, F8, F8},
                          {B16, B16, I16, F8, F8},   {B16, B16, F32, F16, F16},
                          {B16, B16, F8, F8, F8}};
  for (const std::string& path : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    for (const Combo& c : readme) {
      for (bool nonfinite : {false, true}) {
        std::vector<std::vector<std::vector<uint8_t>>> results;
        for (int generic : {0, 1}) {
          ASSERT_EQ(pr_cpu_generic_force(generic), 0);
          std::mt19937_64 rng(53);
          Problem pb(c, {1, 129, 4097, 2 * 2048 + 130}, false);
          pb.Init(rng);
          pb.ts[0].step = 0;  // a first step
          Tensor& t = pb.ts[2];
          std::vector<float> m = pb.Moment(t, 0);
          for (int64_t i = 128; i < 256; ++i) m[i] = 1e-35f * static_cast<float>(i - 190);
          pb.SetMoment(t, 0, m);
          if (nonfinite) {
            Encode(t.grad, c.gd, 300, NAN);
            Encode(t.grad, c.gd, 700, INFINITY);
            Encode(pb.ts[3].grad, c.gd, 4100, -INFINITY);
          }
          precis_step_config_t cfg = kHypers[0].Config();
          cfg.seed = 5;
          for (int k = 0; k < (nonfinite ? 1 : 2); ++k)
            ASSERT_EQ(pb.Step(cfg), PRECIS_OK) << precis_last_error();
          results.push_back(pb.Snapshot());
        }
        EXPECT_TRUE(results[0] == results[1])
            << ComboName(c) << " on " << path << (nonfinite ? " with NaN and inf" : "");
      }
    }
  }
  ASSERT_EQ(pr_cpu_generic_force(0), 0);
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// Two steps of every dtype combination, plain and AMSGrad (IEEE sqrt, odd
// sizes, every hyperparameter set), hashed (FNV-1a over every buffer): the
// digest recorded from x86's scalar path. Every path of every architecture
// must give it (tools/cross_test.sh runs this test on aarch64 under qemu).
TEST(AdamGolden, EveryPathGivesTheRecordedBits) {
  // One division in the param step of moments stored in fewer bits than fp32 since
  // issue #46 item 4 (before, 0xfb33e709f45c9e78); fp8 m in m8 since issue #34 item 1.
  // Each combination's hyperparameters by a hash of its index: by k % 4, every fused
  // fp8 layout got the gradient-unscaling set, whose tiny gradients leave each v code
  // in place whatever its random bits (0x2bf5351a76c8470e then).
  const uint64_t kGolden = 0x3d1683e1704e263aull;
  for (const std::string& p : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(p.c_str()), 0);
    uint64_t h = 0xCBF29CE484222325ull;
    int k = 0;
    for (const Combo& c : AllCombos()) {
      for (bool ams : {false, true}) {
        Problem pb(c, {1, 130, 2049}, ams);
        pb.InitHashed(static_cast<uint32_t>(k));
        precis_step_config_t cfg = kHypers[precis_hash32(static_cast<uint32_t>(k)) % 4].Config();
        cfg.seed = 9;
        cfg.amsgrad = ams;
        ASSERT_EQ(pb.Step(cfg), PRECIS_OK) << precis_last_error();
        ASSERT_EQ(pb.Step(cfg), PRECIS_OK) << precis_last_error();
        for (const std::vector<uint8_t>& b : pb.Snapshot())
          for (uint8_t byte : b) h = (h ^ byte) * 0x100000001B3ull;
        ++k;
      }
    }
    EXPECT_EQ(h, kGolden) << p << " digest 0x" << std::hex << h;
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// The policies the README names (each a fused kernel of its own), plain and
// AMSGrad, at a size that spans many chunks and ends in a partial tile and
// scale block: every path gives the scalar path's bits. One step (the second,
// which reads the first's encodings, runs at the smaller sizes above), so the
// sanitizer build stays within its time.
TEST(Adam, ReadmePoliciesAgreeOnEveryPathAtLargeOddSizes) {
  const std::vector<std::string> paths = RunnablePaths();
  if (paths.size() == 1) GTEST_SKIP() << "only the scalar path runs on this CPU";
  const Combo policies[] = {
      {F32, F32, F32, F32, F32},  // fp32
      {B16, B16, F32, B16, B16},  // bf16 default
      {B16, B16, I16, B16, B16},  // remainders
      {B16, B16, F32, F16, F16},  // fp16 moments
      {B16, B16, F32, F8, F8},    // fp8 moments
      {B16, B16, I16, F8, F8},    // fp8 moments + remainders
      {B16, B16, F8, F8, F8},     // fp8 moments + 8-bit remainders
  };
  int k = 0;
  for (const Combo& c : policies) {
    for (bool ams : {false, true}) {
      ExpectPathsAgree(paths, c, ams, {1000003, 5}, k++, 1);
      if (HasFatalFailure()) return;
    }
  }
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// The paths this CPU runs: the default is the best of them, but neon where SVE's
// vectors are 128 bits; sve exactly where Linux reports SVE (checked here apart
// from the library's own check); and, where the runner names them
// (PRECIS_TEST_PATHS, comma-separated, and PRECIS_TEST_DEFAULT: see
// tools/cross_test.sh), those, so that an emulated CPU without SVE cannot
// leave the sve path untested unnoticed. The expected default asks Linux for the
// vector length as the library does; PRECIS_TEST_DEFAULT, from the runner who
// set up the CPU, is the independent check.
TEST(Adam, RunnablePathsAreTheCpusOwn) {
  const std::vector<std::string> paths = RunnablePaths();
  std::string names;
  for (const std::string& p : paths) names += (names.empty() ? "" : ",") + p;
  std::printf("runnable paths: %s\n", names.c_str());
  const char* got = nullptr;
  ASSERT_EQ(precis_cpu_isa(&got), PRECIS_OK);
  std::string want_default = paths.back();
#if defined(__aarch64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
  const bool sve = (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;
  EXPECT_EQ(std::find(paths.begin(), paths.end(), "sve") != paths.end(), sve) << names;
  if (sve && (prctl(PR_SVE_GET_VL) & PR_SVE_VL_LEN_MASK) == 16) want_default = "neon";
#endif
  if (std::getenv("PRECIS_CPU_ISA") == nullptr) {
    EXPECT_EQ(want_default, got);
    if (const char* want = std::getenv("PRECIS_TEST_DEFAULT")) EXPECT_STREQ(want, got);
  }
  if (const char* want = std::getenv("PRECIS_TEST_PATHS")) EXPECT_EQ(names, want);
}

TEST(Adam, CpuIsaEnvironmentVariableForcesAnyRunnablePath) {
  const char* before = nullptr;
  ASSERT_EQ(precis_cpu_isa(&before), PRECIS_OK);
  std::string best = before;
  setenv("PRECIS_CPU_ISA", "scalar", 1);
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);  // re-reads the environment
  const char* now = nullptr;
  ASSERT_EQ(precis_cpu_isa(&now), PRECIS_OK);
  EXPECT_STREQ(now, "scalar");
  setenv("PRECIS_CPU_ISA", " SCALAR ", 1);  // case and spaces ignored, as in dtype names
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
  ASSERT_EQ(precis_cpu_isa(&now), PRECIS_OK);
  EXPECT_STREQ(now, "scalar");
  setenv("PRECIS_CPU_ISA", "avx9000", 1);  // unknown: ignored
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
  ASSERT_EQ(precis_cpu_isa(&now), PRECIS_OK);
  EXPECT_EQ(best, now);
  for (const char* p : kAllPaths) {  // each path this CPU runs is taken; any other ignored
    const bool runs = pr_cpu_isa_force(p) == 0;
    setenv("PRECIS_CPU_ISA", p, 1);
    ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
    ASSERT_EQ(precis_cpu_isa(&now), PRECIS_OK);
    EXPECT_EQ(runs ? std::string(p) : best, now) << p;
  }
  unsetenv("PRECIS_CPU_ISA");
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);
}

// ---- bad inputs -----------------------------------------------------------------

struct BadCase {
  std::string name;
  precis_status_t want;
  std::string message;  // a substring of precis_last_error()
  std::function<void(precis_step_config_t&, precis_step_tensors_t&, Problem&, int32_t*&)> mutate;
};

// One bad case on a list with an empty tensor (NULL pointers are fine there):
// the status, the message, and nothing written.
void ExpectRefused(const BadCase& bc, bool amsgrad) {
  std::mt19937_64 rng(31);
  Problem pb({B16, B16, F32, F16, F8}, {300, 0, 4000}, amsgrad);
  pb.Init(rng);
  pb.ts[1].param.clear();
  auto before = pb.Snapshot();
  precis_step_config_t cfg = kHypers[0].Config();
  cfg.amsgrad = amsgrad;
  precis_step_tensors_t t = pb.Desc();
  pb.params[1] = pb.masters[1] = pb.ms[1] = pb.vs[1] = nullptr;
  pb.grads[1] = nullptr;
  if (amsgrad) pb.vmaxs[1] = nullptr;
  int32_t found = 77;
  int32_t* found_ptr = &found;
  bc.mutate(cfg, t, pb, found_ptr);
  EXPECT_EQ(precis_step(&cfg, &t, found_ptr), bc.want) << bc.name << ": " << precis_last_error();
  EXPECT_NE(std::string(precis_last_error()).find(bc.message), std::string::npos)
      << bc.name << ": " << precis_last_error();
  EXPECT_NE(std::string(precis_last_error()).find("precis_step"), std::string::npos) << bc.name;
  EXPECT_EQ(found, 77) << bc.name;
  EXPECT_TRUE(pb.Snapshot() == before) << bc.name;
}

TEST(Adam, BadInputsFailAndWriteNothing) {
  using C = precis_step_config_t;
  using T = precis_step_tensors_t;
  static float dummy_scales[4];
  static float* dummy_scale_ptrs[2] = {dummy_scales, dummy_scales};
  static uint64_t side_tables[16];
  static void* muon_outputs[3] = {side_tables, nullptr, side_tables};  // (refused first)
  std::vector<BadCase> cases = {
      {"cfg size", PRECIS_ERR_SIZE_MISMATCH, "cfg->size", [](C& c, T&, Problem&, int32_t*&) { c.size = 8; }},
      {"tensors size", PRECIS_ERR_SIZE_MISMATCH, "tensors->size", [](C&, T& t, Problem&, int32_t*&) { t.size = 0; }},
      {"lr<0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->lr", [](C& c, T&, Problem&, int32_t*&) { c.lr = -1e-3f; }},
      {"lr nan", PRECIS_ERR_INVALID_ARGUMENT, "cfg->lr", [](C& c, T&, Problem&, int32_t*&) { c.lr = NAN; }},
      {"lr inf", PRECIS_ERR_INVALID_ARGUMENT, "cfg->lr", [](C& c, T&, Problem&, int32_t*&) { c.lr = INFINITY; }},
      {"beta1=1", PRECIS_ERR_INVALID_ARGUMENT, "cfg->beta1", [](C& c, T&, Problem&, int32_t*&) { c.beta1 = 1.0f; }},
      {"beta1<0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->beta1", [](C& c, T&, Problem&, int32_t*&) { c.beta1 = -0.1f; }},
      {"beta2 nan", PRECIS_ERR_INVALID_ARGUMENT, "cfg->beta2", [](C& c, T&, Problem&, int32_t*&) { c.beta2 = NAN; }},
      {"beta2>1", PRECIS_ERR_INVALID_ARGUMENT, "cfg->beta2", [](C& c, T&, Problem&, int32_t*&) { c.beta2 = 1.5f; }},
      {"eps<0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->eps", [](C& c, T&, Problem&, int32_t*&) { c.eps = -1e-8f; }},
      {"eps inf", PRECIS_ERR_INVALID_ARGUMENT, "cfg->eps", [](C& c, T&, Problem&, int32_t*&) { c.eps = INFINITY; }},
      {"wd<0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->weight_decay", [](C& c, T&, Problem&, int32_t*&) { c.weight_decay = -0.01f; }},
      {"inv scale 0", PRECIS_ERR_INVALID_ARGUMENT, "cfg->inv_grad_scale", [](C& c, T&, Problem&, int32_t*&) { c.inv_grad_scale = 0.0f; }},
      {"inv scale nan", PRECIS_ERR_INVALID_ARGUMENT, "cfg->inv_grad_scale", [](C& c, T&, Problem&, int32_t*&) { c.inv_grad_scale = NAN; }},
      {"decoupled 2", PRECIS_ERR_INVALID_ARGUMENT, "cfg->decoupled_weight_decay", [](C& c, T&, Problem&, int32_t*&) { c.decoupled_weight_decay = 2; }},
      {"maximize -1", PRECIS_ERR_INVALID_ARGUMENT, "cfg->maximize", [](C& c, T&, Problem&, int32_t*&) { c.maximize = -1; }},
      {"check_finite 7", PRECIS_ERR_INVALID_ARGUMENT, "cfg->check_finite", [](C& c, T&, Problem&, int32_t*&) { c.check_finite = 7; }},
      {"num_threads -1", PRECIS_ERR_INVALID_ARGUMENT, "cfg->num_threads", [](C& c, T&, Problem&, int32_t*&) { c.num_threads = -1; }},
      {"lr_float32 2", PRECIS_ERR_INVALID_ARGUMENT, "cfg->lr_float32", [](C& c, T&, Problem&, int32_t*&) { c.lr_float32 = 2; }},
      {"float32 lr 1e39", PRECIS_ERR_INVALID_ARGUMENT, "beyond float32's range, with cfg->lr_float32 1", [](C& c, T&, Problem&, int32_t*&) { c.lr_float32 = 1, c.lr = 1e39; }},
      {"found_inf NULL", PRECIS_ERR_NULL_POINTER, "found_inf", [](C& c, T&, Problem&, int32_t*& f) { c.check_finite = 1; f = nullptr; }},
      {"param dtype code", PRECIS_ERR_INVALID_DTYPE, "param_dtype", [](C&, T& t, Problem&, int32_t*&) { t.param_dtype = static_cast<precis_dtype_t>(42); }},
      {"param fp8", PRECIS_ERR_INVALID_POLICY, "param_dtype", [](C&, T& t, Problem&, int32_t*&) { t.param_dtype = F8; }},
      {"grad int16", PRECIS_ERR_INVALID_POLICY, "grad_dtype", [](C&, T& t, Problem&, int32_t*&) { t.grad_dtype = I16; }},
      {"grad code", PRECIS_ERR_INVALID_DTYPE, "grad_dtype", [](C&, T& t, Problem&, int32_t*&) { t.grad_dtype = static_cast<precis_dtype_t>(-1); }},
      {"exp_avg int16", PRECIS_ERR_INVALID_POLICY, "exp_avg_dtype", [](C&, T& t, Problem&, int32_t*&) { t.exp_avg_dtype = I16; }},
      {"exp_avg_sq code", PRECIS_ERR_INVALID_DTYPE, "exp_avg_sq_dtype", [](C&, T& t, Problem&, int32_t*&) { t.exp_avg_sq_dtype = PRECIS_DTYPE_COUNT; }},
      {"master code", PRECIS_ERR_INVALID_DTYPE, "master_dtype", [](C&, T& t, Problem&, int32_t*&) { t.master_dtype = static_cast<precis_dtype_t>(9); }},
      {"8-bit remainders need bf16", PRECIS_ERR_INVALID_POLICY, "master_dtype", [](C&, T& t, Problem&, int32_t*&) { t.param_dtype = F16; t.master_dtype = F8; }},
      {"remainders need bf16", PRECIS_ERR_INVALID_POLICY, "master_dtype", [](C&, T& t, Problem&, int32_t*&) { t.param_dtype = F16; t.master_dtype = I16; }},
      {"fp16 master for fp32", PRECIS_ERR_INVALID_POLICY, "master_dtype", [](C&, T& t, Problem&, int32_t*&) { t.param_dtype = F32; t.master_dtype = F16; }},
      {"bf16 master for fp16", PRECIS_ERR_INVALID_POLICY, "master_dtype", [](C&, T& t, Problem&, int32_t*&) { t.param_dtype = F16; t.master_dtype = B16; }},
      {"numels NULL", PRECIS_ERR_NULL_POINTER, "numels", [](C&, T& t, Problem&, int32_t*&) { t.numels = nullptr; }},
      {"steps NULL", PRECIS_ERR_NULL_POINTER, "steps", [](C&, T& t, Problem&, int32_t*&) { t.steps = nullptr; }},
      {"numel<0", PRECIS_ERR_INVALID_ARGUMENT, "numels[1]", [](C&, T&, Problem& p, int32_t*&) { p.numels[1] = -3; }},
      {"step 0", PRECIS_ERR_INVALID_ARGUMENT, "steps[2]", [](C&, T&, Problem& p, int32_t*&) { p.steps[2] = 0; }},
      {"params NULL", PRECIS_ERR_NULL_POINTER, "tensors->params", [](C&, T& t, Problem&, int32_t*&) { t.params = nullptr; }},
      {"grads[2] NULL", PRECIS_ERR_NULL_POINTER, "grads[2] is NULL", [](C&, T&, Problem& p, int32_t*&) { p.grads[2] = nullptr; }},
      {"params[2] NULL", PRECIS_ERR_NULL_POINTER, "params[2] is NULL", [](C&, T&, Problem& p, int32_t*&) { p.params[2] = nullptr; }},
      {"exp_avgs[0] NULL", PRECIS_ERR_NULL_POINTER, "exp_avgs[0] is NULL", [](C&, T&, Problem& p, int32_t*&) { p.ms[0] = nullptr; }},
      {"exp_avg_sqs NULL", PRECIS_ERR_NULL_POINTER, "exp_avg_sqs", [](C&, T& t, Problem&, int32_t*&) { t.exp_avg_sqs = nullptr; }},
      {"masters NULL", PRECIS_ERR_NULL_POINTER, "masters", [](C&, T& t, Problem&, int32_t*&) { t.masters = nullptr; }},
      {"masters[2] NULL", PRECIS_ERR_NULL_POINTER, "masters[2] is NULL", [](C&, T&, Problem& p, int32_t*&) { p.masters[2] = nullptr; }},
      {"scales missing", PRECIS_ERR_NULL_POINTER, "exp_avg_scales", [](C&, T& t, Problem&, int32_t*&) { t.exp_avg_scales = nullptr; }},
      {"scale entry missing", PRECIS_ERR_NULL_POINTER, "exp_avg_sq_scales[2]", [](C&, T&, Problem& p, int32_t*&) { p.v_scales[2] = nullptr; }},
      {"scales for bf16", PRECIS_ERR_INVALID_ARGUMENT, "exp_avg_scales", [](C&, T& t, Problem&, int32_t*&) { t.exp_avg_dtype = B16; t.exp_avg_scales = dummy_scale_ptrs; }},
      // a count no table of which fits in memory, and numels adding up past int64 (they
      // walked the table past its end, or failed as out of memory)
      {"count huge", PRECIS_ERR_INVALID_ARGUMENT, "tensors->count", [](C&, T& t, Problem&, int32_t*&) { t.count = SIZE_MAX; }},
      {"numels past int64", PRECIS_ERR_INVALID_ARGUMENT, "numels[0..2] add up past", [](C&, T&, Problem& p, int32_t*&) { p.numels[0] = INT64_MAX - 5; }},
      // the tables written beside the list: aligned, apart from one another and from
      // the list's buffers (param_fingerprints on a param was zeroed by the step)
      {"fingerprints on a param", PRECIS_ERR_INVALID_ARGUMENT, "param_fingerprints shares memory with params[0]", [](C&, T& t, Problem& p, int32_t*&) { t.param_fingerprints = static_cast<uint64_t*>(const_cast<void*>(p.params[0])); }},
      {"kept on a grad", PRECIS_ERR_INVALID_ARGUMENT, "param_kept shares memory with grads[2]", [](C&, T& t, Problem& p, int32_t*&) { t.param_kept = static_cast<int64_t*>(const_cast<void*>(p.grads[2])); }},
      {"kept misaligned", PRECIS_ERR_INVALID_ARGUMENT, "param_kept (", [](C&, T& t, Problem&, int32_t*&) { t.param_kept = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(side_tables) + 4); }},
      {"kept on fingerprints", PRECIS_ERR_INVALID_ARGUMENT, "param_fingerprints and param_kept share memory", [](C&, T& t, Problem&, int32_t*&) { t.param_fingerprints = side_tables; t.param_kept = reinterpret_cast<int64_t*>(side_tables + 1); }},
      {"kept with muon_momentum", PRECIS_ERR_INVALID_ARGUMENT, "param_kept must be NULL", [](C& c, T& t, Problem&, int32_t*&) { c.rule = PRECIS_RULE_MUON_MOMENTUM; t.outputs = muon_outputs; t.param_kept = reinterpret_cast<int64_t*>(side_tables); }},
  };
  for (const BadCase& bc : cases) ExpectRefused(bc, false);
  // The unmutated call with a numel-0 tensor of NULL pointers is valid.
  std::mt19937_64 rng(31);
  Problem pb({B16, B16, F32, F16, F8}, {300, 0});
  pb.Init(rng);
  precis_step_config_t cfg = kHypers[0].Config();
  precis_step_tensors_t t = pb.Desc();
  pb.params[1] = pb.masters[1] = pb.ms[1] = pb.vs[1] = nullptr;
  pb.grads[1] = nullptr;
  pb.m_scales[1] = pb.v_scales[1] = nullptr;
  int32_t found = 77;
  EXPECT_EQ(precis_step(&cfg, &t, &found), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(found, 0);
  EXPECT_STREQ(precis_last_error(), "");
  // NULL structs; an empty list is a no-op.
  EXPECT_EQ(precis_step(nullptr, &t, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_step(&cfg, nullptr, nullptr), PRECIS_ERR_NULL_POINTER);
  precis_step_tensors_t empty = PRECIS_STEP_TENSORS_INIT;
  found = 77;
  EXPECT_EQ(precis_step(&cfg, &empty, &found), PRECIS_OK);
  EXPECT_EQ(found, 0);
}

TEST(Adam, MoreThreadsThanCanRunAreTheMostThatCan) {
  // libgomp exits the process when it cannot make a thread (40,000 asked did): a count
  // beyond the processors and OpenMP's default is capped, the bits those of 0's.
  std::mt19937_64 rng(32);
  Problem a({B16, B16, F32, F16, F8}, {100000, 8});
  a.Init(rng);
  Problem b = a;
  precis_step_config_t cfg = kHypers[0].Config();
  precis_step_tensors_t ta = a.Desc();
  ASSERT_EQ(precis_step(&cfg, &ta, nullptr), PRECIS_OK) << precis_last_error();
  cfg.num_threads = INT32_MAX;
  precis_step_tensors_t tb = b.Desc();
  ASSERT_EQ(precis_step(&cfg, &tb, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_TRUE(a.Snapshot() == b.Snapshot());
}

TEST(Adam, AmsgradBadInputsFailAndWriteNothing) {
  using C = precis_step_config_t;
  using T = precis_step_tensors_t;
  static float dummy_scales[4];
  static float* dummy_scale_ptrs[2] = {dummy_scales, dummy_scales};
  const size_t old_tensors_size = offsetof(precis_step_tensors_t, max_exp_avg_sqs);
  std::vector<BadCase> cases = {
      {"amsgrad 2", PRECIS_ERR_INVALID_ARGUMENT, "cfg->amsgrad", [](C& c, T&, Problem&, int32_t*&) { c.amsgrad = 2; }},
      {"old tensors struct", PRECIS_ERR_SIZE_MISMATCH, "with cfg->amsgrad", [=](C&, T& t, Problem&, int32_t*&) { t.size = old_tensors_size; }},
      {"max table NULL", PRECIS_ERR_NULL_POINTER, "tensors->max_exp_avg_sqs is NULL", [](C&, T& t, Problem&, int32_t*&) { t.max_exp_avg_sqs = nullptr; }},
      {"max[2] NULL", PRECIS_ERR_NULL_POINTER, "max_exp_avg_sqs[2] is NULL", [](C&, T&, Problem& p, int32_t*&) { p.vmaxs[2] = nullptr; }},
      {"max scales NULL", PRECIS_ERR_NULL_POINTER, "max_exp_avg_sq_scales", [](C&, T& t, Problem&, int32_t*&) { t.max_exp_avg_sq_scales = nullptr; }},
      {"max scale entry NULL", PRECIS_ERR_NULL_POINTER, "max_exp_avg_sq_scales[0]", [](C&, T&, Problem& p, int32_t*&) { p.vmax_scales[0] = nullptr; }},
      {"max scales for bf16", PRECIS_ERR_INVALID_ARGUMENT, "max_exp_avg_sq_scales must be NULL", [](C&, T& t, Problem&, int32_t*&) { t.exp_avg_sq_dtype = B16; t.exp_avg_sq_scales = nullptr; t.max_exp_avg_sq_scales = dummy_scale_ptrs; }},
      {"max is v", PRECIS_ERR_INVALID_ARGUMENT, "max_exp_avg_sqs[2] and exp_avg_sqs[2] share memory", [](C&, T&, Problem& p, int32_t*&) { p.vmaxs[2] = p.vs[2]; }},
      {"max inside the grads", PRECIS_ERR_INVALID_ARGUMENT, "max_exp_avg_sqs[0] and grads[0] share memory", [](C&, T&, Problem& p, int32_t*&) { p.vmaxs[0] = const_cast<uint8_t*>(static_cast<const uint8_t*>(p.grads[0])) + 100; }},
      {"max scales are v's", PRECIS_ERR_INVALID_ARGUMENT, "max_exp_avg_sq_scales[2] and exp_avg_sq_scales[2] share memory", [](C&, T&, Problem& p, int32_t*&) { p.vmax_scales[2] = p.v_scales[2] + 1; }},
      {"max scales in the max", PRECIS_ERR_INVALID_ARGUMENT, "max_exp_avg_sqs[0] and max_exp_avg_sq_scales[0] share memory", [](C&, T&, Problem& p, int32_t*&) { p.vmax_scales[0] = static_cast<float*>(p.vmaxs[0]); }},
  };
  for (const BadCase& bc : cases) ExpectRefused(bc, true);
}

// precis_fingerprint of each tensor's param bytes, as they are now.
std::vector<uint64_t> ParamFingerprints(const Problem& pb) {
  std::vector<const void*> bufs;
  std::vector<int64_t> nbytes;
  for (const Tensor& t : pb.ts) {
    bufs.push_back(t.param.data());
    nbytes.push_back(t.n * DSize(pb.c.pd));
  }
  return Fingerprints(bufs, nbytes);
}

// tensors->param_fingerprints: after a step, each tensor's entry is precis_fingerprint
// of its param as written, for every combination (its fused kernel and the generic
// one), with and without AMSGrad, on every path, 1 and 2 threads, at sizes that end
// mid-word, span tiles, or are empty, and for the README's policies at a size that spans
// chunks (each chunk's terms added by its thread). A skipped step (a NaN gradient)
// leaves the entries as they were, and an older struct (size short of the field) never
// reads it.
TEST(Adam, ParamFingerprintsAreThoseOfTheWrittenParams) {
  const Combo readme[] = {{F32, F32, F32, F32, F32}, {B16, B16, F32, B16, B16},
                          {B16, B16, I16, B16, B16}, {B16, B16, I16, F8, F8},
                          {B16, B16, F8, F8, F8}};
  std::vector<std::pair<Combo, std::vector<int64_t>>> cases;
  for (const Combo& c : AllCombos()) cases.push_back({c, {1, 127, 4097, 0, 3}});
  for (const Combo& c : readme) cases.push_back({c, {70001, 5}});
  for (const std::string& path : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    int k = 0;
    for (const auto& [c, sizes] : cases) {
      for (int generic : {0, 1}) {
        ASSERT_EQ(pr_cpu_generic_force(generic), 0);
        const bool ams = (k++ % 3) == 0;
        std::mt19937_64 rng(41 + k);
        Problem pb(c, sizes, ams);
        pb.Init(rng);
        precis_step_config_t cfg = kHypers[k % 2].Config();
        cfg.amsgrad = ams;
        cfg.num_threads = 1 + generic;
        precis_step_tensors_t d = pb.Desc();
        std::vector<uint64_t> got(d.count, 0xDEADu);
        d.param_fingerprints = got.data();
        ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
        ASSERT_EQ(got, ParamFingerprints(pb)) << ComboName(c) << " on " << path
                                              << (generic ? " (generic, 2 threads)" : "");
      }
    }
  }
  ASSERT_EQ(pr_cpu_generic_force(0), 0);
  ASSERT_EQ(pr_cpu_isa_force(nullptr), 0);

  std::mt19937_64 rng(43);
  Problem pb({B16, B16, I16, F8, F8}, {300, 70001});
  pb.Init(rng);
  Encode(pb.ts[1].grad, B16, 70000, NAN);
  precis_step_config_t cfg = kHypers[0].Config();
  cfg.check_finite = 1;
  precis_step_tensors_t d = pb.Desc();
  std::vector<uint64_t> got(d.count, 0xDEADu);
  d.param_fingerprints = got.data();
  int32_t found = 0;
  ASSERT_EQ(precis_step(&cfg, &d, &found), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(found, 1);
  EXPECT_EQ(got, std::vector<uint64_t>(d.count, 0xDEADu));
  d.size = offsetof(precis_step_tensors_t, param_fingerprints);
  Encode(pb.ts[1].grad, B16, 70000, 0.5f);
  ASSERT_EQ(precis_step(&cfg, &d, &found), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(found, 0);
  EXPECT_EQ(got, std::vector<uint64_t>(d.count, 0xDEADu));
}

// A call's work is cut into chunks of 65,536 elements, or as few as 16,384 when the
// call is too small to give every thread two (here 1 and 2 threads: 65,536; 3:
// 32,768; 8: 16,384): every README policy, with AMSGrad's max and the fingerprints,
// takes the same bits at each.
TEST(Adam, ChunksOfEverySizeGiveTheSameBits) {
  const Combo readme[] = {{F32, F32, F32, F32, F32}, {B16, B16, F32, B16, B16},
                          {B16, B16, I16, B16, B16}, {B16, B16, I16, F8, F8},
                          {B16, B16, F8, F8, F8}};
  const std::vector<int64_t> sizes = {140001, 65536, 7, 70000};
  for (const Combo& c : readme) {
    std::vector<std::vector<std::vector<uint8_t>>> states;
    for (int threads : {1, 2, 3, 8}) {
      std::mt19937_64 rng(47);
      Problem pb(c, sizes, true);
      pb.Init(rng);
      precis_step_config_t cfg = kHypers[1].Config();
      cfg.amsgrad = 1;
      cfg.num_threads = threads;
      std::vector<uint64_t> got(sizes.size(), 0);
      for (int step = 0; step < 2; ++step) {
        precis_step_tensors_t d = pb.Desc();
        d.param_fingerprints = got.data();
        ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
        for (Tensor& t : pb.ts) ++t.step;
      }
      EXPECT_EQ(got, ParamFingerprints(pb)) << ComboName(c) << ", " << threads << " threads";
      states.push_back(pb.Snapshot());
    }
    for (size_t i = 1; i < states.size(); ++i) {
      EXPECT_TRUE(states[i] == states[0]) << ComboName(c) << ", run " << i;
    }
  }
}

TEST(Adam, StructsOfAnOlderHeaderStillWork) {
  // A caller built before amsgrad passes smaller structs: no max tables, and a
  // config whose size ends before amsgrad (whatever the bytes there) is plain Adam.
  std::mt19937_64 rng(33);
  Problem plain({B16, B16, F32, B16, B16}, {1, 127, 4097});
  plain.Init(rng);
  Problem old = plain;
  precis_step_config_t cfg = kHypers[0].Config();
  ASSERT_EQ(plain.Step(cfg), PRECIS_OK) << precis_last_error();
  precis_step_config_t old_cfg = cfg;
  old_cfg.size = offsetof(precis_step_config_t, amsgrad);
  old_cfg.amsgrad = 1;  // not covered by size: never read
  precis_step_tensors_t t = old.Desc();
  t.size = offsetof(precis_step_tensors_t, max_exp_avg_sqs);
  ASSERT_EQ(precis_step(&old_cfg, &t, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_TRUE(old.Snapshot() == plain.Snapshot());
  // One byte short of either is refused.
  t.size -= 1;
  EXPECT_EQ(precis_step(&old_cfg, &t, nullptr), PRECIS_ERR_SIZE_MISMATCH);
  t.size += 1;
  old_cfg.size -= 1;
  EXPECT_EQ(precis_step(&old_cfg, &t, nullptr), PRECIS_ERR_SIZE_MISMATCH);
}

TEST(Adam, AmsgradNanPropagatesAsTorchMaximum) {
  // torch.maximum(max, v) is NaN when either is: a lost state shows.
  EXPECT_TRUE(std::isnan(precis_adam_max(NAN, 1.0f)));
  EXPECT_TRUE(std::isnan(precis_adam_max(1.0f, NAN)));
  EXPECT_EQ(precis_adam_max(2.0f, 1.0f), 2.0f);
  EXPECT_EQ(precis_adam_max(1.0f, 2.0f), 2.0f);
  EXPECT_EQ(precis_adam_max(0.0f, 0.0f), 0.0f);
}

TEST(Adam, ConversionHelpersRejectBadInputs) {
  std::vector<float> src(10, 1.0f), dst(10, 5.0f), scales(1, 3.0f);
  std::vector<uint8_t> codes(20, 0xCD);
  EXPECT_EQ(precis_moment_encode(src.data(), -1, 0, codes.data(), F16, scales.data()), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_moment_encode(nullptr, 10, 0, codes.data(), F16, scales.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_moment_encode(src.data(), 10, 0, nullptr, F16, scales.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_moment_encode(src.data(), 10, 0, codes.data(), F16, nullptr), PRECIS_ERR_NULL_POINTER);
  // the scales it would need, counted without overflow at the largest numel (refused
  // before any element is read)
  EXPECT_EQ(precis_moment_encode(src.data(), INT64_MAX, 0, codes.data(), F8, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_NE(std::string(precis_last_error()).find("need 72057594037927936 block scales"), std::string::npos)
      << precis_last_error();
  EXPECT_EQ(precis_moment_encode(src.data(), 10, 2, codes.data(), F16, scales.data()), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_moment_encode(src.data(), 10, 0, codes.data(), I16, scales.data()), PRECIS_ERR_INVALID_POLICY);
  EXPECT_EQ(precis_moment_encode(src.data(), 10, 0, codes.data(), static_cast<precis_dtype_t>(77), scales.data()), PRECIS_ERR_INVALID_DTYPE);
  src[7] = -1.0f;  // a negative second moment
  EXPECT_EQ(precis_moment_encode(src.data(), 10, 1, codes.data(), F16, scales.data()), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("src[7]"), std::string::npos);
  EXPECT_EQ(codes, std::vector<uint8_t>(20, 0xCD));
  EXPECT_EQ(scales[0], 3.0f);
  EXPECT_EQ(precis_moment_decode(codes.data(), nullptr, 10, 0, F8, dst.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_moment_decode(codes.data(), nullptr, 10, 0, B16, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(dst, std::vector<float>(10, 5.0f));
  EXPECT_EQ(precis_moment_decode(nullptr, nullptr, 0, 0, B16, nullptr), PRECIS_OK);  // empty
  EXPECT_EQ(precis_moment_decode(codes.data(), nullptr, 10, 0, B16, dst.data()), PRECIS_OK);  // unscaled
  std::vector<uint16_t> p(4);
  std::vector<int16_t> r(4);
  EXPECT_EQ(precis_remainder_split(nullptr, 4, p.data(), r.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_remainder_split(src.data(), -4, p.data(), r.data()), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_remainder_join(p.data(), nullptr, 4, dst.data()), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_remainder_join(p.data(), r.data(), 4, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_cpu_isa(nullptr), PRECIS_ERR_NULL_POINTER);
}

// A buffer off its element alignment is refused, naming it, before anything is
// written; every role, the scales and the check_finite entry point included.
TEST(Adam, MisalignedBuffersFailAndWriteNothing) {
  constexpr int64_t n = 5;
  const char* const roles[] = {"params[0]", "grads[0]",  "masters[0]", "exp_avgs[0]",
                               "exp_avg_sqs[0]", "exp_avg_scales[0]", "exp_avg_sq_scales[0]"};
  // bf16 params, fp32 grads and master, fp16 exp_avg, fp8 exp_avg_sq: 2-, 4- and 1-byte
  // elements (fp8 bytes have no alignment to miss: role 4 is never misaligned).
  for (int bad : {0, 1, 2, 3, 5, 6}) {
    Buf bufs[7] = {Buf(n * 2, bad == 0), Buf(n * 4, bad == 1), Buf(n * 4, bad == 2 ? 2 : 0),
                   Buf(n * 2, bad == 3), Buf(n, 0),           Buf(4, bad == 5 ? 3 : 0),
                   Buf(4, bad == 6 ? 1 : 0)};
    const std::vector<Buf> before(std::begin(bufs), std::end(bufs));
    void* p[] = {bufs[0].data()};
    const void* g[] = {bufs[1].data()};
    void* mst[] = {bufs[2].data()};
    void* m[] = {bufs[3].data()};
    void* v[] = {bufs[4].data()};
    float* ms[] = {reinterpret_cast<float*>(bufs[5].data())};
    float* vs[] = {reinterpret_cast<float*>(bufs[6].data())};
    const int64_t numels[] = {n}, steps[] = {1};
    precis_step_tensors_t t = PRECIS_STEP_TENSORS_INIT;
    t.count = 1;
    t.param_dtype = B16, t.grad_dtype = F32, t.master_dtype = F32;
    t.exp_avg_dtype = F16, t.exp_avg_sq_dtype = F8;
    t.params = p, t.grads = g, t.masters = mst, t.exp_avgs = m, t.exp_avg_sqs = v;
    t.exp_avg_scales = ms, t.exp_avg_sq_scales = vs, t.numels = numels, t.steps = steps;
    precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
    int32_t found = 77;
    EXPECT_EQ(precis_step(&cfg, &t, &found), PRECIS_ERR_INVALID_ARGUMENT) << roles[bad];
    EXPECT_NE(std::string(precis_last_error()).find(std::string(roles[bad]) + " ("),
              std::string::npos) << precis_last_error();
    EXPECT_NE(std::string(precis_last_error()).find("not aligned"), std::string::npos);
    EXPECT_EQ(found, 77);
    if (bad == 1) {
      EXPECT_EQ(precis_step_check_finite(&t, &found), PRECIS_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(precis_last_error()).find("grads[0]"), std::string::npos);
    }
    for (int k = 0; k < 7; ++k) {
      EXPECT_TRUE(bufs[k] == before[k]) << roles[bad] << " wrote " << k;
      EXPECT_TRUE(bufs[k].CanaryIntact()) << k;
    }
  }
}

TEST(Adam, ConversionHelpersRefuseMisalignedBuffers) {
  alignas(16) uint8_t raw[256] = {};
  const uint8_t* const src = raw + 1;
  float* const f = reinterpret_cast<float*>(raw + 64);
  float* const scales = reinterpret_cast<float*>(raw + 128);
  EXPECT_EQ(precis_moment_encode(reinterpret_cast<const float*>(src), 4, 0, raw + 200, F16, scales),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("src"), std::string::npos) << precis_last_error();
  EXPECT_EQ(precis_moment_encode(f, 4, 0, raw + 201, F16, scales), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("dst"), std::string::npos) << precis_last_error();
  EXPECT_EQ(precis_moment_encode(f, 4, 0, raw + 201, F8, scales), PRECIS_OK);  // bytes: any address
  EXPECT_EQ(precis_moment_decode(raw + 201, scales, 4, 1, F8, reinterpret_cast<float*>(raw + 2)),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(precis_moment_decode(raw + 200, reinterpret_cast<const float*>(raw + 129), 4, 0, F16, f),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("scales"), std::string::npos) << precis_last_error();
  EXPECT_EQ(precis_remainder_split(f, 4, reinterpret_cast<uint16_t*>(raw + 3),
                                   reinterpret_cast<int16_t*>(raw + 200)),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("param_bf16"), std::string::npos);
  EXPECT_EQ(precis_remainder_join(reinterpret_cast<const uint16_t*>(raw + 200),
                                  reinterpret_cast<const int16_t*>(raw + 210), 4,
                                  reinterpret_cast<float*>(raw + 6)),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("master"), std::string::npos);
}

// The names before issue #66 (the engine was Adam's) stay in the ABI: the old types
// and initializers are the new ones, the old exported functions step and check as their
// namesakes, bit for bit, and their errors name the function called.
TEST(Abi, OldNamesAreTheNewOnes) {
  static_assert(sizeof(precis_adam_config_t) == sizeof(precis_step_config_t), "config");
  static_assert(sizeof(precis_adam_tensors_t) == sizeof(precis_step_tensors_t), "tensors");
  std::mt19937_64 rng(66);
  Problem a({B16, B16, F32, F8, F16}, {1, 127, 4097});
  a.Init(rng);
  Problem b = a;
  const std::vector<uint8_t> before = a.ts[2].param;
  precis_adam_config_t cfg = PRECIS_ADAM_CONFIG_INIT;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.01;
  const precis_step_config_t cfg_new = PRECIS_STEP_CONFIG_INIT;
  EXPECT_EQ(std::memcmp(&cfg_new.size, &cfg.size, sizeof cfg.size), 0);
  for (int k = 0; k < 3; ++k) {
    ASSERT_EQ(a.Step(cfg), PRECIS_OK) << precis_last_error();
    precis_adam_tensors_t d = b.Desc();
    ASSERT_EQ(precis_adam_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
    for (Tensor& t : b.ts) ++t.step;
  }
  EXPECT_NE(a.ts[2].param, before) << "the steps moved the params";
  for (size_t i = 0; i < a.ts.size(); ++i) {
    EXPECT_EQ(a.ts[i].param, b.ts[i].param) << "param " << i;
    EXPECT_EQ(a.ts[i].master, b.ts[i].master) << "master " << i;
    EXPECT_EQ(a.ts[i].m, b.ts[i].m) << "m " << i;
    EXPECT_EQ(a.ts[i].v, b.ts[i].v) << "v " << i;
    EXPECT_EQ(a.ts[i].m_scales, b.ts[i].m_scales) << "m scales " << i;
  }
  // a NaN gradient: both check functions find it; errors name the name called
  precis_adam_tensors_t d = b.Desc();
  reinterpret_cast<uint16_t*>(b.ts[1].grad.data())[5] = 0x7fc0;  // bf16 NaN
  int32_t found_old = 0, found_new = 0;
  EXPECT_EQ(precis_adam_check_finite(&d, &found_old), PRECIS_OK);
  EXPECT_EQ(precis_step_check_finite(&d, &found_new), PRECIS_OK);
  EXPECT_EQ(found_old, 1);
  EXPECT_EQ(found_new, 1);
  cfg.beta1 = 1.0;
  EXPECT_EQ(precis_adam_step(&cfg, &d, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(precis_last_error()).rfind("precis_adam_step: cfg->beta1", 0), 0u)
      << precis_last_error();
  EXPECT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(precis_last_error()).rfind("precis_step: cfg->beta1", 0), 0u)
      << precis_last_error();
  EXPECT_EQ(precis_adam_check_finite(&d, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(std::string(precis_last_error()).rfind("precis_adam_check_finite: ", 0), 0u)
      << precis_last_error();
}

}  // namespace
