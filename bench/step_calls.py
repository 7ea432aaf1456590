"""What a step call costs on the CPU: a precis AdamW step of bench/llama.py's model as
the ordinary loop takes it (its Plan: one op call a group) and as a gradient release
takes it (one call a param: bench/release.py's step_released, what the release's hooks
call), each beside its op calls alone (the same
torch.ops.precis calls, recorded once and replayed: no step Python). No forward or
backward: each param gets a random gradient of its dtype once. The two ways run on two
copies of the model and optimizer (a release's call drops a group's Plan), the replays
on two more, the rows in turns, --repeat rounds after 2; the table gives each row's
best and median ms, and per call.

    PYTHONPATH=torch_ext .venv/bin/python bench/step_calls.py [--size small]
        [--policy fp8-rem8] [--threads 2] [--repeat 15]
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

import llama  # noqa: E402
import machine  # noqa: E402
import precis  # noqa: E402
import release  # noqa: E402
from precis import ops  # noqa: E402

OPS = ("adam_step_", "adam_step_flat_")  # what step_calls.Call.op() hands a step


def optimizer_with_grads(size, policy):
    model = llama.Llama(llama.LlamaConfig.named(release.MODELS[size][0]), seed=0)
    model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)
    opt = precis.optim.AdamW(list(model.parameters()), lr=1e-3, policy=policy)
    opt.step()  # state made (and the ordinary way's Plan)
    return opt


def recorded_ops(step):
    """The op calls `step()` makes, as (op, keyword arguments), for replaying."""
    calls, real = [], {name: getattr(ops, name) for name in OPS}

    def recorder(name):
        def call(**kwargs):
            calls.append((real[name], kwargs))
            return real[name](**kwargs)
        return call
    steady_step = precis.step_plan.steady_step  # (a steady step's call is made once, not
    precis.step_plan.steady_step = lambda *args: False  # through ops' wrappers)
    try:
        for name in OPS:
            setattr(ops, name, recorder(name))
        step()
    finally:
        precis.step_plan.steady_step = steady_step
        for name in OPS:
            setattr(ops, name, real[name])
    return calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=release.MODELS, default="small")
    ap.add_argument("--policy", choices=release.POLICIES, default="fp8-rem8")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = release.POLICIES[args.policy]
    # four copies: the op calls replayed write params and state that their optimizer
    # did not record (its next step would see them as loaded), so each replay keeps its own
    ordinary, ordinary_replayed, released, release_replayed = (
        optimizer_with_grads(args.size, policy) for _ in range(4))
    places = [(gi, i) for gi, group in enumerate(released.param_groups)
              for i in range(len(group["params"]))]

    def step_a_param_at_a_time(opt):
        changed = precis.release.written_behind_ids(opt)  # once a backward, as a release
        for gi, i in places:
            release.step_released(opt, gi, i, changed)

    def release_step():
        step_a_param_at_a_time(released)
    ordinary_ops = recorded_ops(ordinary_replayed.step)
    release_ops = recorded_ops(lambda: step_a_param_at_a_time(release_replayed))
    rows = [("ordinary step (Plan)", ordinary.step, len(ordinary_ops)),
            ("  its op calls alone", lambda: [op(**kw) for op, kw in ordinary_ops],
             len(ordinary_ops)),
            ("one call a param (a release's)", release_step, len(release_ops)),
            ("  its op calls alone", lambda: [op(**kw) for op, kw in release_ops],
             len(release_ops))]
    times = [[] for _ in rows]
    for turn in range(2 + args.repeat):
        for k, (_, fn, _) in enumerate(rows):
            start = time.perf_counter()
            fn()
            if turn >= 2:
                times[k].append(time.perf_counter() - start)
    print(f"machine: {machine.cpu_model()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, precis.cpu_isa() {precis.cpu_isa()}")
    numel = sum(p.numel() for group in ordinary.param_groups for p in group["params"])
    print(f"model: bench/llama.py {args.size}, bf16, {numel} params in {len(places)} "
          f"tensors, precis AdamW policy {args.policy}, {args.repeat} rounds after 2\n")
    print("| row | op calls | ms, best | ms, median | us per call, median |")
    print("|---|---|---|---|---|")
    for (name, _, calls), t in zip(rows, times):
        median = statistics.median(t)
        print(f"| {name} | {calls} | {1e3 * min(t):.2f} | {1e3 * median:.2f} | "
              f"{1e6 * median / calls:.1f} |")
    python = statistics.median(times[2]) - statistics.median(times[3])
    print(f"\nthe release's calls beyond their ops: {1e3 * python:.2f} ms, "
          f"{1e6 * python / len(release_ops):.0f} us a call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
