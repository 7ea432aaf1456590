"""Checkpoints of precis.optim: bit-exact resume, torch.optim state dicts, corrupt
state dicts, and model weights loaded behind the optimizer's back (stale masters)."""
import copy
import math
import io
import warnings

import pytest
import torch

import precis  # noqa: F401
import precis.optim as optim
from precis.checkpoint import STEP_MARKER
from precis.optim import StaleMasterWarning

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8

CONFIGS = {
    "fp32_default": (F32, None),
    "bf16_default": (BF16, None),
    "remainders": (BF16, {"store_param_remainders": True}),
    "fp8_moments": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}),
    "fp8_remainders": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16",
                              "store_param_remainders": True}),
    "remainders8": (BF16, {"store_param_remainders": True, "param_remainder_bits": 8}),
    "fp8_remainders8": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                               "store_param_remainders": True, "param_remainder_bits": 8}),
    "stochastic_rounding": (BF16, {"main_params_dtype": "bf16"}),
}


def mlp(dtype, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 200), torch.nn.Tanh(),
                                torch.nn.Linear(200, 4))
    return model.to(dtype)


def make_opt(model, policy, cls=optim.AdamW, **kw):
    kw.setdefault("lr", 1e-2)
    kw.setdefault("weight_decay", 0.05)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    # two groups, so group hyperparameters travel through the checkpoint too
    return cls([{"params": layers[0].parameters(), "lr": kw["lr"] * 2},
                {"params": list(layers[1].parameters()) + list(layers[2].parameters())}],
               policy=policy, **kw)


def train(model, opt, steps, start=0):
    dtype = next(model.parameters()).dtype
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        ((model(x).float() - y) ** 2).mean().backward()
        opt.step()


def bits(t):
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(as_int)


def assert_models_equal(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.dtype == pb.dtype
        assert torch.equal(bits(pa), bits(pb)), name


def assert_states_equal(opt_a, opt_b):
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for pa, pb in zip(params_a, params_b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert sa[k].dtype == sb[k].dtype and torch.equal(bits(sa[k]), bits(sb[k])), k
            else:
                assert sa[k] == sb[k], k


def save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def load(buf):
    """Plain tensors and python values only: loads with weights_only=True."""
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------
# Bit-exact resume
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_is_bit_exact(config, order):
    dtype, policy = CONFIGS[config]
    straight = mlp(dtype)
    opt_straight = make_opt(straight, policy)
    train(straight, opt_straight, 100)

    first = mlp(dtype)
    opt_first = make_opt(first, policy)
    train(first, opt_first, 50)
    ckpt = load(save({"model": first.state_dict(), "optim": opt_first.state_dict()}))

    resumed = mlp(dtype, seed=123)  # different initial weights, overwritten by the load
    opt_resumed = make_opt(resumed, policy, lr=1.0, weight_decay=0.0)  # hparams come from ckpt
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleMasterWarning)  # a proper resume never warns
        if order == "model_first":
            resumed.load_state_dict(ckpt["model"])
            opt_resumed.load_state_dict(ckpt["optim"])
        else:
            opt_resumed.load_state_dict(ckpt["optim"])
            resumed.load_state_dict(ckpt["model"])
        train(resumed, opt_resumed, 50, start=50)
    assert_models_equal(straight, resumed)
    assert_states_equal(opt_straight, opt_resumed)
    assert [g["lr"] for g in opt_resumed.param_groups] == [2e-2, 1e-2]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_dict_keeps_stored_dtypes(config):
    dtype, policy = CONFIGS[config]
    model = mlp(dtype)
    opt = make_opt(model, policy)
    train(model, opt, 2)
    sd = opt.state_dict()
    resolved = precis.resolve_policy(dtype, policy)
    for i, p in enumerate(model.parameters()):
        st = sd["state"][i]
        if config in ("fp32_default", "stochastic_rounding"):  # torch reads these exactly
            assert st["step"].dtype == F32 and st["step"] == 2 and "precis_step" not in st
        else:  # masters, remainders or moments torch would misread: torch's load refuses
            assert st["step"] == STEP_MARKER and st["precis_step"] == 2
        assert st["exp_avg"].dtype == resolved.exp_avg_dtype
        assert st["exp_avg_sq"].dtype == resolved.exp_avg_sq_dtype
        for key, dt in (("exp_avg", resolved.exp_avg_dtype), ("exp_avg_sq",
                                                             resolved.exp_avg_sq_dtype)):
            assert (key + "_scale" in st) == (dt in (F16, FP8))
            if dt in (F16, FP8):
                assert st[key + "_scale"].dtype == F32
                assert st[key + "_scale"].numel() == -(-p.numel() // 128)
        if resolved.store_param_remainders:
            want = {16: torch.int16, 8: torch.uint8}[resolved.param_remainder_bits]
            assert st["remainder"].dtype == want and "master" not in st
            assert isinstance(st["param_fingerprint"], int)
        elif resolved.has_master:
            assert st["master"].dtype == resolved.main_params_dtype
        else:
            assert "master" not in st and "remainder" not in st
    # the policy is written as plain data, and the live state is not modified
    assert sd["param_groups"][0]["policy"] == policy
    assert all("param_fingerprint" not in s for s in opt.state.values())


def test_load_state_dict_copies():
    model = mlp(BF16)
    opt = make_opt(model, None)
    train(model, opt, 2)
    sd = opt.state_dict()
    other = make_opt(model, None)
    other.load_state_dict(sd)
    p = model[0].weight
    assert other.state[p]["master"].data_ptr() != opt.state[p]["master"].data_ptr()


# ---------------------------------------------------------------------------
# torch.optim state dicts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls,torch_cls", [(optim.AdamW, torch.optim.AdamW),
                                           (optim.Adam, torch.optim.Adam)])
def test_load_torch_state_dict_fp32(cls, torch_cls):
    a, b = mlp(F32), mlp(F32)
    opt_b = torch_cls(b.parameters(), lr=1e-2, weight_decay=0.01)
    train(b, opt_b, 20)
    a.load_state_dict(b.state_dict())
    opt_a = cls(a.parameters(), lr=0.5)
    opt_a.load_state_dict(load(save(opt_b.state_dict())))
    assert opt_a.param_groups[0]["lr"] == 1e-2 and opt_a.param_groups[0]["weight_decay"] == 0.01
    # torch's group keys are kept (as torch would), the optimizer's own stay its own
    assert opt_a.param_groups[0]["amsgrad"] is False and opt_a.param_groups[0]["fused"] is None
    assert opt_a.param_groups[0]["decoupled_weight_decay"] is (cls is optim.AdamW)
    assert opt_a.state[a[0].weight]["step"] == 20
    train(a, opt_a, 20, start=20)
    train(b, opt_b, 20, start=20)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert float((pa - pb).detach().abs().max()) <= 1e-6


def test_load_torch_state_dict_converts_to_the_policy():
    ref = mlp(F32)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, opt_ref, 10)
    model = mlp(BF16)
    model.load_state_dict({k: v.to(BF16) for k, v in ref.state_dict().items()})
    policy = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16"}
    opt = optim.AdamW(model.parameters(), policy=policy)
    opt.load_state_dict(opt_ref.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        st, tst = opt.state[p], opt_ref.state[q]
        assert st["exp_avg"].dtype == FP8 and st["exp_avg_sq"].dtype == F16
        assert "master" not in st  # built from the (already loaded) param at the next step
        dec = opt.decoded_state(p)
        m, v = tst["exp_avg"], tst["exp_avg_sq"]
        assert float((dec["exp_avg"] - m).abs().max()) <= 2 ** -4 * float(m.abs().max()) + 1e-12
        assert float((dec["exp_avg_sq"] - v).abs().max()) <= 2 ** -9 * float(v.max()) + 1e-20
    train(model, opt, 1, start=10)
    st = opt.state[model[0].weight]
    assert st["step"] == 11 and st["master"].dtype == F32


def test_load_torch_state_dict_bf16_moments_exact():
    """torch keeps a bf16 model's moments in bf16: they load bit for bit."""
    ref = mlp(BF16)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, opt_ref, 3)
    model = copy.deepcopy(ref)
    opt = optim.AdamW(model.parameters())
    opt.load_state_dict(opt_ref.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt_ref.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt_ref.state[q]["exp_avg_sq"])


def test_policy_change_on_load_converts():
    """A checkpoint saved with one policy loads into another (e.g. fp32 master ->
    remainders, bf16 -> fp8 moments)."""
    model = mlp(BF16)
    opt = make_opt(model, None)
    train(model, opt, 5)
    masters = {p: opt.master_weight(p) for p in model.parameters()}
    opt2 = make_opt(model, {"store_param_remainders": True, "exp_avg_dtype": "fp8"})
    opt2.load_state_dict(opt.state_dict())
    def same_but_ties(got, want):
        """Bit-equal, except where the master is an exact bf16 tie (low half 0x8000):
        the param was rounded to even there and the remainder format rounds ties up,
        so the closest master it carries is one fp32 ulp below."""
        g, w = bits(got), bits(want)
        tie = (w & 0xFFFF) == 0x8000
        return torch.equal(g[~tie], w[~tie]) and bool(((w - g)[tie] <= 1).all())

    for p in model.parameters():
        assert same_but_ties(opt2.master_weight(p), masters[p])
        assert opt2.state[p]["exp_avg"].dtype == FP8
    opt3 = make_opt(model, None)
    opt3.load_state_dict(opt2.state_dict())  # remainders -> fp32 master
    for p in model.parameters():
        assert same_but_ties(opt3.state[p]["master"], masters[p])
    # the tie fix-up keeps the remainders: the params are the masters' (fingerprints match)
    train(model, opt2, 1, start=5)
    assert all(bool(opt2.state[p]["remainder"].ne(0).any()) for p in model.parameters()
               if p.numel() > 8)


KEEPS_MASTERS = {"bf16_default": "fp32 masters", "remainders": "16-bit remainders",
                 "remainders8": "8-bit remainders"}


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD, optim.Lion])
@pytest.mark.parametrize("config", list(KEEPS_MASTERS))
def test_a_policy_with_nowhere_to_keep_masters_warns_once_naming_them(config, cls):
    """Masters or remainders loaded into a policy that keeps none (the param its own
    master) are dropped with one DroppedStateWarning per load naming what and how many
    params; a policy that keeps them warns of nothing."""
    dtype, policy = CONFIGS[config]
    model = mlp(dtype)
    opt = make_opt(model, policy, cls)
    train(model, opt, 2)
    sd = opt.state_dict()
    n = sum(1 for _ in model.parameters())
    for _ in range(2):  # once per load, at every load
        opt2 = make_opt(model, {"main_params_dtype": "bf16"}, cls)
        with pytest.warns(optim.DroppedStateWarning) as caught:
            opt2.load_state_dict(sd)
        assert len(caught) == 1 and caught[0].filename == __file__
        assert f"the {KEEPS_MASTERS[config]} of {n} params dropped" in str(caught[0].message)
        assert not any(k in st for st in opt2.state.values() for k in ("master", "remainder"))
    for other in ("bf16_default", "remainders", "remainders8"):  # each keeps them
        with warnings.catch_warnings():
            warnings.simplefilter("error", optim.DroppedStateWarning)
            make_opt(model, CONFIGS[other][1], cls).load_state_dict(sd)


@pytest.mark.parametrize("cls", [optim.Muon, optim.NorMuon])
def test_one_object_muon_with_nowhere_to_keep_masters_warns_once(cls):
    """The same for one-object Muon / NorMuon (an "adamw" group beside the matrices)."""
    model = mlp(BF16)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]

    def make(policy):
        return cls([{"params": others, "algorithm": "adamw"}, {"params": matrices}], lr=0.02,
                   policy=policy)
    opt = make(None)
    train(model, opt, 2)
    with pytest.warns(optim.DroppedStateWarning) as caught:
        make({"main_params_dtype": "bf16"}).load_state_dict(opt.state_dict())
    assert len(caught) == 1
    assert f"the fp32 masters of {len(matrices) + len(others)} params dropped" in \
        str(caught[0].message)


def test_from_torch_state_dict_warns_of_masters_its_policy_keeps_nowhere():
    model = mlp(BF16)
    opt = make_opt(model, None)
    train(model, opt, 2)
    params = list(model.parameters())
    torch_sd, masters = precis.checkpoint.to_torch_state_dict(opt.state_dict(), params)
    with pytest.warns(optim.DroppedStateWarning, match=f"fp32 masters of {len(params)} params"):
        precis.checkpoint.from_torch_state_dict(torch_sd, params, {"main_params_dtype": "bf16"},
                                                masters)


AMSGRAD_CONFIGS = ["fp32_default", "bf16_default", "fp8_moments", "fp8_remainders"]


@pytest.mark.parametrize("config", AMSGRAD_CONFIGS)
def test_amsgrad_resume_is_bit_exact(config):
    """amsgrad's running max (in exp_avg_sq's dtype, with its own scales for fp16 /
    fp8) goes through a checkpoint like the other state."""
    dtype, policy = CONFIGS[config]
    straight = mlp(dtype)
    opt_straight = make_opt(straight, policy, amsgrad=True)
    train(straight, opt_straight, 40)
    first = mlp(dtype)
    opt_first = make_opt(first, policy, amsgrad=True)
    train(first, opt_first, 20)
    ckpt = load(save({"model": first.state_dict(), "optim": opt_first.state_dict()}))
    st = ckpt["optim"]["state"][0]
    assert st["max_exp_avg_sq"].dtype == st["exp_avg_sq"].dtype
    assert ("max_exp_avg_sq_scale" in st) == ("exp_avg_sq_scale" in st)
    resumed = mlp(dtype, seed=123)
    opt_resumed = make_opt(resumed, policy)  # amsgrad comes from the checkpoint's groups
    resumed.load_state_dict(ckpt["model"])
    opt_resumed.load_state_dict(ckpt["optim"])
    assert all(g["amsgrad"] for g in opt_resumed.param_groups)
    train(resumed, opt_resumed, 20, start=20)
    assert_models_equal(straight, resumed)
    assert_states_equal(opt_straight, opt_resumed)


@pytest.mark.parametrize("cls,torch_cls", [(optim.AdamW, torch.optim.AdamW),
                                           (optim.Adam, torch.optim.Adam)])
def test_load_torch_amsgrad_state_dict_continues_bit_for_bit(cls, torch_cls):
    """fp32: torch's amsgrad state loads as it is, and precis goes on with torch's bits."""
    a, b = mlp(F32), mlp(F32)
    opt_b = torch_cls(b.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=True)
    train(b, opt_b, 20)
    a.load_state_dict(b.state_dict())
    opt_a = cls(a.parameters(), lr=0.5)
    opt_a.load_state_dict(load(save(opt_b.state_dict())))
    assert opt_a.param_groups[0]["amsgrad"] is True
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(opt_a.state[pa]["max_exp_avg_sq"], opt_b.state[pb]["max_exp_avg_sq"])
    train(a, opt_a, 20, start=20)
    train(b, opt_b, 20, start=20)
    assert_models_equal(a, b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(opt_a.state[pa]["max_exp_avg_sq"], opt_b.state[pb]["max_exp_avg_sq"])


def test_load_torch_amsgrad_state_dict_converts_to_the_policy():
    """Into fp16 moments: max_exp_avg_sq is encoded with scales of its own, and the
    decoded values are torch's within fp16's precision (sqrt domain)."""
    ref = mlp(F32)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, amsgrad=True)
    train(ref, opt_ref, 10)
    model = mlp(BF16)
    model.load_state_dict({k: v.to(BF16) for k, v in ref.state_dict().items()})
    opt = optim.AdamW(model.parameters(), policy={"exp_avg_sq_dtype": "fp16"})
    opt.load_state_dict(opt_ref.state_dict())
    for p, q in zip(model.parameters(), ref.parameters()):
        st = opt.state[p]
        assert st["max_exp_avg_sq"].dtype == F16 and "max_exp_avg_sq_scale" in st
        want = opt_ref.state[q]["max_exp_avg_sq"]
        got = opt.decoded_state(p)["max_exp_avg_sq"]
        assert float((got - want).abs().max()) <= 2 ** -9 * float(want.max()) + 1e-20
    train(model, opt, 1, start=10)
    assert opt.state[model[0].weight]["step"] == 11


# ---------------------------------------------------------------------------
# Corrupt state dicts: ValueError naming the problem, optimizer untouched
# ---------------------------------------------------------------------------


def corruptions():
    last = 5  # the last param: everything before it validates fine

    def drop(key):
        def f(sd):
            del sd[key]
        return f

    def set_state(i, key, value):
        def f(sd):
            sd["state"][i][key] = value(sd["state"][i]) if callable(value) else value
        return f

    def del_state(i, key):
        def f(sd):
            del sd["state"][i][key]
        return f

    def set_group(i, key, value):
        def f(sd):
            sd["param_groups"][i][key] = value
        return f

    return {
        "missing_state": (drop("state"), "'state' and 'param_groups'"),
        "extra_group": (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])),
                        "3 param groups, the optimizer 2"),
        "param_count": (lambda sd: sd["param_groups"][1]["params"].pop(),
                        "group 1 has 3 params in the state dict, 4"),
        "unknown_id": (lambda sd: sd["state"].__setitem__(99, sd["state"][0]), "param id 99"),
        "exp_avg_shape": (set_state(last, "exp_avg", lambda st: st["exp_avg"][:-1]),
                          "'exp_avg' has shape"),
        "exp_avg_dtype": (set_state(last, "exp_avg", lambda st: st["exp_avg"].double()),
                          "'exp_avg' is torch.float64"),
        "exp_avg_not_tensor": (set_state(last, "exp_avg", [1, 2]), "'exp_avg' must be a tensor"),
        "missing_exp_avg_sq": (del_state(last, "exp_avg_sq"), "missing exp_avg_sq"),
        "fp8_without_scale": (del_state(last, "exp_avg_scale"),
                              "fp8 moments need 'exp_avg_scale'"),
        "scale_size": (set_state(last, "exp_avg_sq_scale", torch.zeros(3)),
                       "'exp_avg_sq_scale' must be float32 of shape"),
        "unknown_key": (set_state(last, "momentum_buffer", torch.zeros(1)),
                        "unknown keys momentum_buffer"),
        "max_shape": (set_state(last, "max_exp_avg_sq", torch.zeros(1)),
                      "'max_exp_avg_sq' has shape"),
        "max_negative": (set_state(last, "max_exp_avg_sq",
                                   lambda st: torch.full(st["exp_avg_sq"].shape, -1e-6)),
                         "'max_exp_avg_sq' holds negative values"),
        "max_infinite": (set_state(last, "max_exp_avg_sq",
                                   lambda st: torch.full(st["exp_avg_sq"].shape, math.inf)),
                         "'max_exp_avg_sq' holds non-finite values"),
        "max_fp16_without_scale": (set_state(last, "max_exp_avg_sq",
                                             lambda st: st["exp_avg_sq"].clone()),
                                   "float16 moments need 'max_exp_avg_sq_scale'"),
        "max_scale_negative": (lambda sd: sd["state"][last].update(
            max_exp_avg_sq=sd["state"][last]["exp_avg_sq"].clone(),
            max_exp_avg_sq_scale=sd["state"][last]["exp_avg_sq_scale"].neg().sub(1.0)),
            "'max_exp_avg_sq_scale' holds negative or non-finite scales"),
        "negative_step": (set_state(last, "step", -1), "'step' must be a whole number"),
        "fractional_step": (set_state(last, "step", torch.tensor(2.5)),
                            "'step' must be a whole number"),
        "remainder_dtype": (set_state(last, "remainder", lambda st: st["remainder"].int()),
                            "'remainder' has dtype torch.int32"),
        "remainder_int8": (set_state(last, "remainder",
                                     lambda st: st["remainder"].to(torch.int8)),
                           "'remainder' has dtype torch.int8; expected torch.int16 .* or "
                           "torch.uint8"),
        "master_and_remainder": (set_state(last, "master", torch.zeros(4)),
                                 "both 'master' and 'remainder'"),
        "bad_lr": (set_group(1, "lr", -1.0), "learning rate"),
        "missing_betas": (lambda sd: sd["param_groups"][0].pop("betas"), "lacks betas"),
        "fp16_without_scale": (del_state(last, "exp_avg_sq_scale"),
                               "float16 moments need 'exp_avg_sq_scale'"),
        "negative_scale": (set_state(last, "exp_avg_scale",
                                     lambda st: st["exp_avg_scale"].neg().sub(1.0)),
                           "negative or non-finite scales"),
        "infinite_scale": (set_state(last, "exp_avg_sq_scale",
                                     lambda st: torch.full_like(st["exp_avg_sq_scale"], math.inf)),
                           "negative or non-finite scales"),
        "scale_too_large": (set_state(last, "exp_avg_scale",
                                      lambda st: torch.full_like(st["exp_avg_scale"], 3e38)),
                            "'exp_avg' holds non-finite values"),
        # m8 has no NaN code: an older precis's E4M3 one (0x7F, no 'fp8_m_code')
        "nan_fp8_moment": (set_state(last, "exp_avg",
                                     lambda st: (st.pop("fp8_m_code"),
                                                 st["exp_avg"].clone().fill_(0x7F))[1]),
                           "'exp_avg' holds non-finite values"),
        "negative_second_moment": (set_state(last, "exp_avg_sq",
                                             lambda st: st["exp_avg_sq"].abs().neg().sub(1.0)),
                                   "'exp_avg_sq' holds negative values"),
        "step_beyond_int64": (set_state(last, "step", 2 ** 63), "'step' must be below 2"),
        "differentiable_group": (set_group(1, "differentiable", True), "differentiable=True"),
        "marker_without_count": (del_state(last, "precis_step"), "precis's marker"),
        "precis_step_beyond_int64": (set_state(last, "precis_step", torch.tensor(2.0 ** 63)),
                                     "'step' must be below 2"),
        "step_not_a_number": (set_state(last, "step", "ten"), "'step' must be a number"),
        "stream_negative": (set_state(last, "stream", -1), "'stream' must be an int"),
        "stream_bool": (set_state(last, "stream", True), "'stream' must be an int"),
        "stream_beyond_2_63": (set_state(last, "stream", 1 << 63), "'stream' must be an int"),
        "stream_a_tensor": (set_state(last, "stream", torch.tensor(3)), "'stream' must be an int"),
        "stream_of_another_param": (set_state(last, "stream", 0), "also the stream of param"),
    }


CORRUPTIONS = corruptions()


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_state_dict_rejected_and_optimizer_unchanged(name):
    mutate, match = CORRUPTIONS[name]
    policy = {"store_param_remainders": True, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16"}
    model = mlp(BF16)
    opt = make_opt(model, policy)
    train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    keep_state = copy.deepcopy(opt.state_dict())
    keep_groups = copy.deepcopy(opt.param_groups)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["param_groups"] == keep_state["param_groups"]
    for i, st in keep_state["state"].items():
        for k, v in st.items():
            w = after["state"][i][k]
            assert torch.equal(bits(v), bits(w)) if torch.is_tensor(v) else v == w
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in keep_groups]
    train(model, opt, 1, start=3)  # still works


def test_8bit_correction_of_a_non_bf16_param_rejected_before_anything():
    """A uint8 remainder beside a param that is not bf16 names the param, and the
    optimizer is left as it was."""
    model = mlp(BF16)
    opt = make_opt(model, {"store_param_remainders": True, "param_remainder_bits": 8})
    train(model, opt, 2)
    sd = opt.state_dict()
    other = mlp(F32)
    opt32 = make_opt(other, None)
    train(other, opt32, 1)
    keep = copy.deepcopy(opt32.state_dict())
    with pytest.raises(ValueError, match=r"state of param 0 of group 0 .*torch.float32\): "
                                         r"'remainder' \(torch.uint8\) needs a bfloat16 param"):
        opt32.load_state_dict(sd)
    after = opt32.state_dict()
    for i, st in keep["state"].items():
        assert all(torch.equal(bits(v), bits(after["state"][i][k])) if torch.is_tensor(v)
                   else v == after["state"][i][k] for k, v in st.items())


def master_bits(opt, model):
    return [bits(opt.master_weight(p)).to(torch.int64) & 0xFFFFFFFF for p in model.parameters()]


def round24(u):
    """fp32 master bits rounded to nearest even at bit 8 (finite masters)."""
    return (u + 0x7F + ((u >> 8) & 1)) & 0xFFFFFF00


def test_remainder_width_changes_on_load():
    """int16 remainders, 8-bit corrections and fp32 masters load into one another: to 8
    bits the master rounds to nearest even at 24 bits, except where that is a tie of
    the param (low byte 0x80, where the split would move the param up one), which
    keeps the param and 0x7F: one 24-bit ulp below; to 16 bits or an fp32 master the
    24-bit master is exact. The params never move, and the loaded remainders are
    kept at the next step (their fingerprints still hold)."""
    p16 = {"store_param_remainders": True}
    p8 = {"store_param_remainders": True, "param_remainder_bits": 8}
    for source in (None, p16):  # an fp32 master, int16 remainders
        model = mlp(BF16)
        opt = make_opt(model, source)
        train(model, opt, 5)
        params = [bits(p).clone() for p in model.parameters()]
        full = master_bits(opt, model)
        opt8 = make_opt(model, p8)
        opt8.load_state_dict(opt.state_dict())
        ties = 0
        for p, u, got in zip(model.parameters(), full, master_bits(opt8, model)):
            assert opt8.state[p]["remainder"].dtype == FP8
            r = round24(u)
            tie = ((r & 0xFF00) == 0x8000) & ((r >> 16) == (bits(p).to(torch.int64) & 0xFFFF))
            ties += int(tie.sum())
            assert torch.equal(got, torch.where(tie, r - 0x100, r))
        assert ties > 0
        assert all(torch.equal(bits(p), b) for p, b in zip(model.parameters(), params))
        for target in (p16, None):  # 8 -> 16 and 8 -> fp32 master: exact
            opt_t = make_opt(model, target)
            opt_t.load_state_dict(opt8.state_dict())
            assert all(torch.equal(a, b) for a, b in zip(master_bits(opt_t, model),
                                                          master_bits(opt8, model)))
        # at lr 0 a step keeps the 24-bit master: the converted corrections were kept
        before = master_bits(opt8, model)
        for g in opt8.param_groups:
            g["lr"] = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("error", StaleMasterWarning)
            train(model, opt8, 1, start=5)
        assert all(torch.equal(a, b) for a, b in zip(master_bits(opt8, model), before))
        assert any(bool(opt8.state[p]["remainder"].ne(0).any()) for p in model.parameters())


def test_not_a_state_dict():
    opt = make_opt(mlp(F32), None)
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict([1, 2])


# ---------------------------------------------------------------------------
# The stale-master trap: model weights loaded after the optimizer was built
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["bf16_default", "remainders", "fp8_remainders",
                                    "fp8_remainders8"])
@pytest.mark.parametrize("resync", ["reload_model_params", "automatic"])
def test_stale_master_trap(config, resync):
    dtype, policy = CONFIGS[config]
    model = mlp(dtype)
    checkpoint = copy.deepcopy(model.state_dict())  # weights at step 0
    opt = make_opt(model, policy, lr=5e-2)
    train(model, opt, 20)  # masters now far from the checkpoint
    model.load_state_dict(checkpoint)
    loaded = [p.detach().clone() for p in model.parameters()]

    # the expected result: an optimizer whose masters were rebuilt from the loaded
    # weights (fp32 copy, or zero remainders), with the same moments and steps
    twin_model = copy.deepcopy(model)
    twin = make_opt(twin_model, policy, lr=5e-2)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin.reload_model_params()

    if resync == "reload_model_params":
        opt.reload_model_params()
        with warnings.catch_warnings():
            warnings.simplefilter("error", StaleMasterWarning)
            train(model, opt, 1, start=20)
    else:
        with pytest.warns(StaleMasterWarning, match="reload_model_params"):
            train(model, opt, 1, start=20)
    train(twin_model, twin, 1, start=20)

    for p, q, start in zip(model.parameters(), twin_model.parameters(), loaded):
        # the step continued from the loaded weights, not from the stale masters
        assert float((p.detach().double() - start.double()).abs().max()) <= 2 * 5e-2 * 2 + 1e-2
        assert torch.equal(bits(p), bits(q))
        assert torch.equal(bits(opt.master_weight(p)), bits(twin.master_weight(q)))


def test_stale_master_warns_once():
    model = mlp(BF16)
    checkpoint = copy.deepcopy(model.state_dict())
    opt = make_opt(model, None)
    train(model, opt, 2)
    model.load_state_dict(checkpoint)
    with pytest.warns(StaleMasterWarning):
        train(model, opt, 1, start=2)
    model.load_state_dict(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleMasterWarning)
        train(model, opt, 1, start=3)  # resynced again, silently
    assert torch.equal(opt.state[model[0].weight]["master"].to(BF16), model[0].weight.detach())


def test_unrelated_inplace_write_of_same_values_keeps_master():
    """A write that leaves the param equal to its master's rounding is no reason
    to throw the master away."""
    model = mlp(BF16)
    opt = make_opt(model, None)
    train(model, opt, 3)
    twin_model = copy.deepcopy(model)
    twin = make_opt(twin_model, None)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    p = model[0].weight
    with torch.no_grad():
        p.copy_(p.detach().clone())  # bumps the version, same bits
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleMasterWarning)
        train(model, opt, 2, start=3)
    train(twin_model, twin, 2, start=3)
    assert_models_equal(model, twin_model)
    assert_states_equal(opt, twin)


def test_reload_model_params_before_any_step_is_harmless():
    model = mlp(BF16)
    opt = make_opt(model, None)
    opt.reload_model_params()
    train(model, opt, 1)
    assert opt.state[model[0].weight]["step"] == 1


@pytest.mark.parametrize("policy", [None, {"store_param_remainders": True}])
def test_reload_model_params_checks_every_param_before_it_resyncs_any(policy):
    """A param whose shape changed after the state was made (param.data replaced): named
    before any master is resynced (it resynced the params before it, then raised torch's
    broadcast error naming neither; with remainders it raised nothing)."""
    a = torch.nn.Parameter(torch.randn(8).to(BF16))
    b = torch.nn.Parameter(torch.randn(8).to(BF16))
    opt = precis.optim.AdamW([a, b], lr=1e-3, policy=policy)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    masters = [opt.master_weight(p) for p in (a, b)]
    with torch.no_grad():
        a.copy_(torch.full((8,), 5.0))
    b.data = torch.randn(4).to(BF16)
    key = "remainder" if policy else "master"
    with pytest.raises(ValueError, match=rf"param 1 of group 0 .*reload_model_params: its {key} "
                                         rf"is of shape \(8,\) but the param now of \(4,\)"):
        opt.reload_model_params()
    if not policy:  # (a remainder's master is the param's: a's moved with it)
        assert torch.equal(opt.master_weight(a), masters[0])  # not resynced to 5.0


def test_master_weight_is_a_copy():
    """master_weight() and decoded_state()['master'] are new tensors, as said: writing
    them leaves the optimizer's master as it was (an fp32 master's .float() was it)."""
    for policy in (None, {"main_params_dtype": "fp32"}):
        p = torch.nn.Parameter(torch.randn(8).to(BF16))
        opt = precis.optim.AdamW([p], lr=1e-3, policy=policy)
        p.grad = torch.ones_like(p)
        opt.step()
        kept = opt.state[p]["master"].clone()
        opt.master_weight(p).add_(1.0)
        opt.decoded_state(p)["master"].add_(1.0)
        assert torch.equal(opt.state[p]["master"], kept)


# ---------------------------------------------------------------------------
# fp8 moments saved before the m8 and v8 codes
# ---------------------------------------------------------------------------


def _as_e4m3_state(entry, key="exp_avg_sq"):
    """A state dict entry as a precis without the m8 (key 'exp_avg') or v8 code
    ('exp_avg_sq') saved it: the moment holds E4M3 codes of m (sqrt(v)) / (amax / 448)
    per 128-element block, no 'fp8_m_code' ('fp8_v_code'). Returns it and the
    moment's values."""
    from precis.checkpoint import moment_values
    second = key == "exp_avg_sq"
    old = dict(entry)
    values = moment_values(entry[key], entry[key + "_scale"], second)
    x = values.reshape(-1).sqrt() if second else values.reshape(-1)
    blocks = torch.nn.functional.pad(x, (0, -x.numel() % 128)).view(-1, 128)
    scales = blocks.abs().amax(dim=1) / 448
    codes = (blocks / torch.where(scales > 0, scales, 1)[:, None]).to(torch.float8_e4m3fn)
    old[key] = codes.view(torch.uint8).reshape(-1)[:x.numel()].view(values.shape)
    old[key + "_scale"] = scales
    del old["fp8_v_code" if second else "fp8_m_code"]
    return old, values


def test_fp8_v_saved_before_v8_is_read_and_reencoded():
    """A checkpoint of an older precis (fp8 v as E4M3 codes) loads with its values,
    re-encoded in v8; to_torch_state_dict reads it too; an unknown code is refused."""
    from precis.checkpoint import FP8_V_CODE, moment_values, to_torch_state_dict
    policy = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
    model = mlp(BF16)
    opt = make_opt(model, policy)
    train(model, opt, 3)
    sd = opt.state_dict()
    assert all(s["fp8_v_code"] == FP8_V_CODE for s in sd["state"].values())
    wants = {}
    for index, entry in list(sd["state"].items()):
        sd["state"][index], wants[index] = _as_e4m3_state(entry)
    fresh = make_opt(mlp(BF16), policy)
    fresh.load_state_dict(sd)
    params = [p for g in fresh.param_groups for p in g["params"]]
    torch_sd, _ = to_torch_state_dict(sd)
    for index, p in enumerate(params):
        st = fresh.state[p]
        got = moment_values(st["exp_avg_sq"], st["exp_avg_sq_scale"], True)
        # E4M3 then v8, each rounded to nearest: within 2^-4 + 2^-6 of sqrt(v), plus
        # the subnormal steps of both codes relative to the block's largest root
        root, want = got.sqrt(), wants[index].sqrt()
        floor = want.max() * (2.0 ** -9 / 448 + 2.0 ** -5 / 126)
        assert ((root - want).abs() <= want * (2.0 ** -4 + 2.0 ** -6) + floor).all(), index
        assert torch.allclose(torch_sd["state"][index]["exp_avg_sq"].sqrt(), want, rtol=2.0 ** -4,
                              atol=float(want.max()) * 2.0 ** -9 / 448)
    entry = dict(opt.state_dict()["state"][0], fp8_v_code=3)
    bad = opt.state_dict()
    bad["state"][0] = entry
    with pytest.raises(ValueError, match="'fp8_v_code' is 3"):
        fresh.load_state_dict(bad)


def test_fp8_m_saved_before_m8_is_read_and_reencoded():
    """A checkpoint of an older precis (fp8 m and v as E4M3 codes, no code entries)
    loads with m's values, re-encoded in m8, and saves 'fp8_m_code' again;
    to_torch_state_dict reads it too; an unknown m code is refused, naming the param."""
    from precis.checkpoint import FP8_M_CODE, moment_values, to_torch_state_dict
    policy = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
    model = mlp(BF16)
    opt = make_opt(model, policy)
    train(model, opt, 3)
    sd = opt.state_dict()
    assert all(s["fp8_m_code"] == FP8_M_CODE for s in sd["state"].values())
    wants = {}
    for index, entry in list(sd["state"].items()):
        entry, _ = _as_e4m3_state(entry, "exp_avg_sq")
        sd["state"][index], wants[index] = _as_e4m3_state(entry, "exp_avg")
    fresh = make_opt(mlp(BF16), policy)
    fresh.load_state_dict(sd)
    params = [p for g in fresh.param_groups for p in g["params"]]
    torch_sd, _ = to_torch_state_dict(sd)
    for index, p in enumerate(params):
        st = fresh.state[p]
        got, want = moment_values(st["exp_avg"], st["exp_avg_scale"], False), wants[index]
        # E4M3 then m8, each rounded to nearest: within 2^-4 + 2^-6 of m, plus the
        # subnormal steps of both codes relative to the block's largest |m|
        top = float(want.abs().max())
        floor = top * (2.0 ** -9 / 448 + 2.0 ** -5 / 7.875)
        assert ((got - want).abs() <= want.abs() * (2.0 ** -4 + 2.0 ** -6) + floor).all(), index
        assert torch.allclose(torch_sd["state"][index]["exp_avg"], want, rtol=2.0 ** -4,
                              atol=top * 2.0 ** -9 / 448)
    assert all(s["fp8_m_code"] == FP8_M_CODE for s in fresh.state_dict()["state"].values())
    bad = opt.state_dict()
    bad["state"][0] = dict(bad["state"][0], fp8_m_code=3)
    with pytest.raises(ValueError, match="param 0.*'fp8_m_code' is 3"):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="'fp8_m_code' is 3"):
        to_torch_state_dict(bad)


def test_streams_are_saved_loaded_and_kept_distinct():
    """A param's stream (its stochastic rounding's numbers) is its place in the
    optimizer, left out of the state dict then (the keys of a state dict saved before
    streams were kept); another one is saved and loaded, and a load gives the bits of
    the run it came from. A param added between steps gets a stream no other holds."""
    policy = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
    model = mlp(BF16)
    opt = make_opt(model, policy)
    train(model, opt, 2)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [opt._books.streams[p] for p in params] == list(range(len(params)))
    assert all("stream" not in st for st in opt.state_dict()["state"].values())
    moved = opt.state_dict()  # as if params 1 and 2 had been moved
    moved["state"][1]["stream"], moved["state"][2]["stream"] = 40, 41
    opt.load_state_dict(moved)
    assert [opt._books.streams[p] for p in params[:4]] == [0, 40, 41, 3]
    sd = load(save(opt.state_dict()))
    assert [sd["state"][i].get("stream") for i in range(4)] == [None, 40, 41, None]
    twin_model = copy.deepcopy(model)
    twin = make_opt(twin_model, policy)
    twin.load_state_dict(sd)
    train(model, opt, 2, start=2)
    train(twin_model, twin, 2, start=2)
    assert_models_equal(model, twin_model)
    assert_states_equal(opt, twin)
    # The streams matter: the default streams give other bits.
    other_model = copy.deepcopy(twin_model)
    other = make_opt(other_model, policy)
    sd = twin.state_dict()
    for st in sd["state"].values():
        st.pop("stream", None)
    other.load_state_dict(sd)
    train(twin_model, twin, 1, start=4)
    train(other_model, other, 1, start=4)
    assert not all(torch.equal(bits(twin.state[a]["exp_avg"]), bits(other.state[b]["exp_avg"]))
                   for a, b in zip(twin_model.parameters(), other_model.parameters()))
    # A param added to group 0 takes place 2, whose stream another param keeps.
    extra = torch.nn.Parameter(torch.randn(7).to(BF16))
    opt.param_groups[0]["params"].append(extra)
    extra.grad = torch.randn(7).to(BF16)
    opt.step()
    streams = [opt._books.streams[p] for g in opt.param_groups for p in g["params"]]
    assert len(set(streams)) == len(streams), streams
    opt.load_state_dict(opt.state_dict())  # its own state dict loads


def test_c_errors_name_their_function_once():
    """The C library's message starts with its function's name: a check() naming that
    function does not repeat it; any other `what` still leads the message."""
    import ctypes
    from precis import _lib
    encode = _lib.lib().precis_moment_encode
    for what, want in (("precis_moment_encode", "precis_moment_encode: src is NULL"),
                       ("exp_avg of param 3", "exp_avg of param 3: precis_moment_encode: src is "
                                              "NULL")):
        dst = torch.empty(4, dtype=F16)
        status = encode(None, 4, 0, ctypes.c_void_p(dst.data_ptr()), _lib.DTYPE_FP16, None)
        with pytest.raises(precis.PrecisValueError) as e:
            _lib.check(status, what)
        assert str(e.value) == f"{want} [PRECIS_ERR_NULL_POINTER]"


def test_from_torch_state_dict_refuses_tensors_without_data():
    """A moment with no data for C to read (here a meta tensor) is refused in Python,
    naming the param and the key, before any conversion."""
    from precis import checkpoint
    p = torch.nn.Parameter(torch.randn(5, 3).to(BF16))
    theirs = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    theirs.step()
    sd = theirs.state_dict()
    sd["state"][0]["exp_avg_sq"] = torch.empty(5, 3, device="meta", dtype=BF16)
    with pytest.raises(ValueError, match=r"state of param 0 \(shape \(5, 3\).*'exp_avg_sq' is "
                                         r"a Tensor on meta that holds no data"):
        checkpoint.from_torch_state_dict(sd, [p])
