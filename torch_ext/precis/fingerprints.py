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

from . import _lib, device_reads, ops, tracing
from .stored_forms import dense_flat

_DATA_PTR = torch.Tensor.data_ptr
_WORD = 1 << 64


def of(tensors):
    """A fingerprint (an int in [0, 2^64)) of each tensor's bytes: any change to an
    element changes it. Dense tensors of any strides are read as their memory; others
    through a contiguous copy."""
    out = [0] * len(tensors)
    if not out:
        return out
    cpu, on_devices = split(tensors)
    for i, value in cpu:
        out[i] = value
    for positions, values in on_devices:
        for i, value in zip(positions, unsigned(values)):  # one read back a device
            out[i] = value
    return out


def split(tensors):
    """The fingerprints of tensors, read back from no device: ([(position, int)] of the
    CPU tensors, one C call; [(positions, int64 tensor)] a device, the op's output, not
    read back yet)."""
    cpu, device = [], []  # (position, tensor)
    emulated = device_reads.emulated()  # CPU tensors on the device path: the op, as a GPU's
    for i, t in enumerate(tensors):
        flat = t.reshape(-1) if t.is_contiguous() and not t.is_complex() else dense_flat(t)
        if flat is None:
            flat = dense_flat(t.contiguous())
        (cpu if flat.is_cpu and not emulated else device).append((i, flat))
    values = of_ranges([_DATA_PTR(t) for _, t in cpu],
                       [t.numel() * t.element_size() for _, t in cpu]) if cpu else []
    by_device = {}
    for i, t in device:
        by_device.setdefault(t.device, []).append((i, t))
    return ([(i, value) for (i, _), value in zip(cpu, values)],
            [([i for i, _ in entries], ops.fingerprint([t for _, t in entries]))
             for entries in by_device.values()])


class Records:
    """What the optimizer last left in each param it keeps a copy of: id(param) -> the
    fingerprint of its values then, compared before its next step. A device's are kept
    as the op's output, computed in stream order right after the step, and read back all
    together at the first look: recording after a step makes the host wait for nothing
    (a released step on a GPU, precis.release)."""

    def __init__(self):
        self._values = {}
        # unread records, oldest first: serial -> [ids, int64 tensor, how many of its ids
        # no newer unread record supersedes]; and id -> the serial of its newest one
        self._unread, self._unread_of, self._serial = {}, {}, 0
        # id -> its newest record made on a device (one element: the op's output, or a
        # view of it), for a compare that reads nothing back (on_device)
        self._kept = {}
        # ids of params a step that saw writes itself left (a Plan's Part on the CPU:
        # step_plan.Part.sees), with no record: the next step outside it compares them
        # with their masters' rounding (optim_state.written_behind)
        self.by_rule = set()

    def compare_by_rule(self, ids):
        """Forget the records of ids: compared by rounding until recorded again."""
        ids = list(ids)
        self._read()
        for key in ids:
            self._values.pop(key, None)
            self._kept.pop(key, None)
        self.by_rule.update(ids)

    def record(self, ids, tensors):
        """Record the fingerprints of tensors as they are now (ids: their params')."""
        ids = list(ids)
        self.by_rule.difference_update(ids)
        if not ids:
            return
        cpu, on_devices = split(tensors)
        if cpu:  # (update reads the unread first: a device's alone would wait for it)
            self.update((ids[i], value) for i, value in cpu)
        for positions, values in on_devices:
            self.record_values([ids[i] for i in positions], values)

    def record_values(self, ids, int64s):
        """Record fingerprints already computed on a device (the op's int64 tensor,
        one per id), read back at the first look."""
        ids = list(ids)
        self.by_rule.difference_update(ids)
        # an unread record whose every id a newer one supersedes is never read (a step's
        # each: no backlog); found by id, not by a scan of the unread (a released
        # backward records a param at a time)
        self._serial += 1
        newer = set(ids)
        for key in newer:
            old = self._unread_of.get(key)
            if old is not None:
                entry = self._unread[old]
                entry[2] -= 1
                if entry[2] == 0:
                    del self._unread[old]
            self._unread_of[key] = self._serial
        self._unread[self._serial] = [ids, int64s, len(newer)]
        # (a released param's record is its call's whole output: no view to make)
        self._kept.update(zip(ids, (int64s,) if int64s.numel() == 1 else int64s.split(1)))

    def rewrite(self, ids, tensors):
        """Write the fingerprints of tensors now (ids: their params') into the records
        of those ids made on a device, in their memory (a CUDA graph's replays compare
        against it: graph_records). Returns (the records written, the ids that have no
        such record)."""
        ids = list(ids)
        have = [i for i, key in enumerate(ids) if key in self._kept]
        records = []
        if have:
            _, on_devices = split([tensors[i] for i in have])
            for positions, values in on_devices:
                records += [self._kept[ids[have[i]]] for i in positions]
                torch._foreach_copy_(records[-len(positions):], list(values.split(1)))
            have = [have[i] for positions, _ in on_devices for i in positions]
        kept = set(have)
        return records, [key for i, key in enumerate(ids) if i not in kept]

    def update(self, pairs):
        """Record known fingerprints: (id, int) pairs."""
        pairs = list(pairs)
        self.by_rule.difference_update(key for key, _ in pairs)
        self._read()  # an older record must not overwrite these
        for key, _ in pairs:
            self._kept.pop(key, None)
        self._values.update(pairs)

    def on_device(self, ids):
        """(the ids that have a record made on a device, their records as one int64
        tensor on it), nothing read back; None when one of ids has a newer record
        known on the host only, or they are on several devices."""
        if any(key not in self._kept and key in self._values for key in ids):
            return None
        kept = [key for key in ids if key in self._kept]
        if not kept:
            return kept, None
        views = [self._kept[key] for key in kept]
        if len({v.device for v in views}) > 1:
            return None
        return kept, torch.cat(views)

    def device_record(self, key):
        """key's newest record, where it was made on a device (a one-element int64 tensor:
        the op's output or a view of it), else None (none, or a newer one known on the
        host only)."""
        return self._kept.get(key)

    def __contains__(self, key):
        self._read()
        return key in self._values

    def __getitem__(self, key):
        self._read()
        return self._values[key]

    def _read(self):
        """The unread records into _values, oldest first: one read back a device."""
        unread, self._unread, self._unread_of = self._unread.values(), {}, {}
        by_device = {}
        for ids, values, _ in unread:
            by_device.setdefault(values.device, []).append((ids, values))
        for entries in by_device.values():
            ids = [i for entry_ids, _ in entries for i in entry_ids]
            self._values.update(zip(ids, unsigned(torch.cat([v for _, v in entries]))))


# A param with remainders is recorded in blocks too, BLOCK elements each (the last
# shorter), each block its own fingerprint: a write into part of the param (a slice, a
# row, a clamp of a few elements) costs the remainders of the blocks it touched, the
# others keep theirs. A remainder cannot tell which of its elements were written (any
# param bits and remainder make a master); a master can, element by element
# (csrc/resync.h). A block's value is precis_fingerprint_blocks' (its words' terms at
# their place in the param), so that a step records its params' blocks as it writes them
# (the op's fingerprints out after the params' entries: a CUDA block's chunk is a block).
BLOCK = 1 << 14


class Blocks:
    """The blocks of BLOCK elements of 1-D tensors on one device (flats, of one dtype),
    one after another (the last of each shorter; one empty block for an empty one), made
    once so that tensors that keep their memory (a Plan's params) are fingerprinted step
    after step without making their arguments anew."""

    def __init__(self, flats):
        self.flats = flats
        self.counts = [block_count(flat.numel()) for flat in flats]
        self._args = None
        if device_reads.emulated() or not flats[0].is_cpu:
            return  # (the op: fingerprint.blocks)
        n = len(flats)
        self._args = ((ctypes.c_void_p * n)(*map(_DATA_PTR, flats)),
                      (ctypes.c_int64 * n)(*[f.numel() * f.element_size() for f in flats]),
                      n, BLOCK * flats[0].element_size())

    def fingerprints_now(self):
        """Their fingerprints now, one int64 tensor on their device (the uint64s' bits):
        on the CPU one C call, on the device path one op, nothing read back."""
        if self._args is None:
            return ops.fingerprint_blocks(self.flats, BLOCK * self.flats[0].element_size())
        out = torch.empty(sum(self.counts), dtype=torch.int64)
        _lib.check(_lib.lib().precis_fingerprint_blocks(*self._args, out.data_ptr()),
                   "precis_fingerprint_blocks")
        return out


def of_blocks(flats):
    """The fingerprints of the blocks of each of flats (1-D tensors, on one device), as
    one int64 tensor on it: Blocks(flats).fingerprints_now()."""
    return Blocks(flats).fingerprints_now()


def block_count(numel):
    """How many blocks of_blocks gives a tensor of numel elements."""
    return ops.block_count(numel, BLOCK)


def unsigned(int64s):
    """An int64 tensor of fingerprints (the ops' form) as a list of ints in [0, 2^64),
    as of() gives them: the uint64 each int64 holds (read back by device_reads.read)."""
    return [value % _WORD for value in device_reads.read(int64s, "fingerprints")]


def readable():
    """Whether a step may read fingerprints back now: not while torch.compile traces it,
    nor while a CUDA graph captures it (a capturable step outside a capture reads them:
    the one read back it makes)."""
    # (no capture before CUDA is initialized; is_available() costs a microsecond a call)
    return not tracing.traced() and not (
        torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


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
