"""Eager and torch.compile'd optimizer steps, precis against torch.optim.AdamW.

    PYTHONPATH=torch_ext .venv/bin/python bench/compiled_step.py [--steps 60] [--threads 1]

An MLP's params (3 layers 1024 wide by default: 3.1M params in 6 tensors by
default), with fixed gradients; each row times opt.step() alone (median of the steps
after the first 10), eager and under torch.compile(opt.step) in the default mode,
and counts the graphs dynamo compiled and its graph breaks. Ratios are against
torch's fastest mode on this machine (the fastest torch row, eager or compiled).
"""

import argparse
import time

import torch
from torch._dynamo.utils import counters

import precis
from machine import cpu_model
from policies import POLICIES


def mlp(width, depth, dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    model = torch.nn.Sequential(*layers).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


WARMUP = 10  # steps left out of the median: the compiled rows compile in them

ROWS = {  # name -> (model dtype, optimizer factory)
    "torch AdamW (foreach)": (torch.float32, lambda ps: torch.optim.AdamW(ps, foreach=True)),
    "torch AdamW (fused)": (torch.float32, lambda ps: torch.optim.AdamW(ps, fused=True)),
    "precis fp32": (torch.float32, lambda ps: precis.optim.AdamW(ps)),
    "precis bf16 default": (torch.bfloat16, lambda ps: precis.optim.AdamW(ps)),
    "precis bf16 fp8 moments + remainders": (torch.bfloat16, lambda ps: precis.optim.AdamW(
        ps, policy=POLICIES["fp8 + remainders"][1])),
}


def time_row(dtype, make, compiled, args):
    torch._dynamo.reset()
    counters.clear()
    model = mlp(args.width, args.depth, dtype)
    opt = make(list(model.parameters()))
    step = torch.compile(opt.step) if compiled else opt.step
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    after_warmup = sorted(times[WARMUP:])
    graphs = counters["stats"]["unique_graphs"] if compiled else 0
    breaks = sum(counters["graph_break"].values()) if compiled else 0
    return after_warmup[len(after_warmup) // 2] * 1e3, graphs, breaks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    torch.set_num_threads(args.threads)
    numel = sum(p.numel() for p in mlp(args.width, args.depth, torch.float32).parameters())
    print(f"# {cpu_model()}, torch {torch.__version__}, "
          f"precis cpu_isa={precis.cpu_isa()}, {args.threads} thread(s), {numel:,} params, "
          f"{args.steps} steps")
    results = {(name, compiled): time_row(dtype, make, compiled, args)
               for name, (dtype, make) in ROWS.items() for compiled in (False, True)}
    fastest = min(ms for (name, _), (ms, _, _) in results.items() if name.startswith("torch"))
    print("| row | mode | ms/step | vs torch's fastest | graphs | graph breaks |")
    print("|---|---|---|---|---|---|")
    for (name, compiled), (ms, graphs, breaks) in results.items():
        mode = "compiled" if compiled else "eager"
        shown = (str(graphs), str(breaks)) if compiled else ("-", "-")
        print(f"| {name} | {mode} | {ms:.3f} | {fastest / ms:.2f}x | {shown[0]} | {shown[1]} |")


if __name__ == "__main__":
    main()
