"""What the device path's step costs against the CPU's, on the CPU: a precis AdamW step
of bf16 params as the CPU path takes it (fingerprints compared on the host by one C
call, the kernel recording what it writes) and as a GPU's path takes it
(PRECIS_DEVICE_PATH_ON_CPU=1: the params compared with their records and the flagged
masters resynced by the step's own op call, adam_step_flat_'s fingerprints [out,
records, kept], on the device, nothing read back: the default), and that path with the host's compare (PRECIS_COMPARE_ON_DEVICE=0:
the fingerprints read back). Neither waits for a device here, so the difference is the
device path's extra launches and passes, in the CPU's kernels: an upper bound of what
they add on a GPU. Rows in turns, --repeat rounds after 2; each row's best ms.

    PYTHONPATH=torch_ext .venv/bin/python bench/device_path.py [--numel 8000003]
        [--tensors 4] [--threads 1] [--repeat 8]
"""
import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import machine  # noqa: E402
import precis  # noqa: E402

POLICIES = {"bf16 default (fp32 master)": None,
            "bf16 int16 remainders": {"store_param_remainders": True}}
# (PRECIS_DEVICE_PATH_ON_CPU, PRECIS_COMPARE_ON_DEVICE) of each column
PATHS = {"CPU path": ("0", "0"), "device path, compare on the host": ("1", "0"),
         "device path, compare on the device": ("1", "1")}


def make(numel, tensors, policy):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // tensors + i, generator=gen)
                                 .to(torch.bfloat16)) for i in range(tensors)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    kwargs = {} if policy is None else {"policy": policy}
    return precis.optim.AdamW(params, lr=1e-4, **kwargs)


def step_ms(opt, path):
    # both read at every step
    os.environ["PRECIS_DEVICE_PATH_ON_CPU"], os.environ["PRECIS_COMPARE_ON_DEVICE"] = path
    start = time.perf_counter()
    opt.step()
    return (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=8_000_003)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {machine.cpu_model()}; torch {torch.__version__}, {args.threads} "
          f"thread(s); {args.numel:,} bf16 params in {args.tensors} tensors, AdamW")
    print("| policy | CPU path ms | device path, host compare ms | device path (default) ms | "
          "host compare / CPU | device path / CPU |")
    print("|---|---|---|---|---|---|")
    for name, policy in POLICIES.items():
        # one optimizer a path: a Plan keeps the path it was made on
        opts = {path: make(args.numel, args.tensors, policy) for path in PATHS.values()}
        best = {path: float("inf") for path in PATHS.values()}
        for r in range(2 + args.repeat):
            for path, opt in opts.items():
                ms = step_ms(opt, path)
                if r >= 2:
                    best[path] = min(best[path], ms)
        cpu, device, compare = best.values()
        print(f"| {name} | {cpu:.2f} | {device:.2f} | {compare:.2f} | {device / cpu:.2f}x | "
              f"{compare / cpu:.2f}x |")
    os.environ.pop("PRECIS_DEVICE_PATH_ON_CPU")
    os.environ.pop("PRECIS_COMPARE_ON_DEVICE")


if __name__ == "__main__":
    main()
