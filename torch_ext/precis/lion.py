"""precis.optim.Lion: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms") with precision-aware state, on precis's kernels."""

from .group_checks import check_common, number
from .optimizer import PrecisOptimizer
from .rule import OneState


class LionRule(OneState):
    """Lion (Chen et al. 2023): p -= lr * sign(beta1 * m + (1 - beta1) * g), decoupled
    weight decay; m = beta2 * m + (1 - beta2) * g."""

    name = "lion"
    torch_names = {}  # no torch Lion: exp_avg, as lion-pytorch names it
    group_keys = ("lr", "betas", "weight_decay")

    def op_args(self, group):
        beta1, beta2 = group["betas"]
        return dict(rule="lion", beta1=float(beta1), beta2=float(beta2),
                    weight_decay=float(group["weight_decay"]),
                    maximize=bool(group["maximize"]))

    def check(self, group, where):
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            if not 0.0 <= number(b, -1.0) <= 1.0:
                raise ValueError(f"{where}: Invalid beta parameter at index {i}: {b} "
                                 f"(need a number in [0, 1])")
        for key in ("lr", "weight_decay"):
            if not 0.0 <= number(group[key], 0.0):
                raise ValueError(f"{where}: Invalid {key}: {group[key]} (need >= 0)")
        check_common(group, where, ("weight_decay",), ())


RULE = LionRule()


class Lion(PrecisOptimizer):
    """Lion: c = beta1 * m + (1 - beta1) * g; p = p * (1 - lr * wd) - lr * sign(c);
    m = beta2 * m + (1 - beta2) * g. One state, 'exp_avg', in the policy's
    momentum_dtype (half of AdamW's state at the same dtype); the master as the policy
    keeps it. maximize, capturable, policy, seed, offload and offload_fraction are
    precis.optim.AdamW's (see precis.optim); foreach and fused are accepted."""

    _rule = RULE

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, foreach=None, differentiable=False, fused=None,
                 capturable=False, policy=None, seed=0, offload=False, offload_fraction=1.0):
        super().__init__(params, dict(
            lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
            foreach=foreach, differentiable=differentiable, fused=fused,
            capturable=capturable, policy=policy, seed=seed),
            offload=offload, offload_fraction=offload_fraction)
