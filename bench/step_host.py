"""What one optimizer step costs the host, and the step waited for, over a Llama's params
(bench/llama.py, bf16; two param groups: the matrices decayed, the rest not, as
bench/train_llm.py makes them), beside torch's fused AdamW on fp32 copies (AMP's step).
Each row's median over --steps steady steps (after 5) of: "host ms", the time opt.step()
takes to return (queued, not waited for: on a GPU the time the host cannot spend
queueing the next forward); "waited ms", the step with a wait for the device before and
after it (what train_llm.py's opt ms/step times); their ratio to torch's; and what a
steady step reads back and calls (precis.device_reads' reads, the torch.ops.precis
calls a step makes). On a GPU the params live there; on a CPU the step takes a GPU's
path (PRECIS_DEVICE_PATH_ON_CPU=1, nothing waited for), so the host columns are its
Python, glue and op calls beside the CPU's kernels. --loop times each step after a
forward and backward of a batch of random bytes (--batch x --seq; the AMP row under
bf16 autocast) and the gradients' clipping, the gradients set to None after it, as
bench/train_llm.py's loop does: the host then comes to the step from other work, as
in training. --replay adds, under each row, its step's ops called again with the same
arguments without the optimizer's Python (each op a steady step called, recorded by a
dispatch mode, two steps' calls in turns), and its update op alone so replayed: the
floor of what the step's op calls cost beside its Python. --per-op adds each other op
the steady steps call (torch's step counts; precis's copy back of what its op kept, made
once every 16 steps), over 16 steps, replayed alone: which of them the host's part
beside the update op goes to.

    PYTHONPATH=torch_ext .venv/bin/python bench/step_host.py [--size 125m] [--steps 50] [--loop]
        [--replay] [--per-op]
"""
import argparse
import collections
import functools
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
from precis import device_reads, step_plan  # noqa: E402

FP8_REM8 = dict(store_param_remainders=True, param_remainder_bits=8, exp_avg_dtype="fp8",
                exp_avg_sq_dtype="fp8")
# row -> (param dtype, the optimizer of the groups)
ROWS = {
    "torch fused AdamW, fp32 params (AMP)": (
        torch.float32, lambda groups: torch.optim.AdamW(groups, lr=1e-4, fused=True)),
    "precis default (fp32 master, bf16 m, v)": (
        torch.bfloat16, lambda groups: precis.optim.AdamW(groups, lr=1e-4)),
    "precis fp8 m, v + 8-bit remainders": (
        torch.bfloat16, lambda groups: precis.optim.AdamW(groups, lr=1e-4, policy=FP8_REM8)),
}


class OpCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The torch.ops.precis calls made under it, by name, and every op called under it
    with its arguments (`made`, for a replay)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "precis":
            self.calls[func._opname] += 1
        self.made.append((func, args, kwargs or {}))
        return func(*args, **self.made[-1][2])


def replay_of(opt, before, update_only=False):
    """A step that calls the ops two steady steps of opt called, with their arguments,
    in turns (a Part's two records take turns, so each replay finds the params as the
    replay before left them): the step's op calls without the optimizer's Python. With
    update_only, only its update ops (precis's adam_step_flat_, torch's _fused_adamw_):
    what the step's other ops (step counts, allocations, copies) cost beside them."""
    turns = []
    for _ in range(2):
        before()
        with OpCalls() as log:
            opt.step()
        turns.append([(func, args, kwargs) for func, args, kwargs in log.made
                      if not update_only or "adam" in func._opname])
    turn = [0]

    def step():
        for func, args, kwargs in turns[turn[0]]:
            func(*args, **kwargs)
        turn[0] ^= 1
    return step


def ops_alone(opt, steps, wait, before):
    """[(op, in how many of the steps logged, host ms, waited ms)] of each op the steady
    steps of opt call but its update op (and the profiler's record_function marks), over
    step_plan.KeptRows.ROWS steps (precis copies back what its op kept once in those),
    each op replayed alone with the arguments of its first call, before() ahead of each,
    untimed. Run last: a replayed step count or copy leaves the optimizer's state as it
    found it no longer."""
    first, count = {}, collections.Counter()
    for _ in range(step_plan.KeptRows.ROWS):
        before()
        with OpCalls() as log:
            opt.step()
        for func, args, kwargs in log.made:
            if "adam" not in func._opname and func.namespace != "profiler":
                count[str(func)] += 1
                first.setdefault(str(func), (func, args, kwargs))
    return [(name, count[name],
             *timed(functools.partial(func, *args, **kwargs), steps, wait, before))
            for name, (func, args, kwargs) in first.items()]


def model_of(size, dtype, device):
    """A `size` Llama in dtype on device, with gradients, and its params in two groups."""
    model = llama.Llama(llama.LlamaConfig.named(size), seed=0).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    params = list(model.parameters())
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(dtype)
    return model, [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def training(model, opt, batch, seq, autocast, device):
    """What comes before a step in --loop: a forward and backward of random bytes and the
    clipping of the gradients (the last step's set to None first)."""
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randint(0, 256, (batch, seq), device=device, generator=gen)
    y = torch.roll(x, -1, 1)

    def before():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return before


def timed(step, steps, wait, before):
    """(median host ms, median waited ms) of step over steps, before() ahead of each."""
    host, waited = [], []
    for _ in range(steps):
        before()
        wait()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        wait()
        waited.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(waited) * 1e3


def measure(opt, steps, device, before=lambda: None, replay=False):
    """(median host ms, median waited ms, reads a step, precis calls a step, and with
    replay the (host, waited) ms of the step's ops replayed and of its update ops alone
    replayed, else []), before() run ahead of each step, untimed."""
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        before()
        opt.step()
    wait()
    before()
    reads = sum(device_reads.counts.values())
    with OpCalls() as log:
        opt.step()
    reads = sum(device_reads.counts.values()) - reads
    host, waited = timed(opt.step, steps, wait, before)
    # (an even count of replays: the last leaves the record the optimizer knows of)
    floors = [timed(replay_of(opt, before, only), steps + steps % 2, wait, before)
              for only in (False, True)] if replay else []
    return host, waited, reads, log.calls, floors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="125m", choices=list(llama.SIZES))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--loop", action="store_true",
                        help="a forward and backward before each step (the training loop)")
    parser.add_argument("--replay", action="store_true",
                        help="also each row's step as its ops replayed without the "
                             "optimizer's Python, and its update op alone replayed")
    parser.add_argument("--per-op", action="store_true",
                        help="also each other op of a steady step, replayed alone")
    parser.add_argument("--batch", type=int, help="sequences a batch (default: 16 on a GPU, 2)")
    parser.add_argument("--seq", type=int, help="bytes a sequence (default: 1024 on a GPU, 64)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ["PRECIS_DEVICE_PATH_ON_CPU"] = "1"
    where = torch.cuda.get_device_name() if device.type == "cuda" else "no GPU: a GPU's path"
    params = sum(p.numel() for g in model_of(args.size, torch.float32, "cpu")[1]
                 for p in g["params"])
    batch = args.batch or (16 if device.type == "cuda" else 2)
    seq = args.seq or (1024 if device.type == "cuda" else 64)
    print(f"{where}; host CPU: {machine.cpu_model()}; torch {torch.__version__}; "
          f"{args.size} Llama, {params:,} params; median of {args.steps} steps"
          + (f", each after a forward and backward of {batch} x {seq} bytes" if args.loop
             else ""))
    print("| row | host ms | waited ms | host / torch's | waited / torch's | reads | "
          "precis calls a step |")
    print("|---|---|---|---|---|---|---|")
    ref = None
    for name, (dtype, make) in ROWS.items():
        model, groups = model_of(args.size, dtype, device)
        opt = make(groups)
        before = training(model, opt, batch, seq, dtype == torch.float32, device) \
            if args.loop else (lambda: None)
        host, waited, reads, calls, floors = measure(opt, args.steps, device, before,
                                                     args.replay)
        ref = ref or (host, waited)
        listed = ", ".join(f"{op} {n}" for op, n in sorted(calls.items())) or "-"
        print(f"| {name} | {host:.3f} | {waited:.3f} | {host / ref[0]:.2f}x | "
              f"{waited / ref[1]:.2f}x | {reads} | {listed} |")
        for what, (h, w) in zip(("its ops replayed", "its update op alone, replayed"),
                                floors):
            print(f"| {name}: {what} | {h:.3f} | {w:.3f} | {h / ref[0]:.2f}x | "
                  f"{w / ref[1]:.2f}x | - | - |")
        if args.per_op:
            wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            for op, n, h, w in ops_alone(opt, args.steps, wait, before):
                print(f"| {name}: {op} alone, replayed ({n} in "
                      f"{step_plan.KeptRows.ROWS} steps) | {h:.3f} | {w:.3f} | "
                      f"{h / ref[0]:.2f}x | {w / ref[1]:.2f}x | - | - |")
        del opt, model


if __name__ == "__main__":
    main()
