"""Bad input, as a new user gives it and beyond: each attack is refused with an error that
names what was wrong (the param's group and index, the argument) and leaves everything
as it was: every param, state tensor and group option is compared before and after.

Families: the constructors and param groups of every optimizer, gradients, step()'s
keywords, state dicts and the checkpoint converters, gradient release (in this process:
each raises in Python before anything is written), and the raw torch.ops.precis.* ops
(C code, where a crash could hide: all of them in one subprocess, this file run as a
script, whose verdicts the tests read)."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import precis
import precis.optim as optim
from precis import checkpoint, ops

BF16 = torch.bfloat16
OPTIMIZERS = {"AdamW": optim.AdamW, "Adam": optim.Adam, "SGD": optim.SGD,
              "Lion": optim.Lion, "Muon": optim.Muon, "NorMuon": optim.NorMuon}


# ---- what an attack may not change ------------------------------------------------

def _value(v):
    if isinstance(v, torch.Tensor):
        if v.is_meta:
            return ("meta", v.dtype, tuple(v.shape))
        if v.is_sparse:
            v = v.to_dense()
        return v.detach().clone()
    return copy.deepcopy(v)


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(
                a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and
                      math.isnan(a) and math.isnan(b))


def everything(opt):
    """Every param, state entry and group option of opt, copied."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"params": [_value(p) for p in params],
            "state": [{k: _value(v) for k, v in opt.state[p].items()} if p in opt.state
                      else None for p in params],
            "groups": [{k: _value(v) for k, v in g.items() if k != "params"}
                       for g in opt.param_groups],
            "sizes": [len(g["params"]) for g in opt.param_groups]}


def assert_unchanged(before, after, name):
    assert before["sizes"] == after["sizes"], f"{name}: a param group changed size"
    for i, (a, b) in enumerate(zip(before["params"], after["params"])):
        assert _same(a, b), f"{name}: param {i} changed"
    for i, (a, b) in enumerate(zip(before["state"], after["state"])):
        assert (a is None) == (b is None), f"{name}: param {i}'s state made or dropped"
        if a is not None:
            assert a.keys() == b.keys(), f"{name}: param {i}'s state keys {a.keys()} -> {b.keys()}"
            for k in a:
                assert _same(a[k], b[k]), f"{name}: param {i}'s state {k!r} changed"
    for gi, (a, b) in enumerate(zip(before["groups"], after["groups"])):
        assert a.keys() == b.keys(), f"{name}: group {gi}'s options changed"
        for k in a:
            assert _same(a[k], b[k]), f"{name}: group {gi}'s {k!r} changed"


def refused(opt, attack, error, *parts, name="attack"):
    """attack(opt) raises `error` naming every part; opt (if any) is unchanged."""
    before = everything(opt) if opt is not None else None
    with pytest.raises(error) as info:
        attack(opt)
    message = str(info.value)
    for part in parts:
        assert part in message, f"{name}: {part!r} not in {message!r}"
    if opt is not None:
        assert_unchanged(before, everything(opt), name)
    return message


# ---- the optimizers under attack ------------------------------------------------------

def grads_for(params, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def two_groups(cls, dtype=torch.float32, steps=1, **kw):
    """cls over two groups of two (8, 8) params, stepped `steps` times: the attacks go
    into group 1 (its param 1), after group 0, which must not step either."""
    g = torch.Generator().manual_seed(1)
    groups = [[torch.nn.Parameter(torch.randn(8, 8, generator=g).to(dtype)) for _ in range(2)]
              for _ in range(2)]
    if cls is optim.SGD:  # (a momentum: a state to keep unchanged)
        kw.setdefault("momentum", 0.9)
    opt = cls([{"params": groups[0]}, {"params": groups[1], "lr": 2e-3}], lr=1e-3, **kw)
    for s in range(steps):
        grads_for(groups[0] + groups[1], s)
        opt.step()
    grads_for(groups[0] + groups[1], steps)
    return opt, groups


def step(opt):
    opt.step()


# Attacks on a group or its param after construction: (name, change(opt, groups), error,
# parts of the message). Each runs against every optimizer, its params stepped once.
def _set(key, value):
    return lambda opt, groups: opt.param_groups[1].__setitem__(key, value)


def _append(dtype):
    def change(opt, groups):
        p = torch.nn.Parameter(torch.zeros(8, 8).to(dtype))
        p.grad = torch.zeros(8, 8).to(dtype)
        opt.param_groups[1]["params"].append(p)
    return change


def _main_grad(value):
    return lambda opt, groups: setattr(groups[1][1], "main_grad", value)


def _grad(make):
    return lambda opt, groups: setattr(groups[1][1], "grad", make(groups[1][1]))


def _state(key, make):
    def change(opt, groups):
        st = opt.state[groups[1][1]]
        if key in st:
            st[key] = make(st[key])
    return change


GROUP_ATTACKS = [
    ("lr_overflows_float32", _set("lr", 1e300), ValueError,
     ["param group 1", "lr is 1e+300", "overflows float32"]),
    ("lr_nan", _set("lr", float("nan")), ValueError, ["nan"]),  # (Muon's: torch's words)
    ("lr_meta_tensor", _set("lr", torch.tensor(1e-3, device="meta")), ValueError,
     ["param group 1", "lr is a tensor on the meta device"]),
    ("seed_2_64", _set("seed", 2 ** 64), ValueError,
     ["param group 1", "seed must be an int in [0, 2**64)", str(2 ** 64)]),
    ("seed_2_64_plus_5", _set("seed", 2 ** 64 + 5), ValueError, ["param group 1", "seed"]),
    ("seed_negative", _set("seed", -1), ValueError, ["param group 1", "seed"]),
    ("seed_float", _set("seed", 1.5), ValueError, ["param group 1", "seed"]),
    ("fp8_param_appended", _append(torch.float8_e4m3fn), ValueError,
     ["param 2 of group 1", "float8_e4m3fn"]),
    ("same_param_twice", lambda opt, groups: opt.param_groups[1]["params"].append(
        groups[1][0]), ValueError, ["param group 1: param 2 is param 0 of the group again"]),
    ("float_main_grad", _main_grad(1.0), TypeError,
     ["param 1 of group 1", "main_grad must be a tensor", "float"]),
    ("string_main_grad", _main_grad("g"), TypeError, ["param 1 of group 1", "main_grad"]),
    ("float64_main_grad", _main_grad(torch.zeros(8, 8, dtype=torch.float64)), ValueError,
     ["param 1 of group 1", "float64"]),
    ("main_grad_wrong_shape", _main_grad(torch.zeros(7)), ValueError,
     ["param 1 of group 1", "shape (7,)"]),
    ("meta_exp_avg", _state("exp_avg", lambda t: torch.zeros_like(t, device="meta")),
     RuntimeError, ["param 1 of group 1", "exp_avg is on meta"]),
    ("exp_avg_wrong_dtype", _state("exp_avg", lambda t: t.to(torch.float64)), RuntimeError,
     ["param 1 of group 1", "exp_avg"]),
]


@pytest.mark.parametrize("cls", OPTIMIZERS.values(), ids=OPTIMIZERS)
@pytest.mark.parametrize("name,change,error,parts", GROUP_ATTACKS,
                         ids=[a[0] for a in GROUP_ATTACKS])
def test_group_attack_refused_before_any_group_steps(cls, name, change, error, parts):
    opt, groups = two_groups(cls)
    change(opt, groups)
    refused(opt, step, error, *parts, name=f"{cls.__name__} {name}")


# step()'s keywords: (name, kwargs, error, parts)
STEP_ATTACKS = [
    ("grad_scale_str", dict(grad_scale="2"), TypeError, ["grad_scale must be one value", "str"]),
    ("grad_scale_bool", dict(grad_scale=True), TypeError, ["grad_scale must be one value", "bool"]),
    ("grad_scale_two_values", dict(grad_scale=torch.tensor([1.0, 2.0])), ValueError,
     ["grad_scale must be one value", "got 2 torch.float32 values"]),
    ("grad_scale_meta", dict(grad_scale=torch.tensor(2.0, device="meta")), ValueError,
     ["grad_scale must be one value", "on meta"]),
    ("grad_scale_complex", dict(grad_scale=torch.tensor(2j)), ValueError,
     ["grad_scale must be one value", "complex"]),
    ("grad_scale_zero", dict(grad_scale=0.0), ValueError, ["grad_scale must be finite and > 0"]),
    ("grad_scale_nan", dict(grad_scale=float("nan")), ValueError, ["grad_scale"]),
    ("grad_scale_tiny", dict(grad_scale=1e-45), ValueError,
     ["grad_scale 1e-45 is too small", "1 / grad_scale = 1e+45", "overflows float32"]),
    ("found_inf_two_values", dict(found_inf=torch.zeros(2)), ValueError,
     ["found_inf must be one value", "got 2 torch.float32 values"]),
    ("found_inf_str", dict(found_inf="yes"), TypeError, ["found_inf must be one value", "str"]),
    ("found_inf_meta", dict(found_inf=torch.zeros(1, device="meta")), ValueError,
     ["found_inf must be one value", "on meta"]),
    ("found_inf_list", dict(found_inf=[0.0]), TypeError, ["found_inf must be one value", "list"]),
    ("unknown_keyword", dict(scale=2.0), TypeError, ["unexpected keyword arguments scale"]),
]


@pytest.mark.parametrize("cls", [optim.AdamW, optim.Muon], ids=["AdamW", "Muon"])
@pytest.mark.parametrize("name,kwargs,error,parts", STEP_ATTACKS, ids=[a[0] for a in STEP_ATTACKS])
def test_step_keyword_refused(cls, name, kwargs, error, parts):
    opt, _ = two_groups(cls)
    refused(opt, lambda o: o.step(**kwargs), error, *parts, name=name)


@pytest.mark.parametrize("cls", OPTIMIZERS.values(), ids=OPTIMIZERS)
def test_same_param_twice_warned_as_torch_then_refused_at_the_step(cls):
    """cls([a, a]): torch's warning at construction (a drop-in's), then the step refuses
    it by name (its buffers, given twice, would share memory), changing nothing."""
    a = _params(1)[0]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = cls([a, a])
    a.grad = torch.ones_like(a)
    refused(opt, step, ValueError, "param group 0: param 1 is param 0 of the group again",
            name=cls.__name__)


# ---- the rows of torch's own math (float64 params, sparse gradients) ---------------------

@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD, optim.Muon], ids=["AdamW", "SGD", "Muon"])
def test_torch_math_grad_of_another_dtype_in_group_1_refused_before_group_0(cls):
    """float64 params (torch's math steps them): an int64 gradient in group 1 is refused
    before group 0's params, moments and steps change (torch's own step raised after)."""
    opt, groups = two_groups(cls, torch.float64)
    p = groups[1][1]
    p.grad_dtype = None  # (torch refuses the assignment otherwise)
    p.grad = torch.ones(8, 8, dtype=torch.int64)
    refused(opt, step, ValueError, "param 1 of group 1", "torch.int64", "torch.float64",
            name=cls.__name__)


def _momentum_key(opt, p):
    return "exp_avg" if "exp_avg_sq" in opt.state[p] else \
        "momentum_buffer" if "momentum_buffer" in opt.state[p] else "exp_avg"


# (name, change(opt, p), parts): a float64 param's state as a user or a tool left it
TORCH_MATH_STATE_ATTACKS = [
    ("momentum_of_another_shape",
     lambda opt, p: opt.state[p].__setitem__(_momentum_key(opt, p), torch.zeros(3, dtype=p.dtype)),
     ["param 1 of group 1", "of shape (3,)", "needs a tensor of its shape (8, 8)"]),
    ("momentum_not_a_tensor",
     lambda opt, p: opt.state[p].__setitem__(_momentum_key(opt, p), [0.0] * 64),
     ["param 1 of group 1", "is list", "needs a tensor of its shape (8, 8)"]),
]
TORCH_MATH_ADAM_ATTACKS = [
    ("exp_avg_in_float32",
     lambda opt, p: opt.state[p].__setitem__("exp_avg", torch.zeros(8, 8)),
     ["param 1 of group 1", "its exp_avg is torch.float32", "in torch.float64"]),
    ("step_a_string", lambda opt, p: opt.state[p].__setitem__("step", "x"),
     ["param 1 of group 1", "its step is str", "one-element tensor"]),
    ("no_exp_avg_sq", lambda opt, p: opt.state[p].pop("exp_avg_sq"),
     ["param 1 of group 1", "no exp_avg_sq"]),
    ("amsgrad_turned_on", lambda opt, p: opt.param_groups[1].__setitem__("amsgrad", True),
     ["param 0 of group 1", "no max_exp_avg_sq", "amsgrad turned on"]),  # (its first param)
]


@pytest.mark.parametrize("cls,name,change,parts", [
    (cls, *attack) for cls in (optim.AdamW, optim.SGD, optim.Muon)
    for attack in TORCH_MATH_STATE_ATTACKS] + [
    (optim.AdamW, *attack) for attack in TORCH_MATH_ADAM_ATTACKS],
    ids=[f"{cls}-{a[0]}" for cls in ("AdamW", "SGD", "Muon") for a in TORCH_MATH_STATE_ATTACKS] +
    [f"AdamW-{a[0]}" for a in TORCH_MATH_ADAM_ATTACKS])
def test_torch_math_state_refused_before_group_0(cls, name, change, parts):
    """float64 params (torch's math steps them) whose state was changed by hand: refused
    naming the param before group 0 steps (torch's own step raised after the kernels and
    the earlier groups wrote, naming none)."""
    opt, groups = two_groups(cls, torch.float64)
    change(opt, groups[1][1])
    refused(opt, step, ValueError, *parts, name=f"{cls.__name__} {name}")


@pytest.mark.parametrize("cls,words", [(optim.Muon, "Muon does not support sparse gradients"),
                                       (optim.AdamW, "Adam does not support sparse gradients")],
                         ids=["Muon", "AdamW"])
def test_sparse_grad_after_a_step_refused_before_the_state_is_touched(cls, words):
    """Muon rewrote the param's state into torch's layout (exp_avg and step gone,
    momentum_buffer added) before torch's Muon refused the gradient."""
    opt, groups = two_groups(cls)
    groups[1][1].grad = torch.eye(8).to_sparse()
    message = refused(opt, step, RuntimeError, words, "param 1 of group 1", name=cls.__name__)
    assert message.startswith(words), message  # torch's error first, as torch raises it
    assert "exp_avg" in opt.state[groups[1][1]] and "momentum_buffer" not in \
        opt.state[groups[1][1]]


# ---- constructors ----------------------------------------------------------------------

def _params(n=2, dtype=torch.float32):
    return [torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype)) for _ in range(n)]


CONSTRUCTOR_ATTACKS = [
    ("lr_1e300", lambda cls: cls(_params(), lr=1e300), ValueError,
     ["lr is 1e+300", "overflows float32", "value cannot be converted to type float without "
                                           "overflow"]),
    ("seed_2_64", lambda cls: cls(_params(), seed=2 ** 64), ValueError, ["seed", "2**64"]),
    ("seed_2_64_plus_5", lambda cls: cls(_params(), seed=2 ** 64 + 5), ValueError,
     ["seed", str(2 ** 64 + 5)]),
    ("fp8_param", lambda cls: cls(_params(1, torch.float8_e4m3fn)), ValueError,
     ["param 0 of group 0", "float8_e4m3fn"]),
    ("meta_lr_tensor", lambda cls: cls(_params(), lr=torch.tensor(1e-3, device="meta")),
     ValueError, ["lr is a tensor on the meta device"]),
    ("policy_a_string", lambda cls: cls(_params(), policy="maybe"), TypeError,
     ["policy must be None, a precis.Policy or a mapping", "str"]),
]


@pytest.mark.parametrize("cls", OPTIMIZERS.values(), ids=OPTIMIZERS)
@pytest.mark.parametrize("name,make,error,parts", CONSTRUCTOR_ATTACKS,
                         ids=[a[0] for a in CONSTRUCTOR_ATTACKS])
def test_constructor_refused(cls, name, make, error, parts):
    refused(None, lambda _: make(cls), error, *parts, name=f"{cls.__name__} {name}")


# ---- state dicts, the checkpoint converters, the optimizer's methods ---------------------

def _with_step(value):
    def attack(opt):
        sd = opt.state_dict()
        sd["state"][0]["step"] = value
        opt.load_state_dict(sd)
    return attack


STATE_ATTACKS = [
    ("step_2_63_minus_1", _with_step(2 ** 63 - 1), ValueError,
     ["param 0 of group 0", "'step' must be below 2^63", "(2^63 in float32)"]),
    ("step_2_63_minus_1_tensor", _with_step(torch.tensor(float(2 ** 63 - 1))), ValueError,
     ["param 0 of group 0", "'step' must be below 2^63"]),
    ("step_negative", _with_step(-1), ValueError, ["'step' must be a whole number >= 0"]),
    ("step_half", _with_step(1.5), ValueError, ["'step' must be a whole number >= 0"]),
    ("step_str", _with_step("1"), ValueError, ["'step' must be a number"]),
    ("state_dict_none", lambda opt: opt.load_state_dict(None), ValueError, ["NoneType"]),
    ("state_dict_list", lambda opt: opt.load_state_dict([1]), ValueError, ["list"]),
    ("groups_not_a_list", lambda opt: opt.load_state_dict({"state": {}, "param_groups": 5}),
     ValueError, ["'param_groups' must be a list"]),
    ("master_weight_none", lambda opt: opt.master_weight(None), TypeError,
     ["master_weight(p): p must be a param", "NoneType"]),
    ("master_weight_foreign", lambda opt: opt.master_weight(torch.zeros(3)), ValueError,
     ["master_weight(p): p must be a param", "shape (3,)"]),
    ("decoded_state_none", lambda opt: opt.decoded_state(None), TypeError,
     ["decoded_state(p): p must be a param"]),
]


@pytest.mark.parametrize("cls", [optim.AdamW, optim.Muon], ids=["AdamW", "Muon"])
@pytest.mark.parametrize("name,attack,error,parts", STATE_ATTACKS,
                         ids=[a[0] for a in STATE_ATTACKS])
def test_state_attack_refused(cls, name, attack, error, parts):
    opt, _ = two_groups(cls)
    refused(opt, attack, error, *parts, name=name)


FROM_TORCH = "precis.checkpoint.from_torch_state_dict"
GARBAGE = [
    ("none", None, [], ValueError, ["expected a state dict"]),
    ("string", "x", [], ValueError, ["expected a state dict"]),
    ("state_an_int", {"state": 5, "param_groups": []}, [], ValueError,
     ["'state' must be a mapping"]),
    ("groups_an_int", {"state": {}, "param_groups": 5}, [], ValueError,
     ["'param_groups' a list"]),
    ("group_an_int", {"state": {}, "param_groups": [5]}, [], ValueError,
     ["param group 0 must be a mapping with a 'params' list"]),
    ("group_without_params", {"state": {}, "param_groups": [{"lr": 1}]}, [], ValueError,
     ["param group 0 must be a mapping with a 'params' list"]),
    ("id_a_list", {"state": {}, "param_groups": [{"params": [[0]]}]}, [None], ValueError,
     ["param id [0]", "not an int or a str"]),
    ("id_twice", {"state": {}, "param_groups": [{"params": [0, 0]}]}, [None, None],
     ValueError, ["param id 0 is listed twice"]),
    ("param_not_a_tensor", {"state": {}, "param_groups": [{"params": [0]}]}, [5], TypeError,
     ["params[0] must be a tensor", "int"]),
    ("params_none", {"state": {}, "param_groups": [{"params": [0]}]}, None, TypeError,
     ["params is None"]),
    ("entry_not_a_mapping", {"state": {0: 5}, "param_groups": [{"params": [0]}]}, [None],
     ValueError, ["state of param 0", "expected a mapping"]),
    ("moment_a_string", {"state": {0: {"exp_avg": "x", "exp_avg_sq": "x", "step": 1}},
                         "param_groups": [{"params": [0], "betas": (0.9, 0.99), "eps": 1e-8}]},
     [None], ValueError, ["state of param 0", "'exp_avg' must be a tensor"]),
]


@pytest.mark.parametrize("name,sd,params,error,parts", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_from_torch_state_dict_of_garbage_refused(name, sd, params, error, parts):
    if params is not None:
        params = [torch.nn.Parameter(torch.zeros(8)) if p is None else p for p in params]
    refused(None, lambda _: checkpoint.from_torch_state_dict(sd, params), error, FROM_TORCH,
            *parts, name=name)


# ---- gradient release --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(grad_scale="2"), dict(grad_scale=True),
                                    dict(grad_scale=0.0), dict(max_norm=-1.0),
                                    dict(max_norm=float("inf"))],
                         ids=["grad_scale_str", "grad_scale_bool", "grad_scale_zero",
                              "max_norm_negative", "max_norm_inf"])
def test_release_arguments_refused(kwargs):
    from precis.release import release_gradients
    opt, _ = two_groups(optim.AdamW)
    (key, value), = kwargs.items()
    refused(opt, lambda o: release_gradients(o, **kwargs), ValueError,
            f"{key} must be a finite number > 0", name=key)
    assert opt._books.release is None, "a refused release left its hooks"


# ---- the raw ops: one subprocess runs them all (C code: a crash must not take pytest) ----

def _cpu(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


def _meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device="meta")


def _adam(params, grads, **kw):
    n = len(params)
    args = dict(masters=[], exp_avgs=[_cpu(8) for _ in range(n)],
                exp_avg_sqs=[_cpu(8) for _ in range(n)], exp_avg_scales=[],
                exp_avg_sq_scales=[], steps=[1] * n, lr=1e-3)
    args.update(kw)
    return lambda: ops.adam_step_(params, grads, **args)


def _resync(masters, params, stale, kept):
    return lambda: torch.ops.precis.resync_masters_(masters, params, stale, kept)


def _raw_attacks():
    """name -> (call, the tensors it may not change, parts of the message). Each call is
    made once, in the subprocess."""
    found, grad, kept = _cpu(1), torch.ones(8), _cpu(4, dtype=torch.int64)
    p, g = torch.ones(8), torch.ones(8)
    bf = [torch.ones(8, dtype=BF16) for _ in range(2)]
    masters = [_cpu(8) for _ in range(2)]
    return {
        "accumulate_meta_src": (lambda: ops.accumulate_(p, _meta(8)), [p],
                                ["precis.accumulate_", "src is on meta", "dst is on cpu"]),
        "accumulate_meta_dst": (lambda: ops.accumulate_(_meta(8), p), [p],
                                ["dst is on meta", "src is on cpu"]),
        "cast_meta_src": (lambda: ops.cast_(p, _meta(8)), [p], ["src is on meta"]),
        "fingerprint_cpu_meta": (lambda: ops.fingerprint([p, _meta(8)]), [p],
                                 ["precis.fingerprint", "bufs[1] is on meta",
                                  "bufs[0] is on cpu"]),
        "adam_step_meta_param": (_adam([p, _meta(8)], [g, torch.ones(8)]), [p, g],
                                 ["params[1] is on meta", "params[0] is on cpu"]),
        "adam_step_meta_grad": (_adam([p], [_meta(8)]), [p], ["grads[0] is on meta"]),
        "adam_step_meta_found_inf": (_adam([p], [g], found_inf=_meta(1)), [p],
                                     ["found_inf[0] is on meta"]),
        "adam_step_steps_and_step_tensors": (
            _adam([p], [g], step_tensors=[torch.tensor(1)]), [p],
            ["steps has 1 entries and step_tensors 1", "pass one of them"]),
        "check_finite_found_inf_in_grad": (
            lambda: ops.check_finite_([grad], grad[:1]), [grad],
            ["precis.check_finite_", "grads[0] and found_inf share memory"]),
        "check_finite_meta_grad": (lambda: ops.check_finite_([_meta(8)], found), [found],
                                   ["grads[0] is on meta", "found_inf is on cpu"]),
        "resync_stale_inside_kept": (
            _resync(masters, bf, kept.view(torch.uint8)[:2], kept[:2]), [kept] + masters,
            ["precis.resync_masters_", "stale and kept share memory"]),
        "resync_masters_share_memory": (
            _resync([masters[0], masters[0]], bf, torch.ones(2, dtype=torch.uint8),
                    _cpu(2, dtype=torch.int64)), masters,
            ["masters[0] and masters[1] share memory"]),
        "resync_kept_inside_a_master": (
            _resync(masters, bf, torch.ones(2, dtype=torch.uint8),
                    masters[1].view(torch.int64)[:2]), masters,
            ["share memory", "kept"]),
        "resync_meta_kept": (
            _resync(masters, bf, torch.ones(2, dtype=torch.uint8), _meta(2, dtype=torch.int64)),
            masters, ["kept is on meta"]),
        "adam_step_lists_of_other_lengths": (_adam([p], [g, g]), [p, g],
                                             ["grads has 2 entries but params has 1"]),
    }


def _run_raw_attacks():
    """Runs every raw attack (in the subprocess): {name: [message or None, changed]}."""
    results = {}
    for name, (call, kept, _) in _raw_attacks().items():
        before = [t.clone() for t in kept]
        try:
            call()
            message = None
        except Exception as error:  # (any type: the test asserts which words it has)
            message = f"{type(error).__name__}: {error}"
        changed = [i for i, (a, b) in enumerate(zip(before, kept)) if not torch.equal(a, b)]
        results[name] = [message, changed]
    return results


@pytest.fixture(scope="module")
def raw_results():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the raw attacks' process failed (rc {proc.returncode}):\n" \
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(_raw_attacks()))
def test_raw_op_attack_refused(raw_results, name):
    message, changed = raw_results[name]
    assert message is not None, f"{name}: accepted"
    assert message.startswith("RuntimeError: precis."), message
    for part in _raw_attacks()[name][2]:
        assert part in message, f"{name}: {part!r} not in {message!r}"
    assert not changed, f"{name}: its tensors {changed} changed"


def test_all_meta_raw_op_is_a_no_op_as_torchs_own():
    """A call of meta tensors only (torch's meta-device dry runs) goes on as torch's own
    ops do: shapes only, nothing refused."""
    ops.accumulate_(_meta(8), _meta(8))
    assert ops.fingerprint([_meta(8), _meta(4)]).device.type == "meta"


if __name__ == "__main__":
    print(json.dumps(_run_raw_attacks()))
