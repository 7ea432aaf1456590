// Tests of precis_step's block record (tensors->param_block_fingerprints): after a step,
// tensor i's max(1, ceil(numels[i] / PRECIS_FINGERPRINT_BLOCK)) entries, from the sum of
// the earlier tensors' counts, are precis_fingerprint_blocks of its param as the step
// left it (blocks of PRECIS_FINGERPRINT_BLOCK elements' bytes), and summed with the
// length term they are its param_fingerprints entry: for fp32 params, bf16 params with
// an fp32 master, int16 or 8-bit remainders, or none (stochastic rounding), fp16 params,
// the generic kernel's layouts; under Adam, SGD and Lion; on the fused and the generic
// loops, every SIMD path, 1, 3 and 8 threads; with param_fingerprints or alone; at sizes
// of one element, a partial block, one block, one block and an element, three blocks and
// 5 elements, with an empty tensor in the middle. A skipped step (found_inf) leaves the
// record untouched, muon_momentum (no params written) refuses one, and a struct of an
// older header (size short of the field) never reads it.
//
// And the step's own compare of those blocks (tensors->param_block_records, with
// remainders): a block written since its record has its remainders zeroed before it is
// stepped, as a resync before the step would (the step's bits those of zeroing them by
// hand, then stepping without the compare), param_blocks_kept counts the others'
// elements, a skipped step resyncs too (precis_step_skipped alike), and the refusals (no remainders, kept alone,
// shared memory) write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "precis/precis.h"
#include "step_cpu.h"
#include "tests/c/test_support.h"

namespace {

using namespace precis_test;

constexpr uint64_t kSentinel = 0xB10C5E7ull;  // a record entry no step should leave
constexpr uint64_t kLengthWeight = 0x9E3779B97F4A7C15ull;

// One element; a partial block; one block; one block and one element; an empty tensor
// (its one entry 0); three blocks and 5 elements.
const std::vector<int64_t> kSizes = {1, 127, PRECIS_FINGERPRINT_BLOCK, 0,
                                     PRECIS_FINGERPRINT_BLOCK + 1,
                                     3 * PRECIS_FINGERPRINT_BLOCK + 5};

// Record entries of a tensor of n elements.
int64_t BlockCount(int64_t n) {
  return n == 0 ? 1 : (n + PRECIS_FINGERPRINT_BLOCK - 1) / PRECIS_FINGERPRINT_BLOCK;
}

struct Param {
  int64_t n = 0, step = 0;
  std::vector<uint8_t> param, grad, master, m, v;
  std::vector<float> m_scales, v_scales;
};

// A list of tensors of combination c, masters in [-1, 1], fresh moments.
struct List : AdamTables {
  Combo c;
  std::vector<Param> ps;
  List(const Combo& combo, const std::vector<int64_t>& sizes, uint32_t seed) : c(combo) {
    std::mt19937 r(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t n : sizes) {
      Param p;
      p.n = n;
      p.param.assign(n * DSize(c.pd), 0);
      p.grad.assign(n * DSize(c.gd), 0);
      if (ModeOf(c) != kNone) p.master.assign(n * DSize(c.md), 0);
      p.m.assign(n * DSize(c.ed), 0);
      p.v.assign(n * DSize(c.sd), 0);
      if (Scaled(c.ed)) p.m_scales.assign(Blocks(n), 1.0f);
      if (Scaled(c.sd)) p.v_scales.assign(Blocks(n), 1.0f);
      for (int64_t i = 0; i < n; ++i) {
        SetMasterValue(p.param, p.master, ModeOf(c), c.pd, c.md, i, u(r));
      }
      ps.push_back(std::move(p));
    }
    NewGrads(seed + 1);
  }
  void NewGrads(uint32_t seed) {
    std::mt19937 r(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (Param& p : ps) {
      for (int64_t i = 0; i < p.n; ++i) Encode(p.grad, c.gd, i, 0.1f * nd(r) + 1e-3f);
    }
  }
  precis_step_tensors_t Desc() {
    Clear();
    for (Param& p : ps) {
      Add(p.param.data(), p.grad.data(), p.master.empty() ? nullptr : p.master.data(),
          p.m.data(), p.v.data(), p.m_scales.empty() ? nullptr : p.m_scales.data(),
          p.v_scales.empty() ? nullptr : p.v_scales.data(), p.n, p.step + 1);
    }
    return Describe(c);
  }
  void Advance() {
    for (Param& p : ps) ++p.step;
  }
  int64_t RecordSize() const {
    int64_t total = 0;
    for (const Param& p : ps) total += BlockCount(p.n);
    return total;
  }
  // precis_fingerprint_blocks of the params as they are now: the record the step must
  // leave.
  std::vector<uint64_t> ParamBlocks() const {
    std::vector<const void*> bufs;
    std::vector<int64_t> nbytes;
    for (const Param& p : ps) {
      bufs.push_back(p.param.data());
      nbytes.push_back(p.n * (int64_t)DSize(c.pd));
    }
    std::vector<uint64_t> out((size_t)RecordSize(), 0);
    EXPECT_EQ(precis_fingerprint_blocks(bufs.data(), nbytes.data(), (int64_t)bufs.size(),
                                        PRECIS_FINGERPRINT_BLOCK * (int64_t)DSize(c.pd),
                                        out.data()),
              PRECIS_OK)
        << precis_last_error();
    return out;
  }
  std::vector<uint64_t> ParamFingerprints() const {
    std::vector<const void*> bufs;
    std::vector<int64_t> nbytes;
    for (const Param& p : ps) {
      bufs.push_back(p.param.data());
      nbytes.push_back(p.n * (int64_t)DSize(c.pd));
    }
    return Fingerprints(bufs, nbytes);
  }
  // The bytes of every buffer the step writes, for "nothing written".
  std::vector<std::vector<uint8_t>> State() const {
    std::vector<std::vector<uint8_t>> s;
    for (const Param& p : ps) {
      s.push_back(p.param), s.push_back(p.master), s.push_back(p.m), s.push_back(p.v);
    }
    return s;
  }
};

// got equals want entry for entry; else the first few differing entries, each named by
// its tensor and block.
::testing::AssertionResult SameRecord(const List& list, const std::vector<uint64_t>& got,
                                      const std::vector<uint64_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " entries, want " << want.size();
  }
  std::ostringstream diffs;
  int shown = 0, differing = 0;
  size_t at = 0;
  for (size_t k = 0; k < list.ps.size(); ++k) {
    for (int64_t b = 0; b < BlockCount(list.ps[k].n); ++b, ++at) {
      if (got[at] == want[at]) continue;
      if (shown++ < 4) {
        diffs << " tensor " << k << " (" << list.ps[k].n << " elements) block " << b
              << " (entry " << at << "): 0x" << std::hex << got[at] << ", want 0x" << want[at]
              << std::dec << ";";
      }
      ++differing;
    }
  }
  if (differing == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differing << " of " << got.size()
                                       << " entries differ:" << diffs.str();
}

// The record of each tensor summed, plus its bytes * 0x9E3779B97F4A7C15, is its
// param_fingerprints entry.
::testing::AssertionResult BlocksSumToFingerprints(const List& list,
                                                   const std::vector<uint64_t>& record,
                                                   const std::vector<uint64_t>& fingerprints) {
  size_t at = 0;
  for (size_t k = 0; k < list.ps.size(); ++k) {
    uint64_t sum = (uint64_t)(list.ps[k].n * (int64_t)DSize(list.c.pd)) * kLengthWeight;
    for (int64_t b = 0; b < BlockCount(list.ps[k].n); ++b) sum += record[at++];
    if (sum != fingerprints[k]) {
      return ::testing::AssertionFailure()
             << "tensor " << k << " (" << list.ps[k].n << " elements): blocks + length term 0x"
             << std::hex << sum << ", param_fingerprints 0x" << fingerprints[k];
    }
  }
  return ::testing::AssertionSuccess();
}

precis_step_config_t ConfigOf(int rule) {
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.rule = rule;
  cfg.lr = rule == PRECIS_RULE_LION ? 1e-3 : 1e-2;  // most bf16 params move each step
  cfg.weight_decay = 0.01;
  cfg.decoupled_weight_decay = 1;
  cfg.momentum = rule == PRECIS_RULE_SGD ? 0.9 : 0.0;
  cfg.beta1 = 0.9;
  cfg.beta2 = rule == PRECIS_RULE_LION ? 0.99 : 0.999;
  cfg.seed = 7;
  return cfg;
}

struct Case {
  const char* policy;
  Combo c;
  int rule;
  bool generic;  // the generic kernel forced (pr_cpu_generic_force)
};

std::string CaseName(const Case& k) {
  static const char* const rules[] = {"adam", "sgd", "lion"};
  return std::string(k.policy) + "_" + rules[k.rule] + (k.generic ? "_generic" : "");
}

const char* const kAllPaths[] = {"scalar", "avx2", "avx512", "neon", "sve"};

// The SIMD paths this CPU can run.
std::vector<std::string> RunnablePaths() {
  std::vector<std::string> paths;
  for (const char* p : kAllPaths) {
    if (pr_cpu_isa_force(p) == 0) paths.push_back(p);
  }
  EXPECT_EQ(pr_cpu_isa_force(nullptr), 0);
  return paths;
}

class StepBlocks : public ::testing::TestWithParam<Case> {
 protected:
  void TearDown() override {
    pr_cpu_generic_force(0);
    pr_cpu_isa_force(nullptr);
  }
};

// Two steps, each leaving in the record (a stale one: kSentinel before the first, the
// first step's values before the second) the blocks of the params it wrote; with
// param_fingerprints too, each tensor's blocks sum to its entry.
TEST_P(StepBlocks, RecordIsTheBlocksOfTheParamsAfterEachStep) {
  const Case k = GetParam();
  ASSERT_EQ(pr_cpu_generic_force(k.generic ? 1 : 0), 0);
  for (const std::string& path : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    for (int threads : {1, 3, 8}) {
      for (bool with_fingerprints : {false, true}) {
        SCOPED_TRACE(path + ", " + std::to_string(threads) + " threads" +
                     (with_fingerprints ? ", with param_fingerprints" : ", alone"));
        precis_step_config_t cfg = ConfigOf(k.rule);
        cfg.num_threads = threads;
        List list(k.c, kSizes, 11);
        std::vector<uint64_t> record((size_t)list.RecordSize(), kSentinel);
        for (int step = 1; step <= 2; ++step) {
          const std::vector<uint64_t> before = list.ParamBlocks();
          std::vector<uint64_t> fingerprints(list.ps.size(), kSentinel);
          precis_step_tensors_t d = list.Desc();
          d.param_block_fingerprints = record.data();
          if (with_fingerprints) d.param_fingerprints = fingerprints.data();
          ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
          list.Advance();
          const std::vector<uint64_t> after = list.ParamBlocks();
          ASSERT_NE(after, before) << "step " << step << " wrote no param";
          EXPECT_TRUE(SameRecord(list, record, after)) << "step " << step;
          if (with_fingerprints) {
            EXPECT_EQ(fingerprints, list.ParamFingerprints()) << "step " << step;
            EXPECT_TRUE(BlocksSumToFingerprints(list, record, fingerprints)) << "step " << step;
          }
          list.NewGrads(100 + step);
        }
      }
    }
  }
}

std::vector<Case> Cases() {
  const Combo fp32{F32, F32, F32, F32, F32}, bf16_default{B16, B16, F32, B16, B16},
      remainders{B16, B16, I16, B16, B16}, remainders8{B16, B16, F8, F8, F8},
      stochastic{B16, B16, B16, B16, B16}, fp16{F16, F16, F32, F32, F32},
      generic_layout{B16, F32, F16, F16, F8};  // an fp16 master of bf16 params
  std::vector<Case> out;
  for (bool generic : {false, true}) {
    for (const auto& [name, c] : std::vector<std::pair<const char*, Combo>>{
             {"fp32", fp32},
             {"bf16_master_fp32", bf16_default},
             {"bf16_remainders", remainders},
             {"bf16_remainders8", remainders8},
             {"bf16_stochastic", stochastic},
             {"fp16_master_fp32", fp16},
             {"bf16_master_fp16", generic_layout}}) {
      out.push_back({name, c, PRECIS_RULE_ADAM, generic});
      if (std::string(name) != "bf16_master_fp16") {
        out.push_back({name, c, PRECIS_RULE_SGD, generic});
        out.push_back({name, c, PRECIS_RULE_LION, generic});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Policies, StepBlocks, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return CaseName(i.param); });

// Empty tensors (one entry each, 0) first, last and one after another, between tensors
// of one element and of two blocks; 1 and 3 threads.
TEST(StepBlocksArgs, EmptyTensorsAnywhere) {
  const std::vector<int64_t> sizes = {0, 0, 1, 0, 0, PRECIS_FINGERPRINT_BLOCK + 1, 0};
  for (int threads : {1, 3}) {
    List list({B16, B16, I16, B16, B16}, sizes, 13);
    precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
    cfg.num_threads = threads;
    std::vector<uint64_t> record((size_t)list.RecordSize(), kSentinel);
    ASSERT_EQ(record.size(), 8u);
    precis_step_tensors_t d = list.Desc();
    d.param_block_fingerprints = record.data();
    ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
    EXPECT_TRUE(SameRecord(list, record, list.ParamBlocks())) << threads << " threads";
  }
}

// A step skipped for a NaN gradient (check_finite) writes no param and leaves the record,
// and param_fingerprints beside it, as they were.
TEST(StepBlocksArgs, ASkippedStepLeavesTheRecordUntouched) {
  for (const Combo& c : {Combo{B16, B16, F32, B16, B16}, Combo{B16, B16, I16, B16, B16},
                         Combo{B16, B16, F8, F8, F8}, Combo{F32, F32, F32, F32, F32}}) {
    SCOPED_TRACE(ComboName(c));
    List list(c, kSizes, 3);
    Encode(list.ps[5].grad, c.gd, 2 * PRECIS_FINGERPRINT_BLOCK + 17, NAN);
    const auto state = list.State();
    precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
    cfg.check_finite = 1;
    std::vector<uint64_t> record((size_t)list.RecordSize(), kSentinel);
    std::vector<uint64_t> fingerprints(list.ps.size(), kSentinel);
    precis_step_tensors_t d = list.Desc();
    d.param_block_fingerprints = record.data();
    d.param_fingerprints = fingerprints.data();
    int32_t found = 0;
    ASSERT_EQ(precis_step(&cfg, &d, &found), PRECIS_OK) << precis_last_error();
    EXPECT_EQ(found, 1);
    EXPECT_TRUE(list.State() == state) << "a skipped step wrote a buffer";
    EXPECT_EQ(record, std::vector<uint64_t>(record.size(), kSentinel));
    EXPECT_EQ(fingerprints, std::vector<uint64_t>(fingerprints.size(), kSentinel));
    // The gradient put right, the same call steps and records.
    Encode(list.ps[5].grad, c.gd, 2 * PRECIS_FINGERPRINT_BLOCK + 17, 0.5f);
    ASSERT_EQ(precis_step(&cfg, &d, &found), PRECIS_OK) << precis_last_error();
    EXPECT_EQ(found, 0);
    EXPECT_TRUE(SameRecord(list, record, list.ParamBlocks()));
  }
}

// muon_momentum writes no params: a record is refused (the error names it) and nothing is
// written; the same call without it steps.
TEST(StepBlocksArgs, MuonMomentumRefusesARecord) {
  const Combo c{B16, B16, F32, F32, F32};
  List list(c, kSizes, 5);
  std::vector<std::vector<float>> outputs;
  std::vector<void*> output_ptrs;
  for (const Param& p : list.ps) {
    outputs.emplace_back((size_t)p.n + 1, 0.0f);
    output_ptrs.push_back(outputs.back().data());
  }
  precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
  cfg.rule = PRECIS_RULE_MUON_MOMENTUM;
  cfg.momentum = 0.95;
  precis_step_tensors_t d = list.Desc();
  d.outputs = output_ptrs.data();
  d.output_dtype = F32;
  std::vector<uint64_t> record((size_t)list.RecordSize(), kSentinel);
  d.param_block_fingerprints = record.data();
  const auto state = list.State();
  EXPECT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(precis_last_error()).find("param_block_fingerprints"), std::string::npos)
      << precis_last_error();
  EXPECT_EQ(record, std::vector<uint64_t>(record.size(), kSentinel));
  EXPECT_TRUE(list.State() == state);
  d.param_block_fingerprints = nullptr;
  EXPECT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
}

// A caller built against the header before the field passes a struct whose size ends
// before it: the step never reads it (a pointer left there is not written through).
TEST(StepBlocksArgs, AnOlderStructNeverReadsTheField) {
  const Combo c{B16, B16, F32, B16, B16};
  List list(c, kSizes, 9);
  std::vector<uint64_t> record((size_t)list.RecordSize(), kSentinel);
  std::vector<uint64_t> fingerprints(list.ps.size(), kSentinel);
  precis_step_tensors_t d = list.Desc();
  d.size = offsetof(precis_step_tensors_t, param_block_fingerprints);
  d.param_block_fingerprints = record.data();
  d.param_fingerprints = fingerprints.data();
  const precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
  ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK)
      << precis_last_error();
  EXPECT_EQ(record, std::vector<uint64_t>(record.size(), kSentinel));
  EXPECT_EQ(fingerprints, list.ParamFingerprints());  // the fields before it are read
}

// ---- the step's own compare of the blocks (param_block_records) ----

// Element i of a bf16 param changed (its bits plus one ulp): a write behind the step.
void WriteParam(Param& p, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, p.param.data() + 2 * i, 2);
  bits = (uint16_t)(bits + 1);
  std::memcpy(p.param.data() + 2 * i, &bits, 2);
}

// What a resync before the step does (resync.h's rule): the remainders of each block whose
// fingerprint now differs from record zeroed; returns each tensor's elements in the others.
std::vector<int64_t> ResyncByHand(List& list, const std::vector<uint64_t>& record) {
  const std::vector<uint64_t> now = list.ParamBlocks();
  const size_t rsize = DSize(list.c.md);
  std::vector<int64_t> kept;
  size_t at = 0;
  for (Param& p : list.ps) {
    int64_t k = 0;
    for (int64_t b = 0; b < BlockCount(p.n); ++b, ++at) {
      const int64_t lo = b * PRECIS_FINGERPRINT_BLOCK;
      const int64_t hi = std::min(p.n, lo + PRECIS_FINGERPRINT_BLOCK);
      if (now[at] == record[at]) {
        k += hi - lo;
      } else {
        std::memset(p.master.data() + lo * rsize, 0, (size_t)(hi - lo) * rsize);
      }
    }
    kept.push_back(k);
  }
  return kept;
}

// The writes: the 127-element param's element 3, the second block of the 3-block param
// and its last (5-element) block's last element, the 1-block-and-1 param's lone last
// element (its tail word), and one element of the one-block param written with the value
// it had (no change: nothing resynced).
void WriteBehind(List& list) {
  WriteParam(list.ps[1], 3);
  WriteParam(list.ps[5], PRECIS_FINGERPRINT_BLOCK + 77);
  WriteParam(list.ps[5], 3 * PRECIS_FINGERPRINT_BLOCK + 4);
  WriteParam(list.ps[4], PRECIS_FINGERPRINT_BLOCK);
  uint8_t same[2];
  std::memcpy(same, list.ps[2].param.data() + 20, 2);
  std::memcpy(list.ps[2].param.data() + 20, same, 2);
}

struct CompareCase {
  const char* policy;
  Combo c;
  int rule;
  bool generic;
};

class StepBlockCompare : public ::testing::TestWithParam<CompareCase> {
 protected:
  void TearDown() override {
    pr_cpu_generic_force(0);
    pr_cpu_isa_force(nullptr);
  }
};

// Two lists alike; a step records each one's blocks; the same writes into both; then the
// first steps with its record given (the step's compare) and the second is resynced by
// hand and stepped without: the same bits in every buffer and record, and the kept counts
// those of the hand's resync (a written block's elements not counted).
TEST_P(StepBlockCompare, AWrittenBlockIsResyncedAsBeforeTheStep) {
  const CompareCase k = GetParam();
  ASSERT_EQ(pr_cpu_generic_force(k.generic ? 1 : 0), 0);
  for (const std::string& path : RunnablePaths()) {
    ASSERT_EQ(pr_cpu_isa_force(path.c_str()), 0);
    for (int threads : {1, 3}) {
      SCOPED_TRACE(path + ", " + std::to_string(threads) + " threads");
      precis_step_config_t cfg = ConfigOf(k.rule);
      cfg.num_threads = threads;
      List compared(k.c, kSizes, 21), by_hand(k.c, kSizes, 21);
      std::vector<uint64_t> rec_a((size_t)compared.RecordSize()), rec_b(rec_a.size());
      for (auto [list, rec] : {std::pair{&compared, &rec_a}, std::pair{&by_hand, &rec_b}}) {
        precis_step_tensors_t d = list->Desc();
        d.param_block_fingerprints = rec->data();
        ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
        list->Advance();
        list->NewGrads(31);
        WriteBehind(*list);
      }
      ASSERT_EQ(rec_a, rec_b);
      const std::vector<int64_t> want_kept = ResyncByHand(by_hand, rec_b);
      ASSERT_NE(want_kept[1], by_hand.ps[1].n);  // (the writes changed blocks)
      ASSERT_EQ(want_kept[2], by_hand.ps[2].n);  // (the same value: no change)
      std::vector<uint64_t> out_a(rec_a.size(), kSentinel), out_b(rec_a.size(), kSentinel);
      std::vector<int64_t> kept(compared.ps.size(), -1);
      precis_step_tensors_t d = compared.Desc();
      d.param_block_records = rec_a.data();
      d.param_blocks_kept = kept.data();
      d.param_block_fingerprints = out_a.data();
      ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
      precis_step_tensors_t e = by_hand.Desc();
      e.param_block_fingerprints = out_b.data();
      ASSERT_EQ(precis_step(&cfg, &e, nullptr), PRECIS_OK) << precis_last_error();
      EXPECT_TRUE(compared.State() == by_hand.State()) << "the bits differ";
      EXPECT_EQ(out_a, out_b);
      EXPECT_EQ(kept, want_kept);
    }
  }
}

std::vector<CompareCase> CompareCases() {
  const Combo remainders{B16, B16, I16, B16, B16}, remainders8{B16, B16, F8, F8, F8};
  std::vector<CompareCase> out;
  for (bool generic : {false, true}) {
    out.push_back({"bf16_remainders", remainders, PRECIS_RULE_ADAM, generic});
    out.push_back({"bf16_remainders8", remainders8, PRECIS_RULE_ADAM, generic});
    out.push_back({"bf16_remainders", remainders, PRECIS_RULE_SGD, generic});
    out.push_back({"bf16_remainders8", remainders8, PRECIS_RULE_LION, generic});
  }
  return out;
}

std::string CompareCaseName(const ::testing::TestParamInfo<CompareCase>& i) {
  return CaseName({i.param.policy, i.param.c, i.param.rule, i.param.generic});
}

INSTANTIATE_TEST_SUITE_P(Policies, StepBlockCompare, ::testing::ValuesIn(CompareCases()),
                         CompareCaseName);

// A step skipped for a NaN gradient still resyncs the written blocks (as the resync
// before it would) and counts kept; it writes nothing else, and no block record.
TEST(StepBlockCompareArgs, ASkippedStepStillResyncsTheWrittenBlocks) {
  for (const Combo& c : {Combo{B16, B16, I16, B16, B16}, Combo{B16, B16, F8, F8, F8}}) {
    SCOPED_TRACE(ComboName(c));
    precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
    cfg.check_finite = 1;
    List list(c, kSizes, 23), by_hand(c, kSizes, 23);
    std::vector<uint64_t> record = list.ParamBlocks();
    WriteBehind(list);
    WriteBehind(by_hand);
    const std::vector<int64_t> want_kept = ResyncByHand(by_hand, record);
    Encode(list.ps[5].grad, c.gd, 2 * PRECIS_FINGERPRINT_BLOCK + 17, NAN);
    std::vector<uint64_t> out(record.size(), kSentinel);
    std::vector<int64_t> kept(list.ps.size(), -1);
    precis_step_tensors_t d = list.Desc();
    d.param_block_records = record.data();
    d.param_blocks_kept = kept.data();
    d.param_block_fingerprints = out.data();
    int32_t found = 0;
    ASSERT_EQ(precis_step(&cfg, &d, &found), PRECIS_OK) << precis_last_error();
    EXPECT_EQ(found, 1);
    EXPECT_TRUE(list.State() == by_hand.State()) << "not the resync alone";
    EXPECT_EQ(kept, want_kept);
    EXPECT_EQ(out, std::vector<uint64_t>(out.size(), kSentinel));
    // precis_step_skipped: the same, for a caller that decided to skip (no NaN here)
    List told(c, kSizes, 23);
    WriteBehind(told);
    std::vector<int64_t> told_kept(told.ps.size(), -1);
    std::vector<uint64_t> told_out(record.size(), kSentinel);
    precis_step_tensors_t e = told.Desc();
    e.param_block_records = record.data();
    e.param_blocks_kept = told_kept.data();
    e.param_block_fingerprints = told_out.data();
    ASSERT_EQ(precis_step_skipped(&cfg, &e), PRECIS_OK) << precis_last_error();
    EXPECT_TRUE(told.State() == by_hand.State()) << "precis_step_skipped: not the resync alone";
    EXPECT_EQ(told_kept, want_kept);
    EXPECT_EQ(told_out, std::vector<uint64_t>(told_out.size(), kSentinel));
    e.param_block_records = nullptr;  // (no compare: nothing at all)
    e.param_blocks_kept = nullptr;
    const auto state = told.State();
    ASSERT_EQ(precis_step_skipped(&cfg, &e), PRECIS_OK) << precis_last_error();
    EXPECT_TRUE(told.State() == state);
  }
}

// Each refusal names what was wrong and writes nothing (kept, records, state): records
// without remainders, kept without records, records in the record the step writes or in
// a remainder buffer, kept in the records; a struct of an older header never reads them.
TEST(StepBlockCompareArgs, RefusalsWriteNothing) {
  const precis_step_config_t cfg = ConfigOf(PRECIS_RULE_ADAM);
  {  // an fp32 master: no remainders to resync by blocks
    List list({B16, B16, F32, B16, B16}, kSizes, 25);
    std::vector<uint64_t> record = list.ParamBlocks();
    precis_step_tensors_t d = list.Desc();
    d.param_block_records = record.data();
    const auto state = list.State();
    EXPECT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(precis_last_error()).find("param_block_records needs remainders"),
              std::string::npos) << precis_last_error();
    EXPECT_TRUE(list.State() == state);
  }
  List list({B16, B16, F8, F8, F8}, kSizes, 27);
  std::vector<uint64_t> record = list.ParamBlocks();
  WriteBehind(list);
  const auto state = list.State();
  const std::vector<uint64_t> record_before = record;
  std::vector<int64_t> kept(list.ps.size(), -1);
  struct Bad {
    const char* what;
    const uint64_t* records;
    int64_t* kept;
    uint64_t* out;
    precis_status_t status;
    const char* words;
  };
  std::vector<uint64_t> big(record.size() + list.ps.size() + 8, 0);
  for (const Bad& bad : std::vector<Bad>{
           {"kept alone", nullptr, kept.data(), nullptr, PRECIS_ERR_NULL_POINTER,
            "param_blocks_kept is given but param_block_records is NULL"},
           {"records as the step's record", record.data(), kept.data(), record.data(),
            PRECIS_ERR_INVALID_ARGUMENT, "share memory"},
           {"kept in the records", big.data(), reinterpret_cast<int64_t*>(big.data() + 2),
            nullptr, PRECIS_ERR_INVALID_ARGUMENT, "share memory"},
           {"records in a remainder buffer",
            reinterpret_cast<const uint64_t*>(list.ps[5].master.data() + 8), kept.data(),
            nullptr, PRECIS_ERR_INVALID_ARGUMENT, "shares memory with masters[5]"}}) {
    SCOPED_TRACE(bad.what);
    precis_step_tensors_t d = list.Desc();
    d.param_block_records = bad.records;
    d.param_blocks_kept = bad.kept;
    d.param_block_fingerprints = bad.out;
    EXPECT_EQ(precis_step(&cfg, &d, nullptr), bad.status);
    EXPECT_NE(std::string(precis_last_error()).find(bad.words), std::string::npos)
        << precis_last_error();
    EXPECT_TRUE(list.State() == state);
    EXPECT_EQ(kept, std::vector<int64_t>(kept.size(), -1));
    EXPECT_EQ(record, record_before);
  }
  // An older struct: records and kept beyond its size, never read (the written blocks
  // keep their remainders).
  precis_step_tensors_t d = list.Desc();
  d.size = offsetof(precis_step_tensors_t, param_block_records);
  d.param_block_records = record.data();
  d.param_blocks_kept = kept.data();
  List by_hand({B16, B16, F8, F8, F8}, kSizes, 27);
  WriteBehind(by_hand);
  ASSERT_EQ(precis_step(&cfg, &d, nullptr), PRECIS_OK) << precis_last_error();
  precis_step_tensors_t e = by_hand.Desc();
  ASSERT_EQ(precis_step(&cfg, &e, nullptr), PRECIS_OK) << precis_last_error();
  EXPECT_TRUE(list.State() == by_hand.State());
  EXPECT_EQ(kept, std::vector<int64_t>(kept.size(), -1));
}

}  // namespace
