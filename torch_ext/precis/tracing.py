"""Whether torch.compile is tracing the step (traced()): the one question each part of
the step asks before it reads a value back or waits for a device, which a traced step
can do neither of. A step of offloaded CUDA params runs uncompiled from inside a
compiled call (functional.run_uncompiled, made by disabled()), where torch 2.11 still
answers torch.compiler.is_compiling() with True (2.13 does not): there the step takes
its eager path. Python whose books change between calls (a release's end of a step, its
hooks, precis.ddp's and offload's gradient hooks) runs eagerly when a compiled call
reaches it (run_eagerly): a trace of it would be replayed; so does what torch.compile
gets wrong."""

import contextlib

import torch

# (a list: dynamo reads a module's list item as a constant it guards). One for the
# process: a step traced on one thread while another runs an offloaded CUDA step
# uncompiled would take the eager path (and recompile on the guard); not supported.
_eager = [False]


def traced():
    """Whether the step is being traced by torch.compile (not inside eager())."""
    return torch.compiler.is_compiling() and not _eager[0]


def uncompiled():
    """Whether inside eager(): the uncompiled step of offloaded CUDA params."""
    return _eager[0]


@contextlib.contextmanager
def eager():
    """traced() is False inside, whatever call encloses it."""
    before = _eager[0]
    _eager[0] = True
    try:
        yield
    finally:
        _eager[0] = before


def disabled(fn, reason):
    """fn run eagerly, not traced, where torch.compile traces its caller (a graph break;
    under fullgraph=True dynamo refuses, showing reason, before fn writes anything), with
    traced() False inside."""
    def eagerly(*args):
        with eager():
            return fn(*args)
    return torch.compiler.disable(eagerly, reason=reason)


# run_eagerly(fn, *args): fn(*args) run eagerly (disabled). For Python whose books change
# at every call (a compiled opt.step() in release mode; a release's, precis.ddp's and
# offload's gradient hooks, fired by a backward inside a compiled training step, on the
# thread where dynamo compiles every new frame: which params were stepped, reduced or
# copied, the verdicts left), which dynamo would trace once and replay, or trace again at
# each change until its recompile limit; and for what torch.compile gets wrong (an
# offloaded step's host copies made, Muon's whole matrices gathered from their shards:
# offload.Offload.prepare, muon_step.step).
run_eagerly = disabled(
    lambda fn, *args: fn(*args),
    reason="precis: Python books that change at every call, or work torch.compile gets "
           "wrong (see precis/tracing.py)")
