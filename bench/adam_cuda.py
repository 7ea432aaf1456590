"""Benchmark: the CUDA fused Adam/AdamW step (torch.ops.precis.adam_step_ on CUDA
tensors: the glue's CUDA kernel, precis_cuda_step) per policy and size.

For fp32, the default bf16 policy (fp32 master, bf16 moments), bf16 params + int16
remainders, fp8 moments (fp32 master), and fp8 moments with int16 remainders and with
8-bit corrections, at 10M, 100M and 1B params spread over the tensors of
a transformer-like model (mixed sizes, odd ones among them):

* time per step (CUDA events): the step captured in a CUDA graph and replayed (the
  GPU time of the kernels; lr and step are device tensors) and called eagerly (with
  the overhead of the Python wrapper, the dispatcher and the glue's argument checks);
* achieved bandwidth: the bytes the step must move (read from its tensors:
  moved_bytes, docs/design.md section 7) / time, as a fraction of a device-to-device
  copy measured in the same run;
* torch.optim.AdamW(fused=True) on the same param tensors (in their dtype, with its
  own fp32/bf16 state), timed the same two ways where torch can capture it, and
  the ratio torch time / precis time (> 1: precis is faster; graph vs graph);
* precis.optim.AdamW (eager, the optimizer's Python bookkeeping included) with the
  policy of the row, on the same params: what a training loop without graphs pays.

Run: python3 bench/adam_cuda.py [--sizes 10M,100M,1B] [--configs fp32,bf16,...]
     [--iters 20] [--tensors N]. --tensors spreads each size over about N tensors (the
same layer shapes, more and narrower layers: per-tensor costs, several launches per
step) instead of the model's own count. Prints a table; asserts nothing. Without a CUDA device it says so and
exits with status 1. The libraries are found as the package finds them
($PRECIS_LIBRARY, $PRECIS_TORCH_LIBRARY, else beside the package or in bazel-bin).
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))

from precis import ops, optim  # noqa: E402

F32, F16, BF16, FP8, I16 = torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int16
U8 = torch.uint8  # 8-bit corrections of a bf16 param (param_remainder_bits=8)

# name -> (param, grad, master ("own", "remainders", "remainders8" or a dtype), exp_avg,
#          exp_avg_sq); the bytes a step moves are read from the tensors (moved_bytes).
# POLICIES: the precis.optim policy overrides giving the same state dtypes.
CONFIGS = {
    "fp32": (F32, F32, "own", F32, F32),
    "bf16": (BF16, BF16, F32, BF16, BF16),
    "remainders": (BF16, BF16, "remainders", BF16, BF16),
    "fp8": (BF16, BF16, F32, FP8, FP8),
    "fp8-rem": (BF16, BF16, "remainders", FP8, FP8),
    "fp8-rem8": (BF16, BF16, "remainders8", FP8, FP8),
}
FP8_MOMENTS = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
POLICIES = {"fp32": None, "bf16": None, "remainders": {"store_param_remainders": True},
            "fp8": FP8_MOMENTS,
            "fp8-rem": dict(FP8_MOMENTS, store_param_remainders=True),
            "fp8-rem8": dict(FP8_MOMENTS, store_param_remainders=True, param_remainder_bits=8)}
SIZES = {"10M": 10_000_000, "100M": 100_000_000, "1B": 1_000_000_000}


def model_sizes(total, tensors=None):
    """Tensor sizes of a GPT-like model with about `total` params: per layer qkv,
    proj, fc1, fc2 weights and biases, two layer norms; an embedding takes the rest.
    With `tensors`, as many layers as make about that many tensors, their width
    chosen so that the layers still hold 80% of the params."""
    hidden = 512 if total <= 20_000_000 else (1024 if total <= 200_000_000 else 2048)
    if tensors is not None:
        layers = max(1, round((tensors - 3) / 12))
        hidden = max(8, round(math.sqrt(0.8 * total / (12 * layers)) / 8) * 8)
    h = hidden
    layer = [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h]
    layers = max(1, int(0.8 * total) // sum(layer))
    sizes = layer * layers + [h, h]
    rest = total - sum(sizes)
    if rest > 0:
        sizes.append(rest)  # the embedding: vocab x hidden, any odd count
    return sizes


def make_state(cfg, sizes, device):
    pd, gd, master, md, vd = cfg
    params, grads, masters, ms, vs, mss, vss = [], [], [], [], [], [], []
    empty = torch.empty(0, device=device)
    for n in sizes:
        p = torch.randn(n, device=device).mul_(0.02)
        if master in ("remainders", "remainders8"):  # int16 remainders, uint8 corrections
            params.append(p.to(BF16))
            masters.append(torch.zeros(n, dtype=I16 if master == "remainders" else U8,
                                       device=device))
        elif master == "own":
            params.append(p.to(pd))
            masters.append(torch.empty(0, dtype=pd, device=device))
        else:
            params.append(p.to(pd))
            masters.append(p.to(master))
        del p
        grads.append(torch.randn(n, device=device, dtype=gd).mul_(1e-3))
        for dtype, lst, sl in ((md, ms, mss), (vd, vs, vss)):
            lst.append(torch.zeros(n, dtype=dtype, device=device))
            sl.append(torch.zeros(ops.scale_count(n), device=device)
                      if dtype in (F16, FP8) else empty)
    return dict(params=params, grads=grads, masters=masters, exp_avgs=ms, exp_avg_sqs=vs,
                exp_avg_scales=mss, exp_avg_sq_scales=vss)


def moved_bytes(state):
    """The bytes a step of `state` (make_state's) reads and writes, AMSGrad off: the
    gradients read; the params written, and read too unless a separate float master
    holds their value; the masters or remainders, moments and block scales read and
    written (tools/sass_budget.py's bytes_per_element, from the dtypes)."""
    def nbytes(key):
        return sum(t.numel() * t.element_size() for t in state[key])
    separate_master = any(m.numel() and m.is_floating_point() for m in state["masters"])
    return (nbytes("grads") + nbytes("params") * (1 if separate_master else 2)
            + 2 * sum(nbytes(k) for k in ("masters", "exp_avgs", "exp_avg_sqs",
                                          "exp_avg_scales", "exp_avg_sq_scales")))


def time_it(fn, iters, warmup=3):
    """Mean ms per call, by CUDA events around `iters` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def copy_bandwidth(device, nbytes=1 << 30):
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = time_it(lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms * 1e-3)


def graph_of(fn, warm):
    """fn captured in a CUDA graph (after `warm` on a side stream), or None."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph
    except Exception as e:  # report, do not fail the whole benchmark
        print(f"  (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def bench_precis(state, iters, device):
    lr_t = torch.full((1,), 1e-4, dtype=torch.float64, device=device)
    step_t = torch.zeros(1, dtype=torch.int64, device=device)

    def call(step_tensor):
        ops.adam_step_(
            state["params"], state["grads"], state["masters"], state["exp_avgs"],
            state["exp_avg_sqs"], state["exp_avg_scales"], state["exp_avg_sq_scales"], [],
            1e-4, 0.9, 0.95, 1e-8, 0.1, seed=1, lr_tensor=lr_t,
            step_tensors=[step_tensor] * len(state["params"]))

    def eager():
        step_t.add_(1)
        call(step_t)

    eager_ms = time_it(eager, iters)
    graph = graph_of(eager, eager)
    graph_ms = time_it(graph.replay, iters) if graph is not None else float("nan")
    return graph_ms, eager_ms


def bench_precis_optimizer(state, policy, iters):
    """precis.optim.AdamW.step() eagerly on the same params (its own state)."""
    params = [torch.nn.Parameter(p) for p in state["params"]]
    for p, g in zip(params, state["grads"]):
        p.grad = g
    opt = optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, policy=policy)
    ms = time_it(opt.step, iters)
    del opt, params
    return ms


def bench_torch(state, iters):
    params = [torch.nn.Parameter(p) for p in state["params"]]
    for p, g in zip(params, state["grads"]):
        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=True, capturable=True)
    except (TypeError, RuntimeError, ValueError) as e:
        print(f"  (torch AdamW(fused=True) unavailable: {e})", file=sys.stderr)
        return float("nan"), float("nan")
    eager_ms = time_it(opt.step, iters)
    graph = graph_of(opt.step, opt.step)
    graph_ms = time_it(graph.replay, iters) if graph is not None else float("nan")
    del opt, params
    return graph_ms, eager_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tensors", type=int, help="about this many tensors per size")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"bench/adam_cuda.py: no CUDA device (torch {torch.__version__}: "
              f"torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    copy_bw = copy_bandwidth(device)
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
          f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    header = (f"{'config':<11}{'params':>7}{'tensors':>8}{'B/param':>8}"
              f"{'graph ms':>10}{'eager ms':>10}{'GB/s':>8}{'% copy':>8}"
              f"{'torch graph':>12}{'torch eager':>12}{'x torch':>8}{'opt eager':>10}")
    print(header)
    print("-" * len(header))
    for size_name in args.sizes.split(","):
        total = SIZES[size_name]
        sizes = model_sizes(total, args.tensors)
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            torch.cuda.empty_cache()
            state = make_state(cfg, sizes, device)
            g_ms, e_ms = bench_precis(state, args.iters, device)
            bytes_moved = moved_bytes(state)
            best = g_ms if not math.isnan(g_ms) else e_ms
            gbs = bytes_moved / (best * 1e-3) / 1e9
            tg_ms, te_ms = bench_torch(state, args.iters)
            opt_ms = bench_precis_optimizer(state, POLICIES[name], args.iters)
            # like with like: graph vs graph where both captured, else eager vs eager
            ratio = (tg_ms / g_ms) if not (math.isnan(tg_ms) or math.isnan(g_ms)) else te_ms / e_ms
            print(f"{name:<11}{size_name:>7}{len(sizes):>8}{bytes_moved / sum(sizes):>8.1f}"
                  f"{g_ms:>10.3f}{e_ms:>10.3f}{gbs:>8.0f}{100 * gbs * 1e9 / copy_bw:>7.0f}%"
                  f"{tg_ms:>12.3f}{te_ms:>12.3f}{ratio:>8.2f}{opt_ms:>10.3f}", flush=True)
            del state
    return 0


if __name__ == "__main__":
    sys.exit(main())
