"""ops.HeldStep (precis::hold_step, precis::held_step_): an adam_step_ call held on the C
side, made again with its grads, step count, lr, grad scale, flag and fingerprints; and a
released param's kept call stepped through it."""
import gc
import weakref

import pytest
import torch

import precis
from precis import ops, step_calls

SIZES = (1, 127, 4097)
POLICIES = {
    "default": None,
    "fp8_rem8": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                 "store_param_remainders": True, "param_remainder_bits": 8},
}


def made_calls(monkeypatch, optimizer_class, policy, **options):
    """bf16 params of SIZES, a precis optimizer released on the device path, and the op
    call the full path made for each (after two backwards), by id(param)."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16))
              for n in SIZES]
    opt = optimizer_class(params, lr=1e-2, policy=policy, **options)
    calls, make_call = {}, step_calls.make_call

    def kept(*args, **kwargs):
        call = make_call(*args, **kwargs)
        calls[id(call.params[0])] = call
        return call
    monkeypatch.setattr(step_calls, "make_call", kept)
    release = precis.optim.release_gradients(opt)
    for _ in range(2):
        sum((p.float() ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    monkeypatch.setattr(step_calls, "make_call", make_call)
    return params, opt, calls, release


def snapshot(p, state):
    return [p.detach().clone()] + [v.clone() for v in state.values()]


def restore(p, state, saved):
    with torch.no_grad():
        p.copy_(saved[0])
        for value, was in zip(state.values(), saved[1:]):
            value.copy_(was)


def fresh(fingerprints):
    """A call's fingerprints as the release passes them at a step: a fresh out (the
    record list after it as it is)."""
    if isinstance(fingerprints, list):
        return [torch.empty_like(fingerprints[0]), *fingerprints[1:]]
    return [] if fingerprints is None else [torch.empty_like(fingerprints)]


@pytest.mark.parametrize("rule_hyper", [(), (0.0,)])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("optimizer_class", [precis.optim.AdamW, precis.optim.Lion],
                         ids=["adamw", "lion"])
def test_a_held_call_gives_the_op_calls_bits_and_counts_its_step(monkeypatch, optimizer_class,
                                                                  policy, rule_hyper):
    """For each param (1, 127, 4097 elements), its kept call held (.rule, or .hyper with
    rule_hyper) and made again with a gradient, an lr, a grad scale and the step count
    writes the bits of the op called with the same arguments and step count + 1 (the
    params, every state tensor, the fingerprints out, the flag), three times over, and
    its count steps as torch's float32 `step += 1`; a non-finite gradient sets the flag,
    leaves the param, and the count still steps (the caller takes it back)."""
    params, opt, calls, _ = made_calls(monkeypatch, optimizer_class, POLICIES[policy])
    gen = torch.Generator().manual_seed(1)
    for p in params:
        call, state = calls[id(p)], opt.state[p]
        args = {**call.args, "rule_hyper": rule_hyper} if rule_hyper else call.args
        held = ops.HeldStep(**args, inv_grad_scale_tensor=None)
        for k in range(4):
            grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            if k == 3:
                grad[-1] = float("inf")
            lr, inv_grad_scale = 1e-2 / (k + 1), 1.0 / 2 ** k
            before = snapshot(p, state)
            count = float(state["step"])
            op_out, op_flag = fresh(call.args["fingerprints"]), torch.zeros(1)
            call.op()(**{**args, "grads": [grad], "steps": [int(count) + 1], "lr": lr,
                         "fingerprints": op_out},
                      inv_grad_scale=inv_grad_scale, inv_grad_scale_tensor=None,
                      check_finite=True, found_inf=op_flag)
            by_op = snapshot(p, state)
            restore(p, state, before)
            out, flag = fresh(call.args["fingerprints"]), torch.zeros(1)
            held([p], [grad], state["step"], lr, inv_grad_scale, flag, out)
            assert float(state["step"]) == count + 1  # (the op call left it as it was)
            state["step"].sub_(1.0)
            assert all(torch.equal(a, b) for a, b in zip(snapshot(p, state), by_op)), (p.numel(), k)
            assert all(torch.equal(a, b) for a, b in zip(out, op_out))
            assert torch.equal(flag, op_flag) and float(flag) == (1.0 if k == 3 else 0.0)
            if k == 3:  # (skipped: the param not written; with remainders the blocks'
                # compare against the call's first record still zeroes theirs, as the op's)
                assert torch.equal(p, before[0])
            else:  # (the state moved: a step, not two calls that did nothing)
                assert not all(torch.equal(a, b) for a, b in zip(by_op[1:], before[1:]))
                state["step"].add_(1.0)  # (the step taken: counted)


def test_a_held_call_checks_its_tensors_at_every_call_and_is_let_go_of(monkeypatch):
    """A held call reads its tensors again at every call: a param resized in place (its
    data replaced) is refused with the op's words, nothing written; a step count of
    another dtype, shape or device is refused by name, the count and params untouched;
    once the HeldStep is collected its id is refused ("no held call")."""
    params, opt, calls, _ = made_calls(monkeypatch, precis.optim.AdamW, None)
    p = params[1]
    call, state = calls[id(p)], opt.state[p]
    held = ops.HeldStep(**call.args, inv_grad_scale_tensor=None)
    grad = torch.full(p.shape, 1e-2, dtype=p.dtype)
    before = snapshot(p, state)
    # (a one-byte count: refused before its value is read)
    for count, words in [(torch.zeros((), dtype=torch.uint8), "got 1 uint8 values"),
                         (torch.zeros((), dtype=torch.float64), "got 1 float64 values"),
                         (torch.zeros(2), "got 2 float32 values"),
                         (torch.tensor(-1.0), "is -1;"),
                         (torch.tensor(float("nan")), "is nan;")]:
        with pytest.raises(RuntimeError, match=f"precis.held_step_: step_count.*{words}"):
            held([p], [grad], count, 1e-2, 1.0, torch.zeros(1), [])
        assert all(torch.equal(a, b) for a, b in zip(snapshot(p, state), before))
    with torch.no_grad():
        p.data = torch.zeros(p.numel() + 1, dtype=p.dtype)  # (the held param resized)
    count = state["step"].clone()
    with pytest.raises(RuntimeError, match=r"precis.adam_step_: .*(128|127)"):
        held([p], [torch.zeros(p.numel(), dtype=p.dtype)], count, 1e-2, 1.0, torch.zeros(1),
             [])
    assert torch.equal(count, state["step"]) and not p.any()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(p, state)[1:], before[1:]))
    number = held.held
    del held
    gc.collect()
    with pytest.raises(RuntimeError, match=f"precis.held_step_: no held call {number}"):
        torch.ops.precis.held_step_(number, [p], [grad], state["step"], 1e-2, 1.0,
                                    torch.zeros(1), [])


def test_a_release_holds_its_kept_calls_and_lets_go_when_they_are_made_anew(monkeypatch):
    """A released backward on the device path steps each param by its kept call held on
    the C side (one HeldStep a param, made at its second backward and kept after); a
    state loaded (its tensors replaced) makes the calls anew and lets the held ones go
    (their ids refused by the C side once collected), as remove() does; the bits stay the
    ordinary loop's (test_release_edges)."""
    params, opt, _, release = made_calls(monkeypatch, precis.optim.AdamW, None)

    def backward():
        sum((p.float() ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
    first = {key: entry[1] for key, entry in release.kept.held.items()}
    assert set(first) == {id(p) for p in params}
    backward()
    assert {key: entry[1] for key, entry in release.kept.held.items()} == first  # (the same)
    numbers = [h.held for h in first.values()]
    gone = [weakref.ref(h) for h in first.values()]
    del first
    opt.load_state_dict(opt.state_dict())  # (fresh state tensors: every call made anew)
    backward()
    assert not release.kept.held  # (the stale ones let go; new ones at their next call)
    gc.collect()
    assert not any(ref() for ref in gone)
    grad = torch.zeros(1, dtype=torch.bfloat16)
    for number in numbers:
        with pytest.raises(RuntimeError, match=f"no held call {number} "):
            torch.ops.precis.held_step_(number, [params[0]], [grad], torch.zeros(()), 1e-2,
                                        1.0, torch.zeros(1), [])
    backward()
    assert set(release.kept.held) == {id(p) for p in params}
    release.remove()
    assert not release.kept.held and not release.kept.calls


def test_a_param_swapped_while_its_kept_call_is_held_steps_as_the_ordinary_loop(monkeypatch):
    """torch.utils.swap_tensors (nn.Module._apply's swap path, load_state_dict(assign=
    True)) refuses a param that C++ holds besides its Python object: a held call never
    holds its params (they are put in at each call), so a released param whose kept call
    is held can be swapped, and the steps after it are the ordinary loop's."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    runs = []
    for release in (False, True):
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16))
              for n in SIZES]
        opt = precis.optim.AdamW(ps, lr=1e-2)
        handle = precis.optim.release_gradients(opt) if release else None
        for step in range(5):
            if step == 3:
                if release:
                    assert set(handle.kept.held) == {id(p) for p in ps}
                torch.utils.swap_tensors(ps[1], torch.nn.Parameter(
                    torch.linspace(-1, 1, ps[1].numel()).to(torch.bfloat16)))
            w = torch.Generator().manual_seed(step)
            sum((p.float() * torch.randn(p.shape, generator=w)).sum() for p in ps).backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
