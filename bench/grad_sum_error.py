"""How far a data-parallel gradient reduction lands from the exact sum, per world size:
every rank holds a bf16 gradient (N elements, per-element scales log-normal, sigma 1,
as a bf16 model's gradients are), and the sum over ranks is taken three ways, on gloo:

  bf16 all-reduce          the wire and the sums in bf16 (torch DDP / FSDP2 with a bf16
                           reduce dtype; precis.ddp with grad_comm_dtype bf16)
  bf16 wire, fp32 sums     precis.ddp's all-reduce with grad_sum_dtype fp32 (precis.grad_sums):
                           an all-to-all of bf16 chunks, each rank adding its chunk's W
                           copies in fp32, then an all-gather of the sums in bf16: the
                           same bytes on the wire, one rounding to bf16 at the end
  fp32 all-reduce          the wire and the sums in fp32 (grad_comm_dtype fp32: twice
                           the bytes)

against the float64 sum of the same bf16 gradients (each rank draws every rank's
gradient from its seed). Prints the relative error of the reduced gradient, as a norm
(||reduced - exact|| / ||exact||) and per element (median and p99 of |reduced - exact| /
|exact|), in units of bf16's relative spacing 2^-8. Asserts nothing.

    .venv/bin/python bench/grad_sum_error.py                 # worlds 2-8, 1,048,320 elements
    .venv/bin/python bench/grad_sum_error.py --worlds 2,3 --numel 4096
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402
from two_ranks import run_world, save_result  # noqa: E402  (also puts precis on sys.path)

BF16_SPACING = 2.0 ** -8
WAYS = ("bf16 all-reduce", "bf16 wire, fp32 sums", "fp32 all-reduce")


def gradient(rank, numel):
    gen = torch.Generator().manual_seed(1000 + rank)
    scales = torch.exp(torch.randn(numel, generator=torch.Generator().manual_seed(7)))
    return (scales * torch.randn(numel, generator=gen)).to(torch.bfloat16)


def bf16_wire_fp32_sums(g):
    """The sum over ranks of g as precis.ddp all-reduces a bucket with grad_sum_dtype
    fp32 (its collectives object, unscaled)."""
    from precis.ddp._comm import _Comm
    out = g.clone()
    _Comm(None).all_reduce_wide(out, torch.float32, 1.0).wait()
    return out


def errors(reduced, exact):
    diff = (reduced.double() - exact).abs()
    per_element = diff / exact.abs().clamp_min(1e-300)
    quantiles = torch.quantile(per_element[:2 ** 24].float(),
                               torch.tensor([0.5, 0.99])).tolist()
    return [float(diff.norm() / exact.norm()) / BF16_SPACING] + \
        [q / BF16_SPACING for q in quantiles]


def run_rank(rank, world, port, numel, out_dir):
    import precis.ddp  # noqa: F401  (before init_process_group: precis/ddp/__init__.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    exact = sum(gradient(r, numel).double() for r in range(world))
    g = gradient(rank, numel)
    bf16 = g.clone()
    dist.all_reduce(bf16)
    fp32 = g.float()
    dist.all_reduce(fp32)
    results = {"bf16 all-reduce": errors(bf16, exact),
               "bf16 wire, fp32 sums": errors(bf16_wire_fp32_sums(g), exact),
               "fp32 all-reduce": errors(fp32, exact)}
    dist.barrier()
    if rank == 0:
        save_result(results, out_dir)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,3,4,5,6,7,8")
    ap.add_argument("--numel", type=int, default=840 * 1248)  # divisible by 1-8
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(args.numel % w for w in worlds):
        ap.error("--numel must be a multiple of every world size (the all-to-all's chunks)")
    print(f"{args.numel:,} bf16 gradient elements per rank, gloo; errors against the float64 "
          f"sum in units of 2^-8 (bf16's relative spacing); {cpu_model()}")
    print(f"{'world':>5} {'reduction':<22} {'norm':>7} {'median':>7} {'p99':>8}")
    for world in worlds:
        results = run_world(run_rank, world, args.numel)
        for way in WAYS:
            norm, median, p99 = results[way]
            print(f"{world:>5} {way:<22} {norm:>7.3f} {median:>7.3f} {p99:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
