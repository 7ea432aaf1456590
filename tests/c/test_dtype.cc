// Dtype names, aliases and sizes.
#include <cctype>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "precis/precis.h"
#include "precis_convert.h"

namespace {

// The whole alias table (precis.h and docs/design.md section 3), in the order error
// messages list it.
const std::vector<std::pair<const char*, precis_dtype_t>> kAliases = {
    {"fp32", PRECIS_DTYPE_FP32},         {"float32", PRECIS_DTYPE_FP32},
    {"float", PRECIS_DTYPE_FP32},        {"fp16", PRECIS_DTYPE_FP16},
    {"float16", PRECIS_DTYPE_FP16},      {"half", PRECIS_DTYPE_FP16},
    {"bf16", PRECIS_DTYPE_BF16},         {"bfloat16", PRECIS_DTYPE_BF16},
    {"fp8", PRECIS_DTYPE_FP8_E4M3},      {"float8", PRECIS_DTYPE_FP8_E4M3},
    {"fp8_e4m3", PRECIS_DTYPE_FP8_E4M3}, {"e4m3", PRECIS_DTYPE_FP8_E4M3},
    {"uint8", PRECIS_DTYPE_FP8_E4M3},    {"int16", PRECIS_DTYPE_INT16},
};

// "accepted: fp32, float32, ..., int16".
const std::string kAccepted = [] {
  std::string s = "accepted: ";
  for (size_t i = 0; i < kAliases.size(); ++i) {
    if (i > 0) s += ", ";
    s += kAliases[i].first;
  }
  return s;
}();

precis_status_t Parse(const std::string& name, precis_dtype_t* out) {
  return precis_dtype_from_name(name.c_str(), out);
}

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

TEST(Dtype, CodesAreStable) {
  EXPECT_EQ(PRECIS_DTYPE_FP32, 0);
  EXPECT_EQ(PRECIS_DTYPE_FP16, 1);
  EXPECT_EQ(PRECIS_DTYPE_BF16, 2);
  EXPECT_EQ(PRECIS_DTYPE_FP8_E4M3, 3);
  EXPECT_EQ(PRECIS_DTYPE_INT16, 4);
  EXPECT_EQ(PRECIS_DTYPE_COUNT, 5);
}

TEST(Dtype, EveryAliasParses) {
  for (const auto& [name, dtype] : kAliases) {
    precis_dtype_t out = PRECIS_DTYPE_COUNT;
    ASSERT_EQ(Parse(name, &out), PRECIS_OK) << name << ": " << precis_last_error();
    EXPECT_EQ(out, dtype) << name;
    EXPECT_STREQ(precis_last_error(), "");
  }
}

TEST(Dtype, CaseWhitespaceAndTorchPrefixAreIgnored) {
  for (const auto& [name, dtype] : kAliases) {
    const std::string n = name;
    for (const std::string& variant :
         {Upper(n), " " + n, n + " ", "\t " + Upper(n) + "\n", "torch." + n, "TORCH." + Upper(n),
          "  torch." + n + "\r\n"}) {
      precis_dtype_t out = PRECIS_DTYPE_COUNT;
      ASSERT_EQ(Parse(variant, &out), PRECIS_OK) << "'" << variant << "'";
      EXPECT_EQ(out, dtype) << "'" << variant << "'";
    }
  }
  // Mixed case, and what str(torch.<dtype>) prints in Python.
  precis_dtype_t out;
  ASSERT_EQ(Parse("BFloat16", &out), PRECIS_OK);
  EXPECT_EQ(out, PRECIS_DTYPE_BF16);
  ASSERT_EQ(Parse("torch.bfloat16", &out), PRECIS_OK);
  EXPECT_EQ(out, PRECIS_DTYPE_BF16);
  ASSERT_EQ(Parse("torch.float16", &out), PRECIS_OK);
  EXPECT_EQ(out, PRECIS_DTYPE_FP16);
  ASSERT_EQ(Parse("torch.float32", &out), PRECIS_OK);
  EXPECT_EQ(out, PRECIS_DTYPE_FP32);
}

TEST(Dtype, UnknownNamesFailWithTheAcceptedList) {
  precis_dtype_t out = PRECIS_DTYPE_INT16;
  ASSERT_EQ(Parse("bf17", &out), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_EQ(std::string(precis_last_error()),
            std::string("dtype: 'bf17' is not a dtype; ") + kAccepted);
  EXPECT_EQ(out, PRECIS_DTYPE_INT16);  // untouched

  for (const char* bad :
       {"", " ", "\t\n", "bf 16", "fp32x", "float64", "int8", "fp8_e5m2", "torch.", "torch.bf17",
        "torch.torch.fp32", "torch", "b f16", "fp_32", "32", "-1"}) {
    out = PRECIS_DTYPE_INT16;
    EXPECT_EQ(Parse(bad, &out), PRECIS_ERR_INVALID_DTYPE) << "'" << bad << "'";
    EXPECT_EQ(out, PRECIS_DTYPE_INT16);
    std::string msg = precis_last_error();
    EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(kAccepted), std::string::npos) << msg;
  }
}

TEST(Dtype, VeryLongNameFails) {
  precis_dtype_t out;
  std::string long_name = "   " + std::string(10000, 'f') + "p32";
  EXPECT_EQ(Parse(long_name, &out), PRECIS_ERR_INVALID_DTYPE);
  // A valid name behind a lot of whitespace still parses.
  EXPECT_EQ(Parse(std::string(5000, ' ') + "bf16" + std::string(5000, '\t'), &out), PRECIS_OK);
  EXPECT_EQ(out, PRECIS_DTYPE_BF16);
}

TEST(Dtype, FromNameNullArguments) {
  precis_dtype_t out;
  EXPECT_EQ(precis_dtype_from_name(nullptr, &out), PRECIS_ERR_NULL_POINTER);
  EXPECT_STRNE(precis_last_error(), "");
  EXPECT_EQ(precis_dtype_from_name("fp32", nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_STRNE(precis_last_error(), "");
}

TEST(Dtype, CanonicalNamesRoundTrip) {
  const std::vector<std::pair<precis_dtype_t, const char*>> names = {{PRECIS_DTYPE_FP32, "fp32"},
                                                                     {PRECIS_DTYPE_FP16, "fp16"},
                                                                     {PRECIS_DTYPE_BF16, "bf16"},
                                                                     {PRECIS_DTYPE_FP8_E4M3, "fp8"},
                                                                     {PRECIS_DTYPE_INT16, "int16"}};
  for (const auto& [dtype, expected] : names) {
    const char* name = nullptr;
    ASSERT_EQ(precis_dtype_name(dtype, &name), PRECIS_OK);
    EXPECT_STREQ(name, expected);
    precis_dtype_t back;
    ASSERT_EQ(precis_dtype_from_name(name, &back), PRECIS_OK);
    EXPECT_EQ(back, dtype);
  }
}

TEST(Dtype, Sizes) {
  const std::vector<std::pair<precis_dtype_t, size_t>> sizes = {{PRECIS_DTYPE_FP32, 4},
                                                                {PRECIS_DTYPE_FP16, 2},
                                                                {PRECIS_DTYPE_BF16, 2},
                                                                {PRECIS_DTYPE_FP8_E4M3, 1},
                                                                {PRECIS_DTYPE_INT16, 2}};
  for (const auto& [dtype, expected] : sizes) {
    size_t size = 0;
    ASSERT_EQ(precis_dtype_size(dtype, &size), PRECIS_OK);
    EXPECT_EQ(size, expected) << dtype;
    // The table the kernels read (C and CUDA, host and device).
    EXPECT_EQ(precis_elem_size(dtype), static_cast<int>(expected)) << dtype;
  }
}

TEST(Dtype, InvalidCodes) {
  for (int code : {-1, static_cast<int>(PRECIS_DTYPE_COUNT), 99, -2147483647 - 1}) {
    auto dtype = static_cast<precis_dtype_t>(code);
    const char* name = "untouched";
    EXPECT_EQ(precis_dtype_name(dtype, &name), PRECIS_ERR_INVALID_DTYPE) << code;
    EXPECT_STREQ(name, "untouched");
    EXPECT_NE(std::string(precis_last_error()).find(std::to_string(code)), std::string::npos)
        << precis_last_error();
    size_t size = 12345;
    EXPECT_EQ(precis_dtype_size(dtype, &size), PRECIS_ERR_INVALID_DTYPE) << code;
    EXPECT_EQ(size, 12345u);
    EXPECT_EQ(precis_elem_size(code), 0) << code;
  }
}

TEST(Dtype, NameAndSizeNullOut) {
  EXPECT_EQ(precis_dtype_name(PRECIS_DTYPE_FP32, nullptr), PRECIS_ERR_NULL_POINTER);
  EXPECT_EQ(precis_dtype_size(PRECIS_DTYPE_FP32, nullptr), PRECIS_ERR_NULL_POINTER);
}

}  // namespace
