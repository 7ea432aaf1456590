"""The backward a gradient hook runs in, when it is nested: one started inside a custom
Function's backward, as torch.utils.checkpoint's use_reentrant=True segments run theirs.
There a param's gradient may come in pieces (the segment's, then the outer backward's),
and the nested backward ends before the outer one: a hook that waits for the end of
the backward (precis.ddp's sync, a release's step) must wait for the outer one."""

import sys

import torch


def starting_function():
    """The backward node of the custom Function whose backward started the backward this
    runs in (the innermost, where they nest), or None outside a nested backward. Read
    from this thread's Python frames: an engine run below a Function's backward."""
    frame, engine = sys._getframe(1), False
    while frame is not None:
        if frame.f_code is _ENGINE_RUN:
            engine = True
        elif engine and frame.f_code is _FUNCTION_BACKWARD:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def in_nested_backward():
    """Whether this runs inside a nested backward."""
    return starting_function() is not None


def queue_at_the_end(callback):
    """callback() once the outermost backward running now ends: queued on it (autograd's
    queue_callback queues on the innermost: a nested one ends first), through a hook on
    each Function node that started a nested one, which runs in its parent backward."""
    node = starting_function()
    if node is None:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    else:
        node.register_hook(lambda grad_inputs, grad_outputs: queue_at_the_end(callback))


_ENGINE_RUN = torch.autograd.graph._engine_run_backward.__code__
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__
