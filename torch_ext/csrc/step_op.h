/* step_op.h - what the two Adam ops share: precis::adam_step_ (a list of tensors
 * per state kind, step_kernels.c) and precis::adam_step_flat_ (one buffer per state
 * kind and a table of where each param's state lies in them, step_flat.c), each with
 * its .rule overload (the update rule, precis_rule_t, and its arguments). All turn
 * their arguments into one pr_step_args_t, which pr_step_check_and_run checks whole
 * before anything is written, then steps. */
#ifndef PRECIS_TORCH_STEP_OP_H_
#define PRECIS_TORCH_STEP_OP_H_

#include "rules.h" /* pr_rule_use: what a rule reads */
#include "glue.h"

/* adam_step_'s arguments, in its schema's order (step_kernels.c's pr_step_ops, step_held.c's
 * hold_step and the slots held_step_ puts in). */
enum pr_slot {
  PR_SLOT_PARAMS, PR_SLOT_GRADS, PR_SLOT_MASTERS, PR_SLOT_EXP_AVGS, PR_SLOT_EXP_AVG_SQS,
  PR_SLOT_EXP_AVG_SCALES, PR_SLOT_EXP_AVG_SQ_SCALES, PR_SLOT_STEPS,
  PR_SLOT_HYPER, /* ten slots: pr_step_read_hyper's */
  PR_SLOT_FOUND_INF = PR_SLOT_HYPER + 10, PR_SLOT_LR_TENSOR, PR_SLOT_INV_GRAD_SCALE_TENSOR,
  PR_SLOT_STEP_TENSORS, PR_SLOT_AMSGRAD, PR_SLOT_MAX_EXP_AVG_SQS, PR_SLOT_MAX_EXP_AVG_SQ_SCALES,
  PR_SLOT_IEEE_SQRT, PR_SLOT_STREAMS, PR_SLOT_ELEMENT_OFFSETS,
  /* the .rule overload's: pr_step_read_rule's four, then its lists */
  PR_SLOT_RULE, PR_SLOT_OUTPUTS = PR_SLOT_RULE + 4, PR_SLOT_LR_SCALES, PR_SLOT_FINGERPRINTS,
  PR_SLOT_RULE_HYPER /* .hyper's */
};

/* adam_step_'s arguments up to element_offsets, the .rule overload's prefix, with the
 * alias annotations of the tensors it writes (each a string: "(a!)", ...; "" for a schema
 * that writes none of them: hold_step's); PR_ADAM_STEP_ARGS adam_step_'s own. */
#define PR_ADAM_STEP_ARGS_ANNOTATED(a, b, c, d, e, f, g, h, i)                                \
  "Tensor" a "[] params, Tensor[] grads, Tensor" b "[] masters, "                            \
  "Tensor" c "[] exp_avgs, Tensor" d "[] exp_avg_sqs, Tensor" e "[] exp_avg_scales, "         \
  "Tensor" f "[] exp_avg_sq_scales, int[] steps, float lr, float beta1, float beta2, "        \
  "float eps, float weight_decay, bool adamw, bool maximize, float inv_grad_scale, "         \
  "bool check_finite, int seed, Tensor" g "[] found_inf, Tensor[] lr_tensor, "                \
  "Tensor[] inv_grad_scale_tensor, Tensor[] step_tensors, bool amsgrad, "                    \
  "Tensor" h "[] max_exp_avg_sqs, Tensor" i "[] max_exp_avg_sq_scales, bool ieee_sqrt, "
#define PR_ADAM_STEP_ARGS \
  PR_ADAM_STEP_ARGS_ANNOTATED("(a!)", "(b!)", "(c!)", "(d!)", "(e!)", "(f!)", "(g!)", "(h!)", "(i!)")

/* The .rule overload's arguments after PR_ADAM_STEP_ARGS (.hyper's, then rule_hyper), the
 * same way. */
#define PR_ADAM_STEP_RULE_ARGS_ANNOTATED(j, k)                                               \
  "int[] streams, int[] element_offsets, int rule, float momentum, float dampening, "        \
  "bool nesterov, Tensor" j "[] outputs, float[] lr_scales, Tensor" k "[] fingerprints"
#define PR_ADAM_STEP_RULE_ARGS PR_ADAM_STEP_RULE_ARGS_ANNOTATED("(j!)", "(k!)")

/* The per-param lists of a step. */
enum {
  PR_PARAMS,
  PR_GRADS,
  PR_MASTERS,
  PR_EXP_AVGS,
  PR_EXP_AVG_SQS,
  PR_EXP_AVG_SCALES,
  PR_EXP_AVG_SQ_SCALES,
  PR_MAX_EXP_AVG_SQS, /* amsgrad only */
  PR_MAX_EXP_AVG_SQ_SCALES,
  PR_OUTPUTS, /* muon_momentum only: each param's direction, written */
  PR_LIST_COUNT
};

/* A param's dtype combination: param, grad, master, exp_avg, exp_avg_sq, output
 * (fp32 for a kind the rule does not read); one C call per combination. */
enum { PR_KEY_WIDTH = 6 };

/* Whether list l holds block scales (one float32 per PRECIS_SCALE_BLOCK elements),
 * whose flat buffers are addressed by the table's scale column. */
static inline bool pr_is_scale_list(int l) {
  return l == PR_EXP_AVG_SCALES || l == PR_EXP_AVG_SQ_SCALES || l == PR_MAX_EXP_AVG_SQ_SCALES;
}

/* Each list's name in adam_step_'s schema ("params", "grads", "masters", ...). */
extern const char* const pr_list_names[PR_LIST_COUNT];

typedef struct pr_step_args {
  pr_tensor_list_t lists[PR_LIST_COUNT];
  /* adam_step_flat_'s state lists have no items (lists[l].count is the params'):
   * entry i of list l is the view of buffers[l] that table row i describes (rows,
   * flat_table.h), made when it is read. step_flat.c checked that every row lies
   * inside its buffers and that no two rows overlap. The list op: rows NULL. */
  const int64_t* rows;
  pr_tensor_t buffers[PR_LIST_COUNT];
  pr_int_list_t steps, streams, element_offsets;
  precis_step_config_t cfg;
  int64_t rule;        /* as given: checked against PRECIS_RULE_COUNT before cfg.rule is read */
  pr_float_list_t lr_scales; /* [] or one lr scale per param (sgd, lion) */
  /* adam_step_flat_'s: [] (cfg.lr, cfg.weight_decay for every param) or one per param,
   * its own (its param group's); params of one dtype combination and one (lr, weight
   * decay) make one C call, with the bits of a call of their own. Not with lr_tensor. */
  pr_float_list_t lrs, weight_decays;
  pr_tensor_list_t found_inf, lr_tensor, inv_grad_scale_tensor, step_tensors;
  /* The .rule overloads' out: [] or one int64 tensor on the params' device, entry i
   * params[i]'s precis_fingerprint after the step (precis_step_tensors_t.param_fingerprints;
   * on a GPU the update kernel's record; after a step found_inf skipped, on either, the
   * params as found); where it has more entries, the params' block record after those
   * (param_block_fingerprints: each param's blocks, one after another). */
  pr_tensor_list_t fingerprints;
  /* The .rule overloads' fingerprints [out, records, kept, sums] give it their last
   * three (else []): int64 tensors on the params' device, records and kept an entry per
   * param: each param's fingerprint as recorded (the last step's out), compared with the
   * param's now before the step; a param written since gets its master (or remainders)
   * resynced (precis_resync_changed), kept written as there; sums two entries a param,
   * zero, left zero: on CUDA the compare kernel's sums and counts
   * (precis_cuda_resync_compared; the CPU reads none of it). Nothing is read back: the
   * compare, the flags and the resync are the device's. */
  pr_tensor_list_t resync;
  /* adam_step_flat_.rule's fingerprints [out, records, kept] give it their last two (else
   * []): out holding the params' block record (an entry a param, then their blocks), of
   * params with remainders; records the last step's out (its blocks the record the step
   * compares each block with before stepping it: a block written since has its
   * remainders zeroed, a skipped step's too: precis_step_tensors_t.param_block_records),
   * kept an entry a param (the elements of its blocks that matched: param_blocks_kept),
   * both int64 on the params' device. Nothing read back, no pass over the params of its
   * own: the step's compare is the update's. */
  pr_tensor_list_t block_compare;
  /* fingerprints [out, kept] (adam_step_.rule's and adam_step_flat_.rule's) give it kept
   * (else []): on the CPU, params with a separate master, one contiguous int64 CPU tensor
   * of an entry per param: the step sees writes into the params itself
   * (precis_step_tensors_t.param_kept: an element no longer its master's rounding takes the
   * param as master), kept[i] params[i]'s elements that still rounded; out, the record, may
   * then be empty (none kept). */
  pr_tensor_list_t watch;
  /* adam_step_flat_.counted's step_counts: [] or the float32 CPU tensor of the rows' step
   * counts, which the op advances after the step (written: no other tensor of the call
   * may share its memory). */
  pr_tensor_list_t step_counts;
} pr_step_args_t;

/* The config from the ten hyperparameter slots both schemas share, in this order:
 * lr, beta1, beta2, eps, weight_decay, adamw, maximize, inv_grad_scale,
 * check_finite, seed; and the amsgrad and ieee_sqrt slots. Returns inv_grad_scale
 * as given (checked by pr_step_check_and_run). */
double pr_step_read_hyper(const StableIValue* hyper, StableIValue amsgrad, StableIValue ieee_sqrt,
                          precis_step_config_t* out);

/* The rule from the four slots the .rule overloads share, in this order: rule,
 * momentum, dampening, nesterov (rules: NULL, the default overloads: adam). */
void pr_step_read_rule(const StableIValue* rules, pr_step_args_t* a);

/* The .hyper overloads' rule_hyper (a float list, at most PRECIS_RULE_HYPER_MAX) into
 * a->cfg.rule_hyper: a rule's own hyperparameters, which the C step checks (rules.h). */
void pr_step_take_rule_hyper(pr_call_t* call, StableIValue slot, pr_step_args_t* a);

/* The lists after out in a->fingerprints, by their count: [out, records, kept, sums] the
 * compare's (a->resync), [out, records, kept] the blocks' compare (a->block_compare),
 * [out, kept] the CPU step's own (a->watch; out empty: no record); a->fingerprints then
 * [out]. Another count is left for pr_step_check_and_run to refuse. */
void pr_step_split_fingerprints(pr_step_args_t* a);

/* Param i's entry of list l, NULL where the list is absent: its item, or (the flat op)
 * the view of the list's buffer that table row i describes, made in *view (without a
 * handle: described, not owned). */
const pr_tensor_t* pr_step_entry(const pr_step_args_t* a, size_t i, int l, pr_tensor_t* view);

/* pr_step_entry of each list, into out[] (views[]: its views). */
void pr_step_entries(const pr_step_args_t* a, size_t i, pr_tensor_t views[PR_LIST_COUNT],
                     const pr_tensor_t* out[PR_LIST_COUNT]);

/* Checks every argument of a (lengths, devices, dtypes, sizes, the scalars, the
 * rule's lists, aliasing: step_checks.c); on success *keys holds each param's dtype
 * combination, memory of the call. */
bool pr_step_check_call(pr_call_t* call, pr_step_args_t* a, double inv_grad_scale, int on,
                        int (**keys)[PR_KEY_WIDTH]);

/* The step counts in t (the steps taken so far, each advanced after its step as torch's
 * float32 `step += 1`), checked: one contiguous float32 CPU tensor of n counts in
 * [0, 2^63), its data read only then; else NULL, the failure recorded ("<name> must be
 * one contiguous float32 CPU tensor of <n> counts<per>, got ..."). adam_step_flat_.counted's
 * step_counts and held_step_'s step_count. */
float* pr_step_counts(pr_call_t* call, const pr_tensor_t* t, size_t n, const char* name,
                      const char* per);

/* pr_step_check_call, then one C call per dtype combination; a failure is
 * recorded in call. */
void pr_step_check_and_run(pr_call_t* call, pr_step_args_t* a, double inv_grad_scale, int on);

/* A param's entries in a block record (precis_step_tensors_t.param_block_fingerprints). */
static inline int64_t pr_step_param_blocks(int64_t numel) {
  return numel > 0 ? (numel - 1) / PRECIS_FINGERPRINT_BLOCK + 1 : 1;
}

/* The block record's entries of a's params (each param's pr_step_param_blocks). */
static inline int64_t pr_step_block_values(const pr_step_args_t* a) {
  int64_t total = 0;
  for (size_t i = 0; i < a->lists[PR_PARAMS].count; i++) {
    total += pr_step_param_blocks(a->lists[PR_PARAMS].items[i].numel);
  }
  return total;
}

/* Whether fingerprints' out holds the block record after the params' entries (checked:
 * pr_step_check_call). */
static inline bool pr_step_records_blocks(const pr_step_args_t* a) {
  return a->fingerprints.count && a->lists[PR_PARAMS].count &&
         a->fingerprints.items[0].numel > (int64_t)a->lists[PR_PARAMS].count;
}

#endif /* PRECIS_TORCH_STEP_OP_H_ */
