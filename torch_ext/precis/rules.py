"""The update rules of precis.optim's optimizers: what differs between Adam / AdamW,
SGD, Lion and Muon, and nothing else. The functional core (adam_step), the Plan,
offload, DTensor state and checkpoints serve every rule through the same code; the C
kernels' element stores too (csrc/adam_math.h: one update function per rule over
decoded fp32 values; docs/design.md section 4).

A Rule says which moments a param's state keeps (the one-state rules keep their
momentum in 'exp_avg', in the policy's momentum_dtype), the op arguments of a param
group, torch's constructor checks for that optimizer, and torch's name of each state
key (to_torch_state_dict)."""

import math

import torch

from .group_checks import check_common, check_fused, check_torch_adam, number
from .state_layout import one_state_layout


class Rule:
    """Adam / AdamW: exp_avg and exp_avg_sq (and amsgrad's max), the layout's dtypes."""

    name = "adam"
    flat = True  # a group's steady state may be planned flat (adam_plan)
    first_step_starts_momentum = False  # SGD: the kernel's step 1 starts the buffer from g
    # Muon: its step needs each param whole (Newton-Schulz), not elementwise; precis.ddp
    # then hands every rank a piece of each param that can assemble it (_precis_whole).
    steps_whole_params = False
    all_moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # its state may hold these
    torch_names = {}  # precis state key -> torch's key for this optimizer, where they differ
    group_keys = ("lr", "betas", "eps", "weight_decay")  # a saved param group holds these

    def moments(self, group):
        keys = ("exp_avg", "exp_avg_sq")
        return keys + ("max_exp_avg_sq",) if group.get("amsgrad") else keys

    def required(self):
        """The keys every saved state of a param holds (a torch state dict's too)."""
        return ("step", "exp_avg", "exp_avg_sq")

    def layout(self, layout, policy):
        return layout

    def check_stepped(self, p, where):
        """A param as the step gets it (a precis.ddp piece, say) that this rule cannot
        step: ValueError naming it, before anything is written."""

    def op_args(self, group):
        """The op's hyperparameters of a group, but lr and seed (adam_calls)."""
        beta1, beta2 = group["betas"]
        return dict(beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adamw=group["decoupled_weight_decay"], maximize=bool(group["maximize"]),
                    amsgrad=bool(group["amsgrad"]))

    def check(self, group, where):
        check_torch_adam(group, where)
        check_common(group, where, ("eps", "weight_decay"),
                     ("amsgrad", "decoupled_weight_decay"))
        for i, b in enumerate(group["betas"]):
            if number(b) is None:
                raise ValueError(f"{where}: betas[{i}] must be a number in [0, 1), got {b!r}")


class OneState(Rule):
    """A rule with one state buffer, its momentum: 'exp_avg' in the policy's
    momentum_dtype (exp_avg_dtype where the policy predates it), no exp_avg_sq."""

    torch_names = {"exp_avg": "momentum_buffer"}
    all_moments = ("exp_avg",)

    def moments(self, group):
        return ("exp_avg",)

    def required(self):
        return ("exp_avg",)

    def layout(self, layout, policy):
        return one_state_layout(layout, policy)


class SGD(OneState):
    """torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay (decoupled with
    precis's decoupled_weight_decay=True: SGDW); no state with momentum 0."""

    name = "sgd"
    first_step_starts_momentum = True
    group_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

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


class Lion(OneState):
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


class Muon(OneState):
    """torch.optim.Muon's momentum (the C kernel), then Newton-Schulz in torch, then
    the apply (the C kernel's sgd rule with each matrix's adjusted lr): precis.muon."""

    name = "muon"
    flat = False  # three stages per step (muon_step), not one flat op call
    steps_whole_params = True
    group_keys = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps",
                  "ns_steps", "adjust_lr_fn")

    def op_args(self, group):
        return dict(rule="muon", momentum=float(group["momentum"]),
                    nesterov=bool(group["nesterov"]),
                    weight_decay=float(group["weight_decay"]),
                    ns_coefficients=tuple(map(float, group["ns_coefficients"])),
                    ns_steps=group["ns_steps"], ns_eps=float(group["eps"]),
                    adjust_lr_fn=group["adjust_lr_fn"])

    def check_stepped(self, p, where):
        whole = getattr(p, "_precis_whole", None)  # a precis.ddp piece's whole param
        if len(p.shape if whole is None else whole.shape) != 2:
            raise ValueError(f"{where}: Muon orthogonalizes whole matrices, and this is "
                             f"none, nor a piece that can assemble one (precis.ddp's pieces "
                             f"of a matrix come from precis.ddp.attach_optimizer)")

    def check(self, group, where):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= number(lr, 0.0):
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        momentum = number(group["momentum"], 0.0)
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {group['momentum']} ({where})")
        if not momentum < 1.0:
            raise ValueError(f"momentum should be below 1 but is: {group['momentum']} ({where}; "
                             f"torch.optim.Muon takes 1 too, precis needs it below 1: "
                             f"buf.lerp_(grad, 1 - momentum))")
        if not 0.0 <= number(group["weight_decay"], 0.0):
            raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
        if group["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not "
                             f"supported")
        coefficients = group["ns_coefficients"]
        if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3
                and all(number(c) is not None and math.isfinite(number(c))
                        for c in coefficients)):
            raise ValueError(f"{where}: ns_coefficients must be 3 finite numbers, got "
                             f"{coefficients!r}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"{where}: ns_steps must be an int in [0, 100), got {steps!r}")
        if not 0.0 < number(group["eps"], 0.0):
            raise ValueError(f"{where}: eps must be a finite number > 0, got {group['eps']!r}")
        check_common(group, where, ("momentum", "weight_decay", "eps"), ("nesterov",))


ADAM, SGD_RULE, LION, MUON = Rule(), SGD(), Lion(), Muon()
