"""Loss under FSDP2 at several world sizes: bench/llama.py's model trained with precis on
FSDP2 (precis.fsdp.fully_shard, one unit per block, gloo on the CPU) at world sizes 1
and 4 (--worlds), several seeds each, with bench/train_llm.py's data, schedule, AdamW
hyperparameters and clipping. Each rank trains on its rows of every global batch (FSDP2
averages the gradients, so every world size steps on the same mean gradient). Prints
the final validation loss per world size and seed, each world size's mean and spread
(sample standard deviation over the seeds), and the gap of each world size's mean to
world 1's against world 1's spread: within it, the world size changes nothing a seed
does not. Asserts nothing.

    nice -n 10 .venv/bin/python bench/fsdp_train_llm.py --size small   # ~1 h on 2 cores
    .venv/bin/python bench/fsdp_train_llm.py --size tiny --worlds 1,2 --seeds 1  # quick

--policy takes precis policy overrides as JSON (default: fp8 m, v + int16 remainders).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402
from machine import cpu_model  # noqa: E402
from train_llm import (BETAS, EPS, GRAD_CLIP, REGIMES, RUN_SIZES, VAL_SEED,  # noqa: E402
                       WEIGHT_DECAY, lr_at, set_lr)
from two_ranks import run_world, save_result  # noqa: E402  (also puts precis on sys.path)

FP8_REMAINDERS = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                  "store_param_remainders": True}


def run_rank(rank, world, port, run, lr, seed, policy, out_dir):
    import precis.fsdp  # before init_process_group (docs/design.md section 5)
    import precis.optim
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    model = llama.Llama(llama.LlamaConfig.named(run.model), seed=seed).to(torch.bfloat16)
    precis.fsdp.fully_shard(model, policy=policy, units=(llama.Block,))
    opt = precis.optim.AdamW(llama.param_groups(model, WEIGHT_DECAY), lr=lr, betas=BETAS,
                             eps=EPS, policy=policy)
    val_batches = llama.byte_batches("val", run.batch, run.seq, VAL_SEED)
    val_set = [next(val_batches) for _ in range(run.val_batches)]
    batches = llama.byte_batches("train", run.batch, run.seq, seed)
    rows = slice(rank * run.batch // world, (rank + 1) * run.batch // world)
    start = time.perf_counter()
    for step in range(1, run.steps + 1):
        set_lr(opt, lr_at(step, run.steps, lr))
        x, y = next(batches)
        model.loss(x[rows], y[rows]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    with torch.no_grad():  # every rank runs the whole validation set
        val = float(torch.stack([model.loss(x, y).float() for x, y in val_set]).mean())
    dist.barrier()
    if rank == 0:
        save_result({"val": val, "seconds": seconds}, out_dir)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=RUN_SIZES, default="small")
    ap.add_argument("--regime", choices=REGIMES, default="pretrain")
    ap.add_argument("--worlds", default="1,4")
    ap.add_argument("--seeds", type=int, help="default: the size's seed count")
    ap.add_argument("--steps", type=int, help="default: the size's step count")
    ap.add_argument("--policy", default=json.dumps(FP8_REMAINDERS))
    args = ap.parse_args()
    run = RUN_SIZES[args.size]
    steps, seeds = args.steps or run.steps, args.seeds or run.seeds
    run = type(run)(**{**run.__dict__, "steps": steps, "seeds": seeds})
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(run.batch % w for w in worlds):
        ap.error(f"every world size must divide the batch of {run.batch}")
    policy, lr = json.loads(args.policy), REGIMES[args.regime]
    print(f"{args.size} ({llama.num_params(llama.Llama(llama.LlamaConfig.named(run.model))):,} "
          f"params), {args.regime} (peak lr {lr:g}), {run.steps} steps of {run.batch} x "
          f"{run.seq} bytes, policy {policy}, FSDP2 on gloo, 1 thread per rank; {cpu_model()}")
    print(f"{'world':>5} {'seed':>4} {'val loss':>9} {'train s':>8}")
    finals = {}
    for world in worlds:
        for seed in range(run.seeds):
            result = run_world(run_rank, world, run, lr, seed, policy)
            finals.setdefault(world, []).append(result["val"])
            print(f"{world:>5} {seed:>4} {result['val']:>9.4f} {result['seconds']:>8.1f}",
                  flush=True)
    base = finals[worlds[0]]
    spread = statistics.stdev(base) if len(base) > 1 else float("nan")
    print(f"\n{'world':>5} {'mean val':>9} {'spread':>7} {'gap to world ' + str(worlds[0]):>15} "
          f"{'gap / spread':>12}")
    for world, vals in finals.items():
        mean = statistics.fmean(vals)
        gap = mean - statistics.fmean(base)
        own = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        print(f"{world:>5} {mean:>9.4f} {own:>7.4f} {gap:>+15.4f} {gap / spread:>12.2f}")


if __name__ == "__main__":
    main()
