"""precis.ddp beyond the training trajectory: buffer dtypes and the memory they
take, the broadcast at construction, which collectives go to the backend (in which
dtype, in place or not, how many bytes), sharded optimizer checkpoints, the comm
hook for torch's DDP, argument errors, and a training script under torchrun.
"""
import contextlib
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import ddp_worker as w
import precis
import precis.ddp

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples",
                       "ddp_train.py")

# (model dtype, policy overrides, main grads and comm dtypes the policy gives).
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPE_CASES = {
    "fp16_default": (FP16, None, FP32, FP32),
    "bf16_default": (BF16, None, BF16, BF16),
    "bf16_main_grads_fp32": (BF16, {"main_grads_dtype": "fp32"}, FP32, FP32),
    "bf16_grad_reduce_in_fp32": (BF16, {"grad_reduce_in_fp32": True}, FP32, FP32),
    "bf16_comm_fp32": (BF16, {"grad_comm_dtype": "fp32"}, BF16, FP32),
    "fp32_default": (FP32, None, FP32, FP32),
    "fp32_comm_bf16": (FP32, {"grad_comm_dtype": "bf16"}, FP32, BF16),
}


def one_step(ddp, opt, rank, world_size, batch_index=0):
    x, y = w.make_batches(batch_index + 1)[batch_index]
    per_rank = w.GLOBAL_BATCH // world_size
    for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, 2)):
        with ddp.no_sync() if i == 0 else contextlib.nullcontext():
            w.loss_fn(ddp, xm, ym, per_rank).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------------
# Cases (run in the child processes)
# ---------------------------------------------------------------------------


class _Done:
    def wait(self):
        return True


def spy_collectives(calls, in_place_safe=False):
    """Record every collective precis.ddp hands to torch.distributed as (kind, dtype
    name, numel sent, whether the output overlaps the input); returns a function
    that undoes it. in_place_safe: an output that overlaps its input (the in-place
    calls NCCL takes) is given separate memory before gloo sees it, so gloo's own
    handling of overlaps plays no part."""
    import torch.distributed as dist
    rs, ag = precis.ddp._comm._REDUCE_SCATTER, precis.ddp._comm._ALL_GATHER
    saved = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", rs, ag)}

    def overlaps(a, b):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def all_reduce(t, *args, **kwargs):
        calls.append(("all_reduce", str(t.dtype), t.numel(), False))
        return saved["all_reduce"](t, *args, **kwargs)

    def broadcast(t, *args, **kwargs):
        calls.append(("broadcast", str(t.dtype), t.numel(), False))
        return saved["broadcast"](t, *args, **kwargs)

    def reduce_scatter(out, inp, *args, async_op=False, **kwargs):
        aliased = overlaps(out, inp)
        calls.append(("reduce_scatter", str(inp.dtype), inp.numel(), aliased))
        if aliased and in_place_safe:
            tmp = torch.empty_like(out)
            saved[rs](tmp, inp, *args, async_op=False, **kwargs)
            out.copy_(tmp)
            return _Done() if async_op else None
        return saved[rs](out, inp, *args, async_op=async_op, **kwargs)

    def all_gather(out, inp, *args, **kwargs):
        aliased = overlaps(out, inp)
        calls.append(("all_gather", str(out.dtype), inp.numel(), aliased))
        if aliased and in_place_safe:
            inp = inp.clone()
        return saved[ag](out, inp, *args, **kwargs)

    for name, fn in (("all_reduce", all_reduce), ("broadcast", broadcast), (rs, reduce_scatter),
                     (ag, all_gather)):
        setattr(dist, name, fn)

    def undo():
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return undo


def case_collectives(rank, world_size, strategy, comm):
    """The collectives of construction and of 2 steps on gloo, fp32 model with
    `comm` on the wire, with the bytes counted and any warning raised."""
    import precis.optim
    policy = {"grad_comm_dtype": comm}
    construction, steps = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        undo = spy_collectives(construction)
        try:
            ddp = precis.ddp.DistributedDataParallel(w.make_model(), policy=policy,
                                                     sharding=strategy, bucket_size=50)
        finally:
            undo()
        opt = precis.ddp.attach_optimizer(
            precis.optim.AdamW(ddp.parameters(), policy=policy, **w.OPTIM_KW))
        undo = spy_collectives(steps)
        try:
            for step in range(2):
                one_step(ddp, opt, rank, world_size, step)
        finally:
            undo()
    return {"construction": construction, "steps": steps, "bytes": ddp.comm_bytes,
            "numel": ddp.buffer_bytes()["numel"],
            "warnings": [f"{x.category.__name__}: {x.message}" for x in caught]}


def case_dtypes_and_memory(rank, world_size, name, strategy):
    import precis.optim
    dtype, overrides, want_grad, _ = DTYPE_CASES[name]
    ddp = precis.ddp.DistributedDataParallel(w.make_model(dtype), policy=overrides,
                                             sharding=strategy, bucket_size=50)
    opt = precis.ddp.attach_optimizer(
        precis.optim.AdamW(ddp.parameters(), policy=overrides, **w.OPTIM_KW))
    x, y = w.make_batches(1)[0]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    w.loss_fn(ddp, xm, ym, 1.0).backward()
    main_grads = [None if p.main_grad is None else p.main_grad.dtype
                  for p in ddp.module.parameters()]
    grads_freed = all(p.grad is None for p in ddp.module.parameters())
    piece_grads = [p.main_grad.dtype for g in opt.param_groups for p in g["params"]]
    opt.step()  # allocates the optimizer state
    policy = precis.resolve_policy(dtype, overrides)
    return {"buffer_dtypes": ddp.buffer_dtypes(), "main_grads": main_grads,
            "grads_freed": grads_freed, "piece_grads": piece_grads,
            "buffers": ddp.buffer_bytes(), "report": opt.memory_report(),
            "policy_bytes": policy.bytes_per_param(), "want_grad": want_grad}


def case_broadcast(rank, world_size):
    """Different params and buffers on each rank before wrapping; rank 0's after."""
    torch.manual_seed(100 + rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(torch.bfloat16)
    model[1].running_mean.uniform_()
    before = w.flat_params(model)
    precis.ddp.DistributedDataParallel(model, sharding="optim")
    return {"before": before, "after": w.flat_params(model),
            "buffer": model[1].running_mean.float().clone()}


def case_checkpoint(rank, world_size, strategy, dtype):
    """Save after 2 steps, go on 2 more; a fresh run loaded from the save must
    arrive at the same params, bit for bit."""
    import precis.optim

    def build(seed):
        ddp = precis.ddp.DistributedDataParallel(w.make_model(dtype, seed=seed), sharding=strategy,
                                                 bucket_size=50)
        return ddp, precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(),
                                                                   **w.OPTIM_KW))

    ddp, opt = build(0)
    for step in range(2):
        one_step(ddp, opt, rank, world_size, step)
    buf = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict()}, buf)
    for step in range(2, 4):
        one_step(ddp, opt, rank, world_size, step)
    straight = w.flat_params(ddp.module)

    buf.seek(0)
    saved = torch.load(buf)
    ddp2, opt2 = build(seed=7)  # other weights: everything must come from the checkpoint
    ddp2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    for step in range(2, 4):
        one_step(ddp2, opt2, rank, world_size, step)
    # The other rank's optimizer state must be refused.
    meta = saved["optim"].get("precis_ddp")
    errors = {}
    if meta is not None:
        moved = [list(meta["pieces"][0][:2]) + [meta["pieces"][0][2] - 1]] + meta["pieces"][1:]
        for key, value in (("rank", 1 - rank), ("world_size", 3), ("pieces", moved)):
            bad = dict(saved["optim"], precis_ddp=dict(meta, **{key: value}))
            try:
                opt2.load_state_dict(bad)
            except ValueError as e:
                errors[key] = str(e)
        no_meta = {k: v for k, v in saved["optim"].items() if k != "precis_ddp"}
        try:
            opt2.load_state_dict(no_meta)
        except ValueError as e:
            errors["missing"] = str(e)
        # ... and by an unsharded run's optimizer (precis's or torch's), before it loads
        for make in (precis.optim.AdamW, torch.optim.AdamW):
            whole = precis.ddp.DistributedDataParallel(w.make_model(dtype), bucket_size=50)
            whole_opt = precis.ddp.attach_optimizer(make(whole.parameters(), **w.OPTIM_KW))
            try:
                whole_opt.load_state_dict(saved["optim"])
            except ValueError as e:
                errors[f"into_no_shard_{make.__module__}"] = (str(e), len(whole_opt.state))
    else:  # no_shard: a plain state dict, which a single-process optimizer loads
        plain = precis.optim.AdamW(w.make_model(dtype).parameters(), **w.OPTIM_KW)
        plain.load_state_dict(saved["optim"])
    return {"straight": straight, "resumed": w.flat_params(ddp2.module), "meta": meta,
            "errors": errors, "pieces": precis.ddp.optimizer_pieces(opt),
            "state_numel": sum(s["exp_avg"].numel() for s in opt.state.values())}


def case_comm_hook(rank, world_size, overrides):
    """torch's DDP with precis.ddp.comm_hook: the gradients after backward."""
    model = w.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0003)  # 2+ buckets
    ddp.register_comm_hook(None, precis.ddp.comm_hook(overrides))
    x, y = w.make_batches(1)[0]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    w.loss_fn(ddp, xm, ym, w.GLOBAL_BATCH // world_size).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def case_subgroup(rank, world_size, strategy):
    """A process group other than the world (as a data-parallel group is when
    other dimensions of parallelism exist): same training as with the world."""
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    ddp, _ = w.train_ddp(rank, world_size, 3, sharding=strategy, bucket_size=50,
                         process_group=group)
    return w.flat_params(ddp.module)


def case_grad_scale_skip(rank, world_size, strategy):
    """A NaN on one rank with step(grad_scale=...): every rank must skip the step,
    even those whose shard of the gradient has no NaN."""
    import precis.optim
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), sharding=strategy, bucket_size=50)
    opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW))
    if rank == 1:  # a NaN in the first element of the first param: rank 0's shard
        p = next(ddp.module.parameters())
        p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
    before = w.flat_params(ddp.module)
    x, y = w.make_batches(1)[0]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    w.loss_fn(ddp, xm, ym, 1.0).backward()
    opt.step(grad_scale=1.0)
    return {"skipped": opt.last_step_skipped,
            "unchanged": torch.equal(before, w.flat_params(ddp.module))}


def case_in_place_paths(rank, world_size, strategy):
    """The in-place reduce-scatter and all-gather precis.ddp gives NCCL, run on gloo
    (the overlapping output given its own memory on the way: spy_collectives)."""
    real_init = precis.ddp._comm._Comm.__init__

    def init(self, group):
        real_init(self, group)
        self.in_place = True  # as for NCCL

    calls = []
    precis.ddp._comm._Comm.__init__ = init
    undo = spy_collectives(calls, in_place_safe=True)
    try:
        ddp, _ = w.train_ddp(rank, world_size, 3, sharding=strategy, bucket_size=50)
    finally:
        undo()
        precis.ddp._comm._Comm.__init__ = real_init
    return {"params": w.flat_params(ddp.module), "bytes": ddp.comm_bytes, "calls": calls}


def case_overlap(rank, world_size, overlap):
    """Bytes sent when backward reaches the first layer's output: buckets of the
    later layers are already on the wire when reductions overlap backward."""
    ddp = precis.ddp.DistributedDataParallel(w.make_model(), bucket_size=1,
                                             overlap_grad_reduce=overlap)
    x, y = w.make_batches(1)[0]
    xm, ym = w.local_micro_batches(x, y, rank, world_size, 1)[0]
    seen = []
    h = ddp.module[0](xm)
    h.register_hook(lambda g: seen.append(sum(ddp.comm_bytes.values())))
    out = ddp.module[1:](h)
    before = sum(ddp.comm_bytes.values())
    ((out - ym) ** 2).sum().backward()
    after = sum(ddp.comm_bytes.values())
    nonzero = sum(int(p.main_grad.count_nonzero()) for p in ddp.module.parameters())
    ddp.zero_grad_buffer()
    cleared = all(int(p.main_grad.count_nonzero()) == 0 for p in ddp.module.parameters())
    return {"mid": seen[0] - before, "end": after - before, "nonzero": nonzero,
            "cleared": cleared}


def case_errors(rank, world_size):
    out = {}
    ddp = precis.ddp.DistributedDataParallel
    out["sharding"] = w.error_text(lambda: ddp(nn.Linear(2, 2), sharding="zero3"))
    out["bucket_size"] = w.error_text(lambda: ddp(nn.Linear(2, 2), bucket_size=0))
    out["policy"] = w.error_text(lambda: ddp(
        nn.Linear(2, 2), policy=precis.resolve_policy(torch.bfloat16)))
    out["bad_override"] = w.error_text(lambda: ddp(
        nn.Linear(2, 2), policy={"main_grads_dtype": "fp8"}))
    shared = nn.Linear(2, 2)
    first = ddp(shared)
    out["twice"] = w.error_text(lambda: ddp(shared))
    del first
    for flag in ("overlap_grad_reduce", "check_for_nan_in_grad"):
        out[flag] = w.error_text(lambda: ddp(nn.Linear(2, 2), **{flag: "no"}))
    out["process_group"] = w.error_text(lambda: ddp(nn.Linear(2, 2), process_group="world"))
    # A bad policy is refused before the broadcast writes rank 0's params into this rank's.
    torch.manual_seed(rank)
    mine = nn.Linear(2, 2)
    kept = [p.detach().clone() for p in mine.parameters()]
    out["policy_first"] = w.error_text(lambda: ddp(mine, policy={"exp_avg_dtype": "int7"}))
    out["kept"] = all(torch.equal(p, k) for p, k in zip(mine.parameters(), kept))
    return out


CLIP_MAX_NORM = 0.05  # (below every step's norm here: each step clips)


def case_clip_grad_norm(rank, world_size, sharding, norm_type, bf16):
    """train_ddp's loop with ddp.clip_grad_norm_ between the backward that reduces and
    opt.step(); and torch's clip_grad_norm_ on the wrapper's params, which finds no
    gradient (param.grad is None: they are in main_grad)."""
    import precis.optim
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = w.make_model(dtype)
    ddp = precis.ddp.DistributedDataParallel(model, sharding=sharding)
    opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW))
    per_rank = w.GLOBAL_BATCH // world_size
    norms, after, torch_norms = [], [], []
    for x, y in w.make_batches(3):
        for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, 2)):
            with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                w.loss_fn(ddp, xm, ym, per_rank).backward()
        torch_norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)))
        norms.append(float(ddp.clip_grad_norm_(CLIP_MAX_NORM, norm_type)))
        # (what the step gets: max_norm scales nothing, and the norm is the clipped one)
        after.append(float(ddp.clip_grad_norm_(float("inf"), norm_type)))
        opt.step()
        opt.zero_grad()
    ddp.gather_params()
    return norms, after, torch_norms, w.flat_params(model)


def clipped_reference(norm_type, bf16):
    """One process, the whole global batch, torch's clip_grad_norm_ (its gradients are
    param.grad)."""
    import precis.optim
    model = w.make_model(torch.bfloat16 if bf16 else torch.float32)
    opt = precis.optim.AdamW(model.parameters(), **w.OPTIM_KW)
    norms = []
    for x, y in w.make_batches(3):
        w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM,
                                                          norm_type)))
        opt.step()
        opt.zero_grad()
    return norms, w.flat_params(model)


def case_no_gradient_warned(rank, world_size, sharding):
    """train_ddp's loop (two micro-batches, the second without the first layer's
    gradient on rank 1), then the first layer frozen after the second step: the
    warnings of each step (a param used in one micro-batch has its gradient; a frozen
    one, on no rank, is stepped with zeros all the same)."""
    import precis.optim
    model = w.make_model()
    ddp = precis.ddp.DistributedDataParallel(model, sharding=sharding)
    opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW))
    per_rank = w.GLOBAL_BATCH // world_size
    out = []
    for step, (x, y) in enumerate(w.make_batches(4)):
        if step == 2:
            model[0].requires_grad_(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, 2)):
                with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                    if i == 1 and rank == 1:  # (the first layer's output, detached)
                        h = model[1](model[0](xm).detach())
                        loss = ((model[2:](h).float() - ym) ** 2).sum() / per_rank
                    else:
                        loss = w.loss_fn(ddp, xm, ym, per_rank)
                    loss.backward()
            opt.step()
            opt.zero_grad()
        out.append([str(c.message) for c in caught if "no gradient" in str(c.message)])
    return out


def case_reentrant(rank, world_size, sharding, segments):
    """Two steps of two micro-batches (no_sync() the first) through the model and a last
    layer of its own, some in checkpoint(use_reentrant=True) segments, whose gradients
    come in nested backwards, and the same with use_reentrant=False: the params after
    each run, or the error. segments: "last_layers" (one segment of the last layers),
    "every_layer" (two segments), "every_layer_one_unused" (two, the extra layer used in
    the second micro-batch only)."""
    from torch.utils.checkpoint import checkpoint
    import precis.optim
    out = []
    for reentrant in (True, False):
        torch.manual_seed(5)
        extra = torch.nn.Linear(w.OUT, w.OUT)
        model = torch.nn.Sequential(w.make_model(), extra)
        inner = model[0]
        ddp = precis.ddp.DistributedDataParallel(model, sharding=sharding, bucket_size=50)
        opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW))
        per_rank = w.GLOBAL_BATCH // world_size

        def forward(x, i):
            if segments == "last_layers":
                return checkpoint(model[0][2:], inner[1](inner[0](x)),
                                  use_reentrant=reentrant) + extra(x[:, :w.OUT])
            h = checkpoint(inner[:2], x.requires_grad_(), use_reentrant=reentrant)
            h = checkpoint(inner[2:], h, use_reentrant=reentrant)
            if segments == "every_layer_one_unused" and i == 0:
                return h
            return checkpoint(extra, h, use_reentrant=reentrant)
        try:
            for x, y in w.make_batches(2):
                for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, 2)):
                    with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                        (((forward(xm, i).float() - ym) ** 2).sum() / per_rank).backward()
                opt.step()
                opt.zero_grad()
        except RuntimeError as e:
            out.append(str(e))
            continue
        ddp.gather_params()
        out.append(w.flat_params(model))
    return out


def case_pickled(rank, world_size, sharding):
    """A step, then torch.save / torch.load of a param and of the wrapped module (an
    EMA copy, a debugging dump): the copies' values and their owner (none), and a step
    of the live wrapper after it, as one without the save."""
    import io
    import precis.optim
    from precis.ddp._module import owner
    out = []
    for save in (False, True):
        model = w.make_model()
        ddp = precis.ddp.DistributedDataParallel(model, sharding=sharding)
        opt = precis.ddp.attach_optimizer(precis.optim.AdamW(ddp.parameters(), **w.OPTIM_KW))
        per_rank = w.GLOBAL_BATCH // world_size
        for step, (x, y) in enumerate(w.make_batches(2)):
            for xm, ym in w.local_micro_batches(x, y, rank, world_size, 1):
                w.loss_fn(ddp, xm, ym, per_rank).backward()
            opt.step()
            opt.zero_grad()
            if save and step == 0:
                ddp.gather_params()
                buf = io.BytesIO()
                torch.save({"param": model[0].weight, "module": model}, buf)
                buf.seek(0)
                back = torch.load(buf, weights_only=False)
                out.append((torch.equal(back["param"], model[0].weight),
                            torch.equal(back["module"][0].weight, model[0].weight),
                            owner(back["param"]), owner(back["module"][0].weight),
                            owner(model[0].weight) is ddp))
        ddp.gather_params()
        out.append(w.flat_params(model))
    return out


CASES = {
    **{("pickled", s): (case_pickled, (s,)) for s in ("no_shard", "optim", "optim_grads")},
    **{("reentrant", s, segments): (case_reentrant, (s, segments))
       for s in ("no_shard", "optim", "optim_grads")
       for segments in ("last_layers", "every_layer", "every_layer_one_unused")},
    **{("collectives", s, c): (case_collectives, (s, c))
       for s in ("no_shard", "optim", "optim_grads") for c in ("bf16", "fp16", "fp32")},
    **{("dtypes", n, s): (case_dtypes_and_memory, (n, s))
       for n in DTYPE_CASES for s in ("no_shard", "optim", "optim_grads")},
    ("broadcast",): (case_broadcast, ()),
    **{("checkpoint", s, str(d)): (case_checkpoint, (s, d))
       for s in ("no_shard", "optim", "optim_grads") for d in (torch.float32, torch.bfloat16)},
    ("hook", "same"): (case_comm_hook, (None,)),
    ("hook", "bf16"): (case_comm_hook, ({"grad_comm_dtype": "bf16"},)),
    ("hook", "fp16"): (case_comm_hook, ({"grad_comm_dtype": "fp16"},)),
    ("errors",): (case_errors, ()),
    ("overlap", True): (case_overlap, (True,)),
    ("overlap", False): (case_overlap, (False,)),
    **{("subgroup", s): (case_subgroup, (s,)) for s in ("no_shard", "optim", "optim_grads")},
    **{("grad_scale", s): (case_grad_scale_skip, (s,)) for s in ("optim", "optim_grads")},
    **{("in_place", s): (case_in_place_paths, (s,)) for s in ("optim", "optim_grads")},
    **{("clip", s, n, b): (case_clip_grad_norm, (s, n, b))
       for s in ("no_shard", "optim", "optim_grads") for n in (2.0, float("inf"))
       for b in (False, True)},
    **{("no_gradient", s): (case_no_gradient_warned, (s,))
       for s in ("no_shard", "optim", "optim_grads")},
}


def result(key):
    """The case's result on both ranks (all cases run in one pair of processes)."""
    return w.case_result(CASES, 2, key)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
@pytest.mark.parametrize("name", list(DTYPE_CASES))
def test_buffer_dtypes_follow_the_policy(name, strategy):
    dtype, _, want, comm = DTYPE_CASES[name]
    for r in result(("dtypes", name, strategy)):
        assert r["buffer_dtypes"] == [(dtype, want, comm)]
        assert r["grads_freed"]  # param.grad is freed once added into main_grad
        if strategy == "optim_grads":
            # Only the reduced shard persists; main_grad is gone after backward.
            assert r["main_grads"] == [None] * len(r["main_grads"])
        else:
            assert set(r["main_grads"]) == {want}
        assert set(r["piece_grads"]) == {want}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
@pytest.mark.parametrize("name", list(DTYPE_CASES))
def test_memory_matches_the_policy(name, strategy):
    dtype, _, want_grad, _ = DTYPE_CASES[name]
    by_rank = result(("dtypes", name, strategy))
    grad_size = torch.tensor([], dtype=want_grad).element_size()
    param_size = torch.tensor([], dtype=dtype).element_size()
    for r in by_rank:
        pol, rep, buf = r["policy_bytes"], r["report"], r["buffers"]
        padded = buf["numel"]
        assert w.NUMEL <= padded < w.NUMEL + 2 * 2  # at most world - 1 per bucket (2 buckets)
        if strategy == "no_shard":
            assert padded == w.NUMEL
            assert buf == {"grad": w.NUMEL * grad_size, "grad_shard": 0, "param": 0,
                           "numel": w.NUMEL}
        elif strategy == "optim":
            assert buf == {"grad": padded * grad_size, "grad_shard": 0,
                           "param": padded * param_size, "numel": padded}
        else:  # no full-size gradient buffer at all
            assert buf == {"grad": 0, "grad_shard": padded // 2 * grad_size,
                           "param": padded * param_size, "numel": padded}
        # Per element the optimizer steps, the bytes the policy promises.
        for key, pkey in (("param", "param"), ("grad", "main_grad"), ("master", "master"),
                          ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert rep[key] == pytest.approx(pol[pkey]), (key, rep, pol)
        assert rep["total"] == pytest.approx(pol["total"])
    # Sharded: each element's optimizer state lives on exactly one rank.
    stepped = [r["report"]["numel"] for r in by_rank]
    assert sum(stepped) == (2 * w.NUMEL if strategy == "no_shard" else w.NUMEL), stepped


def test_params_and_buffers_broadcast_from_rank_0():
    r0, r1 = result(("broadcast",))
    assert not torch.equal(r0["before"], r1["before"])
    assert torch.equal(r0["after"], r0["before"]) and torch.equal(r1["after"], r0["before"])
    assert torch.equal(r0["buffer"], r1["buffer"])


def _by_kind(calls):
    out = {}
    for kind, dtype, numel, aliased in calls:
        entry = out.setdefault(kind, {"dtypes": set(), "numel": 0, "aliased": set()})
        entry["dtypes"].add(dtype)
        entry["numel"] += numel
        entry["aliased"].add(aliased)
    return out


@pytest.mark.parametrize("comm", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_collectives_are_the_backends_own(strategy, comm):
    """gloo (torch 2.13) all-reduces and reduce-scatters bf16 and fp16 and all-gathers
    into one tensor: every gradient goes once, in the comm dtype, nothing in fp32
    behind its back; the bytes counted are the bytes handed over."""
    wire = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[comm]
    size = torch.tensor([], dtype=wire).element_size()
    steps = 2
    for r in result(("collectives", strategy, comm)):
        assert not any("deprecated" in m for m in r["warnings"]), r["warnings"]
        # Construction: the params (rank 0's), as raw bytes.
        assert _by_kind(r["construction"]) == {
            "broadcast": {"dtypes": {"torch.uint8"}, "numel": w.NUMEL * 4, "aliased": {False}}}
        assert r["bytes"]["broadcast"] == w.NUMEL * 4
        kinds = _by_kind(r["steps"])
        padded = r["numel"]
        if strategy == "no_shard":
            assert padded == w.NUMEL
            assert kinds == {"all_reduce": {"dtypes": {str(wire)}, "numel": steps * w.NUMEL,
                                            "aliased": {False}}}, kinds
            assert r["bytes"]["all_reduce"] == steps * w.NUMEL * size
            assert r["bytes"]["reduce_scatter"] == r["bytes"]["all_gather"] == 0
        else:
            # optim_grads reduce-scatters each of the 2 micro-batches of a step; gloo
            # gets separate output memory (the in-place calls are NCCL's).
            scattered = steps * padded * (2 if strategy == "optim_grads" else 1)
            assert kinds == {
                "reduce_scatter": {"dtypes": {str(wire)}, "numel": scattered,
                                   "aliased": {False}},
                "all_gather": {"dtypes": {"torch.float32"}, "numel": steps * padded // 2,
                               "aliased": {False}}}, kinds
            assert r["bytes"]["reduce_scatter"] == scattered * size
            assert r["bytes"]["all_gather"] == steps * padded // 2 * 4
            assert r["bytes"]["all_reduce"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_checkpoint_resumes_bit_for_bit(strategy, dtype):
    by_rank = result(("checkpoint", strategy, str(dtype)))
    names = dict(w.make_model().named_parameters())
    for rank, r in enumerate(by_rank):
        assert torch.equal(r["resumed"], r["straight"])
        for name, start, stop in r["pieces"]:
            assert name in names and 0 <= start < stop <= names[name].numel()
        meta = r["meta"]
        if strategy == "no_shard":
            assert meta is None  # the plain state dict (it loaded without DDP)
            continue
        assert meta["format"] == 1 and meta["world_size"] == 2 and meta["rank"] == rank
        assert meta["sharding"] == [strategy] and meta["pieces"] == r["pieces"]
        assert "rank" in r["errors"]["rank"] and "world_size" in r["errors"]["world_size"]
        name, start, stop = r["pieces"][0]  # the first piece differs: it is named
        assert f"piece 0 is {[name, start, stop - 1]} saved, {[name, start, stop]} here" in \
            r["errors"]["pieces"], r["errors"]["pieces"]
        assert "precis_ddp" in r["errors"]["missing"]
        for module in ("precis.adamw", "torch.optim.adamw"):  # (nothing loaded: no state)
            text, state = r["errors"][f"into_no_shard_{module}"]
            assert f"sharding {[strategy]!r}" in text and "steps whole params" in text, text
            assert state == 0
    if strategy != "no_shard":  # the state is split between the ranks
        assert sum(r["state_numel"] for r in by_rank) == w.NUMEL


def test_comm_hook_for_torch_ddp():
    x, y = w.make_batches(1)[0]
    model = w.make_model()
    w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for key, tol in (("same", 1e-6), ("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7)):
        r0, r1 = result(("hook", key))
        for name, g in r0.items():
            assert g.dtype == torch.float32  # written back in the bucket's own dtype
            assert torch.equal(g, r1[name])
            err = ((g - want[name]).abs().max() / want[name].abs().max()).item()
            assert err < tol, (key, name, err)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_process_group_other_than_the_world(strategy):
    r0, r1 = result(("subgroup", strategy))
    assert torch.equal(r0, r1)
    assert (r0 - w.train_reference(3)).abs().max().item() < 1e-6


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_in_place_collectives_of_nccl(strategy):
    r0, r1 = result(("in_place", strategy))
    assert torch.equal(r0["params"], r1["params"])
    kinds = _by_kind(r0["calls"])
    assert kinds["reduce_scatter"]["aliased"] == {True}, kinds
    assert kinds["all_gather"]["aliased"] == {True}, kinds
    assert r0["bytes"]["reduce_scatter"] > 0 and r0["bytes"]["all_gather"] > 0
    assert (r0["params"] - w.train_reference(3)).abs().max().item() < 1e-6


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_sharded_ranks_agree_to_skip_a_step(strategy):
    for r in result(("grad_scale", strategy)):
        assert r == {"skipped": True, "unchanged": True}


def test_reduction_overlaps_backward():
    for r in result(("overlap", True)):
        assert 0 < r["mid"] < r["end"], r  # some buckets went before backward ended
    for r in result(("overlap", False)):
        assert r["mid"] == 0 < r["end"], r  # all at the end of backward
    for r in result(("overlap", True)) + result(("overlap", False)):
        assert r["nonzero"] > 0 and r["cleared"]  # zero_grad_buffer() clears main_grad


def test_argument_errors():
    errors = result(("errors",))[0]
    assert "zero3" in errors["sharding"] and "optim_grads" in errors["sharding"]
    assert "bucket_size" in errors["bucket_size"]
    assert "bfloat16" in errors["policy"]
    assert "main_grads_dtype" in errors["bad_override"]
    assert "already belongs" in errors["twice"]
    for flag in ("overlap_grad_reduce", "check_for_nan_in_grad"):
        assert f"{flag} must be True or False, got str 'no'" in errors[flag], errors[flag]
    assert "process_group must be None (the world) or a torch.distributed ProcessGroup, " \
           "got str" in errors["process_group"]
    for rank_errors in result(("errors",)):
        assert "exp_avg_dtype" in rank_errors["policy_first"] and rank_errors["kept"]


def test_needs_an_initialized_process_group():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        precis.ddp.DistributedDataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize("release", (False, True))
def test_training_script_under_torchrun(tmp_path, release):
    assert os.path.isfile(EXAMPLE), f"{EXAMPLE} is missing (examples/ddp_train.py)"
    env = w.child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={w.free_port()}",
           "--log_dir", str(tmp_path / "logs"), EXAMPLE, "--sharding", "optim",
           "--dtype", "bf16", "--steps", "4", "--width", "16"] + ["--release"] * release
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "ddp_train: OK (2 processes, sharding=optim" in proc.stdout, proc.stdout[-4000:]
    assert f"release={release}" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_clip_grad_norm_clips_the_reduced_gradients(strategy, norm_type, bf16):
    """ddp.clip_grad_norm_ gives the norm torch's clip_grad_norm_ finds in one process
    over the whole batch (the same on both ranks), leaves gradients of norm max_norm
    (a second call reads it), and after 3 clipped steps the one-process params (fp32:
    within 1e-6, the sums' order; bf16: the bf16 gradient buffers' and params'
    roundings); torch's own on the wrapper's params finds no gradient (they are in
    main_grad) and returns 0."""
    norms_ref, ref = clipped_reference(norm_type, bf16)
    assert min(norms_ref) > 10 * CLIP_MAX_NORM  # (every step clips)
    rtol, atol = (2.0 ** -6, 2e-3) if bf16 else (1e-5, 1e-6)
    ranks = w.case_result(CASES, 2, ("clip", strategy, norm_type, bf16))
    for norms, after, torch_norms, params in ranks:
        assert torch_norms == [0.0] * 3
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(norms_ref), rtol=rtol,
                                   atol=0.0)
        torch.testing.assert_close(torch.tensor(after), torch.tensor([CLIP_MAX_NORM] * 3),
                                   rtol=rtol, atol=0.0)
        torch.testing.assert_close(params, ref, rtol=rtol, atol=atol)
    assert ranks[0][:2] == ranks[1][:2]


def test_clip_grad_norm_refuses_a_norm_type_it_cannot_agree_on():
    ddp = precis.ddp.DistributedDataParallel.__new__(precis.ddp.DistributedDataParallel)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="norm_type must be a number > 0 or inf"):
            ddp.clip_grad_norm_(1.0, bad)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_params_without_a_gradient_are_warned_of(strategy):
    """A param frozen after wrapping gets no gradient on any rank but is stepped all the
    same (with zeros): each rank warns, naming it, at every step; a param whose gradient
    came in one micro-batch of the step only warns of nothing."""
    for rank, steps in enumerate(w.case_result(CASES, 2, ("no_gradient", strategy))):
        assert steps[:2] == [[], []], rank
        for messages in steps[2:]:
            assert len(messages) == 1, (rank, messages)
            assert messages[0].startswith(f"precis DDP: 2 params got no gradient on rank "
                                          f"{rank} since the last step (0.weight, 0.bias)")


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_params_and_the_module_pickle(strategy):
    """torch.save of a wrapped param or module (they kept a weakref to their wrapper:
    "cannot pickle 'weakref.ReferenceType' object"): the copies hold the values and
    belong to no wrapper; the live wrapper steps on with the bits of a run without it."""
    for rank, (plain_run, copies, saved_run) in enumerate(
            w.case_result(CASES, 2, ("pickled", strategy))):
        assert copies == (True, True, None, None, True), (rank, copies)
        assert torch.equal(saved_run, plain_run), rank


@pytest.mark.parametrize("segments", ["last_layers", "every_layer", "every_layer_one_unused"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_reentrant_checkpointing_trains_as_without(strategy, segments):
    """Gradients that come in the nested backward of a checkpoint(use_reentrant=True)
    segment (the last layers: the backward's first gradients; or every layer, a layer
    unused in a micro-batch too) are reduced when the outer backward ends: the bits of
    use_reentrant=False (the nested backward's end synced the step, then the outer
    one's gradients raised "arrived after this step's gradients were synchronized")."""
    for rank, (reentrant, plain) in enumerate(
            w.case_result(CASES, 2, ("reentrant", strategy, segments))):
        assert not isinstance(reentrant, str), (rank, reentrant)
        assert torch.equal(reentrant, plain), rank
