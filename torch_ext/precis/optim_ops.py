"""torch.ops.precis.adam_step_: the fused Adam/AdamW step as a torch operator.

One call updates a whole list of parameters in place. The CPU kernel checks
every tensor in Python, groups the tensors by dtype combination (param, grad,
master, exp_avg, exp_avg_sq) and makes one precis_adam_step call per combination
(usually one): the Adam math itself lives in C only.

Lists, all of the same length n unless said otherwise (an empty list stands for
"absent for every param"):

  params             fp32 / fp16 / bf16, contiguous, updated in place
  grads              fp32 / fp16 / bf16, as many elements as the param
  masters            [] or n tensors: fp32 / fp16 master copy, int16 remainders
                     (bf16 params), or an empty tensor where the param is its
                     own master
  exp_avgs           fp32 / fp16 / bf16 / uint8 (fp8 E4M3 bytes)
  exp_avg_sqs        same
  exp_avg_scales     [] or n fp32 tensors: precis_scale_count(numel) block
                     scales for fp16 / fp8 moments, an empty tensor otherwise
  exp_avg_sq_scales  same
  steps              the step number of each param after this update (>= 1)

Returns found_inf: True when check_finite found a NaN/Inf gradient, in which
case nothing at all was modified.
"""

import ctypes
import functools
import math

import torch

from . import _lib, ops

NAMESPACE = "precis"
OP_NAME = "adam_step_"
SCHEMA = (
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_scales, "
    "Tensor(f!)[] exp_avg_sq_scales, int[] steps, float lr, float beta1, float beta2, "
    "float eps, float weight_decay, bool adamw, bool maximize, float inv_grad_scale, "
    "bool check_finite, int seed) -> bool")

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD_DTYPES = PARAM_DTYPES
MASTER_DTYPES = (torch.float32, torch.float16, torch.int16)
MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
SCALED_MOMENT_DTYPES = (torch.float16, torch.uint8)  # stored with per-block fp32 scales

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# Kept at module level: dropping the library object would unregister the op.
_fragment = None


@functools.lru_cache(maxsize=4096)
def scale_count(numel):
    """precis_scale_count(numel): fp32 block scales an fp16/fp8 moment of numel needs."""
    out = ctypes.c_int64()
    _lib.check(_lib.lib().precis_scale_count(int(numel), ctypes.byref(out)),
               "precis_scale_count")
    return out.value


def mix_seed(*values):
    """A 63-bit seed mixed from non-negative ints (splitmix64 finaliser, chained).

    Deterministic across runs and processes; used to give each step, param group
    and dtype combination its own stochastic-rounding stream.
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & _MASK63


def grads_all_finite(grads):
    """True when no gradient holds a NaN or an Inf (one read pass, torch ops).

    Sums in float64: NaN and Inf propagate, and no sum of finite fp32/bf16/fp16
    values overflows float64, so there are no false alarms.
    """
    sums = [g.sum(dtype=torch.float64) for g in grads if g.numel() > 0]
    if not sums:
        return True
    return bool(torch.isfinite(torch.stack(sums)).all())


def _is_absent(t):
    return t.numel() == 0


def _fail(msg):
    raise ValueError(f"precis.adam_step_: {msg}")


def _check_lists(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                 exp_avg_sq_scales, steps):
    n = len(params)
    for name, lst, optional in (("grads", grads, False), ("masters", masters, True),
                                ("exp_avgs", exp_avgs, False),
                                ("exp_avg_sqs", exp_avg_sqs, False),
                                ("exp_avg_scales", exp_avg_scales, True),
                                ("exp_avg_sq_scales", exp_avg_sq_scales, True),
                                ("steps", steps, False)):
        if len(lst) != n and not (optional and len(lst) == 0):
            _fail(f"{name} has {len(lst)} entries but params has {n}"
                  + (" (pass [] when no param has one)" if optional else ""))


def _check_one(i, p, g, master, m, v, ms, vs, step, device_type):
    """Checks of param i and its buffers; returns its dtype-combination key."""
    for name, t in (("params", p), ("grads", g), ("masters", master), ("exp_avgs", m),
                    ("exp_avg_sqs", v), ("exp_avg_scales", ms), ("exp_avg_sq_scales", vs)):
        if t is None:
            continue
        if t.device.type != device_type:
            _fail(f"{name}[{i}] is on {t.device}, params[0] on {device_type}")
        if not t.is_contiguous():
            _fail(f"{name}[{i}] must be contiguous (shape {tuple(t.shape)}, "
                  f"stride {tuple(t.stride())})")
    n = p.numel()
    if p.dtype not in PARAM_DTYPES:
        _fail(f"params[{i}] has dtype {p.dtype}; supported: fp32, fp16, bf16")
    if g.dtype not in GRAD_DTYPES:
        _fail(f"grads[{i}] has dtype {g.dtype}; supported: fp32, fp16, bf16")
    if g.numel() != n:
        _fail(f"grads[{i}] has {g.numel()} elements, params[{i}] has {n}")
    if int(step) < 1:
        _fail(f"steps[{i}] is {step}; it is the step number after this update (>= 1)")
    if master is None or _is_absent(master):
        master_dtype = p.dtype  # the param is its own master
    else:
        master_dtype = master.dtype
        if master_dtype not in MASTER_DTYPES:
            _fail(f"masters[{i}] has dtype {master_dtype}; supported: fp32, fp16, "
                  f"int16 (remainders), or an empty tensor for none")
        if master_dtype == torch.int16 and p.dtype != torch.bfloat16:
            _fail(f"masters[{i}] holds int16 remainders, which need a bf16 param "
                  f"(params[{i}] is {p.dtype})")
        if master.numel() != n:
            _fail(f"masters[{i}] has {master.numel()} elements, params[{i}] has {n}")
    for name, t, scales in (("exp_avgs", m, ms), ("exp_avg_sqs", v, vs)):
        if t.dtype not in MOMENT_DTYPES:
            _fail(f"{name}[{i}] has dtype {t.dtype}; supported: fp32, fp16, bf16, "
                  f"uint8 (fp8 E4M3)")
        if t.numel() != n:
            _fail(f"{name}[{i}] has {t.numel()} elements, params[{i}] has {n}")
        scale_name = name[:-1] + "_scales"
        if t.dtype in SCALED_MOMENT_DTYPES:
            want = scale_count(n)
            if scales is None or scales.dtype != torch.float32 or scales.numel() != want:
                got = ("none" if scales is None else
                       f"{scales.numel()} {scales.dtype} values")
                _fail(f"{scale_name}[{i}]: {t.dtype} moments need {want} float32 block "
                      f"scales (precis_scale_count({n})), got {got}")
        elif scales is not None and not _is_absent(scales):
            _fail(f"{scale_name}[{i}] must be empty: {t.dtype} moments have no scales")
    return (p.dtype, g.dtype, master_dtype, m.dtype, v.dtype)


def _code(dtype):
    return _lib.torch_to_code(dtype)


def _call_c(key, idx, params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
            exp_avg_sq_scales, steps, cfg):
    """One precis_adam_step over the params at indices idx (one dtype combination)."""
    p_dtype, g_dtype, master_dtype, m_dtype, v_dtype = key

    def table(lst):
        return _lib.pointer_array([lst[i] for i in idx])

    tensors = _lib.adam_tensors(
        count=len(idx),
        param_dtype=_code(p_dtype), grad_dtype=_code(g_dtype),
        master_dtype=_code(master_dtype),
        exp_avg_dtype=_code(m_dtype), exp_avg_sq_dtype=_code(v_dtype),
        params=table(params), grads=table(grads),
        exp_avgs=table(exp_avgs), exp_avg_sqs=table(exp_avg_sqs),
        numels=_lib.int64_array([params[i].numel() for i in idx]),
        steps=_lib.int64_array([int(steps[i]) for i in idx]))
    if master_dtype != p_dtype:
        tensors.masters = table(masters)
    if m_dtype in SCALED_MOMENT_DTYPES:
        tensors.exp_avg_scales = table(exp_avg_scales)
    if v_dtype in SCALED_MOMENT_DTYPES:
        tensors.exp_avg_sq_scales = table(exp_avg_sq_scales)
    found = ctypes.c_int32(0)
    _lib.check(_lib.lib().precis_adam_step(ctypes.byref(cfg), ctypes.byref(tensors),
                                           ctypes.byref(found)),
               "precis.adam_step_")
    return bool(found.value)


def _adam_step_cpu(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw,
                   maximize, inv_grad_scale, check_finite, seed):
    _check_lists(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                 exp_avg_sq_scales, steps)
    if not math.isfinite(inv_grad_scale):
        _fail(f"inv_grad_scale must be finite, got {inv_grad_scale}")
    combos = {}  # dtype combination -> indices of its params, in order
    for i, p in enumerate(params):
        key = _check_one(i, p, grads[i], masters[i] if masters else None, exp_avgs[i],
                         exp_avg_sqs[i], exp_avg_scales[i] if exp_avg_scales else None,
                         exp_avg_sq_scales[i] if exp_avg_sq_scales else None, steps[i], "cpu")
        if p.numel() > 0:
            combos.setdefault(key, []).append(i)
    if not combos:
        return False
    # check_finite must hold for the whole list: with several C calls, a later one
    # finding an Inf could not undo the earlier ones, so check everything first.
    if check_finite and len(combos) > 1:
        if not grads_all_finite(grads):
            return True
        check_finite = False
    for k, (key, idx) in enumerate(combos.items()):
        cfg = _lib.adam_config(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay, decoupled_weight_decay=int(adamw),
                               maximize=int(maximize), inv_grad_scale=inv_grad_scale,
                               check_finite=int(check_finite),
                               seed=seed if k == 0 else mix_seed(seed, k))
        if _call_c(key, idx, params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps, cfg):
            return True  # only possible with a single combination: nothing was written
    return False


def _adam_step_cuda(*args):
    raise NotImplementedError(
        "precis.adam_step_: CUDA tensors are not supported yet; the CUDA kernels arrive "
        "with the CUDA issue (libprecis_cuda.so has no Adam step). Keep the params and "
        "optimizer on CPU for now.")




def register():
    """Define and implement torch.ops.precis.adam_step_ once per process."""
    global _fragment
    if _fragment is not None or ops.op_registered(OP_NAME):
        return
    fragment = ops.new_fragment()
    fragment.define(SCHEMA)
    fragment.impl(OP_NAME, _adam_step_cpu, "CPU")
    fragment.impl(OP_NAME, _adam_step_cuda, "CUDA")
    _fragment = fragment


register()


def adam_step_(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
               exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw=True,
               maximize=False, inv_grad_scale=1.0, check_finite=False, seed=0):
    """torch.ops.precis.adam_step_ with keyword defaults; see the module docstring."""
    return torch.ops.precis.adam_step_(
        list(params), list(grads), list(masters), list(exp_avgs), list(exp_avg_sqs),
        list(exp_avg_scales), list(exp_avg_sq_scales), [int(s) for s in steps], float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
        bool(maximize), float(inv_grad_scale), bool(check_finite), int(seed))
