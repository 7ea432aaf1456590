"""Benchmark: precis.optim.AdamW with offload="cpu" (precis.offload) against the same
optimizer stepping on the params' device, and (with a GPU) against torch.optim.AdamW
stepping hand-made CPU copies of the params.

CPU section (always): params on the CPU, offloaded (host copies separate from the
params, as on a GPU) or not, for the fp32 and default bf16 policies on a
transformer-like set of tensors (bench/adam_cuda.py's model_sizes) of --cpu-size
params. What it shows is the cost of the offload's bookkeeping and copies (grad to
host copy, host copy to param) on top of the same kernel, with the host copies
stepped in one op call ("1 piece") and pipelined in precis.offload.BUCKETS pieces
(on the CPU the copies are synchronous, so this row shows the pieces' cost, not
an overlap). Checked first: the three runs end with the same bits.

verify_grads (both sections): the check at step() that the grads the backward
hooks copied are unchanged (Offload.verify_grads: an integer sum of each grad's
bits), for all grads of the model, median ms of --iters. On the CPU also for 2000
grads of 1000 elements, where the per-grad work (on a GPU: a launch per grad) shows.

GPU section (when CUDA is available): a bf16 model of --gpu-size params (default
1B), the default policy (fp32 master, bf16 moments):
  * precis on the device: precis.optim.AdamW, state on the GPU;
  * precis offload: offload="cpu", grads set before step() (so step() copies them to
    the host: no overlap with a backward; the hooks would copy them during backward),
    the CPU step with the fused kernel, the params copied back; step() then returns
    with the copies queued: the time is taken after torch.cuda.synchronize(). In
    one piece (grads all copied, one CPU call, all params copied back) and pipelined
    (each piece waits for its own grads and is copied back while the next is stepped);
  * torch naive: torch.optim.AdamW(foreach=True) on fp32 CPU copies of the params
    (master weights), grads copied into fp32 CPU buffers, params copied back
    (non-pinned, synchronous), as a hand-written offload does it.
Columns: ms per step (median of --iters after a warm-up step; on the CPU the rows
of a policy take turns, step by step), GPU MiB held by the
optimizer (params and grads excluded), CPU GiB of optimizer buffers. Checked first
at 1M params: offload vs on-device precis and vs torch naive agree within bf16
rounding after 3 steps (the CPU and CUDA kernels may differ in the last bits of
sqrt); a disagreement exits with status 1 before any timing.

    .venv/bin/python bench/offload.py [--cpu-size 2e7] [--gpu-size 1e9] [--iters 5]
        [--threads N]

(torch_ext/ is put on sys.path; the libraries are found as the package finds them.)
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))
sys.path.insert(0, HERE)

from adam_cuda import model_sizes  # noqa: E402
from precis import offload, optim  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(sizes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(device=device,
                                                                       dtype=dtype))
            for n in sizes]


def set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.numel(), generator=g) * 1e-3).to(device=p.device,
                                                                  dtype=p.dtype)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(steps, device, iters):
    """Median ms per call of each of steps, taking turns (a load that comes and goes
    on a shared machine hits every row alike), after one warm-up call each (state
    allocated, host copies made)."""
    times = [[] for _ in steps]
    for i in range(iters + 1):
        for row, step in zip(times, steps):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            if i:
                row.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(row) for row in times]


class TorchNaive:
    """torch.optim.AdamW on fp32 CPU copies: grads copied over, params copied back."""

    def __init__(self, params):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float().cpu()) for p in params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        self.opt = torch.optim.AdamW(self.masters, foreach=True, **HP)

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad.copy_(p.grad)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def host_bytes(self):
        return sum(m.numel() * 4 * 2 for m in self.masters) + sum(
            t.numel() * t.element_size() for s in self.opt.state.values()
            for t in s.values() if isinstance(t, torch.Tensor) and t.dim())


def host_bytes(opt):
    """Bytes of the offload's host copies, host grads and the state on the CPU."""
    total = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    off = opt._books.offload
    if off is not None:
        total += sum(t.numel() * t.element_size() for t in
                     list(off._host.values()) + list(off._grad.values()))
    return total


PIPELINED = f"offload {offload.BUCKETS} pieces"
OFFLOAD_ROWS = {"offload 1 piece": 1, PIPELINED: offload.BUCKETS}  # row -> pieces
ROWS = ("on device", *OFFLOAD_ROWS, "torch naive")  # the GPU section's


def run(kind, params):
    """A stepper of the row `kind` over params (grads set by the caller)."""
    if kind == "torch naive":
        return TorchNaive(params)
    opt = optim.AdamW(params, offload=kind in OFFLOAD_ROWS, **HP)
    if kind in OFFLOAD_ROWS:
        opt._books.offload.buckets = OFFLOAD_ROWS[kind]
    return opt


def check_cpu(sizes, dtype):
    """Offloaded (one piece, pipelined) and on-device CPU runs: the same bits after
    3 steps."""
    out = []
    for kind in ROWS[:-1]:
        params = make_params(sizes, dtype, "cpu")
        opt = run(kind, params)
        for s in range(3):
            set_grads(params, s)
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        out.append(flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()]))
    return all(torch.equal(out[0], o) for o in out[1:])


def verify_ms(params, iters):
    """Offload.verify_grads over params' grads (after what the backward hooks do:
    copy each grad, note its bit sum); median ms of iters."""
    device = params[0].device
    off = run(PIPELINED, params)._books.offload

    def check():
        for p in params:
            off.grad_ready(p)
        sync(device)
        t0 = time.perf_counter()
        off.verify_grads()
        sync(device)
        assert len(off._grad_copied) == len(params)  # none taken for changed
        return (time.perf_counter() - t0) * 1e3

    return statistics.median([check() for _ in range(iters + 1)][1:])


def print_verify(name, params, iters):
    print(f"{name:<8}{'verify_grads':<22}{verify_ms(params, iters):>10.2f} ms"
          f"  ({len(params)} grads)")


def cpu_section(args):
    device = torch.device("cpu")
    sizes = model_sizes(int(float(args.cpu_size)))
    print(f"\nCPU: {sum(sizes) / 1e6:.1f}M params in {len(sizes)} tensors, "
          f"{torch.get_num_threads()} threads")
    header = f"{'policy':<8}{'row':<22}{'ms/step':>10}{'vs on device':>14}"
    print(header + "\n" + "-" * len(header))
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if not check_cpu(model_sizes(1_000_000), dtype):
            print(f"bench/offload.py: offloaded and on-device CPU runs differ ({name})",
                  file=sys.stderr)
            return 1
        opts = []
        for kind in ROWS[:-1]:
            params = make_params(sizes, dtype, device)
            set_grads(params, 0)
            opts.append(run(kind, params))
        times = median_ms([opt.step for opt in opts], device, args.iters)
        for kind, ms in zip(ROWS[:-1], times):
            print(f"{name:<8}{kind:<22}{ms:>10.1f}{times[0] / ms:>13.2f}x")
        del opts, params
    for many in (sizes, [1000] * 2000):  # the model; many small grads (dispatch bound)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            params = make_params(many, dtype, device)
            set_grads(params, 0)
            print_verify(name, params, args.iters)
    return 0


def check_gpu(device):
    """1M params, 3 steps: offload vs on-device vs torch naive within bf16 rounding."""
    sizes = model_sizes(1_000_000)
    out = {}
    for kind in ROWS:
        params = make_params(sizes, torch.bfloat16, device)
        opt = run(kind, params)
        for s in range(3):
            set_grads(params, s)
            opt.step()
        sync(device)
        out[kind] = torch.cat([p.detach().float().reshape(-1) for p in params]).cpu()
    ref = out["on device"]
    for kind in ROWS[1:]:
        err = ((out[kind] - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
        print(f"check: {kind} vs on device, largest relative difference {err:.2e}")
        if err > 2 ** -6:  # two bf16 ulps
            return False
    return True


def gpu_section(args):
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"\nGPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads")
    if not check_gpu(device):
        print("bench/offload.py: the offloaded step disagrees with the on-device step",
              file=sys.stderr)
        return 1
    sizes = model_sizes(int(float(args.gpu_size)))
    print(f"bf16 model: {sum(sizes) / 1e9:.2f}B params in {len(sizes)} tensors, default "
          f"policy (fp32 master, bf16 moments)")
    header = f"{'row':<22}{'ms/step':>10}{'vs on device':>14}{'GPU MiB':>10}{'CPU GiB':>10}"
    print(header + "\n" + "-" * len(header))
    params = make_params(sizes, torch.bfloat16, device)
    set_grads(params, 0)
    base = None
    for kind in ROWS:  # one at a time: the optimizers' GPU memory is measured
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        opt = run(kind, params)
        ms, = median_ms([opt.step], device, args.iters)
        gpu_mib = (torch.cuda.memory_allocated(device) - before) / 2 ** 20
        cpu_gib = (opt.host_bytes() if kind == "torch naive" else host_bytes(opt)) / 2 ** 30
        base = base or ms
        print(f"{kind:<22}{ms:>10.1f}{base / ms:>13.2f}x{gpu_mib:>10.0f}{cpu_gib:>10.1f}")
        del opt
    print_verify("bf16", params, args.iters)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-size", default="2e7")
    ap.add_argument("--gpu-size", default="1e9")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for the CPU work (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    status = cpu_section(args)
    if status == 0 and torch.cuda.is_available():
        status = gpu_section(args)
    elif not torch.cuda.is_available():
        print("\n(no CUDA device: GPU section skipped)")
    return status


if __name__ == "__main__":
    sys.exit(main())
