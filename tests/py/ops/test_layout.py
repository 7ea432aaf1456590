"""precis.optim.AdamW / Adam on every param torch steps, against torch.optim bit for bit:
the configurations torch's own optimizer tests use (common_optimizers), channels_last
CNNs, transposed and gapped params, complex64 params; state["step"] as torch keeps it;
state dicts crossing between precis and torch both ways (exact, or a loud failure)."""
import copy
import io

import pytest
import torch
from torch.optim import lr_scheduler as sched
from torch.testing._internal.common_optimizers import optim_db

import precis  # noqa: F401
import precis.optim as optim
from precis import checkpoint, stored_forms

F32, BF16 = torch.float32, torch.bfloat16
PAIRS = {"AdamW": (optim.AdamW, torch.optim.AdamW), "Adam": (optim.Adam, torch.optim.Adam)}
# Configurations of torch's tests that precis refuses on purpose, and why.
REFUSED = {
    "Tensor betas": "betas are doubles in the kernel; torch computes with tensor betas in "
                    "float32 tensor ops",
}


def torch_configs():
    """(optimizer, desc, kwargs) of torch's AdamW / Adam tests, CUDA ones included
    (precis's capturable mode runs on the CPU too)."""
    out = []
    for info in optim_db:
        name = info.optim_cls.__name__
        if name not in PAIRS:
            continue
        for oi in info.optim_inputs_func(device="cuda"):
            reason = next((why for key, why in REFUSED.items() if key in oi.desc), None)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            out.append(pytest.param(name, oi.kwargs, id=f"{name}-{oi.desc}", marks=marks))
    return out


def bits(t):
    if t.is_complex():
        t = torch.view_as_real(t)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(as_int)


def same(a, b):
    if not isinstance(a, torch.Tensor):  # a state's 'stream': an int
        return type(a) is type(b) and a == b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def odd_params(seed=0, dtype=F32):
    """Params of odd sizes and layouts: contiguous, channels_last, transposed, a view
    with gaps between its elements, one element."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return [rand(127), rand(1),
            rand(6, 3, 5, 7).to(memory_format=torch.channels_last),
            rand(33, 17).t(),
            rand(9, 4, 10)[:, ::2, 1:],
            rand(4097)]


def twins(tensors):
    """Two lists of Parameters with the values and strides of tensors (deepcopy keeps a
    view a view, of a copy of its storage)."""
    return ([torch.nn.Parameter(copy.deepcopy(t)) for t in tensors],
            [torch.nn.Parameter(copy.deepcopy(t)) for t in tensors])


def set_grads(a, b, gen, like_param=True):
    for pa, pb in zip(a, b):
        grad = torch.randn(pa.shape, generator=gen, dtype=F32).to(pa.dtype) + 0.05 * pa.detach()
        if like_param:  # autograd gives grads the param's strides
            ga = torch.empty_like(pa).copy_(grad)
        else:
            ga = grad.contiguous()
        pa.grad, pb.grad = ga, torch.empty_like(pb).copy_(grad)


def assert_bitwise(opt_a, opt_b, a, b, step):
    for i, (pa, pb) in enumerate(zip(a, b)):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        for what, x, y in (("param", pa, pb), ("exp_avg", sa["exp_avg"], sb["exp_avg"]),
                           ("exp_avg_sq", sa["exp_avg_sq"], sb["exp_avg_sq"])):
            assert same(x, y), f"step {step}, param {i} {tuple(pa.shape)}: {what} differs"
        assert sa["exp_avg"].stride() == pa.stride() or not pa.is_contiguous() and \
            stored_forms.dense_flat(pa) is None
        assert same(sa["step"], sb["step"].to(sa["step"].device))


@pytest.mark.parametrize("name,kwargs", torch_configs())
def test_torch_test_configurations(name, kwargs):
    """Each configuration of torch's tests, with a scheduler and hooks, params of odd
    sizes and layouts: the same bits as torch after every step; then state dicts
    swapped between the two optimizers, and both go on in step."""
    ours, theirs = PAIRS[name]
    a, b = twins(odd_params())
    kw_a = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    kw_b = dict(kwargs, capturable=False)  # torch's capturable needs CUDA; same bits
    opt_a, opt_b = ours(a, **kw_a), theirs(b, **kw_b)
    calls = []
    for opt in (opt_a, opt_b):
        opt.register_step_pre_hook(lambda o, args, kw: calls.append(("pre", type(o))))
        opt.register_step_post_hook(lambda o, args, kw: calls.append(("post", type(o))))
    sch_a, sch_b = (sched.StepLR(o, step_size=3, gamma=0.5) for o in (opt_a, opt_b))
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        set_grads(a, b, gen)
        opt_a.step()
        opt_b.step()
        sch_a.step()
        sch_b.step()
        assert_bitwise(opt_a, opt_b, a, b, step)
    assert len(calls) == 40
    # fp32 state: torch loads precis's state dict and precis torch's, exactly
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    opt_a.load_state_dict(copy.deepcopy(sd_b))
    for group in sd_a["param_groups"]:
        group["capturable"] = False  # torch's own option (it needs CUDA)
    opt_b.load_state_dict(copy.deepcopy(sd_a))
    for step in range(11, 14):
        set_grads(a, b, gen, like_param=step % 2 == 0)  # contiguous grads: copied
        opt_a.step()
        opt_b.step()
        assert_bitwise(opt_a, opt_b, a, b, step)


def test_step_is_torchs():
    """state['step']: a float32 0-dim CPU tensor, as torch keeps it (capturable: on the
    param's device); an int step of an older state dict loads."""
    a, b = twins([torch.randn(5)])
    opt_a, opt_b = optim.AdamW(a), torch.optim.AdamW(b)
    for p in a + b:
        p.grad = torch.ones(5)
    opt_a.step()
    opt_b.step()
    sa, sb = opt_a.state[a[0]]["step"], opt_b.state[b[0]]["step"]
    assert (sa.dtype, sa.device, sa.shape) == (sb.dtype, sb.device, sb.shape) and sa == sb
    sd = opt_a.state_dict()
    sd["state"][0]["step"] = 7  # older precis: an int
    opt_a.load_state_dict(sd)
    opt_a.step()
    assert opt_a.state[a[0]]["step"].dtype == F32 and int(opt_a.state[a[0]]["step"]) == 8


def test_step_counts_like_torch_past_2_24():
    """float32 counts stop at 2^24 in torch (16777216 + 1 rounds back); precis counts
    the same way and hands the kernel that count."""
    a, b = twins([torch.randn(300)])
    opt_a, opt_b = optim.AdamW(a, lr=1e-3), torch.optim.AdamW(b, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    set_grads(a, b, gen)
    opt_a.step()
    opt_b.step()
    for opt, p in ((opt_a, a[0]), (opt_b, b[0])):
        opt.state[p]["step"].fill_(2.0 ** 24 - 1)
    for step in range(3):
        set_grads(a, b, gen)
        opt_a.step()
        opt_b.step()
        assert_bitwise(opt_a, opt_b, a, b, step)
    assert int(opt_a.state[a[0]]["step"]) == 2 ** 24


def conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 5, 3),
                               torch.nn.Flatten(), torch.nn.Linear(5 * 5 * 5, 3))


@pytest.mark.parametrize("cls", ["AdamW", "Adam"])
def test_channels_last_cnn_bitwise(cls):
    ours, theirs = PAIRS[cls]
    nets = [conv_net().to(memory_format=torch.channels_last) for _ in range(2)]
    conv_w = nets[0][0].weight
    assert not conv_w.is_contiguous() and conv_w.is_contiguous(memory_format=torch.channels_last)
    opt_a = ours(nets[0].parameters(), lr=1e-2, weight_decay=0.05)
    opt_b = theirs(nets[1].parameters(), lr=1e-2, weight_decay=0.05)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 31):
        x = torch.randn(4, 3, 9, 9, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randn(4, 3, generator=gen)
        for net, opt in zip(nets, (opt_a, opt_b)):
            opt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
        params = [list(n.parameters()) for n in nets]
        assert_bitwise(opt_a, opt_b, params[0], params[1], step)
    assert opt_a.state[conv_w]["exp_avg"].stride() == conv_w.stride()


@pytest.mark.parametrize("policy", [None, {"store_param_remainders": True, "exp_avg_dtype": "fp8",
                                           "exp_avg_sq_dtype": "fp16"},
                                    {"store_param_remainders": True, "param_remainder_bits": 8,
                                     "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}],
                         ids=["bf16", "fp8_rem", "fp8_rem8"])
def test_any_strides_step_in_memory_order(policy):
    """A channels_last bf16 param (fp8/fp16 moments: blocks in memory order) steps as the
    contiguous param holding the same memory does; its state is laid out like it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 6, 11, generator=g).to(BF16)
    cl = torch.nn.Parameter(x.to(memory_format=torch.channels_last))
    flat = torch.nn.Parameter(x.permute(0, 2, 3, 1).contiguous())  # same memory sequence
    opt_cl, opt_flat = optim.AdamW([cl], lr=1e-2, policy=policy), optim.AdamW([flat], lr=1e-2,
                                                                              policy=policy)
    for _ in range(5):
        grad = torch.randn(x.shape, generator=g).to(BF16)
        cl.grad = grad.to(memory_format=torch.channels_last)
        flat.grad = grad.permute(0, 2, 3, 1).contiguous()
        opt_cl.step()
        opt_flat.step()
    assert same(cl.permute(0, 2, 3, 1), flat)
    s_cl, s_flat = opt_cl.state[cl], opt_flat.state[flat]
    for key, t in s_cl.items():
        if key in ("step", "stream") or key.endswith("_scale"):
            assert same(t, s_flat[key]), key
            continue
        assert t.stride() == cl.stride(), key
        assert same(t.permute(0, 2, 3, 1), s_flat[key]), key
    # decoded values come in the param's logical shape
    dec_cl, dec_flat = opt_cl.decoded_state(cl), opt_flat.decoded_state(flat)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert dec_cl[key].shape == cl.shape
        assert same(dec_cl[key].permute(0, 2, 3, 1).contiguous(), dec_flat[key]), key
    # and a checkpoint resumes it bit for bit
    twin = torch.nn.Parameter(cl.detach().clone(memory_format=torch.preserve_format))
    opt_twin = optim.AdamW([twin], lr=1.0, policy=policy)
    opt_twin.load_state_dict(torch.load(_saved(opt_cl.state_dict()), weights_only=True))
    grad = torch.randn(x.shape, generator=g).to(BF16).to(memory_format=torch.channels_last)
    cl.grad, twin.grad = grad, grad.clone()
    opt_cl.step()
    opt_twin.step()
    assert same(cl, twin)


def test_param_memory_format_changed_after_state():
    """model.to(memory_format=...) after steps: the state is laid out anew."""
    net = conv_net()
    opt = optim.AdamW(net.parameters(), lr=1e-2, policy={"exp_avg_dtype": "fp8"})
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    w = net[0].weight
    before = opt.decoded_state(w)
    net.to(memory_format=torch.channels_last)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.state[w]["exp_avg"].stride() == w.stride()
    after = opt.decoded_state(w)
    # exp_avg decayed by beta1 from the re-encoded values (fp8: within its rounding)
    assert torch.allclose(after["exp_avg"], before["exp_avg"] * 0.9, rtol=0.13, atol=1e-6)


def test_gapped_view_is_stepped_through_a_copy():
    base = torch.randn(8, 10)
    a = torch.nn.Parameter(base.clone()[:, ::3])
    b = torch.nn.Parameter(base.clone()[:, ::3])
    assert stored_forms.dense_flat(a) is None
    storage = a.untyped_storage().data_ptr()
    opt_a, opt_b = optim.AdamW([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        set_grads([a], [b], gen)
        opt_a.step()
        opt_b.step()
        assert_bitwise(opt_a, opt_b, [a], [b], step)
        if step == 0:
            state = dict(opt_a.state[a])
    assert a.untyped_storage().data_ptr() == storage  # written in place
    assert all(opt_a.state[a][k] is t for k, t in state.items())  # contiguous state, kept


def test_gapped_view_with_scaled_moments_steps_as_its_contiguous_copy():
    policy = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16", "store_param_remainders": True}
    g = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 300, generator=g).to(BF16)[:, ::3])
    c = torch.nn.Parameter(a.detach().contiguous())
    opt_a, opt_c = optim.AdamW([a], policy=policy), optim.AdamW([c], policy=policy)
    for _ in range(5):
        grad = torch.randn(c.shape, generator=g).to(BF16)
        a.grad, c.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_c.step()
    assert same(a.contiguous(), c)
    for key, t in opt_c.state[c].items():
        assert same(opt_a.state[a][key], t), key


def test_expanded_param_refused():
    with pytest.raises(ValueError, match="sharing memory"):
        optim.AdamW([torch.nn.Parameter(torch.randn(1, 4).expand(3, 4))])


@pytest.mark.parametrize("cls,wd", [("AdamW", 0.05), ("Adam", 0.0)])
def test_complex_params_bitwise(cls, wd):
    """Complex64 params as torch steps them (view_as_real of param, grad and state).
    Adam's L2 weight decay is left out: torch adds it to the gradient in complex
    arithmetic (wd * p rounded, then added), the kernel in one fused step, so the
    two differ by roundings there (docs/design.md section 6)."""
    ours, theirs = PAIRS[cls]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g, dtype=torch.complex64) for n in (1, 127, 4097)]
    init.append(torch.randn(9, 5, generator=g, dtype=torch.complex64).t())
    a, b = twins(init)
    opt_a = ours(a, lr=3e-3, weight_decay=wd, maximize=True)
    opt_b = theirs(b, lr=3e-3, weight_decay=wd, maximize=True)
    for step in range(1, 31):
        for pa, pb in zip(a, b):
            grad = torch.randn(pa.shape, generator=g, dtype=torch.complex64)
            pa.grad, pb.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
        assert_bitwise(opt_a, opt_b, a, b, step)
    assert opt_a.state[a[0]]["exp_avg"].dtype == torch.complex64
    # torch's layout both ways
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    opt_a.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    assert_bitwise(opt_a, opt_b, a, b, "load")


def test_complex_params_need_fp32_state():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex64 param"):
        optim.AdamW([p], policy={"exp_avg_dtype": "bf16"})
    with pytest.raises(ValueError, match="complex32"):
        optim.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex32))])


# ---------------------------------------------------------------------------
# precis state dicts in torch.optim: exact values, or a loud failure
# ---------------------------------------------------------------------------

POLICIES = {
    "fp32_default": (F32, None),
    "fp32_bf16_moments": (F32, {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}),
    "fp32_fp8_moments": (F32, {"exp_avg_dtype": "fp8"}),
    "bf16_default": (BF16, None),
    "bf16_fp32_moments_sr": (BF16, {"main_params_dtype": "bf16", "exp_avg_dtype": "fp32"}),
    "stochastic_rounding": (BF16, {"main_params_dtype": "bf16"}),
    "remainders": (BF16, {"store_param_remainders": True}),
    "fp8_remainders": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16",
                              "store_param_remainders": True}),
    "remainders8": (BF16, {"store_param_remainders": True, "param_remainder_bits": 8}),
    "fp8_remainders8": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                               "store_param_remainders": True, "param_remainder_bits": 8}),
    "fp16_default": (torch.float16, None),
}


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def trained(dtype, policy, steps=4):
    a = [torch.nn.Parameter(t.to(dtype)) for t in odd_params()]
    opt = optim.AdamW(a, lr=1e-2, policy=policy)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in a:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return a, opt


@pytest.mark.parametrize("config", list(POLICIES))
def test_torch_loads_precis_state_exactly_or_fails(config):
    dtype, policy = POLICIES[config]
    a, opt = trained(dtype, policy)
    sd = torch.load(_saved(opt.state_dict()), weights_only=True)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    theirs = torch.optim.AdamW(b, lr=1e-2)
    exact = config in ("fp32_default", "fp32_bf16_moments", "stochastic_rounding")
    if not exact:
        with pytest.raises(ValueError, match="precis.checkpoint.to_torch_state_dict"):
            theirs.load_state_dict(sd)
        return
    theirs.load_state_dict(sd)
    for pa, pb in zip(a, b):
        dec, st = opt.decoded_state(pa), theirs.state[pb]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key].float(), dec[key]), key  # the very values
        assert st["step"] == dec["step"]
        pb.grad = torch.ones_like(pb)
    theirs.step()  # and torch steps on


@pytest.mark.parametrize("config", list(POLICIES))
def test_to_torch_state_dict(config):
    """The converter gives torch precis's values (fp32 moments, torch casting them to
    the param dtype) and the masters; torch continues from them."""
    dtype, policy = POLICIES[config]
    a, opt = trained(dtype, policy)
    sd = opt.state_dict()
    torch_sd, masters = checkpoint.to_torch_state_dict(sd, a)
    for i, p in enumerate(a):
        dec = opt.decoded_state(p)
        st = torch_sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"].dtype == F32 and int(st["step"]) == dec["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert same(st[key], dec[key]) and st[key].shape == p.shape
        if i in masters:
            assert same(masters[i], dec["master"])
            if sd["state"][i].get("remainder", torch.zeros(0)).dtype == torch.uint8:
                assert bool((bits(masters[i]) & 0xFF == 0).all())  # the 24-bit master
        else:
            assert not any(k in sd["state"][i] for k in ("master", "remainder"))
    assert all("policy" not in g and "seed" not in g for g in torch_sd["param_groups"])
    # torch on an fp32 copy of the model holding the masters continues exactly from them
    b = [torch.nn.Parameter(masters.get(i, p.detach().float()).clone()) for i, p in enumerate(a)]
    theirs = torch.optim.AdamW(b, lr=1e-2)
    theirs.load_state_dict(torch_sd)
    for i, pb in enumerate(b):
        assert torch.equal(theirs.state[pb]["exp_avg"], torch_sd["state"][i]["exp_avg"])
    if any(k in s for s in sd["state"].values() for k in ("remainder",)):
        with pytest.raises(ValueError, match="give the params"):
            checkpoint.to_torch_state_dict(sd)


def test_torch_precis_torch_round_trip_is_exact():
    b = [torch.nn.Parameter(t) for t in odd_params()]
    theirs = torch.optim.AdamW(b, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in b:
            p.grad = torch.randn(p.shape, generator=gen)
        theirs.step()
    torch_sd = theirs.state_dict()
    precis_sd = checkpoint.from_torch_state_dict(torch_sd, b)
    back, masters = checkpoint.to_torch_state_dict(precis_sd, b)
    assert masters == {}
    for i in torch_sd["state"]:
        for key, value in torch_sd["state"][i].items():
            assert same(back["state"][i][key], value), key
    assert back["param_groups"] == torch_sd["param_groups"]


@pytest.mark.parametrize("config", ["bf16_default", "remainders", "fp8_remainders",
                                    "fp8_remainders8"])
def test_precis_torch_precis_round_trip(config):
    """precis -> torch's layout (+ masters) -> precis: masters, remainders and bf16
    moments come back bit for bit; fp8/fp16 moments within one encoding step."""
    dtype, policy = POLICIES[config]
    a, opt = trained(dtype, policy)
    torch_sd, masters = checkpoint.to_torch_state_dict(opt.state_dict(), a)
    precis_sd = checkpoint.from_torch_state_dict(torch_sd, a, policy, masters)
    twin = optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in a], policy=policy)
    twin.load_state_dict(precis_sd)
    for p, q in zip(a, twin.param_groups[0]["params"]):
        d1, d2 = opt.decoded_state(p), twin.decoded_state(q)
        assert same(d1["master"], d2["master"])
        assert d1["step"] == d2["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            if opt.state[p][key].dtype in (BF16, F32):
                assert same(opt.state[p][key], twin.state[q][key])
            else:
                tol = 2 ** -3 * d1[key].abs().max() + 1e-30
                assert float((d1[key] - d2[key]).abs().max()) <= tol


def test_from_torch_state_dict_checks():
    b = [torch.nn.Parameter(torch.randn(5))]
    theirs = torch.optim.AdamW(b)
    b[0].grad = torch.ones(5)
    theirs.step()
    sd = theirs.state_dict()
    sd["state"][0]["exp_avg_sq"] = -sd["state"][0]["exp_avg_sq"] - 1
    with pytest.raises(ValueError, match="negative values"):
        checkpoint.from_torch_state_dict(sd, b)
    with pytest.raises(ValueError, match="lists 1 params, 2 were given"):
        checkpoint.from_torch_state_dict(sd, b + b)
    sd["state"][0]["exp_avg_sq"] = torch.ones(5)
    sd["state"][0]["step"] = torch.tensor(float(2 ** 63))
    with pytest.raises(ValueError, match="below 2"):
        checkpoint.from_torch_state_dict(sd, b)
    sd["state"][0]["step"] = b"junk"
    with pytest.raises(ValueError, match="marker"):
        checkpoint.from_torch_state_dict(sd, b)
    del sd["state"][0]["exp_avg"]
    with pytest.raises(ValueError, match="expected a mapping with step, exp_avg, exp_avg_sq"):
        checkpoint.to_torch_state_dict(sd)
