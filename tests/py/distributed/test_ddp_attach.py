"""How precis.ddp relates to the optimizer, and the Sharding value.

  * attach_optimizer() works through torch's optimizer hooks: no method of the
    optimizer (instance or class) is replaced, for precis.optim.AdamW and for
    torch.optim.AdamW;
  * the sharded step with a loss scale reads nothing back to the host: the found_inf
    the ranks agree on stays a device tensor (a capturable precis step then makes no
    host read at all), and the ranks still skip together;
  * an optimizer over a wrapper's params that is not attached raises at its first
    step, before anything changes; attach_optimizer refuses optimizers it cannot
    serve;
  * Sharding parses users' strings (or raises naming the accepted ones) and answers
    what each strategy shards.
"""
import contextlib
import warnings

import pytest
import torch

import ddp_worker as w
from precis.ddp import STRATEGIES, Sharding

METHODS = ("step", "zero_grad", "state_dict", "load_state_dict")
# Tensor methods that read a value back to the host (a device synchronization on a GPU).
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def count_host_reads(calls):
    """Append the name of every host-reading Tensor method called inside to calls."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name, fn):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counting(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def backward(ddp, rank, world_size, batch_index=0):
    x, y = w.make_batches(batch_index + 1)[batch_index]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    w.loss_fn(ddp, xm, ym, 1.0).backward()


def nan_in_rank0_shard(ddp):
    """A NaN in this rank's gradient of the first param's first row (rank 0's shard)."""
    p = next(ddp.module.parameters())
    return p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))


# ---------------------------------------------------------------------------
# Cases (run in the child processes)
# ---------------------------------------------------------------------------


def case_no_method_replaced(rank, world_size, strategy, optimizer):
    import precis.ddp
    import precis.optim
    cls = {"precis": precis.optim.AdamW, "torch": torch.optim.AdamW}[optimizer]
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding=strategy, bucket_size=50)
    opt = cls(ddp.parameters(), **w.OPTIM_KW)
    on_class = {name: getattr(type(opt), name) for name in METHODS}
    precis.ddp.attach_optimizer(opt)
    hooks = len(opt._optimizer_step_pre_hooks)
    same = precis.ddp.attach_optimizer(opt) is opt  # again: a no-op
    before = w.flat_params(ddp.module)
    for step in range(2):
        backward(ddp, rank, world_size, step)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    return {"in_instance": [name for name in METHODS if name in vars(opt)],
            "class_unchanged": all(getattr(type(opt), name) is on_class[name]
                                   for name in METHODS),
            "bound_to_class": all(getattr(opt, name).__func__ is on_class[name]
                                  for name in METHODS),
            "again_same": same, "hooks_added_again": len(opt._optimizer_step_pre_hooks) - hooks,
            "has_meta": "precis_ddp" in sd, "params": w.flat_params(ddp.module),
            "moved": not torch.equal(before, w.flat_params(ddp.module))}


def case_no_host_read(rank, world_size, strategy, capturable, nan):
    """One step with a device loss scale after a warm-up step; the host reads made
    inside opt.step(), and whether every rank skipped it."""
    import precis.ddp
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding=strategy, bucket_size=50)
    opt = precis.ddp.attach_optimizer(
        precis.optim.AdamW(ddp.parameters(), capturable=capturable, **w.OPTIM_KW))
    scale = torch.tensor(1024.0)

    def scaled_backward(batch_index):
        x, y = w.make_batches(batch_index + 1)[batch_index]
        xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
        (w.loss_fn(ddp, xm, ym, 1.0) * scale).backward()

    scaled_backward(0)
    opt.step(grad_scale=scale)  # warm-up: the state exists
    if nan and rank == 1:
        nan_in_rank0_shard(ddp)
    scaled_backward(1)
    before = w.flat_params(ddp.module)
    calls = []
    with count_host_reads(calls):
        opt.step(grad_scale=scale)
    flag = opt.last_found_inf if capturable else None
    return {"calls": calls, "unchanged": torch.equal(before, w.flat_params(ddp.module)),
            "found_inf": None if flag is None else float(flag),
            "skipped": opt.last_step_skipped, "params": w.flat_params(ddp.module)}


def case_unattached(rank, world_size, strategy):
    """An optimizer over a wrapper's params, never attached: its step must raise."""
    import precis.ddp
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding=strategy, bucket_size=50)
    opt = precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW)
    backward(ddp, rank, world_size)
    before = w.flat_params(ddp.module)
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "unchanged": torch.equal(before, w.flat_params(ddp.module)),
            "state": len(opt.state)}


def case_group_added_after_attach(rank, world_size, strategy):
    """A param group added after attach_optimizer(): under no_shard stepped whole (its
    params move); a sharded wrapper's param refused at the step, naming it, before
    anything moves (under optim_grads it was never stepped, silently)."""
    import precis.ddp
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding=strategy, bucket_size=50)
    params = list(ddp.parameters())
    opt = precis.ddp.attach_optimizer(precis.optim.AdamW(params[:2], **w.OPTIM_KW))
    opt.add_param_group({"params": params[2:]})
    backward(ddp, rank, world_size)
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    moved = [not torch.equal(b, p) for b, p in zip(before, params)]
    return {"error": error, "moved": moved}


def case_attach_errors(rank, world_size):
    import precis.ddp
    import precis.optim
    out = {}

    # No param of any wrapper.
    out["no_wrapper"] = w.error_text(lambda: precis.ddp.attach_optimizer(
        precis.optim.AdamW(w.make_model().parameters())))
    # A torch optimizer whose step is not elementwise, on a sharded wrapper's pieces.
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding="optim", bucket_size=50)
    lbfgs = torch.optim.LBFGS(ddp.parameters())
    out["not_elementwise"] = w.error_text(lambda: precis.ddp.attach_optimizer(lbfgs))
    out["not_elementwise_groups"] = all(p in set(ddp.parameters())
                                        for g in lbfgs.param_groups for p in g["params"])
    # State for params a sharded wrapper splits (here: loaded from a plain run).
    plain = w.make_model()
    plain_opt = precis.optim.AdamW(plain.parameters(), **w.OPTIM_KW)
    w.loss_fn(plain, *w.make_batches(1)[0], 1.0).backward()
    plain_opt.step()
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding="optim", bucket_size=50)
    opt = precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW)
    opt.load_state_dict(plain_opt.state_dict())
    groups_before = [list(g["params"]) for g in opt.param_groups]
    out["stateful"] = w.error_text(lambda: precis.ddp.attach_optimizer(opt))
    out["groups_unchanged"] = all(
        len(a) == len(b) and all(x is y for x, y in zip(a, b))
        for a, b in zip(groups_before, [g["params"] for g in opt.param_groups]))
    # Strategies: a Sharding, a user's spelling, ZeRO-3 refused. (Results travel
    # through torch.load(weights_only=True): names, not Sharding values.)
    out["spelled"] = precis.ddp.DistributedDataParallel(
        w.make_model(), sharding=" Optim_Grads ").sharding.name
    out["enum"] = precis.ddp.DistributedDataParallel(
        w.make_model(), sharding=Sharding.OPTIM).sharding.name
    out["zero3"] = w.error_text(lambda: precis.ddp.DistributedDataParallel(
        w.make_model(), sharding="optim_grads_params"))
    out["not_a_string"] = w.error_text(lambda: precis.ddp.DistributedDataParallel(
        w.make_model(), sharding=2))
    # fp8 moments: a wrapper given that policy cuts shards at the 128-element blocks of
    # their scales; one not given it cuts them anywhere, which attach_optimizer warns of.
    fp8 = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
    for given in (True, False):
        ddp = precis.ddp.DistributedDataParallel(w.make_model(torch.bfloat16, hidden1=64),
                                                 policy=fp8 if given else None,
                                                 sharding="optim", bucket_size=50)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), policy=fp8,
                                                                 **w.OPTIM_KW))
        out[f"fp8_given_{given}"] = ([str(x.message) for x in caught],
                                     precis.ddp.optimizer_pieces(opt),
                                     {n: p.numel() for n, p in ddp.module.named_parameters()})
    return out


CASES = {
    **{("methods", s, o): (case_no_method_replaced, (s, o))
       for s in STRATEGIES for o in ("precis", "torch")},
    **{("host", s, c, n): (case_no_host_read, (s, c, n))
       for s in STRATEGIES for c in (True, False) for n in (False, True)},
    **{("unattached", s): (case_unattached, (s,)) for s in STRATEGIES},
    **{("added", s): (case_group_added_after_attach, (s,)) for s in STRATEGIES},
    ("errors",): (case_attach_errors, ()),
}


def result(key):
    return w.case_result(CASES, 2, key)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["precis", "torch"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_method_of_the_optimizer_is_replaced(strategy, optimizer):
    r0, r1 = result(("methods", strategy, optimizer))
    for r in (r0, r1):
        assert r["in_instance"] == [], r["in_instance"]
        assert r["class_unchanged"] and r["bound_to_class"]
        assert r["again_same"] and r["hooks_added_again"] == 0
        # The state-dict hook adds the sharded metadata (and its load hook took it).
        assert r["has_meta"] == (strategy != "no_shard")
    assert torch.equal(r0["params"], r1["params"])
    # precis steps main_grad; torch.optim.AdamW steps .grad, which the wrapper lends it
    # from main_grad for its step (it moved nothing before): the same bits (fp32)
    assert r0["moved"]
    if optimizer == "torch":
        assert torch.equal(r0["params"], result(("methods", strategy, "precis"))[0]["params"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_step_with_a_loss_scale_reads_nothing_back(strategy):
    for nan in (False, True):
        r0, r1 = result(("host", strategy, True, nan))
        for r in (r0, r1):
            # capturable: the whole step, agreement included, stays on the device.
            assert r["calls"] == [], r["calls"]
            assert r["found_inf"] == (1.0 if nan else 0.0)
            assert r["unchanged"] == nan
        assert torch.equal(r0["params"], r1["params"])
        # The eager step reads its found_inf once; the counter sees such reads.
        e0, e1 = result(("host", strategy, False, nan))
        for r in (e0, e1):
            assert len(r["calls"]) >= 1, r["calls"]
            assert r["skipped"] == nan and r["unchanged"] == nan
        assert torch.equal(e0["params"], e1["params"])
        # Eager and capturable steps are the same math.
        assert torch.equal(e0["params"], r0["params"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_unattached_optimizer_raises_before_stepping(strategy):
    for r in result(("unattached", strategy)):
        assert r["error"] is not None and "attach_optimizer" in r["error"], r
        assert "'0.weight'" in r["error"], r["error"]
        assert r["unchanged"] and r["state"] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_group_added_after_attach_is_stepped_or_refused(strategy):
    for r in result(("added", strategy)):
        if strategy == "no_shard":
            assert r["error"] is None and all(r["moved"]), r
            continue
        assert r["error"] is not None and "'2.weight'" in r["error"], r
        assert f"sharding {strategy!r}" in r["error"] and "param group 1" in r["error"], r
        assert not any(r["moved"]), r


def test_attach_and_strategy_errors():
    errors = result(("errors",))[0]
    assert "ValueError" in errors["no_wrapper"]
    assert "DistributedDataParallel" in errors["no_wrapper"]
    assert errors["not_elementwise"].startswith("ValueError: attach_optimizer: LBFGS would "
                                                "step this rank's pieces of '0.weight'")
    assert "sharding='no_shard'" in errors["not_elementwise"]
    assert errors["not_elementwise_groups"]  # (its params left as they were)
    assert "ValueError" in errors["stateful"] and "before its first step" in errors["stateful"]
    assert errors["groups_unchanged"]
    assert errors["spelled"] == "OPTIM_GRADS" and errors["enum"] == "OPTIM"
    assert "ValueError" in errors["zero3"] and "optim_grads_params" in errors["zero3"]
    assert "optim_grads" in errors["zero3"].split("accepted here:")[1]
    assert "TypeError" in errors["not_a_string"] and "int" in errors["not_a_string"]
    for r in result(("errors",)):
        warned, pieces, numels = r["fp8_given_True"]
        assert warned == [] and pieces, (warned, pieces)
        assert all(start % 128 == 0 and (stop % 128 == 0 or stop == numels[name])
                   for name, start, stop in pieces), pieces
        assert any(start > 0 or stop < numels[name] for name, start, stop in pieces), pieces
        warned, pieces, _ = r["fp8_given_False"]
        cut = [(name, start, stop) for name, start, stop in pieces
               if start % 128 or (stop % 128 and stop != numels[name])]
        assert cut and len(warned) == 1, (warned, pieces)
        assert "128-element blocks" in warned[0] and repr(cut[0][0]) in warned[0], warned


# ---------------------------------------------------------------------------
# Sharding (no process group needed)
# ---------------------------------------------------------------------------


def test_sharding_parses_names():
    assert Sharding.parse("optim") is Sharding.OPTIM
    assert Sharding.parse(" NO_SHARD\n") is Sharding.NO_SHARD
    assert Sharding.parse(Sharding.OPTIM_GRADS) is Sharding.OPTIM_GRADS
    assert [Sharding.parse(s) for s in STRATEGIES] == \
        [Sharding.NO_SHARD, Sharding.OPTIM, Sharding.OPTIM_GRADS]
    assert "optim_grads_params" not in STRATEGIES  # not served by precis.ddp


@pytest.mark.parametrize("value", ["zero3", "", "optim-grads", "optim grads"])
def test_sharding_refuses_unknown_names(value):
    with pytest.raises(ValueError) as e:
        Sharding.parse(value, "config")
    msg = str(e.value)
    assert msg.startswith("config: ") and repr(value) in msg
    for s in Sharding:
        assert s.value in msg


@pytest.mark.parametrize("value", [None, 1, True, ["optim"], b"optim"])
def test_sharding_refuses_other_types(value):
    with pytest.raises(TypeError, match=type(value).__name__):
        Sharding.parse(value)


def test_sharding_properties():
    table = {  # shards_optimizer_state, shards_grads, shards_params, reduces_every_micro_batch
        Sharding.NO_SHARD: (False, False, False, False),
        Sharding.OPTIM: (True, False, False, False),
        Sharding.OPTIM_GRADS: (True, True, False, True),
        Sharding.OPTIM_GRADS_PARAMS: (True, True, True, True),
    }
    assert set(table) == set(Sharding)
    for s, want in table.items():
        got = (s.shards_optimizer_state, s.shards_grads, s.shards_params,
               s.reduces_every_micro_batch)
        assert got == want, (s, got)
