"""Pieces shared by the multi-process CPU benchmarks (ddp_cpu.py, fsdp_cpu.py,
fsdp_bytes.py, fsdp_train_llm.py): the MLP and its arguments, running one configuration
in spawned gloo ranks, loopback bytes. Not a benchmark itself."""
import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp
import torch.nn as nn

# The precis package, for the benchmarks' ranks (spawned children inherit sys.path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))


def add_arguments(ap, configs):
    """The command-line options both benchmarks take."""
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6, help="hidden width x width layers")
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="global batch (both ranks)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every configuration")
    ap.add_argument("--configs", default=",".join(configs),
                    help="comma-separated names (default: all)")


def make_mlp(args):
    torch.manual_seed(0)
    layers = [nn.Linear(args.inputs, args.width), nn.GELU()]
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    layers.append(nn.Linear(args.width, args.inputs))
    return nn.Sequential(*layers)


def lo_tx_bytes():
    """Bytes sent on the loopback interface so far (all processes)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_result(result, out_dir):
    """Rank 0's result for run_world, written whole or not at all (another rank's
    abort may stop this process)."""
    path = os.path.join(out_dir, "result.pt")
    torch.save(result, path + ".part")
    os.replace(path + ".part", path)


def run_world(run_rank, world, *args):
    """run_rank(rank, world, port, *args, out_dir) in `world` spawned processes (one
    OpenMP thread each), of which rank 0 saves its result with save_result after a
    barrier. Returns that result. gloo's teardown sometimes aborts a rank once every
    rank is done ("terminate called without an active exception"): with the result
    saved, that is no failure."""
    with tempfile.TemporaryDirectory() as out_dir:
        os.environ["OMP_NUM_THREADS"] = "1"
        result = os.path.join(out_dir, "result.pt")
        try:
            mp.start_processes(run_rank, args=(world, free_port(), *args, out_dir),
                               nprocs=world, start_method="spawn")
        except mp.ProcessExitedException:
            if not os.path.exists(result):
                raise
        return torch.load(result)


def run_config(run_rank, name, args):
    """run_rank(rank, 2, port, name, args, out_dir) in 2 spawned processes (one OpenMP
    thread each); each saves its results to out_dir/rank{r}.pt. Returns them by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        os.environ["OMP_NUM_THREADS"] = "1"
        mp.start_processes(run_rank, args=(2, free_port(), name, args, out_dir), nprocs=2,
                           start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


def local_nbytes(t):
    """Bytes this rank holds of t: a DTensor's local shard, a plain tensor whole, 0 for
    None or a non-tensor (e.g. an int step)."""
    if not isinstance(t, torch.Tensor):
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def mb(x):
    return f"{x / 2**20:.1f}"
