// Tests of precis_step's param_kept (the step that sees writes into its params itself):
// a step with it gives the bits of precis_resync_masters of every written param followed
// by a step without it, for every way a param is written (none, a few elements, a few
// elements past the first 1,024, a whole load), at odd sizes, with fp32 and fp16
// masters, bf16 and fp16 params, under Adam, SGD and Lion, on the fused and the generic
// loops; kept is precis_resync_masters'. A whole load that spares a param's first
// elements is taken element by element (the documented exception); a skipped step and
// a refused call write nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "precis/precis.h"
#include "precis_convert.h"
#include "step_cpu.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

// The first elements a step looks at for a whole load (step_cpu.c's PR_PREFIX).
constexpr int64_t kPrefix = 1024;

struct Param {
  int64_t n = 0, step = 0;
  std::vector<uint8_t> param, grad, master, m, v;
  std::vector<float> m_scales, v_scales;
};

struct List : AdamTables {
  Combo c;
  std::vector<Param> ps;
  List(const Combo& combo, const std::vector<int64_t>& sizes, uint32_t seed) : c(combo) {
    std::mt19937 r(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t n : sizes) {
      Param p;
      p.n = n;
      p.param.assign(n * DSize(c.pd), 0);
      p.grad.assign(n * DSize(c.gd), 0);
      p.master.assign(n * DSize(c.md), 0);
      p.m.assign(n * DSize(c.ed), 0);
      p.v.assign(n * DSize(c.sd), 0);
      if (Scaled(c.ed)) p.m_scales.assign(Blocks(n), 1.0f);
      if (Scaled(c.sd)) p.v_scales.assign(Blocks(n), 1.0f);
      for (int64_t i = 0; i < n; ++i) {
        SetMasterValue(p.param, p.master, kSeparate, c.pd, c.md, i, 0.5f * nd(r));
        Encode(p.grad, c.gd, i, 0.01f * nd(r));
      }
      ps.push_back(std::move(p));
    }
  }
  precis_step_tensors_t Desc() {
    Clear();
    for (Param& p : ps) {
      Add(p.param.data(), p.grad.data(), p.master.data(), p.m.data(), p.v.data(),
          p.m_scales.empty() ? nullptr : p.m_scales.data(),
          p.v_scales.empty() ? nullptr : p.v_scales.data(), p.n, p.step + 1);
    }
    return Describe(c);
  }
  precis_status_t Step(const precis_step_config_t& cfg, int64_t* kept,
                       int32_t* found_inf = nullptr) {
    precis_step_tensors_t d = Desc();
    d.param_kept = kept;
    const precis_status_t st = precis_step(&cfg, &d, found_inf);
    if (st == PRECIS_OK && !(found_inf != nullptr && *found_inf)) {
      for (Param& p : ps) ++p.step;
    }
    return st;
  }
  bool SameBytes(const List& o, std::string* where) const {
    for (size_t k = 0; k < ps.size(); ++k) {
      const Param &a = ps[k], &b = o.ps[k];
      const std::pair<const char*, bool> same[] = {
          {"param", a.param == b.param}, {"master", a.master == b.master},
          {"m", a.m == b.m},             {"v", a.v == b.v},
          {"scales", a.m_scales == b.m_scales && a.v_scales == b.v_scales}};
      for (const auto& [name, ok] : same) {
        if (!ok) {
          *where = "tensor " + std::to_string(k) + " (" + std::to_string(a.n) + " elements): " +
                   name;
          return false;
        }
      }
    }
    return true;
  }
};

// How the params are written behind the step's back.
enum Write { kNothing, kFew, kFewPastPrefix, kWhole, kWholeSparingPrefix };

const char* WriteName(Write w) {
  static const char* const names[] = {"nothing", "few", "few_past_prefix", "whole",
                                      "whole_sparing_prefix"};
  return names[w];
}

// Writes into list's params as w says (the same values for the same seed).
void WriteInto(List& list, Write w, uint32_t seed) {
  std::mt19937 r(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Param& p : list.ps) {
    for (int64_t i = 0; i < p.n; ++i) {
      bool write = false;
      switch (w) {
        case kNothing: break;
        case kFew: write = r() % 97 == 0 || i == p.n - 1; break;
        case kFewPastPrefix: write = i >= kPrefix && r() % 97 == 0; break;
        case kWhole: write = true; break;
        case kWholeSparingPrefix: write = i >= kPrefix; break;
      }
      if (write) Encode(p.param, list.c.pd, i, 0.5f * nd(r) + 3.0f);  // never the old value
    }
  }
}

// The reference: every param resynced by precis_resync_masters (a whole load per its
// count), or element by element (per_element: the whole-load-sparing-prefix case),
// then a step without param_kept. kept: the resync's.
void Reference(List& list, const precis_step_config_t& cfg, bool per_element,
               std::vector<int64_t>* kept) {
  precis_step_tensors_t d = list.Desc();
  std::vector<uint8_t> stale(list.ps.size(), 1);
  kept->assign(list.ps.size(), 0);
  if (per_element) {
    for (size_t k = 0; k < list.ps.size(); ++k) {
      Param& p = list.ps[k];
      for (int64_t i = 0; i < p.n; ++i) {
        const float param = Decode(p.param, list.c.pd, i);
        const float master = Decode(p.master, list.c.md, i);
        uint16_t bits;
        std::memcpy(&bits, &p.param[i * 2], 2);
        const uint16_t rounded = list.c.pd == B16 ? precis_f32_to_bf16_rn(master)
                                                  : precis_f32_to_f16_rn(master);
        if (rounded == bits) {
          ++(*kept)[k];
        } else {
          Encode(p.master, list.c.md, i, param);
        }
      }
    }
  } else {
    ASSERT_EQ(precis_resync_masters(d.masters, list.c.md, (const void* const*)d.params,
                                    list.c.pd, d.numels, stale.data(), kept->data(),
                                    (int64_t)list.ps.size()),
              PRECIS_OK)
        << precis_last_error();
  }
  ASSERT_EQ(list.Step(cfg, nullptr), PRECIS_OK) << precis_last_error();
}

struct Case {
  Combo c;
  int rule;
  bool generic;  // the generic kernel forced (pr_cpu_generic_force)
};

std::string CaseName(const Case& k) {
  static const char* const rules[] = {"adam", "sgd", "lion"};
  return ComboName(k.c) + "_" + rules[k.rule] + (k.generic ? "_generic" : "");
}

precis_step_config_t ConfigOf(int rule) {
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.rule = rule;
  cfg.lr = 1e-3;
  cfg.weight_decay = 0.01;
  cfg.decoupled_weight_decay = 1;
  cfg.momentum = rule == PRECIS_RULE_SGD ? 0.9 : 0.0;
  cfg.beta1 = rule == PRECIS_RULE_LION ? 0.9 : 0.9;
  cfg.beta2 = rule == PRECIS_RULE_LION ? 0.99 : 0.999;
  cfg.seed = 7;
  return cfg;
}

class StepKept : public ::testing::TestWithParam<Case> {
 protected:
  void TearDown() override { pr_cpu_generic_force(0); }
};

TEST_P(StepKept, GivesTheResyncsBitsForEveryWrite) {
  const Case k = GetParam();
  pr_cpu_generic_force(k.generic ? 1 : 0);
  const precis_step_config_t cfg = ConfigOf(k.rule);
  // 1, 127, 4097: odd sizes; 70001: several chunks, and over 64 x the prefix (a whole
  // load sparing the prefix is then a whole load by the count)
  const std::vector<int64_t> sizes = {1, 127, 4097, 70001, 0, 2048};
  for (Write w : {kNothing, kFew, kFewPastPrefix, kWhole, kWholeSparingPrefix}) {
    SCOPED_TRACE(WriteName(w));
    List ref(k.c, sizes, 11), got(k.c, sizes, 11);
    std::vector<int64_t> unused(sizes.size(), -1);
    ASSERT_EQ(ref.Step(cfg, nullptr), PRECIS_OK) << precis_last_error();  // a first step
    ASSERT_EQ(got.Step(cfg, unused.data()), PRECIS_OK) << precis_last_error();
    for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(unused[i], sizes[i]) << i;
    WriteInto(ref, w, 23);
    WriteInto(got, w, 23);
    std::vector<int64_t> want, kept(sizes.size(), -1);
    Reference(ref, cfg, w == kWholeSparingPrefix, &want);
    ASSERT_EQ(got.Step(cfg, kept.data()), PRECIS_OK) << precis_last_error();
    std::string where;
    EXPECT_TRUE(got.SameBytes(ref, &where)) << where;
    EXPECT_EQ(kept, want);
    if (w == kNothing) { EXPECT_EQ(kept, sizes); }
    if (w == kWholeSparingPrefix) { EXPECT_EQ(kept[3], kPrefix); }  // its spared elements
    // and the step after: nothing written since, every element kept
    ASSERT_EQ(ref.Step(cfg, nullptr), PRECIS_OK);
    ASSERT_EQ(got.Step(cfg, kept.data()), PRECIS_OK);
    EXPECT_TRUE(got.SameBytes(ref, &where)) << where;
    EXPECT_EQ(kept, sizes);
  }
}

std::vector<Case> Cases() {
  const Combo bf16_default{B16, B16, F32, B16, B16}, fp8_moments{B16, B16, F32, F8, F8},
      fp16_moments{B16, B16, F32, F16, F16}, fp16_master{B16, B16, F16, B16, B16},
      fp16_params{F16, F32, F32, F32, F32}, sgd_default{B16, B16, F32, B16, F32};
  std::vector<Case> out;
  for (bool generic : {false, true}) {
    for (const Combo& c : {bf16_default, fp8_moments, fp16_moments, fp16_master, fp16_params}) {
      out.push_back({c, PRECIS_RULE_ADAM, generic});
    }
    out.push_back({sgd_default, PRECIS_RULE_SGD, generic});
    out.push_back({sgd_default, PRECIS_RULE_LION, generic});
    out.push_back({fp16_master, PRECIS_RULE_SGD, generic});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, StepKept, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return CaseName(i.param); });

TEST(StepKeptArgs, ASkippedStepWritesNothing) {
  const Combo c{B16, B16, F32, B16, B16};
  List list(c, {127, 4097}, 3), before(c, {127, 4097}, 3);
  WriteInto(list, kFew, 5);
  WriteInto(before, kFew, 5);
  Encode(list.ps[1].grad, c.gd, 17, NAN);
  Encode(before.ps[1].grad, c.gd, 17, NAN);
  precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
  cfg.check_finite = 1;
  std::vector<int64_t> kept = {-5, -5};
  int32_t found = 0;
  ASSERT_EQ(list.Step(cfg, kept.data(), &found), PRECIS_OK) << precis_last_error();
  EXPECT_EQ(found, 1);
  std::string where;
  EXPECT_TRUE(list.SameBytes(before, &where)) << where;
  EXPECT_EQ(kept, (std::vector<int64_t>{-5, -5}));
}

TEST(StepKeptArgs, RefusedWithoutASeparateMaster) {
  const Combo remainders{B16, B16, I16, B16, B16}, none{B16, B16, B16, B16, B16},
      fp32{F32, F32, F32, F32, F32};
  for (const Combo& c : {remainders, none, fp32}) {
    SCOPED_TRACE(ComboName(c));
    List list(c, {127}, 3);
    List before = list;
    std::vector<int64_t> kept = {-5};
    EXPECT_EQ(list.Step(ConfigOf(PRECIS_RULE_ADAM), kept.data()), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("param_kept must be NULL"), std::string::npos)
        << precis_last_error();
    std::string where;
    EXPECT_TRUE(list.SameBytes(before, &where)) << where;
    EXPECT_EQ(kept[0], -5);
  }
}

}  // namespace
