"""torch.compile over the precis ops (fake kernels + the C kernels), on CPU.

* opt.step compiled with fullgraph=True writes the eager step's bits, for an fp32
  model and for bf16 models under several policies, and with amsgrad; on CUDA
  params too (inductor's CUDA code around the CUDA kernels) where there is a GPU;
* a compiled step of a fresh optimizer (default mode) has no graph break and keeps
  one graph from its second step on: the step counts reach the op as tensors (as
  ints, dynamo would guard on each and recompile at every step);
* a whole training step (forward, backward, step, zero_grad) compiles into one
  graph and tracks eager over 20 steps;
* the bucket ops inside a compiled region give the eager bits;
* a traced step hands its graph no two inputs that share memory (a Plan's flat state);
* offload="cpu": the compiled step writes the host copies back (the eager bits), and
  refuses offloaded CUDA params (dynamo then falls back to the eager step);
* a float32 or float64 tensor lr changed in place is read at every compiled step
  (fullgraph=True, no graph break).
"""
import contextlib
import copy
import warnings

import pytest
import torch

import precis
from precis import ops

POLICIES = {
    "fp32": (torch.float32, None),
    "bf16 default": (torch.bfloat16, None),
    "bf16 remainders": (torch.bfloat16, {"store_param_remainders": True}),
    "bf16 fp8 moments": (torch.bfloat16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}),
    "bf16 fp16 moments": (torch.bfloat16, {"exp_avg_dtype": "fp16", "exp_avg_sq_dtype": "fp16"}),
    "bf16 fp8 moments + remainders": (torch.bfloat16, {"exp_avg_dtype": "fp8",
                                                       "exp_avg_sq_dtype": "fp8",
                                                       "store_param_remainders": True}),
    "bf16 fp8 moments + 8-bit corrections": (torch.bfloat16, {"exp_avg_dtype": "fp8",
                                                              "exp_avg_sq_dtype": "fp8",
                                                              "store_param_remainders": True,
                                                              "param_remainder_bits": 8}),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _bits(t):
    """t's bytes, on the CPU: a compiled step keeps the step counts on the params'
    device (step_calls.counts_on_device), an eager one on the CPU."""
    return t.detach().reshape(-1).view(torch.uint8).cpu().clone()


def _assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), f"{what}: compiled and eager differ"


def _params(dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device, dtype))
            for shape in ((127,), (33, 5), (1,), (4097,))]


def _give_grads(g, dtype, eager_params, compiled_params):
    """The same random gradients to both twins."""
    for p, q in zip(eager_params, compiled_params):
        grad = torch.randn(p.shape, generator=g).to(p.device, dtype)
        p.grad, q.grad = grad.clone(), grad.clone()


# On CUDA a few policies only: each case compiles its own kernels.
CUDA = pytest.mark.cuda  # skipped without a device (conftest.py)


@pytest.mark.parametrize("name,amsgrad,device",
                         [(name, False, "cpu") for name in POLICIES]
                         + [("fp32", True, "cpu"), ("bf16 fp8 moments", True, "cpu")]
                         + [pytest.param(name, amsgrad, "cuda", marks=CUDA)
                            for name, amsgrad in (("fp32", False), ("bf16 default", False),
                                                  ("bf16 fp8 moments + remainders", False),
                                                  ("bf16 fp8 moments", True))])
def test_compiled_step_gives_the_eager_bits(name, amsgrad, device):
    dtype, policy = POLICIES[name]
    eager_params = _params(dtype, device=device)
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    kw = dict(lr=3e-3, weight_decay=0.05, policy=policy, amsgrad=amsgrad)
    eager = precis.optim.AdamW(eager_params, **kw)
    compiled = precis.optim.AdamW(compiled_params, **kw)
    step = torch.compile(compiled.step, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for k in range(4):
        _give_grads(g, dtype, eager_params, compiled_params)
        eager.step()
        if k == 0:
            compiled.step()  # the state is made eagerly, as torch's optimizers do
        else:
            step()
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        _assert_same_bits(p, q, f"param {i}")
        for key, value in eager.state[p].items():
            other = compiled.state[q][key]
            if isinstance(value, torch.Tensor):
                _assert_same_bits(value, other, f"state[{key!r}] of param {i}")
            else:
                assert value == other, key


@pytest.mark.parametrize("name,amsgrad,copied", [("fp32", False, False),
                                                 ("bf16 fp8 moments + remainders", True, False),
                                                 ("bf16 fp8 moments + remainders", True, True)])
def test_traced_step_gives_the_graph_no_aliased_inputs(name, amsgrad, copied):
    """After an eager step a Plan keeps the state as views of flat buffers; a traced step
    makes those views anew from the buffers in the graph, so that no two inputs of a
    graph share memory: torch 2.11's inductor wrote the op's aliased inputs back from
    the wrong offset on CUDA (H200: params off by up to 3.7; pytorch/pytorch#139628),
    and its cache can hand a graph made for aliased inputs to unaliased ones. copied:
    the optimizer deep-copied after that step and compiled at once (the copy's entries
    get memory of their own until its first eager step makes its Plan)."""
    dtype, policy = POLICIES[name]
    params = _params(dtype)
    opt = precis.optim.AdamW(params, lr=3e-3, policy=policy, amsgrad=amsgrad)
    g = torch.Generator().manual_seed(2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    opt.step()
    assert opt._books.plans, "the eager step made a Plan (flat state)"
    if copied:
        opt = copy.deepcopy(opt)
        params = opt.param_groups[0]["params"]
        for p in params:  # (a deep-copied Parameter has no grad)
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        twin = copy.deepcopy(opt)  # stepped eagerly: the bits the compiled copy must give
        for p, q in zip(params, twin.param_groups[0]["params"]):
            q.grad = p.grad.clone()
        twin.step()
    state = opt.state[params[1]]
    flat = state["exp_avg"] if copied else state.views["exp_avg"][1]  # the Plan's buffer
    assert copied or state["exp_avg"].untyped_storage().data_ptr() == \
        flat.untyped_storage().data_ptr()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([t for t in example_inputs
                       if isinstance(t, torch.Tensor) and t.numel() > 0])
        return gm.forward

    torch.compile(opt.step, fullgraph=True, backend=backend)()
    assert any(t is flat for tensors in graphs for t in tensors), "the flat exp_avg is an input"
    for tensors in graphs:
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        assert len(set(storages)) == len(storages), "two inputs of a graph share memory"
    if copied:
        for i, (p, q) in enumerate(zip(params, twin.param_groups[0]["params"])):
            _assert_same_bits(p, q, f"param {i} of the copy")


def _graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _graph_breaks():
    return dict(torch._dynamo.utils.counters["graph_break"])


def _compile_from_the_first_step(eager, compiled, eager_params, compiled_params, dtype):
    """12 steps of eager and of torch.compile(compiled.step) from the first (default
    mode): one graph for the first step (which makes the state), one for all the
    others, no graph break."""
    step = torch.compile(compiled.step)
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(4)
    for k in range(12):
        _give_grads(g, dtype, eager_params, compiled_params)
        eager.step()
        step()
        if k == 0:
            assert _graphs() == 1, "the first step is one graph"
    assert _graph_breaks() == {}
    assert _graphs() == 2, "one graph for the first step, one for all the others"

@pytest.mark.parametrize("name", list(POLICIES))
def test_fresh_optimizer_compiles_to_one_graph_per_state(name):
    """torch.compile(opt.step) in the default mode from the very first step: the
    first step (which makes the state) is one graph, every later step another one,
    with no graph break; 12 steps give the eager bits."""
    dtype, policy = POLICIES[name]
    eager_params = _params(dtype)
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = precis.optim.AdamW(eager_params, lr=3e-3, policy=policy)
    compiled = precis.optim.AdamW(compiled_params, lr=3e-3, policy=policy)
    _compile_from_the_first_step(eager, compiled, eager_params, compiled_params, dtype)
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        _assert_same_bits(p, q, f"param {i}")
        assert int(compiled.state[q]["step"]) == 12


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def test_compiled_step_records_its_outcome():
    """last_step_skipped / last_found_inf are written by a compiled step too (kept in a
    dict: a setattr on the optimizer fails under torch.compile on 2.11 and is dropped
    on 2.12 and 2.13). Dynamo traces an optimizer's step with capturable=True (its
    OptimizerVariable sets it in the traced param groups), so the step reports as a
    capturable one: skipped None, no flag."""
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(127, generator=g))
    p.grad = torch.randn(127, generator=g)
    opt = precis.optim.AdamW([p], lr=1e-3)
    opt.step()  # the state is made eagerly
    before = p.detach().clone()
    opt.last_step_skipped, opt.last_found_inf = "stale", "stale"
    torch.compile(opt.step, fullgraph=True)()
    assert opt.last_step_skipped is None and opt.last_found_inf is None
    assert not torch.equal(p.detach(), before)  # the compiled step did step


@pytest.mark.parametrize("name", ["fp32", "bf16 default"])
def test_compiled_training_step_tracks_eager(name):
    """forward, backward, step, zero_grad as one graph (fullgraph=True): no graph
    break. Forward and backward are compiled by inductor, whose kernels may round
    differently, so the two runs are compared with a tolerance (fp32: 1e-5
    relative on the loss; bf16: 2e-2), over 20 steps. torch 2.10 cannot trace
    backward() (no trace_autograd_ops): there the step compiles with a graph break."""
    dtype, policy = POLICIES[name]
    models = [_model().to(dtype), None]
    models[1] = copy.deepcopy(models[0])
    opts = [precis.optim.AdamW(m.parameters(), lr=1e-2, policy=policy) for m in models]
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(64, 16, generator=g).to(dtype), torch.randn(64, 1, generator=g).to(dtype))
            for _ in range(20)]

    def make_step(model, opt):
        def train_step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return train_step

    eager_step = make_step(models[0], opts[0])
    compiled_step = make_step(models[1], opts[1])
    compiled_step(*data[0])  # state made eagerly
    eager_step(*data[0])
    traces_backward = hasattr(torch._dynamo.config, "trace_autograd_ops")  # torch 2.11+
    compiled_step = torch.compile(compiled_step, fullgraph=traces_backward)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with (torch._dynamo.config.patch(trace_autograd_ops=True) if traces_backward
          else contextlib.nullcontext()):  # backward() in the graph
        for x, y in data[1:]:
            a = float(eager_step(x, y))
            b = float(compiled_step(x, y))
            assert abs(a - b) <= tol * max(1.0, abs(a)), (a, b)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=tol * 10, atol=tol * 10)
    assert opts[1].state[next(models[1].parameters())]["step"] == 20


def test_bucket_ops_in_a_compiled_region():
    def bucket(main_grad, grad, comm):
        ops.accumulate_(main_grad, grad)
        ops.cast_(comm, main_grad)
        ops.scale_(comm, 0.5)
        return comm * 2, ops.count_nonfinite(comm)

    g = torch.Generator().manual_seed(3)
    main = torch.randn(4097, generator=g)
    grad = torch.randn(4097, generator=g).to(torch.bfloat16)
    grad[7] = float("inf")
    comm = torch.empty(4097, dtype=torch.bfloat16)
    eager = bucket(main.clone(), grad, comm.clone())
    main_c, comm_c = main.clone(), comm.clone()
    compiled = torch.compile(bucket, fullgraph=True)(main_c, grad, comm_c)
    _assert_same_bits(eager[0], compiled[0], "comm * 2")
    assert int(eager[1]) == int(compiled[1]) == 1
    main_e = main.clone()
    ops.accumulate_(main_e, grad)
    _assert_same_bits(main_e, main_c, "main_grad written in the compiled region")


# ---- SGD and Lion (issue #44) -----------------------------------------------------------

ONE_STATE = {"sgd": (precis.optim.SGD, dict(lr=3e-3, momentum=0.9, nesterov=True,
                                            weight_decay=0.05)),
             "lion": (precis.optim.Lion, {})}
ONE_STATE_POLICIES = {
    "bf16 default": (torch.bfloat16, None),
    "bf16 fp8 momentum + 8-bit corrections": (torch.bfloat16, {"exp_avg_dtype": "fp8",
                                                               "store_param_remainders": True,
                                                               "param_remainder_bits": 8}),
}


def _one_state_twins(optimizer, name, **kw):
    """(eager params, compiled params, their optimizers): the same start."""
    cls, args = ONE_STATE[optimizer]
    dtype, policy = ONE_STATE_POLICIES[name]
    eager_params = _params(dtype)
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    return (eager_params, compiled_params, cls(eager_params, policy=policy, **args, **kw),
            cls(compiled_params, policy=policy, **args, **kw))


def _assert_twins(eager, compiled, eager_params, compiled_params, steps):
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        _assert_same_bits(p, q, f"param {i}")
        assert set(eager.state[p]) == set(compiled.state[q]), i
        assert "exp_avg" in eager.state[p] and "exp_avg_sq" not in eager.state[p]
        for key, value in eager.state[p].items():
            other = compiled.state[q][key]
            if key == "step":  # a tensor where the step counts on the device
                assert int(value) == int(other) == steps, (i, value, other)
            elif isinstance(value, torch.Tensor):
                _assert_same_bits(value, other, f"state[{key!r}] of param {i}")
            else:
                assert value == other, key


@pytest.mark.parametrize("name", ["bf16 fp8 momentum + 8-bit corrections"])
@pytest.mark.parametrize("optimizer", ONE_STATE)
def test_one_state_compiled_step_gives_the_eager_bits(optimizer, name):
    """SGD and Lion: opt.step compiled with fullgraph=True (state made by an eager first
    step) writes the eager step's bits (one policy: each case compiles its own graphs;
    the default mode's test below covers both)."""
    eager_params, compiled_params, eager, compiled = _one_state_twins(optimizer, name)
    dtype = eager_params[0].dtype
    step = torch.compile(compiled.step, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for k in range(4):
        _give_grads(g, dtype, eager_params, compiled_params)
        eager.step()
        if k == 0:
            compiled.step()
        else:
            step()
    _assert_twins(eager, compiled, eager_params, compiled_params, 4)


@pytest.mark.parametrize("name", ONE_STATE_POLICIES)
@pytest.mark.parametrize("optimizer", ONE_STATE)
def test_one_state_fresh_optimizer_compiles_to_one_graph_per_state(optimizer, name):
    """SGD and Lion compiled from their first step (default mode): one graph for the
    first step, one for every later one, no graph break; 12 steps give the eager bits."""
    eager_params, compiled_params, eager, compiled = _one_state_twins(optimizer, name)
    dtype = eager_params[0].dtype
    _compile_from_the_first_step(eager, compiled, eager_params, compiled_params, dtype)
    _assert_twins(eager, compiled, eager_params, compiled_params, 12)


@pytest.mark.parametrize("name", ONE_STATE_POLICIES)
@pytest.mark.parametrize("optimizer", ONE_STATE)
def test_one_state_capturable_on_cpu_gives_the_eager_bits(optimizer, name):
    """capturable=True on CPU params (step counts and lr as tensors, read by the kernel):
    the bits of the eager step, step after step, a changed lr included."""
    cls, args = ONE_STATE[optimizer]
    dtype, policy = ONE_STATE_POLICIES[name]
    eager_params = _params(dtype)
    captured_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = cls(eager_params, policy=policy, **args)
    captured = cls(captured_params, policy=policy, capturable=True, **args)
    g = torch.Generator().manual_seed(6)
    for k in range(6):
        if k == 3:
            for opt in (eager, captured):
                opt.param_groups[0]["lr"] = 2e-3
        _give_grads(g, dtype, eager_params, captured_params)
        eager.step()
        captured.step()
    _assert_twins(eager, captured, eager_params, captured_params, 6)


# ---- Muon (issue #44) ---------------------------------------------------------------------

@pytest.mark.parametrize("cls,conventions", [("Muon", "torch"), ("NorMuon", "torch"),
                                             ("NorMuon", "dion")])
@pytest.mark.parametrize("name", ONE_STATE_POLICIES)
def test_muon_compiles_to_one_graph_per_state_and_tracks_eager(name, cls, conventions):
    """Muon compiled from its first step: no graph break (the adjusted lrs are lr times each
    matrix's ratio, multiplied in the kernel, so the lr may stay on the device), one graph
    for the first step and one for the others; the momentum has the eager bits (its kernel
    is elementwise), the masters track eager within 3% of the 6 steps' largest update
    (inductor fuses Newton-Schulz's bf16 ops its own way: torch.optim.Muon compiled
    differs from itself eager by as much). NorMuon too: its row state tracks eager's
    within 5%; with dion's conventions too (polar express, the momentum sum, the
    spectral norm's lr: issue 80)."""
    dtype, policy = ONE_STATE_POLICIES[name]
    g = torch.Generator().manual_seed(0)
    eager_params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
                    for shape in ((127, 33), (33, 127), (64, 64), (1, 5))]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    args = dict(lr=0.02, weight_decay=0.05, policy=policy)
    if conventions == "dion":
        args.update(nesterov=False, eps=1e-8, adjust_lr_fn="spectral_norm",
                    ns_coefficients="polar_express", momentum_form="sum")
    eager = getattr(precis.optim, cls)(eager_params, **args)
    compiled = getattr(precis.optim, cls)(compiled_params, **args)
    step = torch.compile(compiled.step)
    torch._dynamo.utils.counters.clear()
    for _ in range(6):
        _give_grads(g, dtype, eager_params, compiled_params)
        eager.step()
        step()
    assert _graph_breaks() == {}
    assert _graphs() == 2, "one graph for the first step, one for all the others"
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        _assert_same_bits(eager.state[p]["exp_avg"], compiled.state[q]["exp_avg"],
                          f"momentum of param {i}")
        largest = 0.02 * 0.2 * max(p.shape) ** 0.5 * 1.5  # lr * ratio (its bound) * |update|
        diff = (eager.master_weight(p) - compiled.master_weight(q)).abs().max().item()
        assert int(eager.state[p]["step"]) == int(compiled.state[q]["step"]) == 6
        if conventions == "dion" and p.shape[0] == 1:
            # Polar express (dion's) is steeper: its first polynomial's slope is about 20 at
            # 1 / 1.02, where a 1-row matrix's one singular value starts, so inductor's fp32
            # normalization moves that update by up to 25% (dion's own code compiled too)
            continue
        assert diff <= 0.03 * 6 * largest, (i, diff)  # the fp32 masters (bf16 params: ulps)
        assert int(eager.state[p]["step"]) == int(compiled.state[q]["step"]) == 6
        if cls == "NorMuon":
            rows, got = eager.state[p]["row_exp_avg_sq"], compiled.state[q]["row_exp_avg_sq"]
            assert rows.shape == (p.shape[0], 1) and rows.abs().max() > 0, i
            # (a mean of squares: twice Newton-Schulz's own difference, up to 3.1% on a
            # row of 5 elements on an AMD EPYC Zen 4)
            torch.testing.assert_close(got, rows, rtol=0.05, atol=0.0, msg=f"row state {i}")


@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
def test_one_optimizer_for_a_model_compiles_without_a_graph_break(cls):
    """Muon / NorMuon with an "adamw" group compiled: two op calls a step (AdamW's rule's,
    Muon's stages), so the second is first checked with its flag set (check_calls) and
    Muon's stages stop after their checks without reading the flag back: no graph break
    (with the flag read, one a step), one graph for the first step and one for the others;
    the AdamW group's params have the eager bits (an elementwise kernel), the matrices
    track eager as in the test above."""
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16
    eager_params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
                    for shape in ((127, 33), (33, 127), (127,), (5,))]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]

    def make(params):
        return getattr(precis.optim, cls)(
            [{"params": params[2:], "algorithm": "adamw", "lr": 3e-3},
             {"params": params[:2]}], lr=0.02, weight_decay=0.05)

    eager, compiled = make(eager_params), make(compiled_params)
    step = torch.compile(compiled.step)
    torch._dynamo.utils.counters.clear()
    for _ in range(6):
        _give_grads(g, dtype, eager_params, compiled_params)
        eager.step()
        step()
    assert _graph_breaks() == {}
    assert _graphs() == 2, "one graph for the first step, one for all the others"
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        assert int(eager.state[p]["step"]) == int(compiled.state[q]["step"]) == 6
        if p.dim() == 1:
            _assert_same_bits(p, q, f"param {i} (AdamW's rule)")
            _assert_same_bits(eager.state[p]["exp_avg_sq"], compiled.state[q]["exp_avg_sq"],
                              f"second moment of param {i}")
        else:
            _assert_same_bits(eager.state[p]["exp_avg"], compiled.state[q]["exp_avg"],
                              f"momentum of param {i}")
            largest = 0.02 * 0.2 * max(p.shape) ** 0.5 * 1.5  # as in the test above
            diff = (eager.master_weight(p) - compiled.master_weight(q)).abs().max().item()
            assert diff <= 0.03 * 6 * largest, (i, diff)


@pytest.mark.parametrize("name,tolerance", [("AdamW", 1e-6), ("SGD", 1e-6), ("Lion", 1e-6),
                                            ("Muon", 2e-3), ("NorMuon", 2e-3)])
def test_compiled_step_follows_a_changed_float_lr(name, tolerance):
    """A scheduler's float lr under torch.compile: the compiled step uses the new lr, as
    eager does (within 1e-6; Muon's compiled Newton-Schulz rounds apart from eager's, 7e-4
    after 6 steps at one lr, so 2e-3, against the 0.018 a stale lr left). Dynamo shows
    the traced step capturable=True, and the lr went through a device buffer filled from
    the float; the recompiled graph lost that fill and stepped with the old lr (AdamW
    0.0296 off eager's after 3 steps)."""
    g = torch.Generator().manual_seed(0)
    eager_params = [torch.nn.Parameter(torch.randn(127, 33, generator=g))]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    make = getattr(precis.optim, name)
    eager, compiled = make(eager_params, lr=0.02), make(compiled_params, lr=0.02)
    step = torch.compile(compiled.step)
    for k in range(6):
        if k == 3:
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.01
        _give_grads(g, torch.float32, eager_params, compiled_params)
        eager.step()
        step()
    diff = (eager_params[0] - compiled_params[0]).abs().max().item()
    assert diff <= tolerance, diff


# ---- issue 65: a compiled step is the eager step (offload, a tensor lr) -----------------

def _assert_same_state(eager, compiled, eager_params, compiled_params, steps):
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        _assert_same_bits(p, q, f"param {i}")
        assert set(eager.state[p]) == set(compiled.state[q]), i
        for key, value in eager.state[p].items():
            if key == "step":  # a tensor where the step counts on the device
                assert int(value) == int(compiled.state[q][key]) == steps, (i, key)
            elif isinstance(value, torch.Tensor):
                _assert_same_bits(value, compiled.state[q][key], f"state[{key!r}] of param {i}")


@pytest.mark.parametrize("name,policy", [("SGD", "fp32"), ("SGD", "bf16 remainders"),
                                         ("AdamW", "fp32"), ("AdamW", "bf16 remainders"),
                                         ("Lion", "bf16 remainders")])
def test_offloaded_compiled_step_writes_the_params_back(name, policy):
    """offload="cpu" under torch.compile(opt.step) (default mode, from the first step):
    the stepped host copies are written into the params, as eagerly. 4 steps, each
    after a backward (whose hooks copy the grads to the host) and the grads halved in
    place after it (a graph cannot verify the hooks' copies: it copies every grad
    again): the eager step's bits in params and state, no graph break, one graph for
    the first step and one for the others. The compiled step used to step the host
    copies and never write them back (SGD's params stayed where they were: moved 0, 0,
    0 where eager moved 0.1, 0.19, 0.27)."""
    dtype, pol = POLICIES[policy]
    eager_params = _params(dtype, seed=7)
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    kw = dict(lr=0.01, policy=pol, offload="cpu", **({"momentum": 0.9} if name == "SGD" else {}))
    eager = getattr(precis.optim, name)(eager_params, **kw)
    compiled = getattr(precis.optim, name)(compiled_params, **kw)
    step = torch.compile(compiled.step)
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(8)
    for _ in range(4):
        xs = [torch.randn(p.shape, generator=g).to(dtype) for p in eager_params]
        for params in (eager_params, compiled_params):
            sum((p * x).sum() for p, x in zip(params, xs)).backward()
            for p in params:
                p.grad.mul_(0.5)  # after the hook copied it
        eager.step()
        step()
        eager.zero_grad()
        compiled.zero_grad()
    assert _graph_breaks() == {}
    assert _graphs() == 2, "one graph for the first step, one for all the others"
    _assert_same_state(eager, compiled, eager_params, compiled_params, 4)


@pytest.mark.parametrize("policy", ["bf16 default", "bf16 remainders"])
def test_offloaded_compiled_step_of_params_in_one_buffer(policy):
    """Params put in one flat buffer with .data = (as Megatron-style contiguous buffers
    do), offloaded, under torch.compile(opt.step) from the first step: the eager step's
    bits. Their host copies are made eagerly at the first compiled call: made in the
    graph, inductor folded them into the params, and all but the first param were
    stepped from the buffer's first elements (remainders' bits wrong from step 1)."""
    dtype, pol = POLICIES[policy]

    def in_one_buffer(params):
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        start = 0
        for p in params:
            p.data = flat[start:start + p.numel()].view(p.shape)
            start += p.numel()
        return params
    eager_params = in_one_buffer(_params(dtype, seed=7))
    compiled_params = in_one_buffer(_params(dtype, seed=7))
    eager = precis.optim.AdamW(eager_params, lr=0.01, policy=pol, offload="cpu")
    compiled = precis.optim.AdamW(compiled_params, lr=0.01, policy=pol, offload="cpu")
    step = torch.compile(compiled.step)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        _give_grads(g, dtype, eager_params, compiled_params)
        eager.step()
        step()
    _assert_same_state(eager, compiled, eager_params, compiled_params, 3)


@pytest.mark.parametrize("compiled", ["whole step", "backward"])
def test_offloaded_grad_hooks_run_eagerly_in_a_compiled_training_step(compiled, monkeypatch):
    """backward() inside a torch.compile'd function (the whole training step: loss,
    backward, opt.step(), zero_grad(); or the loss and backward, the step eager) fires
    the offload's gradient hooks, which copy each grad to the host, on the thread where
    dynamo compiles every new frame: they run eagerly, never traced (traced, dynamo
    compiled the hook once a param, the param's id in its guards, and at the ninth
    offloaded param hit its recompile limit, here an error), and the run ends with the
    eager run's bits. An eager step takes every hook's copy (none left). 12 params (bf16
    remainders), 3 steps."""
    dtype, pol = POLICIES["bf16 remainders"]
    traced, grad_ready = [], precis.offload.Offload.grad_ready

    def watched(self, p):
        traced.append(precis.tracing.traced())
        return grad_ready(self, p)
    runs = []
    for compiling in (False, True):
        params = [p for seed in range(3) for p in _params(dtype, seed=seed)]
        opt = precis.optim.AdamW(params, lr=0.01, policy=pol, offload="cpu")

        def backward(xs):
            sum((p * x).sum() for p, x in zip(params, xs)).backward()

        def train_step(xs):
            backward(xs)
            opt.step()
            opt.zero_grad()
        if compiling and compiled == "whole step":
            step = torch.compile(train_step)
        elif compiling:
            compiled_backward = torch.compile(backward)

            def step(xs):
                compiled_backward(xs)
                opt.step()
                opt.zero_grad()
        else:
            step = train_step
        if compiling:
            monkeypatch.setattr(precis.offload.Offload, "grad_ready", watched)
        g = torch.Generator().manual_seed(8)
        for _ in range(3):
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                step([torch.randn(p.shape, generator=g).to(dtype) for p in params])
            if compiled == "backward":
                assert opt._books.offload._grad_copied == {}
        runs.append((opt, params))
    assert len(traced) == 12 * 3 and not any(traced), traced
    _assert_same_state(*(r[0] for r in runs), *(r[1] for r in runs), 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_offloaded_cuda_params_are_stepped_uncompiled(device, monkeypatch):
    """Host copies of CUDA params are copied on side streams with events the host waits
    on, which a graph cannot: the step runs uncompiled, so under fullgraph=True dynamo
    refuses before anything is written, and in the default mode it calls the step
    eagerly (the eager bits; on the GPU the traced step's inner frames failed on
    record_stream, H200 2026-11-27), on its eager path (torch 2.11 keeps
    is_compiling() True inside the uncompiled call, and dynamo marks the group
    capturable: either way the step took its capturable path, which refuses the host's
    step counts, H200 2026-11-27). On the CPU the offloaded CPU
    params are taken for CUDA ones (the test of the dispatch; their copies are plain)."""
    if device == "cpu":
        monkeypatch.setattr(precis.offload.Offload, "traced_with_cuda_params",
                            lambda self, groups: precis.tracing.traced())
    g = torch.Generator().manual_seed(9)
    p = torch.nn.Parameter(torch.randn(33, 5, generator=g).to(device))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.randn(33, 5, generator=g).to(device)
    q.grad = p.grad.clone()
    opt = precis.optim.AdamW([p], lr=0.01, offload="cpu")
    twin = precis.optim.AdamW([q], lr=0.01, offload="cpu")
    if device == "cpu":  # as dynamo marks a group of CUDA params without state (its
        opt.param_groups[0]["capturable"] = True  # _set_capturable; H200 2026-11-27)
    before = p.detach().clone()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="offloaded CUDA params runs uncompiled"):
        torch.compile(opt.step, fullgraph=True)()
    assert torch.equal(p.detach(), before) and not opt.state.get(p)
    torch._dynamo.reset()
    # where the step's groups are stepped: whether it takes the capturable path (counts
    # on the device: traced, or a group capturable), the eager path's False
    seen = []
    step_groups = precis.functional.step_groups
    monkeypatch.setattr(precis.functional, "step_groups", lambda *args, **kwargs: seen.append(
        precis.step_calls.counts_on_device(args[0][0])) or step_groups(*args, **kwargs))
    for _ in range(2):
        with monkeypatch.context() as inside:
            # as torch 2.11 answers inside the uncompiled step (2.13 answers False there)
            inside.setattr(torch.compiler, "is_compiling", lambda: True)
            torch.compile(opt.step)()
        twin.step()
    _assert_same_bits(p, q, "param")
    assert not torch.equal(p.detach(), before)
    assert len(seen) == 4 and not any(seen)  # (the twin's eager steps too)
    # dynamo's mark left as it is (a guard of the compiled frame), read as False inside
    assert opt.param_groups[0]["capturable"] is True


def _replayed_grads(seed, params, steps):
    """The gradients _give_grads gives params in `steps` steps from this seed."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _tensor_lr_twins(name, lr_dtype):
    """(eager params, compiled params, their optimizers, their tensor lrs)."""
    g = torch.Generator().manual_seed(10)
    shapes = ((33, 5), (7, 12)) if name == "Muon" else ((127,), (33, 5), (1,))
    eager_params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    lrs = [torch.tensor(0.01, dtype=lr_dtype) for _ in range(2)]
    kw = {"momentum": 0.9} if name == "SGD" else {}
    make = getattr(precis.optim, name)
    return (eager_params, compiled_params, make(eager_params, lr=lrs[0], **kw),
            make(compiled_params, lr=lrs[1], **kw), lrs)


@pytest.mark.parametrize("name,lr_dtype", [("SGD", torch.float32), ("SGD", torch.float64),
                                           ("AdamW", torch.float32), ("AdamW", torch.float64),
                                           ("Lion", torch.float64), ("Muon", torch.float64)])
def test_compiled_step_reads_a_tensor_lr_changed_in_place(name, lr_dtype):
    """A tensor lr changed in place between steps (as torch's schedulers change one),
    under torch.compile(opt.step, fullgraph=True) from the first step: every step reads
    the lr it is given (0.01, 0.02, 0.04, 0.08), one graph for the first step and one
    for the others, no graph break. The eager step's bits (Muon: its compiled
    Newton-Schulz rounds apart from eager's, so the params within 3% of the steps'
    largest updates; its momentum bit for bit). A float64 lr used to be copied into a
    buffer whose copy inductor dropped (the graph kept stepping with the first lr), a
    float32 one failed the graph on a guard of its .item() (5-7 breaks without
    fullgraph)."""
    eager_params, compiled_params, eager, compiled, lrs = _tensor_lr_twins(name, lr_dtype)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    step = torch.compile(compiled.step, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(11)
    for k in range(4):
        for lr in lrs:
            lr.fill_(0.01 * 2 ** k)
        _give_grads(g, torch.float32, eager_params, compiled_params)
        eager.step()
        step()
    assert _graph_breaks() == {}
    assert _graphs() == 2, "one graph for the first step, one for all the others"
    if name == "AdamW":  # precis's eager AdamW has torch's bits (README): torch's too
        lr = torch.tensor(0.01, dtype=lr_dtype)
        reference = torch.optim.AdamW(torch_params, lr=lr)
        for k, grads in enumerate(_replayed_grads(11, eager_params, 4)):
            lr.fill_(0.01 * 2 ** k)
            for p, grad in zip(torch_params, grads):
                p.grad = grad
            reference.step()
        for i, (p, q) in enumerate(zip(torch_params, compiled_params)):
            _assert_same_bits(p, q, f"param {i} against torch.optim.AdamW")
    if name != "Muon":
        _assert_same_state(eager, compiled, eager_params, compiled_params, 4)
        return
    for i, (p, q) in enumerate(zip(eager_params, compiled_params)):
        _assert_same_bits(eager.state[p]["exp_avg"], compiled.state[q]["exp_avg"],
                          f"momentum of param {i}")
        largest = 0.15 * 0.2 * max(p.shape) ** 0.5 * 1.5  # the lrs' sum * ratio * |update|
        diff = (p - q).abs().max().item()
        assert diff <= 0.03 * largest, (i, diff)


@pytest.mark.parametrize("policy", [{"store_param_remainders": True}, None],
                         ids=["remainders", "default"])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_an_eager_step_after_compiled_steps_gives_the_eager_bits(policy, offload):
    """Compiled steps between eager ones: the eager step does not take the compiled
    steps' writes for a load (they record nothing; before, it warned and zeroed the
    remainders: other bits than an all-eager run)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(37, generator=gen).bfloat16())]
    b = [torch.nn.Parameter(a[0].detach().clone())]
    opt_a = precis.optim.AdamW(a, lr=0.01, policy=policy, offload=offload)
    opt_b = precis.optim.AdamW(b, lr=0.01, policy=policy, offload=offload)
    compiled = torch.compile(opt_b.step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", precis.optim.StaleMasterWarning)
        for k in range(5):
            grad = torch.randn(37, generator=gen).bfloat16()
            a[0].grad, b[0].grad = grad.clone(), grad.clone()
            opt_a.step()
            (opt_b.step if k in (0, 4) else compiled)()
    assert torch.equal(a[0], b[0])
    assert torch.equal(opt_a.master_weight(a[0]), opt_b.master_weight(b[0]))
