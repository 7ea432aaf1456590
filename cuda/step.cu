// step.cu - the fused multi-tensor update on the GPU (Adam/AdamW and the one-state
// rules of precis_rule_t: SGD, Lion, Muon's momentum), the CUDA twin of
// csrc/step_cpu.c. The element math is rules.h's, the stores stores.h's, the scale blocks, the
// stochastic-rounding keys and the check_finite semantics are the CPU kernel's,
// so a GPU step writes the CPU's bits.
//
// Layout of a launch (multi-tensor apply):
//  * one launch covers up to kMaxTensors tensors; their pointers, sizes and
//    per-step constants travel by value in the kernel parameters (AdamArgs,
//    < 16 KiB, read in place through __grid_constant__; CUDA 12.1 and newer take
//    32,764 bytes of parameters, as torch's own multi-tensor kernels use them). No
//    device tables, no copies, nothing to synchronize: a captured CUDA graph keeps
//    the values. A model of up to 128 tensors a layout is one launch.
//  * each tensor is cut into chunks of kChunk elements, one CUDA block per
//    chunk; block b finds its tensor by a binary search in first_block[].
//  * a warp takes groups of kGroup = 256 consecutive elements, i.e. two scale
//    blocks of PRECIS_SCALE_BLOCK: 8 elements per thread, read and written as
//    16-byte vectors when the tensor's buffers are aligned (lane l holds
//    elements 8l..8l+7), element by element otherwise (lane l holds l + 32j,
//    coalesced). The amax of each scale block is a warp-shuffle max (on the vector
//    path a half-warp's: lanes 0-15 hold block 0, lanes 16-31 block 1).
//  * a warp runs its groups in two loops: the hot one over the whole groups of a
//    tensor whose buffers are all aligned, AMSGrad off (vector access, nothing
//    checked per element, no branch but the slow paths of IEEE sqrt and division:
//    tools/sass_budget.py reads its SASS and predicts the kernel's speed from it), and
//    a general one for the rest (AMSGrad, unaligned buffers, a tensor's last group).
//  * check_finite: a first kernel over the gradients of the same tables sets
//    *found_inf; every update kernel reads *found_inf first and returns when it
//    is set.
//  * the rule: Adam runs in the kernel specialized for its dtypes (pick_update) or
//    the generic one; the one-state rules (SGD, Lion, MUON_MOMENTUM) in
//    one_state_kernel, which reads the rule with the dtypes at run time. Both are
//    update_block, whose element loop loads and stores the same buffers for every
//    rule (the param and its master, m with its block scales and stochastic
//    rounding), Adam's v besides, MUON_MOMENTUM its output instead of the param.
//    Per-tensor lr scales (SGD, Lion) travel as the tensors' neg_step_size (host lr), or
//    as lr_scales (device lr: the step lr is made on the device).
#include <math.h>

#ifndef __CUDACC_RTC__
#include <cstring>
#endif

#include "common.cuh"
// After common.cuh, which declares internal.h's helpers with C linkage.
#include "step_args.h"
#include "rules.h"
#include "stores.h"
#include "fingerprint.h"
#include "resync.h"

// A named namespace, not an anonymous one: NVRTC names an anonymous namespace after its
// process, and a kernel's symbol must be the same in every image (tools/build_cuda12.py).
namespace precis {
namespace step_cu {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPer = 8;                     // elements per thread in a group
constexpr int kGroup = 32 * kPer;           // elements per warp group
constexpr int kChunkLog2 = 14;
constexpr int64_t kChunk = int64_t(1) << kChunkLog2;  // elements per CUDA block
constexpr int kMaxTensors = 128;            // tensors per launch (AdamArgs < 16 KiB)
constexpr int kRuntime = -1;                // template argument: read the dtype from AdamArgs

// Compile-time knobs of the Adam kernels, for bench/kernel_variants.py, which builds a
// library for each setting and times them on a GPU; the defaults are what a GPU has run
// (the loop the H200 measured), until a GPU measures the others:
//  * PR_ADAM_STAGED: 1, the hot loop keeps the next group's loads in flight (Staged:
//    cp.async copies into shared memory that the thread has just read, ordered only by
//    the thread's program order, which the emulator cannot check; tools/sass_budget.py
//    predicts it covers the H200's latency); 0, it loads a group, waits and computes it.
//  * PR_ADAM_MIN_BLOCKS: __launch_bounds__'s blocks of kThreads an SM (2: 128 registers
//    a thread; 3: 80; 1: 255).
#ifndef PR_ADAM_STAGED
#define PR_ADAM_STAGED 0
#endif
#ifndef PR_ADAM_MIN_BLOCKS
#define PR_ADAM_MIN_BLOCKS 2
#endif

static_assert(kGroup == 2 * PRECIS_SCALE_BLOCK, "a warp group is two scale blocks");
static_assert(kChunk % (kGroup * kWarps) == 0, "a chunk is whole block iterations");

enum {
  kMasterNone = PR_MASTER_NONE,
  kMasterSeparate = PR_MASTER_SEPARATE,
  kMasterRemainder = PR_MASTER_REMAINDER,
  kMasterRemainder8 = PR_MASTER_REMAINDER8
};

// Everything one launch needs, by value.
struct AdamArgs {
  precis_step_consts_t consts;  // host constants; neg_step_size/bias2_sqrt per tensor below
  precis_step_hyper_t hyper;    // for constants computed on the device
  const void* lr;               // device values (NULL: host ones); a float if hyper.lr_float32
  const float* inv_grad_scale;
  float* found_inf;
  uint64_t seed;
  int32_t count;                // tensors in this launch
  int32_t device_consts;        // 1: build the constants on the device from hyper
  int32_t device_steps;         // 1: step_ptrs, else steps
  int32_t grad_dtype, param_dtype, master_dtype, master_mode, exp_avg_dtype, exp_avg_sq_dtype;
  int32_t amsgrad;              // 1: max_exp_avg_sqs (+ scales) are set
  uint32_t first_block[kMaxTensors + 1];  // tensor k has blocks [first_block[k], first_block[k+1])
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  void* masters[kMaxTensors];
  void* exp_avgs[kMaxTensors];
  void* exp_avg_sqs[kMaxTensors];
  float* exp_avg_scales[kMaxTensors];
  float* exp_avg_sq_scales[kMaxTensors];
  union {
    void* max_exp_avg_sqs[kMaxTensors];      // amsgrad only (Adam) ...
    void* outputs[kMaxTensors];              // ... MUON_MOMENTUM only (which has no amsgrad)
  };
  union {
    float* max_exp_avg_sq_scales[kMaxTensors];  // amsgrad only (Adam) ...
    double lr_scales[kMaxTensors];              // ... SGD's and Lion's (tensor_lr_scales)
  };
  int64_t numels[kMaxTensors];
  union {
    int64_t steps[kMaxTensors];              // host step numbers
    const int64_t* step_ptrs[kMaxTensors];   // device step numbers (device_steps)
  };
  float neg_step_size[kMaxTensors];  // host constants (!device_consts)
  float bias2_sqrt[kMaxTensors];
  uint64_t stream[kMaxTensors];  // SR keys: the tensor's stream (precis_step_tensors_t) ...
  uint32_t index0[kMaxTensors];  // ... and its element offset in its param, low 32 bits
  // precis_moment_key(seed, stream[k]), made by the host: its three 64-bit mixes were a
  // third of the Adam kernels' prologue, made by every thread of every block.
  precis_sr_key_t moment_key[kMaxTensors];
  uint8_t vec[kMaxTensors];     // 1: every buffer (check_kernel: the gradient) aligned for
                                // the vector path
  // The one-state rules (the rule itself: hyper.rule); after the tables, so that the
  // specialized Adam kernels' parameter offsets stay as they were.
  int32_t has_m;         // 0: SGD without momentum, no exp_avgs
  int32_t output_dtype;  // the outputs' of a rule that writes no params (Muon's momentum)
  int32_t writes_param;  // 1: the rule writes the params (rules.h, pr_rules), else outputs
  int32_t tensor_lr_scales;  // 1: SGD's or Lion's step lr per tensor, lr * lr_scales[t]
  // The record (tensors->param_fingerprints; NULL: none): tensor k's fingerprint is
  // fingerprints[fp_index[k]], its entries zeroed before the launch.
  unsigned long long* fingerprints;
  uint16_t fp_index[kMaxTensors];
  // The compare's flags and counts (NULL: none), tensor k's at stale[fp_index[k]] and
  // kept[fp_index[k]]: a flagged tensor's chunk is resynced before it is stepped.
  const uint8_t* stale;
  const unsigned long long* kept;
  // The block record (tensors->param_block_fingerprints; NULL: none): CUDA block blk's
  // chunk is one record block (kChunk == PRECIS_FINGERPRINT_BLOCK), its entry
  // blocks[blk]: a launch's tensors' entries are consecutive (for_each_launch).
  unsigned long long* blocks;
  // The blocks' compare (tensors->param_block_records; NULL: none), from the same base as
  // blocks: CUDA block blk's chunk is compared with block_records[blk] before it is
  // stepped, and its elements, if it matched, added to blocks_kept[fp_index[k]] (NULL:
  // none; zeroed before the launch).
  const unsigned long long* block_records;
  unsigned long long* blocks_kept;
};
static_assert(kChunk == PRECIS_FINGERPRINT_BLOCK, "a CUDA block's chunk is one record block");
// Within CUDA 12.1's kernel parameter limit (32,764 bytes; 4 KiB before).
static_assert(sizeof(AdamArgs) <= 16384, "AdamArgs must fit in 16 KiB of kernel parameters");

// Specialized Adam kernels for every policy the README, the demo and the benches name
// (docs/design.md section 3; tools/sass_budget.py's ADVERTISED list, which
// tests/py/tools/test_sass_budget.py checks against those files), the generic one (dtypes
// read at run time) for every other combination: X(grad, param, master mode, master,
// m, v) for each. The device code instantiates these, the host picks among them.
#define PR_ADAM_SPECIALIZED(X)                                                             \
  /* fp32 model: the param is its own master */                                            \
  X(PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, kMasterNone, PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, \
    PRECIS_DTYPE_FP32)                                                                     \
  /* fp32 model, low-precision moments (bench/policies.py, bench/moment_fidelity.py) */    \
  X(PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, kMasterNone, PRECIS_DTYPE_FP32, PRECIS_DTYPE_BF16, \
    PRECIS_DTYPE_BF16)                                                                     \
  X(PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, kMasterNone, PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, \
    PRECIS_DTYPE_FP16)                                                                     \
  X(PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32, kMasterNone, PRECIS_DTYPE_FP32,                  \
    PRECIS_DTYPE_FP8_E4M3, PRECIS_DTYPE_FP8_E4M3)                                          \
  /* bf16 model, default policy (fp32 master, bf16 moments), bf16 or fp32 grads */         \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16)                                                  \
  X(PRECIS_DTYPE_FP32, PRECIS_DTYPE_BF16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16)                                                  \
  /* bf16 + int16 remainders */                                                            \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterRemainder, PRECIS_DTYPE_INT16,            \
    PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16)                                                  \
  /* fp8 moments, with an fp32 master, int16 remainders or 8-bit remainders */             \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_FP8_E4M3, PRECIS_DTYPE_FP8_E4M3)                                          \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterRemainder, PRECIS_DTYPE_INT16,            \
    PRECIS_DTYPE_FP8_E4M3, PRECIS_DTYPE_FP8_E4M3)                                          \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterRemainder8, PRECIS_DTYPE_FP8_E4M3,        \
    PRECIS_DTYPE_FP8_E4M3, PRECIS_DTYPE_FP8_E4M3)                                          \
  /* fp16 moments (bench/policies.py) */                                                   \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_FP16, PRECIS_DTYPE_FP16)                                                  \
  /* bf16 model with all state in fp32 (Megatron's mixed precision; train_llm.py 9d) */    \
  X(PRECIS_DTYPE_BF16, PRECIS_DTYPE_BF16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32)                                                  \
  /* fp16 model, default policy (fp32 master and moments), fp32 or fp16 grads */           \
  X(PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32)                                                  \
  X(PRECIS_DTYPE_FP16, PRECIS_DTYPE_FP16, kMasterSeparate, PRECIS_DTYPE_FP32,              \
    PRECIS_DTYPE_FP32, PRECIS_DTYPE_FP32)                                                  \
  /* the generic kernel */                                                                 \
  X(kRuntime, kRuntime, kRuntime, kRuntime, kRuntime, kRuntime)

// The gradient dtypes of check_kernel: X(grad dtype) for each.
#define PR_CHECK_DTYPES(X) X(PRECIS_DTYPE_FP32) X(PRECIS_DTYPE_FP16) X(PRECIS_DTYPE_BF16)

#ifdef __CUDACC__

// ---- element access ---------------------------------------------------------

__device__ __forceinline__ bool is_scaled(int dtype) {
  return dtype == PRECIS_DTYPE_FP16 || dtype == PRECIS_DTYPE_FP8_E4M3;
}

// The raw bits of the 8 elements of a thread, packed as in memory.
struct Raw {
  uint32_t w[kPer];
};

__device__ __forceinline__ void raw_clear(Raw& r) {
#pragma unroll
  for (int i = 0; i < kPer; ++i) r.w[i] = 0u;
}

__device__ __forceinline__ uint32_t raw_get(const Raw& r, int width, int j) {
  if (width == 4) return r.w[j];
  if (width == 2) return (r.w[j >> 1] >> ((j & 1) * 16)) & 0xFFFFu;
  return (r.w[j >> 2] >> ((j & 3) * 8)) & 0xFFu;
}

// r must have been cleared.
__device__ __forceinline__ void raw_set(Raw& r, int width, int j, uint32_t x) {
  if (width == 4) {
    r.w[j] = x;
  } else if (width == 2) {
    r.w[j >> 1] |= (x & 0xFFFFu) << ((j & 1) * 16);
  } else {
    r.w[j >> 2] |= (x & 0xFFu) << ((j & 3) * 8);
  }
}

// Which elements a warp group covers and which lane holds which.
struct Group {
  int64_t base;   // first element, tensor-relative, a multiple of kGroup
  int64_t numel;  // of the tensor
  int lane;
  bool vec;       // lane holds base + 8*lane + j (vector path), else base + lane + 32*j

  __device__ __forceinline__ int64_t elem(int j) const {
    return vec ? base + lane * kPer + j : base + lane + 32 * j;
  }
  __device__ __forceinline__ bool valid(int j) const { return vec || elem(j) < numel; }
  // 0 or 1: the scale block of the group element j falls in.
  __device__ __forceinline__ int block(int j) const { return vec ? (lane >> 4) : (j >> 2); }
  // Whether the group reaches into its second scale block (always, when whole).
  __device__ __forceinline__ bool second_block() const {
    return vec || base + PRECIS_SCALE_BLOCK < numel;
  }
};

template <bool READ_ONLY>
__device__ __forceinline__ uint4 load16(const void* p) {
  return READ_ONLY ? __ldg(static_cast<const uint4*>(p)) : *static_cast<const uint4*>(p);
}

template <bool READ_ONLY>
__device__ __forceinline__ uint2 load8(const void* p) {
  return READ_ONLY ? __ldg(static_cast<const uint2*>(p)) : *static_cast<const uint2*>(p);
}

template <bool READ_ONLY>
__device__ __forceinline__ uint32_t load_one(const void* base, int width, int64_t e) {
  if (width == 4) {
    const uint32_t* p = static_cast<const uint32_t*>(base) + e;
    return READ_ONLY ? __ldg(p) : *p;
  }
  if (width == 2) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + e;
    return READ_ONLY ? __ldg(p) : *p;
  }
  const uint8_t* p = static_cast<const uint8_t*>(base) + e;
  return READ_ONLY ? __ldg(p) : *p;
}

__device__ __forceinline__ void store_one(void* base, int width, int64_t e, uint32_t x) {
  if (width == 4) {
    static_cast<uint32_t*>(base)[e] = x;
  } else if (width == 2) {
    static_cast<uint16_t*>(base)[e] = (uint16_t)x;
  } else {
    static_cast<uint8_t*>(base)[e] = (uint8_t)x;
  }
}

// The raw bits of the group's elements of a buffer (0 for elements past numel).
template <bool READ_ONLY>
__device__ __forceinline__ void load_group(Raw& r, const void* base, int width, const Group& g) {
  raw_clear(r);
  if (g.vec) {
    const char* p = static_cast<const char*>(base) + (g.base + g.lane * kPer) * width;
    if (width == 4) {
      uint4 a = load16<READ_ONLY>(p), b = load16<READ_ONLY>(p + 16);
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
      r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    } else if (width == 2) {
      uint4 a = load16<READ_ONLY>(p);
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    } else {
      uint2 a = load8<READ_ONLY>(p);
      r.w[0] = a.x; r.w[1] = a.y;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (g.valid(j)) raw_set(r, width, j, load_one<READ_ONLY>(base, width, g.elem(j)));
  }
}

__device__ __forceinline__ void store_group(void* base, int width, const Raw& r, const Group& g) {
  if (g.vec) {
    char* p = static_cast<char*>(base) + (g.base + g.lane * kPer) * width;
    if (width == 4) {
      *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
      *reinterpret_cast<uint4*>(p + 16) = make_uint4(r.w[4], r.w[5], r.w[6], r.w[7]);
    } else if (width == 2) {
      *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    } else {
      *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (g.valid(j)) store_one(base, width, g.elem(j), raw_get(r, width, j));
  }
}

// The fingerprint terms (fingerprint.h's pr_fp_bytes) of the group's param elements,
// their bits r as stored (width bytes each). Vector path: the lane's 8 elements are
// `width` whole words, each a multiply (no branch: the hot loop's); else element by
// element, a last partial word as the zero-padded tail.
__device__ __forceinline__ uint64_t fp_terms(const Raw& r, int width, const Group& g) {
  uint64_t sum = 0;
  if (g.vec) {
    const int64_t word0 = (g.base + g.lane * kPer) * width / 8;
#pragma unroll
    for (int k = 0; k < kPer / 2; ++k) {
      if (k < width) {
        const uint64_t word = (uint64_t)r.w[2 * k + 1] << 32 | r.w[2 * k];
        sum += word * pr_fp_weight(word0 + k);
      }
    }
    return sum;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (g.valid(j)) sum += pr_fp_bytes(raw_get(r, width, j), g.elem(j) * width);
  }
  return sum;
}

// Stored bits -> fp32, as the CPU's tile loads do (fp32, fp16, bf16, fp8); a
// moment before its block scale, where fp8 m is m8 and fp8 v is v8. That is
// precis_moment_code_f32, with common.cuh's exact device forms of fp16, m8 and v8.
__device__ __forceinline__ float to_f32(int dtype, uint32_t bits, bool second = false) {
  if (dtype == PRECIS_DTYPE_FP16) return f16_to_f32(bits);
  if (dtype == PRECIS_DTYPE_FP8_E4M3) return second ? v8_to_f32(bits) : m8_to_f32(bits);
  return precis_moment_code_f32(dtype, second ? 1 : 0, bits);
}

// fp32 -> stored bits rounded to nearest even (fp32, fp16, bf16).
__device__ __forceinline__ uint32_t from_f32_rn(int dtype, float x) {
  if (dtype == PRECIS_DTYPE_FP32) return precis_f32_bits(x);
  if (dtype == PRECIS_DTYPE_FP16) return precis_f32_to_f16_rn(x);
  return precis_f32_to_bf16_rn(x);
}

// Max of two per-block values over the warp.
__device__ __forceinline__ void warp_max2(uint32_t& a, uint32_t& b) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
    b = max(b, __shfl_xor_sync(0xFFFFFFFFu, b, off));
  }
}

// Max over the lane's half-warp (lanes 0-15 or 16-31): the xor offsets stay below 16.
__device__ __forceinline__ uint32_t half_warp_max(uint32_t a) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
  return a;
}

// precis_block_multiplier and precis_block_scale (stores.h), the same bits,
// written as a division always taken and a select: written as the CPU's ternary,
// the compiler branches around the division, and the hot loop would decide per
// block at run time what a select does without a branch (tools/sass_budget.py
// rejects such a decision). Dividing by a zero amax gives inf, which the select drops.
__device__ __forceinline__ float block_multiplier(float amax, int fp8, int sec) {
  const float q = precis_moment_max(fp8, sec) / amax;
  return !(amax < PRECIS_MOMENT_AMAX_MIN) ? q : 0.0f;
}

__device__ __forceinline__ float block_scale(float amax, int fp8, int sec) {
  const float q = amax / precis_moment_max(fp8, sec);
  return !(amax < PRECIS_MOMENT_AMAX_MIN) ? q : 0.0f;
}

// ---- the update ----------------------------------------------------------------

// The square roots and param steps of a thread's eight elements (precis_adam_moments
// done, torch_form 0: the fp8 moments' hot loop), one guard for all: nvcc's own sqrt.rn
// and div.rn are each a fast path under a check and a branch of their own (a guard of
// five instructions an element besides, the division's FCHK and branch four). Here the
// fast paths are those sequences written in PTX, taken for all eight when every input
// lies where they give the IEEE result, else sqrtf and the division called for each
// (zeros, tiny or huge values, inf, NaN: the same bits, slower):
//  * sqrt (PR_SQRT_RN_FAST): MUFU.RSQ, two FMULs, two FMAs, nvcc's for inputs of bits
//    0x0D000000-0x7F7FFFFF ([2^-101, FLT_MAX]); here v <= 2^80 besides, so sqrt(v) <= 2^40.
//  * a / d (PR_DIV_RN_FAST), a = neg_step_size * m, d = sqrt(v) * inv_bias2_sqrt + eps:
//    nvcc's MUFU.RCP, a Newton step of the reciprocal, the quotient and its correction by
//    the exact residual, the residual negated so that a zero a keeps its sign (nvcc's
//    FCHK sends zeros to its slow path). The guard keeps every operand and intermediate
//    normal, far from overflow: d in [2^-60, 2^61) (eps in [2^-60, 2^40], inv_bias2_sqrt
//    <= 2^20, sqrt(v) <= 2^40), a zero or |a| in [2^-64, 2^60] (|neg_step_size| in
//    [2^-40, 2^10], |m| <= 2^50), so a / d in [2^-125, 2^120]; there the sequence
//    commutes with scaling by powers of two, and gives what nvcc's fast path gives for the
//    operands scaled into [1, 2): the correctly rounded quotient. On a GPU,
//    tools/adam_fast_paths_check.cu checks both against sqrt.rn and div.rn.
__device__ __noinline__ float sqrt_called(float x) { return sqrtf(x); }

// The tensor's part of adam_tail_group's guard (its constants, once a block): eps in
// [2^-60, 2^40], inv_bias2_sqrt <= 2^20, |neg_step_size| in [2^-40, 2^10]; and the least
// |m| whose step |a| is at least 2^-64, 2^(-64 - e) for 2^e <= |neg_step_size| < 2^(e + 1),
// as the key (bits << 1) - 2 (a zero m: the largest key).
__device__ __forceinline__ bool tail_constants(const precis_step_consts_t& c, uint32_t& key) {
  const uint32_t eps = precis_f32_bits(c.eps), ibs = precis_f32_bits(c.inv_bias2_sqrt);
  const uint32_t neg = precis_f32_bits(c.neg_step_size) & 0x7FFFFFFFu;
  const bool ok = eps >= 0x21800000u && eps <= 0x53800000u && ibs <= 0x49800000u &&
                  neg >= 0x2B800000u && neg <= 0x44800000u;
  key = ok ? (((190u - (neg >> 23)) << 23) << 1) - 2u : 0xFFFFFFFFu;
  return ok;
}

__device__ __forceinline__ void adam_tail_group(const precis_step_consts_t& c, bool tail_ok,
                                                uint32_t tail_key, float (&p)[kPer],
                                                const float (&m)[kPer], const float (&v)[kPer],
                                                float (&root)[kPer]) {
#if defined(__CUDA_ARCH__) && !defined(PRECIS_CUDA_EMULATED)
  uint32_t lo = 0xFFFFFFFFu, hi = 0u, mmax = 0u, key = 0xFFFFFFFFu;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    lo = min(lo, precis_f32_bits(v[j]));
    hi = max(hi, precis_f32_bits(v[j]));
    mmax = max(mmax, precis_f32_bits(m[j]) & 0x7FFFFFFFu);
    key = min(key, (precis_f32_bits(m[j]) << 1) - 2u);  // |m|'s order; a zero: the largest
  }
  // (|a| <= 2^60 where |m| <= 2^50; |a| >= 2^-64 where m's key >= tail_key)
  if (tail_ok && lo >= 0x0D000000u && hi <= 0x67800000u && mmax <= 0x58800000u &&
      key >= tail_key) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {  // (common.cuh's fast paths)
      PR_SQRT_RN_FAST(root[j], v[j]);
      float q;
      PR_DIV_RN_FAST(q, __fmul_rn(c.neg_step_size, m[j]),
                     __fmaf_rn(root[j], c.inv_bias2_sqrt, c.eps));
      p[j] = p[j] + q;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      root[j] = sqrt_called(v[j]);
      p[j] = precis_adam_param(&c, 0, p[j], m[j], root[j]);
    }
  }
#else
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    root[j] = sqrtf(v[j]);
    p[j] = precis_adam_param(&c, 0, p[j], m[j], root[j]);
  }
#endif
}

// The dtypes of a launch and its rule: compile-time constants where a kernel fixes
// them (the specialized kernels' dtypes; adam in every kernel, rule in Adam's).
struct Dtypes {
  int g, p, master, mode, m, v;
  bool ams;    // AMSGrad: a running max of v, in v's dtype
  bool adam;   // Adam (m and v), else a one-state rule (m only)
  int rule;    // precis_rule_t
  bool has_m;  // m is read and written (all but SGD without momentum)
  int out;     // the outputs' dtype (a rule that writes no params: Muon's momentum)
  bool writes_param;  // the param (and its master) is read and written, else the outputs
  // A specialized kernel's (dtypes fixed at compile time): the hot loop's fp8 forms
  // (adam_tail_group, store_fp8_moments, the 8-bit remainders' words) are compiled into
  // these only (in the generic kernel they made ptxas spill more).
  bool fast;
  // adam_tail_group's guard of the tensor's constants, and the least |m| its fast path
  // takes, as a key (tail_constants)
  bool tail_ok;
  uint32_t tail_key;

  __device__ __forceinline__ bool param() const { return writes_param; }
};

// One tensor's buffers.
struct Buffers {
  void* p;
  const void* g;
  void* master;
  void* m;
  void* v;
  float* ms;
  float* vs;
  void* vmax;  // AMSGrad's running max and its scales
  float* vmaxs;
  void* out;   // MUON_MOMENTUM's output
};

// The stochastic rounding of a store (pr_sr_t): the tensor's key, the step, and the
// low 32 bits of the index of the tensor's first element in its whole param.
struct StoreSr {
  precis_sr_key_t key;
  int64_t step;
  uint32_t index0;
  __device__ __forceinline__ uint32_t index(const Group& g, int j) const {
    return index0 + (uint32_t)g.elem(j);
  }
};

// The random bits of a group's moment stores (pr_sr_t): the step and each
// element's precis_moment_hash, hashed once for both moments.
struct MomentSr {
  int64_t step;
  uint32_t hash[kPer];
  __device__ __forceinline__ MomentSr(const StoreSr& sr, const Group& g) : step(sr.step) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) hash[j] = precis_moment_hash(sr.key, sr.index(g, j));
  }
  __device__ __forceinline__ uint32_t rand(int j, int second) const {
    return precis_moment_rand(hash[j], second, step);
  }
};

// Store a moment of the group: m (second = false; root unused) or v (root =
// sqrt(v)). fp16/fp8: a new scale per block from its amax, as pr_store_moment.
// Rounds stochastically where precis_moment_store_sr says so and sr is given
// (keyed as the CPU's stores), else to nearest.
// decoded (may be null) gets the values as stored, as a later load decodes them.
// All lanes of the warp must call it (shuffles).
__device__ __forceinline__ void store_moment(void* base, float* scales, int dtype, bool second,
                                             int rule, const float (&x)[kPer],
                                             const float (&root)[kPer], const Group& g,
                                             const MomentSr* sr,
                                             float (*decoded)[kPer] = nullptr) {
  const int width = precis_elem_size(dtype);
  if (!precis_moment_store_sr(dtype, second ? 1 : 0, rule)) sr = nullptr;
  Raw r;
  raw_clear(r);
  if (!is_scaled(dtype)) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const uint32_t bits =
          sr != nullptr  // bf16 v, a one-state rule's bf16 momentum
              ? precis_f32_to_bf16_sr(x[j], sr->rand(j, second ? 1 : 0) >> 16)
              : from_f32_rn(dtype, x[j]);
      raw_set(r, width, j, bits);
      if (decoded) (*decoded)[j] = to_f32(dtype, bits, second);
    }
  } else {
    const int fp8 = dtype == PRECIS_DTYPE_FP8_E4M3;
    const int sec = second ? 1 : 0;
    // max |value| of each block, as the CPU's pr_amax: an integer max of the bits
    // with the sign cleared (the float order; a NaN wins). Invalid elements: 0.
    // Vector path: lane l's elements are all in block l >> 4, so each half-warp
    // reduces its own block and a lane needs one multiplier; element-wise path: a
    // lane's elements are in both blocks.
    uint32_t a0 = 0u, a1 = 0u;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      uint32_t u = g.valid(j) ? (precis_f32_bits(second ? root[j] : x[j]) & 0x7FFFFFFFu) : 0u;
      if (g.vec || !g.block(j)) {
        a0 = max(a0, u);
      } else {
        a1 = max(a1, u);
      }
    }
    float amax0, amax1;
    if (g.vec) {
      amax0 = amax1 = precis_bits_f32(half_warp_max(a0));  // this lane's block
    } else {
      warp_max2(a0, a1);
      amax0 = precis_bits_f32(a0);
      amax1 = precis_bits_f32(a1);
    }
    const float mul0 = block_multiplier(amax0, fp8, sec);
    const float mul1 = g.vec ? mul0 : block_multiplier(amax1, fp8, sec);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float y = second ? root[j] : x[j];
      const float mul = g.block(j) ? mul1 : mul0;
      uint32_t q;
      if (sr != nullptr) {
        const uint32_t rnd = sr->rand(j, sec);
        q = fp8 ? (uint32_t)moment_sr_fp8(y, mul, sec, rnd)  // common.cuh: exact device forms
                : (uint32_t)moment_sr_f16(y, mul, sec, rnd);
      } else {
        q = fp8 ? (uint32_t)precis_moment_q_fp8(y, mul, sec)
                : (uint32_t)precis_moment_q_f16(y, mul, sec);
      }
      raw_set(r, width, j, q);
      if (decoded) {
        const float s = block_scale(g.block(j) ? amax1 : amax0, fp8, sec);
        (*decoded)[j] = precis_moment_dq(to_f32(dtype, q, second), s, sec);
      }
    }
    const int64_t s = g.base / PRECIS_SCALE_BLOCK;
    if (g.vec) {
      // Every lane of a half-warp stores its block's scale, the same value to the same
      // address (one store instruction, its two sectors): with a store by one lane only,
      // the compiler branches around the scale's division.
      scales[s + (g.lane >> 4)] = block_scale(amax0, fp8, sec);
    } else {
      if (g.lane == 0) scales[s] = block_scale(amax0, fp8, sec);
      if (g.lane == 1 && g.second_block()) scales[s + 1] = block_scale(amax1, fp8, sec);
    }
  }
  store_group(base, width, r, g);
}

// store_moment of both fp8 moments of a whole group (the hot loop's: Adam, vector path,
// no AMSGrad): the same codes and scales, in fewer instructions. Both blocks' amaxes are
// reduced first (m's in lanes 0-7 of each half-warp, v's in lanes 8-15), then each lane
// takes one of the four divisions its half-warp needs (its m's or v's multiplier, even
// lanes, or scale, odd lanes: the same IEEE divisions and selects as block_multiplier
// and block_scale) and reads the multipliers from the lanes that made them; the scales
// are stored by the lanes that made them.
// The codes: common.cuh's m8_sr_top and v8_sr_top, packed four to a word. All lanes of
// the warp must call it (shuffles).
__device__ __forceinline__ void store_fp8_moments(const Buffers& b, const float (&m)[kPer],
                                                  const float (&root)[kPer], const Group& g,
                                                  const MomentSr& sr) {
  uint32_t am = 0u, av = 0u;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    am = max(am, precis_f32_bits(m[j]) & 0x7FFFFFFFu);
    av = max(av, precis_f32_bits(root[j]) & 0x7FFFFFFFu);
  }
  // The half-warp's maxes, both at once: lanes 0-7 of the half reduce m's, lanes 8-15
  // v's (a first exchange hands each lane's other value to its partner 8 lanes away).
  const bool of_m = (g.lane & 8) == 0, scale = (g.lane & 1) != 0;
  uint32_t a = max(of_m ? am : av,
                   __shfl_xor_sync(0xFFFFFFFFu, of_m ? av : am, 8));
#pragma unroll
  for (int off = 4; off > 0; off >>= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
  const float amax = precis_bits_f32(a);
  const float cmax = of_m ? PRECIS_M8_MAX : PRECIS_V8_MAX;
  const float q = (scale ? amax : cmax) / (scale ? cmax : amax);
  const float value = !(amax < PRECIS_MOMENT_AMAX_MIN) ? q : 0.0f;
  const float mul_m = __shfl_sync(0xFFFFFFFFu, value, g.lane & 16);
  const float mul_v = __shfl_sync(0xFFFFFFFFu, value, (g.lane & 16) | 8);
  float* const at = (of_m ? b.ms : b.vs) + g.base / PRECIS_SCALE_BLOCK + (g.lane >> 4);
#if defined(__CUDA_ARCH__) && !defined(PRECIS_CUDA_EMULATED)
  // a predicated store (a branch around it would be a decision in the hot loop)
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %2, 0; @p st.global.f32 [%0], %1; }" ::"l"(at),
               "f"(value), "r"((int)scale)
               : "memory");
#else
  if (scale) *at = value;
#endif
  uint32_t tm[kPer], tv[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    tm[j] = m8_sr_top(m[j], mul_m, sr.rand(j, 0));
    tv[j] = v8_sr_top(root[j], mul_v, sr.rand(j, 1));
  }
  Raw rm, rv;
#pragma unroll
  for (int k = 0; k < kPer / 4; ++k) {
    rm.w[k] = pack_top_bytes(tm[4 * k], tm[4 * k + 1], tm[4 * k + 2], tm[4 * k + 3]);
    rv.w[k] = pack_top_bytes(tv[4 * k], tv[4 * k + 1], tv[4 * k + 2], tv[4 * k + 3]);
  }
  store_group(b.m, 1, rm, g);
  store_group(b.v, 1, rv, g);
}

// The scales of the group's two blocks (s0, s1); on the vector path a lane's
// elements are all in block lane >> 4, whose scale it loads alone, into both.
__device__ __forceinline__ void load_scales(const float* scales, int64_t sblk, bool second,
                                            const Group& g, float& s0, float& s1) {
  if (g.vec) {
    s0 = s1 = scales[sblk + (g.lane >> 4)];
  } else {
    s0 = scales[sblk];
    if (second) s1 = scales[sblk + 1];
  }
}

// A group's bits as loaded: update_group's loads, apart from its arithmetic, so that the
// hot loop can have the next group's in flight while it computes this one (Staged).
struct Loaded {
  Raw g, p, x, m, v, vmax;
  float ms0, ms1, vs0, vs1;  // the block scales of m and v (scaled dtypes)
};

// The master's or remainder's bytes per element (1: the 8-bit remainder, the fp8 code's).
__device__ __forceinline__ int master_width(const Dtypes& d) {
  return d.mode == kMasterRemainder ? 2 : precis_elem_size(d.master);
}

// Load the group's elements of one tensor, every load before any conversion (the loads
// are then in flight together). What a rule does not read is cleared (specialized
// kernels: Adam, all read).
__device__ __forceinline__ void load_all(Loaded& in, const Buffers& b, const Dtypes& d,
                                         const Group& g) {
  const int wg = precis_elem_size(d.g), wp = precis_elem_size(d.p);
  const int wm = precis_elem_size(d.m), wv = precis_elem_size(d.v);
  const int wx = master_width(d);
  load_group<true>(in.g, b.g, wg, g);
  if (d.param() && d.mode != kMasterSeparate) {
    load_group<false>(in.p, b.p, wp, g);  // the param (own master) or the bf16 high half
  } else {
    raw_clear(in.p);
  }
  if (d.param() && d.mode != kMasterNone) {
    load_group<false>(in.x, b.master, wx, g);
  } else {
    raw_clear(in.x);
  }
  if (d.has_m) {
    load_group<false>(in.m, b.m, wm, g);
  } else {
    raw_clear(in.m);
  }
  if (d.adam) {
    load_group<false>(in.v, b.v, wv, g);
  } else {
    raw_clear(in.v);
  }
  if (d.ams) load_group<false>(in.vmax, b.vmax, wv, g);
  const int64_t sblk = g.base / PRECIS_SCALE_BLOCK;
  const bool has_second_block = g.second_block();
  in.ms0 = in.ms1 = in.vs0 = in.vs1 = 0.0f;
  if (d.has_m && is_scaled(d.m)) load_scales(b.ms, sblk, has_second_block, g, in.ms0, in.ms1);
  if (d.adam && is_scaled(d.v)) load_scales(b.vs, sblk, has_second_block, g, in.vs0, in.vs1);
}

// Update the group's elements of one tensor from their loaded bits: update in fp32
// registers, store everything once.
// Adds the fingerprint terms of the params it stores to *fp.
__device__ __forceinline__ void update_loaded(const Loaded& in, const Buffers& b,
                                              const Dtypes& d, const precis_step_consts_t& c,
                                              const StoreSr& p_sr, const StoreSr& moment_sr,
                                              const Group& g, volatile unsigned long long* fp) {
  const int wg = precis_elem_size(d.g), wp = precis_elem_size(d.p);
  const int wm = precis_elem_size(d.m), wv = precis_elem_size(d.v);
  const int wx = master_width(d);
  const Raw &rg = in.g, &rp = in.p, &rx = in.x, &rm = in.m, &rv = in.v, &rvmax = in.vmax;
  const float ms0 = in.ms0, ms1 = in.ms1, vs0 = in.vs0, vs1 = in.vs1;
  const int64_t sblk = g.base / PRECIS_SCALE_BLOCK;
  const bool has_second_block = g.second_block();

  const int torch_form = precis_adam_torch_form(d.m, d.v);
  // fp8 moments' hot loop: a thread's eight square roots and steps under one guard
  // (adam_tail_group)
  const bool batch_roots = d.fast && d.adam && !d.ams && g.vec &&
                           d.m == PRECIS_DTYPE_FP8_E4M3 && d.v == PRECIS_DTYPE_FP8_E4M3;
  float p[kPer], m[kPer], v[kPer], root[kPer], out[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const float gf = to_f32(d.g, raw_get(rg, wg, j));
    float pf = 0.0f;
    if (!d.param()) {
      // Muon's momentum: no param
    } else if (d.mode == kMasterNone) {
      pf = to_f32(d.p, raw_get(rp, wp, j));
    } else if (d.mode == kMasterSeparate) {
      pf = to_f32(d.master, raw_get(rx, wx, j));
    } else if (d.mode == kMasterRemainder) {
      pf = precis_remainder_master((uint16_t)raw_get(rp, 2, j),
                                   (int16_t)(uint16_t)raw_get(rx, 2, j));
    } else {
      pf = d.fast ? remainder8_master_word(rp.w[j >> 1], j & 1, rx.w[j >> 2], j & 3)
                  : precis_remainder8_master((uint16_t)raw_get(rp, 2, j),
                                             (int8_t)(uint8_t)raw_get(rx, 1, j));
    }
    float mf = 0.0f;
    if (d.has_m) {
      mf = d.fast && d.m == PRECIS_DTYPE_FP8_E4M3 ? m8_byte_to_f32(rm.w[j >> 2], j & 3)
                                                  : to_f32(d.m, raw_get(rm, wm, j));
      if (is_scaled(d.m)) mf = precis_moment_dq(mf, g.block(j) ? ms1 : ms0, 0);
    }
    if (d.adam) {
      float vf = to_f32(d.v, raw_get(rv, wv, j), true);
      if (is_scaled(d.v)) vf = precis_moment_dq(vf, g.block(j) ? vs1 : vs0, 1);
      // precis_adam_moments and _param, the square root kept for the moment store.
      precis_adam_moments(&c, gf, &pf, &mf, &vf);
      v[j] = vf;
      if (batch_roots) {
        p[j] = pf;  // the step: below, after the square roots
      } else {
        const float r = sqrtf(vf);
        p[j] = d.ams ? pf : precis_adam_param(&c, torch_form, pf, mf, r);  // AMSGrad: below
        root[j] = r;
      }
    } else {
      out[j] = precis_rule_update(&c, d.rule, d.has_m ? 1 : 0, gf, &pf, &mf);
      p[j] = pf;
    }
    m[j] = mf;
  }
  if (batch_roots) adam_tail_group(c, d.tail_ok, d.tail_key, p, m, v, root);  // (torch_form 0)
  if (d.ams) {
    // AMSGrad, as pr_amsgrad_tile: store v, take the max of the stored values.
    float stored_v[kPer];
    const MomentSr vsr(moment_sr, g);
    store_moment(b.v, b.vs, d.v, true, PRECIS_RULE_ADAM, v, root, g, &vsr, &stored_v);
    float xs0 = 0.0f, xs1 = 0.0f;
    if (is_scaled(d.v)) load_scales(b.vmaxs, sblk, has_second_block, g, xs0, xs1);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      float xf = to_f32(d.v, raw_get(rvmax, wv, j), true);
      if (is_scaled(d.v)) xf = precis_moment_dq(xf, g.block(j) ? xs1 : xs0, 1);
      v[j] = precis_adam_max(xf, stored_v[j]);
      root[j] = sqrtf(v[j]);
      p[j] = precis_adam_param(&c, torch_form, p[j], m[j], root[j]);
    }
    store_moment(b.vmax, b.vmaxs, d.v, true, PRECIS_RULE_ADAM, v, root, g, nullptr);
  }

  // The master and the param derived from it (pr_store_master).
  if (!d.param()) {
    // Muon's momentum writes its output instead (below)
  } else if (d.mode == kMasterSeparate) {
    Raw out_x, out_p;
    raw_clear(out_x);
    raw_clear(out_p);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      // The param is the rounding of the master as stored.
      const float x = d.master == PRECIS_DTYPE_FP16 ? precis_f16_to_f32(precis_f32_to_f16_rn(p[j]))
                                                    : p[j];
      raw_set(out_x, wx, j, from_f32_rn(d.master, x));
      raw_set(out_p, wp, j, from_f32_rn(d.p, x));
    }
    store_group(b.master, wx, out_x, g);
    store_group(b.p, wp, out_p, g);
    *fp += fp_terms(out_p, wp, g);
  } else if (d.fast && d.mode == kMasterRemainder8 && g.vec) {
    // The 24-bit masters' words: the params their bytes 2-3 rounded (+0x8000), the
    // remainders their bytes 1, packed by PRMTs.
    Raw out_x, out_p;
    uint32_t w[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) w[j] = master24_word(p[j]);
#pragma unroll
    for (int k = 0; k < kPer / 2; ++k) {
      out_p.w[k] = prmt(w[2 * k] + 0x8000u, w[2 * k + 1] + 0x8000u, 0x7632u);
    }
#pragma unroll
    for (int k = 0; k < kPer / 4; ++k) {
      out_x.w[k] = pack_byte1(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    }
    store_group(b.p, 2, out_p, g);
    store_group(b.master, 1, out_x, g);
    *fp += fp_terms(out_p, 2, g);
  } else if (d.mode == kMasterRemainder || d.mode == kMasterRemainder8) {
    Raw out_x, out_p;
    raw_clear(out_x);
    raw_clear(out_p);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (d.mode == kMasterRemainder) {
        raw_set(out_p, 2, j, precis_remainder_param(p[j]));
        raw_set(out_x, 2, j, (uint16_t)precis_remainder_low(p[j]));
      } else {
        raw_set(out_p, 2, j, precis_remainder8_param(p[j]));
        raw_set(out_x, 1, j, (uint8_t)precis_remainder8_low(p[j]));
      }
    }
    store_group(b.p, 2, out_p, g);
    store_group(b.master, wx, out_x, g);
    *fp += fp_terms(out_p, 2, g);
  } else {
    Raw out_p;
    raw_clear(out_p);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      uint32_t bits;
      if (d.p == PRECIS_DTYPE_BF16) {
        // No master: stochastic rounding, keyed like the CPU's.
        bits = precis_f32_to_bf16_sr(p[j], precis_sr_rand16(p_sr.key, p_sr.index(g, j)));
      } else {
        bits = from_f32_rn(d.p, p[j]);
      }
      raw_set(out_p, wp, j, bits);
    }
    store_group(b.p, wp, out_p, g);
    *fp += fp_terms(out_p, wp, g);
  }

  // Hashed once for both moments' stores (AMSGrad: again, v's above), here, after
  // the param's: the hashes are then live only while the moments are stored (fewer
  // registers: the fp8 kernels would spill). Unused where the dtypes store nothing
  // stochastically.
  const MomentSr msr(moment_sr, g);
  if (batch_roots) {  // (the same dtypes and path)
    store_fp8_moments(b, m, root, g, msr);
  } else {
    if (d.has_m) store_moment(b.m, b.ms, d.m, false, d.rule, m, m, g, &msr);
    if (d.adam && !d.ams) store_moment(b.v, b.vs, d.v, true, d.rule, v, root, g, &msr);
  }
  if (!d.param()) {  // the rule's outputs
    Raw out_o;
    raw_clear(out_o);
    const int wo = precis_elem_size(d.out);
#pragma unroll
    for (int j = 0; j < kPer; ++j) raw_set(out_o, wo, j, from_f32_rn(d.out, out[j]));
    store_group(b.out, wo, out_o, g);
  }
}

// Load and update the group's elements of one tensor.
__device__ __forceinline__ void update_group(const Buffers& b, const Dtypes& d,
                                             const precis_step_consts_t& c, const StoreSr& p_sr,
                                             const StoreSr& moment_sr, const Group& g,
                                             volatile unsigned long long* fp) {
  Loaded in;
  load_all(in, b, d, g);
  update_loaded(in, b, d, c, p_sr, moment_sr, g, fp);
}

// ---- the next group in flight ----------------------------------------------------
// The hot loop of a specialized Adam kernel copies the next group's bytes into shared
// memory with asynchronous copies (cp.async, sm_80 and newer) before it computes this
// one: the memory is then busy while the warp computes, where a warp that loads, waits
// and computes leaves it idle (bench/RESULTS.md, "The SASS budget against the H200";
// tools/sass_budget.py counts the bytes in flight). No registers hold the copies. A
// lane copies and reads only its own bytes, so no warp synchronization is needed: its
// reads of a group come before (program order) the copies of the next into the same
// bytes. A copy of a group past the chunk copies nothing (size 0: zeros). The emulator
// (PRECIS_CUDA_EMULATED) copies at once: the same bytes.

// Bytes of a dtype code, as precis_elem_size, at compile time.
__host__ __device__ constexpr int bytes_of(int dtype) {
  return dtype == PRECIS_DTYPE_FP32 ? 4 : dtype == PRECIS_DTYPE_FP8_E4M3 ? 1 : 2;
}
__host__ __device__ constexpr bool scaled_code(int dtype) {
  return dtype == PRECIS_DTYPE_FP16 || dtype == PRECIS_DTYPE_FP8_E4M3;
}

// bytes (16, 8 or 4) from global memory to shared memory, in flight until copy_wait; none
// (zeros) when !valid.
#if defined(__CUDA_ARCH__) && !defined(PRECIS_CUDA_EMULATED)
#define PR_CP_ASYNC 1
#endif
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, int bytes, bool valid) {
#ifdef PR_CP_ASYNC
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
  const int n = valid ? bytes : 0;
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(n)
                 : "memory");
  } else if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(gmem), "r"(n)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(gmem), "r"(n)
                 : "memory");
  }
#else
  if (valid) {
    memcpy(smem, gmem, (size_t)bytes);
  } else {
    memset(smem, 0, (size_t)bytes);
  }
#endif
}

// The copies issued so far form a group (commit); wait for every group (wait).
__device__ __forceinline__ void copy_commit() {
#ifdef PR_CP_ASYNC
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void copy_wait() {
#ifdef PR_CP_ASYNC
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}

// A warp's shared memory for one group of a specialized Adam kernel's buffers: each
// buffer as planes of 32 lanes' slices (a lane's 8 elements: 32 bytes as two planes of
// 16, 16 or 8 bytes as one), then the lanes' block scales of m and v (4 bytes each).
// Planes are multiples of 128 bytes, so every slice is aligned for its copy.
template <int GD, int PD, int MODE, int MD, int ED, int VD>
struct Staged {
  static constexpr bool kP = MODE != kMasterSeparate;  // the param is read
  static constexpr bool kX = MODE != kMasterNone;      // the master or remainder is read
  static constexpr int kWX = MODE == kMasterRemainder ? 2 : bytes_of(MD);
  static constexpr int kG = 0;
  static constexpr int kPOff = kG + 32 * kPer * bytes_of(GD);
  static constexpr int kXOff = kPOff + (kP ? 32 * kPer * bytes_of(PD) : 0);
  static constexpr int kMOff = kXOff + (kX ? 32 * kPer * kWX : 0);
  static constexpr int kVOff = kMOff + 32 * kPer * bytes_of(ED);
  static constexpr int kMsOff = kVOff + 32 * kPer * bytes_of(VD);
  static constexpr int kVsOff = kMsOff + (scaled_code(ED) ? 32 * 4 : 0);
  static constexpr int kBytes = kVsOff + (scaled_code(VD) ? 32 * 4 : 0);  // a warp's

  // One buffer: the lane's slice of the group at e0 (its first element).
  static __device__ __forceinline__ void issue(char* warp, int off, const void* base, int width,
                                               int64_t e0, int lane, bool valid) {
    const char* src = static_cast<const char*>(base) + e0 * width;
    if (width == 4) {
      copy_async(warp + off + lane * 16, src, 16, valid);
      copy_async(warp + off + 512 + lane * 16, src + 16, 16, valid);
    } else if (width == 2) {
      copy_async(warp + off + lane * 16, src, 16, valid);
    } else {
      copy_async(warp + off + lane * 8, src, 8, valid);
    }
  }
  static __device__ __forceinline__ void read(Raw& r, const char* warp, int off, int width,
                                              int lane) {
    raw_clear(r);
    if (width == 4) {
      const uint4 a = *reinterpret_cast<const uint4*>(warp + off + lane * 16);
      const uint4 b = *reinterpret_cast<const uint4*>(warp + off + 512 + lane * 16);
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
      r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    } else if (width == 2) {
      const uint4 a = *reinterpret_cast<const uint4*>(warp + off + lane * 16);
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    } else {
      const uint2 a = *reinterpret_cast<const uint2*>(warp + off + lane * 8);
      r.w[0] = a.x; r.w[1] = a.y;
    }
  }

  // The copies of the whole group at base (valid: it is in the chunk), as load_all reads
  // it on the vector path.
  static __device__ __forceinline__ void issue_all(char* warp, const Buffers& b, int64_t base,
                                                   int lane, bool valid) {
    const int64_t e0 = base + lane * kPer;
    issue(warp, kG, b.g, bytes_of(GD), e0, lane, valid);
    if (kP) issue(warp, kPOff, b.p, bytes_of(PD), e0, lane, valid);
    if (kX) issue(warp, kXOff, b.master, kWX, e0, lane, valid);
    issue(warp, kMOff, b.m, bytes_of(ED), e0, lane, valid);
    issue(warp, kVOff, b.v, bytes_of(VD), e0, lane, valid);
    const int64_t s = base / PRECIS_SCALE_BLOCK + (lane >> 4);  // the lane's block
    if (scaled_code(ED)) copy_async(warp + kMsOff + lane * 4, b.ms + s, 4, valid);
    if (scaled_code(VD)) copy_async(warp + kVsOff + lane * 4, b.vs + s, 4, valid);
  }

  // load_all's result for the group whose copies have landed.
  static __device__ __forceinline__ void read_all(Loaded& in, const char* warp, int lane) {
    read(in.g, warp, kG, bytes_of(GD), lane);
    if (kP) {
      read(in.p, warp, kPOff, bytes_of(PD), lane);
    } else {
      raw_clear(in.p);
    }
    if (kX) {
      read(in.x, warp, kXOff, kWX, lane);
    } else {
      raw_clear(in.x);
    }
    read(in.m, warp, kMOff, bytes_of(ED), lane);
    read(in.v, warp, kVOff, bytes_of(VD), lane);
    in.ms0 = in.ms1 = scaled_code(ED) ? *reinterpret_cast<const float*>(warp + kMsOff + lane * 4)
                                      : 0.0f;
    in.vs0 = in.vs1 = scaled_code(VD) ? *reinterpret_cast<const float*>(warp + kVsOff + lane * 4)
                                      : 0.0f;
  }
};

// The block's part of tensor t's records: each warp's terms summed by shuffles, one
// atomic add per warp and record (a sum mod 2^64: any order, any split gives the CPU's
// value); the tensor's first block adds the length term to the tensor's record (the
// block record has none). Every lane of the warp calls it.
__device__ __forceinline__ void add_record(const AdamArgs& a, int t, int64_t start, int width,
                                           uint64_t fp) {
  if (a.fingerprints == nullptr && a.blocks == nullptr) return;  // (the same for every lane)
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) fp += __shfl_xor_sync(0xFFFFFFFFu, fp, off);
  if ((threadIdx.x & 31u) != 0) return;
  if (a.blocks != nullptr && fp != 0) atomicAdd(a.blocks + blockIdx.x, (unsigned long long)fp);
  if (start == 0 && threadIdx.x == 0) fp += pr_fp_length(a.numels[t] * width);
  if (a.fingerprints != nullptr && fp != 0) {
    atomicAdd(a.fingerprints + a.fp_index[t], (unsigned long long)fp);
  }
}

// A flagged param's chunk [start, end) resynced (resync.h's rule, from the count of its
// kept elements made before the launch: the bits of precis_cuda_resync_masters). Not
// inlined: the rare path keeps its registers out of the update's loop (a barrier or a
// call on every block's path made ptxas spill in the one-state and fp8 kernels).
__device__ __noinline__ void resync_chunk(void* master, int master_dtype, const void* param,
                                          int param_dtype, int64_t numel, int64_t kept,
                                          int64_t start, int64_t end) {
  const int whole = pr_resync_whole(kept, numel);
  for (int64_t j = start + threadIdx.x; j < end; j += blockDim.x) {
    pr_resync_element(master, master_dtype, static_cast<const uint16_t*>(param), param_dtype, j,
                      whole);
  }
}

// A chunk [start, end) of a param with remainders compared with its record before it is
// stepped (tensors->param_block_records): its words' terms (fingerprint.h) summed by the
// CUDA block; written since, its remainders are zeroed (resync.h's rule: the param is
// then its master), else its elements counted in blocks_kept. The params read here are
// in L2 when the update reads them. Not inlined (as resync_chunk): its registers stay out
// of the update's loop.
__device__ __noinline__ void compare_chunk(const AdamArgs& a, int t, int64_t numel,
                                           int64_t start, int64_t end) {
  __shared__ unsigned long long sum;
  const unsigned char* p = static_cast<const unsigned char*>(a.params[t]);
  const int64_t nbytes = 2 * numel;  // (bf16 params: the only ones with remainders)
  const bool aligned = ((uintptr_t)p & 7) == 0;
  unsigned long long part = 0;
  for (int64_t w = start / 4 + threadIdx.x; w < 2 * end / 8; w += blockDim.x) {
    part += pr_fp_word(p, w, aligned) * pr_fp_weight(w);
  }
  if (threadIdx.x == 0) {
    if (end == numel && nbytes % 8 != 0) part += pr_fp_tail_word(p, nbytes);
    sum = 0;
  }
  for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(0xFFFFFFFFu, part, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) atomicAdd(&sum, part);
  __syncthreads();
  if (sum != a.block_records[blockIdx.x]) {
    const size_t rsize = a.master_mode == kMasterRemainder ? 2 : 1;
    unsigned char* r = static_cast<unsigned char*>(a.masters[t]);
    for (int64_t j = start * rsize + threadIdx.x; j < end * (int64_t)rsize; j += blockDim.x) {
      r[j] = 0;
    }
  } else if (threadIdx.x == 0 && a.blocks_kept != nullptr) {
    atomicAdd(a.blocks_kept + a.fp_index[t], (unsigned long long)(end - start));
  }
  __syncthreads();  // (the update's threads read other elements than they zeroed)
}

// The tensor of block blk: the last k with first[k] <= blk (every tensor of a
// launch has at least one block, so first[] is strictly increasing).
__device__ __forceinline__ int find_tensor(const uint32_t* first, int count, uint32_t blk) {
  int lo = 0, hi = count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (first[mid] <= blk) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One CUDA block's chunk of a launch: Adam (ONE_STATE false) with the dtypes of the
// template arguments (kRuntime: from a), or a one-state rule (ONE_STATE: a.hyper.rule,
// SGD, Lion or MUON_MOMENTUM; every dtype from a). The kernels below are this.
template <int GD, int PD, int MODE, int MD, int ED, int VD, bool ONE_STATE>
__device__ __forceinline__ void update_block(const AdamArgs& a) {
  const uint32_t blk = blockIdx.x;
  const int t = find_tensor(a.first_block, a.count, blk);
  const int64_t numel = a.numels[t];
  const int64_t start = (int64_t)(blk - a.first_block[t]) << kChunkLog2;
  const int64_t end = start + kChunk < numel ? start + kChunk : numel;
  // A param its compare flagged: its chunk resynced first, a skipped step's too (as the
  // resync kernels before the update would). The flag is the block's: nothing the launch
  // writes shares its memory (check_resync).
  if (a.stale != nullptr && a.stale[a.fp_index[t]] != 0) {
    resync_chunk(a.masters[t], a.master_dtype, a.params[t], a.param_dtype, numel,
                 (int64_t)a.kept[a.fp_index[t]], start, end);
    __syncthreads();  // (the update's threads read other elements than they wrote)
  }
  // A chunk written since its block's record (the blocks' compare): resynced the same way.
  if (a.block_records != nullptr) compare_chunk(a, t, numel, start, end);
  // A skipped step (found_inf set by check_finite or by the caller) writes nothing
  // (its record: the params as they are, below). Decided per warp, so that a warp
  // never splits before its shuffles.
  const bool skip = a.found_inf != nullptr && __any_sync(0xFFFFFFFFu, *a.found_inf != 0.0f);
  const bool record = a.fingerprints != nullptr || a.blocks != nullptr;
  if (skip && !record) return;

  Dtypes d;
  d.g = GD != kRuntime ? GD : a.grad_dtype;
  d.p = PD != kRuntime ? PD : a.param_dtype;
  d.mode = MODE != kRuntime ? MODE : a.master_mode;
  d.master = MD != kRuntime ? MD : a.master_dtype;
  d.m = ED != kRuntime ? ED : a.exp_avg_dtype;
  d.v = VD != kRuntime ? VD : a.exp_avg_sq_dtype;
  d.ams = !ONE_STATE && a.amsgrad != 0;  // Adam's only (pr_step_check_rule)
  d.adam = !ONE_STATE;
  d.rule = ONE_STATE ? a.hyper.rule : PRECIS_RULE_ADAM;
  d.has_m = ONE_STATE ? a.has_m != 0 : true;
  d.out = a.output_dtype;
  d.writes_param = ONE_STATE ? a.writes_param != 0 : true;
  d.fast = !ONE_STATE && GD != kRuntime && PD != kRuntime && MODE != kRuntime &&
           MD != kRuntime && ED != kRuntime && VD != kRuntime;
  d.tail_ok = false;
  d.tail_key = 0xFFFFFFFFu;

  const int wp = precis_elem_size(d.p);
  constexpr int64_t kStride = (int64_t)kWarps * kGroup;
  // The specialized Adam kernels' hot loop keeps the next group in flight (Staged); the
  // generic and one-state kernels, whose dtypes are read at run time, load as they go.
  constexpr bool kStagedLoop = PR_ADAM_STAGED && !ONE_STATE && GD != kRuntime &&
                               PD != kRuntime && MODE != kRuntime && MD != kRuntime &&
                               ED != kRuntime && VD != kRuntime;
  Group g;
  g.numel = numel;
  g.lane = (int)(threadIdx.x & 31u);
  const bool vec = a.vec[t] != 0;
  if (skip) {
    uint64_t fp = 0;
    // The record of a skipped step: the params as they are, read (the step's record
    // must hold whether the host knows of the skip or not). Rare: no speed needed.
    for (int64_t base = start + (int64_t)(threadIdx.x >> 5) * kGroup; base < end;
         base += kStride) {
      g.base = base;
      g.vec = vec && base + kGroup <= numel;
      Raw r;
      load_group<false>(r, a.params[t], wp, g);
      fp += fp_terms(r, wp, g);
    }
    add_record(a, t, start, wp, fp);
    return;
  }

  int64_t step = a.device_steps ? *a.step_ptrs[t] : a.steps[t];
  precis_step_consts_t c;
  if (a.device_consts) {
    // lr / inv_grad_scale / step from device memory: the constants the host
    // would have made (precis_step_consts_make), made here.
    precis_step_hyper_t h = a.hyper;
    if (a.lr != nullptr) {
      h.lr = h.lr_float32 ? (double)*(const float*)a.lr : *(const double*)a.lr;
    }
    if (a.inv_grad_scale != nullptr) h.inv_grad_scale = *a.inv_grad_scale;
    if (step < 1) step = 1;
    c = precis_step_consts_make(&h, step);
    // SGD's and Lion's own lr of the tensor: the device lr times its scale.
    if (!d.adam && a.tensor_lr_scales) {
      precis_rule_consts_lr(&c, h.lr, a.lr_scales[t], h.lr_float32);
    }
  } else {
    c = a.consts;
    c.neg_step_size = a.neg_step_size[t];
    c.bias2_sqrt = a.bias2_sqrt[t];
    c.inv_bias2_sqrt = 1.0f / c.bias2_sqrt;
    c.first_step = step <= 1;  // SGD's (a.consts is step 1's)
  }
  if (!ONE_STATE) d.tail_ok = tail_constants(c, d.tail_key);
  // Stochastic rounding, keyed by what the elements are (stores.h): the bf16
  // param without a master, and the moments where precis_moment_store_sr says so.
  const uint64_t stream = a.stream[t];
  const uint32_t index0 = a.index0[t];
  StoreSr p_sr = {{0u, 0u}, step, index0};
  if (d.mode == kMasterNone && d.p == PRECIS_DTYPE_BF16) {
    p_sr.key = precis_sr_key(a.seed, stream, step);
  }
  const StoreSr moment_sr = {a.moment_key[t], step, index0};

  Buffers b;
  b.p = a.params[t];
  b.g = a.grads[t];
  b.master = a.masters[t];
  b.m = a.exp_avgs[t];
  b.v = a.exp_avg_sqs[t];
  b.ms = a.exp_avg_scales[t];
  b.vs = a.exp_avg_sq_scales[t];
  b.vmax = a.max_exp_avg_sqs[t];
  b.vmaxs = a.max_exp_avg_sq_scales[t];
  b.out = a.outputs[t];

  // The fingerprint terms of this thread's params as written, summed in shared memory
  // (volatile: kept there), not in a register: one live across the loop made the fp8
  // remainder kernels spill at their 128 registers.
  __shared__ unsigned long long fp_sums[kThreads];
  volatile unsigned long long* fp = &fp_sums[threadIdx.x];
  *fp = 0;
  int64_t base = start + (int64_t)(threadIdx.x >> 5) * kGroup;
  if (vec && !d.ams) {
    // The hot loop (tools/sass_budget.py reads its SASS): whole groups, vector access,
    // no AMSGrad. g.vec and hot.ams are constants here, so nothing is checked against
    // numel and no AMSGrad branch is left in it.
    Dtypes hot = d;
    hot.ams = false;
    g.vec = true;
    if (kStagedLoop) {
      // The next group's copies in flight while this one is computed (Staged).
      typedef Staged<GD, PD, MODE, MD, ED, VD> S;
      __shared__ uint4 staged[kWarps * S::kBytes / 16];  // (uint4: aligned for the copies)
      char* warp = reinterpret_cast<char*>(staged) + (threadIdx.x >> 5) * S::kBytes;
      S::issue_all(warp, b, base, g.lane, base + kGroup <= end);
      copy_commit();
      for (; base + kGroup <= end; base += kStride) {
        Loaded in;
        copy_wait();
        S::read_all(in, warp, g.lane);
        const bool more = base + kStride + kGroup <= end;
        S::issue_all(warp, b, more ? base + kStride : base, g.lane, more);
        copy_commit();
        g.base = base;
        update_loaded(in, b, hot, c, p_sr, moment_sr, g, fp);
      }
      copy_wait();  // (the last, empty, copies: nothing left in flight at the exit)
    } else {
      for (; base + kGroup <= end; base += kStride) {
        g.base = base;
        update_group(b, hot, c, p_sr, moment_sr, g, fp);
      }
    }
  }
  // The rest: AMSGrad, buffers not aligned for vectors, a tensor's last group.
  for (; base < end; base += kStride) {
    g.base = base;
    g.vec = vec && base + kGroup <= numel;
    update_group(b, d, c, p_sr, moment_sr, g, fp);
  }
  add_record(a, t, start, wp, *fp);  // (its own check: no flag live across the loop)
}

// Adam, specialized for the dtypes of a policy, or generic (every argument kRuntime).
template <int GD, int PD, int MODE, int MD, int ED, int VD>
__global__ void __launch_bounds__(kThreads, PR_ADAM_MIN_BLOCKS)
    adam_kernel(const __grid_constant__ AdamArgs a) {
  update_block<GD, PD, MODE, MD, ED, VD, false>(a);
}

// The one-state rules, dtypes and rule read at run time: a kernel of its own, so that
// ptxas allocates its registers apart from the generic Adam kernel's (in one kernel
// the two paths spilled several times what either spills alone).
__global__ void __launch_bounds__(kThreads, 2)
    one_state_kernel(const __grid_constant__ AdamArgs a) {
  update_block<kRuntime, kRuntime, kRuntime, kRuntime, kRuntime, kRuntime, true>(a);
}

// ---- check_finite -----------------------------------------------------------

__device__ __forceinline__ bool nonfinite(int dtype, uint32_t bits) {
  if (dtype == PRECIS_DTYPE_FP32) return (bits & 0x7FFFFFFFu) >= 0x7F800000u;
  if (dtype == PRECIS_DTYPE_FP16) return (bits & 0x7FFFu) >= 0x7C00u;
  return (bits & 0x7FFFu) >= 0x7F80u;  // bf16
}

// *found_inf = 1 if a gradient of the launch is NaN/Inf. Blocks return at once
// when an earlier kernel or block already found one.
template <int GD>
__global__ void __launch_bounds__(kThreads) check_kernel(const __grid_constant__ AdamArgs a) {
  if (__syncthreads_or(threadIdx.x == 0 && *a.found_inf != 0.0f)) return;
  const int width = precis_elem_size(GD);
  const uint32_t blk = blockIdx.x;
  const int t = find_tensor(a.first_block, a.count, blk);
  const int64_t numel = a.numels[t];
  const int64_t start = (int64_t)(blk - a.first_block[t]) << kChunkLog2;
  const int64_t end = start + kChunk < numel ? start + kChunk : numel;
  const void* grads = a.grads[t];
  const bool vec = a.vec[t] != 0;
  Group g;
  g.numel = numel;
  g.lane = (int)(threadIdx.x & 31u);
  int bad = 0;
  for (int64_t base = start + (int64_t)(threadIdx.x >> 5) * kGroup; base < end;
       base += (int64_t)kWarps * kGroup) {
    g.base = base;
    g.vec = vec && base + kGroup <= numel;
    Raw r;
    load_group<true>(r, grads, width, g);
#pragma unroll
    for (int j = 0; j < kPer; ++j) bad |= (g.valid(j) && nonfinite(GD, raw_get(r, width, j))) ? 1 : 0;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *a.found_inf = 1.0f;
}

// Every kernel the host launches, instantiated here: NVRTC reads no host code that would.
#define PR_INSTANTIATE_ADAM(G, P, MO, MA, E, V) \
  template __global__ void adam_kernel<G, P, MO, MA, E, V>(const __grid_constant__ AdamArgs a);
PR_ADAM_SPECIALIZED(PR_INSTANTIATE_ADAM)
#undef PR_INSTANTIATE_ADAM
#define PR_INSTANTIATE_CHECK(G) \
  template __global__ void check_kernel<G>(const __grid_constant__ AdamArgs a);
PR_CHECK_DTYPES(PR_INSTANTIATE_CHECK)
#undef PR_INSTANTIATE_CHECK
#endif  // __CUDACC__

}  // namespace step_cu
}  // namespace precis

#ifndef __CUDACC_RTC__
namespace precis {
namespace step_cu {

// ---- host side ------------------------------------------------------------------

constexpr uint32_t kMaxBlocks = 0x7FFFFFFFu;  // blocks per launch (gridDim.x limit)

typedef void (*Launcher)(const AdamArgs&, unsigned, cudaStream_t);

template <int GD, int PD, int MODE, int MD, int ED, int VD>
void launch_update(const AdamArgs& a, unsigned blocks, cudaStream_t stream) {
  PR_LAUNCH_T(adam_kernel, (GD, PD, MODE, MD, ED, VD), blocks, kThreads, stream, a);
}

void launch_one_state(const AdamArgs& a, unsigned blocks, cudaStream_t stream) {
  PR_LAUNCH(one_state_kernel, blocks, kThreads, stream, a);
}

template <int GD>
void launch_check(const AdamArgs& a, unsigned blocks, cudaStream_t stream) {
  PR_LAUNCH_T(check_kernel, (GD), blocks, kThreads, stream, a);
}

// Adam's kernel for its dtypes (PR_ADAM_SPECIALIZED, the generic one last, which
// matches any); the one-state rules run in one_state_kernel, whatever their dtypes.
Launcher pick_update(int rule, int gd, int pd, int mode, int md, int ed, int vd) {
  if (rule != PRECIS_RULE_ADAM) return launch_one_state;
#define PR_MATCH(want, have) ((want) == kRuntime || (want) == (have))
#define PR_PICK(G, P, MO, MA, E, V)                                                        \
  if (PR_MATCH(G, gd) && PR_MATCH(P, pd) && PR_MATCH(MO, mode) && PR_MATCH(MA, md) &&      \
      PR_MATCH(E, ed) && PR_MATCH(V, vd)) {                                                \
    return launch_update<G, P, MO, MA, E, V>;                                              \
  }
  PR_ADAM_SPECIALIZED(PR_PICK)
#undef PR_PICK
#undef PR_MATCH
  return launch_update<kRuntime, kRuntime, kRuntime, kRuntime, kRuntime, kRuntime>;
}

Launcher pick_check(int gd) {
  switch (gd) {
    case PRECIS_DTYPE_FP32: return launch_check<PRECIS_DTYPE_FP32>;
    case PRECIS_DTYPE_FP16: return launch_check<PRECIS_DTYPE_FP16>;
    default: return launch_check<PRECIS_DTYPE_BF16>;
  }
}

bool aligned(const void* p, uintptr_t to) { return (reinterpret_cast<uintptr_t>(p) % to) == 0; }

// 1 when every buffer of tensor i is aligned for the vector path (16 bytes, 8 for fp8).
uint8_t vector_aligned(const precis_step_tensors_t* t, size_t i, int master_mode, bool amsgrad,
                       pr_rule_use_t u) {
  pr_step_buffer_t bufs[PR_STEP_MAX_BUFFERS];
  const int n = pr_step_buffers(t, i, master_mode, amsgrad, u, bufs);
  for (int k = 0; k < n; ++k) {
    const int w = precis_elem_size(bufs[k].dtype);
    if (bufs[k].vector && !aligned(bufs[k].ptr, (uintptr_t)(w == 1 ? 8 : 16))) return 0;
  }
  return 1;
}

// Entry k of the update's buffer tables: tensor i's buffers that the step reads or
// writes (pr_step_buffers: the rule u's, the master in its mode, AMSGrad's max). The
// tables of the others are never read: NULL, or anything, as for the CPU step.
void set_buffers(AdamArgs& a, int k, const precis_step_tensors_t* t, size_t i, int mode,
                 bool ams, pr_rule_use_t u) {
  a.params[k] = u.param ? t->params[i] : NULL;
  a.masters[k] = u.param && mode != kMasterNone ? t->masters[i] : NULL;
  a.exp_avgs[k] = u.m ? t->exp_avgs[i] : NULL;
  a.exp_avg_scales[k] = u.m && pr_is_scaled((int)t->exp_avg_dtype) ? t->exp_avg_scales[i]
                                                                         : NULL;
  a.exp_avg_sqs[k] = u.v ? t->exp_avg_sqs[i] : NULL;
  a.exp_avg_sq_scales[k] =
      u.v && pr_is_scaled((int)t->exp_avg_sq_dtype) ? t->exp_avg_sq_scales[i] : NULL;
  if (ams) {  // the tables exist only in a struct of this header's size
    a.max_exp_avg_sqs[k] = t->max_exp_avg_sqs[i];
    a.max_exp_avg_sq_scales[k] =
        pr_is_scaled((int)t->exp_avg_sq_dtype) ? t->max_exp_avg_sq_scales[i] : NULL;
  } else if (u.output) {  // outputs share the max's entries (AdamArgs)
    a.outputs[k] = t->outputs[i];
  }
}

int64_t blocks_of(int64_t numel) { return (numel >> kChunkLog2) + ((numel & (kChunk - 1)) != 0); }

// Splits the non-empty tensors of the list into launches of at most kMaxTensors
// tensors and kMaxBlocks blocks; calls emit(args, blocks) for each, stopping at
// the first failure. fill() writes the per-tensor entries beyond the gradients,
// sizes and stochastic-rounding keys. fingerprints (NULL: none): the record, tensor i's
// at fingerprints[i], which a launch reaches as its own base and 16-bit offsets; the
// compare's stale and kept (NULL: none), and the blocks' compare's kept, alike.
// block_record (NULL: none): the block record, a launch's from its base, its tensors'
// entries consecutive (an empty tensor, an entry and no CUDA block, ends a launch); the
// blocks' compare's records (block_records) alike.
template <typename Fill, typename Emit>
precis_status_t for_each_launch(const precis_step_tensors_t* t, AdamArgs* a, Fill fill,
                                Emit emit, unsigned long long* fingerprints = nullptr,
                                const uint8_t* stale = nullptr,
                                const unsigned long long* kept = nullptr,
                                unsigned long long* block_record = nullptr,
                                const unsigned long long* block_records = nullptr,
                                unsigned long long* blocks_kept = nullptr) {
  precis_status_t st = PRECIS_OK;
  uint32_t blocks = 0;
  size_t first = 0;  // the launch's first tensor
  int64_t entry = 0;  // tensor i's first entry in block_record
  bool gap = false;   // an empty tensor since the launch's first
  a->count = 0;
  a->first_block[0] = 0;
  for (size_t i = 0; i < t->count;
       entry += pr_fp_block_count(t->numels[i], PRECIS_FINGERPRINT_BLOCK), ++i) {
    const int64_t numel = t->numels[i];
    if (numel == 0) {
      gap = a->count > 0;
      continue;
    }
    const int64_t nb = blocks_of(numel);  // <= kMaxBlocks, checked by the caller
    if (a->count == kMaxTensors || (int64_t)blocks + nb > (int64_t)kMaxBlocks ||
        (a->count > 0 && i - first > 0xFFFFu) ||
        (gap && (block_record != nullptr || block_records != nullptr))) {
      if ((st = emit(*a, blocks)) != PRECIS_OK) return st;
      a->count = 0;
      blocks = 0;
    }
    if (a->count == 0) {
      first = i;
      gap = false;
      a->fingerprints = fingerprints != nullptr ? fingerprints + i : nullptr;
      a->stale = stale != nullptr ? stale + i : nullptr;
      a->kept = kept != nullptr ? kept + i : nullptr;
      a->blocks = block_record != nullptr ? block_record + entry : nullptr;
      a->block_records = block_records != nullptr ? block_records + entry : nullptr;
      a->blocks_kept = blocks_kept != nullptr ? blocks_kept + i : nullptr;
    }
    const int k = a->count;
    a->fp_index[k] = (uint16_t)(i - first);
    a->grads[k] = t->grads[i];
    a->numels[k] = numel;
    a->stream[k] = pr_step_stream(t, i);
    a->moment_key[k] = precis_moment_key(a->seed, a->stream[k]);
    a->index0[k] = (uint32_t)(uint64_t)pr_step_element_offset(t, i);
    fill(*a, k, i);
    blocks += (uint32_t)nb;
    a->count = k + 1;
    a->first_block[k + 1] = blocks;
  }
  if (a->count > 0) st = emit(*a, blocks);
  return st;
}

// Checks shared by both entry points: sizes within what a launch can index.
precis_status_t check_sizes(const char* fn, const precis_step_tensors_t* t) {
  for (size_t i = 0; i < t->count; ++i) {
    if (blocks_of(t->numels[i]) > (int64_t)kMaxBlocks) {
      return pr_fail(PRECIS_ERR_UNSUPPORTED, "%s: numels[%zu] is %lld; at most %lld elements "
                     "per tensor", fn, i, (long long)t->numels[i],
                     (long long)kMaxBlocks * kChunk);
    }
  }
  return PRECIS_OK;
}

// dev's stale and kept (both NULL: no resync): both given, for a step whose rule writes
// the params with a master or remainders, kept 8-byte aligned, and neither sharing memory
// with the record (zeroed before the launches) nor with any buffer the step writes (a
// block branches on its flag: a flag written while the blocks read it could split one).
precis_status_t check_resync(const char* fn, const precis_step_tensors_t* t, int mode,
                             bool ams, pr_rule_use_t u, const uint8_t* stale,
                             const int64_t* kept, const void* record) {
  if (stale == NULL && kept == NULL) return PRECIS_OK;
  if (stale == NULL || kept == NULL) {
    return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dev->%s is NULL but dev->%s is given", fn,
                   stale == NULL ? "stale" : "kept", stale == NULL ? "kept" : "stale");
  }
  if (mode == kMasterNone || !u.param) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: dev->stale is given but the step has no master or remainders to resync%s",
                   fn, u.param ? "" : " (its rule writes no param)");
  }
  if (!aligned(kept, 8)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: dev->kept (%p) is not 8-byte aligned", fn,
                   (const void*)kept);
  }
  const size_t n = t->count;
  if (pr_overlap(stale, n, kept, 8 * n) || pr_overlap(stale, n, record, 8 * n) ||
      pr_overlap(kept, 8 * n, record, 8 * n)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: dev->stale, dev->kept and tensors->param_fingerprints share memory", fn);
  }
  pr_step_buffer_t bufs[PR_STEP_MAX_BUFFERS];
  for (size_t i = 0; i < n; ++i) {
    const int count = pr_step_buffers(t, i, mode, ams, u, bufs);
    for (int b = 0; b < count; ++b) {
      if (std::strcmp(bufs[b].name, "grads") == 0) continue;  // (only read)
      const size_t bytes = pr_step_buffer_bytes(&bufs[b], t->numels[i]);
      if (pr_overlap(stale, n, bufs[b].ptr, bytes) ||
          pr_overlap(kept, 8 * n, bufs[b].ptr, bytes)) {
        return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                       "%s: dev->stale or dev->kept shares memory with %s[%zu], which the step "
                       "writes",
                       fn, bufs[b].name, i);
      }
    }
  }
  return PRECIS_OK;
}

// The check_finite kernels over every gradient of the list (each aligned to its
// elements: pr_step_check_grads); vector loads where a gradient is 16-byte aligned.
precis_status_t launch_checks(const char* fn, const precis_step_tensors_t* t, float* found_inf,
                              cudaStream_t stream) {
  AdamArgs a = {};
  a.found_inf = found_inf;
  const Launcher launch = pick_check((int)t->grad_dtype);
  return for_each_launch(
      t, &a, [&](AdamArgs& args, int k, size_t i) { args.vec[k] = aligned(t->grads[i], 16); },
      [&](const AdamArgs& args, uint32_t blocks) {
        launch(args, blocks, stream);
        return check_launch(fn);
      });
}

}  // namespace step_cu
}  // namespace precis

namespace precis {
namespace step_cu {

// precis_cuda_step under the name fn (its error messages name the function called).
precis_status_t cuda_step(const char* fn, const precis_step_config_t* cfg,
                          const precis_step_tensors_t* tensors,
                          const precis_cuda_step_device_args_t* dev, void* stream) {
  pr_clear_error();
  // (fields after found_inf came later: read only where dev->size covers them)
  const size_t first_size = offsetof(precis_cuda_step_device_args_t, fingerprints_zeroed);
  if (dev != NULL && dev->size < first_size) {
    return pr_fail(PRECIS_ERR_SIZE_MISMATCH,
                   "%s: dev->size is %zu, expected at least %zu (use "
                   "PRECIS_CUDA_STEP_DEVICE_ARGS_INIT)",
                   fn, dev->size, first_size);
  }
  const void* d_lr = dev != NULL ? dev->lr : NULL;
  const float* d_igs = dev != NULL ? dev->inv_grad_scale : NULL;
  const int64_t* const* d_steps = dev != NULL ? dev->steps : NULL;
  float* d_found = dev != NULL ? dev->found_inf : NULL;
  const bool zeroed = dev != NULL &&
                      PR_HAS_FIELD(dev, precis_cuda_step_device_args_t, fingerprints_zeroed) &&
                      dev->fingerprints_zeroed != 0;
  const bool resyncs = dev != NULL && PR_HAS_FIELD(dev, precis_cuda_step_device_args_t, kept);
  const uint8_t* d_stale = resyncs ? dev->stale : NULL;
  const int64_t* d_kept = resyncs ? dev->kept : NULL;
  int mode = kMasterNone;
  precis_status_t st = pr_step_check_args(fn, cfg, tensors, d_found != NULL, "dev->found_inf",
                                          d_steps == NULL, &mode);
  if (st != PRECIS_OK) return st;
  if (pr_step_param_kept(tensors) != NULL) {  // (the CPU's: dev->stale and kept here)
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_kept must be NULL (precis_step's; on a GPU the "
                   "compare's flags: dev->stale, dev->kept)", fn);
  }
  // The record: device memory, zeroed below in stream order (or by the caller before:
  // dev->fingerprints_zeroed), added to atomically.
  unsigned long long* record =
      reinterpret_cast<unsigned long long*>(pr_step_param_fingerprints(tensors));
  if (!aligned(record, 8)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_fingerprints (%p) is not 8-byte aligned", fn,
                   (const void*)record);
  }
  // The block record: device memory, zeroed below in stream order, added to atomically.
  unsigned long long* block_record =
      reinterpret_cast<unsigned long long*>(pr_step_param_block_fingerprints(tensors));
  if (!aligned(block_record, 8)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->param_block_fingerprints (%p) is not 8-byte aligned", fn,
                   (const void*)block_record);
  }
  // The blocks' compare: its records read by the kernels, its kept zeroed below in stream
  // order and added to atomically (what it may be given: pr_step_check_args).
  const unsigned long long* block_records =
      reinterpret_cast<const unsigned long long*>(pr_step_param_block_records(tensors));
  unsigned long long* blocks_kept =
      reinterpret_cast<unsigned long long*>(pr_step_param_blocks_kept(tensors));
  if (!aligned(block_records, 8) || !aligned(blocks_kept, 8)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: tensors->%s (%p) is not 8-byte aligned", fn,
                   aligned(block_records, 8) ? "param_blocks_kept" : "param_block_records",
                   aligned(block_records, 8) ? (const void*)blocks_kept
                                             : (const void*)block_records);
  }
  if (!aligned(d_lr, cfg->lr_float32 ? 4 : 8) || !aligned(d_igs, 4) || !aligned(d_found, 4)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT,
                   "%s: a pointer of dev is not aligned to its element size", fn);
  }
  if ((st = check_resync(fn, tensors, mode, pr_adam_amsgrad(cfg) != 0, pr_rule_use(cfg),
                         d_stale, d_kept, record)) != PRECIS_OK) {
    return st;
  }
  for (size_t i = 0; d_steps != NULL && i < tensors->count; ++i) {
    if (tensors->numels[i] == 0) continue;
    if (d_steps[i] == NULL) {
      return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: dev->steps[%zu] is NULL", fn, i);
    }
    if (!aligned(d_steps[i], 8)) {
      return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: dev->steps[%zu] (%p) is not 8-byte aligned",
                     fn, i, (const void*)d_steps[i]);
    }
  }
  const precis_step_tensors_t* t = tensors;
  const bool ams = pr_adam_amsgrad(cfg) != 0;
  const pr_rule_use_t u = pr_rule_use(cfg);
  // SGD's and Lion's per-tensor lr scales (host values, checked).
  const double* lr_scales =
      PR_HAS_FIELD(t, precis_step_tensors_t, lr_scales) ? t->lr_scales : NULL;
  if ((st = check_sizes(fn, t)) != PRECIS_OK) return st;

  cudaStream_t s = static_cast<cudaStream_t>(stream);

  // Every entry zeroed, an empty tensor's too (its fingerprint is 0), before any launch.
  if (record != nullptr && t->count > 0 && !zeroed &&
      (st = memset_async(fn, "tensors->param_fingerprints", record,
                         t->count * sizeof(uint64_t), s)) != PRECIS_OK) {
    return st;
  }

  if (block_record != nullptr && t->count > 0) {
    int64_t entries = 0;
    for (size_t i = 0; i < t->count; ++i) {
      entries += pr_fp_block_count(t->numels[i], PRECIS_FINGERPRINT_BLOCK);
    }
    if ((st = memset_async(fn, "tensors->param_block_fingerprints", block_record,
                           (size_t)entries * sizeof(uint64_t), s)) != PRECIS_OK) {
      return st;
    }
  }

  if (blocks_kept != nullptr && t->count > 0 &&
      (st = memset_async(fn, "tensors->param_blocks_kept", blocks_kept,
                         t->count * sizeof(uint64_t), s)) != PRECIS_OK) {
    return st;
  }

  // check_finite: every gradient of the call is scanned before any update runs.
  if (cfg->check_finite && (st = launch_checks(fn, t, d_found, s)) != PRECIS_OK) return st;

  AdamArgs args = {};
  AdamArgs* a = &args;
  const precis_step_hyper_t hyper = precis_step_hyper_from_config(cfg);
  a->hyper = hyper;
  a->consts = precis_step_consts_make(&hyper, 1);
  a->lr = d_lr;
  a->inv_grad_scale = d_igs;
  a->found_inf = d_found;
  a->seed = cfg->seed;
  a->device_consts = (d_lr != NULL || d_igs != NULL || d_steps != NULL) ? 1 : 0;
  a->device_steps = d_steps != NULL ? 1 : 0;
  a->grad_dtype = (int32_t)t->grad_dtype;
  a->param_dtype = (int32_t)t->param_dtype;
  a->master_dtype = (int32_t)t->master_dtype;
  a->master_mode = (int32_t)mode;
  a->exp_avg_dtype = (int32_t)t->exp_avg_dtype;
  a->exp_avg_sq_dtype = (int32_t)t->exp_avg_sq_dtype;
  a->amsgrad = ams ? 1 : 0;
  a->has_m = u.m ? 1 : 0;
  a->output_dtype = u.output ? (int32_t)t->output_dtype : (int32_t)PRECIS_DTYPE_FP32;
  a->writes_param = u.param ? 1 : 0;
  a->tensor_lr_scales = lr_scales != NULL ? 1 : 0;  // only with SGD or Lion (pr_step_check_args)
  const Launcher launch = pick_update(u.rule, (int)t->grad_dtype, (int)t->param_dtype, mode,
                                      (int)t->master_dtype, (int)t->exp_avg_dtype,
                                      (int)t->exp_avg_sq_dtype);
  // Host constants: the step-independent ones in a->consts (made for step 1),
  // neg_step_size and bias2_sqrt per tensor, made once per distinct step in a row
  // (usually once); SGD's first_step from the step in the kernel. A tensor's own lr
  // (SGD, Lion) replaces neg_step_size, with device constants too.
  int64_t last_step = 1;
  precis_step_consts_t last = a->consts;
  return for_each_launch(
      t, a,
      [&](AdamArgs& args, int k, size_t i) {
        set_buffers(args, k, t, i, mode, ams, u);
        args.vec[k] = vector_aligned(t, i, mode, ams, u);
        if (args.device_steps) {
          args.step_ptrs[k] = d_steps[i];
        } else {
          args.steps[k] = t->steps[i];
        }
        if (!args.device_consts) {
          if (t->steps[i] != last_step) {
            last_step = t->steps[i];
            last = precis_step_consts_make(&hyper, last_step);
          }
          args.neg_step_size[k] = last.neg_step_size;
          args.bias2_sqrt[k] = last.bias2_sqrt;
        }
        if (lr_scales != NULL) {  // after set_buffers: lr_scales shares the max's scales
          args.lr_scales[k] = lr_scales[i];
          precis_step_consts_t own = last;
          precis_rule_consts_lr(&own, hyper.lr, lr_scales[i], hyper.lr_float32);
          args.neg_step_size[k] = own.neg_step_size;
        }
      },
      [&](const AdamArgs& args, uint32_t blocks) {
        launch(args, blocks, s);
        return check_launch(fn);
      },
      record, d_stale, reinterpret_cast<const unsigned long long*>(d_kept), block_record,
      block_records, blocks_kept);
}

precis_status_t cuda_check_finite(const char* fn, const precis_step_tensors_t* tensors,
                                  float* found_inf, void* stream) {
  pr_clear_error();
  const precis_step_tensors_t* t = tensors;
  precis_status_t st = pr_step_check_tensors_struct(fn, t, 0);
  if (st != PRECIS_OK) return st;
  if (found_inf == NULL) return pr_fail(PRECIS_ERR_NULL_POINTER, "%s: found_inf is NULL", fn);
  if (!aligned(found_inf, 4)) {
    return pr_fail(PRECIS_ERR_INVALID_ARGUMENT, "%s: found_inf is not 4-byte aligned", fn);
  }
  if ((st = pr_step_check_grads(fn, t)) != PRECIS_OK || t->count == 0 ||
      (st = check_sizes(fn, t)) != PRECIS_OK) {
    return st;
  }
  return launch_checks(fn, t, found_inf, static_cast<cudaStream_t>(stream));
}

}  // namespace step_cu
}  // namespace precis

extern "C" PRECIS_API precis_status_t precis_cuda_step(const precis_step_config_t* cfg,
                                                       const precis_step_tensors_t* tensors,
                                                       const precis_cuda_step_device_args_t* dev,
                                                       void* stream) {
  return precis::step_cu::cuda_step("precis_cuda_step", cfg, tensors, dev, stream);
}

extern "C" PRECIS_API precis_status_t precis_cuda_step_check_finite(
    const precis_step_tensors_t* tensors, float* found_inf, void* stream) {
  return precis::step_cu::cuda_check_finite("precis_cuda_step_check_finite", tensors, found_inf,
                                            stream);
}

// The names before issue #66 (the engine was Adam's), kept exported.
extern "C" PRECIS_API precis_status_t precis_cuda_adam_step(
    const precis_step_config_t* cfg, const precis_step_tensors_t* tensors,
    const precis_cuda_step_device_args_t* dev, void* stream) {
  return precis::step_cu::cuda_step("precis_cuda_adam_step", cfg, tensors, dev, stream);
}

extern "C" PRECIS_API precis_status_t precis_cuda_adam_check_finite(
    const precis_step_tensors_t* tensors, float* found_inf, void* stream) {
  return precis::step_cu::cuda_check_finite("precis_cuda_adam_check_finite", tensors, found_inf,
                                            stream);
}
#endif  // !__CUDACC_RTC__
