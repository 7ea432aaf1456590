"""precis.optim.Muon: torch.optim.Muon with precision-aware state: its momentum and
master in the policy's dtypes, the elementwise parts in precis's kernels, the
Newton-Schulz orthogonalization in torch's (precis.muon_step)."""

from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

from . import rules
from .optimizer import PrecisOptimizer


class Muon(PrecisOptimizer):
    """Muon for 2-D params (torch.optim.Muon's arguments and math: Nesterov momentum,
    Newton-Schulz with torch's coefficients in bf16 through torch's matmuls,
    adjust_lr_fn, decoupled weight decay). The momentum buffer is kept in the policy's
    momentum_dtype (state key 'exp_avg'; torch's 'momentum_buffer' in a state dict
    where torch reads it exactly), the master as the policy keeps it; with the
    fp32 policy on fp32 params it gives torch.optim.Muon's bits. Pair it with
    precis.optim.AdamW (one policy for both) for embeddings, the head and 1-D params.
    policy, seed, offload and offload_fraction are precis.optim.AdamW's; an offloaded
    matrix's momentum and apply run on the CPU, its Newton-Schulz on the param's device.
    DTensor params (FSDP2, HSDP) keep their state sharded; each matrix's bf16 direction
    is all-gathered for Newton-Schulz, which every rank runs on the whole matrix
    (precis.muon_step), so the bits are the same at every world size; so too with
    precis.ddp's ZeRO pieces of matrices (`optim`, `optim_grads`), assembled whole.
    torch.optim.Muon has no capturable (CUDA-graph) step, nor has this one."""

    _rule = rules.MUON

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C), eps=EPS,
                 ns_steps=DEFAULT_NS_STEPS, adjust_lr_fn=None, *, policy=None, seed=0,
                 offload=False, offload_fraction=1.0):
        super().__init__(params, dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, maximize=False, foreach=None, fused=None,
            differentiable=False, capturable=False, policy=policy, seed=seed),
            offload=offload, offload_fraction=offload_fraction)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.ndim != 2:
                self.param_groups.pop()
                raise ValueError(f"Muon only supports 2D parameters whereas we found a "
                                 f"parameter with size: {p.size()}")
