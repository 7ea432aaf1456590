"""The precis demo: a small GPT-style character model trained on CPU.

The same seed, data and model are trained with torch.optim.AdamW on an fp32
model (the baseline) and with precis.optim.AdamW on a bf16 model under several
precision policies. At the end it prints a table (final losses, their gap to the
baseline, optimizer + gradient bytes per parameter measured from the tensors
actually allocated, step time) and writes a PNG: each policy's loss difference to
the baseline over the steps against the baseline's own noise, beside its bytes per param.

Without --steps the run fits a time budget (--budget, 4 minutes for all the trainings
together): it first times a few steps of the fp32 and the bf16 model on this CPU, then
runs 300 steps, or fewer where 300 would not fit, and says what it chose and why.
Every precis run trains a bf16 model, whose forward and backward torch runs about 20x
slower than fp32's on CPUs without bf16 instructions (AVX2): there the budget cuts the run.

    tools/demo.sh                      # the README's first command
    tools/demo.sh --steps 300          # the long run, whatever it takes
    tools/demo.sh --steps 100 --policies baseline,fp8
    tools/demo.sh --release            # precis steps each param inside backward

With --release every precis optimizer steps each param inside backward, as soon as its
gradient is final, and frees it (precis.optim.release_gradients): the bytes column then
counts the gradients alive at the peak of backward, and the step's time is all in
"step ms" (the optimizer's part runs inside backward).
"""
import argparse
import importlib.util
import math
import os
import pathlib
import sys
import textwrap
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# precis as installed (pip); from a clone without it, the checkout's package, whose
# loader finds the libraries in bazel-bin/.
if importlib.util.find_spec("precis") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))
import precis  # noqa: E402

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # shipped by Debian's base-files
FULL_STEPS = 300  # the default run's length where the budget allows it
MIN_STEPS = 20  # below this the losses say little: the run overruns its budget instead
PROBE_STEPS = 3  # timed steps per model dtype, after one untimed (first-call costs)

# name -> (model dtype, policy overrides or None for torch.optim.AdamW)
POLICIES = {
    "baseline": (torch.float32, None),
    "bf16": (torch.bfloat16, {}),
    "remainders": (torch.bfloat16, {"store_param_remainders": True}),
    "fp8": (torch.bfloat16, {"store_param_remainders": True,
                             "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}),
    "fp8-r8": (torch.bfloat16, {"store_param_remainders": True, "param_remainder_bits": 8,
                                "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}),
}
LABELS = {
    "baseline": "fp32 model, torch.optim.AdamW",
    "bf16": "bf16 model, precis default policy",
    "remainders": "bf16 model, precis + int16 remainders",
    "fp8": "bf16 model, precis fp8 moments + int16 remainders",
    "fp8-r8": "bf16 model, precis fp8 moments + 8-bit remainders",
}
COLORS = {"baseline": "black", "bf16": "tab:blue", "remainders": "tab:orange",
          "fp8": "tab:green", "fp8-r8": "tab:red"}


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.n_heads, c // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, context, d_model, n_layers, n_heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer(
            "mask", torch.ones(context, context, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x)).float()  # the loss is always taken in fp32


def load_text(path):
    text = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return data[:split], data[split:], len(chars)


def batches(data, steps, batch, context, seed):
    """The same batches for every run: drawn once from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - context - 1, (steps, batch), generator=g)
    offsets = torch.arange(context + 1)
    return data[starts[..., None] + offsets]  # steps x batch x (context + 1)


def bytes_per_param(model, optimizer, release=None):
    """Optimizer state + gradient bytes per parameter, from the real tensors (with a
    release: the gradients it held at once, its peak_grad_bytes)."""
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    total = 0 if release is None else release.peak_grad_bytes
    for p in params:
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        if grad is not None:
            total += grad.numel() * grad.element_size()
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total / n


@torch.no_grad()
def eval_loss(model, data, context, seed):
    xy = batches(data, 4, 32, context, seed + 1)
    losses = [F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()) for b in xy]
    return float(torch.stack(losses).mean())


def build(name, args, vocab):
    """The seeded model in the policy's dtype and its optimizer."""
    model_dtype, overrides = POLICIES[name]
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab, args.context, args.d_model, args.layers, args.heads)
    model = model.to(model_dtype)
    if overrides is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        optimizer = precis.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                       policy=overrides)
        if args.release:
            return model, optimizer, precis.optim.release_gradients(optimizer)
    return model, optimizer, None


def train_step(model, optimizer, release, xy):
    """One step; returns (loss, optimizer seconds, bytes per param)."""
    logits = model(xy[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), xy[:, 1:].flatten())
    loss.backward()
    opt_start = time.perf_counter()
    optimizer.step()
    opt_time = time.perf_counter() - opt_start
    measured = bytes_per_param(model, optimizer, release)  # before grads are freed
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), opt_time, measured


def probe(name, args, train_data, vocab):
    """Seconds a training step of this policy takes here: the median of a few steps
    after an untimed one (which pays the process's first-call costs)."""
    model, optimizer, release = build(name, args, vocab)
    data = batches(train_data, PROBE_STEPS + 1, args.batch, args.context, args.seed)
    times = []
    for xy in data:
        start = time.perf_counter()
        train_step(model, optimizer, release, xy)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[PROBE_STEPS // 2]


def choose_steps(seconds_per_step, budget):
    """The default run's length: FULL_STEPS if all the trainings fit the budget (seconds)
    at seconds_per_step (of all of them together), else as many as fit, at least MIN_STEPS."""
    return max(MIN_STEPS, min(FULL_STEPS, int(budget / seconds_per_step)))


def clock(seconds):
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def train(name, args, train_data, val_data, vocab, later_seconds=0.0):
    """One training; later_seconds: the estimated time of the trainings after it, for the
    progress lines' time left."""
    model, optimizer, release = build(name, args, vocab)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    data = batches(train_data, args.steps, args.batch, args.context, args.seed)
    losses, step_times = [], []
    began = time.perf_counter()
    for step in range(args.steps):
        start = time.perf_counter()
        loss, opt_time, measured = train_step(model, optimizer, release, data[step])
        schedule.step()
        step_times.append((time.perf_counter() - start, opt_time))
        losses.append(loss)
        if step % args.log_every == 0 or step == args.steps - 1:
            spent = time.perf_counter() - began
            left = spent / (step + 1) * (args.steps - step - 1)
            print(f"  [{name:>10}] step {step + 1:4d}/{args.steps}  loss {loss:.4f}  "
                  f"{clock(spent)} spent, {clock(left)} left, "
                  f"{clock(left + later_seconds)} until the last training ends", flush=True)
    params = sum(p.numel() for p in model.parameters())
    timed = step_times[len(step_times) // 5:] or step_times  # skip warm-up steps
    return {
        "name": name,
        "losses": losses,
        "final": sum(losses[-args.average:]) / len(losses[-args.average:]),
        "val": eval_loss(model, val_data, args.context, args.seed),
        "bytes": measured,
        "step_ms": 1e3 * sum(t for t, _ in timed) / len(timed),
        "opt_ms": 1e3 * sum(t for _, t in timed) / len(timed),
        "params": params,
    }


def print_table(results):
    base = next((r for r in results if r["name"] == "baseline"), None)
    print()
    print(f"{'run':<50} {'train loss':>10} {'vs base':>8} {'val loss':>9} {'vs base':>8} "
          f"{'opt+grad B/param':>17} {'step ms':>8} {'opt ms':>7}")
    for r in results:
        d_train = f"{r['final'] - base['final']:+.4f}" if base else "-"
        d_val = f"{r['val'] - base['val']:+.4f}" if base else "-"
        print(f"{LABELS[r['name']]:<50} {r['final']:>10.4f} {d_train:>8} {r['val']:>9.4f} "
              f"{d_val:>8} {r['bytes']:>17.2f} {r['step_ms']:>8.1f} {r['opt_ms']:>7.2f}")
    print(f"\n{results[0]['params']:,} parameters; train loss = mean of the last steps; "
          "bytes measured from the gradient and optimizer-state tensors after a step.")


def smooth(values, window):
    """Centered moving average (shorter windows at the ends)."""
    half = window // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def plot(results, path):
    """Left: each policy's training loss minus the baseline's, smoothed, against the
    baseline's own step-to-step noise; right: the bytes per parameter each one costs."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    base = next((r for r in results if r["name"] == "baseline"), None)
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12.5, 5), width_ratios=[2.2, 1],
                                   layout="constrained")  # room for the bars' labels
    if base is not None:
        steps = len(base["losses"])
        window = max(3, steps // 15)
        base_smooth = smooth(base["losses"], window)
        warm = steps // 5  # the noise after the steep first steps
        residual = [a - b for a, b in zip(base["losses"][warm:], base_smooth[warm:])]
        noise = (sum(x * x for x in residual) / max(1, len(residual))) ** 0.5
        ax.axhspan(-noise, noise, color="0.85",
                   label=f"baseline's step-to-step noise (\u00b11 sd = {noise:.3f})")
        ax.axhline(0.0, color=COLORS["baseline"], linewidth=1,
                   label=f"{LABELS['baseline']} (final {base['final']:.3f})")
        for r in results:
            if r is base:
                continue
            diff = [a - b for a, b in zip(r["losses"], base["losses"])]
            ax.plot(smooth(diff, window), color=COLORS[r["name"]], linewidth=1.5,
                    label=f"{LABELS[r['name']]} ({r['final'] - base['final']:+.4f} at the end)")
        # symlog: differences far below the noise stay visible beside its band.
        linear = 10 ** math.floor(math.log10(noise / 30))
        ax.set_yscale("symlog", linthresh=linear, linscale=2)
        ax.set_ylabel(f"training loss \u2212 baseline's\n(moving average of {window} steps; "
                      f"linear scale within \u00b1{linear:g})")
        ax.legend(fontsize=8, loc="upper right")
    else:  # no baseline to compare with: the curves themselves
        for r in results:
            ax.plot(r["losses"], color=COLORS[r["name"]], label=LABELS[r["name"]], linewidth=1)
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)  # whole steps on short runs
    ax.set_title("Loss against fp32 AdamW (same seed and data)")
    ax.grid(alpha=0.3)
    names = [textwrap.fill(LABELS[r["name"]], 24) for r in results]
    values = [r["bytes"] for r in results]
    bars.barh(names, values, color=[COLORS[r["name"]] for r in results])
    for y, v in enumerate(values):
        bars.text(v, y, f" {v:.2f}", va="center", fontsize=9)
    bars.invert_yaxis()
    bars.set_xlim(0, max(values) * 1.25)
    bars.set_xlabel("optimizer state + gradient bytes per parameter (measured)")
    bars.set_title("Memory")
    bars.tick_params(axis="y", labelsize=8)
    fig.suptitle(f"TinyGPT on characters, {results[0]['params']:,} parameters, "
                 f"{len(results[0]['losses'])} steps", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"loss differences and bytes per parameter written to {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int,
                    help=f"steps of each training (default: {FULL_STEPS}, or fewer to fit "
                         "--budget)")
    ap.add_argument("--budget", type=float, default=240.0,
                    help="seconds for all the trainings together when --steps is not given")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, help="warm-up steps (default: a tenth of the steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--average", type=int,
                    help="steps averaged for the final loss (default: a fifteenth of the steps)")
    ap.add_argument("--log-every", type=int,
                    help="steps between progress lines (default: a tenth of the steps)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, from {', '.join(POLICIES)}")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="training text (UTF-8)")
    ap.add_argument("--out", default="examples/out/loss_curves.png")
    ap.add_argument("--release", action="store_true",
                    help="precis steps each param inside backward and frees its gradient")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        ap.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if not os.path.exists(args.text):
        ap.error(f"--text {args.text} does not exist")

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    train_data, val_data, vocab = load_text(args.text)
    print(f"precis {precis.__version__}: {len(train_data):,} training characters "
          f"from {args.text}, vocabulary {vocab}; precis.cpu_isa() {precis.cpu_isa()}, "
          f"{torch.get_num_threads()} threads")
    for name in names:
        model_dtype, overrides = POLICIES[name]
        if overrides is not None:
            policy = precis.resolve_policy(model_dtype, overrides)
            print(f"{name}: {policy.to_dict()}")

    # A step's time depends on the model's dtype: the forward and backward dominate it
    # (a precis step of these 0.4M params takes 1-2 ms), so one policy per dtype is timed.
    probed = {}
    for name in names:
        model_dtype = POLICIES[name][0]
        if model_dtype not in probed:
            probed[model_dtype] = probe(name, args, train_data, vocab)
    per_step = {name: probed[POLICIES[name][0]] for name in names}
    all_steps = sum(per_step.values())  # seconds of one step of every training
    print("a training step here (median of a few, forward + backward + optimizer): "
          + ", ".join(f"{str(d).replace('torch.', '')} model {1e3 * t:.0f} ms"
                      for d, t in probed.items()))
    if args.steps is None:
        args.steps = choose_steps(all_steps, args.budget)
        trainings = f"{len(names)} training" + "s" * (len(names) > 1)
        why = f"{FULL_STEPS} steps of {trainings} take about {clock(FULL_STEPS * all_steps)} here"
        if len(probed) == 2:
            ratio = probed[torch.bfloat16] / probed[torch.float32]
            why += f" (the bf16 model's step is {ratio:.1f}x the fp32 model's)"
        if args.steps == FULL_STEPS:
            print(f"{args.steps} steps: {why}, within the budget of {clock(args.budget)} "
                  "(--budget)")
        else:
            print(f"{args.steps} steps, not {FULL_STEPS}: {why}, over the budget of "
                  f"{clock(args.budget)} (--budget); --steps {FULL_STEPS} asks for the long run")
    for flag, default in (("warmup", args.steps // 10), ("average", args.steps // 15),
                          ("log_every", args.steps // 10)):
        if getattr(args, flag) is None:
            setattr(args, flag, max(1, default))
    print(f"{args.steps} steps ({args.warmup} of lr warm-up, the final loss averaged over the "
          f"last {args.average}): the trainings should take about {clock(args.steps * all_steps)}")

    results = []
    for i, name in enumerate(names):
        print(f"training {LABELS[name]} ...", flush=True)
        later = args.steps * sum(per_step[n] for n in names[i + 1:])
        results.append(train(name, args, train_data, val_data, vocab, later))
    print_table(results)
    plot(results, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
