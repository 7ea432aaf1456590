"""torch.ops.precis.cast_ / scale_ / count_nonfinite (the bucket ops precis.ddp uses
around collectives, through precis.ops) against torch, bit for bit, and their error
cases: the C kernel refuses a bad argument with RuntimeError("precis.<op>: ...")
naming it, before writing anything."""
import ctypes
import itertools

import pytest
import torch

from precis import _lib, ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PAIRS = list(itertools.product(DTYPES, DTYPES))
SIZES = [1, 4097, 300_001]  # the last spans several OpenMP chunks
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def short(dtype):
    return str(dtype).replace("torch.", "")


def random_values(n, dtype, gen, specials=True):
    """Normal values across many binades (fp16 subnormals and overflow included),
    with some NaN and +-Inf."""
    x = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-28, 18, (n,), generator=gen))
    if specials and n > 10:
        idx = torch.randint(0, n, (max(1, n // 50),), generator=gen)
        x[idx[0::3]] = float("nan")
        x[idx[1::3]] = float("inf")
        x[idx[2::3]] = float("-inf")
    return x.to(dtype)


def same_values(a, b):
    """Bitwise equal, except that any NaN matches any NaN (payloads may differ)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    a, b = a.clone(), b.clone()
    a[nan_a] = 0
    b[nan_b] = 0
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dst_dtype,src_dtype", PAIRS,
                         ids=[f"{short(d)}<-{short(s)}" for d, s in PAIRS])
def test_cast_matches_torch(dst_dtype, src_dtype, n):
    gen = torch.Generator().manual_seed(n + 7 * DTYPES.index(dst_dtype) + DTYPES.index(src_dtype))
    src = random_values(n, src_dtype, gen)
    dst = torch.empty(n, dtype=dst_dtype)
    out = ops.cast_(dst, src)
    assert out.data_ptr() == dst.data_ptr()
    # torch rounds to nearest even through fp32 too (bf16 <-> fp16 is exact in fp32).
    assert same_values(dst, src.float().to(dst_dtype))
    if dst_dtype == src_dtype:  # a copy, NaN payloads included
        assert torch.equal(dst.view(INT_VIEW[dst_dtype]), src.view(INT_VIEW[src_dtype]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=short)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, -3.0, 0.0])
def test_scale_matches_torch(dtype, n, factor):
    gen = torch.Generator().manual_seed(n + DTYPES.index(dtype))
    buf = random_values(n, dtype, gen)
    # The product in fp32 (factor as an fp32 number), rounded once.
    want = (buf.float() * torch.tensor(factor, dtype=torch.float32)).to(dtype)
    out = ops.scale_(buf, factor)
    assert out.data_ptr() == buf.data_ptr()
    assert same_values(buf, want)


def test_scale_by_one_keeps_bits():
    gen = torch.Generator().manual_seed(3)
    buf = random_values(5000, torch.bfloat16, gen)
    before = buf.clone()
    ops.scale_(buf, 1.0)
    assert torch.equal(buf.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=short)
def test_count_nonfinite(dtype, n):
    gen = torch.Generator().manual_seed(n + 11 * DTYPES.index(dtype))
    buf = random_values(n, dtype, gen)
    count = ops.count_nonfinite(buf)
    assert count.dtype == torch.int64 and count.dim() == 0 and count.device == buf.device
    assert int(count) == int((~torch.isfinite(buf)).sum())


def test_count_nonfinite_edges():
    assert int(ops.count_nonfinite(torch.empty(0))) == 0
    big = torch.tensor([torch.finfo(torch.float16).max, 6e-8, -0.0], dtype=torch.float16)
    assert int(ops.count_nonfinite(big)) == 0
    assert int(ops.count_nonfinite(torch.tensor([1e39], dtype=torch.float32))) == 1
    assert int(ops.count_nonfinite(torch.tensor([70000.0]).half())) == 1  # overflowed


def test_shapes_and_empty():
    dst = torch.zeros(3, 4, dtype=torch.bfloat16)
    ops.cast_(dst, torch.full((12,), 2.5))  # same numel, other shape: fine
    assert torch.equal(dst, torch.full((3, 4), 2.5, dtype=torch.bfloat16))
    ops.scale_(dst, 2.0)
    assert torch.equal(dst, torch.full((3, 4), 5.0, dtype=torch.bfloat16))
    assert ops.cast_(torch.empty(0), torch.empty(0, dtype=torch.float16)).numel() == 0
    assert ops.scale_(torch.empty(0, dtype=torch.float16), 3.0).numel() == 0


def test_same_tensor_cast_is_a_no_op():
    x = torch.randn(100)
    before = x.clone()
    ops.cast_(x, x)
    assert torch.equal(x, before)


def expect_error(fn, *parts, unchanged=None):
    """fn() raises RuntimeError whose message holds every part; `unchanged` keeps
    its bits."""
    before = None if unchanged is None else unchanged.clone()
    with pytest.raises(RuntimeError) as e:
        fn()
    message = str(e.value)
    for part in parts:
        assert part in message, (part, message)
    if unchanged is not None:
        assert torch.equal(unchanged.view(INT_VIEW[unchanged.dtype]),
                           before.view(INT_VIEW[before.dtype]))
    return message


def test_cast_errors():
    dst = torch.zeros(8)
    expect_error(lambda: ops.cast_(dst, torch.randn(7)),
                 "precis.cast_: dst has 8 elements but src has 7", unchanged=dst)
    expect_error(lambda: ops.cast_(dst, torch.randn(8, 2)[:, 0]),
                 "precis.cast_: src must be contiguous", unchanged=dst)
    expect_error(lambda: ops.cast_(dst, torch.ones(8, dtype=torch.int32)),
                 "precis.cast_: src has dtype int32; supported: float32, bfloat16, float16",
                 unchanged=dst)
    expect_error(lambda: ops.cast_(torch.zeros(8, dtype=torch.float64), torch.randn(8)),
                 "precis.cast_: dst has dtype float64")
    # Overlapping buffers of different dtypes: C refuses (PRECIS_ERR_INVALID_ARGUMENT).
    buf = torch.ones(16, dtype=torch.bfloat16)
    expect_error(lambda: ops.cast_(buf.view(torch.float16), buf), "precis.cast_: ",
                 "dst and src overlap", "[invalid argument]", unchanged=buf)
    # Partly overlapping views of one buffer, same dtype: refused too.
    expect_error(lambda: ops.cast_(buf[:8], buf[4:12]), "dst and src overlap", unchanged=buf)


def test_scale_errors():
    buf = torch.ones(4, dtype=torch.float16)
    # NaN, Inf, and a double that overflows the fp32 factor the kernel multiplies by.
    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"),
                       (1e39, "1e+39")):
        expect_error(lambda: ops.scale_(buf, bad),
                     f"precis.scale_: factor is {shown}; must be finite as a float32",
                     unchanged=buf)
    expect_error(lambda: ops.scale_(torch.ones(4, dtype=torch.uint8), 2.0),
                 "precis.scale_: buf has dtype uint8")
    expect_error(lambda: ops.scale_(torch.ones(4, 4).t(), 2.0),
                 "precis.scale_: buf must be contiguous")


def test_count_errors():
    expect_error(lambda: ops.count_nonfinite(torch.ones(4, dtype=torch.int16)),
                 "precis.count_nonfinite: buf has dtype int16")
    expect_error(lambda: ops.count_nonfinite(torch.ones(4, 4).t()),
                 "precis.count_nonfinite: buf must be contiguous")


def test_c_checks_its_own_arguments():
    """The C entry points under the kernels refuse bad arguments by themselves."""
    lib = ctypes.CDLL(_lib.lib().precis_path)  # a handle of its own: prototypes below
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.precis_cast.argtypes = [ptr, _lib.c_dtype, ptr, _lib.c_dtype, i64]
    lib.precis_scale.argtypes = [ptr, _lib.c_dtype, ctypes.c_float, i64]
    lib.precis_count_nonfinite.argtypes = [ptr, _lib.c_dtype, i64, ptr]
    lib.precis_last_error.restype = ctypes.c_char_p
    for fn in (lib.precis_cast, lib.precis_scale, lib.precis_count_nonfinite):
        fn.restype = _lib.c_status
    x = torch.zeros(4)
    status = lib.precis_cast(x.data_ptr(), _lib.DTYPE_FP8_E4M3, x.data_ptr(), _lib.DTYPE_FP32, 4)
    assert status == _lib.ERR_INVALID_DTYPE
    assert b"dst_dtype" in lib.precis_last_error()
    assert lib.precis_scale(None, _lib.DTYPE_FP32, 2.0, 4) == _lib.ERR_NULL_POINTER
    assert lib.precis_scale(x.data_ptr(), _lib.DTYPE_FP32, float("nan"), 4) \
        == _lib.ERR_INVALID_ARGUMENT
    assert lib.precis_count_nonfinite(x.data_ptr(), _lib.DTYPE_FP32, 4, None) \
        == _lib.ERR_NULL_POINTER
    assert lib.precis_cast(x.data_ptr(), _lib.DTYPE_FP32, x.data_ptr(), _lib.DTYPE_FP32, -1) \
        == _lib.ERR_INVALID_ARGUMENT


def test_meta_tensors():
    """Meta tensors reach the fake kernels (what torch.compile traces with): shapes,
    dtypes and devices only, nothing checked or written."""
    dst = torch.empty(10, device="meta", dtype=torch.bfloat16)
    assert torch.ops.precis.cast_(dst, torch.empty(10, device="meta")) is None
    assert torch.ops.precis.scale_(dst, 0.5) is None
    assert ops.cast_(dst, torch.empty(2, 5, device="meta")) is dst
    count = torch.ops.precis.count_nonfinite(dst)
    assert count.device.type == "meta" and count.dtype == torch.int64 and count.dim() == 0


cuda = pytest.mark.cuda  # skipped without a device (conftest.py)


@cuda
@pytest.mark.parametrize("n", [1, 4097, 1_000_003])
@pytest.mark.parametrize("dst_dtype,src_dtype", PAIRS,
                         ids=[f"{short(d)}<-{short(s)}" for d, s in PAIRS])
def test_cuda_cast_matches_cpu(dst_dtype, src_dtype, n):
    gen = torch.Generator().manual_seed(n)
    src = random_values(n, src_dtype, gen)
    want = torch.empty(n, dtype=dst_dtype)
    ops.cast_(want, src)
    got = torch.empty(n, dtype=dst_dtype, device="cuda")
    ops.cast_(got, src.cuda())
    assert same_values(got.cpu(), want)


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=short)
def test_cuda_scale_and_count_match_cpu(dtype):
    gen = torch.Generator().manual_seed(5)
    buf = random_values(1_000_003, dtype, gen)
    gpu = buf.cuda()
    ops.scale_(buf, 1 / 3)
    ops.scale_(gpu, 1 / 3)
    assert same_values(gpu.cpu(), buf)
    count = ops.count_nonfinite(gpu)
    assert count.device.type == "cuda"
    assert int(count) == int(ops.count_nonfinite(buf))


@cuda
def test_cuda_errors():
    x = torch.ones(8, device="cuda")
    expect_error(lambda: ops.cast_(x, torch.ones(8)),
                 "precis.cast_: src is on cpu but dst is on cuda:0", unchanged=x)
    expect_error(lambda: ops.scale_(x, float("nan")), "precis.scale_: factor is nan")
    expect_error(lambda: ops.cast_(x.view(torch.float16)[:8], x.view(torch.float16)[4:12]),
                 "precis.cast_: ", "dst and src overlap")
