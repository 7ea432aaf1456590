"""A capturable precis step captured in a CUDA graph (docs/guide.md's recipe: warm-up
steps on a side stream, torch.cuda.graph, replays) gives the eager steps' bits, and a
param written between replays (a model-only load, `p.copy_(...)`) is taken as an eager
step takes it (precis.graph_records); torch.compile(mode="reduce-overhead") of the step
gives the eager bits too.

On a GPU (marked cuda): torch.cuda.graph and torch.compile themselves. Without one the
same comparisons run against EmulatedGraph on the GPU's path (PRECIS_DEVICE_PATH_ON_CPU=1):
the step run once as inside a capture (graph_records.capturing() True), its torch ops
recorded by a dispatch mode, then replayed without any Python of the step, each op's
outputs copied into the tensors the capture made, as a graph's replay writes the memory
its capture allocated. A host read inside the capture fails there, as it would on a GPU.

AdamW over params of 1, 127 and 4097 bf16 elements, the default policy and fp8 m, v +
8-bit remainders; bits compared exactly (params and every state tensor)."""
import contextlib
import warnings

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

import precis.optim
from precis import fingerprints, graph_records
from state_snapshot import snapshot

SIZES = (1, 127, 4097)
FP8_REM8 = dict(store_param_remainders=True, param_remainder_bits=8, exp_avg_dtype="fp8",
                exp_avg_sq_dtype="fp8")
POLICIES = {"default": None, "fp8-rem8": FP8_REM8}
WARM_UP, REPLAYS = 3, 6
LOAD_AT = WARM_UP + 3  # the step before which the params are written (a model-only load)


class Run:
    """Params with static gradients (the graph reads .grad where the capture found it),
    an lr tensor changed in place, and a capturable AdamW over them."""

    def __init__(self, device, policy):
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.randn(n, generator=gen).to(device, torch.bfloat16)
                       for n in SIZES]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.lr = torch.tensor(1e-2, dtype=torch.float64, device=device)
        self.opt = precis.optim.AdamW(self.params, lr=self.lr, weight_decay=0.1,
                                      policy=policy, capturable=True)

    def feed(self, step):
        """Step `step`'s gradients and lr, written into the tensors the step reads."""
        gen = torch.Generator().manual_seed(100 + step)
        for p in self.params:
            p.grad.copy_(torch.randn(p.shape, generator=gen).to(torch.bfloat16))
        self.lr.fill_(1e-2 / (1 + step))

    def load(self):
        """A model-only load: every param written by copy_, one of them in part."""
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in self.params[:-1]:
                p.copy_(3.0 + torch.randn(p.shape, generator=gen).to(torch.bfloat16))
            self.params[-1][:100].fill_(-2.0)  # a slice: its other elements kept


def loaded_values(device):
    """What Run.load writes, as each param's values (the slice's param: its first 100)."""
    run = Run(device, None)
    run.load()
    return [p.detach().clone() for p in run.params[:-1]], run.params[-1][:100].clone()


# ---- the graphs ----------------------------------------------------------------------


class CudaGraph:
    """torch.cuda.graph as docs/guide.md shows it: warm-up on a side stream, capture
    (which runs nothing), replays."""
    capture_steps = False  # (capturing takes no step)

    def __init__(self):
        self.side = torch.cuda.Stream()
        self.graph = torch.cuda.CUDAGraph()

    def warm_up(self, step):
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            step()
        torch.cuda.current_stream().wait_stream(self.side)

    def capture(self, step):
        with torch.cuda.graph(self.graph):
            step()

    def replay(self):
        self.graph.replay()


class Compiled:
    """torch.compile of the step (mode, or a backend where inductor is not wanted): its
    first calls trace and compile (and, reduce-overhead, record a graph), each a step."""
    capture_steps = True

    def __init__(self, **how):
        self.how = how or {"backend": "aot_eager"}

    def warm_up(self, step):
        step()

    def capture(self, step):
        self.compiled = torch.compile(step, **self.how)
        self.compiled()

    def replay(self):
        self.compiled()


class HostRead(RuntimeError):
    """A captured step read a tensor's value back to the host."""


class Recorder(TorchDispatchMode):
    """Every op called under it, with its arguments and outputs; a host read (.item(),
    float(), bool() of a tensor) raises HostRead, as it would break a CUDA capture, but
    of the tensors `unread_on_a_gpu` (a CPU tensor's value, which the step reads only off
    the device: group_checks.number leaves a device lr unread)."""
    READS = {"_local_scalar_dense", "is_nonzero", "equal"}

    def __init__(self, unread_on_a_gpu=()):
        super().__init__()
        self.ops = []
        self.allowed = {t.data_ptr() for t in unread_on_a_gpu}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._opname in self.READS and args[0].data_ptr() not in self.allowed:
            raise HostRead(f"{func} inside a capture")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def copy_outputs(recorded, new):
    """The tensors of a replayed op's outputs copied into those the capture's call made
    (where they are other memory: an in-place op or a view already wrote them)."""
    for old, fresh in zip(tree_flatten(recorded)[0], tree_flatten(new)[0]):
        if isinstance(old, torch.Tensor) and old.numel() and \
                old.data_ptr() != fresh.data_ptr():
            old.copy_(fresh)


@contextlib.contextmanager
def as_in_a_capture():
    """The step's Python as inside a CUDA graph's capture (fingerprints not readable,
    graph_records.capturing())."""
    readable, capturing = fingerprints.readable, graph_records.capturing
    fingerprints.readable, graph_records.capturing = (lambda: False), (lambda: True)
    try:
        yield
    finally:
        fingerprints.readable, graph_records.capturing = readable, capturing


class EmulatedGraph:
    """A CUDA graph's replay on the CPU: the ops of the step as captured, called again
    with the same arguments and their outputs written into the same memory, no Python
    of the step run. The capture runs the step (a graph's capture does not): it counts
    as one."""
    capture_steps = True

    def __init__(self, unread_on_a_gpu=()):
        self.unread_on_a_gpu = unread_on_a_gpu

    def warm_up(self, step):
        step()

    def capture(self, step):
        with as_in_a_capture(), Recorder(self.unread_on_a_gpu) as recorder:
            step()
        self.ops = recorder.ops

    def replay(self):
        for func, args, kwargs, out in self.ops:
            copy_outputs(out, func(*args, **kwargs))


# ---- the comparison ------------------------------------------------------------------


def captured_and_eager(device, policy, graph, load=False):
    """Two runs fed alike: one stepped eagerly (capturable, outside any graph), one by
    `graph` (warm-up steps, a capture, replays); with load, both written by Run.load
    before step LOAD_AT. Returns (eager, captured) once every step is taken."""
    eager, captured = Run(device, policy), Run(device, policy)
    if isinstance(graph, EmulatedGraph):  # (its lr on the CPU: read by the step's checks)
        graph.unread_on_a_gpu = [captured.lr]
    for step in range(WARM_UP):
        for run in (eager, captured):
            run.feed(step)
        eager.opt.step()
        graph.warm_up(captured.opt.step)
    step = WARM_UP
    captured.feed(step)
    graph.capture(captured.opt.step)
    if graph.capture_steps:
        eager.feed(step)
        eager.opt.step()
        step += 1
    for step in range(step, WARM_UP + REPLAYS):
        if load and step == LOAD_AT:
            eager.load()
            captured.load()
        for run in (eager, captured):
            run.feed(step)
        eager.opt.step()
        graph.replay()
    if device == "cuda":
        torch.cuda.synchronize()
    return eager, captured


def assert_same_bits(eager, captured):
    (params_e, state_e), (params_c, state_c) = snapshot(eager.opt), snapshot(captured.opt)
    for i, (a, b) in enumerate(zip(params_e, params_c)):
        assert torch.equal(a, b), f"param {i} ({SIZES[i]} elements): captured != eager"
    assert state_e.keys() == state_c.keys()
    for i in state_e:
        assert state_e[i].keys() == state_c[i].keys()
        for key in state_e[i]:
            a, b = state_e[i][key], state_c[i][key]
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, \
                f"param {i} ({SIZES[i]} elements) {key}: captured != eager"
    steps = {float(captured.opt.state[p]["step"]) for p in captured.params}
    assert steps == {float(WARM_UP + REPLAYS)}


def assert_load_taken(run, device):
    """After the load and the steps since (small ones: lr <= 1e-2 / 7), each param is
    near what was loaded, not where the run was before it."""
    whole, part = loaded_values(device)
    for p, values in zip(run.params[:-1], whole):
        assert (p.float() - values.float()).abs().max() < 0.1
    assert (run.params[-1][:100].float() + 2.0).abs().max() < 0.1


# ---- on the CPU: the emulated graph on the GPU's path ------------------------------------


@pytest.fixture
def gpu_path(monkeypatch):
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")


@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
def test_emulated_replays_give_the_eager_bits(gpu_path, policy):
    assert_same_bits(*captured_and_eager("cpu", POLICIES[policy], EmulatedGraph()))


@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
def test_emulated_replays_see_a_load_between_them(gpu_path, policy):
    eager, captured = captured_and_eager("cpu", POLICIES[policy], EmulatedGraph(), load=True)
    assert_same_bits(eager, captured)
    assert_load_taken(captured, "cpu")


def test_a_capture_rewrites_the_records_its_compare_reads(gpu_path):
    """The replays' invariant: the captured step writes its new records into the memory
    its compare read (the device records and the remainders' block records), holding
    what the step left in the params; nothing is left to forget (books.unrecorded)."""
    for policy in POLICIES.values():
        run = Run("cpu", policy)
        for step in range(WARM_UP):
            run.feed(step)
            run.opt.step()
        books = run.opt._books
        ids = [id(p) for p in run.params]
        records = [books.written._kept[key] for key in ids]
        blocks = [books.blocks[key] for key in ids] if policy else []
        run.feed(WARM_UP)
        with as_in_a_capture():
            run.opt.step()
        assert [books.written._kept[key] for key in ids] == records  # the same tensors
        assert [books.blocks[key] for key in ids] == blocks if policy else not books.blocks
        now = precis.ops.fingerprint(run.params)
        assert torch.equal(torch.cat(records), now)  # (one element each)
        for p, block in zip(run.params, blocks):
            assert torch.equal(block, fingerprints.of_blocks([p.detach().view(-1)]))
        assert not books.unrecorded


def test_a_capture_without_records_is_left_unrecorded(gpu_path):
    """A capture of an optimizer whose params have no record on the device yet (its
    records dropped, as after a compiled step) compares nothing, and says so: the next
    eager step records anew (books.unrecorded)."""
    run = Run("cpu", None)
    for step in range(WARM_UP):
        run.feed(step)
        run.opt.step()
    precis.functional.forget_records(run.opt._books)
    run.feed(WARM_UP)
    with as_in_a_capture():
        run.opt.step()
    assert run.opt._books.unrecorded


def test_the_recorder_refuses_a_host_read():
    """EmulatedGraph's recorder fails where a capture would: a value read back."""
    with pytest.raises(HostRead), Recorder():
        float(torch.ones(1) * 2)


def test_the_emulated_replay_writes_the_captured_memory():
    """An op that allocates its output (not in place) writes, when replayed, into the
    tensor the capture made, which the ops after it read."""
    x = torch.ones(3)
    acc = torch.zeros(3)
    graph = EmulatedGraph()
    graph.capture(lambda: acc.add_(x * 2))  # (x * 2: a fresh tensor each call)
    x.fill_(5.0)
    graph.replay()
    assert acc.tolist() == [12.0] * 3


def test_compiled_step_gives_the_eager_bits_on_the_cpu(gpu_path):
    """The compiled trajectory's code on the CPU (aot_eager: no inductor build here)."""
    torch._dynamo.reset()
    try:
        assert_same_bits(*captured_and_eager("cpu", None, Compiled()))
    finally:
        torch._dynamo.reset()


# ---- on a GPU ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
def test_cuda_graph_replays_give_the_eager_bits(policy):
    assert_same_bits(*captured_and_eager("cuda", POLICIES[policy], CudaGraph()))


@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
def test_cuda_graph_replays_see_a_load_between_them(policy):
    eager, captured = captured_and_eager("cuda", POLICIES[policy], CudaGraph(), load=True)
    assert_same_bits(eager, captured)
    assert_load_taken(captured, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("policy", POLICIES, ids=list(POLICIES))
def test_compiled_reduce_overhead_gives_the_eager_bits(policy):
    """torch.compile(mode="reduce-overhead") of the step (inductor; CUDA graphs where
    torch takes the step into one). A compiled step compares nothing (it cannot read
    back): a load between compiled steps is declared by reload_model_params()."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        assert_same_bits(*captured_and_eager("cuda", POLICIES[policy],
                                             Compiled(mode="reduce-overhead")))
    finally:
        torch._dynamo.reset()
    # (whether inductor took the step into a CUDA graph: the log says, the bits hold)
    skips = dict(counters["inductor"])
    if any("cudagraph" in key for key in skips):
        warnings.warn(f"reduce-overhead, {policy}: inductor's CUDA graph counters {skips}")
