"""torch.ops.precis.adam_step_ / check_finite_: the fused Adam/AdamW step as torch ops.

One adam_step_ call updates a whole list of parameters in place, on the CPU
(precis_adam_step) or on one CUDA device (precis_cuda_adam_step, cuda_ops.py).
Both kernels check every tensor here first (prepare()), group the tensors by
dtype combination (param, grad, master, exp_avg, exp_avg_sq) and make one C call
per combination (usually one), the k-th combination's stochastic-rounding seed
mixed from (seed, k): the Adam math itself lives in C only, and CPU and GPU write
the same bits.

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
  steps              the step number of each param after this update (>= 1);
                     [] when step_tensors is given

Optional one-element tensors on the params' device (what makes a step capturable
in a CUDA graph: the kernels read them when they run, and nothing syncs):

  found_inf              float32. Nonzero when the update runs: nothing is
                         modified. check_finite sets it to 1 when a gradient is
                         NaN/Inf (then nothing is modified); never cleared.
                         Required by check_finite.
  lr_tensor              float64, used instead of lr
  inv_grad_scale_tensor  float32, used instead of inv_grad_scale
  step_tensors           [] or n int64 tensors, used instead of steps (one tensor
                         may serve several params). Never incremented here.

The ops return nothing (so torch.compile can functionalize them); adam_step_()
below returns found_inf for convenience. check_finite_(grads, found_inf) sets
found_inf to 1 when any gradient holds a NaN/Inf: check several lists first,
then step each with check_finite=False and that found_inf, and either all of
them update or none does.
"""

import ctypes
import functools
import math

import torch

from . import _lib, ops

OP_NAME = "adam_step_"
SCHEMA = (
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_scales, "
    "Tensor(f!)[] exp_avg_sq_scales, int[] steps, float lr, float beta1, float beta2, "
    "float eps, float weight_decay, bool adamw, bool maximize, float inv_grad_scale, "
    "bool check_finite, int seed, Tensor(g!)? found_inf=None, Tensor? lr_tensor=None, "
    "Tensor? inv_grad_scale_tensor=None, Tensor[]? step_tensors=None) -> ()")
CHECK_SCHEMA = "check_finite_(Tensor[] grads, Tensor(a!) found_inf) -> ()"

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD_DTYPES = PARAM_DTYPES
MASTER_DTYPES = (torch.float32, torch.float16, torch.int16)
MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
SCALED_MOMENT_DTYPES = _lib.SCALED_MOMENT_DTYPES  # fp16 / fp8: with fp32 block scales

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# Kept at module level: dropping the library object would unregister the ops.
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

    Deterministic across runs and processes; used to give each param group and
    dtype combination its own stochastic-rounding stream.
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & _MASK63


def _fail(msg):
    raise ValueError(f"precis.adam_step_: {msg}")


def _check_lists(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                 exp_avg_sq_scales, steps, step_tensors):
    n = len(params)
    for name, lst, optional in (("grads", grads, False), ("masters", masters, True),
                                ("exp_avgs", exp_avgs, False),
                                ("exp_avg_sqs", exp_avg_sqs, False),
                                ("exp_avg_scales", exp_avg_scales, True),
                                ("exp_avg_sq_scales", exp_avg_sq_scales, True),
                                ("steps", steps, bool(step_tensors)),
                                ("step_tensors", step_tensors, True)):
        if len(lst) != n and not (optional and len(lst) == 0):
            _fail(f"{name} has {len(lst)} entries but params has {n}"
                  + (" (pass [] when no param has one)" if name != "steps" else
                     " (pass [] only with step_tensors)" if not step_tensors else ""))


def _check_one(i, p, g, master, m, v, ms, vs, step, device):
    """Checks of param i and its buffers; returns its dtype-combination key."""
    for name, t in (("params", p), ("grads", g), ("masters", master), ("exp_avgs", m),
                    ("exp_avg_sqs", v), ("exp_avg_scales", ms), ("exp_avg_sq_scales", vs)):
        if t is None or (name != "params" and t.numel() == 0):
            continue
        if t.device != device:
            _fail(f"{name}[{i}] is on {t.device}, params[0] on {device}")
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
    if step is not None and int(step) < 1:
        _fail(f"steps[{i}] is {step}; it is the step number after this update (>= 1)")
    if master is None or master.numel() == 0:
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
        elif scales is not None and scales.numel() != 0:
            _fail(f"{scale_name}[{i}] must be empty: {t.dtype} moments have no scales")
    return (p.dtype, g.dtype, master_dtype, m.dtype, v.dtype)


def check_scalar(t, name, dtype, device):
    """A one-element `dtype` tensor on `device` (None passes)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"precis.adam_step_: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, params on {device}")
    if t.dtype != dtype or t.numel() != 1:
        _fail(f"{name} must hold one {dtype} value, got {t.numel()} {t.dtype} values")


def prepare(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
            steps, inv_grad_scale, check_finite, found_inf, lr_tensor, inv_grad_scale_tensor,
            step_tensors):
    """Every check of an adam_step_ call, before anything is written.

    Returns {dtype combination: [indices of its non-empty params, in order]}.
    """
    _check_lists(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                 exp_avg_sq_scales, steps, step_tensors)
    if not math.isfinite(inv_grad_scale):
        _fail(f"inv_grad_scale must be finite, got {inv_grad_scale}")
    if check_finite and found_inf is None:
        _fail("check_finite needs found_inf (a one-element float32 tensor, zeroed, on the "
              "params' device) to report a NaN/Inf gradient in")
    combos = {}
    if not params:
        return combos
    device = params[0].device
    for name, t, dtype in (("found_inf", found_inf, torch.float32),
                           ("lr_tensor", lr_tensor, torch.float64),
                           ("inv_grad_scale_tensor", inv_grad_scale_tensor, torch.float32)):
        check_scalar(t, name, dtype, device)
    for i, t in enumerate(step_tensors):
        check_scalar(t, f"step_tensors[{i}]", torch.int64, device)
    for i, p in enumerate(params):
        key = _check_one(i, p, grads[i], masters[i] if masters else None, exp_avgs[i],
                         exp_avg_sqs[i], exp_avg_scales[i] if exp_avg_scales else None,
                         exp_avg_sq_scales[i] if exp_avg_sq_scales else None,
                         None if step_tensors else steps[i], device)
        if p.numel() > 0:
            combos.setdefault(key, []).append(i)
    return combos


def tensors_struct(key, idx, params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps):
    """precis_adam_tensors_t over the params at indices idx (one dtype combination).
    steps: host step numbers, or None (the CUDA kernel then reads device steps)."""
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
        numels=_lib.int64_array([params[i].numel() for i in idx]))
    if steps is not None:
        tensors.steps = _lib.int64_array([int(steps[i]) for i in idx])
    if master_dtype != p_dtype:
        tensors.masters = table(masters)
    if m_dtype in SCALED_MOMENT_DTYPES:
        tensors.exp_avg_scales = table(exp_avg_scales)
    if v_dtype in SCALED_MOMENT_DTYPES:
        tensors.exp_avg_sq_scales = table(exp_avg_sq_scales)
    return tensors


def combo_seed(seed, k):
    """The stochastic-rounding seed of the k-th dtype combination of a call."""
    return seed if k == 0 else mix_seed(seed, k)


# ---- CPU kernels ---------------------------------------------------------------


def grad_tables(grads):
    """precis_adam_tensors_t over the non-empty grads, one per grad dtype: what
    precis_adam_check_finite and its CUDA twin read."""
    by_dtype = {}
    for g in grads:
        if g.numel() > 0:
            by_dtype.setdefault(g.dtype, []).append(g)
    return [_lib.adam_tensors(count=len(gs), grad_dtype=_lib.torch_to_code(dtype),
                              grads=_lib.pointer_array(gs),
                              numels=_lib.int64_array([g.numel() for g in gs]))
            for dtype, gs in by_dtype.items()]


def _check_finite_cpu(grads, found_inf):
    """found_inf = 1 when a gradient holds a NaN/Inf: one C call per grad dtype."""
    _check_finite_args(grads, found_inf, "cpu")
    found = ctypes.c_int32(0)  # once set, the later checks return at once
    for tensors in grad_tables(grads):
        _lib.check(_lib.lib().precis_adam_check_finite(ctypes.byref(tensors), ctypes.byref(found)),
                   "precis.check_finite_")
    if found.value:
        found_inf.fill_(1.0)


def _adam_step_cpu(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                   exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw,
                   maximize, inv_grad_scale, check_finite, seed, found_inf=None, lr_tensor=None,
                   inv_grad_scale_tensor=None, step_tensors=()):
    step_tensors = step_tensors or ()  # the dispatcher may pass None (the schema's default)
    combos = prepare(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                     exp_avg_sq_scales, steps, inv_grad_scale, check_finite, found_inf,
                     lr_tensor, inv_grad_scale_tensor, step_tensors)
    if not combos or (found_inf is not None and float(found_inf) != 0.0):
        return
    # Device values are host memory here: read them now.
    if lr_tensor is not None:
        lr = float(lr_tensor)
    if inv_grad_scale_tensor is not None:
        inv_grad_scale = float(inv_grad_scale_tensor)
    if step_tensors:
        steps = [int(t) for t in step_tensors]
        bad = [(i, s) for i, s in enumerate(steps) if s < 1 and params[i].numel() > 0]
        if bad:
            _fail(f"step_tensors[{bad[0][0]}] holds {bad[0][1]}; it is the step number after "
                  f"this update (>= 1)")
    # All or nothing over several C calls: check every gradient first.
    if check_finite and len(combos) > 1:
        _check_finite_cpu(grads, found_inf)
        if float(found_inf) != 0.0:
            return
        check_finite = False
    for k, (key, idx) in enumerate(combos.items()):
        cfg = _lib.adam_config(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay, decoupled_weight_decay=int(adamw),
                               maximize=int(maximize), inv_grad_scale=inv_grad_scale,
                               check_finite=int(check_finite), seed=combo_seed(seed, k))
        tensors = tensors_struct(key, idx, params, grads, masters, exp_avgs, exp_avg_sqs,
                                 exp_avg_scales, exp_avg_sq_scales, steps)
        found = ctypes.c_int32(0)
        _lib.check(_lib.lib().precis_adam_step(ctypes.byref(cfg), ctypes.byref(tensors),
                                               ctypes.byref(found)), "precis.adam_step_")
        if found.value:  # only possible with a single combination: nothing was written
            found_inf.fill_(1.0)
            return


def _check_finite_args(grads, found_inf, device_type):
    if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.float32 \
            or found_inf.numel() != 1:
        raise ValueError("precis.check_finite_: found_inf must be a one-element float32 tensor")
    for i, g in enumerate(grads):
        if g.device != found_inf.device:
            raise ValueError(f"precis.check_finite_: grads[{i}] is on {g.device}, found_inf on "
                             f"{found_inf.device}")
        if g.dtype not in GRAD_DTYPES or not g.is_contiguous():
            raise ValueError(f"precis.check_finite_: grads[{i}] must be a contiguous fp32 / fp16 "
                             f"/ bf16 tensor, got {g.dtype} of stride {tuple(g.stride())}")
    if found_inf.device.type != device_type:
        raise ValueError(f"precis.check_finite_: found_inf is on {found_inf.device}")


# ---- CUDA kernels (cuda_ops.py, imported at the first CUDA call) and fakes ---------


def _adam_step_cuda(*args, **kwargs):
    from . import cuda_ops
    return cuda_ops.adam_step_cuda(*args, **kwargs)


def _check_finite_cuda(grads, found_inf):
    from . import cuda_ops
    _check_finite_args(grads, found_inf, "cuda")
    return cuda_ops.check_finite_cuda(grads, found_inf)


def _adam_step_fake(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
                    exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw,
                    maximize, inv_grad_scale, check_finite, seed, found_inf=None, lr_tensor=None,
                    inv_grad_scale_tensor=None, step_tensors=()):
    # Shapes, dtypes and devices only (meta / fake tensors, torch.compile tracing).
    step_tensors = step_tensors or ()
    prepare(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
            steps, inv_grad_scale, check_finite, found_inf, lr_tensor, inv_grad_scale_tensor,
            step_tensors)


def _check_finite_fake(grads, found_inf):
    _check_finite_args(grads, found_inf, found_inf.device.type)


def register():
    """Define and implement the ops once per process."""
    global _fragment
    if _fragment is not None or ops.op_registered(OP_NAME):
        return
    fragment = ops.new_fragment()
    fragment.define(SCHEMA)
    fragment.define(CHECK_SCHEMA)
    for name, cpu, cuda, fake in ((OP_NAME, _adam_step_cpu, _adam_step_cuda, _adam_step_fake),
                                  ("check_finite_", _check_finite_cpu, _check_finite_cuda,
                                   _check_finite_fake)):
        fragment.impl(name, cpu, "CPU")
        fragment.impl(name, cuda, "CUDA")
        ops.register_fake(fragment, name, fake)
    _fragment = fragment


register()


def adam_step_(params, grads, masters, exp_avgs, exp_avg_sqs, exp_avg_scales,
               exp_avg_sq_scales, steps, lr, beta1, beta2, eps, weight_decay, adamw=True,
               maximize=False, inv_grad_scale=1.0, check_finite=False, seed=0, *,
               found_inf=None, lr_tensor=None, inv_grad_scale_tensor=None, step_tensors=()):
    """torch.ops.precis.adam_step_ with keyword defaults; see the module docstring.

    With check_finite and no found_inf, a zeroed flag is made. Returns found_inf
    (None when neither given nor needed): nonzero when the step was skipped;
    reading it synchronizes with the device.
    """
    params = list(params)
    if check_finite and found_inf is None and params:
        found_inf = torch.zeros(1, dtype=torch.float32, device=params[0].device)
    torch.ops.precis.adam_step_(
        params, list(grads), list(masters), list(exp_avgs), list(exp_avg_sqs),
        list(exp_avg_scales), list(exp_avg_sq_scales), [int(s) for s in steps or ()],
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
        bool(maximize), float(inv_grad_scale), bool(check_finite), int(seed), found_inf,
        lr_tensor, inv_grad_scale_tensor, list(step_tensors))
    return found_inf


def check_finite_(grads, found_inf):
    """torch.ops.precis.check_finite_: found_inf = 1 if a gradient holds a NaN/Inf."""
    torch.ops.precis.check_finite_(list(grads), found_inf)
    return found_inf
