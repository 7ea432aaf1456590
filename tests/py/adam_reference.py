"""Adam / AdamW in float64 and the per-element tolerances a precis step must meet
against it; shared by test_optim_reference.py (CPU) and test_cuda_adam.py (CUDA).
test_optim_reference.py's docstring derives the tolerances."""
import math

import torch

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8

# Per stored format: (u, a): relative step and absolute floor (block-scaled formats).
UNIT = {F32: (1e-6, 0.0), BF16: (2.0 ** -8, 0.0), F16: (2.0 ** -11, 2.0 ** -24),
        FP8: (2.0 ** -6, 2.0 ** -6 / 7.875)}  # fp8 m: m8 (signed E2M5, max 7.875)
# fp8: m rounds stochastically (a whole m8 step: 3.1%), and sqrt(v) below 1/126 of
# its block's max falls in v8's subnormal steps (2^-5 of amax / 126): ~25% at 1/1000,
# which these log-normal gradients reach in their first steps (0.2 before v8: E4M3
# spans 15 binades, v8 7; docs/design.md section 4). 0.8: the worst seen is 0.625, on
# test_amsgrad's 4097 elements (gradients shrinking 100x a step) in 8 of 32 optimizer
# seeds (/ 0.53 in the others), with the random numbers keyed by stream and index.
# 4.0 since m8 (issue #34 item 1): m below 1/7.875 of its block's largest falls in
# subnormal steps of amax / 252, which a tiny m rounds up to stochastically (unbiased)
# while its sqrt(v) may sit near v8's floor of amax / 4032: one element's update can
# then be off by several lr; the worst seen is 3.07, on test_big_tensor's 1,000,003.
# 6.0 since test_cuda_adam's big tensor (bf16 remainders, fp8 m and v; the same bits
# on the CPU): one element 14.7 lr off after 3 steps, 4.9 lr a step.
UPDATE_ERR = {F32: 1e-5, BF16: 0.012, F16: 0.0015, FP8: 6.0}
# remainders8: a 24-bit master (15 stored mantissa bits) rounded to nearest each step
MASTER_ULP = {"own32": 2.0 ** -23, "fp32": 2.0 ** -23, "remainders": 2.0 ** -23,
              "remainders8": 2.0 ** -16, "fp16": 2.0 ** -11, "own16": 2.0 ** -11,
              "sr": 2.0 ** -7}


def reference(p0, grads, lr, betas, eps, weight_decay, adamw=True, maximize=False,
              amsgrad=False):
    """Adam / AdamW in float64 from zero moments, as torch.optim defines them. Returns
    the final param, m, v and the per-element maxima of |m| and v over all steps
    (the latter is amsgrad's max_exp_avg_sq, whose square root is then the
    denominator's)."""
    beta1, beta2 = betas
    p = p0.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    m_max = torch.zeros_like(p)
    v_max = torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.double()
        if maximize:
            g = -g
        if adamw:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_max = torch.maximum(m_max, m.abs())
        v_max = torch.maximum(v_max, v)
        denom = (v_max if amsgrad else v).sqrt() / math.sqrt(1 - beta2 ** t) + eps
        p = p - lr / (1 - beta1 ** t) * m / denom
    return p, m, v, m_max, v_max


def make_grads(n, steps, dtype, gen):
    """Random gradients with a wide spread of magnitudes (log-normal), as real ones."""
    return [(torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))).to(dtype)
            for _ in range(steps)]


# Stores rounded stochastically (csrc/stores.h, precis_moment_store_sr: every
# low-precision v, fp8 m) land on either neighbour: a whole step. fp8 m is stored in
# the m8 code, fp8 v in v8 (both 5 mantissa bits, subnormal step 2^-5 of amax / 7.875
# and amax / 126).
SR_UNIT = {BF16: (2.0 ** -7, 0.0), F16: (2.0 ** -10, 2.0 ** -24),
           FP8: (2.0 ** -5, 2.0 ** -5 / 7.875)}
V8_UNIT = (2.0 ** -5, 2.0 ** -5 / 126)


def moment_tol(dtype, x_max, k, second):
    """K quantisations of the largest value the element held (v of fp16/fp8 is
    stored in the square-root domain)."""
    if second and dtype == FP8:
        u, a = V8_UNIT
    elif second or dtype == FP8:
        u, a = SR_UNIT.get(dtype, UNIT[dtype])
    else:
        u, a = UNIT[dtype]
    if second and dtype in (F16, FP8):
        u, a = 2 * u + u * u, 3 * a
    return k * (u * x_max + a * float(x_max.max())) + 1e-30


def master_tol(param_dtype, master, m_dtype, v_dtype, p0, ref_p, k, lr):
    """Update error plus one rounding of the master per step, at the largest
    magnitude the element can have had on the way."""
    key = {("own", F32): "own32", ("own", F16): "own16"}.get((master, param_dtype), master)
    update = k * lr * max(UPDATE_ERR[m_dtype], UPDATE_ERR[v_dtype])
    p_max = torch.maximum(p0.double().abs(), ref_p.abs()) + k * lr
    return update + k * MASTER_ULP[key] * p_max + 1e-7
