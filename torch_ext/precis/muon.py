"""precis.optim.Muon: torch.optim.Muon with precision-aware state: its momentum and
master in the policy's dtypes, the elementwise parts in precis's kernels, the
Newton-Schulz orthogonalization in torch's (precis.muon_step)."""

import math

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

from . import adamw, user_warnings
from .group_checks import check_common, number
# (dion's Newton-Schulz coefficients are precis.muon's names too)
from .muon_step import DION_NS_COEFFICIENTS, POLAR_EXPRESS_COEFFICIENTS, ns_iterations  # noqa: F401
from .optimizer import PrecisOptimizer
from .rule import OneState

# What a group that asks for AdamW ({"params": ..., "algorithm": "adamw"}) gets where it
# gives none: torch.optim.AdamW's defaults (its lr is the optimizer's).
ADAMW_GROUP = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                   decoupled_weight_decay=True)

# The momentum's forms (the muon_momentum rule's rule_hyper[0]): torch.optim.Muon's
# average, buf.lerp_(g, 1 - momentum), and dion's (Keller Jordan's first) sum,
# buf = momentum * buf + g; Nesterov's direction lerp(g, buf, momentum) and
# g + momentum * buf. Newton-Schulz takes out their factor (1 - momentum).
MOMENTUM_FORMS = {"ema": 0.0, "sum": 1.0}
# dion's adjust_lr="spectral_norm": lr * sqrt(fan_out / fan_in), beside torch's two.
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_norm")


class AdamWGroupRule(adamw.AdamRule):
    """AdamW's rule for a Muon optimizer's "adamw" groups; it warns of a scheduler's
    momentum cycle: torch's OneCycleLR and CyclicLR (cycle_momentum=True) cycle the
    option optimizer.defaults has, Muon's momentum, in every group, and an AdamW group
    reads none, so its beta1 stays as it was (unlike an AdamW of its own). A warning,
    not a refusal: the scheduler's keys stay in the groups a checkpoint saves."""

    def check(self, group, where):
        super().check(group, where)
        if "max_momentum" in group and "base_momentum" in group:
            user_warnings.warn(
                f"{where} is an 'adamw' group whose 'momentum' a scheduler cycles (torch's "
                f"OneCycleLR and CyclicLR with cycle_momentum=True cycle Muon's momentum in "
                f"every group), which AdamW does not read: its beta1 stays "
                f"{group['betas'][0]!r}, unlike an AdamW's of its own under that scheduler. "
                f"Pass cycle_momentum=False (and delete the group's 'max_momentum' and "
                f"'base_momentum', which a checkpoint keeps), or step these params by a "
                f"precis.optim.AdamW of their own, with a scheduler of its own", UserWarning)


ADAMW_GROUP_RULE = AdamWGroupRule()


class MuonRule(OneState):
    """torch.optim.Muon's momentum (the C kernel), then Newton-Schulz in torch, then
    the apply (the C kernel's sgd rule with each matrix's adjusted lr): precis.muon."""

    name = "muon"
    flat = False  # three stages per step (muon_step), not one flat op call
    steps_whole_params = True
    group_keys = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps",
                  "ns_steps", "adjust_lr_fn")

    def for_group(self, group):
        algorithm = group.get("algorithm", self.name)
        if algorithm == "adamw":
            return ADAMW_GROUP_RULE
        if algorithm != self.name:
            raise ValueError(f"a param group's algorithm is {algorithm!r}; this optimizer "
                             f"steps {self.name!r} (its default) or 'adamw' groups")
        return self

    # Options torch.optim.Muon lacks, at the value a group saved without them stepped
    # with (torch's: the loader sets them on such a group, optim_checkpoint).
    saved_defaults = {"momentum_form": "ema"}

    def op_args(self, group):
        coefficients = group["ns_coefficients"]  # as tuples: a call's arguments are compared
        iterations = ns_iterations(coefficients)
        if iterations is None:
            coefficients = tuple(map(float, coefficients))
        elif coefficients != "polar_express":
            coefficients = iterations[0]
        return dict(rule="muon", momentum=float(group["momentum"]),
                    nesterov=bool(group["nesterov"]),
                    weight_decay=float(group["weight_decay"]),
                    ns_coefficients=coefficients, ns_steps=group["ns_steps"],
                    ns_eps=float(group["eps"]), adjust_lr_fn=group["adjust_lr_fn"],
                    momentum_form=MOMENTUM_FORMS[group["momentum_form"]])

    def check_stepped(self, p, where):
        if p.is_complex():  # (Muon's go to torch's math, which refuses them in its words)
            raise ValueError(f"{where}: complex parameters are not supported (Newton-Schulz "
                             f"orthogonalizes real matrices)")
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
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not "
                             f"supported ({where}: one of {ADJUST_LR_FNS})")
        if group["momentum_form"] not in MOMENTUM_FORMS:
            raise ValueError(f"{where}: momentum_form must be one of {tuple(MOMENTUM_FORMS)}, "
                             f"got {group['momentum_form']!r}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"{where}: ns_steps must be an int in [0, 100), got {steps!r}")
        coefficients = group["ns_coefficients"]

        def triple(c):
            return isinstance(c, (tuple, list)) and len(c) == 3 and all(
                number(x) is not None and math.isfinite(number(x)) for x in c)
        if coefficients == "polar_express" or (
                isinstance(coefficients, (tuple, list)) and coefficients
                and all(isinstance(c, (tuple, list)) for c in coefficients)):
            iterations = ns_iterations(coefficients)[0]
            if not all(map(triple, iterations)) or len(iterations) != steps:
                raise ValueError(f"{where}: ns_coefficients {coefficients!r} must be 3 finite "
                                 f"numbers, or ns_steps ({steps}) triples of them, one an "
                                 f"iteration (\"polar_express\": 5)")
        elif not triple(coefficients):
            raise ValueError(f"{where}: ns_coefficients must be 3 finite numbers, ns_steps "
                             f"triples of them (one an iteration) or \"polar_express\", got "
                             f"{coefficients!r}")
        if not 0.0 < number(group["eps"], 0.0):
            raise ValueError(f"{where}: eps must be a finite number > 0, got {group['eps']!r}")
        check_common(group, where, ("momentum", "weight_decay", "eps"), ("nesterov",))


RULE = MuonRule()


class Muon(PrecisOptimizer):
    """Muon for 2-D params (torch.optim.Muon's arguments and math: Nesterov momentum,
    Newton-Schulz with torch's coefficients in bf16 through torch's matmuls,
    adjust_lr_fn, decoupled weight decay). The momentum buffer is kept in the policy's
    momentum_dtype (state key 'exp_avg'; torch's 'momentum_buffer' in a state dict
    where torch reads it exactly), the master as the policy keeps it; with the
    fp32 policy on fp32 params it gives torch.optim.Muon's bits. Embeddings, the head
    and 1-D params go to AdamW: a param group {"params": ..., "algorithm": "adamw"} is
    stepped by precis.optim.AdamW's rule (its options torch.optim.AdamW's defaults where
    the group gives none, weight_decay 0.01 too; but lr, the optimizer's: give the group
    its own), or a precis.optim.AdamW of their own beside it (one policy for both): the
    same bits.
    microsoft/dion's conventions, where asked (torch's are the defaults):
    adjust_lr_fn="spectral_norm" (lr * sqrt(rows / columns)), ns_coefficients a triple
    per Newton-Schulz iteration (ns_steps of them; dion's classic five:
    precis.muon.DION_NS_COEFFICIENTS) or "polar_express" (dion's default), and
    momentum_form="sum" (buf = momentum * buf + grad, Nesterov grad + momentum * buf; the
    default "ema" is torch's buf.lerp_(grad, 1 - momentum)).
    policy, seed, offload and offload_fraction are precis.optim.AdamW's; an offloaded
    matrix's momentum and apply run on the CPU, its Newton-Schulz on the param's device.
    DTensor params (FSDP2, HSDP) keep their state sharded; each matrix's bf16 direction
    is all-gathered for Newton-Schulz, which every rank runs on the whole matrix
    (precis.muon_step), so the bits are the same at every world size; so too with
    precis.ddp's ZeRO pieces of matrices (`optim`, `optim_grads`), assembled whole.
    torch.optim.Muon has no capturable (CUDA-graph) step; this one takes capturable=True
    as precis's other optimizers do, untried in a CUDA graph."""

    _rule = RULE

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C), eps=EPS,
                 ns_steps=DEFAULT_NS_STEPS, adjust_lr_fn=None, *, momentum_form="ema",
                 policy=None, seed=0, offload=False, offload_fraction=1.0):
        super().__init__(params, self._options(dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, momentum_form=momentum_form, maximize=False,
            foreach=None, fused=None, differentiable=False, capturable=False, policy=policy,
            seed=seed)),
            offload=offload, offload_fraction=offload_fraction)

    def _options(self, defaults):
        """The param groups' default options (NorMuon adds its own)."""
        return defaults

    def add_param_group(self, param_group):
        adam = isinstance(param_group, dict) and param_group.get("algorithm") == "adamw"
        if adam and param_group.get("decoupled_weight_decay", True) is not True:
            raise ValueError(f"{type(self).__name__}: an 'adamw' param group decouples its "
                             f"weight decay (AdamW's); got decoupled_weight_decay="
                             f"{param_group['decoupled_weight_decay']!r}")
        if isinstance(param_group, dict) and "params" in param_group and \
                not isinstance(param_group["params"], set) and \
                param_group.get("algorithm", self._rule.name) == self._rule.name:
            # checked before anything is registered (release, offload); a set, no params
            # or another algorithm: refused there, in torch's words or by name
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = params  # (as torch's add_param_group: a generator once)
            for p in params:
                p = p[1] if isinstance(p, tuple) else p  # (named params: (name, param))
                if isinstance(p, torch.Tensor) and p.ndim != 2:
                    raise ValueError(f"{type(self).__name__} only supports 2D parameters "
                                     f"whereas we found a parameter with size: {p.size()}")
        # (1-D params, embeddings, the head in an 'adamw' group: AdamW's rule, any shape)
        super().add_param_group({**ADAMW_GROUP, **param_group} if adam else param_group)
