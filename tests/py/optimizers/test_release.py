"""precis.optim.release_gradients (issue #45): each param stepped inside backward.

* For the same gradients, a released backward + step() leaves params and every state
  buffer bit-identical to an ordinary backward + step(): AdamW (default, int16 and 8-bit
  remainders, fp8 moments), Adam with L2 decay, SGD, Lion, Muon, at sizes 1, 127, 4097
  and 1_000_003, odd matrix shapes; an lr changed between backwards; capturable.
* Gradients are freed as they are stepped: the live gradient bytes seen during backward
  stay at most one param's (the ordinary loop holds them all).
* Refused, before the param is touched: a second gradient before step() (accumulation);
  a main_grad of no precis.ddp wrapper; a non-precis optimizer; a second release; a bad
  max_norm, grad_scale or bucket_bytes; step(grad_scale=) in release mode. FSDP2 and
  precis.ddp: tests/py/distributed/test_release_fsdp.py, tests/py/distributed/test_release_ddp.py.
* A non-finite gradient: that param and its state are left as they were, the rest are
  stepped as the ordinary step would, a NonFiniteGradientWarning names it.
* max_norm (clipping by an estimate of the global norm) and grad_scale give the
  bits of an ordinary step(grad_scale=...) with the same factor; the norm is torch's.
* state_dict -> weights_only load -> resume in release mode, bit-exact; remove() gives
  the ordinary loop back; a torch.compile'd model's backward releases too.
"""
import contextlib
import copy
import io
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import precis  # loads the package, registers the ops
from precis import optim, release_clipping

FP8_REM8 = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8", "store_param_remainders": True,
            "param_remainder_bits": 8}

# name -> (make optimizer from params, param dtype, shapes)
OPTIMIZERS = {
    "adamw_default": (lambda ps: optim.AdamW(ps, lr=1e-2), torch.bfloat16),
    "adamw_rem16": (lambda ps: optim.AdamW(ps, lr=1e-2, policy={"store_param_remainders": True}),
                    torch.bfloat16),
    "adamw_fp8_rem8": (lambda ps: optim.AdamW(ps, lr=1e-2, policy=FP8_REM8), torch.bfloat16),
    "adam_l2_amsgrad_fp32": (lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
                             torch.float32),
    "sgd_nesterov": (lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True,
                                          weight_decay=0.01), torch.bfloat16),
    "sgd_fp32": (lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1), torch.float32),
    "lion_fp8": (lambda ps: optim.Lion(ps, lr=1e-3, weight_decay=0.1,
                                       policy={"momentum_dtype": "fp8",
                                               "store_param_remainders": True,
                                               "param_remainder_bits": 8}), torch.bfloat16),
}
SHAPES = [(1,), (127,), (4097,), (33, 17)]
MATRICES = [(1, 5), (33, 17), (17, 33), (64, 64)]


def make_params(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def backward(params, gen, scale=1.0, poison=None):
    """One backward whose gradients are random (times scale): loss = sum(p * G), so
    each param's gradient is G in its dtype. poison: index of a param whose gradient
    gets a NaN."""
    targets = [torch.randn(p.shape, generator=gen).to(p.device) * scale for p in params]
    if poison is not None:
        targets[poison].view(-1)[0] = float("nan")
    sum((p.to(torch.float32) * t).sum() for p, t in zip(params, targets)).backward()


def train(make, params, steps, release, seed=1, lr_change=None, **release_kwargs):
    opt = make(params)
    handle = optim.release_gradients(opt, **release_kwargs) if release else None
    gen = torch.Generator().manual_seed(seed)
    for s in range(steps):
        if lr_change is not None and s == 1:
            for group in opt.param_groups:
                group["lr"] = lr_change
        backward(params, gen)
        opt.step()
        opt.zero_grad()
    return opt, handle


def assert_same(params_a, params_b, opt_a, opt_b):
    """The same params, gradients and state; step counts by value (capturable keeps them
    on the params' device, else on the host)."""
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
        assert b.grad is None or torch.equal(a.grad, b.grad)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for key, value in sa[i].items():
            if not isinstance(value, torch.Tensor):
                assert value == sb[i][key], (i, key)
            elif key in ("step", "precis_step"):
                assert float(value) == float(sb[i][key]), (i, key)
            else:
                assert torch.equal(value, sb[i][key]), (i, key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_released_steps_have_the_ordinary_bits(name):
    make, dtype = OPTIMIZERS[name]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, _ = train(make, a, 3, release=False, lr_change=3e-3)
    opt_b, _ = train(make, b, 3, release=True, lr_change=3e-3)
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
@pytest.mark.parametrize("policy", [{}, {"momentum_dtype": "fp8", "store_param_remainders": True,
                                         "param_remainder_bits": 8}])
def test_released_muon_has_the_ordinary_bits(policy, cls):
    dtype = torch.float32 if not policy else torch.bfloat16
    def make(ps):
        return getattr(optim, cls)(ps, lr=2e-2, weight_decay=0.1, policy=policy or None)
    a, b = make_params(MATRICES, dtype), make_params(MATRICES, dtype)
    opt_a, _ = train(make, a, 3, release=False)
    opt_b, _ = train(make, b, 3, release=True)
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("bucket_bytes", [5000, 10**9])
@pytest.mark.parametrize("name", ["adamw_fp8_rem8", "sgd_fp32"])
def test_buckets_have_the_ordinary_bits(name, bucket_bytes):
    make, dtype = OPTIMIZERS[name]
    a, b = make_params(SHAPES * 3, dtype), make_params(SHAPES * 3, dtype)
    opt_a, _ = train(make, a, 3, release=False)
    opt_b, _ = train(make, b, 3, release=True, bucket_bytes=bucket_bytes)
    assert_same(a, b, opt_a, opt_b)


def test_released_one_million_elements():
    make, dtype = OPTIMIZERS["adamw_fp8_rem8"]
    a, b = make_params([(1_000_003,), (3,)], dtype), make_params([(1_000_003,), (3,)], dtype)
    opt_a, _ = train(make, a, 2, release=False)
    opt_b, _ = train(make, b, 2, release=True)
    assert_same(a, b, opt_a, opt_b)


def test_muon_and_adamw_pairing_both_released():
    """The README's pairing: Muon on the matrices, AdamW on the rest, each released."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(19, 31), torch.nn.Tanh(),
                                   torch.nn.Linear(31, 5)).to(torch.bfloat16)

    def run(release):
        model = build()
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        opts = [optim.Muon(matrices, lr=2e-2), optim.AdamW(others, lr=1e-2)]
        if release:
            for opt in opts:
                optim.release_gradients(opt)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            x = torch.randn(7, 19, generator=gen).to(torch.bfloat16)
            model(x).float().square().mean().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        return model, opts

    ma, oa = run(False)
    mb, ob = run(True)
    for x, y in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(x, y)
    for a, b in zip(oa, ob):
        assert_same([], [], a, b)


def test_capturable_on_the_cpu():
    def make(ps):
        return optim.AdamW(ps, lr=1e-2, capturable=True)
    a, b = make_params(SHAPES, torch.bfloat16), make_params(SHAPES, torch.bfloat16)
    opt_a, _ = train(make, a, 3, release=False)
    opt_b, _ = train(make, b, 3, release=True)
    assert_same(a, b, opt_a, opt_b)


def test_gradients_are_freed_as_they_are_stepped():
    """Live gradient bytes, read at every param's gradient hook (registered before the
    release's, so each reads the gradient just accumulated too): in release mode the
    largest param's at most; in the ordinary loop they pile up to every param's; with
    buckets, under a bucket's bytes and one param's."""
    def peak(release, **release_kwargs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(
            torch.bfloat16)
        params = list(model.parameters())
        opt = optim.AdamW(params, lr=1e-3, policy=FP8_REM8)
        seen = []

        def live(_):
            seen.append(sum(p.grad.numel() * p.grad.element_size()
                            for p in params if p.grad is not None))
        for p in params:
            p.register_post_accumulate_grad_hook(live)
        handle = optim.release_gradients(opt, **release_kwargs) if release else None
        model(torch.randn(8, 64, dtype=torch.bfloat16)).float().sum().backward()
        after = opt.memory_report()["grad"]
        opt.step()
        if handle is not None:  # its own count: the most bytes it held at once
            assert handle.peak_grad_bytes == max(seen)
        return max(seen), after, max(p.numel() * 2 for p in params), sum(p.numel() * 2
                                                                          for p in params)

    released, after_released, largest, total = peak(True)
    ordinary, after_ordinary, _, _ = peak(False)
    assert released == largest  # each freed before the next arrives
    assert ordinary == total
    assert after_released == 0.0 and after_ordinary == 2.0  # bytes/param after backward
    bucket = 3 * 64 * 64 * 2  # three weights' gradients: stepped when the third arrives
    bucketed, after_bucketed, _, _ = peak(True, bucket_bytes=bucket)
    assert largest < bucketed < bucket + largest and after_bucketed == 0.0


def test_accumulation_is_refused_before_the_param_changes():
    make, dtype = OPTIMIZERS["adamw_default"]
    params = make_params(SHAPES, dtype)
    opt = make(params)
    optim.release_gradients(opt)
    gen = torch.Generator().manual_seed(4)
    backward(params, gen)
    before = [p.detach().clone() for p in params]
    state = {k: {n: v.clone() for n, v in s.items() if isinstance(v, torch.Tensor)}
             for k, s in opt.state_dict()["state"].items()}
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        backward(params, gen)
    for p, q in zip(params, before):
        assert torch.equal(p, q)
    for k, s in opt.state_dict()["state"].items():
        for n, v in state[k].items():
            assert torch.equal(s[n], v)
    opt.step()  # ends the step: the next backward releases again
    opt.zero_grad()
    backward(params, gen)
    assert all(p.grad is None for p in params)


def simulate_a_gpu(monkeypatch):
    """The CPU taken for a device whose values a read waits for (release.waits_for): a
    released call of one param leaves its verdict there, as on a GPU, so the CPU runs
    that path too."""
    from precis import release
    monkeypatch.setattr(release, "waits_for", lambda device: True)


@contextlib.contextmanager
def named_when_read(waits, name, handle):
    """Around a released backward with an Inf/NaN gradient (and what follows it): its
    NonFiniteGradientWarning, naming `name`, comes when the backward ends, or, waits (as on
    a GPU: the verdicts come back after it without a wait), not before they are read:
    by the read() handed out (handle.skipped, read in it) or anything after it in the
    block. Handed out: read."""
    reads = []

    def read():
        reads.append(True)
        return handle.skipped
    if not waits:
        with pytest.warns(optim.NonFiniteGradientWarning, match=name):
            yield read
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", optim.NonFiniteGradientWarning)
        original = read

        def read():  # (the warning is the read's, nothing before it)
            warnings.simplefilter("default", optim.NonFiniteGradientWarning)
            with pytest.warns(optim.NonFiniteGradientWarning, match=name):
                return original()
        yield read
    assert reads, "named_when_read: read() was not called"


@pytest.mark.parametrize("waits", [False, True, "device path"])
@pytest.mark.parametrize("bucket_bytes", [0, 10**9])
def test_a_nonfinite_gradient_skips_that_param_alone(monkeypatch, bucket_bytes, waits):
    """Alone, or in a bucket (the bucket's step is skipped whole by the kernel, then
    taken again a param at a time). waits: as on a GPU, a call of one param leaves its
    verdict on the device, its step counted on the host, and the verdict is read when
    the backward ends (the skipped param's count taken back then); "device path": also
    the GPU's records (PRECIS_DEVICE_PATH_ON_CPU), the skipped call's record its op's
    out (the param as found): the next backward finds it unwritten (a record taken for a
    write would zero its remainders, and its bits would leave the ordinary loop's), and
    the next backward steps it (its kept call's flag zeroed)."""
    if waits:
        simulate_a_gpu(monkeypatch)
    if waits == "device path":
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    make, dtype = OPTIMIZERS["adamw_fp8_rem8"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, opt_b = make(a), make(b)
    handle = optim.release_gradients(opt_b, bucket_bytes=bucket_bytes)
    for params, opt in ((a, opt_a), (b, opt_b)):  # one step first: the state exists
        backward(params, torch.Generator().manual_seed(5))
        opt.step()
        opt.zero_grad()
    kept = b[1].detach().clone()
    kept_state = {n: v.clone() for n, v in opt_b.state[b[1]].items()}
    gen_a, gen_b = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    # the ordinary loop on the same gradients with param 1's left out
    backward(a, gen_a, poison=1)
    a[1].grad = None
    opt_a.step()
    opt_a.zero_grad()
    with named_when_read(waits, "param 1 of group 0", handle) as read:
        backward(b, gen_b, poison=1)
        # no flag handed out (a kept call's is its own, zeroed at the next backward)
        assert opt_b.last_found_inf is None
        opt_b.step()
        read()
    assert handle.skipped == ["AdamW param 1 of group 0"]
    assert opt_b.last_step_skipped is False  # the others were stepped
    assert torch.equal(b[1], kept)
    for n, v in kept_state.items():
        assert torch.equal(opt_b.state[b[1]][n], v), n
    assert all(p.grad is None for p in b)
    assert_same(a, b, opt_a, opt_b)
    # every record the params as they are, the skipped one's too
    assert [opt_b._books.written[id(p)] for p in b] == precis.fingerprints.of(b)
    for params, opt, gen in ((a, opt_a, gen_a), (b, opt_b, gen_b)):  # param 1 stepped again
        backward(params, gen)
        opt.step()
        opt.zero_grad()
    assert_same(a, b, opt_a, opt_b)
    # every gradient non-finite: nothing of the step is taken, and step() says so
    before = [p.detach().clone() for p in b]
    with pytest.warns(optim.NonFiniteGradientWarning):  # (at the read, waits)
        sum((p.to(torch.float32) * float("nan")).sum() for p in b).backward()
        opt_b.step()
        assert opt_b.last_step_skipped is True
    assert len(handle.skipped) == len(b)
    assert all(torch.equal(p, q) for p, q in zip(b, before))
    backward(b, gen_b)
    opt_b.step()
    assert opt_b.last_step_skipped is False


def test_grad_scale_and_max_norm_match_an_ordinary_step_with_the_same_factor():
    """In one bucket (every gradient stepped at the end of backward) the clipping is
    exact global clipping: an ordinary step(grad_scale=loss scale * norm / max_norm)
    gives the same bits. The norms are torch's (get_total_norm); a spike (gradients x
    100 at the second backward) is clipped at once, and the step after it as usual."""
    make, dtype = OPTIMIZERS["adamw_default"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, opt_b = make(a), make(b)
    max_norm, loss_scale = 5.0, 64.0
    handle = optim.release_gradients(opt_b, max_norm=max_norm, grad_scale=loss_scale,
                                     bucket_bytes=10**9)
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    factors = []
    for spike in (1.0, 100.0, 1.0, 1.0):
        backward(a, gen_a, scale=loss_scale * 3 * spike)
        # the release's arithmetic (each tensor's float64 norm, squared by a multiply and
        # summed in double), which torch's get_total_norm gives to rounding
        norms = [float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) for p in a]
        norm = math.sqrt(sum(n * n for n in norms) * (1.0 / loss_scale ** 2))
        assert norm == pytest.approx(float(torch.nn.utils.get_total_norm(
            [p.grad.float() / loss_scale for p in a])), rel=1e-5)
        factors.append(max(norm * (1.0 / max_norm), 1.0))  # (divided as multiplies)
        opt_a.step(grad_scale=loss_scale * factors[-1])
        opt_a.zero_grad()
        backward(b, gen_b, scale=loss_scale * 3 * spike)
        opt_b.step()
        assert handle.last_norm == norm
    assert factors[1] > 50 * factors[2] and factors[0] > 1.0 and factors[2] > 1.0, factors
    assert_same(a, b, opt_a, opt_b)


def test_resume_from_a_state_dict_in_release_mode():
    make, dtype = OPTIMIZERS["lion_fp8"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, _ = train(make, a, 4, release=True, seed=8)
    # b: two released steps, saved, loaded into a new optimizer, two more
    opt_b = make(b)
    handle = optim.release_gradients(opt_b)
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):
        backward(b, gen)
        opt_b.step()
    buffer = io.BytesIO()
    torch.save({"model": [p.detach() for p in b], "opt": opt_b.state_dict()}, buffer)
    handle.remove()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    c = make_params(SHAPES, dtype, seed=99)
    with torch.no_grad():
        for p, q in zip(c, saved["model"]):
            p.copy_(q)
    opt_c = make(c)
    opt_c.load_state_dict(saved["opt"])
    optim.release_gradients(opt_c)
    for _ in range(2):
        backward(c, gen)
        opt_c.step()
    assert_same(a, c, opt_a, opt_c)


def test_remove_gives_the_ordinary_loop_back():
    make, dtype = OPTIMIZERS["sgd_nesterov"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, _ = train(make, a, 4, release=False)
    opt_b = make(b)
    handle = optim.release_gradients(opt_b)
    gen = torch.Generator().manual_seed(1)
    for s in range(4):
        if s == 2:
            handle.remove()
        backward(b, gen)
        assert all((p.grad is None) == (s < 2) for p in b)
        opt_b.step()
        opt_b.zero_grad()
    assert_same(a, b, opt_a, opt_b)
    optim.release_gradients(opt_b).remove()  # removed: it may be released again


@pytest.mark.parametrize("bucket_bytes", [0, 10**9])
@pytest.mark.parametrize("device_path", [False, True])
def test_compiled_model_releases_too(monkeypatch, bucket_bytes, device_path):
    """A torch.compile'd model's params released, a param at a time or in one bucket, with
    the ordinary loop's bits; device_path: as on a GPU (the kept calls made again at every
    backward but the first, a bucket's too)."""
    if device_path:
        simulate_a_gpu(monkeypatch)
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    from precis.kept_calls import KeptCalls
    again, kept_again = [], KeptCalls.kept_again

    def counted(self, *args, **kwargs):  # (the kept calls made again)
        call = kept_again(self, *args, **kwargs)
        again.append(call is not None)
        return call
    monkeypatch.setattr(KeptCalls, "kept_again", counted)

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 4)).to(torch.bfloat16)

    def run(release):
        model = build()
        opt = optim.AdamW(model.parameters(), lr=1e-2, policy=FP8_REM8)
        handle = optim.release_gradients(opt, bucket_bytes=bucket_bytes) if release else None
        compiled = torch.compile(model)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            compiled(torch.randn(8, 16, generator=gen).to(torch.bfloat16)).float().square() \
                .mean().backward()
            if release:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        return model, opt, handle

    ma, oa, _ = run(False)
    mb, ob, handle = run(True)
    assert_same(list(ma.parameters()), list(mb.parameters()), oa, ob)
    # on a GPU's path the hooks' calls were kept (a bucket's, or each param's) and made
    # again at the second and third backwards: a call a group, or one a param
    assert bool(handle.kept.buckets if bucket_bytes else handle.kept.calls) == device_path
    assert again == ([True] * 2 * (1 if bucket_bytes else 4) if device_path else [])


@pytest.mark.parametrize("bucket_bytes", [0, 10**9])
@pytest.mark.parametrize("device_path", [False, True])
def test_a_compiled_step_ends_a_released_step(monkeypatch, bucket_bytes, device_path):
    """opt.step() and zero_grad() compiled by torch.compile in release mode end the step
    as the eager ones do (the release's books run eagerly: a trace of them would be
    replayed): the bits of the ordinary loop (a param whose gradient had a NaN left as
    it was, named; its step not counted), the optimizer's last_step_skipped, and a
    param the hooks left (a gradient set by hand) stepped by the compiled call;
    device_path: as on a GPU (the verdicts read when asked for)."""
    if device_path:
        simulate_a_gpu(monkeypatch)
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    make, dtype = OPTIMIZERS["adamw_fp8_rem8"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, opt_b = make(a), make(b)
    handle = optim.release_gradients(opt_b, bucket_bytes=bucket_bytes)
    step, zero_grad = torch.compile(opt_b.step), torch.compile(opt_b.zero_grad)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for poison in (None, 2, None):
        backward(a, gen_a, poison=poison)
        if poison is not None:
            a[poison].grad = None
        opt_a.step()
        opt_a.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backward(b, gen_b, poison=poison)
            step()
            skipped = handle.skipped
        assert skipped == ([] if poison is None else [f"AdamW param {poison} of group 0"])
        assert any(w.category is optim.NonFiniteGradientWarning for w in caught) == \
            (poison is not None)
        assert opt_b.last_step_skipped is False
        zero_grad()
    assert_same(a, b, opt_a, opt_b)
    for p, q in zip(a, b):  # a gradient no hook saw: stepped by the compiled call
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    opt_a.step()
    step()
    assert opt_b.last_step_skipped is False and all(q.grad is None or
                                                    torch.equal(q.grad, p.grad)
                                                    for p, q in zip(a, b))
    opt_a.zero_grad()
    zero_grad()
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("bucket_bytes", [0, 10**9])
@pytest.mark.parametrize("device_path", [False, True])
def test_a_compiled_training_step_runs_the_release_eagerly(monkeypatch, bucket_bytes,
                                                          device_path):
    """A training step compiled whole (forward, backward, opt.step(), zero_grad() in one
    torch.compile'd function) in release mode: its backward fires the hooks on the
    thread where dynamo compiles every new frame, and they run eagerly (their books
    change at every backward; a trace would be replayed): never entered while compiling,
    the ordinary loop's bits, a param at a time and in one bucket, on a GPU's path too."""
    if device_path:
        simulate_a_gpu(monkeypatch)
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    from precis import release as release_module, tracing
    compiling, on_grad = [], release_module.GradientRelease._on_grad

    def watched(self, p):  # (is_compiling() is True in an eager call inside a compiled
        compiling.append(tracing.traced())  # one on torch 2.10 and 2.11: traced() is not)
        return on_grad(self, p)
    monkeypatch.setattr(release_module.GradientRelease, "_on_grad", watched)

    def run(release):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4)).to(torch.bfloat16)
        opt = optim.AdamW(model.parameters(), lr=1e-2, policy=FP8_REM8)
        if release:
            optim.release_gradients(opt, bucket_bytes=bucket_bytes)

        def train_step(x):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        step = torch.compile(train_step) if release else train_step
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            step(torch.randn(4, 8, generator=gen).to(torch.bfloat16))
        return list(model.parameters()), opt

    (a, opt_a), (b, opt_b) = run(False), run(True)
    assert compiling == [False] * 16  # (4 params, 4 backwards: every hook eagerly)
    assert_same(a, b, opt_a, opt_b)


def test_bad_input_is_refused_naming_it():
    params = make_params(SHAPES, torch.bfloat16)
    with pytest.raises(TypeError, match="SGD is not a precis optimizer"):
        optim.release_gradients(torch.optim.SGD(params, lr=0.1))
    opt = optim.AdamW(params)
    for bad in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            optim.release_gradients(opt, max_norm=bad)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
            optim.release_gradients(opt, bucket_bytes=bad)
    handle = optim.release_gradients(opt)
    with pytest.raises(ValueError, match="already in release mode"):
        optim.release_gradients(opt)
    handle.remove()
    bucketed = make_params(SHAPES, torch.bfloat16)
    bucketed[2].main_grad = torch.zeros_like(bucketed[2], dtype=torch.float32)
    with pytest.raises(ValueError, match="param 2 of group 0 has a main_grad of no "
                                         "precis.ddp wrapper"):
        optim.release_gradients(optim.AdamW(bucketed))
    # nothing was left behind by the refusals: the ordinary loop runs
    gen = torch.Generator().manual_seed(0)
    backward(params, gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert opt.state[params[0]]["step"] == 1


def test_estimate_functions():
    """The estimate's two rules, as bench/release_clipping.py replays them: the norm so
    far over the call's average share, never below it; without a share the previous
    norm; the shares averaged with SHARE_DECAY, and started anew for other calls."""
    est, avg = release_clipping.estimated_squares, release_clipping.averaged_shares
    assert est(4.0, 0.25, None) == 16.0
    assert est(4.0, 2.0, None) == 4.0  # a share above 1 never lowers the norm so far
    assert est(4.0, None, 3.0) == 9.0 and est(4.0, None, 1.0) == 4.0
    assert est(4.0, 0.0, None) == 4.0 and est(4.0, None, None) == 4.0
    d = release_clipping.SHARE_DECAY
    assert avg([], [1.0, 3.0, 4.0], 4.0) == [0.25, 0.75, 1.0]
    assert avg([0.5, 1.0], [1.0, 4.0], 4.0) == [d * 0.5 + (1 - d) * 0.25, 1.0]
    assert avg([0.5, 1.0], [1.0, 2.0, 4.0], 4.0) == [0.25, 0.5, 1.0]  # other calls


def test_max_norm_estimate_one_param_at_a_time():
    """bucket_bytes=0: call j of a backward divides its gradient by the estimated norm
    over max_norm: the squared norm so far S_j (its own gradient included) over the
    share of the total that call j held in the backwards before (their shares S_j / T
    averaged with release_clipping.SHARE_DECAY), never below S_j (the first backward:
    S_j alone). Two ordinary fp32 optimizers (no random streams), one per param,
    stepped with those factors in the hooks' order, give the same bits. A spike (x 100)
    is clipped from its first gradient on."""
    def build():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(13, 7)), torch.nn.Parameter(torch.randn(5, 13))]

    def loss(w1, w2, x):
        return (w2 @ torch.tanh(w1 @ x)).square().sum()

    a, b = build(), build()
    opt_a = [optim.AdamW([p], lr=1e-2) for p in a]
    opt_b = optim.AdamW(b, lr=1e-2)
    max_norm, decay = 2.0, release_clipping.SHARE_DECAY
    assert 0.0 < decay < 1.0
    handle = optim.release_gradients(opt_b, max_norm=max_norm)
    order = []
    for p in b:  # before the release's hooks: the order they fire in
        p.register_post_accumulate_grad_hook(lambda p: order.append(0 if p is b[0] else 1))
    gen = torch.Generator().manual_seed(1)
    shares, factors = [], []
    for spike in (1.0, 1.0, 100.0, 1.0):
        x = torch.randn(7, 3, generator=gen)
        (loss(*a, x) * spike).backward()
        order.clear()
        (loss(*b, x) * spike).backward()
        so_far, now = 0.0, []
        for j, k in enumerate(order):
            norm = float(torch.linalg.vector_norm(a[k].grad, dtype=torch.float64))
            so_far += norm * norm
            estimate = max(so_far, so_far * (1.0 / shares[j])) if shares else so_far
            bound = math.sqrt(estimate)
            factors.append(max(bound * (1.0 / max_norm), 1.0))
            opt_a[k].step(grad_scale=factors[-1])
            opt_a[k].zero_grad()
            now.append(so_far)
        new = [s / so_far for s in now]
        shares = new if not shares else [decay * s + (1.0 - decay) * n
                                         for s, n in zip(shares, new)]
        assert handle.last_norm == math.sqrt(so_far) and handle.last_norm > max_norm
        opt_b.step()
        opt_b.zero_grad()
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    # the spike's first call is clipped 100x harder, and the call after the spike as usual
    assert factors[4] > 50 * factors[2] and factors[5] > 50 * factors[7], factors


def test_a_backward_that_raises_leaves_the_release_working():
    """A hook raises in the middle of a released backward (max_norm, and a bucket that
    was ready but not stepped): zero_grad() and the next backward step every param as
    an ordinary loop would from there, with this backward's own norm."""
    make, dtype = OPTIMIZERS["adamw_default"]
    for bucket_bytes in (0, 10**9):
        params = make_params(SHAPES, dtype)
        opt = make(params)
        handle = optim.release_gradients(opt, max_norm=1e9, bucket_bytes=bucket_bytes)
        gen = torch.Generator().manual_seed(9)

        def boom(grad):
            raise RuntimeError("boom")
        once = params[2].register_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            backward(params, gen)
        once.remove()
        opt.zero_grad()
        before = [p.detach().clone() for p in params]
        backward(params, gen)
        norm = handle.last_norm
        assert all(p.grad is None for p in params)
        assert all(not torch.equal(p, q) for p, q in zip(params, before))
        opt.step()
        backward(params, gen)  # no "second gradient": the step ended
        assert handle.last_norm != norm and math.isfinite(handle.last_norm)


@pytest.mark.parametrize("then", ["zero_grad", "remove", "state_dict", "load_state_dict",
                                  "decoded_state", "deepcopy"])
def test_a_raised_backward_settles_the_counts(monkeypatch, then):
    """As on a GPU (a call's verdict left on the device, its step counted on the host): a
    backward that raises after hooks stepped params with Inf/NaN gradients leaves those
    counts open; the next zero_grad(), remove(), state_dict(), load_state_dict(),
    decoded_state() or copy takes them back first, so no count stays, or is saved or
    copied, one too high, and none is taken from a loaded state."""
    simulate_a_gpu(monkeypatch)
    make, dtype = OPTIMIZERS["adamw_default"]
    params = make_params(SHAPES, dtype)
    opt = make(params)
    handle = optim.release_gradients(opt)
    gen = torch.Generator().manual_seed(9)
    backward(params, gen)
    opt.step()
    saved = opt.state_dict()
    saved = {"state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in st.items()} for i, st in saved["state"].items()},
             "param_groups": saved["param_groups"]}  # counts 1
    backward(params, gen)
    opt.step()  # counts 2

    def boom(grad):
        raise RuntimeError("boom")
    hook = params[2].register_hook(boom)
    targets = [torch.full(p.shape, float("nan")) for p in params]  # every hook before 2's
    with pytest.raises(RuntimeError, match="boom"):  # steps a NaN, left unread
        sum((p.to(torch.float32) * t).sum() for p, t in zip(params, targets)).backward()
    hook.remove()
    assert 3.0 in [float(opt.state[p]["step"]) for p in params]  # counted, not yet read
    assert opt.last_found_inf is None  # (a call's flag is the release's: not handed out)
    expected = 2.0
    if then == "zero_grad":
        opt.zero_grad()
    elif then == "remove":
        handle.remove()
    elif then == "state_dict":
        sd = opt.state_dict()["state"]
        assert [float(sd[i].get("precis_step", sd[i]["step"])) for i in sd] == \
            [2.0] * len(params)
    elif then == "decoded_state":
        assert [opt.decoded_state(p)["step"] for p in params] == [2] * len(params)
    elif then == "deepcopy":
        params_copy, opt_copy = copy.deepcopy((params, opt))
        assert [float(opt_copy.state[p]["step"]) for p in params_copy] == [2.0] * len(params)
    else:  # (zero_grad() after: an open count left by the load would be taken now)
        opt.load_state_dict(saved)
        opt.zero_grad()
        expected = 1.0
    assert [float(opt.state[p]["step"]) for p in params] == [expected] * len(params)


def test_a_capturable_step_of_the_params_the_hooks_left_counts_as_taken():
    """Release mode, capturable=True: opt.step() steps a param whose gradient was set by
    hand (no hook saw it). Its verdict stays on the device, but the step was taken: the
    optimizer's last_step_skipped is False although the one hooked param was skipped."""
    params = make_params(SHAPES[:2], torch.bfloat16)
    opt = optim.AdamW(params, lr=1e-2, capturable=True)
    optim.release_gradients(opt)
    with pytest.warns(optim.NonFiniteGradientWarning, match="param 0 of group 0"):
        (params[0].to(torch.float32) * float("nan")).sum().backward()
    params[1].grad = torch.randn_like(params[1])
    before = params[1].detach().clone()
    opt.step()
    assert not torch.equal(params[1], before)
    assert opt.last_step_skipped is False


@pytest.mark.parametrize("waits", [False, True, "device path"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("bucket_bytes", [0, 10**9])
def test_offloaded_params_are_released_with_the_ordinary_bits(monkeypatch, bucket_bytes,
                                                               fraction, waits):
    """offload=True (host copies stepped on the host, written back to the params): a
    released backward gives the ordinary loop's bits, every param offloaded or half of
    them, a param at a time or in one bucket, a NaN gradient skipping its param alone
    (the ordinary loop given the same gradients without it). waits: as on a GPU (an
    offloaded call's verdict is still read at once; no call of an optimizer that
    offloads is kept); "device path": also the GPU's records."""
    if waits:
        simulate_a_gpu(monkeypatch)
    if waits == "device path":
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")

    def run(release):
        params = make_params(SHAPES, torch.bfloat16)
        opt = optim.AdamW(params, lr=1e-2, offload=True, offload_fraction=fraction,
                          policy={"store_param_remainders": True})
        handle = optim.release_gradients(opt, bucket_bytes=bucket_bytes) if release else None
        gen = torch.Generator().manual_seed(3)
        for k in range(4):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optim.NonFiniteGradientWarning)
                backward(params, gen, poison=1 if k == 2 else None)
            if not release and k == 2:
                params[1].grad = None
            opt.step()
            opt.zero_grad()
        return params, opt, handle
    (a, opt_a, _), (b, opt_b, handle) = run(False), run(True)
    assert_same(a, b, opt_a, opt_b)
    assert not handle.kept.calls and not handle.kept.buckets  # (an offloaded step: the full path)


def test_torch_math_params_are_released_too():
    """Params torch's own math steps (complex64 under Adam's L2 decay, tensor betas on
    fp32, SGD on complex64): released, with the ordinary loop's bits."""
    def complex_params():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, dtype=torch.complex64, generator=gen))
                for s in ((5,), (3, 4))]

    cases = [
        (complex_params, lambda ps: optim.Adam(ps, lr=1e-2, weight_decay=0.1)),
        (complex_params, lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9)),
        (lambda: make_params(SHAPES, torch.float32),
         lambda ps: optim.Adam(ps, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)))),
    ]
    for build, make in cases:
        a, b = build(), build()
        opt_a, opt_b = make(a), make(b)
        optim.release_gradients(opt_b)
        for params, opt in ((a, opt_a), (b, opt_b)):
            gen = torch.Generator().manual_seed(2)
            for _ in range(2):
                sum((p * torch.randn(p.shape, dtype=p.dtype, generator=gen)).abs().sum()
                    for p in params).backward()
                opt.step()
                opt.zero_grad()
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_a_spike_that_overflows_float32_squares_is_clipped():
    """bf16 gradients of 1e20: their squares overflow float32 (the norm is taken in
    float64), so the step is clipped to max_norm and the next backward works."""
    params = make_params([(64,)], torch.bfloat16)
    opt = optim.SGD(params, lr=1.0)
    handle = optim.release_gradients(opt, max_norm=1.0)
    before = params[0].detach().float().clone()
    (params[0].float() * 1e20).sum().backward()
    opt.step()
    moved = float(torch.linalg.vector_norm(params[0].float() - before))
    assert moved == pytest.approx(1.0, rel=0.02) and handle.last_norm == pytest.approx(8e20,
                                                                                       rel=0.01)
    params[0].float().sum().backward()  # clipped by the spike's norm, no error
    opt.step()


def test_step_refuses_grad_scale_and_added_groups_are_released():
    make, dtype = OPTIMIZERS["adamw_default"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, opt_b = make(a[:2]), make(b[:2])
    optim.release_gradients(opt_b)
    opt_a.add_param_group({"params": a[2:]})
    opt_b.add_param_group({"params": b[2:]})
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(2):
        backward(a, gen_a)
        opt_a.step()
        opt_a.zero_grad()
        backward(b, gen_b)
        assert all(p.grad is None for p in b)  # the added group's too
        opt_b.step()
    assert_same(a, b, opt_a, opt_b)
    backward(b, gen_b)
    with pytest.raises(ValueError, match="grad_scale= / found_inf= .* in release mode"):
        opt_b.step(grad_scale=2.0)


def test_the_hooks_do_not_keep_the_optimizer_alive():
    import gc
    import weakref
    params = make_params(SHAPES, torch.bfloat16)
    opt = optim.AdamW(params)
    optim.release_gradients(opt)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    before = [p.detach().clone() for p in params]
    backward(params, torch.Generator().manual_seed(0))  # no optimizer: nothing stepped
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize("name", ["adamw_default", "adamw_fp8_rem8", "lion_fp8"])
@pytest.mark.parametrize("bucket_bytes", [0, 10**9])
def test_a_model_only_load_between_backwards_is_seen(name, bucket_bytes):
    """Weights written into the params after released steps (a load by any path: here
    p.data's copy_, which moves no version counter torch's DCP would) are what the next
    released backward steps from: the masters / remainders are resynced from them, as in
    the ordinary loop, and the load is not overwritten by the old masters."""
    make, dtype = OPTIMIZERS[name]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    loaded = make_params(SHAPES, dtype, seed=7)
    opt_a, _ = train(make, a, 2, release=False)
    opt_b, handle = train(make, b, 2, release=True, bucket_bytes=bucket_bytes)
    for params in (a, b):
        with torch.no_grad():
            for p, w in zip(params, loaded):
                p.data.copy_(w)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with pytest.warns(optim.StaleMasterWarning):
        backward(a, gen_a)
        opt_a.step()
    with pytest.warns(optim.StaleMasterWarning):
        backward(b, gen_b)
        opt_b.step()
    assert_same(a, b, opt_a, opt_b)
    # stepped from the loaded weights: a small step away from them, not back to the old
    for p, w in zip(b, loaded):
        assert torch.allclose(p.float(), w.float(), rtol=0.05, atol=0.05)
    assert handle.skipped == []


def test_a_released_steps_verdicts_are_read_only_when_asked_for(monkeypatch):
    """As on a GPU (its path): a released backward's verdicts come back when it ends
    without a wait (device_reads.Later) and are read only when asked for: not by
    opt.step() or zero_grad(), but by handle.skipped, last_step_skipped, state_dict()
    or the next backward (or opt.step() where it steps a param the hooks left). Until then
    a skipped param's step count, counted at its call, is one too many; every read takes
    it back first, and the bits are the ordinary loop's (given the same gradients without
    the skipped one's)."""
    from precis import device_reads
    simulate_a_gpu(monkeypatch)
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    reads = []

    class Counted(device_reads.Later):
        def values(self, why):
            if why == "release verdicts":  # (not the StaleMasterWarning's)
                reads.append(why)
            return super().values(why)
    monkeypatch.setattr(device_reads, "Later", Counted)
    make, dtype = OPTIMIZERS["adamw_fp8_rem8"]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, opt_b = make(a), make(b)
    handle = optim.release_gradients(opt_b)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)

    def ordinary(poison):
        backward(a, gen_a, poison=poison)
        if poison is not None:
            a[poison].grad = None
        opt_a.step()
        opt_a.zero_grad()

    def released(poison):
        backward(b, gen_b, poison=poison)
        opt_b.step()
        opt_b.zero_grad()
        return reads

    def counts():
        return [float(opt_b.state[p]["step"]) for p in b]
    ordinary(None)
    assert released(None) == []  # (the first backward's verdicts: unread)
    ordinary(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", optim.NonFiniteGradientWarning)
        assert released(1) == ["release verdicts"]  # (the first's, read by this backward)
    assert counts() == [2.0] * len(b)  # (param 1's: one too many, its verdict unread)
    with pytest.warns(optim.NonFiniteGradientWarning, match="param 1 of group 0"):
        assert opt_b.last_step_skipped is False  # (read: the others were stepped)
    assert counts()[1] == 1.0 and len(reads) == 2
    assert handle.skipped == ["AdamW param 1 of group 0"] and len(reads) == 2  # (read once)
    ordinary(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optim.NonFiniteGradientWarning)
        released(2)
        assert counts()[2] == 3.0
        saved = opt_b.state_dict()  # (the step count saved: taken back)
    assert [float(s["precis_step"]) for s in saved["state"].values()][2] == 2.0
    assert handle.skipped == ["AdamW param 2 of group 0"]
    # a skipped param given a gradient by hand before its verdict was read: opt.step()
    # reads it first (its count taken back before it steps the param), and names it
    ordinary(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", optim.NonFiniteGradientWarning)
        released(1)
    grad = torch.randn(b[1].shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    a[1].grad = grad.clone()
    opt_a.step()
    opt_a.zero_grad()
    b[1].grad = grad.clone()
    with pytest.warns(optim.NonFiniteGradientWarning, match="param 1 of group 0"):
        opt_b.step()
    opt_b.zero_grad()
    ordinary(None)
    released(None)
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("waits", [False, True])
def test_a_capturable_nonfinite_gradient_is_named_when_read(monkeypatch, waits):
    """capturable=True (step counts on the params' device): a param's Inf/NaN verdict
    stays on the device (waits: as on a GPU, read after the backward when asked for).
    That param, its state and its step count are left as they were, the others stepped
    as the ordinary loop steps them, and the warning and `skipped` name it; a backward
    of only NaNs leaves last_step_skipped True."""
    if waits:
        simulate_a_gpu(monkeypatch)
    def make(ps):
        return optim.AdamW(ps, lr=1e-2, capturable=True, policy=FP8_REM8)
    a, b = make_params(SHAPES, torch.bfloat16), make_params(SHAPES, torch.bfloat16)
    opt_a, opt_b = make(a), make(b)
    handle = optim.release_gradients(opt_b)
    for params, opt in ((a, opt_a), (b, opt_b)):
        backward(params, torch.Generator().manual_seed(5))
        opt.step()
        opt.zero_grad()
    kept = b[2].detach().clone()
    kept_state = {n: v.clone() for n, v in opt_b.state[b[2]].items()}
    gen_a, gen_b = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    backward(a, gen_a, poison=2)
    a[2].grad = None
    opt_a.step()
    opt_a.zero_grad()
    with named_when_read(waits, "param 2 of group 0", handle) as read:
        backward(b, gen_b, poison=2)
        assert read() == ["AdamW param 2 of group 0"]
    opt_b.step()
    assert opt_b.last_step_skipped is False and opt_b.last_found_inf is None
    assert torch.equal(b[2], kept)
    for n, v in kept_state.items():
        assert torch.equal(opt_b.state[b[2]][n], v), n
    assert_same(a, b, opt_a, opt_b)
    with pytest.warns(optim.NonFiniteGradientWarning):  # (at the read, waits)
        sum((p.to(torch.float32) * float("nan")).sum() for p in b).backward()
        opt_b.step()
        assert opt_b.last_step_skipped is True
    assert len(handle.skipped) == len(b)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def on(device, params):
    """params on device ("cpu+cuda": every other one on the GPU)."""
    if device == "cpu+cuda":
        return [torch.nn.Parameter(p.detach().to("cuda" if i % 2 else "cpu"))
                for i, p in enumerate(params)]
    return [torch.nn.Parameter(p.detach().to(device)) for p in params]


@pytest.mark.parametrize("device", DEVICES + ["cpu as a gpu"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("capturable", [False, True])
def test_a_released_backward_compares_once_and_waits_for_no_verdict(monkeypatch, capturable,
                                                                    max_norm, device):
    """What a released backward reads, counted per hook: the params' fingerprints are
    compared once a backward (every param at its first step call), not once a call. On a
    GPU (or the CPU taken for one) no hook but the first reads a tensor's value back
    (each read waits for the device; the first reads the compare, and the records the
    last step left unread): the verdicts are read when the backward ends, and with
    capturable=True the norms too; without capturable, clipping reads each call's norm
    and its verdict at once. On the CPU each call's verdict (and norm) is read at once."""
    from precis import functional, optim_state, release
    waits = device != "cpu"
    if device == "cpu as a gpu":
        simulate_a_gpu(monkeypatch)
        device = "cpu"
    params = on(device, make_params(SHAPES, torch.bfloat16))
    opt = optim.AdamW(params, lr=1e-2, capturable=capturable)
    handle = optim.release_gradients(opt, max_norm=max_norm)
    gen = torch.Generator().manual_seed(4)
    backward(params, gen)  # the state made, fingerprints recorded
    opt.step()
    compares, hooks, inside = [], [], []  # hooks: the reads of each hook
    # the compare on the host, or on the device (a GPU's, the emulated device path's)
    real_compare, real_on_device = optim_state.written_behind, functional.compare_on_device
    monkeypatch.setattr(optim_state, "written_behind", lambda books, params: compares.append(
        len(params)) or real_compare(books, params))

    def on_device(books, params, now=None):
        flags = real_on_device(books, params, now)
        if flags is not None:
            compares.append(len(params))
        return flags
    monkeypatch.setattr(functional, "compare_on_device", on_device)
    for name in ("__float__", "item", "tolist", "__bool__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name):
            if inside:
                hooks[-1].append(_name)
            return _real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, spy)
    real_on_grad = release.GradientRelease._on_grad

    def on_grad(self, p):
        inside.append(1)
        hooks.append([])
        try:
            return real_on_grad(self, p)
        finally:
            inside.pop()
    monkeypatch.setattr(release.GradientRelease, "_on_grad", on_grad)
    backward(params, gen)
    opt.step()
    assert compares == [len(params)]  # one compare of every param, at the first hook
    assert len(hooks) == len(params)
    if waits and (capturable or max_norm is None):
        assert hooks[1:] == [[]] * (len(params) - 1)
    else:  # the host makes the norm, or nothing waits (the CPU): each call's verdict
        # (and norm) is read at once
        assert all(reads.count("__float__") == (1 if max_norm is None else 2)
                   for reads in hooks)
    if max_norm is not None:
        assert math.isfinite(handle.last_norm) and handle.last_norm > max_norm


@pytest.mark.parametrize("device", DEVICES + [pytest.param("cpu+cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("bucket_bytes", [0, 300])
@pytest.mark.parametrize("poison", [None, 1])
@pytest.mark.parametrize("grad_scale", [3.0, None])
def test_capturable_clipping_has_the_host_estimates_bits(monkeypatch, grad_scale, poison,
                                                          bucket_bytes, device):
    """max_norm one param at a time: with capturable=True on a GPU the norms, the
    estimate and the divisor are made on the params' device (float64: the host's
    additions, multiplies by the host's reciprocals, an IEEE square root; the
    reciprocal of the scale in float64, then rounded as the host's is), and give the
    bits of the host's estimate (capturable=False): every divisor, params, state, the
    norm and the shares, a spike included, with a loss scale and without (3: no power
    of two, whose reciprocal would hide a rounding); a NaN param skipped by both. On
    the CPU both take the host's path (nothing waits there). With buckets of 300
    bytes some calls hold one param (on the device) and some several (read at once),
    in one backward; with params on two devices, a call whose device is not the sum's
    so far is made on the host."""
    def make(capturable):
        return lambda ps: optim.AdamW(ps, lr=1e-2, capturable=capturable, policy=FP8_REM8)
    divisors = []
    real_divisor = release_clipping.Norm.divisor
    monkeypatch.setattr(release_clipping.Norm, "divisor", lambda self, squares, **kw: (
        divisors[-1].append(real_divisor(self, squares, **kw)) or divisors[-1][-1]))
    results = []
    for capturable in (False, True):
        params = on(device, make_params(SHAPES, torch.bfloat16))
        opt = make(capturable)(params)
        divisors.append([])
        handle = optim.release_gradients(opt, max_norm=3.0, grad_scale=grad_scale,
                                         bucket_bytes=bucket_bytes)
        gen, norms = torch.Generator().manual_seed(11), []
        for k, spike in enumerate((1.0, 1.0, 100.0, 1.0)):
            # (on two devices autograd's threads would run the hooks in an order of
            # their own, and the estimate follows the order: one thread, one order)
            with warnings.catch_warnings(), torch.autograd.set_multithreading_enabled(False):
                warnings.simplefilter("ignore", optim.NonFiniteGradientWarning)
                backward(params, gen, scale=(grad_scale or 1.0) * spike,
                         poison=poison if k == 2 else None)
            opt.step()
            norms.append((handle.last_norm, list(handle._norm.shares), list(handle.skipped)))
        results.append((params, opt, norms))
    (a, opt_a, norms_a), (b, opt_b, norms_b) = results
    assert [float(d) for d in divisors[0]] == [float(d) for d in divisors[1]]
    assert any(float(d) > 1.0 for d in divisors[0])  # (the spike is clipped)
    assert norms_a == norms_b
    assert norms_a[2][2] == ([] if poison is None else ["AdamW param 1 of group 0"])
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("devices", [pytest.param(("cpu", "cuda"), marks=pytest.mark.cuda)])
@pytest.mark.parametrize("bucket_bytes", [0, 20_000])
@pytest.mark.parametrize("capturable", [False, True])
def test_hooks_of_two_devices_take_turns_and_keep_the_ordinary_bits(monkeypatch, capturable,
                                                                    bucket_bytes, devices):
    """Params on two devices with autograd's threads on: each device's hooks run on a
    thread of its own, and a hook waiting on the GPU lets the other thread run. No hook
    starts while another runs (the release's lock), no step call mixes devices (a
    bucket holds one device's params), and without clipping, where the order of
    arrival changes nothing, params and state end with the ordinary loop's bits (its
    step not capturable: a capturable step takes one device)."""
    import threading

    from precis import release

    def on_two(params):  # the first half on devices[0], the rest on devices[1]
        return [torch.nn.Parameter(p.detach().to(devices[0] if i < len(params) // 2
                                                  else devices[1]))
                for i, p in enumerate(params)]
    def make(capturable):
        return lambda ps: optim.AdamW(ps, lr=1e-2, capturable=capturable, policy=FP8_REM8)
    running, overlapped, call_devices, threads = [], [], [], set()
    real_on_grad, real_step = release.GradientRelease._on_grad, release.GradientRelease._step

    def on_grad(self, p):
        overlapped.append(bool(running))
        threads.add(threading.get_ident())
        running.append(id(p))
        try:
            return real_on_grad(self, p)
        finally:
            running.remove(id(p))

    def step(self, params, *args, **kwargs):
        call_devices.append({p.device for p in params})
        return real_step(self, params, *args, **kwargs)
    monkeypatch.setattr(release.GradientRelease, "_on_grad", on_grad)
    monkeypatch.setattr(release.GradientRelease, "_step", step)
    a, b = (on_two(make_params(SHAPES * 2, torch.bfloat16)) for _ in range(2))
    opt_a, _ = train(make(capturable), a, 3, True, bucket_bytes=bucket_bytes)
    opt_b, _ = train(make(False), b, 3, False)
    assert len(threads) == len(set(devices)), "each device's hooks on a thread of its own"
    assert len(overlapped) == 3 * len(a) and not any(overlapped)
    assert call_devices and all(len(d) == 1 for d in call_devices)
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("name", ["adamw_default", "adamw_rem16", "adamw_fp8_rem8"])
def test_a_release_after_ordinary_steps_sees_no_load(name):
    """Ordinary steps first (their Plan holds the params' fingerprints), then a release:
    its one compare a backward must not take the optimizer's own writes for a load (a
    remainder zeroed, a StaleMasterWarning); the ordinary loop's bits."""
    make, dtype = OPTIMIZERS[name]
    a, b = make_params(SHAPES, dtype), make_params(SHAPES, dtype)
    opt_a, opt_b = make(a), make(b)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for params, opt, gen in ((a, opt_a, gen_a), (b, opt_b, gen_b)):
        for _ in range(3):
            backward(params, gen)
            opt.step()
            opt.zero_grad()
    assert opt_b._books.plans, "a plan was made"
    optim.release_gradients(opt_b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", optim.StaleMasterWarning)
        for params, opt, gen in ((a, opt_a, gen_a), (b, opt_b, gen_b)):
            backward(params, gen)
            opt.step()
            opt.zero_grad()
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("poison", [0, 1])
def test_a_bucket_stepped_again_keeps_a_loaded_remainder(poison):
    """A checkpoint's optimizer loaded before its model (remainders saved with their
    params' fingerprints), then one bucket with a NaN: the bucket's call sees the load
    (and keeps the remainders: they belong to these params), the kernel skips it, and
    the params stepped again one at a time must not be taken for loaded a second time
    (their remainders zeroed). The ordinary loop's bits, the NaN param left out."""
    make, dtype = OPTIMIZERS["adamw_rem16"]
    src = make_params(SHAPES, dtype)
    opt_src = make(src)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        backward(src, gen)
        opt_src.step()
        opt_src.zero_grad()
    saved = opt_src.state_dict()
    runs = []
    for release in (False, True):
        params = make_params(SHAPES, dtype, seed=5)
        opt = make(params)
        opt.load_state_dict(saved)  # the optimizer first, then the model
        with torch.no_grad():
            for p, q in zip(params, src):
                p.data.copy_(q)
        handle = optim.release_gradients(opt, bucket_bytes=10**9) if release else None
        with warnings.catch_warnings():
            warnings.simplefilter("error", optim.StaleMasterWarning)
            warnings.simplefilter("ignore", optim.NonFiniteGradientWarning)
            backward(params, torch.Generator().manual_seed(3), poison=poison)
            if not release:
                params[poison].grad = None
            opt.step()
        runs.append((params, opt, handle))
    (a, opt_a, _), (b, opt_b, handle) = runs
    assert handle.skipped == [f"AdamW param {poison} of group 0"]
    assert torch.equal(opt_b.state[b[poison]]["remainder"], opt_src.state[src[poison]]["remainder"])
    assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("how", ["grad_scale", "found_inf", "release"])
def test_a_capturable_first_step_with_a_nan_is_skipped(how):
    """capturable=True on the CPU, a first step whose gradient has a NaN: skipped (its
    count stays 0: the kernel takes at least 1 for a step it does not take, as the CUDA
    kernel does), not refused; in release mode only that param is skipped."""
    p, q = make_params([(5,), (3,)], torch.bfloat16)
    before = [p.detach().clone(), q.detach().clone()]
    opt = optim.AdamW([p, q], lr=1e-2, capturable=True)
    if how == "release":
        optim.release_gradients(opt)
    g = torch.ones(5)
    g[0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optim.NonFiniteGradientWarning)
        ((p.float() * g).sum() + q.float().sum()).backward()
        if how == "grad_scale":
            opt.step(grad_scale=torch.ones(1))
        elif how == "found_inf":
            opt.step(found_inf=torch.ones(1))
        else:
            opt.step()
    assert float(opt.state[p]["step"]) == 0.0 and torch.equal(p, before[0])
    stepped = how == "release"  # the ordinary step skips every param
    assert float(opt.state[q]["step"]) == float(stepped)
    assert torch.equal(q, before[1]) != stepped


class NoGradientFor(torch.autograd.Function):
    """a * 2 forward, whose backward gives b no gradient (None), as custom Functions may."""

    @staticmethod
    def forward(ctx, a, b):
        return a * 2 + b.sum() * 0

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def test_a_param_that_gets_no_gradient_is_left_as_the_ordinary_loop_leaves_it():
    """Its hook runs with .grad None: not stepped, no state made, the others stepped with
    the ordinary bits (a crash inside backward before)."""
    results = []
    for release in (False, True):
        a, b = make_params([(5,), (3,)], torch.float32)
        opt = optim.AdamW([a, b], lr=0.1)
        if release:
            optim.release_gradients(opt)
        for _ in range(2):
            NoGradientFor.apply(a, b).sum().backward()
            opt.step()
            opt.zero_grad()
        assert b not in opt.state and b.grad is None
        results.append((a.detach().clone(), b.detach().clone()))
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_params_the_hooks_left_are_unscaled_and_checked_as_the_hooks_do():
    """Params whose gradients are set by hand (no hook: opt.step() steps them), loss
    scaled by 1024: stepped as a hook would step them, their gradients unscaled (torch's
    SGD on the unscaled gradient, bit for bit; a float64 param, stepped by torch's math,
    too); a NaN gradient there leaves that param as it was, named in `skipped` with a
    NonFiniteGradientWarning, while the others are stepped."""
    a, b = make_params([(4,), (3,)], torch.float32, seed=3)
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = optim.SGD([a, b, c], lr=0.1, momentum=0.9)
    release = optim.release_gradients(opt, grad_scale=1024.0)
    refs = [p.detach().clone().requires_grad_() for p in (b, c)]
    ref_opt = torch.optim.SGD(refs, lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ga, gb = torch.randn(4, generator=gen), torch.randn(3, generator=gen)
        gc = torch.randn(5, generator=gen, dtype=torch.float64)
        (a * ga).sum().mul(1024.0).backward()
        b.grad, c.grad = gb * 1024.0, gc * 1024.0  # (exact: a power of two)
        opt.step()
        opt.zero_grad()
        refs[0].grad, refs[1].grad = gb, gc
        ref_opt.step()
        assert torch.equal(b, refs[0]) and torch.equal(c, refs[1])
        assert opt.last_step_skipped is False and release.skipped == []
    before = [p.detach().clone() for p in (b, c)]
    nan = torch.tensor([1.0, float("nan"), 1.0])
    for poisoned in (b, c):
        other = c if poisoned is b else b
        with pytest.warns(optim.NonFiniteGradientWarning, match="1 params left to opt.step()"):
            b.grad = nan if poisoned is b else torch.ones(3)
            c.grad = nan.double().repeat(2)[:5] if poisoned is c else torch.ones(5).double()
            opt.step()
        opt.zero_grad()
        index = 1 if poisoned is b else 2
        assert release.skipped == [f"SGD param {index} of group 0"]
        assert torch.equal(poisoned, before[index - 1])
        assert not torch.equal(other, before[2 - index])  # stepped
        before = [p.detach().clone() for p in (b, c)]


def test_params_the_hooks_left_are_skipped_one_at_a_time():
    """Two params left to opt.step() (gradients set by hand), one with a NaN: that one is
    left as it was and named, the other gets the ordinary step's bits (the call of both
    is taken again a param at a time, as a bucket is)."""
    a, b = make_params([(4,), (3,)], torch.float32, seed=5)
    ref = b.detach().clone().requires_grad_()
    opt = optim.AdamW([a, b], lr=0.1)
    release = optim.release_gradients(opt)
    a.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    b.grad = torch.randn(3)
    before = a.detach().clone()
    with pytest.warns(optim.NonFiniteGradientWarning, match="1 params left to opt.step()") as rec:
        opt.step()
    ref.grad = b.grad.clone()
    torch.optim.AdamW([ref], lr=0.1).step()
    assert torch.equal(a, before) and torch.equal(b, ref)
    assert release.skipped == ["AdamW param 0 of group 0"] and opt.last_step_skipped is False
    opt.zero_grad()
    with pytest.warns(optim.NonFiniteGradientWarning, match="1 params of this backward") as rec2:
        (a * float("nan")).sum().backward()
    # each warning points at the user's line: opt.step(), backward()
    assert [r.filename for r in (rec[0], rec2[0])] == [__file__, __file__]


def test_warnings_name_the_users_line_under_a_schedulers_wrapper():
    """torch's LRScheduler wraps opt.step() in a function of its own: a frame more
    between the user's line and precis's warnings. The NonFiniteGradientWarning of a
    param left to opt.step() (release mode) and the StaleMasterWarning of a param written
    behind the optimizer (the ordinary loop) still name the line that called opt.step()."""
    import inspect
    a, b = make_params([(4,), (3,)], torch.bfloat16, seed=6)
    opt = optim.AdamW([a, b], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    release = optim.release_gradients(opt)
    a.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0]).bfloat16()
    b.grad = torch.ones(3).bfloat16()
    with pytest.warns(optim.NonFiniteGradientWarning, match="left to opt.step()") as rec:
        opt.step(); line = inspect.currentframe().f_lineno  # noqa: E702 (the line named)
    assert [(r.filename, r.lineno) for r in rec] == [(__file__, line)]
    opt.zero_grad()
    scheduler.step()
    release.remove()
    with torch.no_grad():
        b.fill_(2.0)  # behind the optimizer's back: its master resynced, with a warning
    a.grad, b.grad = torch.ones(4).bfloat16(), torch.ones(3).bfloat16()
    with pytest.warns(optim.StaleMasterWarning) as rec:
        opt.step(); line = inspect.currentframe().f_lineno  # noqa: E702
    assert [(r.filename, r.lineno) for r in rec] == [(__file__, line)]


def test_a_warning_under_deepcopy_names_the_users_line(monkeypatch):
    """copy.deepcopy(opt) settles a release whose verdicts were not read yet (as on a
    GPU): the NonFiniteGradientWarning it gives names the line that called deepcopy, not
    the standard library's copy.py, whose frames lie between."""
    import copy
    import inspect
    simulate_a_gpu(monkeypatch)
    params = make_params(SHAPES, torch.bfloat16)
    opt = optim.AdamW(params, lr=0.1)
    optim.release_gradients(opt)
    sum((p.to(torch.float32) * (float("nan") if i == 1 else 1.0)).sum()
        for i, p in enumerate(params)).backward()  # (the verdicts left unread)
    with pytest.warns(optim.NonFiniteGradientWarning, match="param 1") as rec:
        copy.deepcopy((params, opt)); line = inspect.currentframe().f_lineno  # noqa: E702
    assert [(r.filename, r.lineno) for r in rec] == [(__file__, line)]


def test_a_warning_names_a_libraries_line(monkeypatch, tmp_path):
    """A training library's frame (a module of neither precis, torch nor the standard
    library, wherever it is installed) is the user's: the NonFiniteGradientWarning of a
    param left to opt.step() names the library's line that called it."""
    (tmp_path / "a_trainer.py").write_text("def train_step(opt):\n    opt.step()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import a_trainer
    a, b = make_params([(4,), (3,)], torch.bfloat16, seed=6)
    opt = optim.AdamW([a, b], lr=0.1)
    optim.release_gradients(opt)
    a.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0]).bfloat16()
    b.grad = torch.ones(3).bfloat16()
    with pytest.warns(optim.NonFiniteGradientWarning, match="left to opt.step()") as rec:
        a_trainer.train_step(opt)
    assert [(r.filename, r.lineno) for r in rec] == [(a_trainer.__file__, 2)]


USER_SCRIPT = """\
import sys, warnings
sys.path.insert(0, sys.argv[1])
import torch, precis, precis.optim as optim
p = torch.nn.Parameter(torch.ones(3))
opt = optim.AdamW([p], lr=0.1)
optim.release_gradients(opt)
p.grad = torch.tensor([1.0, float("nan"), 1.0])
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    opt.step()
print(precis.__file__, *[(r.filename, r.lineno) for r in rec])
"""


def test_warnings_name_the_users_line_with_precis_found_through_dotdot(tmp_path):
    """precis imported through a sys.path entry like "examples/../torch_ext" (as the
    examples and some benchmarks add it): its frames' file names keep that form, and
    the warning still names the user's line (the script's opt.step(), line 10)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(precis.__file__)))
    dotdot = os.path.join(root, "..", os.path.basename(root))
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    out = subprocess.run([sys.executable, str(script), dotdot], capture_output=True,
                         text=True, check=True).stdout.split(" ", 1)
    assert ".." in out[0]  # (found through the entry as written)
    assert out[1].strip() == repr((str(script), 10))


def test_max_norm_and_grad_scale_set_later_are_checked():
    """The attributes may change between backwards; a bad value is refused when set,
    naming it, and the old one kept (max_norm 0 divided by zero inside backward)."""
    opt = optim.AdamW(make_params(SHAPES, torch.bfloat16))
    handle = optim.release_gradients(opt, max_norm=1.0, grad_scale=8.0)
    for what in ("max_norm", "grad_scale"):
        for bad in (0.0, -1, float("inf"), True, "2"):
            with pytest.raises(ValueError, match=f"{what} must be a finite number > 0"):
                setattr(handle, what, bad)
    assert (handle.max_norm, handle.grad_scale) == (1.0, 8.0)
    handle.max_norm, handle.grad_scale = None, 4.0
    assert (handle.max_norm, handle.grad_scale) == (None, 4.0)
