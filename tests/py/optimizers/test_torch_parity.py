"""precis.optim.AdamW / Adam against torch 2.13's torch.optim.AdamW / Adam, bit for bit.

fp32 params and the default policy (fp32 everything, the param its own master):
after every one of >= 100 steps the params, exp_avg and exp_avg_sq of both
optimizers are torch.equal. torch runs in its default CPU mode (foreach and fused
off: the for-loop _single_tensor_adam), whose arithmetic the kernel repeats
(csrc/rules.h) with torch's own fp32 sqrt (MKL's, passed by the glue).

Each step's gradient is random noise plus a multiple of the param, so any
difference in a param would also show in the moments of the next steps.
Covered: odd hyperparameters (doubles that are not float32 values), every torch
lr scheduler that applies to Adam (OneCycleLR also cycles beta1), a tensor lr
(float32 and float64), maximize, Adam's L2 weight decay, capturable mode (step
and lr in tensors), sizes 1, 127, 4097 (one optimizer) and 1_000_003; and all of
it (50 steps) with amsgrad=True, max_exp_avg_sq compared too.
"""
import pytest
import torch
from torch.optim import lr_scheduler as sched

import precis  # noqa: F401  (loads the package, registers the ops)
from precis import ops, optim

SIZES = (1, 127, 4097)
BIG = 1_000_003
STEPS = 100
AMS_STEPS = 50  # amsgrad runs: the gradients shrink, so v falls below its running max
ODD = dict(lr=3.3e-4, betas=(0.8765432109, 0.99912345678), eps=1e-7, weight_decay=0.0123)


def make_params(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def run_both(ours, theirs, sizes, kw, steps=STEPS, schedule=None, seed=0, maximize_sign=1.0,
             ours_kw=None):
    """Step precis and torch side by side; fail at the first step whose params or
    moments differ in any bit. schedule(opt) -> scheduler (or None)."""
    init = make_params(sizes, seed)
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    opt_a = ours(a, **kw, **(ours_kw or {}))
    opt_b = theirs(b, **kw)
    sch_a = schedule(opt_a) if schedule else None
    sch_b = schedule(opt_b) if schedule else None
    gen = torch.Generator().manual_seed(seed + 1)
    amsgrad = kw.get("amsgrad", False)
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    for step in range(1, steps + 1):
        shrink = 1.0 / (1.0 + 0.1 * step) if amsgrad else 1.0
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, generator=gen) * shrink + 0.05 * maximize_sign * pa.detach()
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        if sch_a is not None:
            sch_a.step()
            sch_b.step()
        for i, (pa, pb) in enumerate(zip(a, b)):
            sa, sb = opt_a.state[pa], opt_b.state[pb]
            for what, x, y in [("param", pa, pb)] + [(k, sa[k], sb[k]) for k in keys]:
                if not torch.equal(x, y):
                    raise AssertionError(
                        f"step {step}, tensor {i} ({pa.numel()} elements): {what} differs in "
                        f"{int((x != y).sum())} elements, max |diff| "
                        f"{float((x - y).abs().max()):.3g}")
    for pa in a:
        assert int(opt_a.state[pa]["step"]) == steps
        if amsgrad and pa.numel() > 1:  # the max is not just v: the denominators differed
            assert bool((opt_a.state[pa]["max_exp_avg_sq"] > opt_a.state[pa]["exp_avg_sq"]).any())
        assert "master" not in opt_a.state[pa]  # fp32: the param is its own master
    return opt_a, opt_b


# amsgrad on and off: (extra keyword arguments of both optimizers, steps)
AMSGRAD = {"plain": ({}, STEPS), "amsgrad": ({"amsgrad": True}, AMS_STEPS)}
amsgrad_modes = pytest.mark.parametrize("ams", sorted(AMSGRAD))


@amsgrad_modes
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("sizes", [SIZES, (BIG,)], ids=["1-127-4097", "1000003"])
def test_odd_hyperparameters(adamw, sizes, ams):
    ours, theirs = (optim.AdamW, torch.optim.AdamW) if adamw else (optim.Adam, torch.optim.Adam)
    extra, steps = AMSGRAD[ams]
    run_both(ours, theirs, sizes, dict(ODD, **extra), steps)  # Adam: weight_decay is the L2 term


@pytest.mark.parametrize("sizes,ams", [(SIZES, "plain"), ((BIG,), "plain"), (SIZES, "amsgrad")],
                         ids=["1-127-4097", "1000003", "1-127-4097-amsgrad"])
def test_maximize_and_small_beta1(sizes, ams):
    # beta1 < 0.5: torch's lerp_ starts from the gradient end (weight >= 0.5)
    extra, steps = AMSGRAD[ams]
    kw = dict(lr=1.234567e-2, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.05, maximize=True,
              **extra)
    run_both(optim.AdamW, torch.optim.AdamW, sizes, kw, steps, maximize_sign=-1.0)
    run_both(optim.Adam, torch.optim.Adam, sizes, kw, steps, maximize_sign=-1.0)


def test_adam_l2_weight_decay_large_size():
    kw = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    run_both(optim.Adam, torch.optim.Adam, (BIG,), kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", [SIZES, (BIG,)], ids=["1-127-4097", "1000003"])
def test_tensor_lr(dtype, sizes):
    """A 0-dim tensor lr: torch computes 1 - lr * wd and lr / bias_correction1 as
    tensor ops in the lr's dtype; precis follows."""
    kw = dict(ODD, lr=torch.tensor(ODD["lr"], dtype=dtype))
    init = make_params(sizes, 0)
    pa = [torch.nn.Parameter(t.clone()) for t in init]
    pb = [torch.nn.Parameter(t.clone()) for t in init]
    # each optimizer gets its own lr tensor (schedulers write them in place)
    opt_a = optim.AdamW(pa, **dict(kw, lr=kw["lr"].clone()))
    opt_b = torch.optim.AdamW(pb, **dict(kw, lr=kw["lr"].clone()))
    sch_a = sched.ExponentialLR(opt_a, gamma=0.97)
    sch_b = sched.ExponentialLR(opt_b, gamma=0.97)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        for a, b in zip(pa, pb):
            g = torch.randn(a.shape, generator=gen) + 0.05 * a.detach()
            a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        sch_a.step()
        sch_b.step()
        for a, b in zip(pa, pb):
            assert torch.equal(a, b), f"step {step}: params differ"
            assert torch.equal(opt_a.state[a]["exp_avg"], opt_b.state[b]["exp_avg"])
            assert torch.equal(opt_a.state[a]["exp_avg_sq"], opt_b.state[b]["exp_avg_sq"])
    assert isinstance(opt_a.param_groups[0]["lr"], torch.Tensor)


def test_float32_tensor_lr_is_not_the_float_lr():
    """The check above can fail: with this lr, torch's float32-tensor-lr trajectory
    differs from its Python-float one (so precis must take the lr's dtype)."""
    init = make_params((4097,), 0)
    runs = []
    for lr in (ODD["lr"], torch.tensor(ODD["lr"], dtype=torch.float32)):
        p = torch.nn.Parameter(init[0].clone())
        opt = torch.optim.AdamW([p], **dict(ODD, lr=lr))
        gen = torch.Generator().manual_seed(5)
        for _ in range(20):
            p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append(p.detach().clone())
    assert not torch.equal(*runs)


@amsgrad_modes
def test_capturable_on_cpu(ams):
    """capturable=True: step counts and lr in tensors, constants made from them;
    the same bits as torch's default mode."""
    extra, steps = AMSGRAD[ams]
    run_both(optim.AdamW, torch.optim.AdamW, SIZES, dict(ODD, **extra), steps,
             schedule=lambda o: sched.StepLR(o, step_size=7, gamma=0.7),
             ours_kw=dict(capturable=True))


def _sequential(o):
    return sched.SequentialLR(o, [sched.LinearLR(o, start_factor=0.1, total_iters=10),
                                  sched.CosineAnnealingLR(o, T_max=90, eta_min=1e-6)],
                              milestones=[10])


SCHEDULERS = {
    "StepLR": lambda o: sched.StepLR(o, step_size=13, gamma=0.6789),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[17, 40, 71], gamma=0.345),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.987654321),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=37, eta_min=1.1e-5),
    "CosineAnnealingWarmRestarts":
        lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=11, T_mult=2, eta_min=3e-6),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.0731 * s)),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=4.321e-3, total_steps=STEPS,
                                             cycle_momentum=True),
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=1.3e-4, max_lr=2.7e-3, step_size_up=9,
                                         mode="triangular2", cycle_momentum=False),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.123, total_iters=47),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=80, power=1.7),
    "SequentialLR": _sequential,
}


@amsgrad_modes
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers(name, ams):
    extra, steps = AMSGRAD[ams]
    kw = dict(ODD, **extra)
    opt_a, _ = run_both(optim.AdamW, torch.optim.AdamW, SIZES, kw, steps,
                        schedule=SCHEDULERS[name], seed=3)
    if name == "OneCycleLR":  # it drives beta1 too
        assert opt_a.param_groups[0]["betas"][0] != ODD["betas"][0]
    run_both(optim.Adam, torch.optim.Adam, SIZES, kw, steps, schedule=SCHEDULERS[name], seed=4)


def ieee_first_step(p0, g, lr, b1, b2, eps, wd):
    """torch's first AdamW step from zero moments with a correctly rounded sqrt."""
    m = torch.zeros_like(g).lerp_(g, 1 - b1)
    v = torch.zeros_like(g).mul_(b2).addcmul_(g, g, value=1 - b2)
    sqrt_v = v.double().sqrt().float()  # exact: double has > 2 * 24 + 2 bits
    denom = (sqrt_v / (1 - b2) ** 0.5).add_(eps)
    return p0.clone().mul_(1 - lr * wd).addcdiv_(m, denom, value=-(lr / (1 - b1)))


def test_ieee_sqrt_on_request(monkeypatch):
    """PRECIS_CPU_SQRT=ieee: the CPU op takes IEEE sqrt (the CUDA kernels' bits)
    instead of torch's MKL one; everything else stays torch's arithmetic."""
    n, lr, (b1, b2), eps, wd = BIG, ODD["lr"], ODD["betas"], ODD["eps"], ODD["weight_decay"]
    p0, g = make_params((n, n), 7)
    results = {}
    for mode in ("torch", "ieee"):
        monkeypatch.setenv("PRECIS_CPU_SQRT", mode)
        p = torch.nn.Parameter(p0.clone())
        p.grad = g.clone()
        optim.AdamW([p], **ODD).step()
        results[mode] = p.detach().clone()
    want = ieee_first_step(p0, g, lr, b1, b2, eps, wd)
    assert torch.equal(results["ieee"], want)
    assert not torch.equal(results["torch"], want)  # MKL's sqrt is not always IEEE's


@pytest.mark.parametrize("ams", [False, True], ids=["adam", "amsgrad"])
def test_ieee_sqrt_argument_per_call(monkeypatch, ams):
    """adam_step_(..., ieee_sqrt=True): that call takes IEEE sqrt, the bits
    PRECIS_CPU_SQRT=ieee gives every call (what an offloaded CUDA param needs);
    ieee_sqrt=False keeps torch's MKL sqrt."""
    lr, (b1, b2), eps, wd = ODD["lr"], ODD["betas"], ODD["eps"], ODD["weight_decay"]
    sizes = (1, 127, 4097, BIG)
    p0s, gs = make_params(sizes, 8), make_params(sizes, 9)
    v = torch.cat(gs).square().mul_(1 - b2)
    # The data holds values where MKL's sqrt (torch's CPU sqrt) is not IEEE's.
    assert not torch.equal(v.sqrt(), v.double().sqrt().float())

    def step(ieee_sqrt):
        ps = [p.clone() for p in p0s]
        zeros = [[torch.zeros_like(p) for p in p0s] for _ in range(3)]
        ops.adam_step_(ps, gs, [], zeros[0], zeros[1], [], [], [1] * len(ps), lr, b1, b2, eps,
                       wd, amsgrad=ams, max_exp_avg_sqs=zeros[2] if ams else (),
                       ieee_sqrt=ieee_sqrt)
        return torch.cat(ps)

    want = torch.cat([ieee_first_step(p0, g, lr, b1, b2, eps, wd) for p0, g in zip(p0s, gs)])
    monkeypatch.delenv("PRECIS_CPU_SQRT", raising=False)
    assert torch.equal(step(True), want)
    assert not torch.equal(step(False), want)
    monkeypatch.setenv("PRECIS_CPU_SQRT", "ieee")
    assert torch.equal(step(False), want)  # the same bits as the environment's switch


def bits(t):
    """A float32 tensor's bits (NaN's and -0.0's kept: torch.equal sets them apart)."""
    return t.detach().contiguous().view(torch.int32)


LOST = [("Adam", dict(lr=1e-3)), ("AdamW", dict(lr=1e-3, weight_decay=0.01)),
        ("Adam", dict(lr=1e-3, weight_decay=0.01)),  # (an L2 term: torch's m, v go NaN)
        ("SGD", dict(lr=0.05, momentum=0.9)),
        ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True))]


@pytest.mark.parametrize("name,kw", LOST, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_a_lost_param_and_a_negative_zero_gradient_leave_the_state_as_torchs(name, kw):
    """A NaN or Inf element of a param (a step lost it) and a gradient of -0.0: torch adds
    no L2 term without weight decay, so its moments (SGD's buffer) stay finite and SGD's
    buffer keeps -0.0's sign; precis's are torch's to the bit (they were NaN: g + 0 *
    NaN). With an L2 term (Adam's weight decay) torch's go NaN, and precis's as torch's."""
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(127, generator=gen)
    init[[0, 5, 126]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt_a, opt_b = getattr(optim, name)([a], **kw), getattr(torch.optim, name)([b], **kw)
    for step in range(1, 6):
        g = torch.randn(127, generator=gen)
        g[10 + step:40:3] = -0.0
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in opt_b.state[b]:  # (precis keeps SGD's buffer as its exp_avg)
                x, y = opt_a.state[a]["exp_avg" if name == "SGD" else key], opt_b.state[b][key]
                l2 = name == "Adam" and kw.get("weight_decay", 0) != 0
                assert bool(y.isfinite().all()) != l2, (step, key)  # (torch's: as said)
                assert torch.equal(bits(x), bits(y)), (step, key, int((bits(x) != bits(y)).sum()))
        assert torch.equal(bits(a), bits(b)), step
