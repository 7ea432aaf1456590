/* bucket_kernels.c - precis::accumulate_, cast_, scale_ and count_nonfinite, the
 * element-wise ops of a gradient bucket, and fingerprint (what a param holds, for
 * precis.optim's load detection). One body per op serves the CPU
 * (libprecis.so) and the CUDA kernel (libprecis_cuda.so on torch's current
 * stream); the C entry points check dtypes, sizes and overlaps themselves. */
#include <inttypes.h>
#include <stddef.h>

#include "glue.h"

/* The tensor as an element-wise operand: on the kernel's device, contiguous,
 * aligned, one of fp32 / fp16 / bf16. */
static bool pr_check_operand(pr_call_t* call, const pr_tensor_t* t, const char* what, int on) {
  if (!pr_check_kernel_device(call, t, what, on)) return false;
  if (t->dtype != PRECIS_DTYPE_FP32 && t->dtype != PRECIS_DTYPE_FP16 &&
      t->dtype != PRECIS_DTYPE_BF16) {
    return pr_call_fail(call, "%s has dtype %s; supported: float32, bfloat16, float16", what,
                        pr_torch_dtype_name(t->torch_dtype));
  }
  return pr_check_layout(call, t, what);
}

typedef enum { PR_PAIR_ACCUMULATE, PR_PAIR_CAST } pr_pair_op_t;

/* dst (op)= src: accumulate_(Tensor(a!) dst, Tensor src), cast_(same). */
static void pr_pair_kernel(StableIValue* stack, int on, pr_pair_op_t op) {
  pr_call_t call;
  pr_call_start(&call, op == PR_PAIR_ACCUMULATE ? "precis.accumulate_" : "precis.cast_");
  pr_tensor_t dst, src;
  pr_call_take_tensor(&call, stack[0], &dst, "dst");
  pr_call_take_tensor(&call, stack[1], &src, "src");
  if (!call.failed && pr_check_same_device(&call, &src, "src", &dst, "dst") &&
      pr_check_operand(&call, &dst, "dst", on) && pr_check_operand(&call, &src, "src", on)) {
    precis_dtype_t dd = (precis_dtype_t)dst.dtype, sd = (precis_dtype_t)src.dtype;
    if (dst.numel != src.numel) {
      pr_call_fail(&call, "dst has %" PRId64 " elements but src has %" PRId64, dst.numel,
                   src.numel);
    } else if (dst.numel == 0) {
      /* nothing to do */
    } else if (on == PR_ON_CUDA) {
      pr_cuda_ctx_t cuda;
      if (pr_cuda_begin(&call, dst.device_index, &cuda)) {
        pr_call_check(&call,
                      op == PR_PAIR_ACCUMULATE
                          ? cuda.api->accumulate(dst.data, dd, src.data, sd, dst.numel, cuda.stream)
                          : cuda.api->cast(dst.data, dd, src.data, sd, dst.numel, cuda.stream),
                      &cuda);
      }
      pr_cuda_end(&cuda);
    } else {
      pr_call_check(&call,
                    op == PR_PAIR_ACCUMULATE
                        ? precis_accumulate(dst.data, dd, src.data, sd, dst.numel)
                        : precis_cast(dst.data, dd, src.data, sd, dst.numel),
                    NULL);
    }
  }
  pr_call_finish(&call);
}

static void pr_accumulate(StableIValue* stack, int on) {
  pr_pair_kernel(stack, on, PR_PAIR_ACCUMULATE);
}

static void pr_cast(StableIValue* stack, int on) { pr_pair_kernel(stack, on, PR_PAIR_CAST); }

/* scale_(Tensor(a!) buf, float factor): buf *= factor in fp32. */
static void pr_scale(StableIValue* stack, int on) {
  pr_call_t call;
  pr_call_start(&call, "precis.scale_");
  pr_tensor_t buf;
  pr_call_take_tensor(&call, stack[0], &buf, "buf");
  double factor = pr_slot_double(stack[1]);
  float f = (float)factor; /* what the C entry points take */
  if (!call.failed && pr_check_operand(&call, &buf, "buf", on)) {
    if (!(f - f == 0.0f)) {
      pr_call_fail(&call, "factor is %g; must be finite as a float32", factor);
    } else if (buf.numel == 0) {
      /* nothing to do */
    } else if (on == PR_ON_CUDA) {
      pr_cuda_ctx_t cuda;
      if (pr_cuda_begin(&call, buf.device_index, &cuda)) {
        pr_call_check(&call,
                      cuda.api->scale(buf.data, (precis_dtype_t)buf.dtype, f, buf.numel, cuda.stream),
                      &cuda);
      }
      pr_cuda_end(&cuda);
    } else {
      pr_call_check(&call, precis_scale(buf.data, (precis_dtype_t)buf.dtype, f, buf.numel), NULL);
    }
  }
  pr_call_finish(&call);
}

/* A new 0-dim int64 tensor on buf's device (*result, its data *out) for an op's result;
 * false, the call failed, when torch cannot make it. */
static bool pr_new_scalar(pr_call_t* call, const pr_tensor_t* buf, AtenTensorHandle* result,
                          void** out) {
  int64_t no_dims = 0;
  if (pr_torch.aoti_torch_empty_strided(0, &no_dims, &no_dims, pr_torch.dtype_int64,
                                        buf->device_type, buf->device_index, result)) {
    *result = NULL;
    return pr_call_fail(call, "cannot allocate the result on %s", pr_device_name(buf));
  }
  if (pr_torch.aoti_torch_get_data_ptr(*result, out)) {
    return pr_call_fail(call, "cannot read the result's data pointer");
  }
  return true;
}

/* count_nonfinite(Tensor buf) -> Tensor: a 0-dim int64 on buf's device. */
static void pr_count_nonfinite(StableIValue* stack, int on) {
  pr_call_t call;
  pr_call_start(&call, "precis.count_nonfinite");
  pr_tensor_t buf;
  pr_call_take_tensor(&call, stack[0], &buf, "buf");
  AtenTensorHandle result = NULL;
  void* out = NULL;
  if (!call.failed && pr_check_operand(&call, &buf, "buf", on)) {
    pr_new_scalar(&call, &buf, &result, &out);
  }
  if (call.failed) {
    /* nothing to count */
  } else if (on == PR_ON_CUDA) {
    pr_cuda_ctx_t cuda;
    if (pr_cuda_begin(&call, buf.device_index, &cuda)) {
      if (pr_torch.aoti_torch_zero_(result)) { /* the kernel adds to the count */
        pr_call_fail(&call, "cannot zero the result");
      } else if (buf.numel > 0) {
        pr_call_check(&call,
                      cuda.api->count_nonfinite(buf.data, (precis_dtype_t)buf.dtype, buf.numel,
                                                (int64_t*)out, cuda.stream),
                      &cuda);
      }
    }
    pr_cuda_end(&cuda);
  } else {
    int64_t count = 0;
    if (buf.numel > 0) {
      pr_call_check(&call,
                    precis_count_nonfinite(buf.data, (precis_dtype_t)buf.dtype, buf.numel, &count),
                    NULL);
    }
    *(int64_t*)out = count;
  }
  if (call.failed && result) {
    pr_torch.aoti_torch_delete_tensor_object(result);
    result = NULL;
  }
  stack[0] = pr_slot_from_tensor(result); /* torch owns the result */
  pr_call_finish(&call);
}

/* fingerprint(Tensor buf) -> Tensor: precis_fingerprint of buf's bytes, a 0-dim int64
 * (the uint64's bits) on buf's device; any dtype of known size, contiguous. */
static void pr_fingerprint(StableIValue* stack, int on) {
  pr_call_t call;
  pr_call_start(&call, "precis.fingerprint");
  pr_tensor_t buf;
  pr_call_take_tensor(&call, stack[0], &buf, "buf");
  AtenTensorHandle result = NULL;
  void* out = NULL;
  if (!call.failed && pr_check_kernel_device(&call, &buf, "buf", on)) {
    if (buf.elem_size == 0) {
      pr_call_fail(&call, "buf has dtype %s, whose element size is unknown",
                   pr_torch_dtype_name(buf.torch_dtype));
    } else if (pr_check_layout(&call, &buf, "buf")) {
      pr_new_scalar(&call, &buf, &result, &out);
    }
  }
  const int64_t nbytes = buf.numel * (int64_t)buf.elem_size;
  if (call.failed) {
    /* nothing to hash */
  } else if (on == PR_ON_CUDA) {
    pr_cuda_ctx_t cuda;
    if (pr_cuda_begin(&call, buf.device_index, &cuda)) {
      pr_call_check(&call, cuda.api->fingerprint(buf.data, nbytes, (uint64_t*)out, cuda.stream),
                    &cuda);
    }
    pr_cuda_end(&cuda);
  } else {
    const void* data = buf.data;
    pr_call_check(&call, precis_fingerprint(&data, &nbytes, 1, (uint64_t*)out), NULL);
  }
  if (call.failed && result) {
    pr_torch.aoti_torch_delete_tensor_object(result);
    result = NULL;
  }
  stack[0] = pr_slot_from_tensor(result); /* torch owns the result */
  pr_call_finish(&call);
}

PR_KERNEL_PAIR(pr_accumulate)
PR_KERNEL_PAIR(pr_cast)
PR_KERNEL_PAIR(pr_scale)
PR_KERNEL_PAIR(pr_count_nonfinite)
PR_KERNEL_PAIR(pr_fingerprint)

const pr_op_kernels_t pr_bucket_ops[] = {
    {"accumulate_", "accumulate_(Tensor(a!) dst, Tensor src) -> ()", pr_accumulate_cpu,
     pr_accumulate_cuda},
    {"cast_", "cast_(Tensor(a!) dst, Tensor src) -> ()", pr_cast_cpu, pr_cast_cuda},
    {"scale_", "scale_(Tensor(a!) buf, float factor) -> ()", pr_scale_cpu, pr_scale_cuda},
    {"count_nonfinite", "count_nonfinite(Tensor buf) -> Tensor", pr_count_nonfinite_cpu,
     pr_count_nonfinite_cuda},
    {"fingerprint", "fingerprint(Tensor buf) -> Tensor", pr_fingerprint_cpu, pr_fingerprint_cuda},
};
const size_t pr_bucket_op_count = sizeof pr_bucket_ops / sizeof pr_bucket_ops[0];
