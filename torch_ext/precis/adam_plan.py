"""The fast path of a step with many small params: a group's steady state (a Plan)
checked a whole list at a time, so the op call is built with no Python work per param."""

import operator
from itertools import repeat
from typing import NamedTuple

import torch

from . import adam_calls
from .adam_calls import AMSGRAD_LISTS, LISTS, Call
from .dtensor import is_dtensor


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
    DTensor, not complex, not offloaded) with a gradient and complete state. Its
    state's 'step' tensors are views of one float32 buffer (torch's float32
    counts, counted by one add_). Checked at every step, a whole list at a time
    (same params, dtypes, shapes, policy, state object and step tensors; grads contiguous,
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
    lists: dict          # op list name -> state key
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
    try:
        if not all(map(operator.is_, map(_STEP, plan.states), plan.step_views)):
            return None
        lists = {name: list(map(operator.itemgetter(key), plan.states)) if key else []
                 for name, key in plan.lists.items()}
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
    # torch's float32 `step += 1`, as ints
    steps = plan.step_buffer.add(1.0).to(torch.int64).tolist()
    args = dict(params=params, grads=grads, **lists, steps=steps,
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
    lists = {name: next((k for k in keys if k in first), None)
             for name, keys in LISTS.items()
             if group["amsgrad"] or name not in AMSGRAD_LISTS}
    lists["streams"] = "stream" if "stream" in first else None  # ints, not tensors
    steps = torch.stack([st["step"] for st in states]) if states else \
        torch.zeros(0, dtype=torch.float32)
    views = steps.unbind(0)
    for st, view in zip(states, views):
        st["step"] = view
    stamped = tuple(p for p, st in zip(params, states) if "master" in st or "remainder" in st)
    return Plan((pkey, group["amsgrad"]), opt.state, getattr(opt.state, "changes", None),
                call.device, params, tuple(map(_DTYPE, params)),
                tuple(map(_DTYPE, call.args["grads"])), tuple(p.numel() for p in params),
                tuple(map(_SHAPE, params)), states, steps, views, lists, stamped,
                list(map(_VERSION, stamped)), list(map(torch.Tensor.data_ptr, stamped)))
