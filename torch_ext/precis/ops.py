"""torch.ops.precis.*: the precis kernels as native torch ops.

The ops are defined and implemented in C: loading libprecis_torch.so (the glue,
torch_ext/csrc/) registers their schemas and their CPU and CUDA kernels with
torch's dispatcher through libtorch's stable C ABI (docs/design.md section 9).
Each kernel checks every argument before it writes anything and raises
RuntimeError with the precis message. This module loads the glue, adds the fake
kernels torch.compile traces with, and wraps the ops with keyword defaults.

Ops that write their inputs return nothing (so torch.compile can functionalize
them); the wrappers below return the written tensor.

  accumulate_(dst, src)          dst += src (sum in fp32, rounded to nearest even)
  cast_(dst, src)                dst = src converted, rounding to nearest even
  scale_(buf, factor)            buf *= factor in fp32, rounded back (factor finite)
  count_nonfinite(buf) -> Tensor 0-dim int64 on buf's device: NaN/Inf elements
  fingerprint(bufs) -> Tensor    int64 per buf on their device: a 64-bit fingerprint of
                                 each buf's bytes (precis_fingerprint; contiguous; float32,
                                 float16, bfloat16, float64, int64, uint8 or int16)
  resync_masters_(masters, params, stale, kept)  the masters (or remainders) of the
                                 params flagged in stale resynced from them, nothing read
                                 back (precis_resync_masters; below)
  fingerprint.blocks(bufs, block), resync_masters_.blocks(..., block)  the same of each
                                 tensor in blocks (of bytes; of elements), an entry a block
                                 (the records of params with remainders)
  check_finite_(grads, found_inf)  found_inf = 1 when a gradient holds a NaN/Inf
  adam_step_(...)                one fused Adam/AdamW step over a list of params
                                 (or another rule's: below)
  adam_step_flat_(...)           the same over params whose state is flat (below)
  hold_step.rule(...) -> int, held_step_(held, grads, step_count, lr, inv_grad_scale,
                                 found_inf, fingerprints)  an adam_step_.rule (.hyper) call
                                 held on the C side and made again with these, its step
                                 counted (HeldStep, below)

The element-wise ops take contiguous fp32 / bf16 / fp16 tensors on one device,
with the same number of elements (any shapes).

adam_step_ lists, all of the same length n unless said otherwise (an empty list
stands for "absent for every param"):

  params             fp32 / fp16 / bf16, contiguous, updated in place
  grads              fp32 / fp16 / bf16, as many elements as the param
  masters            [] or n tensors: fp32 / fp16 master copy, int16 remainders
                     or uint8 8-bit corrections (bf16 params: a 24-bit master),
                     or an empty tensor where the param is its own master
  exp_avgs           fp32 / fp16 / bf16 / uint8 (fp8: m8 code bytes)
  exp_avg_sqs        same (fp8: v8 code bytes)
  exp_avg_scales     [] or n fp32 tensors: scale_count(numel) block scales for
                     fp16 / fp8 moments, an empty tensor otherwise
  exp_avg_sq_scales  same
  steps              the step number of each param after this update (>= 1);
                     [] when step_tensors is given
  max_exp_avg_sqs    amsgrad only (else []): the running max of exp_avg_sq, in
                     its dtype; the denominator comes from it. The max is taken
                     of the values as stored (v after its rounding, the max as
                     it was stored), so a checkpoint of them round-trips
  max_exp_avg_sq_scales  amsgrad only: its own block scales, as exp_avg_sq_scales
  streams            [] or n ints: a stable id of the whole param each tensor is (a
                     part of); [] gives param i stream i
  element_offsets    [] or n ints >= 0: the index of each tensor's first element in
                     its whole param; [] gives 0

Stochastic rounding (bf16 params without a master, bf16 / fp16 / fp8 v, fp8 m) draws
the random number of an element from (seed, its stream, the step, the low 32 bits of
element_offsets[i] + its index in the tensor): an element rounds the same whether its
param is stepped whole, in pieces, as an FSDP2 shard or as a slice, given its stream
and offset.

Hyperparameters are floats (doubles), used as torch.optim uses its Python floats;
invalid ones (NaN, Inf, negative, a beta outside [0, 1); eps may be 0, as torch's
takes it) raise RuntimeError naming them. For all-fp32 params, grads and state the
CPU kernel takes torch's own fp32 sqrt (MKL's where torch has it), so those steps equal
torch.optim.Adam / AdamW's bit for bit (other combinations take IEEE sqrt); ieee_sqrt=True
(or PRECIS_CPU_SQRT=ieee in the environment) makes it take IEEE sqrt, the CUDA
kernels' bits (the CUDA kernels ignore ieee_sqrt). One-element tensors on the params'
device, each a list of zero or one tensor (what makes a step capturable in a
CUDA graph: the kernels read them when they run, and nothing syncs):

  found_inf              float32. Nonzero when the update runs: nothing is
                         modified. check_finite sets it to 1 when a gradient is
                         NaN/Inf (then nothing is modified); never cleared.
                         Required by check_finite.
  lr_tensor              float64 or float32, used instead of lr (float32: 1 - lr*wd
                         and lr / (1 - beta1^step) in float32, as torch computes
                         them for a float32 tensor lr)
  inv_grad_scale_tensor  float32, used instead of inv_grad_scale
  step_tensors           [] or n int64 tensors, used instead of steps (one tensor
                         may serve several params). Never incremented here.

adam_step_flat_ takes params and grads as lists, and the state as one buffer per
kind (FLAT_BUFFERS: master, exp_avg, exp_avg_sq, their scales, the amsgrad max and
its scales; an empty tensor where the kind is absent), each param's state a
contiguous range of them, and `table`: an int64 CPU tensor of n rows (ROW_* columns)
of offset (into the element buffers), scale offset (into the scale buffers), numel,
stream, the step number after this update, the element offset (as
element_offsets: of the tensor's first element in its whole param), the shape
key (shape_key of the param the row was made for) and its data address
(data_address(param), or 0 for any). Its other arguments are adam_step_'s (no
step_tensors: a flat step is an eager one), and, last, lrs and weight_decays: [] (lr
and weight_decay for every param) or one finite float >= 0 a param, its own (the lr and
weight decay of its param group: one call steps several groups; lrs not with
lr_tensor). Rows out of range or overlapping, a
param (or its grad) of another shape than its row's, a param at another address, or of another dtype
than params[0]'s, and a param, grad or found_inf inside any part of a buffer, are
refused before anything is written.

The kernel groups the params by dtype combination (and, with lrs or weight_decays, by
their lr and weight decay) and makes one C call per group, each the bits of a call of
its own; with check_finite over several, every gradient is checked first,
so the step is all or nothing. check_finite_(grads, found_inf) lets a caller
do the same over several adam_step_ calls.

Rules (rule=, a name of RULES; precis.h's precis_rule_t): "adam" by default, "sgd"
(torch.optim.SGD's momentum, dampening, nesterov; adamw=True: decoupled decay), "lion"
(beta1, beta2) or, adam_step_ only, "muon_momentum" (torch.optim.Muon's momentum: the
direction goes to outputs, one fp32 / fp16 / bf16 tensor per param, and params and
masters are left alone). The one-state rules keep their momentum in exp_avgs (with
exp_avg_scales for fp16 / fp8) and read no exp_avg_sqs, sgd with momentum 0 no
exp_avgs: what a rule does not read must be [] (or empty tensors), as must outputs
but with muon_momentum, and lr_scales (each param's step lr as a multiple of lr, the
product as torch's `lr * ratio`; weight decay keeps lr) but with sgd and lion; amsgrad
is adam's. The wrappers call the .rule overloads: the default overload's arguments,
then rule, momentum, dampening, nesterov (adam_step_: outputs and lr_scales, a
float[]); the default overloads, adam's, keep their schemas for callers that pass every
argument (C++'s callBoxed fills in no defaults). Both .rule overloads end with
fingerprints: [] or one contiguous int64 tensor of an entry per param (a rule that
writes them), entry i set to precis.fingerprints.of([params[i]]) after the step (as an
int64), its terms added as the kernel writes each tile instead of a pass over the
params of its own. CPU params take a CPU tensor, CUDA params a tensor on their device
(zeroed and filled by the call in stream order); a step that writes nothing (found_inf,
given set or set by check_finite) fills it too: the params as they are after the call,
so that a caller that reads the verdict later keeps the record either way. The tensor
may be longer: an entry per param, then the params' blocks
(precis.fingerprints.of_blocks of the params after the step, the block record of params
with remainders), summed as the kernel writes them too.
Both .rule overloads' fingerprints may be [out, records, kept, sums], int64 tensors on
the params' device, records and kept an entry per param, sums two a param (zero; the
call leaves it zero: on a GPU the compare's kernel counts in it, the CPU reads none of
it), for bf16 or fp16 params with a
master or remainders: before the step each param's fingerprint now is compared with
records[i] (what the last step's out left), and a param written since has its master
or remainders resynced as resync_masters_ does (kept[i] as its kept: the param's numel
where not written), after every check and whatever found_inf holds (a skipped step
resyncs too; its out: the params as they are);
nothing is read back (on a GPU the compare is the kernels'), so that a step of a model
with a master is one op call (on a GPU the compare's first kernel fingerprints the
params, compares them and zeroes out for the update kernels). kept and sums must not
lie in any tensor the call reads or writes.
Both .rule overloads' fingerprints may instead be [out, records,
kept] for bf16 params with remainders, out holding their blocks (an entry a param, then
each param's blocks of precis.fingerprints.BLOCK elements), records as long (the last
step's out: its blocks the record), kept an entry a param, int64 on the params' device:
each block is compared with its record as the step reaches it and a block written
since has its remainders zeroed before it is stepped (a skipped step's too), kept[i] the
elements of params[i]'s blocks that matched; no pass over the params of its own (on a GPU
the update kernels compare), nothing read back. On a GPU no param may be empty (its
kernels compare the blocks, and an empty param has none).
On the CPU both .rule overloads' fingerprints may be [out, kept] (out empty: no record):
kept a contiguous int64 CPU tensor of an entry per param; the step sees writes into
params with a separate master itself (an element that is no longer its master's
rounding is taken as master, as resync_masters_ takes it; a param written in its first
1,024 elements is first resynced as resync_masters_ resyncs it), kept[i] the elements
that still rounded (a param's numel where none was taken; left as it was by a skipped
step).
adam_step_flat_.counted is .rule with `Tensor(k!)[] step_counts` after fingerprints: one
contiguous float32 CPU tensor, each row's steps taken so far; the call steps each row
with its count + 1 (torch's float32 `step += 1`; the table's step column unread) and,
once it has run, adds 1 to each count, so that a step counts its steps without torch
ops of its own (each a dispatch that costs a step in a training loop tens of
microseconds of host time). Not with found_inf or check_finite: whether such a step is
taken is known only once its flag is read (on a GPU after the call), so its caller
counts it, through the table.
"""


import weakref

import torch

from . import _lib, tracing
# The ops' constants and pure helpers, precis.ops's names too (callers read them here).
from .op_constants import (DTYPES, FLAT_BUFFERS, MOMENT_DTYPES, PARAM_DTYPES,  # noqa: F401
                           ROW_DATA, ROW_ELEMENT_OFFSET, ROW_NUMEL, ROW_OFFSET,
                           ROW_SCALE_OFFSET, ROW_SHAPE_KEY, ROW_STEP, ROW_STREAM, ROW_WIDTH,
                           RULES, SCALED_MOMENT_DTYPES, block_count, data_address,
                           keeps_block_scales, mix_seed, scale_count, shape_key)

_lib.torch_glue()  # registers torch.ops.precis.* (once per process)




# ---- fake kernels: shapes, dtypes and devices only (torch.compile, meta tensors) ----

def _no_output(*args):
    return None


def _count_nonfinite_fake(buf):
    return buf.new_empty((), dtype=torch.int64)


def _fingerprint_fake(bufs):
    return bufs[0].new_empty((len(bufs),), dtype=torch.int64)


def _fingerprint_blocks_fake(bufs, block):
    return bufs[0].new_empty((sum(block_count(t.numel() * t.element_size(), block)
                                  for t in bufs),), dtype=torch.int64)


def _refuse_meta_among_others(name, arg_names, args):
    """A meta tensor among tensors that hold data sends a call here, not to its kernel, as
    the dispatcher picks the meta key first: it would write nothing. Refused, as torch's
    own ops refuse tensors on two devices (all-meta calls and torch.compile's fake tensors,
    which carry their real device, pass)."""
    meta = other = None
    for arg, value in zip(arg_names, args):
        items = [(arg, value)] if isinstance(value, torch.Tensor) else \
            [(f"{arg}[{i}]", t) for i, t in enumerate(value)] \
            if isinstance(value, (list, tuple)) else []
        for what, t in items:
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_meta:
                meta = meta or what
            else:
                other = other or (what, t.device)
            if meta and other:
                raise RuntimeError(f"precis.{name}: {meta} is on meta but {other[0]} is on "
                                   f"{other[1]}: every tensor of a call must be on one device "
                                   f"(a meta tensor holds no data; the call would do nothing)")


def _checked_fake(name, fake):
    """fake (the op's fake kernel) after _refuse_meta_among_others; name: "op" or
    "op.overload"."""
    op, _, overload = name.partition(".")
    arguments = getattr(getattr(torch.ops.precis, op), overload or "default")._schema.arguments
    arg_names = [a.name for a in arguments]

    def checked(*args, **kwargs):
        _refuse_meta_among_others(name, arg_names, args)
        return fake(*args, **kwargs)
    return checked


def _register_fakes():
    fakes = {"count_nonfinite": _count_nonfinite_fake, "fingerprint": _fingerprint_fake,
             "fingerprint.blocks": _fingerprint_blocks_fake}
    for name in ("accumulate_", "cast_", "scale_", "check_finite_", "resync_masters_",
                 "resync_masters_.blocks",
                 "adam_step_",
                 "adam_step_.rule", "adam_step_.hyper", "held_step_", "adam_step_flat_",
                 "adam_step_flat_.rule", "adam_step_flat_.counted", "adam_step_flat_.hyper",
                 *fakes):
        torch.library.register_fake(f"precis::{name}",
                                    _checked_fake(name, fakes.get(name, _no_output)))


_register_fakes()


# ---- the element-wise ops ----------------------------------------------------------

def _writable(t, name, who):
    """Refuse what torch's in-place ops refuse of the tensor written, before it is: one
    that requires grad while grad mode is on (the op has no backward: torch refuses a
    leaf so, and a non-leaf's gradient would be silently wrong), an inference tensor
    outside inference mode. Not while traced (torch.compile checks its graph's)."""
    if not isinstance(t, torch.Tensor) or tracing.traced():
        return
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"{who}: {name} requires grad and grad mode is on: precis's in-place "
                           f"ops have no backward; call it under torch.no_grad(), or on "
                           f"{name}.detach()")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{who}: {name} is an inference tensor (made in "
                           f"torch.inference_mode()), which is written in place only inside "
                           f"inference mode, as by torch's ops")


def _written(t):
    """t's autograd version bumped, as torch's in-place ops bump it: a graph that saved t
    before the write raises at its backward, rather than using the new values."""
    if not tracing.traced():
        torch.autograd.graph.increment_version((t,))  # (a tuple: a tensor is iterated)


def accumulate_(dst, src):
    """dst += src in place (sum in fp32, rounded to nearest even into dst's dtype).
    dst may be src; no other overlap. Returns dst. As torch's in-place ops: dst's
    version bumped, refused where it requires grad in grad mode."""
    _writable(dst, "dst", "precis.accumulate_")
    torch.ops.precis.accumulate_(dst, src)
    _written(dst)
    return dst


def cast_(dst, src):
    """dst = src converted to dst's dtype (rounding to nearest even); returns dst.
    They must not overlap unless they are the same tensor. dst as accumulate_'s."""
    _writable(dst, "dst", "precis.cast_")
    torch.ops.precis.cast_(dst, src)
    _written(dst)
    return dst


def scale_(buf, factor):
    """buf *= factor in place (product in fp32, rounded back); factor must be finite.
    buf as accumulate_'s dst."""
    _lib.require_tensor(buf, "buf", "precis.scale_")  # the dispatcher needs a tensor to route
    _writable(buf, "buf", "precis.scale_")
    torch.ops.precis.scale_(buf, float(factor))
    _written(buf)
    return buf


def count_nonfinite(buf):
    """Number of NaN/Inf elements of buf, as a 0-dim int64 tensor on buf's device."""
    _lib.require_tensor(buf, "buf", "precis.count_nonfinite")
    return torch.ops.precis.count_nonfinite(buf)


def _tensor_list(tensors, name, who):
    """tensors (a list or tuple of tensors) as a list; a tensor alone refused (list() of
    one is its rows: each would be taken for a tensor of the list)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a list of tensors, got a tensor of shape "
                        f"{tuple(tensors.shape)}; give [t] for one")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _lib.require_tensor(t, f"{name}[{i}]", who)
    return tensors


def fingerprint(bufs):
    """precis_fingerprint of each buf's bytes (a list of contiguous tensors of the dtypes
    the glue knows, float32, float16, bfloat16, float64, int64, uint8 and int16, on one
    device) as an int64 tensor on that device (the uint64s' bits), one launch on a GPU
    for up to 64 of them: what precis.fingerprints compares there."""
    bufs = _tensor_list(bufs, "bufs", "precis.fingerprint")
    if not bufs:
        raise ValueError("precis.fingerprint: bufs is empty")
    return torch.ops.precis.fingerprint(bufs)


def fingerprint_blocks(bufs, block):
    """fingerprint of each buf's bytes in blocks of `block` bytes (op_constants.block_count:
    the last shorter, one for an empty buf), an int64 per block, the bufs' one after
    another, on their device: a record per block without a tensor per block."""
    bufs = _tensor_list(bufs, "bufs", "precis.fingerprint.blocks")
    if not bufs:
        raise ValueError("precis.fingerprint.blocks: bufs is empty")
    return torch.ops.precis.fingerprint.blocks(bufs, int(block))


def resync_masters_blocks_(masters, params, stale, kept, block):
    """resync_masters_ of each master and its param in blocks of `block` elements
    (op_constants.block_count), stale (uint8) and kept (int64) an entry per block, the
    params' one after another: the remainders of the blocks flagged zeroed, nothing read
    back (precis.optim_state.resync_blocks)."""
    masters = _tensor_list(masters, "masters", "precis.resync_masters_.blocks")
    params = _tensor_list(params, "params", "precis.resync_masters_.blocks")
    _lib.require_tensor(stale, "stale", "precis.resync_masters_.blocks")
    _lib.require_tensor(kept, "kept", "precis.resync_masters_.blocks")
    torch.ops.precis.resync_masters_.blocks(masters, params, stale, kept, int(block))
    return kept


def resync_masters_(masters, params, stale, kept=None):
    """precis_resync_masters: for each params[i] (bf16 / fp16) whose flag in stale is set
    (a bool or uint8 tensor, an entry per param), masters[i] resynced from it: an fp32
    master where it no longer rounds to the param, whole after a whole load (at most one
    element in 64 still rounding); 16- or 8-bit remainders (int16 / uint8) zeroed. Each
    master of its param's numel; all on one device, contiguous; the masters and kept apart
    from one another and from everything it reads. Returns kept (int64, an
    entry per param, made when None): the elements that still rounded (a param not
    flagged: its numel; remainders: 0). On a GPU the flags are read there: nothing is
    read back, and a tensor not flagged costs a read of its flag."""
    masters = _tensor_list(masters, "masters", "precis.resync_masters_")
    params = _tensor_list(params, "params", "precis.resync_masters_")
    _lib.require_tensor(stale, "stale", "precis.resync_masters_")
    if stale.dtype == torch.bool:
        stale = stale.view(torch.uint8)
    if kept is None:
        kept = torch.empty(len(params), dtype=torch.int64, device=stale.device)
    torch.ops.precis.resync_masters_(masters, params, stale, kept)
    return kept


# ---- the Adam step -----------------------------------------------------------------

def _one(t):
    return [] if t is None else [t]


def _rule(rule, op):
    """The number of a rule's name (RULES)."""
    number = RULES.get(rule) if isinstance(rule, str) else None
    if number is None:
        raise ValueError(f"precis.{op}: rule is {rule!r}; accepted: "
                         f"{', '.join(map(repr, RULES))}")
    return number


def adam_step_(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
               exp_avg_sq_scales, steps, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, adamw=True,
               maximize=False, inv_grad_scale=1.0, check_finite=False, seed=0, *,
               found_inf=None, lr_tensor=None, inv_grad_scale_tensor=None, step_tensors=(),
               amsgrad=False, max_exp_avg_sqs=(), max_exp_avg_sq_scales=(), ieee_sqrt=False,
               streams=(), element_offsets=(), rule="adam", momentum=0.0, dampening=0.0,
               nesterov=False, outputs=(), lr_scales=(), fingerprints=None, rule_hyper=()):
    """torch.ops.precis.adam_step_.rule with keyword defaults; see the module docstring
    (rule: a name of RULES; outputs, lr_scales: one per param, or empty; beta1, beta2, eps:
    torch.optim.Adam's defaults, read by adam, and lion's betas; fingerprints: None, or an
    int64 tensor of an entry per param, each param's fingerprint after the step: on the
    CPU, or on the params' GPU; the module docstring; on the CPU also [out, kept], as
    adam_step_flat_'s; rule_hyper: the rule's own hyperparameters, at most 4 floats,
    through the .hyper overload: muon_momentum's [0] is its form, 0 torch.optim.Muon's
    average, 1 dion's sum m = momentum * m + g).

    With check_finite and no found_inf, a zeroed flag is made. Returns found_inf
    (None when neither given nor needed): nonzero when the step was skipped;
    reading it synchronizes with the device.
    """
    params = list(params)
    if check_finite and found_inf is None and params:
        found_inf = torch.zeros(1, dtype=torch.float32, device=params[0].device)
    op, args = adam_step_call(
        params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
        steps, lr, beta1, beta2, eps, weight_decay, adamw, maximize, inv_grad_scale,
        check_finite, seed, found_inf=found_inf, lr_tensor=lr_tensor,
        inv_grad_scale_tensor=inv_grad_scale_tensor, step_tensors=step_tensors,
        amsgrad=amsgrad, max_exp_avg_sqs=max_exp_avg_sqs,
        max_exp_avg_sq_scales=max_exp_avg_sq_scales, ieee_sqrt=ieee_sqrt, streams=streams,
        element_offsets=element_offsets, rule=rule, momentum=momentum, dampening=dampening,
        nesterov=nesterov, outputs=outputs, lr_scales=lr_scales, fingerprints=fingerprints,
        rule_hyper=rule_hyper)
    op(*args)
    return found_inf


def adam_step_call(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, adamw=True, maximize=False, inv_grad_scale=1.0,
                   check_finite=False, seed=0, *, found_inf=None, lr_tensor=None,
                   inv_grad_scale_tensor=None, step_tensors=(), amsgrad=False,
                   max_exp_avg_sqs=(), max_exp_avg_sq_scales=(), ieee_sqrt=False, streams=(),
                   element_offsets=(), rule="adam", momentum=0.0, dampening=0.0,
                   nesterov=False, outputs=(), lr_scales=(), fingerprints=None, rule_hyper=()):
    """adam_step_'s call as (the overload, its positional arguments): .rule, or .hyper
    with rule_hyper (found_inf as given: no flag made)."""
    rule = _rule(rule, "adam_step_")
    hyper = (list(map(float, rule_hyper)),) if rule_hyper else ()
    return (torch.ops.precis.adam_step_.hyper if hyper else torch.ops.precis.adam_step_.rule), [
        list(params), list(grads), list(masters), list(exp_avgs), list(exp_avg_sqs),
        list(exp_avg_scales), list(exp_avg_sq_scales), list(map(int, steps or ())),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
        bool(maximize), float(inv_grad_scale), bool(check_finite), int(seed), _one(found_inf),
        _one(lr_tensor), _one(inv_grad_scale_tensor), list(step_tensors or ()), bool(amsgrad),
        list(max_exp_avg_sqs or ()), list(max_exp_avg_sq_scales or ()), bool(ieee_sqrt),
        list(map(int, streams or ())), list(map(int, element_offsets or ())), rule,
        float(momentum), float(dampening), bool(nesterov), list(outputs or ()),
        list(map(float, lr_scales or ())),
        list(fingerprints) if isinstance(fingerprints, (list, tuple)) else _one(fingerprints),
        *hyper]


def _hold(owner, hold, args):
    """owner.held: the id of the call hold(*args) held on the C side, let go of when
    owner is collected."""
    owner.held = hold(*args)
    finalizer = weakref.finalize(owner, _lib.torch_glue().precis_torch_drop_held, owner.held)
    finalizer.atexit = False  # (at exit the process lets go of everything)


class HeldStep:
    """An adam_step_ call held by the C side (precis::hold_step): its tensors kept by
    handle and its settings as given (adam_step_'s keywords, check_finite True: the call
    always checks its gradients), called again with only what changes between calls, a
    call of 8 arguments for torch to convert, not 35 (precis::held_step_; adam_step_'s
    own kernel then checks every tensor as at every call). What it holds stays as it
    was held: the caller keeps a HeldStep only while the call it was made from stands
    (release.GradientRelease's kept calls). Let go when collected."""

    __slots__ = ("held", "__weakref__")

    def __init__(self, **kwargs):
        op, args = adam_step_call(**{**kwargs, "check_finite": True, "found_inf": None,
                                     "params": (), "grads": (), "steps": (),
                                     "fingerprints": None})
        hold = torch.ops.precis.hold_step.hyper if op is torch.ops.precis.adam_step_.hyper \
            else torch.ops.precis.hold_step.rule
        _hold(self, hold, args)

    def __call__(self, params, grads, step_count, lr, inv_grad_scale, found_inf, fingerprints):
        """The held call with these: params and grads lists (the params never held:
        torch.utils.swap_tensors refuses a param C++ holds), step_count their count of steps
        (a float32 CPU tensor of one element: the call steps with step_count + 1, then
        adds 1 to it whatever the verdict, which the caller takes back when found_inf
        says the step was skipped), lr and inv_grad_scale numbers, found_inf the flag (a
        float32 tensor of one element, zeroed: set to 1 where a gradient is not finite),
        fingerprints a list (adam_step_'s). The count is written by the C side: its
        version counter (Tensor._version) does not move, as an add_ would move it."""
        torch.ops.precis.held_step_(self.held, params, grads, step_count, lr, inv_grad_scale,
                                    found_inf, fingerprints)


def adam_step_flat_(params, grads, buffers, table, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, adamw=True, maximize=False, inv_grad_scale=1.0,
                    check_finite=False, seed=0, *, found_inf=None, lr_tensor=None,
                    inv_grad_scale_tensor=None, amsgrad=False, ieee_sqrt=False, rule="adam",
                    momentum=0.0, dampening=0.0, nesterov=False, fingerprints=None, lrs=(),
                    weight_decays=(), resync=(), step_counts=None, rule_hyper=()):
    """torch.ops.precis.adam_step_flat_.rule with keyword defaults: `buffers` maps names
    of FLAT_BUFFERS to the flat state (absent names: empty tensors); rule: a name of
    RULES but muon_momentum (no outputs here); fingerprints: None, or an int64 tensor of
    one entry per param, written with each param's fingerprint after the step (on the
    CPU, or on the params' GPU; the module docstring); lrs, weight_decays: () for lr and
    weight_decay, or one float per param, its own (so that one call steps the params of
    several param groups, each with the bits of a call of its own; lrs not with
    lr_tensor); resync: () or (records, kept, sums), int64 tensors on the params' device,
    passed after fingerprints (which it needs; the module docstring), or (records, kept)
    (the blocks' compare of params with remainders: the module docstring); step_counts: None
    (the table's step column: each row's step number after this update), or a contiguous
    float32 CPU tensor of each row's steps taken so far (the .counted overload), which
    the op steps with + 1 (torch's float32 `step += 1`) and advances after the step, not
    with found_inf or check_finite (whose steps the caller counts once it reads the
    verdict); rule_hyper: as adam_step_'s (the .hyper overload, .counted's arguments and
    it). Returns found_inf, as adam_step_."""
    if check_finite and found_inf is None and params:
        found_inf = torch.zeros(1, dtype=torch.float32, device=params[0].device)
    op, args = flat_call(params, grads, buffers, table, lr, beta1, beta2, eps, weight_decay,
                         adamw, maximize, inv_grad_scale, check_finite, seed,
                         found_inf=found_inf, lr_tensor=lr_tensor,
                         inv_grad_scale_tensor=inv_grad_scale_tensor, amsgrad=amsgrad,
                         ieee_sqrt=ieee_sqrt, rule=rule, momentum=momentum, dampening=dampening,
                         nesterov=nesterov, fingerprints=fingerprints, lrs=lrs,
                         weight_decays=weight_decays, resync=resync, step_counts=step_counts,
                         rule_hyper=rule_hyper)
    op(*args)
    return found_inf


# Places in flat_call's argument list that a steady step rewrites (the schema's order).
FLAT_GRADS, FLAT_LR, FLAT_FINGERPRINTS, FLAT_LRS = 1, len(FLAT_BUFFERS) + 3, \
    len(FLAT_BUFFERS) + 22, -2


def flat_call(params, grads, buffers, table, lr, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, adamw=True, maximize=False, inv_grad_scale=1.0,
              check_finite=False, seed=0, *, found_inf=None, lr_tensor=None,
              inv_grad_scale_tensor=None, amsgrad=False, ieee_sqrt=False, rule="adam",
              momentum=0.0, dampening=0.0, nesterov=False, fingerprints=None, lrs=(),
              weight_decays=(), resync=(), step_counts=None, rule_hyper=()):
    """adam_step_flat_'s call as (the overload, its positional arguments, a list): made
    once, it is called again as op(*args) with no Python per argument (a Plan's steady
    step, step_plan.Steady, rewrites args[FLAT_GRADS], the lr's places and the kept in
    args[FLAT_FINGERPRINTS])."""
    rule = _rule(rule, "adam_step_flat_")
    params = list(params)
    device = params[0].device if params else table.device
    empty = None
    flat = []
    for name in FLAT_BUFFERS:
        t = buffers.get(name)
        if t is None:
            if empty is None:
                empty = torch.empty(0, device=device)
            t = empty
        flat.append(t)
    args = (params, list(grads), *flat, table, float(lr), float(beta1), float(beta2),
            float(eps), float(weight_decay), bool(adamw), bool(maximize), float(inv_grad_scale),
            bool(check_finite), int(seed), _one(found_inf), _one(lr_tensor),
            _one(inv_grad_scale_tensor), bool(amsgrad), bool(ieee_sqrt), rule, float(momentum),
            float(dampening), bool(nesterov), _one(fingerprints) + list(resync))
    rows = [list(map(float, lrs)), list(map(float, weight_decays))]
    if rule_hyper:
        counts = [] if step_counts is None else [step_counts]
        return torch.ops.precis.adam_step_flat_.hyper, \
            [*args, counts, list(map(float, rule_hyper)), *rows]
    if step_counts is None:
        return torch.ops.precis.adam_step_flat_.rule, [*args, *rows]
    return torch.ops.precis.adam_step_flat_.counted, [*args, [step_counts], *rows]


def check_finite_(grads, found_inf):
    """torch.ops.precis.check_finite_: found_inf = 1 if a gradient holds a NaN/Inf
    (found_inf apart from every gradient)."""
    torch.ops.precis.check_finite_(list(grads), found_inf)
    return found_inf
