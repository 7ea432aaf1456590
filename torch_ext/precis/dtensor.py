"""DTensor params (torch's fully_shard, precis.fsdp): each rank steps its local shard;
the state is kept as DTensors placed like the param (docs/design.md section 5), so
state_dict() and torch.distributed.checkpoint see DTensors."""

from collections.abc import Mapping

import torch

from .stored_forms import stamp

try:  # torch builds without distributed support have no DTensor
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = Shard = distribute_tensor = None


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local_shard(p, t):
    """t (p itself, its grad or a state tensor) as p's local shard: the DTensor's
    local tensor (shares its storage), or this rank's slice of a full-size plain
    tensor (a one-process checkpoint). Tensors of plain params pass through."""
    if not is_dtensor(p) or not isinstance(t, torch.Tensor):
        return t
    if is_dtensor(t):
        if t.placements != p.placements or t.device_mesh != p.device_mesh:
            t = t.redistribute(p.device_mesh, p.placements)
        return t.to_local()
    return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local()


def element_offset(p):
    """The index of p's local shard's first element in the whole param (0 for plain
    params): where its stochastic rounding's numbers start. A shard cut along dim 0
    (fully_shard's Shard(0), torch.chunk's rows) is a range of the whole, so its
    elements get the numbers they get when the param is stepped whole, at any world
    size. A shard cut along another dim is not a range: its later rows take numbers
    of elements held by other ranks (still unbiased, but then the bits follow the mesh)."""
    if not is_dtensor(p):
        return 0
    placements = p.placements
    if len(placements) == 1 and type(placements[0]) is Shard and placements[0].dim == 0:
        # torch.chunk's rows, as DTensor cuts them: ceil(rows / world) per rank
        mesh = p.device_mesh
        rows, world = p.shape[0], mesh.size()
        first_row = min(mesh.get_local_rank() * -(-rows // world), rows)
        return first_row * (p.numel() // rows if rows else 0)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    row, index = 1, 0
    for size, offset in zip(reversed(p.shape), reversed(offsets)):
        index += offset * row
        row *= size
    return index


def placed_like(p, local):
    """A local shard of p's layout as a DTensor placed like p (plain params: local)."""
    if not is_dtensor(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def shard_stamp(p):
    """(version, address) of the memory p's values live in (its local shard)."""
    return stamp(local_shard(p, p))


def local_state(p, saved, where):
    """A saved state of p (a mapping as load_state_dict takes it) with its tensors as
    p's local shards, after checking their global shapes."""
    if not is_dtensor(p) or not isinstance(saved, Mapping):
        return saved
    out = dict(saved)
    for key, t in saved.items():
        if key in ("step", "precis_step") or not isinstance(t, torch.Tensor):
            continue
        if key.endswith("_scale"):
            raise ValueError(f"{where}: has '{key}': block-scaled moments cannot be loaded "
                             f"into a DTensor param")
        if t.shape != p.shape:
            raise ValueError(f"{where}: '{key}' has shape {tuple(t.shape)}, the param "
                             f"{tuple(p.shape)}")
        out[key] = local_shard(p, t)
    return out


def meshes_of(calls):
    """The device meshes of the DTensor params of calls, in a fixed order."""
    meshes = []
    for call in calls:
        if call.plan is not None:
            continue  # a shortcut: a Plan's params are never DTensors
        for p in call.params:
            if is_dtensor(p) and p.device_mesh not in meshes:
                meshes.append(p.device_mesh)
    return meshes


def agree_on_nonfinite(flag, meshes):
    """Max of flag over every rank holding a shard of the same params: a NaN/Inf in
    one rank's shard skips the step on all of them (no sync: stays on the device)."""
    for mesh in meshes:
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                         group=mesh.get_group(dim))
