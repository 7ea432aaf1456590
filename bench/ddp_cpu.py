"""precis.ddp against torch.nn.parallel.DistributedDataParallel + torch.optim.AdamW:
2 processes on CPU (gloo over loopback), the same MLP, 2 micro-batches per step.
precis rows attach precis.optim.AdamW to the wrapper (precis.ddp.attach_optimizer),
so step() syncs the gradients, steps this rank's shard and all-gathers the params.

For each configuration it prints the time per step (median over the measured
steps of rank 0; with --repeats, every configuration is run that many times,
interleaved, and the median and range of those medians are shown: a 2-core
machine is noisy), the bytes sent per step and rank, and the memory of each rank:

  payload   bytes per rank handed to collectives (precis: counted by the wrapper;
            torch DDP: its fp32 gradient buckets, one all-reduce per step)
  wire      bytes actually sent over loopback per rank, from /proc/net/dev (all
            processes on the interface, halved; what gloo's own algorithms add
            is included)
  state     bytes of params + gradient buffers + optimizer state of one rank,
            from the tensors allocated (max over ranks)
  peak RSS  peak resident memory of a rank above its RSS before the model was
            built (max over ranks)

    .venv/bin/python bench/ddp_cpu.py --repeats 3     # the table of bench/RESULTS.md
    .venv/bin/python bench/ddp_cpu.py --width 512 --steps 5   # quicker

Needs libprecis.so and libprecis_torch.so (bazel build //:libprecis.so
//:libprecis_torch.so, or PRECIS_LIBRARY=... and PRECIS_TORCH_LIBRARY=...).
"""
import argparse
import contextlib
import datetime
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from machine import cpu_model
from two_ranks import add_arguments, lo_tx_bytes, local_nbytes, make_mlp, mb, run_config

# name -> (implementation, model dtype, sharding)
CONFIGS = {
    "torch DDP + torch AdamW (fp32)": ("torch", torch.float32, None),
    "precis no_shard (fp32)": ("precis", torch.float32, "no_shard"),
    "precis optim (fp32)": ("precis", torch.float32, "optim"),
    "precis optim_grads (fp32)": ("precis", torch.float32, "optim_grads"),
    "precis no_shard (bf16)": ("precis", torch.bfloat16, "no_shard"),
    "precis optim (bf16)": ("precis", torch.bfloat16, "optim"),
    "precis optim_grads (bf16)": ("precis", torch.bfloat16, "optim_grads"),
}


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_rank(rank, world, port, name, args, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    impl, dtype, sharding = CONFIGS[name]
    base_rss = rss_bytes()
    model = make_mlp(args).to(dtype)
    if impl == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    else:
        import precis.ddp
        import precis.optim
        ddp = precis.ddp.DistributedDataParallel(model, sharding=sharding)
        opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(rank)
    per_micro = args.batch // world // args.micro
    micro = [(torch.randn(per_micro, args.inputs, generator=gen).to(dtype),
              torch.randn(per_micro, args.inputs, generator=gen)) for _ in range(args.micro)]

    def step():
        for i, (x, y) in enumerate(micro):
            with ddp.no_sync() if i < args.micro - 1 else contextlib.nullcontext():
                loss = ((ddp(x).float() - y) ** 2).mean()
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    dist.barrier()
    payload0 = sum(ddp.comm_bytes.values()) if impl == "precis" else 0
    tx0 = lo_tx_bytes()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    tx1 = lo_tx_bytes()
    if impl == "precis":
        payload = (sum(ddp.comm_bytes.values()) - payload0) / args.steps
    else:  # torch DDP all-reduces its fp32 gradient buckets once per step
        payload = sum(local_nbytes(p) for p in model.parameters())
    # Persistent tensors of this rank: params, gradient buffers, optimizer state.
    state = sum(local_nbytes(p) for p in model.parameters())
    if impl == "precis":
        b = ddp.buffer_bytes()
        state += b["grad"] + b["grad_shard"]  # the sharded param buffer *is* the params
    else:  # DDP's fp32 buckets, which the grads are views of (freed grads leave them)
        state += sum(local_nbytes(p) for p in model.parameters())
    for s in opt.state.values():
        state += sum(local_nbytes(t) for t in s.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    torch.save({"times": times, "payload": payload, "wire": (tx1 - tx0) / args.steps / world,
                "state": state, "peak": peak,
                "numel": sum(p.numel() for p in model.parameters())},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank tears gloo down while another still sends (it aborts)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap, CONFIGS)
    args = ap.parse_args()

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    runs = {name: [] for name in names}
    for _ in range(args.repeats):  # interleaved, so drifting load hits all alike
        for name in names:
            runs[name].append(run_config(run_rank, name, args))
    rows = []
    for name in names:
        ms = [statistics.median(ranks[0]["times"]) * 1e3 for ranks in runs[name]]
        last = runs[name][-1]
        rows.append((name, ms, last[0]["payload"], sum(r["wire"] for r in last) / 2,
                     max(r["state"] for r in last),
                     max(r["peak"] for ranks in runs[name] for r in ranks), last[0]["numel"]))
    cpu = cpu_model()
    print(f"# {rows[0][6] / 1e6:.2f}M-param MLP (width {args.width}, depth {args.depth}), "
          f"global batch {args.batch} in {args.micro} micro-batches, 2 ranks x 1 thread, gloo "
          f"over loopback; torch {torch.__version__}; {os.cpu_count()} CPUs ({cpu}); "
          f"median of {args.steps} steps after {args.warmup} warm-up, {args.repeats} run(s)")
    print("| configuration | ms/step (range) | payload MB/step/rank | wire MB/step/rank "
          "| state MB/rank | peak RSS MB/rank |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ms, payload, wire, state, peak, _ in rows:
        spread = f" ({min(ms):.0f}-{max(ms):.0f})" if len(ms) > 1 else ""
        print(f"| {name} | {statistics.median(ms):.0f}{spread} | {mb(payload)} | {mb(wire)} "
              f"| {mb(state)} | {mb(peak)} |")


if __name__ == "__main__":
    main()
