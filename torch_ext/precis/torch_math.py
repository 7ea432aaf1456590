"""The params precis steps with torch's own Adam: float64 and complex128 params, every
param of a differentiable=True group, fp32 params with fp32 state in a group whose
betas are tensors (torch then computes with tensor betas, which rounds differently),
and complex64 params under Adam's L2 weight decay.

precis's kernels are fp32 arithmetic over fp32/fp16/bf16 params, and autograd cannot
see into them. For these params torch.optim.Adam's code runs instead (its
`_init_group` makes the state, its functional `adam` does the step, with the group's
foreach / fused / capturable / differentiable flags), so they get torch's values,
torch's state (moments in the param's dtype) and, with differentiable=True, a step
autograd can differentiate through.
"""

import torch
from torch.optim.adam import Adam, adam

# Params torch's math steps whatever the group (precis's kernels have no fp64 path).
DTYPES = (torch.float64, torch.complex128)


def uses_torch_math(group, p, fp32_state):
    """fp32_state: p is kept with fp32 moments and no master (the fp32 policy)."""
    if group["differentiable"] or p.dtype in DTYPES:
        return True
    # torch adds Adam's L2 decay to a complex grad in complex arithmetic, which rounds
    # otherwise than the kernel's fp32 pairs now and then (1 ulp)
    if p.is_complex() and group["weight_decay"] != 0 and not group["decoupled_weight_decay"]:
        return True
    tensor_betas = any(isinstance(b, torch.Tensor) for b in group["betas"])
    return tensor_betas and fp32_state and p.dtype == torch.float32


class Prepared:
    """One group's params for torch's math, their state made (torch.optim.Adam's
    `_init_group`: the lists of its functional `adam`)."""

    def __init__(self, state, group, params):
        self.group = group
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = [], [], [], []
        self.max_exp_avg_sqs, self.steps = [], []
        self.state = state  # what torch's _init_group reads of its optimizer
        self.has_complex = Adam._init_group(
            self, dict(group, params=params), self.params, self.grads, self.exp_avgs,
            self.exp_avg_sqs, self.max_exp_avg_sqs, self.steps)

    def step(self):
        group = self.group
        beta1, beta2 = group["betas"]
        with torch.set_grad_enabled(group["differentiable"]):
            adam(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs,
                 self.max_exp_avg_sqs, self.steps, foreach=group["foreach"],
                 capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], has_complex=self.has_complex,
                 decoupled_weight_decay=group["decoupled_weight_decay"],
                 amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"])
