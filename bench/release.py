"""Gradient release (precis.optim.release_gradients) against the ordinary loop, on the
CPU: the time of a whole training step (forward, backward, step) and the gradient bytes
alive at the peak of backward, for bench/llama.py's models.

Rows, each on the same model, batches and precis AdamW policy:
  * ordinary: backward, then optimizer.step() (precis's Plan: one op call a group);
  * release: each param stepped in its gradient hook, its gradient freed (one op call
    a param);
  * release, buckets of N MiB: the params whose gradients are ready stepped together
    once they reach N MiB (bucket_bytes), the rest at the end of backward.
Columns: ms per training step (the best of --repeat, after --warmup), its ratio to the
ordinary loop's (< 1: slower), the gradient bytes per param alive at the peak of
backward (a hook on every param reads them as each arrives), and the state + those
gradients per param. No clipping in any row (the ordinary loop's global clipping and a
release's clipping by an estimate of it differ in what they compute, not in cost).

    .venv/bin/python bench/release.py [--size tiny|small] [--policy default|fp8-rem8]
        [--buckets 1,16] [--threads N] [--repeat 5]
"""
import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import llama  # noqa: E402
import machine  # noqa: E402
import precis  # noqa: E402
from train_llm import LiveGrads  # noqa: E402

POLICIES = {
    "default": {},
    "fp8-rem8": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                 "store_param_remainders": True, "param_remainder_bits": 8},
}
MODELS = {"tiny": ("tiny", 4, 32), "small": ("small", 4, 32)}  # config, batch, seq (train_llm.py's)


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for st in optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


def run_row(config, batch, seq, policy, release, bucket_bytes, warmup, repeat):
    model = llama.Llama(llama.LlamaConfig.named(config), seed=0).to(torch.bfloat16)
    params = list(model.parameters())
    optimizer = precis.optim.AdamW(params, lr=1e-3, policy=policy)
    live = LiveGrads(model)  # before the release's hooks: each gradient seen alive
    handle = precis.optim.release_gradients(optimizer, bucket_bytes=bucket_bytes) \
        if release else None
    batches = llama.byte_batches("train", batch, seq, 0)
    times = []
    for step in range(warmup + repeat):
        x, y = next(batches)
        start = time.perf_counter()
        model.loss(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    numel = llama.num_params(model)
    if handle is not None and handle.peak_grad_bytes != live.peak:
        raise RuntimeError(f"the release counted a peak of {handle.peak_grad_bytes} gradient "
                           f"bytes, the hooks {live.peak}")
    return min(times) * 1e3, live.peak / numel, state_bytes(optimizer) / numel


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=MODELS, default="tiny")
    ap.add_argument("--policy", choices=POLICIES, default="fp8-rem8")
    ap.add_argument("--buckets", default="1,16", help="bucket sizes in MiB, comma-separated")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config, batch, seq = MODELS[args.size]
    policy = POLICIES[args.policy]
    rows = [("ordinary", False, 0), ("release", True, 0)] + [
        (f"release, buckets of {mib} MiB", True, int(float(mib) * 2**20))
        for mib in args.buckets.split(",") if mib]
    print(f"machine: {machine.cpu_model()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, precis.cpu_isa() {precis.cpu_isa()}")
    print(f"model: bench/llama.py {config}, batch {batch} x {seq}, bf16, precis AdamW "
          f"policy {args.policy}, best of {args.repeat} steps after {args.warmup}\n")
    print("| row | ms/step | vs ordinary | live grads at peak, B/param | state + live grads, "
          "B/param |")
    print("|---|---|---|---|---|")
    base = None
    for name, release, bucket in rows:
        ms, grads, state = run_row(config, batch, seq, policy, release, bucket, args.warmup,
                                   args.repeat)
        base = base or ms
        print(f"| {name} | {ms:.1f} | {base / ms:.2f}x | {grads:.3f} | {state + grads:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
