"""precis's warnings, each named at the user's line: the first frame outside precis and
torch (the line that called opt.step(), backward(), load_state_dict(), ...), however
many frames lie between (torch's step hooks, an LRScheduler's wrapper of opt.step(),
torch.no_grad, autograd's engine, dynamo's eager calls), so no function counts them."""

import os
import sys
import warnings

import torch

# (the package directories whose frames are not the user's)
_INSIDE = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                for path in (__file__, torch.__file__))


def warn(message, category):
    """warnings.warn(message, category) at the first frame outside precis and torch (a
    hook on a thread with no such frame: its outermost)."""
    frame, level = sys._getframe(1), 2  # (stacklevel 2: warn's caller)
    # (abspath: a module found through a sys.path entry like "examples/../torch_ext"
    # keeps that form in its frames' file names)
    while frame.f_back is not None and \
            os.path.abspath(frame.f_code.co_filename).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
