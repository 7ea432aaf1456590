"""Gradient release (precis.optim.release_gradients) against the ordinary loop, on the
CPU: the time of a whole training step (forward, backward, step) and the gradient bytes
alive at the peak of backward, for bench/llama.py's models.

Rows, each on the same model, batches and precis AdamW policy:
  * ordinary: backward, then optimizer.step() (precis's Plan: one op call a group);
  * release: each param stepped in its gradient hook, its gradient freed (one op call
    a param);
  * release, buckets of N MiB: the params whose gradients are ready stepped together
    once they reach N MiB (bucket_bytes), the rest at the end of backward;
  * release, capturable (--capturable): one param at a time with the optimizer's step
    counts on the device (capturable=True), so that with clipping too no call waits
    for a device's norm or verdict (what it costs on the CPU, where nothing waits).
The rows take turns, a training step each (--repeat rounds after --warmup), so the
machine's drift over the run reaches them alike. Columns: ms per training step (best
and median), the ratio to the ordinary loop's (the median over the rounds of the
ordinary step's time over the row's in the same round; < 1: slower), the gradient
bytes per param alive at the peak of
backward (a hook on every param reads them as each arrives), and the state + those
gradients per param. No clipping in any row (the ordinary loop's global clipping and a
release's clipping by an estimate of it differ in what they compute, not in cost).

    .venv/bin/python bench/release.py [--size tiny|small] [--policy default|fp8-rem8]
        [--buckets 1,16] [--capturable] [--threads N] [--repeat 5]

--host: the host part of a released backward, a param at a time, on a GPU's path
(PRECIS_DEVICE_PATH_ON_CPU=1: the compare in the op, nothing read back): bench/
steady_step.py's --params params of --numel elements (so a step's time is its host
part), bf16, precis AdamW (--policy; here "default" unless given), at one thread. Rows in
turns, each round the median
of --steps training steps (a loss summing the params' squares, backward, opt.step(),
zero_grad), the median of the rounds: the backward alone (no step), the ordinary loop
(its step: one steady op call) and the release (a step call in each param's hook), and
the release's op calls alone, replayed a param at a time from the calls the full path
built (no backward, none of the step's Python: what a call kept per param would cost),
and the release with one bucket for every param (bucket_bytes above their bytes: one
step call when the backward ends; its calls made by the full path's walk at the first
backward, kept and made again at the next ones).
"step part" is a row's time less the backward alone's (the replay's: its time); "per
param" that over --params.

--parts adds where the release's host part goes: the release's training steps again, its
methods and calls timed (inclusive: a part's time holds the parts it calls), us a param
a training step and calls a step, this precis's only.

--before DIR adds the rows of an earlier precis (the one-bucket row too), in turns with
these: DIR holds its
torch_ext/precis copied as precis_before (e.g. `git archive <commit> torch_ext/precis |
tar -x -C /tmp/old && mkdir DIR && mv /tmp/old/torch_ext/precis DIR/precis_before`).

    .venv/bin/python bench/release.py --host [--policy default|fp8-rem8] [--mapping]
        [--params 129] [--numel 8] [--steps 30] [--before DIR] [--parts]
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
from precis import functional, ops  # noqa: E402
from train_llm import LiveGrads  # noqa: E402

POLICIES = {
    "default": {},
    "fp8-rem8": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                 "store_param_remainders": True, "param_remainder_bits": 8},
}
MODELS = {"tiny": ("tiny", 4, 32), "small": ("small", 4, 32)}  # config, batch, seq (train_llm.py's)


def step_released(optimizer, gi, i, changed=None):
    """Param i of group gi stepped as a release's hook steps it (GradientRelease._step
    without clipping or a loss scale): the functional core for that param alone, with a
    grad scale of 1 (the kernel checks the gradient), under no_grad. changed: what the
    release's one compare a backward found (precis.release.written_behind_ids; None:
    this call compares its param itself)."""
    with torch.no_grad():
        functional.run(optimizer.param_groups, optimizer.state, optimizer._books, 1.0, None,
                      {gi: [i]}, changed)


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for st in optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


class Row:
    """One row's model, optimizer and (for a release row) its release, stepped a
    training step at a time."""

    def __init__(self, config, batch, seq, policy, release, bucket_bytes, count_bytes=True,
                 capturable=False):
        self.model = llama.Llama(llama.LlamaConfig.named(config), seed=0).to(torch.bfloat16)
        self.optimizer = precis.optim.AdamW(list(self.model.parameters()), lr=1e-3,
                                            policy=policy, capturable=capturable)
        # before the release's hooks: each gradient seen alive (a scan of the live
        # gradients at every hook; count_bytes=False leaves it out of the times)
        self.live = LiveGrads(self.model) if count_bytes else None
        self.handle = precis.optim.release_gradients(self.optimizer, bucket_bytes=bucket_bytes) \
            if release else None
        self.batches = llama.byte_batches("train", batch, seq, 0)
        self.times = []

    def step(self, timed):
        x, y = next(self.batches)
        start = time.perf_counter()
        self.backward(self.model.loss(x, y))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if timed:
            self.times.append(time.perf_counter() - start)

    def backward(self, loss):
        loss.backward()

    def bytes_per_param(self):
        """(live gradient bytes at the peak of backward, state bytes), per param."""
        if self.live is None:
            raise ValueError("bytes_per_param: this Row was made with count_bytes=False")
        numel = llama.num_params(self.model)
        if self.handle is not None and self.handle.peak_grad_bytes != self.live.peak:
            raise RuntimeError(f"the release counted a peak of {self.handle.peak_grad_bytes} "
                               f"gradient bytes, the hooks {self.live.peak}")
        return self.live.peak / numel, state_bytes(self.optimizer) / numel


def import_before(directory):
    """The package precis_before in `directory`: an earlier precis's torch_ext/precis
    copied under that name, for rows beside this one's in the same run (its imports are
    relative; it loads the libraries this precis loaded)."""
    os.environ.setdefault("PRECIS_LIBRARY", precis._lib.lib().precis_path)
    os.environ.setdefault("PRECIS_TORCH_LIBRARY", precis._lib.torch_glue().precis_path)
    sys.path.insert(0, os.path.abspath(directory))
    import precis_before
    return precis_before


REPLAYED = "  the release's op calls alone, replayed (no backward, no step Python)"
ONE_BUCKET = "release, one bucket: every param stepped when the backward ends"


def replayed_ops(train, params, optimizer):
    """--host's replay: what a released param's step call launches, a param at a time,
    from the op call the full path built for it (kept from two released training steps),
    held on the C side as the release holds it (ops.HeldStep): the step (its grad and
    step count put in, a fresh fingerprint output: the record of what it left; with
    remainders the last one its blocks' records), the record kept. (A backward's one
    compare and resync are not a param's.) What a call kept per param costs, with none
    of the full path's Python around it."""
    from precis import step_calls
    calls, make_call = {}, step_calls.make_call

    def kept(*args, **kwargs):
        call = make_call(*args, **kwargs)
        calls[id(call.params[0])] = call
        return call
    step_calls.make_call = kept
    try:
        for _ in range(2):
            train()
    finally:
        step_calls.make_call = make_call
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype) for p in params]
    books = optimizer._books
    # each call held on the C side, as the release holds a kept call (ops.HeldStep)
    held = {key: ops.HeldStep(**call.args, inv_grad_scale_tensor=None)
            for key, call in calls.items() if call.op() is ops.adam_step_}

    @torch.no_grad()
    def replay():
        for p, grad in zip(params, grads):
            call, state = calls[id(p)], optimizer.state[p]
            call.args["grads"] = [grad]  # (the held call counts the step)
            last = call.args["fingerprints"]
            if isinstance(last, list):  # [out, records, kept(, sums)]: compared by the op
                out = torch.empty_like(last[0])  # (its blocks, or the param and its master)
                call.args["fingerprints"] = [out, last[0], *last[2:]]
            else:
                out = call.args["fingerprints"] = torch.empty_like(last)
            out_list = call.args["fingerprints"]
            held[id(p)](call.args["params"], call.args["grads"], state["step"],
                        call.args["lr"], 1.0, torch.zeros(1),
                        out_list if isinstance(out_list, list) else [out_list])
            books.written.record_values([id(p)], out)
    return replay


# --parts: (object, method name, label) of what a released backward's hooks call, each timed
# inclusive of what it calls
PARTS = [
    ("release.GradientRelease", "_take", "the hook's step (_take)"),
    ("release.GradientRelease", "_flush", "  _flush"),
    ("release.GradientRelease", "_step_alone", "    _step_alone (a lone kept call)"),
    ("release.GradientRelease", "_step", "    _step (the walk)"),
    ("release.GradientRelease", "_first_call", "      the backward's first call (compare)"),
    ("release.GradientRelease", "_step_kept", "      _step_kept"),
    ("kept_calls.KeptCalls", "kept_call", "        kept_call"),
    ("ops", "adam_step_", "        the op call (ops.adam_step_)"),
    ("ops.HeldStep", "__call__", "        the held call (ops.HeldStep)"),
    ("fingerprints.Records", "record_values", "        record_values"),
    ("release.GradientRelease", "_backward_done", "the backward's end (verdicts read)"),
]


def timed_parts(package, train, params, steps):
    """{label: (us a param a training step, calls a step)} of PARTS over steps training
    steps of a release (train), each method wrapped by a timer for the run."""
    import importlib
    spent, calls, undo = {}, {}, []
    for where, name, label in PARTS:
        module, _, cls = where.partition(".")
        owner = importlib.import_module(f"{package.__name__}.{module}")
        owner = getattr(owner, cls) if cls else owner
        if not hasattr(owner, name):
            continue  # (an earlier precis without it)
        real = getattr(owner, name)
        spent[label] = calls[label] = 0

        def timer(*args, _real=real, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - start
                calls[_label] += 1
        setattr(owner, name, timer)
        undo.append((owner, name, real))
    try:
        for _ in range(steps):
            train()
    finally:
        for owner, name, real in undo:
            setattr(owner, name, real)
    return {label: (spent[label] / steps / len(params) * 1e6, calls[label] / steps)
            for label in spent}


def host_part(args):
    """--host's table (see the module docstring)."""
    from steady_step import model  # (sets PRECIS_DEVICE_PATH_ON_CPU=1: the device path)
    torch.set_num_threads(1)
    policy = args.policy or "default"
    packages = [("", precis)]
    if args.before:
        packages.append((" (before)", import_before(args.before)))

    def made(package, step, release, bucket_bytes=0):
        params, groups = model(args.params, args.numel, torch.bfloat16)
        for p in params:
            p.grad = None
        # (default: no policy given, as before --policy, but with --mapping; fp8-rem8: a
        # mapping, as a config's and bench/train_llm.py's rows give it)
        optimizer = package.optim.AdamW(
            groups, lr=1e-4, policy=dict(POLICIES[policy]) if args.mapping else
            POLICIES[policy] or None)
        if release:
            package.optim.release_gradients(optimizer, bucket_bytes=bucket_bytes)

        def train():
            loss = sum((p.float() * p.float()).sum() for p in params)
            loss.backward()
            if step:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return train, params, optimizer
    rows = {"backward alone (no step)": made(precis, False, False)}
    pairs = []  # (suffix, the ordinary row, the release's)
    for suffix, package in packages:
        pairs.append((suffix, f"ordinary{suffix}: backward, then optimizer.step()",
                      f"release{suffix}: a step call in each param's hook"))
        rows[pairs[-1][1]] = made(package, True, False)
        rows[pairs[-1][2]] = made(package, True, True)
    for suffix, package in packages:  # (the ordinary row of the same precis beside it)
        ordinary = next(pair[1] for pair in pairs if pair[0] == suffix)
        pairs.append((f", one bucket{suffix}", ordinary, ONE_BUCKET + suffix))
        rows[ONE_BUCKET + suffix] = made(package, True, True, bucket_bytes=1 << 62)
    replay = replayed_ops(*made(precis, True, True))
    rounds = {name: [] for name in rows}
    rounds[REPLAYED] = []
    for r in range(args.warmup + args.repeat):
        for name, train in [(name, row[0]) for name, row in rows.items()] + [(REPLAYED, replay)]:
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                train()
                times.append(time.perf_counter() - start)
            if r >= args.warmup:
                rounds[name].append(statistics.median(times) * 1e6)
    us = {name: statistics.median(values) for name, values in rounds.items()}
    alone = us["backward alone (no step)"]
    print(f"machine: {machine.cpu_model()}, 1 thread, torch {torch.__version__}, load "
          f"average {os.getloadavg()[0]:.2f}; {args.params} params of {args.numel} bf16 "
          f"elements in two groups, precis AdamW {policy}"
          f"{' (a mapping)' if args.mapping or policy != 'default' else ''}, the device "
          f"path; median of "
          f"{args.steps} training steps, median of {args.repeat} rounds after {args.warmup}"
          f"{'; before: ' + args.before if args.before else ''}\n")
    print("| row | us / training step | step part, us | step part per param, us |")
    print("|---|---|---|---|")
    for name, value in us.items():
        part = value if name == REPLAYED else value - alone  # (the replay: no backward)
        print(f"| {name} | {value:.0f} | {part:.0f} | {part / args.params:.1f} |"
              if value is not alone else f"| {name} | {value:.0f} | | |")
    print()
    same = True
    for suffix, ordinary, release in pairs:
        step, released = us[ordinary] - alone, us[release] - alone
        print(f"release{suffix}'s step part / the ordinary step's: {released / step:.1f}x; "
              f"training step, ordinary / release: {us[ordinary] / us[release]:.2f}x")
        # the same params, gradients and number of steps: the release's bits are the loop's
        equal = all(torch.equal(a, b) for a, b in zip(rows[ordinary][1], rows[release][1]))
        print(f"params after {args.warmup + args.repeat} rounds, release{suffix} against the "
              f"ordinary loop: {'bit for bit equal' if equal else 'DIFFERENT'}")
        same = same and equal
    if args.parts:
        train, params, _ = made(precis, True, True)
        for _ in range(args.warmup):
            train()
        print(f"\nwhere the release's host part goes (--parts; {args.steps * args.repeat} "
              f"training steps, timers inclusive):\n")
        print("| part | us a param a step | calls a step |")
        print("|---|---|---|")
        for label, (us_param, count) in timed_parts(precis, train, params,
                                                     args.steps * args.repeat).items():
            print(f"| {label} | {us_param:.1f} | {count:g} |")
    return 0 if same else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=MODELS, default="tiny")
    ap.add_argument("--policy", choices=POLICIES,
                    help="precis AdamW's policy (default: fp8-rem8; --host: default)")
    ap.add_argument("--buckets", default="1,16", help="bucket sizes in MiB, comma-separated")
    ap.add_argument("--capturable", action="store_true",
                    help="a row more: one param at a time, capturable=True")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--host", action="store_true",
                    help="the host part of a released backward (see above)")
    ap.add_argument("--params", type=int, default=129, help="--host: how many params")
    ap.add_argument("--numel", type=int, default=8, help="--host: elements a param")
    ap.add_argument("--steps", type=int, default=30,
                    help="--host: training steps a round")
    ap.add_argument("--mapping", action="store_true",
                    help="--host: the default policy too given as a mapping ({}), as "
                         "bench/train_llm.py gives every policy")
    ap.add_argument("--before", help="--host: a directory holding an earlier precis as "
                                     "the package precis_before, whose rows run beside")
    ap.add_argument("--parts", action="store_true",
                    help="--host: where the release's host part goes (timed methods)")
    args = ap.parse_args(argv)
    if args.host:
        return host_part(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    config, batch, seq = MODELS[args.size]
    policy = POLICIES[args.policy or "fp8-rem8"]
    rows = [("ordinary", False, 0, False), ("release", True, 0, False)] + [
        (f"release, buckets of {mib} MiB", True, int(float(mib) * 2**20), False)
        for mib in args.buckets.split(",") if mib]
    if args.capturable:
        rows.append(("release, capturable", True, 0, True))
    print(f"machine: {machine.cpu_model()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, precis.cpu_isa() {precis.cpu_isa()}")
    print(f"model: bench/llama.py {config}, batch {batch} x {seq}, bf16, precis AdamW "
          f"policy {args.policy or 'fp8-rem8'}, {args.repeat} rounds after {args.warmup}\n")
    built = [Row(config, batch, seq, policy, release, bucket, capturable=capturable)
             for _, release, bucket, capturable in rows]
    # The rows take turns a step at a time (each round in another order), so the VM's
    # drift over a run reaches every row alike; each row's ratio is the median over the
    # rounds of ordinary's time over its own in the same round.
    for turn in range(args.warmup + args.repeat):
        for k in range(len(built)):
            built[(turn + k) % len(built)].step(timed=turn >= args.warmup)
    print("| row | ms/step, best | ms/step, median | vs ordinary (median of paired rounds) "
          "| live grads at peak, B/param | state + live grads, B/param |")
    print("|---|---|---|---|---|---|")
    base = built[0].times
    for (name, *_), row in zip(rows, built):
        grads, state = row.bytes_per_param()
        ratio = statistics.median(b / t for b, t in zip(base, row.times))
        print(f"| {name} | {1e3 * min(row.times):.1f} | {1e3 * statistics.median(row.times):.1f} "
              f"| {ratio:.2f}x | {grads:.3f} | {state + grads:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
