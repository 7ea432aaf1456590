"""What precis.optim's last step wrote into each param, as a 64-bit fingerprint of its
bytes, so that a write behind the optimizer's back is seen whatever made it: torch's
load paths (torch.distributed.checkpoint, FSDP2's load_state_dict,
set_model_state_dict) write the shards without moving their version counters, and a
write through `param.data` moves none either (docs/design.md section 6).

The fingerprint is C's (precis_fingerprint): one call for a list of CPU tensors, or
torch.ops.precis.fingerprint for the list on a GPU (its CUDA twin, the same values),
read back once per device."""

import ctypes

import torch

from . import _lib, ops
from .stored_forms import dense_flat

_DATA_PTR = torch.Tensor.data_ptr
_WORD = 1 << 64


def of(tensors):
    """A fingerprint (an int in [0, 2^64)) of each tensor's bytes: any change to an
    element changes it. Dense tensors of any strides are read as their memory; others
    through a contiguous copy."""
    out = [0] * len(tensors)
    cpu, device = [], []  # (position, tensor)
    for i, t in enumerate(tensors):
        flat = t.reshape(-1) if t.is_contiguous() and not t.is_complex() else dense_flat(t)
        if flat is None:
            flat = dense_flat(t.contiguous())
        (cpu if flat.is_cpu else device).append((i, flat))
    if cpu:
        values = of_ranges([_DATA_PTR(t) for _, t in cpu],
                           [t.numel() * t.element_size() for _, t in cpu])
        for (i, _), value in zip(cpu, values):
            out[i] = value
    by_device = {}
    for i, t in device:
        by_device.setdefault(t.device, []).append((i, t))
    for entries in by_device.values():
        values = unsigned(ops.fingerprint([t for _, t in entries]))  # one read back
        for (i, _), value in zip(entries, values):
            out[i] = value
    return out


def unsigned(int64s):
    """An int64 tensor of fingerprints (the ops' form) as a list of ints in [0, 2^64),
    as of() gives them: the uint64 each int64 holds."""
    return [value % _WORD for value in int64s.tolist()]


def readable():
    """Whether a step may read fingerprints back now: not while torch.compile traces it,
    nor while a CUDA graph captures it (a capturable step outside a capture reads them:
    the one read back it makes)."""
    return not torch.compiler.is_compiling() and not (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def of_ranges(addresses, nbytes):
    """The fingerprints of CPU byte ranges (addresses, lengths), one C call."""
    return list(Ranges(addresses, nbytes).fingerprints_now())


class Ranges:
    """CPU byte ranges fingerprinted step after step (a Plan's params): the C call's
    arrays made once (building them took 0.6 ms for 2,000 ranges, the C call 0.1 ms)."""

    def __init__(self, addresses, nbytes):
        self.count = n = len(addresses)
        self._bufs = (ctypes.c_void_p * n)(*addresses)
        self._nbytes = (ctypes.c_int64 * n)(*nbytes)
        self._out = (ctypes.c_uint64 * n)()

    def fingerprints_now(self):
        """Their fingerprints now (a ctypes array of uint64, overwritten by the next call)."""
        _lib.check(_lib.lib().precis_fingerprint(self._bufs, self._nbytes, self.count,
                                                 self._out), "precis_fingerprint")
        return self._out
