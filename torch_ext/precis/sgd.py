"""precis.optim.SGD: torch.optim.SGD with precision-aware state, on precis's kernels."""

import torch

from .group_checks import check_common, check_fused, number
from .optimizer import PrecisOptimizer
from .rule import OneState


class SGDRule(OneState):
    """torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay (decoupled with
    precis's decoupled_weight_decay=True: SGDW); no state with momentum 0."""

    name = "sgd"
    first_step_starts_momentum = True
    group_keys = ("lr", "momentum", "dampening", "weight_decay")
    # (a group saved before torch had them: torch's SGD.__setstate__ gives these)
    saved_defaults = {"nesterov": False, "maximize": False}

    def moments(self, group):
        return ("exp_avg",) if group["momentum"] != 0 else ()

    def required(self):
        return ()

    def op_args(self, group):
        return dict(rule="sgd", momentum=float(group["momentum"]),
                    dampening=float(group["dampening"]), nesterov=bool(group["nesterov"]),
                    weight_decay=float(group["weight_decay"]),
                    adamw=bool(group["decoupled_weight_decay"]),
                    maximize=bool(group["maximize"]))

    def check(self, group, where):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        for name, key in (("learning rate", "lr"), ("momentum value", "momentum"),
                          ("weight_decay value", "weight_decay")):
            if not 0.0 <= number(group[key], 0.0):
                raise ValueError(f"Invalid {name}: {group[key]} ({where}; need >= 0)")
        if group["nesterov"] and (number(group["momentum"], 0.0) <= 0
                                  or number(group["dampening"], 1.0) != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        check_fused(group)
        check_common(group, where, ("momentum", "dampening", "weight_decay"),
                     ("nesterov", "decoupled_weight_decay"))


RULE = SGDRule()


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

    _rule = RULE

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
