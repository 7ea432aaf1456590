"""Gradient release (precis.optim.release_gradients) on FSDP2 (issue #45): torch's
fully_shard hands each unit's reduce-scattered shard to the sharded param's
post-accumulate-grad hooks, so a released backward steps each shard as soon as its
reduce-scatter is done (the sharded gradient, never a stale one) and frees it.

At worlds 1, 2 and 3 (gloo, one CPU process per rank), for AdamW (bf16 model, default
policy and fp8 m, v + 8-bit remainders, through precis.fsdp and torch's fully_shard;
half of it offloaded to host copies; HSDP's placements), SGD, Lion and Muon (Muon
assembles each whole matrix inside the hook: every rank's hooks come in one order), a
released run ends with the bits of the ordinary run on the same batches: params and
every state buffer, gathered whole. Also: buckets, a checkpoint resumed in release
mode through torch.distributed.checkpoint, and a NaN on one rank's shard (that param
skipped on every rank, the others stepped). capturable=True (the verdicts and the
clipping made on the device) gives the bits of the ordinary run, and of the host's
clipping. Where a GPU is lent: torch's own
CPUOffloadPolicy, world 1 over NCCL (the host gradient a hook reads is the reduced
one)."""
import contextlib

import pytest
import torch
import torch.nn as nn

import ddp_worker as w
import precis
import precis.fsdp
import precis.optim

STEPS = 3
BF16 = torch.bfloat16
FP8_REM8 = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8", "store_param_remainders": True,
            "param_remainder_bits": 8}


def make_model(bias=True):
    """Uneven layers: at world 3 one rank's shard of the 2-row layer is empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(w.IN, 9, bias=bias), nn.Tanh(), nn.Linear(9, 2, bias=bias),
                         nn.Tanh(), nn.Linear(2, w.OUT, bias=bias)).to(BF16)


def shard(model, how, policy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if how == "helper":
        return precis.fsdp.fully_shard(model, policy=policy, units=(nn.Linear,))
    if how == "hsdp":  # (one replica: the shards' placements (Replicate(), Shard(0)))
        mesh = init_device_mesh("cpu", (1, torch.distributed.get_world_size()),
                                mesh_dim_names=("replicate", "shard"))
        return precis.fsdp.fully_shard(model, policy=policy, units=(nn.Linear,), mesh=mesh)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    return fully_shard(model)


def gathered(t):
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return t
    if t.dtype != torch.int16:
        return t.full_tensor()
    as_bf16 = DTensor.from_local(t.to_local().view(BF16), t.device_mesh, t.placements,
                                 run_check=False, shape=t.shape, stride=t.stride())
    return as_bf16.full_tensor().view(torch.int16)


def results(model, opt):
    params = [gathered(p.detach()).clone() for p in model.parameters()]
    states = [{k: gathered(t).clone() for k, t in opt.state[p].items()
               if isinstance(t, torch.Tensor)} for p in model.parameters()]
    return params, states


# name -> (optimizer (ddp_worker.OPTIMIZERS), policy, how the model is sharded[, the
# optimizer's other arguments])
RUNS = {
    "adamw_default": ("adamw", None, "helper"),
    "adamw_fp8_rem8": ("adamw", FP8_REM8, "helper"),
    "adamw_plain": ("adamw", None, "plain"),
    "adamw_hsdp": ("adamw", FP8_REM8, "hsdp"),
    "sgd": ("sgd", None, "helper"),
    "lion_fp8_rem8": ("lion", w.FP8_MOMENTUM_REM8, "helper"),
    "muon": ("muon", None, "helper"),
    "adamw_offloaded": ("adamw", FP8_REM8, "helper", {"offload": "cpu", "offload_fraction": 0.5}),
    "adamw_capturable": ("adamw", FP8_REM8, "helper", {"capturable": True}),
}


def make_run(name):
    """RUNS[name]'s sharded model and its optimizer."""
    optimizer, policy, how, *kw = RUNS[name]
    model = shard(make_model(bias=optimizer != "muon"), how, policy)
    return model, w.make_optimizer(optimizer, model.parameters(), policy=policy,
                                   **(kw or [{}])[0])


def train(rank, world_size, name, release, bucket_bytes=0, poison_at=None, max_norm=None):
    model, opt = make_run(name)
    handle = precis.optim.release_gradients(opt, bucket_bytes=bucket_bytes,
                                            max_norm=max_norm) if release else None
    per_rank = w.GLOBAL_BATCH // world_size
    skipped = []
    for step, (x, y) in enumerate(w.make_batches(STEPS)):
        (xm, ym), = w.local_micro_batches(x, y, rank, world_size, 1)
        poison = poison_at == step and rank == world_size - 1
        with poisoned(model[2]) if poison else contextlib.nullcontext():
            w.loss_fn(model, xm, ym, per_rank).backward()
        if release:  # stepped in backward: every sharded gradient freed there
            assert all(p.grad is None for p in model.parameters()), step
        if poison_at == step and not release:  # the ordinary step without that param
            model[2].weight.grad = None
        opt.step()
        opt.zero_grad()
        if handle is not None:
            skipped.append(list(handle.skipped))
    return results(model, opt), skipped


@contextlib.contextmanager
def poisoned(linear):
    """A NaN in row 0 of this rank's gradient of linear's weight, before the
    reduce-scatter (a hook on the unsharded weight, which FSDP2 puts in place for the
    forward): the rank whose shard holds row 0 finds it."""
    def poison(module, args):  # once: FSDP2 keeps the same unsharded param object
        def nan_row(grad):
            once.remove()
            return grad.index_fill(0, torch.tensor([0]), float("nan"))
        once = module.weight.register_hook(nan_row)
    handle = linear.register_forward_pre_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def case_pair(rank, world_size, name, bucket_bytes=0):
    return train(rank, world_size, name, False)[0], \
        train(rank, world_size, name, True, bucket_bytes)[0]


def case_nonfinite(rank, world_size, name="adamw_default"):
    return train(rank, world_size, name, False, poison_at=1), \
        train(rank, world_size, name, True, poison_at=1)


def case_clip_capturable(rank, world_size):
    """Clipping one shard at a time (max_norm small enough to clip every call), a NaN
    at step 1: on the host (capturable=False), and on the device (capturable=True:
    each DTensor's norm all-reduced there, nothing read until backward ends)."""
    return [train(rank, world_size, name, True, poison_at=1, max_norm=1e-3)
            for name in ("adamw_fp8_rem8", "adamw_capturable")]


def case_resume(rank, world_size, where):
    """Two released steps, saved with DCP, loaded into a new model and optimizer, one
    more released step; against three released steps without the round trip."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    optimizer, policy, how = RUNS["adamw_fp8_rem8"]
    batches = w.make_batches(STEPS)
    per_rank = w.GLOBAL_BATCH // world_size

    def build():
        model = shard(make_model(), how, policy)
        opt = w.make_optimizer(optimizer, model.parameters(), policy=policy)
        precis.optim.release_gradients(opt)
        return model, opt

    def steps(model, opt, which):
        for x, y in (batches[i] for i in which):
            (xm, ym), = w.local_micro_batches(x, y, rank, world_size, 1)
            w.loss_fn(model, xm, ym, per_rank).backward()
            assert all(p.grad is None for p in model.parameters())
            opt.step()

    model, opt = build()
    steps(model, opt, range(STEPS))
    straight = results(model, opt)
    model, opt = build()
    steps(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    model, opt = build()
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd}
    dcp.load(loaded, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    steps(model, opt, range(2, STEPS))
    return straight, results(model, opt)


def train_compiled(rank, world_size, name, release, compiled):
    """train's run without a NaN or clipping, each step (forward, backward, opt.step(),
    zero_grad()) one function, compiled whole or not."""
    model, opt = make_run(name)
    if release:
        precis.optim.release_gradients(opt)
    w.train_whole_steps(model, opt, rank, world_size, STEPS, compiled)
    return results(model, opt)


def case_compiled(rank, world_size, name, release):
    """The eager run and the compiled one, which fails where dynamo compiles a function
    more than 4 times (fail_on_recompile_limit_hit): the 6 params' state made in the
    first compiled step must not compile a frame a param."""
    eager = train_compiled(rank, world_size, name, release, False)
    with torch._dynamo.config.patch(recompile_limit=4, fail_on_recompile_limit_hit=True):
        return eager, train_compiled(rank, world_size, name, release, True)


COMPILED_CASES = {(name, release): (case_compiled, (name, release))
                  for name in RUNS for release in (False, True)}


CASES = {
    **{f"pair_{name}": (case_pair, (name,)) for name in RUNS},
    "pair_buckets": (case_pair, ("adamw_fp8_rem8", 200)),
    "nonfinite": (case_nonfinite, ()),
    "nonfinite_capturable": (case_nonfinite, ("adamw_capturable",)),
    "clip_capturable": (case_clip_capturable, ()),
}
WORLDS = (1, 2, 3)


def assert_same(got, want, where):
    (params_a, states_a), (params_b, states_b) = got, want
    for k, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(a, b), f"{where}: param {k}"
    for k, (a, b) in enumerate(zip(states_a, states_b)):
        assert a.keys() == b.keys() and a, f"{where}: state {k}"
        for key in a:
            assert torch.equal(a[key], b[key]), f"{where}: state {k} {key}"


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", sorted(RUNS) + ["buckets"])
def test_released_fsdp2_steps_have_the_ordinary_bits(name, world_size):
    for rank, (ordinary, released) in enumerate(w.case_result(CASES, world_size,
                                                              f"pair_{name}")):
        assert_same(released, ordinary, f"world {world_size}, rank {rank}")


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("case", ["nonfinite", "nonfinite_capturable"])
def test_a_nan_on_one_rank_skips_that_param_on_every_rank(case, world_size):
    for rank, ((ordinary, _), (released, skipped)) in enumerate(
            w.case_result(CASES, world_size, case)):
        assert skipped == [[], ["AdamW param 2 of group 0"], []], (rank, skipped)
        assert_same(released, ordinary, f"world {world_size}, rank {rank}")


@pytest.mark.parametrize("world_size", WORLDS)
def test_capturable_clipping_has_the_host_estimates_bits(world_size):
    for rank, ((host, host_skipped), (device, device_skipped)) in enumerate(
            w.case_result(CASES, world_size, "clip_capturable")):
        assert host_skipped == device_skipped == [[], ["AdamW param 2 of group 0"], []], rank
        assert_same(device, host, f"world {world_size}, rank {rank}")


@pytest.mark.parametrize("release", [False, True], ids=["ordinary", "released"])
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_compiled_training_step_has_the_eager_bits(name, release):
    """A training step compiled whole (forward, backward, opt.step(), zero_grad() in one
    torch.compile'd function) on FSDP2, world 2, with and without gradient release: the
    eager run's bits, and no frame compiled once a param (the state of DTensor params,
    made in the first compiled step, traced into its graph)."""
    for rank, (eager, compiled) in enumerate(
            w.case_result(COMPILED_CASES, 2, (name, release))):
        assert_same(compiled, eager, f"rank {rank}")


@pytest.mark.parametrize("world_size", (1, 3))
def test_resume_through_dcp_in_release_mode(world_size, tmp_path):
    for rank, (straight, resumed) in enumerate(
            w.run_world(case_resume, world_size, str(tmp_path / "ckpt"))):
        assert_same(resumed, straight, f"world {world_size}, rank {rank}")


def case_cpu_offload_policy(rank, world_size, run):
    """torch's own CPUOffloadPolicy on CUDA (sharded params, gradients and the step on
    the host): an ordinary and a released run of AdamW on the same batches."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    torch.cuda.set_device(rank)
    optimizer, policy, _ = RUNS[run]
    per_rank = w.GLOBAL_BATCH // world_size
    runs = []
    for release in (False, True):
        model = make_model().cuda()
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        opt = w.make_optimizer(optimizer, model.parameters(), policy=policy)
        if release:
            precis.optim.release_gradients(opt)
        for x, y in w.make_batches(STEPS):
            (xm, ym), = w.local_micro_batches(x, y, rank, world_size, 1)
            w.loss_fn(model, xm.cuda(), ym.cuda(), per_rank).backward()
            opt.step()
            opt.zero_grad()
        elsewhere = [(i, k, t.to_local().device.type)
                     for i, state in enumerate(opt.state.values())
                     for k, t in state.items() if hasattr(t, "to_local") and
                     t.to_local().device.type != "cpu"]
        assert len(opt.state) == len(list(model.parameters())) and not elsewhere, \
            f"the state stays with the shards on the host: {elsewhere}"
        runs.append(results(model, opt))
    return runs


@pytest.mark.cuda
@pytest.mark.parametrize("run", ["adamw_default", "adamw_fp8_rem8"])
def test_fsdp2_cpu_offload_policy_release_reads_the_reduced_gradient(run):
    """Under torch's CPUOffloadPolicy a hook could read the host gradient before its
    copy from the GPU was done (pytorch/pytorch#180666, torch before 2.13): the
    release waits for it (release.wait_for_host_grad), so a released run ends with the
    ordinary run's bits. The state stays on the host with the shards (a DTensor made
    by DTensor.from_local would have moved it to the mesh's GPU: the step refused
    params on the host and masters on the GPU). World 1, NCCL for the GPU's tensors
    and gloo for the host's (the shards gathered whole at the end): one GPU."""
    (ordinary, released), = w.run_world(case_cpu_offload_policy, 1, run,
                                        backend="cpu:gloo,cuda:nccl")
    assert ordinary[0][0].device.type == "cpu", "the params were offloaded"
    assert_same(released, ordinary, f"world 1, CPUOffloadPolicy, {run}")
