"""What reading a Plan's remainder resync back costs the host a step, on a GPU's path: the
resync's kept (an entry a block of fingerprints.BLOCK elements) copied back and summed a
param at a time on the host, as the steady step did, against summed on the device up to
each param's last block first (a prefix sum and a stack into buffers made once) and a
value a param copied back, as it did from the seventeenth session until its op compared
the blocks itself and wrote a value a param (step_plan.PartBlocks.records_for). Both read
what they copy back as the warning's words need it (settle_stale: every step, whether
or not a param was written). The params: bench/llama.py's 125m and 350m (their shapes,
on the meta device), and 1B in 180 equal tensors (bench/adam_cuda.py's layout). On the
CPU the device's part (the prefix sum over every block) runs on the host too: there it
is counted; on a GPU it is the device's (a scan, a few kernels, and a stack).

    PYTHONPATH=torch_ext .venv/bin/python bench/stale_words.py [--repeat 200]
"""
import argparse
import itertools
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
from precis import device_reads, fingerprints  # noqa: E402


def counts_of(name):
    """Each param's count of blocks."""
    if name == "1B":
        sizes = [1_000_000_000 // 180] * 180
    else:
        with torch.device("meta"):
            model = llama.Llama(llama.LlamaConfig.named(name), seed=0)
        sizes = [p.numel() for p in model.parameters()]
    return [fingerprints.block_count(n) for n in sizes]


def per_step_us(work, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine.cpu_model()}, 1 thread, torch {torch.__version__}; median of "
          f"{args.repeat} steps\n")
    print("| params | tensors | blocks | a block at a time, summed on the host, us a step "
          "| summed on the device first, us a step | ratio |")
    print("|---|---|---|---|---|---|")
    for name in ("125m", "350m", "1B"):
        counts = counts_of(name)
        kept = torch.full((sum(counts),), fingerprints.BLOCK, dtype=torch.int64)
        prefix = torch.empty_like(kept)
        ends = [prefix[at - 1] for at in itertools.accumulate(counts)]
        so_far = torch.empty(len(counts), dtype=torch.int64)

        def before():
            sums, at, values = [], 0, device_reads.Later(kept).values("bench")
            for n in counts:
                sums.append(sum(values[at:at + n]))
                at += n
            return sums

        def now():
            torch.cumsum(kept, 0, out=prefix)
            values = device_reads.Later(torch.stack(ends, out=so_far)).values("bench")
            return [b - a for a, b in zip([0] + values, values)]
        if before() != now():
            raise SystemExit(f"{name}: the two ways disagree")
        old, new = per_step_us(before, args.repeat), per_step_us(now, args.repeat)
        print(f"| {name} | {len(counts)} | {len(kept):,} | {old:.0f} | {new:.0f} | "
              f"{new / old:.2f}x |")


if __name__ == "__main__":
    main()
