// The precision policy: defaults, overrides, legal sets, combination rules.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "precis/precis.h"

namespace {

constexpr precis_dtype_t FP32 = PRECIS_DTYPE_FP32;
constexpr precis_dtype_t FP16 = PRECIS_DTYPE_FP16;
constexpr precis_dtype_t BF16 = PRECIS_DTYPE_BF16;
constexpr precis_dtype_t FP8 = PRECIS_DTYPE_FP8_E4M3;
constexpr precis_dtype_t INT16 = PRECIS_DTYPE_INT16;
const precis_dtype_t kAllDtypes[] = {FP32, FP16, BF16, FP8, INT16};
const precis_dtype_t kModels[] = {FP32, FP16, BF16};

constexpr uint32_t Bit(precis_policy_field_t f) { return 1u << f; }

struct DtypeField {
  const char* name;
  precis_policy_field_t field;
  precis_dtype_t precis_policy_t::*member;
  std::vector<precis_dtype_t> legal;
  const char* legal_text;
};

const std::vector<DtypeField> kDtypeFields = {
    {"main_params_dtype",
     PRECIS_FIELD_MAIN_PARAMS_DTYPE,
     &precis_policy_t::main_params_dtype,
     {FP32, FP16, BF16},
     "fp32, fp16, bf16"},
    {"main_grads_dtype",
     PRECIS_FIELD_MAIN_GRADS_DTYPE,
     &precis_policy_t::main_grads_dtype,
     {FP32, BF16, FP16},
     "fp32, bf16, fp16"},
    {"grad_comm_dtype",
     PRECIS_FIELD_GRAD_COMM_DTYPE,
     &precis_policy_t::grad_comm_dtype,
     {FP32, BF16, FP16},
     "fp32, bf16, fp16"},
    {"grad_sum_dtype",
     PRECIS_FIELD_GRAD_SUM_DTYPE,
     &precis_policy_t::grad_sum_dtype,
     {FP32, BF16, FP16},
     "fp32, bf16, fp16"},
    {"exp_avg_dtype",
     PRECIS_FIELD_EXP_AVG_DTYPE,
     &precis_policy_t::exp_avg_dtype,
     {FP32, FP16, BF16, FP8},
     "fp32, fp16, bf16, fp8"},
    {"exp_avg_sq_dtype",
     PRECIS_FIELD_EXP_AVG_SQ_DTYPE,
     &precis_policy_t::exp_avg_sq_dtype,
     {FP32, FP16, BF16, FP8},
     "fp32, fp16, bf16, fp8"},
    {"momentum_dtype",
     PRECIS_FIELD_MOMENTUM_DTYPE,
     &precis_policy_t::momentum_dtype,
     {FP32, FP16, BF16, FP8},
     "fp32, fp16, bf16, fp8"},
};

// Every alias of each dtype, to check that legal-set rules see through spellings.
const std::vector<std::pair<const char*, precis_dtype_t>> kAliases = {
    {"fp32", FP32},    {"float32", FP32}, {"float", FP32},    {"fp16", FP16},   {"float16", FP16},
    {"half", FP16},    {"bf16", BF16},    {"bfloat16", BF16}, {"fp8", FP8},     {"float8", FP8},
    {"fp8_e4m3", FP8}, {"e4m3", FP8},     {"uint8", FP8},     {"int16", INT16},
};

// What an unknown name in a dtype field is answered with: every spelling of the dtypes
// the field takes, and none of the others (int16 is no moment's, uint8 no master's).
std::string AcceptedNames(const std::vector<precis_dtype_t>& legal) {
  std::string out = "accepted: ";
  bool first = true;
  for (const auto& [name, dtype] : kAliases) {
    if (std::find(legal.begin(), legal.end(), dtype) == legal.end()) continue;
    out += (first ? "" : ", ") + std::string(name);
    first = false;
  }
  return out;
}

std::string Name(int d) {
  const char* n = nullptr;
  if (precis_dtype_name(static_cast<precis_dtype_t>(d), &n) != PRECIS_OK) {
    return "<" + std::to_string(d) + ">";
  }
  return n;
}

// A readable form for comparisons, so a failure shows the whole policy.
std::string Describe(const precis_policy_t& p) {
  std::ostringstream os;
  os << "size=" << p.size << " param=" << Name(p.param_dtype)
     << " master=" << Name(p.main_params_dtype) << " grads=" << Name(p.main_grads_dtype)
     << " comm=" << Name(p.grad_comm_dtype) << " sum=" << Name(p.grad_sum_dtype)
     << " m=" << Name(p.exp_avg_dtype)
     << " v=" << Name(p.exp_avg_sq_dtype) << " mom=" << Name(p.momentum_dtype)
     << " rem=" << p.store_param_remainders
     << " rem_bits=" << p.param_remainder_bits << " explicit=0x"
     << std::hex << p.explicit_fields;
  return os.str();
}

precis_policy_t Make(precis_dtype_t param, precis_dtype_t master, precis_dtype_t grads,
                     precis_dtype_t comm, precis_dtype_t m, precis_dtype_t v, int rem = 0,
                     uint32_t explicit_fields = 0) {
  precis_policy_t p = PRECIS_POLICY_INIT;
  p.param_dtype = param;
  p.main_params_dtype = master;
  p.main_grads_dtype = grads;
  p.grad_comm_dtype = comm;
  p.grad_sum_dtype = comm;  // the sums follow the wire unless set
  p.exp_avg_dtype = m;
  p.exp_avg_sq_dtype = v;
  p.momentum_dtype = m;  // the momentum follows exp_avg unless set
  p.store_param_remainders = rem;
  p.explicit_fields = explicit_fields;
  return p;
}

precis_policy_t Defaults(precis_dtype_t model) {
  precis_policy_t p = PRECIS_POLICY_INIT;
  EXPECT_EQ(precis_policy_defaults(model, &p), PRECIS_OK) << precis_last_error();
  return p;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string LastError() { return precis_last_error(); }

// ---- defaults ------------------------------------------------------------

TEST(PolicyDefaults, Matrix) {
  EXPECT_EQ(Describe(Defaults(BF16)), Describe(Make(BF16, FP32, BF16, BF16, BF16, BF16)));
  EXPECT_EQ(Describe(Defaults(FP16)), Describe(Make(FP16, FP32, FP32, FP32, FP32, FP32)));
  EXPECT_EQ(Describe(Defaults(FP32)), Describe(Make(FP32, FP32, FP32, FP32, FP32, FP32)));
}

TEST(PolicyDefaults, AreValid) {
  for (precis_dtype_t m : kModels) {
    precis_policy_t p = Defaults(m);
    EXPECT_EQ(precis_policy_validate(&p), PRECIS_OK) << LastError() << " (model " << Name(m) << ")";
    EXPECT_EQ(LastError(), "");
  }
}

TEST(PolicyDefaults, OverwriteEverythingButSize) {
  precis_policy_t p = Make(FP16, FP8, FP8, FP8, INT16, INT16, 7, 0xFFu);
  ASSERT_EQ(precis_policy_defaults(BF16, &p), PRECIS_OK);
  EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
}

TEST(PolicyDefaults, RejectNonModelDtypes) {
  for (precis_dtype_t bad : {FP8, INT16}) {
    precis_policy_t p = Defaults(BF16);
    EXPECT_EQ(precis_policy_defaults(bad, &p), PRECIS_ERR_INVALID_POLICY);
    std::string msg = LastError();  // before Name(), which clears it
    EXPECT_TRUE(Contains(msg, Name(bad))) << msg;
    EXPECT_TRUE(Contains(msg, "fp32, fp16, bf16")) << msg;
    EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
  }
  for (int bad : {-1, 5, 99}) {
    precis_policy_t p = Defaults(BF16);
    EXPECT_EQ(precis_policy_defaults(static_cast<precis_dtype_t>(bad), &p),
              PRECIS_ERR_INVALID_DTYPE);
    EXPECT_TRUE(Contains(LastError(), std::to_string(bad))) << LastError();
    EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
  }
}

// What a caller built before momentum_dtype passes: its struct ends at param_remainder_bits.
constexpr size_t kOldSize = offsetof(precis_policy_t, momentum_dtype);

TEST(PolicyDefaults, BadStruct) {
  EXPECT_EQ(precis_policy_defaults(BF16, nullptr), PRECIS_ERR_NULL_POINTER);
  precis_policy_t p = PRECIS_POLICY_INIT;
  for (size_t size : {size_t{0}, size_t{8}, kOldSize - 1}) {
    p.size = size;
    EXPECT_EQ(precis_policy_defaults(BF16, &p), PRECIS_ERR_SIZE_MISMATCH);
    EXPECT_TRUE(Contains(LastError(), "PRECIS_POLICY_INIT")) << LastError();
    EXPECT_EQ(p.size, size);
  }
}

TEST(PolicyDefaults, LargerStructKeepsItsSizeAndTail) {
  struct Bigger {
    precis_policy_t policy;
    char tail[16];
  } big;
  std::memset(&big, 0x5A, sizeof big);
  big.policy.size = sizeof big;
  ASSERT_EQ(precis_policy_defaults(FP16, &big.policy), PRECIS_OK);
  EXPECT_EQ(big.policy.size, sizeof big);
  for (char c : big.tail) EXPECT_EQ(c, 0x5A);
  EXPECT_EQ(precis_policy_validate(&big.policy), PRECIS_OK);
}

// ---- single overrides ------------------------------------------------------

TEST(PolicySet, EachDtypeFieldAloneChangesOnlyItselfAndItsDependents) {
  for (precis_dtype_t model : kModels) {
    for (const DtypeField& f : kDtypeFields) {
      for (precis_dtype_t d : f.legal) {
        precis_policy_t p = Defaults(model);
        precis_policy_t expected = p;
        expected.*f.member = d;
        expected.explicit_fields = Bit(f.field);
        if (f.field == PRECIS_FIELD_MAIN_GRADS_DTYPE) expected.grad_comm_dtype = d;
        if (f.field == PRECIS_FIELD_MAIN_GRADS_DTYPE || f.field == PRECIS_FIELD_GRAD_COMM_DTYPE) {
          expected.grad_sum_dtype = d;
        }
        if (f.field == PRECIS_FIELD_EXP_AVG_DTYPE) expected.momentum_dtype = d;
        ASSERT_EQ(precis_policy_set(&p, f.name, Name(d).c_str()), PRECIS_OK)
            << LastError() << " (" << f.name << "=" << Name(d) << ")";
        EXPECT_EQ(LastError(), "");
        EXPECT_EQ(Describe(p), Describe(expected)) << f.name << "=" << Name(d);
      }
    }
  }
}

TEST(PolicySet, ValuesAcceptEveryAliasSpelling) {
  struct Case {
    const char* value;
    precis_dtype_t expected;
  };
  for (const Case& c : {Case{"  BFloat16 ", BF16}, Case{"torch.float16", FP16}, Case{"UINT8", FP8},
                        Case{"\te4m3\n", FP8}, Case{"Float", FP32}, Case{"torch.bfloat16", BF16},
                        Case{"HALF", FP16}}) {
    precis_policy_t p = Defaults(BF16);
    ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", c.value), PRECIS_OK) << c.value;
    EXPECT_EQ(p.exp_avg_dtype, c.expected) << c.value;
  }
}

TEST(PolicySet, FieldNamesAreCaseAndWhitespaceInsensitive) {
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, " Exp_Avg_SQ_Dtype\t", "fp8"), PRECIS_OK) << LastError();
  EXPECT_EQ(p.exp_avg_sq_dtype, FP8);
  ASSERT_EQ(precis_policy_set(&p, "GRAD_REDUCE_IN_FP32", "True"), PRECIS_OK) << LastError();
  EXPECT_EQ(p.main_grads_dtype, FP32);
}

TEST(PolicySet, StoreParamRemaindersBooleans) {
  const std::vector<std::pair<const char*, int>> spellings = {
      {"true", 1}, {"TRUE", 1}, {" True ", 1}, {"1", 1},     {"yes", 1}, {"Yes", 1},
      {"on", 1},   {"ON\n", 1}, {"false", 0},  {"False", 0}, {"0", 0},   {" 0 ", 0},
      {"no", 0},   {"NO", 0},   {"off", 0},    {"\tOff", 0}};
  for (const auto& [text, value] : spellings) {
    precis_policy_t p = Defaults(BF16);
    precis_policy_t expected = p;
    p.store_param_remainders = 1 - value;  // make sure the call writes it
    expected.store_param_remainders = value;
    expected.explicit_fields = Bit(PRECIS_FIELD_STORE_PARAM_REMAINDERS);
    ASSERT_EQ(precis_policy_set(&p, "store_param_remainders", text), PRECIS_OK) << text;
    EXPECT_EQ(Describe(p), Describe(expected)) << "'" << text << "'";
  }
}

TEST(PolicySet, BadBooleans) {
  for (const char* field : {"store_param_remainders", "grad_reduce_in_fp32"}) {
    for (const char* text :
         {"", " ", "2", "-1", "maybe", "tru", "yes please", "0x1", "t", "y", "fp32", "nope"}) {
      precis_policy_t p = Defaults(BF16);
      EXPECT_EQ(precis_policy_set(&p, field, text), PRECIS_ERR_INVALID_ARGUMENT)
          << field << "='" << text << "'";
      std::string msg = LastError();
      EXPECT_EQ(msg.rfind(std::string(field) + ": '" + text + "' is not a boolean", 0), 0u) << msg;
      EXPECT_TRUE(Contains(msg, "true, false, 1, 0, yes, no, on, off")) << msg;
      EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
    }
  }
}

TEST(PolicySet, GradReduceInFp32Semantics) {
  struct Case {
    precis_dtype_t model;
    const char* value;
    precis_dtype_t grads;
  };
  for (const Case& c :
       {Case{BF16, "true", FP32}, Case{BF16, "false", BF16}, Case{FP16, "true", FP32},
        Case{FP16, "false", FP16}, Case{FP32, "true", FP32}, Case{FP32, "false", FP32}}) {
    precis_policy_t p = Defaults(c.model);
    precis_policy_t expected = p;
    expected.main_grads_dtype = c.grads;
    expected.grad_comm_dtype = c.grads;  // follows the accumulation dtype
    expected.grad_sum_dtype = c.grads;   // follows the wire
    expected.explicit_fields = Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32);
    ASSERT_EQ(precis_policy_set(&p, "grad_reduce_in_fp32", c.value), PRECIS_OK) << LastError();
    EXPECT_EQ(Describe(p), Describe(expected)) << Name(c.model) << " " << c.value;
  }
}

TEST(PolicySet, GradCommFollowsMainGradsUnlessExplicit) {
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "main_grads_dtype", "fp32"), PRECIS_OK);
  EXPECT_EQ(p.grad_comm_dtype, FP32);
  ASSERT_EQ(precis_policy_set(&p, "main_grads_dtype", "fp16"), PRECIS_OK);
  EXPECT_EQ(p.grad_comm_dtype, FP16);
  ASSERT_EQ(precis_policy_set(&p, "grad_comm_dtype", "bf16"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "main_grads_dtype", "fp32"), PRECIS_OK);
  EXPECT_EQ(p.grad_comm_dtype, BF16);  // explicit now: no longer follows
  EXPECT_EQ(p.explicit_fields,
            Bit(PRECIS_FIELD_MAIN_GRADS_DTYPE) | Bit(PRECIS_FIELD_GRAD_COMM_DTYPE));

  // Explicit comm first, then grad_reduce_in_fp32: comm stays.
  p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "grad_comm_dtype", "bf16"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "grad_reduce_in_fp32", "true"), PRECIS_OK);
  EXPECT_EQ(p.main_grads_dtype, FP32);
  EXPECT_EQ(p.grad_comm_dtype, BF16);
}

TEST(PolicySet, LastWins) {
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "fp8"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "fp16"), PRECIS_OK);
  EXPECT_EQ(p.exp_avg_dtype, FP16);
  ASSERT_EQ(precis_policy_set(&p, "grad_reduce_in_fp32", "true"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "grad_reduce_in_fp32", "false"), PRECIS_OK);
  EXPECT_EQ(p.main_grads_dtype, BF16);
  EXPECT_EQ(p.grad_comm_dtype, BF16);
  ASSERT_EQ(precis_policy_set(&p, "store_param_remainders", "on"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "store_param_remainders", "off"), PRECIS_OK);
  EXPECT_EQ(p.store_param_remainders, 0);
  ASSERT_EQ(precis_policy_set(&p, "main_params_dtype", "fp16"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "main_params_dtype", "fp32"), PRECIS_OK);
  EXPECT_EQ(Describe(p),
            Describe(Make(BF16, FP32, BF16, BF16, FP16, BF16, 0,
                          Bit(PRECIS_FIELD_EXP_AVG_DTYPE) | Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32) |
                              Bit(PRECIS_FIELD_STORE_PARAM_REMAINDERS) |
                              Bit(PRECIS_FIELD_MAIN_PARAMS_DTYPE))));
}

// ---- grad_reduce_in_fp32 against an explicit main_grads_dtype ---------------

struct Conflict {
  precis_dtype_t model;
  const char* grads;
  const char* reduce;
};

const Conflict kConflicts[] = {
    {BF16, "bf16", "true"},  {BF16, "fp16", "true"},  {BF16, "fp32", "false"},
    {BF16, "fp16", "false"}, {FP16, "fp16", "true"},  {FP16, "fp32", "off"},
    {FP16, "bf16", "no"},    {FP32, "bf16", "false"}, {FP32, "fp16", "1"},
};

// In either order, the second call fails and leaves the policy as it was.
TEST(PolicyConflict, SecondOfTheTwoFails) {
  for (const Conflict& c : kConflicts) {
    for (bool grads_first : {true, false}) {
      std::pair<const char*, const char*> grads{"main_grads_dtype", c.grads},
          reduce{"grad_reduce_in_fp32", c.reduce};
      const auto& [first_field, first_value] = grads_first ? grads : reduce;
      const auto& [second_field, second_value] = grads_first ? reduce : grads;
      precis_policy_t p = Defaults(c.model);
      ASSERT_EQ(precis_policy_set(&p, first_field, first_value), PRECIS_OK);
      precis_policy_t before = p;
      EXPECT_EQ(precis_policy_set(&p, second_field, second_value), PRECIS_ERR_INVALID_POLICY)
          << Name(c.model) << " " << c.grads << " " << c.reduce << " grads first " << grads_first;
      EXPECT_TRUE(Contains(LastError(), "grad_reduce_in_fp32")) << LastError();
      EXPECT_TRUE(Contains(LastError(), "main_grads_dtype")) << LastError();
      EXPECT_TRUE(Contains(LastError(), c.grads)) << LastError();
      EXPECT_EQ(Describe(p), Describe(before));
    }
  }
}

TEST(PolicyConflict, ConsistentPairsAgreeInBothOrders) {
  struct Case {
    precis_dtype_t model;
    const char* grads;
    const char* reduce;
  };
  for (const Case& c :
       {Case{BF16, "fp32", "true"}, Case{BF16, "bf16", "false"}, Case{FP16, "fp16", "false"},
        Case{FP16, "fp32", "yes"}, Case{FP32, "fp32", "true"}, Case{FP32, "fp32", "false"}}) {
    precis_policy_t a = Defaults(c.model), b = Defaults(c.model);
    ASSERT_EQ(precis_policy_set(&a, "main_grads_dtype", c.grads), PRECIS_OK);
    ASSERT_EQ(precis_policy_set(&a, "grad_reduce_in_fp32", c.reduce), PRECIS_OK) << LastError();
    ASSERT_EQ(precis_policy_set(&b, "grad_reduce_in_fp32", c.reduce), PRECIS_OK);
    ASSERT_EQ(precis_policy_set(&b, "main_grads_dtype", c.grads), PRECIS_OK) << LastError();
    EXPECT_EQ(Describe(a), Describe(b));
    EXPECT_EQ(a.explicit_fields,
              Bit(PRECIS_FIELD_MAIN_GRADS_DTYPE) | Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32));
  }
}

// ---- order independence ------------------------------------------------------

using Overrides = std::vector<std::pair<const char*, const char*>>;

precis_status_t Resolve(precis_dtype_t model, const Overrides& o, precis_policy_t* out) {
  std::vector<const char*> fields, values;
  for (const auto& [f, v] : o) {
    fields.push_back(f);
    values.push_back(v);
  }
  return precis_policy_resolve(model, fields.data(), values.data(), o.size(), out);
}

// Resolves every permutation of the overrides; each must give `expected_status`
// and, on success, `expected`.
void CheckAllOrders(precis_dtype_t model, const Overrides& o, precis_status_t expected_status,
                    const precis_policy_t& expected) {
  std::vector<size_t> order(o.size());
  std::iota(order.begin(), order.end(), size_t{0});
  int permutations = 0;
  do {
    Overrides permuted;
    for (size_t i : order) permuted.push_back(o[i]);
    precis_policy_t out = PRECIS_POLICY_INIT;
    ASSERT_EQ(Resolve(model, permuted, &out), expected_status) << LastError();
    if (expected_status == PRECIS_OK) {
      EXPECT_EQ(Describe(out), Describe(expected));
    }
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_GT(permutations, 1);
}

TEST(PolicyOrder, ResultDoesNotDependOnOrder) {
  CheckAllOrders(
      BF16,
      {{"main_grads_dtype", "fp32"},
       {"grad_reduce_in_fp32", "true"},
       {"exp_avg_sq_dtype", "fp8"},
       {"store_param_remainders", "yes"}},
      PRECIS_OK,
      Make(BF16, FP32, FP32, FP32, BF16, FP8, 1,
           Bit(PRECIS_FIELD_MAIN_GRADS_DTYPE) | Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32) |
               Bit(PRECIS_FIELD_EXP_AVG_SQ_DTYPE) | Bit(PRECIS_FIELD_STORE_PARAM_REMAINDERS)));
  CheckAllOrders(BF16,
                 {{"grad_reduce_in_fp32", "1"},
                  {"grad_comm_dtype", "bf16"},
                  {"exp_avg_dtype", "fp16"},
                  {"main_params_dtype", "fp16"}},
                 PRECIS_OK,
                 Make(BF16, FP16, FP32, BF16, FP16, BF16, 0,
                      Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32) | Bit(PRECIS_FIELD_GRAD_COMM_DTYPE) |
                          Bit(PRECIS_FIELD_EXP_AVG_DTYPE) | Bit(PRECIS_FIELD_MAIN_PARAMS_DTYPE)));
  CheckAllOrders(
      BF16, {{"main_grads_dtype", "fp16"}, {"grad_comm_dtype", "fp32"}, {"exp_avg_dtype", "fp32"}},
      PRECIS_OK,
      Make(BF16, FP32, FP16, FP32, FP32, BF16, 0,
           Bit(PRECIS_FIELD_MAIN_GRADS_DTYPE) | Bit(PRECIS_FIELD_GRAD_COMM_DTYPE) |
               Bit(PRECIS_FIELD_EXP_AVG_DTYPE)));
  CheckAllOrders(
      FP16,
      {{"grad_reduce_in_fp32", "false"}, {"exp_avg_dtype", "bf16"}, {"main_params_dtype", "fp16"}},
      PRECIS_OK,
      Make(FP16, FP16, FP16, FP16, BF16, FP32, 0,
           Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32) | Bit(PRECIS_FIELD_EXP_AVG_DTYPE) |
               Bit(PRECIS_FIELD_MAIN_PARAMS_DTYPE)));
}

TEST(PolicyOrder, ConflictFailsInEveryOrder) {
  CheckAllOrders(
      BF16, {{"main_grads_dtype", "bf16"}, {"grad_reduce_in_fp32", "on"}, {"exp_avg_dtype", "fp8"}},
      PRECIS_ERR_INVALID_POLICY, Defaults(BF16));
}

// ---- rejections ----------------------------------------------------------------

TEST(PolicySet, EveryIllegalDtypeOfEveryFieldIsRejected) {
  int checked = 0;
  for (const DtypeField& f : kDtypeFields) {
    for (const auto& [alias, dtype] : kAliases) {
      if (std::find(f.legal.begin(), f.legal.end(), dtype) != f.legal.end()) continue;
      precis_policy_t p = Defaults(BF16);
      EXPECT_EQ(precis_policy_set(&p, f.name, alias), PRECIS_ERR_INVALID_POLICY)
          << f.name << "=" << alias;
      std::string msg = LastError();
      std::string head = std::string(f.name) + ": " + Name(dtype) + " ";
      EXPECT_EQ(msg.rfind(head, 0), 0u) << msg;
      if (Name(dtype) != alias) {
        EXPECT_TRUE(Contains(msg, std::string("'") + alias + "'")) << msg;
      }
      EXPECT_TRUE(Contains(msg, std::string("is not allowed; legal: ") + f.legal_text)) << msg;
      EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
      ++checked;
    }
  }
  // 5 fp8 spellings + int16 for master, grads, comm and sums; int16 for the two moments
  // and the momentum.
  EXPECT_EQ(checked, 4 * 6 + 3 * 1);
}

TEST(PolicySet, ExactLegalSetMessage) {
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "main_grads_dtype", "fp8"), PRECIS_ERR_INVALID_POLICY);
  EXPECT_EQ(LastError(), "main_grads_dtype: fp8 is not allowed; legal: fp32, bf16, fp16");
}

TEST(PolicySet, UnknownDtypeValueNamesFieldValueAndAliases) {
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "bf17"), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(LastError(), "exp_avg_dtype: 'bf17' is not a dtype; accepted: fp32, float32, float, "
                         "fp16, float16, half, bf16, bfloat16, fp8, float8, fp8_e4m3, e4m3, uint8");
  ASSERT_EQ(precis_policy_set(&p, "main_params_dtype", "int7"), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(LastError(), "main_params_dtype: 'int7' is not a dtype; accepted: fp32, float32, "
                         "float, fp16, float16, half, bf16, bfloat16");
  for (const DtypeField& f : kDtypeFields) {
    for (const char* bad : {"", "float64", "torch.int8", "none", "fp 32"}) {
      precis_policy_t q = Defaults(FP16);
      EXPECT_EQ(precis_policy_set(&q, f.name, bad), PRECIS_ERR_INVALID_DTYPE) << f.name << bad;
      EXPECT_EQ(LastError(),
                std::string(f.name) + ": '" + bad + "' is not a dtype; " + AcceptedNames(f.legal));
      EXPECT_EQ(Describe(q), Describe(Defaults(FP16)));
    }
  }
}

TEST(PolicySet, UnknownFields) {
  for (const char* bad : {"exp_avg", "", "  ", "lr", "main_param_dtype", "grad_reduce_in_fp16",
                          "exp_avg_dtype_x", "precision"}) {
    precis_policy_t p = Defaults(BF16);
    EXPECT_EQ(precis_policy_set(&p, bad, "fp32"), PRECIS_ERR_INVALID_ARGUMENT) << bad;
    std::string msg = LastError();
    EXPECT_TRUE(Contains(msg, std::string("'") + bad + "' is not a policy field")) << msg;
    EXPECT_TRUE(Contains(msg,
                         "main_params_dtype, main_grads_dtype, grad_comm_dtype, "
                         "exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, "
                         "grad_reduce_in_fp32"))
        << msg;
    EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
  }
  std::string huge(3000, 'k');
  precis_policy_t p = Defaults(BF16);
  EXPECT_EQ(precis_policy_set(&p, huge.c_str(), "fp32"), PRECIS_ERR_INVALID_ARGUMENT);
}

TEST(PolicySet, ParamDtypeIsNotAnOverride) {
  for (const char* key : {"param_dtype", " PARAM_DTYPE "}) {
    precis_policy_t p = Defaults(BF16);
    EXPECT_EQ(precis_policy_set(&p, key, "fp32"), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(Contains(LastError(), "param_dtype")) << LastError();
    EXPECT_TRUE(Contains(LastError(), "model dtype is given separately")) << LastError();
    EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));
  }
}

TEST(PolicySet, NullAndGarbageArguments) {
  precis_policy_t p = Defaults(BF16);
  EXPECT_EQ(precis_policy_set(nullptr, "exp_avg_dtype", "fp32"), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_policy_set(&p, nullptr, "fp32"), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_policy_set(&p, "exp_avg_dtype", nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_TRUE(Contains(LastError(), "exp_avg_dtype")) << LastError();
  EXPECT_EQ(Describe(p), Describe(Defaults(BF16)));

  precis_policy_t small = Defaults(BF16);
  small.size = 8;
  precis_policy_t small_before = small;
  EXPECT_EQ(precis_policy_set(&small, "exp_avg_dtype", "fp32"), PRECIS_ERR_SIZE_MISMATCH);
  EXPECT_EQ(Describe(small), Describe(small_before));

  // A policy whose model dtype is garbage cannot be overridden.
  for (int bad : {3, 4, 99, -1}) {
    precis_policy_t g = Defaults(BF16);
    g.param_dtype = static_cast<precis_dtype_t>(bad);
    precis_policy_t before = g;
    EXPECT_NE(precis_policy_set(&g, "exp_avg_dtype", "fp32"), PRECIS_OK) << bad;
    EXPECT_TRUE(Contains(LastError(), "param_dtype")) << LastError();
    EXPECT_EQ(Describe(g), Describe(before));
  }
}

// ---- validate ------------------------------------------------------------------

TEST(PolicyValidate, LegalSetsAndGarbageCodes) {
  for (const DtypeField& f : kDtypeFields) {
    for (int d : {0, 1, 2, 3, 4, 5, 99, -1}) {
      precis_policy_t p = Defaults(BF16);
      p.*f.member = static_cast<precis_dtype_t>(d);
      bool legal = std::find(f.legal.begin(), f.legal.end(), d) != f.legal.end();
      // The sums' dtype must pair with the wire's (PolicyGradSums): a legal one sets both.
      if (legal && f.field == PRECIS_FIELD_GRAD_COMM_DTYPE) p.grad_sum_dtype = p.grad_comm_dtype;
      if (legal && f.field == PRECIS_FIELD_GRAD_SUM_DTYPE) p.grad_comm_dtype = p.grad_sum_dtype;
      precis_status_t st = precis_policy_validate(&p);
      if (legal) {
        EXPECT_EQ(st, PRECIS_OK) << f.name << "=" << d << ": " << LastError();
      } else {
        EXPECT_EQ(st, d >= 0 && d < PRECIS_DTYPE_COUNT ? PRECIS_ERR_INVALID_POLICY
                                                       : PRECIS_ERR_INVALID_DTYPE)
            << f.name << "=" << d;
        EXPECT_EQ(LastError().rfind(std::string(f.name) + ": ", 0), 0u) << LastError();
      }
    }
  }
}

TEST(PolicyValidate, ParamDtype) {
  for (int d : {3, 4, 5, 99, -1}) {
    precis_policy_t p = Defaults(BF16);
    p.param_dtype = static_cast<precis_dtype_t>(d);
    EXPECT_NE(precis_policy_validate(&p), PRECIS_OK) << d;
    EXPECT_EQ(LastError().rfind("param_dtype: ", 0), 0u) << LastError();
  }
}

TEST(PolicyValidate, StoreParamRemaindersIsZeroOrOne) {
  for (int32_t v : {2, -1, 255}) {
    precis_policy_t p = Defaults(BF16);
    p.store_param_remainders = v;
    EXPECT_EQ(precis_policy_validate(&p), PRECIS_ERR_INVALID_POLICY) << v;
    EXPECT_TRUE(Contains(LastError(), "store_param_remainders")) << LastError();
  }
}

TEST(PolicyValidate, MasterMatrix) {
  struct Case {
    precis_dtype_t model, master;
    bool ok;
  };
  const Case cases[] = {
      {FP32, FP32, true}, {FP32, FP16, false}, {FP32, BF16, false},
      {FP16, FP32, true}, {FP16, FP16, true},  {FP16, BF16, false},
      {BF16, FP32, true}, {BF16, FP16, true},  {BF16, BF16, true},
  };
  for (const Case& c : cases) {
    precis_policy_t p = Defaults(c.model);
    p.main_params_dtype = c.master;
    EXPECT_EQ(precis_policy_validate(&p), c.ok ? PRECIS_OK : PRECIS_ERR_INVALID_POLICY)
        << Name(c.model) << " model, " << Name(c.master) << " master";
    if (!c.ok) {
      std::string msg = LastError();  // before Name(), which clears it
      EXPECT_EQ(msg.rfind("main_params_dtype: ", 0), 0u) << msg;
      EXPECT_TRUE(Contains(msg, Name(c.model))) << msg;
    }
  }
}

TEST(PolicyValidate, RemaindersNeedBf16ParamsAndFp32Master) {
  for (precis_dtype_t model : kModels) {
    for (precis_dtype_t master : {FP32, FP16, BF16}) {
      precis_policy_t p = Defaults(model);
      p.main_params_dtype = master;
      if (precis_policy_validate(&p) != PRECIS_OK) continue;  // master rule already fails
      p.store_param_remainders = 1;
      bool ok = model == BF16 && master == FP32;
      EXPECT_EQ(precis_policy_validate(&p), ok ? PRECIS_OK : PRECIS_ERR_INVALID_POLICY)
          << Name(model) << " " << Name(master);
      if (!ok) {
        EXPECT_EQ(LastError().rfind("store_param_remainders: ", 0), 0u) << LastError();
      }
    }
  }
}

TEST(PolicyValidate, ExplicitBitsDoNotMatter) {
  precis_policy_t p = Defaults(BF16);
  p.explicit_fields = 0xFFFFFFFFu;
  EXPECT_EQ(precis_policy_validate(&p), PRECIS_OK);
}

TEST(PolicyValidate, BadStruct) {
  EXPECT_EQ(precis_policy_validate(nullptr), PRECIS_ERR_NULL_POINTER);
  precis_policy_t p = Defaults(BF16);
  p.size = 0;
  EXPECT_EQ(precis_policy_validate(&p), PRECIS_ERR_SIZE_MISMATCH);
  p.size = sizeof(precis_policy_t) + 64;  // a newer caller's larger struct is fine
  EXPECT_EQ(precis_policy_validate(&p), PRECIS_OK);
}

// ---- resolve --------------------------------------------------------------------

TEST(PolicyResolve, DefaultsPlusOverrides) {
  precis_policy_t out = PRECIS_POLICY_INIT;
  ASSERT_EQ(Resolve(BF16, {{"exp_avg_dtype", "fp8"}, {"grad_reduce_in_fp32", "true"}}, &out),
            PRECIS_OK)
      << LastError();
  EXPECT_EQ(Describe(out), Describe(Make(BF16, FP32, FP32, FP32, FP8, BF16, 0,
                                         Bit(PRECIS_FIELD_EXP_AVG_DTYPE) |
                                             Bit(PRECIS_FIELD_GRAD_REDUCE_IN_FP32))));
  EXPECT_EQ(LastError(), "");
}

TEST(PolicyResolve, NoOverridesGivesDefaults) {
  for (precis_dtype_t model : kModels) {
    precis_policy_t out = PRECIS_POLICY_INIT;
    ASSERT_EQ(precis_policy_resolve(model, nullptr, nullptr, 0, &out), PRECIS_OK);
    EXPECT_EQ(Describe(out), Describe(Defaults(model)));
  }
}

TEST(PolicyResolve, FailureLeavesOutUntouched) {
  const precis_policy_t sentinel = Make(FP16, FP8, FP8, INT16, INT16, FP8, 3, 0xABCDu);
  struct Case {
    precis_dtype_t model;
    Overrides overrides;
    precis_status_t status;
    const char* mentions;
  };
  const std::vector<Case> cases = {
      {FP16,
       {{"store_param_remainders", "true"}},
       PRECIS_ERR_INVALID_POLICY,
       "store_param_remainders"},
      {FP32, {{"main_params_dtype", "fp16"}}, PRECIS_ERR_INVALID_POLICY, "main_params_dtype"},
      {BF16,
       {{"exp_avg_dtype", "fp8"}, {"grad_comm_dtype", "int16"}},
       PRECIS_ERR_INVALID_POLICY,
       "grad_comm_dtype"},
      {BF16, {{"exp_avg_dtype", "bf17"}}, PRECIS_ERR_INVALID_DTYPE, "exp_avg_dtype: 'bf17'"},
      {BF16, {{"param_dtype", "fp32"}}, PRECIS_ERR_INVALID_ARGUMENT, "param_dtype"},
      {FP8, {}, PRECIS_ERR_INVALID_POLICY, "param_dtype"},
      {static_cast<precis_dtype_t>(42), {}, PRECIS_ERR_INVALID_DTYPE, "42"},
  };
  for (const Case& c : cases) {
    precis_policy_t out = sentinel;
    EXPECT_EQ(Resolve(c.model, c.overrides, &out), c.status) << c.mentions;
    EXPECT_TRUE(Contains(LastError(), c.mentions)) << LastError();
    EXPECT_EQ(Describe(out), Describe(sentinel));
  }
}

TEST(PolicyResolve, NullArguments) {
  const char* fields[] = {"exp_avg_dtype", nullptr};
  const char* values[] = {"fp32", "fp32"};
  const char* null_value[] = {"fp32", nullptr};
  precis_policy_t out = PRECIS_POLICY_INIT;
  EXPECT_EQ(precis_policy_resolve(BF16, fields, values, 1, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_policy_resolve(BF16, nullptr, values, 1, &out), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_policy_resolve(BF16, fields, nullptr, 1, &out), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_policy_resolve(BF16, fields, values, 2, &out), PRECIS_ERR_NULL_POINTER);
  EXPECT_TRUE(Contains(LastError(), "fields[1]")) << LastError();
  EXPECT_EQ(precis_policy_resolve(BF16, fields, null_value, 2, &out), PRECIS_ERR_NULL_POINTER);
  EXPECT_TRUE(Contains(LastError(), "fields[1]")) << LastError();  // checked before values[1]
  const char* both[] = {"exp_avg_dtype", "exp_avg_sq_dtype"};
  EXPECT_EQ(precis_policy_resolve(BF16, both, null_value, 2, &out), PRECIS_ERR_NULL_POINTER);
  EXPECT_TRUE(Contains(LastError(), "values[1]")) << LastError();
  const precis_policy_t init = PRECIS_POLICY_INIT;
  EXPECT_EQ(Describe(out), Describe(init));
  out.size = 4;
  EXPECT_EQ(precis_policy_resolve(BF16, nullptr, nullptr, 0, &out), PRECIS_ERR_SIZE_MISMATCH);
  EXPECT_TRUE(Contains(LastError(), "precis_policy_resolve: out->size is 4")) << LastError();
}

TEST(PolicyResolve, ARefusedOverrideIsNamedByItsIndex) {
  precis_policy_t out = PRECIS_POLICY_INIT;
  EXPECT_EQ(Resolve(BF16, {{"exp_avg_dtype", "fp8"}, {"bogus", "fp32"}}, &out),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(LastError(), "precis_policy_resolve: fields[1]: 'bogus'")) << LastError();
  EXPECT_FALSE(Contains(LastError(), "precis_policy_set")) << LastError();
}

TEST(PolicyResolve, AFieldNamedTwiceIsRefusedWhateverItsCase) {
  // Two spellings of one key (a YAML mapping can hold both): no order is the caller's.
  struct Twice {
    const char *first, *second, *field, *value1, *value2;
  };
  const Twice cases[] = {
      {"exp_avg_dtype", "EXP_AVG_DTYPE", "exp_avg_dtype", "fp32", "bf16"},
      {"store_param_remainders", " store_param_remainders", "store_param_remainders", "true",
       "false"},
      {"Param_Remainder_Bits", "param_remainder_bits", "param_remainder_bits", "8", "16"},
  };
  precis_policy_t out = Defaults(FP32);
  const precis_policy_t before = out;
  for (const Twice& t : cases) {
    Overrides o = {{t.first, t.value1}, {"exp_avg_sq_dtype", "fp8"}, {t.second, t.value2}};
    EXPECT_EQ(Resolve(BF16, o, &out), PRECIS_ERR_INVALID_ARGUMENT) << t.first;
    EXPECT_EQ(LastError(), std::string("precis_policy_resolve: fields[0] '") + t.first +
                               "' and fields[2] '" + t.second + "' both name " + t.field +
                               "; give it once");
    EXPECT_EQ(Describe(out), Describe(before));
  }
  // Each once, in any case: taken.
  ASSERT_EQ(Resolve(BF16, {{"EXP_AVG_DTYPE", "fp8"}, {" exp_avg_sq_dtype ", "fp8"}}, &out),
            PRECIS_OK)
      << LastError();
  EXPECT_EQ(out.exp_avg_dtype, FP8);
  EXPECT_EQ(out.exp_avg_sq_dtype, FP8);
}

// ---- legal sets -----------------------------------------------------------------

uint32_t Mask(const std::vector<precis_dtype_t>& dtypes) {
  uint32_t m = 0;
  for (precis_dtype_t d : dtypes) m |= 1u << d;
  return m;
}

TEST(PolicyLegal, MasksPerField) {
  for (const DtypeField& f : kDtypeFields) {
    uint32_t mask = 0;
    ASSERT_EQ(precis_policy_legal_dtypes(f.name, &mask), PRECIS_OK) << f.name;
    EXPECT_EQ(mask, Mask(f.legal)) << f.name;
  }
  uint32_t mask = 0;
  ASSERT_EQ(precis_policy_legal_dtypes(" Param_Dtype ", &mask), PRECIS_OK);
  EXPECT_EQ(mask, Mask({FP32, FP16, BF16}));
}

TEST(PolicyLegal, MasksAgreeWithSet) {
  for (const DtypeField& f : kDtypeFields) {
    uint32_t mask = 0;
    ASSERT_EQ(precis_policy_legal_dtypes(f.name, &mask), PRECIS_OK);
    for (precis_dtype_t d : kAllDtypes) {
      precis_policy_t p = Defaults(BF16);
      bool accepted = precis_policy_set(&p, f.name, Name(d).c_str()) == PRECIS_OK;
      EXPECT_EQ(accepted, ((mask >> d) & 1u) != 0) << f.name << " " << Name(d);
    }
  }
}

TEST(PolicyLegal, Errors) {
  uint32_t mask = 0xDEADu;
  for (const char* field : {"store_param_remainders", "grad_reduce_in_fp32"}) {
    EXPECT_EQ(precis_policy_legal_dtypes(field, &mask), PRECIS_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(Contains(LastError(), "boolean")) << LastError();
  }
  EXPECT_EQ(precis_policy_legal_dtypes("param_remainder_bits", &mask),
            PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(LastError(), "param_remainder_bits takes 16 or 8")) << LastError();
  EXPECT_EQ(precis_policy_legal_dtypes("nope", &mask), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(LastError(), "'nope'")) << LastError();
  EXPECT_EQ(precis_policy_legal_dtypes("", &mask), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mask, 0xDEADu);
  EXPECT_EQ(precis_policy_legal_dtypes(nullptr, &mask), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_policy_legal_dtypes("exp_avg_dtype", nullptr), PRECIS_ERR_NULL_POINTER);
}

}  // namespace

// ---- grad_sum_dtype: follows the wire, pairs with it ------------------------------

TEST(PolicyGradSums, FollowTheWireUnlessSet) {
  struct Case {
    std::vector<const char*> fields, values;
    precis_dtype_t comm, sum;
  };
  const std::vector<Case> cases = {
      {{}, {}, BF16, BF16},
      {{"grad_comm_dtype"}, {"fp32"}, FP32, FP32},
      {{"main_grads_dtype"}, {"fp32"}, FP32, FP32},
      {{"grad_sum_dtype"}, {"fp32"}, BF16, FP32},
      {{"grad_sum_dtype", "grad_comm_dtype"}, {"fp32", "fp16"}, FP16, FP32},
      {{"grad_comm_dtype", "grad_sum_dtype"}, {"fp16", "fp32"}, FP16, FP32},
      {{"grad_sum_dtype", "main_grads_dtype"}, {"fp32", "fp32"}, FP32, FP32},
  };
  for (const Case& c : cases) {
    precis_policy_t p = PRECIS_POLICY_INIT;
    ASSERT_EQ(precis_policy_resolve(BF16, c.fields.data(), c.values.data(), c.fields.size(), &p),
              PRECIS_OK)
        << LastError();
    EXPECT_EQ(p.grad_comm_dtype, c.comm) << Describe(p);
    EXPECT_EQ(p.grad_sum_dtype, c.sum) << Describe(p);
  }
}

TEST(PolicyGradSums, SumsInTheWiresDtypeOrFp32) {
  struct Case {
    const char* comm;
    const char* sum;
    bool ok;
  };
  for (const Case& c : {Case{"bf16", "fp32", true}, Case{"fp16", "fp32", true},
                        Case{"fp32", "fp32", true}, Case{"bf16", "bf16", true},
                        Case{"fp32", "bf16", false}, Case{"bf16", "fp16", false},
                        Case{"fp16", "bf16", false}, Case{"fp32", "fp16", false}}) {
    const char* fields[] = {"grad_comm_dtype", "grad_sum_dtype"};
    const char* values[] = {c.comm, c.sum};
    precis_policy_t out = Defaults(FP32);
    const precis_policy_t before = out;
    precis_status_t st = precis_policy_resolve(BF16, fields, values, 2, &out);
    if (c.ok) {
      EXPECT_EQ(st, PRECIS_OK) << c.comm << " " << c.sum << ": " << LastError();
      continue;
    }
    EXPECT_EQ(st, PRECIS_ERR_INVALID_POLICY) << c.comm << " " << c.sum;
    EXPECT_EQ(LastError(), std::string("grad_sum_dtype: ") + c.sum + " with grad_comm_dtype " +
                               c.comm + "; the sums are in the wire's dtype or in fp32");
    EXPECT_EQ(Describe(out), Describe(before));  // nothing written
  }
}

// ---- param_remainder_bits: 16 (int16, exact fp32 master) or 8 (a 24-bit master) ----------

TEST(PolicyRemainderBits, SixteenByDefaultEightOnlyWithRemainders) {
  EXPECT_EQ(Defaults(BF16).param_remainder_bits, 16);
  struct Case {
    std::vector<const char*> fields, values;
    precis_status_t st;
    int bits;
    const char* error;
  };
  const std::vector<Case> cases = {
      {{"store_param_remainders", "param_remainder_bits"}, {"true", "8"}, PRECIS_OK, 8, ""},
      {{"param_remainder_bits", "store_param_remainders"}, {" 8 ", "on"}, PRECIS_OK, 8, ""},
      {{"store_param_remainders", "param_remainder_bits"}, {"true", "16"}, PRECIS_OK, 16, ""},
      {{"param_remainder_bits"}, {"16"}, PRECIS_OK, 16, ""},
      {{"param_remainder_bits"},
       {"8"},
       PRECIS_ERR_INVALID_POLICY,
       0,
       "param_remainder_bits: 8 without store_param_remainders; the bits are those of the "
       "remainder kept beside each bf16 param"},
      {{"store_param_remainders", "param_remainder_bits"},
       {"true", "12"},
       PRECIS_ERR_INVALID_POLICY,
       0,
       "param_remainder_bits: '12' is not allowed; legal: 16, 8"},
      {{"store_param_remainders", "param_remainder_bits"},
       {"true", "eight"},
       PRECIS_ERR_INVALID_POLICY,
       0,
       "param_remainder_bits: 'eight' is not allowed; legal: 16, 8"},
  };
  for (const Case& c : cases) {
    precis_policy_t out = Defaults(FP32);
    const precis_policy_t before = out;
    precis_status_t st =
        precis_policy_resolve(BF16, c.fields.data(), c.values.data(), c.fields.size(), &out);
    EXPECT_EQ(st, c.st) << LastError();
    if (st == PRECIS_OK) {
      EXPECT_EQ(out.param_remainder_bits, c.bits) << Describe(out);
    } else {
      EXPECT_EQ(LastError(), c.error);
      EXPECT_EQ(Describe(out), Describe(before));
    }
  }
  precis_policy_t garbage = Defaults(BF16);
  garbage.param_remainder_bits = 4;
  EXPECT_EQ(precis_policy_validate(&garbage), PRECIS_ERR_INVALID_POLICY);
  EXPECT_EQ(LastError(), "param_remainder_bits: 4 is not 16 or 8");
}

// ---- momentum_dtype: the one state of SGD, Lion and Muon, following exp_avg_dtype ----------

TEST(PolicyMomentum, DefaultsPerModelDtype) {
  EXPECT_EQ(Defaults(BF16).momentum_dtype, BF16);
  EXPECT_EQ(Defaults(FP16).momentum_dtype, FP32);
  EXPECT_EQ(Defaults(FP32).momentum_dtype, FP32);
  for (precis_dtype_t model : kModels) {
    precis_policy_t out = Defaults(FP16);
    out.momentum_dtype = INT16;  // resolve writes it
    ASSERT_EQ(precis_policy_resolve(model, nullptr, nullptr, 0, &out), PRECIS_OK) << LastError();
    EXPECT_EQ(out.momentum_dtype, Defaults(model).exp_avg_dtype) << Name(model);
    EXPECT_EQ(out.explicit_fields, 0u);
  }
  const precis_policy_t init = PRECIS_POLICY_INIT;
  EXPECT_EQ(init.momentum_dtype, FP32);
}

TEST(PolicyMomentum, FollowsExpAvgWhateverTheOrder) {
  for (precis_dtype_t model : kModels) {
    for (precis_dtype_t m : {FP32, FP16, BF16, FP8}) {
      precis_policy_t p = Defaults(model);
      ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", Name(m).c_str()), PRECIS_OK) << LastError();
      EXPECT_EQ(p.momentum_dtype, m) << Name(model) << " exp_avg " << Name(m);
      EXPECT_EQ(p.explicit_fields, Bit(PRECIS_FIELD_EXP_AVG_DTYPE));
    }
  }
  // With other overrides around it, in every order; the last exp_avg wins and leads.
  precis_policy_t want = Make(BF16, FP32, FP32, FP32, FP8, FP16, 0,
                              Bit(PRECIS_FIELD_EXP_AVG_DTYPE) |
                                  Bit(PRECIS_FIELD_MAIN_GRADS_DTYPE) |
                                  Bit(PRECIS_FIELD_EXP_AVG_SQ_DTYPE));
  CheckAllOrders(BF16,
                 {{"exp_avg_dtype", "uint8"}, {"main_grads_dtype", "fp32"},
                  {"exp_avg_sq_dtype", "half"}},
                 PRECIS_OK, want);
  EXPECT_EQ(want.momentum_dtype, FP8);
  precis_policy_t p = Defaults(FP16);
  ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "fp8"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "bf16"), PRECIS_OK);
  EXPECT_EQ(p.momentum_dtype, BF16);
  // Overrides of other fields leave a followed momentum where exp_avg is.
  ASSERT_EQ(precis_policy_set(&p, "grad_reduce_in_fp32", "false"), PRECIS_OK);
  EXPECT_EQ(p.momentum_dtype, BF16);
}

TEST(PolicyMomentum, ExplicitOverrideWinsInBothOrders) {
  for (precis_dtype_t model : kModels) {
    precis_policy_t want = Defaults(model);
    want.exp_avg_dtype = FP8;
    want.momentum_dtype = FP16;
    want.explicit_fields = Bit(PRECIS_FIELD_EXP_AVG_DTYPE) | Bit(PRECIS_FIELD_MOMENTUM_DTYPE);
    CheckAllOrders(model, {{"exp_avg_dtype", "fp8"}, {"momentum_dtype", "fp16"}}, PRECIS_OK,
                   want);
    // Alone: only the momentum moves.
    precis_policy_t p = Defaults(model);
    precis_policy_t expected = p;
    expected.momentum_dtype = FP8;
    expected.explicit_fields = Bit(PRECIS_FIELD_MOMENTUM_DTYPE);
    ASSERT_EQ(precis_policy_set(&p, " Momentum_Dtype ", "e4m3"), PRECIS_OK) << LastError();
    EXPECT_EQ(Describe(p), Describe(expected));
    // Explicit now: a later exp_avg no longer moves it.
    ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "fp32"), PRECIS_OK);
    EXPECT_EQ(p.momentum_dtype, FP8);
    EXPECT_EQ(p.exp_avg_dtype, FP32);
  }
  // Explicitly the same as exp_avg still counts as explicit.
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "momentum_dtype", "bf16"), PRECIS_OK);
  ASSERT_EQ(precis_policy_set(&p, "exp_avg_dtype", "fp32"), PRECIS_OK);
  EXPECT_EQ(p.momentum_dtype, BF16);
}

TEST(PolicyMomentum, ExplicitBitIsNine) {
  EXPECT_EQ(static_cast<int>(PRECIS_FIELD_MOMENTUM_DTYPE), 9);
  EXPECT_EQ(static_cast<int>(PRECIS_FIELD_COUNT), 10);
  precis_policy_t p = Defaults(BF16);
  ASSERT_EQ(precis_policy_set(&p, "momentum_dtype", "fp32"), PRECIS_OK);
  EXPECT_EQ(p.explicit_fields, 1u << 9);
}

TEST(PolicyMomentum, LegalSetAndErrors) {
  uint32_t mask = 0;
  ASSERT_EQ(precis_policy_legal_dtypes("momentum_dtype", &mask), PRECIS_OK);
  EXPECT_EQ(mask, Mask({FP32, FP16, BF16, FP8}));
  precis_policy_t p = Defaults(BF16);
  const precis_policy_t before = p;
  EXPECT_EQ(precis_policy_set(&p, "momentum_dtype", "int16"), PRECIS_ERR_INVALID_POLICY);
  EXPECT_EQ(LastError(), "momentum_dtype: int16 is not allowed; legal: fp32, fp16, bf16, fp8");
  EXPECT_EQ(Describe(p), Describe(before));
  EXPECT_EQ(precis_policy_set(&p, "momentum_dtype", "bf17"), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(LastError(), std::string("momentum_dtype: 'bf17' is not a dtype; ") +
                             AcceptedNames({FP32, FP16, BF16, FP8}));
  EXPECT_EQ(Describe(p), Describe(before));
  ASSERT_EQ(precis_policy_set(&p, "momentum_dtype", "torch.uint8"), PRECIS_OK);
  EXPECT_EQ(p.momentum_dtype, FP8);
  // Through resolve: *out untouched, the field named.
  precis_policy_t out = Defaults(FP32);
  const precis_policy_t out_before = out;
  EXPECT_EQ(Resolve(BF16, {{"exp_avg_dtype", "fp8"}, {"momentum_dtype", "float64"}}, &out),
            PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(LastError(), std::string("momentum_dtype: 'float64' is not a dtype; ") +
                             AcceptedNames({FP32, FP16, BF16, FP8}));
  EXPECT_EQ(Describe(out), Describe(out_before));
  // Validate checks it, and names it.
  p = Defaults(BF16);
  p.momentum_dtype = INT16;
  EXPECT_EQ(precis_policy_validate(&p), PRECIS_ERR_INVALID_POLICY);
  EXPECT_EQ(LastError(), "momentum_dtype: int16 is not allowed; legal: fp32, fp16, bf16, fp8");
  p.momentum_dtype = static_cast<precis_dtype_t>(7);
  EXPECT_EQ(precis_policy_validate(&p), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(LastError().rfind("momentum_dtype: ", 0), 0u) << LastError();
  // Unknown-field messages list it.
  EXPECT_EQ(precis_policy_set(&p, "momentum", "fp32"), PRECIS_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(LastError(), "param_remainder_bits, momentum_dtype")) << LastError();
}

// The policy precis_policy_t was before momentum_dtype, as an older caller declares it.
struct OldPolicy {
  size_t size;
  precis_dtype_t param_dtype, main_params_dtype, main_grads_dtype, grad_comm_dtype,
      exp_avg_dtype, exp_avg_sq_dtype;
  int32_t store_param_remainders;
  uint32_t explicit_fields;
  precis_dtype_t grad_sum_dtype;
  int32_t param_remainder_bits;
};
static_assert(sizeof(OldPolicy) == kOldSize, "the minimum size is the older struct's");

// A caller's struct of `size` bytes in memory that goes on: what follows must stay as it was.
struct CallerMemory {
  alignas(precis_policy_t) unsigned char bytes[sizeof(precis_policy_t) + 32];
  size_t size;
  explicit CallerMemory(size_t n) : size(n) {
    std::memset(bytes, 0x5A, sizeof bytes);
    policy()->size = n;
  }
  precis_policy_t* policy() { return reinterpret_cast<precis_policy_t*>(bytes); }
  bool TailUntouched() const {
    for (size_t i = size; i < sizeof bytes; ++i) {
      if (bytes[i] != 0x5A) return false;
    }
    return true;
  }
  OldPolicy Old() const {
    OldPolicy o;
    std::memcpy(&o, bytes, sizeof o);
    return o;
  }
};

TEST(PolicyMomentum, OlderSmallerStructStillWorks) {
  CallerMemory mem(kOldSize);
  precis_policy_t* p = mem.policy();
  ASSERT_EQ(precis_policy_defaults(BF16, p), PRECIS_OK) << LastError();
  EXPECT_TRUE(mem.TailUntouched());
  OldPolicy o = mem.Old();
  EXPECT_EQ(o.size, kOldSize);
  EXPECT_EQ(o.exp_avg_dtype, BF16);
  EXPECT_EQ(o.grad_sum_dtype, BF16);
  EXPECT_EQ(o.param_remainder_bits, 16);
  EXPECT_EQ(precis_policy_validate(p), PRECIS_OK) << LastError();

  // Overrides of the fields it has work (an exp_avg whose follower it has no room for).
  ASSERT_EQ(precis_policy_set(p, "exp_avg_dtype", "fp8"), PRECIS_OK) << LastError();
  ASSERT_EQ(precis_policy_set(p, "store_param_remainders", "true"), PRECIS_OK) << LastError();
  ASSERT_EQ(precis_policy_set(p, "param_remainder_bits", "8"), PRECIS_OK) << LastError();
  EXPECT_TRUE(mem.TailUntouched());
  o = mem.Old();
  EXPECT_EQ(o.exp_avg_dtype, FP8);
  EXPECT_EQ(o.param_remainder_bits, 8);
  EXPECT_EQ(o.explicit_fields, Bit(PRECIS_FIELD_EXP_AVG_DTYPE) |
                                   Bit(PRECIS_FIELD_STORE_PARAM_REMAINDERS) |
                                   Bit(PRECIS_FIELD_PARAM_REMAINDER_BITS));
  EXPECT_EQ(precis_policy_validate(p), PRECIS_OK) << LastError();

  // momentum_dtype itself needs the member: fails, nothing written.
  const OldPolicy before = mem.Old();
  EXPECT_EQ(precis_policy_set(p, "momentum_dtype", "fp16"), PRECIS_ERR_SIZE_MISMATCH);
  EXPECT_TRUE(Contains(LastError(), "momentum_dtype")) << LastError();
  EXPECT_TRUE(Contains(LastError(), "PRECIS_POLICY_INIT")) << LastError();
  EXPECT_EQ(std::memcmp(&before, mem.bytes, sizeof before), 0);
  EXPECT_TRUE(mem.TailUntouched());

  // Resolve into it: fine without a momentum override, SIZE_MISMATCH with one.
  CallerMemory out(kOldSize);
  ASSERT_EQ(Resolve(FP16, {{"exp_avg_dtype", "bf16"}, {"main_params_dtype", "fp16"}},
                    out.policy()),
            PRECIS_OK)
      << LastError();
  EXPECT_TRUE(out.TailUntouched());
  EXPECT_EQ(out.Old().exp_avg_dtype, BF16);
  EXPECT_EQ(out.Old().main_params_dtype, FP16);
  EXPECT_EQ(out.Old().size, kOldSize);
  const OldPolicy out_before = out.Old();
  EXPECT_EQ(Resolve(FP16, {{"momentum_dtype", "bf16"}}, out.policy()), PRECIS_ERR_SIZE_MISMATCH);
  EXPECT_TRUE(Contains(LastError(), "precis_policy_resolve: momentum_dtype")) << LastError();
  EXPECT_EQ(std::memcmp(&out_before, out.bytes, sizeof out_before), 0);
  EXPECT_TRUE(out.TailUntouched());

  // Validate of an older struct checks what it has.
  CallerMemory bad(kOldSize);
  ASSERT_EQ(precis_policy_defaults(FP32, bad.policy()), PRECIS_OK);
  bad.policy()->main_params_dtype = FP16;
  EXPECT_EQ(precis_policy_validate(bad.policy()), PRECIS_ERR_INVALID_POLICY);
  EXPECT_EQ(LastError().rfind("main_params_dtype: ", 0), 0u) << LastError();

  // One byte short of even the older struct: refused, naming the size it needs.
  CallerMemory tiny(kOldSize - 1);
  EXPECT_EQ(precis_policy_defaults(BF16, tiny.policy()), PRECIS_ERR_SIZE_MISMATCH);
  EXPECT_TRUE(Contains(LastError(), "expected at least " + std::to_string(kOldSize)))
      << LastError();
  EXPECT_EQ(tiny.policy()->size, kOldSize - 1);
  EXPECT_TRUE(tiny.TailUntouched());
}

TEST(PolicyMomentum, StructUpToTheMemberIsWrittenNoFurther) {
  // A size that holds momentum_dtype but not the tail padding: written up to the member.
  const size_t size = offsetof(precis_policy_t, momentum_dtype) + sizeof(precis_dtype_t);
  CallerMemory mem(size);
  precis_policy_t* p = mem.policy();
  ASSERT_EQ(precis_policy_defaults(BF16, p), PRECIS_OK) << LastError();
  ASSERT_EQ(precis_policy_set(p, "momentum_dtype", "fp8"), PRECIS_OK) << LastError();
  EXPECT_TRUE(mem.TailUntouched());
  precis_dtype_t m;
  std::memcpy(&m, mem.bytes + offsetof(precis_policy_t, momentum_dtype), sizeof m);
  EXPECT_EQ(m, FP8);
  EXPECT_EQ(precis_policy_validate(p), PRECIS_OK) << LastError();
  CallerMemory out(size);
  ASSERT_EQ(Resolve(BF16, {{"momentum_dtype", "fp32"}}, out.policy()), PRECIS_OK) << LastError();
  EXPECT_TRUE(out.TailUntouched());
  std::memcpy(&m, out.bytes + offsetof(precis_policy_t, momentum_dtype), sizeof m);
  EXPECT_EQ(m, FP32);
}
