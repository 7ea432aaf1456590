"""precis.optim.SGD: torch.optim.SGD with precision-aware state, on precis's kernels."""

from . import rules
from .optimizer import PrecisOptimizer


class SGD(PrecisOptimizer):
    """SGD with momentum (torch.optim.SGD's arguments and math: momentum, dampening,
    nesterov, L2 weight_decay, maximize; foreach and fused are accepted and change
    nothing) whose momentum buffer is kept in the policy's momentum_dtype (state key
    'exp_avg'; torch's 'momentum_buffer' in a state dict where torch reads it exactly,
    and in to_torch_state_dict) and whose master in
    the policy's (fp32 master, remainders, or stochastic rounding of bf16 params).
    decoupled_weight_decay=True makes it SGDW (p *= 1 - lr * weight_decay). With the
    fp32 policy on fp32 params it gives torch.optim.SGD's bits. Sparse gradients
    (nn.Embedding(sparse=True)) are stepped by torch.optim.SGD's own math (as float64
    params are; precis.torch_math): torch's bits and state (a sparse 'momentum_buffer'),
    torch's errors (L2 weight_decay, fused) raised before anything is written; only for
    fp32 params with fp32 state: a param whose policy keeps a master or a low-precision
    momentum is refused (torch's step would bypass them). capturable, policy,
    seed, offload and offload_fraction are precis.optim.AdamW's (see precis.optim)."""

    _rule = rules.SGD_RULE

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, capturable=False, decoupled_weight_decay=False, policy=None,
                 seed=0, offload=False, offload_fraction=1.0):
        super().__init__(params, dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused, capturable=capturable,
            decoupled_weight_decay=decoupled_weight_decay, policy=policy, seed=seed),
            offload=offload, offload_fraction=offload_fraction)
