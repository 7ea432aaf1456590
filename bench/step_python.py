"""What an optimizer step costs the host beside its kernels: each row's step over one
param of --numel elements with its update op (and precis's compare pass) made a no-op,
so that only its Python and its other torch ops remain, timed warm (steps back to back)
and cold (64 MiB written before each step, as a step finds the cache after a large
update or a backward). Beside torch's fused step, whose Python is the least a drop-in
step carries: on the CPU this part of a step adds to its kernel's time, in a training
loop on a GPU it is most of the step.

    PYTHONPATH=torch_ext .venv/bin/python bench/step_python.py [--numel 1e6] [--steps 300]
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import machine  # noqa: E402
import precis  # noqa: E402
from precis import step_plan, ops  # noqa: E402

SGD_HP = dict(lr=1e-3, momentum=0.9)
# row -> (param dtype, the optimizer, the torch op its update is)
ROWS = {
    "torch fused SGD, fp32": (torch.float32, lambda p: torch.optim.SGD(p, **SGD_HP, fused=True),
                              "_fused_sgd_"),
    "precis SGD, bf16 default": (torch.bfloat16, lambda p: precis.optim.SGD(p, **SGD_HP), None),
    "torch fused AdamW, fp32": (torch.float32, lambda p: torch.optim.AdamW(p, fused=True),
                                "_fused_adamw_"),
    "precis AdamW, bf16 default": (torch.bfloat16, lambda p: precis.optim.AdamW(p), None),
}


class NoOps:
    """Within it: torch's fused update op `name` (None: precis's flat op, a steady step's
    call of it too, and a Plan's compare, Part.holds, which reads the params) does
    nothing. opt: the optimizer (precis's steady call is made anew within and after)."""

    def __init__(self, name, opt):
        self.name, self.opt = name, opt

    def __enter__(self):
        if self.name is not None:
            self.saved = [(torch, self.name, getattr(torch, self.name))]
            setattr(torch, self.name, lambda *args, **kwargs: None)
        else:
            self.saved = [(ops, "adam_step_flat_", ops.adam_step_flat_),
                          (ops, "flat_call", ops.flat_call),
                          (step_plan.Part, "holds", step_plan.Part.holds)]
            ops.adam_step_flat_ = lambda *args, **kwargs: kwargs.get("found_inf")
            flat_call = ops.flat_call
            ops.flat_call = lambda *args, **kwargs: (lambda *args: None,
                                                     flat_call(*args, **kwargs)[1])
            step_plan.Part.holds = lambda part: True
            self.opt._books.steady = None  # (made anew: its call a no-op)
        return self

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)
        if self.name is None:
            self.opt._books.steady = None


def timed(step, steps, flush):
    """Median us of step over steps, flush() ahead of each (untimed)."""
    times = []
    for _ in range(steps):
        flush()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=float, default=1e6)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = int(args.numel)
    flush_buf = torch.empty(64 << 20, dtype=torch.uint8)
    print(f"{machine.cpu_model()}; torch {torch.__version__}; one param of {numel:,} elements; "
          f"median of {args.steps} steps; 1 thread")
    print("| row | warm us | cold us (64 MiB written before) |")
    print("|---|---|---|")
    for name, (dtype, make, op) in ROWS.items():
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(numel, generator=gen).to(dtype).requires_grad_()
        p.grad = (torch.randn(numel, generator=gen) * 1e-3).to(dtype)
        opt = make([p])
        for _ in range(3):  # (precis: its Plan made, its steady step's path)
            opt.step()
        with NoOps(op, opt):
            warm = timed(opt.step, args.steps, lambda: None)
            cold = timed(opt.step, args.steps, lambda: flush_buf.fill_(1))
        before = p.detach().clone()
        opt.step()  # (the ops put back: a step writes again)
        if torch.equal(before, p.detach()):
            raise SystemExit(f"{name}: a step after the timing wrote nothing")
        print(f"| {name} | {warm:.0f} | {cold:.0f} |")


if __name__ == "__main__":
    main()
