"""Data-parallel training with precis.ddp, launched by torchrun (after
`bazel build //:libprecis.so //:libprecis_torch.so`, from the repository root):

    .venv/bin/torchrun --nproc_per_node=2 examples/ddp_train.py \
        --sharding optim

gloo on CPU, NCCL with --device cuda (one GPU per process). A small MLP learns a
fixed random linear map; each rank trains on its share of every batch, in
micro-batches, with the usual loop (no_sync() for all micro-batches but the last)
once the optimizer is attached to the wrapper (precis.ddp.attach_optimizer).
At the end every rank checks that it holds the same params as the others and
rank 0 prints "ddp_train: OK". With --release each bucket's params (or this rank's
pieces of them) are stepped inside the last micro-batch's backward, as soon as the
bucket's reduction is complete (precis.optim.release_gradients).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

# precis as installed (pip); from a clone without it, the checkout's package, whose
# loader finds the libraries in bazel-bin/.
if importlib.util.find_spec("precis") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))
import precis.ddp
import precis.optim

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sharding", default="no_shard", choices=precis.ddp.STRATEGIES)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--policy", default="{}",
                    help='policy overrides as JSON, e.g. \'{"grad_comm_dtype": "bf16"}\'')
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--release", action="store_true",
                    help="step each bucket's params inside backward, once it is reduced")
    args = ap.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, torch.cuda.current_device()) \
        if args.device == "cuda" else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    per_rank = args.batch // world
    assert per_rank * world == args.batch and per_rank % args.micro_batches == 0, \
        "the global batch must split evenly over ranks and micro-batches"

    torch.manual_seed(rank)  # different init per rank: the wrapper broadcasts rank 0's
    model = nn.Sequential(nn.Linear(16, args.width), nn.GELU(), nn.Linear(args.width, args.width),
                          nn.GELU(), nn.Linear(args.width, 4)).to(device=device, dtype=dtype)
    model = precis.ddp.DistributedDataParallel(model, policy=json.loads(args.policy),
                                               sharding=args.sharding)
    opt = precis.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0,
                             policy=json.loads(args.policy))
    # The wrapper's hooks on the optimizer: step() syncs the gradients first, steps
    # this rank's shard (sharded strategies) and all-gathers the params after.
    precis.ddp.attach_optimizer(opt)
    if args.release:
        precis.optim.release_gradients(opt)

    data = torch.Generator().manual_seed(1234)  # the same batches on every rank
    target_map = torch.randn(16, 4, generator=data)
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=data)
        y = x @ target_map
        xs, ys = (t[rank * per_rank:(rank + 1) * per_rank].to(device) for t in (x, y))
        total = 0.0
        micro = zip(xs.chunk(args.micro_batches), ys.chunk(args.micro_batches))
        for i, (xm, ym) in enumerate(micro):
            last = i == args.micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = ((model(xm.to(dtype)).float() - ym) ** 2).mean() / args.micro_batches
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss (rank 0's share) {total:.4f}", flush=True)

    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(g, flat) for g in gathered):
        raise SystemExit(f"rank {rank}: params differ between ranks")
    if rank == 0:
        print(f"ddp_train: OK ({world} processes, sharding={args.sharding}, "
              f"dtype={args.dtype}, release={args.release}, final loss {total:.4f}, "
              f"bytes sent per step by rank 0: "
              f"{sum(model.comm_bytes.values()) // max(args.steps, 1)})", flush=True)
    dist.barrier()  # no rank tears gloo down while another still sends (it aborts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
