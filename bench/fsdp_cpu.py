"""FSDP2 (torch's fully_shard, ZeRO-3) with precis.optim against FSDP2 with torch.optim.AdamW:
2 processes on CPU (gloo over loopback), the same MLP (one FSDP2 unit per Linear), 2
micro-batches per step, each reduce-scattered (FSDP2's default).

For each configuration it prints the time per step and of the optimizer step alone
(median over the measured steps of rank 0; with --repeats, every configuration is run
that many times, interleaved, and the median and range of the medians are shown), its
ratio to the torch row of the same compute dtype ("vs torch", > 1 = faster; torch.optim.AdamW
in its fastest mode here, chosen per run), the bytes sent per step and rank, and the
state of each rank:

  payload   bytes per rank of the tensors FSDP2 hands to its collectives (all-gather
            outputs + reduce-scatter inputs, counted by wrapping torch.distributed's
            all_gather_single / reduce_scatter_single; each rank sends (W-1)/W of it)
  wire      bytes actually sent over loopback per rank, from /proc/net/dev
  state     bytes of this rank's local shards of the params, their gradients and the
            optimizer state, from the tensors allocated (max over ranks)

The optimizer step itself against a reference loop moving the same bytes is
bench/adam_cpu.py's subject; here it is one part of a sharded training step.

    .venv/bin/python bench/fsdp_cpu.py --repeats 3     # the table of bench/RESULTS.md
    .venv/bin/python bench/fsdp_cpu.py --width 512 --steps 5   # quicker

Needs libprecis.so and libprecis_torch.so (bazel build //:libprecis.so
//:libprecis_torch.so, or PRECIS_LIBRARY=... and PRECIS_TORCH_LIBRARY=...).
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn as nn

from machine import cpu_model
from two_ranks import add_arguments, lo_tx_bytes, local_nbytes, make_mlp, mb, run_config

# name -> (optimizer, model dtype, precis policy overrides or None)
CONFIGS = {
    "FSDP2 + torch AdamW (fp32)": ("torch", torch.float32, None),
    "FSDP2 + precis AdamW (fp32)": ("precis", torch.float32, None),
    "FSDP2 bf16 + torch AdamW (fp32 params and moments)": ("torch", torch.bfloat16, None),
    "precis.fsdp bf16 (fp32 masters as params + bf16 moments)": ("precis", torch.bfloat16, {}),
    "precis.fsdp bf16 (bf16 params + int16 remainders + bf16 moments)": (
        "precis", torch.bfloat16, {"store_param_remainders": True}),
}
TORCH_MODES = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
               "fused": dict(fused=True)}


def shard(model, dtype, policy, world):
    """precis.fsdp for precis rows with a policy; torch's fully_shard otherwise (bf16
    compute with fp32 sharded params: torch's usual mixed precision)."""
    import precis.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if policy is not None:
        return precis.fsdp.fully_shard(model.to(dtype), policy=policy, units=(nn.Linear,))
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) \
        if dtype != torch.float32 else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def run_rank(rank, world, port, name, args, out_dir):
    import precis.optim  # before init_process_group (docs/design.md section 5)
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    impl, dtype, policy = CONFIGS[name]
    model = shard(make_mlp(args), dtype, policy, world)
    if impl == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **TORCH_MODES[args.torch_mode])
    else:
        opt = precis.optim.AdamW(model.parameters(), lr=1e-4)
    payload = [0]
    real = {op: getattr(dist, op) for op in ("all_gather_single", "reduce_scatter_single")}

    def counting(op):
        def call(*a, **kw):
            key, pos = ("output", 0) if op == "all_gather_single" else ("input", 1)
            t = kw[key] if key in kw else a[pos]
            payload[0] += t.numel() * t.element_size()
            return real[op](*a, **kw)
        return call

    for op in real:
        setattr(dist, op, counting(op))
    gen = torch.Generator().manual_seed(rank)
    per_micro = args.batch // world // args.micro
    micro = [(torch.randn(per_micro, args.inputs, generator=gen),
              torch.randn(per_micro, args.inputs, generator=gen)) for _ in range(args.micro)]
    opt_times = []

    def step():
        for x, y in micro:
            loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt_times.append(time.perf_counter() - t0)

    for _ in range(args.warmup):
        step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    opt_times.clear()
    payload[0] = 0
    tx0 = lo_tx_bytes()
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step()
        if i < args.steps - 1:
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    tx1 = lo_tx_bytes()
    params = list(model.parameters())
    state = sum(local_nbytes(p) + local_nbytes(p.grad) for p in params)
    state += sum(local_nbytes(t) for s in opt.state.values() for t in s.values())
    torch.save({"times": times, "opt_times": opt_times, "payload": payload[0] / args.steps,
                "wire": (tx1 - tx0) / args.steps / world, "state": state,
                "numel": sum(p.numel() for p in params)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank tears gloo down while another still sends (it aborts)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap, CONFIGS)
    args = ap.parse_args()

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    runs = {name: [] for name in names}
    torch_modes = {}  # torch row -> its fastest mode (by optimizer time, first repeat)
    for rep in range(args.repeats):  # interleaved, so drifting load hits all alike
        for name in names:
            if CONFIGS[name][0] == "torch":
                if rep == 0:
                    best = None
                    for mode in TORCH_MODES:
                        args.torch_mode = mode
                        ranks = run_config(run_rank, name, args)
                        t = statistics.median(ranks[0]["opt_times"])
                        if best is None or t < best[0]:
                            best = (t, mode, ranks)
                    torch_modes[name] = best[1]
                    runs[name].append(best[2])
                    continue
                args.torch_mode = torch_modes[name]
            runs[name].append(run_config(run_rank, name, args))
    rows = {}
    for name in names:
        ms = [statistics.median(ranks[0]["times"]) * 1e3 for ranks in runs[name]]
        opt_ms = [statistics.median(ranks[0]["opt_times"]) * 1e3 for ranks in runs[name]]
        last = runs[name][-1]
        rows[name] = (ms, opt_ms, last[0]["payload"], sum(r["wire"] for r in last) / 2,
                      max(r["state"] for r in last), last[0]["numel"])
    cpu = cpu_model()
    numel = next(iter(rows.values()))[5]
    print(f"# {numel / 1e6:.2f}M-param MLP (width {args.width}, depth {args.depth}), "
          f"global batch {args.batch} in {args.micro} micro-batches, 2 ranks x 1 thread, gloo "
          f"over loopback; torch {torch.__version__}; {os.cpu_count()} CPUs ({cpu}); "
          f"median of {args.steps} steps after {args.warmup} warm-up, {args.repeats} run(s); "
          f"torch AdamW mode: {', '.join(f'{n}: {m}' for n, m in torch_modes.items())}")
    print("| configuration | ms/step (range) | vs torch | optimizer ms (range) | vs torch "
          "| payload MB/step/rank | wire MB/step/rank | state MB/rank | state B/param/rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        ms, opt_ms, payload, wire, state, _ = rows[name]
        torch_row = next((n for n in names if CONFIGS[n][0] == "torch"
                          and CONFIGS[n][1] == CONFIGS[name][1]), None)

        def ratio(i, values):
            if torch_row is None:
                return "-"
            return f"{statistics.median(rows[torch_row][i]) / statistics.median(values):.2f}x"

        def cell(values):
            spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
            return f"{statistics.median(values):.1f}{spread}"

        print(f"| {name} | {cell(ms)} | {ratio(0, ms)} | {cell(opt_ms)} | {ratio(1, opt_ms)} "
              f"| {mb(payload)} | {mb(wire)} | {mb(state)} | {state / numel:.2f} |")


if __name__ == "__main__":
    main()
