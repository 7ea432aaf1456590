"""What a gradient release's kept op calls were made from, and the records their ops
compare their params with (precis.release: GradientRelease.keep_call, _keep_bucket,
_kept_again): a call made by the full path for a param alone or for a bucket is made
again at later backwards while everything it was made from is the same object
(checked_as, unscheduled, policy_value, made_for, to_keep), its op comparing its
params itself where it can (compared_by, bucket_records)."""

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


# An op call the full path made for released params of one group, kept by
# GradientRelease.keep_call (a param alone) or _keep_bucket (a bucket's params of the
# group), with what it was made from (GradientRelease._kept_again compares them at each
# call): gi its group's index; states, keys, values, made: each param's state dict, its
# keys, its values and made_for, in the call's order; settings, policy: the group's
# unscheduled() and policy_value(); compares: what the op compares itself before it steps
# the params (compared_by), "blocks" (their remainders' blocks, fingerprints [out,
# records, kept]) or "master" (each param with its record, fingerprints [out, records,
# kept, sums]: sums the call's, zero, two a param), else None; kept: where it compares,
# the op's output of what it resynced, an entry a param, copied out when the backward
# ends (made once, as sums); flag: a param alone's found_inf where its verdict is left
# on the device, copied back when the backward ends and zeroed at the next one's first
# call, every kept call's at once (GradientRelease._first_call: one launch, not one a
# call); a bucket's None (its verdict read at once)
KeptCall = collections.namedtuple("KeptCall", "gi call states keys values made settings "
                                              "policy compares sums kept flag")


def to_keep(gi, group, call, alone):
    """The KeptCall of call, the full path's plain call (GradientRelease._plain) for params
    of group gi, as made (alone: a param's, with its flag)."""
    compares = compared_by(call)
    device = call.device
    return KeptCall(
        gi, call, tuple(call.states), tuple(map(tuple, call.states)),
        tuple(tuple(state.values()) for state in call.states),
        tuple(made_for(p, g) for p, g in zip(call.params, call.args["grads"])),
        unscheduled(group), policy_value(group), compares,
        torch.zeros(2 * len(call.params), dtype=torch.int64, device=device)
        if compares == "master" else None,
        torch.empty(len(call.params), dtype=torch.int64, device=device) if compares else None,
        torch.zeros(1, dtype=torch.float32, device=device) if alone else None)


def compared_by(call):
    """What a plain call's op may compare its params with itself (a KeptCall's
    compares), from the fingerprint output the full path made it:
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
    """The records a kept call compares params with (fingerprints [out, records,
    kept(, sums)]): their last call's out where every record is its view, in order (the
    blocks' after the params' entries), else one made of the records; None where one of
    them has none (the full path makes the call anew)."""
    if len(params) == 1:  # (a param alone's, the common call: its record as it is, or
        p = params[0]         # the last out where the record is its view after p's entry)
        if compares == "master":
            return books.written.device_record(id(p))
        record = books.blocks.get(id(p))
        if record is None:
            return None
        if record.data_ptr() == last.data_ptr() + last.element_size() and \
                record.numel() == last.numel() - 1:
            return last
        made = torch.empty_like(last)
        made[1:].copy_(record)
        return made
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
