"""precis.optim.NorMuon (issue #66): Muon's momentum and Newton-Schulz, then dion's per-row
second moment and Frobenius-norm-preserving rescale, its row state kept whole.

* fp32 params, fp32 policy: the bits of a reference written from dion's single-device
  NorMuon (normuon.py's _normuon_normalization_core and muon_update_post_orthogonalize)
  with torch.optim.Muon's momentum and Newton-Schulz (the functions precis's Muon gives
  the bits of): params, momentum and row state torch.equal after every step, tall,
  wide, square, a 1-column matrix of 1_000_003 rows, transposed strides.
* low-precision policies against the fp32 trajectory on the same gradients.
* checkpoints: resume bit-exact, through torch.save; torch.optim.Muon and precis's Muon
  refuse NorMuon's state dict, and to_torch_state_dict its groups; a bad row state
  refused before anything changes.
* a skipped step leaves the row state; bad input named before anything is written.
Offload, gradient release, torch.compile and FSDP2 are in their files' Muon tests."""
import inspect
import io
import math
import warnings

import pytest
import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

import precis  # noqa: F401  (loads the package, registers the ops)
from precis import checkpoint, muon, optim

SHAPES = ((1, 1), (127, 33), (33, 127), (64, 64), (5, 4097))
KW = dict(lr=0.02, weight_decay=0.05, momentum=0.93, beta2=0.9)
NS = dict(ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7)  # torch's
# microsoft/dion's conventions (its NorMuon's defaults but lr, weight decay, beta2)
DION_CONVENTIONS = dict(nesterov=False, eps=1e-8, adjust_lr_fn="spectral_norm",
                        ns_coefficients="polar_express", momentum_form="sum")


def make(shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def grads_for(params, gen):
    return [torch.randn(p.shape, generator=gen) + 0.05 * p.detach().float() for p in params]


class Reference:
    """NorMuon on fp32 params in torch ops, as dion computes it on one device, with
    torch.optim.Muon's momentum (buf.lerp_(g, 1 - momentum), Nesterov g.lerp(buf,
    momentum)) and Newton-Schulz."""

    def __init__(self, params, lr, weight_decay, momentum, beta2, nesterov=True,
                 adjust_lr_fn=None):
        self.params = [p.detach().clone() for p in params]
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.rows = [torch.zeros(p.shape[0], 1) for p in self.params]
        self.kw = dict(lr=lr, wd=weight_decay, mu=momentum, beta2=beta2, nesterov=nesterov,
                       adjust=adjust_lr_fn)

    def step(self, grads):
        k = self.kw
        for i, (p, g) in enumerate(zip(self.params, grads)):
            self.bufs[i].lerp_(g, 1 - k["mu"])
            direction = g.lerp(self.bufs[i], k["mu"]) if k["nesterov"] else self.bufs[i]
            u = _zeropower_via_newtonschulz(direction, NS["ns_coefficients"], NS["ns_steps"],
                                            NS["eps"]).to(torch.float32)
            norm_u = u.norm(p=2, dim=(-2, -1), keepdim=True)
            self.rows[i] = torch.lerp(self.rows[i], (u * u).mean(dim=-1, keepdim=True),
                                      1 - k["beta2"])
            u = u / (self.rows[i].sqrt() + 1e-8)
            u = u * (norm_u / u.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8))
            p.mul_(1 - k["lr"] * k["wd"])
            p.add_(u, alpha=-_adjust_lr(k["lr"], k["adjust"], p.shape))


def assert_like_reference(params, opt, ref, step):
    for i, (p, q) in enumerate(zip(params, ref.params)):
        assert torch.equal(p.detach(), q), f"step {step}: param {i} differs by " \
                                           f"{(p.detach() - q).abs().max().item()}"
        state = opt.state[p]
        assert torch.equal(state["exp_avg"], ref.bufs[i]), f"step {step}: momentum {i}"
        assert state["row_exp_avg_sq"].dtype == torch.float32
        assert torch.equal(state["row_exp_avg_sq"], ref.rows[i]), f"step {step}: row state {i}"


@pytest.mark.parametrize("nesterov", (True, False))
@pytest.mark.parametrize("adjust_lr_fn", (None, "match_rms_adamw"))
def test_fp32_gives_the_bits_of_dions_normuon(nesterov, adjust_lr_fn):
    params = make(SHAPES, 1)
    opt = optim.NorMuon(params, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, **KW)
    ref = Reference(params, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, **KW)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 8):
        grads = grads_for(params, gen)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
        assert_like_reference(params, opt, ref, step)


def test_a_million_rows_and_transposed_strides_give_the_reference_bits():
    """A (1_000_003, 1) matrix (a row state of a million rows) and transposed weights
    (stepped in memory order, normalized by their logical rows)."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(1_000_003, 1, generator=gen)),
              torch.nn.Parameter(torch.randn(64, 33, generator=gen).t()),
              torch.nn.Parameter(torch.randn(127, 5, generator=gen).t())]
    opt = optim.NorMuon(params, **KW)
    ref = Reference(params, **KW)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
        assert_like_reference(params, opt, ref, step)
    assert [p.stride() for p in params[1:]] == [(1, 33), (1, 5)]


def test_the_update_keeps_the_orthogonalized_updates_norm():
    """The normalization changes each row's scale, not the update's Frobenius norm: one
    step from zero state with lr 1 and no weight decay moves each matrix by
    adjusted ratio * ||NS(direction)||_F (within fp32 rounding, 1e-5)."""
    params = make(SHAPES[1:4], 4)
    start = [p.detach().clone() for p in params]
    opt = optim.NorMuon(params, lr=1.0, weight_decay=0.0, momentum=0.9, beta2=0.5)
    gen = torch.Generator().manual_seed(5)
    grads = grads_for(params, gen)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, s, g in zip(params, start, grads):
        direction = g.lerp(g * 0.1, 0.9)  # Nesterov on a buffer (1 - 0.9) * g
        want = _zeropower_via_newtonschulz(direction, NS["ns_coefficients"], NS["ns_steps"],
                                           NS["eps"]).float().norm()
        moved = (p.detach() - s).norm() / _adjust_lr(1.0, None, p.shape)
        assert abs(moved / want - 1) < 1e-5, (p.shape, moved.item(), want.item())
        rows = opt.state[p]["row_exp_avg_sq"]
        assert rows.shape == (p.shape[0], 1) and bool((rows > 0).all())


@pytest.mark.parametrize("policy,tolerance", [(None, 0.05), ({"momentum_dtype": "fp8",
                                              "store_param_remainders": True,
                                              "param_remainder_bits": 8}, 0.10)])
@pytest.mark.parametrize("conventions", ("torch", "dion"))
def test_bf16_policies_follow_the_fp32_trajectory(policy, tolerance, conventions):
    """bf16 params (fp32 master and bf16 momentum by default; fp8 momentum and 8-bit
    remainders) against fp32 params of the same start with the fp32 policy, on the same
    (bf16) gradients, as Muon's test_low_precision_state_tracks_fp32: after 20 steps each
    master's distance to the fp32 run's params is within 5% (10% under fp8 momentum) of
    the distance the fp32 run travelled, and each row state's median ratio to the fp32
    run's within 1% (every row within 10%); with torch's conventions and dion's."""
    low = make(SHAPES[1:4], 6, torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in low]
    start = [p.detach().clone() for p in fp32]
    kw = dict(KW, **(DION_CONVENTIONS if conventions == "dion" else {}))
    opt32, opt = optim.NorMuon(fp32, **kw), optim.NorMuon(low, policy=policy, **kw)
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        for a, b, g in zip(fp32, low, grads_for(fp32, gen)):
            g = g.bfloat16()
            a.grad, b.grad = g.float(), g
        opt32.step()
        opt.step()
    for a, b, s in zip(fp32, low, start):
        travelled = (a.detach() - s).norm()
        off = (opt.master_weight(b) - a.detach()).norm()
        assert off < tolerance * travelled, (a.shape, off.item(), travelled.item())
        ratio = opt.state[b]["row_exp_avg_sq"] / opt32.state[a]["row_exp_avg_sq"]
        assert abs(ratio.median() - 1) < 0.01 and (ratio - 1).abs().max() < 0.10, \
            (a.shape, ratio.median().item(), (ratio - 1).abs().max().item())


def run(params, opt, gen, steps):
    for _ in range(steps):
        for p, g in zip(params, grads_for(params, gen)):
            p.grad = g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype,policy", [(torch.float32, None), (torch.bfloat16, {
    "momentum_dtype": "fp8", "store_param_remainders": True, "param_remainder_bits": 8})])
def test_a_resumed_run_follows_the_run_that_never_stopped(dtype, policy):
    """state_dict through torch.save / weights_only torch.load into a new optimizer over
    params of other weights that load the model's: the next steps' bits equal those of
    the run that never stopped."""
    a, b = make(SHAPES, 8, dtype), make(SHAPES, 9, dtype)
    opt_a = optim.NorMuon(a, policy=policy, **KW)
    gen_a = torch.Generator().manual_seed(10)
    run(a, opt_a, gen_a, 3)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    opt_b = optim.NorMuon(b, policy=policy, **KW)
    opt_b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    gen_b = torch.Generator().manual_seed(11)
    gen_a = torch.Generator().manual_seed(11)
    run(a, opt_a, gen_a, 3)
    run(b, opt_b, gen_b, 3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, t in opt_a.state[p].items():
            assert torch.equal(t, opt_b.state[q][key]), key


def test_to_torch_state_dict_refuses_it():
    """torch has no NorMuon: to_torch_state_dict gave Muon's layout with the row state,
    which torch.optim.Muon loaded and stepped as Muon (the row state dropped, no
    normalization): now refused, naming the group."""
    a = make(SHAPES, 12)
    opt = optim.NorMuon(a, **KW)
    run(a, opt, torch.Generator().manual_seed(13), 2)
    with pytest.raises(ValueError, match=r"param group 0 is NorMuon's \(beta2, a second "
                                         r"moment of each row\), which torch has no"):
        checkpoint.to_torch_state_dict(opt.state_dict(), a)


def test_muons_refuse_normuons_state_dict_and_it_refuses_theirs():
    """torch.optim.Muon loading NorMuon's state dict fails at its first step before it
    writes (the momentum under torch's name is precis's marker: no torch optimizer keeps
    a row state); precis's Muon refuses it on load (a key it does not keep), and NorMuon
    refuses Muon's (its group lacks beta2): never half a state."""
    params = make(SHAPES, 15)
    opt = optim.NorMuon(params, **KW)
    run(params, opt, torch.Generator().manual_seed(16), 1)
    sd = opt.state_dict()
    theirs = torch.optim.Muon(make(SHAPES, 15), lr=0.02)
    theirs.load_state_dict(sd)
    for p in theirs.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in theirs.param_groups[0]["params"]]
    with pytest.raises(AttributeError, match="bytes"):
        theirs.step()
    assert all(torch.equal(p, q) for p, q in zip(theirs.param_groups[0]["params"], before))
    muon = optim.Muon(make(SHAPES, 15), lr=0.02)
    with pytest.raises(ValueError, match="unknown keys row_exp_avg_sq"):
        muon.load_state_dict(sd)
    assert not muon.state
    muon_params = make(SHAPES, 15)
    muon = optim.Muon(muon_params, lr=0.02)
    run(muon_params, muon, torch.Generator().manual_seed(16), 1)
    fresh = optim.NorMuon(make(SHAPES, 15), **KW)
    with pytest.raises(ValueError, match="lacks beta2"):
        fresh.load_state_dict(muon.state_dict())
    assert not fresh.state


@pytest.mark.parametrize("bad,message", [
    (lambda t: t.reshape(-1), r"'row_exp_avg_sq' must be a float tensor of shape \(127, 1\)"),
    (lambda t: t[:5], r"shape \(127, 1\) \(a value a row of the param\), got a "
                      r"torch.float32 tensor of shape \(5, 1\)"),
    (lambda t: t.to(torch.int32), r"must be a float tensor"),
    (lambda t: -t - 1, r"holds a negative, NaN or Inf value"),
    (lambda t: t.fill_(float("nan")), r"holds a negative, NaN or Inf value"),
    (None, r"state of param 1 .*: missing row_exp_avg_sq"),  # (the momentum alone: half)
])
def test_a_bad_row_state_is_refused_before_anything_changes(bad, message):
    params = make(SHAPES, 17)
    opt = optim.NorMuon(params, **KW)
    run(params, opt, torch.Generator().manual_seed(18), 2)
    sd = opt.state_dict()
    if bad is None:  # (a tool that kept only torch.optim.Muon's keys)
        del sd["state"][1]["row_exp_avg_sq"]
    else:
        sd["state"][1]["row_exp_avg_sq"] = bad(sd["state"][1]["row_exp_avg_sq"].clone())
    before = {k: v.clone() for k, v in opt.state[params[1]].items()}
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert all(torch.equal(v, opt.state[params[1]][k]) for k, v in before.items())


def test_a_skipped_step_leaves_the_row_state():
    """An Inf gradient under grad_scale: nothing is written, the row state included; the
    next clean step is the run's that never saw it."""
    a, b = make(SHAPES, 19), make(SHAPES, 19)
    opt_a, opt_b = optim.NorMuon(a, **KW), optim.NorMuon(b, **KW)
    run(a, opt_a, torch.Generator().manual_seed(20), 2)
    run(b, opt_b, torch.Generator().manual_seed(20), 2)
    before = [{k: v.clone() for k, v in opt_a.state[p].items()} for p in a]
    for p in a:
        p.grad = torch.randn(p.shape)
    a[2].grad[3, 4] = float("inf")
    opt_a.step(grad_scale=torch.tensor(2.0))
    assert opt_a.last_step_skipped
    for p, saved in zip(a, before):
        assert all(torch.equal(v, opt_a.state[p][k]) for k, v in saved.items())
    run(a, opt_a, torch.Generator().manual_seed(21), 1)
    run(b, opt_b, torch.Generator().manual_seed(21), 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("kw,message", [
    (dict(beta2=1.0), r"beta2 must be a number in \[0, 1\), got 1.0"),
    (dict(beta2=-0.1), r"beta2 must be a number in \[0, 1\)"),
    (dict(beta2="0.9"), r"beta2 must be a number in \[0, 1\), got '0.9'"),
    (dict(momentum=1.0), r"momentum should be below 1"),
])
def test_bad_hyperparameters_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        optim.NorMuon(make(SHAPES[:1], 22), **dict(KW, **kw))


def test_a_param_that_is_no_matrix_is_refused_as_muon_refuses_it():
    with pytest.raises(ValueError, match=r"NorMuon only supports 2D parameters whereas we "
                                         r"found a parameter with size: torch.Size\(\[7\]\)"):
        optim.NorMuon(make([(3, 4), (7,)], 23), **KW)


def test_a_precis_ddp_piece_is_refused_naming_fsdp2():
    """A flat piece of a matrix with its `_precis_whole` (as precis.ddp's ZeRO hands out):
    refused before anything is written (the ranks that hold no piece of a matrix would not
    keep its row state)."""
    class Whole:
        shape = torch.Size((8, 16))
    piece = torch.nn.Parameter(torch.randn(40))
    piece._precis_whole = Whole()
    other = make([(5, 3)], 24)
    opt = optim.NorMuon([{"params": other}, {"params": make([(8, 16)], 25)}], **KW)
    opt.param_groups[1]["params"] = [piece]
    other[0].grad, piece.grad = torch.randn(5, 3), torch.randn(40)
    before = other[0].detach().clone()
    with pytest.raises(ValueError, match="shard with FSDP2"):
        opt.step()
    assert torch.equal(other[0], before) and not opt.state


def test_state_bytes_per_param_with_fp8_momentum_and_8bit_remainders():
    """fp8 momentum (1 byte + 4/128 of scales), 8-bit remainders (1 byte) and the row
    state (4 bytes a row: 4 / columns a param), measured from the tensors: at most 2.1
    bytes/param on a 125M Llama's matrix shapes (768 x 768, 3072 x 768, 768 x 3072);
    4.1 with the bf16 gradient."""
    shapes = ((768, 768), (3072, 768), (768, 3072))
    params = make(shapes, 26, torch.bfloat16)
    opt = optim.NorMuon(params, policy={"momentum_dtype": "fp8", "store_param_remainders": True,
                                        "param_remainder_bits": 8})
    for p in params:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    report = opt.memory_report()
    state = report["master"] + report["exp_avg"] + report["scales"] + report["rows"]
    assert report["exp_avg_sq"] == 0.0 and report["rows"] == pytest.approx(
        sum(4 * s[0] for s in shapes) / sum(s[0] * s[1] for s in shapes))
    assert state <= 2.1, report
    assert state + report["grad"] <= 4.1, report


# ---- one optimizer for a whole model: Muon's and NorMuon's groups that ask for AdamW ----


def whole_model(seed=0):
    """An embedding, two matrices, a norm and a head (what Muon leaves to AdamW: the
    embedding, the 1-D params, the head), bf16."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 33),
                               torch.nn.LayerNorm(33), torch.nn.Linear(33, 29, bias=False),
                               torch.nn.Linear(29, 50)).to(torch.bfloat16)


def split(model):
    """(the hidden matrices, the rest) of whole_model."""
    hidden = [model[1].weight, model[3].weight]
    return hidden, [p for p in model.parameters() if all(p is not h for h in hidden)]


def train_model(model, opts, steps, first=0):
    for step in range(first, first + steps):
        x = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(step))
        model(x).float().square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


ADAMW_KW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
FP8_REM8 = {"momentum_dtype": "fp8", "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
            "store_param_remainders": True, "param_remainder_bits": 8}


def one_optimizer(cls, model, policy=None, adamw_first=True, **options):
    hidden, rest = split(model)
    groups = [{"params": rest, "algorithm": "adamw", **ADAMW_KW}, {"params": hidden}]
    return getattr(optim, cls)(groups if adamw_first else groups[::-1], lr=0.02,
                               policy=policy, **options)


@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
def test_one_optimizer_gives_the_bits_of_muon_and_adamw_apart(cls):
    """Muon (NorMuon) with a group {"algorithm": "adamw"} for the embedding, the 1-D params
    and the head, the default policy: every param's bits and state after 4 steps of
    training equal those of the two optimizers users pair today, precis.optim.AdamW on the
    rest and Muon on the matrices (the AdamW group first: stochastic rounding's streams,
    v's here, follow a param's place in its optimizer, so the rest keeps its places)."""
    a, b = whole_model(), whole_model()
    one = one_optimizer(cls, a)
    hidden, rest = split(b)
    two = [optim.AdamW(rest, **ADAMW_KW), getattr(optim, cls)(hidden, lr=0.02)]
    train_model(a, [one], 4)
    train_model(b, two, 4)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        theirs = two[0].state.get(q) or two[1].state[q]
        assert set(one.state[p]) == set(theirs), name
        assert all(torch.equal(t, theirs[k]) for k, t in one.state[p].items()), name
    assert set(one.state[a[0].weight]) >= {"exp_avg", "exp_avg_sq"}
    assert "exp_avg_sq" not in one.state[a[1].weight]


@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
def test_with_fp8_state_the_adamw_groups_bits_are_adamws(cls):
    """fp8 moments and momentum + 8-bit remainders, the same gradients set on both (no
    forward couples the params): the AdamW group's params and state equal
    precis.optim.AdamW's on them after 4 steps. (Its matrices' fp8 momentum draws the
    streams of their places, after the rest's, so they equal a Muon's whose params stand
    there, not a Muon's of their own.)"""
    a, b = whole_model(), whole_model()
    one = one_optimizer(cls, a, FP8_REM8)
    rest_a, rest_b = split(a)[1], split(b)[1]
    alone = optim.AdamW(rest_b, policy=FP8_REM8, **ADAMW_KW)
    gen = torch.Generator().manual_seed(27)
    for _ in range(4):
        for p in a.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        for p, q in zip(rest_a, rest_b):
            q.grad = p.grad.clone()
        one.step()
        alone.step()
    for p, q in zip(rest_a, rest_b):
        assert torch.equal(p, q)
        assert all(torch.equal(t, alone.state[q][k]) for k, t in one.state[p].items())
    assert one.state[a[1].weight]["exp_avg"].dtype == torch.uint8


def test_in_any_order_with_fp32_state_the_bits_are_adamws():
    """With no stochastic rounding (fp32 params and state) the groups' order is free."""
    a, b = whole_model().float(), whole_model().float()
    one = one_optimizer("NorMuon", a, adamw_first=False)
    hidden, rest = split(b)
    two = [optim.NorMuon(hidden, lr=0.02), optim.AdamW(rest, **ADAMW_KW)]
    train_model(a, [one], 3)
    train_model(b, two, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
def test_one_optimizers_state_dict_resumes_and_crosses_to_torch_by_algorithm(cls):
    """state_dict -> a new optimizer over other weights that load the model's -> the bits
    of the run that never stopped. to_torch_state_dict refuses the whole (no torch
    optimizer steps two algorithms: torch.optim.AdamW loaded it, moved group 0, then
    raised KeyError 'betas'), naming split_by_algorithm; each part converts, named as
    its torch optimizer names its state (Muon's 'momentum_buffer', AdamW's moments)."""
    a, b = whole_model(), whole_model(1)
    opt_a = one_optimizer(cls, a)
    train_model(a, [opt_a], 3)
    b.load_state_dict(a.state_dict())
    opt_b = one_optimizer(cls, b)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    opt_b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    train_model(a, [opt_a], 2, first=3)
    train_model(b, [opt_b], 2, first=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    params = [p for g in opt_a.param_groups for p in g["params"]]
    with pytest.raises(ValueError, match=r"step adamw and muon .*checkpoint.split_by_algorithm"
                       r"\(sd\)" if cls == "Muon" else r"param group 1 is NorMuon's"):
        checkpoint.to_torch_state_dict(opt_a.state_dict(), params)  # (NorMuon's: not split)
    parts = checkpoint.split_by_algorithm(opt_a.state_dict())
    hidden, rest = split(a)
    if cls == "NorMuon":  # (torch has none: test_to_torch_state_dict_refuses_it)
        with pytest.raises(ValueError, match="is NorMuon's"):
            checkpoint.to_torch_state_dict(parts["muon"], hidden)
    for name, part, ps, keys in (("muon", parts["muon"], hidden, {"momentum_buffer"}),
                                 ("adamw", parts["adamw"], rest, {"exp_avg", "exp_avg_sq"})):
        if cls == "NorMuon" and name == "muon":
            continue
        as_torch, masters = checkpoint.to_torch_state_dict(part, ps)
        assert all(set(as_torch["state"][i]) - {"step"} == keys
                   for i in range(len(ps))), name
        assert set(masters) == set(range(len(ps)))  # bf16 params: fp32 masters
        assert all("algorithm" not in g for g in as_torch["param_groups"]), name


def test_a_groups_algorithm_is_checked_and_kept():
    """An unknown algorithm, an AdamW state dict group loaded where the optimizer steps
    Muon, and a 1-D param in a Muon group: each refused, naming it, nothing changed."""
    model = whole_model()
    hidden, rest = split(model)
    with pytest.raises(ValueError, match="algorithm is 'lion'; this optimizer steps 'normuon'"):
        optim.NorMuon([{"params": hidden}, {"params": rest, "algorithm": "lion"}])
    with pytest.raises(ValueError, match="NorMuon only supports 2D parameters"):
        optim.NorMuon([{"params": hidden}, {"params": rest}])
    opt = one_optimizer("NorMuon", model)
    train_model(model, [opt], 1)
    sd = opt.state_dict()
    sd["param_groups"][0]["algorithm"], sd["param_groups"][1]["algorithm"] = "normuon", "adamw"
    before = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with pytest.raises(ValueError, match="param group 0 was saved for algorithm 'normuon'; "
                                         "this optimizer steps the group by 'adam'"):
        opt.load_state_dict(sd)
    assert all(torch.equal(v, opt.state[p][k]) for p, st in before.items() for k, v in st.items())


@pytest.mark.parametrize("conventions", ("torch", "dion"))
def test_one_optimizer_released_has_the_ordinary_bits(conventions):
    """release_gradients on the one optimizer (each param stepped inside backward by its
    group's rule): the bits of its ordinary steps, with torch's conventions and dion's."""
    options = DION_CONVENTIONS if conventions == "dion" else {}
    a, b = whole_model(), whole_model()
    plain = one_optimizer("NorMuon", a, **options)
    released = one_optimizer("NorMuon", b, **options)
    optim.release_gradients(released)
    train_model(a, [plain], 3)
    train_model(b, [released], 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---- found in review: what the tests above did not hold ---------------------------------


def test_normalized_leaves_the_row_state_where_found_inf_is_set():
    """The device path's skip (no flag read on the host): a set flag leaves the row state
    as it was, a clear one moves it."""
    from precis.normuon import normalized
    gen = torch.Generator().manual_seed(28)
    update, row = torch.randn(7, 5, generator=gen), torch.rand(7, 1, generator=gen)
    before = row.clone()
    normalized(update, row, torch.ones(1), beta2=0.9)
    assert torch.equal(row, before)
    normalized(update, row, torch.zeros(1), beta2=0.9)
    assert not torch.equal(row, before)
    want = torch.lerp(before, (update * update).mean(dim=-1, keepdim=True), 0.1)
    assert torch.equal(row, want)


def test_complex_params_are_refused_before_anything_is_written():
    w = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.complex64))
    other = make([(4, 3)], 29)
    opt = optim.NorMuon([{"params": other}, {"params": [w]}], **KW)
    w.grad, other[0].grad = torch.randn_like(w), torch.randn(4, 3)
    before = [w.detach().clone(), other[0].detach().clone()]
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        opt.step()
    assert torch.equal(w, before[0]) and torch.equal(other[0], before[1]) and not opt.state


@pytest.mark.parametrize("how", ["step", "released", "load"])
def test_an_adamw_groups_bad_hyperparameter_is_refused_by_adamws_checks(how):
    """A bad beta in the "adamw" group (which holds Muon's keys too, so Muon's checks
    would pass it): refused by AdamW's, stepping, released or loading, nothing written."""
    model = whole_model()
    opt = one_optimizer("NorMuon", model)
    train_model(model, [opt], 1)
    snapshot = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    if how == "load":
        sd = opt.state_dict()
        sd["param_groups"][0]["betas"] = (1.5, 0.999)
        with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
            opt.load_state_dict(sd)
    else:
        opt.param_groups[0]["betas"] = (1.5, 0.999)
        if how == "released":
            optim.release_gradients(opt)
        with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
            train_model(model, [opt], 1, first=1)
    for p, saved in snapshot.items():
        assert all(torch.equal(v, opt.state[p][k]) for k, v in saved.items())


def test_a_row_state_of_another_shape_is_refused():
    params = make(SHAPES[1:2], 30)
    opt = optim.NorMuon(params, **KW)
    run(params, opt, torch.Generator().manual_seed(31), 1)
    opt.state[params[0]]["row_exp_avg_sq"] = torch.zeros(8, 1)
    with pytest.raises(RuntimeError, match=r"its row_exp_avg_sq is torch.float32 of shape "
                                           r"\(8, 1\), not float32 of shape \(127, 1\)"):
        run(params, opt, torch.Generator().manual_seed(32), 1)


def test_a_groups_algorithm_changed_after_steps_is_refused():
    """The group's state was made by another rule (a Muon momentum would be read as
    Adam's first moment): refused, naming the group's param, nothing written."""
    model = whole_model()
    opt = one_optimizer("NorMuon", model)
    train_model(model, [opt], 1)
    opt.param_groups[1].update(algorithm="adamw", betas=(0.9, 0.999), amsgrad=False,
                               decoupled_weight_decay=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="is another rule's than 'adam'"):
        train_model(model, [opt], 1, first=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_an_adamw_group_always_decouples_its_weight_decay():
    model = whole_model()
    hidden, rest = split(model)
    with pytest.raises(ValueError, match="an 'adamw' param group decouples its weight decay"):
        optim.Muon([{"params": hidden}, {"params": rest, "algorithm": "adamw",
                                         "decoupled_weight_decay": False}])
    opt = one_optimizer("Muon", model)
    train_model(model, [opt], 1)
    sd = opt.state_dict()
    del sd["param_groups"][0]["decoupled_weight_decay"]  # (a state dict without the flag)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True


def test_decoded_state_gives_a_copy_of_the_row_state():
    params = make(SHAPES[1:2], 33)
    opt = optim.NorMuon(params, **KW)
    run(params, opt, torch.Generator().manual_seed(34), 1)
    opt.decoded_state(params[0])["row_exp_avg_sq"].fill_(7.0)
    assert not bool((opt.state[params[0]]["row_exp_avg_sq"] == 7.0).any())


@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_one_optimizer_offloaded_follows_the_on_device_run(fraction):
    """NorMuon with an "adamw" group, offloaded (every param's state on the host, or
    some): the on-device run's params and state after 3 steps, the row state on the
    host."""
    a, b = whole_model(), whole_model()
    ref = one_optimizer("NorMuon", a)
    hidden, rest = split(b)
    off = optim.NorMuon([{"params": rest, "algorithm": "adamw", **ADAMW_KW},
                         {"params": hidden}], lr=0.02, offload=True, offload_fraction=fraction)
    train_model(a, [ref], 3)
    train_model(b, [off], 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(t, off.state[q][k]) for k, t in ref.state[p].items())
    assert off.state[b[1].weight]["row_exp_avg_sq"].device.type == "cpu"


def test_one_optimizer_crosses_to_torch_muon_and_adamw_and_back():
    """fp32 model, fp32 state: split_by_algorithm's parts, converted, load into
    torch.optim.AdamW (the "adamw" part) and torch.optim.Muon (the rest), which then
    step as precis does (torch.equal); converted back and joined (join_by_algorithm),
    the one optimizer continues bit for bit. (NorMuon's "muon" part is refused:
    test_one_optimizers_state_dict_resumes_and_crosses_to_torch_by_algorithm.)"""
    a = whole_model().float()
    one = one_optimizer("Muon", a)
    train_model(a, [one], 3)
    hidden, rest = split(a)
    parts = checkpoint.split_by_algorithm(one.state_dict())
    to_muon = checkpoint.to_torch_state_dict(parts["muon"], hidden)[0]
    to_adamw = checkpoint.to_torch_state_dict(parts["adamw"], rest)[0]
    c, d = whole_model().float(), whole_model().float()
    c.load_state_dict(a.state_dict())
    d.load_state_dict(a.state_dict())
    hidden_c, rest_c = split(c)
    torch_muon = torch.optim.Muon(hidden_c, lr=0.02)
    torch_adamw = torch.optim.AdamW(rest_c, **ADAMW_KW)
    torch_muon.load_state_dict(to_muon)
    torch_adamw.load_state_dict(to_adamw)
    back = checkpoint.join_by_algorithm(
        {"muon": checkpoint.from_torch_state_dict(to_muon, hidden),
         "adamw": checkpoint.from_torch_state_dict(to_adamw, rest)}, one.param_groups)
    again = one_optimizer("Muon", d)
    again.load_state_dict(back)
    train_model(a, [one], 2, first=3)
    train_model(c, [torch_muon, torch_adamw], 2, first=3)
    train_model(d, [again], 2, first=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), d.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
def test_a_schedulers_momentum_cycle_in_an_adamw_group_is_warned_of(cls, scheduler):
    """torch's OneCycleLR and CyclicLR (cycle_momentum=True, their default) cycle the
    option optimizer.defaults has, Muon's momentum, in every group: an "adamw" group's
    beta1 stayed as it was, silently off the two optimizers' bits. The step warns,
    naming the group (a warning: the keys stay in a checkpoint's groups, which must
    load); with cycle_momentum=False, nothing is said and each group takes the
    scheduler's lr."""
    from torch.optim import lr_scheduler
    make = dict(OneCycleLR=lambda o, cycle: lr_scheduler.OneCycleLR(
                    o, 0.05, total_steps=10, cycle_momentum=cycle),
                CyclicLR=lambda o, cycle: lr_scheduler.CyclicLR(
                    o, 1e-4, 1e-2, cycle_momentum=cycle))[scheduler]
    x = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(0))
    for cycle in (True, False):
        model = whole_model()
        opt = one_optimizer(cls, model)
        schedule = make(opt, cycle)
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                schedule.step()
        said = [str(w.message) for w in caught if "a scheduler cycles" in str(w.message)]
        assert bool(said) == cycle, said
        if cycle:
            assert said[0].startswith(f"{cls} param group 0 is an 'adamw' group whose "
                                      f"'momentum' a scheduler cycles")
            assert caught[0].filename == __file__  # (at the user's line)
            assert opt.param_groups[0]["betas"][0] == 0.9  # (not cycled: what it says)
            with warnings.catch_warnings():  # (its checkpoint, the keys kept, loads)
                warnings.simplefilter("ignore")
                one_optimizer(cls, whole_model()).load_state_dict(opt.state_dict())
        moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        hidden, _ = split(model)
        held = [any(p is h for h in hidden) for p in model.parameters()]
        assert any(m for m, h in zip(moved, held) if h) and \
            any(m for m, h in zip(moved, held) if not h)  # (both groups)
        assert opt.param_groups[0]["lr"] == opt.param_groups[1]["lr"] != 0.02


@pytest.mark.parametrize("cls", ["Muon", "NorMuon"])
def test_an_adamw_groups_defaults_are_torch_adamws(cls):
    """A group {"algorithm": "adamw"} that gives only its lr takes torch.optim.AdamW's
    defaults (weight_decay 0.01, not Muon's 0.1; betas, eps), so the one optimizer and the
    two (Muon(matrices), AdamW(rest), both with their defaults) give the same bits; a
    state dict saved with another weight decay loads as it was saved."""
    defaults = {k: v.default for k, v in inspect.signature(torch.optim.AdamW).parameters.items()
                if k in ("betas", "eps", "weight_decay", "amsgrad")}
    a, b = whole_model(), whole_model()
    hidden, rest = split(a)
    one = getattr(optim, cls)([{"params": rest, "algorithm": "adamw", "lr": 3e-3},
                               {"params": hidden}], lr=0.02)
    assert {k: one.param_groups[0][k] for k in defaults} == defaults
    hidden_b, rest_b = split(b)
    two = [optim.AdamW(rest_b, lr=3e-3), getattr(optim, cls)(hidden_b, lr=0.02)]
    train_model(a, [one], 5)
    train_model(b, two, 5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    saved = one.state_dict()
    saved["param_groups"][0]["weight_decay"] = 0.1  # (as a group saved before the change)
    one.load_state_dict(saved)
    assert one.param_groups[0]["weight_decay"] == 0.1


# microsoft/dion's NorMuon defaults (dion/normuon.py), under precis's (torch.optim.Muon's)
# option names.
DION = dict(lr=0.01, momentum=0.95, beta2=0.95, weight_decay=0.01, eps=1e-8, nesterov=False,
            adjust_lr_fn="spectral_norm", ns_coefficients="polar_express", momentum_form="sum")
DION_SHAPES = ((127, 33), (33, 127), (64, 64), (5, 97))


class DionReference:
    """dion's NorMuon (or Muon: beta2=None) on one device, written from its code in
    eager torch ops: muon_update_pre_orthogonalize's momentum (M = mu*M + G, Nesterov
    mu*M + G), polar_express (or zeropower_via_newtonschulz5 with its classic five:
    classic=True), NorMuon's normalization (_normuon_normalization_core),
    adjust_lr_spectral_norm and muon_update_post_orthogonalize's decay and update.
    dtype: float32, dion's (fp32 params and state, Newton-Schulz in bf16), or float64
    throughout (dion's math, no rounding to speak of)."""

    def __init__(self, params, lr, momentum, weight_decay, eps, nesterov, beta2=None,
                 classic=False, dtype=torch.float32):
        self.dtype = dtype
        self.params = [p.detach().to(dtype, copy=True) for p in params]
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.rows = [torch.zeros(p.shape[0], 1, dtype=dtype) for p in self.params]
        self.lr = lr
        self.mu = torch.tensor(momentum, dtype=dtype)
        self.wd = torch.tensor(weight_decay, dtype=dtype)
        self.eps, self.nesterov, self.beta2, self.classic = eps, nesterov, beta2, classic

    def orthogonalized(self, g):
        x = g.bfloat16() if self.dtype == torch.float32 else g
        if self.classic:
            tall = g.size(-2) > g.size(-1)
            x = x.mT if tall else x
            x = x / (x.norm(dim=(-2, -1), keepdim=True) + self.eps)
            for a, b, c in muon.DION_NS_COEFFICIENTS:
                gram = x @ x.mT
                x = a * x + (b * gram + c * (gram @ gram)) @ x
            return x.mT if tall else x
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + self.eps)
        for a, b, c in muon.POLAR_EXPRESS_COEFFICIENTS:
            if g.size(-2) > g.size(-1):
                gram = x.mT @ x
                x = a * x + x @ (b * gram + c * (gram @ gram))
            else:
                gram = x @ x.mT
                x = a * x + (b * gram + c * (gram @ gram)) @ x
        return x

    def step(self, grads):
        for i, (p, g) in enumerate(zip(self.params, grads)):
            g = g.to(self.dtype)
            self.bufs[i].mul_(self.mu).add_(g)
            u = self.bufs[i] * self.mu + g if self.nesterov else self.bufs[i]
            u = self.orthogonalized(u)
            if self.beta2 is not None:
                u = u.to(self.dtype)
                norm_u = u.norm(p=2, dim=(-2, -1), keepdim=True)
                self.rows[i] = torch.lerp(self.rows[i], (u * u).mean(dim=-1, keepdim=True),
                                          1 - torch.tensor(self.beta2, dtype=self.dtype))
                u = u / (self.rows[i].sqrt() + 1e-8)
                u = u * (norm_u / u.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8))
            p.mul_(1 - self.lr * self.wd)
            p.sub_(u * (self.lr * math.sqrt(p.shape[0] / p.shape[1])))


def distances_from_dion(cls, kw, ref_kw, steps=20):
    """(the largest |param - dion's in float64|, the same of dion's own code on fp32
    params, the largest |param| moved) over DION_SHAPES after `steps` steps on the same
    gradients."""
    params = make(DION_SHAPES, 4)
    opt = getattr(optim, cls)(params, **kw)
    exact = DionReference(params, **ref_kw, dtype=torch.float64)
    dions = DionReference(params, **ref_kw)
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        grads = grads_for(params, gen)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        exact.step(grads)
        dions.step(grads)

    def farthest(ps, qs):
        return max((p.detach().double() - q.double()).abs().max().item() for p, q in zip(ps, qs))
    return (farthest(params, exact.params), farthest(dions.params, exact.params),
            farthest(params, start))


DION_REF = dict(lr=0.01, momentum=0.95, weight_decay=0.01, eps=1e-8, nesterov=False)


@pytest.mark.parametrize("nesterov", (False, True))
def test_dions_options_give_dions_normuon(nesterov):
    """NorMuon with dion's defaults (DION: polar express, its momentum sum, the spectral
    norm's lr) on fp32 params, 20 steps at odd sizes, tall and wide: no farther from dion's
    math in float64 than dion's own code on fp32 params is (both run Newton-Schulz in
    bf16, precis through addmm's one rounding where dion's eager code rounds each
    product: not dion's bits, within its rounding); with torch's conventions (precis's
    defaults) 10 times that (3.5e-2 against 1.5e-3)."""
    near, dions, moved = distances_from_dion("NorMuon", dict(DION, nesterov=nesterov),
                                             dict(DION_REF, nesterov=nesterov, beta2=0.95))
    assert near <= 1.5 * dions and moved > 0.05, (near, dions, moved)
    torchs = {k: DION[k] for k in ("lr", "momentum", "beta2", "weight_decay", "eps")}
    far = distances_from_dion("NorMuon", dict(torchs, nesterov=nesterov),
                              dict(DION_REF, nesterov=nesterov, beta2=0.95))[0]
    assert far > 10 * dions, (far, dions)


def test_dions_classic_five_and_muon():
    """Muon with dion's classic five Newton-Schulz coefficients (a list, one triple an
    iteration), its momentum sum (Nesterov) and spectral norm lr: as near dion's Muon
    in float64 as dion's own code."""
    kw = dict(DION, nesterov=True, ns_coefficients=[list(c) for c in muon.DION_NS_COEFFICIENTS])
    del kw["beta2"]
    near, dions, moved = distances_from_dion("Muon", kw,
                                             dict(DION_REF, nesterov=True, classic=True))
    assert near <= 1.5 * dions and moved > 0.05, (near, dions, moved)


@pytest.mark.parametrize("nesterov", (False, True))
@pytest.mark.parametrize("policy", (None, {"momentum_dtype": "bf16"}))
def test_the_momentum_sum_is_dions_in_the_kernel(nesterov, policy):
    """momentum_form="sum" (the muon_momentum rule's rule_hyper[0]): on fp32 params the
    momentum after each step is torch.equal to dion's M.mul_(mu).add_(G) on the same
    gradients, and the step equals torch's Muon's math with that direction (Nesterov:
    M * mu + G) orthogonalized; under a bf16 momentum (stochastically rounded) the stored
    momentum is within 2^-6 of its largest value. Without the form the momentum is
    torch's average, (1 - mu) of it."""
    params = make(((37, 11),), 31)
    opt = optim.Muon(params, lr=0.02, momentum=0.9, nesterov=nesterov, momentum_form="sum",
                     policy=policy)
    p = params[0]
    buf, ref = torch.zeros_like(p), p.detach().clone()
    gen = torch.Generator().manual_seed(8)
    for _ in range(4):
        g = torch.randn(p.shape, generator=gen)
        p.grad = g.clone()
        opt.step()
        buf.mul_(torch.tensor(0.9)).add_(g)
        direction = buf * torch.tensor(0.9) + g if nesterov else buf
        ref.mul_(1 - 0.02 * 0.1)
        ref.add_(_zeropower_via_newtonschulz(direction, **NS),
                 alpha=-_adjust_lr(0.02, None, p.shape))
        stored = opt.decoded_state(p)["exp_avg"] if policy else opt.state[p]["exp_avg"]
        if policy is None:
            assert torch.equal(stored, buf)
            assert torch.equal(p.detach(), ref), (p.detach() - ref).abs().max()
        else:
            off = (stored.float() - buf).abs().max()
            assert off < 2 ** -6 * buf.abs().max(), off  # (the average: 10 times smaller)


def test_spectral_norm_and_a_list_of_one_triple_are_torchs_bits_so_scaled():
    """adjust_lr_fn="spectral_norm" steps a matrix with lr * sqrt(rows / columns) (a wide
    one too, where torch's "original" keeps lr), and ns_coefficients given as ns_steps
    copies of torch's triple run torch's Newton-Schulz: torch.optim.Muon's bits with
    that lr, no weight decay (which takes the unadjusted lr)."""
    for shape in ((33, 127), (127, 33)):
        ours, theirs = make((shape,), 12), make((shape,), 12)
        ratio = math.sqrt(shape[0] / shape[1])
        opt = optim.Muon(ours, lr=0.02, weight_decay=0.0, adjust_lr_fn="spectral_norm",
                         ns_coefficients=[NS["ns_coefficients"]] * 5)
        ref = torch.optim.Muon(theirs, lr=0.02 * ratio / max(1.0, ratio ** 2) ** 0.5,
                               weight_decay=0.0)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            g = torch.randn(shape, generator=gen)
            ours[0].grad, theirs[0].grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        assert torch.equal(ours[0], theirs[0]), shape


@pytest.mark.parametrize("kw,message", [
    (dict(momentum_form="dion"), r"momentum_form must be one of \('ema', 'sum'\), got 'dion'"),
    (dict(adjust_lr_fn="rms_norm"), r"Adjust learning rate function rms_norm is not supported"),
    (dict(ns_coefficients=[(1.0, 2.0, 3.0)] * 4),
     r"must be 3 finite numbers, or ns_steps \(5\) triples of them"),
    (dict(ns_coefficients="polar_express", ns_steps=6), r"ns_steps \(6\) triples"),
    (dict(ns_coefficients=[(1.0, 2.0)] * 5), r"ns_steps \(5\) triples"),
    (dict(ns_coefficients="polar"), r"or \"polar_express\", got 'polar'"),
])
def test_dions_options_bad_values_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        optim.NorMuon(make(SHAPES[:1], 22), **dict(KW, **kw))


def test_a_state_dict_saved_without_the_momentum_form_loads_as_torchs():
    """A Muon group saved before momentum_form existed (or by torch.optim.Muon) held
    torch's average: loaded into Muon(momentum_form="sum") its group keeps "ema", and it
    continues as the optimizer it was saved from."""
    a, b = make(((9, 7),), 2), make(((9, 7),), 2)
    saved_from = optim.Muon(a, lr=0.02)
    gen = torch.Generator().manual_seed(1)
    for p in (a[0], b[0]):
        p.grad = torch.randn(9, 7, generator=torch.Generator().manual_seed(1))
    saved_from.step()
    sd = saved_from.state_dict()
    del sd["param_groups"][0]["momentum_form"]
    loaded = optim.Muon(b, lr=0.02, momentum_form="sum")
    b[0].data.copy_(a[0].data)
    loaded.load_state_dict(sd)
    assert loaded.param_groups[0]["momentum_form"] == "ema"
    g = torch.randn(9, 7, generator=gen)
    a[0].grad, b[0].grad = g.clone(), g.clone()
    saved_from.step()
    loaded.step()
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("option", [dict(momentum_form="sum"), dict(adjust_lr_fn="spectral_norm"),
                                    dict(ns_coefficients="polar_express")])
def test_dions_options_are_refused_where_torchs_muon_would_step(option):
    """torch.optim.Muon has none of dion's options (it would step such a group with its
    own conventions): to_torch_state_dict refuses the group naming the option; the
    state dict itself, loaded by torch.optim.Muon, fails at its first step before it
    writes (it read a summed momentum as its average, 44% of an update off); a float64
    param (which torch's Muon math steps) is refused naming it, before anything is
    written."""
    params = make(((9, 7), (5, 6)), 3)
    opt = optim.Muon(params, lr=0.02, **option)
    for p in params:
        p.grad = torch.ones(p.shape)
    opt.step()
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"param group 0 asks for {name}=.*torch.optim.Muon "
                                         f"does not have"):
        checkpoint.to_torch_state_dict(opt.state_dict(), params)
    theirs = torch.optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.02)
    theirs.load_state_dict(opt.state_dict())
    before = [p.detach().clone() for p in theirs.param_groups[0]["params"]]
    for p in theirs.param_groups[0]["params"]:
        p.grad = torch.ones(p.shape)
    with pytest.raises(AttributeError, match="bytes"):
        theirs.step()
    assert all(torch.equal(p, b) for p, b in zip(theirs.param_groups[0]["params"], before))
    assert all(isinstance(s["momentum_buffer"], bytes) for s in theirs.state.values())
    wide = [torch.nn.Parameter(torch.ones(9, 7, dtype=torch.float64))]
    opt64 = optim.Muon(wide, lr=0.02, **option)
    wide[0].grad = torch.ones(9, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"torch.optim.Muon's own math, which has no {name}="):
        opt64.step()
    assert torch.equal(wide[0], torch.ones(9, 7, dtype=torch.float64)) and not opt64.state[wide[0]]
