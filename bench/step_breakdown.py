"""Where a precis.optim.AdamW step's time goes with many small tensors, on the CPU:
the whole step() against the op calls inside it (torch.ops.precis.adam_step_ or, once
a group's state is flat, adam_step_flat_: the glue and the kernel), the rest being
Python (the Plan's checks, list building).

Run: PYTHONPATH=torch_ext .venv/bin/python bench/step_breakdown.py
     [--tensors 2000] [--numel 1000] [--threads 1] [--steps 50]
     [--policies "fp32,bf16 default,..."] [--amsgrad]
Prints one row per policy, with the cyclic garbage collections per step (set off by
many temporaries alive at once), and "one-tensor op ms": the op call for the same
elements as one tensor per list, the call a flat layout (one buffer per state kind)
would make, so "op ms" minus it is what the tensors' count costs; and "no-Plan step
ms": the whole step with the group's Plan turned off (each step the full path, a list
per state kind), which is what the Plan's cache saves; asserts nothing. For the kernel's share of the op,
run it under `perf record` and read the pr_adam_chunk_* symbols of libprecis.so.
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))

import precis  # noqa: E402
from precis import adam_plan, ops  # noqa: E402
from machine import cpu_model  # noqa: E402
from policies import POLICIES  # noqa: E402

STEPPED = "fp32,bf16 default,bf16 remainders,bf16 fp8 moments"  # the default --policies


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--policies", default=STEPPED, help="of bench/policies.py, comma-separated")
    ap.add_argument("--amsgrad", action="store_true")
    ap.add_argument("--mixed", action="store_true",
                    help="every other param float32 (a group of two layouts: two op calls)")
    args = ap.parse_args()
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            ap.error(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    torch.set_num_threads(args.threads)
    print(f"{args.tensors} tensors x {args.numel}, {args.threads} thread(s), "
          f"median of {args.steps} steps{', amsgrad' if args.amsgrad else ''}"
          f"{', every other param float32' if args.mixed else ''}; {cpu_model()}, "
          f"cpu_isa {precis.cpu_isa()}")
    print(f"{'policy':<18} {'step ms':>8} {'op ms':>8} {'python ms':>10} {'gc/step':>8} "
          f"{'one-tensor op ms':>17} {'no-Plan step ms':>16}")
    gc.callbacks.append(count_collections)
    for name in names:
        dtype, policy = POLICIES[name]
        step_ms, op_ms, gc_per_step = time_steps(args.tensors, args.numel, dtype, policy,
                                                 args.amsgrad, args.steps, mixed=args.mixed)
        _, one_tensor_op_ms, _ = time_steps(1, args.tensors * args.numel, dtype, policy,
                                            args.amsgrad, args.steps)
        no_plan_ms, _, _ = time_steps(args.tensors, args.numel, dtype, policy, args.amsgrad,
                                      args.steps, planned=False, mixed=args.mixed)
        print(f"{name:<18} {step_ms:8.2f} {op_ms:8.2f} {step_ms - op_ms:10.2f} "
              f"{gc_per_step:8.2f} {one_tensor_op_ms:17.2f} {no_plan_ms:16.2f}")


COLLECTIONS = [0]  # cyclic garbage collections started


def count_collections(phase, info):
    COLLECTIONS[0] += phase == "start"


def time_steps(tensors, numel, dtype, policy, amsgrad, steps, planned=True, mixed=False):
    """Median ms of opt.step() and of the op calls inside it, over `steps` steps of an
    optimizer over `tensors` params of `numel` elements, and the garbage collections
    per step. planned=False: with no Plan (the full path at every step); mixed: every
    other param float32."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(
        torch.float32 if mixed and i % 2 else dtype)) for i in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen).to(p.dtype)
    opt = precis.optim.AdamW(params, lr=1e-3, policy=policy, amsgrad=amsgrad)
    make_plan = adam_plan.make_plan
    if not planned:  # the state stays a tensor per param, stepped by the list op
        adam_plan.make_plan = lambda *args: None
    try:
        return timed_steps(opt, steps)
    finally:
        adam_plan.make_plan = make_plan


def timed_steps(opt, steps):
    for _ in range(3):  # state made, the group's Plan in place
        opt.step()
    real_ops = {name: getattr(ops, name) for name in ("adam_step_", "adam_step_flat_")
                if hasattr(ops, name)}
    in_op = [0.0]

    def timed(real_op):
        def timed_op(*a, **k):
            t0 = time.perf_counter()
            try:
                return real_op(*a, **k)
            finally:
                in_op[0] += time.perf_counter() - t0
        return timed_op

    step_times, op_times = [], []
    COLLECTIONS[0] = 0
    for name, real_op in real_ops.items():
        setattr(ops, name, timed(real_op))
    try:
        for _ in range(steps):
            in_op[0] = 0.0
            t0 = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            op_times.append(in_op[0])
    finally:
        for name, real_op in real_ops.items():
            setattr(ops, name, real_op)
    collections = COLLECTIONS[0] / steps
    step_times.sort()
    op_times.sort()
    return step_times[len(step_times) // 2] * 1e3, op_times[len(op_times) // 2] * 1e3, collections


if __name__ == "__main__":
    main()
