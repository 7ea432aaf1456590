"""precis.optim.AdamW and precis.optim.Adam, and their rule: torch.optim.AdamW / Adam
with precision-aware state, on precis's kernels (see precis.optim's docstring for the
policy, the state, checkpoints and loss scaling)."""

from .group_checks import check_common, check_torch_adam, check_torch_adam_betas, number
from .optimizer import PrecisOptimizer
from .rule import Rule


class AdamRule(Rule):
    """Adam / AdamW: exp_avg and exp_avg_sq (and amsgrad's max), the layout's dtypes."""

    name = "adam"
    all_moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # its state may hold these
    group_keys = ("lr", "betas", "eps", "weight_decay")  # a saved param group holds these
    # (a group saved before torch had them: torch's Adam.__setstate__ gives these)
    saved_defaults = {"amsgrad": False, "maximize": False}

    def moments(self, group):
        keys = ("exp_avg", "exp_avg_sq")
        return keys + ("max_exp_avg_sq",) if group.get("amsgrad") else keys

    def required(self):
        return ("step", "exp_avg", "exp_avg_sq")

    def op_args(self, group):
        beta1, beta2 = group["betas"]
        return dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adamw=group["decoupled_weight_decay"], maximize=bool(group["maximize"]),
                    amsgrad=bool(group["amsgrad"]))

    def check_added(self, group, where):
        check_torch_adam_betas(group["betas"])

    def check(self, group, where):
        check_torch_adam(group, where)
        check_common(group, where, ("eps", "weight_decay"),
                     ("amsgrad", "decoupled_weight_decay"))
        for i, b in enumerate(group["betas"]):
            if number(b) is None:
                raise ValueError(f"{where}: betas[{i}] must be a number in [0, 1), got {b!r}")


RULE = AdamRule()


def _adam_defaults(lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable,
                   differentiable, fused, decoupled_weight_decay, policy, seed):
    return dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                maximize=maximize, foreach=foreach, capturable=capturable,
                differentiable=differentiable, fused=fused,
                decoupled_weight_decay=decoupled_weight_decay, policy=policy, seed=seed)


class AdamW(PrecisOptimizer):
    """AdamW (decoupled weight decay: p -= lr * weight_decay * p) with precision-aware
    state, taking torch.optim.AdamW's arguments (foreach and fused are accepted and
    change nothing for precis's kernel) plus precis's policy and seed. float64 /
    complex128 params, and differentiable=True (fp32 policy only), run torch's own
    math (precis.torch_math). See the module docstring for policy, state, checkpoints
    and loss scaling."""

    _rule = RULE
    _always_decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, policy=None, seed=0, offload=False,
                 offload_fraction=1.0):
        super().__init__(params, _adam_defaults(
            lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable,
            differentiable, fused, True, policy, seed), offload=offload,
            offload_fraction=offload_fraction)


class Adam(PrecisOptimizer):
    """Adam (L2 weight decay: g += weight_decay * p; decoupled_weight_decay=True makes
    it AdamW) with precision-aware state, taking torch.optim.Adam's arguments (see
    AdamW) plus precis's policy and seed."""

    _rule = RULE

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False, policy=None,
                 seed=0, offload=False, offload_fraction=1.0):
        super().__init__(params, _adam_defaults(
            lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable,
            differentiable, fused, decoupled_weight_decay, policy, seed), offload=offload,
            offload_fraction=offload_fraction)

