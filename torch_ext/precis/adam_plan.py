"""The fast path of a step with many small params: a group's steady state (a Plan),
its state flat (one buffer per state kind, each param's state a view of a range of
it), checked a whole list at a time, so that one torch.ops.precis.adam_step_flat_ call
with no Python work per param steps the group: params and grads as lists, the state
as the buffers and a table of where each param's state lies."""

import operator
from itertools import repeat
from typing import NamedTuple

import torch

from . import adam_calls
from .adam_calls import Call
from .dtensor import is_dtensor
from .ops import ROW_NUMEL, ROW_OFFSET, ROW_SCALE_OFFSET, ROW_STEP, ROW_STREAM, ROW_WIDTH
from .ops import scale_count

# The state kinds kept flat, as the op's buffers: state key -> buffer name.
FLAT_KEYS = {"master": "master", "remainder": "master", "exp_avg": "exp_avg",
             "exp_avg_sq": "exp_avg_sq", "exp_avg_scale": "exp_avg_scale",
             "exp_avg_sq_scale": "exp_avg_sq_scale", "max_exp_avg_sq": "max_exp_avg_sq",
             "max_exp_avg_sq_scale": "max_exp_avg_sq_scale"}


_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_IS_CPU = operator.attrgetter("is_cpu")
_VERSION = operator.attrgetter("_version")
_STEP = operator.itemgetter("step")


class Plan(NamedTuple):
    """The steady state of a param group's steps, so that a step need not look at
    each param's state again: one device, every param plain (contiguous, not a
    DTensor, not complex, not offloaded) with a gradient and complete state of one
    layout. Its state is flat: each kind one buffer (`buffers`), each param's entry a
    view of it (`views`), and its 'step' tensors views of one float32 buffer (torch's
    float32 counts, counted by one add_). Checked at every step, a whole list at a time
    (same params, dtypes, shapes, policy, state object, views and step tensors; grads contiguous,
    of the params' sizes, on the device; no write to a param with a master behind
    the optimizer's back); anything else takes the full path, which makes a new
    plan. While the plan holds, the stamps of the params with a master are its
    own (`versions`, `ptrs`), not the optimizer's _synced's: drop_plan hands them back."""
    key: tuple           # (policy key, amsgrad)
    state: dict          # the optimizer's state object ...
    changes: int         # ... and its count of changes, when the plan was made
    device: torch.device
    params: tuple
    param_dtypes: tuple
    grad_dtypes: tuple
    numels: tuple
    shapes: tuple        # the params' shapes (their state has them)
    states: tuple
    step_buffer: torch.Tensor
    step_views: tuple
    buffers: dict        # the op's buffer name -> flat buffer
    views: dict          # state key -> its entry of each param (views of a buffer)
    table: torch.Tensor  # the op's table: where each param's state lies, its step
    stamped: tuple       # the params whose master/remainder a write would make stale ...
    versions: list       # ... their _version after the plan's last step ...
    ptrs: list           # ... and their data_ptr()

    def restamp(self):
        """After a step: the plan's own writes to its params are not stale."""
        self.versions[:] = map(_VERSION, self.stamped)


def planned_call(opt, gi, group, pkey):
    """Group gi's op call from its Plan, or None when the plan does not hold.
    Each check runs over a whole list (map: no Python code per param)."""
    plan = opt._plans.get(gi)
    params = group["params"]
    if plan is None or group["capturable"] or opt._offload is not None or \
            torch.compiler.is_compiling() or plan.key != (pkey, group["amsgrad"]):
        return None
    state = opt.state  # the same entries: the same object, no change since
    if plan.state is not state or plan.changes != getattr(state, "changes", None) or \
            len(params) != len(plan.params) or \
            not all(map(operator.is_, params, plan.params)):
        return None
    try:  # every entry still the view of its buffer
        if not all(map(operator.is_, map(_STEP, plan.states), plan.step_views)) or \
                not all(all(map(operator.is_, map(operator.itemgetter(key), plan.states), views))
                        for key, views in plan.views.items()):
            return None
    except KeyError:  # a state entry was removed
        return None
    mains = list(map(getattr, params, repeat("main_grad"), repeat(None)))
    if all(map(operator.is_, mains, repeat(None))):
        grads = list(map(_GRAD, params))
    else:
        grads = [p.grad if g is None else g for p, g in zip(params, mains)]
    if any(map(operator.is_, grads, repeat(None))) or \
            tuple(map(_DTYPE, grads)) != plan.grad_dtypes or \
            tuple(map(torch.Tensor.numel, grads)) != plan.numels or \
            tuple(map(_DTYPE, params)) != plan.param_dtypes or \
            not all(map(operator.eq, map(_SHAPE, params), plan.shapes)) or \
            not all(map(torch.Tensor.is_contiguous, params)):
        return None
    if plan.device.type == "cpu":
        same_device = all(map(_IS_CPU, grads))
    else:
        same_device = all(map(operator.eq, map(_DEVICE, grads), repeat(plan.device)))
    try:  # False for a sparse COO grad; sparse CSR has no is_contiguous
        contiguous = all(map(torch.Tensor.is_contiguous, grads))
    except RuntimeError:
        contiguous = False
    if not (same_device and contiguous):
        return None
    if list(map(_VERSION, plan.stamped)) != plan.versions or \
            list(map(torch.Tensor.data_ptr, plan.stamped)) != plan.ptrs:
        return None  # written behind our back: the full path resyncs
    plan.table[:, ROW_STEP].copy_(plan.step_buffer.add(1.0))  # torch's float32 `step += 1`
    args = dict(params=params, grads=grads, buffers=plan.buffers, table=plan.table,
                **adam_calls.scalar_args(opt, gi, group, plan.device))
    return Call(plan.device, args, plan.states, params, [], plan)


def drop_plan(opt, gi):
    """Forget group gi's plan, handing its stamps back to _synced (as
    stored_forms.stamp's (version, address) pairs)."""
    plan = opt._plans.pop(gi, None)
    if plan is not None:
        opt._synced.update(zip(map(id, plan.stamped), zip(plan.versions, plan.ptrs)))


def make_plan(opt, gi, group, pkey, calls):
    """A Plan for group gi after a full-path step that made `calls`, or None."""
    if len(calls) != 1 or opt._offload is not None or group["capturable"] or \
            torch.compiler.is_compiling():
        return None
    call = calls[0]
    params, states = tuple(group["params"]), tuple(call.states)
    if call.writebacks or len(call.params) != len(params) or \
            not all(map(operator.is_, params, call.params)):
        return None
    if any(is_dtensor(p) or p.is_complex() or not p.is_contiguous() for p in params):
        return None
    first = states[0] if states else {}
    if any(st.keys() != first.keys() for st in states):
        return None  # params of several layouts in one call
    steps = torch.stack([st["step"] for st in states]) if states else \
        torch.zeros(0, dtype=torch.float32)
    step_views = steps.unbind(0)
    for st, view in zip(states, step_views):
        st["step"] = view
    buffers, views = flatten(states)
    table = torch.zeros(len(states), ROW_WIDTH, dtype=torch.int64)
    if states:
        numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        blocks = torch.tensor([scale_count(p.numel()) for p in params], dtype=torch.int64)
        table[:, ROW_NUMEL] = numels
        table[1:, ROW_OFFSET] = numels.cumsum(0)[:-1]
        table[1:, ROW_SCALE_OFFSET] = blocks.cumsum(0)[:-1]
        table[:, ROW_STREAM] = torch.tensor([st.get("stream", 0) for st in states])
    stamped = tuple(p for p, st in zip(params, states) if "master" in st or "remainder" in st)
    return Plan((pkey, group["amsgrad"]), opt.state, getattr(opt.state, "changes", None),
                call.device, params, tuple(map(_DTYPE, params)),
                tuple(map(_DTYPE, call.args["grads"])), tuple(p.numel() for p in params),
                tuple(map(_SHAPE, params)), states, steps, step_views, buffers, views, table,
                stamped, list(map(_VERSION, stamped)), list(map(torch.Tensor.data_ptr, stamped)))


def flatten(states):
    """Each state kind of `states` (one layout, contiguous entries) copied into one
    buffer, the entries replaced by views of it, in order: (the op's buffers by name,
    the views by state key)."""
    buffers, views = {}, {}
    first = states[0] if states else {}
    for key, name in FLAT_KEYS.items():
        if key not in first:
            continue
        flat = torch.cat([st[key].reshape(-1) for st in states])
        offset, entries = 0, []
        for st in states:
            n = st[key].numel()
            st[key] = flat[offset:offset + n].view(st[key].shape)
            entries.append(st[key])
            offset += n
        buffers[name], views[key] = flat, tuple(entries)
    return buffers, views
