"""precis.optim.SGD, Lion and Muon: the one-state optimizers on precis's element stores
(issue #44, one update engine).

* fp32 params with the fp32 policy: torch.optim.SGD's and torch.optim.Muon's bits after
  every step (params and momentum buffer torch.equal), at sizes 1, 127, 4097 (SGD;
  1_000_003 once) and odd matrix shapes, tall and wide (Muon); Lion against a float64
  reference (no torch Lion), with its tolerance stated below.
* low-precision policies (bf16 params with an fp32 master and bf16 momentum; fp8
  momentum with 8-bit remainders) against the fp32 trajectory on the same gradients.
* checkpoints: state_dict -> torch.save -> weights_only load -> resume bit-exact;
  torch's SGD / Muon state dicts in and out (to_torch_state_dict names the momentum
  'momentum_buffer'); another optimizer's state dict refused, nothing changed.
* bytes per param of state + bf16 gradient, measured from the tensors.
* bad input refused before anything changes, naming what is wrong.
"""
import copy
import io
import re

import pytest
import torch

import precis  # noqa: F401  (loads the package, registers the ops)
from precis import checkpoint, optim

SIZES = (1, 127, 4097)
FP8_REM8 = {"exp_avg_dtype": "fp8", "store_param_remainders": True, "param_remainder_bits": 8}


def make(shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def grads(params, gen, scale=1.0):
    """Random gradients plus a multiple of the param (a difference in a param shows in
    the next steps' momentum)."""
    return [(torch.randn(p.shape, generator=gen) * scale + 0.05 * p.detach().float())
            for p in params]


def step_both(a, b, opt_a, opt_b, gen):
    for pa, pb, g in zip(a, b, grads(a, gen)):
        pa.grad, pb.grad = g.to(pa.dtype), g.to(pb.dtype)
    opt_a.step()
    opt_b.step()


def momentum(opt, p):
    """The momentum buffer's values (precis's stored form decoded; torch's as is)."""
    if isinstance(opt, optim.PrecisOptimizer):
        return opt.decoded_state(p).get("exp_avg")
    state = opt.state.get(p, {})
    return state.get("momentum_buffer", state.get("exp_avg"))


def assert_same(a, b, opt_a, opt_b, step):
    for i, (pa, pb) in enumerate(zip(a, b)):
        assert torch.equal(pa, pb), f"step {step}: param {i} differs"
        ma, mb = momentum(opt_a, pa), momentum(opt_b, pb)
        assert (ma is None) == (mb is None), f"step {step}: param {i}: momentum {ma} vs {mb}"
        if ma is not None:
            assert torch.equal(ma, mb), f"step {step}: momentum of param {i} differs"


SGD_CASES = [
    dict(lr=0.01),
    dict(lr=0.01, momentum=0.9),
    dict(lr=0.0123456789, momentum=0.87654321, dampening=0.3, weight_decay=0.0111),
    dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(lr=0.02, momentum=0.5, maximize=True),
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sgd_fp32_is_torch_bit_for_bit(kw):
    a, b = make(SIZES, 0), make(SIZES, 0)
    opt_a, opt_b = optim.SGD(a, **kw), torch.optim.SGD(b, **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 21):
        step_both(a, b, opt_a, opt_b, gen)
        assert_same(a, b, opt_a, opt_b, step)


def test_sgd_fp32_is_torch_bit_for_bit_at_a_million():
    kw = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    a, b = make((1_000_003,), 2), make((1_000_003,), 2)
    opt_a, opt_b = optim.SGD(a, **kw), torch.optim.SGD(b, **kw)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        step_both(a, b, opt_a, opt_b, gen)
        assert_same(a, b, opt_a, opt_b, step)


def test_sgd_lr_scheduler_and_group_changes_follow_torch():
    a, b = make(SIZES, 4), make(SIZES, 4)
    opt_a = optim.SGD(a[:2], lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(b[:2], lr=0.05, momentum=0.9)
    opt_a.add_param_group({"params": a[2:], "lr": 0.01, "nesterov": True, "momentum": 0.8})
    opt_b.add_param_group({"params": b[2:], "lr": 0.01, "nesterov": True, "momentum": 0.8})
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 3, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 3, gamma=0.5)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 11):
        step_both(a, b, opt_a, opt_b, gen)
        sched_a.step()
        sched_b.step()
        if step == 5:
            for opt in (opt_a, opt_b):
                opt.param_groups[0]["weight_decay"] = 0.01
        assert_same(a, b, opt_a, opt_b, step)


MUON_SHAPES = ((1, 1), (127, 33), (33, 127), (64, 64), (5, 301))


@pytest.mark.parametrize("nesterov", (True, False))
@pytest.mark.parametrize("adjust_lr_fn", (None, "match_rms_adamw"))
def test_muon_fp32_is_torch_bit_for_bit(nesterov, adjust_lr_fn):
    kw = dict(lr=0.02, weight_decay=0.05, momentum=0.93, nesterov=nesterov,
              adjust_lr_fn=adjust_lr_fn)
    a, b = make(MUON_SHAPES, 6), make(MUON_SHAPES, 6)
    opt_a, opt_b = optim.Muon(a, **kw), torch.optim.Muon(b, **kw)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 11):
        step_both(a, b, opt_a, opt_b, gen)
        assert_same(a, b, opt_a, opt_b, step)


def lion_reference(p, gs, lr, betas, wd):
    """Lion in float64: p and the momentum after each gradient of gs."""
    p, m = p.double(), torch.zeros_like(p, dtype=torch.float64)
    b1, b2 = betas
    for g in gs:
        g = g.double()
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    return p, m


@pytest.mark.parametrize("n", SIZES + (1_000_003,))
def test_lion_matches_a_float64_reference(n):
    """fp32 arithmetic against float64: the momentum within 1e-6 relative plus 1e-7; the
    params within 1e-6, except where c is within fp32's rounding of 0 and the sign may
    differ (a 2*lr step): at most 1 element in 10^4 there."""
    lr, betas, wd, steps = 1e-3, (0.9, 0.99), 0.1, 5 if n < 10**6 else 2
    (p,) = make((n,), 8)
    start = p.detach().clone()
    opt = optim.Lion([p], lr=lr, betas=betas, weight_decay=wd)
    gen = torch.Generator().manual_seed(9)
    gs = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        gs.append(g)
        p.grad = g.clone()
        opt.step()
    ref_p, ref_m = lion_reference(start, gs, lr, betas, wd)
    m = opt.decoded_state(p)["exp_avg"].double()
    assert torch.allclose(m, ref_m, rtol=1e-6, atol=1e-7)
    off = (p.detach().double() - ref_p).abs()
    assert float(off.max()) <= 2 * lr * steps + 1e-6
    assert int((off > 1e-6).sum()) <= max(1, n // 10**4)


def test_lion_maximize_and_zero_betas():
    """maximize ascends (the gradient negated); beta1 = 0 steps by sign(g) alone."""
    (p,) = make((4097,), 10)
    start = p.detach().clone()
    opt = optim.Lion([p], lr=0.01, betas=(0.0, 0.5), maximize=True)
    g = torch.randn(4097, generator=torch.Generator().manual_seed(11))
    p.grad = g.clone()
    opt.step()
    assert torch.equal(p.detach(), start + 0.01 * torch.sign(g))


# ---- low-precision state against the fp32 trajectory ---------------------------------


OPTIMIZERS = {
    "sgd": (optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
            ((4097,), (127,), (33, 65))),
    "lion": (optim.Lion, dict(lr=1e-3, weight_decay=0.1), ((4097,), (127,), (33, 65))),
    "muon": (optim.Muon, dict(lr=0.02, weight_decay=0.05), ((127, 33), (64, 64))),
}
POLICIES = {"default": None, "fp8+rem8": FP8_REM8}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_low_precision_state_tracks_fp32(name, policy):
    """bf16 params with the policy's master and momentum, against fp32 params with the
    fp32 policy on the same (bf16) gradients: after 20 steps each master's distance to
    the fp32 run's params is within 5% (default: bf16 momentum) or 10% (fp8 momentum +
    24-bit master) of the distance the fp32 run travelled (L2 norms: Lion's sign flips
    where its c is near 0, a 2 * lr step each, are a few elements, not the bulk)."""
    cls, kw, shapes = OPTIMIZERS[name]
    low = make(shapes, 12, torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in low]
    start = [p.detach().clone() for p in ref]
    opt_low, opt_ref = cls(low, policy=POLICIES[policy], **kw), cls(ref, **kw)
    gen = torch.Generator().manual_seed(13)
    for _ in range(20):
        for pl, pr, g in zip(low, ref, grads(ref, gen)):
            g = g.bfloat16()
            pl.grad, pr.grad = g, g.float()
        opt_low.step()
        opt_ref.step()
    tol = 0.05 if policy == "default" else 0.10
    for pl, pr, p0 in zip(low, ref, start):
        travelled = float((pr.detach() - p0).norm())
        off = float((opt_low.master_weight(pl) - pr.detach()).norm())
        assert off <= tol * travelled, f"{name} {policy}: {off} against {travelled} travelled"


# ---- checkpoints -----------------------------------------------------------------------


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_is_bit_exact(name, policy):
    cls, kw, shapes = OPTIMIZERS[name]
    dtype = torch.float32 if policy == "default" else torch.bfloat16
    a = make(shapes, 14, dtype)
    opt_a = cls(a, policy=POLICIES[policy], **kw)
    gen = torch.Generator().manual_seed(15)
    for _ in range(3):
        for p, g in zip(a, grads(a, gen)):
            p.grad = g.to(dtype)
        opt_a.step()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = cls(b, policy=POLICIES[policy], **kw)
    opt_b.load_state_dict(roundtrip(opt_a.state_dict()))
    for step in range(1, 4):
        step_both(a, b, opt_a, opt_b, gen)
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb), f"step {step} after the load"
            for key, t in opt_a.state[pa].items():
                assert torch.equal(t, opt_b.state[pb][key]), f"{key} at step {step}"


@pytest.mark.parametrize("name", ("sgd", "muon"))
def test_torch_state_dicts_in_and_out(name):
    """to_torch_state_dict gives torch's optimizer a state it continues bit for bit;
    precis's optimizer takes torch's state dict and continues bit for bit."""
    cls, kw, shapes = OPTIMIZERS[name]
    theirs_cls = {"sgd": torch.optim.SGD, "muon": torch.optim.Muon}[name]
    a, b = make(shapes, 16), make(shapes, 16)
    opt_a, opt_b = cls(a, **kw), theirs_cls(b, **kw)
    gen = torch.Generator().manual_seed(17)
    for step in range(1, 4):
        step_both(a, b, opt_a, opt_b, gen)
    torch_sd, masters = checkpoint.to_torch_state_dict(opt_a.state_dict())
    assert masters == {}
    assert all(set(s) == {"step", "momentum_buffer"} for s in torch_sd["state"].values())
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_c = theirs_cls(c, **kw)
    opt_c.load_state_dict(torch_sd)
    d = [torch.nn.Parameter(p.detach().clone()) for p in b]
    opt_d = cls(d, **kw)
    opt_d.load_state_dict(opt_b.state_dict())
    for step in range(1, 4):
        step_both(c, d, opt_c, opt_d, gen)
        assert_same(c, d, opt_c, opt_d, step)


def test_another_optimizers_state_dict_is_refused_and_changes_nothing():
    shapes = ((127,), (33,))
    adam_params, sgd_params, lion_params = make(shapes, 18), make(shapes, 18), make(shapes, 18)
    adam, sgd = optim.AdamW(adam_params), optim.SGD(sgd_params, lr=0.1, momentum=0.9)
    lion = optim.Lion(lion_params)
    for opt, params in ((adam, adam_params), (sgd, sgd_params), (lion, lion_params)):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    before = {id(o): roundtrip(o.state_dict()) for o in (adam, sgd, lion)}
    cases = ((sgd, adam, "lacks momentum, dampening"), (lion, adam, "unknown keys exp_avg_sq"),
             (adam, sgd, "lacks betas"), (lion, sgd, "lacks betas"))
    for target, source, message in cases:
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(source.state_dict())
        after = target.state_dict()
        for index, state in before[id(target)]["state"].items():
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(t, after["state"][index][key])


@pytest.mark.parametrize("name,missing", [("SGD", ("nesterov", "maximize")),
                                          ("Adam", ("amsgrad", "maximize"))])
def test_a_state_dict_saved_before_torch_had_an_option_loads_as_torch_loads_it(name, missing):
    """A group saved by an older torch lacks options added since: torch's __setstate__
    gives them their old value (False), not the optimizer's (precis refused SGD's
    without nesterov: "lacks nesterov"); then torch's bits."""
    kw = dict(lr=0.1, momentum=0.9) if name == "SGD" else dict(lr=0.1)
    source = make(((9, 4),), 31)
    saving = getattr(torch.optim, name)(source, **kw)
    source[0].grad = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
    saving.step()
    sd = saving.state_dict()
    for key in missing:
        del sd["param_groups"][0][key]
    runs = []
    for cls in (getattr(optim, name), getattr(torch.optim, name)):
        params = [torch.nn.Parameter(source[0].detach().clone())]
        opt = cls(params, **{**kw, missing[0]: True})  # (the optimizer's: not taken)
        opt.load_state_dict(copy.deepcopy(sd))
        assert all(opt.param_groups[0][key] is False for key in missing)
        gen = torch.Generator().manual_seed(2)
        for _ in range(2):
            params[0].grad = torch.randn(9, 4, generator=gen)
            opt.step()
        runs.append(params[0])
    assert torch.equal(*runs)


def test_decoded_state_and_state_keys():
    (p,) = make(((127, 33),), 19, torch.bfloat16)
    opt = optim.Muon([p], policy=FP8_REM8)
    p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_scale", "remainder"}
    assert opt.state[p]["exp_avg"].dtype == torch.uint8
    decoded = opt.decoded_state(p)
    assert set(decoded) == {"step", "master", "exp_avg"}
    assert decoded["exp_avg"].dtype == torch.float32 and decoded["exp_avg"].shape == p.shape
    # torch.optim.Muon's first buffer: (1 - momentum) * g (lerp from zero)
    assert torch.allclose(decoded["exp_avg"], 0.05 * p.grad.float(), rtol=0.05, atol=1e-3)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_and_gradient_bytes_per_param(name):
    """fp8 momentum + 8-bit remainders: momentum 1 byte + 1/32 of scales, remainder 1,
    bf16 gradient 2: <= 4.1 bytes/param (6.1 with the bf16 param); the default policy
    (bf16 momentum, fp32 master): <= 8.1."""
    cls, kw, shapes = OPTIMIZERS[name]
    for policy, limit in ((FP8_REM8, 4.1), (None, 8.1)):
        params = make(shapes, 20, torch.bfloat16)
        opt = cls(params, policy=policy, **kw)
        for p in params:
            p.grad = torch.randn(p.shape).bfloat16()
        opt.step()
        report = opt.memory_report()
        state = report["grad"] + report["master"] + report["exp_avg"] + report["scales"]
        assert report["exp_avg_sq"] == 0.0
        assert state <= limit, f"{name} {policy}: {state} bytes/param"
        assert state + report["param"] <= limit + 2.0


# ---- bad input ---------------------------------------------------------------------------


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        optim.Muon([torch.nn.Parameter(torch.zeros(5))])
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero"):
        optim.SGD(make(((3,),), 0), nesterov=True, momentum=0.9, dampening=0.1)
    with pytest.raises(ValueError, match="Invalid momentum value"):
        optim.SGD(make(((3,),), 0), momentum=-0.1)
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        optim.Lion(make(((3,),), 0), betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="momentum"):
        optim.Muon(make(((3, 3),), 0), momentum=1.0)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = optim.Lion([p], lr=0.1)  # no torch Lion to step a float64 param
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="float64"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3, dtype=torch.float64)) and not opt.state


@pytest.mark.parametrize("name", ["Muon", "NorMuon"])
def test_a_refused_group_leaves_a_released_optimizer_as_it_was(name):
    """add_param_group of a group with a 1-D param, refused, under gradient release: no
    hook is left on its params (the next backward stepped the held group and raised in
    the release's books, and the matrix could not be added again: "also in group 1")."""
    cls = getattr(optim, name)
    held, matrix, bias = make(((7, 5), (5, 4), (5,)), 27)
    opt = cls([held], lr=0.02)
    release = optim.release_gradients(opt)
    with pytest.raises(ValueError, match=f"{name} only supports 2D parameters"):
        opt.add_param_group({"params": [matrix, bias]})
    assert len(opt.param_groups) == 1
    x = torch.randn(3, 4)
    before = [t.detach().clone() for t in (matrix, bias)]
    ((x @ matrix.T + bias) @ held.T).sum().backward()
    opt.step()
    assert all(torch.equal(t, b) for t, b in zip((matrix, bias), before))  # not held
    assert matrix.grad is not None and bias.grad is not None  # nothing stepped them
    opt.add_param_group({"params": [matrix]})  # the matrix, now held
    opt.zero_grad()
    ((x @ matrix.T + bias) @ held.T).sum().backward()
    opt.step()
    assert not torch.equal(matrix, before[0]) and matrix.grad is None  # released
    release.remove()


def test_a_refused_step_changes_nothing():
    """A gradient of the wrong size in the second group (a main_grad, which torch does
    not check): the first group is not stepped either (every group's arguments are
    checked before the first write)."""
    a, b = make(((127, 3),), 21), make(((33, 65),), 22)
    opt = optim.Muon([{"params": a}, {"params": b}])
    a[0].grad = torch.randn(127, 3)
    b[0].main_grad = torch.randn(33, 64)
    before = [p.detach().clone() for p in a + b]
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a + b, before)) and not opt.state


def test_muon_refuses_a_flat_piece_it_cannot_assemble():
    """A flat piece of a matrix put in a group after construction (as a precis.ddp
    wrapper's piece would be without attach_optimizer): Newton-Schulz needs the whole
    matrix, so the step refuses it, naming it, before anything is written."""
    matrix, other = make(((33, 65),), 25), make(((7, 5),), 26)
    opt = optim.Muon([{"params": other}, {"params": matrix}])
    piece = matrix[0].detach().view(-1)[:1000]
    opt.param_groups[1]["params"] = [piece]
    other[0].grad, piece.grad = torch.randn(7, 5), torch.randn(1000)
    before = [t.detach().clone() for t in (other[0], matrix[0])]
    with pytest.raises(ValueError, match=r"param 0 of group 1 \(shape \(1000,\)\): Muon "
                                         r"orthogonalizes whole matrices"):
        opt.step()
    assert all(torch.equal(t, b) for t, b in zip((other[0], matrix[0]), before))
    assert not opt.state


def test_sgd_momentum_turned_on_later_starts_from_the_gradient_as_torch():
    """momentum 0 for 3 steps, then 0.9 with dampening 0.5: torch starts the buffer from
    g (no dampening on its first use); so does precis, whatever its step count."""
    a, b = make(SIZES, 23), make(SIZES, 23)
    opt_a, opt_b = optim.SGD(a, lr=0.01), torch.optim.SGD(b, lr=0.01)
    gen = torch.Generator().manual_seed(24)
    for step in range(1, 7):
        if step == 4:
            for opt in (opt_a, opt_b):
                opt.param_groups[0].update(momentum=0.9, dampening=0.5)
        step_both(a, b, opt_a, opt_b, gen)
        assert_same(a, b, opt_a, opt_b, step)


def test_sgd_momentum_turned_off_keeps_the_buffer_as_torch():
    """momentum 0.9, then 0 in one group for three steps (torch keeps its buffer in the
    state, untouched, and so does precis: the op reads none), then 0.9 again, which goes
    on from the kept buffer: torch's bits at every step, and the planned path taken at
    each setting (a plan of the group with its buffer, then one without)."""
    a, b = make(SIZES, 25), make(SIZES, 25)
    opt_a, opt_b = optim.SGD(a[:1], lr=0.01, momentum=0.9), torch.optim.SGD(b[:1], lr=0.01,
                                                                             momentum=0.9)
    for opt, ps in ((opt_a, a), (opt_b, b)):
        opt.add_param_group({"params": ps[1:], "momentum": 0.9, "dampening": 0.2})
    gen = torch.Generator().manual_seed(26)
    for step in range(1, 10):
        if step in (4, 7):
            for opt in (opt_a, opt_b):
                opt.param_groups[1]["momentum"] = 0.0 if step == 4 else 0.9
        step_both(a, b, opt_a, opt_b, gen)
        assert_same(a, b, opt_a, opt_b, step)
        if step in (6, 9):  # two steps at the setting: its plan holds
            assert 1 in opt_a._books.plans, step


def test_muon_steps_a_transposed_matrix_as_torch():
    """A dense matrix in other strides (a transposed weight) is stepped as its elements in
    memory order, Newton-Schulz seeing it in its own strides: torch.optim.Muon's bits,
    and the param keeps its strides."""
    def transposed(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(s, generator=gen).t())
                for s in ((64, 33), (127, 5), (1, 9))]
    a, b = transposed(27), transposed(27)
    kw = dict(lr=0.02, weight_decay=0.05, momentum=0.93)
    opt_a, opt_b = optim.Muon(a, **kw), torch.optim.Muon(b, **kw)
    gen = torch.Generator().manual_seed(28)
    for step in range(1, 5):
        step_both(a, b, opt_a, opt_b, gen)
        assert_same(a, b, opt_a, opt_b, step)
    assert [p.stride() for p in a] == [(1, 33), (1, 5), (1, 9)]


@pytest.mark.parametrize("name", ("SGD", "Lion", "Muon", "AdamW"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("planned", (False, True))
def test_a_gradient_of_another_shape_is_refused_as_torch_does(name, dtype, planned):
    """A gradient with the param's element count in another shape (set through
    .grad.data, which torch's setter does not check): torch.optim raises; so does precis,
    naming both shapes, with nothing changed, on a first step (the full path) and on a
    planned one (the flat op checks each grad's shape against its row)."""
    params = make(((16, 8), (3, 5)), 29, dtype)
    opt = getattr(optim, name)(params, lr=0.01)
    gen = torch.Generator().manual_seed(30)
    for _ in range(3 if planned else 0):
        for p, g in zip(params, grads(params, gen)):
            p.grad = g.to(dtype)
        opt.step()
    assert (0 in opt._books.plans) == (planned and opt._books.rule.flat)  # (Muon: no plan)
    params[1].grad = torch.zeros_like(params[1])
    params[0].grad = torch.zeros_like(params[0])
    params[0].grad.data = torch.randn(8, 16).to(dtype)
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError, match=r"param 0 of group 0 \(shape \(16, 8\)\): its gradient "
                                         r"has shape \(8, 16\)"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    after = opt.state_dict()["state"]
    assert state.keys() == after.keys()
    for i in state:
        for key, value in state[i].items():
            same = torch.equal(value, after[i][key]) if isinstance(value, torch.Tensor) \
                else value == after[i][key]  # (a marker of bytes: STEP_MARKER)
            assert same, (i, key)


# Sparse gradients (nn.Embedding(sparse=True)): torch.optim.SGD's own math steps them
# (precis.torch_math), fp32 params with fp32 state only.


def embedding_model(seed, dtype=torch.float32):
    """An embedding of odd size with sparse gradients, beside a dense layer (which
    precis's kernel steps in the same group)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(37, 5, sparse=True),
                               torch.nn.Linear(5, 3)).to(dtype)


def train(model, opt, steps, gen, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        rows = torch.randint(0, 37, (11,), generator=gen)  # repeats: an uncoalesced grad
        weights = torch.randn(11, 3, generator=gen)  # (linear: maximize does not blow up)
        (model(rows).float() * weights).sum().backward()
        opt.step()
        yield step


def assert_embedding_state_same(sd_a, sd_b):
    """The embedding's (param 0's) state in two state dicts equal: keys, and each
    tensor's layout and bits (a sparse momentum buffer's indices and values as made,
    repeated indices too)."""
    a, b = sd_a["state"].get(0, {}), sd_b["state"].get(0, {})
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for key in b:
        assert a[key].layout == b[key].layout, key
        if b[key].is_sparse:
            assert torch.equal(a[key]._indices(), b[key]._indices()), key
            assert torch.equal(a[key]._values(), b[key]._values()), key
        else:
            assert torch.equal(a[key], b[key]), key


SPARSE_SGD = {"momentum_0": dict(lr=0.05),
              "momentum_0.9": dict(lr=0.05, momentum=0.9),
              "nesterov_maximize": dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True),
              "dampening_foreach": dict(lr=0.05, momentum=0.9, dampening=0.3, foreach=True)}


@pytest.mark.parametrize("kw", SPARSE_SGD.values(), ids=SPARSE_SGD)
def test_sparse_embedding_is_torch_sgd_bit_for_bit(kw):
    """nn.Embedding(sparse=True) trained with precis.optim.SGD: torch.optim.SGD's params
    and state after every step (the embedding's momentum_buffer sparse, as torch's), and
    the state dict saved after it: the embedding's state torch's own (its sparse
    'momentum_buffer', no step); loaded from torch.load(weights_only=True) into a new
    precis.optim.SGD, the run goes on with torch's bits."""
    a, b = embedding_model(31), embedding_model(31)
    opt_a, opt_b = optim.SGD(a.parameters(), **kw), torch.optim.SGD(b.parameters(), **kw)
    gen_a, gen_b = torch.Generator().manual_seed(32), torch.Generator().manual_seed(32)
    for step, _ in zip(train(a, opt_a, 4, gen_a), train(b, opt_b, 4, gen_b)):
        for i, (pa, pb) in enumerate(zip(a.parameters(), b.parameters())):
            assert torch.equal(pa, pb), f"step {step}: param {i} differs"
    sd_a = opt_a.state_dict()
    assert_embedding_state_same(sd_a, opt_b.state_dict())
    if kw.get("momentum"):
        assert sd_a["state"][0]["momentum_buffer"].is_sparse
    resumed = copy.deepcopy(a)
    opt_c = optim.SGD(resumed.parameters(), **kw)
    opt_c.load_state_dict(roundtrip(sd_a))
    gen_c = torch.Generator().manual_seed(33)
    gen_b = torch.Generator().manual_seed(33)
    for step, _ in zip(train(resumed, opt_c, 3, gen_c, 4), train(b, opt_b, 3, gen_b, 4)):
        for i, (pc, pb) in enumerate(zip(resumed.parameters(), b.parameters())):
            assert torch.equal(pc, pb), f"step {step} after the load: param {i} differs"
    assert_embedding_state_same(opt_c.state_dict(), opt_b.state_dict())


def test_sparse_embedding_with_l2_weight_decay_or_fused_is_refused_as_torch():
    """torch.optim.SGD cannot add the (dense) param to a sparse gradient (L2 weight decay)
    and its fused step takes no sparse gradient: precis raises torch's error, before the
    dense layer beside it is stepped."""
    for kw, message in ((dict(weight_decay=0.1), "add(sparse, dense) is not supported"),
                        (dict(weight_decay=0.1, momentum=0.9), "add(sparse, dense)"),
                        (dict(fused=True), "`_fused_sgd` does not support sparse gradients")):
        model, ref = embedding_model(34), embedding_model(34)
        opt = optim.SGD(model.parameters(), lr=0.05, **kw)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=re.escape(message)):
            next(train(model, opt, 1, torch.Generator().manual_seed(35)))
        with pytest.raises(RuntimeError, match=re.escape(message)):  # torch's own words
            next(train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, **kw), 1,
                       torch.Generator().manual_seed(35)))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), kw
        assert not opt.state, kw


def test_sparse_embedding_with_decoupled_weight_decay_is_sgdw():
    """decoupled_weight_decay=True (SGDW, which torch lacks) works with sparse gradients:
    p *= 1 - lr * weight_decay, then torch's SGD step without decay (the kernel's order),
    bit for bit."""
    kw = dict(lr=0.05, momentum=0.9)
    a, b = embedding_model(36), embedding_model(36)
    opt_a = optim.SGD(a.parameters(), weight_decay=0.2, decoupled_weight_decay=True, **kw)
    opt_b = torch.optim.SGD(b[0].parameters(), **kw)
    gen = torch.Generator().manual_seed(37)
    for _ in range(3):
        opt_a.zero_grad(), opt_b.zero_grad()
        rows = torch.randint(0, 37, (11,), generator=gen)
        weights = torch.randn(11, 5, generator=gen)
        (a[0](rows) * weights).sum().backward()
        (b[0](rows) * weights).sum().backward()
        opt_a.step()
        with torch.no_grad():
            b[0].weight.mul_(1 - 0.05 * 0.2)
        opt_b.step()
        assert torch.equal(a[0].weight, b[0].weight)


@pytest.mark.parametrize("dtype,policy", [(torch.bfloat16, None),
                                          (torch.float32, {"momentum_dtype": "bf16"})],
                         ids=["bf16_master", "fp32_bf16_momentum"])
def test_sparse_gradient_with_low_precision_state_is_refused(dtype, policy):
    """torch's math would step a bf16 param in bf16 past its master, and keep its
    momentum in the param's dtype, not the policy's: a sparse gradient of a param whose
    policy keeps a master or low-precision momentum is refused, naming why, before
    anything (the dense layer in the group before it too) is written."""
    model = embedding_model(38, dtype)
    opt = optim.SGD([{"params": model[1].parameters()}, {"params": model[0].parameters()}],
                    lr=0.05, momentum=0.9, policy=policy)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param 0 of group 1 \(shape \(37, 5\)\): its "
                                         r"gradient is sparse.*would bypass.*fp32 state"):
        next(train(model, opt, 1, torch.Generator().manual_seed(39)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not opt.state


def test_sparse_then_dense_gradients_keep_torchs_momentum():
    """A param stepped by the kernel (dense gradients, a Plan made), then given a sparse
    gradient (torch's math takes its momentum over), then dense ones again: torch's math
    goes on stepping the momentum it holds (the kernel would start a new one), torch's
    bits at every step."""
    a, b = make(((37, 5), (9,)), 40), make(((37, 5), (9,)), 40)
    kw = dict(lr=0.05, momentum=0.9, dampening=0.2)
    opt_a, opt_b = optim.SGD(a, **kw), torch.optim.SGD(b, **kw)
    gen = torch.Generator().manual_seed(41)
    for step in range(1, 10):
        if step == 4:
            assert 0 in opt_a._books.plans  # the sparse gradient meets a Plan
        gs = grads(a, gen)
        if step in (4, 5):
            part = gs[0][:20].to_sparse()  # rows 0..19 only
            gs[0] = torch.sparse_coo_tensor(part._indices(), part._values(), (37, 5),
                                            check_invariants=True)
        for pa, pb, g in zip(a, b, gs):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        for i, (pa, pb) in enumerate(zip(a, b)):
            assert torch.equal(pa, pb), f"step {step}: param {i} differs"
            ma = opt_a.state[pa].get("momentum_buffer", opt_a.state[pa].get("exp_avg"))
            assert torch.equal(ma, opt_b.state[pb]["momentum_buffer"]), (step, i)


def test_float64_sgdw_decays_decoupled():
    """A float64 param (stepped by torch's math) of SGD(decoupled_weight_decay=True) decays
    as SGDW, p *= 1 - lr * weight_decay before torch's step without decay, bit for bit
    (torch's SGD alone would add L2 decay to the gradient instead)."""
    a, b = make(((127,), (33, 5)), 42, torch.float64), make(((127,), (33, 5)), 42, torch.float64)
    kw = dict(lr=0.05, momentum=0.9, nesterov=True)
    opt_a = optim.SGD(a, weight_decay=0.3, decoupled_weight_decay=True, **kw)
    opt_b = torch.optim.SGD(b, **kw)
    gen = torch.Generator().manual_seed(43)
    for step in range(1, 5):
        for pa, pb, g in zip(a, b, grads(a, gen)):
            pa.grad, pb.grad = g.double(), g.double()
        opt_a.step()
        with torch.no_grad():
            for p in b:
                p.mul_(1 - 0.05 * 0.3)
        opt_b.step()
        assert all(torch.equal(pa, pb) for pa, pb in zip(a, b)), step


def test_sparse_refusals_after_steps_change_nothing():
    """torch's errors met after steps: a sparse gradient under L2 weight decay where the
    kernel made the momentum (its 'exp_avg' not renamed to torch's 'momentum_buffer'),
    and a dense gradient where sparse ones made the momentum sparse (torch cannot add
    it): raised as torch raises them, the params (the dense layer before them too) and
    the state left as they were."""
    for first, then in (("dense", "sparse"), ("sparse", "dense")):
        model = embedding_model(44)
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
        if first == "sparse":
            opt.param_groups[0]["weight_decay"] = 0
        model[0].sparse = first == "sparse"
        list(train(model, opt, 2, torch.Generator().manual_seed(45)))
        assert model[0].weight.grad.is_sparse == (first == "sparse")
        opt.param_groups[0]["weight_decay"] = 0.1 if then == "sparse" else 0
        model[0].sparse = then == "sparse"
        before = [p.detach().clone() for p in model.parameters()]
        saved = copy.deepcopy(opt.state_dict())
        with pytest.raises(RuntimeError, match=re.escape("add(sparse, dense) is not "
                                                         "supported")):
            next(train(model, opt, 1, torch.Generator().manual_seed(46)))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), first
        after = opt.state_dict()
        for i, st in saved["state"].items():
            assert st.keys() == after["state"][i].keys(), (first, i)
