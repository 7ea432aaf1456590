"""A numpy model of how a moment store's rounding makes v drift, used to choose the
scheme of docs/design.md section 4 before writing kernels (bench/moment_fidelity.py
measures the kernels themselves).

Each element keeps an exact float64 v and a stored one; every step both take
v = beta2 * v + (1 - beta2) * g^2 from the same stationary gradient g = scale * N(0, 1)
(per-element scales log-normal, sigma 1), and the stored one is rounded back into its
format. Formats: bf16 (v itself); block-scaled sqrt(v) (128 elements per fp32 scale,
amax at the top code) in E4M3 or v8 (unsigned E3M5, bias 1). Rounding: to nearest,
or stochastic with probabilities linear in the stored code ("linear") or on the
squares ("squares": unbiased in v), with independent uniform numbers each step or a
Weyl sequence per element (phase + step * golden ratio; the phase has 16 bits, as
precis_moment_rand's half of the element's hash). Prints the sqrt(v) ratio
to the exact v, median (p10-p90), at the last step.

A second table does the same for the first moment m = beta1 * m + (1 - beta1) * g
(beta1 0.9) in 8-bit codes that m could take (issue #34): signed, block-scaled by the
block's largest |m|; E4M3 (what precis stores), E3M4 (one mantissa bit more, a
narrower range), int8 steps (absmax / 127), int8 through a softsign compander
(z = 2y / (1 + |y|) of y = m / absmax, as FlashOptim keeps m; our guess of its
curve), E2M5, in blocks of 128 or 32. It prints the median relative error |stored - exact| / |exact| and the slope of
stored on exact (1: unbiased), at the last step. The gradients are stationary
Gaussians, not bench/moment_fidelity.py's real ones: the codes' order, not their
figures, carries over.

    .venv/bin/python bench/moment_store_model.py [--steps 3000] [--numel 8192] [--seed 0]
"""
import argparse

import numpy as np

BLOCK = 128
GOLDEN = 0.6180339887498949
# unsigned minifloat formats of the scaled sqrt(v): (top value, mantissa bits, bias)
FORMATS = {"e4m3": (448.0, 3, 7), "v8": (126.0, 5, 1)}
# (label, format, rounding, random numbers)
SCHEMES = [
    ("bf16, nearest (before)", "bf16", "nearest", None),
    ("bf16, stochastic, independent numbers", "bf16", "linear", "independent"),
    ("bf16, stochastic, Weyl", "bf16", "linear", "weyl"),
    ("fp8 E4M3 (sqrt), nearest (before)", "e4m3", "nearest", None),
    ("fp8 E4M3 (sqrt), stochastic on squares", "e4m3", "squares", "independent"),
    ("v8 (sqrt), stochastic on squares", "v8", "squares", "independent"),
    ("v8 (sqrt), stochastic, linear, Weyl (chosen)", "v8", "linear", "weyl"),
]


def pick(x, lo, hi, rounding, u):
    """lo or hi for each x in [lo, hi]."""
    if rounding == "nearest":
        return np.where(x - lo < hi - x, lo, hi)
    if rounding == "squares":
        p = (x * x - lo * lo) / np.maximum(hi * hi - lo * lo, 1e-300)
    else:
        p = (x - lo) / np.maximum(hi - lo, 1e-300)
    return np.where(u < p, hi, lo)


def store_bf16(v, rounding, u):
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    lo = ((bits >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = (((bits >> 16) + 1) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return pick(v, lo, hi, rounding, u)


def store_scaled_root(v, fmt, rounding, u):
    top, mbits, bias = FORMATS[fmt]
    root = np.sqrt(v).reshape(-1, BLOCK)
    scale = root.max(axis=1, keepdims=True) / top
    q = root / np.where(scale > 0, scale, 1.0)
    exponent = np.maximum(np.floor(np.log2(np.maximum(q, 1e-300))), 1 - bias)
    step = 2.0 ** (exponent - mbits)
    lo = np.floor(q / step) * step
    hi = np.minimum(lo + step, top)
    code = pick(q, lo, hi, rounding, u.reshape(-1, BLOCK))
    code = np.where((code == 0) & (q > 0), 2.0 ** (1 - bias - mbits), code)  # never zero
    return ((code * scale) ** 2).reshape(-1)


# m codes: (label, magnitude code, block, rounding). Magnitude codes: a FORMATS-like
# minifloat (top, mantissa bits, bias), "int8" (steps of absmax / 127) or "softsign"
# (int8 steps of z = 2y / (1 + |y|), y = |m| / absmax).
M_FORMATS = {"e4m3": (448.0, 3, 7), "e3m4": (31.0, 4, 3), "e2m5": (7.875, 5, 1)}
M_SCHEMES = [
    ("E4M3, stochastic, block 128 (before)", "e4m3", 128, "linear"),
    ("E4M3, stochastic, block 32", "e4m3", 32, "linear"),
    ("E3M4, stochastic, block 128", "e3m4", 128, "linear"),
    ("E3M4, stochastic, block 32", "e3m4", 32, "linear"),
    ("E2M5, stochastic, block 32", "e2m5", 32, "linear"),
    ("int8 steps, stochastic, block 128", "int8", 128, "linear"),
    ("int8 steps, stochastic, block 32", "int8", 32, "linear"),
    ("int8 softsign, stochastic, block 128", "softsign", 128, "linear"),
    ("int8 softsign, nearest, block 32", "softsign", 32, "nearest"),
    ("int8 softsign, stochastic, block 32", "softsign", 32, "linear"),
]


def store_signed(m, code, block, rounding, u):
    """m rounded into a signed 8-bit code of its block's absmax (a sign and 7 bits)."""
    mag = np.abs(m).reshape(-1, block)
    amax = mag.max(axis=1, keepdims=True)
    u = u.reshape(-1, block)
    if code in M_FORMATS:
        top, mbits, bias = M_FORMATS[code]
        scale = amax / top
        q = mag / np.where(scale > 0, scale, 1.0)
        exponent = np.maximum(np.floor(np.log2(np.maximum(q, 1e-300))), 1 - bias)
        step = 2.0 ** (exponent - mbits)
        lo = np.floor(q / step) * step
        out = pick(q, lo, np.minimum(lo + step, top), rounding, u) * scale
    else:
        y = mag / np.where(amax > 0, amax, 1.0)
        z = 2 * y / (1 + y) if code == "softsign" else y  # both in [0, 1]
        lo = np.floor(z * 127) / 127
        hi = np.minimum(lo + 1 / 127, 1.0)
        if code == "softsign":  # round in y, so stochastic rounding is unbiased in m
            lo, hi = lo / (2 - lo), hi / (2 - hi)  # z = 2y / (1 + y) <=> y = z / (2 - z)
        out = pick(y, lo, hi, rounding, u) * amax
    return (np.sign(m).reshape(-1, block) * out).reshape(-1)


def simulate(square, store, beta, steps, numel, seed, numbers="weyl"):
    """(exact, stored) moments after `steps` steps of moment = beta * moment +
    (1 - beta) * x, x the gradient g (or g^2 with square), the stored moment rounded
    by store(value, u) each step with uniform numbers u ("independent" or "weyl")."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.0, numel))
    phase = np.floor(rng.random(numel) * 65536) / 65536  # 16 bits, as precis_moment_rand
    exact = np.zeros(numel)
    stored = np.zeros(numel)
    for t in range(1, steps + 1):
        x = scale * rng.standard_normal(numel)
        x = x * x if square else x
        exact = beta * exact + (1 - beta) * x
        value = beta * stored + (1 - beta) * x
        u = rng.random(numel) if numbers == "independent" else (phase + t * GOLDEN) % 1.0
        stored = store(value, u)
    return exact, stored


def run_m(code, block, rounding, steps, numel, seed, beta1=0.9):
    """(median relative error, slope of stored on exact) of m at the last step."""
    exact, stored = simulate(False, lambda m, u: store_signed(m, code, block, rounding, u),
                             beta1, steps, numel, seed)
    error = np.abs(stored - exact) / np.maximum(np.abs(exact), 1e-300)
    return float(np.median(error)), float(np.dot(stored, exact) / np.dot(exact, exact))


def run(fmt, rounding, numbers, beta2, steps, numel, seed):
    """sqrt(stored v / exact v): median, p10, p90 at the last step."""
    def store(v, u):
        return store_bf16(v, rounding, u) if fmt == "bf16" else \
            store_scaled_root(v, fmt, rounding, u)
    exact, stored = simulate(True, store, beta2, steps, numel, seed, numbers or "independent")
    return np.percentile(np.sqrt(stored / exact), [50, 10, 90])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--numel", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert args.numel % BLOCK == 0, "--numel must be a multiple of 128"
    print(f"sqrt(v) ratio to the exact v after {args.steps} steps, {args.numel} elements, "
          f"seed {args.seed}: median (p10-p90)")
    print("| v stored as | beta2 0.999 | beta2 0.95 |\n|---|---|---|")
    for label, fmt, rounding, numbers in SCHEMES:
        cells = [run(fmt, rounding, numbers, beta2, args.steps, args.numel, args.seed)
                 for beta2 in (0.999, 0.95)]
        print(f"| {label} | " + " | ".join(f"{c[0]:.3f} ({c[1]:.3f}-{c[2]:.3f})"
                                            for c in cells) + " |", flush=True)
    print(f"\nm (beta1 0.9) after {args.steps} steps: median relative error, slope of "
          f"stored on exact")
    print("| m stored as | median rel. error | slope |\n|---|---|---|")
    for label, code, block, rounding in M_SCHEMES:
        error, slope = run_m(code, block, rounding, args.steps, args.numel, args.seed)
        print(f"| {label} | {100 * error:.2f}% | {slope:.4f} |", flush=True)


if __name__ == "__main__":
    main()
