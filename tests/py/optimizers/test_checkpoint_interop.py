"""Issue 65, items 2 and 3: precis state dicts that torch.optim reads exactly or refuses,
and a policy change at load that keeps the masters whatever the load order.

* SGD / Muon state torch would hold itself (fp32 momentum, no master, no scales) is
  saved under torch's 'momentum_buffer': torch.optim.SGD / Muon load it and their next
  steps give precis's bits (torch.equal). Any other state has STEP_MARKER there too:
  torch's loaders read no step and cannot be made to refuse, so their first step fails
  on it before writing a param, where a missing buffer would start a new momentum.
* to_torch_state_dict -> from_torch_state_dict loads back bit for bit (SGD, Muon, Lion);
  checkpoints saved before (momentum under 'exp_avg') still load.
* saved remainders loaded under a policy that keeps them otherwise (an fp32 master,
  remainders of the other width) give the same master whether the model or the
  optimizer is loaded first, without a StaleMasterWarning.
"""
import io
import warnings

import pytest
import torch

import precis  # noqa: F401  (loads the package, registers the ops)
from precis import checkpoint, optim
from precis.checkpoint import STEP_MARKER
from precis.optim import StaleMasterWarning

BF16 = torch.bfloat16


def roundtrip(sd):
    """sd through torch.save and a weights_only torch.load, as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def make(shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def train(opt, params, steps, seed=0):
    for s in range(steps):
        set_grads(params, seed + s)
        opt.step()


def torch_step_refuses(torch_cls, kw, params, sd):
    """torch_cls loads sd into copies of params, and its first step fails on the marker
    before it writes any param."""
    b = clones(params)
    opt_b = torch_cls(b, **kw)
    opt_b.load_state_dict(sd)
    set_grads(b, 5)
    with pytest.raises(AttributeError, match="'bytes' object"):
        opt_b.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(params, b)), "torch stepped a param"


CASES = {
    "sgd": (optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9), ((1,), (127,), (4097,))),
    "sgd_nesterov_wd": (optim.SGD, torch.optim.SGD,
                        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                        ((1,), (127,), (4097,))),
    "sgd_dampening": (optim.SGD, torch.optim.SGD,
                      dict(lr=0.05, momentum=0.8, dampening=0.3), ((127,), (4097,))),
    "muon": (optim.Muon, torch.optim.Muon, dict(lr=0.02), ((1, 1), (127, 33), (4097, 3))),
}


@pytest.mark.parametrize("name", CASES)
def test_torch_loads_precis_state_and_continues_bit_for_bit(name):
    """fp32 params, the default policy: the state dict's momentum is torch's
    'momentum_buffer'; torch's optimizer loads it and its next steps are precis's bits
    (before: torch ignored 'exp_avg' and restarted its momentum, 0.3-0.5 off)."""
    cls, torch_cls, kw, shapes = CASES[name]
    a = make(shapes, 1)
    opt_a = cls(a, **kw)
    train(opt_a, a, 3)
    sd = roundtrip(opt_a.state_dict())
    assert all("momentum_buffer" in s and "exp_avg" not in s for s in sd["state"].values())
    b = clones(a)
    opt_b = torch_cls(b, **kw)
    opt_b.load_state_dict(sd)
    for step in range(3):
        set_grads(a, 10 + step)
        set_grads(b, 10 + step)
        opt_a.step()
        opt_b.step()
        for i, (pa, pb) in enumerate(zip(a, b)):
            assert torch.equal(pa, pb), f"step {step}: param {i} differs"
            assert torch.equal(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["momentum_buffer"])


@pytest.mark.parametrize("name", ("sgd", "muon"))
@pytest.mark.parametrize("policy", (None, {"momentum_dtype": "fp8"}))
def test_torch_refuses_state_it_cannot_read(name, policy):
    """bf16 params with an fp32 master (the default policy), and fp8 momentum: torch's
    loader takes the dict (it reads no step), but its first step fails on the marker
    under 'momentum_buffer' with every param as it was, and the marker names
    to_torch_state_dict (before: torch started a new momentum and dropped the master)."""
    cls, torch_cls, kw, shapes = CASES[name]
    a = make(shapes, 2, BF16)
    opt_a = cls(a, policy=policy, **kw)
    train(opt_a, a, 2)
    sd = roundtrip(opt_a.state_dict())
    for s in sd["state"].values():
        assert s["momentum_buffer"] == STEP_MARKER and s["step"] == STEP_MARKER
        assert b"precis.checkpoint.to_torch_state_dict" in s["momentum_buffer"]
    torch_step_refuses(torch_cls, kw, a, sd)


@pytest.mark.parametrize("name", ("sgd", "muon"))
def test_torch_refuses_a_mixed_dict_whole(name):
    """An fp32 param (state torch reads exactly) beside a bf16 one with a master (state
    it cannot): every param is marked, so torch's first step fails at its first param
    and writes none (with the exact one unmarked, torch stepped it, then failed)."""
    cls, torch_cls, kw, shapes = CASES[name]
    a = make(shapes[1:], 3) + make(shapes[:1], 4, BF16)  # the exact ones first
    opt_a = cls(a, **kw)
    train(opt_a, a, 2)
    sd = roundtrip(opt_a.state_dict())
    assert all(s["momentum_buffer"] == STEP_MARKER for s in sd["state"].values())
    torch_step_refuses(torch_cls, kw, a, sd)
    opt_c = cls(clones(a), **kw)  # precis reads its own dict back whole
    opt_c.load_state_dict(sd)
    for pa, pc in zip(a, opt_c.param_groups[0]["params"]):
        assert torch.equal(opt_a.state[pa]["exp_avg"], opt_c.state[pc]["exp_avg"])


@pytest.mark.parametrize("policy", (None, {"store_param_remainders": True}))
@pytest.mark.parametrize("name", ("sgd", "muon", "lion"))
def test_to_torch_and_back_continues_bit_for_bit(name, policy):
    """precis -> to_torch_state_dict -> from_torch_state_dict -> precis: the same
    trajectory (before: from_torch_state_dict refused 'momentum_buffer', the key
    to_torch_state_dict writes, and Lion's missing exp_avg_sq)."""
    cls, _, kw, shapes = CASES.get(name, (optim.Lion, None, dict(lr=1e-3, weight_decay=0.1),
                                          ((1,), (127,), (4097,))))
    a = make(shapes, 3, BF16 if policy else torch.float32)
    opt_a = cls(a, policy=policy, **kw)
    train(opt_a, a, 3)
    torch_sd, masters = checkpoint.to_torch_state_dict(roundtrip(opt_a.state_dict()), a)
    assert bool(masters) == bool(policy)
    b = clones(a)
    sd = checkpoint.from_torch_state_dict(roundtrip(torch_sd), b, policy, masters)
    opt_b = cls(b, policy=policy, **kw)
    opt_b.load_state_dict(roundtrip(sd))
    train(opt_a, a, 3, seed=20)
    train(opt_b, b, 3, seed=20)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        assert torch.equal(opt_a.master_weight(pa), opt_b.master_weight(pb))


@pytest.mark.parametrize("name", ("sgd", "muon"))
@pytest.mark.parametrize("policy", (None, {"store_param_remainders": True}))
def test_checkpoints_with_momentum_under_exp_avg_still_load(name, policy):
    """A checkpoint saved before (momentum as 'exp_avg', no 'momentum_buffer') resumes
    bit for bit."""
    cls, _, kw, shapes = CASES[name]
    a = make(shapes, 4, BF16 if policy else torch.float32)
    opt_a = cls(a, policy=policy, **kw)
    train(opt_a, a, 3)
    sd = roundtrip(opt_a.state_dict())
    for s in sd["state"].values():
        momentum = s.pop("momentum_buffer")
        if isinstance(momentum, torch.Tensor):
            s["exp_avg"] = momentum
    b = clones(a)
    opt_b = cls(b, policy=policy, **kw)
    opt_b.load_state_dict(sd)
    train(opt_a, a, 3, seed=30)
    train(opt_b, b, 3, seed=30)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_state_of_momentum_none_loads_as_torch(momentum, nesterov):
    """torch.optim.SGD's {'momentum_buffer': None} (torch 1.x saved it for every param,
    momentum 0 too; torch 2.13 loads it as no momentum yet): loaded, then stepped with
    torch's bits (precis refused it: "'exp_avg' must be a tensor, got NoneType")."""
    runs = []
    for cls in (optim.SGD, torch.optim.SGD):
        params = make(((1,), (127,), (4097,)), 6)
        opt = cls(params, lr=0.1, momentum=momentum, nesterov=nesterov)
        group = {k: v for k, v in opt.state_dict()["param_groups"][0].items()}
        opt.load_state_dict({"state": {0: {"momentum_buffer": None},
                                       2: {"momentum_buffer": None}}, "param_groups": [group]})
        train(opt, params, 3)
        runs.append(params)
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("change,message", [
    (lambda s: s.__setitem__("exp_avg", s["momentum_buffer"].clone()),
     "has both 'exp_avg' and 'momentum_buffer'"),
    (lambda s: s.__setitem__("momentum_buffer", b"not precis's marker"),
     "'momentum_buffer' is bytes but not precis's marker"),
])
def test_ambiguous_momentum_refused_before_anything_changes(change, message):
    a = make(((127,),), 5)
    opt = optim.SGD(a, lr=0.1, momentum=0.9)
    train(opt, a, 2)
    before = opt.state[a[0]]["exp_avg"].clone()
    sd = roundtrip(opt.state_dict())
    change(sd["state"][0])
    for load in (opt.load_state_dict,
                 lambda sd: checkpoint.from_torch_state_dict(sd, a),
                 lambda sd: checkpoint.to_torch_state_dict(sd, a)):
        with pytest.raises(ValueError, match=message):
            load(sd)
    assert torch.equal(opt.state[a[0]]["exp_avg"], before)


REMAINDERS16 = {"store_param_remainders": True}
REMAINDERS8 = {"store_param_remainders": True, "param_remainder_bits": 8}
# (the saved policy, the loading one): remainders joined into an fp32 master, or
# converted to the other width (8 -> 16 bits is exact; 16 -> 8 rounds the master)
CHANGES = {"rem16->master": (REMAINDERS16, None), "rem8->master": (REMAINDERS8, None),
           "rem8->rem16": (REMAINDERS8, REMAINDERS16), "rem16->rem8": (REMAINDERS16, REMAINDERS8)}


def load_in_order(sd, model, policy, order, shapes):
    """A new AdamW over fresh params of `shapes`, given the optimizer state sd and the
    model weights `model` in `order`, then a step at lr 0 (it keeps the masters as
    loaded); (params, optimizer, StaleMasterWarnings of the step)."""
    b = make(shapes, 99, BF16)  # other weights until the model is loaded
    opt = optim.AdamW(b, policy=policy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if order == "model first":
            for p, w in zip(b, model):
                p.data.copy_(w)
            opt.load_state_dict(sd)
        else:
            opt.load_state_dict(sd)
            for p, w in zip(b, model):
                p.data.copy_(w)
        for group in opt.param_groups:
            group["lr"] = 0.0  # (the load set the saved one)
        train(opt, b, 1, seed=40)
    return b, opt, [w for w in seen if issubclass(w.category, StaleMasterWarning)]


@pytest.mark.parametrize("change", CHANGES)
def test_policy_change_at_load_keeps_masters_in_either_order(change):
    """Saved remainders, loaded where the policy keeps an fp32 master (or the other
    width), before or after the model: the same masters, the saved ones bit for bit
    where the new form holds them, and no StaleMasterWarning (before, optimizer first:
    every master collapsed to its bf16 param, with the warning)."""
    saved_policy, policy = CHANGES[change]
    shapes = ((1,), (127,), (4097,))
    a = make(shapes, 6, BF16)
    opt_a = optim.AdamW(a, lr=1e-3, policy=saved_policy)
    train(opt_a, a, 3)
    sd = roundtrip(opt_a.state_dict())
    model = [p.detach().clone() for p in a]
    saved = [opt_a.master_weight(p) for p in a]
    runs = {order: load_in_order(sd, model, policy, order, shapes)
            for order in ("model first", "optimizer first")}
    for order, (b, opt_b, stale) in runs.items():
        assert not stale, f"{order}: {stale[0].message}"
    (b1, opt1, _), (b2, opt2, _) = runs.values()
    for p1, p2 in zip(b1, b2):
        assert torch.equal(opt1.master_weight(p1), opt2.master_weight(p2))
        assert torch.equal(p1, p2)
    if change != "rem16->rem8":  # (8 bits hold the master rounded to 24 bits)
        for want, p in zip(saved, b2):
            assert torch.equal(opt2.master_weight(p), want)


RESAVES = {**CHANGES, "rem16->rem16": (REMAINDERS16, REMAINDERS16),
           "master->rem16": (None, REMAINDERS16)}


@pytest.mark.parametrize("weights", ["never loaded", "loaded after"])
@pytest.mark.parametrize("change", RESAVES)
def test_state_dict_before_the_first_step_after_a_load_resumes_as_the_load(change, weights):
    """A checkpoint loaded into an optimizer of another policy before its model's
    weights, and saved again before any step (a conversion script): the new checkpoint
    resumes as the first did, bit for bit and without a StaleMasterWarning, whether the
    weights arrived before the save or never (state_dict() exported the master joined
    with the param's bits at the load, and their fingerprint: its resume was off by up
    to 0.66, or warned and dropped the remainders)."""
    saved_policy, policy = RESAVES[change]
    shapes = ((1,), (127,), (4097,))
    a = make(shapes, 6, BF16)
    opt_a = optim.AdamW(a, lr=1e-3, policy=saved_policy)
    train(opt_a, a, 3)
    sd = roundtrip(opt_a.state_dict())
    b = make(shapes, 99, BF16)  # other weights
    opt_b = optim.AdamW(b, policy=policy)
    opt_b.load_state_dict(sd)
    if weights == "loaded after":
        for p, q in zip(b, a):
            p.data.copy_(q)
    resaved = roundtrip(opt_b.state_dict())
    runs = []
    for state in (sd, resaved):
        c = clones(a)  # the model first, then the optimizer
        opt_c = optim.AdamW(c, lr=1e-3, policy=policy)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt_c.load_state_dict(state)
            train(opt_c, c, 2, seed=40)
        assert not [w for w in seen if issubclass(w.category, StaleMasterWarning)]
        runs.append((c, opt_c))
    (c1, opt1), (c2, opt2) = runs
    for p1, p2 in zip(c1, c2):
        assert torch.equal(p1, p2)
        assert torch.equal(opt1.master_weight(p1), opt2.master_weight(p2))
    if weights == "loaded after" and policy is None:  # the master the step would use
        for p, q, m in zip(b, a, resaved["state"].values()):
            assert torch.equal(m["master"], opt_a.master_weight(q))


def test_optimizer_first_then_other_weights_resyncs_and_warns():
    """The remainder joins only with the weights it was saved with: other weights loaded
    after the optimizer make the master the param's, with the warning, as before."""
    shapes = ((127,),)
    a = make(shapes, 7, BF16)
    opt_a = optim.AdamW(a, lr=1e-3, policy=REMAINDERS16)
    train(opt_a, a, 3)
    other = [p.detach() + 1 for p in a]
    b, opt_b, stale = load_in_order(roundtrip(opt_a.state_dict()), other, None,
                                    "optimizer first", shapes)
    assert stale
    assert not opt_b._books.joins


@pytest.mark.parametrize("offload", [None, "cpu"])  # a Plan's steps; the full path's
def test_a_step_forgets_a_loaded_remainders_fingerprint(offload):
    """A remainder loaded with the model's bits is kept while the param holds them (found
    at the load: its fingerprint is not kept); once a step has written the param the
    remainder moved with it, so reloading the checkpoint's weights afterwards is a load
    (the remainder resynced, with the warning), not the step's remainder kept on the
    saved bits. (An offloaded optimizer, which keeps no Plan, kept the saved fingerprint
    for ever, found by a review.)"""
    kw = {} if offload is None else {"offload": offload}
    a = make(((4097,),), 1, BF16)
    opt_a = optim.AdamW(a, lr=1e-2, policy=REMAINDERS16, **kw)
    train(opt_a, a, 2)
    sd, weights = roundtrip(opt_a.state_dict()), [p.detach().clone() for p in a]
    b = clones(a)
    opt_b = optim.AdamW(b, lr=1e-2, policy=REMAINDERS16, **kw)
    opt_b.load_state_dict(sd)
    assert not opt_b._books.fingerprints  # (the param holds the saved bits: kept)
    train(opt_b, b, 3, seed=5)
    assert not opt_b._books.fingerprints
    for p, w in zip(b, weights):
        p.data.copy_(w)
    with pytest.warns(StaleMasterWarning, match="remainders resynced"):
        train(opt_b, b, 1, seed=7)


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("bits", [16, 8])
def test_a_remainder_loaded_onto_other_bits_is_resynced_whole(monkeypatch, bits,
                                                              device_path):
    """Params written (zeros into every fourth element) and then the optimizer's state
    loaded: the loaded remainders belong to the bits their params were saved with, not to
    these, and no write after the load moves the load's records, so the next step checks
    them anyway (optim_state.written_behind) and resyncs them whole (the master the param
    exactly), with the warning: bit for bit a step of the same state with its remainders
    zeroed. (Kept, they made masters of the zeros and the old low bits: a +0 param with a
    negative remainder joined into a NaN master, and its moments NaN.)"""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    policy = {"store_param_remainders": True, "param_remainder_bits": bits}
    a = make(((4097,), (130,)), 3, BF16)
    opt_a = optim.AdamW(a, lr=1e-2, policy=policy)
    train(opt_a, a, 2)
    sd = roundtrip(opt_a.state_dict())
    train(opt_a, a, 1, seed=4)  # (the params move on from the saved bits)
    b = clones(a)
    for params in (a, b):
        with torch.no_grad():
            for p in params:
                p[::4] = 0.0
    opt_a.load_state_dict(sd)
    opt_b = optim.AdamW(b, lr=1e-2, policy=policy)
    opt_b.load_state_dict(sd)
    with torch.no_grad():
        for p in b:
            opt_b.state[p]["remainder"].zero_()
    with pytest.warns(StaleMasterWarning, match="remainders resynced"):
        train(opt_a, a, 1, seed=9)
    with warnings.catch_warnings():  # (its own check of the same loaded remainders)
        warnings.simplefilter("ignore", StaleMasterWarning)
        train(opt_b, b, 1, seed=9)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in opt_a.state[p])
        assert not opt_a.state[p]["exp_avg"].float().isnan().any()


def test_no_join_anew_once_a_step_changed_the_master():
    """A step between the optimizer's load and the model's moved the master joined at load:
    the saved remainder no longer applies to it, and the model's load is a load (the
    master resynced from the param, with the warning), not a join anew."""
    shapes = ((127,),)
    a = make(shapes, 8, BF16)
    opt_a = optim.AdamW(a, lr=1e-3, policy=REMAINDERS16)
    train(opt_a, a, 3)
    sd = roundtrip(opt_a.state_dict())
    b = make(shapes, 99, BF16)
    opt_b = optim.AdamW(b)
    opt_b.load_state_dict(sd)
    train(opt_b, b, 1, seed=50)
    for p, w in zip(b, a):
        p.data.copy_(w)
    with pytest.warns(StaleMasterWarning):
        train(opt_b, b, 1, seed=51)
    assert not opt_b._books.joins
