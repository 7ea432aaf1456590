"""The layout of a param's state: which moments it keeps, in which dtypes, and how
its master is kept (a separate copy, remainders, or none), from its precision policy,
and its 'step' (torch's form of a step count, step_tensor). The step, the state
modules and the checkpoint conversions all read it from here."""

from typing import NamedTuple, Optional

import torch

from . import torch_math
from .dtensor import blocks_per_row, is_dtensor, row_cutting_placement
from .op_constants import REMAINDER_DTYPES, SCALED_MOMENT_DTYPES
from .policy import check_option, policy_for

# Moment keys and whether each is a second moment (stored like exp_avg_sq);
# max_exp_avg_sq is amsgrad's running max of exp_avg_sq.
MOMENT_KEYS = {"exp_avg": False, "exp_avg_sq": True, "max_exp_avg_sq": True}
COMPLEX_DTYPES = (torch.complex64,)  # a complex64 param is a pair of fp32 values
# State not shaped like the param: one fp32 value a row (index of dim 0) of a matrix,
# shape (rows, 1) of the whole matrix, kept whole on every rank (dtensor.replicated_like):
# a rule that keeps one names it (Rule.row_state). NorMuon's second moment of each row.
# fp32 whatever the policy: rows * 4 bytes is 4 / columns bytes a param (0.005 at 768).
ROW_STATE_KEYS = ("row_exp_avg_sq",)


def step_tensor(n, device=None):
    """torch's form of a step count: a float32 0-dim tensor."""
    return torch.tensor(float(n), dtype=torch.float32, device=device)


class Layout(NamedTuple):
    """What the optimizer keeps for a param, from its policy."""
    master: Optional[str]  # None (param is its own master), "master" or "remainder"
    master_dtype: Optional[torch.dtype]
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype

    def moment_dtype(self, key):
        return self.exp_avg_sq_dtype if MOMENT_KEYS[key] else self.exp_avg_dtype


# The fp32 policy's layout: fp32 moments, the param its own master.
FP32_LAYOUT = Layout(None, None, torch.float32, torch.float32)

# Stored with stochastic rounding (docs/design.md section 4): v in these dtypes, m in fp8.
SR_SECOND_MOMENT_DTYPES = (torch.bfloat16, torch.float16, torch.uint8)


def rounds_stochastically(layout, param_dtype):
    """Whether a step of a param of this layout rounds anything stochastically (a bf16
    param that is its own master, v below fp32, fp8 m): its state then has a 'stream',
    the param's id in the random numbers, kept in checkpoints so that a resumed run
    draws the numbers it would have drawn."""
    return (layout.master is None and param_dtype == torch.bfloat16) or \
        layout.exp_avg_sq_dtype in SR_SECOND_MOMENT_DTYPES or layout.exp_avg_dtype == torch.uint8


def layout_of(policy, stored_dtype=None):
    """stored_dtype: the dtype the param is kept in, when precis.fsdp keeps a sharded
    param in its policy's master dtype: the param is then its own master."""
    if policy.store_param_remainders:  # int16, or uint8: an 8-bit correction
        master, master_dtype = "remainder", REMAINDER_DTYPES[policy.param_remainder_bits]
    elif policy.main_params_dtype not in (policy.param_dtype, stored_dtype):
        master, master_dtype = "master", policy.main_params_dtype
    else:
        master, master_dtype = None, None
    return Layout(master, master_dtype, policy.exp_avg_dtype, policy.exp_avg_sq_dtype)


def torch_layout(p):
    """Whether p's state is torch's, moments in p's dtype: params torch's math steps
    (precis.torch_math) and complex64 ones (pairs of fp32 for the kernel)."""
    return p.is_complex() or p.dtype in torch_math.DTYPES


def param_layout(policy_option, param, who):
    """The Layout of a plain param. A param of torch_layout keeps torch's moments in its
    own dtype; complex64 only under the fp32 policy (fp32 moments, no master)."""
    if param.dtype in torch_math.DTYPES:
        check_option(policy_option, who)
        return Layout(None, None, param.dtype, param.dtype)
    if param.is_complex():
        layout = layout_of(policy_for(policy_option, torch.float32, who))
        if layout != FP32_LAYOUT:
            raise ValueError(f"{who}: a complex64 param (shape {tuple(param.shape)}) is stepped "
                             f"as pairs of fp32 values and takes fp32 moments and no separate "
                             f"master; its policy gives {layout}")
        return Layout(None, None, param.dtype, param.dtype)
    return layout_of(policy_for(policy_option, param.dtype, who))


def one_state_layout(layout, policy):
    """The layout of a rule with one state, its momentum ('exp_avg' in the policy's
    momentum_dtype; exp_avg_dtype where the policy predates it), no exp_avg_sq."""
    momentum = getattr(policy, "momentum_dtype", policy.exp_avg_dtype)
    return layout._replace(exp_avg_dtype=momentum, exp_avg_sq_dtype=torch.float32)


def unscaled_layout(layout, p, who):
    """layout for DTensor param p: bf16 in place of fp16 / fp8 moments when p's rows
    are not whole scale blocks; ValueError when p's placement cuts its rows."""
    scaled = [d in SCALED_MOMENT_DTYPES for d in (layout.exp_avg_dtype, layout.exp_avg_sq_dtype)]
    if not is_dtensor(p) or not any(scaled):
        return layout
    cut = row_cutting_placement(p)
    if cut is not None:
        raise ValueError(f"{who}: a DTensor param of shape {tuple(p.shape)} placed "
                         f"{tuple(p.placements)} cannot have fp16 or fp8 moments: their "
                         f"128-element blocks lie along rows (dim 0's indices), which {cut} "
                         f"cuts, so a block's scale would follow the mesh; shard dim 0 only "
                         f"(fully_shard's default) or use fp32 or bf16 moments")
    if blocks_per_row(p) is not None:
        return layout
    return layout._replace(
        exp_avg_dtype=torch.bfloat16 if scaled[0] else layout.exp_avg_dtype,
        exp_avg_sq_dtype=torch.bfloat16 if scaled[1] else layout.exp_avg_sq_dtype)
