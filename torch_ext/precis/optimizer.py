"""precis.optim's optimizer class: torch.optim.Optimizer's contract over the functional
core (functional.run), shared by every precis optimizer (Adam and AdamW in adamw.py,
SGD, Lion, Muon in theirs), each of which adds only its arguments and its rule (a
precis.rule.Rule, in the same file). See precis.optim's docstring for what they keep
and do."""

import functools
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain

import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import _to_scalar

from . import step_plan, functional, fingerprints, optim_checkpoint, optim_state
from . import _lib, stored_forms, tracing
from .dtensor import is_dtensor, local_shard
from .group_checks import STEPPED_DTYPES, check_param, check_step_scalars
from .offload import Offload, parse as parse_offload
from .state_layout import MOMENT_KEYS, ROW_STATE_KEYS
from .stored_forms import remainder_join


def _recorded(key, doc):
    """A public attribute kept in the books' `last` dict (optim_state.Books)."""
    return property(lambda self: self._books.last[key],
                    lambda self, value: self._books.last.__setitem__(key, value), doc=doc)


def _named(error, name, where):
    """error (a TypeError or ValueError) with its words led by where (the param group),
    not by name (the optimizer's, which where already holds)."""
    text = str(error)
    text = text[len(name) + 2:] if text.startswith(name + ": ") else text
    return _lib.reworded(error, f"{where}: {text}")


class PrecisOptimizer(torch.optim.Optimizer):
    """What every precis optimizer shares (Adam, AdamW, SGD, Lion, Muon differ only in
    their rule, a precis.rule.Rule in their own file, and their arguments): torch's optimizer contract
    (construction, param groups, hooks, state dicts) and the books kept between steps.
    The step itself is functional.run, the functional core; the state dicts' conversion
    is optim_checkpoint's."""

    _rule = None  # the update rule, a precis.rule.Rule: each optimizer's class sets its own
    _always_decoupled = False  # AdamW: every group decouples, whatever a state dict says

    def __init__(self, params, defaults, *, offload, offload_fraction):
        """defaults: the group options (the subclass's arguments, policy and seed)."""
        name = type(self).__name__
        if isinstance(defaults.get("betas"), list):
            defaults["betas"] = tuple(defaults["betas"])
        self._rule.check(defaults, name)
        self._rule.check_added(defaults, name)
        if "betas" in defaults:  # as torch: 0-dim tensors become numbers
            defaults["betas"] = tuple(map(_to_scalar, defaults["betas"]))
        mode = parse_offload(offload, offload_fraction, name)
        if mode is not None and defaults["capturable"]:
            raise ValueError(f"{name}: offload={offload!r} with capturable=True: an offloaded "
                             f"step runs on the host, which a CUDA graph cannot capture")
        self._books = optim_state.Books(name, self._rule)  # what it keeps between steps
        super().__init__(params, defaults)
        self._books.defaults = self.defaults
        self.state = optim_state.CountedState()  # torch's defaultdict(dict), counting changes
        if mode is not None:
            self._books.offload = Offload(offload_fraction, name)
            self._books.offload.select(self.param_groups, self.state)

    @staticmethod
    def profile_hook_step(func):
        """torch's wrapper of a class's step() (Optimizer._patch_step_function applies it
        once a class), as torch writes it: the global and the optimizer's pre hooks (a
        pre hook may replace the arguments), the step, _optimizer_step_code, the post
        hooks, all inside a profiler range named Optimizer.step#<class>.step. The range
        is opened by torch's C++ call (~1.4 us on a Zen 4) rather than by
        record_function's op (~6 us, a twentieth of a steady step: bench/steady_step.py):
        the same event for the profiler and any RecordFunction observer, and the same
        annotation for torch's CUPTI monitor (torch 2.13's record_function pushes one),
        but not a dispatched op (a TorchDispatchMode or make_fx sees no profiler:: op).
        torch.compile traces torch's own wrapper (dynamo knows record_function, not the
        C++ call)."""
        traced = torch_optimizer.Optimizer.profile_hook_step(func)
        enter = torch._C._autograd._record_function_with_args_enter
        leave = torch._C._autograd._record_function_with_args_exit
        monitor_of = getattr(torch.autograd.profiler, "_maybe_cupti_monitor", lambda: None)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling():
                return traced(*args, **kwargs)
            self = args[0]
            # (type(self), not func's class: torch names a subclass's range after it)
            name = f"Optimizer.step#{type(self).__name__}.step"
            span = enter(name)
            monitor = monitor_of()
            annotated = monitor is not None and monitor.push_user_annotation(name) is not None
            try:
                for pre_hook in chain(torch_optimizer._global_optimizer_pre_hooks.values(),
                                      self._optimizer_step_pre_hooks.values()):
                    result = pre_hook(self, args, kwargs)
                    if result is not None:
                        if isinstance(result, tuple) and len(result) == 2:
                            args, kwargs = result
                        else:
                            raise RuntimeError(f"{func} must return None or a tuple of "
                                               f"(new_args, new_kwargs), but got {result}.")
                out = func(*args, **kwargs)
                self._optimizer_step_code()
                for post_hook in chain(self._optimizer_step_post_hooks.values(),
                                       torch_optimizer._global_optimizer_post_hooks.values()):
                    post_hook(self, args, kwargs)
                return out
            finally:
                if annotated:
                    monitor.pop_user_annotation()
                leave(span)
        return wrapper

    @property
    def last_step_skipped(self):
        """Whether the last step() was skipped; None after a capturable step; in release
        mode (precis.release), whether none of the step's params was stepped (its calls'
        verdicts read now where they are still on their way back from a device)."""
        if self._books.last["step_skipped"] is optim_state.VERDICT_UNREAD:
            self._books.release.settle()
        return self._books.last["step_skipped"]

    @last_step_skipped.setter
    def last_step_skipped(self, value):
        self._books.last["step_skipped"] = value

    last_found_inf = _recorded(
        "found_inf", "The device flag of the last capturable step (set when it was skipped), "
        "or None (so after step() in release mode: its verdict is last_step_skipped).")

    def _settle_release(self):
        """The step counts a released backward that raised left open (their verdicts
        still on a device), settled before anything reads, copies or replaces them
        (precis.release's GradientRelease.settle)."""
        if self._books.release is not None:
            self._books.release.settle()
        functional.settle_and_warn(self._books)  # a device compare's warning, not read yet

    def __getstate__(self):
        # The streams and the records of what the last step left in each watched param
        # (section 6 of docs/design.md) go with the state, keyed by the same params: a
        # deepcopy maps them alike, as does a pickle of the params and the optimizer
        # together. The rest of the books is remade.
        books = self._books
        self._settle_release()
        return {**super().__getstate__(), "_precis_streams": books.streams,
                "_precis_written": step_plan.written_by_param(books, list(self.state))}

    def __setstate__(self, state):
        streams = state.pop("_precis_streams", {})
        written = state.pop("_precis_written", {})
        super().__setstate__(state)
        if not hasattr(self, "_books"):
            self._books = optim_state.Books(type(self).__name__, self._rule)
        self._books.defaults = self.defaults
        self._books.streams = streams
        # A load into the copy's params before its first step must be seen: its records
        # are the original's; a param without one (a copy made before they were
        # carried) is recorded as it is now.
        self._books.written.update((id(p), value) for p, value in written.items()
                                   if value is not None)
        self._books.written.compare_by_rule(id(p) for p, value in written.items()
                                            if value is None)  # (no record: by rounding)
        carried = set(map(id, written))
        optim_state.record_written(self._books, [
            p for p, st in self.state.items()
            if id(p) not in carried and optim_state.watched(self._books, p, st)])
        # A copy (deepcopy, torch.load) of a state a Plan made flat shares the copied
        # buffers; its own Plan comes at its first eager step. Until then each entry
        # gets memory of its own, so that a first step traced by torch.compile hands
        # its graph no inputs that share memory (optim_state.op_entry); and the
        # layouts are resolved here, out of any traced step (the policy's C check).
        for st in self.state.values():
            for key, value in list(st.items()):
                if type(value) is torch.Tensor and \
                        value.untyped_storage().nbytes() > value.nbytes:
                    dict.__setitem__(st, key, value.clone())
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype in STEPPED_DTYPES:  # (not a frozen int8 weight, say)
                    optim_state.layout_for(self._books, group, p)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        try:
            rule, where = self._rule.for_group(group), f"{type(self).__name__} param group {index}"
            rule.check(group, where)
            rule.check_added(group, where)
            if group["capturable"] != self.param_groups[0]["capturable"]:
                raise ValueError(f"{type(self).__name__} param group {index}: capturable is "
                                 f"{group['capturable']} but {self.param_groups[0]['capturable']} "
                                 f"in group 0; all param groups must agree")
            for i, p in enumerate(group["params"]):
                if p.requires_grad:
                    check_param(local_shard(p, p),
                                f"{type(self).__name__}: param {i} of group {index}")
                else:  # frozen (an int8 weight, say): torch's optimizers take it and never
                    self._books.unchecked.add(id(p))  # step it; checked if it ever steps
                if p.dtype in STEPPED_DTYPES:  # resolves the policy: bad ones fail now
                    try:
                        optim_state.layout_for(self._books, group, p)
                    except (TypeError, ValueError) as error:  # (named by its group)
                        raise _named(error, self._books.name, where) from None
            if self._books.offload is not None:
                self._books.offload.select(self.param_groups, self.state)
            if self._books.release is not None:  # hooks on the new params too
                self._books.release.track(index)
        except Exception:
            self.param_groups.pop()
            raise

    def zero_grad(self, set_to_none=True):
        """As torch's. `main_grad` buffers belong to their gradient buckets and are
        not touched. Written out rather than inherited: torch.compile does not trace
        torch.optim.Optimizer.zero_grad, so a compiled training step calling it
        could not be one graph."""
        if self._books.release is not None:  # the gradients of this step are dropped
            if tracing.traced():  # (the release's books, eagerly)
                tracing.run_eagerly(self._books.release.end_step)
            else:
                self._books.release.end_step()
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                if p.grad.is_sparse:
                    p.grad.zero_()
                else:
                    grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)

    # -- state ----------------------------------------------------------------

    @torch.no_grad()
    def reload_model_params(self):
        """Resync every master weight and remainder from the params.

        Call it after loading model weights into the params of an optimizer that
        already has state (e.g. model.load_state_dict after the optimizer was built
        and stepped); otherwise the next step would continue from stale masters.
        """
        books = self._books
        for gi, group in enumerate(self.param_groups):  # all checked before any resync
            for i, p in enumerate(group["params"]):
                for key, held in (self.state.get(p) or {}).items():
                    if key in ("master", "remainder") and held.shape != p.shape:
                        raise ValueError(
                            f"{optim_state.where(books, gi, i, p)}: reload_model_params: its "
                            f"{key} is of shape {tuple(held.shape)} but the param now of "
                            f"{tuple(p.shape)}; did the param change shape after the "
                            f"optimizer state was created? (nothing was resynced)")
        functional.settle_and_warn(books)  # (a device compare's warning, not read yet)
        for gi in list(books.plans):  # books.written takes the fingerprints made here
            step_plan.drop_plan(books, gi)
        for group in self.param_groups:
            for p in group["params"]:
                if books.offload is not None:
                    books.offload.reload(p)
                state = self.state.get(p)
                if state:
                    optim_state.resync(books, p, state, auto=False)

    def _check_own_param(self, p, method):
        """p, a param of this optimizer's groups (a method taking one names it if not)."""
        if any(q is p for group in self.param_groups for q in group["params"]):
            return
        where = f"{type(self).__name__}.{method}(p): p must be a param of its param groups"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}, got {type(p).__name__} {p!r}")
        raise ValueError(f"{where}, got a tensor of shape {tuple(p.shape)} that is none of them")

    def master_weight(self, p):
        """p's fp32 master weights as the optimizer sees them (a new tensor; complex64
        for a complex param)."""
        self._check_own_param(p, "master_weight")
        optim_state.joins_arrived(self._books, self.state)  # (the master its step would use)
        state = self.state.get(p, {})
        if "master" in state:  # (a copy: an fp32 master's .float() is the state itself)
            return state["master"].to(torch.float32, copy=True)
        if "remainder" in state:
            return remainder_join(p.detach(), state["remainder"])
        return p.detach().to(torch.complex64 if p.is_complex() else torch.float32, copy=True)

    def decoded_state(self, p):
        """p's state as full-precision values in p's shape: {'step', 'master',
        'exp_avg', 'exp_avg_sq'}, and 'max_exp_avg_sq' with amsgrad (moments decoded
        from their stored form), and a row state as it is kept (NorMuon's
        'row_exp_avg_sq', fp32 (rows, 1)); {} before its first step."""
        self._check_own_param(p, "decoded_state")
        self._settle_release()
        state = self.state.get(p)
        if not state:
            return {}
        return {
            "step": int(state["step"]),
            "master": self.master_weight(p),
            **{key: stored_forms.moment_values(state[key], state.get(key + "_scale"), second)
               for key, second in MOMENT_KEYS.items() if key in state},
            **{key: state[key].clone() for key in ROW_STATE_KEYS if key in state},
        }

    # -- step -----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None, **kwargs):
        """One step over every param that has a gradient (`main_grad`
        when the param has one, else `.grad`).

        grad_scale: the loss scale the gradients carry (tensor or number); they are
        unscaled in the kernel and an Inf/NaN anywhere skips the whole step.
        found_inf: truthy -> skip the step. Both default to the optimizer's
        `grad_scale` / `found_inf` attributes when those are set.
        """
        if kwargs:
            if "grad_scaler" in kwargs:
                raise TypeError(
                    f"{type(self).__name__}.step() got grad_scaler=: precis optimizers do not "
                    f"set _step_supports_amp_scaling; let GradScaler unscale and skip, or pass "
                    f"grad_scale= and found_inf= to step()")
            raise TypeError(f"{type(self).__name__}.step() got unexpected keyword arguments "
                            f"{', '.join(sorted(kwargs))}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        check_step_scalars(type(self).__name__, grad_scale, found_inf)
        release = self._books.release
        if release is None:
            functional.run(self.param_groups, self.state, self._books, grad_scale, found_inf)
            return loss
        # Release mode (precis.release): backward stepped the params; step those still
        # holding a gradient, and end the step.
        if grad_scale is not None or found_inf is not None:
            raise ValueError(f"{type(self).__name__}.step(): grad_scale= / found_inf= (or the "
                             f"optimizer's attributes of those names) in release mode: the "
                             f"params were stepped in backward; give the loss scale to "
                             f"release_gradients(grad_scale=...)")
        if tracing.traced():  # (the release's books, eagerly: a trace would be replayed)
            tracing.run_eagerly(self._end_released_step)
        else:
            self._end_released_step()
        return loss

    def _end_released_step(self):
        """opt.step() in release mode: the params holding a gradient no hook stepped
        stepped (precis.release's GradientRelease.step_left), the step ended (end_step)
        and the backward's compare's warning given."""
        release = self._books.release
        only = release.unstepped()
        release.end_step(stepped=bool(only) and release.step_left(only))
        functional.settle_and_warn(self._books, wait=False)

    # -- checkpoints ------------------------------------------------------------

    def state_dict(self):
        """torch's layout ({'state': {index: {...}}, 'param_groups': [...]}), every
        buffer in its stored dtype (precis.checkpoint.export_state: a state torch
        would misread has 'step' = precis.checkpoint.STEP_MARKER, which torch's
        loader refuses). The policy option is written as plain data (for
        information: load_state_dict keeps the optimizer's own policy), and params
        with remainders get 'param_fingerprint', which lets a load before the model
        weights keep the remainders exact. A loaded remainder no step has used yet,
        whose param does not hold the weights it was saved with, is saved as it was
        loaded (remainder and fingerprint, also where this optimizer keeps a master):
        a checkpoint converted before its model's weights are loaded stays exact.
        Post-hooks (register_state_dict_post_hook) see, and may replace, this form."""
        self._settle_release()
        optim_state.joins_arrived(self._books, self.state)
        hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # (run below, on the export)
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = hooks
        optim_checkpoint.export(self, sd)
        for hook in list(hooks.values()):  # (torch's loop)
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer or of its torch.optim counterpart.

        Hyperparameters come from the state dict (as in torch); the policy stays
        the optimizer's own, and the state is converted to its dtypes (exact
        copies where the dtypes already match). Everything is validated before
        anything changes: a malformed state dict raises ValueError and leaves the
        optimizer as it was.
        """
        books = self._books
        self._settle_release()
        if books.offload is not None:
            books.offload.select(self.param_groups, self.state)
            # Params loaded before (set_state_dict's order) may have been written without
            # moving their version counters (torch.distributed.checkpoint into FSDP2's
            # shards): the host copies are reread from them, not trusted.
            for group in self.param_groups:
                for p in group["params"]:
                    books.offload.reload(p)
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # as torch: hooks get a shallow copy
        for hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        new_groups, new_state, remainder_keys, streams, joins = \
            optim_checkpoint.convert(self, state_dict)
        # Everything checked and converted: apply.
        for group, new in zip(self.param_groups, new_groups):
            group.clear()
            group.update(new)
        self.state = optim_state.CountedState(new_state)
        books.plans.clear()
        books.steady = None  # (its call would keep the old state's buffers alive)
        books.written = fingerprints.Records()
        optim_state.record_written(books, [p for p, st in new_state.items()
                                           if optim_state.watched(books, p, st)])
        books.blocks = {}
        optim_state.record_blocks(books, new_state.items())
        # a loaded remainder belongs to the bits its param was saved with: one whose
        # param holds them now is the master's low bits (a write after this load moves
        # the load's records: resynced block by block); the others are checked at the
        # next step, whether or not their params are written before it
        # (optim_state.written_behind, resync)
        books.fingerprints = {
            p: fp for p, fp in remainder_keys.items() if p.device.type == "meta" or
            stored_forms.fingerprint(optim_state.local_home(books, p)) != fp}
        books.joins = joins
        books.streams = streams
        for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            hook(self)

    # -- memory -----------------------------------------------------------------

    def memory_report(self):
        """Bytes per parameter of each buffer, measured from the tensors allocated.

        Keys: param, grad (main_grad where present, else .grad), master (master
        weights, int16 remainders or uint8 corrections), exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad),
        scales (block scales of the moments), rows (only for a rule with a per-row
        state: NorMuon's, whole on every rank), total; plus numel (parameters counted).
        Buffers not allocated yet (state before the first step, freed grads, no
        amsgrad) count 0.
        """
        sizes = dict.fromkeys(("param", "grad", "master", "exp_avg", "exp_avg_sq",
                               "max_exp_avg_sq", "scales")
                              + (("rows",) if self._rule.row_state else ()), 0)

        def nbytes(t):  # a DTensor: its local shard (params count whole in numel)
            t = t.to_local() if is_dtensor(t) else t
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        numel = 0
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                numel += p.numel()
                sizes["param"] += nbytes(p)
                grad = getattr(p, "main_grad", None)
                sizes["grad"] += nbytes(p.grad if grad is None else grad)
                state = self.state.get(p, {})
                sizes["master"] += nbytes(state.get("master")) + nbytes(state.get("remainder"))
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    sizes[key] += nbytes(state.get(key))
                sizes["scales"] += sum(nbytes(state.get(key)) for key in (
                    "exp_avg_scale", "exp_avg_sq_scale", "max_exp_avg_sq_scale"))
                if self._rule.row_state:
                    sizes["rows"] += nbytes(state.get(self._rule.row_state))
        report = {k: (v / numel if numel else 0.0) for k, v in sizes.items()}
        report["total"] = sum(report.values())
        report["numel"] = numel
        return report


