"""Sharded training (ZeRO-3: params, gradients and optimizer state) with torch's FSDP2 and
precis.optim, launched by torchrun (after `bazel build //:libprecis.so //:libprecis_torch.so`,
from the repository root):

    .venv/bin/torchrun --nproc_per_node=2 examples/fsdp_train.py \
        --dtype bf16 --policy '{"store_param_remainders": true}'
    .venv/bin/torchrun --nproc_per_node=2 examples/fsdp_train.py --dtype bf16 \
        --policy '{"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                   "store_param_remainders": true}' --width 128 --offload
    .venv/bin/torchrun --nproc_per_node=2 examples/fsdp_train.py --dtype bf16 --release

gloo on CPU, NCCL when every process has a GPU of its own. A small MLP, sharded with
precis.fsdp.fully_shard (one FSDP2 unit per Linear), learns a fixed random linear map;
each rank trains on its share of every batch, in micro-batches. At the end the full
params are gathered on every rank and compared, and with --checkpoint the model and
optimizer are saved with torch.distributed.checkpoint (loadable at another world size).
With --release each shard is stepped inside backward, as soon as its reduce-scatter is
done, and its gradient freed (precis.optim.release_gradients): one micro-batch per step
(a release does not accumulate), clipped by a lower bound of the global norm (max_norm).
Rank 0 prints "fsdp_train: OK".
"""
import argparse
import gc
import importlib.util
import json
import os
import sys

import torch
import torch.nn as nn

# precis as installed (pip); from a clone without it, the checkout's package, whose
# loader finds the libraries in bazel-bin/.
if importlib.util.find_spec("precis") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))
import precis.fsdp  # before init_process_group (docs/design.md section 5)
import precis.optim
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH, MICRO_BATCHES = 64, 2  # global batch, split over the ranks, then into micro-batches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--policy", default="{}",
                    help='policy overrides as JSON, e.g. \'{"store_param_remainders": true}\'')
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--checkpoint", help="directory to save the final model and optimizer in")
    ap.add_argument("--offload", action="store_true",
                    help="keep each rank's optimizer state on the CPU and step it there")
    ap.add_argument("--release", action="store_true",
                    help="step each shard inside backward and free its gradient")
    args = ap.parse_args()

    # One GPU per process with NCCL when there are enough GPUs; else CPU and gloo.
    cuda = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    train(args, device)
    # The sharded model and optimizer may sit in reference cycles that hold the process
    # group: free them while it lives (a group freed at exit can abort in gloo's threads).
    gc.collect()
    dist.barrier()  # no rank tears gloo down while another still sends (it aborts)
    dist.destroy_process_group()


def train(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = BATCH // world

    torch.manual_seed(0)  # the same init on every rank: FSDP2 keeps each rank's shard of it
    model = nn.Sequential(nn.Linear(16, args.width), nn.GELU(), nn.Linear(args.width, args.width),
                          nn.GELU(), nn.Linear(args.width, 4))
    model.to(device=device, dtype=DTYPES[args.dtype])
    policy = json.loads(args.policy)
    precis.fsdp.fully_shard(model, policy=policy, units=(nn.Linear,))
    opt = precis.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, policy=policy,
                             offload="cpu" if args.offload else False)
    micro_batches = 1 if args.release else MICRO_BATCHES
    if args.release:
        precis.optim.release_gradients(opt, max_norm=1.0)

    data = torch.Generator().manual_seed(1234)  # the same batches on every rank
    target_map = torch.randn(16, 4, generator=data)
    for step in range(args.steps):
        x = torch.randn(BATCH, 16, generator=data)
        y = x @ target_map
        xs, ys = (t[rank * per_rank:(rank + 1) * per_rank].to(device) for t in (x, y))
        total = 0.0
        for xm, ym in zip(xs.chunk(micro_batches), ys.chunk(micro_batches)):
            # FSDP2 reduce-scatters each micro-batch's gradient and averages over ranks.
            loss = ((model(xm).float() - ym) ** 2).mean() / micro_batches
            loss.backward()
            total += loss.item()
        if not args.release:  # released: clipped inside backward (max_norm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss (rank 0's share) {total:.4f}", flush=True)

    with precis.fsdp.gathered(model):  # every unit's full params, for evaluation
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(g, flat) for g in gathered):
        raise SystemExit(f"rank {rank}: full params differ between ranks")
    if args.checkpoint:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
    report = opt.memory_report()
    if rank == 0:
        print(f"fsdp_train: OK ({world} processes, dtype={args.dtype}, policy={policy}, "
              f"offload={'cpu' if args.offload else 'no'}, release={args.release}, "
              f"final loss {total:.4f}, bytes per param on rank 0: {report['total']:.2f} "
              f"(param {report['param']:.2f}, grad {report['grad']:.2f}, master "
              f"{report['master']:.2f}, moments {report['exp_avg'] + report['exp_avg_sq']:.2f}))",
              flush=True)


if __name__ == "__main__":
    main()
