"""How faithfully the stored momentum of precis.optim.SGD, Lion and Muon tracks the fp32
momentum of the optimizer it stands in for, over thousands of steps ("shadow
optimizers"; the one-state sibling of bench/moment_fidelity.py, issue #44).

Method. For each rule a reference and one shadow per momentum dtype receive the very
same gradients every step (each its own copy), all with lr = 0 and no weight decay,
so the params never move and only the momentum evolves:
  * SGD (momentum 0.9, dampening 0): reference torch.optim.SGD (foreach=False), its
    'momentum_buffer' (buf = g at step 1, then buf = 0.9 buf + g);
  * Lion (betas (0.9, 0.99)): there is no torch Lion, so the reference is Lion's
    momentum in fp32 torch ops as lion-pytorch first wrote it,
    m.mul_(0.99).add_(g, alpha=1 - 0.99) (m moves by 1% of g - m a step);
    precis's fp32 Lion gives its bits (the fp32 row checks it every checkpoint);
  * Muon (momentum 0.95, Nesterov): reference torch.optim.Muon, its
    'momentum_buffer' (buf.lerp_(g, 1 - 0.95)); Muon takes the 2-D params only
    (the real model's 1-D norm weights are left out of its rows);
  * NorMuon (Muon's, beta2 0.95): reference precis.optim.NorMuon with fp32 state (there
    is no torch NorMuon; its fp32 bits are dion's, tests/py/optimizers/test_normuon.py), its
    momentum (rule "normuon") and its per-row second moment (rule "nmrow": one value a
    row, fed by Newton-Schulz's output of the stored momentum: the figures say how far
    a low-precision momentum moves it).
A shadow is precis.optim.SGD / Lion / Muon on its own fp32 copies of the params with
the policy {"momentum_dtype": X} for X in fp32, bf16, fp16, fp8 (bf16 and fp16 round
to nearest, fp8 is the m8 code rounded stochastically: docs/design.md section 4). Its
momentum is read through the public API: opt.decoded_state(p)["exp_avg"]. The fp32
shadow is the sanity row: its momentum must equal the reference's bit for bit.

Muon's Newton-Schulz runs after the momentum update and feeds only the param update
(here lr 0), so it cannot change the momentum; on a CPU without bf16 matmul
instructions (the 2-core AMD EPYC Zen 3, shared) one 128 x 352 Newton-Schulz call took
0.66 s and a 128 x 128 one 0.29 s: 5 Muon optimizers x the tiny model's 37 matrices x
1,000 steps would take about a day. --ns-steps therefore defaults to 0 (torch's
normalization without iterations) for the reference and the shadows alike; --ns-steps 5
runs torch's default (tests/py/ops/test_moment_drift.py checks that the momentum is the
same bits either way).

Gradient sources (every param of a synthetic source is one matrix of --numel
elements, 128 wide, so that Muon takes it too; the elementwise rules do not care):
  * synthetic: bench/moment_fidelity.py's: a fixed log-normal (sigma 1) scale per
    element, every step g = scale * N(0, 1): zero-mean noise, where the momentum
    stays well below the gradient and each step moves it by many spacings;
  * signal:RHO: a fixed mean per element, +-scale (random sign, the same log-normal
    scales), plus noise: g = scale * (sign + RHO * N(0, 1)). The momentum converges
    to the mean and each step moves it by (1 - beta) (g - m) (Lion 1%, Muon 5%, SGD
    10% of its fixed point's gap): with little noise (RHO small) that falls below half
    a spacing of a store that rounds to nearest and the momentum stalls short of the
    mean (bf16: spacing 0.4-0.8% of the value). RHO = 0 is a constant gradient;
  * real: bench/moment_fidelity.py's: a small Llama-style model (bench/llama.py,
    --size) trained by torch.optim.AdamW (fp32, betas (0.9, 0.95), --lr after a
    warmup of 100 steps, weight decay 0.1 on the matrices, gradient norm clipped to
    1.0) on byte tokens of Python's standard library; the shadows get the clipped
    gradients.

Figures at each checkpoint step (50, 400, 1000, 3000 up to --steps, and --steps), for
every source x rule x momentum dtype, over all elements of the rule's params at once
(quantiles are nearest-rank; "big" elements: those whose |m_ref| is above the 10th
percentile of |m_ref|):
  * |m| ratio: |m_shadow| / |m_ref| over the big elements: median, p10, p90 (below 1:
    shrunk toward zero);
  * rel err: the median of |m_shadow - m_ref| / |m_ref| over the big elements;
  * slope: the least-squares slope sum(m_shadow * m_ref) / sum(m_ref^2) over all
    elements (1 = unbiased, < 1 = shrunk);
  * steady: the share of all elements whose gradient is steady, its noise below a
    fifth of its mean (sd(g) < 0.2 |mean(g)|, both over the last ~100 steps: float64
    EMAs of g and g^2 with Lion's 0.99, bias-corrected), where a momentum stored by
    rounding to nearest may stall (RHO < 0.2 above); steady med: the |m| ratio's
    median over the big elements among them (nan when there are none);
  * target (issue #44): fp32 "exact" when bit-identical to the reference; every other
    dtype "pass" when the |m| ratio's median and the slope are each within 1% of 1,
    otherwise "FAIL".

Example (the default run, 1,000 steps of every source: about 15 minutes on 2 shared
AMD EPYC cores, 10 of them the real source; bench/RESULTS.md records the figures):

    PYTHONPATH=torch_ext .venv/bin/python bench/momentum_fidelity.py \\
        [--steps 1000] [--sources synthetic,signal:0.1,signal:0,real] \\
        [--rules sgd,lion,muon,normuon] [--dtypes fp32,bf16,fp16,fp8] [--numel 65536] \\
        [--size tiny] [--seed 0] [--ns-steps 0] [--threads N] [--device cpu|cuda] \\
        [--json out.json] [--check]

--check makes the exit status 1 when some target fails (0 otherwise, and always 0
without it). The script measures; it asserts nothing else.
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))
sys.path.insert(0, HERE)

import llama  # noqa: E402  (bench/llama.py)
import moment_fidelity as mf  # noqa: E402  (its gradient sources and helpers)
import precis  # noqa: E402

RULES = ("sgd", "lion", "muon", "normuon")
DTYPES = mf.DTYPES  # fp32, bf16, fp16, fp8
CHECKPOINTS = mf.CHECKPOINTS
DEFAULT_SOURCES = "synthetic,signal:0.1,signal:0,real"
WIDTH = 128  # a synthetic param is a (numel / 128) x 128 matrix

SGD_MOMENTUM = 0.9
LION_BETAS = (0.9, 0.99)
MUON_MOMENTUM = 0.95
NORMUON_BETA2 = 0.95

# Targets: the |m| ratio's median and the slope each within TOL of 1 (fp32: exact).
TOL = 0.01
# A steady element: sd(g) below STEADY times |mean(g)| over the last ~1 / (1 - 0.99) steps.
STEADY, STEADY_BETA = 0.2, 0.99


# ---------------------------------------------------------------------------
# Gradient sources: (initial param values, an endless iterator of (gradients,
# loss or None)), as bench/moment_fidelity.py's.
# ---------------------------------------------------------------------------


def as_matrices(source):
    """A synthetic source of moment_fidelity's (one 1-D param) with its param and
    gradients viewed as (numel / WIDTH) x WIDTH matrices."""
    initial, gradients = source

    def matrices():
        for grads, loss in gradients:
            yield [g.view(-1, WIDTH) for g in grads], loss

    return [t.view(-1, WIDTH) for t in initial], matrices()


def synthetic_source(args, device):
    return as_matrices(mf.synthetic_source(args, device))


def signal_source(rho):
    def source(args, device):
        gen = torch.Generator().manual_seed(args.seed)
        scale = torch.exp(torch.randn(args.numel, generator=gen))  # log-normal, sigma 1
        mean = scale * torch.where(torch.rand(args.numel, generator=gen) < 0.5, -1.0, 1.0)

        def gradients():
            while True:
                g = mean + rho * scale * torch.randn(args.numel, generator=gen) if rho else mean
                yield [g.view(-1, WIDTH).to(device)], None

        return [torch.zeros(args.numel, device=device).view(-1, WIDTH)], gradients()

    return source


def source_function(name):
    if name == "synthetic":
        return synthetic_source
    if name == "real":
        return mf.real_source
    return signal_source(signal_rho(name))


def signal_rho(name):
    """RHO of a "signal:RHO" source name (ValueError otherwise)."""
    kind, _, rho = name.partition(":")
    if kind != "signal" or not rho or not float(rho) >= 0:
        raise ValueError(name)
    return float(rho)


# ---------------------------------------------------------------------------
# References and shadows
# ---------------------------------------------------------------------------


class TorchLionMomentum:
    """Lion's momentum in fp32 torch ops (lion-pytorch's first form); lr 0, so the
    params never move and are not touched."""

    def __init__(self, params, betas):
        self.params, self.beta2 = params, betas[1]
        self.state = {p: {} for p in params}

    def step(self):
        for p in self.params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg"].mul_(self.beta2).add_(p.grad, alpha=1 - self.beta2)


def make_reference(rule, params, args):
    """(optimizer, its state key of the momentum)."""
    if rule == "sgd":
        return torch.optim.SGD(params, lr=0.0, momentum=SGD_MOMENTUM, foreach=False), \
            "momentum_buffer"
    if rule == "lion":
        return TorchLionMomentum(params, LION_BETAS), "exp_avg"
    if rule == "normuon":
        return make_shadow(rule, params, "fp32", args), "exp_avg"
    return torch.optim.Muon(params, lr=0.0, weight_decay=0.0, momentum=MUON_MOMENTUM,
                            ns_steps=args.ns_steps), "momentum_buffer"


def make_shadow(rule, params, dtype, args):
    policy = {"momentum_dtype": dtype}
    if rule == "normuon":
        return precis.optim.NorMuon(params, lr=0.0, weight_decay=0.0, momentum=MUON_MOMENTUM,
                                    beta2=NORMUON_BETA2, ns_steps=args.ns_steps, policy=policy)
    if rule == "sgd":
        return precis.optim.SGD(params, lr=0.0, momentum=SGD_MOMENTUM, policy=policy)
    if rule == "lion":
        return precis.optim.Lion(params, lr=0.0, betas=LION_BETAS, policy=policy)
    return precis.optim.Muon(params, lr=0.0, weight_decay=0.0, momentum=MUON_MOMENTUM,
                             ns_steps=args.ns_steps, policy=policy)


class Shadows:
    """For one rule: the fp32 reference and one precis optimizer per momentum dtype,
    each on its own fp32 copies of the rule's params (Muon: the 2-D ones)."""

    def __init__(self, rule, initial, args):
        self.rule = rule
        self.which = [i for i, t in enumerate(initial)
                      if rule not in ("muon", "normuon") or t.ndim == 2]
        mine = [initial[i] for i in self.which]
        self.ref_params = mf.fp32_copies(mine)
        self.ref_opt, self.ref_key = make_reference(rule, self.ref_params, args)
        self.shadows = {}  # momentum dtype -> (params, optimizer)
        for dtype in args.dtypes:
            params = mf.fp32_copies(mine)
            try:
                self.shadows[dtype] = (params, make_shadow(rule, params, dtype, args))
            except Exception as e:
                sys.exit(f"precis refused {rule} with momentum_dtype {dtype}: {e}")

    def numel(self):
        return sum(p.numel() for p in self.ref_params)

    def step(self, grads):
        grads = [grads[i] for i in self.which]
        for params, opt in [(self.ref_params, self.ref_opt)] + list(self.shadows.values()):
            for p, g in zip(params, grads):
                p.grad = g.detach().clone()
            opt.step()

    def reference(self):
        return mf.flat([self.ref_opt.state[p][self.ref_key] for p in self.ref_params])

    def shadow(self, dtype):
        params, opt = self.shadows[dtype]
        return mf.flat([opt.decoded_state(p)["exp_avg"] for p in params])

    def rows_reference(self):
        """NorMuon's row second moments, every matrix's rows in one flat tensor."""
        return mf.flat([self.ref_opt.state[p]["row_exp_avg_sq"] for p in self.ref_params])

    def rows_shadow(self, dtype):
        params, opt = self.shadows[dtype]
        return mf.flat([opt.state[p]["row_exp_avg_sq"] for p in params])


class Steadiness:
    """Per element of every param, float64 EMAs of g and g^2 (beta STEADY_BETA)."""

    def __init__(self, initial):
        self.mean = [torch.zeros(t.shape, dtype=torch.float64) for t in initial]
        self.square = [torch.zeros(t.shape, dtype=torch.float64) for t in initial]
        self.steps = 0

    def update(self, grads):
        self.steps += 1
        for mean, square, g in zip(self.mean, self.square, grads):
            g = g.detach().double().cpu()
            mean.mul_(STEADY_BETA).add_(g, alpha=1 - STEADY_BETA)
            square.mul_(STEADY_BETA).addcmul_(g, g, value=1 - STEADY_BETA)

    def steady(self, which):
        """The flat mask of the steady elements of the params `which`."""
        correction = 1 - STEADY_BETA ** self.steps
        masks = []
        for i in which:
            mean = self.mean[i] / correction
            var = (self.square[i] / correction - mean * mean).clamp(min=0)
            masks.append((var.sqrt() < STEADY * mean.abs()).reshape(-1))
        return torch.cat(masks)


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def compare(m, m_ref, steady):
    """The figures of one stored momentum against the reference (a dict)."""
    size = m_ref.abs()
    big = size > mf.quantiles(size, [0.10])[0]
    ratio = m.abs()[big] / size[big]
    med, p10, p90 = mf.quantiles(ratio, [0.5, 0.1, 0.9])
    return {
        "ratio_median": med, "ratio_p10": p10, "ratio_p90": p90,
        "steady_share": steady.double().mean().item(),
        "steady_median": mf.quantiles(ratio[steady[big]], [0.5])[0],
        "rel_err_median": mf.quantiles((m - m_ref).abs()[big] / size[big], [0.5])[0],
        "slope": ((m * m_ref).sum() / (m_ref * m_ref).sum()).item(),
        "exact": bool(torch.equal(m, m_ref)),
    }


def verdict(dtype, fig):
    if dtype == "fp32":
        return "exact" if fig["exact"] else "FAIL"
    ok = abs(fig["ratio_median"] - 1) <= TOL and abs(fig["slope"] - 1) <= TOL
    return "pass" if ok else "FAIL"


HEADER = (f"{'step':>6} {'rule':>5} {'momentum':>8} | {'|m| ratio: med':>14} {'p10':>7} "
          f"{'p90':>7} | {'rel err':>8} | {'slope':>7} | {'steady':>8} {'med':>7} | target")


def row_line(row):
    return (f"{row['step']:>6} {row['rule']:>5} {row['dtype']:>8} | "
            f"{row['ratio_median']:>14.4f} {row['ratio_p10']:>7.4f} {row['ratio_p90']:>7.4f} | "
            f"{row['rel_err_median']:>8.2e} | {row['slope']:>7.4f} | "
            f"{row['steady_share']:>8.3%} {row['steady_median']:>7.4f} | {row['target']}")


def run_source(name, args, device):
    """Run one source for args.steps steps; print its rows as the checkpoints come."""
    print(f"== source {name}")
    initial, gradients = source_function(name)(args, device)
    families = [Shadows(rule, initial, args) for rule in args.rules]
    steadiness = Steadiness(initial)
    print("elements: " + ", ".join(f"{s.rule} {s.numel():,}" for s in families))
    checkpoints = mf.checkpoint_steps(args.steps)
    print(HEADER)
    rows, losses, start = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        grads, loss = next(gradients)
        losses.append(loss)
        for s in families:
            s.step(grads)
        steadiness.update(grads)
        if step not in checkpoints:
            continue
        recent = losses[-mf.LOSS_WINDOW:]
        note = f"{time.perf_counter() - start:.1f} s so far"
        if recent[0] is not None:
            note += (f"; train loss {sum(recent) / len(recent):.4f} nats/byte, mean of steps "
                     f"{step - len(recent) + 1}-{step}")
        print(f"{'':>6} ({note})")
        for s in families:
            m_ref, steady = s.reference(), steadiness.steady(s.which)
            figures = [(s.rule, s.shadow, m_ref, steady)]
            if s.rule == "normuon":  # its row moment too (no element is "steady" there)
                rows_ref = s.rows_reference()
                figures.append(("nmrow", s.rows_shadow, rows_ref,
                                torch.zeros(rows_ref.numel(), dtype=torch.bool)))
            for rule, shadow, ref, mask in figures:
                for dtype in args.dtypes:
                    row = {"source": name, "step": step, "rule": rule, "dtype": dtype,
                           **compare(shadow(dtype), ref, mask)}
                    row["target"] = verdict(dtype, row)
                    rows.append(row)
                    print(row_line(row), flush=True)
        print()
    seconds = time.perf_counter() - start
    print(f"{name}: {args.steps} steps in {seconds:.1f} s\n")
    return rows, seconds


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="steps per source; the last "
                                                            "checkpoint")
    ap.add_argument("--sources", default=DEFAULT_SOURCES,
                    help="synthetic, signal:RHO (RHO >= 0) and real, comma-separated")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="momentum dtypes of the shadows")
    ap.add_argument("--numel", type=int, default=65536,
                    help=f"synthetic and signal: elements (a multiple of {WIDTH})")
    ap.add_argument("--size", default="tiny", help=f"real: model size ({', '.join(llama.SIZES)})")
    ap.add_argument("--batch", type=int, default=8, help="real: sequences per step")
    ap.add_argument("--seq", type=int, default=0, help="real: bytes per sequence "
                                                      "(0: the size's max_seq)")
    ap.add_argument("--lr", type=float, default=2e-4, help="real: the trainer's lr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ns-steps", type=int, default=0,
                    help="Muon's Newton-Schulz iterations (reference and shadows; the "
                         "momentum does not depend on them)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", metavar="PATH", help="write every figure there")
    ap.add_argument("--check", action="store_true",
                    help="exit status 1 when some target fails")
    args = ap.parse_args()
    args.sources = mf.comma_list(args.sources)
    args.rules = mf.comma_list(args.rules)
    args.dtypes = mf.comma_list(args.dtypes)
    for source in args.sources:
        if source not in ("synthetic", "real"):
            try:
                signal_rho(source)
            except ValueError:
                ap.error(f"unknown source {source!r}; known: synthetic, signal:RHO, real")
    for rule in args.rules:
        if rule not in RULES:
            ap.error(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
    for dtype in args.dtypes:
        if dtype not in DTYPES:
            ap.error(f"unknown momentum dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if args.size not in llama.SIZES:
        ap.error(f"unknown size {args.size!r}; known: {', '.join(llama.SIZES)}")
    if args.numel < WIDTH or args.numel % WIDTH:
        ap.error(f"--numel must be a positive multiple of {WIDTH}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if not 0 <= args.ns_steps < 100:
        ap.error("--ns-steps must be in [0, 100)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device")
    return args


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    header = mf.machine_header(device)
    print(f"shadows: precis.optim.SGD (momentum {SGD_MOMENTUM}), Lion (betas {LION_BETAS}), "
          f"Muon (momentum {MUON_MOMENTUM}, ns_steps {args.ns_steps}), NorMuon (Muon's, beta2 "
          f"{NORMUON_BETA2}) on fp32 params, lr 0, policy {{'momentum_dtype': row's}}; "
          f"references: torch.optim.SGD, Lion's momentum in fp32 torch ops, torch.optim.Muon, "
          f"NorMuon with fp32 state")
    print()

    rows, seconds = [], {}
    for name in args.sources:
        source_rows, seconds[name] = run_source(name, args, device)
        rows += source_rows

    failed = [r for r in rows if r["target"] == "FAIL"]
    print("|m| ratio: |m_shadow| / |m_ref| and rel err: median |m_shadow - m_ref| / |m_ref|, "
          "over elements with |m_ref| above its 10th percentile; slope: "
          "sum(m_shadow m_ref) / sum(m_ref^2) over all; steady: the share of elements with "
          f"sd(g) < {STEADY} |mean(g)| over ~100 steps, med: the |m| ratio's median among "
          "the big ones")
    print(f"targets: fp32 exact (bit-identical momentum); |m| ratio median and slope within "
          f"{TOL:.0%} of 1")
    print(f"targets met: {len(rows) - len(failed)} of {len(rows)}")
    if failed:
        print("failed: " + "; ".join(f"{r['source']} {r['rule']} {r['dtype']} step {r['step']}"
                                     for r in failed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "args": vars(args), "seconds": seconds,
                       "rows": rows}, f, indent=1)
    if args.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
