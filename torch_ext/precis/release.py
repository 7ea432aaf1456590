"""Gradient release (precis.optim.release_gradients): each param is stepped inside
backward, as soon as its gradient for this backward is final, and its gradient is freed
there, so at the peak of backward only the gradients not yet stepped are alive.

    release = precis.optim.release_gradients(opt)
    for batch in data:
        loss_fn(model(batch)).backward()  # steps every param, frees its .grad
        opt.step()                        # finishes the step (see below)
        opt.zero_grad()                   # nothing left to zero; harmless
    release.remove()                      # back to the ordinary loop

A param is stepped by the optimizer's own step (adam_step.run, for that param alone):
for the same gradients its params and state get the bits of an ordinary step, for every
precis optimizer and policy; hyperparameters and LR schedulers are read at each param's
step, so changing them between backwards works as in the ordinary loop.

What the mode changes, and what it refuses:
  * opt.step() finishes the step: it steps the params that still hold a gradient (one
    set by hand, or of a param no backward reached) and ends the step, so the next
    backward may step every param again. Call it after every backward.
  * Gradient accumulation over micro-batches: a second gradient for a param before
    opt.step() raises before that param is stepped (the first backward's steps are
    taken). Use the ordinary loop (remove()) to accumulate.
  * Global gradient-norm clipping: torch.nn.utils.clip_grad_norm_ after backward sees
    no gradients (they were freed) and clips nothing. The global norm is known only
    once every param was stepped, so max_norm= clips by a lower bound of it: the larger
    of the previous backward's global norm and this backward's so far (the gradients
    stepped before, and those being stepped). Each gradient is multiplied in the kernel
    by min(1, max_norm / that bound): a spike is clipped from its first gradients on,
    the first gradients of a backward less than exact clipping would, and the step
    after a spike more (docs/design.md section 11.1, and what it measured).
  * A non-finite gradient: that param is not stepped (neither the param nor its state
    change; the kernel checks before it writes), the others are. The params skipped in
    a backward are in `skipped` after it and a NonFiniteGradientWarning names them.
    A GradScaler's skip cannot be all-or-nothing here: pass the loss scale as
    grad_scale= (unscaled in the kernel), and lower the scale when `skipped` is not empty.
  * FSDP2 (torch's fully_shard, precis.fsdp): torch hands each unit's reduce-scattered
    shard to the sharded param's gradient hooks, so each shard is stepped as soon as its
    reduce-scatter is done (the reduced gradient, never a stale one) and freed; the
    ranks' hooks come in one order, so the collectives of a step (agreeing on a
    non-finite gradient, Muon's whole matrices) line up. precis.ddp's params (buckets,
    ZeRO pieces) are refused: their gradients are final after a bucket's reduction,
    which the hooks do not follow yet.
"""

import math
import warnings

import torch
from torch.autograd import Variable

from . import adam_step


def held_bytes(p):
    """Bytes of p's gradient held here (a DTensor's local shard)."""
    grad = p.grad
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    return grad.numel() * grad.element_size()


class NonFiniteGradientWarning(UserWarning):
    """Params whose gradient had an Inf/NaN were not stepped in a released backward."""


def release_gradients(optimizer, *, max_norm=None, grad_scale=None, bucket_bytes=0):
    """Step optimizer's params inside backward (see the module docstring); returns the
    GradientRelease, whose remove() gives the ordinary loop back.

    max_norm: clip by a lower bound of the global gradient norm (the larger of the
    previous backward's and this one's so far; None: no clipping).
    grad_scale: the loss scale the gradients carry (a number; unscaled in the kernel).
    bucket_bytes: step the ready params together once their gradients reach this many
    bytes (and the rest at the end of backward): one op call for many small params, at
    the price of that many bytes of gradients kept alive; 0 steps each param alone."""
    return GradientRelease(optimizer, max_norm=max_norm, grad_scale=grad_scale,
                           bucket_bytes=bucket_bytes)


class GradientRelease:
    """The hooks of one optimizer in release mode, and what they found."""

    def __init__(self, optimizer, *, max_norm=None, grad_scale=None, bucket_bytes=0):
        name = type(optimizer).__name__
        books = getattr(optimizer, "_books", None)
        if books is None:
            raise TypeError(f"release_gradients: {name} is not a precis optimizer")
        if books.release is not None:
            raise ValueError(f"release_gradients: {name} is already in release mode; "
                             f"remove() its release first")
        if max_norm is not None and not (isinstance(max_norm, (int, float))
                                         and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"release_gradients: max_norm must be a finite number > 0, "
                             f"got {max_norm!r}")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or \
                bucket_bytes < 0:
            raise ValueError(f"release_gradients: bucket_bytes must be an int >= 0, "
                             f"got {bucket_bytes!r}")
        self._optimizer = optimizer
        self._where = {}  # id(param) -> (group index, param index)
        for gi, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                what = f"release_gradients: {name} param {i} of group {gi}"
                if hasattr(p, "main_grad") or hasattr(p, "_precis_ddp_piece"):
                    raise ValueError(f"{what} belongs to precis.ddp: release under data "
                                     f"parallelism is not supported yet (a gradient is final "
                                     f"only after its bucket's reduction)")
                if id(p) in self._where:
                    raise ValueError(f"{what} is also in group {self._where[id(p)][0]}")
                self._where[id(p)] = (gi, i)
        self.max_norm = max_norm
        self.grad_scale = grad_scale  # the loss scale the gradients carry, or None
        self.bucket_bytes = bucket_bytes
        self._ready = []  # params whose gradient is final, not stepped yet (a bucket)
        self._ready_bytes = self._ready_held = 0  # whole gradients', this rank's
        self.skipped = []  # the params not stepped in the last backward (non-finite)
        self.last_norm = None  # the global gradient norm of the last backward (max_norm)
        # the most bytes of the optimizer's gradients alive at once in the last backward
        # (this rank's: a DTensor's local shard)
        self.peak_grad_bytes = 0
        self._peak_now = 0
        self._stepped = set()  # id(param) stepped since the last opt.step()
        self._in_backward = False
        self._skipped_now = []
        self._sum_squares = 0.0  # of this backward's gradients stepped so far (max_norm)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for group in optimizer.param_groups for p in group["params"]
                         if p.requires_grad]
        books.release = self

    def remove(self):
        """Remove the hooks: the optimizer steps in opt.step() again, as before."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._optimizer._books.release is self:
            self._optimizer._books.release = None

    # -- the optimizer's side (PrecisOptimizer.step) ---------------------------------

    def pending(self):
        """{group index: [param indices]} of the params opt.step() still has to step
        (a gradient not released), and the step ends: the next backward starts anew."""
        self._stepped.clear()
        only = {}
        for gi, group in enumerate(self._optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None or getattr(p, "main_grad", None) is not None:
                    only.setdefault(gi, []).append(i)
        return only

    # -- the hook ---------------------------------------------------------------

    def _on_grad(self, p):
        where = self._where.get(id(p))
        if where is None:  # added to the optimizer after release_gradients: not ours
            return
        gi, i = where
        if id(p) in self._stepped:
            name = f"{type(self._optimizer).__name__} param {i} of group {gi}"
            raise RuntimeError(
                f"release_gradients: {name} got a second gradient before optimizer.step(): "
                f"gradient accumulation over micro-batches is not supported in release mode "
                f"(each backward steps every param; this one was left as it was). Call "
                f"optimizer.step() after each backward, or remove() the release to accumulate")
        if not self._in_backward:
            self._in_backward = True
            self._skipped_now = []
            self._peak_now = 0
            Variable._execution_engine.queue_callback(self._backward_done)
        self._stepped.add(id(p))
        self._ready.append(p)
        # a bucket's size in whole gradients' bytes (the same on every rank of FSDP2:
        # each rank flushes at the same hook); the peak in the bytes this rank holds
        self._ready_bytes += p.grad.numel() * p.grad.element_size()
        self._ready_held += held_bytes(p)
        self._peak_now = max(self._peak_now, self._ready_held)
        if self._ready_bytes >= self.bucket_bytes:
            self._flush()

    @torch.no_grad()
    def _flush(self):
        """Step the params whose gradients are ready (one op call for those of the
        kernel; a bucket that a non-finite gradient skipped is stepped again a param at
        a time, so only that param is left out), and free their gradients."""
        ready, self._ready, self._ready_bytes, self._ready_held = self._ready, [], 0, 0
        groups = self._optimizer.param_groups
        by_torch = [p for p in ready if self._steps_by_torch(groups[self._where[id(p)][0]], p)]
        kernel = [p for p in ready if not any(p is q for q in by_torch)]
        for p in by_torch:
            self._step([p], by_torch=True)
        if kernel and not self._step(kernel) and len(kernel) > 1:
            for p in kernel:
                self._step([p])
        for p in ready:
            p.grad = None

    def _step(self, params, by_torch=False):
        """One step of params alone (adam_step.run): True if taken; a param skipped for
        a non-finite gradient is named in _skipped_now."""
        opt = self._optimizer
        books = opt._books
        only = {}
        for p in params:
            gi, i = self._where[id(p)]
            only.setdefault(gi, []).append(i)
        loss_scale = 1.0 if self.grad_scale is None else float(self.grad_scale)
        squares, scale = 0.0, loss_scale
        if self.max_norm is not None:
            squares = self._squares(params) / loss_scale ** 2
            scale = loss_scale * self._clip_divisor(squares)
        if by_torch:  # torch's own math takes no grad_scale: checked and unscaled here
            grad = params[0].grad
            taken = bool(torch.isfinite(grad).all())
            if taken:
                if scale != 1.0:
                    grad.div_(scale)
                adam_step.run(opt.param_groups, opt.state, books, None, None, only)
        else:
            # grad_scale (1 without loss scaling or clipping: the kernel multiplies by
            # 1 / grad_scale, exact) makes the kernel check every gradient before it writes
            adam_step.run(opt.param_groups, opt.state, books, scale, None, only)
            flag = books.last["found_inf"]
            taken = not (books.last["step_skipped"] or (flag is not None and float(flag) != 0.0))
        if not taken:
            if len(params) == 1:
                gi, i = self._where[id(params[0])]
                self._skipped_now.append(f"{type(opt).__name__} param {i} of group {gi}")
            return False
        self._sum_squares += squares  # the norm counts the gradients stepped
        return True

    @staticmethod
    def _squares(params):
        """The squared global norm of params' gradients (a DTensor's: all its shards')."""
        total = 0.0
        for p in params:
            norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            total += float(norm) ** 2
        return total

    def _clip_divisor(self, squares):
        """What clipping divides gradients whose squared norm is `squares` by: a lower
        bound of this backward's global norm over max_norm (at least 1), the bound the
        larger of the previous backward's norm and this one's so far (the gradients
        stepped, and these)."""
        so_far = math.sqrt(self._sum_squares + squares) if math.isfinite(squares) else 0.0
        bound = max(so_far, self.last_norm or 0.0)
        return bound / self.max_norm if bound > self.max_norm else 1.0

    @staticmethod
    def _steps_by_torch(group, p):
        """Whether torch's own math steps p (precis.torch_math: float64 / complex128
        params, differentiable=True groups)."""
        return p.dtype in (torch.float64, torch.complex128) or bool(group.get("differentiable"))

    def _backward_done(self):
        self._in_backward = False
        self._flush()
        self.skipped = self._skipped_now
        self.peak_grad_bytes = self._peak_now
        if self.max_norm is not None:
            self.last_norm = math.sqrt(self._sum_squares)
            self._sum_squares = 0.0
        if self.skipped:
            warnings.warn(
                f"release_gradients: {len(self.skipped)} params had an Inf/NaN gradient and "
                f"were not stepped in this backward ({', '.join(self.skipped[:5])}"
                f"{', ...' if len(self.skipped) > 5 else ''})", NonFiniteGradientWarning)
