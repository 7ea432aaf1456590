// precis ops from a C++ program with libtorch and no Python:
//
//   bazel run //examples:dispatcher_example            (or: ./dispatcher_example PATH/libprecis_torch.so)
//
// Loading libprecis_torch.so registers the precis:: ops with torch's
// dispatcher; c10::Dispatcher then finds and calls them like any torch op.
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  const char* glue = argc > 1 ? argv[1] : "./libprecis_torch.so";
  if (!dlopen(glue, RTLD_NOW | RTLD_LOCAL)) {
    std::fprintf(stderr, "cannot load %s: %s\n", glue, dlerror());
    return 1;
  }
  auto& dispatcher = c10::Dispatcher::singleton();

  // dst += src (a bf16 gradient into an fp32 accumulation buffer).
  at::Tensor main_grad = at::zeros({4});
  at::Tensor grad = at::full({4}, 0.5, at::TensorOptions().dtype(at::kBFloat16));
  auto accumulate = dispatcher.findSchemaOrThrow("precis::accumulate_", "")
                        .typed<void(at::Tensor&, const at::Tensor&)>();
  accumulate.call(main_grad, grad);
  accumulate.call(main_grad, grad);
  std::printf("main_grad after two accumulations: %s\n",
              main_grad.to(at::kDouble).sum().item<double>() == 4.0 ? "1 1 1 1" : "wrong");

  // One AdamW step over a list of params (fp32 state, no master copy).
  std::vector<at::Tensor> params = {at::ones({3})}, grads = {at::full({3}, 0.1)};
  std::vector<at::Tensor> exp_avgs = {at::zeros({3})}, exp_avg_sqs = {at::zeros({3})}, none;
  std::vector<c10::IValue> stack = {params, grads, none, exp_avgs, exp_avg_sqs, none, none,
                                    std::vector<int64_t>{1},  // step number after this update
                                    1e-2, 0.9, 0.999, 1e-8, 0.01,  // lr, betas, eps, weight decay
                                    true, false, 1.0, false, int64_t{0},  // adamw, maximize, ...
                                    none, none, none, none,  // found_inf, lr, ... tensors
                                    false, none, none,  // amsgrad off: no running max
                                    false,  // ieee_sqrt off: torch's CPU sqrt
                                    std::vector<int64_t>{},  // streams: param i is stream i
                                    std::vector<int64_t>{}};  // element offsets: 0
  try {
    dispatcher.findSchemaOrThrow("precis::adam_step_", "").callBoxed(&stack);
  } catch (const c10::Error& e) {  // bad arguments: the precis message
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  }
  std::printf("param after one AdamW step: %.6f (1 - lr * (1 + weight decay) = %.6f)\n",
              params[0][0].item<float>(), 1 - 1e-2 * (1 + 1e-2));
  return 0;
}
