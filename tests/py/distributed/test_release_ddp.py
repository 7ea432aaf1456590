"""Gradient release (precis.optim.release_gradients) on precis.ddp (issue #45): each
bucket's params (ZeRO-1/2: this rank's pieces of them) are stepped as soon as the bucket's
reduction is complete, while the later buckets still reduce
(DistributedDataParallel.on_reduced).

At worlds 1, 2 and 3 (gloo, one CPU process per rank), for no_shard, optim (ZeRO-1) and
optim_grads (ZeRO-2), with AdamW (bf16 default, fp8 m, v + 8-bit remainders), SGD and
Muon (whole matrices assembled inside backward, in the same order on every rank), two
micro-batches a step (no_sync for the first: the reduction, and so the release, comes
with the last), a released run ends with the bits of the ordinary run on the same
batches: params and the state of every tensor each rank steps. Also: a NaN in one
rank's gradient skips that param on every rank (the others are stepped), and max_norm's
norm is the whole reduced gradient's on every rank."""
import contextlib

import pytest
import torch
import torch.nn as nn

import ddp_worker as w

STEPS = 3
MICRO = 2
BF16 = torch.bfloat16
FP8_REM8 = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8", "store_param_remainders": True,
            "param_remainder_bits": 8}
STRATEGIES = ("no_shard", "optim", "optim_grads")
# name -> (optimizer (ddp_worker.OPTIMIZERS), policy)
RUNS = {
    "adamw_default": ("adamw", None),
    "adamw_fp8_rem8": ("adamw", FP8_REM8),
    "sgd": ("sgd", None),
    "muon": ("muon", None),
    "adamw_offloaded": ("adamw", FP8_REM8, {"offload": "cpu", "offload_fraction": 0.5}),
}


def make_model(bias):
    """Uneven shards at world 3; a 64-wide layer whose 128-element blocks fp8 moments
    keep when the wrapper cuts its shards at them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(w.IN, 64, bias=bias), nn.Tanh(),
                         nn.Linear(64, 7, bias=bias), nn.Tanh(),
                         nn.Linear(7, w.OUT, bias=bias)).to(BF16)


def train(rank, world_size, strategy, name, release, poison_at=None, max_norm=None):
    """(params, state of each tensor this rank steps, the release's skips and norms per
    step, each tensor's step count)."""
    import precis.ddp
    import precis.optim
    from state_snapshot import state_pieces
    optimizer, policy, *kw = RUNS[name]
    ddp = precis.ddp.DistributedDataParallel(
        make_model(bias=optimizer != "muon"), sharding=strategy, bucket_size=300,
        policy=dict(policy or {}, grad_sum_dtype="fp32"))
    opt = precis.ddp.attach_optimizer(w.make_optimizer(optimizer, ddp.parameters(),
                                                       policy=policy, **(kw or [{}])[0]))
    handle = precis.optim.release_gradients(opt, max_norm=max_norm) if release else None
    per_rank = w.GLOBAL_BATCH // world_size
    seen = []
    for step, (x, y) in enumerate(w.make_batches(STEPS)):
        batches = w.local_micro_batches(x, y, rank, world_size, MICRO)
        for i, (xm, ym) in enumerate(batches):
            last = i == MICRO - 1
            poison = last and poison_at == step and rank == world_size - 1
            if poison:  # a NaN in this rank's gradient of the first weight's row 0
                once = ddp.module[0].weight.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
            with contextlib.nullcontext() if last else ddp.no_sync():
                w.loss_fn(ddp, xm, ym, per_rank).backward()
            if poison:
                once.remove()
        if handle is not None:
            seen.append((list(handle.skipped), handle.last_norm))
        opt.step()
        opt.zero_grad()
    pieces = precis.ddp.optimizer_pieces(opt)
    steps = {tuple(piece): int(opt.state[p]["step"]) for p, piece in
             zip([p for g in opt.param_groups for p in g["params"]], pieces)}
    return w.flat_params(ddp.module), state_pieces(opt, pieces), seen, steps


def case_pair(rank, world_size, strategy, name):
    return train(rank, world_size, strategy, name, False), \
        train(rank, world_size, strategy, name, True)


def case_nonfinite(rank, world_size, strategy):
    return train(rank, world_size, strategy, "adamw_default", True, poison_at=1)


def case_max_norm(rank, world_size, strategy):
    return train(rank, world_size, strategy, "adamw_default", True, max_norm=0.05)


def train_compiled(rank, world_size, strategy, name, release, compiled):
    """(params, state of each tensor this rank steps) after STEPS training steps of one
    micro-batch each, the step (forward, backward, opt.step(), zero_grad()) compiled
    whole or not."""
    import precis.ddp
    import precis.optim
    from state_snapshot import state_pieces
    optimizer, policy, *kw = RUNS[name]
    ddp = precis.ddp.DistributedDataParallel(make_model(bias=optimizer != "muon"),
                                             sharding=strategy, bucket_size=300,
                                             policy=policy)
    opt = precis.ddp.attach_optimizer(w.make_optimizer(optimizer, ddp.parameters(),
                                                       policy=policy, **(kw or [{}])[0]))
    if release:
        precis.optim.release_gradients(opt)
    w.train_whole_steps(ddp, opt, rank, world_size, STEPS, compiled)
    return w.flat_params(ddp.module), state_pieces(opt, precis.ddp.optimizer_pieces(opt))


def case_compiled(rank, world_size, strategy, name, release):
    """The eager and the compiled run, and whether precis.ddp's gradient hooks (a
    gradient ready; the reduction finished at the backward's end, where it has work)
    were traced by dynamo (precis.tracing.traced(): torch 2.10 and 2.11 answer
    is_compiling() with True in an eager call inside a compiled one), at each call of
    the compiled run. (Its step hooks, called by a compiled opt.step(), are traced with
    it: their books are guarded flags, and opt.step(fullgraph=True) keeps working.)"""
    from precis import tracing
    from precis.ddp import _module
    ddp_class, traced = _module.DistributedDataParallel, []
    on_grad, finish = ddp_class._on_grad, ddp_class.finish_grad_sync

    def watched_on_grad(self, p):
        traced.append(tracing.traced())
        return on_grad(self, p)

    def watched_finish(self):
        if self._active:  # (else nothing to finish: opt.step()'s call after the backward's)
            traced.append(tracing.traced())
        return finish(self)
    eager = train_compiled(rank, world_size, strategy, name, release, False)
    ddp_class._on_grad, ddp_class.finish_grad_sync = watched_on_grad, watched_finish
    try:
        compiled = train_compiled(rank, world_size, strategy, name, release, True)
    finally:
        ddp_class._on_grad, ddp_class.finish_grad_sync = on_grad, finish
    return eager, compiled, traced


# (strategy, run, released). Not no_shard Muon's ordinary step: compiled, it runs Newton-
# Schulz on whole plain matrices in inductor's code, which rounds apart from eager's
# (test_compile.py); its ZeRO pieces' and a release's run eagerly.
COMPILED = [(s, name, release) for s in STRATEGIES
            for name in ("adamw_default", "adamw_offloaded", "muon") for release in (False, True)
            if (s, name, release) != ("no_shard", "muon", False)]
COMPILED_CASES = {key: (case_compiled, key) for key in COMPILED}


CASES = {
    **{("pair", s, n): (case_pair, (s, n)) for s in STRATEGIES for n in RUNS},
    **{("nonfinite", s): (case_nonfinite, (s,)) for s in STRATEGIES},
    **{("max_norm", s): (case_max_norm, (s,)) for s in STRATEGIES},
}
WORLDS = (1, 2, 3)


def assert_same(got, want, where):
    """(params, state of each tensor a rank steps) of two runs: the same bits."""
    assert torch.equal(got[0], want[0]), where
    assert got[1].keys() == want[1].keys() and want[1], where
    for piece, state in want[1].items():
        for key, value in state.items():
            mine = got[1][piece][key]
            assert torch.equal(mine, value) if torch.is_tensor(value) else mine == value, \
                (where, piece, key)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", sorted(RUNS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_released_buckets_have_the_ordinary_bits(strategy, name, world_size):
    for rank, (ordinary, released) in enumerate(
            w.case_result(CASES, world_size, ("pair", strategy, name))):
        assert_same(released, ordinary, f"world {world_size}, rank {rank}")
        assert all(skipped == [] for skipped, _ in released[2]), released[2]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_nan_on_one_rank_skips_that_param_on_every_rank(strategy, world_size):
    """The last rank's gradient of the first weight gets a NaN at step 1: every rank
    that steps a piece of it names it and leaves it (its step count ends at 2, the other
    params' at 3), and the ranks end with the same finite params."""
    results = w.case_result(CASES, world_size, ("nonfinite", strategy))
    for rank, (params, _, seen, steps) in enumerate(results):
        skipped = [s for s, _ in seen]
        holds = [piece for piece in steps if piece[0] == "0.weight"]
        assert skipped == [[], ["AdamW param 0 of group 0"] if holds else [], []], \
            (rank, skipped)
        assert all(count == (2 if piece[0] == "0.weight" else 3)
                   for piece, count in steps.items()), (rank, steps)
        assert torch.isfinite(params).all(), rank
    for params, _, _, _ in results[1:]:  # the skip was agreed
        assert torch.equal(params, results[0][0])


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_norm_sees_the_whole_reduced_gradient_on_every_rank(strategy, world_size):
    """The norm each rank's release computes is the whole reduced gradient's (its pieces'
    squares summed over the ranks), the same on every rank and at every world size and
    strategy within bf16's rounding of the gradients, which happens at other points at
    other world sizes (per micro-batch, and in the reduction): 2^-8 relative."""
    results = w.case_result(CASES, world_size, ("max_norm", strategy))
    norms = [[norm for _, norm in seen] for _, _, seen, _ in results]
    assert all(n == norms[0] for n in norms), norms
    reference = w.case_result(CASES, 1, ("max_norm", "no_shard"))[0][2]
    assert norms[0] == pytest.approx([norm for _, norm in reference], rel=2.0 ** -8)
    assert min(norms[0]) > 0.05  # the clipping was exercised
    for params, _, _, _ in results[1:]:
        assert torch.equal(params, results[0][0])


@pytest.mark.parametrize("strategy,name,release", COMPILED)
def test_a_compiled_training_step_runs_the_hooks_eagerly(strategy, name, release):
    """A training step compiled whole (forward, backward, opt.step(), zero_grad() in one
    torch.compile'd function) on precis.ddp, world 2: its backward fires precis.ddp's
    hooks on the thread where dynamo compiles every new frame, and they run eagerly
    (their books, which buckets are ready and reduced, change at every gradient: traced,
    dynamo recompiled them at each change until its limit): never traced (each param's
    gradient and the backward's end a step), the eager run's bits, with and without
    gradient release; AdamW, AdamW offloaded in part (fp8 moments and 8-bit remainders), Muon."""
    for rank, (eager, compiled, traced) in enumerate(
            w.case_result(COMPILED_CASES, 2, (strategy, name, release))):
        params = 3 if name == "muon" else 6  # (Muon's layers have no bias)
        assert len(traced) == (params + 1) * STEPS and not any(traced), (rank, traced)
        assert_same(compiled, eager, f"rank {rank}")
