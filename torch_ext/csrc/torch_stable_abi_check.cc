// Compiled against the installed torch's real headers: fails the build when a
// declaration of torch_stable_abi.h (the glue's plain-C copy of the stable ABI)
// no longer matches torch's. TORCH_TARGET_VERSION 2.10 makes the headers
// declare only what torch 2.10 already had: the glue must run on 2.10 too.
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 10) << 48))
#define USE_CUDA  // declares the CUDA part of the shim too (nothing is linked)
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>

#include <type_traits>

#include "torch_stable_abi.h"

#define PR_CHECK_DECLARATION(name, ret, params)                  \
  static_assert(std::is_same<decltype(::name), pr_##name##_fn>::value, \
                "torch_stable_abi.h declares " #name " unlike the installed torch");
PR_TORCH_CPU_FUNCTIONS(PR_CHECK_DECLARATION)
PR_TORCH_CUDA_FUNCTIONS(PR_CHECK_DECLARATION)

static_assert(TORCH_ABI_VERSION >= PR_TORCH_ABI_2_10, "the installed torch is older than 2.10");
static_assert(std::is_same<AOTITorchError, int32_t>::value, "AOTITorchError changed");
static_assert(std::is_same<StableIValue, uint64_t>::value, "StableIValue changed");
