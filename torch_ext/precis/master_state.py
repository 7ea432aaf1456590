"""A param's saved master weights or remainders, checked and converted to the layout
its policy keeps (precis.checkpoint.convert_state's part for them).

A bf16 param's master is kept whole ('master': fp32 / fp16) or as a remainder beside
the param ('remainder': int16, the fp32 master's low half, exact; or uint8, an 8-bit
correction: a 24-bit master, docs/design.md section 4). A state dict may hold either,
of either width, whatever the policy loading it keeps:

  saved \\ kept    master             remainder of the policy's width
  master          cast               split (kept with the param: remainders_for)
  remainder       joined             as saved, or joined and split at the new width
                                     (16 -> 8 rounds to nearest even; 8 -> 16 exact)
"""

import torch

from . import user_warnings
from .op_constants import PARAM_DTYPES
from .op_constants import REMAINDER_BITS
from .stored_forms import fingerprint, like, remainder_join, remainders_for


class DroppedStateWarning(UserWarning):
    """A loaded state dict held masters or remainders that the loading optimizer's policy
    keeps nowhere (a param that is its own master: main_params_dtype equal to its
    dtype). They were dropped: each param continues from its own bits, the bits below
    them lost. Given once per load, naming what was dropped and of how many params."""


_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dropped(saved, state):
    """What of saved's ('master', 'remainder') the converted state keeps nowhere, in
    words ('fp32 masters', '8-bit remainders'), or None."""
    if "master" in state or "remainder" in state:
        return None
    t = saved.get("master")
    if isinstance(t, torch.Tensor):
        return f"{_SHORT.get(t.dtype, t.dtype)} masters"
    t = saved.get("remainder")
    if isinstance(t, torch.Tensor):
        return f"{REMAINDER_BITS.get(t.dtype, '?')}-bit remainders"
    return None


def warn_dropped(who, counts):
    """The DroppedStateWarning for counts ({what dropped() said: params}), if any."""
    if not counts:
        return
    what = ", ".join(f"the {kind} of {n} param{'s' * (n != 1)}" for kind, n in counts.items())
    user_warnings.warn(f"{who}: {what} dropped: the policy keeps no master for these "
                       f"params (main_params_dtype is their own dtype), so each continues "
                       f"from its param's bits and the bits below them are lost. To keep "
                       f"them, load into a policy with a master (main_params_dtype 'fp32') "
                       f"or remainders (store_param_remainders)", DroppedStateWarning)


def checked(p, saved, where):
    """saved's ('master', 'remainder') tensors (None where absent), after every check:
    ValueError naming what is wrong. p: the (local) param."""
    master, remainder = saved.get("master"), saved.get("remainder")
    if master is not None and remainder is not None:
        raise ValueError(f"{where}: has both 'master' and 'remainder'")
    for key, t in (("master", master), ("remainder", remainder)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: '{key}' must be a tensor, got {type(t).__name__}")
        if t.shape != p.shape:
            raise ValueError(f"{where}: '{key}' has shape {tuple(t.shape)}, the param "
                             f"{tuple(p.shape)}")
    if master is not None:
        if master.dtype not in PARAM_DTYPES:
            raise ValueError(f"{where}: 'master' has dtype {master.dtype}; expected "
                             f"float32, float16 or bfloat16")
        if master.dtype == p.dtype:
            raise ValueError(f"{where}: 'master' has the param's own dtype {p.dtype}; a "
                             f"param of that dtype is its own master, so this copy would be "
                             f"ignored")
        if not bool(torch.isfinite(master).all()):
            raise ValueError(f"{where}: 'master' holds non-finite values")
    if remainder is not None:
        if remainder.dtype not in REMAINDER_BITS:
            raise ValueError(f"{where}: 'remainder' has dtype {remainder.dtype}; expected "
                             f"torch.int16 (a 16-bit remainder) or torch.uint8 (an 8-bit "
                             f"correction)")
        if p.dtype != torch.bfloat16:
            raise ValueError(f"{where}: 'remainder' ({remainder.dtype}) needs a bfloat16 "
                             f"param")
    return master, remainder


def converted(p, master, remainder, fp, layout):
    """(state entries in layout, remainder fingerprint or None) from checked()'s
    tensors and the saved 'param_fingerprint' fp."""
    if layout.master == "master":
        if master is not None:
            return {"master": like(p, master, layout.master_dtype)}, None
        if remainder is not None:  # remainders saved, master wanted now
            return {"master": like(p, remainder_join(p.detach(), remainder),
                                   layout.master_dtype)}, None
    elif layout.master == "remainder":
        bits = REMAINDER_BITS[layout.master_dtype]
        if remainder is not None and remainder.dtype == layout.master_dtype:
            return {"remainder": like(p, remainder)}, fp
        if remainder is not None:  # the other width: through the master it encodes
            high, low = remainders_for(p, remainder_join(p.detach(), remainder), bits)
            # The param is kept (either way the rounding keeps it, ties included), so
            # the saved fingerprint still says whose remainder this is.
            return {"remainder": like(p, low)}, fp if torch.equal(high, p.detach()) \
                else fingerprint(high)
        if master is not None:  # an fp32 master saved, remainders wanted now
            high, low = remainders_for(p, master.float(), bits)
            return {"remainder": like(p, low)}, fingerprint(high)
    # else: nothing kept, or built from the param at the next step
    return {}, None


def pending(p, saved, layout, state):
    """A saved remainder that converted() joined with what p holds at load, which is not
    what it was saved with (its 'param_fingerprint'), into state (the converted state):
    (remainder, its fingerprint, layout, the fingerprint of the join) for rejoin() once p
    holds those bits (a model loaded after its optimizer), else None."""
    remainder, fp = saved.get("remainder"), saved.get("param_fingerprint")
    if remainder is None or fp is None or layout.master is None or (
            layout.master == "remainder" and remainder.dtype == layout.master_dtype):
        return None  # nothing joined (a remainder kept as saved: its fingerprint decides)
    if fingerprint(p) == fp:
        return None  # joined with its own param
    return remainder.detach().clone(), fp, layout, fingerprint(state[layout.master])


def rejoin(state, p, join):
    """pending()'s join made anew with p, into state's master or remainder (in place),
    when p holds the bits the remainder was saved with and no step has changed the join
    since the load; returns whether it was."""
    remainder, fp, layout, loaded = join
    if fingerprint(p) != fp or fingerprint(state[layout.master]) != loaded:
        return False
    entries, _ = converted(p, None, remainder, fp, layout)
    for key, t in entries.items():
        state[key].copy_(t)
    return True
