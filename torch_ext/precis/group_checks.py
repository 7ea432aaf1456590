"""The checks of precis.optim's arguments: torch.optim.Adam's constructor checks, in
its order and words (each rule's own are in its optimizer's file: adamw.py, sgd.py, lion.py, muon.py), then what precis's kernels
need of every optimizer (finite numbers, bools, a policy, params of a dtype it steps).
Each raises before anything is modified."""

import math
import numbers
from collections.abc import Mapping

import torch

from . import torch_math, tracing
from .op_constants import PARAM_DTYPES
from .policy import Policy
from .state_layout import COMPLEX_DTYPES

STEPPED_DTYPES = PARAM_DTYPES + COMPLEX_DTYPES + torch_math.DTYPES
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_param(p, where):
    """A param precis can step: a float32 / float16 / bfloat16 / complex64 tensor in any
    strides whose elements do not share memory (torch's in-place update refuses those
    too). Dense ones are stepped in memory order, others through a contiguous copy."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(p).__name__}")
    if p.dtype not in STEPPED_DTYPES:
        raise ValueError(f"{where} has dtype {p.dtype}; supported: "
                         f"{', '.join(map(str, STEPPED_DTYPES))}")
    if torch._debug_has_internal_overlap(p) == 1:
        raise ValueError(f"{where} (shape {tuple(p.shape)}, stride {tuple(p.stride())}) has "
                         f"elements sharing memory (e.g. an expanded tensor); an in-place "
                         f"update cannot write it")


def check_distinct(params, where):
    """Each param of a group once. torch warns of one listed twice (its step would step it
    twice); precis's step refuses it, by name (its kernels would refuse its state, given
    twice, as buffers sharing memory)."""
    first = {}  # id -> the first index of each param
    for i, p in enumerate(params):
        if first.setdefault(id(p), i) != i:
            raise ValueError(f"{where}: param {i} is param {first[id(p)]} of the group "
                             f"again; list each param once")


def check_torch_adam(group, where):
    """torch.optim.Adam's constructor checks, in its order, with its exception types and
    messages (code matching torch's words keeps working; precis adds where)."""
    lr, betas, capturable, foreach = group["lr"], group["betas"], group["capturable"], \
        group["foreach"]
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, value in (("learning rate", lr), ("epsilon value", group["eps"])):
        if not 0.0 <= number(value, 0.0):
            raise ValueError(f"Invalid {name}: {value} ({where}; need >= 0)")
    for i, b in enumerate(betas):
        if not 0.0 <= number(b, 0.0) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} ({where}; need "
                             f"0 <= beta < 1)")
    wd = group["weight_decay"]
    if not 0.0 <= number(wd, 0.0):
        raise ValueError(f"Invalid weight_decay value: {wd} ({where}; need >= 0)")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for "
                                 f"capturable=False and foreach=True")
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    check_fused(group)


def check_torch_adam_betas(betas):
    """torch.optim.Adam's constructor's check of the betas' types, which its step does
    not repeat (a scheduler's float beta1 beside tensor betas steps)."""
    if not (all(isinstance(b, float) for b in betas)
            or all(isinstance(b, torch.Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")


def check_fused(group):
    """torch's refusals of fused=True with differentiable or foreach."""
    if group["fused"]:
        if group["differentiable"]:
            raise RuntimeError("`fused` does not support `differentiable`")
        if group["foreach"]:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def number(value, other=None):
    """A hyperparameter's value as a float (a one-element tensor's too), or `other` when
    it is not a real number or not readable without a sync (a device tensor)."""
    if isinstance(value, torch.Tensor):
        # Unread (0.0 passes the checks): a device tensor (a sync), and any tensor in a
        # step torch.compile traces (.item() broke its graph, or failed under fullgraph).
        if value.device.type != "cpu" or tracing.traced():
            return 0.0
        if value.numel() != 1 or value.is_complex():
            return other
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return other  # (numpy's scalars are Real, as torch.optim takes them)
    return float(value)


def check_common(group, where, finite_keys, bool_keys):
    """What precis's kernels need of every optimizer's group, after the optimizer's own
    checks: a float32 / float64 tensor lr, finite numbers (lr and finite_keys), bools
    (bool_keys and the flags every precis optimizer has), a seed, a policy. Run at
    construction, for each added group and at every step (schedulers and users change
    groups)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{where}: a tensor lr must hold one float32 or float64 value, got "
                         f"{lr.numel()} {lr.dtype} values")
    if isinstance(lr, torch.Tensor) and lr.is_meta:
        raise ValueError(f"{where}: lr is a tensor on the meta device, which holds no value; "
                         f"give a number or a tensor on the params' device")
    for key in ("lr", *finite_keys):
        value = number(group[key])
        # `abs < inf` rather than math.isfinite: torch.compile traces it on a symbolic
        # lr (a float a scheduler changed) as a guard, math.isfinite as a graph break.
        if value is None or not abs(value) < math.inf:
            raise ValueError(f"{where}: {key} must be a finite number, got {group[key]!r}")
        if key == "lr" and not abs(value) <= FLOAT32_MAX:
            # torch.optim's step refuses it too (its float32 ops: "value cannot be converted
            # to type float without overflow"); precis's kernels would make every param Inf
            raise ValueError(f"{where}: lr is {lr!r}, which overflows float32 (max "
                             f"{FLOAT32_MAX:.8g}); torch.optim refuses it at its step: value "
                             f"cannot be converted to type float without overflow")
    for key in ("maximize", "capturable", "differentiable", *bool_keys):
        if not isinstance(group[key], bool):
            raise ValueError(f"{where}: {key} must be a bool, got {group[key]!r}")
    for key in ("foreach", "fused"):
        if group[key] is not None and not isinstance(group[key], bool):
            raise ValueError(f"{where}: {key} must be None or a bool, got {group[key]!r}")
    seed = group["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"{where}: seed must be an int in [0, 2**64) (the kernels' 64-bit "
                         f"seed), got {seed!r}")
    policy = group["policy"]
    if policy is not None and not isinstance(policy, (Policy, Mapping)):
        raise TypeError(f"{where}: policy must be None, a precis.Policy or a mapping of "
                        f"overrides, got {type(policy).__name__}")


def check_step_scalars(name, grad_scale, found_inf):
    """step()'s grad_scale and found_inf as torch's GradScaler hands them: None, a number
    (found_inf: a bool too) or a one-element real tensor (grad_scale: not bool) that holds
    a value (not meta). Its metadata only: a device value is never read here."""
    for key, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        flag = key == "found_inf"
        if value is None or (isinstance(value, numbers.Real) and
                             (flag or not isinstance(value, bool))):
            continue
        kind = f"{key} must be one value: None, {'a bool, ' if flag else ''}a number or a " \
               f"one-element real tensor (as torch.amp.GradScaler's)"
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}.step(): {kind}, got {type(value).__name__} {value!r}")
        if value.numel() != 1 or value.is_complex() or value.is_meta or \
                (value.dtype == torch.bool and not flag):
            raise ValueError(f"{name}.step(): {kind}, got {value.numel()} {value.dtype} values "
                             f"on {value.device}{' (no data)' if value.is_meta else ''}")
