"""The CUDA Adam/AdamW step: torch.ops.precis.adam_step_ on CUDA tensors (the glue's
CUDA kernel, which calls precis_cuda_step of libprecis_cuda.so).

* Bitwise against the CPU kernel (the same op on CPU tensors: precis_step)
  for every dtype combination, at odd sizes, on aligned buffers (vector path) and
  on views starting at element 1 (element-wise path), from a non-zero state (so
  the decoding of fp16/fp8 block-scaled moments runs too). The two kernels share
  rules.h / stores.h and the GPU does not contract into FMAs, so they agree bit for bit
  when the CPU takes IEEE sqrt too (PRECIS_CPU_SQRT=ieee, set for this module:
  by default the CPU op takes torch's MKL sqrt, as torch's CPU AdamW does).
* Against Adam in float64, with the tolerances test_optim_reference.py derives.
* Many tensors per call (several launches), empty tensors, a tensor over 2^31
  elements (64-bit indexing).
* CUDA graphs: a step captured once and replayed with a changing lr (device
  tensors for lr and step) equals the eager steps.
* check_finite / found_inf: a NaN/Inf gradient anywhere in the call modifies
  nothing, over several dtype combinations too, without a host round trip.
* Argument checks of the C entry point under its old name precis_cuda_adam_step (an
  alias of precis_cuda_step, kept exported), called through ctypes
  (struct mirrors in c_abi.py): these need libprecis_cuda.so but no GPU, and run
  wherever it is built (they skip, saying why, where it is not); those of the op
  need a GPU.

Every other test but test_big_tensor_float64_reference's CPU variant needs a CUDA
device and skips without one.
"""
import ctypes
import warnings

import pytest
import torch

import c_abi
import precis  # noqa: F401  (loads the package, registers the ops)
from precis import _lib, ops, optim
from adam_reference import make_grads, master_tol, moment_tol, reference

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8
MOMENTS = [F32, F16, BF16, FP8]
NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16", FP8: "fp8"}
# (param dtype, master): "own" = the param is its own master ("sr": bf16 with
# stochastic rounding), "remainders" = bf16 + int16 remainders, "remainders8" = bf16 +
# 8-bit remainders (a 24-bit master).
MASTERS = [(F32, "own"), (F16, "fp32"), (F16, "own"), (BF16, "fp32"), (BF16, "fp16"),
           (BF16, "sr"), (BF16, "remainders"), (BF16, "remainders8")]
COMBOS = [(pd, ms, m, v) for pd, ms in MASTERS for m in MOMENTS for v in MOMENTS]
SIZES = [1, 127, 4097]
BIG = 1_000_003
BIG_COMBOS = [(F32, "own", F32, F32), (BF16, "fp32", BF16, BF16), (BF16, "sr", FP8, FP8),
              (BF16, "remainders", FP8, F16), (BF16, "remainders8", FP8, FP8),
              (F16, "fp32", F16, F16)]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def ieee_cpu_sqrt(monkeypatch):
    """The CPU op with IEEE sqrt, as the CUDA kernels (read by the glue per call)."""
    monkeypatch.setenv("PRECIS_CPU_SQRT", "ieee")
needs_cuda = pytest.mark.cuda  # skipped without a device (conftest.py)


def combo_id(c):
    pd, ms, m, v = c
    return f"{NAMES[pd]}-{ms}-m_{NAMES[m]}-v_{NAMES[v]}"


def cuda_lib_or_skip():
    """libprecis_cuda.so through ctypes (c_abi.py); loading it needs no GPU."""
    try:
        return c_abi.cuda_lib()
    except _lib.LibraryError as e:
        pytest.skip(f"libprecis_cuda.so not available: {e}")


# ---------------------------------------------------------------------------
# State: built on the CPU with the C library's encoders (precis.optim's), then placed on a device
# ---------------------------------------------------------------------------


def encode_moment(x, dtype, second):
    """fp32 values (CPU) -> (stored, scales) as the kernels keep them (empty scales
    where the dtype has none)."""
    stored, scales = optim.encode_moment(x, dtype, second)
    return stored, torch.empty(0, dtype=F32) if scales is None else scales


def make_tensor_state(pd, master, m_dtype, v_dtype, n, gen, zero_moments=False, amsgrad=False):
    """One param's buffers on the CPU: dict of params, masters, exp_avgs, exp_avg_sqs,
    exp_avg_scales, exp_avg_sq_scales (empty tensors where absent), and with amsgrad
    max_exp_avg_sqs, max_exp_avg_sq_scales (a max above v here, below it there)."""
    p0 = torch.randn(n, generator=gen)
    if master in ("fp32", "fp16"):
        mst = p0.to(F32 if master == "fp32" else F16)
        param = mst.to(pd)
    elif master == "remainders":
        param, mst = optim.remainder_split(p0)
    elif master == "remainders8":
        param, mst = optim.remainder_split(p0, bits=8)
    else:
        param, mst = p0.to(pd), torch.empty(0, dtype=pd)
    if zero_moments:
        m0, v0 = torch.zeros(n), torch.zeros(n)
    else:
        m0 = 0.1 * torch.randn(n, generator=gen)
        v0 = (0.1 * torch.randn(n, generator=gen)) ** 2 * torch.exp(torch.randn(n, generator=gen))
    m, ms = encode_moment(m0, m_dtype, False)
    v, vs = encode_moment(v0, v_dtype, True)
    state = dict(params=param, masters=mst, exp_avgs=m, exp_avg_sqs=v, exp_avg_scales=ms,
                 exp_avg_sq_scales=vs)
    if amsgrad:
        factor = 0.5 + 1.5 * torch.rand(n, generator=gen)
        state["max_exp_avg_sqs"], state["max_exp_avg_sq_scales"] = \
            encode_moment(v0 * factor, v_dtype, True)
    return state


def place(t, device, offset=0):
    """A contiguous copy of t on device whose data starts `offset` elements into its
    allocation (offset 1: misaligned for the vector path)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=t.dtype, device=device)
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
    view = buf[offset:]
    view.copy_(t.reshape(-1))
    return view


def place_state(states, device, offset=0):
    """List of per-param dicts -> dict of lists on device."""
    return {k: [place(s[k], device, offset) for s in states] for k in states[0]}


def bits(t):
    """Integer view, so that NaN payloads and -0.0 compare too."""
    t = t.detach().cpu().contiguous()
    if t.dtype in (F32,):
        return t.view(torch.int32)
    if t.dtype in (F16, BF16):
        return t.view(torch.int16)
    return t


def assert_same_state(a, b, what=""):
    assert a.keys() == b.keys()
    for k in a:
        for i, (x, y) in enumerate(zip(a[k], b[k])):
            assert x.dtype == y.dtype and x.numel() == y.numel(), (what, k, i)
            if not torch.equal(bits(x), bits(y)):
                diff = (bits(x) != bits(y)).nonzero()
                first = int(diff[0]) if diff.numel() else -1
                raise AssertionError(f"{what}: {k}[{i}] differs at {diff.numel()} of {x.numel()} "
                                     f"elements (first {first}: {x.flatten()[first].item()!r} vs "
                                     f"{y.flatten()[first].item()!r})")


def snapshot(state):
    return {k: [t.clone() for t in ts] for k, ts in state.items()}


def op_step(state, grads, steps, seed=0, check_finite=False, inv_grad_scale=1.0, adamw=True,
            maximize=False, lr=None, step_tensor=None, **device_args):
    """torch.ops.precis.adam_step_ on the state's device (the CPU or the CUDA kernel).

    step_tensor: ONE int64 device step shared by every param (steps may then be None).
    Returns found_inf (a tensor, or None when neither given nor needed).
    """
    h = dict(HYPER)
    if lr is not None:
        h["lr"] = lr
    if step_tensor is not None:
        device_args["step_tensors"] = [step_tensor] * len(state["params"])
    if "max_exp_avg_sqs" in state:
        device_args.update(amsgrad=True, max_exp_avg_sqs=state["max_exp_avg_sqs"],
                           max_exp_avg_sq_scales=state["max_exp_avg_sq_scales"])
    return ops.adam_step_(state["params"], grads, state["masters"], state["exp_avgs"],
                          state["exp_avg_sqs"], state["exp_avg_scales"],
                          state["exp_avg_sq_scales"], steps or [], h["lr"], h["beta1"],
                          h["beta2"], h["eps"], h["weight_decay"], adamw=adamw,
                          maximize=maximize, inv_grad_scale=inv_grad_scale,
                          check_finite=check_finite, seed=seed, **device_args)


def skipped(found):
    """The host verdict of a step's found_inf (reading it synchronizes)."""
    return found is not None and float(found.item()) != 0.0


def run_both(states, grads_per_step, offset=0, **kw):
    """The same steps on the CPU kernel and on the GPU; returns both final states."""
    cpu = place_state(states, "cpu", offset)
    gpu = place_state(states, "cuda", offset)
    n = len(states)
    for k, grads in enumerate(grads_per_step, 1):
        found_cpu = op_step(cpu, [place(g, "cpu", offset) for g in grads], [k] * n, **kw)
        found_gpu = op_step(gpu, [place(g, "cuda", offset) for g in grads], [k] * n, **kw)
        assert skipped(found_cpu) == skipped(found_gpu)
    torch.cuda.synchronize()
    return cpu, gpu


# ---------------------------------------------------------------------------
# Bitwise against the CPU kernel
# ---------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_matches_cpu_bitwise(combo, n, offset):
    pd, ms, m, v = combo
    gen = torch.Generator().manual_seed(7919 * n + COMBOS.index(combo))
    states = [make_tensor_state(pd, ms, m, v, n, gen)]
    grads = [[g] for g in make_grads(n, 3, pd, gen)]
    cpu, gpu = run_both(states, grads, offset, seed=12345)
    assert_same_state(cpu, gpu, combo_id(combo))


AMSGRAD_COMBOS = [(pd, ms, F32 if pd == F32 else BF16, v)
                  for pd, ms in [(F32, "own"), (F16, "fp32"), (BF16, "fp32"), (BF16, "remainders"),
                                 (BF16, "sr")] for v in MOMENTS]


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("combo", AMSGRAD_COMBOS, ids=combo_id)
def test_amsgrad_matches_cpu_bitwise(combo, n, offset):
    """amsgrad: the running max (in exp_avg_sq's dtype and scales) and the update
    from it, the CPU kernel's bits."""
    pd, ms, m, v = combo
    gen = torch.Generator().manual_seed(6007 * n + AMSGRAD_COMBOS.index(combo))
    states = [make_tensor_state(pd, ms, m, v, n, gen, amsgrad=True)]
    grads = [[g * 0.1 ** k] for k, g in enumerate(make_grads(n, 3, pd, gen))]  # v falls
    cpu, gpu = run_both(states, grads, offset, seed=777)
    assert_same_state(cpu, gpu, combo_id(combo) + " amsgrad")


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("grad_dtype", [F32, F16, BF16], ids=NAMES.get)
@pytest.mark.parametrize("pm", MASTERS, ids=lambda pm: f"{NAMES[pm[0]]}-{pm[1]}")
def test_grad_dtypes_bitwise(pm, grad_dtype, offset):
    pd, ms = pm
    m = v = F32 if pd != BF16 else BF16
    gen = torch.Generator().manual_seed(31 + MASTERS.index(pm))
    states = [make_tensor_state(pd, ms, m, v, 4097, gen)]
    grads = [[g] for g in make_grads(4097, 3, grad_dtype, gen)]
    cpu, gpu = run_both(states, grads, offset, seed=3)
    assert_same_state(cpu, gpu)


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
@pytest.mark.parametrize("combo", BIG_COMBOS, ids=combo_id)
def test_big_tensor_bitwise(combo, offset):
    pd, ms, m, v = combo
    gen = torch.Generator().manual_seed(99)
    states = [make_tensor_state(pd, ms, m, v, BIG, gen)]
    grads = [[g] for g in make_grads(BIG, 2, pd, gen)]
    cpu, gpu = run_both(states, grads, offset, seed=5)
    assert_same_state(cpu, gpu, combo_id(combo))


@needs_cuda
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("combo", [(F32, "own", F32, F32), (BF16, "fp32", BF16, BF16),
                                   (BF16, "sr", FP8, F16)], ids=combo_id)
def test_variants_bitwise(combo, adamw, maximize):
    pd, ms, m, v = combo
    gen = torch.Generator().manual_seed(5)
    states = [make_tensor_state(pd, ms, m, v, 4097, gen)]
    grads = [[g] for g in make_grads(4097, 3, pd, gen)]
    cpu, gpu = run_both(states, grads, adamw=adamw, maximize=maximize, inv_grad_scale=0.25)
    assert_same_state(cpu, gpu)


def lose(state, where):
    """NaN, Inf and -Inf at `where` in the param (and its master: a remainder of 0)."""
    lost = torch.tensor([float("nan"), float("inf"), -float("inf")])
    state["params"][where] = lost.to(state["params"].dtype)
    if state["masters"].numel():
        state["masters"][where] = lost.to(state["masters"].dtype) \
            if state["masters"].dtype.is_floating_point else 0


def assert_lost_param_step(combo, adamw, devices):
    """Three steps of a param with lost elements on both devices: the same bits, and
    AdamW's moments finite (no L2 term), Adam's L2 ones NaN where the param is (as
    torch's)."""
    pd, ms, m, v = combo
    gen = torch.Generator().manual_seed(11)
    state = make_tensor_state(pd, ms, m, v, 4097, gen)
    lose(state, [0, 2048, 4096])
    grads = [[g] for g in make_grads(4097, 3, pd, gen)]
    a = place_state([state], devices[0])
    b = place_state([state], devices[1])
    for k, gs in enumerate(grads, 1):
        op_step(a, [place(g, devices[0]) for g in gs], [k], adamw=adamw)
        op_step(b, [place(g, devices[1]) for g in gs], [k], adamw=adamw)
    assert_same_state(a, b, combo_id(combo))
    for key, scales, second in (("exp_avgs", "exp_avg_scales", False),
                                ("exp_avg_sqs", "exp_avg_sq_scales", True)):
        stored, sc = a[key][0].cpu(), a[scales][0].cpu()
        values = optim.decode_moment(stored, sc if sc.numel() else None, second)
        assert bool(values.isfinite().all()) == adamw, (key, combo_id(combo))


@needs_cuda
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("combo", [(F32, "own", F32, F32), (BF16, "fp32", BF16, BF16),
                                   (BF16, "remainders8", FP8, FP8)], ids=combo_id)
def test_a_lost_param_steps_as_on_the_cpu(combo, adamw):
    """NaN and Inf param elements: the L2 term is taken only where its weight decay is
    not 0 (rules.h precis_l2), on the GPU as on the CPU."""
    assert_lost_param_step(combo, adamw, ("cpu", "cuda"))


SIZES_MIXED = [0, 1, 5, 127, 128, 129, 255, 256, 257, 1000, 16383, 16384, 16385, 40000, 0, 3]


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset1"])
def test_many_tensors_and_dtype_combinations(offset):
    """More tensors than one launch holds, empty ones among them, and several dtype
    combinations in one call (one C call each, each with its own SR seed)."""
    gen = torch.Generator().manual_seed(11)
    combos = [(BF16, "fp32", BF16, BF16), (BF16, "sr", FP8, FP8), (F32, "own", F16, F32)]
    states, dtypes = [], []
    for i in range(150):
        pd, ms, m, v = combos[i % len(combos)]
        n = SIZES_MIXED[i % len(SIZES_MIXED)] + (i // len(SIZES_MIXED))
        states.append(make_tensor_state(pd, ms, m, v, n, gen))
        dtypes.append(pd)
    grads = [[torch.randn(s["params"].numel(), generator=gen).to(pd)
              for s, pd in zip(states, dtypes)] for _ in range(2)]
    cpu, gpu = run_both(states, grads, offset, seed=77)
    assert_same_state(cpu, gpu)


@needs_cuda
def test_tensor_over_2_31_elements():
    """64-bit element indexing: one fp16 tensor (its own master, bf16 moments) of
    2^31 + 300 elements; its last elements, across the 2^31 boundary, match the
    CPU kernel run on the same values, handed as a slice with its element offset
    (stochastically rounded v draws each element's numbers from its index in the
    whole param)."""
    n = (1 << 31) + 300
    need = n * (2 + 2 + 2 + 2) + (2 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} free")
    dev = "cuda"
    torch.manual_seed(0)
    p = torch.randn(n, device=dev, dtype=F16)
    g = torch.randn(n, device=dev, dtype=F16)
    m = torch.randn(n, device=dev, dtype=BF16).mul_(0.1)
    v = torch.rand(n, device=dev, dtype=BF16).mul_(0.01)
    lo = (1 << 31) - 5000
    before = {k: t[lo:].cpu().clone() for k, t in dict(p=p, g=g, m=m, v=v).items()}
    empty = torch.empty(0, device=dev)
    op_step(dict(params=[p], masters=[torch.empty(0, dtype=F16, device=dev)], exp_avgs=[m],
                 exp_avg_sqs=[v], exp_avg_scales=[empty], exp_avg_sq_scales=[empty]),
            [g], [1])
    torch.cuda.synchronize()
    cpu = dict(params=[before["p"]], masters=[torch.empty(0, dtype=F16)], exp_avgs=[before["m"]],
               exp_avg_sqs=[before["v"]], exp_avg_scales=[torch.empty(0)],
               exp_avg_sq_scales=[torch.empty(0)])
    op_step(cpu, [before["g"]], [1], element_offsets=[lo])
    assert torch.equal(bits(p[lo:]), bits(cpu["params"][0]))
    assert torch.equal(bits(m[lo:]), bits(cpu["exp_avgs"][0]))
    assert torch.equal(bits(v[lo:]), bits(cpu["exp_avg_sqs"][0]))
    del p, g, m, v
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Against Adam in float64 (tolerances of test_optim_reference.py)
# ---------------------------------------------------------------------------

STEPS = 5
BETAS = (HYPER["beta1"], HYPER["beta2"])


def decoded_master(state, pd, master):
    if master in ("fp32", "fp16"):
        return state["masters"][0].cpu().double()
    if master in ("remainders", "remainders8"):
        return optim.remainder_join(state["params"][0], state["masters"][0]).cpu().double()
    return state["params"][0].cpu().double()


def check_against_reference(combo, n, steps, device="cuda"):
    pd, ms, m_dtype, v_dtype = combo
    gen = torch.Generator().manual_seed(1000 * n + 3 + COMBOS.index(combo))
    s = make_tensor_state(pd, ms, m_dtype, v_dtype, n, gen, zero_moments=True)
    p0 = decoded_master(place_state([s], "cpu"), pd, ms)
    grads = make_grads(n, steps, pd, gen)
    gpu = place_state([s], device)
    for k, g in enumerate(grads, 1):
        op_step(gpu, [g.to(device)], [k], seed=9)
    ref_p, ref_m, ref_v, m_max, v_max = reference(p0, grads, HYPER["lr"], BETAS, HYPER["eps"],
                                                  HYPER["weight_decay"])
    got_m = optim.decode_moment(gpu["exp_avgs"][0], gpu["exp_avg_scales"][0], False).cpu().double()
    got_v = optim.decode_moment(gpu["exp_avg_sqs"][0], gpu["exp_avg_sq_scales"][0],
                                True).cpu().double()
    err_m, tol_m = (got_m - ref_m).abs(), moment_tol(m_dtype, m_max, steps, False)
    assert bool((err_m <= tol_m).all()), f"exp_avg: {float((err_m / tol_m).max()):.3g} x tol"
    err_v, tol_v = (got_v - ref_v).abs(), moment_tol(v_dtype, v_max, steps, True)
    assert bool((err_v <= tol_v).all()), f"exp_avg_sq: {float((err_v / tol_v).max()):.3g} x tol"
    got_p = decoded_master(gpu, pd, ms)
    err_p = (got_p - ref_p).abs()
    tol_p = master_tol(pd, ms, m_dtype, v_dtype, p0, ref_p, steps, HYPER["lr"])
    assert bool((err_p <= tol_p).all()), f"master: {float((err_p / tol_p).max()):.3g} x tol"


@needs_cuda
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_matches_float64_reference(combo, n):
    check_against_reference(combo, n, STEPS)


# The combinations test_optim_reference.py runs at this size (3 steps, as there).
REF_BIG_COMBOS = [(F32, "own", F32, F32), (BF16, "fp32", BF16, BF16),
                  (BF16, "remainders", FP8, FP8), (F16, "fp32", F16, F16)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("combo", REF_BIG_COMBOS, ids=combo_id)
def test_big_tensor_float64_reference(combo, device):
    """The CPU variant steps the same inputs on the CPU kernel, which gives the GPU's
    bits: a bound too tight for these inputs fails there too, without a GPU."""
    check_against_reference(combo, BIG, 3, device)


# ---------------------------------------------------------------------------
# CUDA graphs: device lr / step, capture once, replay
# ---------------------------------------------------------------------------

GRAPH_COMBOS = [(F32, "own", F32, F32), (BF16, "fp32", BF16, BF16), (BF16, "sr", BF16, BF16),
                (BF16, "remainders", FP8, F16)]
LRS = [1e-3, 5e-3, 2e-3, 1e-2, 3e-4]
GRAPH_SIZES = [1, 127, 4097, 70001]


@needs_cuda
@pytest.mark.parametrize("combo", GRAPH_COMBOS, ids=combo_id)
def test_cuda_graph_replay_equals_eager(combo):
    pd, ms, m, v = combo
    gen = torch.Generator().manual_seed(2024)
    states = [make_tensor_state(pd, ms, m, v, n, gen) for n in GRAPH_SIZES]
    grads = [[g for g in (make_grads(n, 1, pd, gen)[0] for n in GRAPH_SIZES)]
             for _ in LRS]
    k_n = len(states)
    igs = 0.5

    # 1. eager, host lr and steps
    host = place_state(states, "cuda")
    for k, (lr, gs) in enumerate(zip(LRS, grads), 1):
        op_step(host, [g.cuda() for g in gs], [k] * k_n, lr=lr, inv_grad_scale=igs, seed=4)

    # 2. eager, lr / step / inv_grad_scale in device memory
    dev_state = place_state(states, "cuda")
    lr_t = torch.zeros(1, dtype=torch.float64, device="cuda")
    step_t = torch.zeros(1, dtype=torch.int64, device="cuda")
    igs_t = torch.full((1,), igs, dtype=F32, device="cuda")
    for lr, gs in zip(LRS, grads):
        lr_t.fill_(lr)
        step_t.add_(1)
        op_step(dev_state, [g.cuda() for g in gs], None, lr=123.0, inv_grad_scale=7.0,
                seed=4, lr_tensor=lr_t, step_tensor=step_t, inv_grad_scale_tensor=igs_t)

    # 3. one captured step, replayed
    graph_state = place_state(states, "cuda")
    static_grads = [torch.zeros(n, dtype=pd, device="cuda") for n in GRAPH_SIZES]
    lr_g = torch.zeros(1, dtype=torch.float64, device="cuda")
    step_g = torch.zeros(1, dtype=torch.int64, device="cuda")
    igs_g = torch.full((1,), igs, dtype=F32, device="cuda")
    # Warm up on a scratch copy (loads the library and the kernels outside capture).
    scratch = place_state(states, "cuda")
    op_step(scratch, static_grads, None, seed=4, lr_tensor=lr_g, step_tensor=step_g + 1,
            inv_grad_scale_tensor=igs_g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_g.add_(1)
        op_step(graph_state, static_grads, None, seed=4, lr_tensor=lr_g, step_tensor=step_g,
                inv_grad_scale_tensor=igs_g)
    for lr, gs in zip(LRS, grads):
        for s, g in zip(static_grads, gs):
            s.copy_(g)
        lr_g.fill_(lr)
        graph.replay()
    torch.cuda.synchronize()
    assert int(step_g) == len(LRS)
    assert_same_state(dev_state, graph_state, "graph replay vs eager (device lr/step)")
    assert_same_state(host, dev_state, "device lr/step vs host lr/steps")

    # 4. and the CPU kernel agrees with all of them
    cpu = place_state(states, "cpu")
    for k, (lr, gs) in enumerate(zip(LRS, grads), 1):
        op_step(cpu, gs, [k] * k_n, lr=lr, inv_grad_scale=igs, seed=4)
    assert_same_state(cpu, host, "CPU vs GPU")


# ---------------------------------------------------------------------------
# check_finite / found_inf
# ---------------------------------------------------------------------------

INF_COMBOS = [(BF16, "fp32", BF16, BF16), (BF16, "remainders", FP8, FP8), (F32, "own", F32, F16)]


def inf_setup(n_combos, bad_tensor, bad_value, gen):
    states, dtypes = [], []
    for i in range(12):
        pd, ms, m, v = INF_COMBOS[i % n_combos]
        states.append(make_tensor_state(pd, ms, m, v, [100, 20000, 3, 70001][i % 4], gen))
        dtypes.append(pd)
    grads = [torch.randn(s["params"].numel(), generator=gen).to(pd)
             for s, pd in zip(states, dtypes)]
    if bad_tensor is not None:
        grads[bad_tensor][grads[bad_tensor].numel() // 2] = bad_value
    return states, grads


def gpu_step_is_skipped(states, grads, **kw):
    """One GPU step from the states that must set found_inf and write nothing;
    returns the GPU state."""
    gpu = place_state(states, "cuda")
    before = snapshot(gpu)
    found = op_step(gpu, [g.cuda() for g in grads], [1] * len(states), **kw)
    torch.cuda.synchronize()
    assert float(found.item()) == 1.0
    assert_same_state(before, gpu, "a skipped step wrote")
    return gpu


@needs_cuda
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("n_combos", [1, 3])
def test_check_finite_skips_everything(n_combos, bad_value):
    gen = torch.Generator().manual_seed(8)
    states, grads = inf_setup(n_combos, 11, bad_value, gen)  # the last tensor: checked last
    gpu_step_is_skipped(states, grads, check_finite=True)
    # and so does the CPU kernel, on the same data
    cpu = place_state(states, "cpu")
    assert skipped(op_step(cpu, grads, [1] * len(states), check_finite=True))
    assert_same_state(place_state(states, "cpu"), cpu, "a skipped CPU step wrote")


@needs_cuda
@pytest.mark.parametrize("n_combos", [1, 3])
def test_check_finite_passes_finite_grads(n_combos):
    gen = torch.Generator().manual_seed(9)
    states, grads = inf_setup(n_combos, None, None, gen)
    cpu, gpu = run_both(states, [grads], check_finite=True, inv_grad_scale=0.5)
    assert_same_state(cpu, gpu)


@needs_cuda
def test_external_found_inf_skips():
    """A found_inf already set (e.g. by a GradScaler) skips the step, no check needed."""
    gen = torch.Generator().manual_seed(10)
    states, grads = inf_setup(3, None, None, gen)
    flag = torch.ones(1, device="cuda")
    gpu = gpu_step_is_skipped(states, grads, found_inf=flag)
    flag.zero_()
    op_step(gpu, [g.cuda() for g in grads], [1] * len(states), found_inf=flag,
            check_finite=True)
    torch.cuda.synchronize()
    assert float(flag.item()) == 0.0
    cpu = place_state(states, "cpu")
    op_step(cpu, grads, [1] * len(states))
    assert_same_state(cpu, gpu)


@needs_cuda
def test_check_finite_in_a_cuda_graph():
    """found_inf zeroed and checked inside the graph: replays skip or step by the data."""
    gen = torch.Generator().manual_seed(12)
    states, grads = inf_setup(3, None, None, gen)
    gpu = place_state(states, "cuda")
    static = [g.cuda() for g in grads]
    flag = torch.zeros(1, device="cuda")
    step_t = torch.zeros(1, dtype=torch.int64, device="cuda")
    lr_t = torch.full((1,), HYPER["lr"], dtype=torch.float64, device="cuda")
    scratch = place_state(states, "cuda")
    op_step(scratch, static, None, check_finite=True, found_inf=flag, lr_tensor=lr_t,
            step_tensor=step_t + 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flag.zero_()
        step_t.add_(1)
        op_step(gpu, static, None, check_finite=True, found_inf=flag, lr_tensor=lr_t,
                step_tensor=step_t)
    before = snapshot(gpu)
    static[4][7] = float("inf")
    graph.replay()
    torch.cuda.synchronize()
    assert float(flag.item()) == 1.0
    assert_same_state(before, gpu, "a skipped replay wrote")
    static[4].copy_(grads[4].cuda())
    step_t.zero_()  # the skipped replay counted a step: undo it, as a caller would
    graph.replay()
    torch.cuda.synchronize()
    assert float(flag.item()) == 0.0
    cpu = place_state(states, "cpu")
    op_step(cpu, grads, [1] * len(states))
    assert_same_state(cpu, gpu)


# ---------------------------------------------------------------------------
# precis.optim on CUDA: the CPU trajectory, CUDA graphs, torch.compile
# ---------------------------------------------------------------------------

OPT_POLICIES = [(F32, None), (BF16, None),
                (BF16, {"exp_avg_dtype": "fp8", "store_param_remainders": True}),
                (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                        "store_param_remainders": True, "param_remainder_bits": 8})]


def mlp(dtype, device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model.to(device=device, dtype=dtype)


def mlp_batch(step, dtype, device):
    gen = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def mlp_loss(model, x, y):
    return ((model(x).float() - y.float()) ** 2).mean()


@needs_cuda
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("dtype,policy", OPT_POLICIES,
                         ids=["fp32", "bf16", "fp8-remainders", "fp8-remainders8"])
def test_optimizer_cuda_follows_the_cpu_trajectory(dtype, policy, amsgrad):
    """Gradients computed on the CPU and stepped on the GPU: the CPU optimizer's bits.
    Then the whole step on the GPU: the same loss curve within a tolerance (only the
    GPU's matmuls differ)."""
    cpu, gpu, grads_from_cpu = mlp(dtype, "cpu"), mlp(dtype, "cuda"), mlp(dtype, "cpu")
    opt_cpu = optim.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.1, policy=policy,
                          amsgrad=amsgrad)
    opt_gpu = optim.AdamW(gpu.parameters(), lr=1e-2, weight_decay=0.1, policy=policy,
                          amsgrad=amsgrad)
    for step in range(12):
        x, y = mlp_batch(step, dtype, "cpu")
        opt_cpu.zero_grad()
        mlp_loss(cpu, x, y).backward()
        opt_cpu.step()
        with torch.no_grad():
            for src, dst in zip(gpu.parameters(), grads_from_cpu.parameters()):
                dst.copy_(src)
        grads_from_cpu.zero_grad()
        mlp_loss(grads_from_cpu, x, y).backward()
        for p, q in zip(gpu.parameters(), grads_from_cpu.parameters()):
            p.grad = q.grad.cuda()
        opt_gpu.step()
    for a, b in zip(cpu.parameters(), gpu.parameters()):
        assert torch.equal(bits(a), bits(b))
        if amsgrad:
            assert torch.equal(bits(opt_cpu.state[a]["max_exp_avg_sq"]),
                               bits(opt_gpu.state[b]["max_exp_avg_sq"]))

    cpu, gpu = mlp(dtype, "cpu", seed=1), mlp(dtype, "cuda", seed=1)
    opt_cpu = optim.AdamW(cpu.parameters(), lr=1e-2, policy=policy)
    opt_gpu = optim.AdamW(gpu.parameters(), lr=1e-2, policy=policy)
    losses = {"cpu": [], "cuda": []}
    for step in range(40):
        for model, opt, dev in ((cpu, opt_cpu, "cpu"), (gpu, opt_gpu, "cuda")):
            x, y = mlp_batch(step % 4, dtype, dev)
            opt.zero_grad()
            loss = mlp_loss(model, x, y)
            loss.backward()
            opt.step()
            losses[dev].append(float(loss))
    # bf16 forward passes round differently on the two devices; the curves agree
    # to within a few percent and both fall.
    tol = 1e-3 if dtype == F32 else 5e-2
    for a, b in zip(losses["cpu"], losses["cuda"]):
        assert abs(a - b) <= tol * max(abs(a), 1e-3), (losses["cpu"], losses["cuda"])
    assert losses["cuda"][-1] < 0.9 * losses["cuda"][0]


@needs_cuda
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
@pytest.mark.parametrize("dtype,policy", OPT_POLICIES,
                         ids=["fp32", "bf16", "fp8-remainders", "fp8-remainders8"])
def test_capturable_optimizer_step_in_a_cuda_graph(dtype, policy, amsgrad):
    """A whole training step (forward, backward, optimizer) captured once and replayed
    with new data and a changing lr equals the same steps taken eagerly."""
    models = {k: mlp(dtype, "cuda") for k in ("eager", "graph")}
    lrs = {k: torch.tensor(1e-2, dtype=torch.float64, device="cuda") for k in models}
    opts = {k: optim.AdamW(m.parameters(), lr=lrs[k], weight_decay=0.1, policy=policy,
                           capturable=True, amsgrad=amsgrad) for k, m in models.items()}
    x_s, y_s = mlp_batch(0, dtype, "cuda")

    def train(k):
        opts[k].zero_grad(set_to_none=True)
        mlp_loss(models[k], x_s, y_s).backward()
        opts[k].step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the optimizer state exists before capture
        for k in models:
            for _ in range(3):
                train(k)
    torch.cuda.current_stream().wait_stream(side)
    opts["graph"].zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp_loss(models["graph"], x_s, y_s).backward()
        opts["graph"].step()
    for step in range(1, 8):
        x, y = mlp_batch(step, dtype, "cuda")
        x_s.copy_(x)
        y_s.copy_(y)
        for k in models:
            lrs[k].fill_(1e-2 / step)
        graph.replay()
        train("eager")
    torch.cuda.synchronize()
    for a, b in zip(models["eager"].parameters(), models["graph"].parameters()):
        assert torch.equal(bits(a), bits(b))
        assert int(opts["graph"].state[b]["step"]) == int(opts["eager"].state[a]["step"]) == 10


@needs_cuda
def test_torch_compile_traces_the_ops():
    """The ops on CUDA tensors in a compiled function (fullgraph: no graph break) write
    what they write eagerly; and a compiled training step with precis.optim matches
    eager."""
    device = "cuda"
    gen = torch.Generator().manual_seed(21)
    n = 4097
    init = [torch.randn(n, generator=gen) for _ in range(2)] + [torch.zeros(n)] * 2

    def fresh():
        p, g, m, v = (t.clone().to(device) for t in init)
        return p, g, m, v, torch.zeros((), dtype=torch.int64, device=device)

    def step_fn(p, g, m, v, step_t, lr_t, flag):
        step_t.add_(1)
        torch.ops.precis.check_finite_([g], flag)
        torch.ops.precis.accumulate_(g, g)
        torch.ops.precis.adam_step_([p], [g], [], [m], [v], [], [], [], 0.0, 0.9, 0.999, 1e-8,
                                    0.1, True, False, 0.5, False, 0, [flag], [lr_t], [],
                                    [step_t], False, [], [], False)
        return p.sum()

    lr_t = torch.tensor(1e-2, dtype=torch.float64, device=device)
    eager = fresh()
    compiled = fresh()
    step_c = torch.compile(step_fn, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        step_fn(*eager, lr_t, torch.zeros(1, device=device))
        step_c(*compiled, lr_t, torch.zeros(1, device=device))
    for a, b in zip(eager, compiled):
        assert torch.equal(bits(a), bits(b))

    models = [mlp(F32, device), mlp(F32, device)]
    opts = [optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = mlp_loss(model, x, y)
        loss.backward()
        opt.step()
        return loss

    compiled_step = torch.compile(train_step, backend="aot_eager")
    for step in range(3):
        x, y = mlp_batch(step, F32, device)
        train_step(models[0], opts[0], x, y)
        compiled_step(models[1], opts[1], x, y)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Argument checks of precis_cuda_adam_step (libprecis_cuda.so without a GPU is
# enough: nothing launches), its structs from c_abi.py
# ---------------------------------------------------------------------------

FAKE = 1 << 20  # a 16-byte aligned address; never dereferenced: every call below fails


def fake_tensors(n=4, **over):
    fields = dict(count=1, param_dtype=_lib.DTYPE_FP32, grad_dtype=_lib.DTYPE_FP32,
                  master_dtype=_lib.DTYPE_FP32, exp_avg_dtype=_lib.DTYPE_FP32,
                  exp_avg_sq_dtype=_lib.DTYPE_FP32,
                  params=(ctypes.c_void_p * 1)(FAKE), grads=(ctypes.c_void_p * 1)(FAKE),
                  exp_avgs=(ctypes.c_void_p * 1)(FAKE), exp_avg_sqs=(ctypes.c_void_p * 1)(FAKE),
                  numels=c_abi.int64_array([n]), steps=c_abi.int64_array([1]))
    fields.update(over)
    return c_abi.adam_tensors(**fields)


def call_cuda(cfg, tensors, dev=None):
    cuda = cuda_lib_or_skip()
    st = cuda.precis_cuda_adam_step(None if cfg is None else ctypes.byref(cfg),
                                    None if tensors is None else ctypes.byref(tensors),
                                    None if dev is None else ctypes.byref(dev), None)
    return st, (cuda.precis_last_error() or b"").decode()


def call_cpu(cfg, tensors, found=True):
    f = ctypes.c_int32(0)
    cpu = c_abi.cpu_lib()
    st = cpu.precis_adam_step(None if cfg is None else ctypes.byref(cfg),
                              None if tensors is None else ctypes.byref(tensors),
                              ctypes.byref(f) if found else None)
    return st, (cpu.precis_last_error() or b"").decode()


BAD_CONFIGS = [dict(lr=-1.0), dict(lr=float("nan")), dict(beta1=1.0), dict(beta2=-0.1),
               dict(eps=-1e-8), dict(weight_decay=float("inf")), dict(inv_grad_scale=0.0),
               dict(decoupled_weight_decay=2), dict(maximize=-1), dict(check_finite=3)]


@pytest.mark.parametrize("bad", BAD_CONFIGS,
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_bad_config_same_message_as_cpu(bad):
    """One validation (csrc/step_args.h) for both kernels: same status, same text."""
    st, msg = call_cuda(c_abi.adam_config(**bad), fake_tensors())
    st_cpu, msg_cpu = call_cpu(c_abi.adam_config(**bad), fake_tensors())
    assert st == st_cpu == _lib.ERR_INVALID_ARGUMENT
    assert msg.startswith("precis_cuda_adam_step: ")
    assert msg.replace("precis_cuda_adam_step", "precis_adam_step") == msg_cpu


@pytest.mark.parametrize("case", ["null_cfg", "null_tensors", "cfg_size", "tensors_size",
                                  "dev_size", "check_finite_no_flag", "bad_dtype",
                                  "illegal_master", "null_numels", "null_steps", "neg_numel",
                                  "null_param", "scales_missing", "scales_extra",
                                  "misaligned", "misaligned_dev"])
def test_argument_errors(case):
    cfg, t, dev = c_abi.adam_config(), fake_tensors(), None
    want = _lib.ERR_NULL_POINTER
    text = None
    if case == "null_cfg":
        cfg, text = None, "cfg is NULL"
    elif case == "null_tensors":
        t, text = None, "tensors is NULL"
    elif case == "cfg_size":
        cfg.size, want, text = 8, _lib.ERR_SIZE_MISMATCH, "PRECIS_STEP_CONFIG_INIT"
    elif case == "tensors_size":
        t.size, want, text = 8, _lib.ERR_SIZE_MISMATCH, "PRECIS_STEP_TENSORS_INIT"
    elif case == "dev_size":
        dev = c_abi.cuda_adam_device_args()
        dev.size, want, text = 8, _lib.ERR_SIZE_MISMATCH, "PRECIS_CUDA_STEP_DEVICE_ARGS_INIT"
    elif case == "check_finite_no_flag":
        cfg.check_finite, text = 1, "dev->found_inf is NULL but cfg->check_finite is 1"
    elif case == "bad_dtype":
        t.exp_avg_dtype, want, text = 17, _lib.ERR_INVALID_DTYPE, "exp_avg_dtype"
    elif case == "illegal_master":
        t.param_dtype, t.master_dtype = _lib.DTYPE_FP32, _lib.DTYPE_INT16
        want, text = _lib.ERR_INVALID_POLICY, "master_dtype int16 with param_dtype fp32"
    elif case == "null_numels":
        t.numels, text = None, "tensors->numels is NULL"
    elif case == "null_steps":
        t.steps, text = None, "tensors->steps is NULL"
    elif case == "neg_numel":
        t.numels, want, text = c_abi.int64_array([-1]), _lib.ERR_INVALID_ARGUMENT, "numels[0]"
    elif case == "null_param":
        t.params, text = (ctypes.c_void_p * 1)(None), "params[0] is NULL"
    elif case == "scales_missing":
        t.exp_avg_dtype, text = _lib.DTYPE_FP8_E4M3, "tensors->exp_avg_scales is NULL"
    elif case == "scales_extra":
        t.exp_avg_sq_scales = (ctypes.c_void_p * 1)(FAKE)
        want, text = _lib.ERR_INVALID_ARGUMENT, "exp_avg_sq_scales must be NULL"
    elif case == "misaligned":
        t.exp_avgs = (ctypes.c_void_p * 1)(FAKE + 2)
        want, text = _lib.ERR_INVALID_ARGUMENT, "exp_avgs[0]"
    elif case == "misaligned_dev":
        dev = c_abi.cuda_adam_device_args(lr=FAKE + 4)
        want, text = _lib.ERR_INVALID_ARGUMENT, "not aligned"
    st, msg = call_cuda(cfg, t, dev)
    assert st == want, msg
    assert msg.startswith("precis_cuda_adam_step: ") and text in msg, msg


def test_device_step_makes_host_steps_optional_and_empty_calls_are_fine():
    # count 0 and all-empty tensors: nothing to launch, OK
    st, msg = call_cuda(c_abi.adam_config(), fake_tensors(count=0))
    assert st == _lib.OK, msg
    st, msg = call_cuda(c_abi.adam_config(), fake_tensors(n=0))
    assert st == _lib.OK, msg
    # with device steps, tensors->steps may be NULL (validation passes; n=0 launches nothing)
    dev = c_abi.cuda_adam_device_args(steps=(ctypes.c_void_p * 1)(FAKE))
    st, msg = call_cuda(c_abi.adam_config(), fake_tensors(n=0, steps=None), dev)
    assert st == _lib.OK, msg
    # ... but each device step pointer of a non-empty tensor must be valid
    for ptr, text in ((None, "dev->steps[0] is NULL"), (FAKE + 4, "not 8-byte aligned")):
        dev = c_abi.cuda_adam_device_args(steps=(ctypes.c_void_p * 1)(ptr))
        st, msg = call_cuda(c_abi.adam_config(), fake_tensors(steps=None), dev)
        assert st != _lib.OK and text in msg, msg


def test_check_finite_entry_point_errors():
    cuda = cuda_lib_or_skip()
    t = fake_tensors()
    assert cuda.precis_cuda_adam_check_finite(ctypes.byref(t), None, None) == _lib.ERR_NULL_POINTER
    assert b"found_inf is NULL" in cuda.precis_last_error()
    assert cuda.precis_cuda_adam_check_finite(None, FAKE, None) == _lib.ERR_NULL_POINTER
    t.grads = (ctypes.c_void_p * 1)(FAKE + 1)
    assert cuda.precis_cuda_adam_check_finite(ctypes.byref(t), FAKE, None) == \
        _lib.ERR_INVALID_ARGUMENT
    t = fake_tensors(n=0)
    assert cuda.precis_cuda_adam_check_finite(ctypes.byref(t), FAKE, None) == _lib.OK


@needs_cuda
def test_op_argument_errors():
    """The glue checks devices, counts and flags before it calls C: RuntimeError with
    the precis message, and nothing written."""
    p = torch.zeros(4, device="cuda")
    g = torch.ones(4, device="cuda")
    hyper = list(HYPER.values())
    cases = [
        (dict(grads=[torch.ones(4)]), "precis.adam_step_: grads[0] is on cpu but params[0] is "
                                      "on cuda:0"),
        (dict(steps=[]), "steps has 0 entries but params has 1"),
        (dict(check_finite=True, found_inf=torch.zeros(1)),
         "found_inf is on cpu but params[0] is on cuda:0"),
        (dict(lr_tensor=torch.ones(1, dtype=torch.float64)),
         "lr_tensor is on cpu but params[0] is on cuda:0"),
        (dict(lr_tensor=torch.ones(2, dtype=torch.float64, device="cuda")),
         "lr_tensor must hold one float64 value, got 2"),
        (dict(lr_tensor=torch.ones(1, dtype=torch.int32, device="cuda")),
         "lr_tensor must hold one float64 or float32 value, got int32"),
    ]
    for over, text in cases:
        kw = dict(grads=[g], steps=[1], check_finite=False, found_inf=None, lr_tensor=None)
        kw.update(over)
        m, v = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
        with pytest.raises(RuntimeError, match="precis.adam_step_: ") as e:
            ops.adam_step_([p], kw["grads"], [], [m], [v], [], [], kw["steps"], *hyper,
                           check_finite=kw["check_finite"], found_inf=kw["found_inf"],
                           lr_tensor=kw["lr_tensor"])
        assert text in str(e.value), (over, str(e.value))
        assert not p.any() and not m.any() and not v.any()


LOAD_POLICIES = {"bf16": None, "fp16-master": {"main_params_dtype": "fp16"},
                 "remainders": {"store_param_remainders": True},
                 "remainders8": {"store_param_remainders": True, "param_remainder_bits": 8}}
LOAD_WRITES = ["none", "one element", "an eighth", "whole load"]


def write_into(p, opt, how, gen):
    """A write into p (the same on either device): one element, every eighth element, or a
    whole load that leaves one element in 100 at its master's rounding."""
    n = p.numel()
    new = (torch.randn(n, generator=gen) * 2).to(BF16)
    flat = p.detach().view(-1)
    if how == "one element":
        flat[n // 2] = new[n // 2].to(flat.device)
    elif how == "an eighth":
        flat[::8] = new[::8].to(flat.device)
    elif how == "whole load":
        keep = torch.arange(n) % 100 == 7
        new[keep] = opt.master_weight(p).view(-1).cpu()[keep].to(BF16)
        flat.copy_(new.to(flat.device))


@needs_cuda
@pytest.mark.parametrize("how", LOAD_WRITES)
@pytest.mark.parametrize("policy", list(LOAD_POLICIES))
def test_loads_on_cuda_match_the_cpu_bitwise(policy, how):
    """A param written between steady steps (the planned step, where the update kernel
    resyncs a flagged param's master itself) gives the CPU step's bits: params, masters
    (or remainders) and the warnings' names, at sizes 1, 127, 4097, 70001, in two
    combinations (weight decay and none)."""
    sizes = [1, 127, 4097, 70001, 300]
    gen = torch.Generator().manual_seed(11)
    start = [(torch.randn(n, generator=gen) * 0.5).to(BF16) for n in sizes]
    opts, params = {}, {}
    for dev in ("cpu", "cuda"):
        params[dev] = [t.clone().to(dev).requires_grad_() for t in start]
        groups = [{"params": params[dev][:3], "weight_decay": 0.1},
                  {"params": params[dev][3:], "weight_decay": 0.0}]
        opts[dev] = optim.AdamW(groups, lr=1e-2, policy=LOAD_POLICIES[policy])
    caught = {}
    for step in range(6):
        grads = [torch.randn(n, generator=gen).to(BF16) for n in sizes]
        wgen = torch.Generator().manual_seed(100 + step)
        for dev in ("cpu", "cuda"):
            if step >= 3:
                wgen.manual_seed(100 + step)
                for i, p in enumerate(params[dev]):
                    if (i + step) % 2 == 0:
                        write_into(p, opts[dev], how, wgen)
            for p, g in zip(params[dev], grads):
                p.grad = g.to(dev)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                opts[dev].step()
                opts[dev].state_dict()  # (the flags read: the warning given now)
            caught.setdefault(dev, []).append(sorted(
                str(w.message) for w in seen
                if issubclass(w.category, optim.StaleMasterWarning)))
        for a, b in zip(params["cpu"], params["cuda"]):
            assert torch.equal(bits(a), bits(b)), (step, a.numel())
            assert torch.equal(bits(opts["cpu"].master_weight(a)),
                               bits(opts["cuda"].master_weight(b))), (step, a.numel())
    assert caught["cpu"] == caught["cuda"]
    assert (how == "none") == all(not c for c in caught["cuda"])
