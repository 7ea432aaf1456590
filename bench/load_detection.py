"""What it costs a precis.optim.AdamW step to see a model-only load by any path: the
optimizer keeps a fingerprint of what its last step left in each param with a copy
(master, remainder, host copy), compares it before the next step (a read of those
params' bytes) and records it after (precis.fingerprints). On the CPU a Plan's op
records it as its kernel writes the params (no read of its own); before that the
record was a second pass over them.

Run: PYTHONPATH=torch_ext .venv/bin/python bench/load_detection.py [--threads 2]
     [--steps 30] [--policies "bf16 default,..."]
Two shapes: many small tensors (2000 x 1000: the Plan's path) and a few large ones
(8 x 4M). Per policy, on the same tensors, steps of these kinds taken in turn: as the
library takes them ("step ms": the compare, the kernel with its records) and with the
record made by a pass after the kernel ("pass-record ms": the Parts without the op's
fingerprints tensor, as before the kernel kept it; params with remainders: their blocks'
record too); "saved" is the second less the first; for params with remainders, the op's
own record of the params but their blocks' by a pass after it ("block-pass ms": as before
the op recorded blocks, issue 79). Then the compare alone ("check ms", one pass, right
after a step, on the same memory), its share of the step ("share"), and one pass against
a plain read of as many bytes (precis.ops.count_nonfinite over one tensor of the watched
params' bytes: a C loop that loads every element once, the same threads: "read ms";
"fp/read" their ratio). Medians of --steps steps of each kind. Asserts nothing.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))

import precis  # noqa: E402
from precis import ops, step_plan  # noqa: E402
from machine import cpu_model  # noqa: E402
from policies import POLICIES  # noqa: E402

DEFAULT = "bf16 default,bf16 remainders,fp8 + 8-bit remainders"
SHAPES = ((2000, 1000), (8, 1 << 22))


RESTAMP = step_plan.Part.restamp


def restamp_by_pass(part):
    """A Part's record made by a pass after its op call, which made none (its
    fingerprints None): the step before the op kept it; its blocks' too (PartBlocks.took
    of no record buffer: their fingerprints now)."""
    if part.stamped and not part.sees:
        part.written[:] = part.written_now()


TOOK = step_plan.PartBlocks.took


def blocks_by_pass(blocks, out, compared=False):
    """The blocks' record of a Part with remainders made by a pass after its op call, as
    before the op made it (the block-pass rows; the CPU's path: nothing compared in the
    op)."""
    TOOK(blocks, None, compared)


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
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--policies", default=DEFAULT, help="of bench/policies.py, comma-separated")
    args = ap.parse_args()
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            ap.error(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), median of {args.steps} steps; {cpu_model()}, "
          f"cpu_isa {precis.cpu_isa()}")
    print(f"{'policy':<24} {'shape':>12} {'step ms':>8} {'pass-record ms':>15} {'saved':>6} "
          f"{'block-pass ms':>14} {'check ms':>9} {'share':>6} {'read ms':>8} {'fp/read':>8}")
    for name in names:
        dtype, policy = POLICIES[name]
        for tensors, numel in SHAPES:
            params, opt = make_opt(tensors, numel, dtype, policy)
            plans = opt._books.plans
            parts = [part for plan in plans.values() for part in plan.parts]
            kernel_record = dict(plans)
            pass_record = {gi: plan._replace(parts=tuple(part._replace(fingerprints=None)
                                                         for part in plan.parts))
                           for gi, plan in plans.items()}
            blocks = any(part.blocks is not None for part in parts)
            steps, passed, block_passed, checks = [], [], [], []
            for _ in range(args.steps):  # each kind in turn, then a compare on that memory
                plans.update(pass_record)
                step_plan.Part.restamp = restamp_by_pass
                passed.append(median_ms(opt.step, 1))
                step_plan.Part.restamp = RESTAMP
                plans.update(kernel_record)
                if blocks:  # the params' record the op's, their blocks' by a pass
                    step_plan.PartBlocks.took = blocks_by_pass
                    block_passed.append(median_ms(opt.step, 1))
                    step_plan.PartBlocks.took = TOOK
                steps.append(median_ms(opt.step, 1))
                checks.append(median_ms(lambda: [part.written_now() for part in parts], 1))
            step_ms, pass_ms = statistics.median(steps), statistics.median(passed)
            check_ms = statistics.median(checks)
            watched = [p for part in parts for p in part.stamped]
            flat = torch.cat([p.detach().reshape(-1) for p in watched])  # the same bytes
            read_ms = median_ms(lambda: ops.count_nonfinite(flat), args.steps)
            block_ms = f"{statistics.median(block_passed):14.2f}" if blocks else f"{'-':>14}"
            print(f"{name:<24} {f'{tensors} x {numel}':>12} {step_ms:8.2f} {pass_ms:15.2f} "
                  f"{pass_ms - step_ms:6.2f} {block_ms} {check_ms:9.2f} "
                  f"{100 * check_ms / step_ms:5.0f}% "
                  f"{read_ms:8.2f} {check_ms / read_ms:7.2f}x", flush=True)
            del params, opt, plans, kernel_record, pass_record, parts


if __name__ == "__main__":
    main()
