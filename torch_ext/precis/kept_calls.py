"""A gradient release's kept op calls (precis.release): a call made by the full path
for a param alone or for a bucket, kept (KeptCalls.keep_call, keep_bucket) and made again
at later backwards (KeptCalls.kept_again) while everything it was made from is the same
object (checked_as, unscheduled, policy_value, made_for, to_keep), its op comparing its
params itself where it can (compared_by, bucket_records); a param alone's held on the C
side (KeptCalls.held_call)."""

import collections
import contextlib
import operator
import weakref
from collections.abc import Mapping

import torch

from . import fingerprints, ops, optim_state, step_calls, tracing
from .checkpoint import next_step
from .dtensor import is_dtensor
from .policy import Policy
from .step_calls import counts_on_device

_grad_of = operator.attrgetter("grad")


# The values a group's check can be kept for (KeptCalls.checked): immutable, so
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
# KeptCalls.keep_call (a param alone) or keep_bucket (a bucket's params of the
# group), with what it was made from (KeptCalls.kept_again compares them at each
# call): gi its group's index; states, keys, values, made: each param's state dict, its
# keys, its values and made_for, in the call's order; settings, policy: the group's
# unscheduled() and policy_value(); compares: what the op compares itself before it steps
# the params (compared_by), "blocks" (their remainders' blocks, fingerprints [out,
# records, kept]) or "master" (each param with its record, fingerprints [out, records,
# kept, sums]: sums the call's, zero, two a param), else None; kept: where it compares,
# the op's output of what it resynced, an entry a param, copied out when the backward
# ends (made once, as sums); flag: a param alone's found_inf where its verdict is left
# on the device, copied back when the backward ends and zeroed at the next one's first
# call, every kept call's at once (KeptCalls.zero_flags: one launch, not one a
# call); a bucket's None (its verdict read at once)
KeptCall = collections.namedtuple("KeptCall", "gi call states keys values made settings "
                                              "policy compares sums kept flag")


def to_keep(gi, group, call, alone):
    """The KeptCall of call, the full path's plain call (KeptCalls.plain) for params
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


class KeptCalls:
    """The op calls one release keeps (a GradientRelease's `kept`): a param alone's (by
    its id) and a bucket's (by its params' ids, in order), each a KeptCall, made again at
    each step call while what it was made from stands; a param alone's held on the C side
    (ops.HeldStep); and each group's check at this backward's start (checked)."""

    _optimizer = property(lambda self: self._optimizer_ref())  # (its release's: weakly)

    def __init__(self, optimizer):
        self._optimizer_ref = weakref.ref(optimizer)
        # group index -> checked_as of the group at this backward's check (checked)
        self.checks = {}
        # id(param) -> its KeptCall (keep_call, kept_call); the kept calls holding a grad
        # now (drop_lent_grads)
        self.calls, self._lent = {}, []
        # id(param) -> (its kept call, that call held on the C side: ops.HeldStep)
        self.held = {}
        # the ids of a bucket's params, in its order -> its KeptCalls, and the calls the
        # full path makes while it steps a bucket (keep_calls, inside keeping_bucket), or
        # None
        self.buckets, self._making = {}, None
        # group index -> (the group's checked() record, its unscheduled() then): kept_again's
        self._unscheduled_at = {}

    def clear(self):
        """Every kept call let go of (their tensors, and those held on the C side)."""
        self.calls.clear()
        self.held.clear()
        self.buckets.clear()

    def checked(self, gi, group):
        """Whether param group gi passed this backward's check holding the same keys and
        the same values (by identity: a scheduler's new lr is a new float; its params the
        same list of the same length), so that its calls (functional.gather) need not
        check it again, a param at a time."""
        seen = self.checks.get(gi)
        return seen is not None and seen[0] == tuple(group) and \
            all(map(operator.is_, seen[1], group.values())) and \
            seen[2] == len(group["params"]) and group.get("policy") == seen[3]

    def keep_call(self, gi, group, call):
        """Keep the op call the full path made for a param alone (functional.gather, a
        call of this release on the device path), to be made again at the next
        backwards (kept_call), where it is a plain call: a dense param stepped in place,
        its grad as it is, no DTensor, precis.ddp piece, offload or Muon stage; its
        fingerprint output, if any, one tensor (made anew at each call: step_groups keeps
        it as the param's record; with remainders, [out, records, kept] at the next calls,
        which compare the param's blocks themselves; a bf16 or fp16 param with a master
        [out, records, kept, sums], which compare the param with its record and resync its
        master themselves)."""
        if len(call.params) != 1 or not self.plain(group, call):
            return
        p = call.params[0]
        # (at the next backwards the op compares the param itself: a param with remainders
        # and its out with its blocks, its blocks with their record; a param with a master
        # and its out, the param with its record, its master resynced where written)
        self.held.pop(id(p), None)  # (held from the call this one replaces)
        self.drop_buckets((id(p),))  # (p flushed alone now: bucket_bytes changed)
        self.calls[id(p)] = to_keep(gi, group, call, True)
        self._lent.append(call)

    def keep_calls(self, gi, group, calls, alone):
        """The op calls the full path made for params of group gi in a call of this
        release on the device path (functional.gather; alone: for one param): a bucket's
        gathered while its step makes them (keep_bucket keeps them), else a param's call
        kept (keep_call)."""
        if self._making is not None:
            self._making.append((gi, group, calls))
        elif alone and len(calls) == 1:
            self.keep_call(gi, group, calls[0])

    def plain(self, group, call):
        """Whether call, the full path's for params of group, may be kept: a plain call
        of the kernel, its params dense and stepped in place, their grads as they are, no
        DTensor, precis.ddp piece, offload or Muon stage, its fingerprint output one
        tensor or none."""
        books = self._optimizer._books
        return call.part is None and not call.writebacks and books.offload is None and \
            not books.param_index and optim_state.rule_of(books, group).flat and \
            isinstance(call.args.get("fingerprints", call.params[0]), torch.Tensor) and \
            all(t is p and g is p.grad and not is_dtensor(p) and not p.is_complex()
                for p, t, g in zip(call.params, call.args["params"], call.args["grads"]))

    def _settings_now(self, gi, group):
        """(this backward's checked_as of group gi, which checked() matched, and the
        group's unscheduled() now: made once a backward)."""
        seen = self.checks[gi]
        now = self._unscheduled_at.get(gi)
        if now is None or now[0] is not seen:
            now = self._unscheduled_at[gi] = (seen, unscheduled(group))
        return seen, now[1]

    def kept_call(self, p, capturable):
        """p's op call kept by keep_call (capturable: its group's counts_on_device) made
        again (kept_again), its step number left to the call that steps it
        (GradientRelease._step_kept); else None (the full path makes the call anew)."""
        entry = self.calls.get(id(p))
        if entry is None or entry.call.params[0] is not p:
            return None
        call = self.kept_again(entry, capturable)
        if call is not None:
            call.args["steps"] = [] if capturable else None
        return call

    def kept_again(self, entry, capturable=False):
        """entry's call (a KeptCall) with its grads, a fresh fingerprint out and the
        group's hyperparameters put in (the lr read as at every call), while nothing else
        it was made from changed: its group's check and settings but the lr (the same
        objects; a policy mapping the same value), each param's state dict and its
        tensors, its and its grad's dtype, shape, strides and memory (unchanged), and
        where its op compares the params a record of each made on its device (with
        remainders its blocks', books.blocks; with a master the param's own,
        books.written: bucket_records); else None. Its step numbers are its caller's."""
        gi, call, states, keys, values, made, settings, policy, compares, sums, kept, _ = entry
        group = self._optimizer.param_groups[gi]
        if not self.checked(gi, group):
            return None
        seen, now = self._settings_now(gi, group)
        params = call.params
        grads = list(map(_grad_of, params))
        if not all(map(operator.is_, settings, now)) or policy != seen[3]:
            return None
        state_of = self._optimizer.state
        for p, grad, state, k, v, m in zip(params, grads, states, keys, values, made):
            if state_of.get(p) is not state or tuple(state) != k or \
                    not all(map(operator.is_, v, state.values())) or \
                    getattr(p, "main_grad", None) is not None or type(grad) is not torch.Tensor \
                    or m != made_for(p, grad):
                return None
        last = call.args.get("fingerprints")
        last = last[0] if isinstance(last, list) else last  # (the last call's out)
        if compares:  # (the records its op compares the params with)
            records = bucket_records(self._optimizer._books, compares, params, last)
            if records is None:
                return None
        call.args["grads"] = grads
        if last is not None:  # a fresh out (the last is the params' record: step_groups')
            out = torch.empty_like(last)
            # (its kept: read when the backward ends, before the next call writes it)
            call.args["fingerprints"] = out if not compares else \
                [out, records, kept] if compares == "blocks" else [out, records, kept, sums]
        lr = group["lr"]
        if type(lr) is float and not capturable and "lr_tensor" not in call.args:
            call.args["lr"] = lr  # (the other settings: the same objects, as made)
        else:  # (a tensor lr's buffer goes with it: a float lr takes none)
            if len(params) == 1:  # (a param alone's: its settings anew, not the held call's)
                self.held.pop(id(params[0]), None)
            call.args.pop("lr_tensor", None)
            call.args.update(step_calls.scalar_args(self._optimizer._books, gi, group,
                                                    call.device))
        self._lent.append(call)
        return call

    def compares_itself(self):
        """The ids of the params whose kept call compares them itself (blocks or master,
        their record standing): a backward's compare leaves their resync to it
        (GradientRelease._written_behind)."""
        books = self._optimizer._books

        def stands(compares, key):
            return (compares == "blocks" and key in books.blocks) or \
                (compares == "master" and books.written.device_record(key) is not None)
        alone = {key for key, entry in self.calls.items() if stands(entry.compares, key)}
        return alone.union(*({id(p) for p in entry.call.params}
                             for entries in self.buckets.values() for entry in entries
                             if all(stands(entry.compares, id(p)) for p in entry.call.params)))

    def zero_flags(self):
        """The flags of the kept calls of params alone zeroed, at a backward's first step
        call (the last backward's were read when it ended, or at this one's start): one
        launch, not one a call."""
        if self.calls:
            torch._foreach_zero_([entry.flag for entry in self.calls.values()])

    def drop_lent_grads(self):
        """The kept calls made since hold no grad after their step (a released grad is
        freed, as the ordinary loop's full path holds none after its call)."""
        for call in self._lent:
            call.args["grads"] = []
        self._lent.clear()

    @contextlib.contextmanager
    def keeping_bucket(self, params, keep):
        """Where keep, the calls the full path makes inside (keep_calls) gathered and,
        once it returned, kept for the next flushes of the bucket params (keep_bucket)."""
        self._making = [] if keep else None
        try:
            yield
            if self._making is not None:
                self.keep_bucket(params, self._making)
        finally:
            self._making = None

    def keep_bucket(self, params, made):
        """Keep the calls the full path made for a bucket's step (made: keep_calls'
        (group index, group, calls)) for its next flushes of the same params in the same
        order (bucket_calls): each a plain call of a group that counts its steps on the
        host, together stepping every param of the bucket. A bucket kept drops those it
        shares a param with (their params flushed otherwise now) and its params' own kept
        calls (made where a bucket was stepped again a param at a time): a param is kept
        by one call."""
        kept = []
        for gi, group, calls in made:
            for call in calls:
                if not self.plain(group, call) or counts_on_device(group):
                    return
                entry = to_keep(gi, group, call, False)  # (holding no grad: a copy of args)
                kept.append(entry._replace(call=call._replace(args=dict(call.args, grads=[]))))
        ids = [id(p) for entry in kept for p in entry.call.params]
        key = tuple(map(id, params))
        if len(ids) != len(key) or set(ids) != set(key):
            return  # (a param torch's math steps, or none stepped: gradless)
        self.drop_buckets(key)
        for p in params:
            self.forget(p)
        self.buckets[key] = kept

    def drop_buckets(self, ids):
        """The kept buckets holding any of the params of ids dropped (their calls hold
        those params' states: a bucket made anew, or a param kept alone, replaces them)."""
        for key in [key for key in self.buckets if not set(key).isdisjoint(ids)]:
            del self.buckets[key]

    def bucket_calls(self, params, changed, uncompared):
        """The calls kept for a bucket of params (keep_bucket), made again (kept_again),
        on the device path (changed: this backward's compare's flags, a dict) while that
        compare left none of them to a kept call's (uncompared: the ids it left); else
        None (a call found stale drops the bucket's: the full path makes them anew)."""
        books = self._optimizer._books
        key = tuple(map(id, params))
        entries = self.buckets.get(key)
        # (a param this backward's compare left must be compared by its call here)
        if entries is None or not isinstance(changed, dict) or books.unrecorded or \
                tracing.traced() or not fingerprints.readable() or \
                any(not entry.compares and not uncompared.isdisjoint(map(id, entry.call.params))
                    for entry in entries):
            return None
        calls = []
        for entry in entries:
            calls.append(self.kept_again(entry))
            if calls[-1] is None:
                del self.buckets[key]
                return None
            calls[-1].args["steps"] = [next_step(int(state["step"])) for state in entry.states]
        return calls

    def held_call(self, p, call):
        """p's kept call held on the C side (ops.HeldStep; made at its first use), or None
        where it is not adam_step_'s, its lr is not put in alone (kept_again's plain float
        lr) or p's step count is not torch's float32 CPU tensor: what it holds is call's as
        kept_again left it, but the params (never held), grads, step count, lr,
        fingerprints and flag that each call puts in. Dropped wherever the kept call is
        (forget, keep_call)."""
        entry = self.held.get(id(p))
        if entry is not None and entry[0] is call:
            return entry[1]
        count = call.states[0].get("step")
        if call.op() is not ops.adam_step_ or type(call.args.get("lr")) is not float or \
                "lr_tensor" in call.args or type(count) is not torch.Tensor or \
                count.dtype != torch.float32 or count.device.type != "cpu" or count.numel() != 1:
            return None  # (the held call counts a float32 CPU step count: torch's)
        held = ops.HeldStep(**call.args, inv_grad_scale_tensor=None)
        self.held[id(p)] = (call, held)
        return held

    def forget(self, p):
        """p's kept call dropped, and its held call (what it holds let go of)."""
        self.calls.pop(id(p), None)
        self.held.pop(id(p), None)
