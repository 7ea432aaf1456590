"""precis.optim.Lion: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms") with precision-aware state, on precis's kernels."""

from . import rules
from .optimizer import PrecisOptimizer


class Lion(PrecisOptimizer):
    """Lion: c = beta1 * m + (1 - beta1) * g; p = p * (1 - lr * wd) - lr * sign(c);
    m = beta2 * m + (1 - beta2) * g. One state, 'exp_avg', in the policy's
    momentum_dtype (half of AdamW's state at the same dtype); the master as the policy
    keeps it. maximize, capturable, policy, seed, offload and offload_fraction are
    precis.optim.AdamW's (see precis.optim); foreach and fused are accepted."""

    _rule = rules.LION

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, foreach=None, differentiable=False, fused=None,
                 capturable=False, policy=None, seed=0, offload=False, offload_fraction=1.0):
        super().__init__(params, dict(
            lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
            foreach=foreach, differentiable=differentiable, fused=fused,
            capturable=capturable, policy=policy, seed=seed),
            offload=offload, offload_fraction=offload_fraction)
