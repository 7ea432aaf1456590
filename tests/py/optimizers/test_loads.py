"""Model-only loads after training steps: nothing a user loads is ever lost.

A red team's table (issue #43): after two training steps, new weights are loaded into
the model by one of torch's paths, then one step at lr 0 and weight decay 0 (which must
leave the loaded weights exactly as they are) and one ordinary step. Every load path x
sharding x offload x policy:

  sharding   one process; torch's plain fully_shard; precis.fsdp.fully_shard (gloo, 2 ranks)
  policy     default (fp32 master), int16 remainders, 8-bit remainders, fp8 m, v + 8-bit
             remainders
  offload    no / offload="cpu" (host copies)
  load by    model.load_state_dict; set_model_state_dict(full_state_dict=True);
             torch.distributed.checkpoint.load + set_model_state_dict; a write into the
             local shards; a write through `param.data` (none of the last four moves a
             version counter the optimizer could watch)

After the lr-0 step the params hold the loaded weights bit for bit, the optimizer's
master is the loaded weights (remainders zero: the load came from bf16 weights), and a
StaleMasterWarning said a load was detected. Also: torch.distributed.checkpoint saves a
model-only-loaded run and a world of another size resumes it exactly, and a fine-tune
resumed from a model-only checkpoint continues from the checkpoint's loss.
"""
import contextlib
import os
import warnings

import pytest
import torch
import torch.nn as nn

import ddp_worker as w
import precis.fsdp
import precis.optim

BF16, FP32 = torch.bfloat16, torch.float32
POLICIES = {
    "default": None,
    "remainders16": {"store_param_remainders": True},
    "remainders8": {"store_param_remainders": True, "param_remainder_bits": 8},
    "fp8_remainders8": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                        "store_param_remainders": True, "param_remainder_bits": 8},
}
PATHS = ("module_load_state_dict", "set_model_state_dict", "dcp_load", "local_shards",
         "param_data")
ONE_PROCESS_PATHS = ("module_load_state_dict", "param_data", "set_model_state_dict")
STEPS_BEFORE = 2


def make_model(seed):
    torch.manual_seed(seed)
    # rows a multiple of 2 ranks and 128-element rows: fp8 moments keep block scales
    return nn.Sequential(nn.Linear(128, 4), nn.Tanh(), nn.Linear(4, 3)).to(BF16)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 128, generator=g), torch.randn(8, 3, generator=g)


def backward(model, step, rank=0, world=1):
    x, y = batch(step)
    per = x.shape[0] // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    loss = ((model(x.to(BF16)).float() - y) ** 2).mean()
    loss.backward()
    return float(loss.detach())


def shard(model, how, policy):
    from torch.distributed.fsdp import fully_shard
    if how == "precis":
        return precis.fsdp.fully_shard(model, policy=policy, units=(nn.Linear,))
    if how == "plain":
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        return fully_shard(model)
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def load(model, new, path, ckpt_dir):
    """Load `new`'s weights (a model sharded as `model`) into `model` by `path`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    if path == "module_load_state_dict":
        model.load_state_dict(new.state_dict())
    elif path == "set_model_state_dict":
        whole = {k: full(v) for k, v in new.state_dict().items()}
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True))
    elif path == "dcp_load":
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": get_model_state_dict(new)}, checkpoint_id=ckpt_dir)
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, sd["model"])
    elif path == "local_shards":
        with torch.no_grad():
            for p, q in zip(model.parameters(), new.parameters()):
                local(p).copy_(local(q))
    elif path == "param_data":
        for p, q in zip(model.parameters(), new.parameters()):
            p.data.copy_(q.data)
    else:
        raise ValueError(path)


def one_load(rank, world, how, policy_name, offload, path, ckpt_dir, capturable=False,
             optimizer="adamw"):
    """Train STEPS_BEFORE steps, load new weights by `path`, step at lr 0 and weight
    decay 0, then once more at lr 1e-2. Returns (loaded params kept bit for bit, max
    |master - loaded|, warned, the next step moved the params, every state value a
    tensor, whether the optimizer kept a copy of any param a load makes stale).
    optimizer: AdamW, or a name of ddp_worker.OPTIMIZERS with its arguments."""
    policy = POLICIES[policy_name]
    model = shard(make_model(0), how, policy)
    new = shard(make_model(1), how, policy)
    if optimizer == "adamw":
        opt = precis.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, policy=policy,
                                 offload=offload, capturable=capturable)
    else:
        opt = w.make_optimizer(optimizer, model.parameters(), policy=policy, offload=offload,
                               capturable=capturable)
    for step in range(STEPS_BEFORE):
        backward(model, step, rank, world)
        opt.step()
        opt.zero_grad()
    # not vacuous: the new weights differ from the trained ones in every param
    assert not any(torch.equal(full(p), full(q)) for p, q in zip(model.parameters(),
                                                                 new.parameters()))
    load(model, new, path, ckpt_dir)
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    backward(model, STEPS_BEFORE, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    opt.zero_grad()
    kept = all(torch.equal(full(p), full(q)) for p, q in zip(model.parameters(),
                                                             new.parameters()))
    master_error = 0.0  # on this rank's shards (gloo gathers no int16)
    for p in model.parameters():
        st, shard_ = opt.state[p], local(p).detach().float()
        if "master" in st:
            master = local(st["master"]).float()
        elif "remainder" in st:  # the load came from bf16 weights: the remainder is zero
            master = shard_ if not bool((local(st["remainder"]) != 0).any()) \
                else torch.full_like(shard_, float("inf"))
        else:
            master = shard_
        if master.numel():
            master_error = max(master_error, float((master - shard_).abs().max()))
    warned = any(issubclass(c.category, precis.optim.StaleMasterWarning) for c in caught)
    for group in opt.param_groups:
        group["lr"] = 1e-2
    backward(model, STEPS_BEFORE + 1, rank, world)
    opt.step()
    moved = not all(torch.equal(full(p), full(q)) for p, q in zip(model.parameters(),
                                                                 new.parameters()))
    all_tensors = all(isinstance(v, torch.Tensor) for st in opt.state.values()
                      for v in st.values())
    copies = any("master" in st or "remainder" in st for st in opt.state.values())
    return kept, master_error, warned, moved, all_tensors, copies


def load_cases(rank, world, ckpt_root):
    hows = ("plain", "precis") if world > 1 else ("one_process",)
    paths = PATHS if world > 1 else ONE_PROCESS_PATHS
    out = {}
    for how in hows:
        for policy_name in POLICIES:
            for offload in (False, "cpu"):
                for path in paths:
                    key = (how, policy_name, offload, path)
                    ckpt_dir = os.path.join(ckpt_root, "_".join(map(str, key)))
                    try:
                        out[key] = one_load(rank, world, how, policy_name, offload, path,
                                            ckpt_dir)
                    except Exception:
                        import traceback
                        out[key] = traceback.format_exc()
    for key in ONE_STATE_CASES[world]:
        how, policy_name, offload, path, optimizer = key
        ckpt_dir = os.path.join(ckpt_root, "_".join(map(str, key)))
        try:
            out[key] = one_load(rank, world, how, policy_name, offload, path, ckpt_dir,
                                optimizer=optimizer)
        except Exception:
            import traceback
            out[key] = traceback.format_exc()
    return out


# SGD and Lion (issue #44): a few cases of the matrix, fp32 masters and 8-bit remainders.
# (how, policy, offload, load path, optimizer), by world size.
ONE_STATE_CASES = {
    1: [("one_process", pol, off, path, opt) for opt in w.ONE_STATE
        for pol in ("default", "remainders8") for off in (False, "cpu")
        for path in ("module_load_state_dict", "param_data")],
    2: [(how, pol, False, "dcp_load", opt) for opt in w.ONE_STATE for how in ("plain", "precis")
        for pol in ("default", "remainders8")] +
       [("precis", pol, "cpu", "local_shards", opt) for opt in w.ONE_STATE
        for pol in ("default", "remainders8")],
}


@contextlib.contextmanager
def _one_process_group(tmp):
    """A gloo group of one (set_model_state_dict needs torch.distributed)."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loads"))
    two = w.run_world(load_cases, 2, root)
    with _one_process_group(root):
        one = load_cases(0, 1, root)
    return {2: two, 1: [one]}


CASES = [(how, pol, off, path) for how in ("plain", "precis") for pol in POLICIES
         for off in (False, "cpu") for path in PATHS] + \
    [("one_process", pol, off, path) for pol in POLICIES for off in (False, "cpu")
     for path in ONE_PROCESS_PATHS]


@pytest.mark.parametrize("case", ONE_STATE_CASES[2] + ONE_STATE_CASES[1],
                         ids=lambda c: "-".join(map(str, c)))
def test_a_model_only_load_is_picked_up_by_sgd_and_lion(results, case):
    """test_a_model_only_load_is_picked_up's checks for SGD and Lion."""
    world = 1 if case[0] == "one_process" else 2
    for rank, by_key in enumerate(results[world]):
        r = by_key[case]
        if isinstance(r, str):
            pytest.fail(f"rank {rank} of {world} failed:\n{r}")
        kept, master_error, warned, moved, all_tensors, copies = r
        assert kept, f"rank {rank}: the step overwrote the loaded weights"
        assert master_error == 0.0, f"rank {rank}: master off the loaded weights by " \
                                    f"{master_error}"
        assert warned == copies, f"rank {rank}: StaleMasterWarning {warned}, copies {copies}"
        assert copies or case[:2] == ("precis", "default"), "no master or remainder was kept"
        assert moved, f"rank {rank}: the step after did not train"
        assert all_tensors, f"rank {rank}: a per-param state value is not a tensor"


@pytest.mark.parametrize("how,policy,offload,path", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_a_model_only_load_is_picked_up(results, how, policy, offload, path):
    """The loaded weights survive the next step bit for bit, the master is them
    (remainders zero), the load is warned about where the optimizer kept a master or
    remainder it resynced (precis.fsdp's default policy shards the fp32 master itself;
    a host copy is reread exactly, silently), and training goes on from them."""
    world = 1 if how == "one_process" else 2
    for rank, by_key in enumerate(results[world]):
        r = by_key[(how, policy, offload, path)]
        if isinstance(r, str):
            pytest.fail(f"rank {rank} of {world} failed:\n{r}")
        kept, master_error, warned, moved, all_tensors, copies = r
        assert kept, f"rank {rank}: the step overwrote the loaded weights"
        assert master_error == 0.0, f"rank {rank}: master off the loaded weights by " \
                                    f"{master_error}"
        assert warned == copies, f"rank {rank}: StaleMasterWarning {warned}, copies {copies}"
        assert moved, f"rank {rank}: the step after did not train"
        assert all_tensors, f"rank {rank}: a per-param state value is not a tensor"


# ---------------------------------------------------------------------------
# After a model-only load: a DCP checkpoint resharded, and a resumed fine-tune
# ---------------------------------------------------------------------------

RESHARD_POLICY = "fp8_remainders8"


def case_reshard(rank, world, ckpt_dir, save):
    """save (world 2): train, a model-only load of new weights (dcp + set_model_state_dict),
    one step at lr 0 (the loaded weights kept), then model and optimizer saved with
    torch.distributed.checkpoint; load (any
    world): a fresh model and optimizer resume from it. Returns the full params and the
    full masters (param joined to its remainder) as each side holds them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    policy = POLICIES[RESHARD_POLICY]
    model = shard(make_model(0), "precis", policy)
    opt = precis.optim.AdamW(model.parameters(), lr=1e-2, policy=policy)
    if save:
        for step in range(STEPS_BEFORE):
            backward(model, step, rank, world)
            opt.step()
            opt.zero_grad()
        load(model, shard(make_model(1), "precis", policy), "dcp_load", ckpt_dir + "_new")
        for group in opt.param_groups:
            group["lr"] = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", precis.optim.StaleMasterWarning)
            backward(model, STEPS_BEFORE, rank, world)
            opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    params = [full(p).detach().clone() for p in model.parameters()]
    masters = [gathered_master(p, opt.state.get(p, {})) for p in model.parameters()]
    return params, masters


def gathered_master(p, state):
    """p's fp32 master, whole: its remainder travels as its int32 widening (gloo gathers
    no int16 or uint8)."""
    if "remainder" not in state:
        return full(p).detach().float()
    from torch.distributed.tensor import DTensor
    r = state["remainder"]
    wide = DTensor.from_local(local(r).to(torch.int32), r.device_mesh, r.placements,
                              shape=r.shape, stride=r.stride())
    return precis.optim.remainder_join(full(p).detach(), full(wide).to(r.dtype))


def test_a_model_only_load_survives_a_resharded_checkpoint(tmp_path):
    """Saved at world 2 after a model-only load and a step at lr 0: the params and the
    masters (8-bit remainders) are the loaded weights; loaded at worlds 1 and 3: as the
    saving run held them, bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    saved = w.run_world(case_reshard, 2, ckpt, True)[0]
    new = [q.detach() for q in make_model(1).parameters()]
    for a, master, b in zip(saved[0], saved[1], new):
        assert torch.equal(a, b) and torch.equal(master, b.float())
    for world in (1, 3):
        for rank, got in enumerate(w.run_world(case_reshard, world, ckpt, False)):
            for a, b in zip(got[0] + got[1], saved[0] + saved[1]):
                assert torch.equal(a, b), f"world {world} rank {rank}"


FINETUNE_STEPS = 4


def case_finetune(rank, world, ckpt_dir, resume):
    """not resume: FINETUNE_STEPS steps from make_model(0), the model saved (model only,
    torch.distributed.checkpoint) after STEPS_BEFORE of them; resume: another model and
    optimizer train STEPS_BEFORE steps on other data, load that checkpoint into the model
    only, and take the remaining steps on the first run's batches. Returns the losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    policy = POLICIES["default"]  # fp32 masters in the optimizer, bf16 shards
    model = shard(make_model(1 if resume else 0), "plain", policy)
    opt = precis.optim.AdamW(model.parameters(), lr=3e-3, policy=policy)
    losses = []
    for step in range(FINETUNE_STEPS):
        if step == STEPS_BEFORE:
            if resume:
                sd = {"model": get_model_state_dict(model)}
                dcp.load(sd, checkpoint_id=ckpt_dir)
                set_model_state_dict(model, sd["model"])
            else:
                dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt_dir)
        data_step = step + 50 if resume and step < STEPS_BEFORE else step
        losses.append(backward(model, data_step, rank, world))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", precis.optim.StaleMasterWarning)
            opt.step()
        opt.zero_grad()
    return losses


def test_a_resumed_fine_tune_continues_from_the_checkpoints_loss(tmp_path):
    """The first loss after the model-only load is the checkpoint's, exactly (the
    loaded weights are the ones used); the next ones stay with the first run's (its
    optimizer state is another run's: within 2%), not with the loss the resumed model
    had before the load."""
    ckpt = str(tmp_path / "ckpt")
    first = w.run_world(case_finetune, 2, ckpt, False)
    resumed = w.run_world(case_finetune, 2, ckpt, True)
    for rank in range(2):
        a, b = first[rank], resumed[rank]
        assert b[STEPS_BEFORE] == a[STEPS_BEFORE], (a, b)
        for step in range(STEPS_BEFORE + 1, FINETUNE_STEPS):
            assert abs(b[step] - a[step]) <= 0.02 * a[step], (step, a, b)
        assert abs(b[STEPS_BEFORE - 1] - a[STEPS_BEFORE - 1]) > 0.1 * a[STEPS_BEFORE - 1], \
            "not vacuous: before the load the resumed run's loss was elsewhere"


# ---------------------------------------------------------------------------
# The fingerprint the detection rests on
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [1, 127, 4097, 1_000_003])
@pytest.mark.parametrize("dtype", [BF16, FP32, torch.float16, torch.complex64])
def test_fingerprints_see_any_changed_element(numel, dtype):
    """precis.fingerprints.of (one C call for a list) and torch.ops.precis.fingerprint
    (the op a GPU uses) agree; one element's lowest bit flipped, two elements swapped or
    a tensor one element shorter changes it; a dense transposed view is hashed as its
    memory, a view with gaps through a copy."""
    from precis import fingerprints, ops
    g = torch.Generator().manual_seed(numel)
    t = torch.randn(numel, generator=g).to(dtype)
    fp = fingerprints.of([t])[0]
    flat = t.view(torch.float32) if t.is_complex() else t
    assert int(ops.fingerprint([flat, flat[:1]])[0]) % (1 << 64) == fp
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[flat.element_size()])
    i = numel // 2
    bits[i] ^= 1
    assert fingerprints.of([t])[0] != fp
    bits[i] ^= 1
    assert fingerprints.of([t])[0] == fp
    if numel > 1:
        u = t.clone()
        u[0], u[-1] = t[-1], t[0]
        assert torch.equal(u, t) or fingerprints.of([u])[0] != fp
        assert fingerprints.of([t[:-1]])[0] != fp
    m = torch.randn(7, 9, generator=g).to(dtype)
    assert fingerprints.of([m.t()]) == fingerprints.of([m])  # the same memory
    assert fingerprints.of([m[:, :4]]) == fingerprints.of([m[:, :4].contiguous()])


def test_fingerprint_op_refuses_what_it_cannot_read():
    from precis import ops
    with pytest.raises(RuntimeError, match=r"bufs\[1\] must be contiguous"):
        ops.fingerprint([torch.randn(3), torch.randn(4, 4).t()])
    with pytest.raises(TypeError, match=r"bufs\[1\]"):
        ops.fingerprint([torch.randn(3), 2])
    with pytest.raises(ValueError, match="empty"):
        ops.fingerprint([])


def test_device_records_are_read_once_at_the_first_look(monkeypatch):
    """fingerprints.Records keeps a device's fingerprints unread (the op's output) until
    something looks: recording again reads nothing (on a GPU each read waits for the
    device: a released backward's hooks record after every step call), and the first
    look reads every record at once, the newest winning; a CPU record (a known int)
    overrides the older unread ones. The device is simulated: split() hands back
    its values as an int64 tensor, as the op does, and the reads are counted."""
    from precis import fingerprints
    reads = []
    real_unsigned = fingerprints.unsigned
    monkeypatch.setattr(fingerprints, "unsigned",
                        lambda t: reads.append(t.numel()) or real_unsigned(t))

    def on_device(tensors):  # every tensor on "the device": its first element, negated
        return [], [(list(range(len(tensors))),
                     torch.tensor([-int(t[0]) for t in tensors], dtype=torch.int64))]
    monkeypatch.setattr(fingerprints, "split", on_device)
    records = fingerprints.Records()
    records.record([1, 2], [torch.tensor([5]), torch.tensor([6])])
    records.record([2], [torch.tensor([7])])
    records.record([3], [torch.tensor([8])])
    assert reads == []
    assert records[2] == (1 << 64) - 7  # the newer of id 2's records; its uint64 form
    assert reads == [4]  # every unread value in one read
    assert records[1] == (1 << 64) - 5 and 3 in records and 4 not in records
    assert reads == [4]
    records.record([1], [torch.tensor([9])])
    records.update([(1, 11)])  # a host record after an unread one: the host's stands
    assert records[1] == 11 and reads == [4, 1]


def test_unread_records_superseded_a_param_at_a_time_are_never_read(monkeypatch):
    """A released backward records its params a param at a time, unread: a record whose
    every id newer records superseded, one or several, is dropped (found by id, not by a
    scan of the unread), so a look reads each id's newest value once, however many
    backwards passed; the values are the newest."""
    from precis import fingerprints
    reads = []
    real_unsigned = fingerprints.unsigned
    monkeypatch.setattr(fingerprints, "unsigned",
                        lambda t: reads.append(t.numel()) or real_unsigned(t))
    monkeypatch.setattr(fingerprints, "split", lambda tensors: (
        [], [(list(range(len(tensors))), torch.tensor([int(t[0]) for t in tensors]))]))
    records = fingerprints.Records()
    records.record([1, 2, 3], [torch.tensor([10]), torch.tensor([20]), torch.tensor([30])])
    records.record([2], [torch.tensor([21])])
    records.record([1, 4], [torch.tensor([11]), torch.tensor([40])])
    assert records[2] == 21 and reads == [6]  # [1, 2, 3] kept whole: 3 is its own
    assert records[1] == 11 and records[3] == 30 and records[4] == 40 and reads == [6]
    records.record(range(7), [torch.tensor([k]) for k in range(7)])  # (a whole step's)
    for backward in range(3):  # each id superseded by a record of its own
        for key in range(7):
            records.record([key], [torch.tensor([100 * backward + key])])
    records.record([1, 2], [torch.tensor([1000]), torch.tensor([2000])])
    assert records[0] == 200 and records[6] == 206 and reads == [6, 7]  # 7 ids, read once
    assert records[1] == 1000 and records[2] == 2000 and records[4] == 204


@pytest.mark.parametrize("policy", ["default", "remainders8"])
@pytest.mark.parametrize("path", ["module_load_state_dict", "param_data"])
def test_an_eager_capturable_step_picks_up_a_load(tmp_path, policy, path):
    """capturable=True (on the CPU here): outside a CUDA graph capture the step compares
    the fingerprints too."""
    kept, master_error, warned, moved, all_tensors, copies = one_load(
        0, 1, "one_process", policy, False, path, str(tmp_path), capturable=True)
    assert kept and master_error == 0.0 and warned and copies and moved and all_tensors


@pytest.mark.parametrize("optimizer", w.ONE_STATE)
@pytest.mark.parametrize("policy", ["default", "remainders8"])
def test_an_eager_capturable_step_of_sgd_and_lion_picks_up_a_load(tmp_path, policy, optimizer):
    """test_an_eager_capturable_step_picks_up_a_load for SGD and Lion (a load through
    `param.data`, which moves no version counter)."""
    kept, master_error, warned, moved, all_tensors, copies = one_load(
        0, 1, "one_process", policy, False, "param_data", str(tmp_path), capturable=True,
        optimizer=optimizer)
    assert kept and master_error == 0.0 and warned and copies and moved and all_tensors


@pytest.mark.parametrize("copy_how", ["deepcopy", "torch_save"])
@pytest.mark.parametrize("policy", ["default", "remainders16"])
@pytest.mark.parametrize("when", ["after_the_copy", "before_the_copy"])
def test_a_copied_optimizer_sees_a_load(copy_how, policy, when):
    """A copy of params and optimizer together (copy.deepcopy, or torch.save and
    torch.load of both), and weights loaded into the copy's params before its first
    step (or into the original's before the copy): the copy's records are the
    original's, so the load is seen (a StaleMasterWarning) and an lr-0 step leaves the
    loaded weights exactly, its master the loaded weights."""
    import copy
    import io
    model = make_model(0)
    opt = precis.optim.AdamW(model.parameters(), lr=1e-2, policy=POLICIES[policy])
    for step in range(STEPS_BEFORE):
        backward(model, step)
        opt.step()
        opt.zero_grad()
    loaded = make_model(7).state_dict()
    if when == "before_the_copy":
        model.load_state_dict(loaded)
    if copy_how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        buffer = io.BytesIO()
        torch.save((model, opt), buffer)
        buffer.seek(0)
        model2, opt2 = torch.load(buffer, weights_only=False)
    if when == "after_the_copy":
        model2.load_state_dict(loaded)
    for group in opt2.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    backward(model2, STEPS_BEFORE)
    with pytest.warns(precis.optim.StaleMasterWarning):
        opt2.step()
    for name, p in model2.named_parameters():
        assert torch.equal(p, loaded[name]), name
        st = opt2.state[p]
        if "master" in st:
            assert torch.equal(st["master"], loaded[name].float()), name
        else:
            assert not st["remainder"].any(), name


# ---------------------------------------------------------------------------
# A write into part of a param is a write into that part (issue #64 item 7)
# ---------------------------------------------------------------------------

def stepped(n, policy=None, offload=False, seed=0):
    """A bf16 param of n elements (and a transposed 9 x 7 one: other strides) after
    three AdamW steps at lr 1e-2 on random gradients, and its optimizer."""
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(BF16)),
          nn.Parameter(torch.randn(7, 9, generator=g).to(BF16).t())]
    opt = precis.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, policy=policy, offload=offload)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(BF16)
        opt.step()
    return ps, opt


def step_at_lr_0(opt, ps):
    """A step that leaves masters as they are (lr 0, no weight decay); the warnings it
    gave, looked for at once (state_dict(): on the device path a Plan's flags are
    copied back every step_plan.KeptRows.ROWS steps)."""
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    for p in ps:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        opt.state_dict()
    return [str(c.message) for c in caught
            if issubclass(c.category, precis.optim.StaleMasterWarning)]


def bits(t):
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("offload", [False, "cpu"])
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_a_partial_write_keeps_the_other_elements_masters(n, offload):
    """4 elements written behind the optimizer (as a clamp or a mask writes them) into
    each of two params, of n elements (n = 1: its one element, a whole load) and a
    transposed 9 x 7: their masters become the written values, every other element's
    master is kept bit for bit (it still rounds to the param), and the warning names
    what it saw in each."""
    ps, opt = stepped(n, offload=offload)
    before = [opt.master_weight(p).clone() for p in ps]  # (the master itself, else)
    g = torch.Generator().manual_seed(1)
    written = []
    with torch.no_grad():
        for p in ps:
            at = torch.randperm(p.numel(), generator=g)[:4]
            flat = p.view(-1) if p.is_contiguous() else p.t().reshape(-1)  # (its memory)
            flat[at] = flat[at] + 0.5  # (0.5 moves any bf16 below 128)
            where = torch.zeros(p.numel(), dtype=torch.bool)
            where[at] = True
            written.append(where.view(p.shape) if p.is_contiguous() else where.view(7, 9).t())
    loaded = [p.detach().clone() for p in ps]
    messages = step_at_lr_0(opt, ps)
    for p, q, master, old, where in zip(ps, loaded, map(opt.master_weight, ps), before,
                                        written):
        assert torch.equal(bits(p), bits(q)), "the step overwrote the written weights"
        assert torch.equal(bits(master[where]), bits(q[where].float()))
        assert torch.equal(bits(master[~where]), bits(old[~where])), \
            "an element nobody wrote lost its master"
    first = "group 0 param 0: a whole load, 1 of 1 elements written" if n == 1 else \
        f"group 0 param 0: a partial write, 4 of {n} elements (the others' masters kept)"
    assert len(messages) == 1 and \
        f"({first}; group 0 param 1: a partial write, 4 of 63 elements (the others' " \
        f"masters kept)), e.g. by loading model weights or applying a mask" in messages[0], \
        messages


@pytest.mark.parametrize("n", [127, 4097])
def test_a_load_with_a_few_elements_equal_by_chance_is_a_whole_load(n):
    """A whole load leaves a few elements equal to the old weights by chance (about 1
    bf16 element in 1,000): up to 1 element in 64 (and 1) still rounding to its master,
    the whole master is the loaded weights, as before partial writes were told apart;
    one more, and it is a partial write."""
    for equal in (max(1, n // 64), max(1, n // 64) + 1):
        ps, opt = stepped(n)
        old = ps[0].detach().clone()
        master_before = opt.master_weight(ps[0]).clone()  # (the master itself, else)
        with torch.no_grad():
            new = (old.float() + 0.25 + torch.rand(n, generator=torch.Generator().manual_seed(2))
                   ).to(BF16)  # (every element moved: the ones equal are set below)
            assert not (new == old).any()
            new[:equal] = old[:equal]
            ps[0].copy_(new)
        messages = step_at_lr_0(opt, ps[:1])
        master = opt.master_weight(ps[0])
        if equal == max(1, n // 64):
            assert torch.equal(bits(master), bits(new.float()))
            assert f"(group 0 param 0: a whole load, {n - equal} of {n} elements " \
                   f"written)" in messages[0]
        else:
            assert torch.equal(bits(master[:equal]), bits(master_before[:equal]))
            assert torch.equal(bits(master[equal:]), bits(new[equal:].float()))
            assert f"(group 0 param 0: a partial write, {n - equal} of {n} elements " \
                   f"(the others' masters kept))" in messages[0]


@pytest.mark.parametrize("policy", ["remainders16", "remainders8"])
def test_a_partial_write_resyncs_remainders_whole(policy):
    """A remainder cannot tell which elements were written (the param is its master's
    high half, whatever was written into it): one written element zeroes its block's
    remainders (master = the param), here the whole tensor's (127 elements: one block),
    and the warning says so."""
    ps, opt = stepped(127, policy=POLICIES[policy])
    assert opt.state[ps[0]]["remainder"].any()  # not vacuous
    with torch.no_grad():
        ps[0][5] += 0.5
    messages = step_at_lr_0(opt, ps[:1])
    assert not opt.state[ps[0]]["remainder"].any()
    assert "(group 0 param 0: written (its remainders resynced whole))" in messages[0]


def after_three_steps(ps, policy, g):
    """ps' AdamW optimizer after three steps (gradients from generator g)."""
    opt = precis.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, policy=policy)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(BF16)
        opt.step()
    return opt


def blocked(n, policy, plan):
    """A bf16 param of n elements after three AdamW steps (and a transposed 9 x 7 one
    beside it where not plan: a group no Plan steps), and its optimizer."""
    g = torch.Generator().manual_seed(3)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(BF16))]
    if not plan:
        ps.append(nn.Parameter(torch.randn(7, 9, generator=g).to(BF16).t()))
    opt = after_three_steps(ps, policy, g)
    assert bool(opt._books.plans) == plan  # (the path the test means to take)
    return ps, opt


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("plan", [True, False])
@pytest.mark.parametrize("policy", ["remainders16", "remainders8"])
def test_a_partial_write_resyncs_the_remainders_of_the_blocks_it_touched(
        policy, plan, device_path, monkeypatch):
    """Remainders are recorded in blocks of fingerprints.BLOCK elements: a slice and an
    element written into a param of 3 blocks and 5 elements zero the remainders of their
    two blocks (the 5-element one too), the other two keep theirs bit for bit; each of
    two such writes is warned of at its step (not only the first). On the CPU (the
    host's compare) and on the device path (emulated: the device's compare, a Plan's or
    the full path's)."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    block = precis.fingerprints.BLOCK
    n = 3 * block + 5
    ps, opt = blocked(n, POLICIES[policy], plan)
    for edit, (at, end) in enumerate([(block + 10, block + 300), (3 * block + 2, 3 * block + 3)]):
        remainder = opt.state[ps[0]]["remainder"]
        before = remainder.clone()
        assert all(before[k * block:(k + 1) * block].any() for k in (0, 2, at // block))
        with torch.no_grad():
            ps[0][at:end] = ps[0][at:end] * 0.5 + 0.25
        loaded = ps[0].detach().clone()
        messages = step_at_lr_0(opt, ps)
        written = torch.zeros(4, dtype=torch.bool)
        written[at // block] = True
        for k in range(4):
            got, old = remainder[k * block:(k + 1) * block], before[k * block:(k + 1) * block]
            assert torch.equal(got, torch.zeros_like(got) if written[k] else old), (edit, k)
        assert torch.equal(bits(ps[0]), bits(loaded)), "the step overwrote the written weights"
        elements = block if at // block < 3 else 5
        assert len(messages) == 1 and (
            f"group 0 param 0: a partial write (its remainders resynced in the blocks of "
            f"{block} elements it touched: {elements} of {n} elements; the others kept)"
            in messages[0]), (edit, messages)
        for group in opt.param_groups:  # an ordinary step before the next write
            group["lr"], group["weight_decay"] = 1e-2, 0.1
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(edit)).to(BF16)
        opt.step()


@pytest.mark.parametrize("device_path", [False, True])
def test_partial_writes_into_several_params_of_a_plan_are_each_worded_by_their_blocks(
        device_path, monkeypatch):
    """A Plan's four params with remainders (5 elements; 3 blocks and 5; 2 blocks; 1
    element): a slice written into the second's second block and an element into the
    third's last block are each warned of by their own blocks (what each param kept,
    summed from its blocks': on the device path on the device, a value a param read
    back), the other two not named, and only those blocks' remainders zeroed."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    block = precis.fingerprints.BLOCK
    sizes = [5, 3 * block + 5, 2 * block, 1]
    g = torch.Generator().manual_seed(4)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in sizes]
    opt = precis.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, policy=POLICIES["remainders8"])
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(BF16)
        opt.step()
    assert opt._books.plans
    before = [opt.state[p]["remainder"].clone() for p in ps]
    with torch.no_grad():
        ps[1][block + 10:block + 300] *= 0.5
        ps[2][-1] = ps[2][-1] * 0.5 + 0.25
    messages = step_at_lr_0(opt, ps)
    assert len(messages) == 1, messages
    words = f"its remainders resynced in the blocks of {block} elements it touched"
    assert f"group 0 param 1: a partial write ({words}: {block} of {sizes[1]} elements; " \
        f"the others kept)" in messages[0], messages
    assert f"group 0 param 2: a partial write ({words}: {block} of {sizes[2]} elements; " \
        f"the others kept)" in messages[0], messages
    assert "param 0:" not in messages[0] and "param 3:" not in messages[0], messages
    for i, (p, old) in enumerate(zip(ps, before)):
        got = opt.state[p]["remainder"]
        for k in range(0, p.numel(), block):
            written = (i, k) in ((1, block), (2, block))
            assert torch.equal(got[k:k + block], torch.zeros_like(got[k:k + block])
                               if written else old[k:k + block]), (i, k)


def loaded_and_stepped(load, steps):
    """Two bf16 params of the default policy (fp32 masters) after three AdamW steps; with
    load, two steps more and an optimizer-only load of the state saved after the three
    (each param's loaded master stands, its param not its rounding, until the param is
    written); then steps: (the params given grads, a write into param 0's first 100
    elements before the step or not, and optionally True: an inf grad, the step skipped by
    the kernel) each. Returns each param's bits and master after
    them, and the StaleMasterWarnings given."""
    import copy
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in (4096, 300)]
    opt = precis.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)

    def step(which=(0, 1), seed=0, inf=False):
        for i, p in enumerate(ps):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i)) \
                .to(BF16) if i in which else None
        if inf:  # (under a loss scale: the kernel checks the grads and skips the step)
            ps[0].grad[5] = float("inf")
            opt.step(grad_scale=1.0)
        else:
            opt.step()

    for k in range(3):
        step(seed=10 * k)
    saved = copy.deepcopy(opt.state_dict())
    if load:
        for k in range(2):
            step(seed=100 + 10 * k)
        opt.load_state_dict(saved)
    messages = []
    for k, (which, write, *inf) in enumerate(steps):
        if write:
            with torch.no_grad():
                ps[0][:100] = 0.5
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(which, seed=1000 + 10 * k, inf=bool(inf))
        messages += [str(c.message) for c in caught
                     if issubclass(c.category, precis.optim.StaleMasterWarning)]
    return [bits(p) for p in ps], [opt.master_weight(p) for p in ps], messages


@pytest.mark.parametrize("device_path", [False, True])
def test_an_optimizer_only_loads_record_beside_a_param_compared_by_rounding(device_path,
                                                                            monkeypatch):
    """An optimizer-only load records each param (its loaded master stands until the param
    is written); a step of param 0 alone leaves param 0 compared by rounding
    (Records.by_rule) and param 1 recorded. The next step's call holds both: on the CPU it
    does not see writes itself (it would take param 1 as its master) and compares param 0
    on the host by rounding (functional.gather's `ruled`), a write into 100 of its
    elements taken there. Params, masters and warnings as an optimizer that never took
    the two steps the load undid, bit for bit (on the device path too)."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    steps = [((0,), False), ((0, 1), True), ((0, 1), False)]
    got, want = loaded_and_stepped(True, steps), loaded_and_stepped(False, steps)
    for k in range(2):
        assert torch.equal(got[0][k], want[0][k]), f"param {k}"
        assert torch.equal(got[1][k], want[1][k]), f"param {k}'s master"
    assert got[2] == want[2] and len(got[2]) == 1 and \
        "group 0 param 0: a partial write, 100 of 4096 elements" in got[2][0], got[2]


@pytest.mark.parametrize("device_path", [False, True])
def test_an_optimizer_only_load_stands_through_a_step_the_kernel_skipped(device_path,
                                                                         monkeypatch):
    """An optimizer-only load, then a step the kernel skips (an inf grad under a loss
    scale: the records stand) after which a Plan is made: its Part must not see writes
    while a param's record stands (the op would take the unwritten param as its master:
    the loaded master lost and a partial write warned of), so the next step compares on
    the host and keeps the loaded masters. Params, masters and warnings as an optimizer
    that never took the two steps the load undid, bit for bit (on the device path too)."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    steps = [((0, 1), False, True), ((0, 1), False), ((0, 1), False)]
    got, want = loaded_and_stepped(True, steps), loaded_and_stepped(False, steps)
    for k in range(2):
        assert torch.equal(got[0][k], want[0][k]), f"param {k}"
        assert torch.equal(got[1][k], want[1][k]), f"param {k}'s master"
    assert got[2] == want[2] == [], got[2]


@pytest.mark.parametrize("device_path", [False, True])
def test_a_write_before_a_skipped_step_is_warned_of_once(device_path, monkeypatch):
    """A write into a param with remainders, then a step the kernel skips (a NaN gradient
    under a loss scale): the step's compare resyncs the written blocks and warns of them;
    the step after finds them as that compare left them (the skipped step records its
    blocks as found), so it neither zeroes them again nor warns again, on both paths."""
    if device_path:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    gen = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(40000, generator=gen).to(BF16)) for _ in range(2)]
    opt = precis.optim.AdamW(ps, lr=1e-2, policy={"store_param_remainders": True})
    counts = []
    for step in range(4):
        if step == 1:
            with torch.no_grad():
                ps[1][:10] += 1
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(BF16)
        if step == 1:
            ps[0].grad[0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(grad_scale=1.0)
            opt.state_dict()  # (reads a device path's verdicts and warnings now)
        counts.append(sum(issubclass(c.category, precis.optim.StaleMasterWarning)
                          for c in caught))
        assert opt.last_step_skipped is (step == 1)
    assert counts == [0, 1, 0, 0], counts


def test_slice_edits_leave_the_other_blocks_masters_as_an_fp32_master_keeps_them():
    """Three slice edits (clamps of a few rows, between steps) into a param of 16
    blocks: with int16 remainders (an exact fp32 master) every element of a block no
    edit touched has the master bits of the run with fp32 masters (which resyncs only
    the elements written), 27 steps later; before blocks, 41% of them did not."""
    rows, cols = 64, 4096
    edits = {3: (5, 7), 6: (20, 21), 9: (40, 43)}  # step -> rows clamped before it

    def run(policy):
        g = torch.Generator().manual_seed(0)
        p = nn.Parameter((torch.randn(rows, cols, generator=g) * 0.1).to(BF16))
        opt = precis.optim.AdamW([p], lr=1e-3, weight_decay=0.01, policy=policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", precis.optim.StaleMasterWarning)
            for step in range(30):
                p.grad = torch.randn(rows, cols, generator=g).to(BF16)
                if step in edits:
                    with torch.no_grad():
                        p[edits[step][0]:edits[step][1]].clamp_(-0.05, 0.05)
                opt.step()
        return opt.master_weight(p).view(-1)

    block = precis.fingerprints.BLOCK
    touched = torch.zeros(rows * cols // block, dtype=torch.bool)
    for a, b in edits.values():
        touched[a * cols // block:(b * cols - 1) // block + 1] = True
    assert 0 < int(touched.sum()) < len(touched)
    kept = (~touched).repeat_interleave(block)
    assert torch.equal(bits(run(POLICIES["remainders16"])[kept]), bits(run(None)[kept]))


MASK_STEPS, MASK_LR = 100, 1e-4


def masked_run(n, precis_adamw, policy=None):
    """MASK_STEPS AdamW steps (lr MASK_LR, weight decay 0.01) of a bf16 param of n
    elements, uniform in +-0.125 (nn.Linear's init for 64 inputs), on gradients of mean
    1 (bf16), a pruning mask (half the elements, element 0 kept) applied after every
    step. precis_adamw: precis's AdamW (fp32 master); else torch's AdamW on an fp32
    copy (fed the same gradients). Returns the param, the master (torch's: the param),
    the mask and the initial weights."""
    g = torch.Generator().manual_seed(n)
    w0 = ((torch.rand(n, generator=g) * 2 - 1) * 0.125).to(BF16)
    mask = torch.rand(n, generator=g) < 0.5
    mask[0] = True
    p = nn.Parameter(w0.clone() if precis_adamw else w0.float())
    make = precis.optim.AdamW if precis_adamw else torch.optim.AdamW
    opt = make([p], lr=MASK_LR, weight_decay=0.01,
               **({"policy": policy} if precis_adamw else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", precis.optim.StaleMasterWarning)
        for _ in range(MASK_STEPS):
            p.grad = (1 + 0.5 * torch.randn(n, generator=g)).to(BF16).to(p.dtype)
            opt.step()
            with torch.no_grad():
                p.mul_(mask)
    master = opt.master_weight(p) if precis_adamw else p.detach()
    return p.detach(), master, mask, w0.float()


@pytest.mark.parametrize("moments", ["fp32", "default"])
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_a_mask_after_every_step_trains_the_unmasked_weights_as_fp32_adamw(n, moments):
    """A pruning mask applied after every step (a partial write each step) must not
    stop the unmasked weights, which a bf16 param moves by its master. Against torch's
    fp32 AdamW (same gradients, same mask): with fp32 moments their masters are its
    weights to 1e-7 (the kernel's and torch's fp32 roundings over 100 steps: 1.5e-8
    seen; an ulp at 0.125 is 7.5e-9) and the params their masters' rounding; with the
    default bf16 moments too, their mean movement is its own to 1% and half a bf16 ulp
    of 0.125 (the params' rounding). n = 4097, default: -0.008987 against -0.008989;
    before, with the whole master resynced from the param at each step, -0.002273.
    (n = 1: its one element is kept by the mask, nothing is written.)"""
    policy = {"exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32"} if moments == "fp32" \
        else None
    p, master, mask, w0 = masked_run(n, True, policy)
    ref, _, _, _ = masked_run(n, False)
    assert torch.equal(p[~mask], torch.zeros_like(p[~mask]))
    if moments == "fp32":
        assert float((master[mask] - ref[mask]).abs().max()) <= 1e-7
        assert torch.equal(bits(p[mask]), bits(master[mask].to(BF16)))
    moved, ref_moved = [float((t.float()[mask] - w0[mask]).mean()) for t in (p, ref)]
    assert ref_moved < -0.008  # not vacuous: lr x steps, less weight decay
    assert abs(moved - ref_moved) <= 0.01 * abs(ref_moved) + 0.125 * 2.0 ** -9, \
        (moved, ref_moved)


def test_a_plans_params_with_an_empty_one_resync_whole_on_the_device_path(monkeypatch):
    """On the device path a Plan's op compares its params' blocks with no empty param among
    them (on a GPU its update kernels do, a CUDA block a record block); with one, the op
    compares each param whole: a partial write then zeroes the written param's remainders
    whole (warned as such), the other param's stay, and the step leaves the write."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    block = precis.fingerprints.BLOCK
    g = torch.Generator().manual_seed(6)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in (2 * block + 3, 0, 300)]
    opt = after_three_steps(ps, POLICIES["remainders8"], g)
    assert opt._books.plans
    other = opt.state[ps[2]]["remainder"].clone()
    assert opt.state[ps[0]]["remainder"][:block].any()
    with torch.no_grad():
        ps[0][block + 5] = 0.5
    loaded = ps[0].detach().clone()
    messages = step_at_lr_0(opt, ps)
    assert not opt.state[ps[0]]["remainder"].any()  # (whole: block 0 untouched, zeroed too)
    assert torch.equal(opt.state[ps[2]]["remainder"], other)
    assert torch.equal(bits(ps[0]), bits(loaded))
    assert len(messages) == 1 and "group 0 param 0: written (its remainders" in messages[0] \
        and "param 2" not in messages[0], messages
