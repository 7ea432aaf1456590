"""precis's warnings, each named at the user's line: the first frame outside precis, torch
and Python's standard library (the line that called opt.step(), backward(),
load_state_dict(), copy.deepcopy(opt), ...), however many frames lie between (torch's
step hooks, an LRScheduler's wrapper of opt.step(), torch.no_grad, autograd's engine,
dynamo's eager calls, copy's), so no function counts them."""

import sys
import warnings

# (the top-level modules whose frames are not the user's: told by the module's name, not
# its file, which depends on how precis and Python were installed)
_NOT_THE_USERS = frozenset({"precis", "torch"}) | sys.stdlib_module_names


def warn(message, category):
    """warnings.warn(message, category) at the first frame outside precis, torch and the
    standard library (a hook on a thread with no such frame: its outermost)."""
    frame, level = sys._getframe(1), 2  # (stacklevel 2: warn's caller)
    while frame.f_back is not None and \
            frame.f_globals.get("__name__", "").partition(".")[0] in _NOT_THE_USERS:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
