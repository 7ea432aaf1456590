"""torch.ops.precis.accumulate_ against torch, bit for bit, and its error cases."""
import itertools

import pytest
import torch

import precis
from precis import _lib

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PAIRS = list(itertools.product(DTYPES, DTYPES))
SIZES = [1, 127, 4097, 1_000_003]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def short(dtype):
    return str(dtype).replace("torch.", "")


def random_values(n, dtype, gen):
    """Normal values across many binades (fp16 subnormals and overflow included)."""
    x = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-28, 18, (n,), generator=gen))
    return x.to(dtype)


def reference(dst, src):
    """The contract: the sum formed in fp32, rounded to nearest even into dst's dtype."""
    return (dst.float() + src.float()).to(dst.dtype)


def same_bits(a, b):
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dst_dtype,src_dtype", PAIRS,
                         ids=[f"{short(d)}+={short(s)}" for d, s in PAIRS])
def test_matches_torch_bitwise(dst_dtype, src_dtype, n):
    gen = torch.Generator().manual_seed(n * 31 + DTYPES.index(dst_dtype) * 3
                                        + DTYPES.index(src_dtype))
    dst = random_values(n, dst_dtype, gen)
    src = random_values(n, src_dtype, gen)
    want = reference(dst, src)
    # torch's own in-place add agrees with that contract for every pair.
    assert same_bits(dst.clone().add_(src), want)
    assert torch.ops.precis.accumulate_(dst, src) is None  # writes dst, returns nothing
    assert same_bits(dst, want)


def test_wrapper_shapes_and_empty():
    dst = torch.ones(3, 4, dtype=torch.bfloat16)
    src = torch.full((12,), 2.0)  # same numel, other shape: fine
    out = precis.accumulate_(dst, src)
    assert out.data_ptr() == dst.data_ptr() and out.shape == (3, 4)
    assert torch.equal(dst, torch.full((3, 4), 3.0, dtype=torch.bfloat16))
    empty = torch.empty(0)
    assert precis.accumulate_(empty, torch.empty(0, dtype=torch.float16)).numel() == 0


def test_cpu_use_does_not_load_the_cuda_library():
    precis.accumulate_(torch.zeros(4), torch.ones(4))
    assert _lib._cuda_lib is None


# torch 1.13 has no AutogradMeta fallthrough, so meta tensors cannot reach a custom op.
TORCH2 = int(torch.__version__.split(".")[0]) >= 2


@pytest.mark.skipif(not TORCH2, reason="meta tensors reach custom ops on torch >= 2")
def test_meta_tensors():
    dst = torch.empty(10, device="meta", dtype=torch.bfloat16)
    assert torch.ops.precis.accumulate_(dst, torch.empty(10, device="meta")) is None
    with pytest.raises(ValueError, match="elements"):
        torch.ops.precis.accumulate_(dst, torch.empty(9, device="meta"))


def expect_error(dst, src, *parts):
    before = dst.clone()
    with pytest.raises(ValueError) as e:
        torch.ops.precis.accumulate_(dst, src)
    for part in parts:
        assert part in str(e.value), (part, str(e.value))
    assert same_bits(dst, before) if dst.dtype in INT_VIEW else torch.equal(dst, before)


def test_size_mismatch():
    expect_error(torch.randn(8), torch.randn(7), "dst has 8 elements", "src has 7")
    expect_error(torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(9),
                 "(2, 4)", "(9,)")


def test_non_contiguous():
    base = torch.randn(8, 2)
    expect_error(torch.randn(8), base[:, 0], "src must be contiguous", "stride")
    dst = torch.randn(4, 4).t()
    expect_error(dst, torch.randn(16), "dst must be contiguous")


def test_unsupported_dtypes():
    expect_error(torch.randn(5), torch.ones(5, dtype=torch.int32),
                 "src has dtype torch.int32", "torch.float32", "torch.bfloat16", "torch.float16")
    expect_error(torch.zeros(5, dtype=torch.int64), torch.randn(5),
                 "dst has dtype torch.int64")
    expect_error(torch.randn(5, dtype=torch.float64), torch.randn(5), "dst has dtype torch.float64")
    expect_error(torch.zeros(5, dtype=torch.uint8), torch.randn(5), "dst has dtype torch.uint8")


def test_different_devices():
    # Meta stands in for a second device on a CPU-only machine; on torch 1.13 the
    # dispatcher cannot route meta tensors, so call the CPU kernel directly there.
    dst = torch.randn(5)
    before = dst.clone()
    call = torch.ops.precis.accumulate_ if TORCH2 else precis.ops._accumulate_cpu
    with pytest.raises(ValueError, match="dst is on cpu but src is on meta"):
        call(dst, torch.empty(5, device="meta"))
    assert torch.equal(dst, before)


def test_c_rejects_bad_codes_directly():
    # The C entry point checks its own arguments too (status -> PrecisValueError).
    dst, src = torch.zeros(4), torch.ones(4)
    status = _lib.lib().precis_accumulate(dst.data_ptr(), _lib.DTYPE_INT16, src.data_ptr(),
                                          _lib.DTYPE_FP32, 4)
    with pytest.raises(precis.PrecisValueError) as e:
        _lib.check(status, "accumulate")
    assert e.value.status in (_lib.ERR_INVALID_DTYPE, _lib.ERR_INVALID_ARGUMENT)
    assert torch.equal(dst, torch.zeros(4))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("n", [1, 4097, 1_000_003])
@pytest.mark.parametrize("dst_dtype,src_dtype", PAIRS,
                         ids=[f"{short(d)}+={short(s)}" for d, s in PAIRS])
def test_cuda_matches_cpu(dst_dtype, src_dtype, n):
    gen = torch.Generator().manual_seed(n)
    dst = random_values(n, dst_dtype, gen)
    src = random_values(n, src_dtype, gen)
    want = reference(dst, src)
    dst_cuda = dst.cuda()
    torch.ops.precis.accumulate_(dst_cuda, src.cuda())
    assert same_bits(dst_cuda.cpu(), want)


@cuda
def test_cuda_device_mismatch():
    expect_error(torch.randn(5, device="cuda"), torch.randn(5), "cuda", "cpu")
