"""The CUDA path of torch.ops.precis.adam_step_: precis_cuda_adam_step through ctypes.

Same lists, same checks and the same grouping by dtype combination as the CPU
path (optim_ops: one C call per combination, the k-th combination's
stochastic-rounding seed mixed from (seed, k)), so a CUDA step writes the bits
the CPU step writes. Nothing here synchronizes with the GPU:

* adam_step_cuda_async() returns the found_inf flag as a device tensor, and
  takes lr / inv_grad_scale / step as device tensors too ("capturable": a CUDA
  graph captured once replays with the values those tensors hold at replay);
* adam_step_cuda() has _adam_step_cpu's signature and result (a bool), for the
  op's CUDA kernel; it reads the flag back (one synchronization) only with
  check_finite.

check_finite over several dtype combinations stays all-or-nothing without a host
round trip: every combination's gradients are checked into one flag
(precis_cuda_adam_check_finite) before any update runs, and every update kernel
skips when the flag is set.
"""

import ctypes
import math

import torch

from . import _lib, optim_ops
from .ops import cuda_stream

OP = "precis.adam_step_ (CUDA)"


def _fail(msg):
    raise ValueError(f"precis.adam_step_: {msg}")


def _scalar_tensor(t, name, dtype, device):
    """Address of a one-element device tensor of `dtype` on `device` (None -> None)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"precis.adam_step_: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, params on {device}")
    if t.dtype != dtype or t.numel() != 1:
        _fail(f"{name} must hold one {dtype} value, got {t.numel()} {t.dtype} values")
    return t.data_ptr()


def _tensors_struct(key, idx, params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                    exp_avg_sq_scales, steps):
    """precis_adam_tensors_t over the params at indices idx (one dtype combination),
    built as optim_ops._call_c builds it for the CPU; the tables hold device pointers."""
    p_dtype, g_dtype, master_dtype, m_dtype, v_dtype = key
    code = _lib.torch_to_code

    def table(lst):
        return _lib.pointer_array([lst[i] for i in idx])

    tensors = _lib.adam_tensors(
        count=len(idx),
        param_dtype=code(p_dtype), grad_dtype=code(g_dtype), master_dtype=code(master_dtype),
        exp_avg_dtype=code(m_dtype), exp_avg_sq_dtype=code(v_dtype),
        params=table(params), grads=table(grads),
        exp_avgs=table(exp_avgs), exp_avg_sqs=table(exp_avg_sqs),
        numels=_lib.int64_array([params[i].numel() for i in idx]),
        steps=_lib.int64_array([int(steps[i]) for i in idx]))
    if master_dtype != p_dtype:
        tensors.masters = table(masters)
    if m_dtype in optim_ops.SCALED_MOMENT_DTYPES:
        tensors.exp_avg_scales = table(exp_avg_scales)
    if v_dtype in optim_ops.SCALED_MOMENT_DTYPES:
        tensors.exp_avg_sq_scales = table(exp_avg_sq_scales)
    return tensors


def adam_step_cuda_async(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                         exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay,
                         adamw=True, maximize=False, inv_grad_scale=1.0, check_finite=False,
                         seed=0, *, found_inf=None, lr_tensor=None, inv_grad_scale_tensor=None,
                         step_tensor=None):
    """One fused Adam/AdamW step of CUDA tensors on the current stream; never syncs.

    The lists are optim_ops' (see its docstring), all on one CUDA device. Extra,
    keyword-only, each a one-element tensor on that device:

    found_inf              float32. Nothing is modified if it is nonzero when the
                           update runs; check_finite sets it to 1 when a gradient is
                           NaN/Inf (it is never cleared: zero it yourself). Created
                           (zeroed) when check_finite and it is None.
    lr_tensor              float64: read on the device instead of `lr`.
    inv_grad_scale_tensor  float32: read on the device instead of `inv_grad_scale`.
    step_tensor            int64: ONE step number (after this update) for every param,
                           read on the device instead of `steps` (which may then be
                           None). Not incremented here: add 1 before the call (inside
                           the graph when capturing).

    With the three device values a CUDA graph captured around this call replays
    with whatever lr and step they hold. Returns found_inf (None if neither given
    nor needed).
    """
    n = len(params)
    if steps is None or (step_tensor is not None and len(steps) == 0):
        if step_tensor is None:
            _fail("steps is None; pass a step per param, or step_tensor")
        steps = [1] * n  # placeholders: the kernels read step_tensor
    optim_ops._check_lists(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                           exp_avg_sq_scales, steps)
    if not math.isfinite(inv_grad_scale):
        _fail(f"inv_grad_scale must be finite, got {inv_grad_scale}")
    if n == 0:
        return found_inf
    device = params[0].device
    if device.type != "cuda":
        _fail(f"params[0] is on {device}; this is the CUDA path")
    combos = {}  # dtype combination -> indices of its params, in order
    for i, p in enumerate(params):
        key = optim_ops._check_one(
            i, p, grads[i], masters[i] if masters else None, exp_avgs[i], exp_avg_sqs[i],
            exp_avg_scales[i] if exp_avg_scales else None,
            exp_avg_sq_scales[i] if exp_avg_sq_scales else None, steps[i], "cuda")
        for name, t in (("params", p), ("grads", grads[i]),
                        ("masters", masters[i] if masters else None),
                        ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i]),
                        ("exp_avg_scales", exp_avg_scales[i] if exp_avg_scales else None),
                        ("exp_avg_sq_scales",
                         exp_avg_sq_scales[i] if exp_avg_sq_scales else None)):
            if t is not None and t.numel() > 0 and t.device != device:
                _fail(f"{name}[{i}] is on {t.device}, params[0] on {device}")
        if p.numel() > 0:
            combos.setdefault(key, []).append(i)

    if check_finite and found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    dev = _lib.cuda_adam_device_args(
        lr=_scalar_tensor(lr_tensor, "lr_tensor", torch.float64, device),
        inv_grad_scale=_scalar_tensor(inv_grad_scale_tensor, "inv_grad_scale_tensor",
                                      torch.float32, device),
        step=_scalar_tensor(step_tensor, "step_tensor", torch.int64, device),
        found_inf=_scalar_tensor(found_inf, "found_inf", torch.float32, device))
    if not combos:
        return found_inf

    cuda = _lib.cuda_lib()
    with torch.cuda.device(device):
        stream = cuda_stream(device)
        structs = [(key, _tensors_struct(key, idx, params, grads, masters, exp_avgs,
                                         exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, steps))
                   for key, idx in combos.items()]
        # All or nothing over several C calls: check every combination first, into
        # the one flag every update kernel then reads.
        if check_finite and len(structs) > 1:
            for _, tensors in structs:
                _lib.check(cuda.precis_cuda_adam_check_finite(ctypes.byref(tensors),
                                                              dev.found_inf, stream), OP, cuda)
            check_finite = False
        for k, (_, tensors) in enumerate(structs):
            cfg = _lib.adam_config(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                   weight_decay=weight_decay, decoupled_weight_decay=int(adamw),
                                   maximize=int(maximize), inv_grad_scale=inv_grad_scale,
                                   check_finite=int(check_finite),
                                   seed=seed if k == 0 else optim_ops.mix_seed(seed, k))
            _lib.check(cuda.precis_cuda_adam_step(ctypes.byref(cfg), ctypes.byref(tensors),
                                                  ctypes.byref(dev), stream), OP, cuda)
    return found_inf


def adam_step_cuda(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw,
                   maximize, inv_grad_scale, check_finite, seed):
    """The op's CUDA kernel: optim_ops._adam_step_cpu's signature and result (True when
    check_finite found a NaN/Inf gradient and nothing was modified). Synchronizes
    only to read that flag, i.e. only with check_finite."""
    found = adam_step_cuda_async(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                                 exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay,
                                 adamw, maximize, inv_grad_scale, check_finite, seed)
    return bool(check_finite and found is not None and float(found.item()) != 0.0)
