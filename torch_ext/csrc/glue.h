/*
 * glue.h - what the files of libprecis_torch.so share: the resolved libtorch
 * functions, the lazily loaded CUDA library, and a kernel call's bookkeeping.
 *
 * A boxed kernel runs in three steps, so that bad input never leaves anything
 * half-written or leaked:
 *   1. take ownership of every argument (pr_call_take_*): tensor and list
 *      handles are recorded in the pr_call_t;
 *   2. check every argument and plan the C calls, recording the first failure
 *      (pr_call_fail), then write;
 *   3. pr_call_finish: free every handle and allocation, then raise the failure
 *      (if any) as a c10::Error through aoti_torch_check.
 */
#ifndef PRECIS_TORCH_GLUE_H_
#define PRECIS_TORCH_GLUE_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "precis/precis.h"
#include "torch_stable_abi.h"

#if defined(__GNUC__)
#define PR_GLUE_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define PR_GLUE_PRINTF(fmt, args)
#endif

/* ---- libtorch, resolved by precis_torch_init (register.c) ---------------- */

typedef struct pr_torch_api {
#define PR_TORCH_SLOT(name, ret, params) pr_##name##_fn* name;
  PR_TORCH_CPU_FUNCTIONS(PR_TORCH_SLOT)
  PR_TORCH_CUDA_FUNCTIONS(PR_TORCH_SLOT)
#undef PR_TORCH_SLOT
  /* torch's codes, read once */
  int32_t dtype_float32, dtype_float16, dtype_bfloat16, dtype_float64, dtype_uint8,
      dtype_int16, dtype_int32, dtype_int64;
  int32_t device_cpu, device_cuda;
  /* MKL's vmsSqrt_64 inside libtorch_cpu, or NULL (a torch built without MKL) */
  void (*mkl_vms_sqrt)(int64_t n, const float* in, float* out, int64_t mode);
  int (*get_num_threads)(void); /* at::get_num_threads(), or NULL */
  /* Python's, where the process runs Python (else NULL): pr_python_hold */
  int (*py_is_initialized)(void);
  int (*py_gil_check)(void);
  int (*py_gil_ensure)(void); /* PyGILState_STATE, an enum */
  void (*py_gil_release)(int);
} pr_torch_api_t;

extern pr_torch_api_t pr_torch;

/* The fp32 square root torch's CPU kernels use, for precis_step_config_t.cpu_sqrt:
 * MKL's when torch has MKL, else NULL (torch's vectorized sqrt is IEEE's);
 * NULL too when the environment has PRECIS_CPU_SQRT=ieee. */
precis_sqrt_fn_t pr_torch_cpu_sqrt(void);

/* torch's intra-op thread count (at::get_num_threads()), or 0 if unknown. */
int32_t pr_torch_num_threads(void);

/* Deleting a handle that holds a tensor's last C++ reference beside its Python object
 * hands that object back to Python (torch decrefs it under the GIL, which it takes and
 * drops for each such tensor: some 40 ns each, 258 times for a step's params and
 * grads). pr_python_hold takes the GIL once for a call's deletions when the process
 * runs Python and this thread does not hold it (a dispatcher call from Python releases
 * it); pr_python_release(its result) gives it back. Without Python: nothing. */
int pr_python_hold(void);
void pr_python_release(int held);

/* ---- libprecis_cuda.so, loaded at the first CUDA call (register.c) --------- */

/* The CUDA library is built by CUDA 13.0's nvcc (tools/build_cuda.sh) with its runtime
 * linked statically: it needs a driver for CUDA 13.0, R580 or newer, whatever CUDA torch
 * was built for. tests/py/optimizers/test_loader.py checks these against nvcc and the README. */
#define PR_CUDA_BUILT_FOR 13000 /* CUDA_VERSION: 1000 * major + 10 * minor */
#define PR_CUDA_MIN_DRIVER "R580 or newer"

typedef struct pr_cuda_api {
  __typeof__(precis_last_error)* last_error;
  __typeof__(precis_cuda_step)* step;
  __typeof__(precis_cuda_step_check_finite)* check_finite;
  __typeof__(precis_cuda_accumulate)* accumulate;
  __typeof__(precis_cuda_cast)* cast;
  __typeof__(precis_cuda_scale)* scale;
  __typeof__(precis_cuda_count_nonfinite)* count_nonfinite;
  __typeof__(precis_cuda_fingerprint)* fingerprint;
  __typeof__(precis_cuda_fingerprint_blocks)* fingerprint_blocks;
  __typeof__(precis_cuda_resync_masters)* resync_masters;
  __typeof__(precis_cuda_resync_compared)* resync_compared;
  __typeof__(precis_cuda_compare_params)* compare_params;
} pr_cuda_api_t;

/* The CUDA library's functions, or NULL with *why set to the reason. */
const pr_cuda_api_t* pr_cuda_api(const char** why);

/* ---- one kernel call ------------------------------------------------------ */

enum { PR_ON_CPU = 0, PR_ON_CUDA = 1 };

/* A tensor argument, owned by the call, with what the checks need. */
typedef struct pr_tensor {
  AtenTensorHandle handle;
  void* data;
  int64_t numel;
  int32_t torch_dtype;
  int dtype; /* the precis dtype code, or -1 when there is none */
  int32_t device_type;
  int32_t device_index;
  uint8_t elem_size; /* bytes per element, 0 when unknown */
  bool contiguous;
} pr_tensor_t;

typedef struct pr_tensor_list {
  size_t count;
  pr_tensor_t* items;
} pr_tensor_list_t;

typedef struct pr_int_list {
  size_t count;
  int64_t* items;
} pr_int_list_t;

typedef struct pr_float_list {
  size_t count;
  double* items;
} pr_float_list_t;

typedef struct pr_call {
  const char* op; /* "precis.adam_step_": starts every message */
  bool failed;
  char message[2048];
  void** blocks; /* malloc'ed memory freed by pr_call_finish */
  size_t block_count, block_cap;
  /* pr_call_alloc's current block, handed out in pieces: a call's some fifty small
   * tables cost one malloc, not fifty (each takes the allocator's lock) */
  char* arena;
  size_t arena_used, arena_cap;
  char* usual; /* the block of the usual size it took from its thread's spare (args.c) */
  pr_tensor_list_t* owned; /* tensors whose handles pr_call_finish frees */
  size_t owned_count, owned_cap;
} pr_call_t;

void pr_call_start(pr_call_t* call, const char* op);

/* Records the first failure ("<op>: <message>"); returns false for `return pr_call_fail(...)`. */
bool pr_call_fail(pr_call_t* call, const char* fmt, ...) PR_GLUE_PRINTF(2, 3);


/* Zeroed memory owned by the call (NULL after recording a failure). */
void* pr_call_alloc(pr_call_t* call, size_t count, size_t size);

/* Take ownership of one stack slot. Always consume the slot, even after a
 * failure, so that every handle is freed. */
void pr_call_take_tensor(pr_call_t* call, StableIValue slot, pr_tensor_t* out, const char* name);
void pr_call_take_tensor_list(pr_call_t* call, StableIValue slot, pr_tensor_list_t* out,
                              const char* name);
void pr_call_take_int_list(pr_call_t* call, StableIValue slot, pr_int_list_t* out,
                           const char* name);
/* A float[] argument: each item a double's bits, as a float argument. */
void pr_call_take_float_list(pr_call_t* call, StableIValue slot, pr_float_list_t* out,
                             const char* name);

/* Frees every tensor handle taken and every allocation, then raises the
 * failure, if any, as a c10::Error. */
void pr_call_finish(pr_call_t* call);

double pr_slot_double(StableIValue slot);
bool pr_slot_bool(StableIValue slot);
int64_t pr_slot_int(StableIValue slot);
StableIValue pr_slot_from_tensor(AtenTensorHandle tensor);

/* ---- checks shared by the kernels (args.c) --------------------------------- */

/* "float32", "cuda:1", ... for messages (static or thread-local storage). */
const char* pr_torch_dtype_name(int32_t torch_dtype);
const char* pr_device_name(const pr_tensor_t* t);

/* a and b are on the same device (the check below without a message: the hot path
 * formats names only for a failure). */
static inline bool pr_same_device(const pr_tensor_t* a, const pr_tensor_t* b) {
  return a->device_type == b->device_type && a->device_index == b->device_index;
}

/* t is on the same device as ref; else records "<what> is on X, <ref_what> on Y". */
bool pr_check_same_device(pr_call_t* call, const pr_tensor_t* t, const char* what,
                          const pr_tensor_t* ref, const char* ref_what);

/* The kernel's device type matches the tensor's (the CPU kernel gets CPU tensors). */
bool pr_check_kernel_device(pr_call_t* call, const pr_tensor_t* t, const char* what, int on);

/* Contiguous and aligned to its element size (only non-empty tensors are checked). */
static inline bool pr_layout_ok(const pr_tensor_t* t) {
  size_t size = t->elem_size;
  return t->numel == 0 || (t->contiguous && (size <= 1 || (uintptr_t)t->data % size == 0));
}
bool pr_check_layout(pr_call_t* call, const pr_tensor_t* t, const char* what);

/* A one-element tensor of torch_dtype on ref's device. */
bool pr_check_scalar(pr_call_t* call, const pr_tensor_t* t, const char* what, int32_t torch_dtype,
                     const pr_tensor_t* ref, const char* ref_what);

/* A tensor's bytes for the overlap check every op shares (pr_check_apart): named
 * name[index], or name alone with PR_NO_INDEX; written: the op writes it. */
#define PR_NO_INDEX SIZE_MAX
typedef struct pr_range {
  uintptr_t lo, hi;
  const char* name; /* static storage: read when a failure is formatted */
  size_t index;
  bool written;
} pr_range_t;

/* Appends t's bytes to ranges[*count] (nothing for an empty tensor). */
void pr_add_range(pr_range_t* ranges, size_t* count, const pr_tensor_t* t, const char* name,
                  size_t index, bool written);

/* No written range overlaps any other (ranges sorted in place or in the call's memory),
 * else records "<a> and <b> share memory; <rule>". */
bool pr_check_apart(pr_call_t* call, pr_range_t* ranges, size_t count, const char* rule);
/* The rule an op other than the step names (the step: its buffers). */
#define PR_APART_RULE "a tensor the op writes must not overlap another it takes"

/* A CUDA kernel's context: the CUDA library, a device guard, torch's current stream. */
typedef struct pr_cuda_ctx {
  const pr_cuda_api_t* api;
  DeviceGuardHandle guard;
  void* stream;
} pr_cuda_ctx_t;

/* Loads the CUDA library (once), switches to the device, gets its current
 * stream; false (failure recorded) if any step fails. Always pair with pr_cuda_end. */
bool pr_cuda_begin(pr_call_t* call, int32_t device_index, pr_cuda_ctx_t* ctx);
void pr_cuda_end(pr_cuda_ctx_t* ctx);

/* Records a failed status of a precis_* call made on `on` (ctx for CUDA). */
bool pr_call_check(pr_call_t* call, precis_status_t status, const pr_cuda_ctx_t* ctx);

/* Registration tables of each kernel file: name, CPU kernel, CUDA kernel. */
typedef struct pr_op_kernels {
  const char* name;
  const char* schema;
  pr_boxed_kernel_fn cpu;
  pr_boxed_kernel_fn cuda;
} pr_op_kernels_t;

extern const pr_op_kernels_t pr_step_ops[];
extern const size_t pr_step_op_count;
extern const pr_op_kernels_t pr_step_flat_ops[];
extern const size_t pr_step_flat_op_count;
extern const pr_op_kernels_t pr_bucket_ops[];
extern const size_t pr_bucket_op_count;
extern const pr_op_kernels_t pr_held_ops[];
extern const size_t pr_held_op_count;

/* The CPU and the CUDA kernel of one body `fn(stack, on)`. The dispatcher
 * checks the number of arguments against the schema. */
#define PR_KERNEL_PAIR(fn)                                                               \
  static void fn##_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {   \
    (void)num_args;                                                                      \
    (void)num_outputs;                                                                   \
    fn(stack, PR_ON_CPU);                                                                \
  }                                                                                      \
  static void fn##_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {  \
    (void)num_args;                                                                      \
    (void)num_outputs;                                                                   \
    fn(stack, PR_ON_CUDA);                                                               \
  }

#endif /* PRECIS_TORCH_GLUE_H_ */
