"""CPU benchmark of the precis fused Adam/AdamW step against torch.optim.AdamW.

For each policy and model size it times optimizer.step() on the same tensors and
prints one table row: parameters per second, achieved GB/s (from the bytes each
policy must move per parameter, DESIGN.md section 7), that as a fraction of the
copy bandwidth measured in the same run, and the speed-up over the fastest mode of
torch.optim.AdamW (for-loop or foreach) on the fp32 version of the same tensors.

    PYTHONPATH=torch_ext /usr/bin/python3 bench/adam_cpu.py [--sizes 1e6,1e7,5e7] [--repeat 5]
"""
import argparse
import os
import platform
import time

import torch

import precis

# name -> (param and grad dtype, policy overrides, bytes moved per parameter)
# Bytes: fp32: read p, g, m, v + write p, m, v = 7 x 4 = 28.
# bf16 default: read g 2, master 4, m 2, v 2; write param 2, master 4, m 2, v 2 = 20.
# remainders: read g 2, param 2, remainder 2, m 2, v 2; write param, remainder, m, v = 18.
# fp8 moments (fp32 master): read g 2, master 4, m 1, v 1; write param 2, master 4,
#   m 1, v 1; plus one fp32 scale per 128 elements for m and v, read and written = 16.125.
POLICIES = {
    "fp32": (torch.float32, {}, 28.0),
    "bf16 default": (torch.bfloat16, {}, 20.0),
    "bf16 remainders": (torch.bfloat16, {"store_param_remainders": True}, 18.0),
    "bf16 fp8 moments": (torch.bfloat16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"},
                         16.0 + 4 * 4 / 128),
}
TORCH_BYTES = 28.0  # torch.optim.AdamW on fp32 tensors


def tensor_sizes(total, seed=0):
    """Mixed tensor sizes like a transformer's (large matrices, small vectors)."""
    g = torch.Generator().manual_seed(seed)
    sizes, left = [], int(total)
    while left > 0:
        kind = int(torch.randint(10, (1,), generator=g))
        if kind < 6:
            n = int(torch.randint(200_000, 4_000_000, (1,), generator=g))
        elif kind < 9:
            n = int(torch.randint(1_000, 50_000, (1,), generator=g))
        else:
            n = int(torch.randint(1, 1_000, (1,), generator=g))
        n = min(n, left)
        sizes.append(n)
        left -= n
    return sizes


def make_params(sizes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.randn(n, generator=g).to(dtype).requires_grad_()
        p.grad = (torch.randn(n, generator=g) * 1e-2).to(dtype)
        params.append(p)
    return params


def time_steps(optimizer, repeat):
    optimizer.step()  # allocate state outside the timing
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(nbytes=512 << 20, repeat=5):
    """GB/s of a large tensor copy (bytes read + bytes written)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def torch_adamw_time(sizes, repeat):
    """Fastest of torch.optim.AdamW's modes available on CPU, on fp32 tensors."""
    results = {}
    for mode in ("for-loop", "foreach"):
        params = make_params(sizes, torch.float32)
        kwargs = {"foreach": mode == "foreach"}
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kwargs)
        except TypeError:  # a torch without the foreach flag
            continue
        results[mode] = time_steps(opt, repeat)
    mode = min(results, key=results.get)
    return mode, results[mode]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,5e7", help="total parameters, comma-separated")
    ap.add_argument("--small-tensors", type=int, default=2000,
                    help="also 2,000 tensors of 1,000 elements (0: skip)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    bandwidth = copy_bandwidth()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, precis {precis.__version__}, CPU ISA "
          f"{precis.cpu_isa()}")
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s (read + write, best of 5)\n")

    cases = [(f"{float(s) / 1e6:g}M mixed", tensor_sizes(float(s))) for s in args.sizes.split(",")]
    if args.small_tensors:
        cases.append((f"{args.small_tensors} x 1000", [1000] * args.small_tensors))
    header = (f"{'case':<14} {'policy':<17} {'ms/step':>9} {'Mparam/s':>9} {'GB/s':>7} "
              f"{'of copy':>8} {'torch ms':>9} {'torch mode':>10} {'vs torch':>9}")
    print(header)
    print("-" * len(header))
    for case, sizes in cases:
        numel = sum(sizes)
        torch_mode, torch_s = torch_adamw_time(sizes, args.repeat)
        for name in args.policies.split(","):
            dtype, overrides, nbytes = POLICIES[name]
            params = make_params(sizes, dtype)
            opt = precis.optim.AdamW(params, lr=1e-3, weight_decay=0.01, policy=overrides)
            seconds = time_steps(opt, args.repeat)
            gbs = numel * nbytes / seconds / 1e9
            print(f"{case:<14} {name:<17} {seconds * 1e3:>9.2f} {numel / seconds / 1e6:>9.1f} "
                  f"{gbs:>7.1f} {gbs / bandwidth:>7.0%} {torch_s * 1e3:>9.2f} {torch_mode:>10} "
                  f"{torch_s / seconds:>8.2f}x")
            del params, opt
    print(f"\nbytes per parameter: " + ", ".join(f"{k} {v[2]:g}" for k, v in POLICIES.items())
          + f"; torch fp32 AdamW {TORCH_BYTES:g}")


if __name__ == "__main__":
    main()
