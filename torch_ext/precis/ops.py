"""torch.ops.precis.*: operators backed by the C library through ctypes.

Registered with torch.library, which is available (with the same define/impl
calls) on torch 1.13 and 2.x. Kernels check their tensors in Python, then pass
raw pointers, element counts and dtype codes to C. Every op has a CPU, a CUDA
(libprecis_cuda.so, loaded at the first CUDA call) and a fake kernel (meta
tensors; FakeTensor and torch.compile on torch 2.x). Ops that write their inputs
return nothing, which lets torch.compile functionalize them; the Python wrappers
return the written tensor.
"""

import torch

from . import _lib

NAMESPACE = "precis"
# Kept at module level: dropping the Library object would unregister the ops.
_library = None

# What the element-wise ops (accumulate_ here, cast_ / scale_ / count_nonfinite in
# bucket_ops.py) take, on either side: accumulate_ accepts all nine pairs.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cuda_stream(device):
    """torch's current stream on device, as the cudaStream_t the C entry points take last.

    Call it under torch.cuda.device(device) so the kernel launches on that device.
    """
    return torch.cuda.current_stream(device).cuda_stream


def cuda_call(name, device, what, *args):
    """libprecis_cuda.so's `name`(*args, stream) on device, on torch's current stream
    there; raises for a non-zero status (messages start with `what`)."""
    cuda = _lib.cuda_lib()
    with torch.cuda.device(device):
        _lib.check(getattr(cuda, name)(*args, cuda_stream(device)), what, cuda)


def check_pair(dst, src, what):
    """Checks of a (dst, src) pair of element-wise tensors, before any write: same
    device, same number of elements, contiguous, DTYPES. Returns their tensor_args."""
    if dst.device != src.device:
        raise ValueError(f"{what}: dst is on {dst.device} but src is on {src.device}")
    if dst.numel() != src.numel():
        raise ValueError(f"{what}: dst has {dst.numel()} elements (shape {tuple(dst.shape)}) "
                         f"but src has {src.numel()} (shape {tuple(src.shape)})")
    return _lib.tensor_arg(dst, "dst", DTYPES, what), _lib.tensor_arg(src, "src", DTYPES, what)


def _accumulate_cpu(dst, src):
    (dptr, n, dcode), (sptr, _, scode) = check_pair(dst, src, "precis.accumulate_")
    if n > 0:
        _lib.check(_lib.lib().precis_accumulate(dptr, dcode, sptr, scode, n),
                   "precis.accumulate_")


def _accumulate_cuda(dst, src):
    (dptr, n, dcode), (sptr, _, scode) = check_pair(dst, src, "precis.accumulate_")
    if n > 0:
        cuda_call("precis_cuda_accumulate", dst.device, "precis.accumulate_ (CUDA)",
                  dptr, dcode, sptr, scode, n)


def _accumulate_fake(dst, src):
    check_pair(dst, src, "precis.accumulate_")


def register():
    """Define and implement the ops once per process, however often this is imported."""
    global _library
    if _library is not None or op_registered("accumulate_"):
        return
    library = torch.library.Library(NAMESPACE, "DEF")
    library.define("accumulate_(Tensor(a!) dst, Tensor src) -> ()")
    library.impl("accumulate_", _accumulate_cpu, "CPU")
    library.impl("accumulate_", _accumulate_cuda, "CUDA")
    register_fake(library, "accumulate_", _accumulate_fake)
    _library = library


def accumulate_(dst, src):
    """dst += src in place (sum in fp32, rounded to nearest even into dst's dtype).

    dst and src: contiguous fp32/bf16/fp16 tensors with the same number of
    elements on the same device. Returns dst.
    """
    torch.ops.precis.accumulate_(dst, src)
    return dst


class _Fragment:
    """torch < 2.0: torch.library.Library knows only DEF and IMPL, but the C++
    library behind it has FRAGMENT, which adds ops to a namespace another library
    (the one above) defines."""

    def __init__(self, ns):
        self.m = torch._C._dispatch_library("FRAGMENT", ns, "", __file__, 0)

    def define(self, schema):
        self.m.define(schema, "")

    def impl(self, name, fn, dispatch_key):
        self.m.impl(name, dispatch_key, fn)


def new_fragment():
    """A library fragment that adds more ops to the precis namespace (torch 1.13 and 2.x)."""
    try:
        return torch.library.Library(NAMESPACE, "FRAGMENT")
    except ValueError:  # torch 1.13
        return _Fragment(NAMESPACE)


def op_registered(name):
    """True if torch.ops.precis.<name> exists already (e.g. the module was imported twice)."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
        return True
    except (AttributeError, RuntimeError):  # 1.13 raises RuntimeError for an unknown op
        return False


def register_fake(library, name, fn):
    """fn as the fake kernel of precis::name: checks shapes, dtypes and devices and
    touches no data. Runs for meta tensors, and under FakeTensor / torch.compile."""
    qualname = f"{NAMESPACE}::{name}"
    if hasattr(torch.library, "register_fake"):  # torch >= 2.4
        torch.library.register_fake(qualname, fn, lib=library)
    elif hasattr(torch.library, "impl_abstract"):  # torch 2.2, 2.3
        torch.library.impl_abstract(qualname, fn, lib=library)
    else:
        library.impl(name, fn, "Meta")
