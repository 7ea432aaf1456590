"""One Muon step of a call's params (what step_calls.Call.op runs for precis.optim.Muon):
the momentum in precis's kernel (the muon_momentum rule: the stored momentum updated,
the direction written in bf16, which Newton-Schulz starts from), Newton-Schulz per
matrix in torch's code and matmuls, then the apply in precis's kernel (the sgd rule
with momentum 0, decoupled weight decay and each matrix's adjusted lr), as
torch.optim.Muon's single-tensor step does it op by op.

A DTensor param (FSDP2) is stepped as its local shard, but Newton-Schulz needs the
whole matrix: each rank's rows of the bf16 direction are all-gathered, every rank
orthogonalizes the same whole matrix and keeps its own rows (dtensor.on_whole), and
the adjusted lr is the whole matrix's. A precis.ddp ZeRO piece (a flat view of the
matrix's elements in this rank's shard) is assembled by on_whole too, through its
`_precis_whole` (precis.ddp's WholeParam: each rank's piece broadcast from it). So the
bits are those of the unsharded step at every world size."""

import math

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from . import device_reads, ops, tracing
from .dtensor import assembled_from_shards, local_shard, on_whole, whole_shape

# Newton-Schulz coefficients as microsoft/dion writes them, one (a, b, c) per iteration:
# its classic five (zeropower_via_newtonschulz5), and polar express (Amsel et al. 2025,
# arXiv 2505.16932; dion's default), which starts from the matrix over 1.02 times its
# norm: ns_coefficients="polar_express".
DION_NS_COEFFICIENTS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                        (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                        (2.8366, -3.0525, 1.2012))
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_EXPRESS_SAFETY = 1.02


def ns_iterations(ns_coefficients):
    """((a, b, c) per iteration, the norm's safety factor) of a group's ns_coefficients,
    or None for one (a, b, c), which torch's Newton-Schulz runs ns_steps times."""
    if ns_coefficients == "polar_express":
        return POLAR_EXPRESS_COEFFICIENTS, POLAR_EXPRESS_SAFETY
    if all(isinstance(c, (tuple, list)) for c in ns_coefficients):
        return tuple(tuple(map(float, c)) for c in ns_coefficients), 1.0
    return None


def lr_ratio(adjust_lr_fn, shape):
    """A matrix's adjusted lr over lr: torch.optim.Muon's (_adjust_lr), or dion's
    spectral norm's sqrt(rows / columns)."""
    if adjust_lr_fn == "spectral_norm":
        return math.sqrt(shape[0] / shape[1])
    return _adjust_lr(1.0, adjust_lr_fn, shape)


def newton_schulz(x, ns_coefficients, ns_steps, eps):
    """x orthogonalized: torch.optim.Muon's code for one (a, b, c) (its bits); for a
    triple per iteration (ns_iterations), torch's iteration with each one's triple, from
    x over its norm times the safety factor (dion's polar express: 1.02, as its code;
    torch's clamp to eps otherwise, so a list of one triple repeated gives torch's bits)."""
    iterations = ns_iterations(ns_coefficients)
    if iterations is None:
        return _zeropower_via_newtonschulz(x, ns_coefficients, ns_steps, eps)
    coefficients, safety = iterations
    y = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        y = y.T
    if safety == 1.0:
        y = y.div(y.norm().clamp(min=eps))
    else:
        y = y.div(y.norm() * safety + eps)
    for a, b, c in coefficients:
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


def step(params, grads, masters, exp_avgs, exp_avg_scales, steps, lr, seed, momentum,
         nesterov, weight_decay, ns_coefficients, ns_steps, ns_eps, adjust_lr_fn,
         momentum_form=0.0, *,
         streams=(), element_offsets=(), inv_grad_scale=1.0, inv_grad_scale_tensor=None,
         check_finite=False,
         found_inf=None, lr_tensor=None, step_tensors=(), ieee_sqrt=False, matrices=None,
         row_moments=(), normalize=None, checks_only=False, **unused):
    """ops.adam_step_'s arguments (those Muon uses), the Newton-Schulz options and the
    momentum's form (the muon_momentum rule's rule_hyper[0]: 0 torch's, 1 dion's);
    matrices: the params as the optimizer holds them (DTensors, whose local shards
    `params` are; default: params), for each whole matrix's shape and Newton-Schulz.
    A found_inf flag set before the apply (by check_finite, or given set: a check-only
    call) leaves every param and state as it was; the momentum call checks the
    apply's arguments too before it writes. The adjusted lr is lr times each matrix's
    ratio (lr_scales, multiplied in the kernel: lr may be a device tensor, lr_tensor, as
    in a compiled or captured step).
    normalize: None (Muon), or a rule's step between Newton-Schulz and the apply,
    normalize(update, row_moment, found_inf) -> the update, given each whole matrix's
    orthogonalized update and its per-row state (row_moments, one a param: NorMuon's).
    checks_only: found_inf is given set and only the two kernels' checks run
    (functional.check_calls' dry run): nothing to orthogonalize, and no flag read back."""
    keys = dict(steps=steps, step_tensors=step_tensors, lr=lr, lr_tensor=lr_tensor, seed=seed,
                streams=streams, element_offsets=element_offsets, ieee_sqrt=ieee_sqrt,
                beta1=0.0, beta2=0.0, eps=1.0, params=params, masters=masters, exp_avg_sqs=[],
                exp_avg_sq_scales=[])
    matrices = params if matrices is None else matrices
    directions = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    ratios = [lr_ratio(adjust_lr_fn, whole_shape(m)) for m in matrices]  # adjusted / lr
    apply = dict(keys, exp_avgs=[], exp_avg_scales=[], weight_decay=weight_decay, adamw=True,
                 rule="sgd", lr_scales=ratios)
    if found_inf is None and check_finite:
        found_inf = torch.zeros(1, dtype=torch.float32, device=params[0].device)
    if found_inf is not None:  # the apply's checks, before the momentum writes
        ops.adam_step_(grads=directions, found_inf=torch.ones_like(found_inf), **apply)
    ops.adam_step_(grads=grads, exp_avgs=exp_avgs, exp_avg_scales=exp_avg_scales,
                   weight_decay=0.0, rule="muon_momentum", momentum=momentum,
                   nesterov=nesterov, outputs=directions, inv_grad_scale=inv_grad_scale,
                   rule_hyper=(momentum_form,) if momentum_form else (),
                   inv_grad_scale_tensor=inv_grad_scale_tensor,
                   check_finite=check_finite, found_inf=found_inf, **keys)
    # On DTensor params every rank gets here or none does: the ranks agreed on the
    # flag before this call (functional.step_eager), so the gathers below match up.
    # (a device's flag is not read, nor a traced step's: the apply below skips by it)
    if checks_only or (found_inf is not None and not device_reads.device_path(found_inf.device)
                       and not tracing.traced() and device_reads.flag(found_inf, "muon skip")):
        return found_inf  # skipped (or checks only): nothing to orthogonalize

    def orthogonalized(x):
        return newton_schulz(x, ns_coefficients, ns_steps, ns_eps)

    def fn(i):
        if normalize is None:
            return orthogonalized
        return lambda x: normalize(orthogonalized(x), row_moments[i], found_inf)

    if tracing.traced() and any(assembled_from_shards(m) for m in matrices):
        # (dynamo fails tracing them: InternalTorchDynamoError, torch 2.13; one eager call)
        updates = tracing.run_eagerly(updates_of, directions, params, matrices, fn)
    else:
        updates = updates_of(directions, params, matrices, fn)
    ops.adam_step_(grads=updates, found_inf=found_inf, **apply)
    return found_inf


def updates_of(directions, params, matrices, fn):
    """Each matrix's update (update below), fn(i) of the i-th."""
    return [update(d, p, m, fn(i))
            for i, (d, p, m) in enumerate(zip(directions, params, matrices))]


def update(direction, p, m, fn):
    """The update of one matrix, fn of the whole matrix (Newton-Schulz, and NorMuon's
    normalization), in the order the kernel steps p (its stepped form: m's local rows,
    or their elements in memory order for a dense matrix in other strides,
    step_calls.kernel_view)."""
    local = local_shard(m, m)
    # (another shape only as kernel_view's flat view of a dense matrix in other strides:
    # Muon refuses complex params, whose flat view would be real pairs)
    if p.shape == local.shape:
        return on_whole(m, direction.view(p.shape), fn).contiguous()
    # a transposed matrix (say): fn of it in its own strides, the update given back in
    # its memory order (in fn's dtype: NorMuon's update is fp32)
    result = on_whole(m, direction.as_strided(local.shape, local.stride()), fn)
    out = direction if result.dtype == direction.dtype else \
        torch.empty_like(direction, dtype=result.dtype)
    out.as_strided(local.shape, local.stride()).copy_(result)  # (the direction is not read again)
    return out
