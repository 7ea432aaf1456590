"""A numpy model of how a moment store's rounding makes v drift, used to choose the
scheme of docs/design.md section 4 before writing kernels (bench/moment_fidelity.py
measures the kernels themselves).

Each element keeps an exact float64 v and a stored one; every step both take
v = beta2 * v + (1 - beta2) * g^2 from the same stationary gradient g = scale * N(0, 1)
(per-element scales log-normal, sigma 1), and the stored one is rounded back into its
format. Formats: bf16 (v itself); block-scaled sqrt(v) (an fp32 scale per block of 128
elements, or 32; the block's amax at the top code) in unsigned 8-bit codes: E4M3, v8
(E3M5, bias 1: precis's), E2M6 and E1M7 (bias 1; a bias only scales a code, which the
block scale undoes; E1M7 is the codes k / 128, k = 0..255: the linear uint8, steps of
amax / 255) and log8 (255 geometric levels from amax / R to amax, and zero); E3M6 and
E3M7 (9 and 10 bits) as references. Minifloats have subnormals (steps of
2^(1 - bias - mantissa bits) below 2^(1 - bias)); no stored code is zero (the least
nonzero one instead). Rounding: to nearest, or stochastic with probabilities linear in
the stored code ("linear") or on the squares ("squares": unbiased in v), with
independent uniform numbers each step or a Weyl sequence per element (phase + step *
golden ratio; the phase has 16 bits, as precis_moment_rand's half of the element's
hash: the kernels' numbers are these). Prints the sqrt(v) ratio to the exact v, median
(p10-p90), at the last step; then, for the block codes at beta2 0.999, its p10-p90 by
the element's place in its block (exact sqrt(v) / the block's largest) beside the
theory's half-width there, and the elements whose code held through the last third of
the steps (beta2 0.999 and 0.95).

Theory. With stochastic rounding a stationary stored v is a random walk: an increment
d = (1 - beta2)(g^2 - v) much smaller than the code's spacing D rounds to a neighbour
with p = |d| / D, a variance p(1 - p) D^2 ~ |d| D, and the EMA keeps ~1 / (2 (1 - beta2))
steps of it, so var(stored v / v) ~ (D / v) E|g^2 / v - 1| / 2, independent of beta2.
For sqrt(v) with relative spacing rho, sigma = sqrt(rho E|g^2 / v - 1| / 4), with
E|Z^2 - 1| = 0.968: the band's half-width goes as sqrt(rho), and a p10-p90 (1.28 sigma)
within +-5% needs rho <= 0.63% (independent numbers; Weyl's narrow the band by ~12%:
~0.8%). 255 steps that fine span a factor 5-8 of sqrt(v), while the p10 element sits 33x
(block 32) to 54x (block 128) below its block's largest. This holds while
(1 - beta2) E|g^2 / v - 1| / 2 << rho (beta2 0.999); at 0.95 a step's variance nears
D^2 / 6, and sigma ~ rho / sqrt(12 (1 - beta2)). Round to nearest stalls once
(1 - beta2)|g^2 - v| < D / 2: the code holds, and the stored v moves only with its
block's scale (the largest element, stored exactly).

A third table does the same for the first moment m = beta1 * m + (1 - beta1) * g
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

BLOCK = 128  # elements per fp32 scale, where a scheme names none
GOLDEN = 0.6180339887498949
E_ABS = 4 * np.exp(-0.5) / np.sqrt(2 * np.pi)  # E|g^2 / v - 1| = E|Z^2 - 1| = 0.968
# unsigned minifloat codes of the scaled sqrt(v): (top value, mantissa bits, bias)
FORMATS = {"e4m3": (448.0, 3, 7), "v8": (126.0, 5, 1), "e2m6": (7.9375, 6, 1),
           "e1m7": (255 / 128, 7, 1), "e3m6": (127.0, 6, 1), "e3m7": (127.5, 7, 1)}
LOG8 = {"log16": 16.0, "log64": 64.0}  # R of log8 codes (top 1)
# (label, format, elements per scale, rounding, random numbers)
SCHEMES = [
    ("bf16, nearest (before)", "bf16", None, "nearest", None),
    ("bf16, stochastic, independent numbers", "bf16", None, "linear", "independent"),
    ("bf16, stochastic, Weyl", "bf16", None, "linear", "weyl"),
    ("fp8 E4M3 (sqrt), nearest (before)", "e4m3", 128, "nearest", None),
    ("fp8 E4M3 (sqrt), stochastic on squares", "e4m3", 128, "squares", "independent"),
    ("v8 (sqrt), stochastic on squares", "v8", 128, "squares", "independent"),
    ("v8 (sqrt), stochastic, linear, Weyl (chosen)", "v8", 128, "linear", "weyl"),
    ("v8, stochastic, independent, block 128", "v8", 128, "linear", "independent"),
    ("v8, stochastic, Weyl, block 32", "v8", 32, "linear", "weyl"),
    ("E2M6, stochastic, Weyl, block 128", "e2m6", 128, "linear", "weyl"),
    ("E2M6, stochastic, Weyl, block 32", "e2m6", 32, "linear", "weyl"),
    ("E2M6, stochastic, independent, block 32", "e2m6", 32, "linear", "independent"),
    ("uint8 = E1M7, nearest, block 128", "e1m7", 128, "nearest", None),
    ("uint8 = E1M7, nearest, block 32", "e1m7", 32, "nearest", None),
    ("uint8 = E1M7, stochastic, Weyl, block 128", "e1m7", 128, "linear", "weyl"),
    ("uint8 = E1M7, stochastic, Weyl, block 32", "e1m7", 32, "linear", "weyl"),
    ("uint8 = E1M7, stochastic, independent, block 32", "e1m7", 32, "linear", "independent"),
    ("log8, R 16, stochastic, Weyl, block 32", "log16", 32, "linear", "weyl"),
    ("log8, R 64, stochastic, Weyl, block 32", "log64", 32, "linear", "weyl"),
    ("E3M6 (9 bits: reference), stochastic, Weyl, block 128", "e3m6", 128, "linear", "weyl"),
    ("E3M7 (10 bits: reference), stochastic, Weyl, block 128", "e3m7", 128, "linear", "weyl"),
]
PLACES = ((1 / 2, 1.0), (1 / 8, 1 / 2), (1 / 32, 1 / 8), (0.0, 1 / 32))


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


def neighbours(q, fmt):
    """The codes lo <= q <= hi of fmt around q in [0, top], and its least nonzero code."""
    if fmt in LOG8:  # 255 levels R^(k / 254 - 1), k = 0..254, and 0
        r = LOG8[fmt]
        k = np.floor(254 * (1 + np.log(np.maximum(q, 1e-300)) / np.log(r)))
        lo = np.where(k >= 0, r ** (k / 254 - 1), 0.0)
        return lo, r ** (np.clip(k + 1, 0, 254) / 254 - 1), 1 / r
    top, mbits, bias = FORMATS[fmt]
    exponent = np.maximum(np.floor(np.log2(np.maximum(q, 1e-300))), 1 - bias)
    step = 2.0 ** (exponent - mbits)
    lo = np.floor(q / step) * step
    return lo, np.minimum(lo + step, top), 2.0 ** (1 - bias - mbits)


def store_scaled_root(v, fmt, rounding, u, block=BLOCK):
    top = FORMATS[fmt][0] if fmt in FORMATS else 1.0
    root = np.sqrt(v).reshape(-1, block)
    scale = root.max(axis=1, keepdims=True) / top
    q = root / np.where(scale > 0, scale, 1.0)
    lo, hi, least = neighbours(q, fmt)
    code = pick(q, lo, hi, rounding, u.reshape(-1, block))
    code = np.where((code == 0) & (q > 0), least, code)  # never zero
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


def run(fmt, block, rounding, numbers, beta2, steps, numel, seed):
    """sqrt(stored v / exact v) at the last step: median, p10, p90; for block codes also
    (p10, p90, the theory's half-width) per PLACES, and the share of elements whose code
    held through the last third of the steps."""
    held = {"step": 0}

    def store(v, u):
        if fmt == "bf16":
            return store_bf16(v, rounding, u)
        out = store_scaled_root(v, fmt, rounding, u, block)
        root = np.sqrt(out).reshape(-1, block)
        code = (root / root.max(axis=1, keepdims=True)).reshape(-1)
        held["step"] += 1
        if held["step"] == steps - steps // 3:
            held["code"], held["same"] = code, np.ones(numel, bool)
        elif "code" in held:
            held["same"] &= np.abs(code - held["code"]) <= 1e-9 * held["code"]
        return out
    exact, stored = simulate(True, store, beta2, steps, numel, seed, numbers or "independent")
    ratio = np.sqrt(stored / exact)
    if fmt == "bf16":
        return np.percentile(ratio, [50, 10, 90]), None, None
    root = np.sqrt(exact).reshape(-1, block)
    place = (root / root.max(axis=1, keepdims=True)).reshape(-1)
    top = FORMATS[fmt][0] if fmt in FORMATS else 1.0
    lo, hi, _ = neighbours(place * top, fmt)
    rho = (hi - lo) / (place * top)  # relative spacing of sqrt(v) at the exact v
    bands = []
    for a, b in PLACES:
        at = (place > a) & (place <= b)
        bands.append((*np.percentile(ratio[at], [10, 90]),
                      1.28 * np.sqrt(E_ABS * rho[at].mean() / 4)) if at.any() else None)
    return np.percentile(ratio, [50, 10, 90]), bands, float(held["same"].mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--numel", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert args.numel % BLOCK == 0, f"--numel must be a multiple of {BLOCK}"
    print(f"sqrt(v) ratio to the exact v after {args.steps} steps, {args.numel} elements, "
          f"seed {args.seed}: median (p10-p90)")
    print("| v stored as | beta2 0.999 | beta2 0.95 |\n|---|---|---|")
    places = []
    for label, fmt, block, rounding, numbers in SCHEMES:
        cells = [run(fmt, block, rounding, numbers, beta2, args.steps, args.numel, args.seed)
                 for beta2 in (0.999, 0.95)]
        print(f"| {label} | " + " | ".join(f"{c[0]:.3f} ({c[1]:.3f}-{c[2]:.3f})"
                                            for c, _, _ in cells) + " |", flush=True)
        if fmt != "bf16":
            places.append((label, cells[0][1], cells[0][2], cells[1][2]))
    print(f"\nbeta2 0.999, by sqrt(v) / its block's largest: p10-p90 (the theory's half-width, "
          f"independent numbers); codes held through the last {args.steps // 3} steps")
    print("| v stored as | above 1/2 | 1/8 to 1/2 | 1/32 to 1/8 | below 1/32 | held, 0.999 | "
          "held, 0.95 |\n|---|---|---|---|---|---|---|")
    for label, bands, held, held_095 in places:
        print(f"| {label} | " + " | ".join("n/a" if b is None else
                                           f"{b[0]:.3f}-{b[1]:.3f} (±{100 * b[2]:.1f}%)"
                                           for b in bands)
              + f" | {100 * held:.1f}% | {100 * held_095:.1f}% |")
    print(f"\nm (beta1 0.9) after {args.steps} steps: median relative error, slope of "
          f"stored on exact")
    print("| m stored as | median rel. error | slope |\n|---|---|---|")
    for label, code, block, rounding in M_SCHEMES:
        error, slope = run_m(code, block, rounding, args.steps, args.numel, args.seed)
        print(f"| {label} | {100 * error:.2f}% | {slope:.4f} |", flush=True)


if __name__ == "__main__":
    main()
