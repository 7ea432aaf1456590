"""precis's functional core, functional.run(param_groups, state, books, grad_scale,
found_inf), called without an optimizer object, as torch's functional adam() is: it
gives precis.optim.AdamW's bits for every policy (and torch.optim.AdamW's with the
fp32 policy), on a plain dict of state as on the optimizer's own."""
from types import SimpleNamespace

import pytest
import torch

import precis.optim
from precis import adamw, functional, optim_state
from state_snapshot import assert_same, snapshot

BF16 = torch.bfloat16
SIZES = (1, 127, 4097)
POLICIES = {  # name -> (param dtype, policy)
    "fp32": (torch.float32, None),
    "bf16 default": (BF16, None),
    "remainders": (BF16, {"store_param_remainders": True}),
    "fp8 + 8-bit remainders": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                                      "store_param_remainders": True,
                                      "param_remainder_bits": 8}),
}


def params(dtype):
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def set_grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def group(ps, policy, **overrides):
    """A param group as the optimizer's constructor fills it in."""
    return {**dict(params=ps, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                   amsgrad=False, maximize=False, foreach=None, capturable=False,
                   differentiable=False, fused=None, decoupled_weight_decay=True,
                   policy=policy, seed=0), **overrides}


@pytest.mark.parametrize("state_kind", ["dict", "CountedState"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_run_without_an_optimizer_gives_the_optimizers_bits(name, state_kind):
    dtype, policy = POLICIES[name]
    ps_opt, ps_fn = params(dtype), params(dtype)
    opt = precis.optim.AdamW(ps_opt, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                             policy=policy)
    groups = [group(ps_fn[:1], policy), group(ps_fn[1:], policy)]
    state = {} if state_kind == "dict" else optim_state.CountedState()
    books = optim_state.Books("AdamW", adamw.RULE)
    for step in range(4):
        set_grads(ps_opt, step)
        set_grads(ps_fn, step)
        opt.step()
        functional.run(groups, state, books, None, None)
    assert_same(snapshot(opt), snapshot(SimpleNamespace(param_groups=groups, state=state)))
    # A plain dict cannot tell a replaced entry: the steady-state Plan needs the
    # optimizer's CountedState, and the full path gives the same bits without it.
    assert bool(books.plans) == (state_kind == "CountedState")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torchs_bits(dtype):
    """The fp32 policy (precis's kernel) and float64 params (torch's own Adam code, its
    state made on the plain dict) give torch.optim.AdamW's bits."""
    ps_torch, ps_fn = params(dtype), params(dtype)
    ref = torch.optim.AdamW(ps_torch, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=False)
    groups, state, books = [group(ps_fn, None)], {}, optim_state.Books("AdamW", adamw.RULE)
    for step in range(4):
        set_grads(ps_torch, step)
        set_grads(ps_fn, step)
        ref.step()
        functional.run(groups, state, books, None, None)
    for p_torch, p_fn in zip(ps_torch, ps_fn):
        assert torch.equal(p_torch, p_fn)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p_torch][key], state[p_fn][key]), key


def test_a_bad_group_fails_before_any_group_is_written():
    ps = params(BF16)
    set_grads(ps, 0)
    before = [p.detach().clone() for p in ps]
    groups = [group(ps[:1], None), group(ps[1:], None, eps=-1.0)]
    state, books = {}, optim_state.Books("AdamW", adamw.RULE)
    with pytest.raises(ValueError, match=r"Invalid epsilon value: -1.0 \(AdamW param group 1"):
        functional.run(groups, state, books, None, None)
    assert all(torch.equal(a, b) for a, b in zip(before, ps)) and not state

