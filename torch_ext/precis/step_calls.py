"""The op calls of a step: a param group's params, grads and state turned into the
arguments of torch.ops.precis.adam_step_ (one call per device of the group's params)."""

import functools
import re
from typing import NamedTuple

import torch

from . import checkpoint as ckpt
from . import device_reads, fingerprints, muon_step, optim_state, stored_forms, tracing
from .dtensor import element_offset, is_dtensor, local_shard
from . import ops
from .op_constants import mix_seed


# The op's state lists and the state keys they hold (the first key present).
LISTS = {"masters": ("master", "remainder"), "exp_avgs": ("exp_avg",),
         "exp_avg_sqs": ("exp_avg_sq",), "exp_avg_scales": ("exp_avg_scale",),
         "exp_avg_sq_scales": ("exp_avg_sq_scale",), "max_exp_avg_sqs": ("max_exp_avg_sq",),
         "max_exp_avg_sq_scales": ("max_exp_avg_sq_scale",)}


def moment_of(key):
    """The moment a state key belongs to (a scale's moment; the master's own key)."""
    return key[:-len("_scale")] if key.endswith("_scale") else key


def unread_moments(books, group):
    """The moments a group's state may hold that its step does not read with the
    group's settings now (AMSGrad's max with amsgrad off, SGD's buffer at momentum 0):
    kept in the state untouched, as torch keeps them, and read again when the setting
    comes back."""
    rule = optim_state.rule_of(books, group)
    return set(rule.all_moments) - set(rule.moments(group))


def counts_on_device(group):
    """Whether the step counts reach the kernel as tensors on the params' device: for a
    capturable group, and in a step traced by torch.compile (as Python ints, dynamo
    would guard on each count and compile a new graph at every step)."""
    return capturable(group) or tracing.traced()


def capturable(group):
    """The group's capturable, but False inside the uncompiled step of offloaded CUDA
    params (tracing.uncompiled()): dynamo marks a group of CUDA params without state
    capturable when it first traces a step (torch's _set_capturable, on the group
    itself), and an offloaded optimizer is never capturable (refused when made)."""
    return group["capturable"] and not tracing.uncompiled()


def mark_written(params):
    """Bump the autograd version of params a kernel wrote in place, as torch's in-place
    ops do: a graph that saved one before the step raises at its backward, as after
    torch.optim's step, rather than using the new values. Not in a step torch.compile
    traces."""
    if params and not tracing.traced():
        torch.autograd.graph.increment_version(params)


class Call(NamedTuple):
    """One torch.ops.precis.adam_step_ call of a step: a param group's params on one
    device, the op's keyword arguments (local shards of DTensors), and the params'
    state dicts."""
    device: torch.device
    args: dict
    states: list
    params: list
    writebacks: list  # (param, contiguous copy stepped in its place)
    part: object = None  # the step_plan.Part that made the call: one add_ counts its steps
    whole: "Call" = None  # for a piece (offload): the call it was cut from
    by_rule: bool = False  # its params with a master are left unrecorded (sees_writes)

    def op(self):
        """What steps the call: adam_step_flat_ for a Plan's Part (its state is flat),
        Muon's three stages (muon_step, given the params themselves: a DTensor's whole
        matrix is orthogonalized), adam_step_ (lists) otherwise."""
        if self.args.get("rule") == "muon":
            return functools.partial(muon_step.step, matrices=self.params)
        return ops.adam_step_flat_ if self.part is not None else ops.adam_step_

    def check_op(self):
        """What runs the call's checks alone, given found_inf set (functional.check_calls):
        op() itself, but Muon's stages stop after their kernels' checks."""
        if self.args.get("rule") == "muon":
            return functools.partial(muon_step.step, matrices=self.params, checks_only=True)
        return self.op()

    # Pieces of a call, for offload's pipelined step (precis.offload.Offload.pipeline).

    def tensor_bytes(self):
        """The bytes of each param's buffers the op reads and writes."""
        lists = [[t.nbytes for t in v] for v in self.args.values()
                 if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)]
        return [sum(column) for column in zip(*lists)]

    def divisible(self):
        """Whether the call may be cut into pieces: not a plan's call (its one add_
        counts every param's step). Pieces give the bits of the whole: the random
        numbers follow each param's stream, not its place in a call."""
        return self.part is None

    def piece(self, start, stop):
        """The call of params[start:stop] (the writebacks go with the first piece): its
        lists cut, and its fingerprints tensor (a view of the whole's: the op writes each
        piece's entries in place)."""
        args = {k: v[start:stop] if isinstance(v, list) or k == "fingerprints" else v
                for k, v in self.args.items()}
        return self._replace(args=args, states=self.states[start:stop],
                             params=self.params[start:stop],
                             writebacks=self.writebacks if start == 0 else [], whole=self)


def kernel_view(t):
    """t as the kernel takes it: contiguous. A dense tensor in other strides
    (channels_last, transposed) gives its elements in memory order, which its
    state shares; complex gives real pairs."""
    if t.is_contiguous() and not t.is_complex():
        return t
    return stored_forms.dense_flat(t)


def sees_writes(books, group, device):
    """Whether the op call of a group's params on device can see writes into its params
    with a master itself (fingerprints [out, kept]: an element that is no longer its
    master's rounding is taken as master, csrc/resync.h's rule), so that they need no
    record between steps (fingerprints.Records.by_rule): on the CPU off the device path,
    an eager step of an elementwise rule (Muon's stages take no fingerprints), not
    offloaded (the op steps host copies, which a write into the params misses)."""
    return device.type == "cpu" and not device_reads.device_path(device) and \
        books.offload is None and not counts_on_device(group) and \
        optim_state.rule_of(books, group).flat


def make_call(books, gi, group, device, ieee_sqrt, entries, sees=False):
    """The adam_step_ arguments for the params of one group on one device (with
    one sqrt). entries: (param, what it is stepped as (optim_state.local_home), its
    grad as stepped, its state). sees: the op sees writes into the params with a master
    itself (sees_writes; functional.gather decides: none of them has a record)."""
    params = [p for p, _, _, _ in entries]
    states = [state for _, _, _, state in entries]
    absent = optim_state.absent(books, device)
    # Plain params (the common case) skip local_shard's per-tensor checks.
    local_of = local_shard if any(is_dtensor(p) for p in params) else (lambda p, t: t)
    locals_, grads, writebacks = [], [], []
    viewed = []  # per param: its state goes to the kernel through kernel_view
    for p, local, grad, _ in entries:
        plain = local.is_contiguous() and not local.is_complex()
        viewed.append(not plain)
        if plain and grad.is_contiguous():
            locals_.append(local)
            grads.append(grad)
            continue
        if not local.is_contiguous() and stored_forms.dense_flat(local) is None:
            # Gaps between its elements: step a contiguous copy, written back after.
            copy = local.contiguous()
            writebacks.append((local, copy))
            local = copy
        if not stored_forms.same_layout(grad, local):  # the kernel walks both in one order
            grad = stored_forms.like(local, grad)
        locals_.append(kernel_view(local))
        grads.append(kernel_view(grad))

    def listed(key, alt=None):
        entry = optim_state.op_entry  # (traced by torch.compile: views made anew)
        values = [local_of(p, entry(state, key) if not alt or key in state else entry(state, alt))
                  for p, state in zip(params, states)]
        if all(v is None for v in values):
            return []
        return [absent if v is None else kernel_view(v) if view else v
                for v, view in zip(values, viewed)]

    capturable = counts_on_device(group)
    unread = unread_moments(books, group)
    # Stochastic rounding's keys: each param's stream (0 where its layout rounds
    # nothing stochastically) and its local shard's first element in the whole param
    # (only DTensors and precis.ddp's pieces, in an optimizer it numbered, start past 0).
    streams = [books.streams.get(p, 0) for p in params]
    pieces = local_of is local_shard or bool(books.param_index)
    offsets = list(map(element_offset, params)) if pieces else []
    args = dict(params=locals_, grads=grads, streams=streams, element_offsets=offsets,
                **{name: [] if moment_of(keys[0]) in unread else listed(*keys)
                   for name, keys in LISTS.items()},
                steps=[] if capturable else [ckpt.next_step(int(s["step"])) for s in states],
                **scalar_args(books, gi, group, device), ieee_sqrt=ieee_sqrt)
    # What an eager step leaves in the params it watches (a master or remainder),
    # summed by the kernel as it writes them: the record needs no pass of its own. The
    # bytes are the params': the kernel steps them (or their contiguous copies, written
    # back) in memory order, as precis.fingerprints reads them; an offloaded CPU param's
    # host copy holds the bytes its write-back leaves in the param (a CUDA param's is
    # recorded on its GPU, off the CPU loop that paces an offloaded step). On the device
    # path the tensor is on the params' device, kept unread as their record (step_groups),
    # a released param's call's too: a call that skips fills it with the params as they
    # are, so a verdict left for later leaves the record known. Not capturable.
    row_state = optim_state.rule_of(books, group).row_state
    if row_state is not None:  # (replicated: a DTensor's local tensor is whole)
        rows = [state[row_state] for state in states]
        args["row_moments"] = [t.to_local() if is_dtensor(t) else t for t in rows]
    path = device_reads.device_path(device)
    by_rule = sees_writes(books, group, device)  # (params with a master: no record)
    if not capturable and args.get("rule") != "muon" and not ieee_sqrt and \
            any(optim_state.watched(books, p, st) and not (by_rule and "master" in st)
                for p, st in zip(params, states)):
        # params with remainders, each stepped in its own memory (what their blocks'
        # record is of: optim_state.record_blocks): an entry a param, then their blocks'
        # record (fingerprints.BLOCK), summed by the op as it writes them too
        own = books.offload is None and not writebacks and not any(viewed) and \
            all("remainder" in st for st in states) and \
            all(t.data_ptr() == local_of(p, p).data_ptr() and t.numel() == local_of(p, p).numel()
                for p, t in zip(params, locals_))
        blocks = sum(fingerprints.block_count(t.numel()) for t in locals_) if own else 0
        args["fingerprints"] = torch.empty(len(params) + blocks, dtype=torch.int64,  # the op
                                           device=device if path else "cpu")  # fills it
    if sees:  # [out, kept], kept each param's numel until the op takes elements of it
        args["fingerprints"] = [args.get("fingerprints", torch.empty(0, dtype=torch.int64)),
                                torch.tensor([t.numel() for t in locals_], dtype=torch.int64)]
    return Call(device, args, states, params, writebacks, by_rule=by_rule)


def scalar_args(books, gi, group, device):
    """The op's hyperparameter arguments for a call of group gi."""
    lr = group["lr"]
    # A float lr under torch.compile goes in as a float: dynamo guards on it and
    # recompiles when it changes. (Dynamo shows the traced step capturable=True; a
    # buffer filled from the float lost that fill in the recompiled graph, which then
    # stepped with the old lr.)
    on_device = isinstance(lr, torch.Tensor) or (capturable(group) and not tracing.traced())
    args = dict(lr=0.0 if on_device else float(lr), seed=mix_seed(group["seed"]),
                **optim_state.rule_of(books, group).op_args(group))
    if on_device:
        args["lr_tensor"] = lr_tensor(books, gi, device, lr)
    return args


def lr_tensor(books, gi, device, lr):
    """The group's lr as a float64 tensor on device, or float32 for a float32
    tensor lr (the kernel then derives the lr's constants in float32, as torch
    does), written without a sync (a copy from a tensor lr, so a replayed graph
    reads its current value)."""
    if isinstance(lr, torch.Tensor) and tracing.traced():
        # The lr itself, a graph input read at every call: inductor dropped the copy of
        # a float64 lr into the buffer below, and the graph kept the first lr.
        return lr.reshape(()).to(device)
    dtype = lr.dtype if isinstance(lr, torch.Tensor) else torch.float64
    buf = optim_state.buffer(books, ("lr", gi, dtype), device, (), dtype)
    if isinstance(lr, torch.Tensor):
        buf.copy_(lr.reshape(()))
    else:
        buf.fill_(float(lr))
    return buf


# The op's refusal of two of its list entries that share memory: "<list>[i] and <list>[j]"
_SHARED = re.compile(r"(\w+)\[(\d+)\] and (\w+)\[(\d+)\] share memory")


def named_overlap(books, param_groups, calls, error):
    """The op's refusal of two entries of its lists that share memory (its words name a
    call's lists and indices: `params[0] and params[1]`) said of the params they belong
    to, by group and index; None for any other error."""
    found = _SHARED.search(str(error))
    if found is None:
        return None
    a, i, b, j = found.group(1), int(found.group(2)), found.group(3), int(found.group(4))
    index = {id(p): (gi, k) for gi, group in enumerate(param_groups)
             for k, p in enumerate(group["params"])}
    for call in calls:
        la, lb = call.args.get(a), call.args.get(b)
        if not (isinstance(la, list) and isinstance(lb, list) and
                max(i, j) < len(call.params) and i < len(la) and j < len(lb) and
                overlap(la[i], lb[j]) and id(call.params[i]) in index and
                id(call.params[j]) in index):
            continue  # (not this call's entries)
        gi, pi = index[id(call.params[i])]
        gj, pj = index[id(call.params[j])]
        what = {"params": "param", "grads": "the gradient of param"}
        first = f"{what.get(a, f'the {a} of param')} {pi} of group {gi}"
        second = f"{what.get(b, f'the {b} of param')} {pj} of group {gj}"
        return (f"{books.name}.step(): {first} and {second} share memory (views of "
                f"one tensor?): each param, gradient and state tensor the step writes must "
                f"have memory of its own; nothing was changed ({error})")
    return None


def overlap(x, y):
    """Whether tensors x and y span common bytes (from the first element to the last)."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or \
            x.numel() == 0 or y.numel() == 0 or x.device != y.device:
        return False
    (a0, a1), (b0, b1) = _span(x), _span(y)
    return a0 < b1 and b0 < a1


def _span(t):
    """The bytes [first, end) a non-empty tensor's elements lie in."""
    start = t.data_ptr()
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()
