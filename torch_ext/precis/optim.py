"""precis.optim: precision-aware fused Adam and AdamW.

    opt = precis.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = precis.optim.AdamW(model.parameters(), policy={"exp_avg_dtype": "fp8",
                                                         "store_param_remainders": True})

The optimizer state of each param lives in the dtypes its precision policy
chooses (docs/design.md section 3): `policy` is None (the defaults for each param's
dtype), a precis.Policy (for params of its param_dtype), or a mapping of
overrides applied per param dtype with precis.resolve_policy. The Adam math is
C's (precis_adam_step, through torch.ops.precis.adam_step_): one call per param
group and step (one per dtype combination in the group). Python only keeps the
books.

Params: float32, float16, bfloat16 or complex64, in any strides. A dense param
(contiguous, channels_last, transposed, any permutation) is stepped as its elements
in memory order, and its state has its strides (fp16/fp8 blocks of 128 follow
memory order); a view with gaps is stepped through a contiguous copy written back;
a param whose elements share memory (expanded) is refused. A complex64 param is
stepped as torch does, as view_as_real pairs of fp32, with complex64 moments and
the fp32 policy (other moment dtypes or masters are refused for it). float64 and
complex128 params, and every param of a differentiable=True group (fp32 params with the
fp32 policy only), are stepped by torch.optim.Adam's own code (precis.torch_math):
torch's values and state, and a step autograd can differentiate through.

torch.compile(opt.step): the step counts reach the kernel as tensors in a traced step,
so a compiled step is one graph from its second step on (the first, which makes the
state, is another), with no graph break from precis, as torch's compiled AdamW.

State of a param (allocated at its first step, laid out like the param, on its device):

  step              torch's: a float32 0-dim tensor on the CPU (on the param's device
                    when capturable), counting as torch's does (exact up to 2^24)
  exp_avg           first moment in exp_avg_dtype (fp8 as uint8 E4M3 bytes)
  exp_avg_sq        second moment in exp_avg_sq_dtype
  exp_avg_scale     fp32 block scales, only for fp16 / fp8 moments
  exp_avg_sq_scale  same for exp_avg_sq
  max_exp_avg_sq    amsgrad only: the running max of exp_avg_sq, in its dtype (+
                    max_exp_avg_sq_scale for fp16 / fp8), as torch's
  master            fp32 / fp16 master weights, when the policy keeps a separate
                    copy (none when the param is its own master: fp32 models, or a
                    bf16 master = stochastic rounding of bf16 params)
  remainder         int16 low halves of the fp32 master (store_param_remainders):
                    master = param:remainder exactly

Checkpoints (precis.checkpoint, plain functions): state_dict() holds every buffer
in its stored dtype, and a run resumed with load_state_dict() follows the same
trajectory bit for bit. A state torch.optim would misread (scaled moments, masters,
remainders) has a 'step' torch's loader refuses with a message naming
precis.checkpoint.to_torch_state_dict, the converter to torch's layout.
load_state_dict() also takes a torch.optim.Adam / AdamW state dict (plain
moments, no master) and converts it to the policy's dtypes; anything malformed
raises ValueError and leaves the optimizer unchanged.

Model weights loaded after the optimizer was built make master weights and
remainders stale. Call reload_model_params() after loading; the optimizer also
notices by itself (a param's _version or storage changed since its last step),
resyncs that param's master or remainder from the param before stepping it, and
warns once (StaleMasterWarning). Writes through `param.data` bypass the version
counter and are not noticed: call reload_model_params() after those.

Sharded params (torch's fully_shard / precis.fsdp: DTensor params): each rank steps
its local shard, the state is kept as DTensors placed like the param (state_dict()
and torch.distributed.checkpoint see DTensors), a NaN/Inf found with grad_scale
skips the step on every rank holding a shard, and fp16/fp8 moments are refused.

Loss scaling: the optimizer leaves `_step_supports_amp_scaling` False, so a
GradScaler unscales the gradients and skips step() on Inf/NaN as it does for any
torch optimizer. To fuse the unscaling into the kernel instead, call
step(grad_scale=scale, found_inf=flag) (or set the optimizer's `grad_scale` /
`found_inf` attributes, as torch's fused Adam reads them): a truthy found_inf
skips the step; with grad_scale, gradients are multiplied by 1/grad_scale in the
kernel (they are not written back) and any Inf/NaN gradient skips the whole step,
every param group, without modifying params or state (a found_inf tensor is then
set to 1). `last_step_skipped` tells whether the last step() was skipped (None after
a step compiled by torch.compile, which dynamo traces as a capturable one).

CPU offload (offload="cpu" or True, offload_fraction): the state of the
offloaded params lives on the CPU and the CPU kernel steps host copies of them in
a few pieces, each written back to its params as soon as it is stepped
(precis.offload, docs/design.md section 10); the state dict has the same format
either way.

Capturable (capturable=True, as torch's): a step reads nothing back from the
device, so a whole optimizer step can be captured in a CUDA graph and replayed.
Each param's 'step' is then torch's float32 tensor on its device (the kernel gets
int64 copies of the counts), the
learning rate goes to the kernel through a float64 device tensor (give the
group a tensor lr, e.g. torch.tensor(1e-3, dtype=torch.float64, device="cuda"),
and change it in place to change the lr of a replayed graph; a float lr is
copied in at capture time), grad_scale and found_inf may be device tensors
(found_inf=GradScaler's flag: a step with found_inf set changes nothing, steps
counts included), and last_step_skipped is None: read `last_found_inf` (the
device flag of the last step, or None) instead. As with any CUDA graph, take a
few eager steps on a side stream first, so that the state exists before capture.
capturable=True also works on CPU params (same results, no graphs there).
All param groups must agree on capturable; all params of a capturable optimizer
must be on one device.
"""

import math
import operator
import warnings
from collections import defaultdict
from collections.abc import Mapping
from itertools import repeat
from typing import NamedTuple

import torch
from torch.optim.optimizer import _device_dtype_check_for_fused, _to_scalar

from . import checkpoint as ckpt
from . import ops, torch_math
from .dtensor import (agree_on_nonfinite, is_dtensor, local_shard, local_state, meshes_of,
                      placed_like, shard_stamp)
from .group_checks import check_hparams, check_param
# The stored forms are precis.optim's public names too (they were defined here first).
from .checkpoint import decode_moment, encode_moment, remainder_join, remainder_split  # noqa
from .offload import Offload, parse as parse_offload
from .ops import PARAM_DTYPES, SCALED_MOMENT_DTYPES, mix_seed, scale_count
from .policy import Policy, policy_for


__all__ = ["Adam", "AdamW", "StaleMasterWarning", "encode_moment", "decode_moment",
           "remainder_split", "remainder_join"]

# Group options of torch.optim.Adam/AdamW that precis keeps for compatibility: foreach
# and fused change nothing (the step is always one fused kernel per dtype combination).
TORCH_FLAG_KEYS = ("amsgrad", "foreach", "differentiable", "fused")
# Group options that are the optimizer's own, whatever a loaded state dict says.
OWN_GROUP_KEYS = ("policy", "capturable")


# The op's state lists and the state keys they hold (the first key present).
_LISTS = {"masters": ("master", "remainder"), "exp_avgs": ("exp_avg",),
          "exp_avg_sqs": ("exp_avg_sq",), "exp_avg_scales": ("exp_avg_scale",),
          "exp_avg_sq_scales": ("exp_avg_sq_scale",), "max_exp_avg_sqs": ("max_exp_avg_sq",),
          "max_exp_avg_sq_scales": ("max_exp_avg_sq_scale",)}
_AMSGRAD_LISTS = ("max_exp_avg_sqs", "max_exp_avg_sq_scales")


class StaleMasterWarning(UserWarning):
    """A param was written outside the optimizer; its master/remainder was resynced."""


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


class _Call(NamedTuple):
    """One torch.ops.precis.adam_step_ call of a step: a param group's params on one
    device, the op's keyword arguments (local shards of DTensors), and the params'
    state dicts."""
    device: torch.device
    args: dict
    states: list
    params: list
    writebacks: list  # (param, contiguous copy stepped in its place)
    plan: "_Plan" = None  # the _Plan that made the call: one add_ counts its steps
    whole: "_Call" = None  # for a piece (offload): the call it was cut from

    # Pieces of a call, for offload's pipelined step (precis.offload.Offload.pipeline).

    def tensor_bytes(self):
        """The bytes of each param's buffers the op reads and writes."""
        lists = [[t.nbytes for t in v] for v in self.args.values()
                 if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)]
        return [sum(column) for column in zip(*lists)]

    def divisible(self):
        """Whether pieces of the call give its bits: not when a bf16 param rounds
        stochastically (no master, no remainder), keyed on its index in the call, nor
        for a plan's call (its one add_ counts every param's step)."""
        return self.plan is None and not any(
            "master" not in st and "remainder" not in st and p.dtype is torch.bfloat16
            for p, st in zip(self.params, self.states))

    def piece(self, start, stop):
        """The call of params[start:stop] (the writebacks go with the first piece)."""
        args = {k: v[start:stop] if isinstance(v, list) else v for k, v in self.args.items()}
        return self._replace(args=args, states=self.states[start:stop],
                             params=self.params[start:stop],
                             writebacks=self.writebacks if start == 0 else [], whole=self)


class _Plan(NamedTuple):
    """The steady state of a param group's steps, so that a step need not look at
    each param's state again: one device, every param plain (contiguous, not a
    DTensor, not complex, not offloaded) with a gradient and complete state. Its
    state's 'step' tensors are views of one float32 buffer (torch's float32
    counts, counted by one add_). Checked at every step, a whole list at a time
    (same params, dtypes, shapes, policy, state object and step tensors; grads contiguous,
    of the params' sizes, on the device; no write to a param with a master behind
    the optimizer's back); anything else takes the full path, which makes a new
    plan. While the plan holds, the stamps of the params with a master are its
    own (`versions`, `ptrs`), not _AdamBase._synced's: _drop_plan hands them back."""
    key: tuple           # (policy key, amsgrad)
    state: dict          # the optimizer's state object
    device: torch.device
    params: tuple
    param_dtypes: tuple
    grad_dtypes: tuple
    numels: tuple
    shapes: tuple        # the params' shapes (their state has them)
    states: tuple
    step_buffer: torch.Tensor
    step_views: tuple
    lists: dict          # op list name -> state key
    stamped: tuple       # the params whose master/remainder a write would make stale ...
    versions: list       # ... their _version after the plan's last step ...
    ptrs: list           # ... and their data_ptr()


_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_IS_CPU = operator.attrgetter("is_cpu")
_VERSION = operator.attrgetter("_version")
_STEP = operator.itemgetter("step")


def _policy_key(policy):
    """A hashable key for a group's policy option (None, Policy or mapping)."""
    if policy is None or isinstance(policy, Policy):
        return policy
    return tuple(sorted((str(k), repr(v)) for k, v in policy.items()))


def _plain_policy(policy):
    """The policy option as plain data (strings, bools, None) for a state dict."""
    if policy is None:
        return None
    if isinstance(policy, Policy):
        return policy.to_dict()
    return {str(k): (v if v is None or isinstance(v, (bool, int, float, str)) else str(v))
            for k, v in policy.items()}


def _kernel_view(t):
    """t as the kernel takes it: contiguous. A dense tensor in other strides
    (channels_last, transposed) gives its elements in memory order, which its
    state shares; complex gives real pairs."""
    if t.is_contiguous() and not t.is_complex():
        return t
    return ckpt.dense_flat(t)


# The fp32 policy's layout: the one differentiable=True takes (torch_math steps it).
_FP32 = ckpt.Layout(None, None, torch.float32, torch.float32)


# ---------------------------------------------------------------------------
# The optimizers
# ---------------------------------------------------------------------------


def _counts_on_device(group):
    """Whether the step counts reach the kernel as tensors on the params' device: for a
    capturable group, and in a step traced by torch.compile (as Python ints, dynamo
    would guard on each count and compile a new graph at every step)."""
    return group["capturable"] or torch.compiler.is_compiling()


def _recorded(key, doc):
    """A public attribute kept in the optimizer's `_last` dict (see _init_books)."""
    return property(lambda self: self._last[key],
                    lambda self, value: self._last.__setitem__(key, value), doc=doc)


class _AdamBase(torch.optim.Optimizer):
    """Shared machinery of Adam and AdamW (a group's decoupled_weight_decay selects the
    weight decay)."""

    _always_decoupled = False  # AdamW: every group decouples, whatever a state dict says

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, *, maximize, foreach,
                 capturable, differentiable, fused, decoupled_weight_decay, policy, seed,
                 offload, offload_fraction):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
                        eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay,
                        policy=policy, seed=seed)
        name = type(self).__name__
        check_hparams(defaults, name)
        defaults["betas"] = tuple(map(_to_scalar, defaults["betas"]))  # as torch: 0-dim tensors
        mode = parse_offload(offload, offload_fraction, name)
        if mode is not None and capturable:
            raise ValueError(f"{name}: offload={offload!r} with capturable=True: an offloaded "
                             f"step runs on the host, which a CUDA graph cannot capture")
        self._init_books()
        super().__init__(params, defaults)
        if mode is not None:
            self._offload = Offload(offload_fraction, name)
            self._offload.select(self.param_groups, self.state)

    # -- bookkeeping that is not optimizer state --------------------------------

    def _init_books(self):
        self._layouts = {}        # (policy key, param dtype) -> _Layout
        self._synced = {}         # id(param) -> (param._version, data_ptr) after our last write
        self._plans = {}          # group index -> _Plan (the steady state of its steps)
        self._fingerprints = {}   # param -> fingerprint its loaded remainder belongs to
        self._buffers = {}        # (use, device) -> scratch tensor kept between steps
        self._offload = None      # the precis.offload.Offload of an offloaded optimizer
        # What step() records, kept as a dict's items: under torch.compile a setattr on
        # an optimizer fails (2.11: AssertionError) or is dropped (2.12, 2.13: the
        # compiled step leaves the attribute as it was); a dict store is traced.
        self._last = {"step_skipped": False, "found_inf": None, "warned_stale": False}

    last_step_skipped = _recorded(
        "step_skipped", "Whether the last step() was skipped; None after a capturable step.")
    last_found_inf = _recorded(
        "found_inf", "The device flag of the last capturable step (set when it was skipped), "
        "or None.")

    def __setstate__(self, state):
        super().__setstate__(state)
        if not hasattr(self, "_layouts"):
            self._init_books()

    def _layout(self, group, param, key=None):
        # A param sharded by precis.fsdp carries its model's policy (the default when
        # the group has none); it may be kept in the master dtype, as its own master.
        model = getattr(param, "_precis_policy", None)
        key = (_policy_key(group["policy"]) if key is None else key, param.dtype, model)
        layout = self._layouts.get(key)
        if param.dtype in torch_math.DTYPES:
            layout = ckpt.Layout(None, None, param.dtype, param.dtype)
        if layout is None:
            name = type(self).__name__
            option = model if group["policy"] is None else group["policy"]
            if param.is_complex():
                layout = ckpt.param_layout(option, param, name)
            else:
                policy = policy_for(option, param.dtype if model is None else model.param_dtype,
                                    name, hint="or a param group per dtype")
                layout = ckpt.layout_of(policy, param.dtype)
                if param.dtype != policy.param_dtype and (
                        layout.master is not None or param.dtype != policy.main_params_dtype):
                    raise ValueError(f"{name}: a param kept in {param.dtype} by precis.fsdp "
                                     f"does not fit the policy {policy.to_dict()}; give the "
                                     f"optimizer the policy given to precis.fsdp.fully_shard")
            self._layouts[key] = layout
        if group["differentiable"] and param.dtype not in torch_math.DTYPES and (
                layout != _FP32 or param.dtype != torch.float32):
            raise ValueError(f"{type(self).__name__}: differentiable=True with a {param.dtype} "
                             f"param kept as {layout}: a differentiable step runs torch's own "
                             f"math, which autograd can follow, and that needs fp32 (or "
                             f"float64) params with the fp32 policy (fp32 moments, no master); "
                             f"precis's low-precision state is stepped by a C kernel autograd "
                             f"cannot differentiate through")
        if is_dtensor(param) and any(d in SCALED_MOMENT_DTYPES for d in
                                      (layout.exp_avg_dtype, layout.exp_avg_sq_dtype)):
            raise ValueError(f"{type(self).__name__}: a DTensor param (shape "
                             f"{tuple(param.shape)}) cannot have fp16 or fp8 moments: their "
                             f"block scales follow the local shard, which a checkpoint could "
                             f"not reshard; use fp32 or bf16 moments")
        return layout

    def _buffer(self, use, device, shape, dtype):
        """A tensor of `shape` on device kept from step to step, made (zeroed) at its
        first use: a step captured in a CUDA graph after warm-up steps allocates
        nothing. Callers overwrite what they read."""
        buf = self._buffers.get((use, device))
        if buf is None:
            buf = self._buffers[(use, device)] = torch.zeros(shape, dtype=dtype, device=device)
        return buf

    def _absent(self, device):
        """The empty fp32 tensor that stands for an absent list entry."""
        return self._buffer("absent", device, (0,), torch.float32)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        try:
            check_hparams(group, f"{type(self).__name__} param group {index}")
            if group["capturable"] != self.param_groups[0]["capturable"]:
                raise ValueError(f"{type(self).__name__} param group {index}: capturable is "
                                 f"{group['capturable']} but {self.param_groups[0]['capturable']} "
                                 f"in group 0; all param groups must agree")
            for i, p in enumerate(group["params"]):
                check_param(local_shard(p, p), f"{type(self).__name__}: param {i} of group {index}")
                self._layout(group, p)  # resolves the policy now: bad ones fail here
            if self._offload is not None:
                self._offload.select(self.param_groups, self.state)
        except Exception:
            self.param_groups.pop()
            raise

    def zero_grad(self, set_to_none=True):
        """As torch's. `main_grad` buffers belong to their gradient buckets and are
        not touched. Written out rather than inherited: torch.compile does not trace
        torch.optim.Optimizer.zero_grad, so a compiled training step calling it
        could not be one graph."""
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                if p.grad.is_sparse:
                    p.grad.zero_()
                else:
                    grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)

    # -- state ----------------------------------------------------------------

    def _home(self, p):
        """What p is stepped as: its host copy when offloaded (precis.offload), else p."""
        if self._offload is not None and self._offload.selected(p):
            return self._offload.host(p)
        return p

    def _where(self, gi, i, p):
        return f"{type(self).__name__}: param {i} of group {gi} (shape {tuple(p.shape)})"

    def _ensure_state(self, p, state, layout, gi, i, capturable, amsgrad):
        """Allocate whatever buffer of p's state is missing (first step, a load that
        carried no master, amsgrad turned on later), and check the rest still fits
        the layout.
        'step' is torch's: a float32 0-dim tensor, on the CPU, or on p's device when
        capturable. Buffers have p's strides (a param whose memory format changed
        since gets its state laid out anew). A DTensor param's buffers are DTensors
        placed like it."""
        local = local_shard(p, p)
        step = state.get("step")
        if not (type(step) is torch.Tensor and step.dtype == torch.float32
                and (step.device == p.device if capturable else step.is_cpu)):
            state["step"] = ckpt.step_tensor(0 if step is None else int(step),
                                             p.device if capturable else "cpu")
        # State made for these strides needs no look (the step path stays cheap).
        relayout = not is_dtensor(p) and "exp_avg" in state and \
            state["exp_avg"].stride() != local.stride()
        moments = [("exp_avg", layout.exp_avg_dtype), ("exp_avg_sq", layout.exp_avg_sq_dtype)]
        if amsgrad:
            moments.append(("max_exp_avg_sq", layout.exp_avg_sq_dtype))
        for key, dtype in moments:
            t = state.get(key)
            if t is None:
                state[key] = placed_like(p, torch.zeros_like(local, dtype=dtype))
                if dtype in SCALED_MOMENT_DTYPES:
                    state[key + "_scale"] = torch.zeros(scale_count(p.numel()),
                                                        dtype=torch.float32, device=p.device)
            elif t.dtype != dtype or t.shape != p.shape:
                raise RuntimeError(
                    f"{self._where(gi, i, p)}: its {key} is {t.dtype} of shape "
                    f"{tuple(t.shape)} but the policy now wants {dtype} of shape "
                    f"{tuple(p.shape)}; did the param change dtype or shape after the "
                    f"optimizer state was created?")
            elif relayout and not ckpt.laid_out_like(t, local):
                state[key], scales = ckpt.relayout(local, t, state.get(key + "_scale"),
                                                   ckpt.MOMENT_KEYS[key])
                if scales is not None:
                    state[key + "_scale"] = scales
        if layout.master == "master":
            if "master" not in state:
                state["master"] = placed_like(p, local.detach().to(dtype=layout.master_dtype,
                                                                    copy=True))
        elif layout.master == "remainder":
            if "remainder" not in state:
                state["remainder"] = placed_like(p, torch.zeros_like(local, dtype=torch.int16))
        for key in ("master", "remainder"):
            if relayout and key in state and not ckpt.laid_out_like(state[key], local):
                state[key] = ckpt.like(local, state[key])
        if ("master" in state and layout.master != "master") or \
                ("remainder" in state and layout.master != "remainder"):
            raise RuntimeError(f"{self._where(gi, i, p)}: its state has a master/remainder its "
                               f"policy does not keep for a {p.dtype} param; did the param "
                               f"change dtype?")

    def _resync(self, p, state, auto):
        """Rebuild p's master or remainder from p. auto: only if it is inconsistent.
        Returns True when something was rewritten."""
        changed = False
        expected = self._fingerprints.pop(p, None)
        local = local_shard(p, self._home(p))
        if "master" in state:
            master = local_shard(p, state["master"])
            if not (auto and torch.equal(ckpt.flat_bits(master.to(p.dtype)),
                                         ckpt.flat_bits(local))):
                master.copy_(local.detach())
                changed = True
        elif "remainder" in state:
            if not (auto and expected is not None and ckpt.fingerprint(local) == expected):
                local_shard(p, state["remainder"]).zero_()  # master = the param exactly
                changed = True
        self._synced[id(p)] = shard_stamp(p)
        return changed

    @torch.no_grad()
    def reload_model_params(self):
        """Resync every master weight and remainder from the params.

        Call it after loading model weights into the params of an optimizer that
        already has state (e.g. model.load_state_dict after the optimizer was built
        and stepped); otherwise the next step would continue from stale masters.
        """
        for gi in list(self._plans):  # _synced takes the stamps made here
            self._drop_plan(gi)
        for group in self.param_groups:
            for p in group["params"]:
                if self._offload is not None:
                    self._offload.reload(p)
                state = self.state.get(p)
                if state:
                    self._resync(p, state, auto=False)

    def master_weight(self, p):
        """p's fp32 master weights as the optimizer sees them (a new tensor; complex64
        for a complex param)."""
        state = self.state.get(p, {})
        if "master" in state:
            return state["master"].float()
        if "remainder" in state:
            return remainder_join(p.detach(), state["remainder"])
        return p.detach().to(torch.complex64 if p.is_complex() else torch.float32, copy=True)

    def decoded_state(self, p):
        """p's state as full-precision values in p's shape: {'step', 'master',
        'exp_avg', 'exp_avg_sq'}, and 'max_exp_avg_sq' with amsgrad (moments decoded
        from their stored form); {} before its first step."""
        state = self.state.get(p)
        if not state:
            return {}
        return {
            "step": int(state["step"]),
            "master": self.master_weight(p),
            **{key: ckpt.moment_values(state[key], state.get(key + "_scale"), second)
               for key, second in ckpt.MOMENT_KEYS.items() if key in state},
        }

    # -- step -----------------------------------------------------------------

    def _gather(self, gi, group, resynced, fresh, torch_params):
        """The op calls of one param group: [_Call], one per device of its params (two
        on the CPU when host copies of CUDA params share it with CPU params). Params
        torch's math steps (torch_math) are appended to torch_params instead.
        (param, None) is appended to `fresh` for a param whose state is made here,
        (param, keys) for one that gets new buffers (e.g. amsgrad's max turned on)."""
        # Hyperparameters may have changed since construction (schedulers, users): a
        # bad one in any group must fail before the first group is written.
        check_hparams(group, f"{type(self).__name__} param group {gi}")
        pkey = _policy_key(group["policy"])
        call = self._planned_call(gi, group, pkey)
        if call is not None:
            return [call]
        self._drop_plan(gi)
        capturable = _counts_on_device(group)
        by_call = {}  # (device, ieee_sqrt) -> [(param, grad, state)]
        for i, p in enumerate(group["params"]):
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is None:
                continue
            layout = self._layout(group, p, pkey)
            if torch_math.uses_torch_math(group, p, layout == _FP32):
                torch_params.append(p)
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{self._where(gi, i, p)}: sparse gradients are not "
                                   f"supported")
            if grad.numel() != p.numel() or grad.device != p.device:
                raise ValueError(f"{self._where(gi, i, p)}: its gradient has {grad.numel()} "
                                 f"elements on {grad.device}, the param {p.numel()} on "
                                 f"{p.device}")
            if grad.dtype not in PARAM_DTYPES + ckpt.COMPLEX_DTYPES or \
                    grad.is_complex() != p.is_complex():  # before any group's kernel writes
                raise ValueError(f"{self._where(gi, i, p)}: its gradient has dtype "
                                 f"{grad.dtype}; supported: float32, float16, bfloat16 (complex64 "
                                 f"for a complex64 param)")
            home = self._home(p)
            if home is not p:  # offloaded: the host copy of the grad
                grad = self._offload.host_grad(p, grad)
            else:
                grad = local_shard(p, grad)
            state = self.state[p]
            had_state, keys = len(state) > 0, set(state)  # not bool(): torch 2.11 cannot trace it
            if group["fused"] and not had_state:  # torch's refusal (e.g. meta params)
                _device_dtype_check_for_fused(p)
            self._ensure_state(home, state, layout, gi, i, capturable, group["amsgrad"])
            if not had_state or set(state) != keys:
                fresh.append((p, None if not had_state else set(state) - keys))
            # Under torch.compile the params' versions and addresses are not
            # traceable: a compiled step does not look for writes behind its back.
            if had_state and not torch.compiler.is_compiling():
                synced = self._synced.get(id(p))
                if synced is not None and synced != shard_stamp(p):
                    if self._resync(p, state, auto=True):
                        resynced.append(f"group {gi} param {i}")
            # The host copy of a CUDA param takes IEEE sqrt, the CUDA kernel's bits, so
            # an offloaded run follows the on-device one.
            ieee_sqrt = home is not p and p.device.type == "cuda"
            by_call.setdefault((home.device, ieee_sqrt), []).append((p, grad, state))
        return [self._call(gi, group, k, device, ieee_sqrt, entries)
                for k, ((device, ieee_sqrt), entries) in enumerate(by_call.items())]

    def _call(self, gi, group, k, device, ieee_sqrt, entries):
        """The adam_step_ arguments for the params of one group on one device (with
        one sqrt)."""
        params = [p for p, _, _ in entries]
        states = [state for _, _, state in entries]
        absent = self._absent(device)
        # Plain params (the common case) skip local_shard's per-tensor checks.
        local_of = local_shard if any(is_dtensor(p) for p in params) else (lambda p, t: t)
        locals_, grads, writebacks = [], [], []
        viewed = []  # per param: its state goes to the kernel through _kernel_view
        for p, grad, _ in entries:
            local = local_of(p, self._home(p))
            plain = local.is_contiguous() and not local.is_complex()
            viewed.append(not plain)
            if plain and grad.is_contiguous():
                locals_.append(local)
                grads.append(grad)
                continue
            if not local.is_contiguous() and ckpt.dense_flat(local) is None:
                # Gaps between its elements: step a contiguous copy, written back after.
                copy = local.contiguous()
                writebacks.append((local, copy))
                local = copy
            if not ckpt.same_layout(grad, local):  # the kernel walks both in one order
                grad = ckpt.like(local, grad)
            locals_.append(_kernel_view(local))
            grads.append(_kernel_view(grad))

        def listed(key, alt=None):
            values = [local_of(p, state.get(key, state.get(alt)) if alt else state.get(key))
                      for p, state in zip(params, states)]
            if all(v is None for v in values):
                return []
            return [absent if v is None else _kernel_view(v) if view else v
                    for v, view in zip(values, viewed)]

        capturable = _counts_on_device(group)
        args = dict(params=locals_, grads=grads,
                    **{name: listed(*keys) for name, keys in _LISTS.items()
                       if group["amsgrad"] or name not in _AMSGRAD_LISTS},
                    steps=[] if capturable else [ckpt.next_step(int(s["step"])) for s in states],
                    **self._scalar_args(gi, group, k, device), ieee_sqrt=ieee_sqrt)
        return _Call(device, args, states, params, writebacks)

    def _scalar_args(self, gi, group, k, device):
        """The op's hyperparameter arguments for call k of group gi."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        on_device = group["capturable"] or isinstance(lr, torch.Tensor)
        args = dict(lr=0.0 if on_device else float(lr), beta1=float(beta1),
                    beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adamw=group["decoupled_weight_decay"], maximize=bool(group["maximize"]),
                    seed=mix_seed(group["seed"], gi, k), amsgrad=bool(group["amsgrad"]))
        if on_device:
            args["lr_tensor"] = self._lr_tensor(gi, device, lr)
        return args

    def _planned_call(self, gi, group, pkey):
        """Group gi's op call from its _Plan, or None when the plan does not hold.
        Each check runs over a whole list (map: no Python code per param)."""
        plan = self._plans.get(gi)
        params = group["params"]
        if plan is None or group["capturable"] or self._offload is not None or \
                torch.compiler.is_compiling() or plan.key != (pkey, group["amsgrad"]):
            return None
        state = self.state  # the same entries: the same object, each param's state the same
        if plan.state is not state or len(params) != len(plan.params) or \
                not all(map(operator.is_, params, plan.params)) or \
                not all(map(operator.is_, map(state.get, params), plan.states)):
            return None
        try:
            if not all(map(operator.is_, map(_STEP, plan.states), plan.step_views)):
                return None
            lists = {name: list(map(operator.itemgetter(key), plan.states)) if key else []
                     for name, key in plan.lists.items()}
        except KeyError:  # a state entry was removed
            return None
        mains = list(map(getattr, params, repeat("main_grad"), repeat(None)))
        if all(map(operator.is_, mains, repeat(None))):
            grads = list(map(_GRAD, params))
        else:
            grads = [p.grad if g is None else g for p, g in zip(params, mains)]
        if any(map(operator.is_, grads, repeat(None))) or \
                tuple(map(_DTYPE, grads)) != plan.grad_dtypes or \
                tuple(map(torch.Tensor.numel, grads)) != plan.numels or \
                tuple(map(_DTYPE, params)) != plan.param_dtypes or \
                not all(map(operator.eq, map(_SHAPE, params), plan.shapes)) or \
                not all(map(torch.Tensor.is_contiguous, params)):
            return None
        if plan.device.type == "cpu":
            same_device = all(map(_IS_CPU, grads))
        else:
            same_device = all(map(operator.eq, map(_DEVICE, grads), repeat(plan.device)))
        try:  # False for a sparse COO grad; sparse CSR has no is_contiguous
            contiguous = all(map(torch.Tensor.is_contiguous, grads))
        except RuntimeError:
            contiguous = False
        if not (same_device and contiguous):
            return None
        if list(map(_VERSION, plan.stamped)) != plan.versions or \
                list(map(torch.Tensor.data_ptr, plan.stamped)) != plan.ptrs:
            return None  # written behind our back: the full path resyncs
        # torch's float32 `step += 1`, as ints
        steps = plan.step_buffer.add(1.0).to(torch.int64).tolist()
        args = dict(params=params, grads=grads, **lists, steps=steps,
                    **self._scalar_args(gi, group, 0, plan.device))
        return _Call(plan.device, args, plan.states, params, [], plan)

    def _drop_plan(self, gi):
        """Forget group gi's plan, handing its stamps back to _synced."""
        plan = self._plans.pop(gi, None)
        if plan is not None:
            self._synced.update(zip(map(id, plan.stamped), zip(plan.versions, plan.ptrs)))

    def _make_plan(self, gi, group, pkey, calls):
        """A _Plan for group gi after a full-path step that made `calls`, or None."""
        if len(calls) != 1 or self._offload is not None or group["capturable"] or \
                torch.compiler.is_compiling():
            return None
        call = calls[0]
        params, states = tuple(group["params"]), tuple(call.states)
        if call.writebacks or len(call.params) != len(params) or \
                not all(map(operator.is_, params, call.params)):
            return None
        if any(is_dtensor(p) or p.is_complex() or not p.is_contiguous() for p in params):
            return None
        first = states[0] if states else {}
        if any(st.keys() != first.keys() for st in states):
            return None  # params of several layouts in one call
        lists = {name: next((k for k in keys if k in first), None)
                 for name, keys in _LISTS.items()
                 if group["amsgrad"] or name not in _AMSGRAD_LISTS}
        steps = torch.stack([st["step"] for st in states]) if states else \
            torch.zeros(0, dtype=torch.float32)
        views = steps.unbind(0)
        for st, view in zip(states, views):
            st["step"] = view
        stamped = tuple(p for p, st in zip(params, states) if "master" in st or "remainder" in st)
        return _Plan((pkey, group["amsgrad"]), self.state,
                     call.device, params, tuple(map(_DTYPE, params)),
                     tuple(map(_DTYPE, call.args["grads"])), tuple(p.numel() for p in params),
                     tuple(map(_SHAPE, params)), states, steps, views, lists, stamped, list(map(_VERSION, stamped)),
                     list(map(torch.Tensor.data_ptr, stamped)))

    def _lr_tensor(self, gi, device, lr):
        """The group's lr as a float64 tensor on device, or float32 for a float32
        tensor lr (the kernel then derives the lr's constants in float32, as torch
        does), written without a sync (a copy from a tensor lr, so a replayed graph
        reads its current value)."""
        dtype = lr.dtype if isinstance(lr, torch.Tensor) else torch.float64
        buf = self._buffer(("lr", gi, dtype), device, (), dtype)
        if isinstance(lr, torch.Tensor):
            buf.copy_(lr.reshape(()))
        else:
            buf.fill_(float(lr))
        return buf

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None, **kwargs):
        """One Adam/AdamW step over every param that has a gradient (`main_grad`
        when the param has one, else `.grad`).

        grad_scale: the loss scale the gradients carry (tensor or number); they are
        unscaled in the kernel and an Inf/NaN anywhere skips the whole step.
        found_inf: truthy -> skip the step. Both default to the optimizer's
        `grad_scale` / `found_inf` attributes when those are set.
        """
        if kwargs:
            if "grad_scaler" in kwargs:
                raise TypeError(
                    f"{type(self).__name__}.step() got grad_scaler=: precis optimizers do not "
                    f"set _step_supports_amp_scaling; let GradScaler unscale and skip, or pass "
                    f"grad_scale= and found_inf= to step()")
            raise TypeError(f"{type(self).__name__}.step() got unexpected keyword arguments "
                            f"{', '.join(sorted(kwargs))}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        capturable = _counts_on_device(self.param_groups[0])
        self._last["step_skipped"] = None if capturable else False
        self._last["found_inf"] = None
        if not capturable and found_inf is not None and float(found_inf) != 0.0:
            self._last["step_skipped"] = True
            return loss

        if self._offload is not None:
            self._offload.select(self.param_groups, self.state)
            self._offload.verify_grads()
        resynced, fresh, torch_params = [], [], []
        try:
            group_calls = []
            for gi, group in enumerate(self.param_groups):
                torch_params.append([])
                group_calls.append(self._gather(gi, group, resynced, fresh, torch_params[-1]))
            calls = [call for gcalls in group_calls for call in gcalls]
            by_torch = self._prepare_torch_math(torch_params, fresh, grad_scale,
                                                found_inf if capturable else None)
            if self._offload is not None:  # device calls first, host calls in pieces
                calls = self._offload.pipeline(calls)
            if calls:
                if capturable:
                    self._step_capturable(calls, grad_scale, found_inf)
                else:
                    self._step_eager(calls, grad_scale, found_inf)
                for call in calls:
                    for param, copy in call.writebacks:
                        param.copy_(copy)
            if not self._last["step_skipped"]:
                for prepared in by_torch:
                    prepared.step()
        except BaseException:
            # A failed first step leaves no state behind: it would be built from the
            # params as they are now, and not resynced after a later weights load.
            # Buffers added to existing state go too: the step changed nothing.
            for p, keys in fresh:
                if keys is None:
                    self.state.pop(p, None)
                else:
                    for key in keys:
                        self.state[p].pop(key, None)
            raise
        if resynced and not self._last["warned_stale"]:
            self._last["warned_stale"] = True
            warnings.warn(
                f"{type(self).__name__}: params were modified outside the optimizer since its "
                f"last step ({', '.join(resynced[:5])}{', ...' if len(resynced) > 5 else ''}), "
                f"e.g. by loading model weights; their master weights / remainders were "
                f"resynced from the params. Call optimizer.reload_model_params() after "
                f"loading weights to do this explicitly (warned once).",
                StaleMasterWarning, stacklevel=3)
        if not torch.compiler.is_compiling():
            for call in calls:  # only a master or remainder can go stale
                if call.plan is not None:
                    call.plan.versions[:] = map(_VERSION, call.plan.stamped)
                    continue
                for p, state in zip(call.params, call.states):
                    if "master" in state or "remainder" in state:
                        self._synced[id(p)] = shard_stamp(p)
            for gi, (group, gcalls) in enumerate(zip(self.param_groups, group_calls)):
                if gi not in self._plans:
                    plan = self._make_plan(gi, group, _policy_key(group["policy"]), gcalls)
                    if plan is not None:
                        self._plans[gi] = plan
        return loss

    def _prepare_torch_math(self, torch_params, fresh, grad_scale, device_found_inf):
        """torch_math.Prepared for each group's params that torch's math steps (their
        state made, new ones recorded in fresh)."""
        if not any(torch_params):
            return []
        if grad_scale is not None or isinstance(device_found_inf, torch.Tensor):
            raise ValueError(f"{type(self).__name__}.step(): grad_scale= and a device "
                             f"found_inf= are not supported with float64 / complex128 params "
                             f"or differentiable=True (stepped by torch's math): let "
                             f"torch.amp.GradScaler unscale the gradients and skip the step")
        fresh.extend((p, None) for params in torch_params for p in params
                     if not self.state.get(p))
        return [torch_math.Prepared(self, group, params)
                for group, params in zip(self.param_groups, torch_params) if params]

    def _inv_grad_scale(self, grad_scale):
        """1 / grad_scale on the host (None when there is no grad_scale)."""
        if grad_scale is None:
            return None
        scale = float(grad_scale)
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"{type(self).__name__}.step(): grad_scale must be finite "
                             f"and > 0, got {scale}")
        return 1.0 / scale

    def _check_calls(self, calls, **kwargs):
        """Every op call checks all its arguments before it writes, but with several
        calls a later one could refuse after an earlier one wrote. So every call but
        the first (which checks before anything is written) first runs once with its
        found_inf flag set: the checks run, the kernels write nothing. Pieces
        (offload) are checked as the call they were cut from, once, so buffers
        shared across pieces are refused too."""
        checked = set()
        for i, call in enumerate(calls):
            whole = call.whole or call
            if (i == 0 and whole is call) or id(whole) in checked:
                continue
            checked.add(id(whole))
            flag = self._buffer("checks_only", whole.device, (1,), torch.float32).fill_(1.0)
            ops.adam_step_(**whole.args, **kwargs, check_finite=False, found_inf=flag)

    def _step_eager(self, calls, grad_scale, found_inf):
        """Host steps and lr; the NaN/Inf verdict of check_finite is read back.
        Offloaded: each call waits for its host grads (Offload.ready) and its host
        copies are written back as soon as it is done."""
        offload = self._offload
        inv_grad_scale = self._inv_grad_scale(grad_scale)
        self._check_calls(calls, inv_grad_scale=inv_grad_scale or 1.0)
        check_finite = inv_grad_scale is not None
        meshes = meshes_of(calls)
        fused = len(calls) == 1 and not meshes  # the kernel checks and skips by itself
        flags = {}  # device -> found_inf flag of its calls
        if check_finite:
            for call in calls:
                if call.device not in flags:
                    flags[call.device] = self._buffer("found_inf", call.device, (1,),
                                                      torch.float32).zero_()
            # Skipping must cover every group, device and rank: check all grads first.
            if not fused:
                for call in calls:
                    if offload is not None:
                        offload.ready(call.params)
                    ops.check_finite_(call.args["grads"], flags[call.device])
                for flag in flags.values():
                    agree_on_nonfinite(flag, meshes)
                if any(float(flag) != 0.0 for flag in flags.values()):
                    return self._skipped(found_inf)
        for call in calls:
            if offload is not None:
                offload.ready(call.params)
            ops.adam_step_(**call.args, inv_grad_scale=inv_grad_scale or 1.0,
                                 check_finite=check_finite and fused,
                                 found_inf=flags.get(call.device))
            if check_finite and fused and float(flags[call.device]) != 0.0:
                return self._skipped(found_inf)  # the only call: nothing was written
            if offload is not None:
                offload.write_back(call.params)
        for call in calls:
            if call.plan is not None:
                call.plan.step_buffer.add_(1.0)
        steps = [state["step"] for call in calls if call.plan is None
                 for state in call.states]
        if steps:
            torch._foreach_add_(steps, 1.0)

    def _step_capturable(self, calls, grad_scale, found_inf):
        """Everything stays on the device: steps, lr, loss scale and the verdict."""
        devices = {call.device for call in calls}
        if len(devices) > 1:
            raise ValueError(f"{type(self).__name__}(capturable=True): params are on "
                             f"{', '.join(sorted(map(str, devices)))}; all must be on one device")
        device = calls[0].device
        if found_inf is not None and not isinstance(found_inf, torch.Tensor):
            if found_inf:
                return  # a host flag: known now, nothing to capture
            found_inf = None
        inv_tensor = None
        if isinstance(grad_scale, torch.Tensor):
            if grad_scale.device != device or grad_scale.numel() != 1:
                raise ValueError(f"{type(self).__name__}.step(): grad_scale must be one value "
                                 f"on {device}, got {grad_scale.numel()} on {grad_scale.device}")
            inv_tensor = self._buffer("inv_grad_scale", device, (1,), torch.float32)
            torch.reciprocal(grad_scale.reshape(1).to(torch.float32), out=inv_tensor)
        inv_host = self._inv_grad_scale(grad_scale) if inv_tensor is None else None
        check_finite = grad_scale is not None
        flag = found_inf
        if flag is not None and (flag.device != device or flag.dtype != torch.float32
                                 or flag.numel() != 1):
            raise ValueError(f"{type(self).__name__}.step(): found_inf must be one float32 "
                             f"value on {device} (a GradScaler's found_inf), got "
                             f"{flag.numel()} {flag.dtype} values on {flag.device}")
        if flag is None and check_finite:
            # Not a cached buffer: last_found_inf hands it out, and may be kept past the next step.
            flag = torch.zeros(1, dtype=torch.float32, device=device)
        if check_finite:
            for call in calls:
                ops.check_finite_(call.args["grads"], flag)
            agree_on_nonfinite(flag, meshes_of(calls))
        # Count the step only where it happens: steps += (found_inf == 0).
        steps = [state["step"] for call in calls for state in call.states]
        if flag is None:
            taken = 1.0
            torch._foreach_add_(steps, 1.0)
        else:
            taken = (flag.reshape(()) == 0).to(torch.float32)
            torch._foreach_add_(steps, [taken] * len(steps))
        # The kernels take int64 step numbers: copies of torch's float32 counts.
        counts = iter(torch.stack(steps).to(torch.int64).unbind())
        for call in calls:
            call.args["step_tensors"] = [next(counts) for _ in call.states]
        try:  # the kernels read the step numbers after this update
            self._check_calls(calls, inv_grad_scale=inv_host or 1.0,
                              inv_grad_scale_tensor=inv_tensor)
            for call in calls:
                ops.adam_step_(**call.args, inv_grad_scale=inv_host or 1.0,
                               inv_grad_scale_tensor=inv_tensor, found_inf=flag)
        except BaseException:  # a call refused its arguments: the step did not happen
            torch._foreach_sub_(steps, taken if flag is None else [taken] * len(steps))
            raise
        self._last["found_inf"] = flag

    def _skipped(self, found_inf):
        self._last["step_skipped"] = True
        if isinstance(found_inf, torch.Tensor):
            found_inf.fill_(1.0)

    # -- checkpoints ------------------------------------------------------------

    def state_dict(self):
        """torch's layout ({'state': {index: {...}}, 'param_groups': [...]}), every
        buffer in its stored dtype (precis.checkpoint.export_state: a state torch
        would misread has 'step' = precis.checkpoint.STEP_MARKER, which torch's
        loader refuses). The policy option is written as plain data (for
        information: load_state_dict keeps the optimizer's own policy), and params
        with remainders get 'param_fingerprint', which lets a load before the model
        weights keep the remainders exact."""
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        indices = [i for group in sd["param_groups"] for i in group["params"]]
        by_index = dict(zip(indices, params))
        for group in sd["param_groups"]:
            group["policy"] = _plain_policy(group.get("policy"))
        for index, state in list(sd["state"].items()):
            p = by_index.get(index)
            # A shard's fingerprint would not survive resharding: a DTensor's remainder is
            # kept on load only when the params were loaded first (set_state_dict's order).
            if p is not None and state:
                sd["state"][index] = ckpt.export_state(state, p,
                                                       remainder_fingerprint=not is_dtensor(p))
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of torch.optim.Adam / AdamW.

        Hyperparameters come from the state dict (as in torch); the policy stays
        the optimizer's own, and the state is converted to its dtypes (exact
        copies where the dtypes already match). Everything is validated before
        anything changes: a malformed state dict raises ValueError and leaves the
        optimizer as it was.
        """
        name = type(self).__name__
        if self._offload is not None:
            self._offload.select(self.param_groups, self.state)
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # as torch: hooks get a shallow copy
        for hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        # Other top-level keys are ignored, as torch ignores them.
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else None
            raise ValueError(f"{name}.load_state_dict: expected a mapping with keys 'state' and "
                             f"'param_groups', got "
                             f"{keys if keys is not None else type(state_dict).__name__}")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(saved_groups, (list, tuple)) or not isinstance(saved_state, Mapping):
            raise ValueError(f"{name}.load_state_dict: 'param_groups' must be a list and "
                             f"'state' a mapping")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: the state dict has {len(saved_groups)} "
                             f"param groups, the optimizer {len(self.param_groups)}")

        new_groups, id_to_param, where_of = [], {}, {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            where = f"{name}.load_state_dict: param group {gi}"
            if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
                raise ValueError(f"{where}: expected a mapping with a 'params' list")
            ids = saved["params"]
            if len(ids) != len(group["params"]):
                raise ValueError(f"{where} has {len(ids)} params in the state dict, "
                                 f"{len(group['params'])} in the optimizer")
            for i, (pid, p) in enumerate(zip(ids, group["params"])):
                if pid in id_to_param:
                    raise ValueError(f"{where}: param id {pid!r} appears twice")
                id_to_param[pid] = p
                where_of[pid] = f"{name}.load_state_dict: state of param {i} of group {gi} " \
                                f"(id {pid!r}, shape {tuple(p.shape)}, {p.dtype})"
            missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in saved]
            if missing:
                raise ValueError(f"{where} lacks {', '.join(missing)}")
            new = {k: v for k, v in saved.items() if k not in OWN_GROUP_KEYS + ("params",)}
            if isinstance(new["betas"], list):
                new["betas"] = tuple(new["betas"])
            for key in ("maximize", "seed") + TORCH_FLAG_KEYS:
                new.setdefault(key, group[key])
            for key in OWN_GROUP_KEYS:
                new[key] = group[key]
            # torch's rule: AdamW always decouples; Adam keeps what was saved (False if absent).
            new["decoupled_weight_decay"] = self._always_decoupled or \
                new.get("decoupled_weight_decay", False)
            new["params"] = group["params"]
            if "param_names" in group and "param_names" not in new:
                new["param_names"] = group["param_names"]
            check_hparams(new, where)
            new_groups.append(new)

        new_state, fingerprints = {}, {}
        layouts = {id(p): self._layout(ng, p) for ng in new_groups for p in ng["params"]}
        for pid, saved in saved_state.items():
            if pid not in id_to_param:
                raise ValueError(f"{name}.load_state_dict: 'state' has an entry for param id "
                                 f"{pid!r}, which no param group lists")
            p = id_to_param[pid]
            state, fp = ckpt.convert_state(local_shard(p, self._home(p)),
                                           local_state(p, saved, where_of[pid]),
                                           layouts[id(p)], where_of[pid])
            if state:
                new_state[p] = {k: v if k == "step" else placed_like(p, v)
                                for k, v in state.items()}
            if fp is not None:
                fingerprints[p] = fp

        # Everything checked and converted: apply.
        for group, new in zip(self.param_groups, new_groups):
            group.clear()
            group.update(new)
        self.state = defaultdict(dict, new_state)
        self._plans.clear()
        self._synced = {id(p): shard_stamp(p) for p in new_state}
        self._fingerprints = fingerprints
        for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            hook(self)

    # -- memory -----------------------------------------------------------------

    def memory_report(self):
        """Bytes per parameter of each buffer, measured from the tensors allocated.

        Keys: param, grad (main_grad where present, else .grad), master (master
        weights or int16 remainders), exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad),
        scales (block scales of the moments), total; plus numel (parameters
        counted). Buffers not allocated yet (state before the first step, freed
        grads, no amsgrad) count 0.
        """
        sizes = dict.fromkeys(("param", "grad", "master", "exp_avg", "exp_avg_sq",
                               "max_exp_avg_sq", "scales"), 0)

        def nbytes(t):  # a DTensor: its local shard (params count whole in numel)
            t = t.to_local() if is_dtensor(t) else t
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        numel = 0
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                numel += p.numel()
                sizes["param"] += nbytes(p)
                grad = getattr(p, "main_grad", None)
                sizes["grad"] += nbytes(p.grad if grad is None else grad)
                state = self.state.get(p, {})
                sizes["master"] += nbytes(state.get("master")) + nbytes(state.get("remainder"))
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    sizes[key] += nbytes(state.get(key))
                sizes["scales"] += sum(nbytes(state.get(key)) for key in (
                    "exp_avg_scale", "exp_avg_sq_scale", "max_exp_avg_sq_scale"))
        report = {k: (v / numel if numel else 0.0) for k, v in sizes.items()}
        report["total"] = sum(report.values())
        report["numel"] = numel
        return report


class AdamW(_AdamBase):
    """AdamW (decoupled weight decay: p -= lr * weight_decay * p) with precision-aware
    state, taking torch.optim.AdamW's arguments (foreach and fused are accepted and
    change nothing for precis's kernel) plus precis's policy and seed. float64 /
    complex128 params, and differentiable=True (fp32 policy only), run torch's own
    math (precis.torch_math). See the module docstring for policy, state, checkpoints
    and loss scaling."""

    _always_decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, policy=None, seed=0, offload=False,
                 offload_fraction=1.0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, policy=policy, seed=seed,
                         offload=offload, offload_fraction=offload_fraction)


class Adam(_AdamBase):
    """Adam (L2 weight decay: g += weight_decay * p; decoupled_weight_decay=True makes
    it AdamW) with precision-aware state, taking torch.optim.Adam's arguments (see
    AdamW) plus precis's policy and seed."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False, policy=None,
                 seed=0, offload=False, offload_fraction=1.0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=decoupled_weight_decay,
                         policy=policy, seed=seed, offload=offload,
                         offload_fraction=offload_fraction)
