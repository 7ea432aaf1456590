"""What it costs a precis.optim.AdamW step to see a model-only load by any path: the
optimizer keeps a fingerprint of what its last step left in each param with a copy
(master, remainder, host copy), compares it before the next step and records it
after (precis.fingerprints), i.e. two reads of those params' bytes per step.

Run: PYTHONPATH=torch_ext .venv/bin/python bench/load_detection.py [--threads 2]
     [--steps 20] [--policies "bf16 default,..."]
Two shapes: many small tensors (2000 x 1000: the Plan's path) and a few large ones
(8 x 4M). Per policy: the step with detection ("step ms"), the same step with the
comparison and the record turned off in this process ("off ms"), what detection
adds ("+%"), one fingerprint pass over the watched params ("fp pass ms") and a
plain read of the same bytes (precis.ops.count_nonfinite over each param: a C loop
that loads every element once and adds a compare, the same threads: "read ms"), the
floor of a pass; "fp/read" is their ratio. Medians of --steps steps, the on and off
steps of a row taken one right after the other. Asserts nothing.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))

import precis  # noqa: E402
from precis import adam_plan, fingerprints, ops, optim_state  # noqa: E402
from machine import cpu_model  # noqa: E402
from policies import POLICIES  # noqa: E402

DEFAULT = "bf16 default,bf16 remainders,fp8 + 8-bit remainders"
SHAPES = ((2000, 1000), (8, 1 << 22))


@contextlib.contextmanager
def detection_off():
    """The comparison and the record turned off in this process (the 'off' column)."""
    saved = optim_state.written_behind, optim_state.record_written, adam_plan.Part.written_now
    optim_state.written_behind = lambda books, params: []
    optim_state.record_written = lambda books, params: None
    adam_plan.Part.written_now = lambda self: self.written
    try:
        yield
    finally:
        optim_state.written_behind, optim_state.record_written, \
            adam_plan.Part.written_now = saved


def median_ms(fn, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_opt(tensors, numel, dtype, policy):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(dtype))
              for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen).to(dtype)
    opt = precis.optim.AdamW(params, lr=1e-3, policy=policy)
    for _ in range(3):  # state made, the Plan in place
        opt.step()
    return params, opt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--policies", default=DEFAULT, help="of bench/policies.py, comma-separated")
    args = ap.parse_args()
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            ap.error(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), median of {args.steps} steps; {cpu_model()}, "
          f"cpu_isa {precis.cpu_isa()}")
    print(f"{'policy':<24} {'shape':>12} {'step ms':>8} {'off ms':>8} {'+%':>6} "
          f"{'fp pass ms':>11} {'read ms':>8} {'fp/read':>8}")
    for name in names:
        dtype, policy = POLICIES[name]
        for tensors, numel in SHAPES:
            params, opt = make_opt(tensors, numel, dtype, policy)
            watched = [p for p in params if optim_state.watched(opt._books, p, opt.state[p])]
            step_ms = median_ms(opt.step, args.steps)
            fp_ms = median_ms(lambda: fingerprints.of(watched), args.steps)
            read_ms = median_ms(lambda: [ops.count_nonfinite(p.detach()) for p in watched],
                                args.steps)
            del params, opt
            with detection_off():  # the same step again, right after: paired
                params, opt = make_opt(tensors, numel, dtype, policy)
                off_ms = median_ms(opt.step, args.steps)
                del params, opt
            print(f"{name:<24} {f'{tensors} x {numel}':>12} {step_ms:8.2f} {off_ms:8.2f} "
                  f"{100 * (step_ms / off_ms - 1):5.0f}% {fp_ms:11.2f} {read_ms:8.2f} "
                  f"{fp_ms / read_ms:7.2f}x", flush=True)

if __name__ == "__main__":
    main()
