"""The optimizer step over a Llama's params (bench/llama.py, 125m by default; two param
groups: the matrices decayed, the rest not, as bench/train_llm.py makes them), eager and
captured in a CUDA graph (docs/guide.md's recipe: warm-up steps on a side stream,
torch.cuda.graph, replays), beside torch's fused AdamW on fp32 params (AMP's step)
taken the same two ways (captured: capturable=True, a tensor lr).

Each row: ms a step, the median of --repeats runs of --steps steps back to back, timed
by CUDA events around them (what a training loop that never waits for the step sees:
the longer of the host's part and the device's), and its ratio to torch's fused AdamW
captured. The precis steps are the capturable ones for the captured rows (step counts,
lr and the compare of the params with what the last step left in them, on the device:
precis.graph_records) and the ordinary ones for the eager rows. The gradients are set
once and stay (the step is timed alone, no forward or backward).

Without a GPU it prints so and exits 0; --check-on-cpu then runs every row at the size
given on the GPU's path (PRECIS_DEVICE_PATH_ON_CPU=1), each "captured" row's step called
as it is (no graph): a check of the script, its figures not a measure.

    PYTHONPATH=torch_ext .venv/bin/python bench/step_graph.py [--size 125m] [--steps 50]
        [--repeats 5] [--check-on-cpu]
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_ext"))

import adam_cuda  # noqa: E402
import llama  # noqa: E402
import machine  # noqa: E402
import precis  # noqa: E402

FP8_REM8 = dict(store_param_remainders=True, param_remainder_bits=8, exp_avg_dtype="fp8",
                exp_avg_sq_dtype="fp8")
REFERENCE = "torch fused AdamW, fp32 params: captured"


def torch_fused(captured):
    def make(groups, lr):
        return torch.optim.AdamW(groups, lr=lr, fused=True, capturable=captured)
    return make


def precis_adamw(policy, captured):
    def make(groups, lr):
        return precis.optim.AdamW(groups, lr=lr, policy=policy, capturable=captured)
    return make


# row -> (param dtype, whether its step is captured, the optimizer of the groups and lr)
ROWS = {
    "torch fused AdamW, fp32 params: eager": (torch.float32, False, torch_fused(False)),
    REFERENCE: (torch.float32, True, torch_fused(True)),
    "precis default: eager": (torch.bfloat16, False, precis_adamw(None, False)),
    "precis default: captured": (torch.bfloat16, True, precis_adamw(None, True)),
    "precis fp8 m, v + 8-bit remainders: eager": (
        torch.bfloat16, False, precis_adamw(FP8_REM8, False)),
    "precis fp8 m, v + 8-bit remainders: captured": (
        torch.bfloat16, True, precis_adamw(FP8_REM8, True)),
}


def groups_of(size, dtype, device):
    """A `size` Llama's params in dtype on device, each with a gradient (set once), in
    two groups: the matrices decayed, the rest not."""
    model = llama.Llama(llama.LlamaConfig.named(size), seed=0).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    params = [p.detach() for p in model.parameters()]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(dtype)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def captured_step(step, device):
    """step captured in a CUDA graph after three warm-up steps on a side stream (the
    guide's recipe): the graph's replay; off a GPU, step itself after the same steps."""
    if device.type != "cuda":
        for _ in range(3):
            step()
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def ms_per_step(step, steps, repeats, device):
    """The median over repeats of the ms a step of `steps` steps taken back to back."""
    for _ in range(3):
        step()
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            runs.append(adam_cuda.time_it(step, steps, warmup=0))  # (CUDA events)
        else:
            begin = time.perf_counter()
            for _ in range(steps):
                step()
            runs.append((time.perf_counter() - begin) * 1e3 / steps)
    return statistics.median(runs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="125m", choices=list(llama.SIZES))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-on-cpu", action="store_true",
                        help="without a GPU: run every row on the GPU's path, no graph "
                             "(a check of the script, not a measure)")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
        where = torch.cuda.get_device_name()
    elif args.check_on_cpu:
        device = torch.device("cpu")
        os.environ["PRECIS_DEVICE_PATH_ON_CPU"] = "1"
        where = "no GPU: a check of the script on the GPU's path, nothing captured"
    else:
        print("bench/step_graph.py: no CUDA device (torch.cuda.is_available() is False): "
              "nothing to capture, nothing measured (--check-on-cpu runs the rows' code)")
        return
    params = sum(p.numel() for g in groups_of(args.size, torch.float32, "cpu")
                 for p in g["params"])
    print(f"{where}; host CPU: {machine.cpu_model()}; torch {torch.__version__}; "
          f"{args.size} Llama, {params:,} params; the step alone, ms a step: median of "
          f"{args.repeats} runs of {args.steps} steps back to back")
    print(f"| row | ms a step | / {REFERENCE} |")
    print("|---|---|---|")
    times = {}
    for name, (dtype, captured, make) in ROWS.items():
        groups = groups_of(args.size, dtype, device)
        # captured: a tensor lr, changed in place (float64 for precis: the guide's)
        lr = torch.tensor(1e-4, device=device,
                          dtype=torch.float64 if "precis" in name else torch.float32) \
            if captured else 1e-4
        opt = make(groups, lr)
        step = captured_step(opt.step, device) if captured else opt.step
        times[name] = ms_per_step(step, args.steps, args.repeats, device)
        del step, opt, groups
    for name, ms in times.items():
        print(f"| {name} | {ms:.3f} | {ms / times[REFERENCE]:.2f}x |")


if __name__ == "__main__":
    main()
