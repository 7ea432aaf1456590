"""DTensor params (torch's fully_shard, precis.fsdp): each rank steps its local shard;
the state is kept as DTensors placed like the param (docs/design.md section 5), so
state_dict() and torch.distributed.checkpoint see DTensors. What must see a whole
tensor (Muon's Newton-Schulz) gathers it and takes its shard back (on_whole).

fp16 / fp8 moments keep a scale per 128-element block. On a DTensor param the blocks
lie along its rows (the elements of one index of dim 0), which no Shard(0) cut
divides, so a block and its scale are the same at every world size; the scales are
a DTensor of shape (rows, blocks per row) placed like the param. A param whose rows
are not whole blocks (1-D params, odd shapes) keeps bf16 moments instead
(state_layout.unscaled_layout); a placement that cuts rows (Shard(1), ...) is refused."""

import math

import torch

from . import _lib, tracing

try:  # torch builds without distributed support have no DTensor
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = Replicate = Shard = distribute_tensor = None
try:  # torch's own (FSDP2 makes its DTensors so): as_dtensor without it moves the shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError:  # pragma: no cover
    DTensorSpec = TensorMeta = None


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
    of elements held by other ranks (still unbiased, but then the bits follow the mesh).
    A plain tensor that is a piece of a param (precis.ddp's shards) carries its offset
    as `_precis_element_offset`."""
    if not is_dtensor(p):
        return getattr(p, "_precis_element_offset", 0)
    placements = p.placements
    cuts = [dim for dim, place in enumerate(placements) if type(place) is not Replicate]
    if len(cuts) == 1 and type(placements[cuts[0]]) is Shard and placements[cuts[0]].dim == 0:
        # torch.chunk's rows, as DTensor cuts them: ceil(rows / world) per rank of the
        # one mesh dim that shards (FSDP2's, HSDP's; torch's general offsets below read
        # a tensor's value: a compiled step recompiles this function once a param)
        mesh = p.device_mesh
        rows, world = p.shape[0], mesh.size(cuts[0])
        first_row = min(mesh.get_local_rank(cuts[0]) * -(-rows // world), rows)
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
    return as_dtensor(local, p.device_mesh, p.placements, p.shape, p.stride())


def as_dtensor(local, mesh, placements, shape, stride):
    """This rank's shard `local` as a DTensor of that mesh, placements, shape and stride,
    its local tensor left where it is. (DTensor.from_local moves a shard to its mesh's
    device: torch's CPUOffloadPolicy keeps the shards of a CUDA mesh on the host, and
    their state must stay there with them.)"""
    if DTensorSpec is None or (tracing.traced() and local.device.type == mesh.device_type):
        # (a torch without DTensorSpec: the shard moves. Traced, in a compiled step's
        # first call: the constructor below breaks dynamo's graph, and each param's state
        # then compiles frames of its own, to dynamo's recompile limit; from_local traces,
        # and moves nothing on the mesh's device)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta),
                   requires_grad=False)


def replicated_like(p, whole):
    """A state tensor of p kept whole on every rank (a per-row state: every rank runs
    the step of p's whole matrix, dtensor.on_whole): a DTensor replicated over p's mesh
    (plain params: whole itself)."""
    if not is_dtensor(p):
        return whole
    mesh = p.device_mesh
    return as_dtensor(whole, mesh, [Replicate()] * mesh.ndim, whole.shape, whole.stride())


def on_whole(p, local, fn):
    """fn applied to the whole tensor whose local shard (p's layout) is `local`, and this
    rank's shard of what fn returns (plain params: fn(local)). For a step that is not
    elementwise (Muon's Newton-Schulz orthogonalizes a whole matrix): the shards are
    all-gathered over p's mesh (only its Shard dims communicate: HSDP's replicas hold
    the same rows), every rank runs fn on the same whole (the same bits at every world
    size) and keeps its own shard of the result, cut as p is (uneven and empty shards
    too). Collective: every rank holding a shard of p calls it. fn runs on p's device
    (a DTensor's: its mesh's, where the gather runs; torch's CPUOffloadPolicy keeps the
    shards of a CUDA mesh on the host), and the shard comes back to local's (an
    offloaded param's host copy: precis.offload).
    A precis.ddp piece stepped whole is assembled by its `_precis_whole` (ddp/_whole.py)."""
    whole = getattr(p, "_precis_whole", None)
    if whole is not None:
        return whole.apply(local, fn, p.device)
    on_p = local.to(p.device)
    if not is_dtensor(p):
        return fn(on_p).to(local.device)
    # (DTensor.from_local puts it on the mesh's device)
    on_mesh = DTensor.from_local(on_p, p.device_mesh, p.placements, run_check=False,
                                 shape=p.shape, stride=p.stride())
    return local_shard(p, fn(on_mesh.full_tensor())).to(local.device)


def assembled_from_shards(p):
    """Whether on_whole assembles the whole of p from its ranks' shards (a collective): a
    DTensor's, a precis.ddp piece's stepped whole."""
    return is_dtensor(p) or getattr(p, "_precis_whole", None) is not None


def whole_shape(p):
    """The shape of the whole param p stands for: a DTensor's global shape, a precis.ddp
    piece's whole param's when it is stepped whole (its `_precis_whole`), else p's."""
    whole = getattr(p, "_precis_whole", None)
    return p.shape if whole is None else whole.shape


def blocks_per_row(p):
    """The 128-element scale blocks in each row (index of dim 0) of a DTensor param,
    or None when its rows are not whole blocks (a 0-dim or 1-D param, odd shapes)."""
    if p.dim() < 2:
        return None
    per_row = math.prod(p.shape[1:])
    return per_row // _lib.SCALE_BLOCK if per_row % _lib.SCALE_BLOCK == 0 else None


def row_cutting_placement(p):
    """The first placement of a DTensor param that cuts its rows (anything but
    Replicate and Shard(0)), or None."""
    for placement in p.placements:
        if not (type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)):
            return placement
    return None


def scales_like(p, local):
    """The block scales of p's local shard (1-D, in block order) as p's state keeps
    them: for a DTensor param a DTensor of shape (rows, blocks per row) placed like p."""
    if not is_dtensor(p):
        return local
    per_row = blocks_per_row(p)
    return as_dtensor(local.view(-1, per_row), p.device_mesh, p.placements,
                      (p.shape[0], per_row), (per_row, 1))


def agreeing_groups(calls):
    """The process groups whose ranks must agree on skipping a step of calls, in a fixed
    order: each mesh dim's of the DTensor params, and the group of a precis.ddp piece
    whose step assembles its whole param (Muon: if one rank skipped, the others would
    wait in its collectives)."""
    groups = []
    for call in calls:
        if call.part is not None:
            continue  # a shortcut: a Plan's params are never DTensors nor Muon's
        for p in call.params:
            whole = getattr(p, "_precis_whole", None)
            if is_dtensor(p):
                found = [p.device_mesh.get_group(d) for d in range(p.device_mesh.ndim)]
            else:
                found = [whole.group] if whole is not None else []
            groups += [g for g in found if not any(g is h for h in groups)]
    return groups


def agree_on_nonfinite(flag, groups):
    """Max of flag over every rank of the groups (agreeing_groups): a NaN/Inf in one
    rank's shard skips the step on all of them (no sync: stays on the device)."""
    for group in groups:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
