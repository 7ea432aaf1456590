"""CPU benchmark of precis's one-state rules (issue #44: SGD, Lion and Muon's element-wise
parts on the update engine) against torch's fastest form of each optimizer and against
the hardware limit. The sibling of bench/adam_cpu.py: its timing, its reference loop's
build (bench/adam_reference_loop.c, whose rule loops are ref_rule_step) and its machine
lines, by import.

Scenarios (the same values in every row of a table): --numel params (default 60M) in
one 2-D tensor, and the same in --tensors N equal 2-D tensors (default 60: 1000 x
1000 each; 0 skips it); each at every --threads count (default 1,2: torch.set_num_
threads(n); precis follows torch's count, the reference loop omp_set_num_threads(n)).

Tables, per rule (--rules), each row one optimizer step on the scenario's tensors:

  * SGD (lr 0.01, momentum 0.9, no dampening, weight decay --sgd-weight-decay, default
    0): torch.optim.SGD for-loop (foreach=False), foreach and fused on fp32 params;
    the fastest is the "vs torch" baseline;
  * Lion (lr 1e-4, betas 0.9, 0.99, weight decay 0.01): torch has no Lion; a plain
    torch implementation in four forms: lion-pytorch's update_fn op by op (for-loop:
    p.mul_, exp_avg.clone().mul_(b1).add(g, alpha=1 - b1).sign_(), p.add_, exp_avg
    .mul_(b2).add_(g, alpha=1 - b2)), the same with lerp (for-loop lerp), and both as
    torch._foreach_* ops (foreach, foreach lerp); the fastest is the baseline;
  * Muon element-wise (lr 0.02, momentum 0.95, Nesterov, weight decay 0.1): the step
    without Newton-Schulz. torch: torch.optim.Muon's own ops (buf.lerp_(g, 1 - mom),
    g.lerp(buf, mom), .bfloat16() as Newton-Schulz's first op, param.mul_(1 - lr * wd),
    param.add_(update, alpha=-adjusted lr)): for-loop (torch.optim.Muon's single-tensor
    code with Newton-Schulz replaced by the bf16 cast) and foreach (the same as
    torch._foreach_* ops; torch.optim.Muon has no foreach). precis: the two op calls
    precis.muon_step makes (ops.adam_step_ rule="muon_momentum" writing the bf16
    direction into a new tensor per param, then rule="sgd" with momentum 0, decoupled
    decay and each param's adjusted lr, as lr_scales its ratio to lr, reading it), and
    each call alone ("momentum op", "apply op"; the momentum alone into a direction made
    once, as its loop writes one) against its own reference loop;
  * Muon whole step (--muon-matrices, default 4x128x128; '' skips): torch.optim.Muon
    against precis.optim.Muon, Newton-Schulz included (torch's bf16 matmuls in both),
    and Newton-Schulz alone over the same matrices.

precis rows, for each rule: the fp32 policy on fp32 params ("fp32"), bf16 params with
the default policy (bf16 momentum, fp32 master: "bf16 default") and with fp8 momentum
and 8-bit remainders ("fp8 + 8-bit rem": exp_avg_dtype fp8, store_param_remainders,
param_remainder_bits 8). SGD and Lion run precis.optim.SGD / .Lion's step(), and under
each such row its op call alone ("op alone": ops.adam_step_ with the group's op
arguments on the optimizer's state; --no-op-rows skips them).

"ref ms" / "vs ref": the hardware limit, ref_rule_step of bench/adam_reference_loop.c
(built in this run as bench/adam_cpu.py builds it: gcc -O3 -march=native -fopenmp):
one OpenMP region per op with the row's thread count, a plain C loop doing the rule's
arithmetic (the same FMAs as csrc/rules.h's element functions, which are torch's)
over arrays of the dtypes the policy keeps (the same bytes per param), with the same
stores (params and Muon's direction in bf16 to nearest, the momentum stochastically in
bf16, and in fp8 with one fp32 scale per 128 elements, 8-bit remainders). vs ref = ref
ms / row ms (1.00x: at the limit); torch's fp32 rows are compared with the fp32 loop.
Targets (issue #44): each rule's fp32 row >= 1.0x torch's fastest; the memory-saving
rows >= 0.8x of their reference loop.

Times: bench/adam_cpu.py's method (each step timed alone after one warm-up step, at
least --repeat steps and --min-time-ms of them per row), with a table's rows (its
reference loops included) timed round-robin, one step of each in turn, so that a load
that comes and goes falls on every row alike (the development VM has 2 cores shared
with other work); "best" is a row's fastest step (the one least disturbed: the ratios
use it, as bench/adam_cpu.py's do), "med" its median. GB/s: the bytes a row must move
per param (reads + writes, printed below the tables) x params / best time. Before
timing, the loops are checked against torch and precis on small tensors (elements that
differ after 3 steps: none for fp32; the bf16 and fp8 momenta draw other random
numbers than precis's, so their rows print the largest differences), and the bf16 loops
that see loads (element by element; with tile records) against the plain one (none, with
a third of the params written; the tile records against the params' fingerprints).

What a precis row includes: SGD's and Lion's whole optimizer.step() (the planned path:
a compare pass over params that keep a master or remainder, then the op, which sums
their record as it writes them, section 6 of docs/design.md), Muon's two op calls with
the direction tensors they allocate; the reference loop is the kernel's work alone. The
targets are the step rows'. Rows without a target take the step apart in the same run:
"op alone" (ops.adam_step_: the kernel, no record), "op with its record" (the planned
step's own op call, adam_step_flat_ with its fingerprints out, for the policies that
keep a record: the step without its compare pass and its Python), "fingerprint pass,
bf16 params" (one precis.fingerprints.of over the bf16 params: the compare), "ref loop
seeing loads, bf16" (the bf16 default's reference loop that also reads each param and
takes it as the master where it is not the master's rounding: a load seen element by
element in the loop itself, with no pass and no record, the least a step that sees
loads could add; "vs ref" against the plain loop), "ref loop with tile records" (the
same loop keeping one 64-bit record per tile of 4,096 elements, the fingerprint of the
tile's bf16 params as written, precis's sum, csrc/fingerprint.h: per tile it
fingerprints the params as found, runs the plain update where that is the record and the
element-by-element one where not, then records the tile as written; its records made by
one step before timing, so the timed steps are steady ones; "vs ref" against the plain
loop) and "new
bf16 direction, written" (a new bf16 tensor per param, filled once: its pages faulted
in, as each Muon step's directions are). The whole-step Muon rows carry no target (Newton-Schulz,
the same torch code in both, is all but all of the step).

    .venv/bin/python bench/rules_cpu.py [--numel 6e7] [--tensors 60] [--threads 1,2]
        [--rules sgd,lion,muon] [--muon-matrices 4x128x128] [--repeat 5]
        [--min-time-ms 200] [--no-muon-halves] [--no-op-rows]
"""
import argparse
import ctypes
import gc
import os
import statistics
import tempfile
import time
from unittest import mock

import torch

import adam_cpu  # noqa: E402  (bench/adam_cpu.py: puts torch_ext/ on sys.path)
from adam_cpu import build_reference, first_line, fmt_ratio, openmp_runtimes
from machine import cpu_model

REF_TARGET = adam_cpu.REF_TARGET  # memory-saving rows: >= 0.8x of their reference loop
TORCH_TARGET = 1.0  # fp32 rows: >= torch's fastest form
SCALE_BLOCK = adam_cpu.SCALE_BLOCK

# The reference loop's rules and storage kinds (adam_reference_loop.c)
REF_SGD, REF_LION, REF_MUON, REF_APPLY = range(4)
KIND_FP32, KIND_BF16, KIND_FP8_REM8 = 0, 1, 6
KIND_BF16_CHECKED = 7  # KIND_BF16 that sees a write into the param in its loop (the check row)
KIND_BF16_TILES = adam_cpu.KIND_BF16_TILES  # ... a tile of adam_cpu.TILE params at a time
TILE = adam_cpu.TILE

FP8_REM8 = {"exp_avg_dtype": "fp8", "store_param_remainders": True, "param_remainder_bits": 8}
# precis rows: name -> (param dtype, policy overrides, reference loop kind)
POLICIES = {
    "fp32": (torch.float32, {}, KIND_FP32),
    "bf16 default": (torch.bfloat16, {}, KIND_BF16),
    "fp8 + 8-bit rem": (torch.bfloat16, FP8_REM8, KIND_FP8_REM8),
}
SCALES = 2 * 4 / SCALE_BLOCK  # one fp32 scale per 128 elements, read and written
# Bytes per param each kind must move (reads + writes), per op:
#   SGD / Lion  fp32: read p, g, m; write p, m = 20. bf16 default: read g 2, master 4,
#               m 2; write param 2, master 4, m 2 = 16. fp8 + 8-bit rem: read g 2,
#               param 2, remainder 1, m 1; write param, remainder, m = 10 + scales.
#   Muon momentum  fp32: read g, m; write m, the bf16 direction = 14. bf16: read g, m;
#               write m, direction = 8. fp8: read g 2, m 1; write m 1, direction 2 = 6
#               + scales.
#   Muon apply  fp32: read p, the bf16 update; write p = 10. bf16: read update 2,
#               master 4; write param 2, master 4 = 12. fp8 + 8-bit rem (no momentum
#               read): read update, param, remainder; write param, remainder = 8.
BYTES = {
    REF_SGD: {KIND_FP32: 20.0, KIND_BF16: 16.0, KIND_FP8_REM8: 10.0 + SCALES},
    REF_MUON: {KIND_FP32: 14.0, KIND_BF16: 8.0, KIND_FP8_REM8: 6.0 + SCALES},
    REF_APPLY: {KIND_FP32: 10.0, KIND_BF16: 12.0, KIND_FP8_REM8: 8.0},
}
BYTES[REF_LION] = BYTES[REF_SGD]

SGD_HP = dict(lr=0.01, momentum=0.9, dampening=0.0, nesterov=False)
LION_HP = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
MUON_HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)


def f32(x):
    """x rounded to float, as a Python float."""
    return ctypes.c_float(x).value


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------


def matrix_shape(n):
    """(rows, cols), rows * cols = n, rows the largest divisor of n up to sqrt(n)."""
    rows = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return rows, n // rows


def initial_values(shapes, seed=0):
    """(param, grad) fp32 values per shape: the same in every row of a scenario."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g), torch.randn(s, generator=g) * 1e-2) for s in shapes]


make_params = adam_cpu.make_params


# ---------------------------------------------------------------------------
# The reference loops
# ---------------------------------------------------------------------------


class RuleConsts(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in (
        "wd", "momentum", "one_minus_dampening", "beta1", "one_minus_beta1", "beta2",
        "one_minus_beta2", "lerp_coef", "out_lerp_coef", "decay", "neg_lr")] + [
        (name, ctypes.c_int32) for name in (
            "lerp_from_g", "out_lerp_from_m", "nesterov", "first_step")] + [
        ("step", ctypes.c_uint32)]


def rule_consts(rule, step, hp):
    """The loop's constants for a rule at step, rounded to float where torch and
    csrc/rules.h round them (precis_step_consts_make)."""
    c = RuleConsts(decay=1.0, step=step, first_step=int(step <= 1))
    if rule == REF_SGD:
        c.wd, c.momentum = hp.get("weight_decay", 0.0), hp["momentum"]
        c.one_minus_dampening = 1.0 - hp["dampening"]
        c.nesterov, c.neg_lr = int(hp["nesterov"]), -hp["lr"]
    elif rule == REF_LION:
        b1, b2 = hp["betas"]
        c.beta1, c.one_minus_beta1, c.beta2, c.one_minus_beta2 = b1, 1.0 - b1, b2, 1.0 - b2
        c.decay, c.neg_lr = 1.0 - hp["lr"] * hp["weight_decay"], -hp["lr"]
    elif rule == REF_MUON:  # torch's lerp: a weight >= 0.5 starts from the end point
        w, wn = f32(1.0 - hp["momentum"]), f32(hp["momentum"])
        c.lerp_from_g, c.out_lerp_from_m = int(w >= 0.5), int(wn >= 0.5)
        c.lerp_coef = w - 1.0 if w >= 0.5 else w
        c.out_lerp_coef = wn - 1.0 if wn >= 0.5 else wn
        c.nesterov = int(hp["nesterov"])
    else:  # REF_APPLY: decoupled decay with the group's lr, the step with the adjusted
        c.decay, c.neg_lr = 1.0 - hp["lr"] * hp["weight_decay"], -hp["adjusted_lr"]
    return c


def load_rules(lib):
    lib.ref_rule_step.restype = ctypes.c_int
    lib.ref_rule_step.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.POINTER(RuleConsts)]
    return lib


def ref_buffers(kind, values, muon=False):
    """Per tensor: {param, grad, master, m, ms, out, records} of a kind (absent: None).
    The bf16 kinds' masters start as precis's do, from the bf16 param; the tile kind's
    records (int64 holding uint64s, one per TILE elements) as zeros: none made yet."""
    bufs = []
    for p0, g0 in values:
        if kind != KIND_FP32:
            p0 = p0.bfloat16().float()
        n = p0.numel()
        b = dict(master=None, ms=None, out=None, records=None)
        if kind == KIND_FP32:
            b.update(param=p0.clone(), grad=g0.clone(), m=torch.zeros_like(p0))
        elif kind in (KIND_BF16, KIND_BF16_CHECKED, KIND_BF16_TILES):
            b.update(param=p0.bfloat16(), grad=g0.bfloat16(), master=p0.clone(),
                     m=torch.zeros(p0.shape, dtype=torch.bfloat16))
            if kind == KIND_BF16_TILES:
                b["records"] = torch.zeros(-(-n // TILE), dtype=torch.int64)
        else:
            from precis.checkpoint import remainder_split
            param, rem = remainder_split(p0, bits=8)
            b.update(param=param, grad=g0.bfloat16(), master=rem,
                     m=torch.zeros(p0.shape, dtype=torch.uint8),
                     ms=torch.zeros(-(-n // SCALE_BLOCK)))
        if muon:
            b["out"] = torch.empty(p0.shape, dtype=torch.bfloat16)
        bufs.append(b)
    return bufs


class RuleRef:
    """One rule's reference loop over a scenario's buffers (ref_buffers), buffer b of
    tensor k as the loop's slot b reads it; step() runs it once."""

    SLOTS = ("param", "grad", "master", "m", "ms", "out", "records")

    def __init__(self, lib, rule, kind, bufs, hp, slots=None):
        self.lib, self.rule, self.kind, self.hp, self.step_count = lib, rule, kind, hp, 0
        self.bufs = bufs
        slots = slots or {}
        numel = [b["grad"].numel() for b in bufs]
        blocks = [0]
        for n in numel:
            blocks.append(blocks[-1] + -(-n // SCALE_BLOCK))
        k = len(bufs)
        self.k = k
        self.numel = (ctypes.c_int64 * k)(*numel)
        self.blocks = (ctypes.c_int64 * (k + 1))(*blocks)

        def ptr(b, slot):
            t = b.get(slots.get(slot, slot))
            return None if t is None else t.data_ptr()
        self.ptrs = (ctypes.c_void_p * (len(self.SLOTS) * k))(
            *[ptr(b, s) for s in self.SLOTS for b in bufs])

    def step(self):
        self.step_count += 1
        c = rule_consts(self.rule, self.step_count, self.hp)
        rc = self.lib.ref_rule_step(self.rule, self.kind, self.k, self.numel, self.blocks,
                                    self.ptrs, ctypes.byref(c))
        if rc:
            raise RuntimeError(f"ref_rule_step({self.rule}, {self.kind}) failed ({rc})")


class MuonRef:
    """Muon's element-wise step as two loops (its two ops): the momentum (grad, m ->
    m, the bf16 direction in 'out'), then the apply (param, master <- out)."""

    def __init__(self, lib, kind, values, hp, parts=("momentum", "apply")):
        bufs = ref_buffers(kind, values, muon=True)
        self.loops = []
        if "momentum" in parts:
            self.loops.append(RuleRef(lib, REF_MUON, kind, bufs, hp,
                                      {"param": "-", "master": "-"}))
        if "apply" in parts:
            self.loops.append(RuleRef(lib, REF_APPLY, kind, bufs, hp,
                                      {"grad": "out", "m": "-", "ms": "-"}))
        self.bufs = bufs

    def step(self):
        for loop in self.loops:
            loop.step()


# ---------------------------------------------------------------------------
# torch's forms
# ---------------------------------------------------------------------------


class TorchLion:
    """Lion in plain torch ops (no torch.optim.Lion): lion-pytorch's update_fn per
    tensor ('for-loop'), with lerp ('for-loop lerp'), and both as foreach ops."""

    FORMS = ("for-loop", "for-loop lerp", "foreach", "foreach lerp")

    def __init__(self, params, form, lr, betas, weight_decay):
        self.params, self.form = params, form
        self.lr, self.wd, (self.b1, self.b2) = lr, weight_decay, betas
        self.m = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        ps, gs, ms = [p.detach() for p in self.params], [p.grad for p in self.params], self.m
        lr, b1, b2, decay = self.lr, self.b1, self.b2, 1 - self.lr * self.wd
        if self.form == "for-loop":
            for p, g, m in zip(ps, gs, ms):
                p.mul_(decay)
                update = m.clone().mul_(b1).add(g, alpha=1 - b1).sign_()
                p.add_(update, alpha=-lr)
                m.mul_(b2).add_(g, alpha=1 - b2)
        elif self.form == "for-loop lerp":
            for p, g, m in zip(ps, gs, ms):
                p.mul_(decay)
                p.add_(m.lerp(g, 1 - b1).sign_(), alpha=-lr)
                m.lerp_(g, 1 - b2)
        elif self.form == "foreach":
            torch._foreach_mul_(ps, decay)
            updates = torch._foreach_mul(ms, b1)
            torch._foreach_add_(updates, gs, alpha=1 - b1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(ps, updates, alpha=-lr)
            torch._foreach_mul_(ms, b2)
            torch._foreach_add_(ms, gs, alpha=1 - b2)
        else:
            torch._foreach_mul_(ps, decay)
            updates = torch._foreach_lerp(ms, gs, 1 - b1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(ps, updates, alpha=-lr)
            torch._foreach_lerp_(ms, gs, 1 - b2)


def bf16_cast(grad, *unused):
    """Newton-Schulz's first op alone (grad.bfloat16()): what Muon's element-wise
    step keeps of it."""
    return grad.bfloat16()


def adjusted_lr(shape, lr=None):
    """torch.optim.Muon's adjusted lr of a matrix (lr=1.0: its ratio to the lr, what
    precis.muon_step passes as lr_scales)."""
    from torch.optim._muon import _adjust_lr
    return _adjust_lr(MUON_HP["lr"] if lr is None else lr, None, shape)


class TorchMuonElementwise:
    """torch.optim.Muon's step without Newton-Schulz (its bf16 cast kept): 'for-loop'
    is torch.optim.Muon's own step with _zeropower_via_newtonschulz patched;
    'foreach' the same ops as torch._foreach_* ops."""

    FORMS = ("for-loop", "foreach")

    def __init__(self, params, form):
        self.params, self.form = params, form
        hp = MUON_HP
        if form == "for-loop":
            self.opt = torch.optim.Muon(params, lr=hp["lr"], weight_decay=hp["weight_decay"],
                                        momentum=hp["momentum"], nesterov=hp["nesterov"])
        else:
            self.bufs = [torch.zeros_like(p) for p in params]
            self.alphas = {-adjusted_lr(p.shape) for p in params}
            if len(self.alphas) != 1:
                raise ValueError("foreach form: the matrices must share one shape")

    @torch.no_grad()
    def step(self):
        hp = MUON_HP
        if self.form == "for-loop":
            with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", bf16_cast):
                self.opt.step()
            return
        ps, gs = [p.detach() for p in self.params], [p.grad for p in self.params]
        torch._foreach_lerp_(self.bufs, gs, 1 - hp["momentum"])
        updates = torch._foreach_lerp(gs, self.bufs, hp["momentum"])
        updates = [u.bfloat16() for u in updates]
        torch._foreach_mul_(ps, 1 - hp["lr"] * hp["weight_decay"])
        torch._foreach_add_(ps, updates, alpha=next(iter(self.alphas)))


def state_lists(opt, params):
    """The op's lists of a precis optimizer's state (masters or remainders, exp_avgs,
    their scales: [] where no param has one) and its step count."""
    states = [opt.state[p] for p in params]

    def listed(*keys):
        values = [next((s[k] for k in keys if k in s), None) for s in states]
        return [] if all(v is None for v in values) else values
    return (listed("master", "remainder"), listed("exp_avg"), listed("exp_avg_scale"),
            int(states[0]["step"]))


class PrecisRuleOp:
    """The op call of precis.optim.SGD's or .Lion's step alone (ops.adam_step_ with the
    group's op arguments, the rule's op_args, on the state its first step made): the
    kernel's time, without the step's Python, its compare pass over params with a master
    and the record the planned op sums as it writes them (docs/design.md section 6)."""

    def __init__(self, precis, params, cls, policy, hp):
        self.ops, self.params, self.lr = precis.ops, params, hp["lr"]
        opt = getattr(precis.optim, cls)(params, policy=policy, **hp)
        opt.step()  # makes the state
        self.masters, self.exp_avgs, self.exp_avg_scales, self.step_count = state_lists(
            opt, params)
        self.args = opt._rule.op_args(opt.param_groups[0])

    def step(self):
        self.step_count += 1
        self.ops.adam_step_(params=[p.detach() for p in self.params],
                            grads=[p.grad for p in self.params], masters=self.masters,
                            exp_avgs=self.exp_avgs, exp_avg_scales=self.exp_avg_scales,
                            exp_avg_sqs=[], exp_avg_sq_scales=[],
                            steps=[self.step_count] * len(self.params), lr=self.lr, seed=0,
                            **self.args)


class PrecisRuleRecordedOp:
    """The op call of precis.optim.SGD's or .Lion's planned step alone, as the step
    makes it: adam_step_flat_ on the Plan's flat state, summing the fingerprints of the
    params it writes (the step's record, docs/design.md section 6). The step less its
    compare pass and its Python; against "op alone", what the record costs."""

    def __init__(self, precis, params, cls, policy, hp):
        opt = getattr(precis.optim, cls)(params, policy=policy, **hp)
        opt.step()  # makes the state
        opt.step()  # ... and the Plan
        calls = precis.step_plan.planned_calls(opt._books, opt.state, opt.param_groups, 0)
        if calls is None or len(calls) != 1 or calls[0].args["fingerprints"] is None:
            raise RuntimeError(f"{cls} {policy}: no planned call with a record")
        self.call, self.opt = calls[0], opt  # (the Plan's state lives in opt)
        self.row_step = precis.ops.ROW_STEP

    def step(self):
        self.call.args["table"][:, self.row_step] += 1  # the next step's number
        self.call.op()(**self.call.args)


class PrecisMuonOps:
    """The two op calls of precis.muon_step.step without Newton-Schulz: the momentum
    (rule muon_momentum, the bf16 direction into a new tensor per param, as muon_step
    allocates it) then the apply (rule sgd, momentum 0, decoupled decay, each param's
    adjusted lr: lr_scales, its ratio to lr) reading the direction. State from
    precis.optim.Muon's first step. parts: both, or one alone (its inputs made once; the
    momentum alone writes a direction made once, as its reference loop does, where
    both allocate it as muon_step does: at 60M params in one tensor a fresh mmap the
    OS faults in, about 70 ms a step at 1 thread on the Zen 3, bench/RESULTS.md)."""

    def __init__(self, precis, params, policy, parts=("momentum", "apply")):
        self.ops, self.params, self.parts = precis.ops, params, parts
        hp = MUON_HP
        opt = precis.optim.Muon(params, lr=hp["lr"], weight_decay=hp["weight_decay"],
                                momentum=hp["momentum"], nesterov=hp["nesterov"],
                                policy=policy)
        with mock.patch("precis.muon_step._zeropower_via_newtonschulz", bf16_cast):
            opt.step()  # makes the state
        self.masters, self.exp_avgs, self.exp_avg_scales, self.step_count = state_lists(
            opt, params)
        self.lr_scales = [adjusted_lr(p.shape, 1.0) for p in params]  # as precis.muon_step
        self.directions = [p.grad.bfloat16() for p in params]  # the apply's alone
        # the momentum's alone
        self.outputs = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
        self.opt = opt

    def step(self, parts=None):
        hp, ops = MUON_HP, self.ops
        parts = parts or self.parts
        self.step_count += 1
        steps = [self.step_count] * len(self.params)
        params = [p.detach() for p in self.params]
        keys = dict(steps=steps, lr=hp["lr"], seed=0, beta1=0.0, beta2=0.0, eps=1.0,
                    params=params, masters=self.masters, exp_avg_sqs=[], exp_avg_sq_scales=[])
        if "momentum" in parts:
            directions = self.outputs if "apply" not in parts else \
                [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
            ops.adam_step_(grads=[p.grad for p in self.params], exp_avgs=self.exp_avgs,
                           exp_avg_scales=self.exp_avg_scales, weight_decay=0.0,
                           rule="muon_momentum", momentum=hp["momentum"],
                           nesterov=hp["nesterov"], outputs=directions, **keys)
        else:
            directions = self.directions
        if "apply" in parts:
            ops.adam_step_(grads=directions, exp_avgs=[], exp_avg_scales=[],
                           weight_decay=hp["weight_decay"], adamw=True, rule="sgd",
                           lr_scales=self.lr_scales, **keys)


# ---------------------------------------------------------------------------
# Checks: the loops against torch and precis (small tensors, 3 steps)
# ---------------------------------------------------------------------------


def differ(xs, ys):
    """'n differ (max |diff| x)' over lists of tensors."""
    n = sum(int((x.float() != y.float()).sum()) for x, y in zip(xs, ys))
    worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(xs, ys))
    return f"{n} differ" + (f" (max |diff| {worst:.2g})" if n else "")


def check_loops(lib, precis, steps=3):
    """Elements of the masters and momenta that differ after `steps` steps: the
    reference loops against torch (fp32) and precis (fp32: the bits must match; the
    bf16 and fp8 momenta round stochastically from other random numbers than precis's:
    the largest differences, for fp8 the masters' only)."""
    shapes = [(40, 25), (3, 43), (64, 64)]
    values = initial_values(shapes, seed=1)
    out = []

    def run(make, dtype):
        params = make_params(values, dtype)
        opt = make(params)
        for _ in range(steps):
            opt.step()
        return params, opt

    def loop(rule, kind, hp):
        ref = RuleRef(lib, rule, kind, ref_buffers(kind, values), hp)
        for _ in range(steps):
            ref.step()
        return ref.bufs

    def master(bufs, kind):
        if kind == KIND_FP32:
            return [b["param"] for b in bufs]
        if kind == KIND_BF16:
            return [b["master"] for b in bufs]
        from precis.checkpoint import remainder_join
        return [remainder_join(b["param"], b["master"]) for b in bufs]

    def precis_master(opt, params, kind):
        if kind == KIND_FP32:
            return [p.detach() for p in params]
        if kind == KIND_BF16:
            return [opt.state[p]["master"] for p in params]
        from precis.checkpoint import remainder_join
        return [remainder_join(p.detach(), opt.state[p]["remainder"]) for p in params]

    def seeing_loads(rule, hp):
        """The bf16 loops that see loads (element by element; with tile records)
        against the plain one: masters that differ with nothing written, then after a
        write into every third param, which the plain loop is given as its master too
        (what seeing the write must do); the tile loop's records against the params'
        fingerprints after each. With the check's tensors, one of 3 tiles ending mid-word
        (records past word 0, the zero-padded last word, and a thread split on a tile
        boundary inside a tensor).
        """
        tvalues = values + initial_values([(3, 3001)], seed=4)
        plain, seen, tiles = (RuleRef(lib, rule, kind, ref_buffers(kind, tvalues), hp)
                              for kind in (KIND_BF16, KIND_BF16_CHECKED, KIND_BF16_TILES))
        loops = (plain, seen, tiles)
        for _ in range(steps):
            for ref in loops:
                ref.step()

        def compare():
            return (differ(master(plain.bufs, KIND_BF16), master(seen.bufs, KIND_BF16)),
                    differ(master(plain.bufs, KIND_BF16), master(tiles.bufs, KIND_BF16)),
                    adam_cpu.tile_records_differ(
                        lib, [(b["param"], b["records"]) for b in tiles.bufs]))
        before, tiles_before, records_before = compare()
        for a, b, c in zip(*(ref.bufs for ref in loops)):
            loaded = (a["param"].float() * -1.5 + 0.25).bfloat16().view(-1)[::3]
            a["param"].view(-1)[::3] = loaded
            b["param"].view(-1)[::3] = loaded
            c["param"].view(-1)[::3] = loaded
            a["master"].view(-1)[::3] = loaded.float()
        for ref in loops:
            ref.step()
        after, tiles_after, records_after = compare()
        return (f"bf16 loop seeing loads vs the plain one: master {before} with nothing "
                f"written, {after} after a write into a third of the params; bf16 loop with "
                f"tile records vs the plain one: master {tiles_before} with nothing written "
                f"(records {records_before} from the params' fingerprints), {tiles_after} "
                f"after a write into a third of the params (records {records_after})")

    sgd_hp = dict(SGD_HP, weight_decay=0.0)
    for rule, name, hp, torch_make, precis_cls in (
            (REF_SGD, "SGD", sgd_hp,
             lambda ps: torch.optim.SGD(ps, foreach=False, **sgd_hp), "SGD"),
            (REF_LION, "Lion", LION_HP, lambda ps: TorchLion(ps, "for-loop", **LION_HP),
             "Lion")):
        bufs = loop(rule, KIND_FP32, hp)
        params, opt = run(torch_make, torch.float32)
        tm = [opt.state[p]["momentum_buffer"] for p in params] if rule == REF_SGD else opt.m
        parts = [f"vs torch {'SGD for-loop' if rule == REF_SGD else 'lion-pytorch for-loop'}"
                 f": p {differ(master(bufs, 0), [p.detach() for p in params])}, "
                 f"m {differ([b['m'] for b in bufs], tm)}"]
        if precis is not None:
            for pol, (dtype, overrides, kind) in POLICIES.items():
                bufs = loop(rule, kind, hp)
                params, opt = run(lambda ps: getattr(precis.optim, precis_cls)(
                    ps, policy=overrides, **hp), dtype)
                got = precis_master(opt, params, kind)
                if kind == KIND_FP8_REM8:
                    worst = max(float((a - b).abs().max())
                                for a, b in zip(master(bufs, kind), got))
                    parts.append(f"vs precis {pol}: master max |diff| {worst:.2g} "
                                 f"(other random numbers)")
                    continue
                pm = [opt.state[p]["exp_avg"] for p in params]
                parts.append(f"vs precis {pol}: master {differ(master(bufs, kind), got)}, "
                             f"m {differ([b['m'] for b in bufs], pm)}"
                             + (" (other random numbers)" if kind == KIND_BF16 else ""))
        out.append(f"{name} loop after {steps} steps: " + "; ".join(parts)
                   + f"; {seeing_loads(rule, hp)}")

    # Muon: square matrices (one adjusted lr), the loops against torch's ops and precis's
    mvalues = initial_values([(32, 32)] * 3, seed=2)
    hp = dict(MUON_HP, adjusted_lr=adjusted_lr((32, 32)))
    ref = MuonRef(lib, KIND_FP32, mvalues, hp)
    params = make_params(mvalues, torch.float32)
    tm = TorchMuonElementwise(params, "for-loop")
    for _ in range(steps):
        ref.step()
        tm.step()
    bufs = [tm.opt.state[p]["momentum_buffer"] for p in params]
    parts = [f"vs torch.optim.Muon (no Newton-Schulz): p "
             f"{differ([b['param'] for b in ref.bufs], [p.detach() for p in params])}, m "
             f"{differ([b['m'] for b in ref.bufs], bufs)}"]
    if precis is not None:
        for pol, (dtype, overrides, kind) in POLICIES.items():
            if kind == KIND_FP8_REM8:
                continue
            ref = MuonRef(lib, kind, mvalues, hp)
            params = make_params(mvalues, dtype)
            po = PrecisMuonOps(precis, params, overrides)  # its first step: the optimizer's
            ref.step()
            for _ in range(steps - 1):
                ref.step()
                po.step()
            got = precis_master(po.opt, params, kind)
            parts.append(f"vs precis {pol} ops: master {differ(master(ref.bufs, kind), got)}, "
                         f"m {differ([b['m'] for b in ref.bufs], po.exp_avgs)}"
                         + (" (other random numbers)" if kind == KIND_BF16 else ""))
    out.append(f"Muon loops after {steps} steps: " + "; ".join(parts))
    return out


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def print_table(title, rows, numel):
    """rows: (label, bytes/param, (best, med) or None, ref (best, med) or None,
    torch baseline best or None, target kind ('torch', 'ref' or None), note)."""
    header = (f"{'row':<30} {'B/param':>7} {'best ms':>9} {'med ms':>9} {'GB/s':>6} "
              f"{'vs torch':>8} {'ref ms':>9} {'ref GB/s':>8} {'vs ref':>7}  target")
    print(title)
    print(header)
    print("-" * len(header))
    met = []
    for label, nbytes, t, ref, torch_s, tgt, note in rows:
        ref_s = ref[0] if ref else None
        ref_cols = (f"{ref_s * 1e3:>9.2f} {numel * nbytes / ref_s / 1e9:>8.1f}"
                    if ref_s else f"{'-':>9} {'-':>8}")
        gbs = f"{numel * nbytes / t[0] / 1e9:>6.1f}" if t and nbytes else f"{'-':>6}"
        if t is None:
            print(f"{label:<30} {(f'{nbytes:g}' if nbytes else '-'):>7} {'n/a':>9} {'-':>9} {'-':>6} {'-':>8} {ref_cols}"
                  f" {'-':>7}  ({note})")
            continue
        best, med = t
        vs_torch = torch_s / best if torch_s else None
        vs_ref = ref_s / best if ref_s else None
        tcol = ""
        if tgt == "torch" and vs_torch is not None:
            ok = vs_torch >= TORCH_TARGET
            met.append(ok)
            tcol = f"torch>={TORCH_TARGET:.2f} {'ok' if ok else 'MISS'}"
        elif tgt == "ref" and vs_ref is not None:
            ok = vs_ref >= REF_TARGET
            met.append(ok)
            tcol = f"ref>={REF_TARGET:.2f} {'ok' if ok else 'MISS'}"
        print(f"{label:<30} {(f'{nbytes:g}' if nbytes else '-'):>7} {best * 1e3:>9.2f} {med * 1e3:>9.2f} "
              f"{gbs} {fmt_ratio(vs_torch):>8} {ref_cols} "
              f"{fmt_ratio(vs_ref):>7}  {tcol}{('  ' + note) if note else ''}".rstrip())
    print()
    return met


def measure(args, entries):
    """Time the steps of a table's rows together: entries (key, factory), each
    factory making its row's objects and returning its step(). Every step is warmed
    up once, then timed round-robin, one step of each row in turn, for at least
    --repeat rounds and until each row has --min-time-ms of timed steps: a load that
    comes and goes (other processes on the machine) falls on every row alike. Returns
    {key: ((best, median) seconds, None) or (None, why not)}."""
    steps, out = {}, {}
    for key, factory in entries:
        try:
            step = factory()
            step()
            steps[key] = step
        except (RuntimeError, TypeError, ValueError) as e:
            out[key] = (None, first_line(e, 70))
    times = {key: [] for key in steps}
    min_s = args.min_time_ms / 1e3
    while steps and (min(len(t) for t in times.values()) < args.repeat
                     or min(sum(t) for t in times.values()) < min_s):
        for key, step in steps.items():
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    for key, t in times.items():
        out[key] = ((min(t), statistics.median(t)), None)
    steps.clear()
    gc.collect()
    return out


def fastest(results, keys):
    ok = {k: results[k][0] for k in keys if results[k][0] is not None}
    key = min(ok, key=lambda k: ok[k][0])
    return key[-1], ok[key][0]


def run_sgd_or_lion(args, lib, precis, values, numel, title, rule):
    """The table of SGD (rule REF_SGD) or Lion (REF_LION)."""
    if rule == REF_SGD:
        hp = dict(SGD_HP, weight_decay=args.sgd_weight_decay)
        forms = list(adam_cpu.TORCH_MODES)

        def torch_make(form):
            return lambda: torch.optim.SGD(make_params(values, torch.float32), **hp,
                                           **adam_cpu.TORCH_MODES[form]).step
        precis_cls = "SGD"
    else:
        hp = LION_HP
        forms = list(TorchLion.FORMS)

        def torch_make(form):
            return lambda: TorchLion(make_params(values, torch.float32), form, **hp).step
        precis_cls = "Lion"

    def ref_make(kind):
        return lambda: RuleRef(lib, rule, kind, ref_buffers(kind, values), hp).step

    def tiles_make():
        """The loop with tile records, its records made by one step: measure's warm-up
        and timed steps are steady ones (every tile matches)."""
        ref = RuleRef(lib, rule, KIND_BF16_TILES, ref_buffers(KIND_BF16_TILES, values), hp)
        ref.step()
        return ref.step

    def precis_make(dtype, overrides):
        return lambda: getattr(precis.optim, precis_cls)(make_params(values, dtype),
                                                         policy=overrides, **hp).step

    def op_make(dtype, overrides, op=PrecisRuleOp):
        return lambda: op(precis, make_params(values, dtype), precis_cls, overrides, hp).step
    entries = [(("torch", f), torch_make(f)) for f in forms]
    for pol, (dtype, overrides, kind) in POLICIES.items():
        entries.append((("ref", kind), ref_make(kind)))
        if precis is not None:
            entries.append((("precis", pol), precis_make(dtype, overrides)))
            if not args.no_op_rows:
                entries.append((("op", pol), op_make(dtype, overrides)))
                if kind != KIND_FP32:  # (fp32 params keep no master: no record)
                    entries.append((("recorded op", pol),
                                    op_make(dtype, overrides, PrecisRuleRecordedOp)))
    if precis is not None and not args.no_op_rows:
        entries.append((("fingerprint",), fingerprint_make(precis, values)))
        entries.append((("ref", KIND_BF16_CHECKED), ref_make(KIND_BF16_CHECKED)))
        entries.append((("ref", KIND_BF16_TILES), tiles_make))
    res = measure(args, entries)
    base_name, base = fastest(res, [("torch", f) for f in forms])
    rows = []
    for f in forms:
        t, err = res[("torch", f)]
        rows.append((f"torch {f} fp32", BYTES[rule][KIND_FP32], t, res[("ref", KIND_FP32)][0],
                     base, None, err))
    for pol, (dtype, overrides, kind) in POLICIES.items():
        t, err = res.get(("precis", pol), (None, "skipped"))
        rows.append((f"precis {pol}", BYTES[rule][kind], t, res[("ref", kind)][0], base,
                     "torch" if kind == KIND_FP32 else "ref", err))
        if ("op", pol) in res:
            t, err = res[("op", pol)]
            rows.append(("  op alone", BYTES[rule][kind], t, res[("ref", kind)][0], None, None,
                         err))
        if ("recorded op", pol) in res:
            t, err = res[("recorded op", pol)]
            rows.append(("  op with its record", BYTES[rule][kind], t, res[("ref", kind)][0],
                         None, None, err))
    if ("fingerprint",) in res:
        t, err = res[("fingerprint",)]
        rows.append(("fingerprint pass, bf16 params", 2.0, t, None, None, None, err))
    if ("ref", KIND_BF16_CHECKED) in res:
        t, err = res[("ref", KIND_BF16_CHECKED)]
        rows.append(("ref loop seeing loads, bf16", BYTES[rule][KIND_BF16] + 2.0, t,
                     res[("ref", KIND_BF16)][0], None, None, err))
    if ("ref", KIND_BF16_TILES) in res:  # + 2 the param read, + a record per tile
        t, err = res[("ref", KIND_BF16_TILES)]
        rows.append(("ref loop with tile records", BYTES[rule][KIND_BF16] + 2.0
                     + adam_cpu.TILE_RECORD_BYTES, t, res[("ref", KIND_BF16)][0], None, None,
                     err))
    head = (f"SGD (momentum {hp['momentum']}, weight decay {hp['weight_decay']})"
            if rule == REF_SGD else "Lion (betas 0.9, 0.99, weight decay 0.01)")
    return print_table(f"== {head}, {title}; torch fastest: {base_name} "
                       f"{base * 1e3:.2f} ms ==", rows, numel)


def fingerprint_make(precis, values):
    """One fingerprint pass over bf16 params (precis.fingerprints.of, as a planned step
    makes one over params that keep a master or remainder, before the op, to see writes
    behind its back; the op records what it writes itself): the step's compare."""
    def make():
        params = [p.detach() for p in make_params(values, torch.bfloat16)]
        return lambda: precis.fingerprints.of(params)
    return make


def direction_make(values):
    """A new bf16 tensor of each param's shape, written once (as muon_step allocates
    the directions the momentum op writes): its pages are faulted in at every step."""
    shapes = [p0.shape for p0, _ in values]
    return lambda: (lambda: [torch.empty(shape, dtype=torch.bfloat16).fill_(0.5)
                             for shape in shapes])


def run_muon_elementwise(args, lib, precis, values, numel, title):
    shapes = {tuple(p0.shape) for p0, _ in values}
    hp = dict(MUON_HP, adjusted_lr=adjusted_lr(next(iter(shapes))))
    both = {k: BYTES[REF_MUON][k] + BYTES[REF_APPLY][k] for k in BYTES[REF_MUON]}
    parts = ((), ("momentum",), ("apply",))  # both ops, or one alone
    if args.no_muon_halves:
        parts = parts[:1]
    made = {}  # one precis object and one loop object per policy serve every part

    def torch_make(form):
        return lambda: TorchMuonElementwise(make_params(values, torch.float32), form).step

    def ref_make(kind, part):
        def make():
            if part == ():
                made[("ref", kind)] = MuonRef(lib, kind, values, hp)
                return made[("ref", kind)].step
            loops = made[("ref", kind)].loops
            return loops[0 if part == ("momentum",) else 1].step
        return make

    def precis_make(dtype, overrides, part):
        def make():
            if part == ():
                made[("precis", dtype, str(overrides))] = PrecisMuonOps(
                    precis, make_params(values, dtype), overrides)
            obj = made[("precis", dtype, str(overrides))]
            return lambda: obj.step(part or ("momentum", "apply"))
        return make

    forms = TorchMuonElementwise.FORMS
    entries = [(("torch", f), torch_make(f)) for f in forms]
    for pol, (dtype, overrides, kind) in POLICIES.items():
        for part in parts:
            entries.append((("ref", kind, part), ref_make(kind, part)))
            if precis is not None:
                entries.append((("precis", pol, part), precis_make(dtype, overrides, part)))
    if precis is not None and not args.no_muon_halves:
        entries.append((("direction",), direction_make(values)))
    res = measure(args, entries)
    made.clear()
    gc.collect()
    base_name, base = fastest(res, [("torch", f) for f in forms])
    rows = []
    for f in forms:
        t, err = res[("torch", f)]
        rows.append((f"torch {f} fp32", both[KIND_FP32], t, res[("ref", KIND_FP32, ())][0],
                     base, None, err))
    for pol, (dtype, overrides, kind) in POLICIES.items():
        for part in parts:
            t, err = res.get(("precis", pol, part), (None, "skipped"))
            ref = res[("ref", kind, part)][0]
            if part == ():
                rows.append((f"precis {pol}", both[kind], t, ref, base,
                             "torch" if kind == KIND_FP32 else "ref", err))
            else:
                rule = REF_MUON if part == ("momentum",) else REF_APPLY
                rows.append((f"  {part[0]} op alone", BYTES[rule][kind], t, ref, None, None,
                             err))
    if ("direction",) in res:
        t, err = res[("direction",)]
        rows.append(("new bf16 direction, written", 2.0, t, None, None, None, err))
    return print_table(f"== Muon element-wise (momentum {hp['momentum']}, Nesterov, weight "
                       f"decay {hp['weight_decay']}; no Newton-Schulz), {title}; torch "
                       f"fastest: {base_name} {base * 1e3:.2f} ms ==", rows, numel)


def run_muon_whole(args, precis, shapes, title):
    from torch.optim._muon import (DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS,
                                   _zeropower_via_newtonschulz)
    values = initial_values(shapes, seed=3)
    numel = sum(p0.numel() for p0, _ in values)
    hp = MUON_HP

    def ns_alone():
        grads = [g0 for _, g0 in values]
        return lambda: [_zeropower_via_newtonschulz(g, (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                                                    DEFAULT_NS_STEPS, EPS) for g in grads]

    def precis_make(dtype, overrides):
        return lambda: precis.optim.Muon(make_params(values, dtype), policy=overrides,
                                         **hp).step
    entries = [("torch", lambda: torch.optim.Muon(make_params(values, torch.float32),
                                                  **hp).step),
               ("ns", ns_alone)]
    if precis is not None:
        entries += [(pol, precis_make(dtype, overrides))
                    for pol, (dtype, overrides, _) in POLICIES.items()]
    res = measure(args, entries)
    base = res["torch"][0][0] if res["torch"][0] else None
    rows = [("torch.optim.Muon fp32", None, *res["torch"][:1], None, base, None,
             res["torch"][1]),
            ("Newton-Schulz alone", None, res["ns"][0], None, base, None, res["ns"][1])]
    for pol in POLICIES:
        t, err = res.get(pol, (None, "skipped"))
        rows.append((f"precis.optim.Muon {pol}", None, t, None, base, None, err))
    return print_table(f"== Muon whole step (Newton-Schulz {DEFAULT_NS_STEPS} steps in "
                       f"bf16), {title} ==", rows, numel)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=6e7, help="params per scenario")
    ap.add_argument("--tensors", type=int, default=60,
                    help="the second scenario's tensor count (0: one tensor only)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--rules", default="sgd,lion,muon",
                    help="of sgd, lion, muon (element-wise), muon-whole")
    ap.add_argument("--muon-matrices", default="4x128x128",
                    help="the whole Muon step's matrices: COUNTxROWSxCOLS ('' skips)")
    ap.add_argument("--sgd-weight-decay", type=float, default=0.0)
    ap.add_argument("--no-muon-halves", action="store_true",
                    help="skip the rows of each Muon op alone")
    ap.add_argument("--no-op-rows", action="store_true",
                    help="skip the rows of SGD's and Lion's op call alone")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--min-time-ms", type=float, default=200.0)
    ap.add_argument("--skip-precis", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    threads = [int(x) for x in args.threads.split(",") if x.strip()]

    precis = None
    if not args.skip_precis:
        import precis
        import precis.muon_step  # noqa: F401  (patched by the Muon rows)
    numel = int(args.numel)
    cases = [(f"{numel / 1e6:g}M params in 1 tensor {'x'.join(map(str, matrix_shape(numel)))}",
              [matrix_shape(numel)])]
    if args.tensors:
        per = numel // args.tensors
        shape = matrix_shape(per)
        cases.append((f"{per * args.tensors / 1e6:g}M params in {args.tensors} tensors "
                      f"{'x'.join(map(str, shape))}", [shape] * args.tensors))
    start = time.perf_counter()

    default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="precis_rules_ref_") as tmp:
        lib, ref_build = build_reference(tmp)
        load_rules(lib)
        isa = precis.cpu_isa() if precis is not None else "-"
        where = ""
        try:
            where = f" ({os.path.relpath(precis._lib.lib().precis_path)})"
        except Exception:
            pass
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
              f"(default threads {default_threads}), precis.cpu_isa() {isa}{where}")
        print(f"reference loop: {os.path.relpath(adam_cpu.REF_SOURCE)} (ref_rule_step) built "
              f"with {ref_build}")
        print(f"OpenMP runtime(s) mapped: {openmp_runtimes()}")
        if not args.skip_checks:
            for line in check_loops(lib, precis):
                print(f"check: {line}")
        print()
        met = []
        for title, shapes in cases:
            numel = sum(r * c for r, c in shapes)
            values = None
            for n in threads:
                torch.set_num_threads(n)
                lib.ref_set_num_threads(n)
                if torch.get_num_threads() != n or lib.ref_get_max_threads() != n:
                    print(f"warning: asked for {n} threads; torch has "
                          f"{torch.get_num_threads()}, the loop {lib.ref_get_max_threads()}")
                if values is None:
                    values = initial_values(shapes)
                load = ", load average %.1f" % os.getloadavg()[0]
                label = f"{title}, {n} thread{'s' if n > 1 else ''}{load}"
                if "sgd" in rules:
                    met += run_sgd_or_lion(args, lib, precis, values, numel, label, REF_SGD)
                if "lion" in rules:
                    met += run_sgd_or_lion(args, lib, precis, values, numel, label, REF_LION)
                if "muon" in rules:
                    met += run_muon_elementwise(args, lib, precis, values, numel, label)
            del values
            gc.collect()
        if args.muon_matrices and ("muon" in rules or "muon-whole" in rules):
            count, rows, cols = (int(x) for x in args.muon_matrices.split("x"))
            for n in threads:
                torch.set_num_threads(n)
                load = ", load average %.1f" % os.getloadavg()[0]
                met += run_muon_whole(args, precis, [(rows, cols)] * count,
                                      f"{count} matrices {rows}x{cols}, {n} "
                                      f"thread{'s' if n > 1 else ''}{load}")
        torch.set_num_threads(default_threads)
    print("bytes per param (reads + writes; the rows' B/param): SGD and Lion fp32 20, bf16 "
          "default 16, fp8 + 8-bit rem 10.0625 (ref loop seeing loads 18, with tile records "
          f"{18 + adam_cpu.TILE_RECORD_BYTES:g}); Muon element-wise (momentum + apply) fp32 "
          "14 + 10, bf16 default 8 + 12, fp8 + 8-bit rem 6.0625 + 8; torch's rows: the fp32 "
          "bytes (the least its ops could move)")
    print("vs torch: torch's fastest form ms / row ms (> 1: faster); vs ref: reference loop "
          "ms / row ms (1.00x: at the limit); ratios of best times")
    print(f"timed in {time.perf_counter() - start:.0f} s")
    if met:
        print(f"targets met: {sum(met)} of {len(met)}")


if __name__ == "__main__":
    main()
