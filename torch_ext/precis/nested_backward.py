"""Whether a gradient hook runs inside a nested backward: one started inside a custom
Function's backward, as torch.utils.checkpoint's use_reentrant=True segments run theirs.
There a param's gradient may come in pieces (the segment's, then the outer backward's),
and the nested backward ends before the outer one: a hook that waits for the end of
the backward (precis.ddp's sync, a release's step) must wait for the outer one."""

import sys

import torch


def in_nested_backward():
    """Read from this thread's Python frames: an engine run below a Function's backward."""
    frame, engine = sys._getframe(1), False
    while frame is not None:
        if frame.f_code is _ENGINE_RUN:
            engine = True
        elif engine and frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False


_ENGINE_RUN = torch.autograd.graph._engine_run_backward.__code__
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__
