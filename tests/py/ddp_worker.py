"""Shared pieces of the multi-process tests (not a test file itself).

run_world(fn, world_size, *args) starts world_size processes (spawn) joined in a
gloo group on 127.0.0.1, runs fn(rank, world_size, *args) on each and returns the
results by rank. A child's exception fails the caller with the child's traceback;
a hung collective fails by timeout instead of hanging. case_result(cases, world_size,
key) runs a table of cases in one world (once) and gives one case's results.

child_env(**values) is the environment for a script run in a child process (the
examples under torchrun, the benchmarks): this process's, with the precis package
found first.

The training helpers give every test the same small model, data and loop, and a
single-process reference run on the concatenated batch.
"""
import contextlib
import datetime
import faulthandler
import gc
import io
import os
import socket
import tempfile
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import precis

# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------

COLLECTIVE_TIMEOUT_S = 120  # gloo raises in a collective that waits longer


def child_env(**values):
    """os.environ with precis's package root first on PYTHONPATH, plus values."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(precis.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")]
                                                          if p])
    env.update(values)
    return env


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, out_dir, args, backend="gloo"):
    # A child killed by a signal (an abort in gloo) writes where each thread was;
    # run_world shows it. (faulthandler keeps the file open until exit.)
    faulthandler.enable(file=open(os.path.join(out_dir, f"rank{rank}.stacks"), "w"))
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            # Written before this rank's teardown resets the other ranks'
            # connections, so the parent reports this error, not theirs.
            _write_atomically(os.path.join(out_dir, f"rank{rank}.err"),
                              traceback.format_exc())
            raise
        buf = io.BytesIO()
        torch.save(result, buf)
        del result
        gc.collect()  # what fn made is finalized (precis objects too) before "saved"
        _write_atomically(os.path.join(out_dir, f"rank{rank}.pt"), buf.getvalue())
        # No rank tears its gloo context down while another still talks to it
        # (torch 2.13's gloo aborts the process: "terminate called without an
        # active exception"). It still fails now and then past this point (1 CI
        # run in many, 3 ranks on 2 cores): run_world runs such a world again.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write_atomically(path, data):
    """path holds all of data (str or bytes) or does not exist."""
    with open(path + ".tmp", "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _raised_in_fn(out_dir, world_size):
    """The tracebacks of ranks whose fn raised, or None when none did."""
    errors = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"rank {r} raised:\n{f.read()}")
    return "\n".join(errors) or None


def _all_saved(out_dir, world_size):
    return all(os.path.exists(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size))


def _stacks(out_dir, world_size):
    """What faulthandler wrote for ranks killed by a signal."""
    texts = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.stacks")
        if not os.path.exists(path):  # died before _entry began
            continue
        with open(path) as f:
            text = f.read().strip()
        if text:
            texts.append(f"rank {r}:\n{text}")
    return "\n".join(texts) or "(no stacks written)"


class _FailedAfterSave(Exception):
    """A child failed after fn returned and every rank saved its result."""


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_world(fn, world_size, *args, timeout=300, backend="gloo"):
    """[fn(0, world_size, *args), ..., fn(world_size - 1, ...)], each in its own process.

    fn must be a module-level function (it is pickled by name). Children inherit
    the environment (PRECIS_LIBRARY, ...) and sys.path; they get one thread each,
    as the machines running the tests have 2 cores. A world where a child fails
    only after every rank saved its result (torch's gloo teardown, now and then)
    runs once more, with a warning; failing so twice fails the caller. backend: the
    process group's ("cpu:gloo,cuda:nccl" for CUDA tensors, one GPU a rank).
    """
    try:
        return _run_world_once(fn, world_size, args, timeout, backend)
    except _FailedAfterSave as first:
        warnings.warn(f"{first}; running the world again")
        try:
            return _run_world_once(fn, world_size, args, timeout, backend)
        except _FailedAfterSave as second:
            raise RuntimeError(f"twice: {first}\nthen {second}") from second


def _run_world_once(fn, world_size, args, timeout, backend):
    with tempfile.TemporaryDirectory() as out_dir:
        # Read by OpenMP and gloo when the child starts.
        with _env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"):
            ctx = mp.start_processes(_entry,
                                     args=(fn, world_size, free_port(), out_dir, args, backend),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            # join() raises ProcessRaisedException (with the child's traceback) or
            # ProcessExitedException when a child fails. The first child to exit may
            # be a victim (its collective reset by the failing rank's teardown), so
            # the errors raised by fn itself are reported first.
            try:
                while not ctx.join(timeout=0.5):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"run_world({fn.__name__}, {world_size}): no "
                                           f"result after {timeout} s (a hung collective?)")
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                raised = _raised_in_fn(out_dir, world_size)
                if raised is not None:
                    raise RuntimeError(f"run_world({fn.__name__}, {world_size}):\n{raised}") from e
                stacks = _stacks(out_dir, world_size)
                if not _all_saved(out_dir, world_size):
                    raise RuntimeError(f"run_world({fn.__name__}, {world_size}): {e}; "
                                       f"stacks:\n{stacks}") from e
                raise _FailedAfterSave(
                    f"run_world({fn.__name__}, {world_size}): {e} after fn returned and every "
                    f"rank saved its result; stacks:\n{stacks}") from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]


def run_cases(rank, world_size, cases):
    """{key: fn(rank, world_size, *args)} over cases {key: (fn, args)}; a case that
    raises gets its traceback text instead, so one failure does not hide the others."""
    out = {}
    for key, (fn, args) in cases.items():
        try:
            out[key] = fn(rank, world_size, *args)
        except Exception:
            out[key] = traceback.format_exc()
    return out


def error_text(fn):
    """"Type: message" of the ValueError, TypeError or RuntimeError fn() raises,
    or None when it returns."""
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


_case_results = {}  # (id of a module-level cases table, world size) -> results by rank


def case_result(cases, world_size, key):
    """Case `key`'s result on every rank. The first call for a table and world size
    runs all its cases in one world; a rank where the case raised fails the test."""
    run = (id(cases), world_size)
    if run not in _case_results:
        _case_results[run] = run_world(run_cases, world_size, cases)
    by_rank = [r[key] for r in _case_results[run]]
    for rank, r in enumerate(by_rank):
        if isinstance(r, str):
            pytest.fail(f"rank {rank} of {world_size} failed:\n{r}")
    return by_rank


# ---------------------------------------------------------------------------
# Model, data, training
# ---------------------------------------------------------------------------

GLOBAL_BATCH = 12      # samples per step, split over ranks and micro-batches
IN, HIDDEN1, HIDDEN2, OUT = 5, 9, 7, 3
NUMEL = IN * HIDDEN1 + HIDDEN1 + HIDDEN1 * HIDDEN2 + HIDDEN2 + HIDDEN2 * OUT + OUT  # 148
OPTIM_KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)

# The optimizers the harnesses step (issue #44: SGD and Lion get every capability
# AdamW has): name -> (precis.optim class name, its keyword arguments). "adamw" is
# the harnesses' own optimizer; SGD with Nesterov momentum; Lion with its defaults;
# Muon (2-D params only) with its defaults but lr and weight decay.
OPTIMIZERS = {
    "adamw": ("AdamW", OPTIM_KW),
    "sgd": ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "lion": ("Lion", {}),
    "muon": ("Muon", dict(lr=0.02, weight_decay=0.05)),
    "normuon": ("NorMuon", dict(lr=0.02, weight_decay=0.05, beta2=0.9)),
    # NorMuon with microsoft/dion's conventions (issue 80 item 6)
    "normuon_dion": ("NorMuon", dict(lr=0.02, weight_decay=0.05, beta2=0.9, nesterov=False,
                                     eps=1e-8, adjust_lr_fn="spectral_norm",
                                     ns_coefficients="polar_express", momentum_form="sum")),
}
WHOLE_MATRIX = ("muon", "normuon")  # orthogonalize whole matrices: 2-D params only
DION_MATRIX = ("normuon_dion",)  # the same, with dion's conventions (test_fsdp's Muon test)
ONE_STATE = ("sgd", "lion")
# fp8 momentum (m8, block-scaled, rounded stochastically) + 8-bit remainders
FP8_MOMENTUM_REM8 = {"exp_avg_dtype": "fp8", "store_param_remainders": True,
                     "param_remainder_bits": 8}


def make_optimizer(name, params, **kw):
    """precis.optim's optimizer `name` (OPTIMIZERS) over params; kw (policy, offload,
    ...) added to its arguments."""
    import precis.optim
    cls, args = OPTIMIZERS[name]
    return getattr(precis.optim, cls)(params, **args, **kw)


def make_model(dtype=torch.float32, seed=0, hidden1=HIDDEN1):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, hidden1), nn.Tanh(), nn.Linear(hidden1, HIDDEN2),
                          nn.Tanh(), nn.Linear(HIDDEN2, OUT))
    return model.to(dtype)


def make_batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, IN, generator=g),
             torch.randn(GLOBAL_BATCH, OUT, generator=g)) for _ in range(steps)]


def local_micro_batches(x, y, rank, world_size, micro):
    """Rank r's micro-batches of a global batch: rank-major contiguous slices, so
    that concatenating every rank's micro-batches gives the global batch back."""
    per_rank = GLOBAL_BATCH // world_size
    per_micro = per_rank // micro
    xs = x[rank * per_rank:(rank + 1) * per_rank]
    ys = y[rank * per_rank:(rank + 1) * per_rank]
    return [(xs[i * per_micro:(i + 1) * per_micro], ys[i * per_micro:(i + 1) * per_micro])
            for i in range(micro)]


def loss_fn(model, x, y, denominator):
    """Sum of squared errors / denominator, computed in fp32 whatever the model dtype."""
    dtype = next(model.parameters()).dtype
    out = model(x.to(dtype)).float()
    return ((out - y) ** 2).sum() / denominator


def train_whole_steps(model, opt, rank, world_size, steps, compiled):
    """steps training steps of one micro-batch each, each step (forward, backward,
    opt.step(), zero_grad()) one function, compiled whole by torch.compile or not."""
    per_rank = GLOBAL_BATCH // world_size

    def train_step(x, y):
        loss_fn(model, x, y, per_rank).backward()
        opt.step()
        opt.zero_grad()
    torch._dynamo.reset()  # (the cases before compiled this code too: no limit reached)
    step = torch.compile(train_step) if compiled else train_step
    for x, y in make_batches(steps):
        step(*local_micro_batches(x, y, rank, world_size, 1)[0])


def flat_params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def train_reference(steps, dtype=torch.float32, policy=None, seed=0):
    """One process, the whole global batch per step: the result DDP must match."""
    import precis.optim
    model = make_model(dtype, seed)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, **OPTIM_KW)
    for x, y in make_batches(steps):
        loss_fn(model, x, y, GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def train_ddp(rank, world_size, steps, dtype=torch.float32, policy=None, micro=2, seed=0,
              model=None, **ddp_kw):
    """The usual training loop on a precis DDP model (its optimizer attached):
    no_sync() for every micro-batch but the last, loss.backward(),
    optimizer.step(), zero_grad()."""
    import precis.ddp
    import precis.optim
    if model is None:
        model = make_model(dtype, seed)
    ddp = precis.ddp.DistributedDataParallel(model, policy=policy, **ddp_kw)
    opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), policy=policy,
                                                         **OPTIM_KW))
    per_rank = GLOBAL_BATCH // world_size
    for x, y in make_batches(steps):
        batches = local_micro_batches(x, y, rank, world_size, micro)
        for i, (xm, ym) in enumerate(batches):
            ctx = ddp.no_sync() if i < micro - 1 else contextlib.nullcontext()
            with ctx:
                # Each rank's share of the global mean; DDP averages over ranks.
                loss_fn(ddp, xm, ym, per_rank).backward()
        opt.step()
        opt.zero_grad()
    return ddp, opt
