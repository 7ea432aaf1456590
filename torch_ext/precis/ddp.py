"""precis.ddp: data parallelism with gradient buckets in the policy's dtypes, and the
distributed (sharded) optimizer (docs/design.md section 5).

    dist.init_process_group("gloo")            # or "nccl"; launched with torchrun
    model = precis.ddp.DistributedDataParallel(model, sharding="optim")
    opt = precis.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in data:
        for micro in batch[:-1]:
            with model.no_sync():
                model(micro).backward()
        model(batch[-1]).backward()
        opt.step()
        opt.zero_grad()

Gradient buffers. The params of the wrapped module are grouped by (param dtype,
main_grads_dtype, grad_comm_dtype, device), the dtypes coming from the precision
policy (`policy` as in precis.optim: None = the defaults for each param's dtype, so
a bf16 model gets a bf16 buffer; a mapping of overrides; or a precis.Policy). Each
group has one contiguous buffer in main_grads_dtype and every param gets
`param.main_grad`, a view into it. A hook after gradient accumulation adds
`param.grad` into `main_grad` (torch.ops.precis.accumulate_) and frees `param.grad`.
The buffer is cut into buckets of about `bucket_size` elements (default 40M, as in
Megatron-LM), in reverse order of the params (the order backward produces grads).

Reduction. On the last micro-batch (outside no_sync()), a bucket is reduced as soon
as all its params have their gradient, asynchronously, while backward goes on:
cast into a temporary buffer in grad_comm_dtype if that differs from
main_grads_dtype, scaled by 1/world once (in the wider of the two dtypes), then
all-reduced (no_shard) or reduce-scattered (optim, optim_grads) and cast back. The
end of backward waits for everything (finish_grad_sync(), also callable by hand),
so after loss.backward() the gradients are synchronized, as with torch's DDP.
Buckets are launched in a fixed order, the same on every rank. With a world of one
process nothing is communicated.

Sharding strategies (Megatron-FSDP's names):

  no_shard     all-reduce; every rank steps the whole model.
  optim        reduce-scatter; the params live in one contiguous buffer per group,
               each bucket padded to a multiple of the world size and split into
               equal shards; rank r keeps optimizer state (master weights, moments)
               only for shard r of every bucket, steps it, and the updated params
               are all-gathered right after optimizer.step(). Only this rank's
               shard of `main_grad` holds the reduced gradient.
  optim_grads  as optim, and gradients are reduce-scattered on every micro-batch
               (no_sync() does not hold them back) into a persistent shard buffer:
               the full-size buffer of a bucket only lives from its first gradient
               to its reduce-scatter, and `param.main_grad` only in between.

The optimizer. precis optimizers call attach_optimizer() on themselves when they
are built: for params of a sharded wrapper the optimizer then steps, instead of
the param, its intersection with this rank's shards, a flat view of the param
whose `main_grad` is the matching view of the reduced gradient shard (one piece per
param and bucket at most, so param groups, weight decay and learning rates keep
working). optimizer.step() first finishes the gradient sync of every wrapper that
owns one of its params (every model chunk, not only the first), steps, then
all-gathers the params; optimizer.zero_grad() also clears the gradient buffers
(zero_grad_buffer()). Build the wrapper before the optimizer. Any other optimizer
that steps `main_grad` can be attached by hand: precis.ddp.attach_optimizer(opt).

Sharded optimizer checkpoints: every rank saves its own
`optimizer.state_dict()` and loads it back with `optimizer.load_state_dict()` into
a run with the same world size, rank, model and strategy. The dict is the inner
optimizer's ({'state', 'param_groups'}, state indexed by position in the param
groups, which list this rank's pieces) plus one key:

  'precis_ddp': {'format': 1, 'world_size': W, 'rank': r,
                 'sharding': [strategy of each wrapper],
                 'pieces': [[param name, start, stop], ...]}

where each piece is elements [start, stop) of the flattened param, in param-group
order (a param stepped whole has start 0 and stop numel; optimizer_pieces(opt)
gives this list). load_state_dict checks this key and raises ValueError on any
mismatch. Under no_shard the state is the same on every rank and the state dict
is the plain one, loadable without DDP. Model weights are the same on every rank
after each step: save them from rank 0.

Backends. Every collective is the backend's own, in the buffer's dtype: all-reduce,
reduce-scatter and all-gather into one tensor (torch.distributed's
reduce_scatter_single / all_gather_single, reduce_scatter_tensor /
all_gather_into_tensor before torch 2.13), which NCCL and gloo have for fp32,
bf16 and fp16 (gloo checked on torch 2.13); so bf16 or fp16 on the wire is also
summed in that dtype, as NCCL does. NCCL reduce-scatters and all-gathers in place; elsewhere
the output gets its own memory (one shard). The construction-time broadcast
moves raw bytes, so module buffers of any dtype travel (gloo still has no int16,
uint16 or fp8 collectives). The process group needs no other operation.

Limits: every rank must produce gradients for the same params in a step (as torch
DDP without find_unused_parameters); module buffers are broadcast from rank 0 once,
at construction; one backward per micro-batch (use no_sync() for all but the last);
move the model to its device and dtype before wrapping it (the buffers are views).

comm_hook(policy) is a communication hook for torch.nn.parallel.DistributedDataParallel
that reduces its buckets in grad_comm_dtype.
"""

import contextlib
import weakref
from collections.abc import Mapping

import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed as dist

from . import ops
from .policy import policy_for

__all__ = ["DistributedDataParallel", "attach_optimizer", "optimizer_pieces", "comm_hook",
           "STRATEGIES", "DEFAULT_BUCKET_SIZE"]

STRATEGIES = ("no_shard", "optim", "optim_grads")
DEFAULT_BUCKET_SIZE = 40_000_000  # elements (Megatron-LM's default; torch DDP: 25 MB)
STATE_DICT_KEY = "precis_ddp"
STATE_DICT_FORMAT = 1

# torch._dynamo is imported above, before any process group exists, because importing
# it later (any torch optimizer's constructor does) keeps references to the live
# default group (torch 2.13): destroy_process_group() then no longer stops gloo's
# worker threads, which release their last tensors while the interpreter shuts
# down and abort the process ("terminate called without an active exception").

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


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------


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
        self.sent = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "broadcast": 0}

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

    def all_gather(self, t):
        """Shard r of t, from rank r, to every rank (in place)."""
        shard = t.numel() // self.world
        mine = t[self.rank * shard:(self.rank + 1) * shard]
        self.sent["all_gather"] += _nbytes(mine)
        src = mine if self.in_place else mine.clone()
        return _Pending([getattr(dist, _ALL_GATHER)(t, src, group=self.group, async_op=True)])

    def broadcast(self, t):
        """t from the group's rank 0 to every rank (in place)."""
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            return
        contiguous = flat.is_contiguous() and flat.data_ptr() == t.data_ptr()
        buf = flat if contiguous else flat.clone()
        # As raw bytes: module buffers may have any dtype, and gloo has none of int16,
        # uint16 or the fp8 types (torch 2.13: "Invalid scalar type").
        b = buf.view(torch.uint8)
        self.sent["broadcast"] += _nbytes(b)
        dist.broadcast(b, group=self.group, group_src=0)
        if not contiguous:
            t.detach().copy_(buf.view(t.shape))


# ---------------------------------------------------------------------------
# Buffers and buckets
# ---------------------------------------------------------------------------


class _Bucket:
    """A range [start, start + numel) of its group's buffers (numel padded for sharding)."""

    def __init__(self, group, params, start, numel):
        self.group, self.params, self.start, self.numel = group, params, start, numel
        self.ready = set()        # params whose gradient arrived in this micro-batch
        self.launched = False
        self.pending = None       # _Pending of the collective in flight
        self.temp = None          # optim_grads: this micro-batch's full-size gradients
        self.grad_shard = None    # optim_grads: the persistent reduced shard

    def shard_range(self, world, rank):
        """[lo, hi) of this rank's shard, in group-buffer coordinates."""
        size = self.numel // world
        return self.start + rank * size, self.start + (rank + 1) * size

    def settle(self):
        """Wait for the collective in flight, if any; the bucket starts over."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.launched = False
        self.ready.clear()

    def drop_temp(self):
        """optim_grads: free the full-size gradients; main_grad is gone with them."""
        self.temp = None
        for q in self.params:
            q.main_grad = None


class _Group:
    """Params of one (param dtype, main grads dtype, comm dtype, device), their buffers."""

    def __init__(self, ddp, key, params, bucket_size):
        self.param_dtype, self.grad_dtype, self.comm_dtype, self.device = key
        world, sharded = ddp.world_size, ddp.sharding != "no_shard"
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
        for chunk in chunks:
            begin = start
            for p in chunk:
                self.offset[p] = start
                start += p.numel()
            numel = start - begin
            if sharded:  # equal shards for every rank
                numel = -(-numel // world) * world
            self.buckets.append(_Bucket(self, chunk, begin, numel))
            start = begin + numel
        self.numel = start

        kw = dict(device=self.device)
        self.grad_data = None
        if ddp.sharding != "optim_grads":
            self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, **kw)
        for p in params:  # optim_grads: only while its bucket's full-size buffer lives
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
        if ddp.sharding == "optim_grads":
            self.grad_shard_data = torch.zeros(self.numel // world, dtype=self.grad_dtype, **kw)
            for b in self.buckets:
                lo = b.start // world
                b.grad_shard = self.grad_shard_data[lo:lo + b.numel // world]

    def view(self, buf, p):
        """p's elements of a group-sized buffer, shaped like p."""
        off = self.offset[p]
        return buf[off:off + p.numel()].view(p.shape)


# ---------------------------------------------------------------------------
# The wrapper
# ---------------------------------------------------------------------------


def _owner(p):
    ref = getattr(p, "_precis_ddp", None)
    return ref() if ref is not None else None


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism with gradient buffers in the policy's dtypes (see the module
    docstring): forward is the wrapped module's; params and buffers are broadcast
    from the group's rank 0 at construction.

    module: an nn.Module whose params are contiguous and on one device per dtype
    group. policy: None, a precis.Policy or a mapping of overrides. process_group:
    default the world. bucket_size: elements per bucket. sharding: "no_shard",
    "optim" or "optim_grads". overlap_grad_reduce: launch bucket reductions during
    backward (False: all at the end of backward). check_for_nan_in_grad: before
    each collective, raise (on every rank) if a gradient has a NaN/Inf, naming the
    param and the rank.
    """

    def __init__(self, module, policy=None, process_group=None, bucket_size=None,
                 sharding="no_shard", overlap_grad_reduce=True, check_for_nan_in_grad=False):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("precis DDP: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first")
        if sharding not in STRATEGIES:
            raise ValueError(f"precis DDP: sharding={sharding!r}; accepted: "
                             f"{', '.join(STRATEGIES)}")
        if bucket_size is None:
            bucket_size = DEFAULT_BUCKET_SIZE
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"precis DDP: bucket_size must be an int >= 1 (elements), "
                             f"got {bucket_size!r}")
        self.module = module
        self.policy = policy
        self.sharding = sharding
        self.bucket_size = bucket_size
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.check_for_nan_in_grad = bool(check_for_nan_in_grad)
        self.process_group = process_group
        self._comm = _Comm(process_group)
        self.world_size, self.rank = self._comm.world, self._comm.rank

        self._names = {}
        for name, p in module.named_parameters():
            self._names.setdefault(p, name)
        params = [p for p in self._names if p.requires_grad]
        for p in params:
            if _owner(p) is not None:
                raise ValueError(f"precis DDP: parameter {self._names[p]!r} already belongs "
                                 f"to another precis DistributedDataParallel")
            if not p.is_contiguous():
                raise ValueError(f"precis DDP: parameter {self._names[p]!r} is not contiguous")

        # Same starting point everywhere: rank 0's params and buffers.
        with torch.no_grad():
            for p in self._names:
                self._comm.broadcast(p)
            for b in module.buffers():
                self._comm.broadcast(b)

        by_key = {}
        for p in params:
            pol = policy_for(policy, p.dtype, "precis DDP")
            key = (p.dtype, pol.main_grads_dtype, pol.grad_comm_dtype, p.device)
            by_key.setdefault(key, []).append(p)
        self._groups = [_Group(self, key, ps, bucket_size) for key, ps in by_key.items()]
        # One launch order for all buckets, the same on every rank: by when their
        # first param's gradient is expected (reverse registration order).
        position = {p: i for i, p in enumerate(reversed(params))}
        self._buckets = sorted((b for g in self._groups for b in g.buckets),
                               key=lambda b: position[b.params[0]])
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._group_of = {p: g for g in self._groups for p in g.offset}
        self._pieces = {}

        self._sync_enabled = True
        self._next_launch = 0         # index in self._buckets of the next bucket to launch
        self._active = False          # gradients arrived since the last finish
        self._synced = False          # the buffers hold a finished, synchronized step
        self._callback_queued = False
        self._hooks = []
        ref = weakref.ref(self)
        for p in params:
            p._precis_ddp = ref
            self._register_hook(p, ref)

    # -- hooks --------------------------------------------------------------

    def _register_hook(self, p, ref):
        def ready(*_):
            ddp = ref()
            if ddp is not None:
                ddp._on_grad(p)

        self._hooks.append(p.register_post_accumulate_grad_hook(ready))

    def _reduces_now(self):
        return self._sync_enabled or self.sharding == "optim_grads"

    @torch.no_grad()
    def _on_grad(self, p):
        name = self._names[p]
        if self._synced:
            raise RuntimeError(
                f"precis DDP: the gradient of {name!r} arrived after this step's gradients "
                f"were synchronized. Call optimizer.zero_grad() (or zero_grad_buffer()) "
                f"before the next backward, and use no_sync() for every backward of a step "
                f"but the last.")
        b = self._bucket_of[p]
        if b.launched:
            raise RuntimeError(f"precis DDP: the gradient of {name!r} arrived after its bucket "
                               f"was reduced (one backward per micro-batch)")
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._active = True
        if p.grad is not None:
            grad = p.grad
            if grad.is_sparse:
                raise RuntimeError(f"precis DDP: {name!r} has a sparse gradient (unsupported)")
            ops.accumulate_(self._main_grad(p, b), grad.contiguous())
            p.grad = None
        b.ready.add(p)
        if self.overlap_grad_reduce and self._reduces_now():
            self._launch_ready()

    def _main_grad(self, p, b):
        if self.sharding == "optim_grads" and b.temp is None:
            self._new_temp(b)
        return p.main_grad

    def _new_temp(self, b):
        g = b.group
        b.temp = torch.zeros(b.numel, dtype=g.grad_dtype, device=g.device)
        for q in b.params:
            q.main_grad = b.temp[g.offset[q] - b.start:][:q.numel()].view(q.shape)

    def _end_of_backward(self):
        self._callback_queued = False
        if self._reduces_now():
            self.finish_grad_sync()
        else:  # no_sync: keep accumulating; readiness starts over next micro-batch
            for b in self._buckets:
                b.ready.clear()

    # -- reduction ----------------------------------------------------------

    def _launch_ready(self):
        # Strictly in order, so every rank issues the same sequence of collectives.
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b):
        b.launched = True
        g, world = b.group, self.world_size
        if self.sharding == "optim_grads":
            if b.temp is None:  # no gradient here this micro-batch: contribute zeros
                self._new_temp(b)
            src = b.temp
        else:
            src = g.grad_data[b.start:b.start + b.numel]
        if self.check_for_nan_in_grad:
            self._check_finite(b, src)
        if world == 1:  # nothing to reduce, nothing to scale
            if self.sharding == "optim_grads":
                b.pending = _Pending(then=lambda: self._keep_shard(b, src))
            return
        comm = src
        if g.comm_dtype != g.grad_dtype:
            comm = torch.empty(b.numel, dtype=g.comm_dtype, device=g.device)
        _scale_into(src, comm, 1.0 / world)

        if self.sharding == "no_shard":
            pending = self._comm.all_reduce(comm)
            then = (lambda: ops.cast_(src, comm)) if comm is not src else None
        else:
            pending = self._comm.reduce_scatter(comm)
            lo, hi = b.shard_range(world, self.rank)
            lo, hi = lo - b.start, hi - b.start
            if self.sharding == "optim":
                # Copy the reduced shard into the buffer, never add: the buffer
                # already holds this rank's local gradient (it would count twice).
                then = (lambda: ops.cast_(src[lo:hi], comm[lo:hi])) \
                    if comm is not src else None
            else:
                then = lambda: self._keep_shard(b, comm[lo:hi])  # noqa: E731
        pending.then = _chain(pending.then, then)
        b.pending = pending

    def _keep_shard(self, b, reduced):
        # optim_grads: the full-size buffer was fresh this micro-batch, so its reduced
        # shard is this micro-batch's contribution: add it, then free the buffer.
        ops.accumulate_(b.grad_shard, reduced)
        b.drop_temp()

    def _check_finite(self, b, src):
        first_bad = 0
        if int(ops.count_nonfinite(src)) > 0:
            g = b.group
            for i, q in enumerate(b.params):
                off = g.offset[q] - b.start
                if int(ops.count_nonfinite(src[off:off + q.numel()])) > 0:
                    first_bad = i + 1
                    break
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=src.device)
        flags[self.rank] = first_bad
        if self.world_size > 1:  # every rank learns who had one, so all raise together
            dist.all_reduce(flags, group=self.process_group)
        found = [(r, b.params[i - 1]) for r, i in enumerate(flags.tolist()) if i > 0]
        if found:
            where = "; ".join(f"parameter {self._names[q]!r} on rank {r}" for r, q in found)
            raise RuntimeError(f"precis DDP: NaN or Inf in the gradient of {where} (found "
                               f"before the gradient reduction, which would spread it to "
                               f"every rank)")

    @torch.no_grad()
    def finish_grad_sync(self):
        """Launch every bucket not yet launched, in order, and wait for all of them.

        Called by itself at the end of every backward that reduces, and by the
        optimizer's step(); a no-op when nothing is pending (or inside no_sync(),
        except under optim_grads, which reduces every micro-batch).
        """
        if not self._active or not self._reduces_now():
            return
        while self._next_launch < len(self._buckets):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        for b in self._buckets:
            b.settle()
        self._next_launch = 0
        self._active = False
        self._synced = self._sync_enabled

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (except under optim_grads)."""
        before = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = before

    @torch.no_grad()
    def zero_grad_buffer(self):
        """Clear the gradient buffers (and param.grad) for the next step."""
        for b in self._buckets:
            b.settle()
            if b.temp is not None:
                b.drop_temp()
        for g in self._groups:
            for buf in (g.grad_data, g.grad_shard_data):
                if buf is not None:
                    buf.zero_()
        for p in self._bucket_of:
            p.grad = None
        self._next_launch = 0
        self._active = self._synced = False
        self._callback_queued = False

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none=set_to_none)
        self.zero_grad_buffer()

    @torch.no_grad()
    def gather_params(self):
        """Sharded strategies: every rank's shard of the params to every rank."""
        if self.sharding == "no_shard" or self.world_size == 1:
            return
        pending = [self._comm.all_gather(b.group.param_data[b.start:b.start + b.numel])
                   for b in self._buckets]
        for p in pending:
            p.wait()

    # -- the optimizer's view -------------------------------------------------

    def _optimizer_params(self, p):
        """What an optimizer steps for param p: p itself (no_shard), or the flat
        piece of p inside this rank's shard, with its main_grad (none if p lies in
        other ranks' shards)."""
        if self.sharding == "no_shard":
            return [p]
        if p not in self._pieces:
            g, b = self._group_of[p], self._bucket_of[p]
            lo, hi = b.shard_range(self.world_size, self.rank)
            off = g.offset[p]
            start, stop = max(off, lo), min(off + p.numel(), hi)
            pieces = []
            if start < stop:
                # A view of p itself: p's version counter tells the optimizer when the
                # param was written behind its back (e.g. a checkpoint load).
                piece = p.detach().view(-1)[start - off:stop - off]
                if self.sharding == "optim":
                    piece.main_grad = g.grad_data[start:stop]
                else:
                    piece.main_grad = b.grad_shard[start - lo:stop - lo]
                piece._precis_ddp_piece = (self._names[p], start - off, stop - off)
                pieces.append(piece)
            self._pieces[p] = pieces
        return self._pieces[p]

    def _nonfinite_in_shard(self):
        """NaN/Inf count of this rank's reduced gradient shards."""
        count = 0
        for b in self._buckets:
            g = b.group
            if self.sharding == "optim_grads":
                count += int(ops.count_nonfinite(b.grad_shard))
            else:
                lo, hi = b.shard_range(self.world_size, self.rank)
                count += int(ops.count_nonfinite(g.grad_data[lo:hi]))
        return count

    # -- introspection ----------------------------------------------------------

    @property
    def comm_bytes(self):
        """Payload bytes this rank handed to collectives, per kind, since construction."""
        return dict(self._comm.sent)

    def buffer_bytes(self):
        """Bytes of the buffers this wrapper allocated: grad (full-size gradient
        buffers), grad_shard (optim_grads), param (sharded param buffers), and the
        number of elements the buffers hold (numel, padding included)."""
        out = {"grad": 0, "grad_shard": 0, "param": 0, "numel": 0}
        for g in self._groups:
            out["numel"] += g.numel
            for key, buf in (("grad", g.grad_data), ("grad_shard", g.grad_shard_data),
                             ("param", g.param_data)):
                if buf is not None:
                    out[key] += _nbytes(buf)
        return out

    def buffer_dtypes(self):
        """[(param dtype, main grads dtype, comm dtype)] of each buffer group."""
        return [(g.param_dtype, g.grad_dtype, g.comm_dtype) for g in self._groups]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# ---------------------------------------------------------------------------
# The optimizer side
# ---------------------------------------------------------------------------


class _Attachment:
    """What attach_optimizer() keeps on an optimizer: its wrappers, the originals."""

    def __init__(self, optimizer, wrappers):
        self.wrappers = wrappers
        self.sharded = [w for w in wrappers if w.sharding != "no_shard"]
        self.step, self.zero_grad = optimizer.step, optimizer.zero_grad
        self.state_dict, self.load_state_dict = optimizer.state_dict, optimizer.load_state_dict


def optimizer_pieces(optimizer):
    """[param name, start, stop] of every tensor the optimizer steps, in param-group
    order: elements [start, stop) of the flattened param (a whole param has start
    0, stop numel; names are None for params of no precis DDP wrapper)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            piece = getattr(p, "_precis_ddp_piece", None)
            if piece is not None:
                out.append(list(piece))
            else:
                ddp = _owner(p)
                out.append([ddp._names[p] if ddp is not None else None, 0, p.numel()])
    return out


def _uses_grad_scale(optimizer, kwargs):
    return kwargs.get("grad_scale") is not None or \
        getattr(optimizer, "grad_scale", None) is not None


def attach_optimizer(optimizer):
    """Make an optimizer step the params of precis DDP wrappers correctly.

    Params of sharded wrappers are replaced, in the param groups, by their pieces
    in this rank's shard; step() then finishes every wrapper's gradient sync
    first and all-gathers the params after; zero_grad() also clears the gradient
    buffers; with a sharded wrapper, state_dict() / load_state_dict() carry and
    check the 'precis_ddp' key (module docstring). Params of no wrapper are left
    alone, and an optimizer without any is returned untouched. precis optimizers
    call this themselves; calling it again is a no-op. Returns the optimizer.
    """
    if getattr(optimizer, "_precis_ddp", None) is not None:
        return optimizer
    wrappers, replaced, new_params = [], [], []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            ddp = _owner(p)
            if ddp is None:
                params.append(p)
                continue
            if ddp not in wrappers:
                wrappers.append(ddp)
            pieces = ddp._optimizer_params(p)
            if len(pieces) != 1 or pieces[0] is not p:
                replaced.append(p)
            params.extend(pieces)
        new_params.append(params)
    if not wrappers:
        return optimizer
    for group, params in zip(optimizer.param_groups, new_params):
        group["params"] = params
    for p in replaced:  # state of a replaced param would never be used again
        optimizer.state.pop(p, None)
    inner = _Attachment(optimizer, wrappers)

    def step(*args, **kwargs):
        for w in inner.wrappers:  # every model chunk, not only the first
            w.finish_grad_sync()
        if inner.sharded and kwargs.get("found_inf") is None and \
                _uses_grad_scale(optimizer, kwargs):
            # Each rank checks only its shard: agree on skipping, or the ranks diverge.
            first = inner.sharded[0]
            bad = torch.tensor([sum(w._nonfinite_in_shard() for w in inner.sharded)],
                               dtype=torch.int64, device=first._groups[0].device)
            dist.all_reduce(bad, group=first.process_group)
            kwargs["found_inf"] = torch.tensor(float(bad.item() > 0))
        out = inner.step(*args, **kwargs)
        for w in inner.sharded:
            w.gather_params()
        return out

    def zero_grad(*args, **kwargs):
        inner.zero_grad(*args, **kwargs)
        for w in inner.wrappers:
            w.zero_grad_buffer()

    def meta():
        return {"format": STATE_DICT_FORMAT, "world_size": wrappers[0].world_size,
                "rank": wrappers[0].rank, "sharding": [w.sharding for w in wrappers],
                "pieces": optimizer_pieces(optimizer)}

    def state_dict():
        sd = inner.state_dict()
        if inner.sharded:  # unsharded state is the same everywhere: a plain state dict
            sd = dict(sd)
            sd[STATE_DICT_KEY] = meta()
        return sd

    def load_state_dict(state_dict):
        if isinstance(state_dict, Mapping) and STATE_DICT_KEY in state_dict:
            state_dict = dict(state_dict)
            saved, want = state_dict.pop(STATE_DICT_KEY), meta()
            for key in ("format", "world_size", "rank", "sharding", "pieces"):
                got = saved.get(key) if isinstance(saved, Mapping) else None
                if got != want[key]:
                    detail = "" if key == "pieces" else f": saved {got!r}, here {want[key]!r}"
                    raise ValueError(
                        f"load_state_dict: the state dict's precis_ddp {key} does not match "
                        f"this run{detail}; a sharded optimizer state loads only into the "
                        f"same world size, rank, model and sharding")
        elif inner.sharded:
            raise ValueError("load_state_dict: this optimizer steps shards of a sharded precis "
                             "DDP model, but the state dict has no 'precis_ddp' key (it was "
                             "not saved by a sharded optimizer)")
        return inner.load_state_dict(state_dict)

    optimizer.step = step
    optimizer.zero_grad = zero_grad
    optimizer.state_dict = state_dict
    optimizer.load_state_dict = load_state_dict
    optimizer._precis_ddp = inner
    return optimizer


# ---------------------------------------------------------------------------
# A communication hook for torch.nn.parallel.DistributedDataParallel
# ---------------------------------------------------------------------------


def comm_hook(policy=None):
    """A hook for torch DDP's register_comm_hook that all-reduces each bucket in the
    policy's grad_comm_dtype (resolved per bucket dtype, `policy` as in precis.optim),
    averaged over the group, and writes the result back into the bucket in its own
    dtype. The comm-dtype copy lives only until its all-reduce is done.

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(process_group, precis.ddp.comm_hook({"grad_comm_dtype": "bf16"}))

    The hook's state is the process group (None: the world).
    """
    comms = {}
    dtypes = {}

    def hook(state, bucket):
        buf = bucket.buffer()
        comm = comms.get(id(state))
        if comm is None:
            comm = comms[id(state)] = _Comm(state)
        if buf.dtype not in dtypes:
            dtypes[buf.dtype] = policy_for(policy, buf.dtype, "precis DDP").grad_comm_dtype
        comm_dtype = dtypes[buf.dtype]
        if comm.world == 1:
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut
        tmp = buf
        if comm_dtype != buf.dtype:
            tmp = torch.empty(buf.shape, dtype=comm_dtype, device=buf.device)
        _scale_into(buf, tmp, 1.0 / comm.world)
        (work,) = comm.all_reduce(tmp).works
        held = [tmp]

        def done(fut):
            fut.wait()  # surfaces an error of the collective
            tmp_ = held.pop()  # drop the comm-dtype copy as soon as it is written back
            if tmp_ is not buf:
                ops.cast_(buf, tmp_)
            return buf

        return work.get_future().then(done)

    return hook
