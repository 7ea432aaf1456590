"""A capturable step captured in a CUDA graph sees a write into its params between
replays (a model-only load), as an eager step does.

An eager step compares each watched param's fingerprint with the record its last step
left (on a GPU on the device: functional.compare_on_device, nothing read back), resyncs
the written ones' masters (precis.resync_masters_), steps, and records the params anew
in new tensors. A replay runs no Python: the compare it captured reads the memory the
records were in at capture, so the captured step writes its new records into that same
memory (rewrite) instead of new tensors, and each replay compares against what the one
before left. What a replay cannot do: warn (StaleMasterWarning needs the host), or
compare a param that had no record on the device when the graph was captured (a capture
without warm-up steps; then, as after a compiled step, the records are dropped at the
next eager step: books.unrecorded)."""

import torch

from . import fingerprints, optim_state, tracing
from .dtensor import local_shard


def capturing():
    """Whether a CUDA graph is capturing the step now (not torch.compile's trace)."""
    return not tracing.traced() and torch.cuda.is_initialized() and \
        torch.cuda.is_current_stream_capturing()


def rewrite(books, calls):
    """After a captured step's op calls: the fingerprints of what they left in their
    watched params, written into the records the captured compare read (the same
    memory: books.written's device records, books.blocks' block records), so that the
    next replay compares against them. The graph writes them at every replay, so they
    are kept (books.captured) for as long as the optimizer lives: a later eager step
    records elsewhere, and its records may be dropped, but not this memory. A param with
    no device record to rewrite leaves the books unrecorded (its write between replays
    is not seen)."""
    pairs = [(p, st) for call in calls for p, st in zip(call.params, call.states)
             if optim_state.watched(books, p, st)]
    records, missing = books.written.rewrite([id(p) for p, _ in pairs],
                                             [local_shard(p, p) for p, _ in pairs])
    books.captured += records
    by_kind = {}  # (device, dtype) -> [(flat, its block record)], as record_blocks
    for p, st in pairs:
        record = books.blocks.get(id(p))
        flat = optim_state.memory_of(local_shard(p, p)) if "remainder" in st else None
        if flat is None:
            continue
        if record is None or record.numel() != fingerprints.block_count(flat.numel()):
            missing.append(id(p))
            continue
        by_kind.setdefault((flat.device, flat.dtype), []).append((flat, record))
    for entries in by_kind.values():  # (one fingerprint call for all their blocks)
        blocks = fingerprints.Blocks([flat for flat, _ in entries])
        records = [record for _, record in entries]
        torch._foreach_copy_(records, list(blocks.fingerprints_now().split(blocks.counts)))
        books.captured += records
    if missing:
        books.unrecorded = True
