"""precis.fsdp: params, gradients and optimizer state all sharded (ZeRO-3, Megatron-FSDP's
`optim_grads_params`) through torch's FSDP2, stepped by precis.optim (docs/design.md
section 5).

    import precis.fsdp, precis.optim                # before init_process_group
    dist.init_process_group("gloo")                 # torchrun; "nccl" on GPUs
    chunks = precis.fsdp.fully_shard([stage0, stage1], policy={"exp_avg_dtype": "bf16"},
                                     units=(Block,))
    opt = precis.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-3)
    for batch in data:
        loss_of(chunks, batch).backward()           # FSDP2 reduce-scatters the gradients
        opt.step()                                  # each rank steps its local shards
        opt.zero_grad()
    with precis.fsdp.gathered(chunks):              # full params of every chunk
        evaluate(chunks)

fully_shard() applies torch.distributed.fsdp.fully_shard to every module matching
`units`, then to each chunk, with a MixedPrecisionPolicy derived from the precision
policy (`policy` as precis.optim takes it: None, a mapping of overrides resolved for
the model's dtype, or a precis.Policy, whose param_dtype is then the model dtype):

  compute (all-gather)   param_dtype, the model dtype
  gradient reduction     grad_comm_dtype (reduce-scatter; FSDP2 averages over ranks),
                         added in grad_sum_dtype: fp32 with a 16-bit wire replaces the
                         reduce-scatter by precis.grad_sums' all-to-all and fp32 sums
                         (1-D meshes: FSDP2's all-reduce over HSDP replicas adds in the
                         wire's dtype and cannot be replaced)
  sharded params         main_params_dtype when the policy keeps a separate master (fp32
                         for bf16 and fp16 models): the sharded param *is* the master, no
                         second copy; else param_dtype (an fp32 model; bf16 params with
                         int16 / 8-bit remainders or stochastic rounding in the
                         optimizer)
  sharded gradients      the sharded params' dtype (FSDP2 casts the reduced gradient to
                         it and accumulates micro-batches there)
  optimizer state        moments and remainders as the policy says, as DTensors placed
                         like the param (precis.optim steps the local shards)

Each sharded param carries the policy (`param._precis_policy`): a precis optimizer
with no policy of its own uses it, and a sharded param kept in the master dtype is
its own master. torch's plain fully_shard works with precis.optim too (the state is
then the policy of the params' own dtype).

Model chunks: a list of modules (e.g. the stages a pipeline rank holds) is sharded
chunk by chunk; gathered(), no_sync() and check_finite_grads() take the same list
and cover every fully_shard unit of every chunk.

Checkpoints: the params and optimizer state are DTensors, so torch.distributed.checkpoint
saves and reshards them (dcp.load into the get_state_dict template, then set_state_dict:
the params are loaded in place before the optimizer, so remainders stay exact; torch
2.13's set_state_dict alone loads the optimizer first, and a state dict reaching the
params only through it, a full one say, loses the remainders at the next step: a
StaleMasterWarning).
"""

import contextlib

import torch
import torch._dynamo  # noqa: F401  (before any process group exists: see precis/ddp/__init__.py)
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from . import ops
from .grad_sums import FSDPReduceScatter
from .policy import Policy, policy_for, whole_policy

__all__ = ["fully_shard", "sharded_dtype", "mixed_precision", "bytes_per_param", "gathered",
           "no_sync", "check_finite_grads"]

_WHO = "precis.fsdp.fully_shard"


def sharded_dtype(policy):
    """The dtype FSDP2 keeps a policy's sharded params (and gradients) in."""
    return policy.main_params_dtype if policy.has_master else policy.param_dtype


def mixed_precision(policy):
    """torch's MixedPrecisionPolicy for a precis policy: compute in the model dtype,
    reduce gradients in grad_comm_dtype (floating-point forward inputs are cast to the
    model dtype)."""
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype,
                                reduce_dtype=policy.grad_comm_dtype)


def bytes_per_param(policy):
    """Bytes each parameter costs in the buffers that stay sharded (summed over the
    ranks: each rank holds about 1/world of it): the sharded param, its gradient,
    remainders and moments. The all-gathered params and unsharded gradients live
    only around one unit's forward and backward, and are not counted."""
    sizes = policy.bytes_per_param()
    stored = sharded_dtype(policy).itemsize
    out = {"param": stored, "grad": stored, "remainder": sizes["remainder"],
           "exp_avg": sizes["exp_avg"], "exp_avg_sq": sizes["exp_avg_sq"]}
    out["total"] = sum(out.values())
    return out


def _chunks(modules, who):
    chunks = [modules] if isinstance(modules, nn.Module) else list(modules)
    if not chunks:
        raise ValueError(f"{who}: no modules given")
    for i, m in enumerate(chunks):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{who}: chunk {i} is a {type(m).__name__}, not an nn.Module")
    return chunks


def _unit_test(units):
    if callable(units) and not isinstance(units, type):
        return units
    classes = (units,) if isinstance(units, type) else tuple(units)
    if not all(isinstance(c, type) for c in classes):
        raise TypeError(f"{_WHO}: units must be a module class, a tuple of them or a "
                        f"callable(module) -> bool, got {units!r}")
    return lambda m: isinstance(m, classes)


def _model_policy(chunks, policy):
    """The model's resolved Policy: its dtype is the floating params' (one for every
    chunk), or a given Policy's param_dtype."""
    dtype, first = None, None
    for ci, chunk in enumerate(chunks):
        if any(isinstance(m, FSDPModule) for m in chunk.modules()):
            raise ValueError(f"{_WHO}: chunk {ci} ({type(chunk).__name__}) is already sharded")
        for name, p in chunk.named_parameters():
            if not p.is_floating_point():
                continue
            if dtype is None:
                dtype, first = p.dtype, f"chunk {ci} param {name!r}"
            elif p.dtype != dtype:
                raise ValueError(f"{_WHO}: chunk {ci} param {name!r} is {p.dtype} but {first} "
                                 f"is {dtype}; give every param the model dtype first")
    if dtype is None:
        raise ValueError(f"{_WHO}: the modules have no floating-point params")
    policy = whole_policy(policy, _WHO)  # (to_dict()'s mapping: its Policy's dtype)
    model_dtype = policy.param_dtype if isinstance(policy, Policy) else dtype
    resolved = policy_for(policy, model_dtype, _WHO)
    stored = sharded_dtype(resolved)
    if resolved.main_grads_dtype.itemsize > stored.itemsize:
        raise ValueError(f"{_WHO}: main_grads_dtype {resolved.main_grads_dtype} is wider than "
                         f"the sharded params ({stored}), where FSDP2 accumulates gradients; "
                         f"keep main_grads_dtype at {stored} or drop store_param_remainders")
    return resolved


def _forget_refused(module):
    """Take off the mark torch's fully_shard leaves on a module it refused: its
    composable-API wrapper registers the module before fully_shard checks anything,
    and a marked module is refused ever after ("can only be applied to a module once")."""
    try:  # torch's private names (2.10 ... 2.13)
        from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    except ImportError:  # pragma: no cover
        return
    module.__dict__.get(REGISTRY_KEY, {}).pop("fully_shard", None)
    module.__dict__.get(STATE_KEY, {}).pop(getattr(_torch_fully_shard, "__wrapped__", None), None)


def fully_shard(modules, policy=None, mesh=None, *, units=(), reshard_after_forward=None):
    """Shard a module, or each module of a list (model chunks), with torch's FSDP2.

    units: module classes (or a callable(module) -> bool) whose instances inside
    each chunk become fully_shard units of their own (e.g. transformer blocks:
    one all-gather and one reduce-scatter each); the chunk itself is one too.
    mesh: a 1-D DeviceMesh (default: every rank of the default group, on the
    params' device type), or a 2-D one with named dims (replicate, shard) for HSDP:
    each param sharded over the second dim, replicated over the first.
    reshard_after_forward: as torch's.
    Params are cast to sharded_dtype(policy) first. Returns what was given, sharded
    (the modules are FSDPModules now). Everything is checked before any module
    changes (should torch's fully_shard still refuse the first module, the params get
    their own data back).
    """
    chunks = _chunks(modules, _WHO)
    is_unit = _unit_test(units)
    resolved = _model_policy(chunks, policy)
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError(f"{_WHO}: no process group: call "
                               f"torch.distributed.init_process_group first, or give a mesh")
        device = next(p.device for c in chunks for p in c.parameters())
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    elif mesh.ndim not in (1, 2):
        raise ValueError(f"{_WHO}: mesh must be 1-D (data parallel) or 2-D (replicate, "
                         f"shard: HSDP), got {mesh.ndim} dims")
    elif mesh.ndim == 2 and mesh.mesh_dim_names is None:
        # torch's fully_shard refuses it too, but only after the params were cast
        raise ValueError(f"{_WHO}: a 2-D (HSDP) mesh needs names for its dims; make it with "
                         f"init_device_mesh({mesh.device_type!r}, {tuple(mesh.shape)}, "
                         f"mesh_dim_names=('replicate', 'shard'))")
    wide_sums = resolved.grad_sum_dtype != resolved.grad_comm_dtype
    if wide_sums and mesh.ndim == 2:
        raise ValueError(f"{_WHO}: grad_sum_dtype {resolved.grad_sum_dtype} with "
                         f"grad_comm_dtype {resolved.grad_comm_dtype} on a 2-D (HSDP) mesh: "
                         f"FSDP2 all-reduces over the replicas with its own all-reduce, which "
                         f"adds in the wire's dtype and cannot be replaced; use a 1-D mesh, or "
                         f"grad_comm_dtype {resolved.grad_sum_dtype}")
    if wide_sums and not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise ValueError(f"{_WHO}: grad_sum_dtype wider than grad_comm_dtype needs "
                         f"FSDPModule.set_custom_reduce_scatter, which torch "
                         f"{torch.__version__} lacks")
    stored, mp_policy = sharded_dtype(resolved), mixed_precision(resolved)
    # innermost first in each chunk: torch shards bottom-up
    targets = [(ci, m) for ci, chunk in enumerate(chunks) for m in
               [*reversed([m for m in chunk.modules() if m is not chunk and is_unit(m)]), chunk]]
    for ci, m in targets:  # torch's fully_shard refuses these (after the cast, were it later)
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            what = f"chunk {ci}" if m is chunks[ci] else f"a unit of chunk {ci}"
            raise ValueError(f"{_WHO}: {what} is a {type(m).__name__}, which has no forward; "
                             f"torch's fully_shard takes modules that run forward: give its "
                             f"modules as chunks (list(...)), or units that run forward")

    params = [list(chunk.parameters()) for chunk in chunks]
    old = [(p, p.data) for ps in params for p in ps if p.is_floating_point() and p.dtype != stored]
    with torch.no_grad():
        for p, data in old:
            p.data = data.to(stored)
    try:
        for ci, m in targets:
            _torch_fully_shard(m, mesh=mesh, mp_policy=mp_policy,
                               reshard_after_forward=reshard_after_forward)
    except Exception as e:
        # torch checks its arguments before it changes a module: refusing the first one,
        # it leaves nothing sharded, and the params get their own data back. What torch
        # has sharded cannot be unsharded.
        done = [ci for ci, chunk in enumerate(chunks)  # torch replaces the params it shards
                if any(isinstance(u, FSDPModule) for u in chunk.modules())
                or any(p is not q for p, q in zip(chunk.parameters(), params[ci]))]
        if done:
            raise RuntimeError(f"{_WHO}: torch's fully_shard failed ({type(e).__name__}: {e}) "
                               f"after it sharded modules of chunk(s) {done}, which cannot be "
                               f"unsharded; build the model again") from e
        for p, data in old:
            p.data = data
        _forget_refused(m)
        raise
    for chunk in chunks:
        for p in chunk.parameters():
            p._precis_policy = resolved
        if wide_sums:
            for m in chunk.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(FSDPReduceScatter(resolved.grad_sum_dtype))
    return modules


def _units(modules, who):
    units = [m for chunk in _chunks(modules, who) for m in chunk.modules()
             if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(f"{who}: no module was sharded with fully_shard")
    return units


def _param_groups(state):
    """A unit's FSDPParamGroups: a list from torch 2.12 on, one or None in 2.10 ... 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


@contextlib.contextmanager
def gathered(modules):
    """Every chunk's full params, for inference: each fully_shard unit of each chunk
    is all-gathered once on entry (in the compute dtype) and stays unsharded through
    any number of forwards; resharded on exit. Inside, the modules' params are
    plain full tensors."""
    units = _units(modules, "precis.fsdp.gathered")
    # FSDP2 has a setter for reshard_after_forward but no getter: keep the private
    # setting to give it back unchanged (torch 2.10 ... 2.13 store it here).
    saved = []
    for u in units:
        state = u._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [g.post_forward_mesh_info for g in _param_groups(state)]))
    try:
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
            u.unshard()
        yield modules
    finally:
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for g, info in zip(_param_groups(state), infos):
                g.post_forward_mesh_info = info
        for u in units:
            u.reshard()


@contextlib.contextmanager
def no_sync(modules):
    """Hold back the gradient reduce-scatter of every unit of every chunk: backward
    accumulates unsharded gradients (in grad_comm_dtype) until a backward outside."""
    units = _units(modules, "precis.fsdp.no_sync")
    for u in units:
        u.set_requires_gradient_sync(False, recurse=False)
    try:
        yield modules
    finally:
        for u in units:
            u.set_requires_gradient_sync(True, recurse=False)


@torch.no_grad()
def check_finite_grads(modules):
    """Raise on every rank when any rank's shard of a gradient holds a NaN or Inf,
    naming the first such param of each such rank. Collective: call it on every rank,
    after backward and before the optimizer step."""
    who = "precis.fsdp.check_finite_grads"
    chunks = _chunks(modules, who)
    names, meshes, first_bad = [], [], 0
    for ci, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            names.append(name if len(chunks) == 1 else f"chunk {ci}: {name}")
            if hasattr(p, "device_mesh") and p.device_mesh not in meshes:
                meshes.append(p.device_mesh)
            g = p.grad
            if g is None:
                continue
            g = g.to_local() if hasattr(g, "to_local") else g
            if not first_bad and g.numel() and int(ops.count_nonfinite(g.contiguous())) > 0:
                first_bad = len(names)
    if len(meshes) != 1:
        raise ValueError(f"{who}: the params lie on {len(meshes)} device meshes; expected "
                         f"the one of fully_shard")
    # Every rank of the mesh holds a shard (of a replica, on a 2-D HSDP mesh): each sets
    # its own flag (by global rank), and the max over each mesh dim in turn gives every
    # rank all of them.
    mesh = meshes[0]
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=mesh.device_type)
    flags[dist.get_rank()] = first_bad
    for dim in range(mesh.ndim):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    found = [(r, i) for r, i in enumerate(flags.tolist()) if i > 0]
    if found:
        where = "; ".join(f"parameter {names[i - 1]!r} on rank {r}" for r, i in found)
        raise RuntimeError(f"precis.fsdp: NaN or Inf in the reduced gradient shard of {where}")
