/* step_held.c - precis::hold_step (.rule, .hyper) and precis::held_step_: an adam_step_
 * call held on the C side and made again with only what changes between calls.
 *
 * A small call's host time is mostly torch's conversion of its arguments, 35 of them for
 * adam_step_.rule (lists of tensors each made into a list of new handles). hold_step.X
 * takes the arguments of the overload it names once and keeps them, each tensor by its
 * handle; held_step_(held, params, grads, step_count, lr, inv_grad_scale, found_inf,
 * fingerprints) puts its own in their slots and runs that overload's own kernel on the
 * whole: every tensor is read and checked again, as at every call (a tensor resized or
 * moved in place is still seen), with the same messages; its step is counted here (a
 * released param's kept call, release.py). The params are put in at each call, never
 * held: torch.utils.swap_tensors refuses a param that C++ holds besides its Python
 * object.
 * What the held tensors are (the same state objects, the same settings) is the caller's
 * to keep: Python holds a call only while it finds everything it was made from
 * unchanged. precis_torch_drop_held (ctypes) lets go of the handles. */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "step_op.h"

enum { PR_HELD_MAX_ARGS = 64, PR_HELD_PUT = 7 };

/* What a slot of the held stack holds, read from the target's schema (a single Tensor:
 * put in, or copied, never held as a scalar). */
enum pr_held_kind { PR_HELD_SCALAR, PR_HELD_TENSOR, PR_HELD_LIST, PR_HELD_TENSORS };

/* What held_step_ puts in, in this order: its params, grads, the steps (step_count + 1 a
 * param), lr, inv_grad_scale, [found_inf] and fingerprints: the slot of each in both held
 * overloads (.hyper is .rule and rule_hyper), and its kind (checked against the
 * overload's schema at each hold). The params are never held: torch.utils.swap_tensors,
 * which nn.Module._apply and load_state_dict(assign=True) use, refuses a param that
 * anything but its Python object holds. */
static const int pr_held_put_slots[PR_HELD_PUT] = {
    PR_SLOT_PARAMS, PR_SLOT_GRADS, PR_SLOT_STEPS, PR_SLOT_HYPER + 0 /* lr */,
    PR_SLOT_HYPER + 7 /* inv_grad_scale */, PR_SLOT_FOUND_INF, PR_SLOT_FINGERPRINTS};
static const unsigned char pr_held_put_kinds[PR_HELD_PUT] = {
    PR_HELD_TENSORS, PR_HELD_TENSORS, PR_HELD_LIST,   PR_HELD_SCALAR,
    PR_HELD_SCALAR,  PR_HELD_TENSORS, PR_HELD_TENSORS};

typedef struct pr_held {
  int64_t id;
  const char* target; /* the overload held: "adam_step_.rule" or ".hyper" */
  pr_boxed_kernel_fn run[2]; /* the target's kernels: PR_ON_CPU, PR_ON_CUDA */
  uint64_t num_args;
  StableIValue slots[PR_HELD_MAX_ARGS]; /* owned: a Tensor's handle, a list (a Tensor[]'s
                                         * items too); not the put slots' (kept empty) */
  unsigned char kinds[PR_HELD_MAX_ARGS];
  unsigned char put[PR_HELD_MAX_ARGS]; /* 1 + the held call's argument put in the slot, or 0 */
  int users;                           /* held calls running it */
  bool dropped;                        /* freed by its last user */
} pr_held_t;

/* The held calls: index = id's low 32 bits, checked against the whole id (a dropped
 * call's id names no other). */
static pthread_mutex_t pr_held_lock = PTHREAD_MUTEX_INITIALIZER;
static pr_held_t** pr_held_table;
static size_t pr_held_cap;
static uint64_t pr_held_serial;

/* Each argument's kind in `schema` ("name(T a, T b) -> ..."), into kinds; the count, or
 * -1 when there are more than max or one is optional (a "T?": a heap value C cannot
 * copy). */
static int pr_held_kinds(const char* schema, unsigned char* kinds, int max) {
  const char* c = strchr(schema, '(');
  int count = 0, depth = 0;
  bool start = true;
  for (c = c ? c + 1 : ""; *c && depth >= 0; c++) {
    if (start && *c != ' ') { /* an argument's type: Tensor(a!)[], Tensor, int[], float */
      if (count == max) return -1;
      const char* end = c + strcspn(c, " ");
      if (end[-1] == '?') return -1;
      bool list = end - c >= 2 && end[-2] == '[' && end[-1] == ']';
      bool tensor = strncmp(c, "Tensor", 6) == 0;
      kinds[count++] = list ? (tensor ? PR_HELD_TENSORS : PR_HELD_LIST)
                            : (tensor ? PR_HELD_TENSOR : PR_HELD_SCALAR);
      start = false;
    }
    if (*c == '(') depth++;
    if (*c == ')') depth--;
    if (*c == ',' && depth == 0) start = true;
  }
  return count;
}

/* Frees what slots of these kinds own (every tensor handle under the GIL, once). */
static void pr_held_free_slots(const StableIValue* slots, const unsigned char* kinds,
                               size_t n) {
  int gil = pr_python_hold(); /* (a tensor's last reference may be Python's object) */
  for (size_t k = 0; k < n; k++) {
    if (kinds[k] == PR_HELD_SCALAR || !slots[k]) continue;
    if (kinds[k] == PR_HELD_TENSOR) {
      pr_torch.aoti_torch_delete_tensor_object((AtenTensorHandle)(uintptr_t)slots[k]);
      continue;
    }
    StableListHandle list = (StableListHandle)(uintptr_t)slots[k];
    size_t count = 0;
    if (kinds[k] == PR_HELD_TENSORS && !pr_torch.torch_list_size(list, &count)) {
      for (size_t i = 0; i < count; i++) {
        StableIValue item = 0;
        if (!pr_torch.torch_list_get_item(list, i, &item) && item) {
          pr_torch.aoti_torch_delete_tensor_object((AtenTensorHandle)(uintptr_t)item);
        }
      }
    }
    pr_torch.torch_delete_list(list);
  }
  pr_python_release(gil);
}

/* A copy of a held slot, owned by the caller (a tensor's, a Tensor[]'s items: new handles
 * of the same tensors; a scalar as it is); 0 when out of memory. */
static StableIValue pr_held_copy(StableIValue slot, unsigned char kind) {
  if (kind == PR_HELD_SCALAR) return slot;
  if (kind == PR_HELD_TENSOR) {
    AtenTensorHandle copy = NULL;
    return pr_torch.aoti_torch_new_tensor_handle((AtenTensorHandle)(uintptr_t)slot, &copy)
               ? 0
               : pr_slot_from_tensor(copy);
  }
  StableListHandle from = (StableListHandle)(uintptr_t)slot, list = NULL;
  size_t n = 0;
  if (pr_torch.torch_list_size(from, &n) || pr_torch.torch_new_list_reserve_size(n, &list)) {
    return 0; /* (a held list's size is read as at its hold: only memory fails it) */
  }
  for (size_t i = 0; i < n; i++) {
    StableIValue item = 0;
    bool ok = !pr_torch.torch_list_get_item(from, i, &item);
    if (ok && kind == PR_HELD_TENSORS) {
      item = pr_held_copy(item, PR_HELD_TENSOR);
      ok = item != 0;
    }
    if (!ok || pr_torch.torch_list_push_back(list, item)) {
      unsigned char tensor = PR_HELD_TENSOR, k = kind;
      if (ok && kind == PR_HELD_TENSORS) pr_held_free_slots(&item, &tensor, 1);
      pr_held_free_slots(&(StableIValue){(StableIValue)(uintptr_t)list}, &k, 1);
      return 0;
    }
  }
  return (StableIValue)(uintptr_t)list;
}

/* hold_step.X: the arguments of target X kept (owned from here), their id returned. */
static void pr_hold(StableIValue* stack, uint64_t num_args, const char* target) {
  pr_call_t call;
  pr_call_start(&call, "precis.hold_step");
  const pr_op_kernels_t* op = NULL;
  for (size_t i = 0; i < pr_step_op_count; i++) {
    if (strcmp(pr_step_ops[i].name, target) == 0) op = &pr_step_ops[i];
  }
  unsigned char kinds[PR_HELD_MAX_ARGS];
  int count = op ? pr_held_kinds(op->schema, kinds, PR_HELD_MAX_ARGS) : -1;
  for (int j = 0; count >= 0 && j < PR_HELD_PUT; j++) { /* (the put slots' kinds) */
    int k = pr_held_put_slots[j];
    if (k >= count || kinds[k] != pr_held_put_kinds[j]) count = -1;
  }
  if (count < 0 || (uint64_t)count != num_args) { /* (unreachable: one macro makes both
                                                     * schemas, with nothing optional) */
    pr_call_fail(&call, "%s's schema cannot be held (%d arguments, %llu given)", target,
                 count, (unsigned long long)num_args);
    pr_call_finish(&call); /* (what the slots own is unknown: left, not freed wrongly) */
    return;
  }
  pr_held_t* held = calloc(1, sizeof *held);
  if (held) {
    held->target = target;
    held->run[PR_ON_CPU] = op->cpu;
    held->run[PR_ON_CUDA] = op->cuda;
    held->num_args = num_args;
    memcpy(held->slots, stack, num_args * sizeof *stack);
    memcpy(held->kinds, kinds, sizeof kinds);
    for (int j = 0; j < PR_HELD_PUT; j++) {
      int k = pr_held_put_slots[j];
      held->put[k] = (unsigned char)(j + 1);
      pr_held_free_slots(&held->slots[k], &held->kinds[k], 1); /* (put in at each call) */
      held->slots[k] = 0;
    }
    pthread_mutex_lock(&pr_held_lock);
    size_t index = 0;
    while (index < pr_held_cap && pr_held_table[index]) index++;
    if (index == pr_held_cap && index < UINT32_MAX) {
      size_t cap = pr_held_cap ? 2 * pr_held_cap : 64;
      pr_held_t** grown = realloc(pr_held_table, cap * sizeof *grown);
      if (grown) {
        memset(grown + pr_held_cap, 0, (cap - pr_held_cap) * sizeof *grown);
        pr_held_table = grown;
        pr_held_cap = cap;
      }
    }
    if (index < pr_held_cap) {
      /* (the serial in [1, 2^31): a positive id, never 0) */
      held->id = (int64_t)((pr_held_serial++ % 0x7fffffffu + 1) << 32 | index);
      pr_held_table[index] = held;
    }
    pthread_mutex_unlock(&pr_held_lock);
  }
  if (!held || !held->id) {
    pr_held_free_slots(held ? held->slots : stack, held ? held->kinds : kinds, num_args);
    free(held);
    pr_call_fail(&call, "out of host memory");
  } else {
    stack[0] = (StableIValue)held->id;
  }
  pr_call_finish(&call);
}

/* The held call `id`, its users counted (NULL: none). */
static pr_held_t* pr_held_use(int64_t id) {
  pthread_mutex_lock(&pr_held_lock);
  size_t index = (size_t)(id & 0xffffffff);
  pr_held_t* held = id > 0 && index < pr_held_cap ? pr_held_table[index] : NULL;
  if (held && (held->id != id || held->dropped)) held = NULL;
  if (held) held->users++;
  pthread_mutex_unlock(&pr_held_lock);
  return held;
}

/* A use ended: the call freed when it was dropped meanwhile and this was its last. */
static void pr_held_unuse(pr_held_t** slot) {
  pr_held_t* held = *slot;
  if (!held) return;
  pthread_mutex_lock(&pr_held_lock);
  bool last = --held->users == 0 && held->dropped;
  pthread_mutex_unlock(&pr_held_lock);
  if (last) {
    pr_held_free_slots(held->slots, held->kinds, held->num_args);
    free(held);
  }
}

/* A held call's pr_call_t ended (cleanup): its handles freed, its failure raised. Never
 * failed once the target's kernel ran, so never a second exception while one unwinds. */
static void pr_held_finish(pr_call_t* call) { pr_call_finish(call); }

/* The held call with put[j] (owned: given to the target's kernel, else freed here) in
 * slot pr_held_put_slots[j], through the target's kernel (which frees the stack it is
 * given, and may raise); a failure before it runs is recorded in call (held: NULL for an
 * id not held, which `id` names). */
static void pr_held_run(pr_call_t* call, const pr_held_t* held, int64_t id,
                        const StableIValue put[PR_HELD_PUT], int on) {
  if (!held && !call->failed) {
    pr_call_fail(call, "no held call %lld (dropped, or never held)", (long long)id);
  }
  if (held && !call->failed && held->run[on] == NULL) {
    pr_call_fail(call, "%s has no kernel here", held->target);
  }
  StableIValue run[PR_HELD_MAX_ARGS];
  uint64_t made = 0; /* the held slots copied so far */
  for (; !call->failed && made < held->num_args; made++) {
    uint64_t k = made;
    run[k] = held->put[k] ? put[held->put[k] - 1] : pr_held_copy(held->slots[k], held->kinds[k]);
    if (!held->put[k] && held->kinds[k] != PR_HELD_SCALAR && !run[k]) {
      pr_call_fail(call, "out of host memory");
    }
  }
  if (call->failed) { /* nothing run: every copy made and every argument put in freed */
    for (uint64_t k = 0; k < made; k++) {
      if (!held->put[k]) pr_held_free_slots(&run[k], &held->kinds[k], 1);
    }
    pr_held_free_slots(put, pr_held_put_kinds, PR_HELD_PUT);
    return;
  }
  held->run[on](run, held->num_args, 0);
}

/* held_step_(int held, Tensor(a!)[] params, Tensor[] grads, Tensor(b!) step_count,
 * float lr, float inv_grad_scale, Tensor(c!) found_inf, Tensor(d!)[] fingerprints): the
 * held adam_step_ call with these in its slots (steps: step_count + 1 for each param,
 * found_inf: [found_inf]); then step_count += 1 (float32, as torch's `step += 1`),
 * whatever the verdict: the caller takes a skipped step back when it reads found_inf. */
static void pr_held_step(StableIValue* stack, int on) {
  /* (held: unused on the way out, also when the target's kernel raises: -fexceptions) */
  const int64_t id = pr_slot_int(stack[0]);
  __attribute__((cleanup(pr_held_unuse))) pr_held_t* held = pr_held_use(id);
  __attribute__((cleanup(pr_held_finish))) pr_call_t call;
  pr_call_start(&call, "precis.held_step_");
  pr_tensor_t count;
  pr_call_take_tensor(&call, stack[3], &count, "step_count");
  /* this call's lists, owned here until the target's kernel takes them */
  StableListHandle flags = NULL, steps = NULL;
  StableIValue flag = stack[6];
  if (pr_torch.torch_new_list_reserve_size(1, &flags) ||
      pr_torch.torch_list_push_back(flags, flag)) {
    unsigned char kinds[2] = {PR_HELD_LIST, PR_HELD_TENSOR};
    pr_held_free_slots((StableIValue[2]){(StableIValue)(uintptr_t)flags, flag}, kinds, 2);
    flags = NULL;
    pr_call_fail(&call, "out of host memory");
  }
  /* (no held call: refused by pr_held_run) */
  float* counted = held && !call.failed ? pr_step_counts(&call, &count, 1, "step_count", "")
                                        : NULL;
  const float next = counted ? *counted + 1.0f : 0.0f; /* (torch's float32 `step += 1`) */
  if (counted) { /* steps: step_count + 1 for each of its params (one count steps them all) */
    size_t n = 0;
    bool ok = !pr_torch.torch_list_size((StableListHandle)(uintptr_t)stack[1], &n) &&
              !pr_torch.torch_new_list_reserve_size(n, &steps);
    for (size_t i = 0; ok && i < n; i++) {
      ok = !pr_torch.torch_list_push_back(steps, (StableIValue)(int64_t)next);
    }
    if (!ok) pr_call_fail(&call, "out of host memory");
  }
  const StableIValue put[PR_HELD_PUT] = {stack[1], stack[2], (StableIValue)(uintptr_t)steps,
                                         stack[4], stack[5], (StableIValue)(uintptr_t)flags,
                                         stack[7]};
  pr_held_run(&call, held, id, put, on);
  if (!call.failed) *counted = next; /* (run: counted was checked) */
}

PRECIS_API void precis_torch_drop_held(int64_t id) {
  pthread_mutex_lock(&pr_held_lock);
  size_t index = (size_t)(id & 0xffffffff);
  pr_held_t* held = id > 0 && index < pr_held_cap ? pr_held_table[index] : NULL;
  if (held && held->id == id && !held->dropped) {
    held->dropped = true;
    pr_held_table[index] = NULL;           /* (the index free for another) */
    held = held->users == 0 ? held : NULL; /* else its last user frees it */
  } else {
    held = NULL;
  }
  pthread_mutex_unlock(&pr_held_lock);
  if (held) {
    pr_held_free_slots(held->slots, held->kinds, held->num_args);
    free(held);
  }
}

#define PR_HOLD_KERNEL(fn, target)                                  \
  static void fn(StableIValue* stack, uint64_t n, uint64_t outs) { \
    (void)outs;                                                    \
    pr_hold(stack, n, target);                                     \
  }
PR_HOLD_KERNEL(pr_hold_rule, "adam_step_.rule")
PR_HOLD_KERNEL(pr_hold_hyper, "adam_step_.hyper")
PR_KERNEL_PAIR(pr_held_step)

/* The ops' arguments without their alias annotations: a hold writes nothing. */
#define PR_HOLD_ARGS                                              \
  PR_ADAM_STEP_ARGS_ANNOTATED("", "", "", "", "", "", "", "", "") \
  PR_ADAM_STEP_RULE_ARGS_ANNOTATED("", "")

const pr_op_kernels_t pr_held_ops[] = {
    {"hold_step.rule", "hold_step.rule(" PR_HOLD_ARGS ") -> int", pr_hold_rule, pr_hold_rule},
    {"hold_step.hyper", "hold_step.hyper(" PR_HOLD_ARGS ", float[] rule_hyper) -> int",
     pr_hold_hyper, pr_hold_hyper},
    {"held_step_",
     "held_step_(int held, Tensor(a!)[] params, Tensor[] grads, Tensor(b!) step_count, "
     "float lr, float inv_grad_scale, Tensor(c!) found_inf, Tensor(d!)[] fingerprints) -> ()",
     pr_held_step_cpu, pr_held_step_cuda},
};
const size_t pr_held_op_count = sizeof pr_held_ops / sizeof pr_held_ops[0];
