"""The stored forms of optimizer state, and the memory order they follow.

A dense param of any strides (channels_last, transposed) is stepped as the 1-D
sequence of its elements in memory; its state has the same strides, and fp16 / fp8
block scales follow memory order. The stored forms are C's (precis_moment_encode /
decode, precis_remainder_split / join, through ctypes):

  encode_moment / decode_moment     fp32 values <-> a moment in fp32 / bf16 / fp16 / fp8
  remainder_split / remainder_join  fp32 master <-> bf16 param + int16 remainder or
                                    uint8 8-bit correction (a 24-bit master)
  flat_bits / fingerprint           a tensor's bits; a param's hash (remainders' key)
"""

import torch

from . import _lib
from .dtensor import as_dtensor
from .op_constants import (_MASK63, MOMENT_DTYPES, REMAINDER_BITS, REMAINDER_DTYPES,  # noqa: F401
                           SCALED_MOMENT_DTYPES, mix_seed, scale_count, torch_to_code)


# ---------------------------------------------------------------------------
# Memory order: a dense param of any strides (channels_last, transposed) is stepped
# as the 1-D sequence of its elements in memory; its state has the same strides.
# ---------------------------------------------------------------------------


def dense_flat(t):
    """t's elements in memory order as a 1-D view (complex: as real pairs), or None
    when t is not dense and non-overlapping."""
    if t.is_contiguous() and not t.is_complex():  # (the common case, without the sort)
        return t.view(-1)
    if t.is_complex():
        t = torch.view_as_real(t)
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    v = t.permute(order)
    return v.view(-1) if v.is_contiguous() else None


def same_layout(a, b):
    """Same shape and strides on every dim that has more than one element."""
    if a.stride() == b.stride():
        return a.shape == b.shape
    return a.shape == b.shape and all(sa == sb for n, sa, sb in
                                      zip(a.shape, a.stride(), b.stride()) if n > 1)


def laid_out_like(t, p):
    """Whether t has the strides like(p, ...) gives: p's when p is dense, else
    contiguous."""
    return same_layout(t, p) or (t.is_contiguous() and dense_flat(p) is None)


def like(p, t, dtype=None):
    """A fresh copy of t (p's shape) laid out like p, on p's device."""
    out = torch.empty_like(p, dtype=dtype or t.dtype, memory_format=torch.preserve_format)
    return out.copy_(t)


def _cpu_dense(t, dtype=None):
    """t on the CPU in dtype, keeping its strides when it is dense (else contiguous)."""
    t = t.detach().to(device="cpu", dtype=dtype or t.dtype)
    return t if dense_flat(t) is not None else t.contiguous()


# ---------------------------------------------------------------------------
# Stored forms (C). They work on CPU copies and return tensors on the input's device
# with the input's strides (block scales follow memory order).
# ---------------------------------------------------------------------------


def encode_moment(values, dtype, second_moment):
    """fp32 moment values -> (stored tensor in dtype, fp32 scales or None), laid out
    like values.

    dtype: torch.float32 / float16 / bfloat16 / uint8 (fp8). second_moment selects
    the exp_avg_sq encoding (values are v itself, not its square root).
    """
    _lib.require_tensor(values, "values", "precis.checkpoint.encode_moment")
    if dtype not in MOMENT_DTYPES:
        raise ValueError(f"precis: moment dtype {dtype} not in {MOMENT_DTYPES}")
    src = _cpu_dense(values, torch.float32)
    n = src.numel()
    dst = torch.empty_like(src, dtype=dtype)
    scales = torch.zeros(scale_count(n), dtype=torch.float32) \
        if dtype in SCALED_MOMENT_DTYPES else None
    if n > 0:
        _lib.check(_lib.lib().precis_moment_encode(
            dense_flat(src).data_ptr(), n, int(bool(second_moment)), dense_flat(dst).data_ptr(),
            torch_to_code(dtype), None if scales is None else scales.data_ptr()),
            "precis_moment_encode")
    dev = values.device
    return dst.to(dev), (None if scales is None else scales.to(dev))


def on_local_shards(fn, first, *rest):
    """fn(first, *rest), or for DTensors (a sharded param's state) fn of their local
    shards placed like `first`: for the element-wise decodings below, exact."""
    if not hasattr(first, "to_local"):
        return fn(first, *rest)
    out = fn(first.to_local(), *(t.to_local() if hasattr(t, "to_local") else t for t in rest))
    return as_dtensor(out, first.device_mesh, first.placements, first.shape, out.stride())


def decode_moment(stored, scales, second_moment, legacy_fp8=False):
    """Stored moment (+ its fp32 scales for fp16/fp8) -> fp32 values, same shape and
    strides. legacy_fp8: an fp8 moment in the E4M3 code of a state saved before
    FP8_M_CODE / FP8_V_CODE (see legacy_fp8)."""
    _lib.require_tensor(stored, "stored", "precis.checkpoint.decode_moment")
    if scales is not None:
        _lib.require_tensor(scales, "scales", "precis.checkpoint.decode_moment")
    if stored.dtype not in MOMENT_DTYPES:
        raise ValueError(f"precis: moment dtype {stored.dtype} not in {MOMENT_DTYPES}")
    src = _cpu_dense(stored)
    n = src.numel()
    sc = None
    if stored.dtype in SCALED_MOMENT_DTYPES:
        if scales is None or scales.numel() != scale_count(n):
            raise ValueError(f"precis: a {stored.dtype} moment of {n} elements needs "
                             f"{scale_count(n)} scales")
        sc = scales.detach().to(device="cpu", dtype=torch.float32).contiguous()
    dst = torch.empty_like(src, dtype=torch.float32)
    if legacy_fp8 and stored.dtype == torch.uint8:
        # m = E4M3 code * block scale, v = its square; blocks in memory order
        codes = dense_flat(src).view(torch.float8_e4m3fn).float()
        x = codes * sc.repeat_interleave(_lib.SCALE_BLOCK)[:n]
        dense_flat(dst).copy_(x * x if second_moment else x)
    elif n > 0:
        _lib.check(_lib.lib().precis_moment_decode(
            dense_flat(src).data_ptr(), None if sc is None else sc.data_ptr(), n,
            int(bool(second_moment)), torch_to_code(stored.dtype),
            dense_flat(dst).data_ptr()), "precis_moment_decode")
    return dst.to(stored.device)


def moment_values(stored, scales, second_moment, legacy_fp8=False):
    """A stored moment's values in full precision: fp32 (a complex or float64 param's
    moment, kept as torch keeps it, as it is; so is a sparse one, torch's SGD momentum after
    sparse gradients); legacy_fp8 as decode_moment."""
    if stored.is_complex() or stored.dtype == torch.float64 or stored.is_sparse:
        return stored.detach().clone()
    return on_local_shards(lambda t, sc: decode_moment(t, sc, second_moment, legacy_fp8),
                           stored, scales)


# fp8 moments are stored in precis's own codes (csrc/stores.h, docs/design.md
# section 4): m / scale in m8 (signed E2M5), sqrt(v) / scale in v8 (unsigned E3M5).
# A state dict says so with 'fp8_m_code': FP8_M_CODE beside an fp8 first moment and
# 'fp8_v_code': FP8_V_CODE beside an fp8 second one. A state saved by an older
# precis lacks the entry and holds E4M3 codes with scales of amax / 448: it is read
# as such and re-encoded.
FP8_M_CODE = 2
FP8_V_CODE = 2
FP8_CODE_KEYS = {False: ("fp8_m_code", FP8_M_CODE), True: ("fp8_v_code", FP8_V_CODE)}


def legacy_fp8(saved, where, second_moment):
    """Whether a saved param state holds its fp8 first (second_moment: second)
    moments in the E4M3 code of precis before FP8_M_CODE (FP8_V_CODE); ValueError
    for a code this precis does not know."""
    key, known = FP8_CODE_KEYS[bool(second_moment)]
    code = saved.get(key)
    if code is not None and (isinstance(code, bool) or code != known):
        raise ValueError(f"{where}: '{key}' is {code!r}; this precis reads "
                         f"{known} (or none: a state saved before it)")
    return code is None



def relayout(p, stored, scales, second_moment):
    """A stored moment (and its scales) laid out like p: fp16 / fp8 blocks follow
    memory order, so those are decoded and encoded anew."""
    if stored.dtype not in SCALED_MOMENT_DTYPES:
        return like(p, stored), scales
    values = like(p, decode_moment(stored, scales, second_moment), torch.float32)
    return encode_moment(values, stored.dtype, second_moment)


# (split, join) in C, by width
_REMAINDER_C = {16: ("precis_remainder_split", "precis_remainder_join"),
                8: ("precis_remainder8_split", "precis_remainder8_join")}


def remainder_split(master, bits=16):
    """fp32 master -> (bf16 param, remainder) (docs/design.md section 4). bits=16: an
    int16 remainder, exact; bits=8: a uint8 correction, the master rounded to nearest
    even at 24 bits."""
    _lib.require_tensor(master, "master", "precis.checkpoint.remainder_split")
    if bits not in REMAINDER_DTYPES:
        raise ValueError(f"precis: remainder_split: bits must be 16 or 8, got {bits!r}")
    src = master.detach().to(device="cpu", dtype=torch.float32).contiguous()
    n = src.numel()
    param = torch.empty(src.shape, dtype=torch.bfloat16)
    rem = torch.empty(src.shape, dtype=REMAINDER_DTYPES[bits])
    if n > 0:
        name = _REMAINDER_C[bits][0]
        _lib.check(getattr(_lib.lib(), name)(src.data_ptr(), n, param.data_ptr(),
                                             rem.data_ptr()), name)
    return param.to(master.device), rem.to(master.device)


def remainder_join(param, remainder):
    """bf16 param + remainder (int16, or a uint8 8-bit correction) -> the fp32 master
    they encode (contiguous)."""
    _lib.require_tensor(param, "param", "precis.checkpoint.remainder_join")
    _lib.require_tensor(remainder, "remainder", "precis.checkpoint.remainder_join")
    if param.dtype != torch.bfloat16 or remainder.dtype not in REMAINDER_BITS:
        raise ValueError(f"precis: remainder_join needs a bf16 param and an int16 remainder "
                         f"(or a uint8 8-bit correction), got {param.dtype} and "
                         f"{remainder.dtype}")
    if param.shape != remainder.shape:
        raise ValueError(f"precis: remainder_join: a param of shape {tuple(param.shape)} but "
                         f"remainders of shape {tuple(remainder.shape)}")
    if hasattr(param, "to_local"):  # a sharded param: each shard's own master
        return on_local_shards(remainder_join, param.detach(), remainder)
    p = param.detach().cpu().contiguous()
    r = remainder.detach().cpu().contiguous()
    out = torch.empty(p.shape, dtype=torch.float32)
    if p.numel() > 0:
        name = _REMAINDER_C[REMAINDER_BITS[r.dtype]][1]
        _lib.check(getattr(_lib.lib(), name)(p.data_ptr(), r.data_ptr(), p.numel(),
                                             out.data_ptr()), name)
    return out.to(param.device)


def remainders_for(param, master, bits=16):
    """(bf16 param, remainder of `bits`) for an fp32 master, kept with the param as it is.

    A master saved by an fp32-master policy went with a param rounded to nearest even,
    and an int16 remainder converted to 8 bits rounds its low byte away, while
    remainder_split rounds an exact tie (low half 0x8000, low byte 0x80) up: there the
    param is one below the split's, and 0x7FFF / 0x7F (the master less one ulp of the
    remainder) is the closest remainder it can carry. Any other difference means the
    param is not (yet) the master's: the split stands, and its fingerprint decides at
    the next step."""
    high, low = remainder_split(master, bits)
    p = param.detach().to(high.device).contiguous()
    if torch.equal(high, p):
        return high, low
    h16, p16 = high.view(torch.int16), p.view(torch.int16)
    # the tie's remainder: -0x8000 as int16, 0x80 as the uint8 correction
    tie = (low == (-0x8000 if bits == 16 else 0x80)) & (h16 == p16 + 1)
    if not bool(((h16 == p16) | tie).all()):
        return high, low
    return p, torch.where(tie, torch.full_like(low, 0x7FFF if bits == 16 else 0x7F), low)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FP_CHUNK = 1 << 20


def flat_bits(t):
    """t's elements (logical order) as integers of the same size, flattened."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def fingerprint(param):
    """A 63-bit hash of a param's bits (checkpoint time only; not on the step path).

    Saved next to remainders: a remainder is only the low bits of the master, so
    it is reused after a reload only when the param holds the very bits it was
    saved with.
    """
    bits = flat_bits(param.detach())
    h = 0
    for start in range(0, bits.numel(), _FP_CHUNK):
        chunk = bits[start:start + _FP_CHUNK].to(device="cpu", dtype=torch.int64)
        pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64)
        part = int(((chunk + 40503) * (pos * 2654435761 + 97)).sum())
        h = mix_seed(h, part & _MASK63)
    return mix_seed(h, bits.numel(), bits.element_size())
