"""What a gradient release's kept op calls were made from, and the records their ops
compare their params with (precis.release: GradientRelease.keep_call, kept_call,
_keep_bucket, _bucket_calls): a call made by the full path for a param alone or for a
bucket is made again at later backwards while everything it was made from is the same
object (checked_as, unscheduled, policy_value, made_for), its op comparing its params
itself where it can (compared_by, block_records, bucket_records)."""

import collections
from collections.abc import Mapping

import torch

from . import fingerprints, optim_state
from .policy import Policy


# The values a group's check can be kept for (GradientRelease.checked): immutable, so
# a group holding the same objects passes again; a tensor (an lr filled in place) is
# checked at every call, as before. A policy mapping (a YAML config's) is kept by its
# value (policy_value), which a write into the mapping changes.
IMMUTABLE = (float, int, bool, str, type(None), Policy)


def checked_as(group):
    """(group's keys, its values, its params' count, its policy_value) as a check that
    passed saw them (its hyperparameters', and each param listed once), or None when a
    value other than its params and policy is mutable, or a param is listed twice
    (functional.gather refuses it)."""
    for key, value in group.items():
        if key not in ("params", "policy") and not isinstance(value, IMMUTABLE) and not (
                isinstance(value, tuple) and all(isinstance(v, IMMUTABLE) for v in value)):
            return None
    params, policy = group["params"], group.get("policy")
    if len(set(map(id, params))) != len(params) or \
            not isinstance(policy, IMMUTABLE + (Mapping,)):
        return None
    return tuple(group), tuple(group.values()), len(params), policy_value(group)


def policy_value(group):
    """A group's policy as a value to compare later ones with: a copy of a mapping (its
    values immutable: strings, numbers, dtypes, None), else the policy itself (None, or
    an immutable Policy)."""
    policy = group.get("policy")
    return dict(policy) if isinstance(policy, Mapping) else policy


def unscheduled(group):
    """A group's settings but its lr (a scheduler's, read at every call) and its params."""
    return tuple(value for key, value in group.items() if key not in ("lr", "params"))


def made_for(p, grad):
    """What a kept call was made for, of p and its grad: dtypes, devices, shapes, strides,
    memory (a grad not dense and contiguous: never kept)."""
    dense = grad.layout == torch.strided and grad.is_contiguous()
    return (p.dtype, p.device, p.shape, p.stride(), p.data_ptr(), dense, grad.dtype,
            grad.device, grad.shape)


# A released param's op call kept by GradientRelease.keep_call, with what it was made from
# (kept_call compares them at each call); compares: what the op compares itself before it
# steps the param, "blocks" (its remainders' blocks, fingerprints [out, records, kept]) or
# "master" (the param with its record, fingerprints [out, records, kept, sums]: sums the
# call's, zero), else None; flag: the call's found_inf where its verdict is left on the
# device, read when the backward ends and zeroed at the next one's first call, every kept
# call's at once (GradientRelease._first_call: one launch, not one a call)
KeptCall = collections.namedtuple("KeptCall", "call state keys values settings policy made "
                                              "compares sums flag")

# One op call of a bucket kept by GradientRelease._keep_bucket (a bucket's params of one
# param group), with what it was made from, as a KeptCall's, each of its params' (states,
# keys, values, made: tuples in the call's order); gi: its group's index; compares
# (compared_by) and sums as a KeptCall's, for all its params (records and kept an entry a
# param, sums two)
KeptBucketCall = collections.namedtuple("KeptBucketCall", "gi call states keys values made "
                                                          "settings policy compares sums")


def block_records(record, last):
    """The records (fingerprints [out, records, kept]) of a param whose blocks' record is
    `record`: its last call's out where record is that out's blocks (a view of it), else
    a copy of record after the param's own entry (which the op does not read)."""
    if record.data_ptr() == last.data_ptr() + last.element_size() and \
            record.numel() == last.numel() - 1:
        return last
    records = torch.empty_like(last)
    records[1:].copy_(record)
    return records


def compared_by(call):
    """What a plain call's op may compare its params with itself (a KeptCall's or a
    KeptBucketCall's compares), from the fingerprint output the full path made it:
    "blocks" where every param keeps remainders (the longer out), "master" where each is
    a bf16 or fp16 param with a master (an entry a param), else None."""
    out, n = call.args.get("fingerprints"), len(call.params)
    if out is None or any(p.numel() == 0 for p in call.params):
        return None
    if all("remainder" in state for state in call.states) and \
            out.numel() == n + sum(fingerprints.block_count(p.numel()) for p in call.params):
        return "blocks"
    if all("master" in state for state in call.states) and out.numel() == n and \
            all(p.dtype in (torch.bfloat16, torch.float16) for p in call.params):
        return "master"
    return None


def bucket_records(books, compares, params, last):
    """The records a bucket's call compares params with (fingerprints [out, records,
    kept(, sums)]): their last call's out where every record is its view, in order (the
    blocks' after the params' entries), else one made of the records; None where one of
    them has none (the full path makes the call anew)."""
    if compares == "master":
        records = [books.written.device_record(id(p)) for p in params]
        start = last.data_ptr()
    else:
        records = [books.blocks.get(id(p)) for p in params]
        start = last.data_ptr() + len(params) * last.element_size()
    if any(r is None for r in records):
        return None
    at = start
    for r in records:
        if r.data_ptr() != at:
            break
        at += r.numel() * r.element_size()
    else:
        if at == last.data_ptr() + last.numel() * last.element_size():
            return last
    if compares == "master":
        return torch.cat(records)
    made = torch.empty_like(last)  # (the params' entries: not read)
    made[len(params):].copy_(torch.cat(records))
    return made


def compared_resynced(entries, kept):
    """The StaleMasterWarning's words for released params whose op compared them (their
    blocks, or a param with its master) ((group index, param index, param, whether it
    keeps remainders) each), given each one's kept, read back."""
    words = [(gi, i, optim_state.resync_words(k, p.numel(), remainder))
             for (gi, i, p, remainder), k in zip(entries, kept)]
    return [f"group {gi} param {i}: {w}" for gi, i, w in words if w]
