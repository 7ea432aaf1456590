"""Torch operations a gradient-release hook makes (precis.optim.release_gradients), per
configuration: on a GPU each is a kernel launch (or a read back) a param, so their count
bounds how fast a released backward can go once nothing waits. Counted with a
TorchDispatchMode while the hooks run (views included), averaged over the hooks of one
backward of four bf16 params (sizes 127, 4097, 33, 1000; AdamW, default policy), the
first hook's fingerprint compare included; on the CPU a capturable release takes the
host's path (docs/design.md section 11.1), so its device path is counted on a GPU.

    .venv/bin/python bench/release_ops.py [--device cuda]
"""
import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import precis.optim as optim
from precis import release

SIZES = (127, 4097, 33, 1000)


class Counter(TorchDispatchMode):
    """Counts the operations dispatched while `inside` is set."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.inside
        return func(*args, **(kwargs or {}))


def ops_a_hook(device, capturable, max_norm, grad_scale):
    params = [torch.nn.Parameter(torch.randn(n, device=device).bfloat16()) for n in SIZES]
    opt = optim.AdamW(params, lr=1e-3, capturable=capturable)
    handle = optim.release_gradients(opt, max_norm=max_norm, grad_scale=grad_scale)
    counter = Counter()
    real = release.GradientRelease._on_grad

    def on_grad(self, p):
        counter.inside = True
        try:
            return real(self, p)
        finally:
            counter.inside = False

    def backward():
        sum((p.float() * torch.randn(p.shape, device=device)).sum() for p in params).backward()
        opt.step()
    for _ in range(3):  # past the first steps (state made, shares known)
        backward()
    release.GradientRelease._on_grad = on_grad
    try:
        with counter:
            backward()
    finally:
        release.GradientRelease._on_grad = real
        handle.remove()
    return counter.count / len(params)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(f"device: {args.device}, torch {torch.__version__}")
    print(f"{'capturable':>10} {'max_norm':>8} {'grad_scale':>10} {'ops a hook':>10}")
    for capturable in (True, False):
        for max_norm in (1.0, None):
            for grad_scale in (None, 8.0):
                n = ops_a_hook(args.device, capturable, max_norm, grad_scale)
                print(f"{capturable!s:>10} {max_norm!s:>8} {grad_scale!s:>10} {n:>10.1f}")


if __name__ == "__main__":
    main()
