"""Gradient release's edge cases (issue 65, item 5), each against the ordinary loop
(backward, clip_grad_norm_, opt.step()) on random data at odd sizes:

* a bad lr (NaN) in any param group raises before any param moves, as step() does;
* torch.utils.checkpoint(use_reentrant=True), a weight used by two segments: the
  ordinary bits (each segment's nested backward adds to the gradient; the param is
  stepped when the outer backward ends); a weight stepped by its gradient from outside
  a segment and then given more by one is refused, naming use_reentrant=False;
* a param frozen when the release was made and unfrozen later is hooked and clipped;
* release_gradients(muon, adamw, max_norm=...): one global norm for both optimizers
  (one bucket each: exact global clipping);
* a float64 param (torch's math) in a one-bucket release: clipped by the global norm.

Clipping with one bucket is exact: an ordinary step(grad_scale=norm / max_norm), norm
the release's last_norm, gives the same bits, and that norm is the global norm made
as the release makes it (each gradient's float64 norm, squared, summed: to rel 1e-12,
the order of the sum), and torch's get_total_norm to rel 1e-6.
"""
import inspect
import math
import re
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import precis  # loads the package, registers the ops
from precis import optim, step_calls

ONE_BUCKET = 10**9


def snapshot(params, opts):
    return [p.detach().clone() for p in params], \
        [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
         for opt in opts for st in opt.state.values()]


def assert_unchanged(before, params, opts):
    now = snapshot(params, opts)
    assert all(torch.equal(a, b) for a, b in zip(before[0], now[0]))
    assert len(before[1]) == len(now[1])
    for a, b in zip(before[1], now[1]):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                   for k in a)


def the_factor(params, max_norm, released_norm=None):
    """The global norm of params' gradients (made as the release makes it) and the
    clipping divisor of exact global clipping; released_norm: the release's norm of the
    same gradients, checked against the global norm and taken for the divisor (the
    same norm, summed in the release's order)."""
    norms = [float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) for p in params
             if p.grad is not None]
    norm = math.sqrt(sum(n * n for n in norms))
    torch_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params
                                                      if p.grad is not None]))
    assert norm == pytest.approx(torch_norm, rel=1e-6)
    if released_norm is not None:
        assert released_norm == pytest.approx(norm, rel=1e-12)
        norm = released_norm
    return norm, max(norm * (1.0 / max_norm), 1.0)


# -- a bad lr ------------------------------------------------------------------

@pytest.mark.parametrize("bad_group", [0, 1])
@pytest.mark.parametrize("bucket_bytes", [0, ONE_BUCKET])
def test_a_bad_lr_in_any_group_raises_before_any_param_moves(bad_group, bucket_bytes):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in (5, 129, 7)]
    opt = optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], lr=1e-2)
    release = optim.release_gradients(opt, bucket_bytes=bucket_bytes)
    for step in range(2):  # the second with state made by the first
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        if step == 1:
            good = opt.param_groups[bad_group]["lr"]
            opt.param_groups[bad_group]["lr"] = float("nan")
            before = snapshot(params, [opt])
            with pytest.raises(ValueError, match=f"Invalid learning rate: nan "
                                                 f"\\(AdamW param group {bad_group}"):
                loss.backward()
            assert_unchanged(before, params, [opt])
            opt.zero_grad()
            opt.param_groups[bad_group]["lr"] = good
            loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        loss.backward()
        opt.step()
        opt.zero_grad()
    release.remove()


@pytest.mark.parametrize("device_path", [False, True])
def test_a_bad_lr_set_between_two_hooks_raises_at_the_next_step_call(monkeypatch, device_path):
    """The groups are checked at a backward's first step call, and each later call of
    that backward skips the check only while its group holds the same values: an lr a
    hook makes NaN after the first param was stepped is refused at the next param's
    call, which leaves that param as it was (on the CPU's path and a GPU's)."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in (5, 129, 7)]
    opt = optim.AdamW(params, lr=1e-2)
    arrived = []

    def nan_lr_after_the_first(p):  # (hooked before the release: runs before its hook)
        arrived.append(p)
        if len(arrived) == 2:
            opt.param_groups[0]["lr"] = float("nan")
    for p in params:
        p.register_post_accumulate_grad_hook(nan_lr_after_the_first)
    optim.release_gradients(opt)
    for step in range(2):  # the second with state made by the first
        arrived.clear()
        opt.param_groups[0]["lr"] = 1e-2
        before = snapshot(params, [opt])
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        with pytest.raises(ValueError, match="Invalid learning rate: nan"):
            loss.backward()
        first, second = (next(i for i, p in enumerate(params) if p is q) for q in arrived)
        assert not torch.equal(params[first], before[0][first])  # stepped
        assert torch.equal(params[second], before[0][second])  # refused
        opt.zero_grad()


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("when", ["between backwards", "in a hook after the param's step"])
def test_a_partial_write_into_remainders_resyncs_its_blocks_as_the_ordinary_loop(
        monkeypatch, device_path, when):
    """A write into one block of a param with remainders (three blocks and five
    elements), between two backwards or in a hook of the user's right after the
    release stepped the param (the ordinary loop: the same write right after its step),
    is resynced at the next backward's compare in that block alone, warned of as such,
    with the ordinary loop's bits in params and state (the blocks a call left recorded
    at the call: one recorded at the backward's end would hide the hook's write)."""
    from precis.optim_state import StaleMasterWarning
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    block = precis.fingerprints.BLOCK
    policy = {"store_param_remainders": True, "param_remainder_bits": 8}

    def made():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16))
              for n in (3 * block + 5, 7)]
        return ps, optim.AdamW(ps, lr=1e-2, weight_decay=0.1, policy=policy)
    (ordinary, opt), (released, released_opt) = made(), made()
    optim.release_gradients(released_opt)
    write_at = [2] if when == "between backwards" else [1, 2]

    def write(p):
        with torch.no_grad():
            p[block + 10:block + 300] *= 0.5
    step_now = [0]
    if when != "between backwards":  # (hooked after the release's: after its step)
        released[0].register_post_accumulate_grad_hook(
            lambda p: write(p) if step_now[0] in write_at else None)
    gen = torch.Generator().manual_seed(1)
    for k in range(4):
        step_now[0] = k
        weights = [torch.randn(p.shape, generator=gen) for p in ordinary]
        warned = []
        for ps, optimizer in ((ordinary, opt), (released, released_opt)):
            if when == "between backwards" and k in write_at:
                write(ps[0])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sum((p.float() * w).sum() for p, w in zip(ps, weights)).backward()
                optimizer.step()
                optimizer.zero_grad()
                if optimizer is opt:  # (a Plan's findings come every 16 steps: looked at
                    optimizer.state_dict()  # once; the release's are its step's own)
            if when != "between backwards" and k in write_at and ps is ordinary:
                write(ps[0])  # the ordinary loop's: right after its step
            warned.append([str(c.message) for c in caught
                           if issubclass(c.category, StaleMasterWarning)])
        assert warned[0] == warned[1], (k, warned)
        found = k - 1 in write_at if when != "between backwards" else k in write_at
        assert len(warned[1]) == found and (not found or (
            f"group 0 param 0: a partial write (its remainders resynced in the blocks of "
            f"{block} elements it touched: {block} of {3 * block + 5} elements; the others "
            f"kept)" in warned[1][0])), (k, warned)
        assert all(torch.equal(a, b) for a, b in zip(ordinary, released)), k
        for a, b in zip(ordinary, released):
            assert all(torch.equal(x, y) for x, y in zip(opt.state[a].values(),
                                                          released_opt.state[b].values()))


@pytest.mark.parametrize("policy", [None, {"store_param_remainders": True}])
def test_a_written_param_no_backward_steps_is_resynced_and_warned_of_once(monkeypatch, policy):
    """On a GPU's path a backward's first step call compares every param; a param written
    behind the optimizer's back that then gets no gradient for backwards is resynced and
    warned of once, as the ordinary loop does, with the ordinary loop's bits: its kept
    call compares it itself (a master's param with its record, remainders' blocks with
    theirs), so when it is next stepped, as the ordinary loop does; its record then the
    param as it is (and its blocks' record)."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")

    def run(release):
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(4097, generator=gen).to(torch.bfloat16))
              for _ in range(2)]
        opt = optim.AdamW(ps, lr=1e-2, policy=policy)
        if release:
            optim.release_gradients(opt)
        g = torch.Generator().manual_seed(1)
        counts = []
        for step, used in enumerate([(0, 1), (0,), (0,), (0,), (0, 1)]):
            if step == 1:
                with torch.no_grad():
                    ps[1][:10] += 1  # written behind the optimizer's back
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                weights = [torch.randn(p.shape, generator=g) for p in ps]
                sum((ps[i].float() * weights[i]).sum() for i in used).backward()
                opt.step()
                opt.zero_grad()
            counts.append(sum(issubclass(c.category, optim.StaleMasterWarning)
                              for c in caught))
            if release and step == 4:
                assert opt._books.written[id(ps[1])] == precis.fingerprints.of([ps[1]])[0]
                if policy is not None:
                    assert torch.equal(opt._books.blocks[id(ps[1])],
                                       precis.fingerprints.of_blocks([ps[1].detach()]))
        return ps, opt, counts
    (ordinary, opt, counts), (released, released_opt, released_counts) = run(False), run(True)
    assert counts == [0, 0, 0, 0, 1], counts  # the ordinary loop: when next stepped
    assert released_counts == counts, released_counts
    assert all(torch.equal(a, b) for a, b in zip(ordinary, released))
    for a, b in zip(ordinary, released):
        assert all(torch.equal(x, y) for x, y in zip(opt.state[a].values(),
                                                      released_opt.state[b].values()))


def two_groups_adamw(policy=None, shapes=((5, 3), (129,), (7,))):
    """bf16 params of shapes in two AdamW groups (the first decayed), seeded alike."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16))
              for s in shapes]
    return params, optim.AdamW([{"params": params[:1], "weight_decay": 0.1},
                                {"params": params[1:]}], lr=1e-2, policy=policy)


def kept_calls_counted(monkeypatch, release):
    """A list that gets, at each released param's step, whether its op call was kept
    (release.kept.kept_call gave it: True) or made anew (step_calls.make_call: False)."""
    again, kept_call, make_call = [], release.kept.kept_call, step_calls.make_call

    def kept(*args):
        call = kept_call(*args)
        if call is not None:
            again.append(True)
        return call

    def made(*args, **kwargs):
        call = make_call(*args, **kwargs)
        if any(id(p) in release._where for p in call.params):
            again.append(False)
        return call
    monkeypatch.setattr(release.kept, "kept_call", kept)
    monkeypatch.setattr(step_calls, "make_call", made)
    return again


def test_a_kept_call_gives_the_ordinary_bits_through_schedules_writes_and_loads(monkeypatch):
    """On a GPU's path a released param's op call is made once and made again at later
    backwards while nothing it was made from changed (KeptCalls.kept_call): bit for
    bit the ordinary loop's through an lr changed at every step (read at every call), a
    write into a param (the kept call's compare and resync), the optimizer's state loaded
    and amsgrad turned on (the calls made anew), each with a write too (a param the
    backward's first call left to its kept call, its call made anew: that call compares
    it); made again at most steps, anew at those. A kept call is stepped alone
    (GradientRelease._step_alone): no walk of step_eager."""
    from precis import functional
    from precis.optim_state import StaleMasterWarning
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    shapes = [(5, 3), (129,), (7,)]
    (ordinary, opt), (released, released_opt) = two_groups_adamw(), two_groups_adamw()
    again = kept_calls_counted(monkeypatch, optim.release_gradients(released_opt))
    walked, step_eager = [], functional.step_eager

    def counted(books, *args, **kwargs):
        walked.append(books is released_opt._books)
        return step_eager(books, *args, **kwargs)
    monkeypatch.setattr(functional, "step_eager", counted)
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleMasterWarning)  # (the writes)
        for step in range(8):
            weights = [torch.randn(s, generator=gen) for s in shapes]
            for params, optimizer in ((ordinary, opt), (released, released_opt)):
                for group in optimizer.param_groups:  # a scheduler's: a new float a step
                    group["lr"] = 1e-2 * 0.9 ** step
                    group["amsgrad"] = step >= 6
                if step in (3, 5, 6):
                    with torch.no_grad():
                        params[1][:10] = 0.5 + step
                if step == 5:
                    optimizer.load_state_dict(optimizer.state_dict())
                sum((p.float() * w).sum() for p, w in zip(params, weights)).backward()
                optimizer.step()
                optimizer.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(ordinary, released)), step
    assert len(again) == 8 * len(shapes)
    # anew at step 0 (none kept), 5 (the state loaded) and 6 (amsgrad on); again else
    assert again == [False] * 3 + [True] * 12 + [False] * 6 + [True] * 3, again
    assert walked.count(True) == again.count(False)  # (the calls made anew, alone)


@pytest.mark.parametrize("bits", [16, 8])
def test_a_kept_call_compares_blocks_against_a_record_its_own_step_did_not_leave(monkeypatch,
                                                                                bits):
    """On a GPU's path a released param with remainders is compared block by block by its
    kept call (fingerprints [out, records, kept]) against its blocks' record, whichever
    step left it: its own last call's, or opt.step()'s of the params no hook stepped (their
    grads given by hand: one call for them all), or reload_model_params()'s after a write;
    bit for bit the ordinary loop's, which the same writes and steps go through."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    policy = {"store_param_remainders": True, "param_remainder_bits": bits}
    (ordinary, opt), (released, released_opt) = two_groups_adamw(policy), \
        two_groups_adamw(policy)
    again = kept_calls_counted(monkeypatch, optim.release_gradients(released_opt))
    gen = torch.Generator().manual_seed(4)
    for step in range(7):
        weights = [torch.randn(p.shape, generator=gen) for p in ordinary]
        for params, optimizer in ((ordinary, opt), (released, released_opt)):
            with torch.no_grad():
                if step == 4:  # a write, then the records made anew by a reload
                    params[1][3:9] = 0.25
                    optimizer.reload_model_params()
                if step == 5:  # a write its kept call's compare finds
                    params[2][0] = -1.0
            if step == 2:  # grads by hand: opt.step() steps them in one call, no hook
                for p, w in zip(params, weights):
                    p.grad = (w * 1e-2).to(p.dtype)
            else:
                sum((p.float() * w).sum() for p, w in zip(params, weights)).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optim.StaleMasterWarning)
                optimizer.step()
            optimizer.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(ordinary, released)), step
        for a, b in zip(ordinary, released):
            assert all(torch.equal(x, y) for x, y in zip(opt.state[a].values(),
                                                          released_opt.state[b].values()))
    # kept but at the first step and opt.step()'s (one call a group: made, not kept)
    assert again == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 12, again


def test_a_policy_mapping_keeps_its_calls_and_a_write_into_it_is_refused_as_a_step_refuses_it(
        monkeypatch):
    """A policy given as a mapping (a YAML config's; fp8 moments and 8-bit remainders
    here) is kept by its value: a released param's call is made again at later
    backwards, bit for bit the ordinary loop's; the mapping written in place (m's dtype
    changed) is seen at the next backward, which refuses the old state's layout as the
    ordinary step() does, before the param moves (a call kept by the mapping's identity
    would step the old layout on)."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    shapes = [(5, 3), (129,), (7,)]

    def made():  # (a mapping each: the test writes into both)
        return two_groups_adamw({"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                                 "store_param_remainders": True, "param_remainder_bits": 8})
    (ordinary, opt), (released, released_opt) = made(), made()
    again = kept_calls_counted(monkeypatch, optim.release_gradients(released_opt))
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        weights = [torch.randn(s, generator=gen) for s in shapes]
        for params, optimizer in ((ordinary, opt), (released, released_opt)):
            sum((p.float() * w).sum() for p, w in zip(params, weights)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(ordinary, released)), step
    assert again == [False] * 3 + [True] * 9
    for optimizer in (opt, released_opt):
        optimizer.param_groups[0]["policy"]["exp_avg_dtype"] = "bf16"  # both groups'
    weights = [torch.randn(s, generator=gen) for s in shapes]
    with pytest.raises(RuntimeError, match="the policy now wants") as ordinary_error:
        sum((p.float() * w).sum() for p, w in zip(ordinary, weights)).backward()
        opt.step()
    before = snapshot(released, [released_opt])
    with pytest.raises(RuntimeError, match="the policy now wants") as released_error:
        sum((p.float() * w).sum() for p, w in zip(released, weights)).backward()
    # (the ordinary step names the first param it gathers, the release its first hook's)
    assert "its exp_avg is torch.uint8" in str(ordinary_error.value)
    assert "its exp_avg is torch.uint8" in str(released_error.value)
    assert_unchanged(before, released, [released_opt])


@pytest.mark.parametrize("bucket_bytes", [20, ONE_BUCKET])
@pytest.mark.parametrize("policy", [None, {"store_param_remainders": True,
                                           "param_remainder_bits": 8}, "fp32"])
def test_a_kept_bucket_gives_the_ordinary_bits_through_schedules_writes_and_loads(
        monkeypatch, policy, bucket_bytes):
    """On a GPU's path a bucket's op calls are made once and made again at its later
    flushes while nothing they were made from changed (KeptCalls.bucket_calls):
    params and state bit for bit the ordinary loop's through an lr changed at every step,
    writes into params (the backward's compare and resync; an fp32 param has no copy to
    resync), the optimizer's state loaded and amsgrad turned on (the calls made anew),
    a gradient with an Inf (the bucket skipped, then stepped a param at a time: that
    param alone left as it was, as the ordinary loop leaves it here without its
    gradient). Made again at every flush but the first, the load's, amsgrad's and the
    next of the bucket stepped a param at a time (its params' calls kept alone then
    dropped it); with a master or remainders its calls compare the params themselves
    (the backward's first compare leaves them: KeptCalls.compares_itself), and the
    StaleMasterWarnings name the params the ordinary loop's name; in buckets of 20
    bytes' worth of bf16 elements (two of two params a backward in one param group, the
    129 elements' and the first param alone) and in one (the two groups' calls)."""
    from precis import optim_state
    from precis.kept_calls import KeptCalls
    from precis.optim_state import StaleMasterWarning
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    shapes = [(5, 3), (129,), (7,), (3, 2), (4,), (6,)]

    def made():
        params, opt = two_groups_adamw(None if policy == "fp32" else policy, shapes)
        if policy == "fp32":  # (fp32 params: no master, no record to keep)
            params, opt = [torch.nn.Parameter(p.detach().float()) for p in params], None
            opt = optim.AdamW([{"params": params[:1], "weight_decay": 0.1},
                               {"params": params[1:]}], lr=1e-2)
        return params, opt
    (ordinary, opt), (released, released_opt) = made(), made()
    # (20 bytes: 10 elements of bf16, 5 of fp32's)
    release = optim.release_gradients(released_opt, bucket_bytes=bucket_bytes * (
        2 if policy == "fp32" and bucket_bytes == 20 else 1))
    kept, bucket_calls = [], KeptCalls.bucket_calls

    def counted(self, params, *args):  # (step, the bucket's params, whether kept)
        calls = bucket_calls(self, params, *args)
        kept.append((step, {id(p) for p in params}, calls is not None))
        return calls
    monkeypatch.setattr(KeptCalls, "bucket_calls", counted)
    gen = torch.Generator().manual_seed(5)
    named = {id(opt): set(), id(released_opt): set()}  # by each loop's StaleMasterWarnings

    def warned(optimizer, caught):
        named[id(optimizer)].update(name for w in caught if w.category is StaleMasterWarning
                                    for name in re.findall(r"group \d+ param \d+",
                                                           str(w.message)))
    for step in range(9):
        weights = [torch.randn(s, generator=gen) for s in shapes]
        if step == 7:  # an Inf in the third param's gradient
            weights[2][1] = float("inf")
        for params, optimizer in ((ordinary, opt), (released, released_opt)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", StaleMasterWarning)  # (the writes)
                warnings.simplefilter("ignore", optim.NonFiniteGradientWarning)
                for group in optimizer.param_groups:  # a scheduler's: a new float a step
                    group["lr"] = 1e-2 * 0.9 ** step
                    group["amsgrad"] = step >= 6
                if step in (3, 5, 6):
                    with torch.no_grad():
                        params[0][1] = 0.5 + step
                        params[3][0] = -0.25 * step
                if step == 5:
                    optimizer.load_state_dict(optimizer.state_dict())
                sum((p.float() * w).sum() for p, w in zip(params, weights)).backward()
                if optimizer is opt and step == 7:  # (the ordinary loop: no grad scale,
                    ordinary[2].grad = None  # nothing checked; the param left out by hand)
                optimizer.step()
                optimizer.zero_grad()
            warned(optimizer, caught)
        if step == 7:
            assert release.skipped == ["AdamW param 1 of group 1"]
        # (the records the steps left: what they wrote, so no param is taken for written
        # at the next backward)
        assert not optim_state.written_behind(released_opt._books, released), step
        assert all(torch.equal(a, b) for a, b in zip(ordinary, released)), step
        for a, b in zip(ordinary, released):
            assert opt.state[a].keys() == released_opt.state[b].keys(), step
            assert all(torch.equal(opt.state[a][k], released_opt.state[b][k])
                       for k in opt.state[a]), step
    assert len(kept) == 9 * (2 if bucket_bytes == 20 else 1), kept
    assert all(was == (step not in (0, 5, 6) and not (step == 8 and id(released[2]) in ids))
               for step, ids, was in kept), kept
    for optimizer in (opt, released_opt):  # (the warnings still to give: given now)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StaleMasterWarning)
            optimizer.state_dict()
        warned(optimizer, caught)
    # the same params named (a fp32 param has no copy to resync: none)
    assert named[id(released_opt)] == named[id(opt)], named
    assert named[id(opt)] == (set() if policy == "fp32" else
                              {"group 0 param 0", "group 1 param 2"}), named


def test_a_resume_checks_the_loaded_remainders_once(monkeypatch):
    """Remainders loaded with the optimizer's state belong to the bits their params were
    saved with: a resume that loads the optimizer first and the model's weights after
    keeps them for the next step to check (books.fingerprints), kept where the params hold
    the saved bits by then, and once checked they are forgotten (else the compare of
    every backward after would run on the host). Bit for bit the ordinary loop's through
    the same resume; a load where the params hold the saved bits already keeps nothing
    to check."""
    from precis import release as release_module
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    policy = {"store_param_remainders": True, "param_remainder_bits": 8}
    (ordinary, opt), (released, released_opt) = two_groups_adamw(policy), \
        two_groups_adamw(policy)
    optim.release_gradients(released_opt)
    on_device, written_behind = [], release_module.GradientRelease._written_behind

    def compared(self):  # (whether a backward's first compare ran on the device)
        written = written_behind(self)
        on_device.append(isinstance(written, dict))
        return written
    monkeypatch.setattr(release_module.GradientRelease, "_written_behind", compared)
    gen = torch.Generator().manual_seed(6)
    saved = {}
    for step in range(6):
        weights = [torch.randn(p.shape, generator=gen) for p in ordinary]
        for params, optimizer in ((ordinary, opt), (released, released_opt)):
            if step == 1:  # a checkpoint: the optimizer's state and the model's weights
                saved[id(optimizer)] = (optimizer.state_dict(),
                                        [p.detach().clone() for p in params])
            if step == 4:  # resumed from it: the optimizer first, then the weights
                state, bits = saved[id(optimizer)]
                optimizer.load_state_dict(state)
                assert len(optimizer._books.fingerprints) == len(params)  # (not yet theirs)
                with torch.no_grad():
                    for p, b in zip(params, bits):
                        p.copy_(b)
            with warnings.catch_warnings():
                warnings.simplefilter("error", optim.StaleMasterWarning)  # (kept: no resync)
                sum((p.float() * w).sum() for p, w in zip(params, weights)).backward()
                optimizer.step()
            optimizer.zero_grad()
            assert not optimizer._books.fingerprints, step
        assert all(torch.equal(a, b) for a, b in zip(ordinary, released)), step
        for a, b in zip(ordinary, released):
            assert all(torch.equal(opt.state[a][k], released_opt.state[b][k])
                       for k in opt.state[a]), step
    # (the resumed backward's calls made anew, for the loaded state: they compare, and
    # check the loaded remainders, themselves; the first compare leaves them)
    assert on_device == [True] * 6, on_device
    state, bits = saved[id(opt)]  # (the weights first: nothing left to check)
    with torch.no_grad():
        for p, b in zip(ordinary, bits):
            p.copy_(b)
    opt.load_state_dict(state)
    assert not opt._books.fingerprints


def test_a_bad_lr_in_the_other_optimizer_of_a_pair_raises_before_any_param_moves():
    gen = torch.Generator().manual_seed(1)
    matrix, bias = torch.nn.Parameter(torch.randn(13, 7, generator=gen)), \
        torch.nn.Parameter(torch.randn(7, generator=gen))
    muon, adamw = optim.Muon([matrix], lr=2e-2), optim.AdamW([bias], lr=1e-2)
    optim.release_gradients(muon, adamw)
    adamw.param_groups[0]["lr"] = float("nan")
    before = snapshot([matrix, bias], [muon, adamw])
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        (torch.randn(5, 13, generator=gen) @ matrix + bias).square().sum().backward()
    assert_unchanged(before, [matrix, bias], [muon, adamw])


# -- reentrant activation checkpointing -------------------------------------------

def shared_weight_model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.3)
            for s in ((9, 11), (11, 11), (11, 3), (11,))]


def two_segments(params, x):
    """w used by both checkpointed segments, w0 and w2 outside them."""
    w0, w, w2, bias = params
    h = torch.tanh(x @ w0)
    h = checkpoint(lambda t: torch.tanh(t @ w + bias), h, use_reentrant=True)
    h = checkpoint(lambda t: torch.tanh(t @ w), h, use_reentrant=True)
    return (h @ w2).square().mean()


def all_in_one_segment(params, x):
    """Every param inside the segment: no hook of the outer backward comes."""
    return checkpoint(two_segments, params, x, use_reentrant=True)


def train(forward, release, steps=3, max_norm=None, **release_kwargs):
    params = shared_weight_model()
    opt = optim.AdamW(params, lr=1e-2)
    if release:
        handle = optim.release_gradients(opt, max_norm=max_norm, **release_kwargs)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        x = torch.randn(4, 9, generator=gen).requires_grad_()
        forward(params, x).backward()
        if release:
            opt.step()
            norms.append(handle.last_norm)
        elif max_norm is not None:
            norm, factor = the_factor(params, max_norm)
            norms.append(norm)
            opt.step(grad_scale=factor)
        else:
            opt.step()
        opt.zero_grad()
    return params, opt, norms


@pytest.mark.parametrize("forward", [two_segments, all_in_one_segment])
@pytest.mark.parametrize("bucket_bytes", [0, 100, ONE_BUCKET])
def test_reentrant_checkpointing_gives_the_ordinary_bits(forward, bucket_bytes):
    a, opt_a, _ = train(forward, release=False)
    b, opt_b, _ = train(forward, release=True, bucket_bytes=bucket_bytes)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(a, b):
        for key, value in opt_a.state[x].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b.state[y][key]))


@pytest.mark.parametrize("forward", [two_segments, all_in_one_segment])
def test_reentrant_checkpointing_is_clipped_by_the_global_norm(forward):
    a, _, norms_a = train(forward, release=False, max_norm=0.05)
    b, _, norms_b = train(forward, release=True, max_norm=0.05, bucket_bytes=ONE_BUCKET)
    assert norms_b == pytest.approx(norms_a, rel=1e-12) and min(norms_a) > 0.05
    for x, y in zip(a, b):
        assert torch.allclose(x, y, rtol=0, atol=1e-6)


def test_a_weight_stepped_before_its_segment_gives_more_is_refused_naming_it():
    """w used in a segment and after it, outside: its outer gradient comes first (and
    is stepped), then the segment's; refused, naming use_reentrant=False. The next
    backward defers it from the start and gives the ordinary bits from there."""
    def forward(params, x):
        w, w2 = params[1], params[2]
        h = checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=True)
        return (torch.tanh(h @ w) @ w2).square().mean()
    params = shared_weight_model()
    opt = optim.AdamW(params[1:3], lr=1e-2)
    optim.release_gradients(opt)
    x = torch.randn(4, 11).requires_grad_()
    with pytest.raises(RuntimeError, match="AdamW param 0 of group 0 got a gradient inside a "
                                           "reentrant checkpoint.*use_reentrant=False"):
        forward(params, x).backward()
    opt.zero_grad()
    ref = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = optim.AdamW(ref[1:3], lr=1e-2)
    ref_opt.load_state_dict(opt.state_dict())
    for _ in range(2):
        forward(params, x).backward()
        opt.step()
        forward(ref, x).backward()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(params, ref))


def test_a_nan_in_a_segment_alone_is_named_at_the_line_of_opt_step():
    """Every param in one reentrant segment: no hook of the outer backward comes, so
    opt.step() steps them (as their backward's end would have); a NaN gradient leaves
    its param as it was, named in a warning that points at the opt.step() line (not
    a frame of torch or precis), as the hooks' and step_left's warnings do."""
    w = torch.nn.Parameter(torch.randn(5, 3))
    bias = torch.nn.Parameter(torch.randn(3))
    opt = optim.AdamW([w, bias], lr=1e-2)
    release = optim.release_gradients(opt)
    x = torch.randn(4, 5)
    x[1, 2] = float("nan")  # (w's gradient NaN; bias's, of the sum, finite)
    x.requires_grad_()  # (a reentrant segment runs its backward only for such inputs)
    before = w.detach().clone()
    checkpoint(lambda t: t @ w + bias, x, use_reentrant=True).sum().backward()
    with pytest.warns(optim.NonFiniteGradientWarning,
                      match="1 params of the last backward") as rec:
        opt.step(); line = inspect.currentframe().f_lineno  # noqa: E702 (the line named)
    assert (rec[0].filename, rec[0].lineno) == (__file__, line)
    assert release.skipped == ["AdamW param 0 of group 0"] and torch.equal(w, before)
    assert opt.state[bias]["step"] == 1 and opt.last_step_skipped is False


# -- a param unfrozen after the release was made ----------------------------------

@pytest.mark.parametrize("bucket_bytes", [0, ONE_BUCKET])
def test_a_param_unfrozen_later_is_hooked_and_clipped(bucket_bytes):
    """Frozen when the release is made, trainable from the second step on: its gradient
    is freed in backward and counted in max_norm's norm (one bucket: the bits of exact
    global clipping; one param at a time: the last call's estimate is exact, so the
    backward's norm is the ordinary loop's)."""
    def build():
        gen = torch.Generator().manual_seed(2)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in (33, 17, 5)]
        ps[1].requires_grad_(False)
        return ps
    a, b = build(), build()
    opt_a, opt_b = optim.AdamW(a, lr=1e-2), optim.AdamW(b, lr=1e-2)
    release = optim.release_gradients(opt_b, max_norm=0.5, bucket_bytes=bucket_bytes)
    freed = []
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for step in range(3):
        if step == 1:
            a[1].requires_grad_(True)
            b[1].requires_grad_(True)
        sum((p * torch.randn(p.shape, generator=gen_b)).sum() for p in b).backward()
        freed.append(b[1].grad is None)
        opt_b.step()
        opt_b.zero_grad()
        sum((p * torch.randn(p.shape, generator=gen_a)).sum() for p in a).backward()
        _, factor = the_factor(a, 0.5, release.last_norm)
        opt_a.step(grad_scale=factor)
        opt_a.zero_grad()
        if bucket_bytes:
            assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert freed == [True, True, True]
    assert not torch.equal(b[1], build()[1])  # stepped since it was unfrozen


# -- several optimizers, one norm --------------------------------------------------

def muon_adamw_pair(release, bucket_bytes=ONE_BUCKET, max_norm=0.1, steps=3,
                    released_norms=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(19, 31), torch.nn.Tanh(),
                                torch.nn.Linear(31, 5))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    muon, adamw = optim.Muon(matrices, lr=2e-2), optim.AdamW(others, lr=1e-2)
    handle = optim.release_gradients(muon, adamw, max_norm=max_norm,
                                     bucket_bytes=bucket_bytes) if release else None
    gen = torch.Generator().manual_seed(2)
    norms = []
    for step in range(steps):
        x = torch.randn(7, 19, generator=gen)
        (model(x).square().mean() * 10).backward()
        if release:
            norms.append(handle.last_norm)
            muon.step()
            adamw.step()
        else:
            norm, factor = the_factor(list(model.parameters()), max_norm,
                                      None if released_norms is None else released_norms[step])
            norms.append(norm)
            muon.step(grad_scale=factor)
            adamw.step(grad_scale=factor)
        muon.zero_grad()
        adamw.zero_grad()
    return list(model.parameters()), norms, (handle, muon, adamw)  # (a release holds
    # its optimizer weakly)


def test_one_norm_clips_a_muon_and_adamw_pair_as_the_ordinary_loop():
    b, norms_b, (handle, *optimizers) = muon_adamw_pair(release=True)
    a, norms_a, _ = muon_adamw_pair(release=False, released_norms=norms_b)
    assert min(norms_a) > 0.1
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert isinstance(handle, optim.GradientReleases) and handle.skipped == []
    handle.remove()
    assert all(opt._books.release is None for opt in optimizers)


def test_one_norm_one_param_at_a_time_is_the_global_norm():
    """Without buckets the estimate's last call is exact: the backward's norm is the
    pair's global norm (each optimizer's own would be smaller)."""
    _, norms_a, _ = muon_adamw_pair(release=False, bucket_bytes=0, steps=1)
    _, norms_b, _ = muon_adamw_pair(release=True, bucket_bytes=0, steps=1)
    assert norms_b == pytest.approx(norms_a, rel=1e-12)


def test_several_optimizers_bad_input_leaves_no_hook():
    gen = torch.Generator().manual_seed(0)
    p, q = (torch.nn.Parameter(torch.randn(5, generator=gen)) for _ in range(2))
    first, second = optim.AdamW([p]), optim.AdamW([q])
    with pytest.raises(ValueError, match="AdamW is given twice"):
        optim.release_gradients(first, first)
    with pytest.raises(ValueError, match="a param of SGD is also in AdamW"):
        optim.release_gradients(first, optim.SGD([p, q], lr=0.1))
    with pytest.raises(TypeError, match="SGD is not a precis optimizer"):
        optim.release_gradients(first, torch.optim.SGD([q], lr=0.1))
    optim.release_gradients(second)
    with pytest.raises(ValueError, match="already in release mode"):
        optim.release_gradients(first, second)
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        optim.release_gradients(first, optim.AdamW([torch.nn.Parameter(torch.ones(2))]),
                                max_norm=-1.0)
    assert first._books.release is None  # nothing left behind: the ordinary loop runs
    (p * 2).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first.step()
    assert first.state[p]["step"] == 1


# -- a float64 param in one bucket -------------------------------------------------

@pytest.mark.parametrize("bucket_bytes", [ONE_BUCKET, 13 * 8 + 29 * 4 + 21 * 8])
def test_a_float64_param_in_one_bucket_is_clipped_by_the_global_norm(bucket_bytes):
    """One bucket flushed when backward ends, or by its last gradient (its bytes
    exactly: inside backward); the float64 params are stepped by torch's math."""
    def build():
        gen = torch.Generator().manual_seed(4)
        return [torch.nn.Parameter(torch.randn(13, dtype=torch.float64, generator=gen)),
                torch.nn.Parameter(torch.randn(29, generator=gen)),
                torch.nn.Parameter(torch.randn(3, 7, dtype=torch.float64, generator=gen))]
    a, b = build(), build()
    # the ordinary loop: the kernel's param by step(grad_scale=), torch's math's (which
    # takes no grad_scale) on gradients divided as the release divides them
    opt_a32 = optim.AdamW(a[1:2], lr=1e-2)
    opt_a64 = optim.AdamW(a[::2], lr=1e-2)
    opt_b = optim.AdamW(b, lr=1e-2)
    release = optim.release_gradients(opt_b, max_norm=0.5, bucket_bytes=bucket_bytes)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):
        sum((p * torch.randn(p.shape, generator=gen_b, dtype=p.dtype)).sum()
            for p in b).backward()
        opt_b.step()
        opt_b.zero_grad()
        sum((p * torch.randn(p.shape, generator=gen_a, dtype=p.dtype)).sum()
            for p in a).backward()
        norm, factor = the_factor(a, 0.5, release.last_norm)
        assert factor > 1.0
        opt_a32.step(grad_scale=factor)
        for p in a[::2]:
            p.grad.div_(factor)
        opt_a64.step()
        opt_a32.zero_grad()
        opt_a64.zero_grad()
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_a_bad_lr_is_refused_before_opt_step_steps_the_params_no_hook_saw():
    """A gradient set by hand (no hook saw it: opt.step() steps it), a NaN lr in another
    group: refused before that param moves, as the ordinary step() refuses it."""
    gen = torch.Generator().manual_seed(6)
    p, q = (torch.nn.Parameter(torch.randn(11, generator=gen)) for _ in range(2))
    opt = optim.SGD([{"params": [p]}, {"params": [q]}], lr=0.1, momentum=0.9)
    optim.release_gradients(opt)
    opt.param_groups[1]["lr"] = float("nan")
    p.grad = torch.randn(11, generator=gen)
    before = snapshot([p, q], [opt])
    with pytest.raises(ValueError, match="SGD param group 1"):
        opt.step()
    assert_unchanged(before, [p, q], [opt])


@pytest.mark.parametrize("waits", [False, True])
def test_a_bucket_with_a_nan_stepped_again_keeps_the_flush_divisor(monkeypatch, waits):
    """One bucket, max_norm, a NaN in one gradient: the bucket's call is skipped and its
    params stepped again one at a time, each by the flush's divisor (the global norm of
    the finite gradients), on the host's path also where a call of one param would
    leave its norm on the device (capturable, the CPU taken for a GPU: waits)."""
    from precis import release as release_module
    if waits:
        monkeypatch.setattr(release_module, "waits_for", lambda device: True)

    def build():
        gen = torch.Generator().manual_seed(7)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in (31, 6, 17)]
    a, b = build(), build()
    opt_a = optim.AdamW(a, lr=1e-2, capturable=True)
    opt_b = optim.AdamW(b, lr=1e-2, capturable=True)
    release = optim.release_gradients(opt_b, max_norm=0.5, bucket_bytes=ONE_BUCKET)
    gen = torch.Generator().manual_seed(8)
    targets = [torch.randn(p.shape, generator=gen) for p in a]
    targets[1][2] = float("nan")
    with pytest.warns(optim.NonFiniteGradientWarning, match="AdamW param 1 of group 0"):
        sum((p * t).sum() for p, t in zip(b, targets)).backward()
    opt_b.step()
    sum((p * t).sum() for p, t in zip(a, targets)).backward()
    a[1].grad = None  # (the NaN's param is left as it was)
    _, factor = the_factor(a, 0.5, release.last_norm)
    assert factor > 1.0 and release.skipped == ["AdamW param 1 of group 0"]
    opt_a.step(grad_scale=factor)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


# -- what the ordinary loop takes, released too ------------------------------------


def sparse_embedding_run(release, offload, max_norm, steps=3):
    """SGD (momentum) on nn.Embedding(sparse=True): torch's math steps its sparse
    gradient; the ordinary loop clips it by the norm of its coalesced values (an index
    given twice summed), as the release's one param alone is clipped."""
    emb = torch.nn.Embedding(11, 3, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(11, 3, generator=torch.Generator().manual_seed(3)))
    opt = optim.SGD(emb.parameters(), lr=0.1, momentum=0.9,
                    **(dict(offload="cpu") if offload else {}))
    released = optim.release_gradients(opt, max_norm=max_norm) if release else None
    for k in range(steps):
        emb(torch.tensor([1, 2, 2, 7 + k])).pow(2).sum().backward()
        if max_norm is not None and not release:
            norm = float(torch.linalg.vector_norm(emb.weight.grad.coalesce().values(),
                                                  dtype=torch.float64))
            factor = max(norm * (1.0 / max_norm), 1.0)
            assert factor > 1.0
            emb.weight.grad.div_(factor)
        opt.step()
        opt.zero_grad()
    if released is not None:
        released.remove()
    return emb.weight.detach()


@pytest.mark.parametrize("max_norm", [None, 0.5])
@pytest.mark.parametrize("offload", [False, True])
def test_a_sparse_gradient_is_stepped_as_the_ordinary_loop_steps_it(max_norm, offload):
    """A sparse gradient, released or offloaded: the ordinary loop's bits (both raised
    torch's sparse errors inside backward: the release's finiteness check and norm, the
    offload's copy of the gradient to the host)."""
    ordinary = sparse_embedding_run(False, False, max_norm)
    assert torch.equal(sparse_embedding_run(False, offload, max_norm), ordinary)
    assert torch.equal(sparse_embedding_run(True, offload, max_norm), ordinary)


def test_a_complex_param_is_clipped_by_its_norm():
    """complex64 params with max_norm (the release's norm was asked in float64 of a
    complex gradient, which torch refuses): one bucket, the ordinary loop's bits with
    step(grad_scale=) by the global norm, its |z|^2 summed."""
    def build():
        gen = torch.Generator().manual_seed(9)
        return [torch.nn.Parameter(torch.randn(s, dtype=torch.complex64, generator=gen))
                for s in ((8, 4), (127,))]
    a, b = build(), build()
    opt_a, opt_b = optim.AdamW(a, lr=1e-2), optim.AdamW(b, lr=1e-2)
    release = optim.release_gradients(opt_b, max_norm=0.1, bucket_bytes=ONE_BUCKET)
    for k in range(3):
        gen = torch.Generator().manual_seed(k)
        targets = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in a]
        sum(((p * t).abs() ** 2).sum() for p, t in zip(b, targets)).backward()
        opt_b.step()
        sum(((p * t).abs() ** 2).sum() for p, t in zip(a, targets)).backward()
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(
            torch.view_as_real(p.grad), dtype=torch.float64)) ** 2 for p in a))
        assert release.last_norm == pytest.approx(norm, rel=1e-12)
        factor = max(release.last_norm * (1.0 / 0.1), 1.0)
        assert factor > 1.0
        opt_a.step(grad_scale=factor)
        opt_a.zero_grad()
        opt_b.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_dropped_optimizer_is_freed_at_once_and_its_hooks_do_nothing():
    """A resume that builds a new optimizer without remove(): the old one, which its
    release held (a cycle through its books), lived on until a garbage collection, its
    hooks stepping the params and freeing their gradients, so that the new one stepped
    nothing and the next backward raised ("got a second gradient")."""
    import gc
    import weakref
    lin = torch.nn.Linear(5, 3)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    enabled = gc.isenabled()
    gc.disable()  # (freed by its count of references, not by a collection)
    try:
        old = optim.AdamW(lin.parameters(), lr=1e-2)
        optim.release_gradients(old)
        lin(x).pow(2).sum().backward()
        old.step()
        saved, dropped = old.state_dict(), weakref.ref(old)
        del old
        assert dropped() is None
        new = optim.AdamW(lin.parameters(), lr=1e-2)
        new.load_state_dict(saved)
        optim.release_gradients(new)
        for _ in range(2):
            lin(x).pow(2).sum().backward()
            new.step()
        assert all(float(new.state[p]["step"]) == 3.0 for p in lin.parameters())
    finally:
        if enabled:
            gc.enable()


def test_a_gradient_set_by_hand_after_its_param_was_stepped_is_refused():
    """A gradient set after backward on a param the release stepped inside it: the
    ordinary loop steps with it; opt.step() dropped it silently. Now refused, naming the
    param, before opt.step() steps anything (a param no hook saw keeps its gradient)."""
    lin = torch.nn.Linear(4, 4)
    extra = torch.nn.Parameter(torch.ones(3))
    opt = optim.SGD([{"params": lin.parameters()}, {"params": [extra]}], lr=0.1)
    optim.release_gradients(opt)
    lin(torch.ones(2, 4)).pow(2).sum().backward()
    lin.bias.grad = torch.full((4,), 100.0)
    extra.grad = torch.ones(3)  # (no hook stepped it: opt.step() would)
    before = snapshot([*lin.parameters(), extra], [opt])
    with pytest.raises(RuntimeError, match=r"SGD param 1 of group 0 was stepped inside "
                                           r"backward and holds a gradient set since"):
        opt.step()
    assert_unchanged(before, [*lin.parameters(), extra], [opt])
    opt.zero_grad()  # (drops it: the next step is an ordinary released one)
    lin(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()


def test_a_group_added_with_a_param_of_an_optimizer_released_with_it_is_refused():
    """release_gradients(o1, o2) refuses a param of both; a group that o1 adds later
    with one of o2's was taken, hooked twice, and stepped by o2 alone."""
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    o1, o2 = optim.AdamW(a.parameters(), lr=0.1), optim.AdamW(b.parameters(), lr=0.1)
    optim.release_gradients(o1, o2)
    hooks = len(b.weight._post_accumulate_grad_hooks)
    with pytest.raises(ValueError, match=r"AdamW param 0 of group 1 is also in AdamW, "
                                         r"released with it: it would be stepped twice"):
        o1.add_param_group({"params": [b.weight]})
    assert len(o1.param_groups) == 1 and len(b.weight._post_accumulate_grad_hooks) == hooks


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("bucket_bytes", [0, ONE_BUCKET])
def test_every_released_step_bumps_the_params_autograd_version(monkeypatch, device_path,
                                                               bucket_bytes):
    """A released step writes its params in place, as torch's step does: each bumps their
    versions (a graph that saved one before raises at its backward), also the steps of
    the calls the release keeps (from the second backward on), which did not."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    lin = torch.nn.Linear(5, 3)
    opt = optim.AdamW(lin.parameters(), lr=1e-2)
    optim.release_gradients(opt, bucket_bytes=bucket_bytes)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    for _ in range(4):
        versions = [p._version for p in lin.parameters()]
        lin(x).square().sum().backward()
        assert all(p._version > v for p, v in zip(lin.parameters(), versions))
        opt.step()


def test_a_pair_whose_other_optimizer_was_dropped_steps_on():
    """release_gradients(a, b), b dropped (rebuilt at a resume): the pair's handle kept b's
    release alive, whose dead optimizer the next backward's group check read
    (AttributeError inside backward)."""
    import gc
    lin, other = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    a = optim.AdamW(lin.parameters(), lr=1e-2)
    b = optim.AdamW(other.parameters(), lr=1e-2)
    enabled = gc.isenabled()
    gc.disable()
    try:
        pair = optim.release_gradients(a, b)
        del b
        before = [p.detach().clone() for p in lin.parameters()]
        lin(torch.ones(2, 5)).square().sum().backward()
        a.step()
        assert not any(torch.equal(p, q) for p, q in zip(lin.parameters(), before))
        pair.remove()
    finally:
        if enabled:
            gc.enable()


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


def test_a_backward_that_raised_leaves_its_ready_gradients_to_opt_step():
    """One bucket, a backward that raised after some gradients were ready (not stepped
    yet): opt.step() steps them, as the ordinary loop does (it refused them as gradients
    "set by hand" on params the hooks stepped)."""
    runs = []
    for release in (False, True):
        torch.manual_seed(0)
        first, second = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
        opt = optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-2)
        if release:
            optim.release_gradients(opt, bucket_bytes=ONE_BUCKET)
        with pytest.raises(RuntimeError, match="boom"):
            second(_Boom.apply(first(torch.ones(2, 5)))).square().sum().backward()
        opt.step()
        runs.append([p.detach().clone() for p in (*first.parameters(), *second.parameters())])
    assert all(torch.equal(p, q) for p, q in zip(*runs))
