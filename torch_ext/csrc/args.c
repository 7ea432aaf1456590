/* args.c - a kernel call's bookkeeping (owned handles, allocations, the first
 * failure) and the argument checks every kernel shares. See glue.h. */
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "glue.h"
#include "precis_convert.h"

void pr_call_start(pr_call_t* call, const char* op) {
  memset(call, 0, sizeof *call);
  call->op = op;
}

bool pr_call_fail(pr_call_t* call, const char* fmt, ...) {
  if (call->failed) return false; /* the first failure is the one reported */
  call->failed = true;
  int n = snprintf(call->message, sizeof call->message, "%s: ", call->op);
  if (n < 0 || (size_t)n >= sizeof call->message) return false;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(call->message + n, sizeof call->message - (size_t)n, fmt, ap);
  va_end(ap);
  return false;
}

bool pr_call_check(pr_call_t* call, precis_status_t status, const pr_cuda_ctx_t* ctx) {
  if (status == PRECIS_OK) return true;
  /* Each library keeps its own thread-local last error. */
  const char* detail = ctx ? ctx->api->last_error() : precis_last_error();
  return pr_call_fail(call, "%s [%s]", detail && *detail ? detail : precis_status_string(status),
                      precis_status_string(status));
}

static bool pr_grow(void** array, size_t* cap, size_t count, size_t size) {
  if (count < *cap) return true;
  size_t want = *cap ? *cap * 2 : 16;
  void* grown = realloc(*array, want * size);
  if (!grown) return false;
  *array = grown;
  *cap = want;
  return true;
}

/* The bytes of a call's usual block: its tables for a few hundred params. */
enum { PR_ARENA_BYTES = 64 * 1024, PR_ARENA_ALIGN = 16 };

/* Each thread keeps one usual block between its calls (freed when the thread ends): a
 * call's first block costs no malloc and no free, whose free of a block this large would
 * consolidate the heap (glibc) at every op call. */
static pthread_key_t pr_spare_key;
static pthread_once_t pr_spare_once = PTHREAD_ONCE_INIT;
static bool pr_spare_ok;

static void pr_spare_make_key(void) { pr_spare_ok = pthread_key_create(&pr_spare_key, free) == 0; }

/* The thread's spare usual block (taken: the thread has none until it is given back), or
 * a new one; NULL when out of memory. */
static char* pr_take_usual_block(void) {
  pthread_once(&pr_spare_once, pr_spare_make_key);
  char* block = pr_spare_ok ? pthread_getspecific(pr_spare_key) : NULL;
  if (block) {
    pthread_setspecific(pr_spare_key, NULL);
    return block;
  }
  return malloc(PR_ARENA_BYTES);
}

/* A usual block back to the thread's spare, or freed when it has one. */
static void pr_give_back_usual_block(char* block) {
  if (pr_spare_ok && !pthread_getspecific(pr_spare_key) &&
      pthread_setspecific(pr_spare_key, block) == 0) {
    return;
  }
  free(block);
}

void* pr_call_alloc(pr_call_t* call, size_t count, size_t size) {
  if (call->failed) return NULL;
  count = count ? count : 1;
  size = size ? size : 1;
  if (size > (SIZE_MAX - PR_ARENA_ALIGN) / count) {
    pr_call_fail(call, "out of host memory (%zu x %zu bytes)", count, size);
    return NULL;
  }
  size_t bytes = (count * size + PR_ARENA_ALIGN - 1) & ~(size_t)(PR_ARENA_ALIGN - 1);
  if (bytes > call->arena_cap - call->arena_used) { /* a new block (a large table: its own) */
    size_t cap = bytes > PR_ARENA_BYTES ? bytes : PR_ARENA_BYTES;
    if (!pr_grow((void**)&call->blocks, &call->block_cap, call->block_count, sizeof(void*))) {
      pr_call_fail(call, "out of host memory");
      return NULL;
    }
    char* block = cap == PR_ARENA_BYTES ? pr_take_usual_block() : malloc(cap);
    if (!block) {
      pr_call_fail(call, "out of host memory (%zu x %zu bytes)", count, size);
      return NULL;
    }
    if (cap == PR_ARENA_BYTES && !call->usual) call->usual = block;
    call->blocks[call->block_count++] = block;
    call->arena = block;
    call->arena_used = 0;
    call->arena_cap = cap;
  }
  void* p = call->arena + call->arena_used;
  call->arena_used += bytes;
  return memset(p, 0, bytes);
}

/* The precis dtype of a torch dtype (-1: none) and its element size. */
static int pr_precis_dtype(int32_t torch_dtype, uint8_t* size) {
  int d = -1;
  if (torch_dtype == pr_torch.dtype_float32) {
    d = PRECIS_DTYPE_FP32;
  } else if (torch_dtype == pr_torch.dtype_bfloat16) {
    d = PRECIS_DTYPE_BF16;
  } else if (torch_dtype == pr_torch.dtype_float16) {
    d = PRECIS_DTYPE_FP16;
  } else if (torch_dtype == pr_torch.dtype_uint8) {
    d = PRECIS_DTYPE_FP8_E4M3;
  } else if (torch_dtype == pr_torch.dtype_int16) {
    d = PRECIS_DTYPE_INT16;
  }
  if (d >= 0) {
    *size = (uint8_t)precis_elem_size(d); /* the core's one table of sizes */
  } else if (torch_dtype == pr_torch.dtype_float64 || torch_dtype == pr_torch.dtype_int64) {
    *size = 8;
  } else {
    *size = 0;
  }
  return d;
}

/* Fill *out from an owned handle: argument name (item index of a list, or -1). */
static void pr_describe(pr_call_t* call, AtenTensorHandle h, pr_tensor_t* out, const char* name,
                        long long index) {
  memset(out, 0, sizeof *out);
  out->handle = h;
  out->dtype = -1;
  /* None for a Tensor argument arrives as an undefined tensor, whose properties
   * cannot be read. */
  if (!h || pr_torch.aoti_torch_get_data_ptr(h, &out->data) ||
      pr_torch.aoti_torch_get_numel(h, &out->numel) ||
      pr_torch.aoti_torch_get_dtype(h, &out->torch_dtype) ||
      pr_torch.aoti_torch_get_device_type(h, &out->device_type) ||
      pr_torch.aoti_torch_get_device_index(h, &out->device_index) ||
      pr_torch.aoti_torch_is_contiguous(h, &out->contiguous)) {
    if (index < 0) {
      pr_call_fail(call, "%s is not a defined tensor (None?)", name);
    } else {
      pr_call_fail(call, "%s[%lld] is not a defined tensor (None?)", name, index);
    }
    return;
  }
  if (out->numel > 0 && out->data == NULL &&  /* (its storage freed: resize_(0), as FSDP does) */
      (out->device_type == pr_torch.device_cpu || out->device_type == pr_torch.device_cuda)) {
    char item[24] = "";
    if (index >= 0) snprintf(item, sizeof item, "[%lld]", index);
    pr_call_fail(call, "%s%s has %lld elements but no storage (its storage was freed: resized "
                 "to 0 bytes)", name, item, (long long)out->numel);
    out->dtype = -1;
    return;
  }
  out->dtype = pr_precis_dtype(out->torch_dtype, &out->elem_size);
}

/* The call owns the handles of tensors[0..count) from now on (pr_call_finish
 * frees them); false when it cannot keep the record. */
static bool pr_call_own(pr_call_t* call, pr_tensor_t* tensors, size_t count) {
  if (!pr_grow((void**)&call->owned, &call->owned_cap, call->owned_count, sizeof *call->owned)) {
    return pr_call_fail(call, "out of host memory");
  }
  call->owned[call->owned_count++] = (pr_tensor_list_t){count, tensors};
  return true;
}

void pr_call_take_tensor(pr_call_t* call, StableIValue slot, pr_tensor_t* out, const char* name) {
  AtenTensorHandle h = (AtenTensorHandle)(uintptr_t)slot;
  memset(out, 0, sizeof *out);
  out->dtype = -1;
  if (h && !pr_call_own(call, out, 1)) {
    pr_torch.aoti_torch_delete_tensor_object(h);
    return;
  }
  pr_describe(call, h, out, name, -1);
}

/* A list argument's handle and item count (0 after a failure); NULL, failure
 * recorded, when the list is missing. */
static StableListHandle pr_list_arg(pr_call_t* call, StableIValue slot, const char* name,
                                    size_t* n) {
  StableListHandle list = (StableListHandle)(uintptr_t)slot;
  *n = 0;
  if (!list) {
    pr_call_fail(call, "%s is missing", name);
  } else if (pr_torch.torch_list_size(list, n)) {
    pr_call_fail(call, "cannot read the size of %s", name);
    *n = 0;
  }
  return list;
}

/* The list handle is always deleted, and every item taken: owned by the call,
 * or deleted at once when the call cannot hold it. */
void pr_call_take_tensor_list(pr_call_t* call, StableIValue slot, pr_tensor_list_t* out,
                              const char* name) {
  out->count = 0;
  out->items = NULL;
  size_t n;
  StableListHandle list = pr_list_arg(call, slot, name, &n);
  if (!list) return;
  pr_tensor_t* tensors = n ? pr_call_alloc(call, n, sizeof(pr_tensor_t)) : NULL;
  if (tensors && !pr_call_own(call, tensors, n)) tensors = NULL;
  for (size_t i = 0; i < n; i++) {
    StableIValue item = 0;
    if (pr_torch.torch_list_get_item(list, i, &item)) {
      pr_call_fail(call, "cannot read %s[%zu]", name, i);
      item = 0;
    }
    AtenTensorHandle h = (AtenTensorHandle)(uintptr_t)item;
    if (tensors) {
      pr_describe(call, h, &tensors[i], name, (long long)i);
    } else if (h) {
      pr_torch.aoti_torch_delete_tensor_object(h);
    }
  }
  pr_torch.torch_delete_list(list);
  if (tensors) {
    out->count = n;
    out->items = tensors;
  }
}

void pr_call_take_int_list(pr_call_t* call, StableIValue slot, pr_int_list_t* out,
                           const char* name) {
  out->count = 0;
  out->items = NULL;
  size_t n;
  StableListHandle list = pr_list_arg(call, slot, name, &n);
  if (!list) return;
  int64_t* items = n ? pr_call_alloc(call, n, sizeof(int64_t)) : NULL;
  for (size_t i = 0; items && i < n; i++) {
    StableIValue item = 0;
    if (pr_torch.torch_list_get_item(list, i, &item)) {
      pr_call_fail(call, "cannot read %s[%zu]", name, i);
    }
    items[i] = (int64_t)item;
  }
  pr_torch.torch_delete_list(list);
  if (items) {
    out->count = n;
    out->items = items;
  }
}

void pr_call_take_float_list(pr_call_t* call, StableIValue slot, pr_float_list_t* out,
                             const char* name) {
  pr_int_list_t bits; /* the same 64-bit slots, each a double's bits */
  pr_call_take_int_list(call, slot, &bits, name);
  out->count = 0;
  out->items = bits.count ? pr_call_alloc(call, bits.count, sizeof(double)) : NULL;
  if (!out->items) return;
  for (size_t i = 0; i < bits.count; i++) {
    out->items[i] = pr_slot_double((StableIValue)bits.items[i]);
  }
  out->count = bits.count;
}

void pr_call_finish(pr_call_t* call) {
  int held = call->owned_count ? pr_python_hold() : -1; /* (the GIL once, not a tensor) */
  for (size_t k = 0; k < call->owned_count; k++) {
    for (size_t i = 0; i < call->owned[k].count; i++) {
      AtenTensorHandle h = call->owned[k].items[i].handle;
      if (h) pr_torch.aoti_torch_delete_tensor_object(h);
    }
  }
  pr_python_release(held);
  for (size_t i = 0; i < call->block_count; i++) {
    if (call->blocks[i] == call->usual) {
      pr_give_back_usual_block(call->usual);
    } else {
      free(call->blocks[i]);
    }
  }
  call->usual = NULL;
  free(call->owned);
  free(call->blocks);
  call->owned = NULL;
  call->blocks = NULL;
  call->owned_count = call->block_count = 0;
  call->arena = NULL;
  call->arena_used = call->arena_cap = 0;
  if (call->failed) {
    /* Throws a c10::Error through this C frame (built with -fexceptions); the
     * message is copied before anything unwinds. */
    pr_torch.aoti_torch_check(false, call->op, __FILE__, (uint32_t)__LINE__, call->message);
  }
}

/* ---- stack slots ------------------------------------------------------------ */

double pr_slot_double(StableIValue slot) {
  double d;
  memcpy(&d, &slot, sizeof d);
  return d;
}

bool pr_slot_bool(StableIValue slot) { return (slot & 0xff) != 0; }

int64_t pr_slot_int(StableIValue slot) { return (int64_t)slot; }

StableIValue pr_slot_from_tensor(AtenTensorHandle tensor) {
  return (StableIValue)(uintptr_t)tensor;
}

/* ---- shared checks ------------------------------------------------------------ */

const char* pr_torch_dtype_name(int32_t d) {
  static _Thread_local char other[48];
  if (d == pr_torch.dtype_float32) return "float32";
  if (d == pr_torch.dtype_float16) return "float16";
  if (d == pr_torch.dtype_bfloat16) return "bfloat16";
  if (d == pr_torch.dtype_float64) return "float64";
  if (d == pr_torch.dtype_uint8) return "uint8";
  if (d == pr_torch.dtype_int16) return "int16";
  if (d == pr_torch.dtype_int32) return "int32";
  if (d == pr_torch.dtype_int64) return "int64";
  snprintf(other, sizeof other, "another dtype (torch code %" PRId32 ")", d);
  return other;
}

const char* pr_device_name(const pr_tensor_t* t) {
  static _Thread_local char names[2][32];
  static _Thread_local int next;
  char* out = names[next++ & 1]; /* two per message */
  if (t->device_type == pr_torch.device_cpu) return "cpu";
  if (t->device_type == pr_torch.device_cuda) {
    snprintf(out, sizeof names[0], "cuda:%" PRId32, t->device_index);
  } else {
    snprintf(out, sizeof names[0], "device type %" PRId32 ":%" PRId32, t->device_type,
             t->device_index);
  }
  return out;
}

bool pr_check_same_device(pr_call_t* call, const pr_tensor_t* t, const char* what,
                          const pr_tensor_t* ref, const char* ref_what) {
  if (pr_same_device(t, ref)) return true;
  return pr_call_fail(call, "%s is on %s but %s is on %s", what, pr_device_name(t), ref_what,
                      pr_device_name(ref));
}

bool pr_check_kernel_device(pr_call_t* call, const pr_tensor_t* t, const char* what, int on) {
  int32_t want = on == PR_ON_CUDA ? pr_torch.device_cuda : pr_torch.device_cpu;
  if (t->device_type == want) return true;
  return pr_call_fail(call, "%s is on %s; precis kernels run on cpu and cuda tensors", what,
                      pr_device_name(t));
}

bool pr_check_layout(pr_call_t* call, const pr_tensor_t* t, const char* what) {
  if (pr_layout_ok(t)) return true;
  if (!t->contiguous) return pr_call_fail(call, "%s must be contiguous", what);
  size_t size = t->elem_size;
  if (size > 1 && (uintptr_t)t->data % size != 0) {
    return pr_call_fail(call, "%s is not aligned to its %zu-byte elements (address %p)", what,
                        size, t->data);
  }
  return true;
}

bool pr_check_scalar(pr_call_t* call, const pr_tensor_t* t, const char* what, int32_t torch_dtype,
                     const pr_tensor_t* ref, const char* ref_what) {
  if (t->torch_dtype != torch_dtype || t->numel != 1) {
    return pr_call_fail(call, "%s must hold one %s value, got %" PRId64 " %s values", what,
                        pr_torch_dtype_name(torch_dtype), t->numel,
                        pr_torch_dtype_name(t->torch_dtype));
  }
  return pr_check_same_device(call, t, what, ref, ref_what) && pr_check_layout(call, t, what);
}

/* ---- overlaps: what an op writes apart from everything else it takes ---------- */

void pr_add_range(pr_range_t* ranges, size_t* count, const pr_tensor_t* t, const char* name,
                  size_t index, bool written) {
  if (t->numel == 0) return; /* (no bytes: nothing to overlap) */
  uintptr_t lo = (uintptr_t)t->data;
  ranges[(*count)++] =
      (pr_range_t){lo, lo + (uintptr_t)t->numel * t->elem_size, name, index, written};
}

static const char* pr_range_name(const pr_range_t* r, char* buf, size_t cap) {
  if (r->index == PR_NO_INDEX) return r->name;
  snprintf(buf, cap, "%s[%zu]", r->name, r->index);
  return buf;
}

/* Merges the sorted runs a[0..na) and b[0..nb) into out; ties keep a's first. */
static void pr_merge_ranges(const pr_range_t* a, size_t na, const pr_range_t* b, size_t nb,
                            pr_range_t* out) {
  size_t i = 0, j = 0;
  while (i < na && j < nb) *out++ = b[j].lo < a[i].lo ? b[j++] : a[i++];
  while (i < na) *out++ = a[i++];
  while (j < nb) *out++ = b[j++];
}

/* ranges sorted by address (stable), in ranges or in a buffer of the call.
 * A natural merge sort: tensors allocated in param order give each list a few
 * long runs (ascending from the heap; descending, as mmap'd blocks come, is
 * reversed), which it merges in O(n) passes; O(n log n) at worst. */
static pr_range_t* pr_sort_ranges(pr_call_t* call, pr_range_t* ranges, size_t n) {
  size_t* ends = pr_call_alloc(call, n + 1, sizeof(size_t));
  pr_range_t* spare = pr_call_alloc(call, n, sizeof(pr_range_t));
  if (!ends || !spare) return NULL;
  size_t runs = 0;
  for (size_t start = 0; start < n;) {
    size_t end = start + 1;
    if (end < n && ranges[end].lo < ranges[start].lo) { /* strictly descending */
      while (end < n && ranges[end].lo < ranges[end - 1].lo) end++;
      for (size_t i = start, j = end - 1; i < j; i++, j--) {
        pr_range_t t = ranges[i];
        ranges[i] = ranges[j];
        ranges[j] = t;
      }
    } else {
      while (end < n && ranges[end].lo >= ranges[end - 1].lo) end++;
    }
    ends[runs++] = end;
    start = end;
  }
  while (runs > 1) { /* merge neighbouring runs pairwise */
    size_t merged = 0;
    for (size_t k = 0, start = 0; k < runs; k += 2) {
      size_t mid = ends[k], end = k + 1 < runs ? ends[k + 1] : mid;
      pr_merge_ranges(ranges + start, mid - start, ranges + mid, end - mid, spare + start);
      ends[merged++] = end;
      start = end;
    }
    runs = merged;
    pr_range_t* t = ranges;
    ranges = spare;
    spare = t;
  }
  return ranges;
}

bool pr_check_apart(pr_call_t* call, pr_range_t* ranges, size_t count, const char* rule) {
  ranges = pr_sort_ranges(call, ranges, count);
  if (!ranges) return false;
  /* Sweep in address order, keeping the furthest-reaching range seen so far
   * and the furthest-reaching written one. */
  const pr_range_t* reach_any = NULL;
  const pr_range_t* reach_written = NULL;
  for (size_t k = 0; k < count; k++) {
    const pr_range_t* r = &ranges[k];
    const pr_range_t* hit = r->written ? reach_any : reach_written;
    if (hit && hit->hi > r->lo) {
      char x[96], y[96];
      return pr_call_fail(call, "%s and %s share memory; %s", pr_range_name(hit, x, sizeof x),
                          pr_range_name(r, y, sizeof y), rule);
    }
    if (!reach_any || r->hi > reach_any->hi) reach_any = r;
    if (r->written && (!reach_written || r->hi > reach_written->hi)) reach_written = r;
  }
  return true;
}

bool pr_cuda_begin(pr_call_t* call, int32_t device_index, pr_cuda_ctx_t* ctx) {
  const char* why = NULL;
  ctx->guard = NULL;
  ctx->stream = NULL;
  ctx->api = pr_cuda_api(&why);
  if (!ctx->api) return pr_call_fail(call, "%s", why);
  if (pr_torch.aoti_torch_create_device_guard(device_index, &ctx->guard)) {
    ctx->guard = NULL;
    return pr_call_fail(call, "cannot switch to cuda:%" PRId32, device_index);
  }
  if (pr_torch.aoti_torch_get_current_cuda_stream(device_index, &ctx->stream)) {
    return pr_call_fail(call, "cannot get the current CUDA stream of cuda:%" PRId32,
                        device_index);
  }
  return true;
}

void pr_cuda_end(pr_cuda_ctx_t* ctx) {
  if (ctx->guard) pr_torch.aoti_torch_delete_device_guard(ctx->guard);
  ctx->guard = NULL;
}
