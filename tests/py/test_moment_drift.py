"""Low-precision moments must track AdamW's over thousands of steps (no drift).

The CI-sized version of bench/moment_fidelity.py's stationary case: 4096
elements (32 scale blocks, per-element gradient scales spread log-normally so a
block holds a realistic range), 2,000 steps of stationary Gaussian gradients.
A precis.optim.AdamW with lr = 0 on an fp32 param stores its moments in the
dtype under test; the same gradients drive a float64 reference of m and v. At
the end the element-wise ratio sqrt(v_stored / v_ref) must have its median
within 1% of 1 and its 10th-90th percentiles within 0.95-1.05 (0.90-1.10 for
fp8, whose neighbouring v codes are up to 3% apart), at beta2 = 0.999 (where
rounding to nearest stalls v: bf16 v drifted to a median of 1.065 by step 1,000)
and 0.95. The first moment must stay unbiased: the least-squares slope of the
stored m against the reference within 1% of 1.

Everything is seeded, so each assertion has one outcome; the bounds are the
issue's targets, with the margins the bench records (docs/design.md section 4).
"""
import pytest
import torch

import precis
from precis import checkpoint

N = 4096
STEPS = 2000
BAND = {"bf16": 0.05, "fp16": 0.05, "fp8": 0.10}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _decoded(state, key):
    second = key == "exp_avg_sq"
    return checkpoint.moment_values(state[key], state.get(key + "_scale"), second).double()


def _run(dtype, beta2, device):
    gen = torch.Generator().manual_seed(20)
    scale = torch.exp(torch.randn(N, generator=gen, dtype=torch.float64))
    p = torch.nn.Parameter(torch.zeros(N, device=device))
    opt = precis.optim.AdamW([p], lr=0.0, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0,
                             policy={"exp_avg_dtype": dtype, "exp_avg_sq_dtype": dtype})
    m = torch.zeros(N, dtype=torch.float64)
    v = torch.zeros(N, dtype=torch.float64)
    for _ in range(STEPS):
        g = (scale * torch.randn(N, generator=gen, dtype=torch.float64)).float()
        p.grad = g.to(device)
        opt.step()
        g64 = g.double()
        m.mul_(0.9).add_(g64, alpha=0.1)
        v.mul_(beta2).addcmul_(g64, g64, value=1 - beta2)
    state = opt.state[p]
    return _decoded(state, "exp_avg").cpu(), _decoded(state, "exp_avg_sq").cpu(), m, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta2", [0.999, 0.95])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8"])
def test_second_moment_tracks_adamw(dtype, beta2, device):
    m_s, v_s, m_ref, v_ref = _run(dtype, beta2, device)
    ratio = (v_s / v_ref).sqrt()
    median = ratio.median().item()
    p10, p90 = torch.quantile(ratio, torch.tensor([0.1, 0.9], dtype=torch.float64)).tolist()
    band = BAND[dtype]
    where = f"{dtype} v, beta2 {beta2}, {device}: sqrt(v) ratio median {median:.4f}, " \
            f"p10 {p10:.4f}, p90 {p90:.4f} after {STEPS} steps"
    assert abs(median - 1) <= 0.01, where
    assert 1 - band <= p10 and p90 <= 1 + band, where
    slope = ((m_s * m_ref).sum() / (m_ref * m_ref).sum()).item()
    assert abs(slope - 1) <= 0.01, f"{dtype} m, beta2 {beta2}, {device}: slope {slope:.4f}"
