// A C++ program with libtorch and no Python: loads the glue (libprecis_torch.so)
// with dlopen and calls precis::adam_step_ and precis::accumulate_ through
// c10::Dispatcher, against its own float64 reference.
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "precis/precis.h"

namespace {

std::string GluePath() {
  const char* root = std::getenv("TEST_SRCDIR");
  return std::string(root ? root : ".") + "/precis/libprecis_torch.so";
}

class Dispatcher : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    handle_ = dlopen(GluePath().c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
    auto init = reinterpret_cast<precis_status_t (*)()>(dlsym(handle_, "precis_torch_init"));
    auto message = reinterpret_cast<const char* (*)()>(dlsym(handle_, "precis_torch_init_message"));
    ASSERT_NE(init, nullptr);
    ASSERT_EQ(init(), PRECIS_OK) << message();
  }
  static void* handle_;
};
void* Dispatcher::handle_ = nullptr;

c10::OperatorHandle Op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor Random(int64_t n, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

TEST_F(Dispatcher, NoPythonInTheProcess) {
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "Py_Initialize"), nullptr);
}

TEST_F(Dispatcher, SchemasAreRegistered) {
  for (const char* name : {"precis::adam_step_", "precis::check_finite_", "precis::accumulate_",
                           "precis::cast_", "precis::scale_", "precis::count_nonfinite"}) {
    EXPECT_TRUE(c10::Dispatcher::singleton().findSchema({name, ""}).has_value()) << name;
  }
}

TEST_F(Dispatcher, AccumulateMatchesReference) {
  for (int64_t n : {1, 127, 4097, 1000003}) {
    at::Tensor dst = Random(n, at::kFloat, 1);
    at::Tensor src = Random(n, at::kBFloat16, 2);
    at::Tensor want = dst.to(at::kDouble) + src.to(at::kDouble);  // exact in double
    want = want.to(at::kFloat);                                   // one rounding
    Op("precis::accumulate_").typed<void(at::Tensor&, const at::Tensor&)>().call(dst, src);
    EXPECT_TRUE(at::equal(dst, want)) << "n=" << n;
  }
}

TEST_F(Dispatcher, BadCallRaisesC10ErrorAndWritesNothing) {
  at::Tensor dst = Random(8, at::kFloat, 3);
  at::Tensor before = dst.clone();
  try {
    Op("precis::accumulate_").typed<void(at::Tensor&, const at::Tensor&)>().call(
        dst, Random(7, at::kFloat, 4));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("precis.accumulate_: dst has 8 elements but src has 7"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(at::equal(dst, before));
}

// One AdamW step in float64 from the same inputs (torch's AdamW formula);
// vmax: AMSGrad's running max of v, or null.
void AdamWReference(std::vector<double>& p, const std::vector<double>& g,
                    std::vector<double>& m, std::vector<double>& v, std::vector<double>* vmax,
                    int64_t step, double lr, double b1, double b2, double eps, double wd) {
  double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
  for (size_t i = 0; i < p.size(); i++) {
    p[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    double denom_v = v[i];
    if (vmax) denom_v = (*vmax)[i] = std::max((*vmax)[i], v[i]);
    p[i] -= lr / bc1 * m[i] / (std::sqrt(denom_v / bc2) + eps);
  }
}

std::vector<double> Doubles(const at::Tensor& t) {
  at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// (amsgrad, ieee_sqrt): both square roots are within an ulp of the reference's.
class DispatcherAdam : public Dispatcher,
                       public ::testing::WithParamInterface<std::tuple<bool, bool>> {};

TEST_P(DispatcherAdam, StepMatchesReference) {
  const auto [ams, ieee_sqrt] = GetParam();
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  std::vector<int64_t> sizes = {1, 127, 4097};
  std::vector<at::Tensor> params, grads, ms, vs, vmaxs;
  std::vector<std::vector<double>> rp, rm, rv, rvmax;
  for (size_t i = 0; i < sizes.size(); i++) {
    params.push_back(Random(sizes[i], at::kFloat, 10 + i));
    ms.push_back(at::zeros({sizes[i]}));
    vs.push_back(at::zeros({sizes[i]}));
    if (ams) vmaxs.push_back(at::zeros({sizes[i]}));
    rp.push_back(Doubles(params.back()));
    rm.emplace_back(sizes[i], 0.0);
    rv.emplace_back(sizes[i], 0.0);
    rvmax.emplace_back(sizes[i], 0.0);
  }
  auto op = Op("precis::adam_step_");
  for (int64_t step = 1; step <= 3; step++) {
    grads.clear();
    // Shrinking gradients: v falls below its running max after the first step.
    const double scale = 1.0 / (double)(step * step);
    for (size_t i = 0; i < sizes.size(); i++) {
      grads.push_back(Random(sizes[i], at::kFloat, 100 * step + i).mul_(scale));
    }
    std::vector<at::Tensor> none;
    std::vector<c10::IValue> stack = {
        params, grads, none, ms, vs, none, none, std::vector<int64_t>(sizes.size(), step),
        lr, b1, b2, eps, wd, true, false, 1.0, false, int64_t{0},
        none, none, none, none, ams, vmaxs, none, ieee_sqrt, std::vector<int64_t>{},
        std::vector<int64_t>{}};  // streams, element offsets: the defaults
    op.callBoxed(&stack);
    for (size_t i = 0; i < sizes.size(); i++) {
      AdamWReference(rp[i], Doubles(grads[i]), rm[i], rv[i], ams ? &rvmax[i] : nullptr, step, lr,
                     b1, b2, eps, wd);
    }
  }
  for (size_t i = 0; i < sizes.size(); i++) {
    std::vector<double> got = Doubles(params[i]);
    for (size_t j = 0; j < got.size(); j++) {
      // fp32 arithmetic against float64: a few ulps of the param, or of lr.
      ASSERT_NEAR(got[j], rp[i][j], 1e-6 * std::fabs(rp[i][j]) + 1e-7) << "param " << i << " [" << j << "]";
    }
    if (!ams) continue;
    std::vector<double> got_max = Doubles(vmaxs[i]);
    for (size_t j = 0; j < got_max.size(); j++) {
      ASSERT_NEAR(got_max[j], rvmax[i][j], 1e-5 * rvmax[i][j]) << "max " << i << " [" << j << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AmsgradIeeeSqrt, DispatcherAdam,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

TEST_F(Dispatcher, AdamStepRefusesAliasedBuffers) {
  at::Tensor p = Random(64, at::kFloat, 5), before = p.clone();
  std::vector<at::Tensor> params = {p}, none;
  std::vector<c10::IValue> stack = {
      params, params, none, std::vector<at::Tensor>{at::zeros({64})},
      std::vector<at::Tensor>{at::zeros({64})}, none, none, std::vector<int64_t>{1},
      1e-3, 0.9, 0.999, 1e-8, 0.0, true, false, 1.0, false, int64_t{0}, none, none, none, none,
      false, none, none, false, std::vector<int64_t>{}, std::vector<int64_t>{}};
  EXPECT_THROW(Op("precis::adam_step_").callBoxed(&stack), c10::Error);
  EXPECT_TRUE(at::equal(p, before));
}

// A boxed call that must raise a c10::Error whose message holds each of `words`.
void ExpectRefused(const c10::OperatorHandle& op, std::vector<c10::IValue> stack,
                   std::initializer_list<const char*> words) {
  try {
    op.callBoxed(&stack);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    for (const char* w : words) {
      EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << w << " not in " << e.what();
    }
  }
}

// adam_step_.rule's arguments for one fp32 AdamW call of `params` (m, v in fp32), steps
// and found_inf as given, fingerprints [] (the .rule overload's stack).
std::vector<c10::IValue> RuleStack(const std::vector<at::Tensor>& params,
                                   const std::vector<at::Tensor>& grads,
                                   const std::vector<at::Tensor>& ms,
                                   const std::vector<at::Tensor>& vs, std::vector<int64_t> steps,
                                   double lr, double inv_grad_scale,
                                   const std::vector<at::Tensor>& found_inf) {
  std::vector<at::Tensor> none;
  std::vector<int64_t> ints;
  return {params, grads, none, ms, vs, none, none, steps, lr, 0.9, 0.999, 1e-8, 0.01, true,
          false, inv_grad_scale, true, int64_t{7}, found_inf, none, none, none, false, none,
          none, false, ints, ints, int64_t{0} /* adam */, 0.0, 0.0, false, none,
          std::vector<double>{}, none};
}

// precis::hold_step.rule keeps a call's state by handle (here its only owner once the
// caller's is gone) and precis::held_step_ makes it again with its params (never held),
// grads, step count, lr and flag: the bits of adam_step_.rule's call with the same
// arguments, the count advanced; a bad count refused before anything is written; a
// dropped call refused.
TEST_F(Dispatcher, HeldStepGivesAdamStepsBitsAndCountsItsStep) {
  auto drop = reinterpret_cast<void (*)(int64_t)>(dlsym(handle_, "precis_torch_drop_held"));
  ASSERT_NE(drop, nullptr);
  const std::vector<int64_t> sizes = {1, 127, 4097};
  std::vector<at::Tensor> params, ms, vs, twin_params, twin_ms, twin_vs;
  int64_t held = 0;
  {
    std::vector<at::Tensor> my_ms, my_vs;  // (freed at the scope's end: the hold's only)
    for (size_t i = 0; i < sizes.size(); i++) {
      params.push_back(Random(sizes[i], at::kFloat, 20 + i));
      my_ms.push_back(at::zeros({sizes[i]}));
      my_vs.push_back(at::zeros({sizes[i]}));
      // views of the same memory, for reading it back (no second reference to the tensors
      // the call holds would show a use after free under a sanitizer either way)
      ms.push_back(my_ms.back().view({sizes[i]}));
      vs.push_back(my_vs.back().view({sizes[i]}));
      twin_params.push_back(params.back().clone());
      twin_ms.push_back(my_ms.back().clone());
      twin_vs.push_back(my_vs.back().clone());
    }
    std::vector<at::Tensor> none;
    auto stack = RuleStack(params, none, my_ms, my_vs, {}, 0.0, 1.0, none);
    c10::Dispatcher::singleton().findSchemaOrThrow("precis::hold_step", "rule").callBoxed(&stack);
    ASSERT_EQ(stack.size(), 1u);
    held = stack[0].toInt();
  }
  // (the params are never held: torch.utils.swap_tensors refuses a param C++ holds)
  for (const at::Tensor& p : params) EXPECT_EQ(p.use_count(), 1);
  auto held_step = c10::Dispatcher::singleton().findSchemaOrThrow("precis::held_step_", "");
  auto rule = c10::Dispatcher::singleton().findSchemaOrThrow("precis::adam_step_", "rule");
  at::Tensor count = at::zeros({}, at::kFloat);
  for (int64_t step = 1; step <= 3; step++) {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < sizes.size(); i++) {
      grads.push_back(Random(sizes[i], at::kFloat, 200 * step + i));
    }
    const double lr = 1e-2 / (double)step, inv_grad_scale = 1.0 / 8.0;
    at::Tensor flag = at::zeros({1}), twin_flag = at::zeros({1});
    std::vector<c10::IValue> stack = {held, params, grads, count, lr, inv_grad_scale, flag,
                                      std::vector<at::Tensor>{}};
    held_step.callBoxed(&stack);
    auto twin = RuleStack(twin_params, grads, twin_ms, twin_vs,
                          std::vector<int64_t>(sizes.size(), step), lr, inv_grad_scale,
                          {twin_flag});
    rule.callBoxed(&twin);
    EXPECT_EQ(count.item<float>(), (float)step);
    EXPECT_EQ(flag.item<float>(), 0.0f);
    for (size_t i = 0; i < sizes.size(); i++) {
      EXPECT_TRUE(at::equal(params[i], twin_params[i])) << "step " << step << " param " << i;
      EXPECT_TRUE(at::equal(ms[i], twin_ms[i]) && at::equal(vs[i], twin_vs[i])) << i;
    }
  }
  // a step count of another dtype: refused, nothing written (the params, the count)
  std::vector<at::Tensor> before;
  for (const at::Tensor& p : params) before.push_back(p.clone());
  std::vector<at::Tensor> grads;
  for (int64_t n : sizes) grads.push_back(Random(n, at::kFloat, 999));
  at::Tensor bad_count = at::zeros({}, at::kDouble);
  ExpectRefused(held_step,
                {held, params, grads, bad_count, 1e-2, 1.0, at::zeros({1}),
                 std::vector<at::Tensor>{}},
                {"precis.held_step_: step_count must be one contiguous float32 CPU tensor of 1 "
                 "count, got 1 float64 values"});
  for (size_t i = 0; i < params.size(); i++) EXPECT_TRUE(at::equal(params[i], before[i]));
  EXPECT_EQ(count.item<float>(), 3.0f);
  // two params against a hold of three: refused by adam_step_'s own check (raised through
  // the held call), nothing written, the count as it was
  std::vector<at::Tensor> two(params.begin(), params.begin() + 2);
  std::vector<at::Tensor> two_grads(grads.begin(), grads.begin() + 2);
  ExpectRefused(held_step,
                {held, two, two_grads, count, 1e-2, 1.0, at::zeros({1}),
                 std::vector<at::Tensor>{}},
                {"precis.adam_step_: ", "params has 2"});
  for (size_t i = 0; i < params.size(); i++) EXPECT_TRUE(at::equal(params[i], before[i]));
  EXPECT_EQ(count.item<float>(), 3.0f);
  drop(held);
  drop(held);  // (an id dropped already: ignored)
  ExpectRefused(held_step,
                {held, params, grads, count, 1e-2, 1.0, at::zeros({1}), std::vector<at::Tensor>{}},
                {"precis.held_step_: no held call"});
  EXPECT_EQ(count.item<float>(), 3.0f);
}

}  // namespace
