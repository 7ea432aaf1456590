"""torch.ops.precis.resync_masters_ (through precis.ops.resync_masters_) against a
reference written here in torch ops, bit for bit: for a param whose flag in stale is
set, an fp32 master keeps its bits where, rounded to nearest even to the param's
dtype, it is the param's very bits, and takes the param's value elsewhere; every
element takes it when at most max(1, n // 64) elements (and not all) still round
(a whole load); kept = the elements that still rounded. An fp16 master (of bf16 or
fp16 params) the same, its value rounded to the param's dtype, and a rewrite storing
the param's value rounded to nearest even into fp16 (param.to(torch.float16)). int16 /
uint8 remainders
are zeroed (kept 0). A param not flagged: nothing read or written, kept = numel.
And the op's errors, each leaving every buffer as it was."""
import pytest
import torch

from precis import ops

cuda = pytest.mark.cuda  # skipped without a device (conftest.py)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
PARAM_DTYPES = [torch.bfloat16, torch.float16]
SIZES = [1, 127, 4097, 1_000_003]
CASES = ["none", "partial", "whole", "boundary_whole", "boundary_partial", "all_kept"]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.int16: torch.int16, torch.uint8: torch.uint8, torch.float64: torch.int64}


def short(dtype):
    return str(dtype).replace("torch.", "")


def bits(t):
    return t.reshape(-1).view(INT_VIEW[t.dtype])


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(bits(a.cpu()), bits(b.cpu()))


def rounding(master, param):
    """Per element: master rounded to nearest even to param's dtype is param's bits."""
    return bits(master.to(param.dtype)) == bits(param)


def few(n):
    return max(1, n // 64)


def reference(master, param, flag):
    """(the master after the op, kept) from the contract."""
    n = param.numel()
    if not flag:
        return master.clone(), n
    if master.dtype not in (torch.float32, torch.float16):
        return torch.zeros_like(master), 0
    r = rounding(master, param)
    kept = int(r.sum())
    value = param.to(master.dtype)
    if kept != n and kept <= few(n):
        return value, kept
    return torch.where(r, master, value), kept


def random_masters(n, gen):
    """Finite fp32 values over binades that fp16 keeps normal or subnormal."""
    return torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-20, 12, (n,),
                                                                        generator=gen))


def spoiled(master, param_dtype, gen):
    """Params none of which master rounds to: new random values, where one happens to be
    master's rounding, the next value (its last bit flipped)."""
    p = random_masters(master.numel(), gen).to(param_dtype)
    same = rounding(master, p)
    b = bits(p).clone()
    b[same] ^= 1
    return b.view(param_dtype)


def make(n, param_dtype, case, gen, master_dtype=torch.float32):
    """(master, param) of n elements written as case says, and the kept it leads to."""
    master = random_masters(n, gen).to(master_dtype)
    param = master.to(param_dtype, copy=True)  # in sync (fp16 in fp16: not master itself)
    if case in ("none", "all_kept"):
        keep = n
    elif case == "partial":
        idx = torch.randperm(n, generator=gen)[: n // 4]  # none of one element
        param[idx] = spoiled(master[idx], param_dtype, gen)
        keep = n - idx.numel()
    elif case == "whole":
        param = spoiled(master, param_dtype, gen)
        keep = 0
        if n > 64 * 3:  # a load keeps a few values all the same
            param[:: n // 3] = master[:: n // 3].to(param_dtype)
            keep = len(range(0, n, n // 3))
    else:
        keep = min(n, few(n) if case == "boundary_whole" else few(n) + 1)
        param = spoiled(master, param_dtype, gen)
        idx = torch.randperm(n, generator=gen)[:keep]
        param[idx] = master[idx].to(param_dtype)
    # masters that round, moved off the param's value where they still round, so that
    # rewriting one shows
    off = (bits(master) + 1).view(master.dtype)
    keep_off = rounding(master, param) & rounding(off, param)
    master = torch.where(keep_off, off, master)
    assert int(rounding(master, param).sum()) == keep, "the test's data"
    return master, param, keep


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=short)
def test_fp32_masters_match_the_reference(device, case, n, param_dtype):
    check_against_the_reference(device, case, n, param_dtype, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=short)
def test_fp16_masters_match_the_reference(device, case, n, param_dtype):
    check_against_the_reference(device, case, n, param_dtype, torch.float16)


def check_against_the_reference(device, case, n, param_dtype, master_dtype):
    gen = torch.Generator().manual_seed(n * 13 + CASES.index(case) * 2
                                        + PARAM_DTYPES.index(param_dtype)
                                        + (7 if master_dtype == torch.float16 else 0))
    master, param, keep = make(n, param_dtype, case, gen, master_dtype)
    assert master.dtype == master_dtype
    flag = case != "none"
    want, want_kept = reference(master, param, flag)
    assert want_kept == (keep if flag else n)
    whole = flag and keep != n and keep <= few(n)
    if case == "boundary_whole" and n > 1:
        assert whole
    if case in ("boundary_partial", "partial") and n > 4:
        assert not whole
    if whole and keep and not (master_dtype == param_dtype == torch.float16):
        # (an fp16 master of an fp16 param rounds to it only as its very bits: nothing shows)
        assert not same_bits(want, master), "the test's data: a whole load shows"
    m, p = master.to(device, copy=True), param.to(device, copy=True)
    stale = torch.tensor([flag], device=device)  # bool
    kept = ops.resync_masters_([m], [p], stale)
    assert kept.dtype == torch.int64 and kept.device == m.device and kept.shape == (1,)
    assert int(kept[0]) == want_kept
    assert same_bits(m, want)
    assert same_bits(p, param), "params written"
    if flag and want_kept != n:
        assert not same_bits(m, master), "nothing rewritten"
    else:
        assert same_bits(m, master), "rewritten though nothing was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master_dtype,param_dtype",
                         [(torch.int16, torch.bfloat16), (torch.int16, torch.float16),
                          (torch.uint8, torch.bfloat16)],
                         ids=["int16-bf16", "int16-fp16", "uint8-bf16"])
def test_remainders_are_zeroed_only_where_stale(device, master_dtype, param_dtype):
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 127, 0, 4097, 1_000_003, 33]
    flags = [1, 0, 1, 1, 1, 0]
    lo, hi = (-32768, 32768) if master_dtype == torch.int16 else (1, 256)
    masters = [torch.randint(lo, hi, (n,), generator=gen, dtype=master_dtype) for n in sizes]
    for m in masters:
        m[m == 0] = 7  # no zero: a zeroing shows everywhere
    params = [random_masters(n, gen).to(param_dtype) for n in sizes]
    before = [m.clone() for m in masters]
    pbefore = [p.clone() for p in params]
    dm = [m.to(device, copy=True) for m in masters]
    dp = [p.to(device, copy=True) for p in params]
    kept = ops.resync_masters_(dm, dp, torch.tensor(flags, dtype=torch.uint8, device=device))
    assert kept.tolist() == [0 if f else n for f, n in zip(flags, sizes)]
    for i, (m, b, f) in enumerate(zip(dm, before, flags)):
        want, _ = reference(b, pbefore[i], f)
        assert same_bits(m, want), i
        assert same_bits(dp[i], pbefore[i]), i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.float16], ids=short)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=short)
def test_130_tensors_with_mixed_flags(device, param_dtype, master_dtype):
    """130 tensors: on a GPU two launches (128 a launch)."""
    gen = torch.Generator().manual_seed(130 + PARAM_DTYPES.index(param_dtype)
                                        + (3 if master_dtype == torch.float16 else 0))
    masters, params, flags, want, want_kept = [], [], [], [], []
    for i in range(130):
        n = [0, 1, 127, 4097, 64 * 5, 9000][i % 6]
        case = CASES[(i // 6) % len(CASES)]
        m, p, _ = make(n, param_dtype, case, gen, master_dtype) if n else (
            torch.empty(0, dtype=master_dtype), torch.empty(0, dtype=param_dtype), 0)
        flag = i % 4 != 3
        w, k = reference(m, p, flag)
        masters.append(m.to(device, copy=True))
        params.append(p.to(device, copy=True))
        flags.append(flag)
        want.append(w)
        want_kept.append(k)
    kept = torch.full((130,), -1, dtype=torch.int64, device=device)
    out = ops.resync_masters_(masters, params, torch.tensor(flags, device=device), kept)
    assert out is kept
    assert kept.tolist() == want_kept
    for i in range(130):
        assert same_bits(masters[i], want[i]), i
    assert sum(1 for f, k, m in zip(flags, want_kept, masters) if f and k != m.numel()) > 40


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stale_dtype", [torch.bool, torch.uint8], ids=short)
def test_bool_and_uint8_stale(device, stale_dtype):
    gen = torch.Generator().manual_seed(9)
    pairs = [make(500, torch.bfloat16, "partial", gen) for _ in range(3)]
    values = [1, 0, 1] if stale_dtype == torch.bool else [255, 0, 2]  # any nonzero byte
    stale = torch.tensor(values, device=device).to(stale_dtype)
    masters = [m.to(device, copy=True) for m, _, _ in pairs]
    kept = ops.resync_masters_(masters, [p.to(device, copy=True) for _, p, _ in pairs], stale)
    assert kept.tolist() == [pairs[0][2], 500, pairs[2][2]]
    for (m0, p0, _), m, v in zip(pairs, masters, values):
        assert same_bits(m, reference(m0, p0, v)[0])
    assert same_bits(masters[1], pairs[1][0])  # not flagged: untouched
    assert not same_bits(masters[0], pairs[0][0])


@pytest.mark.parametrize("device", DEVICES)
def test_no_tensors(device):
    kept = ops.resync_masters_([], [], torch.zeros(0, dtype=torch.bool, device=device))
    assert kept.shape == (0,) and kept.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_master_edge_values(device):
    """fp16 masters of bf16 params: ties of fp16 -> bf16 (1 + 2^-8 -> 1, 1 + 3 * 2^-8 ->
    1 + 2^-6), and rewrites of bf16 values past fp16's range (-> inf), below its
    subnormals (-> 0, a tie to even) and among them (a tie, up to even), as
    param.to(torch.float16) gives them."""
    m16 = torch.tensor([0x3C04, 0x3C0C, 0x3C05, 0x0000, 0x8000, 0x7BFF, 0x0001, 0x3C00,
                        0x3555, 0x3555, 0x3555, 0x3555, 0x3555, 0x3555, 0x3555, 0x3555],
                       dtype=torch.int32).to(torch.int16).view(torch.float16)
    pb = torch.tensor([0x3F80, 0x3F82, 0x3F81, 0x0000, 0x8000, 0x477F, 0x3380, 0x3F81,
                       0x4780, 0xC780, 0x477F, 0x3300, 0x3340, 0x33C0, 0x8001, 0x387F],
                      dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    r = rounding(m16, pb)
    assert r[:7].tolist() == [True] * 5 + [False, True] and not r[7:].any(), r
    want, want_kept = reference(m16, pb, True)
    assert want_kept == 6
    assert bits(want)[8:].tolist() == [0x7C00, -1024, 0x7BF8, 0, 1, 2, -32768, 0x03FC]
    assert bits(want)[5].item() == 0x7BF8 and bits(want)[7].item() == 0x3C08
    m = m16.to(device, copy=True)
    kept = ops.resync_masters_([m], [pb.to(device)], torch.ones(1, dtype=torch.bool,
                                                                device=device))
    assert int(kept[0]) == want_kept
    assert same_bits(m, want)


# ---- errors ---------------------------------------------------------------------------

def expect_error(masters, params, stale, kept, *parts):
    """RuntimeError("precis.resync_masters_: ...") holding every part; nothing written."""
    before = [m.clone() for m in masters]
    kept_before = kept.clone() if kept is not None else None
    with pytest.raises(RuntimeError) as e:
        ops.resync_masters_(masters, params, stale, kept)
    message = str(e.value)
    assert message.startswith("precis.resync_masters_: "), message
    for part in parts:
        assert part in message, (part, message)
    for m, b in zip(masters, before):
        assert same_bits(m, b), "written on a rejected call"
    if kept is not None:
        assert torch.equal(kept.cpu(), kept_before.cpu()), "kept written on a rejected call"


def stale_pair(device="cpu", n=50):
    """Two bf16 params and their stale masters (a call that went ahead rewrites them)."""
    gen = torch.Generator().manual_seed(3)
    ms, ps = [], []
    for _ in range(2):
        m, p, _ = make(n, torch.bfloat16, "whole", gen)
        ms.append(m.to(device, copy=True))
        ps.append(p.to(device, copy=True))
    return ms, ps


def flags(k=2, device="cpu", dtype=torch.uint8):
    return torch.ones(k, dtype=dtype, device=device)


def sentinel(k=2, device="cpu", dtype=torch.int64):
    return torch.full((k,), -9, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_error_harness_a_good_call_writes(device):  # what the error cases must not do
    ms, ps = stale_pair(device)
    before = [m.clone() for m in ms]
    kept = sentinel(device=device)
    ops.resync_masters_(ms, ps, flags(device=device), kept)
    assert kept.tolist() != [-9, -9]
    assert not same_bits(ms[0], before[0]) and not same_bits(ms[1], before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_error_count_mismatch(device):
    ms, ps = stale_pair(device)
    expect_error(ms, ps[:1], flags(device=device), sentinel(device=device),
                 "masters has 2 tensors but params 1")


@pytest.mark.parametrize("device", DEVICES)
def test_error_numel_mismatch(device):
    ms, ps = stale_pair(device)
    ps[1] = ps[1][:-1]
    expect_error(ms, ps, flags(device=device), sentinel(device=device),
                 "masters[1] has 50 elements but params[1] 49")


@pytest.mark.parametrize("device", DEVICES)
def test_error_mixed_dtypes(device):
    ms, ps = stale_pair(device)
    expect_error(ms, [ps[0], ps[1].half()], flags(device=device), sentinel(device=device),
                 "params[1]", "one dtype each")
    ms2 = [ms[0], ms[1].to(torch.int16)]
    expect_error(ms2, ps, flags(device=device), sentinel(device=device),
                 "masters[1]", "one dtype each")


@pytest.mark.parametrize("device", DEVICES)
def test_error_unsupported_dtypes(device):
    ms, ps = stale_pair(device)
    expect_error([m.double() for m in ms], ps, flags(device=device), sentinel(device=device),
                 "float64", "must be float32, float16, int16 or uint8")
    expect_error(ms, [p.float() for p in ps], flags(device=device), sentinel(device=device),
                 "param_dtype", "must be bf16 or fp16")
    expect_error([torch.ones(50, dtype=torch.uint8, device=device) for _ in ps],
                 [p.half() for p in ps],
                 flags(device=device), sentinel(device=device),
                 "8-bit remainders are of bf16 params")


@pytest.mark.parametrize("device", DEVICES)
def test_error_non_contiguous_master(device):
    ms, ps = stale_pair(device)
    big = torch.zeros(100, device=device)
    big[::2] = ms[1]
    ms[1] = big[::2]
    expect_error(ms, ps, flags(device=device), sentinel(device=device),
                 "masters[1] must be contiguous")
    assert same_bits(big[1::2], torch.zeros(50)), "written between the elements"


@pytest.mark.parametrize("device", DEVICES)
def test_error_stale_dtype_and_length(device):
    ms, ps = stale_pair(device)
    expect_error(ms, ps, flags(device=device, dtype=torch.int32), sentinel(device=device),
                 "stale must hold 2 uint8 values", "int32")
    expect_error(ms, ps, flags(3, device=device), sentinel(device=device),
                 "stale must hold 2 uint8 values", "got 3")
    expect_error(ms, ps, flags(1, device=device, dtype=torch.bool), sentinel(device=device),
                 "stale must hold 2 uint8 values", "got 1")


@pytest.mark.parametrize("device", DEVICES)
def test_error_kept_dtype_and_length(device):
    ms, ps = stale_pair(device)
    expect_error(ms, ps, flags(device=device), sentinel(device=device, dtype=torch.int32),
                 "kept must hold 2 int64 values", "int32")
    expect_error(ms, ps, flags(device=device), sentinel(3, device=device),
                 "kept must hold 2 int64 values", "got 3")


@cuda
def test_error_tensors_on_two_devices():
    ms, ps = stale_pair("cuda")
    expect_error([ms[0], ms[1].cpu()], ps, flags(device="cuda"), sentinel(device="cuda"),
                 "masters[1] is on cpu")
    expect_error(ms, [ps[0].cpu(), ps[1]], flags(device="cuda"), sentinel(device="cuda"),
                 "params[0] is on cpu")
    expect_error(ms, ps, flags(device="cuda"), sentinel(device="cpu"), "kept is on cpu")
    expect_error(ms, ps, flags(device="cpu"), sentinel(device="cpu"), "stale is on cpu")


# ---- the Python users: optim_state's resync_flagged and described ---------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["both_transposed", "master_transposed", "param_transposed"])
def test_resync_flagged_any_strides(device, layout):
    """optim_state.resync_flagged: the op's bits, whatever the two tensors' strides."""
    from precis import optim_state
    gen = torch.Generator().manual_seed(21)
    master, param, keep = make(48 * 40, torch.bfloat16, "partial", gen)
    want, want_kept = reference(master, param, True)
    m2, p2, w2 = (t.view(48, 40) for t in (master, param, want))
    m = m2.t().contiguous().t() if layout != "param_transposed" else m2.clone()
    p = p2.t().contiguous().t() if layout != "master_transposed" else p2.clone()
    m, p = m.to(device), p.to(device)
    assert torch.equal(m.cpu(), m2) and torch.equal(p.cpu(), p2)  # same values, own strides
    kept = optim_state.resync_flagged(m, p, torch.ones(1, dtype=torch.uint8, device=device))
    assert kept.tolist() == [want_kept] and want_kept == keep
    assert same_bits(m.cpu().contiguous(), w2)
    assert same_bits(p.cpu().contiguous(), p2)


def test_described_follows_the_kernels_rule():
    """optim_state.described words what the op decided: a whole load exactly where the
    op rewrote every element (kept <= max(1, n // 64), not n)."""
    from precis import optim_state
    assert optim_state.WHOLE_LOAD == 64  # csrc/resync.h's PR_WHOLE_LOAD
    gen = torch.Generator().manual_seed(4)
    for n in (1, 2, 63, 127, 128, 4097):
        for keep in sorted({0, few(n), few(n) + 1, n - 1, n}):
            if not 0 <= keep <= n:
                continue
            master = random_masters(n, gen)
            param = spoiled(master, torch.bfloat16, gen)
            param[:keep] = master[:keep].to(torch.bfloat16)
            off = (bits(master) + 1).view(torch.float32)
            master = torch.where(rounding(master, param) & rounding(off, param), off, master)
            m = master.clone()
            kept = int(ops.resync_masters_([m], [param], torch.ones(1, dtype=torch.bool))[0])
            assert kept == keep
            words = optim_state.described(kept, n)
            rewritten = int((bits(m) != bits(master)).sum())
            if keep == n:
                assert words == "" and rewritten == 0
            elif words.startswith("a whole load"):
                assert same_bits(m, param.float()), (n, keep, words)
                assert f"{n - kept} of {n} elements written" in words
            else:
                assert words.startswith("a partial write"), words
                assert rewritten == n - keep, (n, keep, words)


@pytest.mark.parametrize("device", DEVICES)
def test_summed_gives_each_runs_sum(device):
    """optim_state.summed (a param's kept from its blocks': one value a param read back):
    the sums of runs of 1, 127, 4097 and 2 int64 values, exactly, against Python's."""
    from precis import optim_state
    gen = torch.Generator().manual_seed(5)
    counts = [1, 127, 4097, 2]
    values = torch.randint(0, 1 << 40, (sum(counts),), generator=gen, dtype=torch.int64)
    want, at = [], 0
    for n in counts:
        want.append(sum(values[at:at + n].tolist()))
        at += n
    got = optim_state.summed(values.to(device), counts)
    assert got.dtype == torch.int64 and got.device.type == device
    assert got.tolist() == want
    assert optim_state.summed(values[:1].to(device), [1]).tolist() == values[:1].tolist()
