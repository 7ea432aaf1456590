"""The known traps of gradient buckets (docs/design.md section 5), one test each:

  * optim: the reduced shard is copied into the unsharded buffer, never added (the
    buffer already holds the local gradient, which would count twice);
  * a world of one process does not double the gradients;
  * no_sync() holds back every micro-batch but the last, and the last reduces
    everything accumulated (optim_grads reduces every micro-batch by design);
  * every model chunk (several wrappers under one optimizer) is synchronized;
  * a backward after optimizer.step() starts from zero buffers, with no zero_grad
    (the step consumed them; a second synced backward without a step raises);
  * a NaN/Inf gradient is reported with the parameter's name and rank, before the
    collective, on every rank;
  * torch's ZeroRedundancyOptimizer over a precis optimizer: its load_state_dict puts
    saved entries into the optimizer's state as saved, refused by name at the step;
    each rank's own optimizer state dict resumes.

All world-2 cases run in one pair of processes; each case catches its own errors
so one failure does not hide the others.
"""
import contextlib
import os

import pytest
import torch
import torch.nn as nn

import ddp_worker as w

STRATEGIES = ("no_shard", "optim", "optim_grads")


def reference_grads(x, y, seed=0, dtype=torch.float32):
    """{param name: flat gradient} of the mean loss over (x, y), one process."""
    model = w.make_model(dtype, seed)
    w.loss_fn(model, x, y, x.shape[0]).backward()
    return {name: p.grad.detach().float().reshape(-1) for name, p in model.named_parameters()}


def optimizer_grads(opt):
    """[(param name, start, stop, the main_grad the optimizer will use)] of every
    param or piece the optimizer steps."""
    import precis.ddp
    pieces = precis.ddp.optimizer_pieces(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    return [(name, a, b, p.main_grad.detach().float().reshape(-1))
            for (name, a, b), p in zip(pieces, params)]


def grad_error(opt, ref):
    """Largest relative difference between what the optimizer sees and ref; also
    the number of elements compared."""
    worst, n = 0.0, 0
    for name, a, b, got in optimizer_grads(opt):
        want = ref[name][a:b]
        scale = want.abs().max().item() + 1e-30
        worst = max(worst, ((got - want).abs().max() / scale).item())
        n += b - a
    return worst, n


def build(rank, world_size, strategy, policy=None, dtype=torch.float32, **kw):
    import precis.ddp
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(w.make_model(dtype), policy=policy,
                                             sharding=strategy, bucket_size=50, **kw)
    opt = precis.ddp.attach_optimizer(
        precis.optim.AdamW(ddp.parameters(), policy=policy, **w.OPTIM_KW))
    return ddp, opt


def backward_micro_batches(ddp, rank, world_size, micro, sync_last=True):
    x, y = w.make_batches(1)[0]
    per_rank = w.GLOBAL_BATCH // world_size
    for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, micro)):
        last = i == micro - 1 and sync_last
        with contextlib.nullcontext() if last else ddp.no_sync():
            w.loss_fn(ddp, xm, ym, per_rank).backward()
    return x, y


# ---------------------------------------------------------------------------
# Cases (run in the child processes)
# ---------------------------------------------------------------------------


def case_reduced_grads(rank, world_size, strategy, policy, micro):
    """What the optimizer sees after backward == the single-process gradient."""
    ddp, opt = build(rank, world_size, strategy, policy)
    x, y = backward_micro_batches(ddp, rank, world_size, micro)
    err, n = grad_error(opt, reference_grads(x, y))
    return {"err": err, "numel": n, "bytes": ddp.comm_bytes}


def case_no_sync(rank, world_size, strategy):
    """Per micro-batch: bytes sent, and whether main_grad is still the local one."""
    ddp, opt = build(rank, world_size, strategy)
    x, y = w.make_batches(1)[0]
    micro = 3
    per_rank = w.GLOBAL_BATCH // world_size
    batches = w.local_micro_batches(x, y, rank, world_size, micro)
    sent, local_ok = [], []
    local = None
    for i, (xm, ym) in enumerate(batches):
        with contextlib.nullcontext() if i == micro - 1 else ddp.no_sync():
            w.loss_fn(ddp, xm, ym, per_rank).backward()
        sent.append(sum(ddp.comm_bytes.values()))
        if strategy != "optim_grads" and i < micro - 1:
            # Still this rank's own accumulated gradient: compare with a local run.
            model = w.make_model()
            for xl, yl in batches[:i + 1]:
                w.loss_fn(model, xl, yl, per_rank).backward()
            local = {n: p.grad.reshape(-1) for n, p in model.named_parameters()}
            local_ok.append(all(torch.allclose(p.main_grad.reshape(-1), local[n], atol=1e-7)
                                for n, p in ddp.module.named_parameters()))
    err, _ = grad_error(opt, reference_grads(x, y))
    return {"sent": sent, "local_ok": local_ok, "err": err}


def case_only_no_sync_then_step(rank, world_size, strategy):
    """All micro-batches inside no_sync(): step() still reduces everything."""
    ddp, opt = build(rank, world_size, strategy)
    x, y = backward_micro_batches(ddp, rank, world_size, 2, sync_last=False)
    ref = reference_grads(x, y)
    ddp.finish_grad_sync()  # what optimizer.step() does first
    err, _ = grad_error(opt, ref)
    return {"err": err}


class Chunk(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


def case_model_chunks(rank, world_size, strategy):
    """The test model cut in two chunks, each its own wrapper (as with pipeline
    stages of virtual chunks), one optimizer over both: trains like one process."""
    import precis.ddp
    import precis.optim
    full = w.make_model()
    layers = list(full)
    chunk_kw = [dict(bucket_size=30), dict(bucket_size=1000, overlap_grad_reduce=False)]
    chunks = [precis.ddp.DistributedDataParallel(Chunk(part), sharding=strategy, **kw)
              for part, kw in zip((layers[:2], layers[2:]), chunk_kw)]
    opt = precis.optim.AdamW([p for c in chunks for p in c.parameters()], **w.OPTIM_KW)
    precis.ddp.attach_optimizer(opt)  # one call covers both chunks
    steps, micro = 3, 2
    per_rank = w.GLOBAL_BATCH // world_size
    for x, y in w.make_batches(steps):
        for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, micro)):
            ctx = contextlib.ExitStack()
            if i < micro - 1:
                for c in chunks:
                    ctx.enter_context(c.no_sync())
            with ctx:
                out = chunks[1](chunks[0](xm)).float()
                (((out - ym) ** 2).sum() / per_rank).backward()
        opt.step()
        opt.zero_grad()
    return {"params": torch.cat([w.flat_params(c) for c in chunks]),
            "bytes": [sum(c.comm_bytes.values()) - c.comm_bytes["broadcast"] for c in chunks]}


def case_nan(rank, world_size, strategy, bad_rank, no_sync):
    """bad_rank's gradient of '2.weight' gets a NaN: every rank must raise, naming it."""
    ddp, _ = build(rank, world_size, strategy, check_for_nan_in_grad=True)
    if rank == bad_rank:
        p = dict(ddp.module.named_parameters())["2.weight"]
        p.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan")))
    x, y = w.make_batches(1)[0]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    before = dict(ddp.comm_bytes)
    try:
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            w.loss_fn(ddp, xm, ym, 1.0).backward()
    except RuntimeError as e:
        # The bucket holding 2.weight is the second of two: the first may have gone.
        return {"error": str(e), "before": before, "after": ddp.comm_bytes}
    return {"error": None}


def case_after_a_backward_that_raised(rank, world_size):
    """A backward that raised after some buckets were reduced (a bucket a param, the first
    layer's weight, whose gradient comes last, refused by a hook): the next backward's
    error says how to start over (the wrapper's zero_grad(); the optimizer's is not
    enough), and after it a backward and step go on."""
    import precis.ddp
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), bucket_size=1)
    opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW))
    first = dict(ddp.module.named_parameters())["0.weight"]

    def refuse(grad):
        raise RuntimeError("refused by a hook")
    handle = first.register_hook(refuse)
    x, y = w.make_batches(1)[0]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    errors = []
    try:
        w.loss_fn(ddp, xm, ym, 1.0).backward()
    except RuntimeError as e:
        errors.append(str(e))
    handle.remove()
    opt.zero_grad()
    try:
        w.loss_fn(ddp, xm, ym, 1.0).backward()
    except RuntimeError as e:
        errors.append(str(e))
    ddp.zero_grad()
    w.loss_fn(ddp, xm, ym, 1.0).backward()
    opt.step()
    return errors


def case_grad_after_sync(rank, world_size):
    """A second synced backward without zero_grad: an explicit error, not a wrong sum."""
    ddp, opt = build(rank, world_size, "no_shard")
    backward_micro_batches(ddp, rank, world_size, 1)
    try:
        backward_micro_batches(ddp, rank, world_size, 1)
    except RuntimeError as e:
        first = str(e)
    else:
        first = None
    ddp.zero_grad()  # clears the buffers: the next backward is fine
    x, y = backward_micro_batches(ddp, rank, world_size, 1)
    err, _ = grad_error(opt, reference_grads(x, y))
    return {"error": first, "err": err}


def case_step_consumes_grads(rank, world_size, strategy):
    """step() with lr 0 (the params stay as they are), then a backward with no
    zero_grad(): the optimizer sees that backward's gradient, not a sum."""
    ddp, opt = build(rank, world_size, strategy)
    for group in opt.param_groups:
        group["lr"] = 0.0
    x, y = backward_micro_batches(ddp, rank, world_size, 2)
    before, _ = grad_error(opt, reference_grads(x, y))
    opt.step()
    x, y = w.make_batches(2)[1]
    per_rank = w.GLOBAL_BATCH // world_size
    for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, 2)):
        with contextlib.nullcontext() if i == 1 else ddp.no_sync():
            w.loss_fn(ddp, xm, ym, per_rank).backward()
    after, _ = grad_error(opt, reference_grads(x, y))
    return {"before": before, "after": after}


def case_step_without_a_backward(rank, world_size, strategy, torch_optimizer):
    """A second step() with no backward since the first: nothing moves (torch's DDP leaves
    .grad None; the buffers held the last step's gradient, stepped again), its state
    untouched; a step that raises leaves the gradients to the next backward; the next
    backward and step go on as a run without the extra step."""
    import precis.ddp
    import precis.optim
    make = torch.optim.AdamW if torch_optimizer else precis.optim.AdamW

    def run(extra):
        ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding=strategy,
                                                 bucket_size=50)
        opt = precis.ddp.attach_optimizer(make(ddp.parameters(), **w.OPTIM_KW))
        out = {}
        for step in range(2):
            backward_micro_batches(ddp, rank, world_size, 1)
            opt.step()
            opt.zero_grad()
            if extra and step == 0:
                params = w.flat_params(ddp.module)
                state = [v.clone() for s in opt.state.values() for v in s.values()
                         if torch.is_tensor(v)]
                opt.step()  # no backward since
                out["moved"] = not torch.equal(params, w.flat_params(ddp.module))
                out["state_moved"] = not all(
                    torch.equal(a, b) for a, b in zip(state, [
                        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]))
                def refuse(*args):  # (after the attachment's pre-hook: it hid them)
                    raise RuntimeError("a step that raises")
                handle = opt.register_step_pre_hook(refuse)
                try:
                    opt.step()
                except RuntimeError as e:
                    out["raised"] = str(e)
                handle.remove()
        out["params"] = w.flat_params(ddp.module)
        return out

    extra, plain = run(True), run(False)
    return {"moved": extra["moved"], "state_moved": extra["state_moved"],
            "raised": extra.get("raised"), "same": torch.equal(extra["params"], plain["params"])}


def case_zero_redundancy_resume(rank, world_size, name):
    """torch's ZeroRedundancyOptimizer over a precis optimizer (bf16 model, its default
    policy), 2 steps, then a resume: through ZeroRedundancyOptimizer.load_state_dict
    (which puts the saved entries into optimizer.state as they are: refused at the step,
    by name, nothing changed), and through each rank's own optimizer's state dict
    (zero.optim: the uninterrupted run's bits)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import precis.optim
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD" else dict(lr=1e-2)

    def zero(model):
        return ZeroRedundancyOptimizer(model.parameters(),
                                       optimizer_class=getattr(precis.optim, name), **kw)

    def step(model, opt, i):
        x, y = w.make_batches(i + 1)[i]
        w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad()

    model = w.make_model(torch.bfloat16)
    opt = zero(model)
    for i in range(2):
        step(model, opt, i)
    own = copy.deepcopy(opt.optim.state_dict())
    opt.consolidate_state_dict(0)
    full = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(full, src=0)
    resumed, again = copy.deepcopy(model), copy.deepcopy(model)
    step(model, opt, 2)  # (the uninterrupted run's third step)

    loaded = zero(resumed)
    loaded.load_state_dict(full[0])
    before = w.flat_params(resumed)
    error = w.error_text(lambda: step(resumed, loaded, 2))
    kept = torch.equal(before, w.flat_params(resumed))
    through_own = zero(again)
    through_own.optim.load_state_dict(own)
    step(again, through_own, 2)
    return {"error": error, "kept": kept,
            "own_bits": torch.equal(w.flat_params(again), w.flat_params(model))}


CASES_2 = {
    **{("reduced", s, "fp32comm"): (case_reduced_grads, (s, None, 1)) for s in STRATEGIES},
    **{("reduced", s, "bf16comm"): (case_reduced_grads, (s, {"grad_comm_dtype": "bf16"}, 1))
       for s in STRATEGIES},
    **{("reduced", s, "fp16comm"): (case_reduced_grads, (s, {"grad_comm_dtype": "fp16"}, 1))
       for s in STRATEGIES},
    **{("no_sync", s): (case_no_sync, (s,)) for s in STRATEGIES},
    **{("only_no_sync", s): (case_only_no_sync_then_step, (s,)) for s in STRATEGIES},
    **{("chunks", s): (case_model_chunks, (s,)) for s in STRATEGIES},
    **{("nan", s): (case_nan, (s, 1, False)) for s in STRATEGIES},
    ("nan", "optim_grads", "no_sync"): (case_nan, ("optim_grads", 0, True)),
    ("grad_after_sync",): (case_grad_after_sync, ()),
    **{("consumed", s): (case_step_consumes_grads, (s,)) for s in STRATEGIES},
    ("raised",): (case_after_a_backward_that_raised, ()),
    **{("no_backward", s, t): (case_step_without_a_backward, (s, t))
       for s in STRATEGIES for t in (False, True)},
    **{("zero_redundancy", n): (case_zero_redundancy_resume, (n,)) for n in ("AdamW", "SGD")},
}
CASES_1 = {
    **{("reduced", s, "micro2"): (case_reduced_grads, (s, None, 2)) for s in STRATEGIES},
    **{("reduced", s, "bf16comm"): (case_reduced_grads, (s, {"grad_comm_dtype": "bf16"}, 2))
       for s in STRATEGIES},
    **{("nan", s): (case_nan, (s, 0, False)) for s in STRATEGIES},
}


def result(world_size, key):
    """The case's result on every rank (fails the test with a child's traceback)."""
    return w.case_result(CASES_2 if world_size == 2 else CASES_1, world_size, key)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_double_counting(strategy):
    # fp32 on the wire: in place (reduce-scatter into the buffer's own shard).
    for r in result(2, ("reduced", strategy, "fp32comm")):
        assert r["err"] < 1e-6, r
    # Another dtype on the wire: the reduced shard is cast back into the buffer;
    # adding it instead would give local + mean (about 1.5x the gradient).
    for comm, tol in (("fp16comm", 2.0 ** -10), ("bf16comm", 2.0 ** -7)):
        for r in result(2, ("reduced", strategy, comm)):
            assert r["err"] < tol, (comm, r)
    # Between them the ranks step every element exactly once.
    numel = [r["numel"] for r in result(2, ("reduced", strategy, "fp32comm"))]
    assert sum(numel) == (w.NUMEL if strategy != "no_shard" else 2 * w.NUMEL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_world_size_one_does_not_double(strategy):
    (r,) = result(1, ("reduced", strategy, "micro2"))
    assert r["err"] < 1e-6, r  # 2 micro-batches, no factor 2 anywhere
    assert r["numel"] == w.NUMEL
    sent = {k: v for k, v in r["bytes"].items() if k != "broadcast"}
    assert sum(sent.values()) == 0, sent  # nothing to communicate with one process
    # Nor is the gradient rounded to a wire dtype it never travels in.
    (r,) = result(1, ("reduced", strategy, "bf16comm"))
    assert r["err"] < 1e-6, r


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync(strategy):
    for r in result(2, ("no_sync", strategy)):
        sent = r["sent"]
        if strategy == "optim_grads":
            # Reduce-scattered every micro-batch, so no full buffer persists.
            assert sent[0] < sent[1] < sent[2], sent
        else:
            assert sent[0] == sent[1] < sent[2], sent  # nothing until the last
            assert r["local_ok"] == [True, True]       # local gradients meanwhile
        assert r["err"] < 1e-6, r  # the last reduced all three micro-batches


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_step_after_no_sync_only_reduces_everything(strategy):
    for r in result(2, ("only_no_sync", strategy)):
        assert r["err"] < 1e-6, r


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_model_chunk_is_synced(strategy):
    r0, r1 = result(2, ("chunks", strategy))
    assert torch.equal(r0["params"], r1["params"])
    assert all(b > 0 for b in r0["bytes"]), r0["bytes"]
    want = w.train_reference(3)
    assert (r0["params"] - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_names_param_and_rank(strategy):
    for rank, r in enumerate(result(2, ("nan", strategy))):
        assert r["error"] is not None, f"rank {rank} did not raise"
        assert "'2.weight'" in r["error"] and "rank 1" in r["error"], r["error"]
        assert "rank 0" not in r["error"], r["error"]
    (r,) = result(1, ("nan", strategy))
    assert "'2.weight'" in r["error"] and "rank 0" in r["error"], r["error"]


def test_nan_under_no_sync_with_optim_grads():
    # optim_grads reduces every micro-batch, so it checks every micro-batch.
    for r in result(2, ("nan", "optim_grads", "no_sync")):
        assert r["error"] is not None and "'2.weight' on rank 0" in r["error"], r


def test_gradient_after_sync_needs_zero_grad():
    for r in result(2, ("grad_after_sync",)):
        assert r["error"] is not None and "zero_grad" in r["error"], r
        assert r["err"] < 1e-6, r


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_after_step_starts_from_zero(strategy):
    for r in result(2, ("consumed", strategy)):
        assert r["before"] < 1e-6 and r["after"] < 1e-6, r


def test_after_a_backward_that_raised_the_error_says_how_to_start_over():
    for errors in result(2, ("raised",)):
        assert len(errors) == 2 and "refused by a hook" in errors[0], errors
        assert "arrived after its bucket was reduced" in errors[1], errors
        assert "start over with the wrapper's zero_grad()" in errors[1], errors


@pytest.mark.parametrize("torch_optimizer", [False, True], ids=["precis", "torch"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_step_without_a_backward_moves_nothing(strategy, torch_optimizer):
    for r in result(2, ("no_backward", strategy, torch_optimizer)):
        assert not r["moved"] and not r["state_moved"], r
        assert r["raised"] is not None and r["same"], r


# ---------------------------------------------------------------------------
# The harness itself: a failing or hung child must fail the test, not hang it.
# ---------------------------------------------------------------------------


def child_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def child_hangs(rank, world_size):
    import time
    import torch.distributed as dist
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # rank 1 never joins this collective
    else:
        time.sleep(600)
    return rank


def child_aborts(rank, world_size):
    import time
    if rank == 1:
        os.abort()  # killed by a signal inside fn: no result, no traceback
    time.sleep(60)  # so rank 1's death is the one reported (rank 0 is killed then)
    return rank


def child_aborts_at_exit(rank, world_size, marker):
    """Rank 1 aborts after its result is saved: in every world, or (marker given)
    in the first only."""
    import atexit
    if rank == 1 and not (marker and os.path.exists(marker)):
        if marker:
            open(marker, "w").close()
        atexit.register(os.abort)
    return rank * 10


def test_harness_surfaces_child_errors_and_hangs():
    with pytest.raises(Exception, match="boom from rank 1") as e:
        w.run_world(child_raises, 2)
    assert "Traceback" in str(e.value)  # the child's traceback comes along
    with pytest.raises(TimeoutError, match="child_hangs"):
        w.run_world(child_hangs, 2, timeout=5)
    with pytest.raises(RuntimeError, match="SIGABRT") as e:
        w.run_world(child_aborts, 2)
    assert "rank 1:" in str(e.value) and "child_aborts" in str(e.value)  # its stacks


def test_harness_reruns_a_world_that_fails_after_saving(tmp_path):
    # torch's gloo teardown fails now and then after every rank saved its result:
    # the world runs again, with a warning holding the dead rank's stacks.
    with pytest.warns(UserWarning, match="SIGABRT after fn returned") as record:
        assert w.run_world(child_aborts_at_exit, 2, str(tmp_path / "aborted")) == [0, 10]
    assert "rank 1:" in str(record[0].message)
    # A failure there in every run is a failure.
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="twice"):
        w.run_world(child_aborts_at_exit, 2, "")


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_zero_redundancy_optimizer_resume(name):
    """torch's ZeroRedundancyOptimizer puts a saved state's entries into the precis
    optimizer's state as saved: its next step refuses them by name, nothing changed;
    each rank's own optimizer's state dict resumes with the uninterrupted run's bits."""
    for r in result(2, ("zero_redundancy", name)):
        assert r["error"].startswith(f"RuntimeError: {name}: param ")
        assert "its state is a saved state dict's entry" in r["error"]
        assert "zero.optim.load_state_dict" in r["error"]
        assert r["kept"] and r["own_bits"]
