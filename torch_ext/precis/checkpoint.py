"""precis.checkpoint: optimizer state dicts checked and converted, as plain functions
(no optimizer needed; precis.optim calls them).

The stored forms (encode_moment / decode_moment, remainder_split / remainder_join) are
precis.stored_forms's, and precis.checkpoint's names too.

A precis state dict has torch's layout ({'state': {index: {...}}, 'param_groups':
[...]}) with each buffer in its stored dtype. A param's state that torch.optim.AdamW
would read exactly (unscaled moments its param dtype holds exactly, no master, no
remainder) keeps torch's 'step', a float32 tensor, and torch loads and continues it.
Any other state (fp16 / fp8 moments and their scales, masters, remainders, moments
wider than the param) has 'step' = STEP_MARKER, bytes torch's loader cannot read as
a number: torch.optim.Adam(W).load_state_dict raises ValueError quoting it (naming
precis and to_torch_state_dict), and the step count is in 'precis_step'. SGD's and
Muon's momentum is saved under torch's 'momentum_buffer' where torch reads it exactly,
else the marker is there too (export_state); loads take either name (precis_keys).

  to_torch_state_dict(sd, params)   -> (torch.optim.AdamW's fp32 layout, fp32 masters)
  from_torch_state_dict(sd, params, policy, masters)  -> a precis state dict
  convert_state(p, saved, layout, where)  one param's saved state -> precis state,
                                          checked (ValueError naming what is wrong)
"""

import math
import struct
from collections.abc import Mapping

import torch

from . import _lib
from .dtensor import (blocks_per_row, is_dtensor, local_shard, placed_like, replicated_like,
                      scales_like)
from .op_constants import SCALED_MOMENT_DTYPES, scale_count
# The stored forms are precis.checkpoint's public names too (they were defined here first).
from .stored_forms import (FP8_CODE_KEYS, FP8_M_CODE, FP8_V_CODE, decode_moment,  # noqa: F401
                           encode_moment, fingerprint, laid_out_like, legacy_fp8, like,
                           moment_values, remainder_join, remainder_split, REMAINDER_DTYPES)
from . import master_state, torch_math
from .policy import policy_for
# The layout of a param's state (Layout and layout_of are precis.checkpoint's public names too).
from .state_layout import (COMPLEX_DTYPES, FP32_LAYOUT, MOMENT_KEYS, ROW_STATE_KEYS,  # noqa: F401
                           Layout, layout_of, one_state_layout, param_layout,
                           rounds_stochastically, step_tensor, torch_layout, unscaled_layout)

__all__ = ["encode_moment", "decode_moment", "remainder_split", "remainder_join",
           "to_torch_state_dict", "from_torch_state_dict", "convert_state", "export_state",
           "split_by_algorithm", "join_by_algorithm", "Layout", "layout_of", "STEP_MARKER"]

REQUIRED_KEYS = ("step", "exp_avg", "exp_avg_sq")
STEP_MARKER = (b"precis optimizer state (fp16/fp8 moments with block scales, master weights "
               b"or remainders) that torch.optim cannot read: convert it with "
               b"precis.checkpoint.to_torch_state_dict")


# ---------------------------------------------------------------------------
# Step counts: torch keeps a float32 tensor (state_layout.step_tensor; it stops counting
# exactly at 2^24, as torch's does); older checkpoints hold ints.
# ---------------------------------------------------------------------------


def step_value(value, where):
    """A saved step (number or one-element tensor) -> int, checked: whole, in [0, 2^63)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{where}: 'step' must be a number or a one-element real tensor, "
                             f"got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: 'step' must be a number, got {value!r}")
    if value < 0 or isinstance(value, float) and not (math.isfinite(value) and
                                                      value == int(value)):
        raise ValueError(f"{where}: 'step' must be a whole number >= 0, got {value!r}")
    # the kernels count steps in int64, from torch's float32 count (state_layout.step_tensor)
    if value >= 2 ** 63 or torch.tensor(float(value), dtype=torch.float32) >= 2.0 ** 63:
        raise ValueError(f"{where}: 'step' must be below 2^63 once kept as torch's float32 "
                         f"count (the kernels count steps in int64), got {value!r}"
                         f"{' (2^63 in float32)' if value < 2 ** 63 else ''}")
    return int(value)


def next_step(n):
    """The step count after n, as torch's float32 `step += 1` computes it."""
    if n < 2 ** 24:  # exact in float32
        return n + 1
    return int(struct.unpack("f", struct.pack("f", float(n + 1)))[0])


# ---------------------------------------------------------------------------
# One param's state
# ---------------------------------------------------------------------------


def _sparse_moment(p, t, key, second, dtype, where):
    """A sparse saved moment (torch.optim.SGD's momentum_buffer after sparse gradients),
    kept as torch made it (a copy on p's device): only as a first moment in p's own
    dtype, where p's state is torch's (precis.torch_math steps it)."""
    if second or t.dtype != p.dtype or dtype != p.dtype or t.shape != p.shape:
        raise ValueError(f"{where}: '{key}' is sparse ({t.dtype}, shape {tuple(t.shape)}), "
                         f"torch.optim.SGD's momentum after sparse gradients: it loads "
                         f"only as the momentum of a {tuple(t.shape)} param of its "
                         f"dtype with state in that dtype (no master), not a {p.dtype} "
                         f"param of shape {tuple(p.shape)} kept in {dtype}")
    if not bool(torch.isfinite(t._values()).all()):
        raise ValueError(f"{where}: '{key}' holds non-finite values (Inf or NaN)")
    return t.detach().to(p.device, copy=True)


def _moment(p, saved, key, dtype, where):
    """A saved moment -> (stored in dtype laid out like p, its scales or None)."""
    second = MOMENT_KEYS[key]
    t, scales = saved[key], saved.get(key + "_scale")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: '{key}' must be a tensor, got {type(t).__name__}")
    if t.is_sparse:  # torch's SGD momentum from sparse gradients: torch's math steps it
        return _sparse_moment(p, t, key, second, dtype, where), None
    legacy = t.dtype == torch.uint8 and legacy_fp8(saved, where, second)
    if t.shape != p.shape:
        raise ValueError(f"{where}: '{key}' has shape {tuple(t.shape)}, the param "
                         f"{tuple(p.shape)}")
    if torch_layout(p):
        if t.dtype != p.dtype or scales is not None:
            raise ValueError(f"{where}: '{key}' of a {p.dtype} param must be {p.dtype} (torch's "
                             f"layout, no scales), got {t.dtype}")
        values = torch.view_as_real(t) if t.is_complex() else t
    else:
        if scales is not None:
            if t.dtype not in SCALED_MOMENT_DTYPES:
                raise ValueError(f"{where}: '{key}_scale' given but '{key}' is {t.dtype}; only "
                                 f"float16 and fp8 (uint8) moments carry scales")
            want = scale_count(p.numel())
            if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32
                    or scales.dim() != 1 or scales.numel() != want):
                got = (f"{scales.dtype} of shape {tuple(scales.shape)}"
                       if isinstance(scales, torch.Tensor) else type(scales).__name__)
                raise ValueError(f"{where}: '{key}_scale' must be float32 of shape ({want},), "
                                 f"got {got}")
            if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
                raise ValueError(f"{where}: '{key}_scale' holds negative or non-finite scales")
        elif t.dtype not in (torch.float32, torch.bfloat16):
            # Stored fp16 / fp8 moments are value / scale: without their scales they would
            # be read as wrong numbers.
            hint = {torch.uint8: f" (fp8 moments need '{key}_scale')",
                    torch.float16: f" (float16 moments need '{key}_scale'; a float16 moment of "
                                   f"a torch state dict: convert it with .float() first)"
                    }.get(t.dtype, "")
            raise ValueError(f"{where}: '{key}' has dtype {t.dtype}; expected float32, "
                             f"bfloat16, or float16/fp8 (uint8) with '{key}_scale'{hint}")
        values = decode_moment(t, scales, second, legacy) if scales is not None else t.float()
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{where}: '{key}' holds non-finite values (Inf or NaN, or scales "
                         f"too large for its stored values)")
    # Scaled second moments store sqrt(v) / scale (decoding squares it): a negative
    # stored value is as corrupt as a negative v.
    if second:
        raw = values if p.is_complex() else t
        # uint8: v8 has no sign; an older E4M3 code has (0x80: -0)
        negative = ((raw > 0x80) if legacy else torch.zeros((), dtype=torch.bool)) \
            if raw.dtype == torch.uint8 else (raw < 0)
        if bool((values < 0).any() or negative.any()):
            raise ValueError(f"{where}: '{key}' holds negative values (a second moment is a "
                             f"running mean of squares)")
    if torch_layout(p):
        return like(p, t), None
    target_scaled = dtype in SCALED_MOMENT_DTYPES
    if t.dtype == dtype and not legacy and (scales is not None) == target_scaled and (
            not target_scaled or laid_out_like(t, p)):
        return like(p, t), (scales.to(p.device, copy=True) if target_scaled else None)
    # Another stored form (or scaled blocks in another memory order): encode the fp32
    # values in the policy's dtype, laid out like p.
    stored, new_scales = encode_moment(like(p, values, torch.float32), dtype, second)
    return like(p, stored), (None if new_scales is None else new_scales.to(p.device))


def state_keys(moments=tuple(MOMENT_KEYS), row_state=None):
    """The keys a param's state in a state dict may have, for an optimizer keeping
    `moments` (each rule's moments: Adam's three, the one-state rules' exp_avg) and
    row_state (Rule.row_state)."""
    return (("step", "precis_step") + tuple(moments) + tuple(k + "_scale" for k in moments)
            + ("master", "remainder", "param_fingerprint")
            + tuple(key for key, _ in FP8_CODE_KEYS.values()) + ("stream",)
            + ((row_state,) if row_state else ()))


def row_state_of(saved, key, rows, where):
    """A saved per-row state (state_layout.ROW_STATE_KEYS) as precis keeps it: float32 of
    shape (rows, 1), on the CPU until placed; checked (ValueError naming what is wrong).
    A DTensor's is replicated: its local tensor is the whole."""
    t = saved[key]
    if is_dtensor(t):
        t = t.full_tensor()
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or \
            tuple(t.shape) != (rows, 1):
        got = f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) \
            else type(t).__name__
        raise ValueError(f"{where}: '{key}' must be a float tensor of shape {(rows, 1)} (a "
                         f"value a row of the param), got {got}")
    values = t.detach().to(torch.float32, copy=True)
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError(f"{where}: '{key}' holds a negative, NaN or Inf value (a mean of "
                         f"squares is finite and >= 0)")
    return values


def convert_state(p, saved, layout, where, required=REQUIRED_KEYS, moments=tuple(MOMENT_KEYS),
                  row_state=None):
    """One param's saved state (precis's or torch.optim's) -> (precis state in layout's
    dtypes and p's memory layout, remainder fingerprint or None); every check first,
    ValueError naming what is wrong. p: the (local) param; required: the keys the
    optimizer's rule needs (Rule.required; 'step' need not be there: torch's SGD keeps
    none); moments: those its rule keeps (another's are refused: a
    state dict of another optimizer); row_state: None or (its key, the whole matrix's
    rows): Rule.row_state, kept whole (row_state_of)."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(saved).__name__}")
    if not saved:
        return {}, None
    accepted = state_keys(moments, row_state and row_state[0])
    unknown = sorted(str(k) for k in saved if k not in accepted)
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)}; accepted: "
                         f"{', '.join(accepted)}")
    missing = [k for k in required if k not in saved]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    # torch's SGD keeps no step: a saved momentum means at least one step was taken (SGD's
    # first step starts its buffer from g)
    step = saved.get("step", int(any(k in saved for k in MOMENT_KEYS)))
    if isinstance(step, bytes):
        if step != STEP_MARKER or "precis_step" not in saved:
            raise ValueError(f"{where}: 'step' is bytes but not precis's marker followed by "
                             f"'precis_step'")
        step = saved["precis_step"]
    state = {"step": step_tensor(step_value(step, where))}
    master, remainder = master_state.checked(p, saved, where)
    fp = saved.get("param_fingerprint")
    if fp is not None and (isinstance(fp, bool) or not isinstance(fp, int)):
        raise ValueError(f"{where}: 'param_fingerprint' must be an int")
    stream = saved.get("stream")
    if stream is not None:
        if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**63:
            raise ValueError(f"{where}: 'stream' must be an int in [0, 2^63) (the op takes int64), "
                             f"got {stream!r}")
        if rounds_stochastically(layout, p.dtype):
            state["stream"] = stream  # (precis.optim keeps it outside the state: Books.streams)
    for key in MOMENT_KEYS:
        if key not in saved:
            continue
        stored, scales = _moment(p, saved, key, layout.moment_dtype(key), where)
        state[key] = stored
        if scales is not None:
            state[key + "_scale"] = scales

    if row_state is not None and row_state[0] in saved:
        state[row_state[0]] = row_state_of(saved, *row_state, where).to(p.device)
    entries, fp = master_state.converted(p, master, remainder, fp, layout)
    state.update(entries)
    return state, fp


def torch_reads_exactly(state, param_dtype):
    """Whether torch.optim.AdamW, loading this state, gets exactly its values: no
    master, remainder or scales, and moments its param dtype holds (torch casts
    them to it); no torch optimizer keeps a row state (NorMuon's)."""
    if any(k in state for k in ("master", "remainder") + ROW_STATE_KEYS) or any(
            k + "_scale" in state for k in MOMENT_KEYS):
        return False
    exact = {param_dtype} | ({torch.bfloat16} if param_dtype == torch.float32 else set())
    return all(state[k].dtype in exact for k in MOMENT_KEYS if k in state)


def export_state(state, param, remainder_fingerprint=True, torch_names=None,
                 whole_dict_exact=True):
    """A param's live state as a precis state dict entry (new dict, same tensors): the
    step as torch keeps it where torch reads the state exactly, else STEP_MARKER and
    'precis_step'; 'param_fingerprint' next to a remainder (remainder_fingerprint);
    'fp8_m_code' / 'fp8_v_code' next to an fp8 first / second moment. torch_names
    (precis key -> torch's, Rule.torch_names: SGD's and Muon's 'momentum_buffer'): a state
    torch reads exactly has the buffer under torch's name, which torch's loader reads;
    any other has STEP_MARKER there too, beside precis's key, as torch.optim.SGD and
    Muon read no step: their step fails on the bytes ("'bytes' object has no attribute
    'mul_'") where a missing buffer would silently start a new momentum.
    whole_dict_exact=False: another param of the same state dict is not read exactly,
    so this one is marked too (torch's step then fails at its first param, before it
    writes any: refused whole, never half)."""
    out = dict(state)
    for k, second in MOMENT_KEYS.items():
        if isinstance(out.get(k), torch.Tensor) and out[k].dtype == torch.uint8:
            code_key, code = FP8_CODE_KEYS[second]
            out[code_key] = code
    if "remainder" in out and remainder_fingerprint:
        out["param_fingerprint"] = fingerprint(param)
    exact = whole_dict_exact and torch_reads_exactly(state, param.dtype)
    if not exact:
        out["precis_step"] = out["step"]
        out["step"] = STEP_MARKER
    for ours, theirs in (torch_names or {}).items():
        if ours in out:
            out[theirs] = out.pop(ours) if exact else STEP_MARKER
    return out


def precis_keys(saved, torch_names, where):
    """A saved param state with torch's names (torch_names: precis key -> torch's, e.g.
    SGD's 'momentum_buffer') under precis's ('exp_avg'); STEP_MARKER under torch's name
    (export_state's, beside precis's key) dropped. precis's own names pass as they are
    (checkpoints saved before export_state used torch's)."""
    if not isinstance(saved, Mapping) or not any(t in saved for t in torch_names.values()):
        return saved
    saved = dict(saved)
    for ours, theirs in torch_names.items():
        if theirs not in saved:
            continue
        value = saved.pop(theirs)
        if value is None:  # torch's SGD: no momentum yet (torch 1.x saved one for every
            continue       # param, momentum 0 too), which its next step starts from g
        if isinstance(value, bytes):
            if value != STEP_MARKER or ours not in saved:
                raise ValueError(f"{where}: '{theirs}' is bytes but not precis's marker "
                                 f"beside '{ours}'")
        elif ours in saved:
            raise ValueError(f"{where}: has both '{ours}' and '{theirs}', torch's name for "
                             f"it; which one holds the buffer?")
        else:
            saved[ours] = value
    return saved


def dcp_merged(saved_state, listed, who):
    """saved_state ('state' of a state dict: param id -> its state) with what
    torch.distributed.checkpoint.load gives back put together again. dcp.load copies a
    saved tensor into the template's in place, but sets every other value (the bytes of
    STEP_MARKER, fp8 codes, fingerprints, streams: plain Python values it round-trips
    exactly) at its path of str keys: an int param id 3 gets a second entry '3' beside
    the template's 3, which still holds the template's own non-tensor values. Each such
    entry is merged over its param's (the loaded values win); listed: the ids the param
    groups list. A str id that is neither listed nor an int id's is refused, naming what
    to call."""
    by_str = {str(pid): pid for pid in listed if not isinstance(pid, str)}
    extra = [k for k in saved_state if isinstance(k, str) and k not in listed]
    if not extra:
        return saved_state
    unknown = [k for k in extra if k not in by_str]
    if unknown:
        raise ValueError(f"{who}: 'state' has an entry for param id {unknown[0]!r}, which no "
                         f"param group lists (they list {sorted(listed, key=str)!r}). A str id "
                         f"beside int ones is what torch.distributed.checkpoint.load leaves for "
                         f"a value that is not a tensor: load into a template from this "
                         f"optimizer's state_dict() (taken after a step, so that it holds "
                         f"every param's state), or use "
                         f"torch.distributed.checkpoint.state_dict.get_state_dict / "
                         f"set_state_dict")
    merged = {k: v for k, v in saved_state.items() if k not in extra}
    for key in extra:
        pid, values = by_str[key], saved_state[key]
        if not isinstance(values, Mapping):
            raise ValueError(f"{who}: 'state' entry {key!r} (param id {pid!r} as "
                             f"torch.distributed.checkpoint.load writes it) must be a "
                             f"mapping, got {type(values).__name__}")
        merged[pid] = {**merged.get(pid, {}), **values}
    return merged


# ---------------------------------------------------------------------------
# Whole state dicts: torch.optim.AdamW's fp32 layout <-> precis's
# ---------------------------------------------------------------------------

PRECIS_GROUP_KEYS = ("policy", "seed")


def _indexed(sd, params, who):
    """(param index -> param) over sd's param groups, after checking their sizes."""
    if not isinstance(sd, Mapping) or not {"state", "param_groups"} <= set(sd):
        raise ValueError(f"{who}: expected a state dict with 'state' and 'param_groups'")
    groups = sd["param_groups"]
    if not isinstance(sd["state"], Mapping) or not isinstance(groups, (list, tuple)):
        raise ValueError(f"{who}: 'state' must be a mapping and 'param_groups' a list, got "
                         f"{type(sd['state']).__name__} and {type(groups).__name__}")
    for k, g in enumerate(groups):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise ValueError(f"{who}: param group {k} must be a mapping with a 'params' list "
                             f"of param ids, got {g!r:.80}")
    indices = [i for g in groups for i in g["params"]]
    seen = set()
    for i in indices:
        if not isinstance(i, (int, str)):
            raise ValueError(f"{who}: param id {i!r} in 'param_groups' is not an int or a str")
        if i in seen:
            raise ValueError(f"{who}: param id {i!r} is listed twice in 'param_groups'")
        seen.add(i)
    if params is None:
        return dict.fromkeys(indices)
    params = list(params)
    for k, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{who}: params[{k}] must be a tensor (a param), got "
                            f"{type(p).__name__}")
    if len(params) != len(indices):
        raise ValueError(f"{who}: the state dict lists {len(indices)} params, {len(params)} "
                         f"were given (give them in the order of its param groups)")
    return dict(zip(indices, params))


def _torch_names(group):
    """(the keys a state of this param group needs, precis key -> torch's) for the
    optimizer whose options the saved group holds: Adam / AdamW (betas and eps), SGD
    and Muon (their 'momentum_buffer'), Lion (exp_avg)."""
    if "betas" in group and "eps" in group:
        return REQUIRED_KEYS, {}
    if "momentum" in group:
        return (), {"exp_avg": "momentum_buffer"}
    return (), {}


def to_torch_state_dict(sd, params=None):
    """A precis state dict -> (state dict its torch.optim optimizer loads, masters).

    Moments become fp32 values in the param's shape (complex64 for complex params),
    named as torch's optimizer names them (SGD's and Muon's momentum: 'momentum_buffer'),
    'step' torch's float32 tensor; scales, remainders and fingerprints go. torch keeps
    its moments in the param's dtype and casts them on load (exact for fp32 params).
    masters: {param index: fp32 master} for every param that had a separate master or
    remainders: torch's optimizer state holds none, so train on an fp32 copy of the
    model holding them (e.g. param.data = masters[i]) to continue exactly. Remainders
    are joined with their params, which must then be given (`params`, in the order of
    the state dict's param groups).
    A Muon / NorMuon state dict with "adamw" groups (one optimizer stepping two
    algorithms, which no torch optimizer does) is refused: split_by_algorithm gives its
    parts, each of which converts for its torch optimizer (torch.optim.Muon,
    torch.optim.AdamW). So is a Muon group with options torch.optim.Muon lacks (dion's
    momentum_form, adjust_lr_fn or ns_coefficients), which it would step otherwise, and
    a NorMuon group (torch.optim.Muon would drop its row state and normalization)."""
    who = "precis.checkpoint.to_torch_state_dict"
    by_index = _indexed(sd, params, who)
    for gi, group in enumerate(sd["param_groups"]):  # (before the split's advice)
        if _algorithm(group) == "muon" and "beta2" in group:
            raise ValueError(f"{who}: param group {gi} is NorMuon's (beta2, a second moment "
                             f"of each row), which torch has no optimizer for: "
                             f"torch.optim.Muon would step its matrices without the "
                             f"normalization; only precis.optim.NorMuon continues it "
                             f"(decoded_state(p) reads its state as fp32)")
    algorithms = {_algorithm(g) for g in sd["param_groups"]}
    if len(algorithms) > 1:
        raise ValueError(f"{who}: the state dict's param groups step "
                         f"{' and '.join(sorted(algorithms))} "
                         f"(a Muon / NorMuon optimizer's \"adamw\" groups), which no one torch "
                         f"optimizer does: split it with precis.checkpoint.split_by_algorithm(sd) "
                         f"and convert each part (torch.optim.Muon loads the 'muon' one, "
                         f"torch.optim.AdamW the 'adamw' one)")
    for gi, group in enumerate(sd["param_groups"]):
        lacks = torch_math.muon_options_torch_lacks(group) if "ns_steps" in group else []
        if lacks:
            raise ValueError(f"{who}: param group {gi} asks for {', '.join(lacks)}, which "
                             f"torch.optim.Muon does not have (it would step the group with "
                             f"its own); only a precis optimizer continues it")
    group_of = {i: g for g in sd["param_groups"] for i in g["params"]}
    state, masters = {}, {}
    for index, saved in sd["state"].items():
        where = f"{who}: state of param {index!r}"
        required, names = _torch_names(group_of.get(index, {}))
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: expected a mapping with {', '.join(required)}")
        # torch's names (a param torch's math stepped, or export_state's exact state)
        # as precis's: moments of a float64 or complex param come back as they are
        saved = precis_keys(saved, names, where)
        if any(k not in saved for k in required):
            raise ValueError(f"{where}: expected a mapping with {', '.join(required)}")
        step = saved.get("step", 0)
        step = saved.get("precis_step") if isinstance(step, bytes) else step
        entry = {"step": step_tensor(step_value(step, where))}
        for key, second in MOMENT_KEYS.items():
            legacy = legacy_fp8(saved, where, second)
            if key in saved:
                entry[names.get(key, key)] = moment_values(saved[key], saved.get(key + "_scale"),
                                                           second, legacy)
        for key in ROW_STATE_KEYS:  # torch has no such optimizer: kept under precis's name
            if isinstance(saved.get(key), torch.Tensor):
                entry[key] = saved[key].detach().float().clone()
        state[index] = entry
        if "master" in saved:
            masters[index] = saved["master"].float()
        elif "remainder" in saved:
            p = by_index.get(index)
            if p is None:
                raise ValueError(f"{where} holds remainders, the low bits of its fp32 "
                                 f"master: give the params to join them with")
            masters[index] = remainder_join(p.detach(), saved["remainder"])
    groups = [{k: v for k, v in g.items() if k not in PRECIS_GROUP_KEYS}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}, masters


# The options a Muon / NorMuon optimizer's "adamw" group carries from the optimizer's
# defaults that torch.optim.AdamW has no use for (split_by_algorithm drops them).
MUON_GROUP_KEYS = ("algorithm", "momentum", "nesterov", "ns_coefficients", "ns_steps",
                   "adjust_lr_fn", "momentum_form", "beta2")


def _algorithm(group):
    """A param group's algorithm as split_by_algorithm names it: "adamw" (a Muon
    optimizer's "adamw" groups) or the optimizer's own ("muon" for Muon's and
    NorMuon's: Muon's state torch.optim.Muon's layout holds, NorMuon's to_torch_state_dict
    refuses; "default" for others)."""
    if group.get("algorithm") == "adamw":
        return "adamw"
    return "muon" if "ns_steps" in group else "default"


def split_by_algorithm(sd):
    """A state dict of one optimizer whose param groups step different algorithms (a
    precis.optim.Muon / NorMuon with "adamw" groups) -> {algorithm: state dict}: "muon"
    (the Muon / NorMuon groups) and "adamw", each with its groups in their order and
    their params' state, the params numbered from 0 as that optimizer's own state dict
    numbers them ("adamw" groups without their "algorithm" key and Muon's options). So
    to_torch_state_dict(parts["muon"], matrices) is what torch.optim.Muon(matrices)
    loads (a Muon's: NorMuon's it refuses), to_torch_state_dict(parts["adamw"], others)
    torch.optim.AdamW(others)'s
    (matrices, others: the params of each part's groups, in order). The way back:
    join_by_algorithm."""
    who = "precis.checkpoint.split_by_algorithm"
    _indexed(sd, None, who)
    parts = {}
    for group in sd["param_groups"]:
        algorithm = _algorithm(group)
        part = parts.setdefault(algorithm, {"state": {}, "param_groups": []})
        first = sum(len(g["params"]) for g in part["param_groups"])
        kept = group if algorithm != "adamw" else \
            {k: v for k, v in group.items() if k not in MUON_GROUP_KEYS}
        part["param_groups"].append(dict(kept, params=list(range(first, first + len(
            group["params"])))))
        for new, old in enumerate(group["params"], first):
            if old in sd["state"]:
                part["state"][new] = sd["state"][old]
    return parts


def join_by_algorithm(parts, param_groups):
    """split_by_algorithm's parts (precis state dicts, e.g. from_torch_state_dict's of
    torch.optim.Muon's and torch.optim.AdamW's) -> one state dict for the optimizer
    whose param groups are param_groups (its param_groups, or its state dict's): each of
    its groups takes the next group of its algorithm's part ("adamw" for its "adamw"
    groups, "muon" for the others), the params numbered in the groups' order."""
    who = "precis.checkpoint.join_by_algorithm"
    taken = {name: 0 for name in parts}
    out = {"state": {}, "param_groups": []}
    for gi, group in enumerate(param_groups):
        algorithm = "adamw" if group.get("algorithm") == "adamw" else "muon"
        part = parts.get(algorithm)
        if part is None or taken[algorithm] >= len(part["param_groups"]):
            raise ValueError(f"{who}: param group {gi} steps {algorithm!r}, and the "
                             f"{algorithm!r} part has no group left for it (parts: "
                             f"{ {k: len(p['param_groups']) for k, p in parts.items()} } groups)")
        saved = part["param_groups"][taken[algorithm]]
        taken[algorithm] += 1
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"{who}: param group {gi} has {len(group['params'])} params, "
                             f"its {algorithm!r} part's group {len(saved['params'])}")
        first = sum(len(g["params"]) for g in out["param_groups"])
        new = dict(saved, params=list(range(first, first + len(saved["params"]))))
        if algorithm == "adamw":
            new["algorithm"] = "adamw"
        out["param_groups"].append(new)
        for index, old in enumerate(saved["params"], first):
            if old in part["state"]:
                out["state"][index] = part["state"][old]
    left = {k: len(p["param_groups"]) - taken[k] for k, p in parts.items()
            if len(p["param_groups"]) > taken[k]}
    if left:
        raise ValueError(f"{who}: groups left over, which no param group takes: {left}")
    return out


def local_scales(p, t, where, key):
    """Saved block scales t of DTensor param p (a DTensor of shape (rows, blocks per
    row), or a one-process checkpoint's (rows * blocks per row,) in memory order: the
    same blocks) as p's local shard's, 1-D."""
    per_row = blocks_per_row(p)
    want = (p.shape[0], per_row)
    if tuple(t.shape) != want and (is_dtensor(t) or t.dim() != 1 or t.numel() != math.prod(want)):
        raise ValueError(f"{where}: '{key}' has shape {tuple(t.shape)}; the block scales of a "
                         f"DTensor param of shape {tuple(p.shape)} have shape {want} (a block "
                         f"per {_lib.SCALE_BLOCK} elements of each row)")
    return local_shard(p, t if is_dtensor(t) else t.reshape(want)).reshape(-1)


def local_state(p, saved, where):
    """A saved state of p (a mapping as load_state_dict takes it) with its tensors as
    p's local shards, after checking their global shapes."""
    if not is_dtensor(p) or not isinstance(saved, Mapping):
        return saved
    out = dict(saved)
    rows_fit = blocks_per_row(p) is not None
    for key, t in saved.items():
        if key in ("step", "precis_step") + ROW_STATE_KEYS or not isinstance(t, torch.Tensor):
            continue  # (a row state is whole on every rank: row_state_of)
        if key.endswith("_scale"):
            if rows_fit:
                out[key] = local_scales(p, t, where, key)
            continue
        if t.shape != p.shape:
            raise ValueError(f"{where}: '{key}' has shape {tuple(t.shape)}, the param "
                             f"{tuple(p.shape)}")
        scales = saved.get(key + "_scale")
        if scales is not None and not rows_fit:
            # Blocks a shard would cut (a one-process checkpoint's): this param keeps
            # its moments unscaled, so load their values.
            if is_dtensor(t) or is_dtensor(scales):
                raise ValueError(f"{where}: '{key}' is block-scaled, which a DTensor param of "
                                 f"shape {tuple(p.shape)} cannot hold (its rows are not whole "
                                 f"blocks of {_lib.SCALE_BLOCK})")
            second = MOMENT_KEYS[key]
            t = moment_values(t, scales, second, t.dtype == torch.uint8
                              and legacy_fp8(saved, where, second))
            del out[key + "_scale"]
        out[key] = local_shard(p, t)
    return out


def placed_state(p, key, value):
    """A converted state tensor of p (its local shard's) placed as p's state keeps it:
    like p, its block scales as scales_like, a row state whole on every rank."""
    if not isinstance(value, torch.Tensor) or key == "step":
        return value
    if key.endswith("_scale"):
        return scales_like(p, value)
    return replicated_like(p, value) if key in ROW_STATE_KEYS else placed_like(p, value)


def from_torch_state_dict(sd, params, policy=None, masters=None):
    """A torch.optim.Adam / AdamW, SGD or Muon state dict (any to_torch_state_dict
    writes, Lion's too) -> a precis state dict for an optimizer over `params` (in the
    order of sd's param groups) with `policy` (as precis.optim takes it): moments
    encoded in the policy's dtypes (a one-state rule's momentum in its momentum_dtype,
    named as export_state names it), checked as load_state_dict
    checks them. masters: optional {param index: fp32 master} (e.g. from
    to_torch_state_dict, or the fp32 weights torch trained): kept as the policy keeps
    masters; without, masters are built from the params at the first step. DTensor
    params (FSDP2) get their state as DTensors placed like them, as precis.optim keeps it."""
    who = "precis.checkpoint.from_torch_state_dict"
    if params is None:
        raise TypeError(f"{who}: params is None; give the params the state is for, in the "
                        f"order of the state dict's param groups")
    by_index = _indexed(sd, params, who)
    group_of = {i: g for g in sd["param_groups"] for i in g["params"]}
    masters = masters or {}
    state, dropped = {}, {}
    for index, saved in sd["state"].items():
        if index not in by_index:
            raise ValueError(f"{who}: 'state' has an entry for param id {index!r}, which no "
                             f"param group lists")
        p = by_index[index]
        where = f"{who}: state of param {index!r} (shape {tuple(p.shape)}, {p.dtype})"
        # As precis.optim lays it out: a param of precis.fsdp carries its model's policy
        # (kept in the master dtype, it is its own master); a DTensor's moments are bf16
        # where its rows are not whole scale blocks.
        model = getattr(p, "_precis_policy", None)
        option = model if policy is None else policy
        layout = param_layout(option, p, who) if model is None or torch_layout(p) else \
            layout_of(policy_for(option, model.param_dtype, who), p.dtype)
        required, names = _torch_names(group_of[index])
        if required != REQUIRED_KEYS and not torch_layout(p):  # a one-state rule's momentum
            layout = one_state_layout(layout, policy_for(
                option, p.dtype if model is None else model.param_dtype, who))
        layout = unscaled_layout(layout, p, who)
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(saved).__name__}")
        saved = dict(precis_keys(saved, names, where))
        if index in masters and layout.master is not None:
            saved["master"] = masters[index]
        elif index in masters:  # (its policy keeps none: master_state.warn_dropped)
            kind = master_state.dropped({"master": masters[index]}, {})
            dropped[kind] = dropped.get(kind, 0) + 1
        # A DTensor param (FSDP2) is converted shard by shard, as load_state_dict does:
        # the C conversions read plain tensors' memory, and a DTensor has none of its own.
        saved, local = local_state(p, saved, where), local_shard(p, p.detach())
        for key, t in (("param", local), *saved.items()):  # what C would read as NULL
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            if is_dtensor(t):  # (a DTensor param's are its local shards by now)
                raise ValueError(f"{where}: '{key}' is a DTensor (sharded) but the param is "
                                 f"not: give the sharded params it was saved with, or full "
                                 f"tensors (its full_tensor())")
            if t.device.type == "meta" or t.data_ptr() == 0:
                raise ValueError(f"{where}: '{key}' is a {type(t).__name__} on {t.device} that "
                                 f"holds no data; give tensors holding its values")
        row = next((k for k in ROW_STATE_KEYS if k in saved), None)  # (NorMuon's)
        converted, fp = convert_state(local, saved, layout, where, required,
                                      row_state=row and (row, p.shape[0]))
        if converted:
            converted = {k: placed_state(p, k, v) for k, v in converted.items()}
            state[index] = export_state(converted, p, remainder_fingerprint=False,
                                        torch_names=names)
            # A shard's fingerprint would not survive resharding (precis.optim saves none
            # for DTensors either).
            if fp is not None and not is_dtensor(p):
                state[index]["param_fingerprint"] = fp
    master_state.warn_dropped(who, dropped)
    return {"state": state, "param_groups": [dict(g) for g in sd["param_groups"]]}
