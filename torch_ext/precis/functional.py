"""One Adam/AdamW step of precis.optim: the functional core under the optimizer class.
It turns the param groups into op calls (step_calls, or their Plan), checks them all
before anything is written, runs them (eager: host step counts; capturable or compiled:
counts as device tensors, nothing read back), and hands params torch's math steps to
torch_math. It takes what it works on as arguments, as torch's functional adam():
the param groups, the state dict (param -> its state) and the optimizer's books
(optim_state.Books), so it runs and is tested without an optimizer object."""

import functools
import math

import torch
from torch.optim.optimizer import _device_dtype_check_for_fused

from . import step_calls, step_plan, device_reads, fingerprints, ops, optim_state
from . import graph_records, torch_math, tracing, user_warnings
from .step_calls import counts_on_device
from .dtensor import agree_on_nonfinite, agreeing_groups, local_shard
from .group_checks import FLOAT32_MAX, STEPPED_DTYPES, check_distinct, check_param
from .op_constants import PARAM_DTYPES
from .optim_state import StaleMasterWarning, policy_key
from .state_layout import COMPLEX_DTYPES, FP32_LAYOUT

# A kernel step's gradients: a param dtype's, or complex64 for a complex64 param.
GRAD_DTYPES = PARAM_DTYPES + COMPLEX_DTYPES


def run(param_groups, state, books, grad_scale, found_inf, only=None, changed=None,
        verdict_later=False):
    """One step of every param group (the body of Adam/AdamW.step(), after the
    closure): op calls built per group, checked all before any writes, run; state made
    by a failed step is taken back. state: param -> its state dict (made at a param's
    first step); books: an optim_state.Books. A Plan's call the op refuses (nothing
    written) sends the step down the full path. only: None (every param with a
    gradient), or {group index: [param indices]}: those alone are stepped, on the full
    path (a Plan covers a whole group), each with the bits a whole step gives it
    (gradient release, precis.release). changed: None, or the ids of the params written
    behind the optimizer's back, compared already (a release compares every param once a
    backward, not once a call: optim_state.written_behind), or on the device path
    compare_on_device's flags. verdict_later: an eager step
    of one op call that checks its gradients (a grad_scale) leaves its Inf/NaN verdict
    unread in books.last["found_inf"] (a tensor on the call's device), the step
    counted and books.last["step_skipped"] None: the caller reads the verdict later,
    and takes a skipped param's count back (a release on a GPU, whose hooks would
    each wait for the device); any other step reads it at once, as without."""
    if books.offload is not None and books.offload.traced_with_cuda_params(param_groups):
        return run_uncompiled(param_groups, state, books, grad_scale, found_inf, only,
                              changed, verdict_later)
    resynced = []  # params whose master / remainder was rebuilt (a refused try's too)
    if tracing.traced():
        books.unrecorded = True  # (torch.compile replays this at every compiled call)
    elif books.unrecorded:  # (in a CUDA graph's capture too: it records anew, rewrite)
        forget_records(books)
    # the earlier steps' device compares whose copies are done (never waited for: a
    # host that runs ahead must not stop here); not in a release's calls, which read
    # nothing before the backward ends (its opt.step() looks: settle_and_warn)
    if only is None:
        settle_stale(books, resynced, wait=False)
    try:
        # (a steady step: one op call made once, while its Plan holds; else the full path)
        if not (only is None and changed is None and grad_scale is None and
                found_inf is None and fingerprints.readable() and
                step_plan.steady_step(books, state, param_groups)):
            step_groups(param_groups, state, books, grad_scale, found_inf, resynced, only,
                        changed, verdict_later)
        refused = False
    except step_plan.Refused:
        refused = True
    if refused:  # out of the handler: an error of the full path is not chained to it
        for gi in list(books.plans):
            step_plan.drop_plan(books, gi)
        step_groups(param_groups, state, books, grad_scale, found_inf, resynced, only,
                    changed, verdict_later)
    if only is None:
        settle_stale(books, resynced, wait=False)  # a device's compare, once read back
    warn_stale(books, resynced)


# A step with host copies of CUDA params, under torch.compile: dynamo calls it eagerly.
# (Its groups may say capturable: dynamo marks them; step_calls.capturable.)
run_uncompiled = tracing.disabled(
    run, reason="precis: a step of offloaded CUDA params runs uncompiled: their copies "
                "between the devices run on side streams that a compiled graph cannot wait for")


def forget_records(books):
    """Drop what the optimizer recorded of its params: compiled steps wrote them since
    without recording (a compiled step compares and records nothing), so a compare
    would take their writes for a load. The next eager step records anew; a load made
    between compiled steps is not seen (reload_model_params() declares it)."""
    for gi in list(books.plans):
        step_plan.drop_plan(books, gi)
    books.written = fingerprints.Records()
    books.blocks = {}
    books.unrecorded = False


def warn_stale(books, resynced):
    """The StaleMasterWarning naming resynced (the params resynced): once, but each time
    a write into remainders is found (a write costs them the low bits of every block it
    touched, where a master loses only the elements written)."""
    if resynced and (not books.last["warned_stale"] or
                     any(optim_state.REMAINDER_WORDS in name for name in resynced)):
        books.last["warned_stale"] = True
        user_warnings.warn(
            f"{books.name}: params were modified outside the optimizer between its "
            f"steps ({'; '.join(resynced[:5])}{'; ...' if len(resynced) > 5 else ''}), "
            f"e.g. by loading model weights or applying a mask; the master weights of "
            f"the elements written / the remainders of the blocks written were resynced "
            f"from the params. Call optimizer.reload_model_params() after "
            f"loading weights to do this explicitly (warned once; a write into remainders "
            f"each time one is found).",
            StaleMasterWarning)


def settle_stale(books, resynced, wait=True):
    """The names of the params a device's compare resynced (a planned call's resync,
    step_plan.watch_resynced, or gather's resync_on_device: their flags copied back
    without waiting) appended to resynced,
    each once its copy is done (looked at by every step, never waited for: usually the
    next step's), or all at once with wait (state_dict() and the like: with the rows of
    kept the Plans' op calls wrote since their last copy, step_plan.KeptRows)."""
    last = books.last
    if not (wait or last.get("stale_later") or last.get("kept_uncopied")) or \
            not fingerprints.readable():
        return  # (nothing copied, no event queried in a capture)
    step_plan.copy_uncopied(books)
    if wait:
        for plan in step_plan.distinct(books.plans):
            step_plan.copy_kept(books, plan)
    pending = books.last.get("stale_later")
    if not pending:
        return
    ready = [wait or later.ready() for _, later in pending]  # (each copy on its own)
    books.last["stale_later"] = [entry for entry, r in zip(pending, ready) if not r]
    resynced += [name for (described, later), r in zip(pending, ready) if r
                 for name in described(later.values("stale warning"))]


def settle_and_warn(books, wait=True):
    """settle_stale and its warning: at once (state_dict() and the like: no step comes
    first), or without waiting (wait False: a released backward's opt.step())."""
    resynced = []
    settle_stale(books, resynced, wait)
    warn_stale(books, resynced)


def step_groups(param_groups, state, books, grad_scale, found_inf, resynced, only=None,
                changed=None, verdict_later=False):
    """run()'s step: each group's calls (a Plan's, or the full path's), run; params
    whose master or remainder a gather resyncs are appended to `resynced`; only,
    changed and verdict_later as run()'s."""
    capturable = counts_on_device(param_groups[0])
    books.last["step_skipped"] = None if capturable else False
    books.last["found_inf"] = None
    # A flag read here skips every param, those torch's math steps too: any host
    # flag, and a device one only when eager (a capturable step reads nothing back).
    # A clear device flag goes on: the kernels set it if they find Inf/NaN.
    # On the device path an eager step's kernels take a device flag instead, read with
    # their verdict (step_eager's `given`).
    on_host = not isinstance(found_inf, torch.Tensor)
    given = None
    if found_inf is not None and (on_host or not capturable):
        if not on_host and books.offload is None and device_reads.device_path(found_inf.device):
            given = found_inf
        elif float(found_inf) != 0.0 if on_host else \
                device_reads.flag(found_inf, "found_inf given"):
            books.last["step_skipped"] = True
            return
        elif on_host:
            found_inf = None

    if books.offload is not None:
        books.offload.prepare(param_groups, state)
        books.offload.verify_grads()
    fresh, torch_params = [], []
    streams = optim_state.NewStreams(books)
    ran = []  # (the calls whose op ran: their outputs hold what they left)
    calls = []  # (the step's op calls, once made: an overlap refused names their params)
    watched = False  # (whether watch_resynced took what ran's ops kept)
    try:
        group_calls, first_index = [], 0  # first_index: of the group's param 0
        for gi, group in enumerate(param_groups):
            torch_params.append([])
            picked = None if only is None else only.get(gi, [])
            group_calls.append([] if picked == [] else
                               gather(books, state, param_groups, gi, first_index, resynced,
                                      fresh, torch_params[-1], streams, picked, changed))
            first_index += len(group["params"])
        calls = [call for gcalls in group_calls for call in gcalls]
        by_torch = prepare_torch_math(books, state, param_groups, torch_params, fresh,
                                      grad_scale, found_inf if capturable else None)
        if books.offload is not None:  # device calls first, host calls in pieces
            calls = books.offload.pipeline(calls)
        if calls:
            if capturable:
                step_capturable(books, calls, grad_scale, found_inf)
            else:
                step_eager(books, calls, grad_scale, found_inf, verdict_later, given, ran)
                step_plan.watch_resynced(books, ran)
                watched = True
            for call in calls:
                for param, copy in call.writebacks:
                    param.copy_(copy)
            if not books.last["step_skipped"]:  # (None: capturable, taken on the device)
                step_calls.mark_written([p for call in calls for p in call.params])
        elif given is not None and device_reads.flag(given, "found_inf given"):
            books.last["step_skipped"] = True  # (params torch's math steps alone)
        if not books.last["step_skipped"]:
            for prepared in by_torch:
                prepared.step()
    except BaseException as error:
        # A failed first step leaves no state behind: it would be built from the
        # params as they are now, and not resynced after a later weights load.
        # Buffers added to existing state go too: the step changed nothing.
        for p, keys in fresh:
            if keys is None:
                state.pop(p, None)
            else:
                for key in keys:
                    state[p].pop(key, None)
        # A Plan's call whose op ran before the error (a later call refused): its
        # records are what it wrote, as after a step (else the next compare would take
        # the step's own writes for writes behind it)
        for call in ran:
            if call.part is not None:
                call.part.restamp()
                if call.part.blocks is not None:
                    call.part.blocks.took(call.args["fingerprints"], call.part.compared)
        if not watched:  # (and what their ops' resyncs kept, once)
            step_plan.watch_resynced(books, ran)
        named = step_calls.named_overlap(books, param_groups, calls, error) \
            if isinstance(error, RuntimeError) else None
        if named is None:
            raise
        raise RuntimeError(named) from None
    # What the step left in params that keep a copy (master, host copy): the kernel's
    # sums where it kept them and wrote (step_skipped False; on the device path also a
    # verdict left for later, None: a skipped call's sums are the params as found), else
    # read now (a skipped first step records its new state's too).
    if fingerprints.readable():
        skipped = books.last["step_skipped"]
        watched = []  # read now
        for call in calls:
            if call.part is not None:
                if not skipped:  # a plan's records stand while its params stay unwritten
                    call.part.restamp()
                continue
            kept = [(p, i) for i, (p, st) in enumerate(zip(call.params, call.states))
                    if optim_state.watched(books, p, st)]
            out = op_outputs(call)[0]
            seen = isinstance(out, list)  # [out, kept]: the op saw writes itself
            if seen:
                out = out[0] if out[0].numel() else None
                if skipped is False:
                    took_written(books, param_groups, call, resynced)
            if call.by_rule and (skipped is False or seen):  # (a skipped step's records
                books.written.compare_by_rule(  # stand: the masters they guard too)
                    id(p) for p, i in kept if "master" in call.states[i])
                kept = [(p, i) for p, i in kept if "master" not in call.states[i]]
            if out is not None and skipped is not True and \
                    device_reads.device_path(out.device) and kept:
                # kept unread (a fresh tensor each step: no later step writes it); a verdict
                # left for later (skipped None) too: a call that skips fills it as found
                books.written.record_values(
                    [id(p) for p, _ in kept], out if len(kept) == len(call.params) else
                    torch.stack([out[i] for _, i in kept]))  # (views: no index copied over)
            elif out is not None and skipped is False:
                values = fingerprints.unsigned(out)  # as it wrote
                books.written.update((id(p), values[i]) for p, i in kept)
            else:
                watched += [p for p, _ in kept]
        optim_state.record_written(books, watched)
        # and, block by block, those with remainders (every call's, as the step left them;
        # a Plan's Part by the blocks it made once); a skipped step's records stand, but on
        # the device path, where its compare resynced written blocks without recording
        # them: there as found (kept, the next step would resync and warn of them again)
        every = [call for gcalls in group_calls for call in gcalls]
        stand = {call.device: skipped and not device_reads.device_path(call.device)
                 for call in every}
        # from the op's output where it ran (a step skipped before its op, or a refused
        # call, wrote none: a pass over them, as found)
        ran = set(map(id, ran))
        recorded = set()  # (calls whose op recorded their params' blocks)
        for call in every:
            if stand[call.device]:
                continue
            if call.part is not None and call.part.blocks is not None:
                call.part.blocks.took(call.args["fingerprints"] if id(call) in ran else None,
                                      call.part.compared)
            elif call.part is None and id(call) in ran and op_outputs(call)[1] is not None:
                recorded.add(id(call))  # (a tensor a call: no later call writes it)
                books.blocks.update(zip(map(id, call.params), op_outputs(call)[1].split(
                    [fingerprints.block_count(p.numel()) for p in call.args["params"]])))
        optim_state.record_blocks(books, [
            (p, st) for call in every
            if (call.part is None or call.part.blocks is None) and id(call) not in recorded
            for p, st in zip(call.params, call.states)
            if not (stand[call.device] and id(p) in books.blocks)])
    elif graph_records.capturing():  # the records the captured compare reads, rewritten
        graph_records.rewrite(books, calls)
    if books.last["step_skipped"] is False and (books.fingerprints or books.joins):
        optim_state.forget_loaded(books, [p for call in calls for p in call.params])
    if only is None and not tracing.traced():
        step_plan.make_plans(books, state, param_groups,
                             {gi: gcalls for gi, gcalls in enumerate(group_calls)
                              if gi not in books.plans})


def op_outputs(call):
    """A call's fingerprints output as (its params' record, the blocks' record the op
    made after their entries, or None): [out, kept] as given; make_call gives params
    with remainders the longer out."""
    out = call.args.get("fingerprints")
    if isinstance(out, torch.Tensor) and out.numel() > len(call.params):
        return out[:len(call.params)], out[len(call.params):]
    return out, None


def took_written(books, param_groups, call, resynced):
    """The names of the params whose written elements a call's op took as masters (its
    fingerprints [out, kept]: kept, each param's elements that still rounded) appended to
    resynced, in resync's words, until the warning was given."""
    if books.last["warned_stale"]:
        return
    kept = device_reads.read(call.args["fingerprints"][1], "kept")  # (a CPU tensor: no wait)
    for p, t, k in zip(call.params, call.args["params"], kept):
        if k != t.numel():
            gi, i = next((gi, i) for gi, group in enumerate(param_groups)
                         for i, q in enumerate(group["params"]) if q is p)
            resynced.append(f"group {gi} param {i}: {optim_state.described(k, t.numel())}")


def gather(books, states, param_groups, gi, first_index, resynced, fresh, torch_params,
           streams, picked=None, changed=None):
    """The op calls of one param group: [Call], one per device of its params (two
    on the CPU when host copies of CUDA params share it with CPU params), or of its
    params at the indices `picked` (not None: no Plan). Params
    torch's math steps (torch_math) are appended to torch_params instead.
    (param, None) is appended to `fresh` for a param whose state is made here,
    (param, keys) for one that gets new buffers (e.g. amsgrad's max turned on);
    streams (optim_state.NewStreams) gives new states their streams; first_index is
    the optimizer's index of the group's first param (as state_dict() numbers it);
    changed as run()'s."""
    # Hyperparameters may have changed since construction (schedulers, users): a
    # bad one in any group must fail before the first group is written.
    group = param_groups[gi]
    plan = None if picked is not None else books.plans.get(gi)
    if plan is not None and gi != plan.groups[0]:
        return []  # stepped, its hyperparameters checked, by its plan's first group's calls
    rule = optim_state.rule_of(books, group)
    # (a release's calls check a group once a backward while it holds the same values)
    checked = picked is not None and books.release is not None and \
        books.release.kept.checked(gi, group)
    if not checked:
        rule.check(group, f"{books.name} param group {gi}")
    calls = None if picked is not None else step_plan.planned_calls(books, states, param_groups, gi)
    if calls is not None:
        return calls
    step_plan.drop_plan(books, gi)
    params = group["params"]
    if not checked and not tracing.traced() and len(set(map(id, params))) != len(params):
        check_distinct(params, f"{books.name} param group {gi}")  # (names the twice listed)
    picked = range(len(params)) if picked is None else picked
    capturable = counts_on_device(group)
    # Params written since the optimizer last left them (a load by any of torch's paths,
    # a write through p.data): compared by content, as those move no version counter.
    # A step compiled or captured in a CUDA graph compares nothing (it cannot read the
    # fingerprints back): reload_model_params() declares a load there.
    written = None  # the device path's compare: {id(p): a flag, set when p was written}
    if not fingerprints.readable():
        # a CUDA graph's capture compares on the device, as its replays do (graph_records)
        if changed is None and graph_records.capturing():
            written = compare_on_device(books, [params[i] for i in picked])
            books.unrecorded |= written is None  # (then no load between replays is seen)
        changed = set()
    elif isinstance(changed, dict):  # a release's compare_on_device, once a backward
        written, changed = changed, set()
    elif changed is None:
        written = compare_on_device(books, [params[i] for i in picked])
        changed = set() if written is not None else \
            set(map(id, optim_state.written_behind(books, [params[i] for i in picked])))
    # a release's calls on the device path: kept, to be made again while nothing they
    # were made from changes (KeptCalls.keep_calls: a param's, a bucket's)
    keep = checked and written is not None and fingerprints.readable()
    pkey = policy_key(group["policy"])
    to_resync = []  # (i, p, state) of the params the device path's compare looked at
    sees = {}  # (device, ieee_sqrt) -> whether the call's op sees writes itself
    ruled = {}  # (device, ieee_sqrt) -> [(i, p, state, in changed)] left to the op
    by_call = {}  # (device, ieee_sqrt) -> [(param, grad, state)]
    for i in picked:
        p = params[i]
        # step_plan.grads_of's rule, a param at a time: dynamo traces this form, not
        # its map() over builtins (a traced step would break its graph there)
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor) or p.dtype not in STEPPED_DTYPES:
            check_param(p, optim_state.where(books, gi, i, p))  # (one appended by hand)
            raise TypeError(f"{optim_state.where(books, gi, i, p)}: its main_grad must be a "
                            f"tensor (or None: .grad), got {type(grad).__name__}")
        layout = optim_state.layout_for(books, group, p, pkey)
        fp32_state = layout == FP32_LAYOUT
        if torch_math.uses_torch_math(rule.name, group, p, fp32_state, states.get(p)):
            why = torch_math.refusal(books.name, rule.name, p, fp32_state, group)
            if why is not None:
                raise ValueError(f"{optim_state.where(books, gi, i, p)}: {why}")
            torch_math.check_grad(rule.name, p, optim_state.where(books, gi, i, p))
            torch_math.check_state(rule.name, group, p, states.get(p),
                                   optim_state.where(books, gi, i, p))
            torch_params.append(p)
            continue
        if books.unchecked and id(p) in books.unchecked:  # (frozen when added: its check)
            check_param(local_shard(p, p), optim_state.where(books, gi, i, p))
            books.unchecked.discard(id(p))
        rule.check_stepped(p, optim_state.where(books, gi, i, p))
        if grad.is_sparse:
            raise RuntimeError(f"{optim_state.where(books, gi, i, p)}: sparse gradients are not "
                               f"supported")
        if grad.shape != p.shape or grad.device != p.device:
            raise ValueError(f"{optim_state.where(books, gi, i, p)}: its gradient has "
                             f"shape {tuple(grad.shape)} on {grad.device}, the param "
                             f"{tuple(p.shape)} on {p.device}")
        if grad.dtype not in GRAD_DTYPES or \
                grad.is_complex() != p.is_complex():  # before any group's kernel writes
            raise ValueError(f"{optim_state.where(books, gi, i, p)}: its gradient has dtype "
                             f"{grad.dtype}; supported: float32, float16, bfloat16 (complex64 "
                             f"for a complex64 param)")
        offloaded = books.offload is not None and books.offload.selected(p)
        home = optim_state.local_home(books, p)  # (of its local shard, for a DTensor)
        if offloaded:  # the host copy of the grad
            grad = books.offload.host_grad(p, grad)
        else:
            grad = local_shard(p, grad)
        if group["fused"]:  # torch's refusal (e.g. meta params), before a state is made
            known = states.get(p)
            if known is None or len(known) == 0:
                _device_dtype_check_for_fused(p)
        state = optim_state.state_of(states, p)
        # not bool(): torch 2.11 cannot trace it. ensure_state only adds keys, and a
        # dict keeps their order: the new ones are those past the old count.
        had_state, count = len(state) > 0, len(state)
        try:
            optim_state.ensure_state(books, p, home, state, layout, gi, i, capturable,
                                     rule, rule.moments(group), streams,
                                     optim_state.stream_index(books, p, first_index + i))
        finally:  # keys it added before refusing the state go too (run() takes them back)
            if not had_state or len(state) != count:
                fresh.append((p, None if not had_state else set(list(state)[count:])))
        # The host copy of a CUDA param takes IEEE sqrt, the CUDA kernel's bits, so
        # an offloaded run follows the on-device one.
        ieee_sqrt = offloaded and p.device.type == "cuda"
        key = (home.device, ieee_sqrt)
        by_call.setdefault(key, []).append((p, home, grad, state))
        if key not in sees:
            sees[key] = step_calls.sees_writes(books, group, home.device)
        # A param with a master compared by rounding (Records.by_rule) is left to its
        # call's op, which sees writes into it itself; one with a record (an optimizer-only
        # load's: the loaded master stands until the param is written) is compared here,
        # and then its call does not see (it would take the unwritten param as master)
        left = sees[key] and had_state and "master" in state
        if left and id(p) in books.written.by_rule:
            ruled.setdefault(key, []).append((i, p, state, id(p) in changed))
            changed.discard(id(p))
            continue
        sees[key] = sees[key] and not left
        if had_state and id(p) in changed:
            changed.discard(id(p))  # its record is fresh after this (a release's later calls)
            if offloaded:  # the host copy first (exact: nothing to warn of), then the
                books.offload.reload(p)  # master is checked against it
            seen = optim_state.resync(books, p, state, auto=True)
            if seen:
                resynced.append(f"group {gi} param {i}: {seen}")
        elif had_state and written and id(p) in written:
            to_resync.append((i, p, state))
    for key, entries in ruled.items():  # a call that does not see: compared here, by rounding
        for i, p, state, was_changed in entries if not sees[key] else ():
            seen = optim_state.resync(books, p, state, auto=True) if was_changed else ""
            if seen:
                resynced.append(f"group {gi} param {i}: {seen}")
    if to_resync:
        resync_written(books, gi, to_resync, written)
    calls = [step_calls.make_call(books, gi, group, device, ieee_sqrt, entries,
                                  sees=sees[device, ieee_sqrt] and (device, ieee_sqrt) in ruled)
             for (device, ieee_sqrt), entries in by_call.items()]
    if keep:
        books.release.kept.keep_calls(gi, group, calls, alone=len(picked) == 1)
    return calls


def resync_written(books, gi, to_resync, written):
    """resync_on_device of group gi's written params (gather's, and a release's kept call
    made again), their names queued for when its kept is read back (settle_stale): once,
    remainders' every time (warn_stale); nothing queued in a capture (no event to query)."""
    looked, kept = resync_on_device(books, to_resync, written)
    if looked and fingerprints.readable() and \
            (not books.last["warned_stale"] or any(r for _, _, r in looked)):
        books.last.setdefault("stale_later", []).append(
            (functools.partial(described, gi, looked), device_reads.Later(kept)))


def compare_on_device(books, params, now=None):
    """The device path's compare of params (those with a record made on a device): {id(p):
    a 0-dim bool tensor, set when p was written since the optimizer last left it}, with
    nothing read back; now (a list, or None): set to [their ids, their fingerprints now
    (an int64 tensor on the device)]. None where the step compares on the host instead:
    off the device path or the compare not on the device (device_reads.compares_on_device),
    offloaded (the host copies are reread on the host), a loaded remainder's fingerprint to
    check (books.fingerprints) or to join anew (books.joins), a record known on the host
    only."""
    if not params or books.offload is not None or \
            not device_reads.compares_on_device(params[0].device) or \
            (books.fingerprints and any(p in books.fingerprints for p in params)) or \
            (books.joins and any(p in books.joins for p in params)):
        return None
    by_id = {id(p): p for p in params}
    found = books.written.on_device(list(by_id))
    if found is None:
        return None
    ids, records = found
    if not ids:
        return {}
    _, on_devices = fingerprints.split([local_shard(by_id[key], by_id[key]) for key in ids])
    if len(on_devices) != 1 or on_devices[0][1].device != records.device:
        return None
    if now is not None:
        now[:] = [ids, on_devices[0][1]]
    return dict(zip(ids, (on_devices[0][1] != records).unbind()))


def resync_on_device(books, entries, written):
    """optim_state.resync of the params of entries ((i, p, its state) each), decided on
    the device (written: id(p) -> its compare's flag) by precis.resync_masters_: one call
    for all whose masters are laid out as their params and of one kind, one for all whose
    remainders have a record of their blocks (optim_state.resync_blocks: by those, the
    blocks recorded as found), each other param alone (optim_state.resync_flagged);
    nothing is touched for an unwritten p. Returns ([(i, p, whether p keeps a
    remainder)], the op's kept for each, an int64 tensor not read back) for `described`."""
    batches, looked, kepts, by_blocks = {}, [], [], {}
    for i, p, state in entries:
        key = "master" if "master" in state else "remainder" if "remainder" in state else None
        if key is None:  # (a state emptied by hand: nothing to resync)
            continue
        local, master = local_shard(p, p).detach(), local_shard(p, state[key])
        pair, entry = optim_state.flat_pair(master, local), (i, p, key == "remainder")
        if key == "remainder" and pair is not None:
            by_blocks[id(p)] = (entry, master, local)
        elif pair is None:
            looked.append(entry)
            kepts.append(optim_state.resync_flagged(master, local, written[id(p)].reshape(1)))
        else:
            batch = batches.setdefault((master.dtype, local.dtype, local.device), [])
            batch.append((entry, *pair, written[id(p)]))
    done, kept = optim_state.resync_blocks(
        books, [(entry[1], master, local) for entry, master, local in by_blocks.values()])
    looked += [by_blocks.pop(id(p))[0] for p, _, _ in done]
    if kept is not None:
        kepts.append(kept)
    for entry, master, local in by_blocks.values():  # no record of its blocks: whole
        looked.append(entry)
        kepts.append(optim_state.resync_flagged(master, local, written[id(entry[1])].reshape(1)))
    for batch in batches.values():
        looked += [entry for entry, _, _, _ in batch]
        kepts.append(ops.resync_masters_([m for _, m, _, _ in batch], [q for _, _, q, _ in batch],
                                         torch.stack([w for _, _, _, w in batch])))
    return looked, (torch.cat(kepts) if len(kepts) > 1 else kepts[0]) if kepts else None


def described(gi, looked, kept):
    """The StaleMasterWarning's words for the params resync_on_device looked at ((i, p,
    whether p keeps a remainder) each), given its kept, read back."""
    words = [(i, optim_state.resync_words(k, local_shard(p, p).numel(), remainder))
             for (i, p, remainder), k in zip(looked, kept)]
    return [f"group {gi} param {i}: {w}" for i, w in words if w]


def prepare_torch_math(books, state, param_groups, torch_params, fresh, grad_scale,
                       device_found_inf):
    """torch_math's step for each group's params that torch's math steps (their
    state made where the rule's torch counterpart keeps one, new ones recorded in
    fresh)."""
    if not any(torch_params):
        return []
    if grad_scale is not None or isinstance(device_found_inf, torch.Tensor):
        raise ValueError(f"{books.name}.step(): grad_scale= and a device "
                         f"found_inf= are not supported with params stepped by torch's "
                         f"own math (float64 / complex128 params, differentiable=True; "
                         f"precis.torch_math): let torch.amp.GradScaler unscale the "
                         f"gradients and skip the step")
    def rule(group):
        return optim_state.rule_of(books, group).name
    for group, params in zip(param_groups, torch_params):
        if params and torch_math.keeps_state(rule(group), group):
            fresh.extend((p, None) for p in params if not state.get(p))
            for p in params:  # torch's _init_group reads state[p]: a plain dict too
                optim_state.state_of(state, p)
    grad_enabled = books.defaults.get("differentiable", False) is True  # (a checked bool)
    return [torch_math.prepared(rule(group), state, group, params, grad_enabled)
            for group, params in zip(param_groups, torch_params) if params]


def inv_grad_scale_of(books, grad_scale):
    """1 / grad_scale on the host (None when there is no grad_scale)."""
    if grad_scale is None:
        return None
    scale = device_reads.number(grad_scale, "grad_scale")
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"{books.name}.step(): grad_scale must be finite "
                         f"and > 0, got {scale}")
    if not 1.0 / scale <= FLOAT32_MAX:  # (the kernels unscale by it, in float32)
        raise ValueError(f"{books.name}.step(): grad_scale {scale:g} is too small: the "
                         f"gradients are unscaled by 1 / grad_scale = {1.0 / scale:g}, "
                         f"which overflows float32")
    return 1.0 / scale


def check_calls(books, calls, first, **kwargs):
    """Every op call checks all its arguments before it writes, but with several
    calls a later one could refuse after an earlier one wrote. So every call but
    the first (which checks before anything is written; `first`: it too, when the
    ranks agree on something before it runs) first runs once with its found_inf flag
    set: the checks run, the kernels write nothing (a planned call's compare, which
    writes whatever the flag holds, left out). Pieces (offload) are checked as
    the call they were cut from, once, so buffers shared across pieces are refused
    too."""
    checked = set()
    for i, call in enumerate(calls):
        whole = call.whole or call
        if (i == 0 and whole is call and not first) or id(whole) in checked:
            continue
        checked.add(id(whole))
        flag = optim_state.buffer(books, "checks_only", whole.device, (1,),
                                  torch.float32).fill_(1.0)
        # (not a planned call's compare: its resync writes whatever the flag holds; a
        # Part that sees writes itself keeps its kept, which a skipped call leaves as is;
        # nor a kept call's, fingerprints [out, records, kept(, sums)]: its out alone)
        sees = whole.part is not None and whole.part.sees
        args = {k: v for k, v in whole.args.items() if k != "resync" or sees}
        out = args.get("fingerprints")
        if isinstance(out, list) and len(out) > 2:
            args["fingerprints"] = out[0]
        whole.check_op()(**args, **kwargs, check_finite=False, found_inf=flag)


def step_eager(books, calls, grad_scale, found_inf, verdict_later=False, given=None, ran=None):
    """Host steps and lr; the NaN/Inf verdict of check_finite is read back (or, with
    verdict_later and one call that checks its own gradients, left on its device in
    books.last["found_inf"], the steps counted: run()'s verdict_later).
    On the device path (one device, not offloaded) a grad_scale
    tensor goes to the kernels as one (an invalid one sets the flag; refused once the
    verdict is read) and a device found_inf given (`given`, not read yet) seeds the
    flag, so that the step reads only its verdict. ran: None, or a list the calls whose
    op ran are appended to (a step skipped before them runs none).
    Offloaded: each call waits for its host grads (Offload.ready) and its host
    copies are written back as soon as it is done. In a step with a Plan's calls, a
    refusal before anything is written and before the ranks agreed on anything
    raises step_plan.Refused (the op checks the grads, not the plan)."""
    offload = books.offload
    device = calls[0].device
    on_device = offload is None and not verdict_later and device_reads.device_path(device) \
        and all(call.device == device for call in calls)
    if given is not None and not (on_device and given.device == device and
                                  given.numel() == 1):
        if device_reads.flag(given, "found_inf given"):
            return skipped(books, found_inf)
        given = None
    inv_tensor = inv_scale_on(books, grad_scale, device) if on_device else None
    inv_grad_scale = None if inv_tensor is not None else inv_grad_scale_of(books, grad_scale)
    check_finite = grad_scale is not None
    groups = agreeing_groups(calls)
    fused = len(calls) == 1 and not groups  # the kernel checks and skips by itself
    later = verdict_later and fused and check_finite and offload is None and \
        len(calls[0].params) == 1  # (its caller takes one param's count back)
    flags = {}  # device -> found_inf flag of its calls
    # A Plan's call counts its steps in its op, unless a flag decides once it is read
    # whether the step was taken: then through its table, and the caller adds them. With
    # several calls every table holds this update's step numbers first, so that
    # check_calls' dry runs refuse a bad count before the first call writes.
    flagged = check_finite or given is not None
    counted = {id(call) for call in calls if call.part is not None and not flagged and
               call.op() is ops.adam_step_flat_ and call.part.op_counts()}
    for call in calls:
        if call.part is not None and (len(calls) > 1 or id(call) not in counted):
            call.part.count_by_table()
    written = agreed = False
    try:
        check_calls(books, calls, check_finite and bool(groups),
                    inv_grad_scale=inv_grad_scale or 1.0, inv_grad_scale_tensor=inv_tensor)
        if check_finite or given is not None:
            for call in calls:
                if call.device not in flags:  # (one read later: not the cached buffer)
                    flags[call.device] = torch.zeros(1, dtype=torch.float32,
                                                     device=call.device) if later else \
                        optim_state.buffer(books, "found_inf", call.device, (1,),
                                           torch.float32).zero_()
            if given is not None:
                flags[device].copy_(given.reshape(1))
            if inv_tensor is not None:  # an invalid scale: nothing is written
                scale = grad_scale.reshape(1)
                flags[device].masked_fill_(~(torch.isfinite(scale) & (scale > 0)), 1.0)
        if check_finite:
            # Skipping must cover every group, device and rank: check all grads first.
            if not fused:
                for call in calls:
                    if offload is not None:
                        offload.ready(call.params)
                    ops.check_finite_(call.args["grads"], flags[call.device])
                agreed = bool(groups)  # (every call was checked before: see check_calls)
                for flag in flags.values():
                    agree_on_nonfinite(flag, groups)
                if any(device_reads.flag(flag, "verdict") for flag in flags.values()):
                    return verdict_set(books, grad_scale, found_inf, inv_tensor)
        for call in calls:
            if offload is not None:
                offload.ready(call.params)
            counts = dict(step_counts=call.part.step_buffer) if id(call) in counted else {}
            call.op()(**call.args, inv_grad_scale=inv_grad_scale or 1.0,
                      inv_grad_scale_tensor=inv_tensor, check_finite=check_finite and fused,
                      found_inf=flags.get(call.device), **counts)
            written = True
            if ran is not None:
                ran.append(call)
            if check_finite and fused and not later and \
                    device_reads.flag(flags[call.device], "verdict"):
                # the only call: nothing was written
                return verdict_set(books, grad_scale, found_inf, inv_tensor)
            if offload is not None:
                offload.write_back(call.params)
        if given is not None and not check_finite and \
                device_reads.flag(flags[device], "verdict"):  # every call saw it: none wrote
            return skipped(books, found_inf)
    except RuntimeError as error:
        if written or agreed or all(call.part is None for call in calls):
            raise
        raise step_plan.Refused(str(error)) from error
    for call in calls:
        if call.part is not None and id(call) not in counted:
            call.part.step_buffer.add_(1.0)
    steps = [state["step"] for call in calls if call.part is None
             for state in call.states]
    if steps:
        torch._foreach_add_(steps, 1.0)
    if later:  # counted as taken; the caller reads the verdict
        books.last["found_inf"] = flags[calls[0].device]
        books.last["step_skipped"] = None


def step_capturable(books, calls, grad_scale, found_inf):
    """Everything stays on the device: steps, lr, loss scale and the verdict."""
    devices = {call.device for call in calls}
    if len(devices) > 1:
        raise ValueError(f"{books.name}(capturable=True): params are on "
                         f"{', '.join(sorted(map(str, devices)))}; all must be on one device")
    device = calls[0].device  # found_inf: None or a device flag (step_groups read a host one)
    inv_tensor = None
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.device != device or grad_scale.numel() != 1:
            raise ValueError(f"{books.name}.step(): grad_scale must be one value "
                             f"on {device}, got {grad_scale.numel()} on {grad_scale.device}")
        inv_tensor = optim_state.buffer(books, "inv_grad_scale", device, (1,), torch.float32)
        # in float32, or in float64 for a float64 scale (a release's clipping divisor,
        # made as the host makes it: the host's 1 / scale, then rounded to float32)
        scale = grad_scale.reshape(1)
        inv_tensor.copy_(torch.reciprocal(scale if scale.dtype == torch.float64 else
                                          scale.to(torch.float32)))
    inv_host = inv_grad_scale_of(books, grad_scale) if inv_tensor is None else None
    check_finite = grad_scale is not None
    flag = found_inf
    if flag is not None and (flag.device != device or flag.dtype != torch.float32
                             or flag.numel() != 1):
        raise ValueError(f"{books.name}.step(): found_inf must be one float32 "
                         f"value on {device} (a GradScaler's found_inf), got "
                         f"{flag.numel()} {flag.dtype} values on {flag.device}")
    if flag is None and check_finite:
        # Not a cached buffer: last_found_inf hands it out, and may be kept past the next step.
        flag = torch.zeros(1, dtype=torch.float32, device=device)
    if check_finite:
        for call in calls:
            ops.check_finite_(call.args["grads"], flag)
        agree_on_nonfinite(flag, agreeing_groups(calls))
    # Count the step only where it happens: steps += (found_inf == 0).
    steps = [optim_state.op_entry(state, "step") for call in calls for state in call.states]
    if flag is None:
        taken = 1.0
        torch._foreach_add_(steps, 1.0)
    else:
        taken = (flag.reshape(()) == 0).to(torch.float32)
        torch._foreach_add_(steps, [taken] * len(steps))
    # The kernels take int64 step numbers: copies of torch's float32 counts, at least 1
    # (a skipped first step counts 0 and writes nothing; the CUDA kernel clamps alike).
    counts = iter(torch.stack(steps).clamp_min(1.0).to(torch.int64).unbind())
    for call in calls:
        call.args["step_tensors"] = [next(counts) for _ in call.states]
    try:  # the kernels read the step numbers after this update
        check_calls(books, calls, False, inv_grad_scale=inv_host or 1.0,
                    inv_grad_scale_tensor=inv_tensor)
        for call in calls:
            call.op()(**call.args, inv_grad_scale=inv_host or 1.0,
                      inv_grad_scale_tensor=inv_tensor, found_inf=flag)
            if books.offload is not None:  # (a step torch.compile traces: capturable
                books.offload.write_back(call.params)  # refuses offload)
    except BaseException:  # a call refused its arguments: the step did not happen
        torch._foreach_sub_(steps, taken if flag is None else [taken] * len(steps))
        raise
    books.last["found_inf"] = flag


def inv_scale_on(books, grad_scale, device):
    """1 / grad_scale as a float32 tensor on device, computed there (not read back), for
    a grad_scale tensor of one value on device; else None. In float32, or from float64
    for a float64 scale (as the host makes 1 / scale, then rounded to float32)."""
    if not (isinstance(grad_scale, torch.Tensor) and grad_scale.device == device and
            grad_scale.numel() == 1):
        return None
    scale = grad_scale.reshape(1)
    inv = optim_state.buffer(books, "inv_grad_scale", device, (1,), torch.float32)
    return inv.copy_(torch.reciprocal(scale if scale.dtype == torch.float64 else
                                      scale.to(torch.float32)))


def verdict_set(books, grad_scale, found_inf, inv_tensor):
    """A step whose flag was read set: skipped, or refused for an invalid grad_scale
    tensor that set it (step_eager's device path; nothing was written)."""
    if inv_tensor is not None:
        inv_grad_scale_of(books, grad_scale)  # raises for an invalid one
    return skipped(books, found_inf)


def skipped(books, found_inf):
    books.last["step_skipped"] = True
    if isinstance(found_inf, torch.Tensor):
        found_inf.fill_(1.0)
