/* bucket_kernels.c - precis::accumulate_, cast_, scale_ and count_nonfinite, the
 * element-wise ops of a gradient bucket, and fingerprint and resync_masters_ (what a
 * param holds, and its master resynced after a write, for precis.optim's load
 * detection). One body per op serves the CPU
 * (libprecis.so) and the CUDA kernel (libprecis_cuda.so on torch's current
 * stream); the C entry points check dtypes, sizes and overlaps themselves, but
 * resync_masters_'s, checked here (pr_check_apart, as every op's). */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>

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

/* A new int64 tensor of `numel` elements (0: 0-dim) on like's device (*result, its data
 * *out) for an op's result; false, the call failed, when torch cannot make it. */
static bool pr_new_int64(pr_call_t* call, const pr_tensor_t* like, int64_t numel,
                         AtenTensorHandle* result, void** out) {
  int64_t one = 1;
  if (pr_torch.aoti_torch_empty_strided(numel > 0 ? 1 : 0, &numel, &one, pr_torch.dtype_int64,
                                        like->device_type, like->device_index, result)) {
    *result = NULL;
    return pr_call_fail(call, "cannot allocate the result on %s", pr_device_name(like));
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
    pr_new_int64(&call, &buf, 0, &result, &out);
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

/* How many blocks of `block` (> 0) a run of n (>= 0) takes: the last shorter, and one
 * empty block for an empty run (so that every tensor has an entry). */
static size_t pr_block_count(int64_t n, int64_t block) {
  return n > 0 ? (size_t)((n - 1) / block + 1) : 1;
}

/* fingerprint(Tensor[] bufs) -> Tensor: precis_fingerprint of each buf's bytes, an int64
 * per buf (the uint64's bits) on their device; bufs of any dtype of known size,
 * contiguous, all on one device. fingerprint.blocks(Tensor[] bufs, int block) -> Tensor:
 * precis_fingerprint_blocks of the bufs, blocks of `block` bytes (> 0, a multiple of 8;
 * pr_block_count a buf), an int64 per block, the bufs' one after another: precis.
 * fingerprints' records of params with remainders, as a step's block record. */
static void pr_fingerprint_of(StableIValue* stack, int on, bool blocked) {
  const int64_t block = blocked ? pr_slot_int(stack[1]) : 0;
  pr_call_t call;
  pr_call_start(&call, blocked ? "precis.fingerprint.blocks" : "precis.fingerprint");
  pr_tensor_list_t bufs;
  pr_call_take_tensor_list(&call, stack[0], &bufs, "bufs");
  AtenTensorHandle result = NULL;
  void* out = NULL;
  const void** data = NULL;
  int64_t* nbytes = NULL;
  size_t ranges = 0;
  char what[48];
  bool ok = !call.failed;
  if (ok && bufs.count == 0) ok = pr_call_fail(&call, "bufs is empty (no device to run on)");
  if (ok && blocked && (block <= 0 || block % 8 != 0)) {
    ok = pr_call_fail(&call, "block is %" PRId64 " bytes, must be > 0 and a multiple of 8",
                      block);
  }
  size_t values = 0; /* the result's entries */
  for (size_t i = 0; ok && i < bufs.count; i++) {
    const pr_tensor_t* b = &bufs.items[i];
    values += block ? pr_block_count(b->numel * (int64_t)b->elem_size, block) : 1;
  }
  ranges = bufs.count;
  if (ok) {
    data = pr_call_alloc(&call, ranges, sizeof *data);
    nbytes = pr_call_alloc(&call, ranges, sizeof *nbytes);
    ok = data != NULL && nbytes != NULL;
  }
  for (size_t i = 0; ok && i < bufs.count; i++) {
    const pr_tensor_t* b = &bufs.items[i];
    snprintf(what, sizeof what, "bufs[%zu]", i);
    ok = pr_check_kernel_device(&call, b, what, on) &&
         pr_check_same_device(&call, b, what, &bufs.items[0], "bufs[0]") &&
         pr_check_layout(&call, b, what);
    if (ok && b->elem_size == 0) {
      ok = pr_call_fail(&call, "%s has dtype %s, whose element size is unknown", what,
                        pr_torch_dtype_name(b->torch_dtype));
    }
    if (ok) {
      data[i] = b->data;
      nbytes[i] = b->numel * (int64_t)b->elem_size;
    }
  }
  ok = ok && pr_new_int64(&call, &bufs.items[0], (int64_t)values, &result, &out);
  if (!ok) {
    /* nothing to hash */
  } else if (on == PR_ON_CUDA) {
    pr_cuda_ctx_t cuda;
    if (pr_cuda_begin(&call, bufs.items[0].device_index, &cuda)) {
      pr_call_check(&call,
                    block ? cuda.api->fingerprint_blocks(data, nbytes, (int64_t)ranges, block,
                                                         (uint64_t*)out, cuda.stream)
                          : cuda.api->fingerprint(data, nbytes, (int64_t)ranges,
                                                  (uint64_t*)out, cuda.stream),
                    &cuda);
    }
    pr_cuda_end(&cuda);
  } else {
    pr_call_check(&call,
                  block ? precis_fingerprint_blocks(data, nbytes, (int64_t)ranges, block,
                                                    (uint64_t*)out)
                        : precis_fingerprint(data, nbytes, (int64_t)ranges, (uint64_t*)out),
                  NULL);
  }
  if (call.failed && result) {
    pr_torch.aoti_torch_delete_tensor_object(result);
    result = NULL;
  }
  stack[0] = pr_slot_from_tensor(result); /* torch owns the result */
  pr_call_finish(&call);
}

/* resync_masters_(Tensor(a!)[] masters, Tensor[] params, Tensor stale, Tensor(b!) kept):
 * precis_resync_masters (on CUDA precis_cuda_resync_masters, the flags read there): the
 * masters (fp32, fp16) or remainders (int16, uint8) of the params (bf16 or fp16, masters[i]
 * of params[i]'s numel) where stale (uint8 or a bool viewed so, an entry per param) is
 * set; kept (int64, an entry per param) gets what each still rounded to. All on one
 * device, contiguous; the masters one dtype, the params one dtype.
 * resync_masters_.blocks(..., int block): each master and its param in blocks of `block`
 * elements (pr_block_count), a flag and a kept per block, the params' one after another:
 * the remainders of the blocks written (precis.optim_state.resync_blocks), without a
 * tensor per block. */
static void pr_resync_masters_of(StableIValue* stack, int on, bool blocked) {
  const int64_t block = blocked ? pr_slot_int(stack[4]) : 0;
  pr_call_t call;
  pr_call_start(&call, blocked ? "precis.resync_masters_.blocks" : "precis.resync_masters_");
  pr_tensor_list_t masters, params;
  pr_tensor_t stale, kept;
  pr_call_take_tensor_list(&call, stack[0], &masters, "masters");
  pr_call_take_tensor_list(&call, stack[1], &params, "params");
  pr_call_take_tensor(&call, stack[2], &stale, "stale");
  pr_call_take_tensor(&call, stack[3], &kept, "kept");
  const size_t n = masters.count;
  size_t entries = n; /* a flag each: a param's, or a block's */
  void** mdata = NULL;
  const void** pdata = NULL;
  int64_t* numels = NULL;
  char what[48], each[48];
  bool ok = !call.failed;
  if (ok && params.count != n) {
    ok = pr_call_fail(&call, "masters has %zu tensors but params %zu", n, params.count);
  }
  if (ok && blocked && block <= 0) {
    ok = pr_call_fail(&call, "block is %" PRId64 " elements, must be > 0", block);
  }
  if (ok && blocked) {
    entries = 0;
    for (size_t i = 0; i < n; i++) entries += pr_block_count(params.items[i].numel, block);
  }
  if (blocked) {
    snprintf(each, sizeof each, "block of %" PRId64 " elements", block);
  } else {
    snprintf(each, sizeof each, "param");
  }
  if (ok && (stale.torch_dtype != pr_torch.dtype_uint8 || stale.numel != (int64_t)entries)) {
    ok = pr_call_fail(&call, "stale must hold %zu uint8 values (a flag per %s), got %" PRId64
                      " %s values", entries, each, stale.numel,
                      pr_torch_dtype_name(stale.torch_dtype));
  }
  if (ok && (kept.torch_dtype != pr_torch.dtype_int64 || kept.numel != (int64_t)entries)) {
    ok = pr_call_fail(&call, "kept must hold %zu int64 values (one per %s), got %" PRId64
                      " %s values", entries, each, kept.numel,
                      pr_torch_dtype_name(kept.torch_dtype));
  }
  ok = ok && pr_check_kernel_device(&call, &stale, "stale", on) &&
       pr_check_layout(&call, &stale, "stale") &&
       pr_check_same_device(&call, &kept, "kept", &stale, "stale") &&
       pr_check_layout(&call, &kept, "kept");
  if (ok && n > 0) {
    mdata = pr_call_alloc(&call, entries, sizeof *mdata);
    pdata = pr_call_alloc(&call, entries, sizeof *pdata);
    numels = pr_call_alloc(&call, entries, sizeof *numels);
    ok = mdata != NULL && pdata != NULL && numels != NULL;
  }
  for (size_t i = 0, at = 0; ok && i < n; i++) {
    const pr_tensor_t *m = &masters.items[i], *p = &params.items[i];
    snprintf(what, sizeof what, "masters[%zu]", i);
    ok = pr_check_same_device(&call, m, what, &stale, "stale") && pr_check_layout(&call, m, what);
    snprintf(what, sizeof what, "params[%zu]", i);
    ok = ok && pr_check_same_device(&call, p, what, &stale, "stale") &&
         pr_check_layout(&call, p, what);
    if (ok && (m->torch_dtype != masters.items[0].torch_dtype ||
               p->torch_dtype != params.items[0].torch_dtype)) {
      ok = pr_call_fail(&call, "masters[%zu] / params[%zu] are %s / %s where masters[0] / "
                        "params[0] are %s / %s: one dtype each", i, i,
                        pr_torch_dtype_name(m->torch_dtype), pr_torch_dtype_name(p->torch_dtype),
                        pr_torch_dtype_name(masters.items[0].torch_dtype),
                        pr_torch_dtype_name(params.items[0].torch_dtype));
    }
    if (ok && m->numel != p->numel) {
      ok = pr_call_fail(&call, "masters[%zu] has %" PRId64 " elements but params[%zu] %" PRId64,
                        i, m->numel, i, p->numel);
    }
    if (ok) {
      const int64_t step = blocked ? block : p->numel;
      const size_t count = blocked ? pr_block_count(p->numel, block) : 1;
      for (size_t k = 0; k < count; k++, at++) {
        const int64_t begin = (int64_t)k * step;
        mdata[at] = (char*)m->data + begin * (int64_t)m->elem_size;
        pdata[at] = (const char*)p->data + begin * (int64_t)p->elem_size;
        numels[at] = p->numel - begin < step ? p->numel - begin : step;
      }
    }
  }
  if (ok) { /* what it writes (masters, kept) apart from all it takes */
    pr_range_t* ranges = pr_call_alloc(&call, 2 * n + 2, sizeof *ranges);
    size_t count = 0;
    ok = ranges != NULL;
    for (size_t i = 0; ok && i < n; i++) {
      pr_add_range(ranges, &count, &masters.items[i], "masters", i, true);
      pr_add_range(ranges, &count, &params.items[i], "params", i, false);
    }
    if (ok) {
      pr_add_range(ranges, &count, &stale, "stale", PR_NO_INDEX, false);
      pr_add_range(ranges, &count, &kept, "kept", PR_NO_INDEX, true);
      ok = pr_check_apart(&call, ranges, count, PR_APART_RULE);
    }
  }
  /* the dtypes (precis codes; the C entry points name a wrong one) */
  precis_dtype_t mdt = n > 0 ? (precis_dtype_t)masters.items[0].dtype : PRECIS_DTYPE_FP32;
  precis_dtype_t pdt = n > 0 ? (precis_dtype_t)params.items[0].dtype : PRECIS_DTYPE_BF16;
  if (ok && n > 0 && (masters.items[0].dtype < 0 || params.items[0].dtype < 0)) {
    ok = pr_call_fail(&call, "masters / params are %s / %s; must be float32, float16, int16 "
                      "or uint8 / bfloat16 or float16",
                      pr_torch_dtype_name(masters.items[0].torch_dtype),
                      pr_torch_dtype_name(params.items[0].torch_dtype));
  }
  if (!ok) {
    /* nothing written */
  } else if (on == PR_ON_CUDA) {
    pr_cuda_ctx_t cuda;
    if (pr_cuda_begin(&call, stale.device_index, &cuda)) {
      pr_call_check(&call,
                    cuda.api->resync_masters(mdata, mdt, pdata, pdt, numels,
                                             (const uint8_t*)stale.data, (int64_t*)kept.data,
                                             (int64_t)entries, cuda.stream),
                    &cuda);
    }
    pr_cuda_end(&cuda);
  } else {
    pr_call_check(&call,
                  precis_resync_masters(mdata, mdt, pdata, pdt, numels, (const uint8_t*)stale.data,
                                        (int64_t*)kept.data, (int64_t)entries),
                  NULL);
  }
  pr_call_finish(&call);
}

PR_KERNEL_PAIR(pr_accumulate)
PR_KERNEL_PAIR(pr_cast)
PR_KERNEL_PAIR(pr_scale)
PR_KERNEL_PAIR(pr_count_nonfinite)
static void pr_fingerprint(StableIValue* stack, int on) { pr_fingerprint_of(stack, on, false); }
static void pr_fingerprint_blocks(StableIValue* stack, int on) {
  pr_fingerprint_of(stack, on, true);
}

PR_KERNEL_PAIR(pr_fingerprint)
PR_KERNEL_PAIR(pr_fingerprint_blocks)
static void pr_resync_masters(StableIValue* stack, int on) {
  pr_resync_masters_of(stack, on, false);
}
static void pr_resync_masters_blocks(StableIValue* stack, int on) {
  pr_resync_masters_of(stack, on, true);
}

PR_KERNEL_PAIR(pr_resync_masters)
PR_KERNEL_PAIR(pr_resync_masters_blocks)

const pr_op_kernels_t pr_bucket_ops[] = {
    {"accumulate_", "accumulate_(Tensor(a!) dst, Tensor src) -> ()", pr_accumulate_cpu,
     pr_accumulate_cuda},
    {"cast_", "cast_(Tensor(a!) dst, Tensor src) -> ()", pr_cast_cpu, pr_cast_cuda},
    {"scale_", "scale_(Tensor(a!) buf, float factor) -> ()", pr_scale_cpu, pr_scale_cuda},
    {"count_nonfinite", "count_nonfinite(Tensor buf) -> Tensor", pr_count_nonfinite_cpu,
     pr_count_nonfinite_cuda},
    {"fingerprint", "fingerprint(Tensor[] bufs) -> Tensor", pr_fingerprint_cpu,
     pr_fingerprint_cuda},
    {"fingerprint.blocks", "fingerprint.blocks(Tensor[] bufs, int block) -> Tensor",
     pr_fingerprint_blocks_cpu, pr_fingerprint_blocks_cuda},
    {"resync_masters_",
     "resync_masters_(Tensor(a!)[] masters, Tensor[] params, Tensor stale, Tensor(b!) kept) -> ()",
     pr_resync_masters_cpu, pr_resync_masters_cuda},
    {"resync_masters_.blocks",
     "resync_masters_.blocks(Tensor(a!)[] masters, Tensor[] params, Tensor stale, "
     "Tensor(b!) kept, int block) -> ()",
     pr_resync_masters_blocks_cpu, pr_resync_masters_blocks_cuda},
};
const size_t pr_bucket_op_count = sizeof pr_bucket_ops / sizeof pr_bucket_ops[0];
