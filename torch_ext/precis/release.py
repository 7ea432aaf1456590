"""Gradient release (precis.optim.release_gradients): each param is stepped inside
backward, as soon as its gradient for this backward is final, and its gradient is freed
there, so at the peak of backward only the gradients not yet stepped are alive.

    release = precis.optim.release_gradients(opt)
    for batch in data:
        loss_fn(model(batch)).backward()  # steps every param, frees its .grad
        opt.step()                        # ends the step (see below)
        opt.zero_grad()                   # nothing left to zero; harmless
    release.remove()                      # back to the ordinary loop

Several optimizers (Muon's matrices + AdamW's rest): release_gradients(muon, adamw,
max_norm=...) releases each, clipped by one global norm (a GradientReleases).

A param is stepped by the optimizer's own step (functional.run, for that param alone):
for the same gradients its params and state get the bits of an ordinary step, for every
precis optimizer and policy; hyperparameters and LR schedulers are read at each param's
step, so changing them between backwards works as in the ordinary loop; every param
group (of every optimizer released together) is checked at a backward's first step
call, so a bad one (a NaN lr) raises before any param moves, as step() raises. A param
added to the optimizer later (add_param_group) is released too, and so is one frozen
when the release was made and unfrozen later (every param is hooked).

What the mode changes, and what it refuses:
  * opt.step() ends the step: it steps the params that still hold a gradient (one set
    by hand on a param no hook saw, or left by a backward that raised), so the next
    backward may step every param again; a gradient set by hand on a param a hook
    stepped is refused (it would be a second step). It steps them as a hook would,
    unscaled by grad_scale and each gradient
    checked (those with an Inf/NaN are named in `skipped`, GradientRelease.step_left),
    but not clipped. Call it after every backward. Its grad_scale= / found_inf= (and the
    optimizer's attributes of those names) are refused: the params were stepped in
    backward; give the loss scale to the release (grad_scale=).
  * Gradient accumulation over micro-batches: a second gradient for a param before
    opt.step() or opt.zero_grad() raises before that param is stepped (the first
    backward's steps are taken). Use the ordinary loop (remove()) to accumulate; under
    precis.ddp, no_sync() accumulates and the release steps after the last micro-batch.
  * Global gradient-norm clipping: torch.nn.utils.clip_grad_norm_ after backward sees
    no gradients (they were freed) and clips nothing. The global norm is known only
    once every param was stepped, so max_norm= clips by an estimate of it: this
    backward's norm so far (the gradients stepped before, and those being stepped),
    divided by the share of the total the same step calls held in past backwards
    (averaged), never below the norm so far. Each gradient is multiplied in the kernel
    by min(1, max_norm / that estimate). It follows the total's scale at once (a spike
    of the whole batch, a decaying norm), errs only as far as the norm's distribution
    over the params moves from its average, and is exact for the last params of a
    backward; with one bucket for every param (bucket_bytes above their bytes) it is
    exact global clipping (docs/design.md section 11.1): a flush is clipped by one
    divisor, every gradient of it counted (those torch's math steps too), and at the
    end of backward the last buckets of the optimizers released together are one
    flush. Several optimizers released together share the norm.
  * Reentrant activation checkpointing (use_reentrant=True) runs a nested backward per
    segment, and a weight used by two segments gets its gradient in pieces: a param
    whose gradient comes in a nested backward (in_nested_backward) is stepped when the
    outer backward ends (at opt.step() when no hook of the outer one came), then and
    in every later backward, with the ordinary bits; its gradient lives till then. A
    param stepped by its gradient from outside the segments and then given more by one
    is refused (RuntimeError naming use_reentrant=False), the params stepped before
    it staying stepped; the next backward defers it from the start.
  * A non-finite gradient: that param is not stepped (neither the param nor its state
    change; the kernel checks before it writes), the others are. The params skipped in
    a backward are in `skipped` after it and a NonFiniteGradientWarning names them (on a
    GPU once its verdicts are read: below). A GradScaler's skip cannot be
    all-or-nothing here: pass the loss scale as grad_scale= (unscaled in the kernel),
    and lower the scale when `skipped` is not empty. After opt.step(), the optimizer's
    last_step_skipped is True only if no param of the step was stepped.
  * On a GPU a hook waits for the device only where the host needs a value at once: a
    backward compares the params' fingerprints once (at its first step call, but those
    whose kept calls compare them at their own; on the device path it resyncs the
    written ones with a master or remainders there too: a write made during a
    backward, after that call and before a param's own, is not seen, as no load path
    makes one) and records them unread (fingerprints.Records: each call's op output); a
    call of one param leaves its Inf/NaN verdict there, and with capturable=True (step
    counts on the device) its clipping norm too (the estimate made on the device, with
    the host's bits); without capturable, max_norm reads each call's norm and verdict.
    The verdicts left there are copied back when the backward ends, without a wait, and
    read when asked for: `skipped`, the optimizer's last_step_skipped, whatever settles
    a backward that raised (below), opt.step() where it steps a param the hooks left, or
    the next backward's first step call (its params' step counts must be right): so
    opt.step() does not drain the device after each backward, and the next
    backward waits, if at all, for the last one's calls, behind which the next forward
    is queued. Until then a skipped param's step count, counted by the host at its
    call, is one too many (read, it is taken back); the warning comes with the read.
    Read at once: a bucket's verdict and norm (it may be stepped again a param at a
    time), and the verdicts of offloaded calls, of DTensors (their ranks agree first),
    of precis.ddp's buckets and of params torch's math steps.
  * A backward that raised: the params its hooks stepped stay stepped (call zero_grad()
    or step() before the next backward, as after any backward); those whose gradients
    were ready but not yet stepped keep them, as in the ordinary loop. The verdicts its
    hooks left on a device are read at the next step(), zero_grad(), remove(),
    state_dict(), load_state_dict(), decoded_state(), copy of the optimizer or backward,
    whichever comes first (GradientRelease.settle), before any step count is saved.
  * FSDP2 (torch's fully_shard, precis.fsdp): torch hands each unit's reduce-scattered
    shard to the sharded param's gradient hooks, so each shard is stepped as soon as its
    reduce-scatter is done (the reduced gradient, never a stale one) and freed; the
    ranks' hooks come in one order, so the collectives of a step (agreeing on a
    non-finite gradient, Muon's whole matrices, a DTensor's norm) line up.
  * Params on several devices: autograd runs each device's hooks on a thread of its
    own, in an order that varies from run to run. The hooks take turns (a lock), and
    a bucket holds one device's params (a param of another device steps the bucket
    first: a capturable step runs on one device). max_norm's estimate follows the
    order the gradients came in, so there the clipped bits can vary between runs;
    torch.autograd.set_multithreading_enabled(False) fixes the order.
  * precis.ddp: a bucket's params (ZeRO-1/2: this rank's pieces of them) are stepped
    once the bucket's reduction is complete, while later buckets reduce
    (DistributedDataParallel.on_reduced, which agrees on finiteness and norms across
    the ranks); its gradient buffers are the wrapper's and stay allocated.
"""

import threading
import weakref

import torch
from torch.autograd import Variable

from . import step_plan, functional, device_reads, fingerprints, optim_state
from . import step_calls, torch_math, tracing
from .kept_calls import KeptCalls, checked_as
from .nested_backward import in_nested_backward
from .release_clipping import Norm, positive_or_none, squared_norm, values
from .release_verdicts import Verdicts, warn_skipped
from .checkpoint import next_step
from .step_calls import counts_on_device
from .state_layout import FP32_LAYOUT


def held_bytes(p):
    """Bytes of p's gradient held here (a DTensor's local shard)."""
    grad = p.grad
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    return grad.numel() * grad.element_size()


# torch's FSDP2 with CPUOffloadPolicy copied each reduced gradient to the host with
# non_blocking=True and ran the post-accumulate-grad hooks before that copy was done,
# so a hook read a stale gradient (pytorch/pytorch#180666; torch 2.13 copies
# synchronously where a param has hooks).
OFFLOAD_COPY_MAY_BE_IN_FLIGHT = torch.__version__ < "2.13"


def wait_for_host_grad(p):
    """Wait until p's host gradient is there: on the torch versions above, a device
    sync before a hook reads an FSDP2 shard's gradient on the host while CUDA runs."""
    grad = p.grad
    if OFFLOAD_COPY_MAY_BE_IN_FLIGHT and grad is not None and grad.device.type == "cpu" \
            and hasattr(grad, "to_local") and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def hook_grad(p, fn):
    """p.register_post_accumulate_grad_hook(fn), for a frozen p too (torch refuses a hook
    on a tensor that does not require grad; the hook stays when p is unfrozen later)."""
    if p.requires_grad:
        return p.register_post_accumulate_grad_hook(fn)
    p.requires_grad_(True)
    try:
        return p.register_post_accumulate_grad_hook(fn)
    finally:
        p.requires_grad_(False)


def ddp_wrapper(t):
    """The precis.ddp wrapper whose buckets reduce t's gradient (t a whole param of it,
    or a piece attach_optimizer made), or None."""
    ref = getattr(t, "_precis_ddp", None) or getattr(t, "_precis_ddp_wrapper", None)
    return ref() if ref is not None else None


def graph_task():
    """The autograd graph task running now (a backward), or -1."""
    return torch._C._current_graph_task_id()


def waits_for(device):
    """Whether reading a value back from `device` waits for it (a GPU's queued work;
    the CPU's values are there already; a CPU on the device path waits as a GPU)."""
    return device_reads.device_path(device)


def written_behind_ids(optimizer, compared=frozenset()):
    """The ids of a precis optimizer's params written behind its back since it last
    stepped them (a load), for functional.run(changed=...): a release compares every
    param at a backward's first step call, in one pass (one read back a device), not
    each at its own call (which would wait for the device twice a call). None while a
    step is traced (nothing is compared). On the device path, {id: a flag on the device}
    (functional.compare_on_device: nothing read back), but for the params with a master
    or remainders: those are resynced here, decided on the device by their flags (a
    remainder by its blocks), a few calls a param group, not a few a param at its step
    (nothing writes a param, its master or remainder between a backward's first hook and
    its own), and recorded as they are (the compare's own fingerprints; blocks by the
    resync's: one this backward does not step is not resynced again at the next); but
    those of `compared`, whose kept calls compare them themselves
    (KeptCalls.compares_itself): on the device path not compared here at all (a
    call that steps one of them otherwise compares its params itself:
    GradientRelease._step)."""
    if not fingerprints.readable():
        return None
    books = optimizer._books
    for gi in list(books.plans):  # a plan holds its params' records (a release steps
        step_plan.drop_plan(books, gi)  # none by a plan): back to books.written first
    params = [p for group in optimizer.param_groups for p in group["params"]]
    now, rest = [], [p for p in params if id(p) not in compared]
    on_device = functional.compare_on_device(books, rest, now) if rest else {}
    if on_device is None:
        return set(map(id, optim_state.written_behind(books, params)))
    resynced = set()
    for gi, group in enumerate(optimizer.param_groups):
        entries = [(i, p, optimizer.state[p]) for i, p in enumerate(group["params"])
                   if id(p) in on_device and
                   ("master" in optimizer.state.get(p, ()) or
                    "remainder" in optimizer.state.get(p, ()))]
        if entries:
            functional.resync_written(books, gi, entries, on_device)
            resynced.update(id(p) for _, p, _ in entries)
    if resynced:
        ids, values = now
        at = [k for k, key in enumerate(ids) if key in resynced]
        books.written.record_values([ids[k] for k in at],
                                    values if len(at) == len(ids) else values[at])
    return {key: flag for key, flag in on_device.items() if key not in resynced}


def check_groups(optimizer):
    """Every param group of optimizer checked (ValueError naming the first bad one)."""
    books = optimizer._books
    for gi, group in enumerate(optimizer.param_groups):
        optim_state.rule_of(books, group).check(group, f"{books.name} param group {gi}")


def check_releases(norm):
    """Every param group of every optimizer released together (sharing norm) checked,
    once a backward, before its first step call: a bad hyperparameter (an lr a scheduler
    made NaN) in any group fails before any param moves, as the ordinary step() does."""
    if norm.checked != norm.task:
        for release in norm.live():
            check_groups(release._optimizer)
            release.kept.checks = {gi: checked_as(group) for gi, group
                                   in enumerate(release._optimizer.param_groups)}
        norm.checked = norm.task


def flush_releases(norm):
    """The end of a backward (a release's _backward_done, the first): every release's
    params still to step (the deferred ones of a nested backward, the last buckets)
    stepped, with max_norm all clipped by one divisor, every gradient counted in:
    with one bucket each (bucket_bytes above their bytes), exact global clipping
    across the optimizers."""
    releases = [r for r in norm.live() if id(r) in norm.open or r._deferred]
    for release in releases:
        if release._deferred and id(release) not in norm.open:
            release._arrived([])  # its books in this backward too
        deferred, release._deferred = release._deferred, {}
        for p in deferred.values():  # their gradients are final now
            if p.grad is not None:
                release._take(p)
    ready = [p for release in releases for p in release._ready]
    if norm.max_norm is None or len(ready) <= 1:
        for release in releases:
            release._flush()
        return
    squares = [[release._unscaled(squared_norm([p])) for p in release._ready]
               for release in releases]
    divisor = norm.divisor([sq for each in squares for sq in each], each=True)
    for release, each in zip(releases, squares):
        release._flush(divisor, each)
    norm.call_done()


def release_gradients(optimizer, *optimizers, max_norm=None, grad_scale=None, bucket_bytes=0):
    """Step optimizer's params inside backward (see the module docstring); returns the
    GradientRelease, whose remove() gives the ordinary loop back. The optimizer keeps
    it; the hooks keep neither (a dropped optimizer's hooks do nothing). Several
    optimizers (Muon's matrices + AdamW's rest): one release each, sharing max_norm's
    global norm and the param groups' check; returns a GradientReleases of them.

    max_norm: clip by an estimate of the global gradient norm (this backward's so far
    over its average share of the total at this point; None: no clipping).
    grad_scale: the loss scale the gradients carry (a finite number > 0; unscaled in the
    kernel); the attribute of that name may be changed between backwards.
    bucket_bytes: step the ready params together once their gradients reach this many
    bytes (and the rest at the end of backward): one op call for many small params, at
    the price of that many bytes of gradients kept alive; 0 steps each param alone."""
    optimizers = (optimizer,) + optimizers
    for i, opt in enumerate(optimizers):  # the refusals that need no hook, before any
        check_releasable(opt)
        if any(opt is other for other in optimizers[:i]):
            raise ValueError(f"release_gradients: {type(opt).__name__} is given twice")
    seen = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if seen.setdefault(id(p), opt) is not opt:
                    raise ValueError(f"release_gradients: a param of {type(opt).__name__} is "
                                     f"also in {type(seen[id(p)]).__name__}: it would be "
                                     f"stepped twice")
    norm = Norm(max_norm)
    releases = []
    try:
        for opt in optimizers:
            releases.append(GradientRelease(opt, grad_scale=grad_scale,
                                            bucket_bytes=bucket_bytes, norm=norm))
    except BaseException:
        for release in releases:  # no hook left behind
            release.remove()
        raise
    return releases[0] if len(releases) == 1 else GradientReleases(releases)


def check_releasable(optimizer):
    """TypeError / ValueError unless optimizer is a precis optimizer not in release mode."""
    name = type(optimizer).__name__
    books = getattr(optimizer, "_books", None)
    if books is None:
        raise TypeError(f"release_gradients: {name} is not a precis optimizer")
    if books.release is not None:
        raise ValueError(f"release_gradients: {name} is already in release mode; "
                         f"remove() its release first")


class GradientReleases:
    """The releases of several optimizers made by one release_gradients call: one
    global norm for max_norm (last_norm), one grad_scale; remove() removes them all."""

    def __init__(self, releases):
        self.releases = releases

    max_norm = property(lambda self: self.releases[0].max_norm,
                        lambda self, value: setattr(self.releases[0], "max_norm", value))
    last_norm = property(lambda self: self.releases[0].last_norm)
    skipped = property(lambda self: [name for r in self.releases for name in r.skipped])

    @property
    def grad_scale(self):
        return self.releases[0].grad_scale

    @grad_scale.setter
    def grad_scale(self, value):
        positive_or_none("grad_scale", value)  # (checked before any release changes)
        for release in self.releases:
            release.grad_scale = value

    def remove(self):
        for release in self.releases:
            release.remove()


class GradientRelease:
    """The hooks of one optimizer in release mode, and what they found. max_norm and
    grad_scale may be changed between backwards (checked when set). The clipping books
    are a Norm's, shared by the releases of one release_gradients call."""

    max_norm = property(lambda self: self._norm.max_norm,
                        lambda self, value: setattr(self._norm, "max_norm", value))
    last_norm = property(lambda self: self._norm.last_norm)
    _lock = property(lambda self: self._norm.lock)
    grad_scale = property(lambda self: self._grad_scale,
                          lambda self, value: setattr(self, "_grad_scale",
                                                      positive_or_none("grad_scale", value)))
    # held weakly: the optimizer keeps its release (books.release), not the other way
    # round, so that a dropped optimizer is freed at once and its hooks do nothing
    _optimizer = property(lambda self: self._optimizer_ref())

    def __init__(self, optimizer, *, max_norm=None, grad_scale=None, bucket_bytes=0,
                 norm=None):
        check_releasable(optimizer)
        books = optimizer._books
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or \
                bucket_bytes < 0:
            raise ValueError(f"release_gradients: bucket_bytes must be an int >= 0, "
                             f"got {bucket_bytes!r}")
        # max_norm, the norm's books and the lock the hooks take turns by (autograd runs
        # each device's hooks on its own thread); max_norm checked before any hook is left
        self._norm = Norm(max_norm) if norm is None else norm
        self.grad_scale = grad_scale  # the loss scale the gradients carry, or None
        self._optimizer_ref = weakref.ref(optimizer)
        self._where = {}  # id(param) -> (group index, param index)
        self._handles = []
        self._wrappers = []  # the precis.ddp wrappers listened to
        for gi in range(len(optimizer.param_groups)):
            self.track(gi)  # a refused param raises before any hook is left behind
        self.bucket_bytes = bucket_bytes
        # what its step calls found: the params skipped, whether the step took any
        self.verdicts = Verdicts(optimizer._books, self._name)
        # the most bytes of the optimizer's gradients alive at once in the last backward
        # (this rank's: a DTensor's local shard)
        self.peak_grad_bytes = 0
        self._stepped = set()  # id(param) stepped since the last opt.step() / zero_grad()
        self._task = None  # the backward (graph task) the books below are of
        # params whose gradient came in a nested backward (reentrant checkpointing),
        # stepped when the outer backward ends (id -> param), and every param seen so
        self._deferred, self._nested = {}, set()
        # ((the last hook's backward, its thread), whether nested there: _on_grad)
        self._task_nested = (None, False)
        # the op calls the full path made for its params, kept and made again, and each
        # group's check at this backward's start
        self.kept = KeptCalls(optimizer)
        self._start_backward(None)
        self._norm.releases.append(weakref.ref(self))
        books.release = self

    def track(self, gi):
        """Release the params of param group gi too (a group added after the release:
        PrecisOptimizer.add_param_group calls it); every param is checked first."""
        name = type(self._optimizer).__name__
        group = self._optimizer.param_groups[gi]
        others = [r for r in self._norm.live() if r is not self]
        hooked, wrappers = [], []
        for i, p in enumerate(group["params"]):
            if id(p) in self._where:
                raise ValueError(f"release_gradients: {name} param {i} of group {gi} is also "
                                 f"in group {self._where[id(p)][0]}")
            for other in others:  # (released together: release_gradients' check, again)
                if id(p) in other._where:
                    raise ValueError(f"release_gradients: {name} param {i} of group {gi} is "
                                     f"also in {type(other._optimizer).__name__}, released "
                                     f"with it: it would be stepped twice")
            wrapper = ddp_wrapper(p)
            if wrapper is None and hasattr(p, "main_grad"):
                raise ValueError(f"release_gradients: {name} param {i} of group {gi} has a "
                                 f"main_grad of no precis.ddp wrapper: its gradient's "
                                 f"reduction cannot be followed")
            if wrapper is not None:
                if not any(wrapper is w for w in self._wrappers + wrappers):
                    wrappers.append(wrapper)
            elif p.is_floating_point() or p.is_complex():  # a frozen param too: it may be
                hooked.append(p)  # made trainable later (fine-tuning); an int8 one never
        self._where.update((id(p), (gi, i)) for i, p in enumerate(group["params"]))
        ref = weakref.ref(self)  # the hooks must not keep the optimizer alive

        def on_grad(p):
            if tracing.traced():  # (a backward inside a compiled call: its books eagerly)
                return tracing.run_eagerly(on_grad, p)
            release = ref()
            if release is not None and release._optimizer is not None:
                with release._lock:
                    release._on_grad(p)

        def on_reduced(tensors, finite, squares):
            if tracing.traced():
                return tracing.run_eagerly(on_reduced, tensors, finite, squares)
            release = ref()
            if release is not None and release._optimizer is not None:
                with release._lock:
                    release._on_reduced(tensors, finite, squares)
        self._handles += [hook_grad(p, on_grad) for p in hooked]
        self._handles += [w.on_reduced(self._optimizer, on_reduced) for w in wrappers]
        self._wrappers += wrappers

    def remove(self):
        """Remove the hooks: the optimizer steps in opt.step() again, as before (the
        verdicts a backward that raised left on a device read first)."""
        self.settle()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        opt = self._optimizer
        if opt is not None and opt._books.release is self:
            opt._books.release = None
        self.kept.clear()

    @property
    def skipped(self):
        """The params not stepped in the last backward (an Inf/NaN gradient), by name. On
        a GPU the verdicts of its calls come back after it, without a wait: reading
        this reads them (waits for the device if they are not back yet), as the next
        backward, opt.state_dict() and the optimizer's last_step_skipped do."""
        if self.verdicts.skipped is None:
            with self._lock:
                self.verdicts.publish()
        return self.verdicts.skipped

    # -- the optimizer's side (PrecisOptimizer.step, zero_grad) -------------------

    def unstepped(self):
        """{group index: [param indices]} of the params holding a gradient that no hook
        stepped since the step began (what opt.step() still steps). The params only a
        nested backward gave gradients (every param in reentrant checkpoint segments) are
        stepped first, as their backward's end would have stepped them (clipped)."""
        releases = [r for r in self._norm.live() if r._deferred]
        with self._lock:
            for release in releases:
                release._arrived([])  # books outside a backward (task -1)
            for release in releases:
                release._backward_done("of the last backward")
        for p in self._ready:  # (taken, not stepped: a backward or a flush that raised)
            self._stepped.discard(id(p))
        only = {}
        for gi, group in enumerate(self._optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in self._stepped:
                    if p.grad is not None:  # (a hook freed the one it stepped with)
                        raise RuntimeError(
                            f"release_gradients: {self._name(p)} was stepped inside "
                            f"backward and holds a gradient set since (by hand?), which "
                            f"this step would drop or step a second time: opt.step() "
                            f"stepped nothing (zero_grad() drops it). Change gradients in "
                            f"a hook registered before release_gradients, or remove() "
                            f"the release")
                elif p.grad is not None or getattr(p, "main_grad", None) is not None:
                    only.setdefault(gi, []).append(i)
        return only

    @torch.no_grad()
    def step_left(self, only):
        """opt.step()'s steps of the params holding a gradient that no hook stepped
        (`only`, as unstepped() gives): as a hook steps them, unscaled by grad_scale and
        each gradient checked, but not clipped; the kernel's params in one call, stepped
        again a param at a time when an Inf/NaN skipped it (as _flush does a bucket).
        Those left as they were are named in `skipped`, with a NonFiniteGradientWarning.
        Returns whether any was stepped (or, capturable, left its verdict on the
        device)."""
        with self._lock:
            # (the hooks' verdicts first: a param they skipped is stepped with its count
            # taken back, and named with them)
            self.verdicts.publish()
            opt = self._optimizer
            check_groups(opt)  # every group, as the ordinary step() checks them
            scale = 1.0 if self.grad_scale is None else float(self.grad_scale)
            params = [opt.param_groups[gi]["params"][i]
                      for gi, indices in only.items() for i in indices]
            by_torch, kernel = [], []
            for p in params:
                (by_torch if p.grad is not None and self._steps_by_torch(p) else kernel).append(p)

            def kernel_step(ps):  # (None: capturable, its verdict left on the device)
                try:
                    functional.run(opt.param_groups, opt.state, opt._books, scale, None,
                                  self._indices(ps))
                finally:
                    self.kept.drop_lent_grads()
                return opt._books.last["step_skipped"] is not True
            taken = {}
            if kernel and kernel_step(kernel):
                taken.update((id(p), True) for p in kernel)
            else:
                taken.update((id(p), len(kernel) > 1 and kernel_step([p])) for p in kernel)
            taken.update((id(p), self._step_by_torch(p, scale)) for p in by_torch)
            skipped = [self._name(p) for p in params if not taken[id(p)]]
            # this step's: the backward's too when its hooks stepped params
            self.verdicts.skipped = (self.verdicts.skipped if self._stepped else []) + skipped
            warn_skipped(skipped, "left to opt.step()")
            return any(taken.values())

    def settle(self):
        """Read the verdicts the last backward (or one that raised) left on a device
        (remove(), the optimizer's last_step_skipped, and PrecisOptimizer's
        state_dict(), load_state_dict(), decoded_state() and copies: the step counts
        saved, copied or replaced are then the settled ones)."""
        with self._lock:
            self.verdicts.publish()

    def end_step(self, stepped=False):
        """opt.step() (stepped: whether it stepped params the hooks left) or zero_grad():
        the next backward may step every param again. The optimizer's last_step_skipped
        says whether nothing of the step was taken (every gradient non-finite)."""
        with self._lock:  # (settle() may run on another thread: a verdict is read once)
            if self._task == -1:  # books opened outside a backward (precis.ddp's sync)
                self._backward_done("of the last backward")
            self.verdicts.end_step(ended=bool(self._stepped) or stepped, stepped=stepped)
            self._stepped.clear()
            self._deferred.clear()  # (zero_grad(): their gradients are dropped)

    # -- the hooks ----------------------------------------------------------------

    def _on_grad(self, p):
        if p.grad is None:  # a backward that gave it no gradient (a None from a custom
            return          # Function): not stepped, as in the ordinary loop
        wait_for_host_grad(p)
        # (nested or not for the whole of a backward on one thread, read once: on a
        # device's thread a segment's hooks see no frame of the engine's run)
        where = (graph_task(), threading.get_ident())
        if self._task_nested[0] != where:
            self._task_nested = (where, in_nested_backward())
        nested = self._task_nested[1]
        if nested or id(p) in self._nested:
            self._defer(p, nested)
        else:
            self._take(p)

    def _defer(self, p, nested):
        """p's gradient came in a nested backward (a reentrant checkpoint's segment), now
        or in a backward before: another segment may add to it, so p is stepped when the
        outer backward ends (or at opt.step(), if no hook of the outer one came), its
        gradient kept till then, as the ordinary loop keeps it."""
        self._nested.add(id(p))  # (a backward after a refusal defers it from the start)
        if id(p) in self._stepped:  # stepped by its gradient outside the segments (or
            raise RuntimeError(     # by a backward before opt.step(): accumulation)
                f"release_gradients: {self._name(p)} got a gradient inside a reentrant "
                f"checkpoint (torch.utils.checkpoint's use_reentrant=True) after it was "
                f"stepped with its gradient from outside: use checkpoint(..., "
                f"use_reentrant=False), or remove() the release for this model (or, if "
                f"a backward before gave it one: call optimizer.step() after each "
                f"backward; gradient accumulation is not supported in release mode)")
        self._deferred[id(p)] = p
        if not nested:
            self._arrived([])  # the outer backward's books, and its end (_backward_done)

    def _take(self, p):
        """p's gradient is final: step it, alone or in a bucket."""
        self._arrived([p])
        if self._ready and self._ready[0].device != p.device:
            self._flush()  # a bucket holds one device's params
        self._ready.append(p)
        # a bucket's size in whole gradients' bytes (the same on every rank of FSDP2:
        # each rank flushes at the same hook); the peak in the bytes this rank holds
        self._ready_bytes += p.grad.numel() * p.grad.element_size()
        self._ready_held += held_bytes(p)
        self._peak_now = max(self._peak_now, self._ready_held)
        if self._ready_bytes >= self.bucket_bytes:
            self._flush()

    @torch.no_grad()
    def _on_reduced(self, tensors, finite, squares):
        """A precis.ddp bucket's reduction is complete (DistributedDataParallel.on_reduced):
        this rank's tensors of it are stepped together, but those whose gradient is not
        finite on some rank (the ranks agreed); the norm counts every one of the
        optimizer's params in the bucket, whether or not this rank holds a piece."""
        picked = [(t, ok) for t, ok in zip(tensors, finite) if id(t) in self._where]
        self._arrived([t for t, _ in picked])
        self.verdicts.now += [self._name(t) for t, ok in picked if not ok]
        good = [t for t, ok in picked if ok]
        total = sum(sq for ok, sq in zip(finite, squares) if ok)
        if good:
            self._step(good, squares=total)
        elif self.max_norm is not None:  # nothing here to step: its share of the norm
            self._norm.add(total)
            self._norm.call_done()

    def _arrived(self, params):
        """params' gradients are final in this backward: refuse a second one before
        opt.step() (accumulation), and start the backward's books at its first."""
        for p in params:
            if id(p) in self._stepped:
                p.grad = None  # (refused: dropped, so that opt.step() ends the step)
                raise RuntimeError(
                    f"release_gradients: {self._name(p)} got a second gradient before "
                    f"optimizer.step(): gradient accumulation over micro-batches is not "
                    f"supported in release mode (each backward steps every param; this one "
                    f"was left as it was). Call optimizer.step() after each backward, or "
                    f"remove() the release to accumulate (precis.ddp: use no_sync())")
        task = graph_task()
        if task != self._task:  # this backward's first gradient
            self._start_backward(task)
            if task != -1:  # (else a precis.ddp sync outside backward: end_step ends it)
                Variable._execution_engine.queue_callback(self._backward_done)
        self._stepped.update(map(id, params))

    def _start_backward(self, task):
        """Fresh books for backward `task`. A backward that raised never reached
        _backward_done: its params ready but not stepped keep their gradients, as in
        the ordinary loop (zero_grad() drops them, or the next backward adds to them)."""
        for p in getattr(self, "_ready", ()):
            self._stepped.discard(id(p))
        self.verdicts.publish()  # the last backward's (or one that raised: its
        self._task = task                            # steps count for the step)
        self._ready = []  # params whose gradient is final, not stepped yet (a bucket)
        self._ready_bytes = self._ready_held = 0  # whole gradients', this rank's
        self._peak_now = 0
        self.verdicts.now = []  # (the params skipped in this backward)
        self._changed = None  # ids of params written behind the optimizer (_written_behind)
        self._uncompared = frozenset()  # ids of params it left to their calls' compare
        self._norm.start(task, self)  # its squared norm so far, by step call (max_norm)

    def _name(self, p):
        gi, i = self._where[id(p)]
        return f"{type(self._optimizer).__name__} param {i} of group {gi}"

    @torch.no_grad()
    def _flush(self, divisor=None, squares=None):
        """Step the params whose gradients are ready (one op call for those of the
        kernel; a bucket that a non-finite gradient skipped is stepped again a param at
        a time, so only that param is left out), and free their gradients. With
        max_norm, every param of the flush is clipped by one divisor, its own norm
        counted in (a param torch's math steps too), or by `divisor` (flush_releases: the
        buckets of several releases; squares: each ready param's, unscaled)."""
        ready, self._ready, self._ready_bytes, self._ready_held = self._ready, [], 0, 0
        own = divisor is None
        if own and len(ready) == 1 and self.max_norm is None and self._step_alone(ready[0]):
            ready[0].grad = None
            return
        if own and self.max_norm is not None and len(ready) > 1:
            squares = [self._unscaled(squared_norm([p])) for p in ready]
            divisor = self._norm.divisor(squares, each=True)
        kernel, taken, calls = [], {}, None
        if len(ready) > 1:
            # a bucket's kept calls, after this backward's check and compare: made from
            # params none of which torch's math steps, and found unchanged since
            self._first_call()
            calls = self.kept.bucket_calls(ready, self._changed, self._uncompared)
        for p in ready if calls is None else ():
            if self._steps_by_torch(p):
                taken[id(p)] = self._step([p], by_torch=True, divisor=divisor)
            else:
                kernel.append(p)
        if calls is not None:
            kernel = ready
        if kernel and self._step(kernel, divisor=divisor, calls=calls,
                                 keep=len(kernel) == len(ready) > 1):
            taken.update((id(p), True) for p in kernel)
        else:
            taken.update((id(p), len(kernel) > 1 and self._step([p], divisor=divisor))
                         for p in kernel)
        if divisor is not None:  # the norm counts the gradients stepped, in the order
            for p, sq in zip(ready, squares):  # the divisor summed them
                if taken[id(p)]:
                    self._norm.add(sq)
            if own:  # the flush is one step call of the profile
                self._norm.call_done()
        for p in ready:
            p.grad = None

    def _unscaled(self, squares):
        """squares of gradients that carry grad_scale, without it (unscaled only by a
        scale: x * 1 and 1 * x are exact, and on a device each operation is a kernel
        launch a param; by the reciprocal: release_clipping.estimated_squares)."""
        loss_scale = 1.0 if self.grad_scale is None else float(self.grad_scale)
        return squares * (1.0 / loss_scale ** 2) if loss_scale != 1.0 else squares

    def _step(self, params, by_torch=False, squares=None, divisor=None, calls=None,
              keep=False):
        """One step of params alone (functional.run): True if taken (or if its verdict is
        left on the device, in verdicts.now); a param skipped for a non-finite gradient
        is named in verdicts.now. squares: their gradients' squared norm (max_norm), when
        known (precis.ddp's, agreed by the ranks). divisor: the clipping divisor of the
        flush this call is part of (which counts the norm and the profile's call). calls:
        a bucket's kept calls, made again (KeptCalls.bucket_calls); else keep: whether the
        calls the full path makes for params are kept for their next flushes
        (KeptCalls.keep_bucket)."""
        opt = self._optimizer
        only = self._indices(params)
        self._first_call()
        # A kernel call of one param on a GPU waits for nothing the host need not know at
        # once: its Inf/NaN verdict stays on the device until the backward ends
        # (Verdicts.read; a skipped param's step, counted on the host, is taken back
        # there), and with the step counts on the device (capturable) so do its norm and
        # clipping divisor (_backward_done); without, clipping reads each call's norm. On
        # the CPU nothing waits: the host's path (whose square root is correctly
        # rounded, torch's float64 one on the CPU not always)
        group = opt.param_groups[self._where[id(params[0])][0]]
        capturable = counts_on_device(group)
        alone = not by_torch and len(params) == 1 and squares is None and \
            divisor is None and waits_for(params[0].device)
        norm_on_device = alone and capturable and \
            (not isinstance(self._norm.sum_squares, torch.Tensor) or
             self._norm.sum_squares.device == params[0].device)  # (params on several devices)
        lazy = norm_on_device or (alone and self.max_norm is None)
        loss_scale = 1.0 if self.grad_scale is None else float(self.grad_scale)
        scale = loss_scale
        own = divisor is None  # (else a flush's, which counts the norm)
        if self.max_norm is not None:
            if own:
                if squares is None:
                    squares = squared_norm(params, on_device=norm_on_device)
                squares = self._unscaled(squares)
                divisor = self._norm.divisor(squares)
            scale = loss_scale * divisor if loss_scale != 1.0 else divisor
        if by_torch:
            taken = self._step_by_torch(params[0], scale, self._changed)
        else:
            # grad_scale (1 without loss scaling or clipping: the kernel multiplies by
            # 1 / grad_scale, exact) makes the kernel check every gradient before it writes
            try:
                if calls is not None:
                    self._step_bucket(calls, scale)
                elif not (len(params) == 1 and
                          self._step_kept(params[0], group, scale, lazy, capturable)):
                    # (a param the backward's compare left to its kept call: this call
                    # compares its params itself; those compared then compare as found)
                    changed = None if any(id(q) in self._uncompared for q in params) \
                        else self._changed
                    with self.kept.keeping_bucket(params, keep):
                        functional.run(opt.param_groups, opt.state, opt._books, scale, None,
                                      only, changed, verdict_later=lazy)
            finally:
                self.kept.drop_lent_grads()
            last = opt._books.last
            flag = last["found_inf"]
            if lazy and flag is not None:  # (counted on the device: found_inf == 0 added)
                # named (and, counted on the host, its step taken back) at Verdicts.read
                counted = None if capturable else opt.state[params[0]]["step"]
                self.verdicts.now.append((params[0], flag, counted))
                last["found_inf"] = None  # (the release's: never handed out)
                if self.max_norm is not None:  # the norm counts the gradients stepped
                    self._norm.add(torch.where(flag.reshape(()) == 0, squares, 0.0))
                    self._norm.call_done()
                return True
            taken = not (last["step_skipped"] or
                         (flag is not None and device_reads.flag(flag, "verdict")))
        self.verdicts.taken = self.verdicts.taken or taken
        if self.max_norm is not None and own:
            if taken:  # the norm counts the gradients stepped
                self._norm.add(squares)
            self._norm.call_done()
        if not taken and len(params) == 1:
            self.verdicts.now.append(self._name(params[0]))
        return taken

    def _first_call(self):
        """At this backward's first step call: every released group checked, the
        params written behind the optimizer's back found (_written_behind) and, on the
        device path, the kept calls' flags zeroed (the last backward's were read when it
        ended, or at this one's start: _start_backward)."""
        if self._changed is None:
            check_releases(self._norm)
            self._changed = self._written_behind()
            if isinstance(self._changed, dict):
                self.kept.zero_flags()

    def _step_alone(self, p):
        """p's step by its kept call when it is stepped alone with nothing to clip, its
        step counted on the host and its verdict left on the device (what _step does for
        such a param, without its walk; a kept call is the kernel's, never torch's math:
        what decides that is what KeptCalls.kept_call finds unchanged). False where _step steps p
        (p not stepped; this backward's first call made, a kept call found stale
        dropped, as _step would)."""
        gi = self._where[id(p)][0]
        group = self._optimizer.param_groups[gi]
        books = self._optimizer._books
        if id(p) not in self.kept.calls or counts_on_device(group) or \
                books.offload is not None or not waits_for(p.device):
            return False
        self._first_call()
        scale = 1.0 if self.grad_scale is None else float(self.grad_scale)
        try:
            if not self._step_kept(p, group, scale, True, False):
                return False
        finally:
            self.kept.drop_lent_grads()
        # its verdict read with the backward's others (Verdicts.copy, Verdicts.read), as
        # _step leaves it; the flag the release's, never handed out (last_found_inf)
        self.verdicts.now.append((p, books.last["found_inf"], self._optimizer.state[p]["step"]))
        books.last["found_inf"] = None
        return True

    def _step_kept(self, p, group, scale, lazy, capturable):
        """p's step by the op call kept for it (KeptCalls.kept_call), on the device path, its
        verdict left on the device where lazy (as _step's functional.run call; capturable:
        the group's counts_on_device, as its callers read it): what functional.run does
        for that call (its resync where the backward's compare flagged p, step_eager's or
        step_capturable's step, step_groups' records of what the op wrote), none of its
        walk of the groups. False (nothing done) where the full path steps p, and makes
        its call anew."""
        books, (gi, i) = self._optimizer._books, self._where[id(p)]
        written = self._changed
        if not isinstance(written, dict) or books.unrecorded or tracing.traced() or \
                not fingerprints.readable():
            return False
        call = self.kept.kept_call(p, capturable)
        if call is None:  # (made anew: the full path's gather keeps the new one)
            self.kept.forget(p)
            return False
        state = call.states[0]
        compares = isinstance(call.args.get("fingerprints"), list)  # (kept_call's form)
        if id(p) in written and not compares:
            functional.resync_written(books, gi, [(i, p, state)], written)
        books.last["step_skipped"] = None if capturable else False  # (step_groups' start)
        books.last["found_inf"] = None
        # (step_eager's call of one param whose verdict is left for later, without its
        # walk: checked by the op before it writes, counted on the host; by the call held
        # on the C side where it holds, which counts the step itself)
        later = not capturable and lazy and books.offload is None
        held = self.kept.held_call(p, call) if later else None
        if not capturable and held is None:
            call.args["steps"] = [next_step(int(state["step"]))]
        if capturable:
            functional.step_capturable(books, [call], scale, None)
        elif later:
            flag = self.kept.calls[id(p)].flag  # (zeroed by _first_call)
            inv_grad_scale = functional.inv_grad_scale_of(books, scale)
            if held is not None:
                out = call.args.get("fingerprints")
                held(call.args["params"], call.args["grads"], state["step"], call.args["lr"],
                     inv_grad_scale, flag,
                     out if isinstance(out, list) else [] if out is None else [out])
            else:
                call.op()(**call.args, inv_grad_scale=inv_grad_scale, inv_grad_scale_tensor=None,
                          check_finite=True, found_inf=flag)
                state["step"].add_(1.0)
            books.last["found_inf"], books.last["step_skipped"] = flag, None
        else:
            functional.step_eager(books, [call], scale, None, verdict_later=lazy)
        skipped = books.last["step_skipped"]  # (None: taken, or its verdict left for later)
        if skipped is not True:
            step_calls.mark_written([p])
        if compares:  # its kept read with the verdicts' books (Verdicts.queue_compares)
            out, _, kept, *sums = call.args["fingerprints"]  # (sums: a master's compare)
            out, blocks = (out, None) if sums else (out[:1], out[1:])
            self.verdicts.compares.append(([(gi, i, p, not sums)], kept))
        else:
            out, blocks = functional.op_outputs(call)
        if optim_state.watched(books, p, state):
            if out is None or skipped is True:  # (no out: capturable; skipped: as found)
                optim_state.record_written(books, [p])
            else:
                books.written.record_values([id(p)], out)
        if blocks is not None:
            books.blocks[id(p)] = blocks
        else:  # (none kept: a param without remainders drops its record)
            optim_state.record_blocks(books, [(p, state)])
        if skipped is False and (books.fingerprints or books.joins):
            optim_state.forget_loaded(books, [p])
        return True

    def _step_bucket(self, calls, scale):
        """A bucket's step by its kept calls (KeptCalls.bucket_calls), its verdict read at once, as
        the full path's (a bucket an Inf/NaN skipped is stepped again a param at a time):
        what functional.run does for those calls (the resync of the params the backward's
        compare flagged, step_eager's step, step_groups' records of what the ops wrote),
        none of its walk of the groups."""
        books, written = self._optimizer._books, self._changed
        for call in calls:  # (the params the backward's compare flagged: resynced)
            if isinstance(call.args.get("fingerprints"), list):
                continue  # (its op compares them)
            flagged = [(self._where[id(p)][1], p, state)
                       for p, state in zip(call.params, call.states) if id(p) in written]
            if flagged:
                functional.resync_written(books, self._where[id(call.params[0])][0], flagged,
                                          written)
        books.last["step_skipped"], books.last["found_inf"] = False, None
        ran = []
        functional.step_eager(books, calls, scale, None, ran=ran)
        if books.last["step_skipped"] is not True:
            step_calls.mark_written([p for call in calls for p in call.params])
        self._record_bucket(calls, ran)

    def _record_bucket(self, calls, ran):
        """step_groups' records of what a bucket's kept calls left (ran: those whose op
        ran; one skipped before its op left its params as found): the params with a
        master or remainders by the op's output where it ran and the step was taken, the
        blocks of those with remainders by the op's output where it ran, else by a pass."""
        books = self._optimizer._books
        skipped = books.last["step_skipped"]
        ran = set(map(id, ran))
        for call in calls:
            n, out = len(call.params), call.args.get("fingerprints")
            if isinstance(out, list):  # (its op compared them: [out, records, kept(, sums)])
                if id(call) not in ran:  # (not compared: their records stand, and each
                    continue             # is stepped again alone, compared by its call)
                out, _, kept, *sums = out
                self.verdicts.compares.append((
                    [(*self._where[id(p)], p, not sums) for p in call.params], kept))
                out, blocks = (out, None) if sums else (out[:n], out[n:])
            else:
                out, blocks = functional.op_outputs(call) if id(call) in ran else (None, None)
            watched = [k for k, (p, state) in enumerate(zip(call.params, call.states))
                       if optim_state.watched(books, p, state)]
            if watched and (out is None or skipped is True):
                optim_state.record_written(books, [call.params[k] for k in watched])
            elif watched:  # (views of out: no index copied over)
                books.written.record_values(
                    [id(call.params[k]) for k in watched],
                    out if len(watched) == len(call.params) else
                    torch.stack([out[k] for k in watched]))
            if blocks is not None:
                books.blocks.update(zip(map(id, call.params), blocks.split(
                    [fingerprints.block_count(p.numel()) for p in call.params])))
            else:
                optim_state.record_blocks(books, list(zip(call.params, call.states)))
        if skipped is False and (books.fingerprints or books.joins):
            optim_state.forget_loaded(books, [p for call in calls for p in call.params])

    def _indices(self, params):
        """{group index: [param indices]} of params, as functional.run's `only`."""
        only = {}
        for p in params:
            gi, i = self._where[id(p)]
            only.setdefault(gi, []).append(i)
        return only

    def _step_by_torch(self, p, scale, changed=None):
        """One step of p by torch's own math, which takes no grad_scale: its gradient
        checked and unscaled here. True if taken."""
        if not device_reads.flag(torch.isfinite(values(p.grad)).all(), "finite gradient"):
            return False
        if scale != 1.0:
            p.grad.div_(scale)
        opt = self._optimizer
        functional.run(opt.param_groups, opt.state, opt._books, None, None, self._indices([p]),
                      changed)
        return True

    def _written_behind(self):
        """written_behind_ids of the optimizer: at a backward's first step call. On the
        device path it leaves the params whose kept calls compare them uncompared
        (_uncompared): a call that steps one of them otherwise compares its params."""
        compared = self.kept.compares_itself()
        written = written_behind_ids(self._optimizer, compared)
        self._uncompared = compared if isinstance(written, dict) else frozenset()
        return written

    def _steps_by_torch(self, p):
        """Whether torch's own math steps p (precis.torch_math: float64 / complex128
        params, differentiable=True groups, what the rule's torch counterpart takes)."""
        books = self._optimizer._books
        group = self._optimizer.param_groups[self._where[id(p)][0]]
        layout = optim_state.layout_for(books, group, p)
        return torch_math.uses_torch_math(optim_state.rule_of(books, group).name, group, p,
                                          layout == FP32_LAYOUT,
                                          self._optimizer.state.get(p))

    def _backward_done(self, where="of this backward"):
        """The end of a backward (queued by autograd at its first gradient; or, for books
        opened outside one, called by opt.step() / zero_grad(): where, which backward
        its warning names)."""
        if tracing.traced():  # (a backward inside a compiled call: its books eagerly)
            return tracing.run_eagerly(self._backward_done, where)
        with self._lock:  # (queued by autograd: outside the hooks' turns)
            flush_releases(self._norm)  # every release's last buckets, clipped as one
            self._task = None
            self.peak_grad_bytes = self._peak_now
            self._norm.done(self)  # the last release's: the norm, its shares
            self.verdicts.copy()
            if not self.verdicts.unread:  # (nothing left on a device: named now)
                self.verdicts.publish(where)
