"""torch.ops.precis.accumulate_ against torch, bit for bit, and its error cases."""
import ctypes
import functools
import itertools
import os
import subprocess
import sys

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


_CPU_ONLY_CHILD = """
import torch, precis
from precis import ops
precis.accumulate_(torch.zeros(4), torch.ones(4))
ops.cast_(torch.zeros(4, dtype=torch.bfloat16), torch.ones(4))
ops.scale_(torch.ones(4), 2.0)
ops.count_nonfinite(torch.ones(4))
ops.adam_step_([torch.ones(4)], [torch.ones(4)], [], [torch.zeros(4)], [torch.zeros(4)], [], [],
               [1], 1e-3, 0.9, 0.999, 1e-8, 0.0, check_finite=True)
with open("/proc/self/maps") as f:
    print(f.read())
"""


def test_cpu_use_does_not_load_the_cuda_library():
    """libprecis_cuda.so is loaded at the first CUDA tensor only: a fresh process that
    uses every op on CPU tensors maps libprecis.so and the glue, and not it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    maps = subprocess.run([sys.executable, "-c", _CPU_ONLY_CHILD], env=env, check=True,
                          capture_output=True, text=True, timeout=300).stdout
    assert "libprecis.so" in maps and "libprecis_torch.so" in maps
    assert "libprecis_cuda.so" not in maps


def test_meta_tensors():
    """Meta tensors reach the registered fake kernel (shapes only; it checks nothing
    and writes nothing)."""
    dst = torch.empty(10, device="meta", dtype=torch.bfloat16)
    assert torch.ops.precis.accumulate_(dst, torch.empty(10, device="meta")) is None
    assert precis.accumulate_(dst, torch.empty(2, 5, device="meta", dtype=torch.float16)) is dst


def expect_error(dst, src, *parts, call=None):
    """The kernel refuses with RuntimeError("precis.accumulate_: ...") holding every
    part, and leaves dst as it was."""
    before = dst.clone()
    with pytest.raises(RuntimeError) as e:
        (call or torch.ops.precis.accumulate_)(dst, src)
    message = str(e.value)
    assert message.startswith("precis.accumulate_: "), message
    for part in parts:
        assert part in message, (part, message)
    if dst.device.type != "meta":
        assert same_bits(dst, before) if dst.dtype in INT_VIEW else torch.equal(dst, before)


def test_size_mismatch():
    expect_error(torch.randn(8), torch.randn(7), "dst has 8 elements but src has 7")
    expect_error(torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(9),
                 "dst has 8 elements but src has 9")


def test_non_contiguous():
    base = torch.randn(8, 2)
    expect_error(torch.randn(8), base[:, 0], "src must be contiguous")
    dst = torch.randn(4, 4).t()
    expect_error(dst, torch.randn(16), "dst must be contiguous")


SUPPORTED = "; supported: float32, bfloat16, float16"


def test_unsupported_dtypes():
    expect_error(torch.randn(5), torch.ones(5, dtype=torch.int32), "src has dtype ", SUPPORTED)
    expect_error(torch.zeros(5, dtype=torch.int64), torch.randn(5),
                 "dst has dtype int64" + SUPPORTED)
    expect_error(torch.randn(5, dtype=torch.float64), torch.randn(5),
                 "dst has dtype float64" + SUPPORTED)
    expect_error(torch.zeros(5, dtype=torch.uint8), torch.randn(5),
                 "dst has dtype uint8" + SUPPORTED)
    expect_error(torch.randn(5), torch.zeros(5, dtype=torch.int16),
                 "src has dtype int16" + SUPPORTED)


def test_other_device_reaching_the_cpu_kernel():
    """A CPU and a meta tensor dispatch to the (meta) fake kernel; the CPU kernel, reached
    directly, refuses tensors that are not on one device, or not on the CPU, and names them."""
    cpu_kernel = functools.partial(torch.ops.precis.accumulate_.default.redispatch,
                                   torch._C.DispatchKeySet(torch._C.DispatchKey.CPU))
    meta = torch.empty(5, device="meta")
    expect_error(torch.randn(5), meta, "src is on ", " but dst is on cpu", call=cpu_kernel)
    expect_error(meta, torch.randn(5), "src is on cpu but dst is on ", call=cpu_kernel)
    expect_error(meta, meta, "dst is on ", "precis kernels run on cpu and cuda tensors",
                 call=cpu_kernel)


def test_c_rejects_bad_codes_directly():
    # The C entry point checks its own arguments too (status -> PrecisValueError).
    accumulate = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_int64)(("precis_accumulate", _lib.lib()))
    dst, src = torch.zeros(4), torch.ones(4)
    status = accumulate(dst.data_ptr(), _lib.DTYPE_INT16, src.data_ptr(), _lib.DTYPE_FP32, 4)
    with pytest.raises(precis.PrecisValueError) as e:
        _lib.check(status, "accumulate")
    assert e.value.status in (_lib.ERR_INVALID_DTYPE, _lib.ERR_INVALID_ARGUMENT)
    assert str(e.value).startswith("accumulate: ")
    assert torch.equal(dst, torch.zeros(4))


cuda = pytest.mark.cuda  # skipped without a device (conftest.py)


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
    got = dst_cuda.cpu()
    # inf + -inf makes a NaN whose bits are the hardware's (x86: 0xFFC00000, CUDA:
    # 0x7FFFFFFF): where the sum is NaN only NaN-ness is the contract.
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert same_bits(got[~nan], want[~nan])


@cuda
def test_cuda_device_mismatch():
    expect_error(torch.randn(5, device="cuda"), torch.randn(5), "src is on cpu")
    expect_error(torch.randn(5), torch.randn(5, device="cuda"), "dst is on cpu")


@pytest.mark.parametrize("write", [
    lambda dst: precis.accumulate_(dst, torch.ones(4)),
    lambda dst: precis.ops.cast_(dst, torch.ones(4, dtype=torch.bfloat16)),
    lambda dst: precis.ops.scale_(dst, 2.0),
])
def test_a_write_is_seen_by_autograd_as_torchs_in_place_ops(write):
    """The element-wise ops bump the written tensor's version (a graph that saved it
    raises at backward; it gave a gradient of the new values: 8 where torch's 6), refuse a
    tensor requiring grad while grad mode is on (a leaf, or a non-leaf whose gradient
    would be silently wrong) and an inference tensor outside inference mode, as torch's
    in-place ops do, before anything is written."""
    import precis.ops
    a = torch.full((4,), 3.0, requires_grad=True)
    y = a * 1
    s = (y * y).sum()  # saves y
    before = y._version
    with torch.no_grad():
        write(y)
    assert y._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.backward()
    for dst in (torch.zeros(4, requires_grad=True), a * 1):
        kept = dst.detach().clone()
        with pytest.raises(RuntimeError, match="requires grad and grad mode is on"):
            write(dst)
        assert torch.equal(dst.detach(), kept)
    with torch.inference_mode():
        made = torch.full((4,), 0.5)
    with pytest.raises(RuntimeError, match="is an inference tensor"):
        write(made)
    assert torch.equal(made, torch.full((4,), 0.5))
    with torch.inference_mode():
        write(made)  # (inside: allowed, as torch's; no version to bump)
    assert not torch.equal(made, torch.full((4,), 0.5))
    plain = torch.full((4,), 0.5)
    write(plain)  # (a buffer: as before)
    assert not torch.equal(plain, torch.full((4,), 0.5))
