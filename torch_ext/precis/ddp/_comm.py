"""Collectives on one process group (the bytes handed to each counted), the
asynchronous handles they return, and the scaling of a buffer into its wire dtype.
Sums wider than the wire come from precis.grad_sums."""

import torch
import torch.distributed as dist

from .. import ops
from ..grad_sums import start_chunk_sum

# torch 2.13 renamed the single-tensor collectives (the old names still work, with
# a FutureWarning); torch 2.10 to 2.12 have only the old names.
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") \
    else "reduce_scatter_tensor"
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") \
    else "all_gather_into_tensor"


def _nbytes(t):
    return t.numel() * t.element_size()


def _scale_into(src, comm, factor):
    """comm = src * factor in comm's dtype (comm may be src itself), scaling once, in
    the wider of the two dtypes; src may be scaled in place on the way."""
    if comm is src or src.element_size() >= comm.element_size():
        ops.scale_(src, factor)
        if comm is not src:
            ops.cast_(comm, src)
    else:
        ops.cast_(comm, src)
        ops.scale_(comm, factor)


class _Pending:
    """Asynchronous collectives (torch Work objects) and what to do once they are done."""

    def __init__(self, works=(), then=None):
        self.works, self.then = list(works), then

    def wait(self):
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
        self.works, self.then = [], None


def _chain(first, second):
    def both():
        if first is not None:
            first()
        if second is not None:
            second()
    return both


class _Comm:
    """torch.distributed on one process group, counting the bytes handed to it."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        # NCCL reduce-scatters and all-gathers in place (output a shard of the input,
        # or input a shard of the output); other backends are given separate memory
        # for that shard, as nothing promises that they allow the overlap.
        self.in_place = self.backend == "nccl"
        # Payload bytes this rank handed to each kind of collective.
        self.sent = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "broadcast": 0,
                     "all_to_all": 0}

    def all_reduce(self, t):
        """Sum t in place over the group, in t's dtype."""
        self.sent["all_reduce"] += _nbytes(t)
        return _Pending([dist.all_reduce(t, group=self.group, async_op=True)])

    def reduce_scatter(self, t):
        """Sum t over the group into this rank's shard of t (the rest is scratch)."""
        shard = t.numel() // self.world
        mine = t[self.rank * shard:(self.rank + 1) * shard]
        self.sent["reduce_scatter"] += _nbytes(t)
        reduce_scatter = getattr(dist, _REDUCE_SCATTER)
        if self.in_place:
            return _Pending([reduce_scatter(mine, t, group=self.group, async_op=True)])
        out = torch.empty_like(mine)
        return _Pending([reduce_scatter(out, t, group=self.group, async_op=True)],
                        lambda: mine.copy_(out))

    def reduce_scatter_wide(self, t, sum_dtype, scale, done):
        """scale * the sum of t over the group, added in sum_dtype (precis.grad_sums),
        for this rank's chunk of t (t.numel() a multiple of the world): once the
        all-to-all is done, done(total) gets it as a sum_dtype tensor of one chunk."""
        self.sent["all_to_all"] += _nbytes(t)
        work, finish = start_chunk_sum(t, self.group, sum_dtype, scale)
        return _Pending([work], lambda: done(finish()))

    def all_reduce_wide(self, t, sum_dtype, scale):
        """t = scale * (sum of t over the group), added in sum_dtype, in place: each rank
        sums its chunk (reduce_scatter_wide), rounds it once into t's dtype, and the
        chunks are all-gathered (launched and waited for once the sums are done)."""
        shard = t.numel() // self.world
        mine = t[self.rank * shard:(self.rank + 1) * shard]

        def gather(total):
            ops.cast_(mine, total)
            self.all_gather(t).wait()
        return self.reduce_scatter_wide(t, sum_dtype, scale, gather)

    def all_gather(self, t):
        """Shard r of t, from rank r, to every rank (in place)."""
        shard = t.numel() // self.world
        mine = t[self.rank * shard:(self.rank + 1) * shard]
        self.sent["all_gather"] += _nbytes(mine)
        src = mine if self.in_place else mine.clone()
        return _Pending([getattr(dist, _ALL_GATHER)(t, src, group=self.group, async_op=True)])

    def broadcast(self, t, src=0):
        """t from the group's rank src to every rank (in place)."""
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            return
        contiguous = flat.is_contiguous() and flat.data_ptr() == t.data_ptr()
        buf = flat if contiguous else flat.clone()
        # As raw bytes: module buffers may have any dtype, and gloo has none of int16,
        # uint16 or the fp8 types (torch 2.13: "Invalid scalar type").
        b = buf.view(torch.uint8)
        self.sent["broadcast"] += _nbytes(b)
        dist.broadcast(b, group=self.group, group_src=src)
        if not contiguous:
            t.detach().copy_(buf.view(t.shape))
