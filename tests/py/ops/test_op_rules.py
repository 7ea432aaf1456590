"""The update rules through the ops (issue #44: precis.h's precis_rule_t), on the CPU.

* sgd with fp32 params, grads and state: torch.optim.SGD's bits (its single-tensor
  path) over 3 steps at sizes 1, 127, 4097: momentum 0 and 0.9, dampening 0.5,
  Nesterov, weight decay, maximize; SGDW's decoupled decay as torch's mul_ / add_;
* lion against a float64 reference of each step from the same fp32 state;
* muon_momentum: torch.optim.Muon's buf.lerp_(grad, 1 - momentum) and
  grad.lerp(buf, momentum) bit for bit in fp32, a bf16 output the .bfloat16() of that
  fp32 update; params and masters untouched;
* bf16 params with fp32 masters and fp8 momentum stay near the fp32 trajectory;
* per-param lr_scales; outputs' dtype in the grouping (one C call per combination);
  the flat op's .rule overload gives the list op's bits;
* every refused call (a rule's missing or ignored lists, amsgrad with another rule,
  an unknown rule, an output aliasing a grad, ...) raises before anything is written.
"""
import functools

import pytest
import torch

import precis  # noqa: F401  (registers the ops)
from precis import _lib, op_constants, ops

SIZES = (1, 127, 4097)
F32, BF16, FP8 = torch.float32, torch.bfloat16, torch.uint8
ADAM_HYPER = (0.9, 0.999, 1e-8)  # beta1, beta2, eps: read by adam only (and lion's betas)


def _problem(seed=0, steps=3, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in SIZES]
    grads = [[torch.randn(n, generator=g) * scale for n in SIZES] for _ in range(steps)]
    return params, grads


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _ulps(a, b):
    """The largest difference of two fp32 tensors in units in the last place."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude to a line
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _assert_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not torch.equal(_bits(got), _bits(want)):
        ulps = _ulps(got.float(), want.float()) if got.dtype == F32 else "n/a"
        raise AssertionError(f"{what}: bits differ (max {ulps} ulp)")


# ---- sgd: torch.optim.SGD's bits ----------------------------------------------------

SGD_CASES = {
    "plain": dict(momentum=0.0),
    "momentum": dict(momentum=0.9),
    "dampening": dict(momentum=0.9, dampening=0.5),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "weight_decay": dict(momentum=0.9, weight_decay=0.1),
    "plain_weight_decay_maximize": dict(momentum=0.0, weight_decay=0.1, maximize=True),
    "all": dict(momentum=0.9, nesterov=True, weight_decay=0.05, maximize=True),
}


def _sgd_ops(params, grads, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0,
             maximize=False, adamw=False, lr_scales=()):
    params = [p.clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params] if momentum else []
    for step, gs in enumerate(grads, start=1):
        ops.adam_step_(params, gs, [], bufs, [], [], [], [step] * len(params), lr, *ADAM_HYPER,
                       weight_decay, adamw=adamw, maximize=maximize, rule="sgd",
                       momentum=momentum, dampening=dampening, nesterov=nesterov,
                       lr_scales=lr_scales)
    return params, bufs


def _sgd_torch(params, grads, lrs, momentum=0.0, dampening=0.0, nesterov=False,
               weight_decay=0.0, maximize=False):
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.SGD([dict(params=[p], lr=lr) for p, lr in zip(mine, lrs)],
                          momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=weight_decay, maximize=maximize, foreach=False)
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in mine], [opt.state[p].get("momentum_buffer") for p in mine]


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_gives_torch_sgd_bits(case):
    kw = SGD_CASES[case]
    params, grads = _problem(1)
    got_p, got_m = _sgd_ops(params, grads, 1e-2, **kw)
    want_p, want_m = _sgd_torch(params, grads, [1e-2] * len(params), **kw)
    for i in range(len(params)):
        _assert_bits(got_p[i], want_p[i], f"{case}: params[{i}]")
        if kw["momentum"]:
            _assert_bits(got_m[i], want_m[i], f"{case}: momentum buffer {i}")
        else:
            assert want_m[i] is None and got_m == []


def test_sgd_per_param_lr_scales_give_torch_param_groups_bits():
    """lr_scales: each param's step lr is lr * lr_scales[i], as torch.optim.SGD's param
    groups of those lrs (and as one call per param with that lr)."""
    params, grads = _problem(2)
    lr, lr_scales = 0.5, [0.2, 0.02, 0.006]
    lrs = [lr * s for s in lr_scales]
    kw = dict(momentum=0.9, weight_decay=0.1, nesterov=True)  # L2 decay: no lr in it
    got_p, got_m = _sgd_ops(params, grads, lr, lr_scales=lr_scales, **kw)
    want_p, want_m = _sgd_torch(params, grads, lrs, **kw)
    for i in range(len(params)):
        _assert_bits(got_p[i], want_p[i], f"params[{i}]")
        _assert_bits(got_m[i], want_m[i], f"momentum buffer {i}")
        alone_p, alone_m = _sgd_ops([params[i]], [[gs[i]] for gs in grads], lrs[i], **kw)
        _assert_bits(got_p[i], alone_p[0], f"params[{i}] alone")


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_sgdw_decays_with_lr_and_steps_with_lr_times_its_scale(adjust_lr_fn, lr_tensor):
    """adamw=True (decoupled decay, Muon's apply): torch.optim.Muon's
    p.mul_(1 - lr*wd).add_(d, alpha=-_adjust_lr(lr, fn, shape)), torch's float ops, bit
    for bit, with lr_scales the ratios _adjust_lr(1.0, fn, shape) (lr * ratio in the
    kernel, as in _adjust_lr): the decay takes lr, the step lr * lr_scales[i]; the same
    with the lr as a float64 tensor (lr_tensor: a compiled step's)."""
    from torch.optim._muon import _adjust_lr
    params, grads = _problem(3)
    lr, wd = 0.02, 0.1
    shapes = [(127, 33), (33, 127), (7, 13)]
    lr_scales = [_adjust_lr(1.0, adjust_lr_fn, shape) for shape in shapes]
    extra = dict(lr_tensor=torch.tensor(lr, dtype=torch.float64)) if lr_tensor else {}
    got = [p.clone() for p in params]
    for step, gs in enumerate(grads, start=1):
        ops.adam_step_(got, gs, [], [], [], [], [], [step] * len(got), 0.0 if lr_tensor else lr,
                       *ADAM_HYPER, wd, adamw=True, rule="sgd", lr_scales=lr_scales, **extra)
    for i, p in enumerate(params):
        want = p.clone()
        for gs in grads:
            want.mul_(1 - lr * wd).add_(gs[i], alpha=-_adjust_lr(lr, adjust_lr_fn, shapes[i]))
        _assert_bits(got[i], want, f"params[{i}]")


# ---- lion: a float64 reference --------------------------------------------------------

LION_TOL = 5e-7  # relative to |p| + lr (p), |m| + |g| (m): 4 fp32 ulps (measured 1)


def _lion_reference(p, m, g, lr, beta1, beta2, wd, lr_i):
    p, m, g = p.double(), m.double(), g.double()
    u = beta1 * m + (1 - beta1) * g
    return p * (1 - lr * wd) - lr_i * torch.sign(u), beta2 * m + (1 - beta2) * g, u


@pytest.mark.parametrize("wd,maximize,per_param", [(0.0, False, False), (0.1, False, False),
                                                    (0.1, True, True)])
def test_lion_follows_a_float64_reference(wd, maximize, per_param):
    """Each step from the kernel's own fp32 state, against float64: p within
    LION_TOL of it except where u = beta1*m + (1 - beta1)*g is within fp32 rounding of 0
    (its sign is then either), m within LION_TOL."""
    params, grads = _problem(4)
    lr, beta1, beta2 = 1e-3, 0.9, 0.99
    lr_scales = [1.0, 0.3, 2.0] if per_param else []
    p = [t.clone() for t in params]
    m = [torch.zeros_like(t) for t in params]
    for step, gs in enumerate(grads, start=1):
        before = [(q.clone(), n.clone()) for q, n in zip(p, m)]
        ops.adam_step_(p, gs, [], m, [], [], [], [step] * 3, lr, beta1, beta2, 1e-8, wd,
                       maximize=maximize, rule="lion", lr_scales=lr_scales)
        for i, ((p0, m0), g) in enumerate(zip(before, gs)):
            g = -g if maximize else g
            want_p, want_m, u = _lion_reference(p0, m0, g, lr, beta1, beta2, wd,
                                                lr * lr_scales[i] if lr_scales else lr)
            tiny = u.abs() <= 1e-6 * (beta1 * m0.double().abs() + (1 - beta1) * g.double().abs())
            err_p = (p[i].double() - want_p).abs()
            ok = (err_p <= LION_TOL * (want_p.abs() + lr)) | tiny
            assert bool(ok.all()), (step, i, float(err_p.max()))
            err_m = (m[i].double() - want_m).abs()
            assert bool((err_m <= LION_TOL * (m0.double().abs() + g.double().abs())).all()), \
                (step, i, float(err_m.max()))


# ---- muon_momentum: torch.optim.Muon's momentum ---------------------------------------

@pytest.mark.parametrize("momentum", [0.95, 0.3])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum_gives_torch_muon_bits(momentum, nesterov):
    """m: buf.lerp_(grad, 1 - momentum); fp32 outputs: the update (grad.lerp(buf,
    momentum) with Nesterov, else buf) bit for bit; bf16 outputs its .bfloat16() (a
    twin with bf16 params and fp32 masters, fp32 grads and m: its params neither
    read nor written, nor its masters)."""
    params, grads = _problem(5)
    masters = [torch.randn(n) for n in SIZES]
    bf16_params = [p.bfloat16() for p in params]
    before = [_bits(t) for t in params + masters + bf16_params]
    m32 = [torch.zeros_like(p) for p in params]
    m16 = [torch.zeros_like(p) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for step, gs in enumerate(grads, start=1):
        out32 = [torch.full_like(p, float("nan")) for p in params]
        out16 = [torch.full_like(p, float("nan"), dtype=BF16) for p in params]
        ops.adam_step_(params, gs, [], m32, [], [], [], [step] * 3, 1e-2, *ADAM_HYPER, 0.0,
                       rule="muon_momentum", momentum=momentum, nesterov=nesterov,
                       outputs=out32)
        ops.adam_step_(bf16_params, gs, masters, m16, [], [], [],
                       [step] * 3, 1e-2, *ADAM_HYPER, 0.0, rule="muon_momentum",
                       momentum=momentum, nesterov=nesterov, outputs=out16)
        for i, (buf, g) in enumerate(zip(bufs, gs)):
            buf.lerp_(g, 1 - momentum)
            update = g.lerp(buf, momentum) if nesterov else buf
            _assert_bits(m32[i], buf, f"step {step}: m[{i}]")
            _assert_bits(out32[i], update, f"step {step}: outputs[{i}] (fp32)")
            _assert_bits(m16[i], buf, f"step {step}: m[{i}] (bf16 params)")
            _assert_bits(out16[i], update.bfloat16(), f"step {step}: outputs[{i}] (bf16)")
    after = [_bits(t) for t in params + masters + bf16_params]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_output_dtype_is_part_of_the_combination():
    """Outputs of three dtypes in one call: the bits of one call per param."""
    params, grads = _problem(6, steps=1)
    dtypes = (F32, BF16, torch.float16)
    m = [torch.randn(n) for n in SIZES]
    m_alone = [t.clone() for t in m]
    outs = [torch.empty(n, dtype=d) for n, d in zip(SIZES, dtypes)]
    ops.adam_step_(params, grads[0], [], m, [], [], [], [2] * 3, 1e-2, *ADAM_HYPER, 0.0,
                   rule="muon_momentum", momentum=0.9, nesterov=True, outputs=outs)
    for i in range(3):
        out = torch.empty(SIZES[i], dtype=dtypes[i])
        ops.adam_step_([params[i]], [grads[0][i]], [], [m_alone[i]], [], [], [], [2], 1e-2,
                       *ADAM_HYPER, 0.0, rule="muon_momentum", momentum=0.9, nesterov=True,
                       outputs=[out])
        _assert_bits(outs[i], out, f"outputs[{i}]")
        _assert_bits(m[i], m_alone[i], f"m[{i}]")


# ---- bf16 params, fp32 masters, fp8 momentum ------------------------------------------

# Against the fp32 trajectory from the same start and the same (bf16) gradients, after
# 3 steps. fp8 e4m3 keeps 3 mantissa bits: a stored m lies within one spacing (2^-3 of
# it) of its value, stochastically rounded (unbiased), plus its block's floor. So
#   sgd:  |master - p32| <= 0.025 * lr * steps * max|g| (the worst case, 2^-3 of lr
#         times each step's |m|, is ~14x that; measured here 0.007 * lr * steps *
#         max|g|), and the bf16 param is its master rounded to nearest;
#   lion: |master - p32| <= 2 * lr * steps where sign(u) flips (u near 0), else within
#         fp32 roundings (1e-5); at most 1% of the elements (measured 0.02%);
#   muon_momentum (bf16 outputs): |out - out32| <= 2^-3 * |out32| + 2^-6 * max|out32|,
#         and the median relative error <= 2^-5 (measured 0.3% to 0.6%).
MIXED_LR = 1e-2


def _mixed_state(params):
    p16 = [p.bfloat16() for p in params]
    masters = [p.float() for p in p16]
    m8 = [torch.zeros(p.numel(), dtype=FP8) for p in params]
    scales = [torch.zeros(ops.scale_count(p.numel())) for p in params]
    p32 = [p.float() for p in p16]
    m32 = [torch.zeros_like(p) for p in p32]
    return p16, masters, m8, scales, p32, m32


@pytest.mark.parametrize("rule", ["sgd", "lion", "muon_momentum"])
def test_bf16_params_fp32_masters_fp8_momentum_track_fp32(rule):
    params, grads = _problem(7)
    grads = [[g.bfloat16() for g in gs] for gs in grads]
    p16, masters, m8, scales, p32, m32 = _mixed_state(params)
    kw = dict(sgd=dict(momentum=0.9, weight_decay=0.01), lion=dict(weight_decay=0.1),
              muon_momentum=dict(momentum=0.95, nesterov=True))[rule]
    beta1, beta2 = (0.9, 0.99) if rule == "lion" else (0.9, 0.999)
    wd = kw.pop("weight_decay", 0.0)
    for step, gs in enumerate(grads, start=1):
        o16 = [torch.empty_like(p) for p in p16] if rule == "muon_momentum" else []
        o32 = [torch.empty_like(p) for p in p32] if rule == "muon_momentum" else []
        ops.adam_step_(p16, gs, masters, m8, [], scales, [], [step] * 3, MIXED_LR, beta1,
                       beta2, 1e-8, wd, seed=11, rule=rule, outputs=o16, **kw)
        ops.adam_step_(p32, [g.float() for g in gs], [], m32, [], [], [], [step] * 3,
                       MIXED_LR, beta1, beta2, 1e-8, wd, rule=rule, outputs=o32, **kw)
    gmax = max(float(g.float().abs().max()) for gs in grads for g in gs)
    for i in range(3):
        assert torch.isfinite(masters[i]).all() and torch.isfinite(m8[i].float()).all()
        if rule == "sgd":
            err = (masters[i] - p32[i]).abs().max()
            assert float(err) <= 0.025 * MIXED_LR * 3 * gmax, (i, float(err))
            assert torch.equal(p16[i], masters[i].bfloat16())  # rounded to nearest
        elif rule == "lion":
            err = (masters[i] - p32[i]).abs()
            assert float(err.max()) <= 2 * MIXED_LR * 3 + 1e-6, (i, float(err.max()))
            flipped = (err > 1e-5).float().mean()
            assert float(flipped) <= 0.01, (i, float(flipped))
        else:
            want = o32[i]
            err = (o16[i].float() - want).abs()
            bound = 2 ** -3 * want.abs() + 2 ** -6 * float(want.abs().max())
            assert bool((err <= bound).all()), (i, float((err - bound).max()))
            nonzero = want != 0
            assert float((err[nonzero] / want[nonzero].abs()).median()) <= 2 ** -5, i
            assert torch.equal(masters[i], p16[i].float())  # untouched


# ---- the flat op's .rule overload -----------------------------------------------------

def _flat(params, moments):
    table = torch.zeros(len(params), ops.ROW_WIDTH, dtype=torch.int64)
    sizes = torch.tensor([p.numel() for p in params])
    table[:, ops.ROW_NUMEL] = sizes
    table[1:, ops.ROW_OFFSET] = sizes.cumsum(0)[:-1]
    table[:, ops.ROW_STREAM] = torch.arange(len(params))
    table[:, ops.ROW_SHAPE_KEY] = torch.tensor([ops.shape_key(p.shape) for p in params])
    table[:, ops.ROW_DATA] = torch.tensor([ops.data_address(p) for p in params])
    return table, {"exp_avg": torch.zeros(int(sizes.sum()))} if moments else {}


@pytest.mark.parametrize("rule,kw", [("sgd", dict(momentum=0.9, dampening=0.1)),
                                     ("sgd", dict()), ("lion", dict())])
def test_flat_rule_gives_the_list_bits(rule, kw):
    params, grads = _problem(8)
    flat_p = [p.clone() for p in params]
    table, buffers = _flat(flat_p, kw.get("momentum", 0.0) or rule == "lion")
    list_p = [p.clone() for p in params]
    list_m = [torch.zeros_like(p) for p in params] if buffers else []
    for step, gs in enumerate(grads, start=1):
        table[:, ops.ROW_STEP] = step
        ops.adam_step_flat_(flat_p, gs, buffers, table, 1e-2, 0.9, 0.99, 1e-8, 0.1,
                            rule=rule, **kw)
        ops.adam_step_(list_p, gs, [], list_m, [], [], [], [step] * 3, 1e-2, 0.9, 0.99, 1e-8,
                       0.1, streams=range(3), rule=rule, **kw)
    for i in range(3):
        _assert_bits(flat_p[i], list_p[i], f"params[{i}]")
    if buffers:
        _assert_bits(buffers["exp_avg"], torch.cat(list_m), "exp_avg")


# ---- refused calls: before anything is written ----------------------------------------

def _refused(call, tensors, match, error=RuntimeError):
    """call raises error matching `match` and leaves every tensor as it was."""
    before = [_bits(t) for t in tensors]
    with pytest.raises(error, match=match):
        call()
    assert all(torch.equal(b, _bits(t)) for b, t in zip(before, tensors))


def _two_combos():
    """A fp32 param and a bf16 one with an fp32 master: two C calls."""
    g = torch.Generator().manual_seed(9)
    p = [torch.randn(64, generator=g), torch.randn(300, generator=g).bfloat16()]
    grads = [torch.randn(64, generator=g), torch.randn(300, generator=g).bfloat16()]
    masters = [torch.empty(0), p[1].float()]
    m = [torch.randn(64, generator=g), torch.randn(300, generator=g)]
    return p, grads, masters, m


def _step(p, grads, masters, m, v=(), **kw):
    return lambda: ops.adam_step_(p, grads, masters, m, list(v), [], [], [2] * len(p), 1e-2,
                                  *ADAM_HYPER, 0.0, **kw)


def test_refused_rule_arguments_write_nothing():
    p, grads, masters, m = _two_combos()
    outs = [torch.zeros(64), torch.zeros(300, dtype=BF16)]
    v = [torch.zeros(64), torch.zeros(300)]
    every = p + grads + masters + m + outs + v
    cases = [
        (dict(rule="muon_momentum", momentum=0.9),
         r"rule muon_momentum writes each param's direction to outputs.*outputs has 0 entries"),
        (dict(rule="muon_momentum", momentum=0.9, outputs=outs[:1]), "outputs has 1 entries"),
        (dict(rule="sgd", momentum=0.9, outputs=outs),
         r"outputs has 2 entries with rule sgd.*pass \[\]"),
        (dict(rule="lion", amsgrad=True, max_exp_avg_sqs=v),
         "amsgrad is True with rule lion; only adam"),
        (dict(rule="adam", lr_scales=[0.1, 0.1]), "lr_scales has 2 entries with rule adam"),
        (dict(rule="sgd", momentum=0.9, lr_scales=[0.1]),
         "lr_scales has 1 entries but params has 2"),
        (dict(rule="lion", lr_scales=[0.1, -1.0]),
         r"lr_scales\[1\] is -1; must be finite and >= 0"),
        (dict(rule="lion", lr_scales=[float("inf"), 0.1]), r"lr_scales\[0\] is inf"),
        (dict(rule="muon_momentum", momentum=0.9,
              outputs=[outs[0], torch.zeros(300, dtype=torch.float64)]),
         r"outputs\[1\] has dtype float64; supported: float32, float16, bfloat16"),
        (dict(rule="muon_momentum", momentum=0.9, outputs=[outs[0], torch.zeros(299)]),
         r"outputs\[1\] has 299 elements, params\[1\] has 300"),
        (dict(rule="muon_momentum", momentum=0.9, outputs=[outs[0], outs[1][::2]]),
         r"outputs\[1\] must be contiguous"),
        (dict(rule="muon_momentum", momentum=1.5, outputs=outs), "momentum"),  # the C check
        (dict(rule="adam", nesterov=True), "nesterov"),  # the C check
    ]
    for kw, match in cases:
        _refused(_step(p, grads, masters, m, v if kw.get("rule") == "adam" else (), **kw),
                 every, match)
    # what a rule does not read must be absent: [] or empty tensors
    _refused(_step(p, grads, masters, m, v, rule="sgd", momentum=0.9), every,
             r"exp_avg_sqs\[0\] has 64 elements with rule sgd, which does not read it")
    _refused(_step(p, grads, masters, m, rule="sgd"), every,
             r"exp_avgs\[0\] has 64 elements with rule sgd.*no momentum buffer with momentum 0")
    _refused(_step(p, grads, masters, [], rule="lion"), every,
             "exp_avgs has 0 entries but params has 2")
    # accepted: empty tensors for v with lion
    ops.adam_step_(p, grads, masters, m, [torch.empty(0)] * 2, [], [], [2, 2], 1e-2,
                   *ADAM_HYPER, 0.0, rule="lion")


def test_unknown_rule_names_and_numbers_are_refused():
    p, grads, masters, m = _two_combos()
    every = p + grads + masters + m
    for name in ("Adam", "muon", "", 1, None):
        _refused(_step(p, grads, masters, m, rule=name), every, "rule is", error=ValueError)
    table, _ = _flat(p[:1], False)
    _refused(lambda: ops.adam_step_flat_(p[:1], grads[:1], {}, table, 1e-2, *ADAM_HYPER, 0.0,
                                         rule="sgdw"), every, "rule is 'sgdw'", error=ValueError)
    for number in (-1, 4, 1 << 40):  # the op itself, past ops.py
        _refused(lambda: torch.ops.precis.adam_step_.rule(
            p, grads, masters, m, [], [], [], [2, 2], 1e-2, *ADAM_HYPER, 0.0, True, False, 1.0,
            False, 0, [], [], [], [], False, [], [], False, [], [], number, 0.0, 0.0, False, [],
            [], []), every, rf"precis.adam_step_: rule is {number}; accepted: 0 \(adam\)")


def test_a_call_on_two_devices_names_the_tensor_that_chose_the_kernel():
    """The dispatcher picks a kernel by every tensor of a call: the CPU kernel reached
    with params[0] elsewhere (meta here; on a GPU machine a CUDA kernel with params on
    the host) names the first tensor on the kernel's device, which made the choice."""
    cpu_kernel = functools.partial(torch.ops.precis.adam_step_.rule.redispatch,
                                   torch._C.DispatchKeySet(torch._C.DispatchKey.CPU))

    def call(p, g, m, lr_tensor=()):
        return lambda: cpu_kernel(
            [p], [g], [], [m], [], [], [], [2], 1e-2, *ADAM_HYPER, 0.0, True, False, 1.0,
            False, 0, [], list(lr_tensor), [], [], False, [], [], False, [], [], 1, 0.9, 0.0,
            False, [], [], [])
    meta, cpu = torch.zeros(5, device="meta"), torch.zeros(5)
    lr = torch.tensor(1e-2, dtype=torch.float64)
    for args, match in (((meta, cpu, cpu), r"params\[0\] is on .* but grads\[0\] is on cpu"),
                        ((meta, meta, cpu), r"but exp_avgs\[0\] is on cpu: every tensor of a "
                                            r"call must be on one device"),
                        ((meta, meta, meta, [lr]), "but lr_tensor is on cpu"),
                        ((meta, meta, meta), "precis kernels run on cpu and cuda tensors")):
        _refused(call(*args), [cpu, lr], match)
    table, buffers = _flat([cpu], True)  # the flat op: its state's buffers are named
    table[:, ops.ROW_STEP] = 2
    table[:, ops.ROW_DATA] = ops.data_address(meta)
    flat = [buffers.get(name, torch.empty(0)) for name in ops.FLAT_BUFFERS]
    with pytest.raises(RuntimeError, match=r"params\[0\] is on .* but exp_avg is on cpu"):
        torch.ops.precis.adam_step_flat_.rule.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), [meta], [meta], *flat, table,
            1e-2, *ADAM_HYPER, 0.0, True, False, 1.0, False, 0, [], [], [], False, False, 1,
            0.9, 0.0, False, [])


def test_an_output_aliasing_a_grad_or_state_is_refused():
    """Outputs are written: they may share memory with nothing (a grad, m, a param,
    another output), in either combination."""
    p, grads, masters, m = _two_combos()
    shared = torch.zeros(300)
    every = p + grads + masters + m + [shared]
    for outs, match in (
            ([torch.zeros(64), grads[1]], r"grads\[1\] and outputs\[1\] share memory"),
            ([grads[0], torch.zeros(300, dtype=BF16)], r"grads\[0\] and outputs\[0\]"),
            ([m[0], torch.zeros(300)], r"exp_avgs\[0\] and outputs\[0\]"),
            ([torch.zeros(64), p[1]], r"params\[1\] and outputs\[1\]"),
            ([shared[:64], shared], r"outputs\[1\] and outputs\[0\]|outputs\[0\] and outputs")):
        _refused(_step(p, grads, masters, m, rule="muon_momentum", momentum=0.9, outputs=outs),
                 every + outs, match)


def test_the_flat_op_refuses_muon_momentum():
    params, grads = _problem(10, steps=1)
    table, buffers = _flat(params, True)
    table[:, ops.ROW_STEP] = 1
    _refused(lambda: ops.adam_step_flat_(params, grads[0], buffers, table, 1e-2, *ADAM_HYPER,
                                         0.0, rule="muon_momentum", momentum=0.9),
             params + list(buffers.values()), "muon_momentum writes outputs, which this op")


def test_default_overloads_keep_their_schemas():
    """Callers that pass every argument (C++'s callBoxed, this file's positional calls)
    keep the default overloads; the rule's arguments are the .rule overloads'."""
    default = torch.ops.precis.adam_step_.default._schema
    rule = torch.ops.precis.adam_step_.rule._schema
    assert [a.name for a in default.arguments][-2:] == ["streams", "element_offsets"]
    assert [a.name for a in rule.arguments][len(default.arguments):] == [
        "rule", "momentum", "dampening", "nesterov", "outputs", "lr_scales", "fingerprints"]
    # the flat op's: each row's lr and weight decay last in both, with defaults (callers
    # from before them keep their calls)
    flat = torch.ops.precis.adam_step_flat_.default._schema
    flat_rule = torch.ops.precis.adam_step_flat_.rule._schema
    last = ["lrs", "weight_decays"]
    assert [a.name for a in flat.arguments][-2:] == last
    assert [a.name for a in flat_rule.arguments][len(flat.arguments) - 2:] == [
        "rule", "momentum", "dampening", "nesterov", "fingerprints"] + last
    assert all(a.has_default_value() for a in flat.arguments[-2:] + flat_rule.arguments[-2:])
    assert ops.RULES == {"adam": 0, "sgd": 1, "lion": 2, "muon_momentum": 3}


def test_opcheck_and_compile_of_a_rule_step():
    """torch.library.opcheck passes for the .rule overload (schema, fake kernel,
    functionalization), and a compiled sgd step writes the eager bits."""
    params, grads = _problem(12, steps=1)
    outs = [torch.empty(n, dtype=BF16) for n in SIZES]
    m = [torch.zeros(n) for n in SIZES]
    args = (params, grads[0], [], m, [], [], [], [1] * 3, 1e-2, *ADAM_HYPER, 0.0, True, False,
            1.0, False, 0, [], [], [], [], False, [], [], False, [], [], 3, 0.9, 0.0, True,
            outs, [], [])
    torch.library.opcheck(torch.ops.precis.adam_step_.rule, args)

    def step(ps, gs, bufs):
        ops.adam_step_(ps, gs, [], bufs, [], [], [], [2] * 3, 1e-2, *ADAM_HYPER, 0.1,
                       rule="sgd", momentum=0.9, nesterov=True)

    eager_p, eager_m = [p.clone() for p in params], [g.clone() for g in grads[0]]
    compiled_p, compiled_m = [p.clone() for p in params], [g.clone() for g in grads[0]]
    step(eager_p, grads[0], eager_m)
    torch._dynamo.reset()
    try:
        torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_p, grads[0],
                                                                   compiled_m)
    finally:
        torch._dynamo.reset()
    for i in range(3):
        _assert_bits(compiled_p[i], eager_p[i], f"params[{i}]")
        _assert_bits(compiled_m[i], eager_m[i], f"m[{i}]")


def test_the_rule_names_are_the_librarys():
    """op_constants.RULES, the Python copy of the rule table, names each rule of the
    library's (csrc/rules.h, through precis_rule_name) by its value, and no other; a
    name it does not hold is refused naming those it does."""
    assert op_constants.RULES == _lib.rule_names()
    assert list(op_constants.RULES.values()) == list(range(len(op_constants.RULES)))
    p, g = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="'adam', 'sgd', 'lion', 'muon_momentum'"):
        ops.adam_step_([p], [g], [], [torch.zeros(3)], [], [], [], [1], 1e-3, rule="signum")
