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
                    when capturable), counting as torch's does (exact up to 2^24).
                    With fused=True too, where torch's fused step keeps it on the
                    device: an eager precis step counts on the host, and never
                    waits on the device for a count
  exp_avg           first moment in exp_avg_dtype (fp8 as uint8 bytes of precis's m8 code)
  exp_avg_sq        second moment in exp_avg_sq_dtype
  exp_avg_scale     fp32 block scales, only for fp16 / fp8 moments
  exp_avg_sq_scale  same for exp_avg_sq
  max_exp_avg_sq    amsgrad only: the running max of exp_avg_sq, in its dtype (+
                    max_exp_avg_sq_scale for fp16 / fp8), as torch's
  master            fp32 / fp16 master weights, when the policy keeps a separate
                    copy (none when the param is its own master: fp32 models, or a
                    bf16 master = stochastic rounding of bf16 params)
  remainder         int16 low halves of the fp32 master (store_param_remainders):
                    master = param:remainder exactly; uint8 with
                    param_remainder_bits 8: one more byte of mantissa, a 24-bit
                    master rounded to nearest each step

Checkpoints (precis.checkpoint, plain functions): state_dict() holds every buffer
in its stored dtype, and a run resumed with load_state_dict() follows the same
trajectory bit for bit. A state torch.optim would misread (scaled moments, masters,
remainders) has a 'step' torch's loader refuses with a message naming
precis.checkpoint.to_torch_state_dict, the converter to torch's layout.
load_state_dict() also takes a torch.optim.Adam / AdamW state dict (plain
moments, no master) and converts it to the policy's dtypes; anything malformed
raises ValueError and leaves the optimizer unchanged.

Model weights loaded after the optimizer was built make master weights, remainders
and host copies (offload) stale. Call reload_model_params() after loading; the
optimizer also notices by itself, by any path the weights came (model.load_state_dict,
torch.distributed.checkpoint, set_model_state_dict, FSDP2's shards, writes through
`param.data`): it keeps a 64-bit fingerprint of what its last step left in each param
that has such a copy, compares it before the next step (precis.fingerprints; the
cost is one read of those params before and one after each step), resyncs a changed
param's copies from the param (a master that still rounds to it and a remainder loaded
for its very bits are kept) and warns once (StaleMasterWarning). A step compiled by
torch.compile or captured in a CUDA graph compares nothing: call reload_model_params()
after a load there (an eager capturable step compares, reading the fingerprints back).

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
device (but the load check's fingerprints, outside a capture), so a whole optimizer
step can be captured in a CUDA graph and replayed.
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

from collections.abc import Mapping

import torch
from torch.optim.optimizer import _to_scalar

from . import adam_plan, adam_step, optim_checkpoint, optim_state, stored_forms
from . import checkpoint as ckpt
# The stored forms are precis.optim's public names too (they were defined here first).
from .stored_forms import decode_moment, encode_moment, remainder_join, remainder_split  # noqa
from .dtensor import is_dtensor, local_shard
from .group_checks import check_hparams, check_param
from .offload import Offload, parse as parse_offload
from .optim_state import StaleMasterWarning


__all__ = ["Adam", "AdamW", "StaleMasterWarning", "encode_moment", "decode_moment",
           "remainder_split", "remainder_join"]


def _recorded(key, doc):
    """A public attribute kept in the books' `last` dict (optim_state.Books)."""
    return property(lambda self: self._books.last[key],
                    lambda self, value: self._books.last.__setitem__(key, value), doc=doc)


class _AdamBase(torch.optim.Optimizer):
    """What Adam and AdamW share (a group's decoupled_weight_decay selects the weight
    decay): torch's optimizer contract (construction, param groups, hooks, state dicts)
    and the books kept between steps. The step itself is adam_step.run, the
    functional core; the state dicts' conversion is optim_checkpoint's."""

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
        self._books = optim_state.Books(name)  # what it keeps between steps
        super().__init__(params, defaults)
        self.state = optim_state.CountedState()  # torch's defaultdict(dict), counting changes
        if mode is not None:
            self._books.offload = Offload(offload_fraction, name)
            self._books.offload.select(self.param_groups, self.state)

    last_step_skipped = _recorded(
        "step_skipped", "Whether the last step() was skipped; None after a capturable step.")
    last_found_inf = _recorded(
        "found_inf", "The device flag of the last capturable step (set when it was skipped), "
        "or None.")

    def __getstate__(self):
        # The streams go with the state (keyed by the same params: a deepcopy maps both
        # alike); the rest of the books is remade.
        return {**super().__getstate__(), "_precis_streams": self._books.streams}

    def __setstate__(self, state):
        streams = state.pop("_precis_streams", {})
        super().__setstate__(state)
        if not hasattr(self, "_books"):
            self._books = optim_state.Books(type(self).__name__)
        self._books.streams = streams

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
                check_param(local_shard(p, p),
                            f"{type(self).__name__}: param {i} of group {index}")
                optim_state.layout_for(self._books, group, p)  # resolves the policy: bad ones fail now
            if self._books.offload is not None:
                self._books.offload.select(self.param_groups, self.state)
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

    @torch.no_grad()
    def reload_model_params(self):
        """Resync every master weight and remainder from the params.

        Call it after loading model weights into the params of an optimizer that
        already has state (e.g. model.load_state_dict after the optimizer was built
        and stepped); otherwise the next step would continue from stale masters.
        """
        books = self._books
        for gi in list(books.plans):  # books.written takes the fingerprints made here
            adam_plan.drop_plan(books, gi)
        for group in self.param_groups:
            for p in group["params"]:
                if books.offload is not None:
                    books.offload.reload(p)
                state = self.state.get(p)
                if state:
                    optim_state.resync(books, p, state, auto=False)

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
            **{key: stored_forms.moment_values(state[key], state.get(key + "_scale"), second)
               for key, second in ckpt.MOMENT_KEYS.items() if key in state},
        }

    # -- step -----------------------------------------------------------------

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
        adam_step.run(self.param_groups, self.state, self._books, grad_scale, found_inf)
        return loss

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
        optim_checkpoint.export(self, sd)
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
        books = self._books
        if books.offload is not None:
            books.offload.select(self.param_groups, self.state)
            # Params loaded before (set_state_dict's order) may have been written without
            # moving their version counters (torch.distributed.checkpoint into FSDP2's
            # shards): the host copies are reread from them, not trusted.
            for group in self.param_groups:
                for p in group["params"]:
                    books.offload.reload(p)
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # as torch: hooks get a shallow copy
        for hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        new_groups, new_state, fingerprints, streams = optim_checkpoint.convert(self, state_dict)
        # Everything checked and converted: apply.
        for group, new in zip(self.param_groups, new_groups):
            group.clear()
            group.update(new)
        self.state = optim_state.CountedState(new_state)
        books.plans.clear()
        books.written = {}
        optim_state.record_written(books, [p for p, st in new_state.items()
                                           if optim_state.watched(books, p, st)])
        books.fingerprints = fingerprints
        books.streams = streams
        for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            hook(self)

    # -- memory -----------------------------------------------------------------

    def memory_report(self):
        """Bytes per parameter of each buffer, measured from the tensors allocated.

        Keys: param, grad (main_grad where present, else .grad), master (master
        weights, int16 remainders or uint8 corrections), exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad),
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
