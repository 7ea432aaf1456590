"""The fast path of a step with many small params: the steady state of param groups
stepped together (a Plan), their state flat (one buffer per state kind and layout, each
param's state a view of a range of it), checked a whole list at a time, so that one
torch.ops.precis.adam_step_flat_ call per layout with no Python work per param steps
them: params and grads as lists, the state as the buffers, a table of where each param's
state lies, and each param's lr and weight decay (its group's). Groups whose other
hyperparameters agree share a Plan (a model's decayed and undecayed groups: one call a
step, not one a group)."""

import itertools
import operator
from itertools import repeat
from typing import NamedTuple

import torch

from . import step_calls, device_reads, fingerprints, ops, optim_state, torch_math
from .step_calls import Call
from .dtensor import element_offset, is_dtensor
from .group_checks import FLOAT32_MAX
from .optim_state import CountedState, ParamState, policy_key
from .op_constants import ROW_DATA, ROW_ELEMENT_OFFSET, ROW_NUMEL, ROW_OFFSET, ROW_SCALE_OFFSET
from .op_constants import ROW_SHAPE_KEY, ROW_STEP, ROW_STREAM, ROW_WIDTH
from .op_constants import FLAT_BUFFERS, data_address, scale_count, shape_key

# The state kinds kept flat, as the op's buffers: state key -> buffer name.
FLAT_KEYS = {"master": "master", "remainder": "master", "exp_avg": "exp_avg",
             "exp_avg_sq": "exp_avg_sq", "exp_avg_scale": "exp_avg_scale",
             "exp_avg_sq_scale": "exp_avg_sq_scale", "max_exp_avg_sq": "max_exp_avg_sq",
             "max_exp_avg_sq_scale": "max_exp_avg_sq_scale"}


_GRAD = operator.attrgetter("grad")
_KEPT_AT = 2  # kept's place in a compared call's fingerprints: [out, records, kept(, sums)]
_DATA_PTR = torch.Tensor.data_ptr


class Part(NamedTuple):
    """The params of one layout (param dtype and state dtypes) in a planned group, and
    their state flat: each kind one buffer (`buffers`), each param's entry a view of
    it, its 'step' tensors views of one float32 buffer (torch's float32 counts, counted
    by one add_). One adam_step_flat_ call steps it. While the plan holds, the
    fingerprints of its params with a master are its own, not books.written's:
    drop_plan hands them back."""
    pick: object         # the group's list -> this part's (a list), or None: all of it
    dtype: torch.dtype   # its params' (the op refuses a call of mixed dtypes)
    params: tuple
    states: tuple
    step_buffer: torch.Tensor
    buffers: dict        # each of the op's buffers by name (an empty tensor where absent)
    table: torch.Tensor  # the op's table: where each param's state lies, its step
    stamped: tuple       # the params whose master/remainder a write would make stale ...
    ptrs: list           # ... their data_ptr() (the op checks ROW_DATA too) ...
    ranges: object       # ... their bytes as fingerprints.Ranges (None off the CPU) ...
    written: list        # ... and their fingerprints after the plan's last step ...
    stamped_at: tuple    # ... and their places in params
    fingerprints: object  # the op's out (an int64 per param): on the CPU a tensor; on the
    # device path a list of two on the device taking turns (out()), so that the step never
    # writes the record the next compare reads; None without stamped params
    # the device path (device_reads.device_path): `written` holds one int64 tensor, the
    # op's last out, compared and resynced by the op itself (resync_args)
    compared: bool = False  # whether the op compares (the compare on the device)
    places: tuple = ()     # their (group index, place in it), for StaleMasterWarning's names
    runs: tuple = ()       # (member, count) a run of rows: its rows' group (Plan.groups[member])
    numels: list = None    # the stamped params' numels: a kept of nothing written
    kept: object = None    # on the CPU (sees): the int64 tensor the op writes what it kept
    kept_rows: object = None  # with the compare: KeptRows, where the op writes what it kept,
    # a row a step, and its sums (two int64 a param, zero: on CUDA the compare's, left
    # zero by each call)
    sums: object = None
    step_column: object = None  # table[:, ROW_STEP], a view made once ...
    next_steps: object = None   # ... and the float32 steps after this update: for a call
    # the op does not count (count_by_table), no allocation a step
    blocks: object = None  # PartBlocks, for params with remainders
    # On the CPU, params with a master: the op sees writes into them itself (fingerprints
    # [empty, kept]: an element no longer its master's rounding takes the param), so the
    # Part keeps no record, compares none and ranges/written stay empty; `kept` (each
    # param's numel until a step takes elements) is the op's count, for the warning
    sees: bool = False

    def op_counts(self):
        """Whether its op call counts its steps (adam_step_flat_'s step_counts: its float32 CPU
        step buffer, advanced by the op, no torch op a step): unless a flag (found_inf,
        check_finite) decides after the call whether the step was taken."""
        return self.step_buffer.dtype == torch.float32 and self.step_buffer.device.type == "cpu"

    def count_by_table(self):
        """For a call the op does not count: its table's step column set to this update's
        step numbers (torch's float32 `step += 1`), the step buffer advanced by the caller
        once the step is known taken."""
        torch.add(self.step_buffer, 1.0, out=self.next_steps)
        self.step_column.copy_(self.next_steps)

    def out(self):
        """The int64 tensor the op records this step's fingerprints in (the call's
        `fingerprints`): on the device path the buffer whose turn it is; for a Part that
        sees writes itself an empty one (no record)."""
        return self.fingerprints[0] if isinstance(self.fingerprints, list) else \
            self.fingerprints

    def written_now(self):
        """The fingerprints of the stamped params' values now, at self.ptrs (a list of
        ints; on the CPU one C call, compared with `written` in C by list ==; on the
        device path a list of the op's int64 tensor, not read back)."""
        if self.ranges is not None:
            return self.ranges.fingerprints_now()[:]
        if self.compared:
            return [ops.fingerprint(list(self.stamped))]
        return fingerprints.of(self.stamped)

    def records(self):
        """(ids of the stamped params, their fingerprints after the plan's last step: a
        list of ints, or on the device path the op's int64 tensor, unread)."""
        ids = list(map(id, self.stamped))
        if self.sees:  # (None: no record, compared by rule: written_by_param)
            return ids, [None] * len(ids)
        return ids, self.written[0] if self.compared else self.written

    def resync_args(self):
        """The op's resync for this step: (records, kept, sums), the stamped params'
        fingerprints after the plan's last step (`written`, the op's out then), the Part's
        int64 tensor the op writes with what it kept (csrc/resync.h's rule: a param written
        since has its master resynced where it no longer rounds from it, or its remainders
        zeroed; a param not written keeps its numel: the row of kept_rows this step's
        call writes), for the warning (described), read later, and the sums the op's CUDA
        compare keeps zero between its calls."""
        return self.written[0], self.kept_rows.now(), self.sums

    def described(self, rows):
        """The StaleMasterWarning's words for what the op's resync did at the steps of
        `rows` (kept read back: a list a step), as optim_state.resync words them, each
        param once, as the first step that resynced it (nothing for a row that is each
        param's numel: none written)."""
        remainder = "remainder" in self.states[0]
        words = {}
        for kept in rows:
            if kept != self.numels:
                for where, p, k in zip(self.places, self.stamped, kept):
                    w = optim_state.resync_words(k, p.numel(), remainder)
                    if w and where not in words:
                        words[where] = w
        return [f"group {gi} param {i}: {w}" for (gi, i), w in words.items()]


    def restamp(self):
        """After a step that wrote the params: what the plan's own writes left in them.
        The op summed their fingerprints as it wrote them (no pass of its own over the
        params): on the device path its output is kept unread, and the buffers turn.
        Nothing for a Part that sees writes itself (no record)."""
        if not self.stamped or self.sees:
            return
        if isinstance(self.fingerprints, list):
            out = self.fingerprints[0]
            # (every param of a Part is stamped: see make_part)
            self.written[:] = [out if self.blocks is None else self.blocks.views[id(out)][0]]
            self.fingerprints.reverse()  # the next step writes the other
            return
        out = self.fingerprints
        values = fingerprints.unsigned(out if self.blocks is None else
                                       self.blocks.views[id(out)][0])
        self.written[:] = [values[i] for i in self.stamped_at]

    def holds(self):
        """Its params still of its dtype (the first: the op refuses the others if they
        differ from it), none with a master given new memory (`p.data = ...`) and none
        written behind our back (a load: their fingerprints), a whole list at a time."""
        return self.params[0].dtype == self.dtype and \
            list(map(_DATA_PTR, self.stamped)) == self.ptrs and \
            (self.compared or self.sees or self.written_now() == self.written)


class KeptRows:
    """What a compared Part's op kept of each param (csrc/resync.h's rule: an int64 entry
    a param, on the params' device; its numel where the param was not written) at its last
    ROWS steps, a row a step, copied back in one copy once every row is written, or sooner
    (copy: a Plan dropped, state_dict() and the like), so that a step copies nothing back
    of its own: the StaleMasterWarning names a write at most ROWS steps after it (and the
    copy's time). A copy is queued on the current stream, as the op calls are (as
    books.written's records of the op's outputs are read)."""
    ROWS = 16

    def __init__(self, count, device):
        self.rows = torch.empty(self.ROWS, count, dtype=torch.int64, device=device)
        self.views = list(self.rows)  # (each row's view made once, not a step)
        self.written = 0  # rows the op has written since the last copy

    def now(self):
        """The row the next op call writes."""
        return self.views[self.written]

    def took(self):
        """After an op call wrote now(): the rows copied back (copy) once all are
        written, else None."""
        self.written += 1
        return self.copy() if self.written == self.ROWS else None

    def copy(self):
        """The rows written since the last copy, copied back without waiting (a
        device_reads.Later; its values a list a row), or None where there are none (the
        next call writes the first row again: in stream order, after the copy)."""
        if not self.written:
            return None
        later = device_reads.Later(self.rows if self.written == self.ROWS else
                                   self.rows[:self.written])
        self.written = 0
        return later


class Plan(NamedTuple):
    """The steady state of the steps of param groups stepped together (`groups`: one, or
    several whose hyperparameters but lr and weight decay agree), so that a step need
    not look at each param's state again: one device, every param plain (contiguous,
    not a DTensor, not complex, not offloaded) with a gradient and complete state, the
    groups' params in one Part per layout (one op call each, each param with its group's
    lr and weight decay: a model of one layout is one call a step). Checked at every
    step, a whole list at a time: the same params, the same state object with no change
    counted since (optim_state.CountedState: no state entry replaced or removed), each
    Part's holds(), a grad for every param and the groups' hyperparameters still
    agreeing. The op checks the rest as it checks every call: each param's size, shape
    (the table's shape key), address (for a param with a master: `p.data = ...` keeps
    its version), dtype, device and contiguity, and the grads'; a call it refuses raises
    Refused before anything is written, and the step is taken again on the full path.
    Anything else takes the full path for every group of the plan, which makes new
    plans. books.plans maps each of its groups to it."""
    keys: tuple          # per group: plan_keys'
    state: dict          # the optimizer's state object ...
    changes: int         # ... and its count of changes, when the plan was made
    device: torch.device
    params: tuple        # the groups' params, one after another
    parts: tuple         # a Part per layout
    groups: tuple = (0,)  # the group indices (ascending)
    sizes: tuple = ()    # their counts of params


class Refused(Exception):
    """A planned op call refused its arguments (the op checks them all before it
    writes): nothing was written, and the step is taken again on the full path,
    which copes (a grad in other strides) or names what is wrong."""


def agreeing(scalars):
    """The op arguments of a group's call that its plan's groups must share: all but lr
    and weight decay (each param's own in the call), or None with an lr tensor (a
    device value, not one a param)."""
    if "lr_tensor" in scalars:
        return None
    return tuple(sorted((k, v) for k, v in scalars.items() if k not in ("lr", "weight_decay")))


def plan_keys(books, groups):
    """What of each group its Plan is made for (Plan.keys): its policy's key, the moments
    its step reads (rule.moments) and what routes a param to torch's math (a group made
    differentiable, or given tensor betas, steps by torch's math from then on)."""
    return tuple((policy_key(g["policy"]), optim_state.rule_of(books, g).moments(g),
                  torch_math.routing_key(g)) for g in groups)


def planned_calls(books, state, param_groups, gi):
    """The op calls of group gi's Plan (one per Part), or None when the plan does not
    hold; [] for a plan's group after its first (the first's calls step it). Each check
    runs over a whole list (map: no Python code per param)."""
    plan = books.plans.get(gi)
    if plan is None or books.offload is not None:
        return None
    if gi != plan.groups[0]:
        return []  # (a plan that did not hold was dropped, for all its groups, at the first)
    groups = [param_groups[g] for g in plan.groups if g < len(param_groups)]
    if len(groups) != len(plan.groups) or any(map(step_calls.counts_on_device, groups)) or \
            plan.keys != plan_keys(books, groups):
        return None
    # the same entries: the same state object, no change since
    lists = [g["params"] for g in groups]
    if plan.state is not state or plan.changes != getattr(state, "changes", None) or \
            tuple(map(len, lists)) != plan.sizes:
        return None
    params = lists[0] if len(lists) == 1 else [p for ps in lists for p in ps]
    if not all(map(operator.is_, params, plan.params)) or \
            not all(part.holds() for part in plan.parts):
        return None
    grads = grads_of(params)
    if any(map(operator.is_, grads, repeat(None))):  # a param without a grad this step
        return None
    for g, group in zip(plan.groups[1:], groups[1:]):  # (the first's: gather's) before
        optim_state.rule_of(books, group).check(group, f"{books.name} param group {g}")  # read
    scalars = [step_calls.scalar_args(books, g, group, plan.device)
               for g, group in zip(plan.groups, groups)]
    if len(scalars) > 1 and any(agreeing(s) != agreeing(scalars[0]) or agreeing(s) is None
                                for s in scalars):
        return None
    calls = []
    for part in plan.parts:
        mine = params if part.pick is None else part.pick(params)
        args = dict(params=mine, grads=grads if part.pick is None else part.pick(grads),
                    buffers=part.buffers, table=part.table, fingerprints=part.out(),
                    **scalars[0])
        if part.compared and part.blocks is not None and part.blocks.record is not None \
                and part.blocks.in_op:
            # (the op compares each block with its record as it steps it, resyncs those
            # written since and writes what each param kept: fingerprints [out, records,
            # kept]; all stamped: make_part)
            args["resync"] = (part.blocks.records_for(args["fingerprints"]),
                              part.kept_rows.now())
        elif part.compared:  # (the op compares each param whole)
            args["resync"] = part.resync_args()
        elif part.sees:
            args["resync"] = (part.kept,)  # (fingerprints [empty, kept])
        if len(scalars) > 1:  # each row its group's
            args["lrs"] = [x for m, n in part.runs for x in repeat(scalars[m]["lr"], n)]
            args["weight_decays"] = [x for m, n in part.runs
                                     for x in repeat(scalars[m]["weight_decay"], n)]
        calls.append(Call(plan.device, args, part.states, mine, [], part))
    return calls


class PartBlocks:
    """The blocks of a Part's params that keep remainders (fingerprints.BLOCK), made once:
    their fingerprints.Blocks; `record`, the fingerprints of their blocks after the plan's
    last step (books.blocks', one tensor: handed back to books.blocks by drop_plan), None
    where a param had none; with the compare on the device, `holder`, the Part's record
    buffer whose blocks `record` is (the op's out of the last step: the next step's op
    compares each block with it, fingerprints [out, records, kept]), None while the record
    lies elsewhere."""

    def __init__(self, books, params):
        self.ids = list(map(id, params))
        self.blocks = fingerprints.Blocks([p.detach().view(-1) for p in params])
        records = [books.blocks.get(key) for key in self.ids]
        self.record = None if any(r is None or r.numel() != n for r, n in
                                  zip(records, self.blocks.counts)) else torch.cat(records)
        self.holder = None
        self.outs = []
        self.views = {}
        # (the op compares blocks with no empty param among them: on a GPU its update
        # kernels do, a CUDA block a record block; else the op compares each param whole)
        self.in_op = all(n > 0 for n in map(torch.numel, params))

    def cut(self, outs):
        """The Part's record buffers (outs: one, or on the device path two taking
        turns), an entry a param and then their blocks' (the op's fingerprints), each
        as two views made once (views: id -> (the params' entries, their blocks'))."""
        self.outs = list(outs)
        self.views = {id(out): (out[:len(self.ids)], out[len(self.ids):]) for out in outs}

    def took(self, out, compared=False):
        """After a step's op call given `out`, one of the Part's record buffers: the
        blocks' record it holds (made as the op wrote the params, or as found by a call
        that skipped the step, after its compare; on the device path the next step's op
        writes the other buffer). out None (no op call ran: a step skipped before it, a
        refused call): with the compare in the op (compared) the record stands (no
        compare ran: the next one sees the writes since), else their fingerprints now
        (the full path resynced them before)."""
        views = self.views.get(id(out))
        if views is not None:
            self.record, self.holder = views[1], out
        elif not compared:
            self.record, self.holder = self.blocks.fingerprints_now(), None

    def records_for(self, out):
        """The op's records for a step that writes `out`: the other record buffer, the
        record copied into its blocks where it lies elsewhere (the plan's first step, a
        step after a pass)."""
        if self.holder is None or self.holder is out:
            other = next(o for o in self.outs if o is not out)
            self.views[id(other)][1].copy_(self.record)
            self.record, self.holder = self.views[id(other)][1], other
        return self.holder

    def hand_back(self, books):
        """The record into books.blocks (the plan dropped), copied: its buffer is the
        plan's."""
        if self.record is not None:
            books.blocks.update(zip(self.ids, self.record.clone().split(self.blocks.counts)))


def grads_of(params):
    """Each param's gradient as the step reads it: main_grad, else .grad."""
    mains = list(map(getattr, params, repeat("main_grad"), repeat(None)))
    if all(map(operator.is_, mains, repeat(None))):
        return list(map(_GRAD, params))
    return [p.grad if g is None else g for p, g in zip(params, mains)]


def distinct(plans):
    """Each plan of books.plans once (a plan of several groups is there once a group)."""
    return list({id(plan): plan for plan in plans.values()}.values())


def drop_plan(books, gi):
    """Forget group gi's plan (for every group of it), handing its fingerprints back to
    books.written."""
    plan = books.plans.pop(gi, None)
    if plan is None:
        return
    if books.steady is not None and books.steady.plan is plan:
        books.steady = None  # (its call would keep the plan's buffers alive)
    for g in plan.groups:
        books.plans.pop(g, None)
    hand_back(books, plan)


def hand_back(books, plan):
    """A plan's records (its params' fingerprints, and their blocks') into books.written
    and books.blocks: when it is dropped, and before a plan made anew with its groups
    reads them there (make_plans: else the new one's would be those of the step before
    the earlier plan's first, and its first compare would take the plan's own steps for
    writes); its kept's rows copied back for the warning (copy_kept)."""
    copy_kept(books, plan)
    for part in plan.parts:
        if part.sees:  # no record: the next step compares them by rounding
            books.written.compare_by_rule(map(id, part.stamped))
            continue
        ids, values = part.records()
        if isinstance(values, torch.Tensor):
            books.written.record_values(ids, values)
        else:
            books.written.update(zip(ids, values))
        if part.blocks is not None:
            part.blocks.hand_back(books)


def written_by_param(books, params):
    """{param: the fingerprint of what the optimizer last left in it} for those of params
    with a record (a holding Plan's own, else books.written's), keyed by the params
    themselves: what a copy of the optimizer (deepcopy, pickle) carries over; None for
    one compared by rule (no record: Part.sees, Records.by_rule)."""
    planned = {}
    for plan in distinct(books.plans):
        for part in plan.parts:
            ids, values = part.records()
            planned.update(zip(ids, fingerprints.unsigned(values)
                               if isinstance(values, torch.Tensor) else values))
    ruled = books.written.by_rule
    return {p: planned[id(p)] if id(p) in planned else None if id(p) in ruled else
            books.written[id(p)]
            for p in params if id(p) in planned or id(p) in books.written or id(p) in ruled}


def make_plans(books, state, param_groups, made):
    """Plans for the groups of `made` ({group index: the calls a full-path step made for
    it}) that can have one, after that step: those whose hyperparameters but lr and
    weight decay agree (agreeing) share one. Only a state dict that counts its changes
    (optim_state.CountedState, of ParamStates) gets one: a plain dict's replaced entries
    would go unseen."""
    if books.offload is not None or not isinstance(state, CountedState) or \
            not all(optim_state.rule_of(books, group).flat for group in param_groups):
        return  # (Muon's groups are not flat, nor are an optimizer's with them)
    together = {}  # (device, the moments read, agreeing op args) -> [(gi, states)]
    for gi, calls in made.items():
        states = plannable(books, state, param_groups[gi], calls)
        if states is not None:
            key = together_key(books, param_groups, gi, calls[0].device)
            together.setdefault(key, []).append((gi, states))
    if not together:
        return
    # The groups of a plan made earlier that the new ones agree with (one call a step
    # again after a group fell off and came back): made anew with them where they can be
    earlier = {}
    for plan in distinct(books.plans):
        key = together_key(books, param_groups, plan.groups[0], plan.device)
        if key in together and all(g < len(param_groups) for g in plan.groups):
            hand_back(books, plan)  # (its records are newer than books')
            earlier.setdefault(key, []).extend(
                (g, tuple(state[p] for p in param_groups[g]["params"])) for g in plan.groups)
    for key, members in together.items():
        # all, else the new ones, else each new one that can alone (make_plan refuses a
        # layout of empty params before it changes anything)
        for attempt in ([sorted(members + earlier[key])] if key in earlier else []) + [members]:
            if register(books, attempt, make_plan(books, state, param_groups, key[0], attempt)):
                break
        else:
            for member in members if len(members) > 1 else ():
                register(books, [member], make_plan(books, state, param_groups, key[0], [member]))


def register(books, members, plan):
    """Group members' (their (index, states)) plan, if one: whether there is."""
    if plan is None:
        return False
    for gi, _ in members:
        drop_plan(books, gi)  # (a plan made earlier: its records handed back)
    for gi, _ in members:
        books.plans[gi] = plan
    return True


def together_key(books, param_groups, gi, device):
    """What group gi's steps share with the groups a plan steps with it: its device, the
    moments it reads and its op arguments but lr and weight decay (agreeing; with an lr
    tensor, the group itself: a plan of its own)."""
    group = param_groups[gi]
    agree = agreeing(step_calls.scalar_args(books, gi, group, device))
    return device, optim_state.rule_of(books, group).moments(group), \
        agree if agree is not None else gi


def plannable(books, state, group, calls):
    """The states of a group's params if the full-path step that made `calls` for it
    leaves it one a Plan can step, else None."""
    if len(calls) != 1 or step_calls.counts_on_device(group):
        return None
    call = calls[0]
    params, states = tuple(group["params"]), tuple(call.states)
    if not all(isinstance(st, ParamState) and st.owner is state for st in states):
        return None  # a state a user put there: its entries' changes are not counted
    grads = grads_of(params)  # the op's own (not copies): plain, as the flat op takes them
    if call.writebacks or len(call.params) != len(params) or \
            not all(map(operator.is_, params, call.params)) or \
            not all(map(operator.is_, grads, call.args["grads"])):
        return None
    if any(is_dtensor(p) or p.is_complex() or not p.is_contiguous() for p in params):
        return None
    # A loaded remainder's fingerprint still to check, or a join still to make anew, is
    # the host compare's (optim_state.resync): no Part looks for them (a step that
    # wrote the param forgot them: optim_state.forget_loaded)
    if any(p in books.fingerprints or p in books.joins for p in params):
        return None
    # A param with a master whose record stands (an optimizer-only load's, which a step
    # the kernel skipped left): its master stands until the param is written, so the
    # host compares it (functional.gather); a Part on the CPU would see it written
    # (Part.sees: the op takes a param that is not its master's rounding)
    if not device_reads.device_path(call.device) and \
            any(id(p) in books.written for p, st in zip(params, states) if "master" in st):
        return None
    return states


def make_plan(books, state, param_groups, device, members):
    """The Plan of the groups of members ((group index, its params' states) each, their
    hyperparameters agreeing), or None."""
    groups = [param_groups[gi] for gi, _ in members]
    lists = [tuple(group["params"]) for group in groups]
    params = tuple(p for ps in lists for p in ps)
    states = tuple(st for _, sts in members for st in sts)
    # each row's group: its member and its place in it
    where = [(m, gi, i) for m, (gi, _) in enumerate(members) for i in range(len(lists[m]))]
    # a moment the step does not read now (amsgrad off, SGD at momentum 0) stays in the
    # state, out of the plan: the plan's key changes when the setting comes back
    unread = step_calls.unread_moments(books, groups[0])
    keys = [key for key in FLAT_KEYS if step_calls.moment_of(key) not in unread]
    by_layout = {}  # (param dtype, each flat key's dtype) -> positions in params
    for i, (p, st) in enumerate(zip(params, states)):
        layout = (p.dtype, tuple((key, st[key].dtype) for key in keys if key in st))
        by_layout.setdefault(layout, []).append(i)
    # A part of no elements: the op would read its empty buffers as absent (the list path)
    if any(not any(params[i].numel() for i in positions) for positions in by_layout.values()):
        return None
    parts = tuple(make_part(books, params, states,
                            None if len(by_layout) == 1 else positions, keys, where)
                  for positions in by_layout.values())
    return Plan(plan_keys(books, groups), state, state.changes, device, params, parts,
                tuple(gi for gi, _ in members),
                tuple(map(len, lists)))


def picker(positions):
    """A function taking a list to its items at `positions` (a list), in C."""
    get = operator.itemgetter(*positions)
    return (lambda seq: [get(seq)]) if len(positions) == 1 else (lambda seq: list(get(seq)))


def make_part(books, params, states, positions, keys, where):
    """The Part of params[positions] (all of them for None), their state's `keys` made
    flat; where: each param's (member of the plan, group index, place in the group)."""
    pick = None if positions is None else picker(positions)
    if pick is not None:
        params, states, where = tuple(pick(params)), tuple(pick(states)), pick(where)
    runs = tuple((m, len(list(rows))) for m, rows in
                 itertools.groupby(m for m, _, _ in where))
    steps = torch.stack([st["step"] for st in states])
    for i, (st, view) in enumerate(zip(states, steps.unbind(0))):
        dict.__setitem__(st, "step", view)  # not counted: the plan's own rewiring
        st.views["step"] = (view, steps, i)
    flat = flatten(states, keys)
    absent = torch.empty(0, device=params[0].device)
    buffers = {name: flat.get(name, absent) for name in FLAT_BUFFERS}  # no allocation per step
    table = torch.zeros(len(states), ROW_WIDTH, dtype=torch.int64)
    numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
    blocks = torch.tensor([scale_count(p.numel()) for p in params], dtype=torch.int64)
    table[:, ROW_NUMEL] = numels
    table[1:, ROW_OFFSET] = numels.cumsum(0)[:-1]
    table[1:, ROW_SCALE_OFFSET] = blocks.cumsum(0)[:-1]
    table[:, ROW_STREAM] = torch.tensor([books.streams.get(p, 0) for p in params])
    table[:, ROW_ELEMENT_OFFSET] = torch.tensor(list(map(element_offset, params)))
    table[:, ROW_SHAPE_KEY] = torch.tensor([shape_key(p.shape) for p in params])
    # the step numbers of a call the op does not count (count_by_table writes them); else
    # read only by functional.check_calls' dry runs, which write nothing: any count >= 1
    table[:, ROW_STEP] = 1
    with_master = ["master" in st or "remainder" in st for st in states]
    # a master's record of its param goes stale when the param's memory is replaced
    table[:, ROW_DATA] = torch.tensor([data_address(p) if m else 0
                                       for p, m in zip(params, with_master)])
    stamped_at = tuple(i for i, m in enumerate(with_master) if m)
    stamped = tuple(params[i] for i in stamped_at)
    ptrs = list(map(_DATA_PTR, stamped))
    cpu = not device_reads.device_path(params[0].device)  # (emulated: a GPU's Part)
    # masters on the CPU: the op sees writes into their params (remainders cannot tell
    # which of their elements were written: their blocks' records stay)
    sees = cpu and stamped != () and "master" in states[0]
    ranges = fingerprints.Ranges(ptrs, [p.numel() * p.element_size() for p in stamped]) \
        if cpu and not sees else None
    device = params[0].device
    compare = device_reads.compares_on_device(device)
    places = tuple(where[i][1:] for i in stamped_at)
    # the op's record: read back after the step (restamp), or with the compare on the
    # device two buffers taking turns, kept unread; params with remainders: an entry a
    # param, then their blocks' (the op records them as it writes: PartBlocks.took)
    remainders = states != () and "remainder" in states[0]  # (then every param is stamped)
    entries = len(params) + (sum(map(fingerprints.block_count, map(torch.numel, params)))
                             if remainders else 0)
    outs = None if not stamped else torch.empty(0, dtype=torch.int64) if sees else \
        [torch.zeros(entries, dtype=torch.int64, device=device) for _ in range(2)] \
        if compare else torch.zeros(entries, dtype=torch.int64, device=device)
    # A Part's layout holds its state's keys, so its params all keep a master or
    # remainder (stamped == params) or none do (nothing stamped, no record)
    compared = compare and stamped != ()
    kept_rows, sums = (KeptRows(len(stamped), device),
                       torch.zeros(2 * len(stamped), dtype=torch.int64, device=device)) \
        if compared else (None, None)
    # (each param's numel: what a step that took nothing leaves)
    kept = torch.tensor([p.numel() for p in stamped], dtype=torch.int64) if sees else None
    blocks = PartBlocks(books, params) if remainders else None
    if blocks is not None:
        blocks.cut(outs if isinstance(outs, list) else [outs])
    part = Part(pick, params[0].dtype, params, states, steps, buffers, table, stamped, ptrs,
                ranges, [], stamped_at, outs, compared, places, runs,
                [p.numel() for p in stamped], kept, kept_rows, sums, table[:, ROW_STEP],
                torch.empty_like(steps), blocks, sees)
    if not sees:
        part.written[:] = part.written_now()
    return part


def flatten(states, keys):
    """Each state kind of `states` (one layout, contiguous entries) among `keys` copied
    into one buffer, the entries replaced by views of it (not counted as changes: the
    plan's own rewiring; recorded in the ParamState's views): the op's buffers by name."""
    buffers = {}
    first = states[0] if states else {}
    for key in keys:
        if key not in first:
            continue
        flat = torch.cat([st[key].reshape(-1) for st in states])
        offset = 0
        for st in states:
            n = st[key].numel()
            view = flat[offset:offset + n].view(st[key].shape)
            dict.__setitem__(st, key, view)
            st.views[key] = (view, flat, offset)
            offset += n
        buffers[FLAT_KEYS[key]] = flat
    return buffers


def watch_resynced(books, calls):
    """After a step's calls ran (`calls`: those whose op ran): what each planned call's
    resync kept, watched for the StaleMasterWarning (watch_kept)."""
    for call in calls:
        if call.part is not None and "resync" in call.args:
            watch_kept(books, call.part)


def watch_kept(books, part):
    """After a call of part's op ran: what its resync kept, watched for the
    StaleMasterWarning until it has been given (named once; remainders' at every look
    that finds a write, functional.settle_stale names them): on the CPU (a Part that sees
    writes itself) read at once, kept only where the step took elements; with the
    compare a row of part.kept_rows, copied back with the others (KeptRows)."""
    if books.last["warned_stale"] and part.blocks is None:
        return  # (the op writes its row of kept_rows again: never read)
    if part.sees:
        if part.kept.tolist() != part.numels:
            keep_looking(books, part.described, device_reads.Later(part.kept[None]))
        return
    keep_looking(books, part.described, part.kept_rows.took())


def copy_kept(books, plan):
    """The rows of kept that plan's Parts wrote since their last copy, copied back for the
    warning (a Plan dropped, or the warning looked for at once: settle_stale's wait); while
    torch.compile traces or a CUDA graph captures (nothing copied there) left for the next
    step that can copy them (copy_uncopied)."""
    readable = fingerprints.readable()
    for part in plan.parts:
        if part.kept_rows is not None and part.kept_rows.written:
            if readable:
                keep_looking(books, part.described, part.kept_rows.copy())
            else:  # (the KeptRows itself: a Plan kept copies its later rows with them)
                books.last.setdefault("kept_uncopied", []).append(
                    (part.described, part.kept_rows))


def copy_uncopied(books):
    """The rows copy_kept could not copy (a Plan dropped while torch.compile traced or a
    CUDA graph captured), copied back now (functional.settle_stale, readable)."""
    for described, rows in books.last.pop("kept_uncopied", ()):
        keep_looking(books, described, rows.copy())


def keep_looking(books, described, later):
    """A Later of a Part's kept (a row a step) queued for functional.settle_stale to read
    with the Part's `described` (none where None)."""
    if later is not None:
        books.last.setdefault("stale_later", []).append((described, later))


# The types of a group's settings a steady step compares by identity: immutable, so that
# the same object is the same value (a list or a mapping could change in place).
_IMMUTABLE = (float, int, bool, str, type(None), torch.dtype, optim_state.Policy)


def immutable(value):
    """Whether value cannot change in place: a plain scalar, a dtype, a Policy or a tuple
    of them."""
    return isinstance(value, _IMMUTABLE) or \
        (type(value) is tuple and all(map(immutable, value)))


def mapping_of_immutables(value):
    """Whether value is a plain dict of immutable keys and values (a policy's overrides,
    as from YAML): it can change in place, so a steady step compares its items too."""
    return type(value) is dict and all(map(immutable, itertools.chain(*value.items())))


class Steady:
    """A steady step of an optimizer whose param groups one Plan of one Part steps: the
    op call made once (ops.flat_call, one for each turn of the Part's record buffers) and
    called again while nothing it was made from changed, so that the step's Python is a
    few checks over whole lists and one op call. What it compares at each step, else it
    hands the step to functional.step_groups (the Plan's calls made anew, or the full
    path):
    the Plan is still books' (dropped or remade: no), each group's settings but its lr
    are the same objects (an immutable value: the same setting; the checks and op
    arguments made from them stand; a dict of immutables, a policy's overrides as from
    YAML, with the same items too), the same params in the same lists (the state
    object and its count of changes: Plan), Part.holds(), a grad for each param. The lr
    (a scheduler changes it at every step) is checked as the groups' checks check a
    plain number and written into the call (one lr for every row while the groups' lrs
    are equal: no list of lrs for the op to take). The op checks the rest, as at every
    call: each param's size, shape, address, dtype, device and contiguity, and its
    grad's; a call it refuses raises Refused before anything is written. Not for a step
    with a loss scale or a found_inf, a Part whose params keep remainders off the device
    path (their compare comes before the op call, on the host), several calls a step or a
    tensor lr (copied into the call's lr_tensor at every step). A Part with remainders on
    the device path takes it while the op compares their blocks (fingerprints [out,
    records, kept]: the record held by the Part's other buffer)."""

    def __init__(self, books, state, param_groups):
        plan = books.plans.get(0)
        self.plan = plan
        self.calls = None  # a turn (Part.out(), the record read) -> (op, args, resync)
        if plan is None or plan.groups != tuple(range(len(param_groups))) or \
                len(plan.parts) != 1 or books.offload is not None or \
                books.release is not None:
            return
        part = plan.parts[0]
        self.part = part
        self.groups = [(group, tuple(k for k in group if k not in ("params", "lr")))
                       for group in param_groups]
        self.settings = [tuple(map(group.__getitem__, keys)) for group, keys in self.groups]
        self.lrs = [group["lr"] for group in param_groups]
        # (a tensor lr is copied into the call's lr_tensor at every step: not steady)
        # (a dict setting, a policy's overrides: its items compared at each step)
        self.dicts = [(v, optim_state.policy_key(v)) for values in self.settings
                      for v in values if mapping_of_immutables(v)]
        if (part.blocks is not None and not part.compared) or not part.op_counts() or \
                not all(type(lr) in (float, int) for lr in self.lrs) or \
                not all(immutable(v) or mapping_of_immutables(v)
                        for values in self.settings for v in values) \
                or any(map(step_calls.counts_on_device, param_groups)):
            return
        self.lists = [group["params"] for group in param_groups]
        # each list's params as the plan has them (compared by identity at each step: a
        # list changed in place is seen)
        held = [tuple(params) for params in self.lists]
        if tuple(map(len, held)) != plan.sizes or \
                sum(map(len, held)) != len(plan.params) or \
                not all(map(operator.is_, itertools.chain(*held), plan.params)):
            return
        self.held = held
        self.params = list(plan.params)
        self.one_lr = None  # (first_call: whether the call takes one lr for every row)
        self.calls = {}

    def step(self, books, state, param_groups):
        """One steady step, or False (nothing done) when it cannot take it."""
        plan, part = self.plan, self.part
        if books.plans.get(0) is not plan or len(param_groups) != len(self.groups) or \
                books.fingerprints or books.joins or plan.state is not state or \
                plan.changes != state.changes:
            return False
        for group, (kept, keys), values, params, held in zip(
                param_groups, self.groups, self.settings, self.lists, self.held):
            if group is not kept or len(group) != len(keys) + 2 or \
                    group["params"] is not params or len(params) != len(held) or \
                    not all(map(operator.is_, params, held)) or \
                    not all(map(operator.is_, map(group.__getitem__, keys), values)):
                return False
        for value, key in self.dicts:  # (its items' reprs: 1 and True, 0.0 and -0.0 apart)
            if optim_state.policy_key(value) != key:
                return False  # (changed in place)
        params = self.params  # (the lists' params, one after another: the plan's)
        # (with the compare in the op, the op's own check of each stamped param's address
        # stands for holds()'s: a refusal sends the step down the full path)
        if params[0].dtype != part.dtype or not (part.compared or part.holds()):
            return False
        blocks, out = part.blocks, part.out()
        if blocks is not None and (blocks.record is None or not blocks.in_op or
                                   blocks.holder is None or blocks.holder is out):
            return False  # (the full path's call compares whole, or moves the record)
        # (grads_of in one pass: a param's main_grad where it has one, else its .grad; a
        # main_grad of None, which grads_of passes over, is refused below as a grad None)
        grads = list(map(getattr, params, repeat("main_grad"), map(_GRAD, params)))
        lrs = [group["lr"] for group in param_groups]
        if not all(map(operator.is_, lrs, self.lrs)):
            if not all(type(lr) in (float, int) and 0.0 <= lr <= FLOAT32_MAX for lr in lrs):
                return False  # (the full path's checks name it)
            self.relr(lrs)
        # (a turn: the record the op writes, and with the compare the one it reads)
        turn = id(part.out()), id(part.written[0]) if part.compared else None
        call = self.calls.get(turn)
        if call is None:  # (made with the lrs now, every param with a grad)
            if any(map(operator.is_, grads, repeat(None))):
                return False
            call = self.calls[turn] = self.first_call(books, state, param_groups)
            if call is None:
                self.calls = None
                return False
        op, args, resync = call
        args[ops.FLAT_GRADS] = grads
        if resync is not None and part.kept_rows is not None:  # (this step's row)
            args[ops.FLAT_FINGERPRINTS][_KEPT_AT] = part.kept_rows.now()
        books.last["step_skipped"] = False
        books.last["found_inf"] = None
        try:
            op(*args)  # (a grad None: refused by torch's boxing, before the call)
        except RuntimeError as error:
            if any(map(operator.is_, grads, repeat(None))):
                return False  # (the full path steps the params that have one)
            raise Refused(str(error)) from error
        finally:
            args[ops.FLAT_GRADS] = []  # (kept, they would outlive zero_grad(set_to_none))
        step_calls.mark_written(self.params)
        part.restamp()
        if blocks is not None:
            blocks.took(out)
        if resync is not None:
            watch_kept(books, part)
        return True

    def first_call(self, books, state, param_groups):
        """A turn's op call, made as planned_calls makes it (which checks everything),
        or None; with one lr for every row (no lrs) while the groups' lrs are equal."""
        group = param_groups[0]  # (as gather checks it; planned_calls the others)
        optim_state.rule_of(books, group).check(group, f"{books.name} param group 0")
        calls = planned_calls(books, state, param_groups, 0)
        if not calls or len(calls) != 1:
            return None
        kwargs = calls[0].args
        lrs = kwargs.get("lrs")
        one_lr = lrs is None or same_values(lrs)
        if self.calls and one_lr != self.one_lr:
            self.calls.clear()  # (every turn's call takes its lrs the same way)
        self.one_lr = one_lr
        if lrs is not None and one_lr:
            kwargs = {**kwargs, "lr": lrs[0], "lrs": ()} if lrs else kwargs
        self.lr_at = ops.FLAT_LR if one_lr else ops.FLAT_LRS
        return ops.flat_call(**kwargs, step_counts=self.part.step_buffer) + \
            (kwargs.get("resync"),)

    def relr(self, lrs):
        """Each turn's call given the groups' lrs now (checked); none kept where they
        would take them otherwise than they do (made anew, with the lrs now)."""
        self.lrs = lrs
        if not self.calls:
            return  # (the first call is made with them)
        values = [float(lr) for lr in lrs]
        if same_values(values) != self.one_lr:
            self.calls.clear()  # (one lr for every row, or a list of them: made anew)
            return
        value = [x for m, n in self.part.runs for x in repeat(values[m], n)] \
            if self.lr_at == ops.FLAT_LRS else values[0]
        for _, args, _ in self.calls.values():
            args[self.lr_at] = value


def same_values(values):
    """Whether the numbers are one value, bit for bit (0.0 and -0.0 two)."""
    return len(set(map(float.hex, map(float, values)))) == 1


def steady_step(books, state, param_groups):
    """A steady step (Steady) of the optimizer whose books are `books`, or False where it
    cannot take one (the caller then steps on the full path)."""
    steady = books.steady
    if steady is None or steady.plan is not books.plans.get(0):
        steady = books.steady = Steady(books, state, param_groups)
    if steady.calls is not None and steady.step(books, state, param_groups):
        return True
    books.steady = None  # made anew at the next step, from what this one leaves
    return False
