"""precis.optim.NorMuon and its rule: Muon's momentum and Newton-Schulz (precis.optim.Muon,
torch.optim.Muon's math), then NorMuon's normalization of each orthogonalized update
(Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491;
as microsoft/dion's NorMuon does it on one device): a second moment of each row's mean
square, the update divided by its root, and rescaled to the Frobenius norm it had."""

import functools

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS
from torch.optim._muon import EPS as EPS_NS

from .group_checks import number
from .muon import Muon, MuonRule

EPS = 1e-8  # the normalization's (dion's): in the root's denominator and the norm's floor


def normalized(update, row_moment, found_inf, beta2):
    """NorMuon's update of one whole matrix from its orthogonalized update, in fp32;
    row_moment (rows, 1), the second moment of each row's mean square, is updated in
    place (left as it was where found_inf is set: a step skipped on the device)."""
    u = update.to(torch.float32)
    norm = u.norm(p=2, dim=(-2, -1), keepdim=True)
    old = row_moment.to(u.device)
    new = torch.lerp(old, (u * u).mean(dim=-1, keepdim=True), 1.0 - beta2)
    u = u / (new.sqrt() + EPS)
    u = u * (norm / u.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=EPS))
    if found_inf is not None:
        new = torch.where(found_inf.to(new.device) != 0, old, new)
    row_moment.copy_(new)
    return u


class NorMuonRule(MuonRule):
    """Muon's three stages (precis.muon_step) with the normalization between
    Newton-Schulz and the apply; its per-row state 'row_exp_avg_sq'."""

    name = "normuon"
    row_state = "row_exp_avg_sq"
    group_keys = MuonRule.group_keys + ("beta2",)

    def op_args(self, group):
        return dict(super().op_args(group),
                    normalize=functools.partial(normalized, beta2=float(group["beta2"])))

    def required(self):  # (a momentum without its rows' moment would resume half)
        return super().required() + (self.row_state,)

    def check_stepped(self, p, where):
        super().check_stepped(p, where)
        if getattr(p, "_precis_whole", None) is not None:
            raise ValueError(f"{where}: NorMuon keeps a second moment of each row of the whole "
                             f"matrix on every rank that steps it, which precis.ddp's ZeRO "
                             f"pieces do not all do; shard with FSDP2 (fully_shard) instead")

    def check(self, group, where):
        super().check(group, where)
        if not 0.0 <= number(group["beta2"], -1.0) < 1.0:
            raise ValueError(f"{where}: beta2 must be a number in [0, 1), got "
                             f"{group['beta2']!r}")


RULE = NorMuonRule()


class NorMuon(Muon):
    """NorMuon for 2-D params: precis.optim.Muon's arguments, math and capabilities
    (policies, FSDP2 with the same bits at every world size, offload, checkpoints,
    gradient release, torch.compile), plus beta2, the decay of each row's second
    moment. dion's NorMuon on its defaults: NorMuon(params, lr=0.01, weight_decay=0.01,
    nesterov=False, eps=1e-8, adjust_lr_fn="spectral_norm",
    ns_coefficients="polar_express", momentum_form="sum") (Muon's options). The state adds 'row_exp_avg_sq', an fp32 tensor of shape (rows, 1) kept
    whole on every rank (a DTensor replicated over an FSDP2 param's mesh: each rank
    runs Newton-Schulz on the whole matrix anyway, so a sharded one would cost a
    gather a step to save 4 bytes a row). The momentum is torch.optim.Muon's
    (buf.lerp_(grad, 1 - momentum)) unless momentum_form="sum" asks for dion's
    (buf = momentum * buf + grad), which is torch's over (1 - momentum). No torch
    optimizer keeps its state: torch.optim.Muon loads its state dict but fails at its
    first step before it writes (the momentum under torch's name is precis's marker);
    precis.checkpoint.to_torch_state_dict refuses its groups (torch.optim.Muon would
    step them as Muon, the row state dropped). "adamw" groups as Muon's."""

    _rule = RULE

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C), eps=EPS_NS,
                 ns_steps=DEFAULT_NS_STEPS, adjust_lr_fn=None, beta2=0.95, *,
                 momentum_form="ema", policy=None, seed=0, offload=False,
                 offload_fraction=1.0):
        self._beta2 = beta2
        super().__init__(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
                         ns_steps, adjust_lr_fn, momentum_form=momentum_form, policy=policy,
                         seed=seed, offload=offload, offload_fraction=offload_fraction)

    def _options(self, defaults):
        return dict(defaults, beta2=self._beta2)
