/* step_checks.c - every check of an Adam step's arguments, before anything is
 * written: the list lengths, each param's tensors (device, layout, dtypes, sizes),
 * the scalars, the rule's lists (what it reads must be there, what it would ignore
 * must not), and aliasing (no buffer the step writes may overlap another).
 * precis::adam_step_ and precis::adam_step_flat_ share them (step_op.h); a failure
 * is recorded in the call, in adam_step_'s words (its lists).
 */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "step_op.h"
#include "flat_table.h"

const char* const pr_list_names[PR_LIST_COUNT] = {
    "params", "grads", "masters", "exp_avgs", "exp_avg_sqs", "exp_avg_scales",
    "exp_avg_sq_scales", "max_exp_avg_sqs", "max_exp_avg_sq_scales", "outputs"};


/* Lists that may be empty ("absent for every param"): a moment the rule does not
 * read too (outputs: checked by pr_check_rule_lists). */
static bool pr_list_optional(int l, pr_rule_use_t reads) {
  if (l == PR_EXP_AVGS) return !reads.m;
  if (l == PR_EXP_AVG_SQS) return !reads.v;
  return l != PR_PARAMS && l != PR_GRADS;
}

/* The rule's own lists (rules.h's pr_rules): a known rule, amsgrad only where the rule
 * takes it, outputs exactly for a rule that writes no params, lr_scales only for a rule
 * that takes them ([] or one finite scale >= 0 per param). */
static bool pr_check_rule_lists(pr_call_t* call, const pr_step_args_t* a, pr_rule_use_t reads) {
  size_t n = a->lists[PR_PARAMS].count, outputs = a->lists[PR_OUTPUTS].count;
  const char* rule = pr_rule_name(a->cfg.rule);
  char names[256];
  if (a->cfg.amsgrad && !pr_rules[a->cfg.rule].amsgrad) {
    return pr_call_fail(call, "amsgrad is True with rule %s; only adam keeps a running max of "
                              "exp_avg_sq", rule);
  }
  if (reads.output && outputs != n) {
    return pr_call_fail(call, "rule %s writes each param's direction to outputs, one tensor per "
                              "param: outputs has %zu entries but params has %zu", rule,
                        outputs, n);
  }
  if (!reads.output && outputs) {
    return pr_call_fail(call, "outputs has %zu entries with rule %s, which writes the params; "
                              "pass [] (only %s writes outputs)", outputs, rule,
                        pr_rule_names_with(offsetof(pr_rule_info_t, param), 0, names,
                                           sizeof names));
  }
  if (a->lr_scales.count && !reads.lr_scales) {
    return pr_call_fail(call,
                        "lr_scales has %zu entries with rule %s; pass [] (only %s take an lr "
                        "scale per param)",
                        a->lr_scales.count, rule,
                        pr_rule_names_with(offsetof(pr_rule_info_t, lr_scales), 1, names,
                                           sizeof names));
  }
  if (a->lr_scales.count && a->lr_scales.count != n) {
    return pr_call_fail(call, "lr_scales has %zu entries but params has %zu (pass [] for lr)",
                        a->lr_scales.count, n);
  }
  for (size_t i = 0; i < a->lr_scales.count; i++) {
    if (!(isfinite(a->lr_scales.items[i]) && a->lr_scales.items[i] >= 0.0)) {
      return pr_call_fail(call, "lr_scales[%zu] is %.17g; must be finite and >= 0", i,
                          a->lr_scales.items[i]);
    }
  }
  return true;
}

/* lrs and weight_decays (adam_step_flat_'s): [] or one finite value >= 0 per param (as
 * the C step checks lr and weight_decay: checked here, since a later C call of the step
 * could refuse its own after an earlier one wrote); lrs not with lr_tensor. */
static bool pr_check_row_hyper(pr_call_t* call, const pr_step_args_t* a) {
  size_t n = a->lists[PR_PARAMS].count;
  const pr_float_list_t* lists[2] = {&a->lrs, &a->weight_decays};
  const char* names[2] = {"lrs", "weight_decays"};
  if (a->lrs.count && a->lr_tensor.count) {
    return pr_call_fail(call, "lrs has %zu entries and lr_tensor is given; pass one (lrs: each "
                              "param's lr on the host, lr_tensor: one lr on the device)",
                        a->lrs.count);
  }
  for (int k = 0; k < 2; k++) {
    if (lists[k]->count && lists[k]->count != n) {
      return pr_call_fail(call, "%s has %zu entries but params has %zu (pass [] for the one "
                                "value of every param)", names[k], lists[k]->count, n);
    }
    for (size_t i = 0; i < lists[k]->count; i++) {
      double v = lists[k]->items[i];
      if (!(isfinite(v) && v >= 0.0)) {
        return pr_call_fail(call, "%s[%zu] is %.17g; must be finite and >= 0", names[k], i, v);
      }
    }
  }
  return true;
}

/* Each moment list with its scales list. */
static const int pr_moment_lists[3][2] = {{PR_EXP_AVGS, PR_EXP_AVG_SCALES},
                                          {PR_EXP_AVG_SQS, PR_EXP_AVG_SQ_SCALES},
                                          {PR_MAX_EXP_AVG_SQS, PR_MAX_EXP_AVG_SQ_SCALES}};

/* (step_op.h) */
const pr_tensor_t* pr_step_entry(const pr_step_args_t* a, size_t i, int l, pr_tensor_t* view) {
  const pr_tensor_list_t* list = &a->lists[l];
  if (list->count == 0) return NULL;
  if (list->items) return &list->items[i];
  const int64_t* row = &a->rows[i * PR_ROW_WIDTH];
  int64_t first, count; /* inside the buffer: step_flat.c checked the row (else empty) */
  if (pr_flat_row_range(row, row[PR_ROW_NUMEL], pr_is_scale_list(l), a->buffers[l].numel,
                        &first, &count) != PR_ROW_OK) {
    first = count = 0;
  }
  *view = a->buffers[l];
  view->handle = NULL;
  view->data = (char*)a->buffers[l].data + first * (int64_t)a->buffers[l].elem_size;
  view->numel = count;
  return view;
}

void pr_step_entries(const pr_step_args_t* a, size_t i, pr_tensor_t views[PR_LIST_COUNT],
                     const pr_tensor_t* out[PR_LIST_COUNT]) {
  for (int l = 0; l < PR_LIST_COUNT; l++) out[l] = pr_step_entry(a, i, l, &views[l]);
}

/* fingerprints: [] or one contiguous int64 tensor of an entry per param, or of those and
 * then the params' block record (pr_step_block_values), on the params' device (the CUDA
 * step records into device memory), for a rule that writes params. */
static bool pr_check_fingerprints(pr_call_t* call, const pr_step_args_t* a,
                                  pr_rule_use_t reads) {
  size_t n = a->lists[PR_PARAMS].count;
  if (a->fingerprints.count == 0) return true;
  if (a->fingerprints.count > 1) {
    return pr_call_fail(call, "fingerprints has %zu entries; pass [] or one tensor (or [out, "
                              "kept] on the CPU, or [out, records, kept]; the flat op also "
                              "[out, records, kept, sums])",
                        a->fingerprints.count);
  }
  const pr_tensor_t* f = &a->fingerprints.items[0];
  if (!reads.param) {
    return pr_call_fail(call, "fingerprints must be [] with rule %s, which writes no params",
                        pr_rule_name(reads.rule));
  }
  const pr_tensor_t* p0 = n ? &a->lists[PR_PARAMS].items[0] : NULL;
  bool on_cpu = !p0 || p0->device_type == pr_torch.device_cpu;
  const int64_t with_blocks = (int64_t)n + pr_step_block_values(a);
  if (f->torch_dtype != pr_torch.dtype_int64 || !f->contiguous ||
      (f->numel != (int64_t)n && (n == 0 || f->numel != with_blocks)) ||
      (p0 ? !pr_same_device(f, p0) : f->device_type != pr_torch.device_cpu)) {
    return pr_call_fail(call, "fingerprints must be a contiguous int64 %s tensor of %zu values "
                              "(one per param), or %" PRId64 " (then each param's blocks of %d "
                              "elements), on the params' device %s; got %" PRId64
                              " %s values on %s%s",
                        on_cpu ? "CPU" : "CUDA", n, with_blocks, PRECIS_FINGERPRINT_BLOCK,
                        p0 ? pr_device_name(p0) : "cpu", f->numel,
                        pr_torch_dtype_name(f->torch_dtype), pr_device_name(f),
                        f->contiguous ? "" : ", not contiguous");
  }
  return true;
}

/* watch: [] or [kept] (fingerprints [out, kept]): one contiguous int64 CPU tensor of an
 * entry per param, for CPU params that a rule writes (the C step refuses any but bf16 or
 * fp16 params with a separate master). */
static bool pr_check_watch(pr_call_t* call, const pr_step_args_t* a, pr_rule_use_t reads) {
  const size_t n = a->lists[PR_PARAMS].count;
  if (a->watch.count == 0) return true;
  const pr_tensor_t* k = &a->watch.items[0];
  const pr_tensor_t* p0 = n ? &a->lists[PR_PARAMS].items[0] : NULL;
  if (!reads.param) {
    return pr_call_fail(call, "fingerprints' kept needs a rule that writes params, not %s",
                        pr_rule_name(reads.rule));
  }
  if (p0 && p0->device_type != pr_torch.device_cpu) {
    return pr_call_fail(call, "fingerprints [out, kept] is the CPU's (params on %s: pass "
                              "[out, records, kept, sums])", pr_device_name(p0));
  }
  if (k->torch_dtype != pr_torch.dtype_int64 || !k->contiguous || k->numel != (int64_t)n ||
      k->device_type != pr_torch.device_cpu) {
    return pr_call_fail(call, "fingerprints[1] (kept) must be a contiguous int64 CPU tensor of "
                              "%zu values (one per param), got %" PRId64 " %s values on %s%s",
                        n, k->numel, pr_torch_dtype_name(k->torch_dtype), pr_device_name(k),
                        k->contiguous ? "" : ", not contiguous");
  }
  return true;
}

/* resync: [] or [records, kept, sums] (fingerprints[1:]), each a contiguous int64 tensor
 * on the params' device (records and kept an entry per param, sums two), for params
 * (bf16 or fp16) whose master or remainders the rule steps (pr_step_args_t.resync). */
static bool pr_check_resync(pr_call_t* call, const pr_step_args_t* a, pr_rule_use_t reads) {
  size_t n = a->lists[PR_PARAMS].count;
  static const char* const names[] = {"records", "kept", "sums"};
  if (a->resync.count == 0) return true;
  if (!reads.param || a->lists[PR_MASTERS].count != n) {
    return pr_call_fail(call, "fingerprints' records, kept and sums need params with a master or "
                              "remainders that rule %s steps (masters has %zu entries, params "
                              "%zu)",
                        pr_rule_name(reads.rule), a->lists[PR_MASTERS].count, n);
  }
  const pr_tensor_t* p0 = n ? &a->lists[PR_PARAMS].items[0] : NULL;
  if (p0 && p0->dtype != PRECIS_DTYPE_BF16 && p0->dtype != PRECIS_DTYPE_FP16) {
    return pr_call_fail(call, "fingerprints' records, kept and sums need bf16 or fp16 params (a "
                              "master or remainders of them), got %s",
                        pr_torch_dtype_name(p0->torch_dtype));
  }
  for (int k = 0; k < 3; k++) {
    const pr_tensor_t* t = &a->resync.items[k];
    const size_t want = k == 2 ? 2 * n : n; /* sums: two a param */
    if (t->torch_dtype != pr_torch.dtype_int64 || !t->contiguous || t->numel != (int64_t)want ||
        (p0 ? !pr_same_device(t, p0) : t->device_type != pr_torch.device_cpu)) {
      return pr_call_fail(call, "fingerprints[%d] (%s) must be a contiguous int64 tensor of "
                                "%zu values (%s a param, on the params' device %s), got "
                                "%" PRId64 " %s values on %s%s", k + 1, names[k], want,
                          k == 2 ? "two" : "one", p0 ? pr_device_name(p0) : "cpu", t->numel,
                          pr_torch_dtype_name(t->torch_dtype), pr_device_name(t),
                          t->contiguous ? "" : ", not contiguous");
    }
  }
  return true;
}

/* block_compare: [] or [records, kept] (fingerprints [out, records, kept]): out holding
 * the params' blocks, records a contiguous int64 tensor of as many values, kept one of an
 * entry per param, both on the params' device, for params with remainders (int16 or
 * 8-bit: every param's master entry) that the rule steps (pr_step_args_t.block_compare). */
static bool pr_check_block_compare(pr_call_t* call, const pr_step_args_t* a,
                                   pr_rule_use_t reads) {
  const size_t n = a->lists[PR_PARAMS].count;
  if (a->block_compare.count == 0) return true;
  if (!reads.param || a->lists[PR_MASTERS].count != n) {
    return pr_call_fail(call, "fingerprints [out, records, kept] needs params with remainders "
                              "that rule %s steps (masters has %zu entries, params %zu)",
                        pr_rule_name(reads.rule), a->lists[PR_MASTERS].count, n);
  }
  pr_tensor_t view;
  for (size_t i = 0; i < n; i++) {
    const pr_tensor_t* master = pr_step_entry(a, i, PR_MASTERS, &view);
    const int mdt = master ? master->dtype : -1;
    if (a->lists[PR_PARAMS].items[i].dtype != PRECIS_DTYPE_BF16 ||
        (mdt != PRECIS_DTYPE_INT16 && mdt != PRECIS_DTYPE_FP8_E4M3)) {
      return pr_call_fail(call, "fingerprints [out, records, kept] needs bf16 params with "
                                "remainders (int16 or uint8), but params[%zu] is %s with a "
                                "%s master",
                          i, pr_torch_dtype_name(a->lists[PR_PARAMS].items[i].torch_dtype),
                          master ? pr_torch_dtype_name(master->torch_dtype)
                                        : "missing");
    }
  }
  const pr_tensor_t* p0 = n ? &a->lists[PR_PARAMS].items[0] : NULL;
  const int64_t values = (int64_t)n + pr_step_block_values(a);
  if (!pr_step_records_blocks(a)) {
    return pr_call_fail(call, "fingerprints [out, records, kept] needs out of %" PRId64
                              " values (an entry a param, then each param's blocks of %d "
                              "elements), got %" PRId64,
                        values, PRECIS_FINGERPRINT_BLOCK, a->fingerprints.items[0].numel);
  }
  static const char* const names[] = {"records", "kept"};
  for (int k = 0; k < 2; k++) {
    const pr_tensor_t* t = &a->block_compare.items[k];
    const int64_t want = k == 0 ? values : (int64_t)n;
    if (t->torch_dtype != pr_torch.dtype_int64 || !t->contiguous || t->numel != want ||
        (p0 ? !pr_same_device(t, p0) : t->device_type != pr_torch.device_cpu)) {
      return pr_call_fail(call, "fingerprints[%d] (%s) must be a contiguous int64 tensor of "
                                "%" PRId64 " values (%s, on the params' device %s), got "
                                "%" PRId64 " %s values on %s%s", k + 1, names[k], want,
                          k == 0 ? "as many as out: the last step's out" : "one a param",
                          p0 ? pr_device_name(p0) : "cpu", t->numel,
                          pr_torch_dtype_name(t->torch_dtype), pr_device_name(t),
                          t->contiguous ? "" : ", not contiguous");
    }
  }
  return true;
}

static bool pr_check_list_lengths(pr_call_t* call, const pr_step_args_t* a) {
  size_t n = a->lists[PR_PARAMS].count;
  if (a->rule < 0 || a->rule >= PRECIS_RULE_COUNT) {
    char rules[256];
    return pr_call_fail(call, "rule is %" PRId64 "; accepted: %s", a->rule,
                        pr_rule_list(rules, sizeof rules));
  }
  pr_rule_use_t reads = pr_rule_use(&a->cfg);
  if (!pr_check_rule_lists(call, a, reads) || !pr_check_row_hyper(call, a)) return false;
  for (int l = PR_GRADS; l < PR_OUTPUTS; l++) {
    size_t got = a->lists[l].count;
    bool optional = pr_list_optional(l, reads);
    if (got != n && !(optional && got == 0)) {
      return pr_call_fail(call, "%s has %zu entries but params has %zu%s", pr_list_names[l], got,
                          n, optional ? " (pass [] when no param has one)" : "");
    }
  }
  size_t steps = a->steps.count, step_tensors = a->step_tensors.count;
  if (step_tensors != 0 && step_tensors != n) {
    return pr_call_fail(call, "step_tensors has %zu entries but params has %zu", step_tensors, n);
  }
  if (step_tensors != 0 && steps != 0) { /* neither would say which it used */
    return pr_call_fail(call, "steps has %zu entries and step_tensors %zu; pass one of them "
                              "(steps: each param's step number on the host, step_tensors: "
                              "on the device) and [] for the other", steps, step_tensors);
  }
  if (steps != n && !(step_tensors && steps == 0)) {
    return pr_call_fail(call, "steps has %zu entries but params has %zu%s", steps, n,
                        step_tensors ? "" : " (pass [] only with step_tensors)");
  }
  const pr_int_list_t* keyed[] = {&a->streams, &a->element_offsets};
  const char* keyed_names[] = {"streams", "element_offsets"};
  for (int k = 0; k < 2; k++) {
    if (keyed[k]->count != 0 && keyed[k]->count != n) {
      return pr_call_fail(call, "%s has %zu entries but params has %zu (pass [] for the "
                                "defaults: stream i, offset 0)", keyed_names[k],
                          keyed[k]->count, n);
    }
  }
  for (size_t i = 0; i < a->element_offsets.count; i++) {
    if (a->element_offsets.items[i] < 0) {
      return pr_call_fail(call, "element_offsets[%zu] is %" PRId64 "; it is the index of the "
                                "param's first element in its whole param (>= 0)", i,
                          a->element_offsets.items[i]);
    }
  }
  const pr_tensor_list_t* singles[] = {&a->found_inf, &a->lr_tensor, &a->inv_grad_scale_tensor};
  const char* names[] = {"found_inf", "lr_tensor", "inv_grad_scale_tensor"};
  for (int s = 0; s < 3; s++) {
    if (singles[s]->count > 1) {
      return pr_call_fail(call, "%s has %zu entries; pass [] or one tensor", names[s],
                          singles[s]->count);
    }
  }
  size_t maxes = a->lists[PR_MAX_EXP_AVG_SQS].count;
  if (a->cfg.amsgrad && maxes != n) {
    return pr_call_fail(call, "amsgrad needs max_exp_avg_sqs, one per param: it has %zu entries "
                              "but params has %zu", maxes, n);
  }
  if (!a->cfg.amsgrad && (maxes || a->lists[PR_MAX_EXP_AVG_SQ_SCALES].count)) {
    return pr_call_fail(call, "max_exp_avg_sqs and max_exp_avg_sq_scales must be [] when amsgrad "
                              "is false");
  }
  if (a->cfg.check_finite && a->found_inf.count == 0) {
    return pr_call_fail(call, "check_finite needs found_inf (a one-element float32 tensor, "
                              "zeroed, on the params' device) to report a NaN/Inf gradient in");
  }
  return pr_check_fingerprints(call, a, reads) && pr_check_resync(call, a, reads) &&
         pr_check_watch(call, a, reads) && pr_check_block_compare(call, a, reads);
}

/* A moment (or its scales) the rule does not read: absent, else refused (the step
 * would leave it as it is, which its caller did not mean). */
static bool pr_check_unread(pr_call_t* call, const pr_step_args_t* a, const pr_tensor_t* t,
                            int l, size_t i) {
  if (!t || t->numel == 0) return true;
  const char* why = l == PR_EXP_AVGS || l == PR_EXP_AVG_SCALES
                        ? "it keeps no momentum buffer with momentum 0"
                        : "it keeps no exp_avg_sq";
  return pr_call_fail(call, "%s[%zu] has %" PRId64 " elements with rule %s, which does not read "
                            "it (%s); pass [] or an empty tensor",
                      pr_list_names[l], i, t->numel, pr_rule_name(a->cfg.rule), why);
}

/* params[i]'s buffers: device, layout, dtype, size. Fills key[] on success. */
static bool pr_check_param(pr_call_t* call, const pr_step_args_t* a, size_t i,
                           int key[PR_KEY_WIDTH]) {
  const pr_rule_use_t reads = pr_rule_use(&a->cfg);
  const pr_tensor_t* p0 = &a->lists[PR_PARAMS].items[0];
  const pr_tensor_t* p = &a->lists[PR_PARAMS].items[i];
  pr_tensor_t views[PR_LIST_COUNT];
  const pr_tensor_t* e[PR_LIST_COUNT];
  pr_step_entries(a, i, views, e);
  char what[64];
  for (int l = 0; l < PR_LIST_COUNT; l++) {
    const pr_tensor_t* t = e[l];
    if (!t || (l != PR_PARAMS && t->numel == 0)) continue; /* empty: absent */
    if (pr_same_device(t, p0) && pr_layout_ok(t)) continue; /* no name to format */
    snprintf(what, sizeof what, "%s[%zu]", pr_list_names[l], i);
    if (!pr_check_same_device(call, t, what, p0, "params[0]") || !pr_check_layout(call, t, what)) {
      return false;
    }
  }
  int64_t n = p->numel;
  const pr_tensor_t* g = e[PR_GRADS];
  if (p->dtype != PRECIS_DTYPE_FP32 && p->dtype != PRECIS_DTYPE_FP16 &&
      p->dtype != PRECIS_DTYPE_BF16) {
    return pr_call_fail(call, "params[%zu] has dtype %s; supported: float32, float16, bfloat16",
                        i, pr_torch_dtype_name(p->torch_dtype));
  }
  if (g->dtype != PRECIS_DTYPE_FP32 && g->dtype != PRECIS_DTYPE_FP16 &&
      g->dtype != PRECIS_DTYPE_BF16) {
    return pr_call_fail(call, "grads[%zu] has dtype %s; supported: float32, float16, bfloat16",
                        i, pr_torch_dtype_name(g->torch_dtype));
  }
  if (g->numel != n) {
    return pr_call_fail(call, "grads[%zu] has %" PRId64 " elements, params[%zu] has %" PRId64, i,
                        g->numel, i, n);
  }
  if (a->steps.count && a->steps.items[i] < 1 && n > 0) {
    return pr_call_fail(call, "steps[%zu] is %" PRId64 "; it is the step number after this "
                              "update (>= 1)", i, a->steps.items[i]);
  }
  const pr_tensor_t* master = e[PR_MASTERS];
  int master_dtype = p->dtype; /* none: the param is its own master */
  if (master && master->numel != 0) {
    master_dtype = master->dtype;
    if (master_dtype != PRECIS_DTYPE_FP32 && master_dtype != PRECIS_DTYPE_FP16 &&
        master_dtype != PRECIS_DTYPE_INT16 && master_dtype != PRECIS_DTYPE_FP8_E4M3) {
      return pr_call_fail(call, "masters[%zu] has dtype %s; supported: float32, float16, int16 "
                                "or uint8 (16- or 8-bit remainders), or an empty tensor for none",
                          i, pr_torch_dtype_name(master->torch_dtype));
    }
    if (master_dtype == p->dtype) { /* the kernel would take the param as its master */
      return pr_call_fail(call, "masters[%zu] has dtype %s, that of params[%zu]: a param of its "
                                "master's dtype is its own master and the tensor would be "
                                "ignored; pass an empty tensor",
                          i, pr_torch_dtype_name(master->torch_dtype), i);
    }
    if ((master_dtype == PRECIS_DTYPE_INT16 || master_dtype == PRECIS_DTYPE_FP8_E4M3) &&
        p->dtype != PRECIS_DTYPE_BF16) {
      return pr_call_fail(call, "masters[%zu] holds %s remainders, which need a bfloat16 param "
                                "(params[%zu] is %s)",
                          i, master_dtype == PRECIS_DTYPE_INT16 ? "int16" : "8-bit (uint8)", i,
                          pr_torch_dtype_name(p->torch_dtype));
    }
    if (master->numel != n) {
      return pr_call_fail(call, "masters[%zu] has %" PRId64 " elements, params[%zu] has %" PRId64,
                          i, master->numel, i, n);
    }
  }
  int64_t scale_count = -1; /* read when a moment is scaled */
  const bool read[3] = {reads.m, reads.v, a->cfg.amsgrad};
  for (int k = 0; k < 3; k++) {
    int l = pr_moment_lists[k][0];
    if (!read[k]) { /* amsgrad's lists without amsgrad are [] (pr_check_list_lengths) */
      if (!pr_check_unread(call, a, e[l], l, i) ||
          !pr_check_unread(call, a, e[pr_moment_lists[k][1]], pr_moment_lists[k][1], i)) {
        return false;
      }
      continue;
    }
    const pr_tensor_t* t = e[l];
    const pr_tensor_t* scales = e[pr_moment_lists[k][1]];
    const char* name = pr_list_names[l];
    const char* scale_name = pr_list_names[pr_moment_lists[k][1]];
    const pr_tensor_t* v = e[PR_EXP_AVG_SQS];
    if (l == PR_MAX_EXP_AVG_SQS && t->torch_dtype != v->torch_dtype) {
      return pr_call_fail(call, "max_exp_avg_sqs[%zu] has dtype %s; the running max of amsgrad "
                                "is kept in exp_avg_sqs[%zu]'s dtype, %s",
                          i, pr_torch_dtype_name(t->torch_dtype), i,
                          pr_torch_dtype_name(v->torch_dtype));
    }
    if (t->dtype != PRECIS_DTYPE_FP32 && t->dtype != PRECIS_DTYPE_FP16 &&
        t->dtype != PRECIS_DTYPE_BF16 && t->dtype != PRECIS_DTYPE_FP8_E4M3) {
      return pr_call_fail(call, "%s[%zu] has dtype %s; supported: float32, float16, bfloat16, "
                                "uint8 (fp8)",
                          name, i, pr_torch_dtype_name(t->torch_dtype));
    }
    if (t->numel != n) {
      return pr_call_fail(call, "%s[%zu] has %" PRId64 " elements, params[%zu] has %" PRId64,
                          name, i, t->numel, i, n);
    }
    bool scaled = t->dtype == PRECIS_DTYPE_FP16 || t->dtype == PRECIS_DTYPE_FP8_E4M3;
    if (scaled && scale_count < 0) scale_count = precis_scale_blocks(n);
    if (scaled && (!scales || scales->dtype != PRECIS_DTYPE_FP32 ||
                   scales->numel != scale_count)) {
      return pr_call_fail(call, "%s[%zu]: %s moments need %" PRId64 " float32 block scales "
                                "(precis_scale_count(%" PRId64 ")), got %" PRId64 " %s values",
                          scale_name, i, pr_torch_dtype_name(t->torch_dtype), scale_count, n,
                          scales ? scales->numel : 0,
                          scales ? pr_torch_dtype_name(scales->torch_dtype) : "float32");
    }
    if (!scaled && scales && scales->numel != 0) {
      return pr_call_fail(call, "%s[%zu] must be empty: %s moments have no scales", scale_name, i,
                          pr_torch_dtype_name(t->torch_dtype));
    }
  }
  const pr_tensor_t* out = e[PR_OUTPUTS]; /* muon_momentum: one per param */
  if (out && out->dtype != PRECIS_DTYPE_FP32 && out->dtype != PRECIS_DTYPE_FP16 &&
      out->dtype != PRECIS_DTYPE_BF16) {
    return pr_call_fail(call, "outputs[%zu] has dtype %s; supported: float32, float16, bfloat16",
                        i, pr_torch_dtype_name(out->torch_dtype));
  }
  if (out && out->numel != n) {
    return pr_call_fail(call, "outputs[%zu] has %" PRId64 " elements, params[%zu] has %" PRId64,
                        i, out->numel, i, n);
  }
  key[0] = p->dtype;
  key[1] = g->dtype;
  key[2] = master_dtype;
  key[3] = reads.m ? e[PR_EXP_AVGS]->dtype : PRECIS_DTYPE_FP32;
  key[4] = reads.v ? e[PR_EXP_AVG_SQS]->dtype : PRECIS_DTYPE_FP32;
  key[5] = out ? out->dtype : PRECIS_DTYPE_FP32;
  return true;
}

/* ---- aliasing: no buffer that is written may overlap any other buffer ------ */

/* A flat list's buffer, named for an overlap (pr_check_apart). */
static const char* const pr_buffer_names[PR_LIST_COUNT] = {
    "the buffer of params", "the buffer of grads", "the buffer of masters",
    "the buffer of exp_avgs", "the buffer of exp_avg_sqs", "the buffer of exp_avg_scales",
    "the buffer of exp_avg_sq_scales", "the buffer of max_exp_avg_sqs",
    "the buffer of max_exp_avg_sq_scales", "the buffer of outputs"};
static const char* const pr_resync_names[3] = {
    "fingerprints[1] (records)", "fingerprints[2] (kept)", "fingerprints[3] (sums)"};
static const char* const pr_block_compare_names[2] = {"fingerprints[1] (records)",
                                                      "fingerprints[2] (kept)"};
static const char* const pr_read_scalar_names[3] = {"lr_tensor", "inv_grad_scale_tensor",
                                                    "a step tensor"};

/* A flat list's views lie in its buffer and do not overlap one another
 * (step_flat.c's checks), so its buffer stands for them all: the whole buffer,
 * rows or not, must be apart from every other argument. */
static bool pr_check_aliasing(pr_call_t* call, const pr_step_args_t* a) {
  size_t total = a->found_inf.count + a->fingerprints.count + a->resync.count + a->watch.count +
                 a->block_compare.count +
                 a->lr_tensor.count + a->inv_grad_scale_tensor.count + a->step_tensors.count +
                 a->step_counts.count + 1;
  for (int l = 0; l < PR_LIST_COUNT; l++) total += a->lists[l].items ? a->lists[l].count : 1;
  pr_range_t* ranges = pr_call_alloc(call, total, sizeof(pr_range_t));
  if (!ranges) return false;
  size_t count = 0; /* list by list: each list's tensors tend to be in address order */
  for (int l = 0; l < PR_LIST_COUNT; l++) {
    const pr_tensor_list_t* list = &a->lists[l];
    if (list->count && !list->items) {
      pr_add_range(ranges, &count, &a->buffers[l], pr_buffer_names[l], PR_NO_INDEX, true);
      continue;
    }
    for (size_t i = 0; i < list->count; i++) { /* (grads are only read) */
      pr_add_range(ranges, &count, &list->items[i], pr_list_names[l], i, l != PR_GRADS);
    }
  }
  for (size_t i = 0; i < a->found_inf.count; i++) {
    pr_add_range(ranges, &count, &a->found_inf.items[i], "found_inf", PR_NO_INDEX, true);
  }
  for (size_t i = 0; i < a->fingerprints.count; i++) {
    pr_add_range(ranges, &count, &a->fingerprints.items[i], "fingerprints", PR_NO_INDEX, true);
  }
  for (size_t i = 0; i < a->watch.count; i++) {
    pr_add_range(ranges, &count, &a->watch.items[i], "fingerprints[1] (kept)", PR_NO_INDEX, true);
  }
  for (size_t i = 0; i < a->resync.count && i < 3; i++) { /* (the records are only read) */
    pr_add_range(ranges, &count, &a->resync.items[i], pr_resync_names[i], PR_NO_INDEX, i != 0);
  }
  for (size_t i = 0; i < a->block_compare.count && i < 2; i++) { /* (records only read) */
    pr_add_range(ranges, &count, &a->block_compare.items[i], pr_block_compare_names[i],
                 PR_NO_INDEX, i != 0);
  }
  /* What the step only reads, which the compare's kept (written before the step) must
   * not overlap either: the scalar tensors and the flat op's table. */
  const pr_tensor_list_t* scalars[] = {&a->lr_tensor, &a->inv_grad_scale_tensor,
                                       &a->step_tensors};
  for (size_t s = 0; s < 3; s++) {
    for (size_t i = 0; i < scalars[s]->count; i++) {
      pr_add_range(ranges, &count, &scalars[s]->items[i], pr_read_scalar_names[s], PR_NO_INDEX,
                   false);
    }
  }
  for (size_t i = 0; i < a->step_counts.count; i++) { /* (written after the step) */
    pr_add_range(ranges, &count, &a->step_counts.items[i], "step_counts", PR_NO_INDEX, true);
  }
  if (a->rows && a->lists[PR_PARAMS].count) {
    uintptr_t lo = (uintptr_t)a->rows;
    ranges[count++] = (pr_range_t){
        lo, lo + (uintptr_t)(a->lists[PR_PARAMS].count * PR_ROW_WIDTH * sizeof(int64_t)),
        "the table", PR_NO_INDEX, false};
  }
  return pr_check_apart(call, ranges, count, "every buffer the step writes must be its own");
}

/* ---- the whole call ----------------------------------------------------------- */

/* The call's lists of scalar tensors (found_inf, lr_tensor, inv_grad_scale_tensor: none
 * or one; step_tensors: none or one a param), named as the checks name them. */
enum { PR_SCALAR_LISTS = 4 };
static const char* const pr_scalar_names[PR_SCALAR_LISTS] = {
    "found_inf", "lr_tensor", "inv_grad_scale_tensor", "step_tensors"};
static void pr_scalar_lists(const pr_step_args_t* a,
                            const pr_tensor_list_t* out[PR_SCALAR_LISTS]) {
  out[0] = &a->found_inf;
  out[1] = &a->lr_tensor;
  out[2] = &a->inv_grad_scale_tensor;
  out[3] = &a->step_tensors;
}

/* Whether params[0] is on the kernel's device. If not, the dispatcher picked the
 * kernel by another tensor of the call: the failure names the first tensor on the
 * kernel's device (what a user must move), else says which devices the kernels take. */
static bool pr_check_params_device(pr_call_t* call, const pr_step_args_t* a, int on) {
  int32_t want = on == PR_ON_CUDA ? pr_torch.device_cuda : pr_torch.device_cpu;
  const pr_tensor_t* p0 = &a->lists[PR_PARAMS].items[0];
  if (p0->device_type == want) return true;
  const pr_tensor_list_t* scalars[PR_SCALAR_LISTS];
  pr_scalar_lists(a, scalars);
  const pr_tensor_t* found = NULL;
  char what[64] = "";
  for (int l = 0; l < PR_LIST_COUNT && !found; l++) {
    const pr_tensor_list_t* list = &a->lists[l];
    if (a->rows && l > PR_GRADS) { /* the flat op: its buffer, named in the singular */
      if (a->buffers[l].handle && a->buffers[l].device_type == want) {
        found = &a->buffers[l];
        snprintf(what, sizeof what, "%.*s", (int)strlen(pr_list_names[l]) - 1, pr_list_names[l]);
      }
      continue;
    }
    for (size_t i = 0; list->items && i < list->count && !found; i++) {
      if (list->items[i].device_type == want) {
        found = &list->items[i];
        snprintf(what, sizeof what, "%s[%zu]", pr_list_names[l], i);
      }
    }
  }
  for (int s = 0; s < PR_SCALAR_LISTS && !found; s++) {
    for (size_t i = 0; i < scalars[s]->count && !found; i++) {
      if (scalars[s]->items[i].device_type == want) {
        found = &scalars[s]->items[i];
        if (s == PR_SCALAR_LISTS - 1) { /* step_tensors: one a param */
          snprintf(what, sizeof what, "%s[%zu]", pr_scalar_names[s], i);
        } else {
          snprintf(what, sizeof what, "%s", pr_scalar_names[s]);
        }
      }
    }
  }
  if (!found) return pr_check_kernel_device(call, p0, "params[0]", on);
  return pr_call_fail(call, "params[0] is on %s but %s is on %s: every tensor of a call must "
                            "be on one device", pr_device_name(p0), what, pr_device_name(found));
}

float* pr_step_counts(pr_call_t* call, const pr_tensor_t* t, size_t n, const char* name,
                      const char* per) {
  if (t->torch_dtype != pr_torch.dtype_float32 || t->device_type != pr_torch.device_cpu ||
      !t->contiguous || t->numel != (int64_t)n || !t->data) {
    pr_call_fail(call, "%s must be one contiguous float32 CPU tensor of %zu count%s%s, got "
                       "%" PRId64 " %s values on %s%s", name, n, n == 1 ? "" : "s", per,
                 t->numel, pr_torch_dtype_name(t->torch_dtype), pr_device_name(t),
                 t->contiguous ? "" : ", not contiguous");
    return NULL;
  }
  float* counts = (float*)t->data; /* (read only once a float32 CPU tensor of n) */
  for (size_t i = 0; i < n; i++) {
    /* (NaN fails too; below 2^63 the count + 1 converts to an int64, as torch's copy does) */
    if (!(counts[i] >= 0.0f && counts[i] < 0x1p63f)) {
      pr_call_fail(call, "%s[%zu] is %g; must be a count in [0, 2^63)", name, i,
                   (double)counts[i]);
      return NULL;
    }
  }
  return counts;
}

bool pr_step_check_call(pr_call_t* call, pr_step_args_t* a, double inv_grad_scale, int on,
                        int (**keys_out)[PR_KEY_WIDTH]) {
  size_t n = a->lists[PR_PARAMS].count;
  bool ok = !call->failed && pr_check_list_lengths(call, a);
  if (ok && !(fabs(inv_grad_scale) <= FLT_MAX)) { /* NaN too */
    ok = pr_call_fail(call, "inv_grad_scale must be finite (a float32), got %g", inv_grad_scale);
  }
  int (*keys)[PR_KEY_WIDTH] = ok && n ? pr_call_alloc(call, n, sizeof *keys) : NULL;
  if (ok && n) {
    const pr_tensor_t* p0 = &a->lists[PR_PARAMS].items[0];
    ok = keys && pr_check_params_device(call, a, on);
    const pr_tensor_list_t* scalars[PR_SCALAR_LISTS];
    pr_scalar_lists(a, scalars);
    /* lr_tensor: float64, or float32 as torch's tensor lrs mostly are (the
     * lr-derived constants are then float32 arithmetic, as in torch) */
    a->cfg.lr_float32 =
        a->lr_tensor.count && a->lr_tensor.items[0].torch_dtype == pr_torch.dtype_float32;
    int32_t scalar_dtypes[] = {pr_torch.dtype_float32,
                               a->cfg.lr_float32 ? pr_torch.dtype_float32 : pr_torch.dtype_float64,
                               pr_torch.dtype_float32};
    if (ok && a->lr_tensor.count && !a->cfg.lr_float32 &&
        a->lr_tensor.items[0].torch_dtype != pr_torch.dtype_float64) {
      ok = pr_call_fail(call, "lr_tensor must hold one float64 or float32 value, got %s",
                        pr_torch_dtype_name(a->lr_tensor.items[0].torch_dtype));
    }
    for (int s = 0; ok && s < 3; s++) {
      if (scalars[s]->count) {
        ok = pr_check_scalar(call, &scalars[s]->items[0], pr_scalar_names[s], scalar_dtypes[s],
                             p0, "params[0]");
      }
    }
    char what[48];
    for (size_t i = 0; ok && i < a->step_tensors.count; i++) {
      snprintf(what, sizeof what, "step_tensors[%zu]", i);
      ok = pr_check_scalar(call, &a->step_tensors.items[i], what, pr_torch.dtype_int64, p0,
                           "params[0]");
    }
    for (size_t i = 0; ok && i < n; i++) ok = pr_check_param(call, a, i, keys[i]);
    ok = ok && pr_check_aliasing(call, a);
  }
  *keys_out = keys;
  return ok;
}
