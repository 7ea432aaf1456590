"""torch's own optimizer test database for Adam, AdamW, SGD and Muon, driven against
precis.

The torch wheel ships the cases its optimizer tests run on
(torch.testing._internal.common_optimizers): the `optim_db` entries for Adam,
AdamW, SGD and Muon, each with its `optim_inputs_func` (Adam: default, lr,
weight_decay, maximize, amsgrad; capturable and tensor lr/betas on CUDA. SGD: lr,
tensor lr, weight_decay, momentum, maximize, dampening, nesterov. Muon: lr, tensor
lr, weight_decay, momentum, ns_steps, ns_coefficients), its `optim_error_inputs_func`
(bad params, bad hyperparameters, with the exception type and regex torch's tests
expect, raised at construction or at step), and
`_get_optim_inputs_including_global_cliquey_kwargs`, which adds the foreach /
fused / differentiable variant of each input (Muon has none). This module drives
those entries (nothing of torch's test files is copied: the checks are this module's
own) against precis.optim.Adam / AdamW / SGD / Muon (default policy) next to torch's,
so that whatever torch's tests would see of its optimizers, precis shows the same:

* every optimizer input x float32 / float64: params, every state tensor after
  each of a few steps, and state_dict() (every key torch has, in 'state' and in
  each param group); bit for bit in the default mode and with foreach=True on the
  CPU, and with differentiable=True (where the step must also backpropagate as
  torch's), within a stated tolerance of torch run with the same flag for fused
  (and on CUDA); tensor lr / betas on the CPU, which torch's database has only on
  CUDA;
* every error input: the same exception (or warning) type, matching torch's
  regex, with torch's message as the start of precis's;
* torch's constructor errors, hooks (step, state_dict, load_state_dict, global
  step hooks), state dicts (round trip through torch.save / torch.load with
  weights_only=True, torch's into precis and precis's into torch), named params
  (param_names, cross loads), the decoupled_weight_decay group key after loads,
  float64 state, fused=True with params on the meta device;
* sparse gradients (torch's `supports_sparse`: SGD, every input and
  `metadata_for_sparse` with its schedulers): torch's bits and state, its sparse
  momentum_buffer through state dicts both ways; torch's errors where torch raises
  (before precis writes anything), and for Adam, AdamW and Muon, which refuse them.

What precis keeps otherwise by design, and the comparisons allow: SGD's and Muon's
momentum is 'exp_avg' in precis's state (in the policy's momentum dtype; compared
under torch's name 'momentum_buffer', which precis.checkpoint.to_torch_state_dict
gives it: precis's state dict goes to torch through it), and precis counts a 'step'
for every param its kernels step (torch's SGD keeps none; extra keys are allowed,
torch's all compared). Params torch's own math steps (float64, complex128,
differentiable=True; precis.torch_math) keep torch's state exactly, 'momentum_buffer'
included. Muon's params are matrices (torch's Muon takes only 2-D params); Muon has
no foreach / fused / differentiable flags and takes no complex params.

The device is a parameter: "cuda" runs where a GPU is (torch's error cases on
CUDA included), and skips elsewhere.
"""
import copy
import io
import re
from contextlib import nullcontext

import pytest
import torch
from torch.nn import Parameter
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum, _get_optim_inputs_including_global_cliquey_kwargs, optim_db)

import precis  # noqa: F401  (loads the package, registers the ops)
from precis import checkpoint, optim

NAMES = ("Adam", "AdamW", "SGD", "Muon")
INFOS = {info.name: info for info in optim_db if info.name in NAMES}
TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD,
         "Muon": torch.optim.Muon}
OURS = {"Adam": optim.Adam, "AdamW": optim.AdamW, "SGD": optim.SGD, "Muon": optim.Muon}
# precis's state key -> torch's, where they differ (each rule's torch_names)
TORCH_NAMES = {"SGD": {"exp_avg": "momentum_buffer"}, "Muon": {"exp_avg": "momentum_buffer"}}
FUSED_NAMES = [n for n in NAMES if "fused" in INFOS[n].supported_impls]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.cuda  # skipped without a device (conftest.py)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DTYPES = {"float32": torch.float32, "float64": torch.float64}
SIZES = [(127,), (33, 5), (1,), (4097,)]
MATRICES = [(33, 5), (5, 33), (1, 1), (64, 64)]  # Muon's (2-D params only)
STEPS = 5


def sizes_of(cls):
    """The param shapes an optimizer class (torch's or precis's) is run on."""
    return MATRICES if "Muon" in cls.__name__ else SIZES  # (a subclass: MyMuon)


# torch's fused CPU kernel orders the update differently from its for-loop step,
# which precis repeats: after 5 steps of these inputs the params differ from the
# for-loop's by up to ~2e-6 relative (a few ulps of fp32 per step; elements near
# zero by < 1e-9 absolute, the update's rounding), exp_avg not at all, exp_avg_sq by
# <= 2 ulps; in float64 by <= 2 ulps (measured: torch fused vs torch for-loop, torch
# 2.13 CPU, every input below, three seeds: rtol 2e-6 / atol 1e-9 held; the bounds
# below leave 2x / 10x). On the CPU torch's foreach=True runs the per-tensor ops
# and gives the for-loop's bits: compared bit for bit there. On CUDA (H100, torch
# 2.11, 2026-11-24) the same bounds held for the default and foreach modes.
TOL = {torch.float32: dict(rtol=4e-6, atol=1e-8), torch.float64: dict(rtol=4e-15, atol=1e-17)}
# torch's fused CPU SGD against its for-loop (torch 2.13, every SGD input below, three
# seeds): params within TOL, the float32 momentum buffer off by up to 8.5e-8 absolute
# beyond rtol 4e-6 (elements near zero after cancellation: 1 ulp of the buffer's O(1)
# values), the float64 one within TOL. atol leaves 2.4x.
TOL_SGD_FUSED_FLOAT32 = dict(rtol=4e-6, atol=2e-7)
# torch's fused and capturable float32 steps on CUDA compute their scalars in float32:
# the fused kernel's 1 - beta2 is 1 - float(0.999), 1.29e-5 relative below precis's
# float(1 - 0.999), and the capturable step's bias corrections are float32 tensor
# ops. Measured on the H100 (torch 2.11): exp_avg_sq off by up to 1.3e-5 relative
# after one step, params by up to 1.7e-5 relative (1.3e-8 absolute) after two. rtol
# leaves ~3x over what was seen. v off by 1.29e-5 puts each update off by half that,
# the same way every step: 5 steps at lr 0.01 with |m / sqrt(v)| up to ~3 move a
# param near zero by up to ~1e-6 (param_atol, for params only). The fused kernel's
# exp_avg, beta1 * m + (1 - beta1) * g, may round its terms apart from precis's: an
# element near zero after they cancel keeps that rounding as its whole difference
# (H200, torch 2.11, 2026-11-26: 1.77e-8 absolute, 2 of 4097 elements after 5 steps,
# an ulp of terms below 0.5); atol leaves ~3x over what was seen.
TOL_CUDA_FLOAT32_SCALARS = dict(rtol=5e-5, atol=5e-8, param_atol=1e-6)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tensors here are small (<= 4097 elements), and on a
    busy 2-core machine torch's thread pool costs ~50 ms a step (its fused CPU kernel
    and its for-loop ops alike), ~1 ms on one thread. Every kernel compared here
    works element by element: the bits do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------
# Cases from torch's database
# ---------------------------------------------------------------------------------


def mode_of(kwargs):
    """Which of torch's implementations the kwargs select: differentiable, fused,
    foreach, or default (the for-loop single-tensor step)."""
    for flag in ("differentiable", "fused", "foreach"):
        if kwargs.get(flag):
            return flag
    return "default"


def optim_inputs(name, device, dtype):
    """torch's inputs with their global-cliquey variants. The helper leaves foreach
    out on the CPU (torch has no foreach kernels there), but torch.optim accepts
    foreach=True on the CPU (it runs the per-tensor ops): a user may pass it, so the
    variant is added here, for every input of an optimizer that has foreach."""
    inputs = _get_optim_inputs_including_global_cliquey_kwargs(device, dtype, INFOS[name])
    cases = [(i.desc, i.kwargs) for i in inputs]
    if "foreach" in INFOS[name].supported_impls and not any(kw.get("foreach")
                                                             for _, kw in cases):
        for desc, kw in [(d, k) for d, k in cases if mode_of(k) == "default"]:
            cases.append((f"{desc} & foreach", dict(copy.deepcopy(kw), foreach=True)))
    return cases


def case_id(*parts):
    return "-".join(re.sub(r"[^A-Za-z0-9.=+]+", "_", str(p).replace(" & ", "+")).strip("_")
                    for p in parts)


def step_cases(only=None):
    cases = []
    for name in NAMES:
        for device in ("cpu", "cuda"):
            for dname, dtype in DTYPES.items():
                for desc, kwargs in optim_inputs(name, device, dtype):
                    if only is not None and mode_of(kwargs) != only:
                        continue
                    marks = [needs_cuda] if device == "cuda" else []
                    cases.append(pytest.param(name, device, dtype, kwargs, marks=marks,
                                              id=case_id(name, device, dname, desc)))
    return cases


def error_cases():
    """(name, device, dtype, index) of each error input. torch builds the CUDA ones
    on the device, so they are listed only where there is one (torch's own error
    test runs on the CPU only)."""
    cases = []
    for name in NAMES:
        for device in ("cpu", "cuda"):
            if device == "cuda" and not HAS_CUDA:
                cases.append(pytest.param(name, device, None, None, marks=needs_cuda,
                                          id=case_id(name, device)))
                continue
            for dname, dtype in DTYPES.items():
                errors = INFOS[name].optim_error_inputs_func(device, dtype)
                for i, err in enumerate(errors):
                    cases.append(pytest.param(
                        name, device, dtype, i,
                        id=case_id(name, device, dname, i, err.optimizer_error_input.desc)))
    return cases


# ---------------------------------------------------------------------------------
# Running both optimizers
# ---------------------------------------------------------------------------------


def initial(device, dtype, sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).to(device) for s in sizes]


def grads_of(step, like):
    """The gradients of step `step` (the same for every run: seeded by the step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in like]


def names_of(cls):
    """precis's state keys -> torch's for the optimizer class (precis's one-state
    optimizers' 'exp_avg'); {} for torch's classes."""
    return TORCH_NAMES.get(cls.__name__, {}) if cls in OURS.values() else {}


class Run:
    """An optimizer stepped over the seeded gradients, with what each step left."""

    def __init__(self, cls, kwargs, device, dtype, steps=STEPS):
        self.differentiable = bool(kwargs.get("differentiable"))
        self.names = names_of(cls)
        inits = initial(device, dtype, sizes_of(cls))
        if self.differentiable:
            # As torch's differentiable tests: the params are non-leaf copies of
            # leaves, so that the step's in-place updates are recorded by autograd.
            self.leaves = [t.clone().requires_grad_() for t in inits]
            self.params = [leaf.clone() for leaf in self.leaves]
        else:
            self.leaves = None
            self.params = [Parameter(t.clone()) for t in inits]
        # each optimizer its own kwargs: tensors in them (lr, betas) are written in place
        self.opt = cls(self.params, **copy.deepcopy(kwargs))
        self.first_grads, self.trace = [], []
        self.steps(0, steps)

    def steps(self, start, stop):
        for step in range(start, stop):
            grads = grads_of(step, self.params)
            if self.differentiable and step == 0:
                self.first_grads = [g.requires_grad_() for g in grads]
            for p, g in zip(self.params, grads):
                p.grad = g
            with torch.enable_grad() if self.differentiable else nullcontext():
                self.opt.step()
            self.trace.append(([p.detach().clone() for p in self.params],
                               [{self.names.get(k, k): v.detach().clone()
                                 if torch.is_tensor(v) else v
                                 for k, v in self.opt.state[p].items()} for p in self.params]))
        return self


def tolerance(mode, device, dtype, capturable=False, name="Adam"):
    """None = bit for bit. Default mode and foreach: torch's for-loop bits on the
    CPU (what precis promises); differentiable: precis runs torch's own math, on any
    device; float64 default mode on CUDA too. Otherwise the measured TOL (torch's
    float32 scalars on CUDA: TOL_CUDA_FLOAT32_SCALARS; SGD's fused float32 momentum:
    TOL_SGD_FUSED_FLOAT32)."""
    if mode == "differentiable" or (device == "cpu" and mode in ("default", "foreach")):
        return None
    if mode == "default" and dtype == torch.float64:
        return None
    if device == "cuda" and dtype.to_real() == torch.float32 and (mode == "fused" or capturable):
        return TOL_CUDA_FLOAT32_SCALARS
    if name == "SGD" and mode == "fused" and dtype.to_real() == torch.float32:
        return TOL_SGD_FUSED_FLOAT32
    return TOL[dtype.to_real()]  # complex: its parts' tolerance


def assert_tensor(ours, theirs, what, tol=None, param=False, on_cpu=False):
    """ours equals theirs (bit for bit, or within tol: its param_atol for a param);
    on_cpu: ours is on the CPU where theirs is on its device, values compared there."""
    assert torch.is_tensor(ours), f"{what}: precis has {type(ours).__name__}, torch a tensor"
    assert ours.layout == theirs.layout, f"{what}: precis has {ours.layout}, torch {theirs.layout}"
    if theirs.is_sparse:  # (torch's SGD momentum after sparse gradients): as torch made it,
        assert ours.shape == theirs.shape, what  # repeated indices (uncoalesced) too
        assert_tensor(ours._indices(), theirs._indices(), f"{what} indices", None, False, on_cpu)
        assert_tensor(ours._values(), theirs._values(), f"{what} values", tol, param, on_cpu)
        return
    where = torch.device("cpu") if on_cpu else theirs.device
    assert (ours.dtype, ours.shape, ours.device) == (theirs.dtype, theirs.shape, where), (
        f"{what}: precis has {ours.dtype} {tuple(ours.shape)} on {ours.device}, torch "
        f"{theirs.dtype} {tuple(theirs.shape)} on {theirs.device}")
    a, b = ours.detach(), theirs.detach().to(where)
    if tol is None:
        if not torch.equal(a, b):
            diff = (a != b)
            raise AssertionError(f"{what}: {int(diff.sum())} of {a.numel()} elements differ "
                                 f"from torch's, max |diff| {float((a - b).abs().max()):.3g}")
    else:
        atol = tol.get("param_atol", tol["atol"]) if param else tol["atol"]
        torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=atol,
                                   msg=lambda m: f"{what}: {m}")


def assert_value(ours, theirs, what, tol=None):
    if torch.is_tensor(theirs):
        assert_tensor(ours, theirs, what, tol)
    elif isinstance(theirs, (tuple, list)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), \
            f"{what}: precis has {ours!r}, torch {theirs!r}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_value(a, b, f"{what}[{i}]", tol)
    else:  # a number of either type (torch's Adam has weight_decay=0, an int)
        same = ours is theirs if isinstance(theirs, bool) or theirs is None else ours == theirs
        assert same and isinstance(ours, bool) == isinstance(theirs, bool), \
            f"{what}: precis has {ours!r}, torch {theirs!r}"


def assert_state(ours, theirs, what, tol=None, step_on_cpu=False):
    """Every key of torch's state is in precis's, with an equal value ('step'
    exactly, whatever the tolerance; step_on_cpu: precis's on the CPU)."""
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"{what}: precis's state lacks {missing}"
    for key in theirs:
        if key == "step" and step_on_cpu:
            assert_tensor(ours[key], theirs[key], f"{what} 'step'", None, on_cpu=True)
        else:
            assert_value(ours[key], theirs[key], f"{what} {key!r}",
                         None if key == "step" else tol)


def step_on_cpu(kwargs, device, dtype):
    """Whether precis keeps 'step' on the CPU where torch keeps it on the device: a
    fused step of its kernels that is not capturable (precis's counts stay on the
    host, so neither the step nor a Plan waits on the device; optim.py's docstring).
    float64 params are stepped by torch's own math (precis.torch_math), which keeps
    torch's step."""
    return device != "cpu" and bool(kwargs.get("fused")) and not kwargs.get("capturable") \
        and dtype.to_real() == torch.float32


def assert_runs(ours, theirs, tol, step_on_cpu=False):
    for step, ((pa, sa), (pb, sb)) in enumerate(zip(ours.trace, theirs.trace), 1):
        for i, (a, b) in enumerate(zip(pa, pb)):
            assert_tensor(a, b, f"step {step}, param {i} {tuple(b.shape)}", tol, param=True)
        for i, (a, b) in enumerate(zip(sa, sb)):
            assert_state(a, b, f"step {step}, state of param {i}", tol, step_on_cpu)
    assert len(ours.trace) == len(theirs.trace)


def assert_groups(ours, theirs, what):
    """Every key of torch's param groups is in precis's, with an equal value
    (precis adds its own keys: policy, seed)."""
    assert len(ours) == len(theirs), f"{what}: {len(ours)} param groups, torch {len(theirs)}"
    for gi, (ga, gb) in enumerate(zip(ours, theirs)):
        missing = sorted(set(gb) - set(ga))
        assert not missing, f"{what}: param group {gi} lacks torch's keys {missing}"
        for key in gb:
            if key == "params" and gb[key] and torch.is_tensor(gb[key][0]):  # the params
                assert [p.shape for p in ga[key]] == [p.shape for p in gb[key]], what
                continue
            assert_value(ga[key], gb[key], f"{what}: param group {gi} {key!r}")


def torch_named(sd, names):
    """A state dict with its params' state keys as torch names them (names: precis's
    key -> torch's, Run.names)."""
    return dict(sd, state={index: {names.get(k, k): v for k, v in state.items()}
                           for index, state in sd["state"].items()})


def assert_state_dicts(ours, theirs, tol=None, step_on_cpu=False):
    assert set(theirs) <= set(ours), f"state_dict keys {sorted(ours)}, torch's {sorted(theirs)}"
    assert sorted(ours["state"]) == sorted(theirs["state"]), \
        f"state_dict 'state' indices {sorted(ours['state'])}, torch's {sorted(theirs['state'])}"
    for index in theirs["state"]:
        assert_state(ours["state"][index], theirs["state"][index],
                     f"state_dict 'state'[{index}]", tol, step_on_cpu)
    assert_groups(ours["param_groups"], theirs["param_groups"], "state_dict")


# ---------------------------------------------------------------------------------
# 1. Every optimizer input: steps and state dicts
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name,device,dtype,kwargs", step_cases())
def test_steps_match_torch(name, device, dtype, kwargs):
    theirs = Run(TORCH[name], kwargs, device, dtype)
    ours = Run(OURS[name], kwargs, device, dtype)
    assert_runs(ours, theirs, tolerance(mode_of(kwargs), device, dtype,
                                        bool(kwargs.get("capturable")), name),
                step_on_cpu(kwargs, device, dtype))
    assert_groups(ours.opt.param_groups, theirs.opt.param_groups, "param_groups")


@pytest.mark.parametrize("name,device,dtype,kwargs", step_cases())
def test_state_dict_matches_torch(name, device, dtype, kwargs):
    theirs = Run(TORCH[name], kwargs, device, dtype, steps=2)
    ours = Run(OURS[name], kwargs, device, dtype, steps=2)
    assert_state_dicts(torch_named(ours.opt.state_dict(), ours.names),
                       theirs.opt.state_dict(),
                       tolerance(mode_of(kwargs), device, dtype,
                                 bool(kwargs.get("capturable")), name),
                       step_on_cpu(kwargs, device, dtype))


@pytest.mark.parametrize("name,device,dtype,kwargs", step_cases(only="differentiable"))
def test_differentiable_step_backpropagates_as_torch(name, device, dtype, kwargs):
    """differentiable=True: the steps are recorded by autograd; the gradient of a
    loss on the stepped params reaches the initial params and the first step's
    gradients, with torch's values."""
    results = []
    # torch's amsgrad step writes max_exp_avg_sq in place where the previous step's
    # graph needs it: torch backpropagates through one amsgrad step only.
    steps = 1 if kwargs.get("amsgrad") else 3
    for cls in (TORCH[name], OURS[name]):
        run = Run(cls, kwargs, device, dtype, steps=steps)
        weights = initial(device, dtype, sizes_of(cls), seed=7)
        loss = sum((p * w).sum() for p, w in zip(run.params, weights))
        # (torch's SGD starts its momentum buffer from grad.detach(): with momentum and
        # without Nesterov the first step's grads do not reach the params)
        results.append(torch.autograd.grad(loss, run.leaves + run.first_grads,
                                           allow_unused=True, materialize_grads=True))
    theirs, ours = results
    n = len(ours) // 2
    for i, (a, b) in enumerate(zip(ours, theirs)):
        what = f"d loss / d {'initial param' if i < n else 'first gradient'} {i % n}"
        assert_tensor(a, b, what)
    # One step's update, lr * m / (sqrt(v) + eps) with m and v from one grad, is
    # lr * g / (|g| + eps): its derivative (~lr * eps / g^2) is a difference that
    # torch's capturable amsgrad step on CUDA rounds to exactly 0 (H100, torch 2.11).
    detached = name == "SGD" and kwargs.get("momentum", 0) != 0 and not kwargs.get("nesterov")
    if not (device == "cuda" and kwargs.get("capturable")) and not detached:
        assert all(bool(g.ne(0).any()) for g in theirs[n:]), \
            "torch's step does not depend on the grad"


# Tensor lr / betas in the default mode: torch's database has them only with
# capturable=True (CUDA inputs), but torch accepts them on the CPU too; its step then
# computes 1 - beta and lr / bias_correction as tensor ops (float32 when the tensors
# are), and its constructor squeezes betas of shape (1,) or (1, 1) to 0-dim.
ADAM_TENSOR_HPARAMS = {
    "tensor_lr": dict(lr=torch.tensor(0.01), weight_decay=0.1, amsgrad=True),
    "tensor_betas": dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
    "tensor_lr_and_betas": dict(lr=torch.tensor(0.01),
                                betas=(torch.tensor(0.8), torch.tensor(0.95))),
    "tensor_betas_1_element": dict(betas=(torch.tensor([[[0.9]]]), torch.tensor([[0.99]]))),
}
# torch's SGD takes a tensor weight_decay too (its step adds it as alpha=)
TENSOR_HPARAMS = {
    "Adam": ADAM_TENSOR_HPARAMS, "AdamW": ADAM_TENSOR_HPARAMS,
    "SGD": {"tensor_lr": dict(lr=torch.tensor(0.01), momentum=0.9, weight_decay=0.1),
            "tensor_weight_decay": dict(weight_decay=torch.tensor(0.1), momentum=0.9,
                                        nesterov=True)},
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("name,case", [(n, c) for n in TENSOR_HPARAMS
                                       for c in sorted(TENSOR_HPARAMS[n])])
def test_tensor_hyperparameters_match_torch(name, case, dtype):
    kwargs = TENSOR_HPARAMS[name][case]
    theirs = Run(TORCH[name], kwargs, "cpu", dtype)
    ours = Run(OURS[name], kwargs, "cpu", dtype)
    assert_runs(ours, theirs, None)
    assert_state_dicts(torch_named(ours.opt.state_dict(), ours.names), theirs.opt.state_dict())


# options that give each optimizer all of its state
FULL_STATE = {"Adam": dict(weight_decay=0.1, amsgrad=True),
              "AdamW": dict(weight_decay=0.1, amsgrad=True),
              "SGD": dict(momentum=0.9, weight_decay=0.1), "Muon": {}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_float64_params_keep_float64_state(name, device):
    """torch's state, keys and dtypes: float64 moments (and Adam's float32 'step')."""
    kwargs = FULL_STATE[name]
    theirs = Run(TORCH[name], kwargs, device, torch.float64, steps=1)
    ours = Run(OURS[name], kwargs, device, torch.float64, steps=1)
    for p, q in zip(ours.params, theirs.params):
        dtypes = {k: v.dtype for k, v in ours.opt.state[p].items() if torch.is_tensor(v)}
        expected = {k: v.dtype for k, v in theirs.opt.state[q].items()}
        assert {v for k, v in expected.items() if k != "step"} == {torch.float64}
        assert expected.get("step", torch.float32) == torch.float32
        assert dtypes == expected


# (Muon: torch's refuses complex params, an error input of its database)
COMPLEX_CASES = [("Adam", dict(weight_decay=0.1, amsgrad=True)),
                 ("Adam", dict(weight_decay=0.1, decoupled_weight_decay=True)),
                 ("AdamW", dict(weight_decay=0.1, amsgrad=True))] + [("SGD", kwargs) for kwargs in (
    dict(lr=0.01), dict(momentum=0.9, dampening=0.5, weight_decay=0.1),
    dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True))]


@pytest.mark.parametrize("name,kwargs", COMPLEX_CASES,
                         ids=[case_id(n, *(f"{k}={v}" for k, v in kw.items()))
                              for n, kw in COMPLEX_CASES])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_params_match_torch(name, kwargs, device, dtype):
    """complex64 goes through precis's kernel as pairs of fp32 (torch's Adam steps
    view_as_real pairs too; torch's SGD and Adam's L2 decay compute in complex
    arithmetic, and precis runs torch's math there), complex128 through torch's math
    (torch_math): torch's bits and torch's state dtypes."""
    theirs = Run(TORCH[name], kwargs, device, dtype)
    ours = Run(OURS[name], kwargs, device, dtype)
    tol = tolerance("default", device, dtype)
    assert_runs(ours, theirs, tol)
    assert_state_dicts(torch_named(ours.opt.state_dict(), ours.names),
                       theirs.opt.state_dict(), tol)


# ---------------------------------------------------------------------------------
# 2. Every error input, and 9. constructor errors
# ---------------------------------------------------------------------------------


def tensors_in(params):
    """The tensors of an optimizer's params argument (tensors, (name, tensor) pairs,
    or param groups of either)."""
    if torch.is_tensor(params):
        return [params]
    out = []
    for item in params:
        if isinstance(item, dict):
            out += tensors_in(item["params"])
        elif isinstance(item, tuple):
            out.append(item[1])
        else:
            out.append(item)
    return out


def error_message(cls, err, device, dtype):
    """Run one error input on cls the way torch's tests run it; return the message of
    the exception or warning (checked to have torch's type and regex)."""
    inp = err.optimizer_error_input
    params = inp.params if inp.params is not None else \
        [Parameter(torch.randn(2, 3, device=device, dtype=dtype))]
    kwargs = inp.kwargs
    if err.error_on == OptimizerErrorEnum.STEP_ERROR:
        opt = cls(params, **kwargs)
        for t in tensors_in(params):
            t.grad = torch.rand_like(t)
        build = opt.step
    else:
        def build():
            cls(params, **kwargs)
    if issubclass(err.error_type, Warning):
        with pytest.warns(err.error_type, match=err.error_regex) as record:
            build()
        return next(str(w.message) for w in record
                    if isinstance(w.message, err.error_type)
                    and re.search(err.error_regex, str(w.message)))
    with pytest.raises(err.error_type, match=err.error_regex) as info:
        build()
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("name,device,dtype,index", error_cases())
def test_error_input_raises_as_torch(name, device, dtype, index):
    # each run gets fresh params and kwargs: the database makes new ones per call
    err = INFOS[name].optim_error_inputs_func(device, dtype)[index]
    theirs = error_message(TORCH[name], err, device, dtype)
    err = INFOS[name].optim_error_inputs_func(device, dtype)[index]
    ours = error_message(OURS[name], err, device, dtype)
    assert ours.startswith(theirs), f"precis: {ours!r}\ntorch:  {theirs!r}"


# (kwargs, exception type, torch's message): cases torch's tests match on, beside its
# error inputs (test_dropin.py has float lr/eps/betas/weight_decay out of range).
ADAM_CONSTRUCTOR_ERRORS = [
    (dict(lr=-1), ValueError, "Invalid learning rate: -1"),
    (dict(lr=torch.tensor(-1e-3)), ValueError, "Invalid learning rate: -0.0010000000474974513"),
    (dict(eps=-0.5), ValueError, "Invalid epsilon value: -0.5"),
    (dict(betas=(0.5, 1)), ValueError, "Invalid beta parameter at index 1: 1"),
    (dict(betas=(torch.tensor(1.0), torch.tensor(0.9))), ValueError,
     "Invalid beta parameter at index 0: 1.0"),
    (dict(weight_decay=-2), ValueError, "Invalid weight_decay value: -2"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    (dict(lr=torch.tensor(1e-3), foreach=True), ValueError,
     "lr as a Tensor is not supported for capturable=False and foreach=True"),
    (dict(betas=(0.9, torch.tensor(0.99))), ValueError,
     "betas must be either both floats or both Tensors"),
    (dict(betas=(0.9, 0)), ValueError, "betas must be either both floats or both Tensors"),
    (dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True), ValueError,
     "betas[0] as a Tensor is not supported for capturable=False and foreach=True"),
    (dict(fused=True, differentiable=True), RuntimeError,
     "`fused` does not support `differentiable`"),
    (dict(fused=True, foreach=True), RuntimeError,
     "`fused` and `foreach` cannot be `True` together."),
]
CONSTRUCTOR_ERRORS = {
    "Adam": ADAM_CONSTRUCTOR_ERRORS, "AdamW": ADAM_CONSTRUCTOR_ERRORS,
    "SGD": [
        (dict(lr=-1), ValueError, "Invalid learning rate: -1"),
        (dict(lr=torch.tensor(-1e-3)), ValueError,
         "Invalid learning rate: -0.0010000000474974513"),
        (dict(weight_decay=-2), ValueError, "Invalid weight_decay value: -2"),
        (dict(weight_decay=torch.tensor(-0.5)), ValueError, "Invalid weight_decay value: -0.5"),
        (dict(nesterov=True), ValueError,
         "Nesterov momentum requires a momentum and zero dampening"),
        (dict(momentum=0.9, nesterov=True, dampening=0.1), ValueError,
         "Nesterov momentum requires a momentum and zero dampening"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
        (dict(fused=True, differentiable=True), RuntimeError,
         "`fused` does not support `differentiable`"),
        (dict(fused=True, foreach=True), RuntimeError,
         "`fused` and `foreach` cannot be `True` together."),
    ],
    "Muon": [
        (dict(lr=-1), ValueError, "Learning rate should be >= 0 but is: -1"),
        (dict(lr=torch.tensor(-1e-3)), ValueError,
         "Learning rate should be >= 0 but is: -0.0010000000474974513"),
        (dict(momentum=-0.5), ValueError, "momentum should be >= 0 but is: -0.5"),
        (dict(weight_decay=-1), ValueError, "weight decay should be >= 0 but is: -1"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    ],
}
CONSTRUCTOR_CASES = [(name, *case) for name in NAMES for case in CONSTRUCTOR_ERRORS[name]]


@pytest.mark.parametrize("name,kwargs,error,message", CONSTRUCTOR_CASES,
                         ids=[f"{n}-{i}-{case_id(m)}" for i, (n, _, _, m) in
                              enumerate(CONSTRUCTOR_CASES)])
def test_constructor_error_worded_as_torch(name, kwargs, error, message):
    msgs = []
    for cls in (TORCH[name], OURS[name]):
        with pytest.raises(Exception) as info:
            cls([Parameter(torch.randn(2, 3))], **copy.deepcopy(kwargs))
        assert type(info.value) is error, f"{cls.__module__}: {info.value!r}"
        msgs.append(str(info.value))
    theirs, ours = msgs
    assert theirs == message, f"torch's message changed: {theirs!r}"
    assert ours.startswith(theirs), f"precis: {ours!r}\ntorch:  {theirs!r}"


# ---------------------------------------------------------------------------------
# 3. Hooks
# ---------------------------------------------------------------------------------


def fresh(cls, seed=0, **kwargs):
    params = [Parameter(t) for t in initial("cpu", torch.float32, sizes_of(cls), seed=seed)]
    return cls(params, **kwargs), params


def set_grads(params, step):
    for p, g in zip(params, grads_of(step, params)):
        p.grad = g


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks_as_torch(name):
    """Instance and global step pre/post hooks: called in torch's order with the
    same arguments; a pre hook's in-place change to the grads and its replacement
    of the step's arguments (here: a closure) take effect; removed hooks are not
    called."""
    outcome = {}
    for lib, cls in (("torch", TORCH[name]), ("precis", OURS[name])):
        opt, params = fresh(cls, lr=1e-2, weight_decay=0.1)
        log = []

        def closure():
            log.append("closure")
            return torch.tensor(3.0)

        def pre(o, args, kwargs):
            log.append(("pre", o is opt, len(args), sorted(kwargs)))
            for p in params:
                p.grad.mul_(0.5)
            return (args[0], closure), kwargs

        def post(o, args, kwargs):
            log.append(("post", o is opt, len(args), [float(p.detach().sum()) for p in params]))

        handles = [register_optimizer_step_pre_hook(
                       lambda o, a, k: log.append(("global_pre", o is opt, len(a)))),
                   register_optimizer_step_post_hook(
                       lambda o, a, k: log.append(("global_post", o is opt, len(a)))),
                   opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
        try:
            losses = []
            for step in range(3):
                set_grads(params, step)
                losses.append(opt.step())
                if step == 1:
                    for h in handles:
                        h.remove()
        finally:
            for h in handles:
                h.remove()
        outcome[lib] = (log, [float(x) if x is not None else None for x in losses],
                        [p.detach().clone() for p in params])
    (log_t, loss_t, params_t), (log_p, loss_p, params_p) = outcome["torch"], outcome["precis"]
    assert log_p == log_t
    assert loss_p == loss_t == [3.0, 3.0, None]
    for i, (a, b) in enumerate(zip(params_p, params_t)):
        assert_tensor(a, b, f"param {i} after the hooked steps")


@pytest.mark.parametrize("name", NAMES)
def test_step_profiler_range_and_bad_pre_hook_as_torch(name, monkeypatch):
    """The step's profiler range (precis opens it by torch's C++ call, not
    record_function: PrecisOptimizer.profile_hook_step) is torch's: one event a step
    named Optimizer.step#<class>.step, a subclass's after the subclass, around the
    hooks, the same annotations for torch's CUPTI monitor; and a pre hook returning
    neither None nor (args, kwargs) raises torch's error, before the step writes
    anything, its range closed."""
    from torch.profiler import _cupti_monitor
    annotations = []

    class Monitor:  # (torch's CUPTI monitor, running: what record_function tells it)
        def push_user_annotation(self, name):
            annotations.append(("push", name))
            return len(annotations)

        def pop_user_annotation(self):
            annotations.append(("pop",))
    outcome = {}
    for lib, cls in (("torch", TORCH[name]), ("precis", OURS[name])):
        sub = type(f"My{name}", (cls,), {})
        names = []
        for kind in (cls, sub):
            opt, params = fresh(kind, lr=1e-2)
            opt.register_step_pre_hook(
                lambda o, a, k: torch.autograd.profiler.record_function("in_pre_hook")
                .__enter__().__exit__(None, None, None))
            annotations.clear()
            monkeypatch.setattr(_cupti_monitor, "_monitor_singleton", Monitor())
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for step in range(2):
                    set_grads(params, step)
                    opt.step()
            monkeypatch.undo()
            names.append(list(annotations))
            events = [e for e in prof.events() if e.name.startswith("Optimizer.step#")]
            hooked = [e for e in prof.events() if e.name == "in_pre_hook"]
            assert len(hooked) == 2 and all(
                any(s.time_range.start <= h.time_range.start and
                    h.time_range.end <= s.time_range.end for s in events) for h in hooked)
            names.append(sorted(e.name for e in events))
        opt, params = fresh(cls, lr=1e-2)
        set_grads(params, 0)
        before = [p.detach().clone() for p in params]
        opt.register_step_pre_hook(lambda o, a, k: "not a tuple")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with pytest.raises(RuntimeError) as error:
                opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        closed = [e.time_range.end >= e.time_range.start for e in prof.events()
                  if e.name.startswith("Optimizer.step#")]
        outcome[lib] = names, closed, \
            re.sub(r"<function .*? at 0x[0-9a-f]+>", "F", str(error.value))
    assert outcome["precis"] == outcome["torch"]
    ranges = [f"Optimizer.step#{name}.step"] * 2, [f"Optimizer.step#My{name}.step"] * 2
    assert outcome["torch"][0][1::2] == list(ranges)
    assert outcome["torch"][0][0::2] == [
        [("push", r), ("push", "in_pre_hook"), ("pop",), ("pop",)] * 2
        for r in (ranges[0][0], ranges[1][0])]
    assert outcome["torch"][1] == [True]
    # (precis's classes step through precis's wrapper, not torch's record_function)
    assert OURS[name].step.__code__ is \
        optim.AdamW.profile_hook_step(lambda: None).__code__
    assert "must return None or a tuple of (new_args, new_kwargs), but got not a tuple" in \
        outcome["torch"][2]


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_hooks_as_torch(name):
    """state_dict pre/post hooks: torch's order (prepend too); a post hook's
    changes, and a returned dict, end up in the result; a post hook sees the state
    as it is returned (precis's export: SGD's saw 'exp_avg', not 'momentum_buffer')."""
    outcome = {}
    for lib, cls in (("torch", TORCH[name]), ("precis", OURS[name])):
        opt, params = fresh(cls, lr=1e-2)
        set_grads(params, 0)
        opt.step()
        log = []
        opt.register_state_dict_pre_hook(lambda o: log.append(("pre", o is opt)))
        opt.register_state_dict_pre_hook(lambda o: log.append(("pre_first", o is opt)),
                                          prepend=True)

        def post_in_place(o, sd):
            log.append(("post_in_place", sorted(sd)))
            sd["param_groups"][0]["note"] = "kept"
            seen.update((k, sorted(v)) for k, v in sd["state"].items())

        def post_returning(o, sd):
            log.append(("post_returning", sorted(sd)))
            return dict(sd, extra=1)

        opt.register_state_dict_post_hook(post_in_place)
        opt.register_state_dict_post_hook(post_returning)
        seen = {}
        sd = opt.state_dict()
        assert seen == {k: sorted(v) for k, v in sd["state"].items()}, lib
        outcome[lib] = (log, sorted(sd), sd["param_groups"][0].get("note"), sd.get("extra"))
    assert outcome["precis"] == outcome["torch"]


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_hooks_as_torch(name):
    """load_state_dict pre/post hooks: torch's order (prepend too); the pre hooks get
    a shallow copy of the caller's dict (in-place changes to its top level do not
    reach the caller), their changes and a returned dict are what is loaded; the
    post hook sees the loaded optimizer."""
    outcome = {}
    for lib, cls in (("torch", TORCH[name]), ("precis", OURS[name])):
        opt, params = fresh(cls, lr=1e-2)
        set_grads(params, 0)
        opt.step()
        saved = opt.state_dict()
        saved["extra"] = "metadata"
        log = []

        def pre_first(o, sd):
            log.append(("pre_first", o is opt, sorted(sd)))
            sd.pop("extra")  # in place, returns None

        def pre_returning(o, sd):
            log.append(("pre_returning", sorted(sd)))
            groups = [dict(g, lr=0.5) for g in sd["param_groups"]]
            return {"state": sd["state"], "param_groups": groups}

        opt.register_load_state_dict_pre_hook(pre_returning)
        opt.register_load_state_dict_pre_hook(pre_first, prepend=True)
        opt.register_load_state_dict_post_hook(
            lambda o: log.append(("post", o is opt, o.param_groups[0]["lr"])))
        opt.load_state_dict(saved)
        outcome[lib] = (log, sorted(saved), saved["param_groups"][0]["lr"],
                        opt.param_groups[0]["lr"])
    assert outcome["precis"] == outcome["torch"]


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_with_extra_top_level_key_as_torch(name):
    """A state dict carrying an extra top-level key (e.g. added by a state_dict post
    hook) loads in torch, which reads only 'state' and 'param_groups'."""
    results = []
    for cls in (TORCH[name], OURS[name]):
        opt, params = fresh(cls, lr=1e-2)
        set_grads(params, 0)
        opt.step()
        sd = dict(opt.state_dict(), extra={"epoch": 3})
        other, params2 = fresh(cls, lr=1e-2)
        other.load_state_dict(sd)
        set_grads(params2, 1)
        other.step()
        results.append([p.detach().clone() for p in params2])
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert_tensor(a, b, f"param {i} after loading and stepping")


# ---------------------------------------------------------------------------------
# 4. State dicts
# ---------------------------------------------------------------------------------


def saved_and_loaded(sd):
    """sd through torch.save and torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resumed(cls, sd, run, kwargs, stop):
    """A new optimizer of cls on copies of run's params, loaded with sd, continued
    from run's last step to `stop`."""
    cont = copy.copy(run)
    cont.params = [Parameter(p.detach().clone()) for p in run.params]
    cont.opt = cls(cont.params, **copy.deepcopy(kwargs))
    cont.names = names_of(cls)
    cont.opt.load_state_dict(sd)
    cont.trace = []
    return cont.steps(len(run.trace), stop)


def assert_same_end(ours, theirs, tol=None):
    (pa, sa), (pb, sb) = ours.trace[-1], theirs.trace[-1]
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert_tensor(a, b, f"param {i} at the end", tol)
    for i, (a, b) in enumerate(zip(sa, sb)):
        assert_state(a, b, f"state of param {i} at the end", tol)


KW = {"Adam": dict(lr=2e-2, weight_decay=0.1, amsgrad=True),
      "AdamW": dict(lr=2e-2, weight_decay=0.1, amsgrad=True),
      "SGD": dict(lr=2e-2, momentum=0.9, weight_decay=0.1, nesterov=True),
      "Muon": dict(lr=2e-2, weight_decay=0.1, momentum=0.9)}


# Who saves, who loads, and whose uninterrupted run the resumed one must end on.
SAVE_LOAD = {"precis_to_precis": (OURS, OURS, OURS),
             "torch_to_precis": (TORCH, OURS, TORCH),
             "precis_to_torch": (OURS, TORCH, TORCH)}


def state_dict_for(loader, name, sd):
    """What `loader` is given of precis's state dict sd: torch's SGD and Muon name the
    momentum otherwise ('momentum_buffer'), so they get it through
    precis.checkpoint.to_torch_state_dict; torch's Adam reads precis's state of these
    fp32-policy and float64 params as it is."""
    if loader is TORCH and name in TORCH_NAMES:
        return checkpoint.to_torch_state_dict(sd)[0]
    return sd


@pytest.mark.parametrize("saver,loader,reference", SAVE_LOAD.values(), ids=SAVE_LOAD)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_saved_state_continues_bitwise(name, dtype, saver, loader, reference):
    kw = KW[name]
    whole = Run(reference[name], kw, "cpu", dtype, steps=6)
    half = Run(saver[name], kw, "cpu", dtype, steps=3)
    sd = saved_and_loaded(half.opt.state_dict())
    if saver is OURS:
        sd = state_dict_for(loader, name, sd)
    cont = resumed(loader[name], sd, half, kw, 6)
    assert_same_end(cont, whole)
    assert_state_dicts(torch_named(cont.opt.state_dict(), cont.names),
                       torch_named(whole.opt.state_dict(), whole.names))


@pytest.mark.parametrize("name,momentum", [("SGD", 0.9), ("SGD", 0.0), ("Muon", 0.9)])
def test_float64_state_survives_two_round_trips(name, momentum):
    """A float64 param of SGD / Muon keeps torch's state ('momentum_buffer' in float64,
    stepped by torch's math); precis.checkpoint converts a loaded one to precis's names
    ('exp_avg' and a 'step'), and a state dict taken right after a load (before any
    step) loads again: the run resumed after two loads ends on the uninterrupted one."""
    kw = dict(KW[name], momentum=momentum)
    if name == "SGD" and momentum == 0:
        kw.pop("nesterov")
    whole = Run(OURS[name], kw, "cpu", torch.float64, steps=6)
    half = Run(OURS[name], kw, "cpu", torch.float64, steps=3)
    between = resumed(OURS[name], saved_and_loaded(half.opt.state_dict()), half, kw, 3)
    cont = resumed(OURS[name], saved_and_loaded(between.opt.state_dict()), half, kw, 6)
    assert_same_end(cont, whole)
    assert_state_dicts(cont.opt.state_dict(), whole.opt.state_dict())
    for state in cont.opt.state_dict()["state"].values():
        assert set(state) == ({"momentum_buffer"} if momentum else set()), state


# ---------------------------------------------------------------------------------
# 5. Named params
# ---------------------------------------------------------------------------------


def model(name, seed=0):
    """Two linear layers (without biases for Muon, which takes matrices only)."""
    torch.manual_seed(seed)
    bias = name != "Muon"
    return torch.nn.Sequential(torch.nn.Linear(4, 3, bias=bias), torch.nn.Linear(3, 2, bias=bias))


LAYOUTS = {
    "named_parameters": lambda m: m.named_parameters(),
    "named_groups": lambda m: [{"params": list(m[0].named_parameters(prefix="first")),
                                "lr": 1e-2},
                               {"params": list(m[1].named_parameters())}],
    "plain_groups": lambda m: [{"params": list(m[0].parameters()), "lr": 1e-2},
                               {"params": list(m[1].parameters())}],
    "renamed_groups": lambda m: [{"params": [(f"a.{n}", p) for n, p in m[0].named_parameters()],
                                  "lr": 1e-2},
                                 {"params": [(f"b.{n}", p) for n, p in m[1].named_parameters()]}],
}


def step_model(m, opt, step):
    gen = torch.Generator().manual_seed(step)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


@pytest.mark.parametrize("layout", ["named_parameters", "named_groups"])
@pytest.mark.parametrize("name", NAMES)
def test_param_names_as_torch(name, layout):
    outcome = []
    for cls in (TORCH[name], OURS[name]):
        m = model(name)
        opt = cls(LAYOUTS[layout](m))
        step_model(m, opt, 0)
        sd = opt.state_dict()
        outcome.append(([g.get("param_names") for g in opt.param_groups],
                        [g.get("param_names") for g in sd["param_groups"]],
                        [p.detach().clone() for p in m.parameters()]))
    (groups_t, sd_t, params_t), (groups_p, sd_p, params_p) = outcome
    assert groups_t[0] is not None  # torch records the names
    assert groups_p == groups_t
    assert sd_p == sd_t
    for i, (a, b) in enumerate(zip(params_p, params_t)):
        assert_tensor(a, b, f"param {i}")


CROSS = [("named_groups", "plain_groups"), ("plain_groups", "named_groups"),
         ("named_groups", "renamed_groups")]


@pytest.mark.parametrize("saved,loaded", CROSS, ids=[f"{a}-into-{b}" for a, b in CROSS])
@pytest.mark.parametrize("name", NAMES)
def test_param_names_after_load_as_torch(name, saved, loaded):
    """torch's Optimizer.load_state_dict: the saved param_names replace the loading
    optimizer's; a dict saved without names leaves the loading optimizer's names."""
    outcome = []
    for cls in (TORCH[name], OURS[name]):
        m = model(name)
        src = cls(LAYOUTS[saved](m))
        step_model(m, src, 0)
        m2 = copy.deepcopy(m)
        dst = cls(LAYOUTS[loaded](m2))
        dst.load_state_dict(src.state_dict())
        step_model(m2, dst, 1)
        outcome.append(([g.get("param_names") for g in dst.param_groups],
                        [g.get("param_names") for g in dst.state_dict()["param_groups"]],
                        [g["lr"] for g in dst.param_groups],
                        [p.detach().clone() for p in m2.parameters()]))
    (groups_t, sd_t, lr_t, params_t), (groups_p, sd_p, lr_p, params_p) = outcome
    assert groups_p == groups_t, f"param_names in param_groups: precis {groups_p}, torch {groups_t}"
    assert sd_p == sd_t, f"param_names in state_dict(): precis {sd_p}, torch {sd_t}"
    assert lr_p == lr_t
    for i, (a, b) in enumerate(zip(params_p, params_t)):
        assert_tensor(a, b, f"param {i} after the load and a step")


# ---------------------------------------------------------------------------------
# 6. decoupled_weight_decay
# ---------------------------------------------------------------------------------


BUILT = {"AdamW": ("AdamW", {}), "Adam": ("Adam", {}),
         "Adam(decoupled_weight_decay=True)": ("Adam", {"decoupled_weight_decay": True})}


@pytest.mark.parametrize("built", sorted(BUILT))
def test_decoupled_weight_decay_group_key_as_torch(built):
    name, extra = BUILT[built]
    values = []
    for lib in (TORCH, OURS):
        opt, _ = fresh(lib[name], weight_decay=0.1, **extra)
        opt.add_param_group({"params": [Parameter(torch.randn(3))]})
        values.append(([g["decoupled_weight_decay"] for g in opt.param_groups],
                       [g["decoupled_weight_decay"] for g in opt.state_dict()["param_groups"]]))
    assert values[1] == values[0]


# (saved by, loaded into, drop the key from the saved dict first)
LOADS = [("AdamW", "Adam", False), ("Adam", "AdamW", False),
         ("Adam(decoupled_weight_decay=True)", "Adam", False),
         ("AdamW", "AdamW", True), ("AdamW", "Adam", True), ("Adam", "AdamW", True),
         ("Adam", "Adam", True)]


@pytest.mark.parametrize("src,dst,drop", LOADS, ids=[
    f"{s}-into-{d}" + ("-without-key" if drop else "") for s, d, drop in LOADS])
def test_decoupled_weight_decay_after_load_as_torch(src, dst, drop):
    """torch 2.13: a loaded group keeps the saved decoupled_weight_decay (Adam's
    __setstate__ defaults a missing one to False), and AdamW's __setstate__ sets
    True whatever was saved. The next step decays as the loaded flag says."""
    outcome = []
    for lib in (TORCH, OURS):
        name, extra = BUILT[src]
        opt, params = fresh(lib[name], lr=1e-2, weight_decay=0.1, **extra)
        set_grads(params, 0)
        opt.step()
        sd = opt.state_dict()
        if drop:
            for g in sd["param_groups"]:
                del g["decoupled_weight_decay"]
        other, params2 = fresh(lib[BUILT[dst][0]], lr=1e-2, weight_decay=0.1)
        with torch.no_grad():
            for p, q in zip(params2, params):
                p.copy_(q)
        other.load_state_dict(sd)
        flags = ([g["decoupled_weight_decay"] for g in other.param_groups],
                 [g["decoupled_weight_decay"] for g in other.state_dict()["param_groups"]])
        set_grads(params2, 1)
        other.step()
        outcome.append((flags, [p.detach().clone() for p in params2]))
    (flags_t, params_t), (flags_p, params_p) = outcome
    assert flags_p == flags_t, f"decoupled_weight_decay: precis {flags_p}, torch {flags_t}"
    for i, (a, b) in enumerate(zip(params_p, params_t)):
        assert_tensor(a, b, f"param {i} after the load and a step")


# ---------------------------------------------------------------------------------
# 8. fused=True with params on the meta device
# ---------------------------------------------------------------------------------


def meta_model():
    with torch.device("meta"):
        return torch.nn.Linear(33, 5)


FUSED_STATE = {"SGD": dict(momentum=0.9)}  # group options that make a state


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_on_meta_params_fails_at_step_as_torch(name):
    msgs = []
    for cls in (TORCH[name], OURS[name]):
        m = meta_model()
        opt = cls(m.parameters(), fused=True)  # construction works
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError) as info:
            opt.step()
        msgs.append(str(info.value))
    theirs, ours = msgs
    assert theirs.startswith("`fused=True` requires all the params to be floating point "
                             "Tensors of supported devices"), theirs
    assert ours.startswith(theirs), f"precis: {ours!r}\ntorch:  {theirs!r}"


@pytest.mark.parametrize("when", ["built_after_to_empty", "built_on_meta_swapped"])
@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_after_to_empty_matches_torch(name, when):
    """A model built on the meta device, moved with to_empty(device="cpu") and
    initialized: its fused optimizer, built after the move, or built before it (and
    a step tried on meta) with torch's swap_module_params_on_conversion keeping the
    Parameter objects, steps as torch's fused one does."""
    swap = when == "built_on_meta_swapped"
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        runs = []
        for cls in (TORCH[name], OURS[name]):
            m = meta_model()
            opt = None
            if swap:
                opt = cls(m.parameters(), fused=True)
                for p in m.parameters():
                    p.grad = torch.ones_like(p)
                with pytest.raises(RuntimeError):
                    opt.step()
            m.to_empty(device="cpu")
            with torch.no_grad():
                for p, t in zip(m.parameters(), initial("cpu", torch.float32, [(5, 33), (5,)])):
                    p.copy_(t)
            if opt is None:
                opt = cls(m.parameters(), fused=True)
            for group in opt.param_groups:  # SGD: with a momentum buffer to compare
                group.update(FUSED_STATE.get(name, {}))
            params = list(m.parameters())
            assert all(p is q for p, q in zip(opt.param_groups[0]["params"], params))
            for step in range(3):
                set_grads(params, step)
                opt.step()
            runs.append((params, opt))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    (params_t, opt_t), (params_p, opt_p) = runs
    tol, names = tolerance("fused", "cpu", torch.float32, name=name), names_of(OURS[name])
    for i, (a, b) in enumerate(zip(params_p, params_t)):
        assert_tensor(a, b, f"param {i}", tol)
        assert_state({names.get(k, k): v for k, v in opt_p.state[a].items()}, opt_t.state[b],
                     f"state of param {i}", tol)


# ---------------------------------------------------------------------------------
# 10. Sparse gradients
# ---------------------------------------------------------------------------------

# torch's database marks the optimizers that take sparse gradients (SGD: its
# `supports_sparse`, with `metadata_for_sparse`'s kwargs and schedulers, which torch's
# sparse test runs); torch's Adam, AdamW and Muon refuse them at the step.
SPARSE_NAMES = [n for n in NAMES if INFOS[n].supports_sparse]


def sparse_grads_of(step, like):
    """The gradients of step `step`: param 0's dense (precis's kernel steps it beside the
    others), the others sparse as nn.Embedding(sparse=True) makes them: random rows,
    some repeated (uncoalesced, which torch's own sparse test also feeds)."""
    gen = torch.Generator().manual_seed(2000 + step)
    grads = [torch.randn(like[0].shape, generator=gen, dtype=like[0].dtype)]
    for t in like[1:]:
        rows = torch.randint(0, t.shape[0], (t.shape[0] // 2 + 3,), generator=gen)
        values = torch.randn((len(rows),) + tuple(t.shape[1:]), generator=gen, dtype=t.dtype)
        grads.append(torch.sparse_coo_tensor(rows[None], values, t.shape, check_invariants=True))
    return grads


class SparseRun(Run):
    """A Run on sparse_grads_of's gradients, its schedulers (constructors, as torch's
    metadata_for_sparse lists them) stepped after each step."""

    def __init__(self, cls, kwargs, dtype, makers=(), steps=STEPS):
        self.makers = makers
        super().__init__(cls, kwargs, "cpu", dtype, steps)

    def steps(self, start, stop):
        if not hasattr(self, "schedulers"):
            self.schedulers = [make(self.opt) for make in self.makers]
        for step in range(start, stop):
            for p, g in zip(self.params, sparse_grads_of(step, self.params)):
                p.grad = g
            self.opt.step()
            for scheduler in self.schedulers:
                scheduler.step()
            self.trace.append(([p.detach().clone() for p in self.params],
                               [{self.names.get(k, k): v.detach().clone()
                                 if torch.is_tensor(v) else v
                                 for k, v in self.opt.state[p].items()} for p in self.params]))
        return self


def sparse_cases():
    """Every input of the optimizers that take sparse gradients (and their foreach and
    fused variants; torch's sparse test leaves differentiable out, as here), and the
    kwargs of metadata_for_sparse with and without its schedulers."""
    cases = []
    for name in SPARSE_NAMES:
        for dname, dtype in DTYPES.items():
            for desc, kwargs in optim_inputs(name, "cpu", dtype):
                if mode_of(kwargs) != "differentiable":
                    cases.append(pytest.param(name, dtype, kwargs, False,
                                              id=case_id(name, dname, desc)))
            for scheduled in (False, True):
                cases.append(pytest.param(name, dtype, INFOS[name].metadata_for_sparse[0],
                                          scheduled, id=case_id(name, dname, "metadata_for_sparse",
                                                                "scheduled" * scheduled)))
    return cases


@pytest.mark.parametrize("name,dtype,kwargs,scheduled", sparse_cases())
def test_sparse_gradients_step_as_torch(name, dtype, kwargs, scheduled):
    """Sparse gradients: torch's bits and state (its momentum_buffer sparse, as torch
    makes it) after every step, and its state dict; where torch raises (L2 weight decay
    adds the dense param to the sparse gradient; fused), precis raises torch's error
    before anything is written (torch has stepped the dense param 0 by then)."""
    makers = INFOS[name].metadata_for_sparse[1] if scheduled else ()
    try:
        theirs = SparseRun(TORCH[name], kwargs, dtype, makers)
    except RuntimeError as error:
        ours = SparseRun(OURS[name], kwargs, dtype, makers, steps=0)
        before = [p.detach().clone() for p in ours.params]
        with pytest.raises(RuntimeError) as info:
            ours.steps(0, 1)
        assert str(info.value).startswith(str(error)), f"precis: {info.value}\ntorch: {error}"
        for i, (p, b) in enumerate(zip(ours.params, before)):
            assert_tensor(p, b, f"param {i} after the refused step")
        assert not any(ours.opt.state.values()), "the refused step left state"
        return
    ours = SparseRun(OURS[name], kwargs, dtype, makers)
    assert_runs(ours, theirs, None)
    assert_state_dicts(torch_named(ours.opt.state_dict(), ours.names), theirs.opt.state_dict())
    assert_groups(ours.opt.param_groups, theirs.opt.param_groups, "param_groups")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("name", [n for n in NAMES if n not in SPARSE_NAMES])
def test_sparse_gradients_refused_as_torch(name, dtype):
    """torch's Adam, AdamW and Muon refuse sparse gradients: precis raises torch's error
    (type, and its message first), before anything is written or any state is made."""
    messages = []
    for cls in (TORCH[name], OURS[name]):
        params = [Parameter(t) for t in initial("cpu", dtype, sizes_of(cls))]
        opt = cls(params)
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, sparse_grads_of(0, params)):
            p.grad = g
        with pytest.raises(RuntimeError) as info:
            opt.step()
        messages.append(str(info.value))
    theirs, ours = messages
    assert ours.startswith(theirs), f"precis: {ours!r}\ntorch:  {theirs!r}"
    for i, (p, b) in enumerate(zip(params, before)):
        assert_tensor(p, b, f"param {i} after the refused step")
    assert not any(opt.state.values()), "the refused step left state"


@pytest.mark.parametrize("saver,loader,reference", SAVE_LOAD.values(), ids=SAVE_LOAD)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("name", SPARSE_NAMES)
def test_sparse_momentum_state_continues_bitwise(name, dtype, saver, loader, reference):
    """A state dict holding the sparse momentum buffer of sparse gradients, through
    torch.save / torch.load(weights_only=True), into either optimizer: the run resumed
    ends on the uninterrupted one."""
    kw = dict(lr=2e-2, momentum=0.9, dampening=0.1)
    whole = SparseRun(reference[name], kw, dtype, steps=6)
    half = SparseRun(saver[name], kw, dtype, steps=3)
    sd = saved_and_loaded(half.opt.state_dict())
    if saver is OURS:
        sd = state_dict_for(loader, name, sd)
    cont = copy.copy(half)
    cont.params = [Parameter(p.detach().clone()) for p in half.params]
    cont.opt = loader[name](cont.params, **kw)
    cont.names = names_of(loader[name])
    cont.opt.load_state_dict(sd)
    cont.trace = []
    cont.steps(3, 6)
    assert_same_end(cont, whole)
    assert_state_dicts(torch_named(cont.opt.state_dict(), cont.names),
                       torch_named(whole.opt.state_dict(), whole.names))
