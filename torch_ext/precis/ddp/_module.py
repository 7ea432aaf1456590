"""The module wrapper: gradient hooks, bucket reduction, the pieces an optimizer steps."""

import contextlib
import math
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from .. import ops, tracing, user_warnings
from .._lib import SCALE_BLOCK
from ..nested_backward import in_nested_backward, queue_at_the_end
from ..op_constants import keeps_block_scales
from ..policy import policy_for
from ._buffers import DEFAULT_BUCKET_SIZE, _Group
from ._comm import _Comm, _Pending, _chain, _nbytes, _scale_into
from ._sharding import STRATEGIES, Sharding
from ._whole import WholeParam


def _dead():
    return None


class WrapperRef:
    """A weak reference to a wrapper, kept on each of its params: pickled or deep-copied
    (torch.save of a param or of the module, an EMA copy) as None, as the copy belongs
    to no wrapper (a weakref itself does not pickle, and deepcopy kept the original's)."""

    __slots__ = ("_ref",)

    def __init__(self, wrapper):
        self._ref = weakref.ref(wrapper)

    def __call__(self):
        return self._ref()

    def __reduce__(self):
        return (_dead, ())


def owner(p):
    """The DistributedDataParallel whose buffers hold p's gradient, or None."""
    ref = getattr(p, "_precis_ddp", None)
    return ref() if ref is not None else None


def holder_owner(t):
    """The wrapper whose buffers hold the gradient of t, a tensor an attached optimizer
    steps (a param, or a sharded optimizer's piece of one), or None."""
    ref = getattr(t, "_precis_ddp_wrapper", None) or getattr(t, "_precis_ddp", None)
    return ref() if ref is not None else None


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism with gradient buffers in the policy's dtypes (see the package
    docstring): forward is the wrapped module's; params and buffers are broadcast
    from the group's rank 0 at construction. Attach the optimizer with
    precis.ddp.attach_optimizer().

    module: an nn.Module whose params are contiguous and on one device per dtype
    group. policy: None, a precis.Policy or a mapping of overrides. process_group:
    default the world. bucket_size: elements per bucket. sharding: a Sharding or its
    name: "no_shard", "optim" or "optim_grads". overlap_grad_reduce: launch bucket
    reductions during backward (False: all at the end of backward).
    check_for_nan_in_grad: before each collective, raise (on every rank) if a
    gradient has a NaN/Inf, naming the param and the rank (a debugging aid: it reads a
    count back from the device at each bucket).
    """

    def __init__(self, module, policy=None, process_group=None, bucket_size=None,
                 sharding="no_shard", overlap_grad_reduce=True, check_for_nan_in_grad=False):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("precis DDP: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first")
        sharding = Sharding.parse(sharding, "precis DDP")
        if sharding.shards_params:
            raise ValueError(f"precis DDP: sharding={sharding.value!r} shards the params "
                             f"themselves, which precis.ddp does not (it keeps whole params "
                             f"on every rank); accepted here: {', '.join(STRATEGIES)}")
        if bucket_size is None:
            bucket_size = DEFAULT_BUCKET_SIZE
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"precis DDP: bucket_size must be an int >= 1 (elements), "
                             f"got {bucket_size!r}")
        for name, flag in (("overlap_grad_reduce", overlap_grad_reduce),
                           ("check_for_nan_in_grad", check_for_nan_in_grad)):
            if type(flag) is not bool:  # ("no" from a config is no False)
                raise TypeError(f"precis DDP: {name} must be True or False, "
                                f"got {type(flag).__name__} {flag!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"precis DDP: process_group must be None (the world) or a "
                            f"torch.distributed ProcessGroup, got {type(process_group).__name__}")
        self.module = module
        self.policy = policy
        self.sharding = sharding
        self.bucket_size = bucket_size
        self.overlap_grad_reduce = overlap_grad_reduce
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self.process_group = process_group
        self._comm = _Comm(process_group)
        self.world_size, self.rank = self._comm.world, self._comm.rank

        self._names = {}
        for name, p in module.named_parameters():
            self._names.setdefault(p, name)
        params = [p for p in self._names if p.requires_grad]
        for p in params:
            if owner(p) is not None:
                raise ValueError(f"precis DDP: parameter {self._names[p]!r} already belongs "
                                 f"to another precis DistributedDataParallel")
            if not p.is_contiguous():
                raise ValueError(f"precis DDP: parameter {self._names[p]!r} is not contiguous")
        policies = {p: policy_for(policy, p.dtype, "precis DDP") for p in params}  # (a bad
        # one refused before the broadcast writes this rank's params)

        # Same starting point everywhere: rank 0's params and buffers.
        with torch.no_grad():
            for p in self._names:
                self._comm.broadcast(p)
            for b in module.buffers():
                self._comm.broadcast(b)

        by_key, scaled = {}, set()
        for p in params:
            pol = policies[p]
            key = (p.dtype, pol.main_grads_dtype, pol.grad_comm_dtype, pol.grad_sum_dtype,
                   p.device)
            by_key.setdefault(key, []).append(p)
            if keeps_block_scales(pol):
                scaled.add(key)
        # Block-scaled moments: shards cut at their scales' blocks (_Group's align).
        self._groups = [_Group(key, ps, bucket_size, self.world_size, sharding,
                               align=SCALE_BLOCK if key in scaled else 1)
                        for key, ps in by_key.items()]
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
        self._arrived = set()         # params whose gradient arrived since the buffers
                                      # were zeroed (the last step)
        self._synced = False          # the buffers hold a finished, synchronized step
        self._consumed = False        # an attached optimizer stepped on the buffers
        self._hidden = []             # (tensor, main_grad) hidden from a step (hide_grads)
        self.gradients_made = 0       # the buffers' gradients started anew (a count)
        self._callback_queued = False
        self._next_notify = 0         # index in self._buckets of the next bucket to hand out
        self._reduced_hooks = OrderedDict()  # on_reduced's (optimizer, listener)
        self._stepped_by = {}  # param -> weakref to the attached optimizer that steps it
        self._hooks = []
        ref = WrapperRef(self)
        for p in params:
            p._precis_ddp = ref
            self._register_hook(p, ref)

    # -- hooks --------------------------------------------------------------

    def _register_hook(self, p, ref):
        def ready(*_):
            if tracing.traced():  # (a backward inside a compiled call: its books eagerly)
                return tracing.run_eagerly(ready)
            ddp = ref()
            if ddp is not None:
                ddp._on_grad(p)

        self._hooks.append(p.register_post_accumulate_grad_hook(ready))

    def _reduces_now(self):
        return self._sync_enabled or self.sharding.reduces_every_micro_batch

    @torch.no_grad()
    def _on_grad(self, p):
        name = self._names[p]
        if self._consumed:  # the first gradient after a step: start from zero
            self._clear_grads()
        elif self._synced:
            raise RuntimeError(
                f"precis DDP: the gradient of {name!r} arrived after this step's gradients "
                f"were synchronized, and no attached optimizer has stepped on them. Call "
                f"optimizer.step() (precis.ddp.attach_optimizer) or zero_grad_buffer() "
                f"before the next backward, and use no_sync() for every backward of a step "
                f"but the last.")
        b = self._bucket_of[p]
        if b.launched:
            raise RuntimeError(f"precis DDP: the gradient of {name!r} arrived after its bucket "
                               f"was reduced (one backward per micro-batch; after a backward "
                               f"that raised, start over with the wrapper's zero_grad(), which "
                               f"clears its buffers: the optimizer's does not)")
        self._active = True
        if p.grad is not None:
            grad = p.grad
            if grad.is_sparse:
                raise RuntimeError(f"precis DDP: {name!r} has a sparse gradient (unsupported)")
            if self.sharding.shards_grads and b.temp is None:
                b.new_temp()
            ops.accumulate_(p.main_grad, grad.contiguous())
            p.grad = None
        b.ready.add(p)
        self._arrived.add(p)
        # The end-of-backward callback goes on the outermost backward: a gradient of a
        # nested one (a use_reentrant=True checkpoint's segment) would have it run when
        # that ends, before the outer backward's gradients. Nor does such a gradient
        # launch a bucket (the outer backward may add to its param's); the callback does.
        # (A look at the frames, made only where it decides something.)
        if not self._callback_queued:
            queue_at_the_end(self._end_of_backward)
            self._callback_queued = True
        if self.overlap_grad_reduce and self._reduces_now() and \
                len(b.ready) == len(b.params) and not in_nested_backward():
            self._launch_ready()  # (only a bucket this gradient filled lets one launch)

    def _end_of_backward(self):
        if tracing.traced():
            return tracing.run_eagerly(self._end_of_backward)
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
            # the bucket before it is handed out while this one reduces
            self._notify_reduced(self._next_launch - 1)

    def _launch(self, b):
        b.launched = True
        g, world = b.group, self.world_size
        if self.sharding.shards_grads:
            if b.temp is None:  # no gradient here this micro-batch: contribute zeros
                b.new_temp()
            src = b.temp
        else:
            src = g.grad_data[b.start:b.start + b.numel]
        if self.check_for_nan_in_grad:
            self._check_finite(b, src)
        if world == 1:  # nothing to reduce, nothing to scale
            if self.sharding.shards_grads:
                b.pending = _Pending(then=lambda: self._keep_shard(b, src))
            return
        comm = src
        if g.comm_dtype != g.grad_dtype:
            comm = torch.empty(b.numel, dtype=g.comm_dtype, device=g.device)
        if g.wide_sums:
            b.pending = self._launch_wide(b, src, comm)
            return
        _scale_into(src, comm, 1.0 / world)

        if not self.sharding.shards_optimizer_state:
            pending = self._comm.all_reduce(comm)
            then = (lambda: ops.cast_(src, comm)) if comm is not src else None
        else:
            pending = self._comm.reduce_scatter(comm)
            lo, hi = b.shard_range(world, self.rank)
            lo, hi = lo - b.start, hi - b.start
            if self.sharding.shards_grads:
                then = lambda: self._keep_shard(b, comm[lo:hi])  # noqa: E731
            else:
                # Copy the reduced shard into the buffer, never add: the buffer
                # already holds this rank's local gradient (it would count twice).
                then = (lambda: ops.cast_(src[lo:hi], comm[lo:hi])) \
                    if comm is not src else None
        pending.then = _chain(pending.then, then)
        b.pending = pending

    def _launch_wide(self, b, src, comm):
        # The wire carries the gradient unscaled; 1/world multiplies the wide sum,
        # so the only roundings are into the wire's dtype and from the sum.
        if comm is not src:
            ops.cast_(comm, src)
        scale = 1.0 / self.world_size
        if not self.sharding.shards_optimizer_state:
            pending = self._comm.all_reduce_wide(comm, b.group.sum_dtype, scale)
            if comm is not src:
                pending.then = _chain(pending.then, lambda: ops.cast_(src, comm))
            return pending
        lo, hi = b.shard_range(self.world_size, self.rank)
        if self.sharding.shards_grads:
            def done(total):
                self._keep_shard(b, total)
        else:
            def done(total):  # copy, never add: src holds this rank's local gradient
                ops.cast_(src[lo - b.start:hi - b.start], total)
        return self._comm.reduce_scatter_wide(comm, b.group.sum_dtype, scale, done)

    def _keep_shard(self, b, reduced):
        # Sharded grads: the full-size buffer was fresh this micro-batch, so its
        # reduced shard is this micro-batch's contribution: add it, free the buffer.
        ops.accumulate_(b.grad_shard, reduced)
        b.drop_temp()

    def _check_finite(self, b, src):
        first_bad = 0
        if int(ops.count_nonfinite(src)) > 0:
            g = b.group
            for i, q in enumerate(b.params):
                if int(ops.count_nonfinite(g.view(src, q, b.start))) > 0:
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

        Called by itself at the end of every backward that reduces, and before an
        attached optimizer's step(); a no-op when nothing is pending (or inside
        no_sync(), except under sharded grads, which reduce every micro-batch).
        """
        if not self._active or not self._reduces_now():
            return
        if self._sync_enabled:  # (the step's last micro-batch)
            self._warn_no_gradient()
        while self._next_launch < len(self._buckets):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        for b in self._buckets:
            b.wait()
        self._notify_reduced(len(self._buckets))
        for b in self._buckets:
            b.settle()
        self._next_launch = self._next_notify = 0
        self._active = False
        self._synced = self._sync_enabled

    def _warn_no_gradient(self):
        """Warn of this wrapper's params that got no gradient on this rank since the last
        step (frozen after wrapping, or not used): the optimizer steps them with the
        reduced gradient all the same. Only buckets not yet launched can hold one (a
        bucket launches early once all its params' gradients arrived)."""
        waiting = {p for b in self._buckets[self._next_launch:] if len(b.ready) < len(b.params)
                   for p in b.params if p not in self._arrived}
        missing = [name for p, name in self._names.items() if p in waiting]  # (model order)
        if missing:
            user_warnings.warn(
                f"precis DDP: {len(missing)} params got no gradient on rank {self.rank} since "
                f"the last step ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})"
                f": they are stepped with the reduced gradient all the same, zero where no "
                f"rank gave one, so momentum and weight decay still move them (torch's "
                f"optimizers leave a param without a gradient as it is). Every rank must "
                f"produce gradients for the same params in a step: set requires_grad=False "
                f"on frozen params before wrapping the model", UserWarning)

    # -- reduced buckets handed out (gradient release, precis.release) -------------

    def on_reduced(self, optimizer, fn):
        """Call fn(tensors, finite, squares) each time a bucket's reduction of a step's
        final gradient is complete (not inside no_sync(); in bucket order, the same on
        every rank; the bucket before the one just launched, while that one reduces),
        for the bucket's params that `optimizer` (attached) steps: tensors, what it steps
        for each (the param, or this rank's piece of it, perhaps empty and then not in
        the optimizer); finite, whether each one's reduced gradient is finite on every
        rank; squares, the squared norm of each one's whole reduced gradient (float64
        host numbers, agreed by one all-reduce a bucket when sharded). Returns a handle
        whose remove() stops it."""
        handle = RemovableHandle(self._reduced_hooks)
        self._reduced_hooks[handle.id] = (weakref.ref(optimizer), fn)
        return handle

    def _notify_reduced(self, upto):
        """Hand buckets [_next_notify, upto) to the on_reduced listeners, their
        collectives waited for."""
        while self._next_notify < upto:
            b = self._buckets[self._next_notify]
            self._next_notify += 1
            if not self._reduced_hooks or not self._sync_enabled:
                continue  # (inside no_sync, ZeRO-2 reduces a gradient not yet final)
            b.wait()
            tensors = [self._stepped_tensor(p) for p in b.params]
            grads = [t.main_grad for t in tensors]
            stats = torch.stack(
                [ops.count_nonfinite(g).to(torch.float64) for g in grads] +
                [torch.linalg.vector_norm(g, dtype=torch.float64).square()
                 for g in grads])
            if self.sharding.shards_optimizer_state and self.world_size > 1:
                dist.all_reduce(stats, group=self.process_group)
            stats = stats.tolist()
            finite = [count == 0 for count in stats[:len(grads)]]
            squares = stats[len(grads):]
            for optimizer, fn in list(self._reduced_hooks.values()):
                mine = [k for k, p in enumerate(b.params)
                        if self._stepped_by.get(p, _dead)() is optimizer()]
                if mine:
                    fn([tensors[k] for k in mine], [finite[k] for k in mine],
                       [squares[k] for k in mine])

    def _stepped_tensor(self, p):
        """What an attached optimizer steps for p: p, or this rank's piece of it."""
        if not self.sharding.shards_optimizer_state:
            return p
        if p not in self._pieces:  # (made by attach_optimizer, for its optimizer's params)
            self._optimizer_params(p)
        return self._pieces[p][0]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (except under optim_grads)."""
        before = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = before

    def hide_grads(self, tensors):
        """The main_grad of tensors (of this wrapper's, an attached optimizer steps them)
        set to None until show_grads(): an optimizer's step after its step on the same
        gradients sees none (torch's DDP leaves .grad None), not those again."""
        for t in tensors:
            self._hidden.append((t, t.main_grad))
            t.main_grad = None

    def show_grads(self):
        """The main_grads hide_grads() hid, back (after the step; or, where the step
        raised, before the next step or gradient)."""
        for t, grad in self._hidden:
            t.main_grad = grad
        self._hidden = []

    @torch.no_grad()
    def _clear_grads(self):
        """Zero the gradient buffers and start the reduction over (param.grad untouched)."""
        self.show_grads()
        self.gradients_made += 1
        for b in self._buckets:
            b.settle()
            if b.temp is not None:
                b.drop_temp()
        for g in self._groups:
            g.zero_grads()
        self._next_launch = self._next_notify = 0
        self._active = self._synced = self._consumed = False
        self._callback_queued = False
        self._arrived.clear()

    def zero_grad_buffer(self):
        """Clear the gradient buffers (and param.grad) for the next step; an attached
        optimizer's step() makes the next backward do this by itself."""
        self._clear_grads()
        for p in self._bucket_of:
            p.grad = None

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none=set_to_none)
        self.zero_grad_buffer()

    @torch.no_grad()
    def gather_params(self):
        """Sharded optimizer state: every rank's shard of the params to every rank."""
        if not self.sharding.shards_optimizer_state or self.world_size == 1:
            return
        pending = [self._comm.all_gather(b.group.param_data[b.start:b.start + b.numel])
                   for b in self._buckets]
        for p in pending:
            p.wait()

    # -- what an attached optimizer sees (precis.ddp._optimizer) -------------------

    def _optimizer_params(self, p, whole=False):
        """What an optimizer steps for param p: p itself (no_shard), or the flat
        piece of p inside this rank's shard, with its main_grad (none if p lies in
        other ranks' shards). whole: for an optimizer that steps each param whole
        (Muon): every rank gets a piece, empty where p lies in other ranks' shards,
        and each piece's `_precis_whole` (a WholeParam) assembles p for the step."""
        if not self.sharding.shards_optimizer_state:
            return [p]
        if p not in self._pieces:
            g, b = self._group_of[p], self._bucket_of[p]
            off, numel = g.offset[p], p.numel()
            ranges = []  # [start, stop) of p's elements in each rank's shard
            for rank in range(self.world_size):
                lo, hi = b.shard_range(self.world_size, rank)
                start, stop = max(off, lo) - off, min(off + numel, hi) - off
                ranges.append((start, stop) if start < stop else (0, 0))
            start, stop = ranges[self.rank]
            # A view of p itself: p's version counter tells the optimizer when the
            # param was written behind its back (e.g. a checkpoint load).
            piece = p.detach().view(-1)[start:stop]
            if self.sharding.shards_grads:  # the shard buffer begins at this rank's lo
                lo = b.shard_range(self.world_size, self.rank)[0] if start < stop else off
                piece.main_grad = b.grad_shard[off + start - lo:off + stop - lo]
            else:
                piece.main_grad = g.grad_data[off + start:off + stop]
            piece._precis_ddp_piece = (self._names[p], start, stop)
            piece._precis_ddp_wrapper = WrapperRef(self)  # (owner() is a whole param's)
            piece._precis_element_offset = start  # of its first element in p
            self._pieces[p] = (piece, ranges)
        piece, ranges = self._pieces[p]
        if whole:
            if not hasattr(piece, "_precis_whole"):
                piece._precis_whole = WholeParam(p.shape, ranges, self._comm)
            return [piece]
        return [piece] if piece.numel() else []

    def _grad_shards(self):
        """This rank's shard of every bucket's gradient (sharded optimizer state: where
        the reduced gradient the optimizer steps lies)."""
        for b in self._buckets:
            if self.sharding.shards_grads:
                yield b.grad_shard
            else:
                lo, hi = b.shard_range(self.world_size, self.rank)
                yield b.group.grad_data[lo:hi]

    def _nonfinite_in_shard(self):
        """NaN/Inf count of this rank's reduced gradient shards: a 0-dim int64 tensor
        on the first group's device, never read back here (no host sync)."""
        count = torch.zeros((), dtype=torch.int64, device=self._groups[0].device)
        for shard in self._grad_shards():
            count += ops.count_nonfinite(shard).to(count.device)
        return count

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ for this wrapper's gradients, which live in
        main_grad: after backward param.grad is None, so torch's own finds no gradient,
        returns 0 and clips nothing. The total norm of the reduced gradient (under
        sharded state every rank's shards, agreed by one all-reduce on the device),
        and every gradient the optimizer steps scaled by min(1, max_norm / (total +
        1e-6)), as torch's; nothing is read back to the host (error_if_nonfinite=True
        reads the total, as torch's). Call it after the backward that reduces, before
        optimizer.step(); it covers this wrapper's params (model chunks in several
        wrappers: clip by the norm of their norms yourself). norm_type: a number > 0
        or inf. Returns the total norm (a 0-dim float32 tensor)."""
        norm_type = float(norm_type)
        if not norm_type > 0.0:  # (NaN too)
            raise ValueError(f"precis DDP: clip_grad_norm_'s norm_type must be a number > 0 "
                             f"or inf, got {norm_type}")
        self.finish_grad_sync()
        sharded = self.sharding.shards_optimizer_state
        grads = [t for t in (self._grad_shards() if sharded else
                             (g.grad_data for g in self._groups)) if t.numel()]
        device = self._groups[0].device if self._groups else torch.device("cpu")
        # (|x|^p summed over the ranks' shards: their norms to the power p)
        power = 1.0 if math.isinf(norm_type) or not (sharded and self.world_size > 1) \
            else norm_type
        total = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)
                                 .to(device) for t in grads])
            total = torch.linalg.vector_norm(norms, norm_type) ** power
        if sharded and self.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else
                            dist.ReduceOp.SUM, group=self.process_group)
            total = total ** (1.0 / power)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"precis DDP: the total norm of order {norm_type} of the "
                               f"gradients is non-finite, so it cannot be clipped (set "
                               f"error_if_nonfinite=False to scale them by it anyway)")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for t in grads:
            t.mul_(coef.to(t.device))
        return total

    def _grads_consumed(self):
        """An attached optimizer stepped: the next gradient starts the buffers over."""
        self._consumed = True

    # -- introspection ----------------------------------------------------------

    @property
    def comm_bytes(self):
        """Payload bytes this rank handed to collectives, per kind, since construction."""
        return dict(self._comm.sent)

    def buffer_bytes(self):
        """Bytes of the buffers this wrapper allocated: grad (full-size gradient
        buffers), grad_shard (sharded grads), param (sharded param buffers), and the
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
