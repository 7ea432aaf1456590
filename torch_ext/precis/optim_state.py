"""The optimizer state of precis.optim's params: the state dict itself (CountedState,
each param's a ParamState), which dtypes each param's state takes (its Layout, from
the group's policy), making the buffers a step needs, and resyncing a master or
remainder (or host copy) from its param when the param was written behind the optimizer's
back. Functions of the optimizer's books (a Books: what it keeps between steps beside its
state dict)."""

import itertools
from collections.abc import Mapping

import torch

from . import _lib, fingerprints, master_state, ops, stored_forms, torch_math, tracing
from .dtensor import (is_dtensor, local_shard, placed_like, replicated_like, scales_like,
                      whole_shape)
from .op_constants import SCALED_MOMENT_DTYPES, scale_count
from .policy import Policy, policy_for, whole_policy
from .state_layout import (FP32_LAYOUT, MOMENT_KEYS, ROW_STATE_KEYS, layout_of, param_layout,
                           rounds_stochastically, step_tensor, torch_layout, unscaled_layout)


class _CountsChanges:
    """The dict methods that change entries, each counting the change first
    (_count) so that a Plan sees any replaced or removed entry with one comparison."""

    def __setitem__(self, key, value):
        self._count()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._count()
        super().__delitem__(key)

    def __ior__(self, other):
        self._count()
        return super().__ior__(other)

    def pop(self, *args):
        self._count()
        return super().pop(*args)

    def popitem(self):
        self._count()
        return super().popitem()

    def clear(self):
        self._count()
        super().clear()

    def update(self, *args, **kwargs):
        self._count()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._count()
        return super().setdefault(key, default)


class CountedState(_CountsChanges, dict):
    """optimizer.state: param -> its state (a ParamState), a missing param getting a
    new one (as torch's defaultdict(dict)). `changes` counts the changes to its entries
    and to theirs, so that a Plan sees any param's state replaced, removed or given
    another tensor without looking at each param at every step (bench/step_breakdown.py,
    2,000 params: the step's Python went from 1.2-1.9 ms to 0.8-1.1 ms with it and the
    grads' checks left to the op; bench/RESULTS.md). A dict with a Python __missing__,
    not a defaultdict: dynamo traces this one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.changes = 0
        for key, value in self.items():  # a loaded state's plain dicts
            dict.__setitem__(self, key, self._adopt(value))

    def _count(self):
        self.changes += 1

    def _adopt(self, value):
        """A param's state as this dict keeps it: a ParamState of its own (a plain dict
        one holding its entries; a ParamState of none, e.g. a copy, made its)."""
        if type(value) is dict:
            return ParamState(self, value)
        if isinstance(value, ParamState) and value.owner is None:
            value.owner = self
        return value

    def __setitem__(self, key, value):
        super().__setitem__(key, self._adopt(value))

    def __missing__(self, key):
        value = self[key] = ParamState(self)
        return value

    def __reduce__(self):  # pickle sets the items before the attributes
        return CountedState, (), {"changes": self.changes}, None, iter(self.items())


class ParamState(_CountsChanges, dict):
    """One param's state in a CountedState (`owner`), its changes counted there. A
    copy (copy, deepcopy, pickle) has no owner until a CountedState takes it in.
    `views`: key -> (entry, buffer, offset) for the entries a Plan made views of its
    flat buffers (step_plan.flatten), read by op_entry."""

    def __init__(self, owner=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = owner
        self.views = {}

    def _count(self):
        if self.owner is not None:
            self.owner.changes += 1

    # `views` follows the entries: a replaced or removed one drops its record (and
    # with it the reference to a flat buffer no entry may use any more).
    def __setitem__(self, key, value):
        self.views.pop(key, None)
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.views.pop(key, None)
        super().__delitem__(key)

    def pop(self, key, *default):
        self.views.pop(key, None)
        return super().pop(key, *default)

    def clear(self):
        self.views.clear()
        super().clear()

    def __reduce__(self):  # (a copy has no views: its first eager step makes them anew)
        return ParamState, (), None, None, iter(self.items())

    def __copy__(self):
        return ParamState(None, self)


def op_entry(state, key):
    """state[key] (or None) as the op takes it. In a step traced by torch.compile, an
    entry a Plan made a view of its flat buffer is made anew in the graph from the
    buffer, so that the graph's inputs are the buffers, not views that share them.
    (torch 2.11's inductor reads aliased inputs that an op writes at the wrong offset
    on CUDA, pytorch/pytorch#139628, fixed by #184232: the H200 gave the wrong params;
    and its compile cache can give a graph made for aliased inputs to unaliased ones.)"""
    value = state.get(key)
    if value is None or not tracing.traced():
        return value
    view = getattr(state, "views", {}).get(key)
    if view is None or view[0] is not value:  # not a view, or replaced since
        return value
    _, buffer, offset = view
    return buffer[offset:offset + value.numel()].view(value.shape)


def state_of(states, p):
    """p's state dict in `states`, an empty one made at its first step. In the
    optimizer's CountedState it is a ParamState: a plain dict a user put there is
    replaced by one holding its entries (the Plan needs their changes counted; torch
    would fill the user's dict, precis fills its own). A plain dict otherwise (the
    functional core called with a plain dict)."""
    state = states.get(p)
    if isinstance(states, CountedState):
        if not isinstance(state, ParamState):
            states[p] = {} if state is None else state  # CountedState adopts it
            state = states[p]
    elif state is None:
        state = states[p] = {}
    return state


# books.last["step_skipped"] of a step in release mode whose verdicts are still on their
# way back from a device (precis.release): the optimizer's last_step_skipped reads them
VERDICT_UNREAD = "the verdicts of the step's released calls, not read yet"


class Books:
    """What precis.optim keeps between steps that is not optimizer state, handed to
    the functional core (functional.run) beside the param groups and the state dict."""

    def __init__(self, name, rule):
        self.name = name          # the optimizer's class name, for messages
        self.rule = rule          # its update rule (a precis.rule.Rule)
        self.layouts = {}         # (policy key, param dtype, model policy) -> Layout
        # id(param) -> the fingerprint of the values the optimizer last left in it (its
        # local shard), for params that keep a copy of them (watched)
        self.written = fingerprints.Records()
        # id(param) -> the fingerprints of its blocks (fingerprints.of_blocks, an int64
        # tensor on its device) as the optimizer last left it, for params with remainders:
        # a write resyncs the remainders of the blocks it touched (resync_blocks)
        self.blocks = {}
        # a step compiled or captured since the last eager one wrote the params without
        # recording it: the records are stale, so the next eager step drops them
        self.unrecorded = False
        # the records a CUDA graph's captured step writes at every replay, kept alive
        # (graph_records.rewrite): the graph holds their addresses
        self.captured = []
        self.plans = {}           # group index -> step_plan.Plan (of the groups stepped with it)
        self.steady = None        # step_plan.Steady: the call of a steady step, made once
        self.fingerprints = {}    # param -> fingerprint its loaded remainder belongs to
        # param -> a loaded remainder joined at load with bits not its own: joined anew
        # when its param arrives (master_state.pending)
        self.joins = {}
        # param -> its stochastic rounding's stream (an int): kept here, as the per-param
        # state holds only tensors (as torch's optimizers' does; users' loops and torch's
        # tests .detach() every value), and an int the op takes needs no read back
        self.streams = {}
        self.buffers = {}         # (use, device) -> scratch tensor kept between steps
        self.offload = None       # the precis.offload.Offload of an offloaded optimizer
        # id(param) -> the index its stream is numbered by, where not its place in the
        # optimizer: precis.ddp.attach_optimizer's (a piece's whole param's index)
        self.param_index = {}
        self.release = None       # the precis.release.GradientRelease in release mode
        # the optimizer's defaults (its own dict): torch's math steps under grad mode
        # defaults["differentiable"], as torch's step does, whatever a group says
        self.defaults = {}
        # ids of params frozen (requires_grad False) when added, whose check
        # (group_checks.check_param) waits for a step that gets a gradient for them
        self.unchecked = set()
        # What step() records, kept as a dict's items: under torch.compile a setattr on
        # an optimizer fails (2.11: AssertionError) or is dropped (2.12, 2.13: the
        # compiled step leaves the attribute as it was); a dict store is traced.
        self.last = {"step_skipped": False, "found_inf": None, "warned_stale": False}


class StaleMasterWarning(UserWarning):
    """A param was written outside the optimizer (e.g. a model-only load, a mask); the
    master of each element written (a remainder: the whole tensor's) or its host copy
    was resynced from it. The message says what it saw in each param: a whole load, or
    a partial write and how many elements of how many."""


def policy_key(policy):
    """A hashable key for a group's policy option (None, Policy or mapping)."""
    if policy is None or isinstance(policy, Policy):
        return policy
    return tuple(sorted((str(k), repr(v)) for k, v in policy.items()))


def plain_policy(policy):
    """The policy option as plain data (strings, bools, None) for a state dict."""
    if policy is None:
        return None
    if isinstance(policy, Policy):
        return policy.to_dict()
    return {str(k): (v if v is None or isinstance(v, (bool, int, float, str)) else str(v))
            for k, v in policy.items()}


def rule_of(books, group):
    """The rule that steps a param group (Rule.for_group: the optimizer's, or AdamW's for
    a Muon group that asks for it)."""
    return books.rule.for_group(group)


def layout_for(books, group, param, key=None):
    # A param sharded by precis.fsdp carries its model's policy (the default when
    # the group has none); it may be kept in the master dtype, as its own master.
    model = getattr(param, "_precis_policy", None)
    rule = rule_of(books, group)
    key = (policy_key(group["policy"]) if key is None else key, param.dtype, model, rule.name)
    layout = books.layouts.get(key)
    if layout is None:
        name = books.name
        option = whole_policy(model if group["policy"] is None else group["policy"], name)
        if torch_layout(param):
            layout = param_layout(option, param, name)
        else:
            try:
                policy = policy_for(option, param.dtype if model is None else
                                    model.param_dtype, name, hint="or a param group per dtype")
            except _lib.PrecisValueError as error:  # (C's words name the field, not the param)
                if error.status != _lib.ERR_INVALID_POLICY or model is not None or \
                        not isinstance(option, Mapping):
                    raise
                mixed = any(q.dtype != param.dtype for q in group["params"])
                way = (f"A mapping of overrides applies to every param of its group, each "
                       f"by its dtype: give the {param.dtype} params (norms kept in fp32, "
                       f"say) a param group of their own with a policy that fits them"
                       if mixed else f"Give the group a policy that fits {param.dtype} params")
                raise _lib.PrecisValueError(
                    f"{name}: the policy {dict(option)} applied to a {param.dtype} param "
                    f"(shape {tuple(param.shape)}): {error}. {way}", error.status) from None
            layout = rule.layout(layout_of(policy, param.dtype), policy)
            if param.dtype != policy.param_dtype and (
                    layout.master is not None or param.dtype != policy.main_params_dtype):
                raise ValueError(f"{name}: a param kept in {param.dtype} by precis.fsdp "
                                 f"does not fit the policy {policy.to_dict()}; give the "
                                 f"optimizer the policy given to precis.fsdp.fully_shard")
        books.layouts[key] = layout
    if group["differentiable"] and param.dtype not in torch_math.DTYPES and (
            layout != FP32_LAYOUT or param.dtype != torch.float32):
        raise ValueError(f"{books.name}: differentiable=True with a {param.dtype} "
                         f"param kept as {layout}: a differentiable step runs torch's own "
                         f"math, which autograd can follow, and that needs fp32 (or "
                         f"float64) params with the fp32 policy (fp32 moments, no master); "
                         f"precis's low-precision state is stepped by a C kernel autograd "
                         f"cannot differentiate through")
    return unscaled_layout(layout, param, books.name)


def buffer(books, use, device, shape, dtype):
    """A tensor of `shape` on device kept from step to step, made (zeroed) at its
    first use: a step captured in a CUDA graph after warm-up steps allocates
    nothing. Callers overwrite what they read."""
    buf = books.buffers.get((use, device))
    if buf is None:
        buf = books.buffers[(use, device)] = torch.zeros(shape, dtype=dtype, device=device)
    return buf


def absent(books, device):
    """The empty fp32 tensor that stands for an absent list entry."""
    return buffer(books, "absent", device, (0,), torch.float32)


def home(books, p):
    """What p is stepped as: its host copy when offloaded (precis.offload), else p."""
    if books.offload is not None and books.offload.selected(p):
        return books.offload.host(p)
    return p


def local_home(books, p):
    """The tensor p's step reads and writes: its host copy when offloaded (of its
    local shard, for a DTensor), else its local shard (p itself when plain)."""
    if books.offload is not None and books.offload.selected(p):
        return books.offload.host(p)
    return local_shard(p, p)


def stream_index(books, p, place):
    """The index p's stream is numbered by (NewStreams): its place in the optimizer,
    unless books.param_index says otherwise."""
    return books.param_index.get(id(p), place)


def where(books, gi, i, p):
    return f"{books.name}: param {i} of group {gi} (shape {tuple(p.shape)})"


class NewStreams:
    """The streams of params whose state a step makes (docs/design.md section 4): the
    param's index in the optimizer (stream_index: as state_dict() numbers it; for a param
    of an optimizer precis.ddp attached, the index its whole param had), unless another
    param holds that one (params added or moved since, or streams loaded: books.streams),
    then the next free one. The streams in use are collected once, at the first
    param that needs one."""

    def __init__(self, books):
        self._streams, self._used = books.streams, None

    def take(self, index):
        if self._used is None:
            self._used = set(self._streams.values())
        stream = index if index not in self._used else max(self._used) + 1
        self._used.add(stream)
        return stream


def ensure_state(books, p, local, state, layout, gi, i, capturable, rule, moments, streams,
                 index):
    """Allocate whatever buffer of p's state is missing (first step, a load that
    carried no master, amsgrad turned on later), and check the rest still fits
    the layout. rule: the group's (rule_of); moments: the moment keys it keeps (Rule.moments). A
    layout that rounds stochastically gets a stream (books.streams)
    unless p has one (streams.take(index): index is p's in the optimizer).
    'step' is torch's: a float32 0-dim tensor, on the CPU, or on p's device when
    capturable. Buffers are made like `local` (local_home(books, p): on its device,
    with its strides; a param whose memory format changed since gets its state laid
    out anew); a DTensor param's are DTensors placed like it."""
    foreign = [k for k in state if (k in MOMENT_KEYS and k not in rule.all_moments) or
               (k in ROW_STATE_KEYS and k != rule.row_state)]
    if foreign or (rule.name == "adam" and "exp_avg" in state and "exp_avg_sq" not in state):
        raise RuntimeError(f"{where(books, gi, i, p)}: its state ({', '.join(sorted(state))}) "
                           f"is another rule's than {rule.name!r}, which steps its group now; "
                           f"did the group's 'algorithm' change after steps?")
    step = state.get("step")
    if not (type(step) is torch.Tensor and step.dtype == torch.float32
            and (step.device == p.device if capturable else step.is_cpu)):
        if isinstance(step, bytes):  # (checkpoint.STEP_MARKER: a saved state's entry)
            raise RuntimeError(
                f"{where(books, gi, i, p)}: its state is a saved state dict's entry, put into "
                f"optimizer.state as saved (torch's ZeroRedundancyOptimizer.load_state_dict "
                f"does so); precis's optimizers take a saved state through load_state_dict, "
                f"which converts it: load it there (under ZeroRedundancyOptimizer, each rank's "
                f"own zero.optim.state_dict() into zero.optim.load_state_dict()), or shard "
                f"with precis.ddp (sharding='optim')")
        state["step"] = step_tensor(0 if step is None else int(step),
                                    p.device if capturable else "cpu")
    if p not in books.streams and rounds_stochastically(layout, p.dtype):
        books.streams[p] = streams.take(index)
    # State made for these strides needs no look (the step path stays cheap).
    relayout = not is_dtensor(p) and "exp_avg" in state and \
        state["exp_avg"].stride() != local.stride()
    for key in moments:
        dtype = layout.moment_dtype(key)
        t = state.get(key)
        if t is None:
            if rule.first_step_starts_momentum and step is not None and \
                    int(state["step"]):
                # SGD's momentum turned on after steps without: its kernel starts a buffer
                # from g at step 1, as torch starts one that is None (the step counts
                # nothing else for SGD: torch's keeps none)
                state["step"].zero_()
            state[key] = placed_like(p, torch.zeros_like(local, dtype=dtype))
            if dtype in SCALED_MOMENT_DTYPES:
                state[key + "_scale"] = scales_like(p, torch.zeros(
                    scale_count(local.numel()), dtype=torch.float32, device=local.device))
        elif t.dtype != dtype or t.shape != p.shape:
            raise RuntimeError(
                f"{where(books, gi, i, p)}: its {key} is {t.dtype} of shape "
                f"{tuple(t.shape)} but the policy now wants {dtype} of shape "
                f"{tuple(p.shape)}; did the param change dtype or shape, or the group's "
                f"policy, after the optimizer state was created? (a policy changes through "
                f"state_dict() and load_state_dict() into an optimizer made with the new one)")
        elif type(t) is torch.Tensor and t.device != local.device:  # (a meta one: no data)
            raise RuntimeError(f"{where(books, gi, i, p)}: its {key} is on {t.device} but the "
                               f"param's step runs on {local.device}; a state tensor must be "
                               f"on its param's device")
        elif relayout and not stored_forms.laid_out_like(t, local):
            state[key], scales = stored_forms.relayout(local, t, state.get(key + "_scale"),
                                                       MOMENT_KEYS[key])
            if scales is not None:
                state[key + "_scale"] = scales
    key = layout.master  # "master" (a copy) or "remainder" (its low bits), or None
    if key is not None and key not in state:  # a remainder of zeros: master = the param
        state[key] = placed_like(p, local.detach().to(dtype=layout.master_dtype, copy=True)
                                 if key == "master" else
                                 torch.zeros_like(local, dtype=layout.master_dtype))
    elif key is not None and state[key].dtype != layout.master_dtype:
        field = "main_params_dtype" if key == "master" else "param_remainder_bits"
        raise RuntimeError(f"{where(books, gi, i, p)}: its {key} is {state[key].dtype} but "
                           f"the policy now wants {layout.master_dtype} ({field}); convert the "
                           f"state through state_dict() and load_state_dict()")
    for key in ("master", "remainder"):
        if relayout and key in state and not stored_forms.laid_out_like(state[key], local):
            state[key] = stored_forms.like(local, state[key])
    key = rule.row_state
    if key is not None:  # one fp32 value a row of the whole matrix, on every rank
        rows = (whole_shape(p)[0], 1)
        t = state.get(key)
        if t is None:
            state[key] = replicated_like(p, torch.zeros(rows, dtype=torch.float32,
                                                        device=local.device))
        elif t.dtype != torch.float32 or tuple(t.shape) != rows:
            raise RuntimeError(f"{where(books, gi, i, p)}: its {key} is {t.dtype} of shape "
                               f"{tuple(t.shape)}, not float32 of shape {rows} (a value a row "
                               f"of the param); did the param change shape?")
    if ("master" in state and layout.master != "master") or \
            ("remainder" in state and layout.master != "remainder"):
        raise RuntimeError(f"{where(books, gi, i, p)}: its state has a master/remainder its "
                           f"policy does not keep for a {p.dtype} param; did the param "
                           f"change dtype?")


def watched(books, p, state):
    """Whether the optimizer keeps a copy of p's values that a write into p would make
    stale: a master or remainder in its state, or a host copy (offload)."""
    return "master" in state or "remainder" in state or (
        books.offload is not None and books.offload.selected(p))


def record_written(books, params):
    """Remember what params (their local shards) hold now, as the optimizer left them
    (a GPU's read back at the next look: fingerprints.Records)."""
    params = list(params)
    books.written.record(map(id, params), [local_shard(p, p) for p in params])


def written_behind(books, params):
    """The params (among those with a record in books.written) whose values changed
    since the optimizer last left them: each one's fingerprint now against its record;
    those to compare by rule (books.written.by_rule: a step that saw writes itself
    left them unrecorded), which resync() takes element by element (nothing where none
    was written: no warning); and those whose loaded remainder is still to be checked
    against their bits (books.fingerprints: a load's, whose param did not hold the bits
    it was saved with then), which resync() keeps if the param holds them now."""
    ruled = [p for p in params if id(p) in books.written.by_rule] \
        if books.written.by_rule else []
    recorded = [p for p in params if id(p) in books.written]
    now = fingerprints.of([local_shard(p, p) for p in recorded])
    written = [p for p, value in zip(recorded, now) if books.written[id(p)] != value]
    if books.fingerprints:
        seen = set(map(id, written))
        written += [p for p in params if p in books.fingerprints and id(p) not in seen]
    return written + ruled


# A write that leaves at most one element in WHOLE_LOAD (and at most one in any tensor)
# rounding to its master is a load of the whole tensor, resynced whole: new weights
# equal the old ones by chance in about 1 bf16 element of 1,000 (docs/design.md
# section 6). The kernels decide it (csrc/resync.h's PR_WHOLE_LOAD); this one words
# the warning.
WHOLE_LOAD = 64


def resync(books, p, state, auto):
    """Rebuild p's master or remainder from p. auto: only what is inconsistent with p:
    the elements of a master that no longer round to p (a write into part of p, such as
    a mask or a clamp, is a write into that part: the other elements keep their masters
    bit for bit), all of them after a whole load (resync_master); a remainder, whole,
    unless it was loaded for p's very bits (a remainder cannot tell which elements were
    written). Returns what it rewrote, for the StaleMasterWarning ('' when nothing)."""
    seen = ""
    expected = books.fingerprints.pop(p, None)
    join = books.joins.pop(p, None)
    local = local_home(books, p)
    if auto and join is not None and master_state.rejoin(state, local, join):
        pass  # the param a loaded remainder was saved with arrived: its master, no warning
    elif "master" in state:
        seen = resync_master(local_shard(p, state["master"]), local.detach(), auto,
                             describe=not books.last["warned_stale"])
    elif "remainder" in state:
        if not (auto and expected is not None and stored_forms.fingerprint(local) == expected):
            # (a loaded remainder whose param never held its bits since the load: the
            # blocks' records, the load's, say nothing of it; resynced whole)
            remainder = local_shard(p, state["remainder"])
            done, kept = resync_blocks(books, [(p, remainder, local.detach())]
                                       if auto and expected is None else [])
            if not done:
                remainder.zero_()  # master = the param exactly
                seen = REMAINDERS_RESYNCED
            else:  # (a read back: this compare reads on the host already)
                seen = resync_words(int(kept[0]), local.numel(), True)
    record_written(books, [p])
    record_blocks(books, [(p, state)])
    return seen


def record_blocks(books, pairs):
    """Remember what the params of pairs ((param, its state) each) that keep remainders
    hold now, block by block (books.blocks; fingerprints.of_blocks: one call a device,
    nothing read back); the others' records are dropped."""
    by_device = {}
    for p, state in pairs:
        flat = memory_of(local_shard(p, p)) if "remainder" in state else None
        if flat is None:
            books.blocks.pop(id(p), None)
        else:
            by_device.setdefault((flat.device, flat.dtype), []).append((p, flat))
    for entries in by_device.values():
        blocks = fingerprints.Blocks([flat for _, flat in entries])
        books.blocks.update(zip([id(p) for p, _ in entries],
                                blocks.fingerprints_now().split(blocks.counts)))


def memory_of(t):
    """t's memory as a 1-D view (detached), or None when t is not dense."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else stored_forms.dense_flat(t)


def resync_blocks(books, entries):
    """Zero the remainders of the blocks written since books.blocks recorded them (the
    master of each is then the param), for each (p, remainder, param) of entries
    (remainder: p's local one or its host copy's; param: the tensor it pairs with, p's
    local shard or that host copy): one fingerprint call and one precis.resync_masters_
    call for all of one device and kind, nothing read back; their blocks recorded as
    found (a write resynced once, not again at the next compare; not in a capture,
    whose records graph_records rewrites). Returns ([the entries resynced], their kept:
    an int64 tensor on the device, the elements whose remainders each kept, summed
    there from its blocks'); an entry whose p has no usable record is left out (the
    caller resyncs it whole)."""
    batches = {}
    for entry in entries:
        p, remainder, param = entry
        record, pair = books.blocks.get(id(p)), flat_pair(remainder, param)
        source = memory_of(local_shard(p, p))
        if record is None or pair is None or source is None or \
                source.numel() != pair[1].numel() or \
                record.numel() != fingerprints.block_count(source.numel()):
            continue
        key = (source.device, source.dtype, pair[0].device, pair[0].dtype)
        batches.setdefault(key, []).append((entry, pair, source, record))
    done, kepts = [], []
    for batch in batches.values():
        blocks = fingerprints.Blocks([source for _, _, source, _ in batch])
        now = blocks.fingerprints_now()
        records = [record for _, _, _, record in batch]
        written = now != (torch.cat(records) if len(records) > 1 else records[0])
        remainders = [pair[0] for _, pair, _, _ in batch]
        kept = torch.empty(written.numel(), dtype=torch.int64, device=remainders[0].device)
        ops.resync_masters_blocks_(remainders, [pair[1] for _, pair, _, _ in batch],
                                   written.to(kept.device).view(torch.uint8), kept,
                                   fingerprints.BLOCK)
        if fingerprints.readable():  # (a CUDA graph's capture rewrites its records)
            books.blocks.update(zip([id(entry[0]) for entry, _, _, _ in batch],
                                    now.split(blocks.counts)))
        done += [entry for entry, _, _, _ in batch]
        kepts.append(summed(kept, blocks.counts))
    return done, (torch.cat(kepts) if len(kepts) > 1 else kepts[0]) if kepts else None


def summed(values, counts):
    """The sums of consecutive runs of values (a 1-D tensor), of counts[i] (>= 1: block
    counts, an empty param's one empty block) each, made where values are, in a few
    launches whatever the number of runs (a prefix sum, its runs' ends, their
    differences; nothing copied to a device): a warning then reads a value a param back,
    not one a block."""
    prefix = values.cumsum(0)
    ends = torch.stack([prefix[at - 1] for at in itertools.accumulate(counts)])
    return torch.diff(ends, prepend=ends.new_zeros(1))


def joins_arrived(books, state):
    """Make anew, as the next step would, each loaded remainder's join (books.joins)
    whose param holds the bits it was saved with now (a model loaded after its
    optimizer): what state_dict() exports is then the master the step would use."""
    for p, join in list(books.joins.items()):
        if p in state and master_state.rejoin(state[p], local_home(books, p), join):
            del books.joins[p]
            record_written(books, [p])  # (as the optimizer left it: nothing to resync)


def forget_loaded(books, params):
    """Forget the loaded remainder's fingerprint and the join still to make anew of each
    of params, which a step just wrote: the remainder moved with the step (it no longer
    belongs to the bits it was saved with), and master_state.rejoin refuses a join whose
    master a step changed."""
    for p in params:
        books.fingerprints.pop(p, None)
        books.joins.pop(p, None)


def resync_master(master, param, auto, describe=True):
    """Rewrite master from param: whole (not auto), or by precis.resync_masters_ (the rule
    of csrc/resync.h): where it does not round to param, and whole when at most
    max(1, numel / WHOLE_LOAD) elements (not all) still round to it (a whole load: bit for
    bit what a resync did before partial writes were told apart). Decided by the
    kernel, nothing read back; the count is read back only to describe what was seen
    ('' when nothing was rewritten), not once the warning was given (describe False:
    'written')."""
    if not auto:
        master.copy_(param)
        return "reloaded"
    kept = resync_flagged(master, param, torch.ones(1, dtype=torch.uint8, device=param.device))
    if not describe:
        return "written"
    return described(int(kept[0]), param.numel())  # (a read back: once, for the warning)


def resync_flagged(master, param, stale):
    """precis.resync_masters_ of one master (or remainder) and its param where stale (a
    1-element flag, on the device on a GPU's path) is set: kept (an int64 of one
    entry). Any strides: their memory taken flat where both are laid out alike and
    dense (flat_pair), else through contiguous copies."""
    pair = flat_pair(master, param)
    if pair is not None:
        return ops.resync_masters_([pair[0]], [pair[1]], stale)
    work = master.contiguous()
    kept = ops.resync_masters_([work], [param.contiguous()], stale)
    master.copy_(work)
    return kept


def flat_pair(master, param):
    """(master, param) as 1-D views of their memory, element for element, when both are
    dense and laid out alike (what precis.resync_masters_ takes without copies); else
    None."""
    flat_master, flat_param = stored_forms.dense_flat(master), stored_forms.dense_flat(param)
    if flat_master is None or flat_param is None or not stored_forms.same_layout(master, param):
        return None
    return flat_master, flat_param


# resync's words for a param whose remainders it zeroed: REMAINDER_WORDS in each, as a
# write into remainders is warned of each time one is found (functional.warn_stale)
REMAINDER_WORDS = "its remainders resynced"
REMAINDERS_RESYNCED = f"written ({REMAINDER_WORDS} whole)"


def resync_words(kept, n, remainder):
    """What precis.resync_masters_ did to a param of n elements, from its kept (read
    back), in resync's words ('' when nothing was rewritten): remainders are zeroed
    in the blocks written (kept: the elements of the others; 0: whole), a master where it
    no longer rounds (described)."""
    if remainder:
        if kept == n:
            return ""
        return REMAINDERS_RESYNCED if kept == 0 else \
            f"a partial write ({REMAINDER_WORDS} in the blocks of " \
            f"{fingerprints.BLOCK} elements it touched: {n - kept} of {n} elements; the " \
            f"others kept)"
    return described(kept, n)


def described(kept, n):
    """What resync_master rewrote of a master of n elements, kept of which still rounded
    to the param, for the StaleMasterWarning ('' when nothing)."""
    if kept == n:
        return ""
    if kept <= max(1, n // WHOLE_LOAD):
        return f"a whole load, {n - kept} of {n} elements written"
    return f"a partial write, {n - kept} of {n} elements (the others' masters kept)"
