"""The optimizer side: attach_optimizer() ties an optimizer to the wrappers owning
its params through torch's optimizer hooks (no method of the optimizer is
replaced), and the sharded optimizer state dict."""

import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import tracing, user_warnings
from .._lib import SCALE_BLOCK
from ..op_constants import keeps_block_scales
from ..optim_state import layout_for
from ._module import holder_owner, owner

STATE_DICT_KEY = "precis_ddp"
STATE_DICT_FORMAT = 1

# torch's optimizers whose step is elementwise: each may step this rank's pieces of a
# sharded wrapper's params (another one, Muon or L-BFGS say, needs whole params)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
               torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)

_attachments = weakref.WeakKeyDictionary()  # optimizer -> its _Attachment
_unrelated = weakref.WeakSet()               # optimizers seen stepping no wrapper's param


def attach_optimizer(optimizer):
    """Make an optimizer step the params of precis DDP wrappers correctly; returns it.

    Params of sharded wrappers are replaced, in the param groups, by their pieces
    in this rank's shard. Through the optimizer's step hooks, step() then first
    finishes the gradient sync of every wrapper owning one of its params, hands the
    step a found_inf all ranks agree on when it unscales (grad_scale) a sharded
    gradient, and all-gathers the params after; the next backward starts the
    gradient buffers from zero. With a sharded wrapper, state_dict() carries and
    load_state_dict() checks the 'precis_ddp' key (package docstring). Params of no
    wrapper are left alone. An optimizer other than precis's (torch.optim.AdamW, say)
    steps .grad: the reduced gradient is lent to it as .grad (in the param's dtype) for
    its step only (GradScaler's unscale_ and torch's clip_grad_norm_, before it, find
    none); on a sharded wrapper only torch's elementwise optimizers (ELEMENTWISE) are
    taken, as they step this rank's pieces. Call it once, after building the optimizer
    with all its param groups and before its first step or state dict load; calling it
    again is a no-op.
    """
    if optimizer in _attachments:
        return optimizer
    precis_optimizer = hasattr(optimizer, "_books")  # (optim_state.Books)
    if not precis_optimizer and not isinstance(optimizer, ELEMENTWISE):
        split = [ddp._names[p] for group in optimizer.param_groups for p in group["params"]
                 if (ddp := owner(p)) is not None and ddp.sharding.shards_optimizer_state]
        if split:
            raise ValueError(f"attach_optimizer: {type(optimizer).__name__} would step this "
                             f"rank's pieces of {split[0]!r} and the other params a sharded "
                             f"wrapper splits, and its step is not one torch.optim keeps "
                             f"elementwise ({', '.join(c.__name__ for c in ELEMENTWISE)}): "
                             f"use sharding='no_shard', or a precis optimizer "
                             f"(precis.optim.Muon steps whole matrices)")
    wrappers, replaced, new_params, owned = [], [], [], []
    # Each stepped tensor -> its param's index in the optimizer before any is replaced:
    # a precis optimizer numbers its stream by it (and a piece's elements by their place
    # in the whole param), so every rank and world size rounds an element alike.
    index_of, index, cut = {}, 0, []
    # A rule whose step is not elementwise (Muon) gets a piece of every param on every
    # rank, empty ones too: its step assembles each whole param, a collective.
    whole = getattr(getattr(optimizer, "_rule", None), "steps_whole_params", False)
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            ddp = owner(p)
            pieces = [p] if ddp is None else ddp._optimizer_params(p, whole)
            if ddp is not None:
                owned.append((ddp, p))
                if ddp not in wrappers:
                    wrappers.append(ddp)
            if len(pieces) != 1 or pieces[0] is not p:
                replaced.append((ddp, p))
                if _cuts_blocks(optimizer, group, p, pieces):
                    cut.append(ddp._names[p])
            index_of.update((id(q), index) for q in pieces)
            index += 1
            params.extend(pieces)
        new_params.append(params)
    if not wrappers:
        raise ValueError(f"attach_optimizer: no param of this {type(optimizer).__name__} "
                         f"belongs to a precis DistributedDataParallel (build the wrapper "
                         f"first, then the optimizer over its parameters())")
    stepped = [ddp._names[p] for ddp, p in replaced if optimizer.state.get(p)]
    if stepped:
        raise ValueError(f"attach_optimizer: the optimizer already has state for "
                         f"{', '.join(map(repr, stepped[:3]))}, which a sharded wrapper "
                         f"splits into this rank's pieces; attach it before its first step "
                         f"and before loading a state dict")
    if cut:
        user_warnings.warn(f"attach_optimizer: {type(optimizer).__name__} keeps block-scaled "
                           f"(fp16 / fp8) moments of {', '.join(map(repr, cut[:3]))}"
                           f"{', ...' if len(cut) > 3 else ''}, whose shards cut their "
                           f"scales' 128-element blocks: the scales then follow the shard, "
                           f"and the bits the world size. Give the DistributedDataParallel "
                           f"the optimizer's policy (policy=...), which cuts shards at the "
                           f"blocks", UserWarning)
    for ddp, p in owned:
        ddp._stepped_by[p] = weakref.ref(optimizer)  # (its buckets' listeners)
    for group, params in zip(optimizer.param_groups, new_params):
        group["params"] = params
    for _, p in replaced:
        optimizer.state.pop(p, None)
    if precis_optimizer:
        optimizer._books.param_index = index_of
    _attachments[optimizer] = _Attachment(optimizer, wrappers)
    return optimizer


def _cuts_blocks(optimizer, group, p, pieces):
    """Whether a precis optimizer keeps p's moments block-scaled (fp16 / fp8) and one of
    its pieces starts or ends inside a 128-element block (its wrapper was not given
    that policy)."""
    if not hasattr(optimizer, "_books"):  # not a precis optimizer
        return False
    try:  # the layout the optimizer will give p's pieces
        layout = layout_for(optimizer._books, group, p)
    except ValueError:  # the step names it
        return False
    if not keeps_block_scales(layout):
        return False
    return any(start % SCALE_BLOCK or (stop % SCALE_BLOCK and stop != p.numel())
               for _, start, stop in (q._precis_ddp_piece for q in pieces))


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
                ddp = owner(p)
                out.append([ddp._names[p] if ddp is not None else None, 0, p.numel()])
    return out


def _uses_grad_scale(optimizer, kwargs):
    return kwargs.get("grad_scale") is not None or \
        getattr(optimizer, "grad_scale", None) is not None


class _Attachment:
    """The hooks tying one optimizer to its wrappers (each takes the optimizer as
    its first argument, so nothing here keeps the optimizer alive)."""

    def __init__(self, optimizer, wrappers):
        self.wrappers = wrappers
        # A precis optimizer steps main_grad; any other steps .grad, which the wrappers
        # keep in main_grad (.grad None after backward): handed over for its step
        self.lends_grads = not hasattr(optimizer, "_books")
        self.stepped_on = {}  # id(wrapper) -> its gradients_made at this optimizer's last step
        self.groups_seen = len(optimizer.param_groups)  # (those added later: _refuse_added)
        self.sharded = [w for w in wrappers if w.sharding.shards_optimizer_state]
        self.handles = [optimizer.register_step_pre_hook(self._before_step),
                        optimizer.register_step_post_hook(self._after_step)]
        if self.sharded:  # unsharded state is the same everywhere: a plain state dict
            self.handles += [optimizer.register_state_dict_post_hook(self._add_meta),
                             optimizer.register_load_state_dict_pre_hook(self._check_meta)]
        else:  # (but not a sharded one's: its shards would be taken for whole params)
            self.handles.append(optimizer.register_load_state_dict_pre_hook(self._refuse_shards))

    # -- step -----------------------------------------------------------------

    def _before_step(self, optimizer, args, kwargs):
        if len(optimizer.param_groups) != self.groups_seen:
            self._refuse_added(optimizer)
        for w in self.wrappers:  # every model chunk, not only the first
            w.show_grads()  # (hidden by a step that raised)
            w.finish_grad_sync()
        stale = [w for w in self.wrappers if self.stepped_on.get(id(w)) == w.gradients_made]
        if stale:  # this optimizer stepped on them, and no gradient came since (the walk
            holders = _grad_holders(optimizer)  # of the params only then)
            for w in stale:
                w.hide_grads([t for t in holders if holder_owner(t) is w])
        if self.lends_grads:  # (in the param's dtype, as torch's DDP gives it)
            for t in _grad_holders(optimizer):
                g = t.main_grad
                t.grad = g if g.dtype == t.dtype else g.to(t.dtype)
        if self.sharded and kwargs.get("found_inf") is None and \
                _uses_grad_scale(optimizer, kwargs):
            return args, dict(kwargs, found_inf=self._agreed_found_inf())
        return None

    def _refuse_added(self, optimizer):
        """A param group added after attach_optimizer() holding a whole param of a sharded
        wrapper: refused before the step (its gradient is reduced in shards, this rank's
        only, or gone with the full-size buffer: it was stepped on the rest, or never)."""
        for gi, group in enumerate(optimizer.param_groups[self.groups_seen:], self.groups_seen):
            for p in group["params"]:
                ddp = owner(p)
                if ddp is not None and ddp.sharding.shards_optimizer_state:
                    raise RuntimeError(
                        f"precis DDP: {type(optimizer).__name__}.step(): parameter "
                        f"{ddp._names[p]!r} of a sharded DistributedDataParallel (sharding "
                        f"{ddp.sharding.value!r}) is in param group {gi}, added after "
                        f"attach_optimizer(): its gradient is reduced in shards, each rank "
                        f"its own, so it cannot be stepped whole; add every param group "
                        f"before attach_optimizer(), or use sharding='no_shard'")
        self.groups_seen = len(optimizer.param_groups)

    def _agreed_found_inf(self):
        """1.0 on every rank when any rank's gradient shard holds a NaN/Inf, else 0.0
        (one float32 on the device): each rank sees only its shard, and ranks that
        skip differently diverge. Built and agreed on the device: nothing is read
        back to the host here."""
        counts = [w._nonfinite_in_shard() for w in self.sharded]
        bad = counts[0]
        for count in counts[1:]:
            bad = bad + count.to(bad.device)
        first = self.sharded[0]
        if first.world_size > 1:
            dist.all_reduce(bad, group=first.process_group)
        return (bad > 0).to(torch.float32).reshape(1)

    def _after_step(self, optimizer, args, kwargs):
        for w in self.wrappers:
            w.show_grads()
        if self.lends_grads:
            for t in _grad_holders(optimizer):
                t.grad = None
        for w in self.sharded:
            w.gather_params()
        for w in self.wrappers:
            w._grads_consumed()
            self.stepped_on[id(w)] = w.gradients_made

    # -- state dict -------------------------------------------------------------

    def _meta(self, optimizer):
        first = self.wrappers[0]
        return {"format": STATE_DICT_FORMAT, "world_size": first.world_size,
                "rank": first.rank, "sharding": [w.sharding.value for w in self.wrappers],
                "pieces": optimizer_pieces(optimizer)}

    def _add_meta(self, optimizer, state_dict):
        return {**state_dict, STATE_DICT_KEY: self._meta(optimizer)}

    def _refuse_shards(self, optimizer, state_dict):
        """A sharded optimizer's state dict (its 'precis_ddp' key) refused by an unsharded
        one, before anything is loaded."""
        if isinstance(state_dict, Mapping) and STATE_DICT_KEY in state_dict:
            saved = state_dict[STATE_DICT_KEY]
            sharding = saved.get("sharding") if isinstance(saved, Mapping) else None
            raise ValueError(f"load_state_dict: the state dict was saved by an optimizer of a "
                             f"sharded precis DDP model (sharding {sharding!r}: each rank's "
                             f"shards), but this optimizer steps whole params (no_shard); a "
                             f"sharded optimizer state loads only into the same world size, "
                             f"rank, model and sharding")
        return None

    def _check_meta(self, optimizer, state_dict):
        """The state dict without its 'precis_ddp' key, once that key matches this run."""
        if not (isinstance(state_dict, Mapping) and STATE_DICT_KEY in state_dict):
            raise ValueError("load_state_dict: this optimizer steps shards of a sharded precis "
                             "DDP model, but the state dict has no 'precis_ddp' key (it was "
                             "not saved by a sharded optimizer)")
        saved, want = state_dict[STATE_DICT_KEY], self._meta(optimizer)
        for key in ("format", "world_size", "rank", "sharding", "pieces"):
            got = saved.get(key) if isinstance(saved, Mapping) else None
            if got != want[key]:
                detail = f": saved {got!r}, here {want[key]!r}" if key != "pieces" else \
                    _first_difference(got, want[key])
                raise ValueError(
                    f"load_state_dict: the state dict's precis_ddp {key} does not match "
                    f"this run{detail}; a sharded optimizer state loads only into the "
                    f"same world size, rank, model and sharding")
        return {k: v for k, v in state_dict.items() if k != STATE_DICT_KEY}


def _grad_holders(optimizer):
    """The tensors the optimizer steps that hold a wrapper's gradient (main_grad)."""
    return [t for group in optimizer.param_groups for t in group["params"]
            if getattr(t, "main_grad", None) is not None]


def _first_difference(saved, here):
    """Where two pieces lists ([name, start, stop] each) part, for a message; a wrapper
    given fp16 / fp8 moments cuts its shards at 128-element blocks, which checkpoints
    saved by precis before it did (2026-11-24) do not."""
    saved = list(saved) if isinstance(saved, (list, tuple)) else []
    for k, (a, b) in enumerate(zip(saved, here)):
        if list(a) != list(b):
            return (f": piece {k} is {list(a)} saved, {list(b)} here (with fp16 / fp8 "
                    f"moments a wrapper cuts its shards at 128-element blocks)")
    return f": {len(saved)} pieces saved, {len(here)} here"


def _refuse_unattached(optimizer, args, kwargs):
    """A global step pre-hook. An optimizer that steps a wrapper's params without
    being attached would step gradients that were never reduced (sharded: all but
    this rank's shard) and leave the ranks' params apart: raise instead. Each
    optimizer's params are looked at once, at its first step."""
    if tracing.traced() or optimizer in _attachments or optimizer in _unrelated:
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            ddp = owner(p)
            if ddp is not None:
                raise RuntimeError(
                    f"precis DDP: {type(optimizer).__name__}.step() steps parameter "
                    f"{ddp._names[p]!r} of a precis DistributedDataParallel, but the optimizer "
                    f"is not attached to it: call precis.ddp.attach_optimizer(optimizer) "
                    f"once, after building it")
    _unrelated.add(optimizer)
    return None


register_optimizer_step_pre_hook(_refuse_unattached)
