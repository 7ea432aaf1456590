"""precis's warnings, each named at the user's line: the first frame outside precis, torch
and Python's standard library (the line that called opt.step(), backward(),
load_state_dict(), copy.deepcopy(opt), ...), however many frames lie between (torch's
step hooks, an LRScheduler's wrapper of opt.step(), torch.no_grad, autograd's engine,
dynamo's eager calls, copy's), so no function counts them."""

import os
import sys
import sysconfig
import warnings

import torch


def _directory(path):
    return os.path.abspath(path) + os.sep


# (the directories whose frames are not the user's: precis's, torch's, the standard
# library's; but the installed packages', which a system Python keeps inside the latter)
_OURS = tuple(_directory(os.path.dirname(path)) for path in (__file__, torch.__file__))
_LIBRARY = tuple(_directory(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib"))
_PACKAGES = tuple(_directory(sysconfig.get_paths()[key]) for key in ("purelib", "platlib"))


def _inside(path):
    path = os.path.abspath(path)
    return path.startswith(_OURS) or \
        (path.startswith(_LIBRARY) and not path.startswith(_PACKAGES))


def warn(message, category):
    """warnings.warn(message, category) at the first frame outside precis, torch and the
    standard library (a hook on a thread with no such frame: its outermost)."""
    frame, level = sys._getframe(1), 2  # (stacklevel 2: warn's caller)
    # (abspath: a module found through a sys.path entry like "examples/../torch_ext"
    # keeps that form in its frames' file names)
    while frame.f_back is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
