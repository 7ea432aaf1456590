"""What a steady step's host part costs, measured on the CPU: a precis AdamW step over
--params params made tiny (--numel elements each, so that a step's time is its host
part: its Python, its op call's dispatch, checks and argument table), on a GPU's path
(PRECIS_DEVICE_PATH_ON_CPU=1: the compare in the op, nothing read back), two param
groups (decayed and not, as bench/train_llm.py makes them), beside one
torch._foreach_add_(params, grads) over the same tensors and torch's fused AdamW step (fp32
copies), in the same run. Rows in turns, --repeat rounds after 2, each row's median of
--steps calls a round, then the median of the rounds (us). "steady path off" is the same
optimizer's step taken down the full path at every step (Plan calls made anew: the step
before step_plan.Steady); "its op call alone" replays the steady step's one
adam_step_flat_ call (its record buffers' turns kept), no step Python around it, and
"checks only" that call with its found_inf flag set: the op's host part alone. The fp8
m, v + 8-bit remainders rows: its steady step (the op compares the params' blocks with
their record itself: fingerprints [out, records, kept]), its op call alone, and the
same step with the policy given as a dict rather than a precis.Policy.

    PYTHONPATH=torch_ext .venv/bin/python bench/steady_step.py [--params 129] [--numel 8]
        [--steps 300] [--repeat 7]
"""
import argparse
import os
import statistics
import sys
import time

import torch

os.environ["PRECIS_DEVICE_PATH_ON_CPU"] = "1"  # (read at every step)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import machine  # noqa: E402
import precis  # noqa: E402
from precis import ops, step_plan  # noqa: E402
from precis.step_plan import planned_calls  # noqa: E402

FP8_REM8 = dict(store_param_remainders=True, param_remainder_bits=8, exp_avg_dtype="fp8",
                exp_avg_sq_dtype="fp8")


def model(count, numel, dtype):
    """count params of numel elements (every other one a (2, numel / 2) matrix) with
    gradients, in two groups: the matrices decayed, the rest not."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn((2, numel // 2) if i % 2 == 0 else (numel,),
                                             generator=gen).to(dtype)) for i in range(count)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(dtype)
    return params, [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def full_path_step(opt):
    """opt.step() taken down the full path (no steady step)."""
    def step():
        real = step_plan.steady_step
        step_plan.steady_step = lambda *args: False
        try:
            opt.step()
        finally:
            step_plan.steady_step = real
    return step


def op_alone(opt):
    """The steady step's op call, replayed (its turn's call, then the Part's restamp)."""
    for _ in range(4):  # (each turn's call made; the first steady step's reads the first record)
        opt.step()
    steady = opt._books.steady
    part = steady.part
    params = steady.lists[0] + steady.lists[1] if len(steady.lists) > 1 else steady.lists[0]
    grads = step_plan.grads_of(params)  # (a kept call holds none after its step)

    def call():
        op, args, _ = steady.calls[id(part.out()), id(part.written[0]) if part.compared
                                   else None]
        args[ops.FLAT_GRADS] = grads
        op(*args)
        args[ops.FLAT_GRADS] = []
        part.restamp()
    return call


def checks_only(opt):
    """The steady step's op call made with its found_inf flag set (the .rule overload, the
    table's step column; no compare, whose resync writes whatever the flag holds): the op
    takes and checks every argument and launches nothing, its host part alone."""
    for _ in range(3):
        opt.step()
    steady = opt._books.steady
    calls = planned_calls(opt._books, opt.state, opt.param_groups, 0)
    kwargs = {k: v for k, v in calls[0].args.items() if k != "resync"}
    flag = torch.ones(1)
    op, args = ops.flat_call(**kwargs, found_inf=flag)
    params = steady.lists[0] + steady.lists[1] if len(steady.lists) > 1 else steady.lists[0]

    def call():
        args[ops.FLAT_GRADS] = step_plan.grads_of(params)
        op(*args)
    return call


def timed(fn, steps):
    """Median us of fn over steps calls."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=129)
    parser.add_argument("--numel", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bf16, groups = model(args.params, args.numel, torch.bfloat16)
    fp32, fp32_groups = model(args.params, args.numel, torch.float32)
    precis_default = precis.optim.AdamW(groups, lr=1e-4)
    rem_params, rem_groups = model(args.params, args.numel, torch.bfloat16)
    # (a Policy: a mapping can change in place, and a steady step compares settings by
    # identity)
    precis_rem8 = precis.optim.AdamW(rem_groups, lr=1e-4,
                                     policy=precis.resolve_policy(torch.bfloat16, FP8_REM8))
    _, dict_groups = model(args.params, args.numel, torch.bfloat16)
    precis_dict = precis.optim.AdamW(dict_groups, lr=1e-4, policy=dict(FP8_REM8))
    torch_fused = torch.optim.AdamW(fp32_groups, lr=1e-4, fused=True)
    off_params, off_groups = model(args.params, args.numel, torch.bfloat16)
    precis_off = precis.optim.AdamW(off_groups, lr=1e-4)
    for opt in (precis_default, precis_rem8, precis_dict, torch_fused):
        for _ in range(3):
            opt.step()
    for _ in range(3):
        full_path_step(precis_off)()
    params = [p.detach() for p in bf16]
    grads = [p.grad for p in bf16]
    for opt in (precis_default, precis_rem8, precis_dict):
        steady = opt._books.steady
        assert steady is not None and steady.calls is not None, "no steady step"

    def foreach_add():
        torch._foreach_add_(params, grads, alpha=0.0)
    rows = {
        "torch._foreach_add_(params, grads), bf16": foreach_add,
        "torch fused AdamW step, fp32": torch_fused.step,
        "precis AdamW default step (steady)": precis_default.step,
        "  its op call alone, replayed": op_alone(precis_default),
        "  its op call, checks only (nothing launched), with the grads read":
            checks_only(precis_default),
        "precis AdamW default step, steady path off (before)": full_path_step(precis_off),
        "precis fp8 m, v + 8-bit remainders step (steady: the op compares the blocks)":
            precis_rem8.step,
        "  its op call alone, replayed (fp8 + 8-bit remainders)": op_alone(precis_rem8),
        "  the same, its policy a dict (as from YAML; its items compared at each step)":
            precis_dict.step,
    }
    rounds = {name: [] for name in rows}
    with torch.no_grad():
        for r in range(2 + args.repeat):
            for name, fn in rows.items():
                us = timed(fn, args.steps)
                if r >= 2:
                    rounds[name].append(us)
    print(f"CPU: {machine.cpu_model()}; torch {torch.__version__}, 1 thread; "
          f"{args.params} params of {args.numel} elements in two groups; the device path "
          f"(PRECIS_DEVICE_PATH_ON_CPU=1); median of {args.steps} calls, median of "
          f"{args.repeat} rounds")
    print("| row | us | / foreach_add | / torch fused step |")
    print("|---|---|---|---|")
    us = {name: statistics.median(values) for name, values in rounds.items()}
    ref, fused = us["torch._foreach_add_(params, grads), bf16"], \
        us["torch fused AdamW step, fp32"]
    for name, value in us.items():
        print(f"| {name} | {value:.1f} | {value / ref:.2f}x | {value / fused:.2f}x |")


if __name__ == "__main__":
    main()
