"""A step that fails, for any reason, changes nothing: no param, no state, no step
count, and leaves no half-made state; in eager and capturable mode (on CPU here;
test_cuda_adam.py has the CUDA side)."""
import pytest
import torch

import precis.optim as optim
from state_snapshot import assert_same, bits, snapshot

BF16 = torch.bfloat16


def two_group_model(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    first = [torch.nn.Parameter(torch.randn(127, generator=g).to(dtype)) for _ in range(2)]
    second = [torch.nn.Parameter(torch.randn(33, 5, generator=g).to(dtype)) for _ in range(2)]
    return first, second


def set_grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def make(capturable=False, policy=None, dtype=torch.float32, amsgrad=False):
    first, second = two_group_model(dtype)
    opt = optim.AdamW([{"params": first}, {"params": second, "lr": 3e-3}], lr=1e-2,
                      weight_decay=0.05, capturable=capturable, policy=policy, amsgrad=amsgrad)
    return opt, first + second


def bad_lr(opt, ps):
    opt.param_groups[1]["lr"] = float("nan")
    return ValueError, "Invalid learning rate"


def bad_betas(opt, ps):
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    return ValueError, "Invalid beta parameter at index 1"


def bad_grad_dtype(opt, ps):
    # torch refuses a float64 .grad on a float32 param; a main_grad is read first
    ps[-1].main_grad = ps[-1].grad.double()
    return ValueError, "gradient has dtype torch.float64"


def aliased_state(opt, ps):
    """Refused by the op of the second group, after the first group's op was fine."""
    st = opt.state[ps[-1]]
    st["exp_avg_sq"] = st["exp_avg"]
    return RuntimeError, "exp_avg"


def aliased_first_state(opt, ps):
    """Refused by the op of the first group, which runs without a checks-only pass
    (it checks before it writes; the second group's op has not run yet)."""
    st = opt.state[ps[0]]
    st["exp_avg_sq"] = st["exp_avg"]
    return RuntimeError, "exp_avg"


def aliased_max(opt, ps):
    """amsgrad: the running max shares exp_avg_sq's memory (second group's op)."""
    st = opt.state[ps[-1]]
    st["max_exp_avg_sq"] = st["exp_avg_sq"]
    return RuntimeError, "max_exp_avg_sqs"


FAILURES = {"bad_lr": bad_lr, "bad_betas": bad_betas, "bad_grad_dtype": bad_grad_dtype,
            "aliased_state": aliased_state, "aliased_first_state": aliased_first_state}
AMSGRAD_FAILURES = dict(FAILURES, aliased_max=aliased_max)
# make()'s arguments and the failures to try: fp32, and amsgrad (its max_exp_avg_sq must
# stay untouched too) with bf16 and with block-scaled fp16 second moments
SETUPS = {"fp32": ({}, FAILURES),
          "amsgrad_bf16": (dict(dtype=BF16, amsgrad=True), AMSGRAD_FAILURES),
          "amsgrad_fp16_v": (dict(dtype=BF16, amsgrad=True, policy={"exp_avg_sq_dtype": "fp16"}),
                             AMSGRAD_FAILURES)}


@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
@pytest.mark.parametrize("setup,name", [(setup, name) for setup, (_, failures) in SETUPS.items()
                                        for name in failures])
def test_failed_step_changes_nothing(setup, name, capturable):
    kw, failures = SETUPS[setup]
    opt, ps = make(capturable, **kw)
    for step in range(2):
        set_grads(ps, step)
        opt.step()
    assert all(("max_exp_avg_sq" in opt.state[p]) == bool(kw.get("amsgrad")) for p in ps)
    set_grads(ps, 7)
    error, words = failures[name](opt, ps)
    before = snapshot(opt)
    with pytest.raises(error, match=words):
        opt.step()
    assert_same(before, snapshot(opt))


@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
@pytest.mark.parametrize("name", ["bad_lr", "bad_betas", "bad_grad_dtype"])
def test_failed_first_step_leaves_no_state(name, capturable):
    opt, ps = make(capturable)
    set_grads(ps, 0)
    error, words = FAILURES[name](opt, ps)
    before = snapshot(opt)
    with pytest.raises(error, match=words):
        opt.step()
    assert_same(before, snapshot(opt))
    assert len(opt.state) == 0


@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_amsgrad_turned_on_by_a_failed_step_adds_no_state(capturable):
    """amsgrad switched on for existing state: the max is made at the next step,
    and a step that fails drops it again."""
    opt, ps = make(capturable)
    set_grads(ps, 0)
    opt.step()
    for group in opt.param_groups:
        group["amsgrad"] = True
    set_grads(ps, 1)
    error, words = bad_lr(opt, ps)
    before = snapshot(opt)
    with pytest.raises(error, match=words):
        opt.step()
    assert_same(before, snapshot(opt))
    opt.param_groups[1]["lr"] = 1e-3
    opt.step()
    assert all("max_exp_avg_sq" in opt.state[p] for p in ps)


def test_weights_loaded_after_a_failed_first_step_are_kept():
    """bf16 params, fp32 masters: the master a failed first step would have made holds
    the old weights; an lr=0 step after a weights load must not bring them back."""
    opt, ps = make(dtype=BF16)
    set_grads(ps, 0)
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError):
        opt.step()
    with torch.no_grad():
        for i, p in enumerate(ps):
            p.copy_(torch.full_like(p, 0.25 * (i + 1)))
    loaded = [bits(p) for p in ps]
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    opt.step()
    assert all(torch.equal(bits(p), b) for p, b in zip(ps, loaded))


def test_capturable_step_counts_kept_when_an_op_refuses():
    opt, ps = make(capturable=True)
    set_grads(ps, 0)
    opt.step()
    steps = [opt.state[p]["step"].clone() for p in ps]
    aliased_state(opt, ps)
    with pytest.raises(RuntimeError):
        opt.step()
    assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(ps, steps))
    assert all(int(s) == 1 for s in steps)
