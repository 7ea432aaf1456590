"""precis.optim.AdamW / Adam as drop-ins for torch.optim.AdamW / Adam: the same
arguments and defaults, the same param-group keys, the same errors for invalid
hyperparameters, torch's optimizer hooks; and the inputs precis refuses (with a
message naming what was wrong) before anything changes."""
import copy
import inspect

import pytest
import torch

import precis
import precis.optim as optim
from adam_reference import make_grads, master_tol, reference

PAIRS = [(optim.AdamW, torch.optim.AdamW), (optim.Adam, torch.optim.Adam)]
PRECIS_ONLY = {"policy", "seed"}  # group keys and arguments
OPTIMIZER_ONLY = {"offload", "offload_fraction"}  # arguments of the whole optimizer


def params(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 7, generator=g)) for _ in range(n)]


def set_grads(ps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["AdamW", "Adam"])
def test_signature_has_torch_arguments_and_defaults(ours, theirs):
    mine = inspect.signature(ours.__init__).parameters
    torch_params = inspect.signature(theirs.__init__).parameters
    for name, p in torch_params.items():
        assert name in mine, f"{ours.__name__} lacks torch's argument {name!r}"
        assert mine[name].default == p.default, name
        assert mine[name].kind == p.kind, name
    assert set(mine) - set(torch_params) == PRECIS_ONLY | OPTIMIZER_ONLY


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["AdamW", "Adam"])
def test_param_groups_have_torch_keys(ours, theirs):
    a, b = ours(params()), theirs(params())
    ga, gb = a.param_groups[0], b.param_groups[0]
    assert set(gb) <= set(ga)
    assert set(ga) - set(gb) == PRECIS_ONLY
    for key in gb:
        if key != "params":
            assert ga[key] == gb[key], key


def test_torch_defaults_spelled_out_are_accepted():
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
              maximize=False, foreach=None, capturable=False, differentiable=False, fused=None)
    for fused, foreach in ((False, None), (True, None), (None, True), (False, False)):
        opt = optim.AdamW(params(), **dict(kw, fused=fused, foreach=foreach))
        assert opt.param_groups[0]["fused"] is fused
        assert opt.param_groups[0]["foreach"] is foreach
    optim.Adam(params(), decoupled_weight_decay=False, **dict(kw, weight_decay=0.0))


@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["AdamW", "Adam"])
def test_eps_zero_steps_as_torch(ours, theirs, amsgrad):
    """eps=0, which torch accepts (eps >= 0), steps: fp32 params (the default policy:
    torch's bits) as torch's, at odd sizes, an element whose first gradient is 0 made
    NaN by 0 / 0 as torch makes it; bf16 params with the default policy (fp32 master,
    bf16 m and v) within the float64 reference's tolerance (tests/py/adam_reference.py),
    their gradients never 0."""
    # (Adam's L2 term would make a zero gradient non-zero: no decay there)
    kw = dict(lr=1e-2, eps=0.0, weight_decay=0.1 if ours is optim.AdamW else 0.0,
              amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(5)
    p0 = [torch.randn(n, generator=gen) for n in (1, 127, 4097)]
    grads = [[torch.randn(p.shape, generator=gen) for p in p0] for _ in range(3)]
    for g in grads[0]:
        g[::7] = 0.0  # (m = v = 0 at step 1: 0 / 0)
    mine = [torch.nn.Parameter(p.clone()) for p in p0]
    torch_params = [torch.nn.Parameter(p.clone()) for p in p0]
    a, b = ours(mine, **kw), theirs(torch_params, **kw)
    for step in grads:
        for p, q, g in zip(mine, torch_params, step):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert all(bool(p.isnan().any()) for p in mine)  # (the 0 / 0 elements)
    for p, q in zip(mine, torch_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)

    steps = 3
    p0 = torch.randn(4097, generator=gen).to(torch.bfloat16)
    grads = [g.masked_fill(g == 0, 1e-3) for g in
             make_grads(p0.numel(), steps, torch.bfloat16, gen)]
    p = torch.nn.Parameter(p0.clone())
    opt = ours([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expect = reference(p0, grads, kw["lr"], (0.9, 0.999), 0.0, kw["weight_decay"],
                           adamw=ours is optim.AdamW, amsgrad=amsgrad)[0]
    master = opt.decoded_state(p)["master"].double()
    tol = master_tol(torch.bfloat16, "fp32", torch.bfloat16, torch.bfloat16, p0, expect,
                         steps, kw["lr"])
    assert bool(((master - expect).abs() <= tol).all()), \
        f"worst error {float(((master - expect).abs() / tol).max()):.3g} x tolerance"


def test_fused_and_foreach_together_fail_as_in_torch():
    with pytest.raises(RuntimeError) as theirs:
        torch.optim.AdamW(params(), fused=True, foreach=True)
    with pytest.raises(RuntimeError) as ours:
        optim.AdamW(params(), fused=True, foreach=True)
    assert str(ours.value).startswith(str(theirs.value))


def test_differentiable_refused_for_low_precision_state():
    """differentiable=True runs torch's math, for fp32 params with the fp32 policy only
    (test_torch_optim_db checks that case against torch)."""
    bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params()]
    with pytest.raises(ValueError, match="autograd"):
        optim.AdamW(bf16, differentiable=True)
    with pytest.raises(ValueError, match="autograd"):
        optim.AdamW(params(), differentiable=True, policy={"exp_avg_dtype": "bf16"})


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_a_differentiable_group_in_an_optimizer_made_without_steps_as_torch(name):
    """torch's step takes its grad mode from the optimizer's defaults, not the group's: a
    group added with differentiable=True (fp32 params: torch's math steps them) steps
    under no_grad beside the others, with torch's bits in both groups (precis stepped
    group 0, then failed in group 1: an in-place write of a leaf under grad mode)."""
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD" else dict(lr=1e-2)
    runs = []
    for cls in (getattr(optim, name), getattr(torch.optim, name)):
        a, b = params(2)
        opt = cls([a], **kw)
        opt.add_param_group({"params": [b], "differentiable": True})
        for seed in range(3):
            set_grads([a, b], seed)
            opt.step()
        runs.append((a, b))
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("key", ["betas", "differentiable"])
def test_a_group_turned_to_torchs_math_mid_run_steps_as_torch(monkeypatch, key, device_path):
    """Tensor betas (foreach=False) or differentiable=True set on a group after some
    steps: torch's math steps it from then on, as when set from the start (the step's
    plan, made for the kernel, was kept: up to 876 of 1000 elements off torch's)."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    value = (torch.tensor(0.8), torch.tensor(0.9)) if key == "betas" else True
    runs = []
    for cls in (optim.Adam, torch.optim.Adam):
        ps = params(2)
        opt = cls(ps, lr=1e-2, foreach=False)
        for seed in range(5):
            if seed == 2:
                opt.param_groups[0][key] = value
            set_grads(ps, seed)
            opt.step()
        runs.append(ps)
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)


def test_a_schedulers_float_beta1_beside_tensor_betas_steps_as_torch():
    """OneCycleLR (cycle_momentum) on tensor betas writes a float beta1 beside the tensor
    beta2: torch's step takes it (its "both floats or both Tensors" is a constructor
    check), precis refused every step; torch's bits now. Made so, still refused."""
    from torch.optim import lr_scheduler
    runs = []
    for cls in (optim.Adam, torch.optim.Adam):
        ps = params(2)
        opt = cls(ps, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=False)
        schedule = lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=10)
        assert isinstance(opt.param_groups[0]["betas"][0], float)
        for seed in range(4):
            set_grads(ps, seed)
            opt.step()
            schedule.step()
        runs.append(ps)
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)
    for make in (lambda: optim.Adam(params(1), betas=(0.9, torch.tensor(0.99))),
                 lambda: optim.Adam(params(1)).add_param_group(
                     {"params": params(1, 3), "betas": (torch.tensor(0.9), 0.99)})):
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            make()


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("policy", [None, {"exp_avg_dtype": "fp8", "store_param_remainders": True}])
def test_a_step_between_forward_and_backward_is_caught_by_autograd_as_torchs(
        monkeypatch, policy, device_path):
    """A param saved by a forward and then stepped before its backward: torch's in-place
    step bumps its version, and the backward raises; the kernels wrote it unseen, and
    the backward used the new weights (silently wrong gradients). Every step (the first,
    the steady one); a param the step did not write (no gradient) is not bumped."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    dtype = torch.float32 if policy is None else torch.bfloat16
    lin, frozen = torch.nn.Linear(4, 4).to(dtype), torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = optim.AdamW([*lin.parameters(), frozen], lr=0.1, policy=policy)
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True, dtype=dtype)
        y = (lin(x) * frozen).float().square().sum()
        for p in lin.parameters():
            p.grad = torch.ones_like(p)
        frozen.grad = None  # (the last backward gave it one before it raised)
        frozen_version = frozen._version
        opt.step()
        assert frozen._version == frozen_version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_numpy_scalar_hyperparameters_taken_as_their_values():
    """numpy scalars for lr, weight_decay and eps (a config read with numpy), taken as
    torch.optim takes them, at their values: the bits of torch given float() of each
    (precis refused them: "lr must be a finite number, got np.float32(0.01)"; torch
    given the numpy scalars themselves does its scalar arithmetic in numpy's float32 or
    float16, off by that rounding)."""
    np = pytest.importorskip("numpy")
    kw = dict(lr=np.float32(1e-2), weight_decay=np.float64(0.1), eps=np.float32(1e-6))
    runs = []
    for cls, values in ((optim.AdamW, kw), (torch.optim.AdamW,
                                             {k: float(v) for k, v in kw.items()})):
        ps = params(2)
        opt = cls(ps, **values)
        later = np.float16(2e-2)  # (as a scheduler of numpy values)
        opt.param_groups[0]["lr"] = later if cls is optim.AdamW else float(later)
        for seed in range(3):
            set_grads(ps, seed)
            opt.step()
        runs.append(ps)
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)
    for cls, extra in ((optim.SGD, dict(momentum=0.9)), (optim.Lion, {}), (optim.Muon, {})):
        p = torch.nn.Parameter(torch.randn(4, 4))
        p.grad = torch.ones(4, 4)
        before = p.detach().clone()
        cls([p], lr=np.float32(1e-2), **extra).step(grad_scale=np.float32(2.0))
        assert not torch.equal(p, before)


BAD = [dict(lr=-1.0), dict(lr=float("nan")), dict(eps=-1e-8), dict(weight_decay=-0.1),
       dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.5)), dict(betas=(0.9, 1.0))]


@pytest.mark.parametrize("kw", BAD, ids=[str(k) for k in BAD])
@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["AdamW", "Adam"])
def test_invalid_hyperparameters_worded_as_torch(ours, theirs, kw):
    try:
        theirs(params(), **kw)
        torch_message = None
    except ValueError as e:
        torch_message = str(e)
    with pytest.raises(ValueError) as e:
        ours(params(), **kw)
    if torch_message is not None:  # torch lets lr=nan through; precis refuses it
        assert str(e.value).startswith(torch_message)


def test_adam_with_decoupled_weight_decay_is_adamw():
    pa, pb = params(), params()
    a = optim.Adam(pa, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    b = optim.AdamW(pb, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        set_grads(pa, seed=step)
        set_grads(pb, seed=step)
        a.step()
        b.step()
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    c = optim.Adam(params(), lr=1e-2, weight_decay=0.1)  # L2: a different trajectory
    set_grads(c.param_groups[0]["params"], seed=0)
    c.step()
    first_a = optim.Adam(params(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    set_grads(first_a.param_groups[0]["params"], seed=0)
    first_a.step()
    assert not torch.equal(c.param_groups[0]["params"][0], first_a.param_groups[0]["params"][0])


def test_optimizer_hooks_run():
    ps = params()
    opt = optim.AdamW(ps, lr=1e-2)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd_pre"))

    def sd_post(o, sd):
        seen.append("sd_post")
        sd["extra"] = 1
        return sd
    opt.register_state_dict_post_hook(sd_post)

    def load_pre(o, sd):
        seen.append("load_pre")
        sd = dict(sd)
        sd.pop("extra")
        return sd
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
    set_grads(ps)
    opt.step()
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert seen == ["pre", "post", "sd_pre", "sd_post", "load_pre", "load_post"]


@pytest.mark.parametrize("value", ["fp8\0junk", "bf16\0"])
def test_nul_bytes_in_policy_strings_refused(value):
    with pytest.raises(ValueError, match="NUL byte"):
        precis.resolve_policy(torch.bfloat16, {"exp_avg_dtype": value})
    with pytest.raises(ValueError, match="NUL byte"):
        precis.resolve_policy(torch.bfloat16, {"exp_avg_dtype\0x": "fp8"})
    with pytest.raises(ValueError, match="NUL byte"):
        optim.AdamW(params(), policy={"exp_avg_sq_dtype": value})


def test_master_of_the_params_own_dtype_refused_on_load():
    ps = params()
    opt = optim.AdamW(ps, lr=1e-2)
    set_grads(ps)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["master"] = ps[0].detach().clone()  # fp32 master of an fp32 param
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[ps[0]].items()}
    with pytest.raises(ValueError, match="own dtype"):
        opt.load_state_dict(sd)
    assert all(torch.equal(opt.state[ps[0]][k], v) if torch.is_tensor(v)
               else opt.state[ps[0]][k] == v for k, v in before.items())


POLICIES_WITH_STREAMS = [None, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"},
                         {"store_param_remainders": True, "param_remainder_bits": 8}]


@pytest.mark.parametrize("policy", POLICIES_WITH_STREAMS, ids=["default", "fp8", "remainders8"])
def test_per_param_state_holds_only_tensors(policy):
    """As torch's optimizers' (whose test_fused_matches_forloop .detach()es every value,
    as users' "move the state to a device" loops do): the stochastic rounding's stream
    lives outside the state, and the state survives being moved and detached like that;
    a state dict and a deepcopy carry the streams."""
    ps = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params()]
    opt = optim.AdamW(ps, policy=policy)
    g = torch.Generator().manual_seed(1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
    opt.step()
    for p in ps:
        assert opt.state[p], "no state made"
        for key, value in opt.state[p].items():
            assert isinstance(value, torch.Tensor), (key, type(value))
    assert all(p in opt._books.streams for p in ps)  # kept outside the state
    for p in ps:  # a user's loop over the state, then a step and a round trip
        for key, value in list(opt.state[p].items()):
            opt.state[p][key] = value.detach().to("cpu")
    opt.step()
    twin = optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], policy=policy)
    twin.load_state_dict(opt.state_dict())
    for a, b in zip(ps, twin.param_groups[0]["params"]):
        for key in opt.state[a]:
            assert torch.equal(opt.state[a][key], twin.state[b][key]), key
    copied = copy.deepcopy(opt)
    assert [copied._books.streams[p] for p in copied.param_groups[0]["params"]] == \
        [opt._books.streams[p] for p in ps]


def test_state_dict_keeps_what_a_pre_hook_puts_in_state():
    """torch's test_state_dict_pre_hook: a pre-hook may put a non-dict entry into
    optimizer.state (state["test"] = 1); state_dict() carries it, as torch's does, and
    the optimizer still steps."""
    ps = params()
    opt = optim.AdamW(ps, policy={"exp_avg_sq_dtype": "bf16"})
    set_grads(ps)
    opt.step()

    def pre_hook(optimizer):
        optimizer.state["test"] = 1

    opt.register_state_dict_pre_hook(pre_hook)
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1
    assert sorted(k for k in sd["state"] if k != "test") == [0, 1, 2]
    opt.step()  # the non-param entry is passed over
    sd["state"].pop("test")
    fresh = optim.AdamW(params(), policy={"exp_avg_sq_dtype": "bf16"})
    fresh.load_state_dict(sd)


def model_with_frozen_params(dtype=torch.float32):
    """Two linear layers and three frozen params no optimizer can step: an int8 weight
    (a quantized one), an fp8 one, an expanded one (elements sharing memory)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(dtype)
    m.int8 = torch.nn.Parameter(torch.randint(-128, 127, (3, 5), dtype=torch.int8),
                                requires_grad=False)
    m.fp8 = torch.nn.Parameter(torch.randn(3, 5).to(torch.float8_e4m3fn), requires_grad=False)
    m.expanded = torch.nn.Parameter(torch.randn(1, 5, dtype=dtype).expand(3, 5),
                                    requires_grad=False)
    return m


def same_state_dict(a, b):
    """Two optimizer state dicts hold the same groups and the same state, bit for bit."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert st.keys() == b["state"][k].keys(), k
        for key, value in st.items():
            other = b["state"][k][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) \
                else value == other, (k, key)
    return True


def train_frozen(m, opt, steps=3):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, 5, generator=gen).to(m[0].weight.dtype)
        m(x).float().square().sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_frozen_params_of_any_dtype_are_taken_and_left_as_torch(name):
    """model.parameters() with frozen params no optimizer steps (int8, fp8, expanded):
    taken as torch takes them, left as they are, the others stepped with torch's bits
    (fp32); the state dict saved and loaded, also with fp8 state and 8-bit remainders on
    a bf16 model; one made trainable later refused at its step (an in-place update cannot
    write an expanded tensor) before anything changes; a saved state for the int8 one
    refused."""
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD" else dict(lr=1e-2)
    ours, theirs = model_with_frozen_params(), model_with_frozen_params()
    frozen = [t.detach().clone() for t in (ours.int8, ours.fp8, ours.expanded)]
    opt = getattr(optim, name)(ours.parameters(), **kw)
    train_frozen(ours, opt)
    train_frozen(theirs, getattr(torch.optim, name)(theirs.parameters(), **kw))
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q)
    assert torch.equal(ours.int8, frozen[0]) and torch.equal(ours.expanded, frozen[2])
    again = getattr(optim, name)(ours.parameters(), **kw)
    again.load_state_dict(opt.state_dict())
    assert same_state_dict(again.state_dict(), opt.state_dict())

    bf16 = model_with_frozen_params(torch.bfloat16)
    policy = {"exp_avg_dtype": "fp8", "store_param_remainders": True, "param_remainder_bits": 8}
    low = getattr(optim, name)(bf16.parameters(), policy=policy, **kw)
    train_frozen(bf16, low)
    getattr(optim, name)(bf16.parameters(), policy=policy, **kw).load_state_dict(
        low.state_dict())

    ours.expanded.requires_grad_(True)
    ours(torch.randn(2, 5)).sum().backward()
    ours.expanded.grad = torch.ones(3, 5)
    before = [p.detach().clone() for p in ours.parameters()]
    saved = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"param 2 of group 0 .* has elements sharing memory"):
        opt.step()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1
               else torch.equal(a, b) for a, b in zip(before, ours.parameters()))
    assert same_state_dict(opt.state_dict(), saved)

    ours.expanded.requires_grad_(False)
    state = opt.state_dict()
    state["state"][0] = state["state"][3]  # (the int8 weight: param 0 of the group)
    with pytest.raises(ValueError, match=r"state of param 0 of group 0 .*torch.int8\): "
                                         rf"{name} never steps a param of this dtype"):
        getattr(optim, name)(ours.parameters(), **kw).load_state_dict(state)
