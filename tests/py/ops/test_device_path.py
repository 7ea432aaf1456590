"""A GPU step that never waits (issue 64): what a steady-state step reads back from the
device, and how many ops it launches, on the device path emulated on the CPU
(PRECIS_DEVICE_PATH_ON_CPU=1, precis.device_reads), with the compare on the device (a
GPU's default; PRECIS_COMPARE_ON_DEVICE=0 compares on the host).

Every read goes through device_reads.read (or its flag / number), which counts it: a
scan of the step path's sources finds no other (.item(), .tolist(), float() / bool() /
int() of a tensor). Each optimizer x policy x capturable x loss scale x gradient
release runs steps of a two-group model; a steady-state step's reads are held to
expected_reads (0 but where it says why), a Plan's precis op calls to theirs; on a GPU
(the `cuda` variant) a step of 0 reads must make no sync. Run this file as a script
for the table of reads and ops per step:

    PYTHONPATH=torch_ext .venv/bin/python tests/py/ops/test_device_path.py
"""
import collections
import itertools
import os
import re
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __name__ == "__main__":  # (pytest's conftest does this)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                    "torch_ext"))
import precis.optim  # noqa: E402
from precis import device_reads, optim_state  # noqa: E402

OPTIMIZERS = {"AdamW": lambda params, **kw: precis.optim.AdamW(params, lr=1e-3, **kw),
              "SGD": lambda params, **kw: precis.optim.SGD(params, lr=1e-2, momentum=0.9, **kw),
              "Lion": lambda params, **kw: precis.optim.Lion(params, lr=1e-4, **kw),
              "Muon": lambda params, **kw: precis.optim.Muon(params, lr=1e-2, **kw)}
POLICIES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
            "rem16": (torch.bfloat16, {"store_param_remainders": True}),
            "fp16_master": (torch.bfloat16, {"main_params_dtype": "fp16"}),
            "fp8_rem8": (torch.bfloat16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                                          "store_param_remainders": True,
                                          "param_remainder_bits": 8})}
SCALE = 1024.0
WARMUP, MEASURED = 3, 2


class Launches(TorchDispatchMode):
    """Counts the ops dispatched: torch.ops.precis.* by name, and all others."""

    def __init__(self):
        super().__init__()
        self.precis = collections.Counter()
        self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "precis":
            self.precis[func.__name__.split(".")[0]] += 1
        else:
            self.others += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def compare_on_device(monkeypatch):
    """The compare on the device (device_reads.compares_on_device), the default, which
    this file holds to 0 reads (PRECIS_COMPARE_ON_DEVICE=0, the host's compare, reads
    two int64s a param)."""
    monkeypatch.delenv("PRECIS_COMPARE_ON_DEVICE", raising=False)


def two_groups(dtype, device="cpu"):
    """Two param groups of two matrices each (Muon steps matrices only)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [[(32, 16), (16, 32)], [(8, 16), (16, 8)]]
    return [[torch.randn(s, generator=gen).to(dtype).to(device).requires_grad_()
             for s in group] for group in shapes]


def measure(optimizer, policy, capturable, scaled, release, device="cpu"):
    """Steps on the device path (emulated on the CPU): the reads (device_reads.counts:
    why -> reads), precis op calls (name -> calls) and other ops of MEASURED steady-state
    steps, each per step. On a GPU, a sync in a measured step raises (torch.cuda's sync
    debug mode)."""
    dtype, option = POLICIES[policy]
    groups = two_groups(dtype, device)
    opt = OPTIMIZERS[optimizer]([{"params": g} for g in groups], policy=option,
                                **({"capturable": True} if capturable else {}))
    params = [p for g in groups for p in g]
    gen = torch.Generator().manual_seed(1)
    if release:
        precis.optim.release_gradients(opt, grad_scale=SCALE if scaled else None)
    # made before the steps: a copy to a GPU would wait for it
    weights = [[torch.randn(p.shape, generator=gen).to(device) for p in params]
               for _ in range(WARMUP + MEASURED)]
    grad_scale, found_inf = torch.tensor(SCALE, device=device), torch.zeros(1, device=device)

    def step():
        loss = sum((p.float() * w).sum() for p, w in zip(params, weights.pop())) * 1e-3
        (loss * SCALE if scaled else loss).backward()
        if release or not scaled:
            opt.step()
        else:
            opt.step(grad_scale=grad_scale, found_inf=found_inf)
        opt.zero_grad()

    old = os.environ.get("PRECIS_DEVICE_PATH_ON_CPU")
    os.environ["PRECIS_DEVICE_PATH_ON_CPU"] = "1"
    syncs = torch.cuda.get_sync_debug_mode() if device != "cpu" else None
    try:
        for _ in range(WARMUP):
            step()
        before = collections.Counter(device_reads.counts)
        with Launches() as launches:
            for _ in range(MEASURED):
                if syncs is not None and expected_reads(optimizer, policy, capturable,
                                                        scaled, release) == 0:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                finally:
                    if syncs is not None:
                        torch.cuda.set_sync_debug_mode(syncs)
        reads = collections.Counter(device_reads.counts)
        reads.subtract(before)
    finally:
        if old is None:
            del os.environ["PRECIS_DEVICE_PATH_ON_CPU"]
        else:
            os.environ["PRECIS_DEVICE_PATH_ON_CPU"] = old
    per_step = {why: n / MEASURED for why, n in reads.items() if n}
    return per_step, {k: n / MEASURED for k, n in launches.precis.items()}, \
        launches.others / MEASURED


CONFIGS = [config for config in itertools.product(OPTIMIZERS, POLICIES, (False, True),
                                                  (False, True), (False, True))
           if not (config[0] == "Muon" and config[2])]  # (Muon has no capturable)


def expected_reads(optimizer, policy, capturable, scaled, release):
    """A steady-state step's reads on the device path: none, but one for an eager step
    (not capturable) given a loss scale, its verdict (found_inf and grad_scale go to the
    kernels as tensors: its step counts are on the host, torch's eager form, which the
    kernels take as numbers, and a skipped step must not count). A released backward's
    calls' verdicts are copied back when it ends, without a wait, and read at the next
    backward (precis.release: they name the params skipped and take their counts back)."""
    return 1 if scaled and not capturable and not release else 0


@pytest.mark.parametrize("optimizer,policy,capturable,scaled,release", CONFIGS)
def test_reads_and_launches_of_a_steady_state_step(optimizer, policy, capturable, scaled,
                                                   release):
    reads, launches, _ = measure(optimizer, policy, capturable, scaled, release)
    assert sum(reads.values()) == expected_reads(optimizer, policy, capturable, scaled,
                                                 release), reads
    if optimizer != "Muon" and not capturable and not release:  # one Plan for both groups
        # one flat call for both groups (each param with its group's lr and weight decay),
        # which checks its grads itself and, with a master or remainders, compares the
        # params with its last record (the record after the step is its own output) and
        # resyncs what it flagged (kernels that return at once for a param not flagged);
        # params with remainders by blocks (precis.fingerprints.BLOCK): the op compares
        # each block with its record before it steps it (fingerprints [out, records,
        # kept]) and records the blocks as it writes them
        assert launches == {"adam_step_flat_": 1}


STEP_PATH = ("functional.py", "step_plan.py", "step_calls.py", "fingerprints.py",
             "muon_step.py")
# float() / bool() / int() on the step path of what is no device tensor, by line
NOT_TENSORS = {
    ("functional.py", "elif float(found_inf) != 0.0 if on_host else \\"),  # a host number
    ("functional.py", "check_calls(books, calls, check_finite and bool(groups),"),  # a list
    ("functional.py", "agreed = bool(groups)"),
    ("step_calls.py", "pieces = local_of is local_shard or bool(books.param_index)"),
    # torch's eager step counts: CPU tensors on every path, a GPU's too
    ("step_calls.py", 'steps=[] if capturable else [ckpt.next_step(int(s["step"])) '
                      'for s in states],'),
    ("step_calls.py", 'args = dict(lr=0.0 if on_device else float(lr), '
                      'seed=mix_seed(group["seed"]),'),  # a float lr
    ("step_calls.py", "buf.fill_(float(lr))"),
    ("step_plan.py", "values = [float(lr) for lr in lrs]"),  # floats and ints (Steady.step)
    # the op's error text, on the refusal's path
    ("step_calls.py", "a, i, b, j = found.group(1), int(found.group(2)), found.group(3), "
                      "int(found.group(4))"),
    # a CPU tensor: the kept of a Part that sees writes itself (Part.sees: never on a device)
    ("step_plan.py", "if part.kept.tolist() != part.numels:"),
}


def conversions(source):
    """(line, its text) of each .item() / .tolist() / float( / bool( / int( in the code
    of source (not in its strings and comments)."""
    import io
    import tokenize
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = source.splitlines()
    found = []
    for prev, tok, nxt in zip(tokens, tokens[1:], tokens[2:]):
        if tok.type == tokenize.NAME and nxt.string == "(" and (
                tok.string in ("item", "tolist") and prev.string == "." or
                tok.string in ("float", "bool", "int") and prev.string != "."):
            found.append((tok.start[0], lines[tok.start[0] - 1].strip()))
    return found


def test_the_step_path_reads_only_through_the_funnel():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "torch_ext",
                        "precis")
    found = {}
    for name in STEP_PATH:
        with open(os.path.join(here, name)) as f:
            for line, text in conversions(f.read()):
                if (name, text.split("  #")[0].strip()) not in NOT_TENSORS:
                    found[f"{name}:{line}"] = text
    assert found == {}
    # the scan finds what it looks for
    assert [line for line, _ in conversions("x = t.tolist()\ny = float(t)  # float(\n"
                                            "z = 'int(t)'\n")] == [1, 2]


def test_the_device_path_switch_is_read_at_each_step(monkeypatch):
    """PRECIS_DEVICE_PATH_ON_CPU=1 at a step sends its fingerprints through the op (its
    Plan compares them as tensors); without it the C call reads CPU params directly."""
    calls = collections.Counter()
    real = torch.ops.precis.fingerprint

    class Counting:
        def __call__(self, bufs):
            calls["op"] += 1
            return real(bufs)
    for on in ("1", None):
        calls.clear()
        if on:
            monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", on)
        else:
            monkeypatch.delenv("PRECIS_DEVICE_PATH_ON_CPU", raising=False)
        monkeypatch.setattr(torch.ops.precis, "fingerprint", Counting())
        p = torch.randn(64, dtype=torch.bfloat16).requires_grad_()
        opt = precis.optim.AdamW([p], lr=1e-3)
        for _ in range(3):
            p.grad = torch.randn(64, dtype=torch.bfloat16)
            opt.step()
        monkeypatch.undo()
        assert (calls["op"] > 0) == bool(on)


@pytest.mark.parametrize("capturable", [False, True])  # a Plan's Part; the full path
@pytest.mark.parametrize("policy", ["bf16", "rem16", "fp16_master"])
@pytest.mark.parametrize("copied_late", [False, True])
def test_a_load_is_resynced_on_the_device_path_and_warned_lazily(monkeypatch, capturable,
                                                                 policy, copied_late):
    """A load on the device path: the loaded param's master is rebuilt (its remainder
    zeroed) before the step, with nothing read back, and the StaleMasterWarning names
    it once its flags are copied back: at the end of the step (the full path's), or of
    the step that fills its Plan's rows of them (step_plan.KeptRows: at most ROWS steps
    later), or (the copy not done, copied_late) at state_dict(), which waits for it (a
    read); no step waits for it."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    if copied_late:
        monkeypatch.setattr(device_reads.Later, "ready", lambda self: False)
    # seeded: a random load equal to 2 of 32 old elements by chance is a partial write
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(32, generator=gen).to(torch.bfloat16).requires_grad_()
              for _ in range(2)]
    opt = precis.optim.AdamW(params, lr=1e-2, weight_decay=0.0, policy=POLICIES[policy][1],
                             **({"capturable": True} if capturable else {}))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(32, generator=gen).to(torch.bfloat16)
        opt.step()
    kept = opt.master_weight(params[0])
    loaded = torch.randn(32, generator=gen).to(torch.bfloat16)
    assert loaded.ne(params[1].detach()).all(), "the test's data: a whole load"
    params[1].data.copy_(loaded)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = collections.Counter(device_reads.counts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(precis.step_plan.KeptRows.ROWS):
            opt.step()
    reads = collections.Counter(device_reads.counts)
    reads.subtract(before)
    # nothing read back: (copied late) the earlier steps' flags are not waited for either
    assert +reads == {}
    stale = [w for w in caught if issubclass(w.category, precis.optim.StaleMasterWarning)]
    said = "written (its remainders" if policy == "rem16" else "a whole load, "  # (resync's)
    if copied_late:
        assert stale == []
        with pytest.warns(precis.optim.StaleMasterWarning, match=re.escape(f"group 0 param 1: {said}")):
            opt.state_dict()
        assert device_reads.counts["stale warning"] > 0
    else:
        assert len(stale) == 1 and f"group 0 param 1: {said}" in str(stale[0].message)
        assert "param 0" not in str(stale[0].message)
    assert torch.equal(params[1].detach(), loaded)
    assert torch.equal(opt.master_weight(params[1]), loaded.float())
    assert torch.equal(opt.master_weight(params[0]), kept)  # the unwritten param's kept


@pytest.mark.parametrize("policy", ["bf16", "rem16", "fp8_rem8"])
@pytest.mark.parametrize("looked", ["rows filled", "plan dropped",
                                    "plan dropped in a capture", "state_dict"])
def test_a_plans_kept_rows_name_a_write_once_they_are_copied_back(monkeypatch, policy,
                                                                   looked):
    """On the device path a Plan's op writes what it kept of each param in a row a step
    (step_plan.KeptRows), copied back in one copy once its ROWS rows are written: two
    writes at middle rows (param 1's, then param 0's three steps later) are named by the
    step that fills the rows and by none before (rows filled), by the next step when the
    Plan is dropped first (its rows copied as it goes; dropped where nothing can be copied,
    as while torch.compile traces or a CUDA graph captures: at the next step that can), or
    at once by state_dict(); in one warning, each param once, and not again."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    dtype, option = POLICIES[policy]
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(64, generator=gen).to(dtype).requires_grad_() for _ in range(2)]
    opt = precis.optim.AdamW(params, lr=1e-2, policy=option)
    books = opt._books

    def stale(act):
        for p in params:
            p.grad = torch.randn(64, generator=gen).to(dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            act()
        return [str(w.message) for w in caught
                if issubclass(w.category, precis.optim.StaleMasterWarning)]

    for _ in range(WARMUP):
        assert stale(opt.step) == []
    rows, = [part.kept_rows for part in books.plans[0].parts]
    while rows.written != 5:  # (a write found at a middle row)
        assert stale(opt.step) == []
    for p in (params[1], params[0]):
        p.data.copy_(torch.randn(64, generator=gen).to(dtype))
        assert all(stale(opt.step) == [] for _ in range(3))
    assert rows.written == 11
    if looked == "rows filled":
        said = [stale(opt.step) for _ in range(rows.ROWS - rows.written)]
        assert said[:-1] == [[]] * (len(said) - 1), said
        said = said[-1]
    elif looked == "state_dict":
        said = stale(opt.state_dict)
    else:
        if looked == "plan dropped in a capture":
            monkeypatch.setattr(precis.fingerprints, "readable", lambda: False)
        precis.step_plan.drop_plan(books, 0)
        monkeypatch.undo()
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
        said = stale(opt.step)
    assert len(said) == 1 and said[0].count("group 0 param 1:") == 1 and \
        said[0].count("group 0 param 0:") == 1, said
    assert all(stale(opt.step) == [] for _ in range(rows.ROWS + 1))  # (named once)


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
@pytest.mark.parametrize("case", ["inf grad", "found_inf set", "found_inf set, scaled",
                                  "scale 0", "scale nan", "taken"])
def test_an_eager_step_reads_only_its_verdict(monkeypatch, optimizer, case):
    """On the device path an eager step's found_inf and grad_scale tensors go to the
    kernels: one read, the verdict (a skipped step with a grad_scale reads the scale too,
    to refuse an invalid one). A skipped step writes nothing and counts nothing; an
    invalid grad_scale is refused (ValueError) once the verdict is read, nothing
    written; a clear flag steps as the host path does."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    groups = two_groups(torch.bfloat16)
    params = [p for g in groups for p in g]
    opt = OPTIMIZERS[optimizer]([{"params": g} for g in groups])
    gen = torch.Generator().manual_seed(3)

    def grads():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    grads()
    opt.step()
    opt.step()  # (a Plan for AdamW's groups)
    grads()
    before = [p.detach().clone() for p in params]
    steps = [float(opt.state[p]["step"]) for p in params]
    scale = {"scale 0": 0.0, "scale nan": float("nan")}.get(case, 2.0)
    found_inf = torch.ones(1) if "found_inf set" in case else torch.zeros(1)
    kwargs = dict(found_inf=found_inf)
    if case != "found_inf set":
        kwargs["grad_scale"] = torch.tensor(scale)
    if case == "inf grad":
        params[3].grad[0] = float("inf")
    reads = device_reads.total()
    if case.startswith("scale "):
        with pytest.raises(ValueError, match="grad_scale must be finite and > 0"):
            opt.step(**kwargs)
    else:
        opt.step(**kwargs)
    # the verdict; a set one with a grad_scale, the scale too (invalid, or Inf/NaN?)
    assert device_reads.total() - reads == (1 if case in ("taken", "found_inf set") else 2)
    if case == "taken":
        assert opt.last_step_skipped is False
        assert [float(opt.state[p]["step"]) for p in params] == [s + 1 for s in steps]
        assert all(not torch.equal(p, b) for p, b in zip(params, before))
        return
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == steps
    if not case.startswith("scale "):
        assert opt.last_step_skipped is True and float(found_inf) == 1.0


class AllOps(TorchDispatchMode):
    """Every op dispatched, as namespace.name.overload."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD", "Lion"])
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp8_rem8"])
def test_a_planned_steady_step_calls_its_op_and_no_allocation(monkeypatch, optimizer,
                                                              policy):
    """Every op a Plan's steady step calls on the device path, in order: the one flat call
    (.counted: it counts the steps in the Part's float32 buffer itself, no torch op for
    them), and with a master or remainders, once every KeptRows.ROWS steps, the copy back
    of what the op kept at those steps (one clone here; on a GPU a non-blocking copy to
    pinned memory). Nothing else: the op's kept and the steps' buffer are the Part's own
    (no allocation a step). With a found_inf flag
    the counts go through the table (torch's float32 `step += 1` into a buffer made once,
    then into the table) and are kept once the step is known taken."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    dtype, option = POLICIES[policy]
    groups = two_groups(dtype)
    opt = OPTIMIZERS[optimizer]([{"params": g} for g in groups], policy=option)
    params = [p for g in groups for p in g]
    gen = torch.Generator().manual_seed(3)
    for _ in range(WARMUP + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if _ < WARMUP:
            opt.step()
    steps = [float(opt.state[p]["step"]) for p in params]
    rows = precis.step_plan.KeptRows.ROWS
    stepped = []
    for _ in range(rows):
        with AllOps() as log:
            opt.step()
        stepped.append([n for n in log.names if not n.startswith("profiler.")])
    copy_back = [] if policy == "fp32" else ["aten.clone.default"]
    # (remainders too: the op compares, resyncs and records them by blocks,
    # fingerprints.BLOCK, its kept a value a param)
    assert sorted(stepped) == [["precis.adam_step_flat_.counted"]] * (rows - 1) + \
        [["precis.adam_step_flat_.counted"] + copy_back], stepped
    assert [float(opt.state[p]["step"]) for p in params] == [s + rows for s in steps]
    flag = torch.zeros(1)
    with AllOps() as log:
        opt.step(found_inf=flag)
    at = log.names.index("precis.adam_step_flat_.rule")
    before_op = log.names[:at]
    assert "aten.add.out" in before_op and "aten.copy_.default" in before_op[
        before_op.index("aten.add.out"):], log.names
    assert "aten.add_.Tensor" in log.names[at:], log.names  # (after the verdict's read)
    assert [float(opt.state[p]["step"]) for p in params] == [s + rows + 1 for s in steps]


class Sequence(TorchDispatchMode):
    """The names of the precis ops dispatched, in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "precis":
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["plan", "full", "full, strided"])
@pytest.mark.parametrize("policy", ["bf16", "rem16"])
def test_the_update_op_records_what_it_writes_on_the_device_path(monkeypatch, path, policy):
    """An eager step on the device path keeps the update op's own fingerprints as the
    record (no fingerprint pass after the update), equal to the params' fingerprints,
    and for params with remainders their blocks' record too (but for a call that steps
    a param in other strides: a pass after it); a skipped step (found_inf set) keeps
    the records right: a step after it with no load warns nothing, and a load after it
    is still seen (a Plan's step's warnings looked for at once: state_dict(); the full
    path's are its step's own)."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    planned = path == "plan"
    if path == "full":  # (plain params: no Plan made)
        monkeypatch.setattr(precis.step_plan, "make_plans", lambda *args: None)
    gen = torch.Generator().manual_seed(4)
    # (a param in other strides takes the full path: no Plan)
    params = [torch.randn(32, 16, generator=gen).to(torch.bfloat16).requires_grad_(),
              torch.randn(16, 8, generator=gen).to(torch.bfloat16).t().requires_grad_()
              if path == "full, strided" else torch.randn(8, 16, generator=gen)
              .to(torch.bfloat16).requires_grad_()]
    opt = precis.optim.AdamW(params, lr=1e-2, policy=POLICIES[policy][1])
    books = opt._books

    def step(**kwargs):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        with Sequence() as seq, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(**kwargs)
            if planned:  # (its findings are read back every KeptRows.ROWS steps)
                opt.state_dict()
        return seq.names, [str(w.message) for w in caught
                           if issubclass(w.category, precis.optim.StaleMasterWarning)]

    def recorded():
        kept = precis.step_plan.written_by_param(books, params)
        if [kept[p] for p in params] != precis.fingerprints.of(params):
            return False
        if policy != "rem16":
            return True
        if planned:  # (a Plan's Part: its PartBlocks' record, all its params' blocks)
            part, = [part for plan in precis.step_plan.distinct(books.plans)
                     for part in plan.parts]
            blocks = part.blocks.record.split(part.blocks.blocks.counts)
        else:
            blocks = [books.blocks[id(p)] for p in params]
        return all(torch.equal(b, precis.fingerprints.of_blocks([optim_state.memory_of(p)]))
                   for b, p in zip(blocks, params))

    for _ in range(3):
        step()
    assert bool(books.plans) == planned
    names, stale = step()
    update = "adam_step_flat_" if planned else "adam_step_"
    assert update in names and stale == []
    # nothing after it; but for remainders stepped in a copy (a param in other strides)
    # the record of their blocks (fingerprints.BLOCK): one pass (else the op records
    # them as it writes them)
    after = ["fingerprint"] if policy == "rem16" and path == "full, strided" else []
    assert [n for n in names[names.index(update):] if n == "fingerprint"] == after, names
    assert recorded()
    for _ in range(2):  # a skipped step, then one with no load: nothing warned
        names, stale = step(found_inf=torch.ones(1))
        assert opt.last_step_skipped is True and stale == [] and recorded()
        names, stale = step()
        assert opt.last_step_skipped is False and stale == [] and recorded()
    step(found_inf=torch.ones(1))
    loaded = torch.randn(params[1].shape, generator=gen).to(torch.bfloat16)
    params[1].data.copy_(loaded)  # a load after a skipped step
    names, stale = step()
    assert len(stale) == 1 and "param 1" in stale[0] and "param 0" not in stale[0]
    assert recorded()


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer,policy,capturable,scaled,release", CONFIGS)
def test_a_cuda_step_reads_what_the_emulated_one_reads(optimizer, policy, capturable,
                                                      scaled, release):
    """On a GPU: the same reads as on the emulated path, and a step counted at 0 reads
    makes no sync torch sees (torch.cuda.set_sync_debug_mode("error"))."""
    reads, _, _ = measure(optimizer, policy, capturable, scaled, release, device="cuda")
    assert sum(reads.values()) == expected_reads(optimizer, policy, capturable, scaled,
                                                 release), reads


def table():
    print("| optimizer | policy | capturable | loss scale | release | reads/step | "
          "precis ops/step | other ops/step |")
    print("|---|---|---|---|---|---|---|---|")
    for config in CONFIGS:
        try:
            reads, ops, others = measure(*config)
        except Exception as error:  # (a combination an optimizer refuses)
            print(f"| {' | '.join(map(str, config))} | refused: {str(error)[:60]} |||")
            continue
        print(f"| {' | '.join(map(str, config))} | {sum(reads.values()):g} "
              f"({', '.join(f'{k} {v:g}' for k, v in sorted(reads.items()))}) | "
              f"{sum(ops.values()):g} ({', '.join(f'{k} {v:g}' for k, v in sorted(ops.items()))}) "
              f"| {others:g} |")


if __name__ == "__main__":
    os.environ.pop("PRECIS_COMPARE_ON_DEVICE", None)  # (the fixture's: the default)
    table()



def blocks_recorded(books, params):
    """Whether each param's blocks' record (a Plan's Part's, else books.blocks') is the
    fingerprints of its blocks now."""
    parts = [part for plan in precis.step_plan.distinct(books.plans) for part in plan.parts]
    found = []
    for p in params:
        part = next((part for part in parts if any(q is p for q in part.params)), None)
        if part is None:
            record = books.blocks.get(id(p))
        else:
            at = [id(q) for q in part.params].index(id(p))
            record = part.blocks.record.split(part.blocks.blocks.counts)[at]
        found.append(record is not None and torch.equal(
            record, precis.fingerprints.of_blocks([optim_state.memory_of(p)])))
    return found


@pytest.mark.parametrize("path", ["plan", "full"])
def test_a_step_skipped_before_its_ops_keeps_the_blocks_records(monkeypatch, path):
    """A step a loss scale skips before any op call ran (an Inf found by its check of
    every gradient, two op calls a step: two groups no Plan merges) leaves the params
    with remainders as they were, and their blocks' records right: taken from no op
    output (none was written), the next step warns of no write and keeps the
    remainders."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    if path == "full":  # (plain params: no Plan made)
        monkeypatch.setattr(precis.step_plan, "make_plans", lambda *args: None)
    gen = torch.Generator().manual_seed(0)
    a, b = [torch.randn(64, 64, generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in range(2)]
    opt = precis.optim.AdamW([{"params": [a]}, {"params": [b], "betas": (0.8, 0.99)}],
                             lr=1e-2, policy={"store_param_remainders": True})

    def step(bad=False):
        for p in (a, b):
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        if bad:
            a.grad[0, 0] = float("inf")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(grad_scale=torch.tensor(1.0))
        return [w for w in caught if issubclass(w.category, precis.optim.StaleMasterWarning)]
    for _ in range(4):
        step()
    assert bool(opt._books.plans) == (path == "plan")
    assert blocks_recorded(opt._books, [a, b]) == [True, True]
    assert step(bad=True) == [] and opt.last_step_skipped is True
    assert blocks_recorded(opt._books, [a, b]) == [True, True]
    remainders = [opt.state[p]["remainder"].clone() for p in (a, b)]
    assert all(r.ne(0).any() for r in remainders)
    assert step() == [] and opt.last_step_skipped is False
    assert blocks_recorded(opt._books, [a, b]) == [True, True]


@pytest.mark.parametrize("emulated", [False, True])
def test_a_skipped_first_step_records_the_blocks_a_later_write_is_found_in(monkeypatch,
                                                                          emulated):
    """A first step skipped by its own check (a loss scale, an Inf) records the blocks of
    the new state's params as found, so that a write into one block later costs that
    block's remainders only (worded as a partial write), not the whole param's."""
    if emulated:
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    block = precis.fingerprints.BLOCK
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(3 * block, generator=gen).to(torch.bfloat16).requires_grad_()
    opt = precis.optim.AdamW([p], lr=1e-2, policy={"store_param_remainders": True})
    p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    p.grad[0] = float("inf")
    opt.step(grad_scale=1.0)
    assert opt.last_step_skipped is True
    assert blocks_recorded(opt._books, [p]) == [True]
    for _ in range(2):  # remainders of every block
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    with torch.no_grad():
        p[2 * block + 5] += 1.0  # a write into the third block only
    p.grad = torch.zeros_like(p)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        opt.state_dict()  # (the warning's words, read once copied back)
    words = [str(w.message) for w in caught
             if issubclass(w.category, precis.optim.StaleMasterWarning)]
    assert len(words) == 1 and f"{block} of {3 * block} elements" in words[0], words


def test_a_released_backward_records_blocks_from_its_calls(monkeypatch):
    """A released backward of params with remainders on the device path: from the second
    backward its first call compares none of them (each is left to its kept call: no
    fingerprint call at all), each param's step call compares its blocks with their
    record before it steps them and records them as it writes them (no fingerprint call
    nor resync a param), and the records are the blocks' fingerprints after it."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)) \
        .to(torch.bfloat16)
    opt = precis.optim.AdamW(model.parameters(), lr=1e-3, policy=POLICIES["fp8_rem8"][1])
    precis.optim.release_gradients(opt)
    x = torch.randn(8, 16).to(torch.bfloat16)
    for _ in range(3):
        with Launches() as launches:
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    # (from the second backward each param's kept call is held on the C side: its
    # step is precis::held_step_, adam_step_'s kernel)
    assert dict(launches.precis) == {"held_step_": 4}
    assert blocks_recorded(opt._books, list(model.parameters())) == [True] * 4


def test_a_dict_policy_takes_the_steady_step_until_it_changes_in_place(monkeypatch):
    """A policy given as a dict (overrides, as from YAML; here fp8 m, v + 8-bit
    remainders) takes the steady step (no full-path step: step_groups never called) with
    the bits of the full path's steps; a change to the dict in place is seen: that step
    goes down the full path."""
    from precis import functional, step_plan
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    dtype, option = POLICIES["fp8_rem8"]
    made = []
    for _ in range(2):
        policy = dict(option)
        groups = two_groups(dtype)
        made.append((precis.optim.AdamW([{"params": g} for g in groups], lr=1e-3,
                                        policy=policy), [p for g in groups for p in g], policy))
    (steady_opt, steady_ps, policy), (full_opt, full_ps, _) = made
    real = functional.step_groups
    full_steps = []

    def counted(*args, **kwargs):
        full_steps.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(functional, "step_groups", counted)
    gen = torch.Generator().manual_seed(8)
    for k in range(WARMUP + 3):
        for p, q in zip(steady_ps, full_ps):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.clone()
        before = len(full_steps)
        steady_opt.step()
        if k >= WARMUP:
            assert len(full_steps) == before, f"step {k}: the full path"
        with monkeypatch.context() as m:  # (the other: the full path at every step)
            m.setattr(step_plan, "steady_step", lambda *args: False)
            full_opt.step()
    assert all(torch.equal(p.view(torch.int16), q.view(torch.int16))
               for p, q in zip(steady_ps, full_ps))
    policy["momentum_dtype"] = None  # (in place: the same policy, other items)
    for p in steady_ps:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    before = len(full_steps)
    steady_opt.step()
    assert len(full_steps) == before + 1
