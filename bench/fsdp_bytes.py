"""Bytes per param held under FSDP2 (torch's fully_shard, ZeRO-3), per precis policy and
world size, beside torch.optim.AdamW on FSDP2 and precis in one process: after one
training step of bench/llama.py's model (one FSDP2 unit per block), each rank counts
the bytes of its local shards of the params, their gradients and the optimizer state
(from the tensors allocated). On GPUs the params, grads and state are device memory
and "host" (offload="cpu": the host copies of the shards, their grads and their state)
is host memory; on this CPU all of it is host memory, counted the same way.

    .venv/bin/python bench/fsdp_bytes.py --size 125m        # worlds 1 2 4
    .venv/bin/python bench/fsdp_bytes.py --size tiny --worlds 1,2

Columns: bytes per param summed over ranks (params, grads, state, host, their total), the
largest rank's MiB, and "vs alone": the total's ratio to the same policy's in one
process without FSDP2 (world "alone"; 1.00: FSDP2 costs no memory of its own). The
total is the measure, not the state: precis.fsdp keeps fp32 masters as the sharded
params. Under FSDP2, params whose rows are not whole 128-element blocks keep bf16
moments where the policy says fp16 / fp8 (docs/design.md section 5): the header gives
their share. torchao's 8-bit AdamW is not installed here; its row is left out.
"""
import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import SIZES, Block, Llama, num_params  # noqa: E402
from machine import cpu_model  # noqa: E402
from policies import FP8, FP16, REMAINDERS  # noqa: E402
from two_ranks import local_nbytes, run_world, save_result  # noqa: E402  (also puts precis on sys.path)

BF16 = torch.bfloat16
# name -> (optimizer, precis policy overrides; None: torch.optim.AdamW, fp32 params)
ROWS = {
    "torch AdamW (bf16 compute, fp32 params, moments)": ("torch", None),
    "precis bf16 default (fp32 masters, bf16 m, v)": ("precis", {}),
    "precis remainders (bf16 + int16, bf16 m, v)": ("precis", REMAINDERS),
    "precis fp16 m, v (fp32 masters)": ("precis", FP16),
    "precis fp8 m, v + remainders": ("precis", {**FP8, **REMAINDERS}),
    "precis fp8 m, v + remainders, offload": ("offload", {**FP8, **REMAINDERS}),
    "precis fp8 m, v + 8-bit remainders": ("precis", {**FP8, **REMAINDERS,
                                                        "param_remainder_bits": 8}),
}


def one_step(model, opt, cfg):
    tokens = torch.randint(cfg.vocab, (2, 33), generator=torch.Generator().manual_seed(0))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()


def counted(model, opt):
    """(params, grads, state, host) bytes held here (a DTensor: its local shard); host:
    what offload="cpu" keeps on the host (host copies, host grads, their state)."""
    params = list(model.parameters())
    offload = opt._books.offload if hasattr(opt, "_books") else None
    on_host = [offload is not None and offload.selected(p) for p in opt.state]
    state = [sum(local_nbytes(t) for t in s.values()) for s in opt.state.values()]
    host = sum(b for b, h in zip(state, on_host) if h)
    return (sum(local_nbytes(p) for p in params), sum(local_nbytes(p.grad) for p in params),
            sum(state) - host, host + (offload.host_bytes() if offload is not None else 0))


def make_optimizer(model, impl, policy):
    import precis.optim
    if impl == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return precis.optim.AdamW(model.parameters(), lr=1e-4, policy=policy,
                              offload="cpu" if impl == "offload" else False)


def run_rank(rank, world, port, name, size, out_dir):
    import precis.fsdp  # before init_process_group (docs/design.md section 5)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    impl, policy = ROWS[name]
    cfg = SIZES[size]
    model = Llama(cfg)
    if impl == "torch":
        mesh = init_device_mesh("cpu", (world,))
        mp_policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    else:
        precis.fsdp.fully_shard(model.to(BF16), policy=policy, units=(Block,))
    opt = make_optimizer(model, impl, policy)
    one_step(model, opt, cfg)
    sums = torch.tensor(counted(model, opt), dtype=torch.float64)
    largest = sums.sum().clone()
    dist.all_reduce(sums)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    dist.barrier()
    if rank == 0:
        save_result({"sums": sums.tolist(), "largest": float(largest)}, out_dir)
    dist.destroy_process_group()


def one_process(name, size):
    """(params, grads, state) bytes of the same step without FSDP2: precis on the bf16
    model, torch on the fp32 model (its usual mixed precision keeps fp32 params)."""
    import precis.optim  # noqa: F401
    impl, policy = ROWS[name]
    cfg = SIZES[size]
    model = Llama(cfg) if impl == "torch" else Llama(cfg).to(BF16)
    opt = make_optimizer(model, impl, policy)
    one_step(model, opt, cfg)
    return counted(model, opt)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="125m", choices=sorted(SIZES))
    ap.add_argument("--worlds", default="1,2,4")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    model = Llama(SIZES[args.size])
    numel = num_params(model)
    unscaled = sum(p.numel() for p in model.parameters()
                   if p.dim() < 2 or p[0].numel() % 128)
    print(f"bench/llama.py {args.size}: {numel:,} params ({100 * unscaled / numel:.2f}% in "
          f"rows that are not whole 128-element blocks), one FSDP2 unit per block, gloo, "
          f"1 thread per rank; {cpu_model()}")
    print(f"{'optimizer':<50} {'world':>6} {'params':>7} {'grads':>6} {'state':>6} "
          f"{'host':>6} {'total':>6} {'max rank MiB':>12} {'vs alone':>9}")
    for name in ROWS:
        alone = one_process(name, args.size)
        base = sum(alone) / numel
        rows = [("alone", list(alone), sum(alone))]
        rows += [(str(w), r["sums"], r["largest"]) for w in worlds
                 for r in [run_world(run_rank, w, name, args.size)]]
        for world, sums, largest in rows:
            per = [s / numel for s in sums]
            print(f"{name:<50} {world:>6} {per[0]:>7.3f} {per[1]:>6.3f} {per[2]:>6.3f} "
                  f"{per[3]:>6.3f} {sum(per):>6.3f} {largest / 2**20:>12.2f} "
                  f"{sum(per) / base:>9.4f}")


if __name__ == "__main__":
    main()
