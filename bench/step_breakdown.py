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
per state kind), which is what the Plan's cache saves; and "checks-only op ms": the
last step's op calls made again with their found_inf flag set, so the op takes its
lists through torch's dispatcher and the glue checks them all but the kernel writes
nothing: what the tensors' count costs in the op; and "grads-read ms": one pass
reading the params' grads (step_plan.grads_of, as the step reads them) right after a
step, the caches as the step finds them; and "lists-only op ms": the last step's flat
op calls made again with a table the op refuses as soon as it has taken its lists, less
the same refusal with empty lists (the error's own cost), so what remains is torch's
conversion of the params and grads lists into stable-ABI handles, the glue's read of
each tensor and the handles' release, the part of "checks-only op ms" that no glue can
save while the lists are lists; and "checks-only cold ms": the checks-only calls each
made right after a pass over as many bytes as the step streams (params, grads, state),
as the op finds the caches in a real step, so its excess over "checks-only op ms" is
what the per-tensor reads cost cold; and "fixed ms": the Python of a step of 2 params
of 10 elements (its step less its op call), what any step costs outside the op.
"grads-read ms" + "lists-only op ms" + "one-tensor op ms" + "fixed ms" is then the
step's floor while params and grads are lists of this many tensors ("floor x": that
floor over "one-tensor op ms"); the floor once the op also takes and checks every
param and grad, as a bad input demands ("checked floor x"), is "grads-read ms" +
"checks-only op ms" + the one-tensor call's kernel (its op less its own checks-only
call, so that one call's dispatch is counted once) + "fixed ms". Asserts nothing.
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))

import precis  # noqa: E402
from precis import step_plan, ops  # noqa: E402
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
          f"{'one-tensor op ms':>17} {'no-Plan step ms':>16} {'checks-only op ms':>18} "
          f"{'grads-read ms':>14} {'lists-only op ms':>17} {'checks-only cold ms':>20} "
          f"{'fixed ms':>9} {'step x':>7} {'floor x':>8} {'checked floor x':>16}")
    gc.callbacks.append(count_collections)
    for name in names:
        dtype, policy = POLICIES[name]
        step_ms, op_ms, gc_per_step, checks_ms, grads_ms, lists_ms, cold_ms = time_steps(
            args.tensors, args.numel, dtype, policy, args.amsgrad, args.steps, mixed=args.mixed)
        one_tensor = time_steps(1, args.tensors * args.numel, dtype, policy,
                                args.amsgrad, args.steps)
        one_tensor_op_ms, one_tensor_kernel_ms = one_tensor[1], one_tensor[1] - one_tensor[3]
        no_plan_ms = time_steps(args.tensors, args.numel, dtype, policy, args.amsgrad,
                                args.steps, planned=False, mixed=args.mixed)[0]
        tiny = time_steps(2, 10, dtype, policy, args.amsgrad, args.steps)
        fixed_ms = tiny[0] - tiny[1]
        floor_ms = grads_ms + lists_ms + one_tensor_op_ms + fixed_ms
        checked_floor_ms = grads_ms + checks_ms + one_tensor_kernel_ms + fixed_ms
        print(f"{name:<18} {step_ms:8.2f} {op_ms:8.2f} {step_ms - op_ms:10.2f} "
              f"{gc_per_step:8.2f} {one_tensor_op_ms:17.2f} {no_plan_ms:16.2f} "
              f"{checks_ms:18.2f} {grads_ms:14.2f} {lists_ms:17.2f} {cold_ms:20.2f} "
              f"{fixed_ms:9.2f} {step_ms / one_tensor_op_ms:6.2f}x "
              f"{floor_ms / one_tensor_op_ms:7.2f}x {checked_floor_ms / one_tensor_op_ms:15.2f}x")


COLLECTIONS = [0]  # cyclic garbage collections started


def count_collections(phase, info):
    COLLECTIONS[0] += phase == "start"


def time_steps(tensors, numel, dtype, policy, amsgrad, steps, planned=True, mixed=False):
    """Median ms of opt.step() and of the op calls inside it, over `steps` steps of an
    optimizer over `tensors` params of `numel` elements, the garbage collections
    per step, the median ms of the last step's op calls made checks-only, of one
    pass reading the grads after a step, of the flat calls' lists taken alone
    (lists_only_ms), and of the checks-only calls after a sweep of the step's bytes.
    planned=False: with no Plan (the full path at every step); mixed: every other
    param float32."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(
        torch.float32 if mixed and i % 2 else dtype)) for i in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen).to(p.dtype)
    opt = precis.optim.AdamW(params, lr=1e-3, policy=policy, amsgrad=amsgrad)
    make_plan = step_plan.make_plan
    if not planned:  # the state stays a tensor per param, stepped by the list op
        step_plan.make_plan = lambda *args: None
    try:
        return timed_steps(opt, steps)
    finally:
        step_plan.make_plan = make_plan


def timed_steps(opt, steps):
    for _ in range(3):  # state made, the group's Plan in place
        opt.step()
    real_ops = {name: getattr(ops, name) for name in ("adam_step_", "adam_step_flat_")
                if hasattr(ops, name)}
    in_op = [0.0]
    last_calls = []  # (op, its keyword arguments) of the step being timed

    def timed(real_op):
        def timed_op(**kwargs):
            flag = kwargs.get("found_inf")
            if not (isinstance(flag, torch.Tensor) and float(flag) != 0.0):
                last_calls.append((real_op, kwargs))  # not functional's own checks-only call
            t0 = time.perf_counter()
            try:
                return real_op(**kwargs)
            finally:
                in_op[0] += time.perf_counter() - t0
        return timed_op

    step_times, op_times = [], []
    COLLECTIONS[0] = 0
    for name, real_op in real_ops.items():
        setattr(ops, name, timed(real_op))
    steady_step = step_plan.steady_step  # (its call is made once: not through ops' wrappers)
    step_plan.steady_step = lambda *args: False
    try:
        for _ in range(steps):
            in_op[0] = 0.0
            last_calls.clear()
            t0 = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            op_times.append(in_op[0])
    finally:
        step_plan.steady_step = steady_step
        for name, real_op in real_ops.items():
            setattr(ops, name, real_op)
    collections = COLLECTIONS[0] / steps
    return median_ms(step_times), median_ms(op_times), collections, \
        checks_only_ms(last_calls, steps), grads_read_ms(opt, steps), \
        lists_only_ms(last_calls, steps), \
        checks_only_ms(last_calls, steps, sweep=torch.empty(step_bytes(opt) // 4))


def grads_read_ms(opt, steps):
    """Median ms of step_plan.grads_of over every param, right after a step."""
    params = [p for group in opt.param_groups for p in group["params"]]
    times = []
    for _ in range(steps):
        opt.step()
        t0 = time.perf_counter()
        step_plan.grads_of(params)
        times.append(time.perf_counter() - t0)
    return median_ms(times)


def checks_only_ms(calls, steps, sweep=None):
    """Median ms of `calls` made again with their found_inf flag set: every argument
    taken and checked, nothing written (the op's contract, which functional's
    check_calls relies on); each time right after a pass over `sweep` (a float32
    tensor) when one is given."""
    flag = torch.ones(1, dtype=torch.float32)
    times = []
    with torch.no_grad():
        for _ in range(steps):
            if sweep is not None:
                sweep.fill_(1.0)
            t0 = time.perf_counter()
            for op, kwargs in calls:
                # (a flag leaves the count to the caller: the table's, not step_counts)
                kept = {k: v for k, v in kwargs.items() if k != "step_counts"}
                op(**{**kept, "check_finite": False, "found_inf": flag})
            times.append(time.perf_counter() - t0)
    return median_ms(times)


def step_bytes(opt):
    """The bytes a step streams: every param, its grad and its state tensors."""
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            total += p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
            total += sum(t.nbytes for t in opt.state.get(p, {}).values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def lists_only_ms(calls, steps):
    """Median ms of `calls`' params and grads lists taken by the flat op and no
    further: each call made again with a one-element float32 table, which the op
    refuses right after taking its arguments, less the same refusal with empty lists.
    NaN when the step made no flat op call (no Plan)."""
    flat = [kwargs for op, kwargs in calls if op is ops.adam_step_flat_]
    if not flat:
        return float("nan")
    bad_table = torch.zeros(1)

    def refused(params, grads, kwargs):
        try:
            ops.adam_step_flat_(**{**kwargs, "params": params, "grads": grads,
                                   "table": bad_table, "check_finite": False})
        except RuntimeError:
            return
        raise AssertionError("adam_step_flat_ took a float32 table")

    times = []
    with torch.no_grad():
        for _ in range(steps):
            t0 = time.perf_counter()
            for kwargs in flat:
                refused(kwargs["params"], kwargs["grads"], kwargs)
            t1 = time.perf_counter()
            for kwargs in flat:
                refused([], [], kwargs)
            times.append(2 * t1 - t0 - time.perf_counter())
    return median_ms(times)


def median_ms(times):
    return sorted(times)[len(times) // 2] * 1e3


if __name__ == "__main__":
    main()
