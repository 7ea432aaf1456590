"""Gradient (and, sharded, param) buffers of one dtype group, cut into buckets."""

import torch

DEFAULT_BUCKET_SIZE = 40_000_000  # elements (Megatron-LM's default; torch DDP: 25 MB)


class _Bucket:
    """A range [start, start + numel) of its group's buffers (numel padded for sharding)."""

    def __init__(self, group, params, start, numel):
        self.group, self.params, self.start, self.numel = group, params, start, numel
        self.ready = set()        # params whose gradient arrived in this micro-batch
        self.launched = False
        self.pending = None       # _Pending of the collective in flight
        self.temp = None          # sharded grads: this micro-batch's full-size gradients
        self.grad_shard = None    # sharded grads: the persistent reduced shard

    def shard_range(self, world, rank):
        """[lo, hi) of this rank's shard, in group-buffer coordinates."""
        size = self.numel // world
        return self.start + rank * size, self.start + (rank + 1) * size

    def wait(self):
        """Wait for the collective in flight, if any (the bucket stays launched)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def settle(self):
        """Wait for the collective in flight, if any; the bucket starts over."""
        self.wait()
        self.launched = False
        self.ready.clear()

    def new_temp(self):
        """Sharded grads: a zeroed full-size gradient buffer; main_grad views into it."""
        g = self.group
        self.temp = torch.zeros(self.numel, dtype=g.grad_dtype, device=g.device)
        for q in self.params:
            q.main_grad = g.view(self.temp, q, self.start)

    def drop_temp(self):
        """Sharded grads: free the full-size gradients; main_grad is gone with them."""
        self.temp = None
        for q in self.params:
            q.main_grad = None


class _Group:
    """Params of one (param dtype, main grads dtype, comm dtype, sum dtype, device),
    their buffers.

    key: that tuple; params: in registration order; world: the group size; sharding:
    a Sharding. Sharded optimizer state pads every bucket to a multiple of world and
    makes the params views of one param buffer (all-gathered in place); sharded
    grads keep only a shard buffer (no full-size gradient buffer). Sums wider than
    the wire pad every bucket too (each rank sums one equal chunk). align: with
    sharded state, every param and every shard starts at a multiple of it (the 128
    elements of fp16 / fp8 moments' block scales: a piece's blocks are then its whole
    param's, and any world size gives one process's bits).
    """

    def __init__(self, key, params, bucket_size, world, sharding, align=1):
        self.param_dtype, self.grad_dtype, self.comm_dtype, self.sum_dtype, self.device = key
        sharded = sharding.shards_optimizer_state
        padded = sharded or self.wide_sums
        # Cut buckets in reverse order: backward produces the last params' grads first.
        chunks, chunk, size = [], [], 0
        for p in reversed(params):
            chunk.append(p)
            size += p.numel()
            if size >= bucket_size:
                chunks.append(chunk)
                chunk, size = [], 0
        if chunk:
            chunks.append(chunk)
        self.offset = {}  # param -> offset in the group's buffers
        self.buckets = []
        start = 0
        align = align if sharded else 1
        for chunk in chunks:
            begin = start
            for p in chunk:
                start = -(-start // align) * align
                self.offset[p] = start
                start += p.numel()
            numel = start - begin
            if padded:  # equal shards (or chunks) for every rank, each a multiple of align
                numel = -(-numel // (world * align)) * world * align
            self.buckets.append(_Bucket(self, chunk, begin, numel))
            start = begin + numel
        self.numel = start

        kw = dict(device=self.device)
        self.grad_data = None
        if not sharding.shards_grads:
            self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, **kw)
        for p in params:  # sharded grads: only while its bucket's full-size buffer lives
            p.main_grad = None if self.grad_data is None else self.view(self.grad_data, p)
        self.param_data = None
        if sharded:
            # The params become views of one buffer, so shards can be all-gathered in place.
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, **kw)
            with torch.no_grad():
                for p in params:
                    view = self.view(self.param_data, p)
                    view.copy_(p.detach())
                    p.data = view
        self.grad_shard_data = None
        if sharding.shards_grads:
            self.grad_shard_data = torch.zeros(self.numel // world, dtype=self.grad_dtype, **kw)
            for b in self.buckets:
                lo = b.start // world
                b.grad_shard = self.grad_shard_data[lo:lo + b.numel // world]

    @property
    def wide_sums(self):
        """Gradients added in a wider dtype than the wire's (grad_sum_dtype)."""
        return self.sum_dtype != self.comm_dtype

    def view(self, buf, p, start=0):
        """p's elements of a buffer that begins at group offset `start` (the group's
        own buffers begin at 0), shaped like p."""
        off = self.offset[p] - start
        return buf[off:off + p.numel()].view(p.shape)

    def zero_grads(self):
        """Zero the persistent gradient buffers (full-size or shard)."""
        for buf in (self.grad_data, self.grad_shard_data):
            if buf is not None:
                buf.zero_()
