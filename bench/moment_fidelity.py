"""How faithfully precis's low-precision optimizer moments track fp32 AdamW's over
thousands of steps ("shadow optimizers").

Method. For each beta2 a reference and one shadow per moment dtype receive the
very same gradients every step:
  * the reference is torch.optim.AdamW (fp32 state, for-loop mode) on fp32 copies of
    the params; its exp_avg (m) and exp_avg_sq (v) are the exact fp32 moments;
  * a shadow is precis.optim.AdamW on its own fp32 copies of the params, with the
    policy {"exp_avg_dtype": X, "exp_avg_sq_dtype": X} for X in fp32, bf16, fp16,
    fp8. Its moments are read through the public API only: opt.state[p] holds the
    stored tensors, decoded by precis.checkpoint.moment_values(stored,
    state.get("exp_avg_scale" / "exp_avg_sq_scale"), second_moment).
Every optimizer has lr = 0 and weight_decay = 0, so the params never move and only
the moments evolve (beta1 0.9, eps 1e-8). The fp32 shadow is the sanity row: its
moments must equal the reference's bit for bit.

Gradient sources:
  * synthetic: one param of --numel elements; each element has a fixed scale drawn
    once, log-normal (sigma 1), so a 128-element scale block holds a realistic
    spread; every step g = scale * N(0, 1) from a seeded torch.Generator;
  * real: a small Llama-style model (bench/llama.py, --size) trained by
    torch.optim.AdamW (fp32, betas (0.9, 0.95), --lr after a linear warmup of 100
    steps, then constant; weight decay 0.1 on the matrices; gradient norm clipped to
    1.0) on byte tokens of Python's standard library sources. The gradients each
    step hands the shadows are the clipped ones, what the trainer's optimizer sees.

Figures at each checkpoint step (50, 400, 1000, 3000 up to --steps, and --steps),
for every source x beta2 x moment dtype, over all elements of all params at once
(quantiles are nearest-rank):
  * sqrt(v) ratio: sqrt(v_shadow / v_ref) per element with v_ref > 0: median, p10, p90;
  * m rel err: the median of |m_shadow - m_ref| / |m_ref| over the elements whose
    |m_ref| is above the 10th percentile of |m_ref| ("big m" below);
    m slope: the least-squares slope sum(m_shadow * m_ref) / sum(m_ref^2) over all
    elements (1 = unbiased, < 1 = shrunk toward zero);
  * |u| ratio: the update u = (m / bc1) / (sqrt(v / bc2) + eps), with torch's bias
    corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t applied to both; per element
    |u_shadow| / |u_ref| over the big-m elements: median, p10, p90;
  * target: fp32 "exact" when both moments equal the reference's bit for bit; bf16
    and fp16 "pass" when the sqrt(v) median is within 1% of 1 and p10 and p90 lie in
    [0.95, 1.05]; fp8 the same with [0.90, 1.10]; otherwise "FAIL".

Example (the full run; about ten minutes on 2 cores):

    PYTHONPATH=torch_ext .venv/bin/python bench/moment_fidelity.py --steps 3000 \\
        [--sources synthetic,real] [--beta2 0.95,0.999] [--dtypes fp32,bf16,fp16,fp8] \\
        [--numel 65536] [--size tiny] [--seed 0] [--threads N] [--device cpu|cuda] \\
        [--json out.json] [--check]

--check makes the exit status 1 when some target fails (0 otherwise, and always 0
without it). The script measures; it asserts nothing else.
"""
import argparse
import json
import os
import shlex
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))
sys.path.insert(0, HERE)

import llama  # noqa: E402  (bench/llama.py)
from machine import cpu_model  # noqa: E402
import precis  # noqa: E402
from precis import checkpoint  # noqa: E402

BETA1, EPS = 0.9, 1e-8
CHECKPOINTS = (50, 400, 1000, 3000)
DTYPES = ("fp32", "bf16", "fp16", "fp8")
SOURCES = ("synthetic", "real")

# Targets on the sqrt(v) ratio: median within MEDIAN_TOL of 1, p10 and p90 within
# 1 -+ the band (fp32 must be exact).
MEDIAN_TOL = 0.01
BANDS = {"bf16": 0.05, "fp16": 0.05, "fp8": 0.10}

# The real source's trainer.
TRAIN_BETAS, TRAIN_WEIGHT_DECAY, TRAIN_CLIP, TRAIN_WARMUP = (0.9, 0.95), 0.1, 1.0, 100
LOSS_WINDOW = 50  # the loss printed at a checkpoint: the mean of the last 50 steps


# ---------------------------------------------------------------------------
# Gradient sources: each returns (initial param values, an endless iterator of
# (gradients, loss or None)), the gradients one fp32 tensor per param.
# ---------------------------------------------------------------------------


def synthetic_source(args, device):
    gen = torch.Generator().manual_seed(args.seed)
    scale = torch.exp(torch.randn(args.numel, generator=gen))  # log-normal, sigma 1

    def gradients():
        while True:
            yield [(scale * torch.randn(args.numel, generator=gen)).to(device)], None

    return [torch.zeros(args.numel, device=device)], gradients()


def real_source(args, device):
    cfg = llama.LlamaConfig.named(args.size)
    model = llama.Llama(cfg, seed=args.seed).to(device)
    opt = torch.optim.AdamW(llama.param_groups(model, TRAIN_WEIGHT_DECAY), lr=args.lr,
                            betas=TRAIN_BETAS)
    batches = llama.byte_batches("train", args.batch, args.seq or cfg.max_seq, args.seed)
    print(f"real: Llama {args.size} ({llama.num_params(model):,} params), batch "
          f"{args.batch} x {args.seq or cfg.max_seq} bytes of {llama.stdlib_source()}")
    initial = [p.detach().clone() for p in model.parameters()]

    def gradients():
        step = 0
        while True:
            step += 1
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, step / TRAIN_WARMUP)
            x, y = (t.to(device) for t in next(batches))
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN_CLIP)
            opt.step()  # leaves the (clipped) gradients as they are
            yield [p.grad for p in model.parameters()], loss.item()

    return initial, gradients()


SOURCE_FUNCTIONS = {"synthetic": synthetic_source, "real": real_source}


# ---------------------------------------------------------------------------
# Shadow optimizers
# ---------------------------------------------------------------------------


def fp32_copies(initial):
    return [torch.nn.Parameter(t.detach().clone().float()) for t in initial]


class Shadows:
    """For one beta2: the fp32 torch.optim.AdamW reference and one precis.optim.AdamW
    per moment dtype, each on its own fp32 copies of the params, all with lr = 0 and
    no weight decay."""

    def __init__(self, initial, beta2, dtypes):
        self.beta2 = beta2
        betas = (BETA1, beta2)
        self.ref_params = fp32_copies(initial)
        self.ref_opt = torch.optim.AdamW(self.ref_params, lr=0.0, betas=betas, eps=EPS,
                                         weight_decay=0.0, foreach=False)
        self.shadows = {}  # moment dtype -> (params, optimizer)
        for dtype in dtypes:
            params = fp32_copies(initial)
            policy = {"exp_avg_dtype": dtype, "exp_avg_sq_dtype": dtype}
            try:
                opt = precis.optim.AdamW(params, lr=0.0, betas=betas, eps=EPS,
                                         weight_decay=0.0, policy=policy)
            except Exception as e:
                sys.exit(f"precis refused the policy {policy} for fp32 params: {e}")
            self.shadows[dtype] = (params, opt)

    def step(self, grads):
        """Give every optimizer its own copy of the same gradients and step it."""
        everyone = [(self.ref_params, self.ref_opt)] + list(self.shadows.values())
        for params, opt in everyone:
            for p, g in zip(params, grads):
                p.grad = g.detach().clone()
            opt.step()

    def reference_moments(self):
        """(m, v) of the reference, each flattened over all params, float64."""
        states = [self.ref_opt.state[p] for p in self.ref_params]
        return (flat([s["exp_avg"] for s in states]),
                flat([s["exp_avg_sq"] for s in states]))

    def shadow_moments(self, dtype):
        """(m, v) of one shadow, decoded from their stored form, flattened, float64."""
        params, opt = self.shadows[dtype]
        states = [opt.state[p] for p in params]
        m = [checkpoint.moment_values(s["exp_avg"], s.get("exp_avg_scale"), False)
             for s in states]
        v = [checkpoint.moment_values(s["exp_avg_sq"], s.get("exp_avg_sq_scale"), True)
             for s in states]
        return flat(m), flat(v)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).double()


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def quantiles(x, qs):
    """Nearest-rank quantiles of a 1-D tensor (nan when it is empty)."""
    if x.numel() == 0:
        return [float("nan")] * len(qs)
    s = torch.sort(x).values
    return [s[round(q * (s.numel() - 1))].item() for q in qs]


def update(m, v, step, beta2):
    """Adam's update direction with torch's bias corrections (lr left out)."""
    bc1, bc2 = 1 - BETA1 ** step, 1 - beta2 ** step
    return (m / bc1) / ((v / bc2).sqrt() + EPS)


def compare(m, v, m_ref, v_ref, step, beta2):
    """The figures of one shadow against the reference (a dict of floats)."""
    has_v = v_ref > 0
    sqrt_v_ratio = (v[has_v] / v_ref[has_v]).sqrt()
    big_m = m_ref.abs() > quantiles(m_ref.abs(), [0.10])[0]
    m_err = (m - m_ref)[big_m].abs() / m_ref[big_m].abs()
    u_ratio = (update(m, v, step, beta2).abs() / update(m_ref, v_ref, step, beta2).abs())[big_m]
    sv_med, sv_p10, sv_p90 = quantiles(sqrt_v_ratio, [0.5, 0.1, 0.9])
    u_med, u_p10, u_p90 = quantiles(u_ratio, [0.5, 0.1, 0.9])
    return {
        "sqrt_v_median": sv_med, "sqrt_v_p10": sv_p10, "sqrt_v_p90": sv_p90,
        "m_rel_err_median": quantiles(m_err, [0.5])[0],
        "m_slope": ((m * m_ref).sum() / (m_ref * m_ref).sum()).item(),
        "u_median": u_med, "u_p10": u_p10, "u_p90": u_p90,
        "exact": bool(torch.equal(m, m_ref) and torch.equal(v, v_ref)),
    }


def verdict(dtype, fig):
    """"exact" / "pass" / "FAIL" against the targets (module docstring)."""
    if dtype == "fp32":
        return "exact" if fig["exact"] else "FAIL"
    lo, hi = 1 - BANDS[dtype], 1 + BANDS[dtype]
    ok = (abs(fig["sqrt_v_median"] - 1) <= MEDIAN_TOL
          and lo <= fig["sqrt_v_p10"] and fig["sqrt_v_p90"] <= hi)
    return "pass" if ok else "FAIL"


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------

HEADER = (f"{'step':>6} {'beta2':>6} {'moments':>7} | {'sqrt(v) ratio: med':>18} {'p10':>7} "
          f"{'p90':>7} | {'m rel err':>9} {'m slope':>8} | {'|u| ratio: med':>14} "
          f"{'p10':>7} {'p90':>7} | target")


def row_line(row):
    return (f"{row['step']:>6} {row['beta2']:>6g} {row['dtype']:>7} | "
            f"{row['sqrt_v_median']:>18.4f} {row['sqrt_v_p10']:>7.4f} {row['sqrt_v_p90']:>7.4f} | "
            f"{row['m_rel_err_median']:>9.2e} {row['m_slope']:>8.4f} | "
            f"{row['u_median']:>14.4f} {row['u_p10']:>7.4f} {row['u_p90']:>7.4f} | "
            f"{row['target']}")


def checkpoint_steps(last):
    return sorted({s for s in CHECKPOINTS if s <= last} | {last})


def run_source(name, args, device):
    """Run one gradient source for args.steps steps; print its table as the
    checkpoints come and return its rows."""
    print(f"== source {name}")
    initial, gradients = SOURCE_FUNCTIONS[name](args, device)
    shadows = [Shadows(initial, beta2, args.dtypes) for beta2 in args.beta2]
    checkpoints = checkpoint_steps(args.steps)
    print(HEADER)
    rows, losses, start = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        grads, loss = next(gradients)
        losses.append(loss)
        for s in shadows:
            s.step(grads)
        if step not in checkpoints:
            continue
        recent = losses[-LOSS_WINDOW:]
        note = f"{time.perf_counter() - start:.1f} s so far"
        if recent[0] is not None:
            note += (f"; train loss {sum(recent) / len(recent):.4f} nats/byte, mean of steps "
                     f"{step - len(recent) + 1}-{step}")
        print(f"{'':>6} ({note})")
        for s in shadows:
            m_ref, v_ref = s.reference_moments()
            for dtype in args.dtypes:
                m, v = s.shadow_moments(dtype)
                row = {"source": name, "step": step, "beta2": s.beta2, "dtype": dtype,
                       **compare(m, v, m_ref, v_ref, step, s.beta2)}
                row["target"] = verdict(dtype, row)
                if recent[0] is not None:
                    row["train_loss"] = sum(recent) / len(recent)
                rows.append(row)
                print(row_line(row), flush=True)
        print()
    seconds = time.perf_counter() - start
    print(f"{name}: {args.steps} steps in {seconds:.1f} s\n")
    return rows, seconds


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------




def comma_list(text, convert=str):
    return [convert(x.strip()) for x in text.split(",") if x.strip()]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=CHECKPOINTS[-1],
                    help="steps per source; the last checkpoint")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--beta2", default="0.95,0.999")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="moment dtypes of the shadows")
    ap.add_argument("--numel", type=int, default=65536, help="synthetic: elements")
    ap.add_argument("--size", default="tiny", help=f"real: model size ({', '.join(llama.SIZES)})")
    ap.add_argument("--batch", type=int, default=8, help="real: sequences per step")
    ap.add_argument("--seq", type=int, default=0, help="real: bytes per sequence "
                                                      "(0: the size's max_seq)")
    ap.add_argument("--lr", type=float, default=2e-4, help="real: the trainer's lr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", metavar="PATH", help="write every figure there")
    ap.add_argument("--check", action="store_true",
                    help="exit status 1 when some target fails")
    args = ap.parse_args()
    args.sources = comma_list(args.sources)
    args.beta2 = comma_list(args.beta2, float)
    args.dtypes = comma_list(args.dtypes)
    for source in args.sources:
        if source not in SOURCES:
            ap.error(f"unknown source {source!r}; known: {', '.join(SOURCES)}")
    for dtype in args.dtypes:
        if dtype not in DTYPES:
            ap.error(f"unknown moment dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if args.size not in llama.SIZES:
        ap.error(f"unknown size {args.size!r}; known: {', '.join(llama.SIZES)}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device")
    return args


def machine_header(device):
    """The run's machine and command (the JSON's header), printed as two lines."""
    header = {
        "cpu": cpu_model(), "cpu_isa": precis.cpu_isa(), "torch": torch.__version__,
        "precis": precis.__version__, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    }
    print(f"machine: {header['cpu']}, precis.cpu_isa() {header['cpu_isa']}, torch "
          f"{header['torch']}, precis {header['precis']}, {header['threads']} threads, "
          f"device {header['device']}")
    print(f"command: {header['command']}")
    return header


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    header = machine_header(device)
    print(f"shadows: precis.optim.AdamW on fp32 params, lr 0, betas (0.9, beta2), eps 1e-8, "
          f"exp_avg and exp_avg_sq in the row's dtype; reference: torch.optim.AdamW (fp32)")
    print()

    rows, seconds = [], {}
    for name in args.sources:
        source_rows, seconds[name] = run_source(name, args, device)
        rows += source_rows

    failed = [r for r in rows if r["target"] == "FAIL"]
    print("sqrt(v) ratio: sqrt(v_shadow / v_ref) over elements with v_ref > 0; m rel err: "
          "median |m_s - m_ref| / |m_ref| and |u| ratio: |u_s| / |u_ref|, both over elements "
          "with |m_ref| above its 10th percentile; m slope: sum(m_s m_ref) / sum(m_ref^2)")
    print(f"targets: fp32 exact (bit-identical moments); sqrt(v) median within "
          f"{MEDIAN_TOL:.0%} of 1 and p10, p90 within 1 -+ "
          + ", ".join(f"{b:.2f} ({d})" for d, b in BANDS.items()))
    print(f"targets met: {len(rows) - len(failed)} of {len(rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "args": vars(args), "seconds": seconds,
                       "rows": rows}, f, indent=1)
    if args.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
