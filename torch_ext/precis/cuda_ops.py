"""The CUDA kernels of torch.ops.precis.adam_step_ and check_finite_ (precis_cuda_*
through ctypes). optim_ops imports this module at the first CUDA call.

Same checks and the same grouping by dtype combination as the CPU kernel
(optim_ops.prepare / tensors_struct / combo_seed), so a CUDA step writes the bits
the CPU step writes. Everything runs on torch's current stream of the params'
device and nothing synchronizes with the GPU: lr / inv_grad_scale / steps may
live in device tensors (lr_tensor, inv_grad_scale_tensor, step_tensors) and the
NaN/Inf verdict stays in found_inf, so a CUDA graph captured around a call
replays with the values those tensors hold at replay.

check_finite over several dtype combinations stays all-or-nothing without a host
round trip: every combination's gradients are checked into found_inf
(precis_cuda_adam_check_finite) before any update runs, and every update kernel
skips when found_inf is set.
"""

import ctypes

import torch

from . import _lib, optim_ops
from .ops import cuda_stream

OP = "precis.adam_step_ (CUDA)"


def _address(t):
    return None if t is None else t.data_ptr()


def adam_step_cuda(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw,
                   maximize, inv_grad_scale, check_finite, seed, found_inf=None, lr_tensor=None,
                   inv_grad_scale_tensor=None, step_tensors=()):
    """The op's CUDA kernel; arguments and semantics as in optim_ops' docstring."""
    step_tensors = step_tensors or ()  # the dispatcher may pass None (the schema's default)
    combos = optim_ops.prepare(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                               exp_avg_sq_scales, steps, inv_grad_scale, check_finite, found_inf,
                               lr_tensor, inv_grad_scale_tensor, step_tensors)
    if not combos:
        return
    device = params[0].device
    if device.type != "cuda":
        optim_ops._fail(f"params[0] is on {device}; this is the CUDA kernel")
    cuda = _lib.cuda_lib()
    with torch.cuda.device(device):
        stream = cuda_stream(device)
        calls = []
        for key, idx in combos.items():
            tensors = optim_ops.tensors_struct(key, idx, params, grads, masters, exp_avgs,
                                               exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
                                               None if step_tensors else steps)
            dev = _lib.cuda_adam_device_args(
                lr=_address(lr_tensor), inv_grad_scale=_address(inv_grad_scale_tensor),
                found_inf=_address(found_inf))
            if step_tensors:
                dev.steps = _lib.pointer_array([step_tensors[i] for i in idx])
            calls.append((tensors, dev))
        # All or nothing over several C calls: check every combination first, into
        # the one flag every update kernel then reads.
        if check_finite and len(calls) > 1:
            for tensors, dev in calls:
                _lib.check(cuda.precis_cuda_adam_check_finite(ctypes.byref(tensors),
                                                              dev.found_inf, stream), OP, cuda)
            check_finite = False
        for k, (tensors, dev) in enumerate(calls):
            cfg = _lib.adam_config(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                   weight_decay=weight_decay, decoupled_weight_decay=int(adamw),
                                   maximize=int(maximize), inv_grad_scale=inv_grad_scale,
                                   check_finite=int(check_finite),
                                   seed=optim_ops.combo_seed(seed, k))
            _lib.check(cuda.precis_cuda_adam_step(ctypes.byref(cfg), ctypes.byref(tensors),
                                                  ctypes.byref(dev), stream), OP, cuda)


def check_finite_cuda(grads, found_inf):
    """found_inf = 1 when a gradient holds a NaN/Inf: one C call per grad dtype."""
    tables = optim_ops.grad_tables(grads)
    if not tables:
        return
    cuda = _lib.cuda_lib()
    with torch.cuda.device(found_inf.device):
        stream = cuda_stream(found_inf.device)
        for tensors in tables:
            _lib.check(cuda.precis_cuda_adam_check_finite(ctypes.byref(tensors),
                                                          found_inf.data_ptr(), stream),
                       "precis.check_finite_ (CUDA)", cuda)
