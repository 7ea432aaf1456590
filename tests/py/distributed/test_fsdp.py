"""precis.optim on params sharded by torch's FSDP2 (fully_shard, DTensor params), through
precis.fsdp.fully_shard and through torch's plain fully_shard, on 1, 2 and 3 CPU
processes (gloo), against one process training on the concatenated batch.

The model (5 -> 9 -> 2 -> 3) has a layer of 2 rows: at world 3 one rank's shard of it
is empty, and every other layer is split unevenly.

Tolerances (3 steps of 2 micro-batches, lr 1e-2):
  fp32 everywhere: 1e-6 (only the summation order of the reduction differs).
  bf16 compute: the gradients are rounded to bf16 at other points than in the
    one-process run (per micro-batch and in the bf16 reduce-scatter); each is off by
    <= 2^-8 relative, and Adam's update moves by at most about 2^-6 of lr per step
    for that: 3 * lr * 2^-6 = 4.7e-4 on the fp32 masters; bf16 params (remainders,
    plain bf16 model) may then round the other way: + 2 bf16 ulps.
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import ddp_worker as w
import precis
import precis.checkpoint
import precis.fsdp
import precis.optim

STEPS = 3
MICRO = 2
LR = w.OPTIM_KW["lr"]
BF16_ROUNDED = STEPS * LR * 2.0 ** -6
BF16, FP32 = torch.bfloat16, torch.float32
CLIP = 0.05  # below the gradient norms of these steps: clipping scales every step
EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples",
                       "fsdp_train.py")


def make_model(dtype=FP32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(w.IN, 9), nn.Tanh(), nn.Linear(9, 2), nn.Tanh(),
                         nn.Linear(2, w.OUT)).to(dtype)


NUMEL = sum(p.numel() for p in make_model().parameters())  # 5*9+9 + 9*2+2 + 2*3+3 = 83


def dcp_save(model, opt, where):
    """The model and optimizer saved with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)


def dcp_load(model, opt, where):
    """dcp_save's checkpoint loaded into model and opt (at any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def full_params(model):
    """The full params (collective: every rank gets them)."""
    return flat(p.full_tensor() for p in model.parameters())


def reference(steps, dtype=FP32, policy=None, clip=None):
    """One process, whole batch: (params, fp32 masters, grad norms of each step)."""
    model = make_model(dtype)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, **w.OPTIM_KW)
    norms = []
    for x, y in w.make_batches(steps):
        w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    return flat(params), flat(opt.master_weight(p) for p in params), norms


def shard(model, world_size, how, policy):
    """Shard with precis.fsdp ("helper"; "hsdp": on a 2 x world/2 mesh),
    precis.ddp.data_parallel ("ddp") or torch's own fully_shard ("plain"; "plain_hsdp")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    hsdp = how.endswith("hsdp")
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")) \
        if hsdp else init_device_mesh("cpu", (world_size,))
    if how in ("helper", "hsdp"):
        return precis.fsdp.fully_shard(model, policy=policy, units=(nn.Linear,),
                                       mesh=mesh if hsdp else None)
    if how == "ddp":  # precis.ddp's entry point for every strategy
        return precis.ddp.data_parallel(model, "optim_grads_params", policy=policy,
                                        units=(nn.Linear,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_steps(model, opt, rank, world_size, batches, chunks=None, clip=None, hold=False):
    """The usual loop: MICRO micro-batches per step (with hold: the reduction held back
    for all but the last), optional clipping, step, zero_grad. Returns the grad norms."""
    chunks = model if chunks is None else chunks
    per_rank = w.GLOBAL_BATCH // world_size
    norms = []
    for x, y in batches:
        for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, MICRO)):
            held = hold and i < MICRO - 1
            with precis.fsdp.no_sync(chunks) if held else contextlib.nullcontext():
                w.loss_fn(model, xm, ym, per_rank).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
    return norms


# ---------------------------------------------------------------------------
# Cases (run in the child processes)
# ---------------------------------------------------------------------------

# name -> (model dtype, policy, "helper" | "plain", clip, hold back reductions)
TRAIN = {
    "fp32_helper": (FP32, None, "helper", None, False),
    "fp32_plain": (FP32, None, "plain", None, False),
    "fp32_no_sync": (FP32, None, "helper", None, True),
    "fp32_clip": (FP32, None, "helper", CLIP, False),
    "bf16_masters": (BF16, None, "helper", None, False),
    "bf16_remainders": (BF16, {"store_param_remainders": True}, "helper", None, False),
    "bf16_remainders8": (BF16, {"store_param_remainders": True, "param_remainder_bits": 8}, "helper", None,
                         False),
    "bf16_plain": (BF16, None, "plain", None, False),
    "fp32_via_ddp": (FP32, None, "ddp", None, False),
    "bf16_remainders_via_ddp": (BF16, {"store_param_remainders": True}, "ddp", None, False),
}


def case_train(rank, world_size, name, offload=False):
    """(full params, grad norms, dtypes of the sharded params and of the state)."""
    from torch.distributed.tensor import DTensor
    dtype, policy, how, clip, hold = TRAIN[name]
    model = shard(make_model(dtype), world_size, how, policy)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, offload=offload, **w.OPTIM_KW)
    norms = train_steps(model, opt, rank, world_size, w.make_batches(STEPS), clip=clip,
                        hold=hold)
    p = next(iter(model.parameters()))
    state = opt.state[p]
    assert all(isinstance(t, DTensor) for k, t in state.items()
               if isinstance(t, torch.Tensor) and k != "step")  # step: torch's plain tensor
    return full_params(model), norms, p.dtype, {k: t.dtype for k, t in state.items()
                                                if isinstance(t, torch.Tensor) and k != "step"}


# TRAIN cases run again with offload="cpu": clipping, held-back reductions, masters,
# remainders, through precis.fsdp and torch's fully_shard
TRAIN_OFFLOADED = ("fp32_clip", "fp32_no_sync", "bf16_masters", "bf16_remainders",
                   "bf16_plain")


def case_chunks(rank, world_size):
    """Two chunks (as two pipeline stages held by one rank), trained, then gathered."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    base = make_model()
    chunks = precis.fsdp.fully_shard([base[:2], base[2:]])
    model = nn.Sequential(*chunks)  # a container only: the chunks run their own hooks
    opt = precis.optim.AdamW([p for c in chunks for p in c.parameters()], **w.OPTIM_KW)
    train_steps(model, opt, rank, world_size, w.make_batches(STEPS), chunks=chunks)
    gathers = []
    # FSDP2's all-gather: all_gather_single in torch 2.13, all_gather_into_tensor before.
    # The spy must see the gathers of a forward outside gathered() (checked below).
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def spy(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    x = torch.randn(5, w.IN, generator=torch.Generator().manual_seed(7))
    with precis.fsdp.gathered(chunks):
        inside = flat(model.parameters())  # plain full tensors, not DTensors
        dtensors_inside = [isinstance(p, DTensor) for p in model.parameters()]
        setattr(dist, name, spy)
        try:
            with torch.no_grad():
                out = model(x)
                out_again = model(x)  # still unsharded after a forward
        finally:
            setattr(dist, name, real)
    after = [isinstance(p, DTensor) for p in model.parameters()]
    inside_gathers = len(gathers)
    final = full_params(model)
    setattr(dist, name, spy)
    try:
        with torch.no_grad():
            model(x)  # sharded again: gathers
    finally:
        setattr(dist, name, real)
    outside_gathers = len(gathers) - inside_gathers
    return inside, dtensors_inside, after, out, out_again, inside_gathers, outside_gathers, final


MEMORY = {  # name -> (model dtype, policy)
    "fp32": (FP32, None),
    "bf16_masters": (BF16, None),
    "bf16_remainders": (BF16, {"store_param_remainders": True}),
    "bf16_remainders8": (BF16, {"store_param_remainders": True, "param_remainder_bits": 8}),
}


def case_memory(rank, world_size, name):
    """This rank's memory_report() after one step, and its share of the elements."""
    dtype, policy = MEMORY[name]
    model = shard(make_model(dtype), world_size, "helper", policy)
    opt = precis.optim.AdamW(model.parameters(), **w.OPTIM_KW)
    x, y = w.make_batches(1)[0]
    w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
    opt.step()
    local = sum(p.to_local().numel() for p in model.parameters())
    return opt.memory_report(), local


def case_nonfinite(rank, world_size, offload=False):
    """A NaN in the last rank's shard only: check_finite_grads names it on every rank,
    and step(grad_scale=...) is skipped on every rank."""
    import torch.distributed as dist
    model = shard(make_model(), world_size, "helper", None)
    opt = precis.optim.AdamW(model.parameters(), offload=offload, **w.OPTIM_KW)
    x, y = w.make_batches(1)[0]
    w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
    bad = model[2].weight
    if rank == world_size - 1 and bad.grad.to_local().numel() == 0:
        bad = model[0].weight  # the last rank's shard of model[2].weight is empty
    if rank == world_size - 1:
        bad.grad.to_local().view(-1)[0] = float("nan")
    message = None
    try:
        precis.fsdp.check_finite_grads(model)
    except RuntimeError as e:
        message = str(e)
    before = full_params(model)
    opt.step(grad_scale=4.0)
    skipped = opt.last_step_skipped
    unchanged = torch.equal(full_params(model), before)
    steps = [int(s["step"]) for s in opt.state.values()]
    # A clean step afterwards still agrees (nothing is left set).
    opt.zero_grad()
    w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
    opt.step(grad_scale=4.0)
    flags = torch.tensor([float(opt.last_step_skipped)])
    dist.all_reduce(flags)
    return message, skipped, unchanged, steps, float(flags)


def case_row_cut_refused(rank, world_size):
    """fp8 moments for a param sharded along dim 1 (tensor parallel's Shard(1)): its
    blocks along the rows would be cut. Refused when the optimizer is made."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    param = nn.Parameter(distribute_tensor(torch.zeros(4, 256), mesh, [Shard(1)]))
    try:
        precis.optim.AdamW([param], policy={"exp_avg_dtype": "fp8"})
    except ValueError as e:
        return {"message": str(e)}  # not a bare str: case_result reads that as a failure
    return {"message": None}


# Policies whose steps round stochastically (bf16 v; a bf16 param with no master),
# stepped with the same full gradients at every world size.
SAME_GRADS = {
    "bf16_default": None,
    "bf16_remainders": {"store_param_remainders": True},
    "bf16_no_master": {"main_params_dtype": "bf16"},
    # block-scaled moments: blocks along rows; params whose rows are not whole blocks
    # (the biases, the 41- and 97-wide weights) keep bf16 moments when sharded
    "fp8_remainders": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                       "store_param_remainders": True},
    "fp8_remainders8": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                        "store_param_remainders": True, "param_remainder_bits": 8},
    "fp16_moments": {"exp_avg_dtype": "fp16", "exp_avg_sq_dtype": "fp16"},
}
SCALED = ("fp8_remainders", "fp8_remainders8", "fp16_moments")
SAME_GRADS_STEPS = 12


def same_grads_model():
    """Odd-sized layers (97 and 7 rows: uneven shards at worlds 2 and 3; one rank's
    shard of the 7-row layer is short at world 3), bf16; the last weight's rows are
    two 128-element blocks (fp16 / fp8 moments keep their scales when sharded)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(41, 97), nn.Linear(97, 256), nn.Linear(256, 7)).to(BF16)


def muon_model():
    """Matrices only (Muon's params), bf16: (127, 33) tall, (33, 127) wide, (7, 256) and
    (2, 128), whose rows are whole 128-element blocks (fp8 momentum keeps its scales
    when sharded); 127 and 7 rows are uneven at worlds 2 and 3, and at world 3 one
    rank's shard of the 2-row one is empty. Never run forward: the steps set the
    gradients."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(33, 127, bias=False), nn.Linear(127, 33, bias=False),
                         nn.Linear(256, 7, bias=False), nn.Linear(128, 2, bias=False)).to(BF16)


def model_for(optimizer):
    """The same-gradients model of an optimizer (a name of ddp_worker.OPTIMIZERS)."""
    return muon_model() if optimizer in w.WHOLE_MATRIX + w.DION_MATRIX else same_grads_model()


def set_same_grads(model, step, scale=1.0):
    """Step `step`'s gradients (times scale): the same full tensors (seeded by step and
    param) whatever the model is sharded as."""
    from torch.distributed.tensor import distribute_tensor
    for i, p in enumerate(model.parameters()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        g = (g * 0.1).to(BF16).to(p.dtype) * scale  # (precis.fsdp's sharded masters: fp32)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) \
            if hasattr(p, "device_mesh") else g


def same_grads_steps(model, opt, steps, first=0):
    """Steps first .. first+steps-1 with set_same_grads' gradients."""
    for step in range(first, first + steps):
        set_same_grads(model, step)
        opt.step()


def same_grads_run(policy, world_size=None, steps=SAME_GRADS_STEPS, how="plain",
                   optimizer="adamw"):
    """`steps` steps of same_grads_steps on shards of torch's fully_shard (world_size, how
    as shard() takes it) or on the whole model (None); same_grads_results of it.
    optimizer: a name of ddp_worker.OPTIMIZERS."""
    model = model_for(optimizer)
    if world_size is not None:
        model = shard(model, world_size, how, policy)
    opt = w.make_optimizer(optimizer, model.parameters(), policy=policy)
    same_grads_steps(model, opt, steps)
    return same_grads_results(model, opt, world_size is not None)


def same_grads_results(model, opt, sharded):
    """Per param, as full tensors: the params, their state tensors by key, their
    decoded_state() and the moments and masters of checkpoint.to_torch_state_dict
    (none with dion's conventions, which torch.optim.Muon lacks, nor NorMuon's, which
    torch has no optimizer for: it refuses them)."""
    full = gathered if sharded else (lambda t: t)
    params = [full(p.detach()).clone() for p in model.parameters()]
    states = [{k: full(t).clone() for k, t in opt.state[p].items()
               if isinstance(t, torch.Tensor) and k != "step"} for p in model.parameters()]
    decoded = [{k: full(t) for k, t in opt.decoded_state(p).items() if k != "step"}
               for p in model.parameters()]
    if any(g.get("momentum_form") == "sum" or "beta2" in g for g in opt.param_groups):
        return params, states, decoded, [{} for _ in params], {}
    torch_sd, masters = precis.checkpoint.to_torch_state_dict(opt.state_dict(),
                                                              list(model.parameters()))
    as_torch = [{k: full(t) for k, t in torch_sd["state"][i].items() if k != "step"}
                for i in range(len(params))]
    masters = {i: full(t) for i, t in masters.items()}
    return params, states, decoded, as_torch, masters


def gathered(t):
    """A DTensor's full tensor; int16 (remainders) travels as bf16, which gloo gathers."""
    from torch.distributed.tensor import DTensor
    if t.dtype != torch.int16:
        return t.full_tensor()
    as_bf16 = DTensor.from_local(t.to_local().view(BF16), t.device_mesh, t.placements,
                                 run_check=False, shape=t.shape, stride=t.stride())
    return as_bf16.full_tensor().view(torch.int16)


def case_same_grads(rank, world_size, name, how="plain"):
    return same_grads_run(SAME_GRADS[name], world_size, how=how)


def case_hsdp_train(rank, world_size, name, how="hsdp"):
    """TRAIN's case `name` through precis.fsdp on a 2 x 2 mesh (HSDP; how="helper":
    on the 1-D mesh of the 4 ranks)."""
    dtype, policy, *_ = TRAIN[name]
    model = shard(make_model(dtype), world_size, how, policy)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, **w.OPTIM_KW)
    train_steps(model, opt, rank, world_size, w.make_batches(STEPS))
    placements = {tuple(map(str, p.placements)) for p in model.parameters()}
    return full_params(model), placements


# 4 ranks: FSDP2 on 4 shards, and HSDP on a 2 x 2 mesh (replicate, shard)
HSDP_TRAIN = ("fp32_helper", "bf16_masters", "bf16_remainders")
HSDP_CASES = {
    **{f"same_grads_{name}": (case_same_grads, (name, "plain_hsdp")) for name in SAME_GRADS},
    **{f"same_grads_4_{name}": (case_same_grads, (name,)) for name in SAME_GRADS},
    **{f"train_{name}{suffix}": (case_hsdp_train, (name, how)) for name in HSDP_TRAIN
       for suffix, how in (("", "hsdp"), ("_fsdp", "helper"))},
}


OFFLOADED = ("bf16_default", "fp8_remainders", "fp16_moments")
FRACTIONS = (1.0, 0.5)


def case_offloaded(rank, world_size, name, fraction):
    """same_grads_run's steps with offload="cpu": each rank's shards (of the params
    within the fraction) stepped as host copies of them, separate tensors."""
    policy = SAME_GRADS[name]
    model = shard(same_grads_model(), world_size, "plain", policy)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, offload="cpu",
                             offload_fraction=fraction, **w.OPTIM_KW)
    same_grads_steps(model, opt, SAME_GRADS_STEPS)
    params = list(model.parameters())
    hosts = [opt._books.offload._host.get(p) for p in params]
    numel = sum(p.numel() for p, h in zip(params, hosts) if h is not None)
    assert 0 < numel <= fraction * sum(p.numel() for p in params), (numel, fraction)
    for p, h in zip(params, hosts):
        if h is not None:  # a copy of the local shard, not the shard itself
            local = p.to_local()
            assert h.shape == local.shape and h.data_ptr() != local.data_ptr()
            assert torch.equal(h, local)  # written back after each step
    return same_grads_results(model, opt, True)


def case_scaled_loads(rank, world_size, whole_sd):
    """fp8 moments + remainders: a bad state dict is refused with the optimizer left as
    it was; then the one-process state dict whole_sd (flat block scales) loads into the
    shards. Returns (refusals, unchanged, decoded state after the load, per param)."""
    policy = SAME_GRADS["fp8_remainders"]
    model = shard(same_grads_model(), world_size, "plain", policy)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, **w.OPTIM_KW)
    same_grads_steps(model, opt, 2)
    before = same_grads_results(model, opt, True)
    refusals = []
    fitting = 4  # the 256-wide weight: its fp8 moments keep block scales when sharded
    for key, bad in (("exp_avg_scale", torch.ones(7, 3)), ("exp_avg_scale", torch.ones(21)),
                     ("fp8_v_code", 7)):
        sd = opt.state_dict()
        sd["state"][fitting] = dict(sd["state"][fitting], **{key: bad})
        try:
            opt.load_state_dict(sd)
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    after = same_grads_results(model, opt, True)
    opt.load_state_dict(whole_sd)
    decoded = [{k: gathered(t) for k, t in opt.decoded_state(p).items() if k != "step"}
               for p in model.parameters()]
    kinds = [{k: t.dtype for k, t in opt.state[p].items() if isinstance(t, torch.Tensor)}
             for p in model.parameters()]
    same_grads_steps(model, opt, 1, first=2)  # and it steps
    return refusals, before, after, decoded, kinds


CKPT_AT, CKPT_MORE = 5, 3  # steps before torch.distributed.checkpoint saves, after it loads


def case_same_grads_resharded(rank, world_size, name, path, save, optimizer="adamw"):
    """save: CKPT_AT steps of same_grads_steps, saved with torch.distributed.checkpoint;
    else a model of other weights loads it and takes CKPT_MORE steps more.
    Returns same_grads_results. optimizer: a name of ddp_worker.OPTIMIZERS, whose
    policies are ONE_STATE_POLICIES where it is not AdamW."""
    policy = SAME_GRADS[name] if optimizer == "adamw" else ONE_STATE_POLICIES[name]
    torch.manual_seed(0)
    model = model_for(optimizer)
    if not save:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # weights the load must replace
    model = shard(model, world_size, "plain", policy)
    opt = w.make_optimizer(optimizer, model.parameters(), policy=policy)
    where = os.path.join(path, name if optimizer == "adamw" else f"{optimizer}_{name}")
    if save:
        same_grads_steps(model, opt, CKPT_AT)
        dcp_save(model, opt, where)
    else:
        dcp_load(model, opt, where)
        same_grads_steps(model, opt, CKPT_MORE, first=CKPT_AT)
    return same_grads_results(model, opt, True)


def case_same_grads_through(rank, world_size, name):
    """CKPT_AT + CKPT_MORE steps of same_grads_steps with no checkpoint between."""
    return same_grads_run(SAME_GRADS[name], world_size, CKPT_AT + CKPT_MORE)


# ---- issue #43: HSDP meshes, refused meshes, torch's state dicts of sharded params ----


def case_hsdp_finite_grads(rank, world_size, shape):
    """check_finite_grads on a 2-D (replicate, shard) mesh of `shape`: clean gradients
    pass; an Inf in the last rank's shard is named on every rank. Returns the messages."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = precis.fsdp.fully_shard(make_model(), mesh=mesh, units=(nn.Linear,))
    x, y = w.make_batches(1)[0]
    w.loss_fn(model, x, y, w.GLOBAL_BATCH).backward()
    out = [w.error_text(lambda: precis.fsdp.check_finite_grads(model))]
    if rank == world_size - 1:
        model[2].weight.grad.to_local().view(-1)[0] = float("inf")
    out.append(w.error_text(lambda: precis.fsdp.check_finite_grads(model)))
    return out


def case_refused_meshes_change_nothing(rank, world_size):
    """A bf16 model given an unnamed 2-D mesh (torch's fully_shard asks for names), a
    reshard_after_forward torch refuses, and a ModuleList chunk: each refused with the
    params as they were; then sharded for real (a named mesh), it becomes fp32 masters.
    A failure of torch's after it sharded a module is said to be one (the last message).
    Returns (messages, whether the params stayed, their dtypes after the real shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    model = make_model(BF16)
    before = [p.detach().clone() for p in model.parameters()]
    named = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    tries = [lambda: precis.fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (world_size, 1)),
                                             units=(nn.Linear,)),
             lambda: precis.fsdp.fully_shard(model, units=(nn.Linear,), reshard_after_forward=3),
             lambda: precis.fsdp.fully_shard([model[:2], nn.ModuleList(model[2:])])]
    messages, kept = [], []
    for attempt in tries:
        messages.append(w.error_text(attempt))
        kept.append(all(type(p) is nn.Parameter and p.dtype == BF16 and torch.equal(p, b)
                        for p, b in zip(model.parameters(), before)))
    precis.fsdp.fully_shard(model, mesh=named, units=(nn.Linear,))
    real, calls = precis.fsdp._torch_fully_shard, []

    def fails_second(module, **kwargs):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("torch failed")
        return real(module, **kwargs)

    precis.fsdp._torch_fully_shard = fails_second
    try:
        messages.append(w.error_text(lambda: precis.fsdp.fully_shard([make_model(BF16)[:2],
                                                                      make_model(BF16)])))
    finally:
        precis.fsdp._torch_fully_shard = real
    return messages, kept, [p.dtype for p in model.parameters()]


ROUND_TRIP = {  # name -> policy, for the bf16 same_grads_model
    "default": None,
    "fp16_moments": SAME_GRADS["fp16_moments"],
    "fp8_remainders8": SAME_GRADS["fp8_remainders8"],
}


def case_torch_round_trip(rank, world_size, name, how):
    """precis -> torch -> precis on DTensor params (how: "plain", torch's fully_shard, or
    "helper", precis.fsdp): 2 steps, the state dict through to_torch_state_dict and
    from_torch_state_dict into a fresh optimizer over a twin model holding the same
    shards; then a step of both. Returns same_grads_results of both, before and after,
    and the refusal of the sharded state for plain params."""
    policy = ROUND_TRIP[name]
    models = [shard(same_grads_model(), world_size, how, policy) for _ in range(2)]
    opt = precis.optim.AdamW(models[0].parameters(), policy=policy, **w.OPTIM_KW)
    same_grads_steps(models[0], opt, 2)
    a, b = (list(m.parameters()) for m in models)
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.to_local().copy_(pa.to_local())
    torch_sd, masters = precis.checkpoint.to_torch_state_dict(opt.state_dict(), a)
    twin = precis.optim.AdamW(b, policy=policy, **w.OPTIM_KW)
    twin.load_state_dict(precis.checkpoint.from_torch_state_dict(torch_sd, b, policy, masters))
    out = [same_grads_results(models[0], opt, True), same_grads_results(models[1], twin, True)]
    same_grads_steps(models[0], opt, 1, first=2)
    same_grads_steps(models[1], twin, 1, first=2)
    whole = [nn.Parameter(p.full_tensor()) for p in a]
    refused = w.error_text(lambda: precis.checkpoint.from_torch_state_dict(torch_sd, whole, policy))
    return out + [same_grads_results(models[0], opt, True),
                  same_grads_results(models[1], twin, True), refused]


ISSUE43 = {  # run in one world of 2
    **{f"finite_grads_{r}x{s}": (case_hsdp_finite_grads, ((r, s),)) for r, s in ((2, 1), (1, 2))},
    "refused_meshes": (case_refused_meshes_change_nothing, ()),
    **{f"round_trip_{name}_{how}": (case_torch_round_trip, (name, how)) for name in ROUND_TRIP
       for how in ("plain", "helper")},
}


# SGD and Lion (issue #44), ddp_worker.OPTIMIZERS' arguments: the default policy (bf16
# params, fp32 master, bf16 momentum rounded to nearest) and fp8 momentum (m8 in blocks
# along rows, rounded stochastically: the keys) + 8-bit remainders; for the same-gradients
# runs also bf16 params without a master (written with stochastic rounding). Params
# whose rows are not whole 128-element blocks keep bf16 momentum when sharded, as
# AdamW's moments.
ONE_STATE_POLICIES = {"bf16_default": None, "fp8m_remainders8": w.FP8_MOMENTUM_REM8,
                      "bf16_no_master": {"main_params_dtype": "bf16"}}
ONE_STATE_RUNS = [(opt, name) for opt in w.ONE_STATE for name in ONE_STATE_POLICIES
                  if name != "bf16_no_master"]


def case_one_state_same_grads(rank, world_size, optimizer, name, steps=SAME_GRADS_STEPS,
                              how="plain"):
    return same_grads_run(ONE_STATE_POLICIES[name], world_size, steps, how, optimizer)


def case_one_state_offloaded(rank, world_size, optimizer, name, fraction):
    """case_offloaded's steps for SGD / Lion: each rank's shards of the params within the
    fraction stepped as host copies."""
    policy = ONE_STATE_POLICIES[name]
    model = shard(same_grads_model(), world_size, "plain", policy)
    opt = w.make_optimizer(optimizer, model.parameters(), policy=policy, offload="cpu",
                           offload_fraction=fraction)
    same_grads_steps(model, opt, SAME_GRADS_STEPS)
    hosts = [opt._books.offload._host.get(p) for p in model.parameters()]
    assert any(h is not None for h in hosts) and (fraction == 1.0 or None in hosts)
    return same_grads_results(model, opt, True)


FULL_STATE_DICT = ("bf16_default", "fp8_remainders8", "bf16_remainders")


def case_full_state_dict(rank, world_size, name):
    """A full state dict (get_state_dict(full_state_dict=True)) after 2 steps, loaded as
    the guide says (set_model_state_dict, then set_optimizer_state_dict) into a model of
    other weights, then a step: (its same_grads_results, those of 3 straight steps). 16-bit
    remainders: {"refused": torch's gather's error}, as the guide says."""
    import copy
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict)
    policy, full = SAME_GRADS[name], StateDictOptions(full_state_dict=True)
    model = shard(same_grads_model(), world_size, "plain", policy)
    opt = precis.optim.AdamW(model.parameters(), policy=policy, **w.OPTIM_KW)
    same_grads_steps(model, opt, 2)
    if name == "bf16_remainders":
        return {"refused": w.error_text(lambda: get_state_dict(model, opt, options=full))}
    saved = copy.deepcopy(get_state_dict(model, opt, options=full))  # (not the live state)
    same_grads_steps(model, opt, 1, first=2)
    other = same_grads_model()
    with torch.no_grad():
        for p in other.parameters():
            p.neg_()
    other = shard(other, world_size, "plain", policy)
    resumed = precis.optim.AdamW(other.parameters(), policy=policy, **w.OPTIM_KW)
    set_model_state_dict(other, saved[0], options=full)
    set_optimizer_state_dict(other, resumed, saved[1], options=full)
    same_grads_steps(other, resumed, 1, first=2)
    return (same_grads_results(other, resumed, True), same_grads_results(model, opt, True))


CASES = {
    **{f"full_state_dict_{name}": (case_full_state_dict, (name,)) for name in FULL_STATE_DICT},
    **{f"train_{name}": (case_train, (name,)) for name in TRAIN},
    **{f"train_{name}_offloaded": (case_train, (name, "cpu")) for name in TRAIN_OFFLOADED},
    "nonfinite_offloaded": (case_nonfinite, ("cpu",)),
    **{f"same_grads_{name}": (case_same_grads, (name,)) for name in SAME_GRADS},
    **{f"through_{name}": (case_same_grads_through, (name,)) for name in SCALED},
    **{f"offloaded_{name}_{f}": (case_offloaded, (name, f)) for name in OFFLOADED
       for f in FRACTIONS},
    **{f"memory_{name}": (case_memory, (name,)) for name in MEMORY},
    "chunks": (case_chunks, ()),
    "nonfinite": (case_nonfinite, ()),
    "row_cut_refused": (case_row_cut_refused, ()),
    **{f"same_grads_{opt}_{name}": (case_one_state_same_grads, (opt, name))
       for opt in w.ONE_STATE for name in ONE_STATE_POLICIES},
    **{f"through_{opt}_{name}": (case_one_state_same_grads, (opt, name, CKPT_AT + CKPT_MORE))
       for opt, name in ONE_STATE_RUNS},
    **{f"offloaded_{opt}_{name}_0.5": (case_one_state_offloaded, (opt, name, 0.5))
       for opt, name in ONE_STATE_RUNS},
}
WORLDS = (1, 2, 3)

_references = {}


def cached_reference(dtype, policy, clip=None):
    key = (dtype, repr(policy), clip)
    if key not in _references:
        _references[key] = reference(STEPS, dtype, policy, clip)
    return _references[key]


def bf16_ulp(x):
    mag = x.abs().clamp(min=2.0 ** -126)
    return torch.pow(2.0, torch.floor(torch.log2(mag)) - 7)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", sorted(TRAIN))
def test_training_matches_one_process(world_size, name):
    dtype, policy, how, clip, hold = TRAIN[name]
    results = w.case_result(CASES, world_size, f"train_{name}")
    params, masters, norms = cached_reference(dtype, policy, clip)
    got = results[0][0]
    for r in results[1:]:
        assert torch.equal(r[0], got), "ranks disagree on the full params"
    if dtype == FP32:
        torch.testing.assert_close(got, params, rtol=0, atol=1e-6)
    elif results[0][2] == FP32:  # bf16 model, fp32 sharded params: they are the masters
        torch.testing.assert_close(got, masters, rtol=0, atol=BF16_ROUNDED)
    else:
        diff = (got - params).abs()
        bound = 2 * bf16_ulp(params) + BF16_ROUNDED
        assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())}"
    if clip is not None:
        assert len(results[0][1]) == STEPS
        torch.testing.assert_close(torch.tensor(results[0][1]), torch.tensor(norms),
                                   rtol=1e-6, atol=0)
        assert min(norms) > CLIP  # clipping acted on every step


def assert_same_results(got, want, where, params=None):
    """Two same_grads_results agree bit for bit (params: only those indices)."""
    (got_params, got_states, *got_views), (want_params, want_states, *want_views) = got, want
    keep = range(len(want_params)) if params is None else params
    for k in keep:
        assert torch.equal(got_params[k], want_params[k]), f"{where}: param {k}"
        assert got_states[k].keys() == want_states[k].keys(), f"{where}: param {k}"
        for key, t in want_states[k].items():
            # block scales: (rows, blocks per row) when sharded, a flat list when whole
            assert torch.equal(got_states[k][key].reshape(-1).view(torch.uint8),
                               t.reshape(-1).view(torch.uint8)), f"{where}: {key} of param {k}"
    # decoded_state(), to_torch_state_dict()'s moments: per param, the same values
    (got_decoded, got_torch, got_masters), (want_decoded, want_torch, want_masters) = \
        got_views, want_views
    for what, got_all, want_all in (("decoded", got_decoded, want_decoded),
                                    ("torch", got_torch, want_torch)):
        for k in keep:
            assert got_all[k].keys() == want_all[k].keys(), (where, what, k)
            for key, t in want_all[k].items():
                assert torch.equal(got_all[k][key], t), f"{where}: {what} {key} of param {k}"
    # to_torch_state_dict()'s masters: {param index: fp32 master}
    assert got_masters.keys() == want_masters.keys(), where
    for k in keep:
        if k in want_masters:
            assert torch.equal(got_masters[k], want_masters[k]), f"{where}: master {k}"


@pytest.mark.parametrize("name", sorted(SAME_GRADS))
def test_stochastic_rounding_gives_the_bits_of_the_whole_at_every_world_size(name):
    """The same full gradients: the shards at worlds 1, 2 and 3 end with the same bits,
    state included (each element's random numbers follow its param's stream and its
    index in the whole param, not the shard it is in; fp16 / fp8 blocks lie along rows,
    which Shard(0) never cuts); so do decoded_state() and
    precis.checkpoint.to_torch_state_dict() of the sharded state. They are the bits of
    the unsharded model, except for the params that keep bf16 moments when sharded
    (rows that are not whole 128-element blocks) under a block-scaled policy."""
    whole = same_grads_run(SAME_GRADS[name])
    whole_states = whole[1]
    assert any("exp_avg_sq" in st and st["exp_avg_sq"].dtype != FP32 for st in whole_states)
    like_whole = [k for k, p in enumerate(same_grads_model().parameters())
                  if name not in SCALED or (p.dim() == 2 and p.shape[1] % 128 == 0)]
    first = None
    for world_size in WORLDS:
        for rank, result in enumerate(w.case_result(CASES, world_size, f"same_grads_{name}")):
            where = f"world {world_size}, rank {rank}"
            assert_same_results(result, whole, where, like_whole)
            if first is None:
                first = result
                if name in SCALED:  # the fitting weight is block-scaled, the rest bf16
                    dtypes = [st["exp_avg"].dtype for st in result[1]]
                    assert dtypes[-2] != BF16 and dtypes.count(BF16) == len(dtypes) - 1, dtypes
            assert_same_results(result, first, where)


@pytest.mark.parametrize("name", FULL_STATE_DICT)
def test_a_full_state_dict_loaded_model_first_resumes_bit_for_bit(name):
    """torch's full state dict of FSDP2 shards (every rank gathers every buffer), loaded
    model first into other weights (the guide's order: remainders join the weights they
    were saved with), resumes with the bits of the run it was saved from; 16-bit
    remainders cannot be gathered (gloo and NCCL move no int16), as the guide says."""
    for rank, result in enumerate(w.case_result(CASES, 2, f"full_state_dict_{name}")):
        if name == "bf16_remainders":
            assert "Invalid scalar type" in result["refused"], result
            continue
        got, want = result
        assert_same_results(got, want, f"rank {rank}")


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", OFFLOADED)
def test_offload_under_fsdp2_gives_the_bits_of_the_on_device_step(name, world_size, fraction):
    """offload="cpu" with DTensor params (all of them, or the first half of the
    elements): each rank steps host copies of its shards, with the bits of the step
    on the shards themselves."""
    on_device = w.case_result(CASES, world_size, f"same_grads_{name}")
    offloaded = w.case_result(CASES, world_size, f"offloaded_{name}_{fraction}")
    for rank, (got, want) in enumerate(zip(offloaded, on_device)):
        assert_same_results(got, want, f"world {world_size}, rank {rank}")


@pytest.mark.parametrize("name", sorted(SAME_GRADS))
def test_four_ranks_and_hsdp_state_have_the_bits_of_fsdp_at_world_2(name):
    """The same full gradients on 4 ranks, as FSDP2's 4 shards and as torch's
    fully_shard on a 2 x 2 mesh (replicate, shard: HSDP): every rank ends with the
    bits of FSDP2 at world 2 (which test_stochastic_rounding_... ties to worlds 1 and 3)."""
    fsdp = w.case_result(CASES, 2, f"same_grads_{name}")[0]
    for how, key in (("world 4", f"same_grads_4_{name}"), ("HSDP", f"same_grads_{name}")):
        for rank, result in enumerate(w.case_result(HSDP_CASES, 4, key)):
            assert_same_results(result, fsdp, f"{how} rank {rank}")


@pytest.mark.parametrize("name", HSDP_TRAIN)
def test_hsdp_through_precis_fsdp_trains_as_fsdp(name):
    """precis.fsdp.fully_shard with a 2-D mesh: params placed (Replicate, Shard(0)), and
    the training loop ends where FSDP2 on the same 4 ranks ends (the same gradients,
    summed in another order: fp32 to 1e-6, bf16 the bound of
    test_training_matches_one_process)."""
    want = w.case_result(HSDP_CASES, 4, f"train_{name}_fsdp")[0][0]
    for rank, (got, placements) in enumerate(w.case_result(HSDP_CASES, 4, f"train_{name}")):
        assert placements == {("R", "S(0)")}, placements  # Replicate(), Shard(0)
        if TRAIN[name][0] == FP32:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        else:
            diff = (got - want).abs()
            assert bool((diff <= 2 * bf16_ulp(want) + BF16_ROUNDED).all()), f"rank {rank}"


@pytest.fixture(scope="module")
def resharded_checkpoints(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("same_grads_dcp"))
    for name in SCALED:
        w.run_world(case_same_grads_resharded, 2, name, path, True)
    return path


@pytest.mark.parametrize("name", SCALED)
def test_scaled_state_on_disk_has_a_grid_of_rows(resharded_checkpoints, name):
    """The checkpoint holds the stored moments (fp8: uint8, fp16) and their scales as
    whole tensors: (7, 2) for the 256-wide weight of 7 rows, whatever the world size."""
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(os.path.join(resharded_checkpoints, name)) \
        .read_metadata().state_dict_metadata
    scales = {key: tuple(m.size) for key, m in meta.items() if key.endswith("_scale")}
    assert scales == {f"optim.state.2.weight.{k}_scale": (7, 2)
                      for k in ("exp_avg", "exp_avg_sq")}, scales
    stored = torch.uint8 if name.startswith("fp8") else torch.float16
    assert meta["optim.state.2.weight.exp_avg"].properties.dtype == stored
    if name == "fp8_remainders8":  # the 8-bit corrections, whole
        assert meta["optim.state.2.weight.remainder"].properties.dtype == torch.uint8


@pytest.mark.parametrize("world_size", (1, 3))
@pytest.mark.parametrize("name", SCALED)
def test_scaled_state_resharded_by_dcp_continues_bit_exact(resharded_checkpoints, name,
                                                           world_size):
    """fp16 / fp8 moments (bytes and block scales as DTensors) saved by
    torch.distributed.checkpoint at world 2 and loaded at 1 and 3: the next steps give
    the bits of the run that never stopped."""
    results = w.run_world(case_same_grads_resharded, world_size, name,
                          resharded_checkpoints, False)
    through = w.case_result(CASES, 2, f"through_{name}")[0]
    for rank, result in enumerate(results):
        assert_same_results(result, through, f"{name}: loaded at world {world_size}, rank {rank}")


@pytest.mark.parametrize("world_size", (2,))
def test_sharded_param_and_state_dtypes(world_size):
    """precis.fsdp keeps the masters as the sharded params (fp32) and the moments in
    bf16; with remainders the params stay bf16 and the remainders are int16."""
    masters = w.case_result(CASES, world_size, "train_bf16_masters")[0]
    assert masters[2] == FP32
    assert masters[3] == {"exp_avg": BF16, "exp_avg_sq": BF16}
    rem = w.case_result(CASES, world_size, "train_bf16_remainders")[0]
    assert rem[2] == BF16
    assert rem[3] == {"exp_avg": BF16, "exp_avg_sq": BF16, "remainder": torch.int16}
    rem8 = w.case_result(CASES, world_size, "train_bf16_remainders8")[0]
    assert rem8[2] == BF16
    assert rem8[3] == {"exp_avg": BF16, "exp_avg_sq": BF16, "remainder": torch.uint8}
    plain = w.case_result(CASES, world_size, "train_bf16_plain")[0]
    assert plain[2] == BF16
    assert plain[3] == {"exp_avg": BF16, "exp_avg_sq": BF16, "master": FP32}
    fp32 = w.case_result(CASES, world_size, "train_fp32_helper")[0]
    assert fp32[3] == {"exp_avg": FP32, "exp_avg_sq": FP32}


@pytest.mark.parametrize("world_size", WORLDS)
def test_every_chunk_trains_and_gathers(world_size):
    results = w.case_result(CASES, world_size, "chunks")
    params, _, _ = cached_reference(FP32, None)
    ref = make_model()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(params, ref.parameters())
    x = torch.randn(5, w.IN, generator=torch.Generator().manual_seed(7))
    for inside, dtensors_inside, after, out, out_again, gathers, outside, final in results:
        torch.testing.assert_close(final, params, rtol=0, atol=1e-6)  # both chunks trained
        assert torch.equal(inside, final)  # gathered() gives the params exactly
        assert not any(dtensors_inside) and all(after)
        with torch.no_grad():
            torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
        assert torch.equal(out, out_again)
        assert gathers == 0  # gathered once on entry, nothing in the forwards
        # The spy sees FSDP2's gathers in a forward after the exit (one rank gathers nothing).
        assert outside > 0 or world_size == 1


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_bytes_per_param_fall_with_world(name):
    """Measured from the allocated local shards: summed over ranks they are the policy's
    bytes per param exactly, and each rank holds its share of the elements."""
    dtype, policy = MEMORY[name]
    resolved = precis.resolve_policy(dtype, policy)
    want = precis.fsdp.bytes_per_param(resolved)
    per_rank_total = {}
    for world_size in WORLDS:
        results = w.case_result(CASES, world_size, f"memory_{name}")
        assert sum(local for _, local in results) == NUMEL
        for key, report_key in (("param", "param"), ("grad", "grad"), ("exp_avg", "exp_avg"),
                                ("exp_avg_sq", "exp_avg_sq"), ("remainder", "master")):
            got = sum(report[report_key] for report, _ in results)
            assert got == pytest.approx(want[key], abs=1e-12), (world_size, key)
        for report, local in results:
            assert report["numel"] == NUMEL
            assert report["total"] == pytest.approx(want["total"] * local / NUMEL)
        per_rank_total[world_size] = max(report["total"] for report, _ in results)
    assert per_rank_total[1] == pytest.approx(want["total"])
    # The uneven shards of this small model: within 20% of 1/world.
    for world_size in WORLDS[1:]:
        assert per_rank_total[world_size] <= 1.2 * want["total"] / world_size


def test_policy_bytes_per_param():
    masters = precis.fsdp.bytes_per_param(precis.resolve_policy(BF16))
    assert masters == {"param": 4, "grad": 4, "remainder": 0, "exp_avg": 2, "exp_avg_sq": 2,
                       "total": 12}
    rem = precis.fsdp.bytes_per_param(precis.resolve_policy(BF16, {"store_param_remainders":
                                                                   True}))
    assert rem["total"] == 2 + 2 + 2 + 2 + 2
    rem8 = precis.fsdp.bytes_per_param(precis.resolve_policy(BF16, {"store_param_remainders": True, "param_remainder_bits": 8}))
    assert (rem8["remainder"], rem8["total"]) == (1, 2 + 2 + 1 + 2 + 2)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", sorted(TRAIN_OFFLOADED))
def test_offloaded_training_gives_the_bits_of_the_on_device_one(name, world_size):
    """The usual loop (clip_grad_norm_ on the DTensor grads, no_sync) with offload="cpu":
    the full params, grad norms and dtypes of the run that steps the shards."""
    offloaded = w.case_result(CASES, world_size, f"train_{name}_offloaded")
    on_device = w.case_result(CASES, world_size, f"train_{name}")
    for rank, (got, want) in enumerate(zip(offloaded, on_device)):
        assert torch.equal(got[0], want[0]), f"rank {rank}: params"
        assert got[1:] == want[1:], f"rank {rank}"


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("nonfinite", ("nonfinite", "nonfinite_offloaded"))
def test_nonfinite_gradient_named_and_skipped_on_every_rank(world_size, nonfinite):
    results = w.case_result(CASES, world_size, nonfinite)
    for message, skipped, unchanged, steps, later_skips in results:
        assert message is not None and f"on rank {world_size - 1}" in message, message
        assert "weight" in message
        assert skipped is True and unchanged
        assert all(s == 0 for s in steps)  # lazily created state, nothing stepped
        assert later_skips == 0.0


@pytest.mark.parametrize("world_size", (2,))
def test_scaled_state_dicts_checked_and_one_process_ones_load(world_size):
    """A state dict whose block scales have another grid, or whose fp8 code is unknown,
    is refused naming it, nothing changed; a one-process state dict (flat scales) loads
    into the shards: block-scaled params keep its moments' bits, the others (bf16
    moments when sharded) their values rounded to bf16."""
    policy = SAME_GRADS["fp8_remainders"]
    model = same_grads_model()
    opt = precis.optim.AdamW(model.parameters(), policy=policy, **w.OPTIM_KW)
    same_grads_steps(model, opt, 2)
    whole_sd = opt.state_dict()
    whole = [{k: t for k, t in opt.decoded_state(p).items() if k != "step"}
             for p in model.parameters()]
    for rank, (refusals, before, after, decoded, kinds) in enumerate(
            w.run_world(case_scaled_loads, world_size, whole_sd)):
        where = f"rank {rank}"
        assert "'exp_avg_scale' has shape (7, 3)" in refusals[0], refusals[0]
        assert "'exp_avg_scale' has shape (21,)" in refusals[1], refusals[1]
        assert "'fp8_v_code' is 7" in refusals[2], refusals[2]
        assert_same_results(after, before, where)
        for k, (got, want) in enumerate(zip(decoded, whole)):
            scaled = kinds[k]["exp_avg"] == torch.uint8
            assert scaled == (k == 4), (where, k, kinds[k])
            for key in ("exp_avg", "exp_avg_sq"):  # (the masters join other params)
                want_k = want[key] if scaled else want[key].to(BF16).float()  # to nearest
                assert torch.equal(got[key], want_k), f"{where}: {key} of param {k}"


def test_scaled_moments_refused_where_a_placement_cuts_rows():
    [result] = w.case_result(CASES, 1, "row_cut_refused")
    message = result["message"]
    assert message is not None and "fp16 or fp8 moments" in message, message
    assert "(4, 256)" in message and "Shard(dim=1)" in message, message


@pytest.mark.parametrize("shape", ((2, 1), (1, 2)))
def test_check_finite_grads_on_hsdp_meshes(shape):
    """Clean gradients pass on a 2-D mesh (the reduction covers every rank of it); an
    Inf in rank 1's shard is named, with its param, on every rank."""
    for rank, (clean, bad) in enumerate(w.case_result(ISSUE43, 2, "finite_grads_%dx%d" % shape)):
        assert clean is None, (rank, clean)
        assert bad is not None and "'2.weight' on rank 1" in bad, (rank, bad)
        assert "on rank 0" not in bad, (rank, bad)


def test_meshes_torch_refuses_change_nothing():
    for rank, (messages, kept, dtypes) in enumerate(
            w.case_result(ISSUE43, 2, "refused_meshes")):
        unnamed, torch_refused, container, half_done = messages
        assert unnamed.startswith("ValueError: precis.fsdp.fully_shard"), unnamed
        assert "mesh_dim_names=('replicate', 'shard')" in unnamed and "(2, 1)" in unnamed
        assert torch_refused is not None and "reshard_after_forward" in torch_refused
        assert container is not None and "chunk 1 is a ModuleList" in container, container
        assert kept == [True, True, True], (rank, messages)
        assert "torch failed) after it sharded modules of chunk(s) [0]" in half_done, half_done
        assert dtypes == [FP32] * len(dtypes)  # and sharded for real afterwards: fp32 masters


@pytest.mark.parametrize("how", ("plain", "helper"))
@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_precis_torch_precis_round_trip_of_sharded_params(name, how):
    """precis -> torch.optim's layout (+ masters) -> precis on FSDP2's DTensor params:
    the fresh optimizer holds the state of the one that saved it bit for bit (masters,
    remainders, moments; the fp16 / fp8 ones and their scales re-encoded from their
    values give the same bytes), and the next step of both agrees bit for bit. Given
    plain params, the sharded state is refused, naming the param and key."""
    for rank, (saved, loaded, saved_next, loaded_next, refused) in enumerate(
            w.case_result(ISSUE43, 2, f"round_trip_{name}_{how}")):
        where = f"{name}, {how}, rank {rank}"
        scaled = {st[k].dtype for st in saved[1] for k in ("exp_avg", "exp_avg_sq")} & \
            {torch.float16, torch.uint8}
        assert bool(scaled) == (name != "default"), where  # the 256-wide weight's moments
        assert_same_results(loaded, saved, where)
        assert_same_results(loaded_next, saved_next, f"{where}, after a step")
        assert refused is not None and "state of param 0" in refused, (where, refused)
        assert "'exp_avg' is a DTensor (sharded) but the param is not" in refused, refused


# ---- argument errors: before anything changes, no process group needed ------------


def test_bad_arguments_change_nothing():
    model = make_model(BF16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        precis.fsdp.fully_shard(model, policy={"exp_avg_dtype": "int8"})
    with pytest.raises(ValueError, match="main_grads_dtype"):
        precis.fsdp.fully_shard(model, policy={"store_param_remainders": True,
                                               "main_grads_dtype": "fp32"})
    with pytest.raises(TypeError, match="chunk 1"):
        precis.fsdp.fully_shard([model, "layer"])
    mixed = make_model(BF16)
    mixed[2].float()
    with pytest.raises(ValueError, match="'2.weight' is torch.float32"):
        precis.fsdp.fully_shard(mixed)
    with pytest.raises(RuntimeError, match="init_process_group"):
        precis.fsdp.fully_shard(model)
    with pytest.raises(ValueError, match="no module was sharded"):
        with precis.fsdp.gathered(model):
            pass
    for p, b in zip(model.parameters(), before):
        assert p.dtype == BF16 and torch.equal(p, b)


def test_a_whole_policy_as_a_mapping_is_taken_as_the_policy():
    """fully_shard(policy=p.to_dict()) (a policy from YAML) is fully_shard(policy=p): the
    model's dtype is p's, to which an fp32 model is cast (it was refused as 'for bf16
    params'); its fields are checked whole. No process group: it goes as far as that."""
    p = precis.resolve_policy(BF16, {"store_param_remainders": True})
    for policy in (p, p.to_dict()):
        model = make_model()
        with pytest.raises(RuntimeError, match="init_process_group"):
            precis.fsdp.fully_shard(model, policy=policy)
        assert all(q.dtype == FP32 for q in model.parameters())  # (nothing changed)
    with pytest.raises(ValueError, match="read as a whole policy.*missing exp_avg_dtype"):
        precis.fsdp.fully_shard(make_model(), policy={
            k: v for k, v in p.to_dict().items() if k != "exp_avg_dtype"})


# ---- checkpoints: torch.distributed.checkpoint, resharded --------------------------

CKPT = {  # name -> (model dtype, policy)
    "fp32": (FP32, None),
    "bf16_masters": (BF16, None),
    "bf16_remainders": (BF16, {"store_param_remainders": True}),
    "bf16_remainders8": (BF16, {"store_param_remainders": True, "param_remainder_bits": 8}),
}
# saved from host copies (offload="cpu"); name -> (the CKPT entry, offloaded on load)
CKPT_OFFLOADED = {"bf16_remainders_offloaded": ("bf16_remainders", False),
                  "bf16_masters_offloaded": ("bf16_masters", True)}
CKPT_STEPS, MORE_STEPS = 2, 2


def case_checkpoint(rank, world_size, path, save):
    """save: train CKPT_STEPS and save every policy's model and optimizer; else load
    them and train MORE_STEPS more. Returns the final full params per policy."""
    out = {}
    batches = w.make_batches(CKPT_STEPS + MORE_STEPS)
    for name in (*CKPT, *CKPT_OFFLOADED):
        base, offloaded_on_load = CKPT_OFFLOADED.get(name, (name, False))
        dtype, policy = CKPT[base]
        offload = "cpu" if name in CKPT_OFFLOADED and (save or offloaded_on_load) else False
        model = shard(make_model(dtype, seed=0 if save else 5), world_size, "helper", policy)
        opt = precis.optim.AdamW(model.parameters(), policy=policy, offload=offload,
                                 **w.OPTIM_KW)
        where = os.path.join(path, name)
        if save:
            train_steps(model, opt, rank, world_size, batches[:CKPT_STEPS])
            dcp_save(model, opt, where)
        else:
            dcp_load(model, opt, where)
            train_steps(model, opt, rank, world_size, batches[CKPT_STEPS:])
        out[name] = full_params(model)
    return out


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp_dcp"))
    w.run_world(case_checkpoint, 2, path, True)
    return path


def test_checkpoint_keeps_state_dtypes_on_disk(saved_checkpoint):
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(os.path.join(saved_checkpoint, "bf16_remainders")) \
        .read_metadata().state_dict_metadata
    dtypes = {key.split(".")[-1]: m.properties.dtype for key, m in meta.items()
              if key.startswith("optim.state.") and hasattr(m, "properties")}
    # remainders: torch.optim would misread this state, so its count is in precis_step
    assert dtypes == {"exp_avg": BF16, "exp_avg_sq": BF16, "remainder": torch.int16,
                      "precis_step": FP32}
    meta = dcp.FileSystemReader(os.path.join(saved_checkpoint, "bf16_remainders8")) \
        .read_metadata().state_dict_metadata
    dtypes = {key.split(".")[-1]: m.properties.dtype for key, m in meta.items()
              if key.startswith("optim.state.") and hasattr(m, "properties")}
    assert dtypes == {"exp_avg": BF16, "exp_avg_sq": BF16, "remainder": torch.uint8,
                      "precis_step": FP32}
    meta = dcp.FileSystemReader(os.path.join(saved_checkpoint, "bf16_masters")) \
        .read_metadata().state_dict_metadata
    weight = meta["model.0.weight"]
    assert weight.properties.dtype == FP32 and tuple(weight.size) == (9, w.IN)


@pytest.mark.parametrize("world_size", (3, 1))
def test_checkpoint_resharded_continues_as_one_process(saved_checkpoint, world_size):
    results = w.run_world(case_checkpoint, world_size, saved_checkpoint, False)
    for name, (on_device, _) in CKPT_OFFLOADED.items():
        for r in results:  # saved offloaded: the bits of the one saved from the device
            assert torch.equal(r[name], r[on_device]), name
    for name, (dtype, policy) in CKPT.items():
        params, masters, _ = reference(CKPT_STEPS + MORE_STEPS, dtype, policy)
        got = results[0][name]
        for r in results[1:]:
            assert torch.equal(r[name], got)
        if dtype == FP32:
            torch.testing.assert_close(got, params, rtol=0, atol=1e-6)
        elif name == "bf16_masters":
            torch.testing.assert_close(got, masters, rtol=0, atol=BF16_ROUNDED * 4 / 3)
        else:
            diff = (got - params).abs()
            bound = 2 * bf16_ulp(params) + BF16_ROUNDED * 4 / 3
            assert bool((diff <= bound).all()), (name, float((diff - bound).max()))


# ---- the example under torchrun -----------------------------------------------------


@pytest.mark.parametrize("how", ("remainders", "fp8_offloaded", "fp8_released"))
def test_training_script_under_torchrun(tmp_path, how):
    assert os.path.isfile(EXAMPLE), f"{EXAMPLE} is missing (examples/fsdp_train.py)"
    env = w.child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    policy, extra = {
        "remainders": ('{"store_param_remainders": true}', []),
        "fp8_offloaded": ('{"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8", '
                          '"store_param_remainders": true}', ["--offload"]),
        "fp8_released": ('{"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8", '
                         '"store_param_remainders": true, "param_remainder_bits": 8}',
                         ["--release"]),
    }[how]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={w.free_port()}",
           "--log_dir", str(tmp_path / "logs"), EXAMPLE, "--dtype", "bf16",
           "--policy", policy, "--steps", "4", "--width", "128",
           "--checkpoint", str(tmp_path / "ckpt"), *extra]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "fsdp_train: OK (2 processes" in proc.stdout, proc.stdout[-4000:]
    assert ("offload=cpu" in proc.stdout) == (how == "fp8_offloaded"), proc.stdout[-4000:]
    assert ("release=True" in proc.stdout) == (how == "fp8_released"), proc.stdout[-4000:]
    assert os.path.isfile(tmp_path / "ckpt" / ".metadata")


# ---- SGD and Lion (issue #44): FSDP2 at worlds 1-3, offload, DCP resharded ------------


@pytest.mark.parametrize("name", sorted(ONE_STATE_POLICIES))
@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_optimizers_give_the_bits_of_the_whole_at_every_world_size(optimizer, name):
    """SGD and Lion on torch's fully_shard with the same full gradients: the shards at
    worlds 1, 2 and 3 end with the same bits, state, decoded_state() and
    to_torch_state_dict() included, and with those of the unsharded model (under fp8
    momentum: for the weight whose rows are whole blocks; the others keep bf16 momentum
    when sharded)."""
    scaled = name == "fp8m_remainders8"
    whole = same_grads_run(ONE_STATE_POLICIES[name], optimizer=optimizer)
    like_whole = [k for k, p in enumerate(same_grads_model().parameters())
                  if not scaled or (p.dim() == 2 and p.shape[1] % 128 == 0)]
    first = None
    for world_size in WORLDS:
        for rank, result in enumerate(w.case_result(CASES, world_size,
                                                    f"same_grads_{optimizer}_{name}")):
            where = f"{optimizer}, world {world_size}, rank {rank}"
            assert_same_results(result, whole, where, like_whole)
            if first is None:
                first = result
                states = result[1]
                assert all("exp_avg" in st and "exp_avg_sq" not in st for st in states), \
                    [list(st) for st in states]
                dtypes = [st["exp_avg"].dtype for st in states]
                want = [torch.uint8 if scaled and k == 4 else BF16 for k in range(len(states))]
                assert dtypes == want, dtypes  # the 256-wide weight: m8, the rest bf16
            assert_same_results(result, first, where)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_offload_under_fsdp2_gives_the_bits_of_the_on_device_step(optimizer,
                                                                            world_size):
    """SGD and Lion with offload="cpu" on DTensor params (the first half of the elements,
    fp8 momentum + 8-bit remainders): the bits of the step on the shards themselves."""
    on_device = w.case_result(CASES, world_size, f"same_grads_{optimizer}_fp8m_remainders8")
    offloaded = w.case_result(CASES, world_size, f"offloaded_{optimizer}_fp8m_remainders8_0.5")
    for rank, (got, want) in enumerate(zip(offloaded, on_device)):
        assert_same_results(got, want, f"{optimizer}, world {world_size}, rank {rank}")


def case_one_state_checkpoints(rank, world_size, path, save, runs=ONE_STATE_RUNS):
    """case_same_grads_resharded for every one of runs (saved at one world, loaded at
    another): {(optimizer, policy name): same_grads_results}."""
    return {(opt, name): case_same_grads_resharded(rank, world_size, name, path, save, opt)
            for opt, name in runs}


@pytest.fixture(scope="module")
def one_state_checkpoints(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("one_state_dcp"))
    w.run_world(case_one_state_checkpoints, 2, path, True)
    return path


def test_one_state_checkpoint_holds_the_momentum_in_its_dtype(one_state_checkpoints):
    """On disk: the momentum alone ('exp_avg'; fp8: uint8 bytes and a (7, 2) grid of
    scales for the 256-wide weight), no exp_avg_sq; SGD's and Lion's group options."""
    assert_momentum_on_disk(one_state_checkpoints, ONE_STATE_RUNS)


def assert_momentum_on_disk(path, runs):
    """The checkpoints of case_one_state_checkpoints(runs) under path hold the momentum
    alone, in its dtype (the fp8 one: for model[2].weight, whose rows are two blocks),
    and their optimizer's group options."""
    import torch.distributed.checkpoint as dcp
    for opt, name in runs:
        meta = dcp.FileSystemReader(os.path.join(path, f"{opt}_{name}")) \
            .read_metadata().state_dict_metadata
        keys = {key.split(".")[-1] for key in meta if key.startswith("optim.state.")}
        assert "exp_avg" in keys and "exp_avg_sq" not in keys, (opt, name, keys)
        weight = meta["optim.state.2.weight.exp_avg"].properties.dtype
        if name == "fp8m_remainders8":
            assert weight == torch.uint8, (opt, weight)
            assert tuple(meta["optim.state.2.weight.exp_avg_scale"].size) == (7, 2)
            assert meta["optim.state.2.weight.remainder"].properties.dtype == torch.uint8
        else:
            assert weight == BF16, (opt, weight)
        groups = {key.split(".")[-1] for key in meta if key.startswith("optim.param_groups.")}
        assert ("nesterov" in groups) == (opt in ("sgd",) + w.WHOLE_MATRIX), (opt, groups)
        assert ("ns_steps" in groups) == (opt in w.WHOLE_MATRIX), (opt, groups)
        assert ("betas" in groups) == (opt == "lion"), (opt, groups)
        # NorMuon's row state, whole (rows, 1) fp32, saved once: it is replicated
        assert ("row_exp_avg_sq" in keys) == (opt == "normuon"), (opt, keys)
        if opt == "normuon":
            row = meta["optim.state.0.weight.row_exp_avg_sq"]
            assert tuple(row.size) == (127, 1) and row.properties.dtype == torch.float32


@pytest.mark.parametrize("world_size", (1, 3))
def test_one_state_state_resharded_by_dcp_continues_bit_exact(one_state_checkpoints,
                                                              world_size):
    """SGD and Lion (bf16 momentum; fp8 momentum with its block scales as DTensors, and
    8-bit remainders) saved by torch.distributed.checkpoint at world 2, loaded at 1 and
    3 into a model of other weights: the next steps give the bits of the run that
    never stopped."""
    results = w.run_world(case_one_state_checkpoints, world_size, one_state_checkpoints, False)
    for opt, name in ONE_STATE_RUNS:
        through = w.case_result(CASES, 2, f"through_{opt}_{name}")[0]
        for rank, by_run in enumerate(results):
            assert_same_results(by_run[(opt, name)], through,
                                f"{opt} {name}: loaded at world {world_size}, rank {rank}")


# ---- Muon on FSDP2: whole matrices orthogonalized on every rank ------------------------
# Muon steps each rank's local shards (the momentum, the apply) but orthogonalizes whole
# matrices: each rank's rows of the bf16 direction are all-gathered, every rank runs
# Newton-Schulz on the whole matrix and keeps its own rows (dtensor.on_whole), and the
# adjusted lr is the whole matrix's (the tall (127, 33) one's differs from its shards').
# ddp_worker's ranks run one thread each, and so does the one-process reference here:
# the matmuls' bits do not follow the thread count (checked on this machine's CPU), but
# nothing promises it. ONE_STATE_POLICIES on muon_model.
MUON_RUNS = [(opt, name) for opt in w.WHOLE_MATRIX for name in ("bf16_default", "fp8m_remainders8")]


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def case_muon_nonfinite(rank, world_size, optimizer="muon"):
    """A loss scale of 4 with step 1's gradients scaled by it, a NaN in the last rank's
    shard of the first matrix's: skipped on every rank, nothing written; then the clean
    step 1 (scaled: a power of 2, the unscaled bits). Returns (skipped, results before
    the skipped step, after it, after the clean step)."""
    model = shard(muon_model(), world_size, "plain", None)
    opt = w.make_optimizer(optimizer, model.parameters())
    same_grads_steps(model, opt, 1)
    before = same_grads_results(model, opt, True)
    set_same_grads(model, 1, scale=4.0)
    if rank == world_size - 1:
        next(model.parameters()).grad.to_local().view(-1)[-1] = float("nan")
    opt.step(grad_scale=4.0)
    skipped = opt.last_step_skipped
    after_skip = same_grads_results(model, opt, True)
    set_same_grads(model, 1, scale=4.0)
    opt.step(grad_scale=4.0)
    return skipped, before, after_skip, same_grads_results(model, opt, True)


MUON_CASES = {  # worlds 1, 2 and 3; Muon's and NorMuon's (its row state whole on every rank)
    **{f"same_grads_{opt}_{name}": (case_one_state_same_grads, (opt, name))
       for opt in w.WHOLE_MATRIX + w.DION_MATRIX for name in ONE_STATE_POLICIES},
    **{f"through_{opt}_{name}": (case_one_state_same_grads, (opt, name, CKPT_AT + CKPT_MORE))
       for opt, name in MUON_RUNS},
    **{f"nonfinite_{opt}": (case_muon_nonfinite, (opt,)) for opt in w.WHOLE_MATRIX},
}
MUON_HSDP_CASES = {  # 4 ranks: FSDP2's 4 shards, and a 2 x 2 mesh (replicate, shard)
    f"{how}_{opt}_{name}": (case_one_state_same_grads, (opt, name, SAME_GRADS_STEPS, how))
    for how in ("plain", "plain_hsdp") for opt, name in MUON_RUNS}


@pytest.mark.parametrize("optimizer", w.WHOLE_MATRIX + w.DION_MATRIX)
@pytest.mark.parametrize("name", sorted(ONE_STATE_POLICIES))
def test_muon_gives_the_bits_of_the_whole_at_every_world_size(name, optimizer):
    """Muon and NorMuon (with torch's conventions, and dion's) on torch's fully_shard (uneven shards of tall, wide and block-row
    matrices) with the same full gradients: the shards at worlds 1, 2 and 3 end with the
    same bits, state (NorMuon's row state too), decoded_state() and to_torch_state_dict()
    included, and with those of the unsharded model (under fp8 momentum: for the (7, 256)
    and (2, 128) weights, whose rows are whole blocks; the others keep bf16 momentum when
    sharded)."""
    scaled = name == "fp8m_remainders8"
    with one_thread():
        whole = same_grads_run(ONE_STATE_POLICIES[name], optimizer=optimizer)
    like_whole = [2, 3] if scaled else [0, 1, 2, 3]
    first = None
    for world_size in WORLDS:
        for rank, result in enumerate(w.case_result(MUON_CASES, world_size,
                                                    f"same_grads_{optimizer}_{name}")):
            where = f"{optimizer} {name}, world {world_size}, rank {rank}"
            assert_same_results(result, whole, where, like_whole)
            if first is None:
                first = result
                dtypes = [st["exp_avg"].dtype for st in result[1]]
                assert dtypes == [BF16, BF16] + [torch.uint8 if scaled else BF16] * 2, dtypes
            assert_same_results(result, first, where)


@pytest.mark.parametrize("optimizer", w.WHOLE_MATRIX)
@pytest.mark.parametrize("world_size", WORLDS)
def test_muon_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(world_size,
                                                                          optimizer):
    """A NaN in one rank's shard under a loss scale: every rank skips (nothing written,
    no rank orthogonalizes alone); the next step gives the unsharded model's bits."""
    with one_thread():
        whole = same_grads_run(None, steps=2, optimizer=optimizer)
    for rank, (skipped, before, after_skip, after) in enumerate(
            w.case_result(MUON_CASES, world_size, f"nonfinite_{optimizer}")):
        where = f"world {world_size}, rank {rank}"
        assert skipped is True, where
        assert_same_results(after_skip, before, where)
        assert_same_results(after, whole, where)


def test_muon_on_four_ranks_and_hsdp_gives_the_bits_of_fsdp_at_world_2():
    """The same gradients on 4 ranks, as FSDP2's 4 shards (uneven: rows 32, 32, 32, 31;
    9, 9, 9, 6; 2, 2, 2, 1; 1, 1, 0, 0) and as torch's fully_shard on a 2 x 2 mesh (replicate, shard:
    HSDP, the directions gathered over the shard dim only): every rank ends with the
    bits of FSDP2 at world 2."""
    for opt, name in MUON_RUNS:
        fsdp = w.case_result(MUON_CASES, 2, f"same_grads_{opt}_{name}")[0]
        for how in ("plain", "plain_hsdp"):
            for rank, result in enumerate(w.case_result(MUON_HSDP_CASES, 4,
                                                        f"{how}_{opt}_{name}")):
                assert_same_results(result, fsdp, f"{opt} {how} {name}, rank {rank}")


@pytest.fixture(scope="module")
def muon_checkpoints(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("muon_dcp"))
    w.run_world(case_one_state_checkpoints, 2, path, True, MUON_RUNS)
    return path


@pytest.mark.parametrize("world_size", (1, 3))
def test_muon_state_resharded_by_dcp_continues_bit_exact(muon_checkpoints, world_size):
    """Muon's state (bf16 momentum; fp8 momentum with its block scales, 8-bit
    remainders) saved by torch.distributed.checkpoint at world 2 (on disk: the momentum
    alone, in its dtype), loaded at 1 and 3 into a model of other weights: the next steps
    give the bits of the run that never stopped."""
    assert_momentum_on_disk(muon_checkpoints, MUON_RUNS)
    results = w.run_world(case_one_state_checkpoints, world_size, muon_checkpoints, False,
                          MUON_RUNS)
    for opt, name in MUON_RUNS:
        through = w.case_result(MUON_CASES, 2, f"through_{opt}_{name}")[0]
        for rank, by_run in enumerate(results):
            assert_same_results(by_run[(opt, name)], through,
                                f"muon {name}: loaded at world {world_size}, rank {rank}")
