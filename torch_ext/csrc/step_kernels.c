/* step_kernels.c - precis::adam_step_ (and its .rule overload) and
 * precis::check_finite_.
 *
 * One adam_step_ call updates a list of params in place. Its kernel checks
 * every argument (step_checks.c), groups the params by dtype combination (param,
 * grad, master, exp_avg, exp_avg_sq, output) into one precis_step_tensors_t each,
 * then makes one C call per combination: precis_step on the CPU, precis_cuda_step on
 * torch's current stream of the params' device. Stochastic rounding is keyed by
 * each param's stream and element offset (streams, element_offsets), never by
 * the param's place in the call or its combination. With check_finite over
 * several combinations, every gradient is checked first, so the step is all
 * or nothing. The argument lists are documented in torch_ext/precis/ops.py.
 */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "step_op.h"

/* The slot of each list (the schema appends the amsgrad ones, the .rule overload
 * outputs). */
static const int pr_list_slots[PR_LIST_COUNT] = {
    PR_SLOT_PARAMS,         PR_SLOT_GRADS,          PR_SLOT_MASTERS,
    PR_SLOT_EXP_AVGS,       PR_SLOT_EXP_AVG_SQS,    PR_SLOT_EXP_AVG_SCALES,
    PR_SLOT_EXP_AVG_SQ_SCALES, PR_SLOT_MAX_EXP_AVG_SQS, PR_SLOT_MAX_EXP_AVG_SQ_SCALES,
    PR_SLOT_OUTPUTS};

/* The tensors of one dtype combination, as the C entry points take them. */
typedef struct pr_combo {
  int key[PR_KEY_WIDTH]; /* dtype codes: param, grad, master, exp_avg, exp_avg_sq, output */
  double lr, weight_decay; /* its params' (pr_step_args_t's lrs, weight_decays), or cfg's */
  size_t count;
  precis_step_tensors_t tensors;
  const int64_t** device_steps; /* CUDA with step_tensors: one device pointer per tensor */
  size_t* params_index;         /* with fingerprints: tensor j's index in params */
  int64_t blocks;               /* its tensors' entries in a block record */
} pr_combo_t;

/* ---- planning: one precis_step_tensors_t per dtype combination (and per lr and
 * weight decay, where each param has its own) ----------------------------------- */

/* Param i's lr and weight decay: its own (adam_step_flat_'s lrs, weight_decays), else
 * the call's. */
static double pr_row_lr(const pr_step_args_t* a, size_t i) {
  return a->lrs.count ? a->lrs.items[i] : a->cfg.lr;
}
static double pr_row_weight_decay(const pr_step_args_t* a, size_t i) {
  return a->weight_decays.count ? a->weight_decays.items[i] : a->cfg.weight_decay;
}

static pr_combo_t* pr_plan(pr_call_t* call, const pr_step_args_t* a,
                           const int (*keys)[PR_KEY_WIDTH], size_t* combo_count, int on) {
  const pr_rule_use_t reads = pr_rule_use(&a->cfg);
  size_t n = a->lists[PR_PARAMS].count;
  size_t* combo_of = pr_call_alloc(call, n, sizeof(size_t));
  size_t* first = pr_call_alloc(call, n, sizeof(size_t)); /* a param of each combination */
  size_t* last = pr_call_alloc(call, n, sizeof(size_t));  /* ... and its last so far */
  if (!combo_of || !first || !last) return NULL;
  /* The blocks' compare takes each combination's records and kept as runs (on CUDA the
   * update kernels read them so): a param joins a combination only after its last
   * param (groups of one lr and weight decay that interleave with another's: a
   * combination a run). */
  const bool runs = a->block_compare.count != 0;
  size_t used = 0;
  for (size_t i = 0; i < n; i++) {
    if (a->lists[PR_PARAMS].items[i].numel == 0) continue;
    size_t c = 0;
    while (c < used && !(memcmp(keys[first[c]], keys[i], sizeof keys[i]) == 0 &&
                         pr_row_lr(a, first[c]) == pr_row_lr(a, i) &&
                         pr_row_weight_decay(a, first[c]) == pr_row_weight_decay(a, i) &&
                         (!runs || last[c] + 1 == i))) {
      c++;
    }
    if (c == used) first[used++] = i;
    combo_of[i] = c;
    last[c] = i;
  }
  pr_combo_t* combos = pr_call_alloc(call, used, sizeof(pr_combo_t));
  if (!combos) return NULL;
  for (size_t i = 0; i < n; i++) {
    const int64_t numel = a->lists[PR_PARAMS].items[i].numel;
    if (numel != 0) {
      combos[combo_of[i]].count++;
      combos[combo_of[i]].blocks += pr_step_param_blocks(numel);
    }
  }
  for (size_t c = 0; c < used; c++) {
    pr_combo_t* combo = &combos[c];
    memcpy(combo->key, keys[first[c]], sizeof combo->key);
    combo->lr = pr_row_lr(a, first[c]);
    combo->weight_decay = pr_row_weight_decay(a, first[c]);
    size_t m = combo->count;
    precis_step_tensors_t init = PRECIS_STEP_TENSORS_INIT;
    precis_step_tensors_t* t = &combo->tensors;
    *t = init;
    t->param_dtype = (precis_dtype_t)combo->key[0];
    t->grad_dtype = (precis_dtype_t)combo->key[1];
    t->master_dtype = (precis_dtype_t)combo->key[2];
    t->exp_avg_dtype = (precis_dtype_t)combo->key[3];
    t->exp_avg_sq_dtype = (precis_dtype_t)combo->key[4];
    t->output_dtype = (precis_dtype_t)combo->key[5];
    t->params = pr_call_alloc(call, m, sizeof(void*));
    t->grads = pr_call_alloc(call, m, sizeof(void*));
    t->masters = pr_call_alloc(call, m, sizeof(void*));
    t->exp_avgs = pr_call_alloc(call, m, sizeof(void*));
    t->exp_avg_sqs = pr_call_alloc(call, m, sizeof(void*));
    t->exp_avg_scales = pr_call_alloc(call, m, sizeof(float*));
    t->exp_avg_sq_scales = pr_call_alloc(call, m, sizeof(float*));
    if (reads.output) t->outputs = pr_call_alloc(call, m, sizeof(void*));
    if (a->lr_scales.count) t->lr_scales = pr_call_alloc(call, m, sizeof(double));
    if (a->cfg.amsgrad) {
      t->max_exp_avg_sqs = pr_call_alloc(call, m, sizeof(void*));
      t->max_exp_avg_sq_scales = pr_call_alloc(call, m, sizeof(float*));
    }
    t->numels = pr_call_alloc(call, m, sizeof(int64_t));
    t->steps = pr_call_alloc(call, m, sizeof(int64_t));
    t->streams = pr_call_alloc(call, m, sizeof(uint64_t));
    t->element_offsets = pr_call_alloc(call, m, sizeof(int64_t));
    if (on == PR_ON_CUDA && a->step_tensors.count) {
      combo->device_steps = pr_call_alloc(call, m, sizeof(int64_t*));
    }
    if (a->fingerprints.count) t->param_fingerprints = pr_call_alloc(call, m, sizeof(uint64_t));
    /* (the CPU's, scattered into out after the step; on CUDA a run of out itself) */
    if (pr_step_records_blocks(a) && on != PR_ON_CUDA) {
      t->param_block_fingerprints = pr_call_alloc(call, (size_t)combo->blocks, sizeof(uint64_t));
    }
    /* (the blocks' compare: on the CPU its records gathered and its kept scattered, by
     * pr_run_cpu; on CUDA runs of the tensors themselves, set by pr_run_cuda) */
    if (a->block_compare.count && on != PR_ON_CUDA) {
      t->param_block_records = pr_call_alloc(call, (size_t)combo->blocks, sizeof(uint64_t));
      t->param_blocks_kept = pr_call_alloc(call, m, sizeof(int64_t));
    }
    /* (a combination without a separate master keeps no master to take from the param:
     * its params' kept is their numel) */
    const bool separate = (t->master_dtype == PRECIS_DTYPE_FP32 ||
                           t->master_dtype == PRECIS_DTYPE_FP16) &&
                          t->master_dtype != t->param_dtype;
    if (a->watch.count && separate) t->param_kept = pr_call_alloc(call, m, sizeof(int64_t));
    if (a->fingerprints.count || a->watch.count) {
      combo->params_index = pr_call_alloc(call, m, sizeof(size_t));
    }
    if (call->failed) return NULL;
    combo->count = 0; /* refilled below */
  }
  for (size_t i = 0; i < n; i++) {
    if (a->lists[PR_PARAMS].items[i].numel == 0) continue;
    pr_combo_t* combo = &combos[combo_of[i]];
    precis_step_tensors_t* t = &combo->tensors;
    size_t j = combo->count++;
    pr_tensor_t views[PR_LIST_COUNT];
    const pr_tensor_t* e[PR_LIST_COUNT];
    pr_step_entries(a, i, views, e);
    const pr_tensor_t* master = e[PR_MASTERS];
    const pr_tensor_t* ms = e[PR_EXP_AVG_SCALES];
    const pr_tensor_t* vs = e[PR_EXP_AVG_SQ_SCALES];
    ((void**)t->params)[j] = a->lists[PR_PARAMS].items[i].data;
    if (combo->params_index) combo->params_index[j] = i;
    ((const void**)t->grads)[j] = a->lists[PR_GRADS].items[i].data;
    ((void**)t->masters)[j] = master && master->numel ? master->data : NULL;
    /* a kind the rule does not read may be absent: its table stays NULL below */
    ((void**)t->exp_avgs)[j] = reads.m ? e[PR_EXP_AVGS]->data : NULL;
    ((void**)t->exp_avg_sqs)[j] = reads.v ? e[PR_EXP_AVG_SQS]->data : NULL;
    ((float**)t->exp_avg_scales)[j] = reads.m && ms && ms->numel ? ms->data : NULL;
    ((float**)t->exp_avg_sq_scales)[j] = reads.v && vs && vs->numel ? vs->data : NULL;
    if (reads.output) ((void**)t->outputs)[j] = e[PR_OUTPUTS]->data;
    if (a->lr_scales.count) ((double*)t->lr_scales)[j] = a->lr_scales.items[i];
    if (a->cfg.amsgrad) {
      const pr_tensor_t* xs = e[PR_MAX_EXP_AVG_SQ_SCALES];
      ((void**)t->max_exp_avg_sqs)[j] = e[PR_MAX_EXP_AVG_SQS]->data;
      ((float**)t->max_exp_avg_sq_scales)[j] = xs && xs->numel ? xs->data : NULL;
    }
    ((int64_t*)t->numels)[j] = a->lists[PR_PARAMS].items[i].numel;
    ((uint64_t*)t->streams)[j] = a->streams.count ? (uint64_t)a->streams.items[i] : (uint64_t)i;
    ((int64_t*)t->element_offsets)[j] = a->element_offsets.count ? a->element_offsets.items[i] : 0;
    if (a->step_tensors.count) {
      const void* step = a->step_tensors.items[i].data;
      if (combo->device_steps) {
        combo->device_steps[j] = step;
      } else {
        int64_t value = *(const int64_t*)step; /* host memory on the CPU */
        if (value < 1) {
          pr_call_fail(call, "step_tensors[%zu] holds %" PRId64 "; it is the step number after "
                             "this update (>= 1)", i, value);
          return NULL;
        }
        ((int64_t*)t->steps)[j] = value;
      }
    } else {
      ((int64_t*)t->steps)[j] = a->steps.items[i];
    }
  }
  for (size_t c = 0; c < used; c++) {
    precis_step_tensors_t* t = &combos[c].tensors;
    t->count = combos[c].count;
    /* Tables the C entry points want NULL when the dtypes carry none, and those the
     * rule does not read (their kinds are keyed fp32: no scale tables either). */
    if (t->master_dtype == t->param_dtype) t->masters = NULL;
    if (!reads.m) t->exp_avgs = NULL;
    if (!reads.v) t->exp_avg_sqs = NULL;
    if (t->exp_avg_dtype != PRECIS_DTYPE_FP16 && t->exp_avg_dtype != PRECIS_DTYPE_FP8_E4M3) {
      t->exp_avg_scales = NULL;
    }
    if (t->exp_avg_sq_dtype != PRECIS_DTYPE_FP16 && t->exp_avg_sq_dtype != PRECIS_DTYPE_FP8_E4M3) {
      t->exp_avg_sq_scales = NULL;
      t->max_exp_avg_sq_scales = NULL;
    }
    if (combos[c].device_steps) t->steps = NULL;
  }
  *combo_count = used;
  return combos;
}

/* ---- running ------------------------------------------------------------------ */

/* torch's sqrt where precis follows a torch.optim mode bit for bit: fp32 params,
 * grads and state. Other layouts take IEEE sqrt, as the CUDA kernels do (their
 * CPU and CUDA bits then agree, and the CPU loop stays one pass). */
static precis_sqrt_fn_t pr_sqrt_for(const precis_step_tensors_t* t, precis_sqrt_fn_t torch_sqrt) {
  const precis_dtype_t f32 = PRECIS_DTYPE_FP32;
  bool all_fp32 = t->param_dtype == f32 && t->grad_dtype == f32 && t->master_dtype == f32 &&
                  t->exp_avg_dtype == f32 && t->exp_avg_sq_dtype == f32;
  return all_fp32 ? torch_sqrt : NULL;
}

/* The config of a call's C steps on the CPU: its scalar tensors' values read there. */
static precis_step_config_t pr_cpu_config(const pr_step_args_t* a) {
  precis_step_config_t cfg = a->cfg;
  if (a->lr_tensor.count) {
    const void* lr = a->lr_tensor.items[0].data;
    cfg.lr = cfg.lr_float32 ? (double)*(const float*)lr : *(const double*)lr;
  }
  if (a->inv_grad_scale_tensor.count) {
    cfg.inv_grad_scale = *(const float*)a->inv_grad_scale_tensor.items[0].data;
  }
  return cfg;
}

/* Each combination's C step called with no tensors: its config (the hyperparameters)
 * checked as the step will check it, nothing launched or written; so that the compare's
 * resync, which writes before the steps run, is never followed by their refusal. */
static bool pr_check_configs(pr_call_t* call, const pr_step_args_t* a,
                             const pr_combo_t* combos, size_t count, int on) {
  precis_step_config_t cfg = on == PR_ON_CUDA ? a->cfg : pr_cpu_config(a);
  cfg.check_finite = 0;
  pr_cuda_ctx_t cuda;
  if (on == PR_ON_CUDA && !pr_cuda_begin(call, a->lists[PR_PARAMS].items[0].device_index, &cuda)) {
    return false;
  }
  bool ok = true;
  for (size_t c = 0; ok && c < count; c++) {
    precis_step_tensors_t none = combos[c].tensors;
    none.count = 0;
    none.param_fingerprints = NULL;
    none.param_kept = NULL;
    if (!a->lr_tensor.count) cfg.lr = combos[c].lr;
    cfg.weight_decay = combos[c].weight_decay;
    int32_t found = 0;
    ok = on == PR_ON_CUDA
             ? pr_call_check(call, cuda.api->step(&cfg, &none, NULL, cuda.stream), &cuda)
             : pr_call_check(call, precis_step(&cfg, &none, &found), NULL);
  }
  if (on == PR_ON_CUDA) pr_cuda_end(&cuda);
  return ok;
}

/* out[i] = precis_fingerprint of CPU params[i] as they are now (the compare's, and a
 * skipped call's record). */
static bool pr_fingerprint_params(pr_call_t* call, const pr_step_args_t* a, uint64_t* out) {
  const size_t n = a->lists[PR_PARAMS].count;
  const void** bufs = pr_call_alloc(call, n, sizeof *bufs);
  int64_t* nbytes = pr_call_alloc(call, n, sizeof *nbytes);
  if (!bufs || !nbytes) return false;
  for (size_t i = 0; i < n; i++) {
    const pr_tensor_t* p = &a->lists[PR_PARAMS].items[i];
    bufs[i] = p->data;
    nbytes[i] = p->numel * (int64_t)p->elem_size;
  }
  return pr_call_check(call, precis_fingerprint(bufs, nbytes, (int64_t)n, out), NULL);
}

/* Each param's first entry in the block record (out after the params' entries). */
static int64_t* pr_block_firsts(pr_call_t* call, const pr_step_args_t* a) {
  const size_t n = a->lists[PR_PARAMS].count;
  int64_t* first = pr_call_alloc(call, n ? n : 1, sizeof *first);
  for (size_t i = 0, at = 0; first && i < n; i++) {
    first[i] = (int64_t)at;
    at += (size_t)pr_step_param_blocks(a->lists[PR_PARAMS].items[i].numel);
  }
  return first;
}

/* The block record (out after the params' entries) of the params as they are now: a
 * skipped call's, and on CUDA after steps whose kernels did not keep it; a call a run
 * of params of one element size (their blocks' bytes), on CUDA on cuda's stream. */
static bool pr_blocks_as_found(pr_call_t* call, const pr_step_args_t* a, pr_cuda_ctx_t* cuda) {
  const size_t n = a->lists[PR_PARAMS].count;
  uint64_t* blocks = (uint64_t*)a->fingerprints.items[0].data + n;
  const int64_t* first = pr_block_firsts(call, a);
  const void** bufs = pr_call_alloc(call, n ? n : 1, sizeof *bufs);
  int64_t* nbytes = pr_call_alloc(call, n ? n : 1, sizeof *nbytes);
  bool ok = first != NULL && bufs != NULL && nbytes != NULL;
  for (size_t i = 0; ok && i < n; i++) {
    const pr_tensor_t* p = &a->lists[PR_PARAMS].items[i];
    bufs[i] = p->data;
    nbytes[i] = p->numel * (int64_t)p->elem_size;
  }
  for (size_t i = 0, end; ok && i < n; i = end) {
    const size_t size = a->lists[PR_PARAMS].items[i].elem_size;
    for (end = i + 1; end < n && a->lists[PR_PARAMS].items[end].elem_size == size; end++) {
    }
    const int64_t block = (int64_t)PRECIS_FINGERPRINT_BLOCK * (int64_t)size;
    const int64_t count = (int64_t)(end - i);
    ok = cuda ? pr_call_check(call, cuda->api->fingerprint_blocks(bufs + i, nbytes + i, count,
                                                                  block, blocks + first[i],
                                                                  cuda->stream),
                              cuda)
              : pr_call_check(call, precis_fingerprint_blocks(bufs + i, nbytes + i, count,
                                                              block, blocks + first[i]),
                              NULL);
  }
  return ok;
}

/* A skipped call's record (fingerprints' out): the params as they are, as the CUDA
 * kernels leave it, so that a caller that reads the verdict later (a released param's
 * call) can keep the record either way. */
static void pr_record_as_found(pr_call_t* call, const pr_step_args_t* a) {
  if (a->fingerprints.count && a->lists[PR_PARAMS].count) {
    if (pr_fingerprint_params(call, a, (uint64_t*)a->fingerprints.items[0].data) &&
        pr_step_records_blocks(a)) {
      pr_blocks_as_found(call, a, NULL);
    }
  }
}

/* The blocks' compare on the CPU (pr_step_args_t.block_compare): before the steps each
 * combination's records gathered from records' blocks (scatter 0), after them its kept
 * scattered into kept (scatter 1; an empty param's: 0, its numel). */
static bool pr_block_compare_cpu(pr_call_t* call, const pr_step_args_t* a,
                                 const pr_combo_t* combos, size_t count, int scatter) {
  if (!a->block_compare.count) return true;
  const size_t n = a->lists[PR_PARAMS].count;
  const uint64_t* records = (const uint64_t*)a->block_compare.items[0].data + n;
  int64_t* kept = a->block_compare.items[1].data;
  const int64_t* first = scatter ? NULL : pr_block_firsts(call, a);
  if (!scatter && !first) return false;
  if (scatter) memset(kept, 0, n * sizeof *kept);
  for (size_t c = 0; c < count; c++) {
    const precis_step_tensors_t* t = &combos[c].tensors;
    for (size_t j = 0, at = 0; j < t->count; j++) {
      const size_t i = combos[c].params_index[j], mine = (size_t)pr_step_param_blocks(t->numels[j]);
      if (scatter) {
        kept[i] = t->param_blocks_kept[j];
      } else {
        memcpy((uint64_t*)t->param_block_records + at, records + first[i], mine * sizeof *records);
      }
      at += mine;
    }
  }
  return true;
}

/* A call skipped before its steps ran (found_inf given set, or a NaN in one of several
 * combinations): what a skipped C step does to each (the blocks' compare), then the
 * record of the params as found. */
static void pr_skipped_cpu(pr_call_t* call, const pr_step_args_t* a, const pr_combo_t* combos,
                           size_t count, const precis_step_config_t* cfg) {
  for (size_t c = 0; a->block_compare.count && c < count; c++) {
    if (!pr_call_check(call, precis_step_skipped(cfg, &combos[c].tensors), NULL)) return;
  }
  if (pr_block_compare_cpu(call, a, combos, count, 1)) pr_record_as_found(call, a);
}

static void pr_run_cpu(pr_call_t* call, pr_step_args_t* a, pr_combo_t* combos, size_t count) {
  float* found_inf = a->found_inf.count ? a->found_inf.items[0].data : NULL;
  precis_step_config_t cfg = pr_cpu_config(a);
  if (!pr_block_compare_cpu(call, a, combos, count, 0)) return;
  if (found_inf && *found_inf != 0.0f) { /* skipped before it started */
    cfg.check_finite = 0;
    pr_skipped_cpu(call, a, combos, count, &cfg);
    return;
  }
  int32_t found = 0;
  if (cfg.check_finite && count > 1) { /* all or nothing over several C calls */
    for (size_t c = 0; c < count; c++) {
      if (!pr_call_check(call, precis_step_check_finite(&combos[c].tensors, &found), NULL)) return;
    }
    cfg.check_finite = 0;
    if (found) {
      *found_inf = 1.0f;
      pr_skipped_cpu(call, a, combos, count, &cfg);
      return;
    }
  }
  for (size_t c = 0; c < count; c++) {
    cfg.cpu_sqrt = pr_sqrt_for(&combos[c].tensors, a->cfg.cpu_sqrt);
    if (!a->lr_tensor.count) cfg.lr = combos[c].lr;
    cfg.weight_decay = combos[c].weight_decay;
    if (!pr_call_check(call, precis_step(&cfg, &combos[c].tensors, &found), NULL)) return;
    if (found) { /* only with a single combination: nothing but its compare was written */
      *found_inf = 1.0f;
      if (pr_block_compare_cpu(call, a, combos, count, 1)) pr_record_as_found(call, a);
      return;
    }
  }
  if (!pr_block_compare_cpu(call, a, combos, count, 1)) return;
  if (a->fingerprints.count) { /* each param's, in params' order (an empty param's: 0) */
    uint64_t* out = a->fingerprints.items[0].data;
    memset(out, 0, a->lists[PR_PARAMS].count * sizeof *out);
    for (size_t c = 0; c < count; c++) {
      const precis_step_tensors_t* t = &combos[c].tensors;
      for (size_t j = 0; j < t->count; j++) {
        out[combos[c].params_index[j]] = t->param_fingerprints[j];
      }
    }
  }
  if (pr_step_records_blocks(a)) { /* each param's blocks, in params' order */
    const size_t n = a->lists[PR_PARAMS].count;
    uint64_t* blocks = (uint64_t*)a->fingerprints.items[0].data + n;
    const int64_t* first = pr_block_firsts(call, a);
    if (!first) return;
    memset(blocks, 0, (size_t)pr_step_block_values(a) * sizeof *blocks); /* (empty: 0) */
    for (size_t c = 0; c < count; c++) {
      const precis_step_tensors_t* t = &combos[c].tensors;
      for (size_t j = 0, at = 0; j < t->count; j++) {
        const size_t mine = (size_t)pr_step_param_blocks(t->numels[j]);
        memcpy(blocks + first[combos[c].params_index[j]], t->param_block_fingerprints + at,
               mine * sizeof *blocks);
        at += mine;
      }
    }
  }
  if (a->watch.count) { /* each param's, in params' order (where none was taken: its numel) */
    int64_t* kept = a->watch.items[0].data;
    for (size_t i = 0; i < a->lists[PR_PARAMS].count; i++) {
      kept[i] = a->lists[PR_PARAMS].items[i].numel;
    }
    for (size_t c = 0; c < count; c++) {
      const precis_step_tensors_t* t = &combos[c].tensors;
      for (size_t j = 0; t->param_kept && j < t->count; j++) {
        kept[combos[c].params_index[j]] = t->param_kept[j];
      }
    }
  }
}

/* Whether the combinations (of a call with fingerprints: params_index set) each hold a
 * run of consecutive params in order, and together all n. */
static bool pr_combos_in_runs(const pr_combo_t* combos, size_t count, size_t n) {
  size_t total = 0;
  for (size_t c = 0; c < count; c++) {
    const size_t* index = combos[c].params_index;
    for (size_t j = 1; j < combos[c].count; j++) {
      if (index[j] != index[0] + j) return false;
    }
    total += combos[c].count;
  }
  return total == n;
}

/* The update on CUDA; stale (NULL: none): the compare's flags, which the update kernels
 * read to resync each flagged param's chunks as they step them (with kept, the resync
 * list's), given only when fused (below). A C call that fails leaves the combinations
 * after it neither resynced nor stepped, and the op raises; their record entries,
 * zeroed by the compare, flag them again at the next step, which resyncs them then. */
static void pr_run_cuda(pr_call_t* call, pr_step_args_t* a, pr_combo_t* combos, size_t count,
                        bool fused, const uint8_t* stale) {
  pr_cuda_ctx_t cuda;
  if (pr_cuda_begin(call, a->lists[PR_PARAMS].items[0].device_index, &cuda)) {
    precis_cuda_step_device_args_t dev = PRECIS_CUDA_STEP_DEVICE_ARGS_INIT;
    dev.lr = a->lr_tensor.count ? a->lr_tensor.items[0].data : NULL;
    dev.inv_grad_scale =
        a->inv_grad_scale_tensor.count ? a->inv_grad_scale_tensor.items[0].data : NULL;
    dev.found_inf = a->found_inf.count ? a->found_inf.items[0].data : NULL;
    precis_step_config_t cfg = a->cfg;
    bool ok = true;
    if (cfg.check_finite && count > 1) { /* every update kernel then reads the one flag */
      for (size_t c = 0; ok && c < count; c++) {
        ok = pr_call_check(call, cuda.api->check_finite(&combos[c].tensors, dev.found_inf,
                                                        cuda.stream),
                           &cuda);
      }
      cfg.check_finite = 0;
    }
    /* The record: written by the update kernels themselves when fused (no pass over the
     * params), else a fingerprint of the params after the steps. */
    uint64_t* out = a->fingerprints.count ? a->fingerprints.items[0].data : NULL;
    size_t n = a->lists[PR_PARAMS].count;
    const bool blocks = pr_step_records_blocks(a);
    const int64_t* first = blocks && fused ? pr_block_firsts(call, a) : NULL;
    ok = ok && (!blocks || !fused || first);
    /* the blocks' compare: only fused (pr_step_check_and_run), its records and kept runs */
    const uint64_t* records =
        a->block_compare.count ? (const uint64_t*)a->block_compare.items[0].data + n : NULL;
    int64_t* blocks_kept = a->block_compare.count ? a->block_compare.items[1].data : NULL;
    for (size_t c = 0; ok && c < count; c++) {
      const size_t i0 = combos[c].params_index[0];
      combos[c].tensors.param_fingerprints = fused ? out + i0 : NULL;
      /* (fused: no empty param, a combination's run of params a run of blocks) */
      combos[c].tensors.param_block_fingerprints = first ? out + n + first[i0] : NULL;
      combos[c].tensors.param_block_records = records && first ? records + first[i0] : NULL;
      combos[c].tensors.param_blocks_kept = records && first ? blocks_kept + i0 : NULL;
    }
    dev.fingerprints_zeroed = fused && a->resync.count; /* (by pr_resync's launch) */
    const int64_t* kept = stale ? a->resync.items[1].data : NULL;
    for (size_t c = 0; ok && c < count; c++) {
      dev.steps = combos[c].device_steps;
      dev.stale = stale ? stale + combos[c].params_index[0] : NULL;
      dev.kept = stale ? kept + combos[c].params_index[0] : NULL;
      if (!a->lr_tensor.count) cfg.lr = combos[c].lr;
      cfg.weight_decay = combos[c].weight_decay;
      ok = pr_call_check(call, cuda.api->step(&cfg, &combos[c].tensors, &dev, cuda.stream),
                         &cuda);
    }
    if (ok && out && !fused && n) {
      const void** bufs = pr_call_alloc(call, n, sizeof(void*));
      int64_t* nbytes = pr_call_alloc(call, n, sizeof(int64_t));
      ok = bufs && nbytes;
      for (size_t i = 0; ok && i < n; i++) {
        const pr_tensor_t* p = &a->lists[PR_PARAMS].items[i];
        bufs[i] = p->data;
        nbytes[i] = p->numel * (int64_t)p->elem_size;
      }
      ok = ok && pr_call_check(call, cuda.api->fingerprint(bufs, nbytes, (int64_t)n, out,
                                                           cuda.stream),
                               &cuda);
      ok = ok && (!blocks || pr_blocks_as_found(call, a, &cuda));
    }
  }
  pr_cuda_end(&cuda);
}

/* adam_step_ (rules: false), adam_step_.rule (true: its slots after the default's) or
 * adam_step_.hyper (hyper: .rule's and rule_hyper). */
static void pr_step_op(StableIValue* stack, int on, bool rules, bool hyper) {
  pr_call_t call;
  pr_call_start(&call, "precis.adam_step_"); /* both overloads: the op's name */
  pr_step_args_t a;
  memset(&a, 0, sizeof a);
  for (int l = 0; l < PR_LIST_COUNT; l++) {
    if (l == PR_OUTPUTS && !rules) continue; /* [] */
    pr_call_take_tensor_list(&call, stack[pr_list_slots[l]], &a.lists[l], pr_list_names[l]);
  }
  if (rules) {
    pr_call_take_float_list(&call, stack[PR_SLOT_LR_SCALES], &a.lr_scales, "lr_scales");
    pr_call_take_tensor_list(&call, stack[PR_SLOT_FINGERPRINTS], &a.fingerprints,
                             "fingerprints");
    pr_step_split_fingerprints(&a);
  }
  pr_call_take_int_list(&call, stack[PR_SLOT_STEPS], &a.steps, "steps");
  pr_call_take_int_list(&call, stack[PR_SLOT_STREAMS], &a.streams, "streams");
  pr_call_take_int_list(&call, stack[PR_SLOT_ELEMENT_OFFSETS], &a.element_offsets,
                        "element_offsets");
  pr_call_take_tensor_list(&call, stack[PR_SLOT_FOUND_INF], &a.found_inf, "found_inf");
  pr_call_take_tensor_list(&call, stack[PR_SLOT_LR_TENSOR], &a.lr_tensor, "lr_tensor");
  pr_call_take_tensor_list(&call, stack[PR_SLOT_INV_GRAD_SCALE_TENSOR], &a.inv_grad_scale_tensor,
                           "inv_grad_scale_tensor");
  pr_call_take_tensor_list(&call, stack[PR_SLOT_STEP_TENSORS], &a.step_tensors, "step_tensors");
  double inv_grad_scale = pr_step_read_hyper(&stack[PR_SLOT_HYPER], stack[PR_SLOT_AMSGRAD],
                                             stack[PR_SLOT_IEEE_SQRT], &a.cfg);
  pr_step_read_rule(rules ? &stack[PR_SLOT_RULE] : NULL, &a);
  if (hyper) pr_step_take_rule_hyper(&call, stack[PR_SLOT_RULE_HYPER], &a);
  pr_step_check_and_run(&call, &a, inv_grad_scale, on);
  pr_call_finish(&call);
}

static void pr_step_op_default(StableIValue* stack, int on) { pr_step_op(stack, on, false, false); }
static void pr_step_op_rule(StableIValue* stack, int on) { pr_step_op(stack, on, true, false); }
static void pr_step_op_hyper(StableIValue* stack, int on) { pr_step_op(stack, on, true, true); }

double pr_step_read_hyper(const StableIValue* hyper, StableIValue amsgrad, StableIValue ieee_sqrt,
                          precis_step_config_t* out) {
  double inv_grad_scale = pr_slot_double(hyper[7]);
  /* Hyperparameters go to the C step as the doubles they are; it checks them
   * (NaN, negative, beta >= 1, ...) before it writes anything. */
  precis_step_config_t cfg = PRECIS_STEP_CONFIG_INIT;
  cfg.lr = pr_slot_double(hyper[0]);
  cfg.beta1 = pr_slot_double(hyper[1]);
  cfg.beta2 = pr_slot_double(hyper[2]);
  cfg.eps = pr_slot_double(hyper[3]);
  cfg.weight_decay = pr_slot_double(hyper[4]);
  cfg.decoupled_weight_decay = pr_slot_bool(hyper[5]);
  cfg.maximize = pr_slot_bool(hyper[6]);
  /* a double beyond float's range is refused (pr_step_check_call); no cast of it */
  cfg.inv_grad_scale = fabs(inv_grad_scale) <= FLT_MAX ? (float)inv_grad_scale : NAN;
  cfg.check_finite = pr_slot_bool(hyper[8]);
  cfg.seed = (uint64_t)pr_slot_int(hyper[9]);
  cfg.amsgrad = pr_slot_bool(amsgrad);
  /* torch's own fp32 sqrt (torch.optim's bits), or IEEE sqrt when the caller
   * asks for the CUDA kernels' bits (an offloaded step of a CUDA param) */
  cfg.cpu_sqrt = pr_slot_bool(ieee_sqrt) ? NULL : pr_torch_cpu_sqrt();
  cfg.num_threads = pr_torch_num_threads(); /* torch's thread count, not OpenMP's default */
  *out = cfg;
  return inv_grad_scale;
}

void pr_step_split_fingerprints(pr_step_args_t* a) {
  pr_tensor_t* rest = a->fingerprints.items + 1;
  switch (a->fingerprints.count) {
    case 4:
      a->resync = (pr_tensor_list_t){3, rest};
      a->fingerprints.count = 1;
      return;
    case 3:
      a->block_compare = (pr_tensor_list_t){2, rest};
      a->fingerprints.count = 1;
      return;
    case 2:
      a->watch = (pr_tensor_list_t){1, rest};
      a->fingerprints.count = a->fingerprints.items[0].numel == 0 ? 0 : 1;
      return;
    default:
      return;
  }
}

void pr_step_read_rule(const StableIValue* rules, pr_step_args_t* a) {
  a->rule = rules ? pr_slot_int(rules[0]) : PRECIS_RULE_ADAM;
  /* An unknown rule is refused by pr_step_check_call, naming a->rule; nothing reads
   * cfg.rule before. */
  a->cfg.rule = a->rule >= 0 && a->rule < PRECIS_RULE_COUNT ? (int32_t)a->rule : PRECIS_RULE_ADAM;
  if (!rules) return;
  /* Checked by the C step, as the other hyperparameters (pr_step_read_hyper). */
  a->cfg.momentum = pr_slot_double(rules[1]);
  a->cfg.dampening = pr_slot_double(rules[2]);
  a->cfg.nesterov = pr_slot_bool(rules[3]);
}

void pr_step_take_rule_hyper(pr_call_t* call, StableIValue slot, pr_step_args_t* a) {
  pr_float_list_t values;
  pr_call_take_float_list(call, slot, &values, "rule_hyper");
  if (call->failed) return;
  if (values.count > PRECIS_RULE_HYPER_MAX) {
    pr_call_fail(call, "rule_hyper has %zu entries; a rule takes at most %d", values.count,
                 PRECIS_RULE_HYPER_MAX);
    return;
  }
  for (size_t k = 0; k < values.count; k++) a->cfg.rule_hyper[k] = values.items[k];
}

/* The compare and resync (pr_step_args_t.resync), before the step: on the CPU the
 * params' fingerprints now into kept, then precis_resync_changed; on CUDA
 * precis_cuda_resync_compared (the fingerprint and compare in its first launch, its
 * flags in scratch device memory that torch's allocator reuses after them), which also
 * zeroes the step's record (out) for the update kernels to add to: they then need no
 * memset (pr_run_cuda). When the update kernels keep the record (fused), they resync too:
 * precis_cuda_compare_params leaves the masters to them, its flags in *stale, their
 * scratch in *flags for the caller to delete once the update is queued. */
static bool pr_resync(pr_call_t* call, const pr_step_args_t* a, int on, bool fused,
                      AtenTensorHandle* flags, uint8_t** stale_out) {
  const size_t n = a->lists[PR_PARAMS].count;
  void** masters = pr_call_alloc(call, n, sizeof *masters);
  const void** params = pr_call_alloc(call, n, sizeof *params);
  int64_t* numels = pr_call_alloc(call, n, sizeof *numels);
  if (!masters || !params || !numels) return false;
  pr_tensor_t view;
  const pr_tensor_t* master = NULL;
  for (size_t i = 0; i < n; i++) { /* (the flat op's masters: one buffer, one dtype) */
    const pr_tensor_t* p = &a->lists[PR_PARAMS].items[i];
    master = pr_step_entry(a, i, PR_MASTERS, &view);
    masters[i] = master->data;
    params[i] = p->data;
    numels[i] = p->numel;
  }
  const precis_dtype_t mdt = (precis_dtype_t)master->dtype;
  const precis_dtype_t pdt = (precis_dtype_t)a->lists[PR_PARAMS].items[0].dtype;
  const int64_t* records = a->resync.items[0].data;
  int64_t* kept = a->resync.items[1].data;
  if (on != PR_ON_CUDA) {
    uint8_t* stale = pr_call_alloc(call, n, 1);
    return stale && pr_fingerprint_params(call, a, (uint64_t*)kept) &&
           pr_call_check(call, precis_resync_changed(masters, mdt, params, pdt, numels, records,
                                                     stale, kept, (int64_t)n),
                         NULL);
  }
  const pr_tensor_t* p0 = &a->lists[PR_PARAMS].items[0];
  AtenTensorHandle scratch = NULL;
  void* stale = NULL;
  int64_t size = (int64_t)n, one = 1;
  if (pr_torch.aoti_torch_empty_strided(1, &size, &one, pr_torch.dtype_uint8, p0->device_type,
                                        p0->device_index, &scratch) ||
      pr_torch.aoti_torch_get_data_ptr(scratch, &stale)) {
    if (scratch) pr_torch.aoti_torch_delete_tensor_object(scratch);
    return pr_call_fail(call, "resync: cannot allocate %zu bytes of flags on %s", n,
                        pr_device_name(p0));
  }
  pr_cuda_ctx_t cuda;
  uint64_t* out = a->fingerprints.count ? a->fingerprints.items[0].data : NULL;
  bool ok = pr_cuda_begin(call, p0->device_index, &cuda) &&
            pr_call_check(call, (fused ? cuda.api->compare_params : cuda.api->resync_compared)(
                                    masters, mdt, params, pdt, numels, records, stale, kept,
                                    a->resync.items[2].data, out, (int64_t)n, cuda.stream),
                          &cuda);
  pr_cuda_end(&cuda);
  if (ok && fused) {
    *flags = scratch;
    *stale_out = stale;
  } else {
    pr_torch.aoti_torch_delete_tensor_object(scratch); /* (after its kernels, in stream order) */
  }
  return ok;
}

void pr_step_check_and_run(pr_call_t* call, pr_step_args_t* a, double inv_grad_scale, int on) {
  int (*keys)[PR_KEY_WIDTH] = NULL;
  bool ok = pr_step_check_call(call, a, inv_grad_scale, on, &keys);
  size_t combo_count = 0;
  pr_combo_t* combos = ok && a->lists[PR_PARAMS].count
                           ? pr_plan(call, a, (const int(*)[PR_KEY_WIDTH])keys, &combo_count, on)
                           : NULL;
  if (!ok || call->failed) return;
  /* On CUDA the update kernels keep the record when each combination holds a run of
   * params in order (one param group's) and together they hold every param, each
   * combination's entries then a run of the record's; else (dtypes mixed in a group, an
   * empty param) precis_cuda_fingerprint of the params after the steps. */
  const size_t n = a->lists[PR_PARAMS].count;
  const bool fused = on == PR_ON_CUDA && a->fingerprints.count &&
                     pr_combos_in_runs(combos, combo_count, n);
  if (a->block_compare.count && on == PR_ON_CUDA && n && !fused) {
    pr_call_fail(call, "fingerprints [out, records, kept] on a GPU needs no empty param (the "
                       "update kernels compare the blocks, and an empty param has none); "
                       "compare before the op");
    return;
  }
  AtenTensorHandle flags = NULL;
  uint8_t* stale = NULL;
  if (a->resync.count && n &&
      !(pr_check_configs(call, a, combos, combo_count, on) &&
        pr_resync(call, a, on, fused, &flags, &stale))) {
    return;
  }
  if (on == PR_ON_CUDA) {
    /* every param empty: only their record (zeros) to write */
    if (combo_count || (a->fingerprints.count && n)) {
      pr_run_cuda(call, a, combos, combo_count, fused, stale);
    }
    if (flags) pr_torch.aoti_torch_delete_tensor_object(flags); /* (after the update) */
  } else { /* with no combination (every param empty) too: it writes their fingerprints */
    pr_run_cpu(call, a, combos, combo_count);
  }
}

/* check_finite_(Tensor[] grads, Tensor(a!) found_inf): found_inf = 1 when a
 * gradient holds a NaN/Inf; one C call per grad dtype. */
static void pr_check_finite(StableIValue* stack, int on) {
  pr_call_t call;
  pr_call_start(&call, "precis.check_finite_");
  pr_tensor_list_t grads;
  pr_tensor_t found_inf;
  pr_call_take_tensor_list(&call, stack[0], &grads, "grads");
  pr_call_take_tensor(&call, stack[1], &found_inf, "found_inf");
  bool ok = !call.failed && pr_check_kernel_device(&call, &found_inf, "found_inf", on);
  if (ok && (found_inf.torch_dtype != pr_torch.dtype_float32 || found_inf.numel != 1)) {
    ok = pr_call_fail(&call, "found_inf must be a one-element float32 tensor, got %" PRId64
                             " %s values", found_inf.numel,
                      pr_torch_dtype_name(found_inf.torch_dtype));
  }
  ok = ok && pr_check_layout(&call, &found_inf, "found_inf");
  /* One table per grad dtype (fp32, fp16, bf16). */
  const void** tables[3] = {NULL, NULL, NULL};
  int64_t* numels[3] = {NULL, NULL, NULL};
  size_t counts[3] = {0, 0, 0};
  char what[48];
  for (size_t i = 0; ok && i < grads.count; i++) {
    const pr_tensor_t* g = &grads.items[i];
    if (!pr_same_device(g, &found_inf) || !pr_layout_ok(g)) { /* the name for the message */
      snprintf(what, sizeof what, "grads[%zu]", i);
      ok = pr_check_same_device(&call, g, what, &found_inf, "found_inf") &&
           pr_check_layout(&call, g, what);
    }
    if (ok && g->dtype != PRECIS_DTYPE_FP32 && g->dtype != PRECIS_DTYPE_FP16 &&
        g->dtype != PRECIS_DTYPE_BF16) {
      ok = pr_call_fail(&call, "grads[%zu] has dtype %s; supported: float32, float16, bfloat16",
                        i, pr_torch_dtype_name(g->torch_dtype));
    }
  }
  if (ok) { /* found_inf, written, apart from the grads it reads */
    pr_range_t* ranges = pr_call_alloc(&call, grads.count + 1, sizeof *ranges);
    size_t count = 0;
    ok = ranges != NULL;
    for (size_t i = 0; ok && i < grads.count; i++) {
      pr_add_range(ranges, &count, &grads.items[i], "grads", i, false);
    }
    if (ok) {
      pr_add_range(ranges, &count, &found_inf, "found_inf", PR_NO_INDEX, true);
      ok = pr_check_apart(&call, ranges, count, PR_APART_RULE);
    }
  }
  for (int d = 0; ok && d < 3; d++) {
    tables[d] = pr_call_alloc(&call, grads.count, sizeof(void*));
    numels[d] = pr_call_alloc(&call, grads.count, sizeof(int64_t));
    ok = tables[d] && numels[d];
  }
  for (size_t i = 0; ok && i < grads.count; i++) {
    const pr_tensor_t* g = &grads.items[i];
    if (g->numel == 0) continue;
    tables[g->dtype][counts[g->dtype]] = g->data;
    numels[g->dtype][counts[g->dtype]++] = g->numel;
  }
  pr_cuda_ctx_t cuda = {NULL, NULL, NULL};
  ok = ok && (on == PR_ON_CPU || pr_cuda_begin(&call, found_inf.device_index, &cuda));
  int32_t found = 0;
  for (int d = 0; ok && d < 3; d++) {
    if (!counts[d]) continue;
    precis_step_tensors_t t = PRECIS_STEP_TENSORS_INIT;
    t.count = counts[d];
    t.grad_dtype = (precis_dtype_t)d;
    t.grads = tables[d];
    t.numels = numels[d];
    ok = on == PR_ON_CUDA
             ? pr_call_check(&call, cuda.api->check_finite(&t, found_inf.data, cuda.stream),
                             &cuda)
             : pr_call_check(&call, precis_step_check_finite(&t, &found), NULL);
  }
  pr_cuda_end(&cuda);
  if (ok && on == PR_ON_CPU && found) *(float*)found_inf.data = 1.0f;
  pr_call_finish(&call);
}

PR_KERNEL_PAIR(pr_step_op_default)
PR_KERNEL_PAIR(pr_step_op_rule)
PR_KERNEL_PAIR(pr_step_op_hyper)
PR_KERNEL_PAIR(pr_check_finite)

const pr_op_kernels_t pr_step_ops[] = {
    {"adam_step_",
     "adam_step_(" PR_ADAM_STEP_ARGS "int[] streams=[], int[] element_offsets=[]) -> ()",
     pr_step_op_default_cpu, pr_step_op_default_cuda},
    /* The update rule: a Tensor[] cannot have a default ([]), and a boxed C++ caller
     * passes every argument (nothing fills defaults), so the rule's arguments are an
     * overload's, and the default overload keeps its callers. */
    {"adam_step_.rule",
     "adam_step_.rule(" PR_ADAM_STEP_ARGS PR_ADAM_STEP_RULE_ARGS ") -> ()",
     pr_step_op_rule_cpu, pr_step_op_rule_cuda},
    /* .rule with a rule's own hyperparameters (precis_step_config_t.rule_hyper): a rule
     * with new ones needs no new overload. */
    {"adam_step_.hyper",
     "adam_step_.hyper(" PR_ADAM_STEP_ARGS PR_ADAM_STEP_RULE_ARGS ", float[] rule_hyper) -> ()",
     pr_step_op_hyper_cpu, pr_step_op_hyper_cuda},
    {"check_finite_", "check_finite_(Tensor[] grads, Tensor(a!) found_inf) -> ()",
     pr_check_finite_cpu, pr_check_finite_cuda},
};
const size_t pr_step_op_count = sizeof pr_step_ops / sizeof pr_step_ops[0];
