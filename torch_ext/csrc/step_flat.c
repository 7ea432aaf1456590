/* step_flat.c - precis::adam_step_flat_: one Adam/AdamW step over a param group
 * whose state is flat, one buffer per state kind (precis.optim's layout), with a
 * table of where each param's state lies in them (flat_table.h, which
 * fuzz/flat_table.c fuzzes); its .rule overload steps another rule (sgd, lion: no
 * outputs, so not muon_momentum).
 *
 * The arguments are named in the schema below and read by the slot names of
 * pr_flat_slot. Here each row is checked against its param (numel, dtype, shape
 * key, data address) and its buffers (inside them), and the rows against each
 * other (no overlap); then the state goes to the checks and the run adam_step_ has
 * (step_op.h) as buffers and rows, each param's entry a view made when read. So
 * offsets out of range, a numel that overflows, rows that overlap (two views of
 * the same memory) or a step below 1 are refused before anything is written. lrs and
 * weight_decays ([] or one a row) give each row its own lr and weight decay, so that
 * one call steps the params of several param groups (step_op.h's pr_step_args_t); the
 * .rule overload's fingerprints may be [out, records, kept, sums]: then the params are
 * compared with their records and those written since have their masters resynced,
 * before the step (pr_step_args_t.resync), so that a step of a model is one op call;
 * on the CPU they may be [out, kept] (out empty: no record), the step then seeing the
 * writes into params with a master itself (pr_step_args_t.watch).
 * The .counted overload is .rule with step_counts, a float32 CPU tensor of the rows'
 * step counts: each row steps with its count + 1 (torch's float32 `step += 1`; the table's
 * step column unread) and the counts are advanced after the step, so that a step
 * counts its steps without torch ops of its own (each a dispatch that costs a step in a
 * training loop tens of microseconds of host time). The .hyper overload is .counted
 * (step_counts [] or one tensor) with rule_hyper, a rule's own hyperparameters
 * (precis_step_config_t.rule_hyper). The argument lists are documented
 * in torch_ext/precis/ops.py.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "step_op.h"
#include "flat_table.h"

/* The schema's arguments, in order. */
enum pr_flat_slot {
  PR_FLAT_PARAMS,
  PR_FLAT_GRADS,
  PR_FLAT_MASTER,
  PR_FLAT_EXP_AVG,
  PR_FLAT_EXP_AVG_SQ,
  PR_FLAT_EXP_AVG_SCALE,
  PR_FLAT_EXP_AVG_SQ_SCALE,
  PR_FLAT_MAX_EXP_AVG_SQ,
  PR_FLAT_MAX_EXP_AVG_SQ_SCALE,
  PR_FLAT_TABLE,
  PR_FLAT_HYPER, /* ten slots: pr_step_read_hyper's */
  PR_FLAT_FOUND_INF = PR_FLAT_HYPER + 10,
  PR_FLAT_LR_TENSOR,
  PR_FLAT_INV_GRAD_SCALE_TENSOR,
  PR_FLAT_AMSGRAD,
  PR_FLAT_IEEE_SQRT,
  /* the default overload's last two: each row's lr and weight decay ([]: the scalars) */
  PR_FLAT_LRS,
  PR_FLAT_WEIGHT_DECAYS,
  PR_FLAT_RULE = PR_FLAT_IEEE_SQRT + 1, /* the .rule overload's: pr_step_read_rule's four
                                            slots, fingerprints, then lrs, weight_decays */
  PR_FLAT_FINGERPRINTS = PR_FLAT_RULE + 4,
  PR_FLAT_RULE_LRS,
  PR_FLAT_RULE_WEIGHT_DECAYS,
  PR_FLAT_STEP_COUNTS = PR_FLAT_FINGERPRINTS + 1, /* the .counted overload's: step_counts, lrs, */
  PR_FLAT_COUNTED_LRS,                      /* weight_decays */
  PR_FLAT_COUNTED_WEIGHT_DECAYS,
  PR_FLAT_RULE_HYPER = PR_FLAT_STEP_COUNTS + 1, /* the .hyper overload's: .counted's */
  PR_FLAT_HYPER_LRS,                            /* and rule_hyper, then lrs, weight_decays */
  PR_FLAT_HYPER_WEIGHT_DECAYS,
};

/* Each buffer: the list it stands for and its name (a scale list's buffer is read
 * at the table's scale column: pr_is_scale_list). */
static const struct {
  int slot, list;
  const char* name;
} pr_flat_buffers[] = {
    {PR_FLAT_MASTER, PR_MASTERS, "master"},
    {PR_FLAT_EXP_AVG, PR_EXP_AVGS, "exp_avg"},
    {PR_FLAT_EXP_AVG_SQ, PR_EXP_AVG_SQS, "exp_avg_sq"},
    {PR_FLAT_EXP_AVG_SCALE, PR_EXP_AVG_SCALES, "exp_avg_scale"},
    {PR_FLAT_EXP_AVG_SQ_SCALE, PR_EXP_AVG_SQ_SCALES, "exp_avg_sq_scale"},
    {PR_FLAT_MAX_EXP_AVG_SQ, PR_MAX_EXP_AVG_SQS, "max_exp_avg_sq"},
    {PR_FLAT_MAX_EXP_AVG_SQ_SCALE, PR_MAX_EXP_AVG_SQ_SCALES, "max_exp_avg_sq_scale"},
};
#define PR_FLAT_BUFFER_COUNT (sizeof pr_flat_buffers / sizeof pr_flat_buffers[0])

/* The table: int64, on the CPU, contiguous, PR_ROW_WIDTH values per param. */
static const int64_t* pr_flat_rows(pr_call_t* call, const pr_tensor_t* table, size_t n) {
  if (table->torch_dtype != pr_torch.dtype_int64 || table->device_type != pr_torch.device_cpu ||
      !table->contiguous || table->numel != (int64_t)n * PR_ROW_WIDTH) {
    pr_call_fail(call, "table must be a contiguous int64 CPU tensor of %zu x %d values (offset, "
                       "scale offset, numel, stream, step, element offset, shape key, data "
                       "address per param), got %" PRId64 " %s values on %s%s",
                 n, PR_ROW_WIDTH, table->numel,
                 pr_torch_dtype_name(table->torch_dtype), pr_device_name(table),
                 table->contiguous ? "" : ", not contiguous");
    return NULL;
  }
  return (const int64_t*)table->data;
}

/* Row i's range in buffer b (`name`) lies inside it: pr_flat_row_range's check. */
static bool pr_flat_inside(pr_call_t* call, const pr_tensor_t* b, const char* name, bool scales,
                           size_t i, const int64_t* row) {
  int64_t first, count;
  if (pr_flat_row_range(row, row[PR_ROW_NUMEL], scales, b->numel, &first, &count) != PR_ROW_OK) {
    return pr_call_fail(call, "table row %zu: %" PRId64 " elements at %" PRId64 " lie outside "
                              "%s (%" PRId64 " elements)", i, count, first, name, b->numel);
  }
  return true;
}

/* pr_step_check_and_run names what it refuses in adam_step_'s words (its lists);
 * a failure it records gets the key to this op's. */
static void pr_flat_explain(pr_call_t* call) {
  size_t used = strlen(call->message);
  snprintf(call->message + used, sizeof call->message - used,
           " (where this names adam_step_'s lists: entry [i] is table row i; masters, "
           "exp_avgs, exp_avg_sqs and their scales are the master, exp_avg, exp_avg_sq, "
           "*_scale buffers; steps, streams, element_offsets the table's columns)");
}

/* No two rows overlap in the element column (scales: the scale column), or two
 * params would step the same state; `name`: a list of that column, to name the
 * shared entries. */
static bool pr_flat_rows_disjoint(pr_call_t* call, const int64_t* rows, size_t n, bool scales,
                                  const char* name) {
  if (pr_flat_rows_ascending(rows, n, scales)) return true;
  pr_span_t* spans = pr_call_alloc(call, n, sizeof(pr_span_t));
  size_t a, b;
  if (spans && pr_flat_rows_overlap(rows, n, scales, spans, &a, &b)) {
    pr_call_fail(call, "%s[%zu] and %s[%zu] share memory (table rows %zu and %zu overlap in the "
                       "%s column)", name, a, name, b, a, b, scales ? "scale offset" : "offset");
    pr_flat_explain(call);
  }
  return !call->failed;
}

/* list[i] (params or grads) has the shape table row i was made for (its shape key). */
static bool pr_flat_row_shape(pr_call_t* call, const pr_tensor_t* t, const char* list, size_t i,
                              const int64_t* row) {
  int64_t dim = 0, *sizes = NULL;
  if (pr_torch.aoti_torch_get_dim(t->handle, &dim) ||
      pr_torch.aoti_torch_get_sizes(t->handle, &sizes)) {
    return pr_call_fail(call, "cannot read the sizes of %s[%zu]", list, i);
  }
  if (pr_shape_key(dim, sizes) != row[PR_ROW_SHAPE_KEY]) {
    char shape[96];
    int used = snprintf(shape, sizeof shape, "(");
    for (int64_t d = 0; d < dim && used < (int)sizeof shape; d++) {
      used += snprintf(shape + used, sizeof shape - (size_t)used, "%s%" PRId64, d ? ", " : "",
                       sizes[d]);
    }
    if (used < (int)sizeof shape) snprintf(shape + used, sizeof shape - (size_t)used, ")");
    return pr_call_fail(call, "%s[%zu] has shape %s, not that of the param table row %zu was "
                              "made for (its shape key differs: ops.shape_key)", list, i, shape,
                        i);
  }
  return true;
}

/* params[i] is the param its row was made for: params[0]'s dtype (one call steps
 * one layout), the row's shape key (its grad's too, where given: torch.optim refuses a
 * grad of another shape) and, unless the row's is 0, its data address (a param whose memory
 * was replaced, `p.data = ...`, is refused: its caller's record of it, such as a
 * master synced from it, is stale). */
static bool pr_flat_same_param(pr_call_t* call, const pr_tensor_t* first, const pr_tensor_t* param,
                               const pr_tensor_t* grad, size_t i, const int64_t* row) {
  if (param->torch_dtype != first->torch_dtype) {
    return pr_call_fail(call, "params[%zu] has dtype %s, params[0] %s: the params of one call "
                              "share a dtype (one layout)", i,
                        pr_torch_dtype_name(param->torch_dtype),
                        pr_torch_dtype_name(first->torch_dtype));
  }
  if (!pr_flat_row_shape(call, param, "params", i, row) ||
      (grad != NULL && !pr_flat_row_shape(call, grad, "grads", i, row))) {
    return false;
  }
  if (row[PR_ROW_DATA] != 0 && (int64_t)(uintptr_t)param->data != row[PR_ROW_DATA]) {
    return pr_call_fail(call, "params[%zu] lies at another address than the one table row %zu "
                              "was made for (its memory was replaced)", i, i);
  }
  return true;
}

/* The .counted overload's step_counts (the others': NULL, the table's step column): one contiguous
 * float32 CPU tensor of n counts in [0, 2^63), the steps taken so far, advanced by the
 * call (sharing no memory with its other tensors: pr_step_args_t.step_counts). Not with
 * found_inf or check_finite: whether such a step is taken is known only once its flag is
 * read (on a GPU, after the call), so its caller counts it. */
static float* pr_flat_step_counts(pr_call_t* call, const pr_tensor_list_t* given, size_t n,
                                  const pr_step_args_t* a) {
  if (call->failed) return NULL;
  if (given->count != 1) {
    pr_call_fail(call, "step_counts must be one contiguous float32 CPU tensor of %zu counts "
                       "(one a table row), got %zu tensors", n, given->count);
    return NULL;
  }
  float* counts = pr_step_counts(call, given->items, n, "step_counts", " (one a table row)");
  if (counts && (a->found_inf.count != 0 || a->cfg.check_finite)) {
    pr_call_fail(call, "step_counts cannot be given with found_inf or check_finite: whether the "
                       "step is taken is known only once its flag is read, so the caller "
                       "counts it");
    return NULL;
  }
  return counts;
}

/* The overloads' slots after the default's. */
enum pr_flat_overload { PR_FLAT_DEFAULT, PR_FLAT_RULES, PR_FLAT_COUNTED, PR_FLAT_HYPERS };

/* adam_step_flat_, .rule, .counted or .hyper (`overload`). */
static void pr_step_op_flat(StableIValue* stack, int on, enum pr_flat_overload overload) {
  const bool rules = overload != PR_FLAT_DEFAULT;
  /* (step_counts: .counted's one tensor; .hyper's [] or one) */
  const bool takes_counts = overload == PR_FLAT_COUNTED || overload == PR_FLAT_HYPERS;
  const int lrs_slot = overload == PR_FLAT_DEFAULT   ? PR_FLAT_LRS
                       : overload == PR_FLAT_RULES   ? PR_FLAT_RULE_LRS
                       : overload == PR_FLAT_COUNTED ? PR_FLAT_COUNTED_LRS
                                                     : PR_FLAT_HYPER_LRS;
  pr_call_t call;
  pr_call_start(&call, "precis.adam_step_flat_"); /* both overloads */
  pr_step_args_t a;
  memset(&a, 0, sizeof a);
  pr_tensor_t buffers[PR_FLAT_BUFFER_COUNT], table;
  pr_tensor_list_t step_counts = {0, NULL};
  pr_call_take_tensor_list(&call, stack[PR_FLAT_PARAMS], &a.lists[PR_PARAMS], "params");
  pr_call_take_tensor_list(&call, stack[PR_FLAT_GRADS], &a.lists[PR_GRADS], "grads");
  for (size_t k = 0; k < PR_FLAT_BUFFER_COUNT; k++) {
    pr_call_take_tensor(&call, stack[pr_flat_buffers[k].slot], &buffers[k],
                        pr_flat_buffers[k].name);
  }
  pr_call_take_tensor(&call, stack[PR_FLAT_TABLE], &table, "table");
  pr_call_take_tensor_list(&call, stack[PR_FLAT_FOUND_INF], &a.found_inf, "found_inf");
  pr_call_take_tensor_list(&call, stack[PR_FLAT_LR_TENSOR], &a.lr_tensor, "lr_tensor");
  pr_call_take_tensor_list(&call, stack[PR_FLAT_INV_GRAD_SCALE_TENSOR],
                           &a.inv_grad_scale_tensor, "inv_grad_scale_tensor");
  double inv_grad_scale = pr_step_read_hyper(&stack[PR_FLAT_HYPER], stack[PR_FLAT_AMSGRAD],
                                             stack[PR_FLAT_IEEE_SQRT], &a.cfg);
  pr_step_read_rule(rules ? &stack[PR_FLAT_RULE] : NULL, &a);
  if (rules) {
    pr_call_take_tensor_list(&call, stack[PR_FLAT_FINGERPRINTS], &a.fingerprints,
                             "fingerprints");
    pr_step_split_fingerprints(&a);
    if (takes_counts) {
      pr_call_take_tensor_list(&call, stack[PR_FLAT_STEP_COUNTS], &step_counts, "step_counts");
    }
    if (overload == PR_FLAT_HYPERS) pr_step_take_rule_hyper(&call, stack[PR_FLAT_RULE_HYPER], &a);
  }
  pr_call_take_float_list(&call, stack[lrs_slot], &a.lrs, "lrs");
  pr_call_take_float_list(&call, stack[lrs_slot + 1], &a.weight_decays, "weight_decays");
  if (!call.failed && a.rule >= 0 && a.rule < PRECIS_RULE_COUNT && !pr_rules[a.rule].param) {
    pr_call_fail(&call, "rule %s writes outputs, which this op does not take; step it with "
                        "adam_step_", pr_rule_name((int)a.rule));
  }

  for (size_t k = 0; k < PR_FLAT_BUFFER_COUNT && !call.failed && !a.cfg.amsgrad; k++) {
    if (pr_flat_buffers[k].list >= PR_MAX_EXP_AVG_SQS && buffers[k].numel != 0) {
      pr_call_fail(&call, "%s must be an empty tensor when amsgrad is False (it has %" PRId64
                   " elements)", pr_flat_buffers[k].name, buffers[k].numel);
    }
  }
  size_t n = a.lists[PR_PARAMS].count;
  const bool counted = overload == PR_FLAT_COUNTED || step_counts.count;
  float* counts = counted ? pr_flat_step_counts(&call, &step_counts, n, &a) : NULL;
  if (counts != NULL) a.step_counts = step_counts; /* (the aliasing checks: written) */
  const int64_t* rows = call.failed ? NULL : pr_flat_rows(&call, &table, n);
  if (rows != NULL && n > 0) {
    a.steps.count = a.streams.count = a.element_offsets.count = n;
    a.steps.items = pr_call_alloc(&call, n, sizeof(int64_t));
    a.streams.items = pr_call_alloc(&call, n, sizeof(int64_t));
    a.element_offsets.items = pr_call_alloc(&call, n, sizeof(int64_t));
    a.rows = rows;
    for (size_t k = 0; k < PR_FLAT_BUFFER_COUNT; k++) {
      /* (an undefined tensor failed the call; an amsgrad buffer without amsgrad too) */
      if (buffers[k].numel == 0) continue; /* the list stays [] */
      a.lists[pr_flat_buffers[k].list].count = n; /* views made when read (step_op.h) */
      a.buffers[pr_flat_buffers[k].list] = buffers[k];
    }
  }
  for (size_t i = 0; rows != NULL && !call.failed && i < n; i++) {
    const int64_t* row = &rows[i * PR_ROW_WIDTH];
    const pr_tensor_t* param = &a.lists[PR_PARAMS].items[i];
    int64_t param_numel = param->numel, first, count;
    if (pr_flat_row_range(row, param_numel, 0, INT64_MAX, &first, &count) == PR_ROW_BAD_NUMEL) {
      pr_call_fail(&call, "table row %zu: numel %" PRId64 ", params[%zu] has %" PRId64, i,
                   row[PR_ROW_NUMEL], i, param_numel);
      break;
    }
    /* (a grads list of another length is refused with the lists' other checks) */
    const pr_tensor_t* grad = i < a.lists[PR_GRADS].count ? &a.lists[PR_GRADS].items[i] : NULL;
    if (!pr_flat_same_param(&call, &a.lists[PR_PARAMS].items[0], param, grad, i, row)) {
      break;
    }
    a.steps.items[i] = counts ? (int64_t)(counts[i] + 1.0f) : row[PR_ROW_STEP];
    a.streams.items[i] = row[PR_ROW_STREAM];
    a.element_offsets.items[i] = row[PR_ROW_ELEMENT_OFFSET];
    bool inside = true;
    for (size_t k = 0; k < PR_FLAT_BUFFER_COUNT && inside; k++) {
      inside = buffers[k].numel == 0 ||
               pr_flat_inside(&call, &buffers[k], pr_flat_buffers[k].name,
                              pr_is_scale_list(pr_flat_buffers[k].list), i, row);
    }
    if (!inside) break;
  }
  /* Rows that overlap, in each column a present buffer reads (the first such list
   * names them). */
  for (int scales = 0; rows != NULL && !call.failed && scales < 2; scales++) {
    for (size_t k = 0; k < PR_FLAT_BUFFER_COUNT; k++) {
      int list = pr_flat_buffers[k].list;
      if (buffers[k].numel == 0 || pr_is_scale_list(list) != (bool)scales) continue;
      pr_flat_rows_disjoint(&call, rows, n, scales, pr_list_names[list]);
      break;
    }
  }
  /* Every list check, and the aliasing check (the buffers against the params,
   * grads and each other), then the step. */
  if (!call.failed) {
    pr_step_check_and_run(&call, &a, inv_grad_scale, on);
    if (call.failed) pr_flat_explain(&call);
  }
  for (size_t i = 0; counts != NULL && !call.failed && i < n; i++) counts[i] += 1.0f;
  pr_call_finish(&call);
}

static void pr_flat_default(StableIValue* stack, int on) {
  pr_step_op_flat(stack, on, PR_FLAT_DEFAULT);
}
static void pr_flat_rule(StableIValue* stack, int on) { pr_step_op_flat(stack, on, PR_FLAT_RULES); }
static void pr_flat_counted(StableIValue* stack, int on) {
  pr_step_op_flat(stack, on, PR_FLAT_COUNTED);
}
static void pr_flat_hyper(StableIValue* stack, int on) {
  pr_step_op_flat(stack, on, PR_FLAT_HYPERS);
}

PR_KERNEL_PAIR(pr_flat_default)
PR_KERNEL_PAIR(pr_flat_rule)
PR_KERNEL_PAIR(pr_flat_counted)
PR_KERNEL_PAIR(pr_flat_hyper)

/* adam_step_flat_'s arguments, the .rule overload's prefix. */
#define PR_FLAT_ARGS                                                                           \
  "Tensor(a!)[] params, Tensor[] grads, Tensor(b!) master, "                                   \
  "Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq, Tensor(e!) exp_avg_scale, "                      \
  "Tensor(f!) exp_avg_sq_scale, Tensor(h!) max_exp_avg_sq, Tensor(i!) max_exp_avg_sq_scale, "  \
  "Tensor table, float lr, float beta1, float beta2, float eps, float weight_decay, "          \
  "bool adamw, bool maximize, float inv_grad_scale, bool check_finite, int seed, "             \
  "Tensor(g!)[] found_inf, Tensor[] lr_tensor, Tensor[] inv_grad_scale_tensor, "               \
  "bool amsgrad, bool ieee_sqrt"

/* Last, with defaults: a caller (or a saved program) that leaves them out keeps its call. */
#define PR_FLAT_ROW_HYPER "float[] lrs=[], float[] weight_decays=[]"

const pr_op_kernels_t pr_step_flat_ops[] = {
    {"adam_step_flat_", "adam_step_flat_(" PR_FLAT_ARGS ", " PR_FLAT_ROW_HYPER ") -> ()",
     pr_flat_default_cpu, pr_flat_default_cuda},
    /* The rule's arguments as adam_step_.rule's (step_kernels.c says why an overload). */
    {"adam_step_flat_.rule",
     "adam_step_flat_.rule(" PR_FLAT_ARGS ", int rule, float momentum, float dampening, "
     "bool nesterov, Tensor(j!)[] fingerprints, " PR_FLAT_ROW_HYPER ") -> ()",
     pr_flat_rule_cpu, pr_flat_rule_cuda},
    /* .rule with the step counts it advances (an overload: a Tensor[] argument has no
     * default). */
    {"adam_step_flat_.counted",
     "adam_step_flat_.counted(" PR_FLAT_ARGS ", int rule, float momentum, float dampening, "
     "bool nesterov, Tensor(j!)[] fingerprints, Tensor(k!)[] step_counts, " PR_FLAT_ROW_HYPER
     ") -> ()",
     pr_flat_counted_cpu, pr_flat_counted_cuda},
    /* .counted with a rule's own hyperparameters (step_kernels.c's adam_step_.hyper). */
    {"adam_step_flat_.hyper",
     "adam_step_flat_.hyper(" PR_FLAT_ARGS ", int rule, float momentum, float dampening, "
     "bool nesterov, Tensor(j!)[] fingerprints, Tensor(k!)[] step_counts, float[] rule_hyper, "
     PR_FLAT_ROW_HYPER ") -> ()",
     pr_flat_hyper_cpu, pr_flat_hyper_cuda},
};
const size_t pr_step_flat_op_count = sizeof pr_step_flat_ops / sizeof pr_step_flat_ops[0];
