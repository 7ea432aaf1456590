"""precis.offload: the optimizer's state and step on the CPU for params that live on
another device (docs/design.md section 10). precis.optim builds one Offload for an
optimizer made with offload="cpu" and asks it: which params it offloads (select,
selected), the host copy a param is stepped as (host), whether the grads copied
during backward are still current (verify_grads), the host copy of a gradient
(host_grad), the order of the step's op calls (pipeline), to write stepped copies
back (write_back) and to reread the params (reload). Everything else (state,
resync, checkpoints, all-or-nothing) is the optimizer's, with the host copy
standing where the param would.

Per offloaded param p:

  host copy   a CPU tensor of p's shape and dtype (pinned when p is on CUDA), the
              param the CPU kernel steps; the master weights, remainders and moments
              live on the CPU next to it. It is reread from p whenever p was written
              outside the optimizer (the optimizer compares p's fingerprint with what
              its last write-back left: precis.fingerprints), so loaded weights are
              never overwritten by it.
  host grad   a CPU buffer the gradient is copied into: by a post-accumulate-grad
              hook as soon as backward produces it (every backward; under gradient
              accumulation the last one's copy is the one stepped), or at step() when
              the hook did not copy it since the last step (a main_grad reduced by
              precis.ddp) or it changed after the copy (GradScaler.unscale_,
              clip_grad_norm_, a new .grad). A change is seen in the grad's identity,
              version counter, or the sum of its bits as integers, taken on its device
              when copied and again at step(), compared with one read back per device:
              GradScaler's unscaling writes in place without counting a version.

The step is pipelined (pipeline): the calls of params stepped on their device are
issued first, so a GPU runs them while the CPU steps the host copies; the host
copies of CUDA params are stepped in BUCKETS byte-balanced pieces, one op call
each (host copies of CPU params in one: their copies do not overlap anything). A piece
waits only for its own host grads (ready: copies still in flight go on while the
CPU steps earlier pieces), and its host copies are written back (asynchronously
on CUDA) as soon as it is stepped, while the CPU steps the next piece. Pieces give
the bits of the whole call (the kernel steps each tensor on its own, and
stochastic rounding follows each param's stream, not its place in a call). All pieces' arguments are checked, and a
NaN/Inf skip decided, before the first piece is stepped (precis.optim).

On CUDA the copies go through side streams (device-to-host after the work that
produced the tensor; host-to-device after the work queued before the step, not
after the step's device calls, and before any later work on the current stream),
with events the host waits on before it reads or rewrites a host tensor; on the
CPU they are plain copies between separate tensors, so the whole logic runs
without a GPU. A step torch.compile traces copies host copies of CPU params in its graph (every
grad again, a write-back after each call), the host copies of params that share their
storage made outside it (prepare); one with host copies of CUDA params runs uncompiled
(traced_with_cuda_params). The gradient hooks, fired by a backward inside a compiled
call, run eagerly (traced, dynamo would compile one a param: id(p) in its guards).

Selection (offload_fraction, as Megatron-LM's optimizer_offload_fraction): params
in param-group order, each counted once; a param is offloaded when the elements
offloaded so far, its own included, stay within offload_fraction of all elements;
the rest are stepped on their device. It is remade when the param groups
change (add_param_group, precis.ddp.attach_optimizer); a param whose state already
lives on the other side then raises.
"""

import weakref

import torch

from . import tracing, user_warnings
from .dtensor import is_dtensor, local_shard, whole_shape
from .stored_forms import dense_flat, flat_bits, same_layout

MODES = ("cpu",)
BUCKETS = 4  # pieces the host copies of CUDA params are stepped in (Offload.buckets)


def parse(offload, fraction, where):
    """The offload option: None (off) or "cpu"; fraction checked in [0, 1]."""
    if offload is None or offload is False:
        mode = None
    elif offload is True or offload == "cpu":
        mode = "cpu"
    else:
        raise ValueError(f"{where}: offload must be False, True or one of {MODES}, "
                         f"got {offload!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{where}: offload_fraction must be a number in [0, 1], "
                         f"got {fraction!r}")
    if mode is None and fraction not in (0.0, 1.0):  # (a warning: a config toggles offload)
        user_warnings.warn(f"{where}: offload_fraction={fraction!r} is given but offload is "
                           f"{offload!r}: nothing is offloaded; set offload='cpu' to offload "
                           f"that fraction of the state", UserWarning)
    return mode


def _bit_sums(grads):
    """Each grad's elements read as integers and summed (a 0-dim int64 tensor on its
    device, one reduction per grad): a change to any element's bits moves it, where a
    norm in floating point can round a change away or keep it (a sign flipped)."""
    return [flat_bits(g).sum(dtype=torch.int64) for g in grads]


def _host_like_strides(t):
    """The strides of t's host copy: t's own when t is dense (its state, laid out
    like the host copy, then keeps the on-device layout: fp16/fp8 scale blocks
    follow memory order), else contiguous."""
    return t.stride() if dense_flat(t) is not None else torch.empty(t.shape, device="meta").stride()


def _host_like(t):
    """An empty host buffer for t (pinned when t is on CUDA), strided as above."""
    return torch.empty_strided(t.shape, _host_like_strides(t), dtype=t.dtype, device="cpu",
                               pin_memory=t.is_cuda)


class Offload:
    """The host side of an offloaded optimizer (module docstring)."""

    def __init__(self, fraction, name):
        self.fraction = float(fraction)
        self.name = name
        self._key = None            # ids of the params the selection was made from
        self._selected = set()      # ids of offloaded params
        self._host = {}             # param -> host copy
        self._grad = {}             # param -> host grad buffer
        self._grad_copied = {}      # param -> (weakref to the grad copied, version, bit sum)
        self._pending = {}          # host tensor -> CUDA event of a copy reading/writing it
        self._fence = {}            # CUDA device -> event before this step's kernels
        self.buckets = None  # None: BUCKETS when a host copy is of a CUDA param, else 1
        self._hooks = {}            # param -> post-accumulate-grad hook handle
        self._copied_eagerly = set()  # ids of the selected params prepare() copies eagerly
        self._streams = {}          # (device, direction) -> CUDA side stream

    # -- which params -----------------------------------------------------------

    def select(self, param_groups, state):
        """(Re)make the selection when the params of the groups changed."""
        params = _params_of(param_groups)
        key = tuple(map(id, params))
        if key == self._key:
            return
        # A precis.ddp piece stepped whole (Muon) counts as its whole matrix, so every
        # rank offloads the same ones and their assembling collectives come in one order.
        sizes = [whole_shape(p).numel() for p in params]
        budget, taken, selected = self.fraction * sum(sizes), 0, set()
        for p, size in zip(params, sizes):
            if taken + size <= budget:
                taken += size
                selected.add(id(p))
        for p in params:
            if id(p) in selected and type(p) not in (torch.Tensor, torch.nn.Parameter) \
                    and not is_dtensor(p):
                raise ValueError(f"{self.name}(offload='cpu'): a {type(p).__name__} param "
                                 f"(shape {tuple(p.shape)}) cannot be offloaded, only plain "
                                 f"tensors and DTensors (FSDP2's params: their local shards)")
            on_host = id(p) in selected or p.is_cpu
            # 'step' is a CPU tensor on either side (capturable is refused)
            if any(isinstance(v, torch.Tensor) and k != "step" and
                   (v.device.type == "cpu") != on_host for k, v in state.get(p, {}).items()):
                raise RuntimeError(f"{self.name}(offload='cpu'): the param groups changed and "
                                   f"a param of shape {tuple(p.shape)} with state moved across "
                                   f"offload_fraction's cut; add param groups before the "
                                   f"first step")
        self._key, self._selected = key, selected
        self._copied_eagerly = {id(p) for p in params if id(p) in selected and not owns(p)}
        for p in [p for p in self._hooks if id(p) not in selected]:
            self._hooks.pop(p).remove()
        for books in (self._host, self._grad, self._grad_copied):
            for p in [p for p in books if id(p) not in selected]:
                del books[p]
        for p in params:
            if id(p) in selected and p not in self._hooks and p.is_leaf and p.requires_grad:
                self._hooks[p] = p.register_post_accumulate_grad_hook(
                    _grad_hook(weakref.ref(self)))

    def selected(self, p):
        return id(p) in self._selected

    def traced_with_cuda_params(self, param_groups):
        """Whether torch.compile is tracing a step that takes host copies of CUDA params.
        Their copies run on side streams, with events the host waits on (a backward's
        grad copies still in flight among them), which a graph cannot wait for: such a
        step runs uncompiled (functional.run). Host copies of CPU params are copied
        plainly in the graph."""
        return tracing.traced() and any(
            id(p) in self._selected and p.is_cuda
            for group in param_groups for p in group["params"])

    def host_bytes(self):
        """Bytes of the host copies and host grads (the state is the optimizer's)."""
        return sum(t.numel() * t.element_size()
                   for books in (self._host, self._grad) for t in books.values())

    # -- host copies ---------------------------------------------------------------

    def prepare(self, param_groups, state):
        """Before a step's op calls: the selection (re)made when the params of the groups
        changed (select). Under torch.compile, a new selection and the host copies of the
        params that do not own their storage (DTensors, views: precis.ddp's pieces of one
        flat buffer, params put in one with .data =) are made eagerly, in one call (a
        graph break at the first compiled call): made inside the graph, such a host copy,
        which the graph writes back into its param, is folded into the param by inductor.
        It comes out of the graph as the param itself (as pytorch#195451): a DTensor's
        next compile then fails, and params sharing a buffer were stepped from each
        other's values (aot_eager gives the eager bits). A param that owns its storage
        still has its host copy made in the graph (no graph break): folded, it is the
        param, which holds the same values on the host. Uncompiled, host() makes each
        host copy when first asked."""
        if not tracing.traced():
            self.select(param_groups, state)
        elif self._key != tuple(map(id, _params_of(param_groups))) or any(
                id(p) in self._copied_eagerly and self._host.get(p) is None
                for group in param_groups for p in group["params"]):
            tracing.run_eagerly(self._prepare_eagerly, param_groups, state)

    def _prepare_eagerly(self, param_groups, state):
        self.select(param_groups, state)
        for group in param_groups:
            for p in group["params"]:
                if id(p) in self._copied_eagerly:
                    self.host(p)

    def host(self, p):
        """p's host copy (of its local shard, for a DTensor), read from p when made; the
        optimizer rereads it (reload) when p was written behind its back."""
        hp = self._host.get(p)
        if hp is None:
            hp = self._host[p] = _host_like(local_shard(p, p))
            self.reload(p)
            return hp
        self._wait(hp)  # the CPU step rewrites it: the last write-back must have read it
        return hp

    def reload(self, p):
        """Reread p's host copy from p (after writes the version counter misses)."""
        hp = self._host.get(p)
        if hp is None:
            return
        self._wait(hp)  # an earlier write-back may still read it
        self._copy(hp, local_shard(p, p), "d2h")
        self._wait(hp)

    def verify_grads(self):
        """Forget the hook's copies of grads changed since: step() copies those again.
        The bit sums of all grads are compared with one read back per device."""
        if tracing.traced():
            return  # a graph reads nothing back: host_grad copies every grad again
        entries = []  # (param, grad, its bit sum when copied)
        for p, (ref, version, bit_sum) in list(self._grad_copied.items()):
            grad = ref()
            if grad is None or grad is not p.grad or local_shard(p, grad)._version != version:
                del self._grad_copied[p]
            else:
                entries.append((p, local_shard(p, grad), bit_sum))
        by_device = {}
        for (p, grad, then), now in zip(entries, _bit_sums([g for _, g, _ in entries])):
            by_device.setdefault(grad.device, []).append((p, then, now))
        for rows in by_device.values():
            changed = torch.stack([now for _, _, now in rows]) != \
                torch.stack([then for _, then, _ in rows])
            for (p, _, _), c in zip(rows, changed.tolist()):
                if c:
                    del self._grad_copied[p]

    def host_grad(self, p, grad):
        """The host copy of grad (p's gradient), copied now unless the hook's copy
        counts (verify_grads() kept it and grad is the tensor copied). On CUDA the
        copy may still be in flight: ready() waits for it, so a piece of the step
        starts as soon as its own grads are on the host. A host grad laid out
        unlike its host copy is read at once (relaid out for the kernel): it is
        waited for here."""
        # (a step torch.compile traces does not verify the hook's copies)
        copied = None if tracing.traced() else self._grad_copied.pop(p, None)
        hg = self._grad.get(p)
        if copied is None or copied[0]() is not grad:
            hg = self._copy_grad(p, local_shard(p, grad))
        if not same_layout(hg, self._host[p]):
            self._wait(hg)
        return hg

    def ready(self, params):
        """Wait for the host grads of params (copies in flight on CUDA)."""
        for p in params:
            hg = self._grad.get(p)
            if hg is not None:
                self._wait(hg)

    def _copy_grad(self, p, grad):
        hg = self._grad.get(p)
        if hg is None or hg.dtype != grad.dtype or hg.shape != grad.shape or \
                hg.stride() != _host_like_strides(grad):
            hg = self._grad[p] = _host_like(grad)
        self._wait(hg)
        self._copy(hg, grad, "d2h")
        return hg

    def grad_ready(self, p):
        """The post-accumulate-grad hook: copy p.grad to the host now, while backward
        goes on; step() uses it unless the grad changes before."""
        if id(p) not in self._selected or p.grad is None or p.grad.is_sparse:
            return  # (a sparse one: torch's math steps it, copied at the step)
        grad, local = p.grad, local_shard(p, p.grad)
        self._copy_grad(p, local)
        self._grad_copied[p] = (weakref.ref(grad), local._version, _bit_sums([local])[0])

    # -- the step ----------------------------------------------------------------

    def pipeline(self, calls):
        """The step's op calls (precis.optim's _Call) in the order they run: the calls
        of params stepped on their device first, then the calls of host copies cut
        into self.buckets pieces (default: see __init__) of about equal bytes (a piece never spans two calls,
        and a call that cannot be cut stays whole). Run write_back(piece.params)
        after each piece's call."""
        host = [c for c in calls if any(id(p) in self._selected for p in c.params)]
        pieces = [c for c in calls if not any(id(p) in self._selected for p in c.params)]
        self._fence = {}
        for p in (p for c in host for p in c.params):
            if p.is_cuda and p.device not in self._fence:
                # Write-backs wait for the work queued before this step, not for
                # the device calls about to be queued, which never touch them.
                self._fence[p.device] = torch.cuda.current_stream(p.device).record_event()
        n = self.buckets or (BUCKETS if self._fence else 1)
        if n == 1:
            return pieces + host
        sizes = [call.tensor_bytes() for call in host]
        total, done, k = sum(map(sum, sizes)), 0, 1
        for call, nbytes in zip(host, sizes):
            cuts, divisible = [0], call.divisible()
            for i, b in enumerate(nbytes):
                done += b
                if k < n and done * n >= k * total:  # piece k ends here
                    while k < n and done * n >= k * total:
                        k += 1
                    if divisible and i + 1 < len(nbytes):
                        cuts.append(i + 1)
            cuts.append(len(nbytes))
            pieces += [call.piece(a, b) for a, b in zip(cuts, cuts[1:])]
        return pieces

    def write_back(self, params):
        """Copy the stepped host copies of params into the params (on CUDA: queued
        on a side stream after the work queued before the step; the current stream
        waits for it)."""
        for p in params:
            if id(p) not in self._selected:
                continue
            self._copy(local_shard(p, p), self._host[p], "h2d")

    # -- copies (asynchronous on CUDA) ------------------------------------------

    def _copy(self, dst, src, direction):
        dev = src if direction == "d2h" else dst
        if not dev.is_cuda:
            dst.copy_(src)
            return
        current = torch.cuda.current_stream(dev.device)
        stream = self._streams.get((dev.device, direction))
        if stream is None:
            stream = self._streams[(dev.device, direction)] = torch.cuda.Stream(dev.device)
        if direction == "d2h":
            stream.wait_stream(current)  # after the work that produced src
        else:
            stream.wait_event(self._fence[dev.device])  # after the work that used dst
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        dev.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        self._pending[src if direction == "h2d" else dst] = event
        if direction == "h2d":
            current.wait_stream(stream)  # later device work sees the new param

    def _wait(self, host_tensor):
        event = self._pending.pop(host_tensor, None)
        if event is not None:
            event.synchronize()


def _params_of(param_groups):
    """The groups' params, in order, once each (what the selection is made from)."""
    return list(dict.fromkeys(p for g in param_groups for p in g["params"]))


def owns(p):
    """Whether p is a plain tensor alone in its storage (what a compiled step may copy to
    the host inside its graph: prepare)."""
    return not is_dtensor(p) and p._base is None and p.storage_offset() == 0 and \
        p.untyped_storage().nbytes() == p.numel() * p.element_size()


def _grad_hook(ref):
    def hook(p):
        if tracing.traced():  # (a backward inside a compiled call: its books eagerly)
            return tracing.run_eagerly(hook, p)
        offload = ref()
        if offload is not None:
            offload.grad_ready(p)
    return hook
