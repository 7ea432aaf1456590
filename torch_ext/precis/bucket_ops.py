"""torch.ops.precis.{cast_, scale_, count_nonfinite}: what a gradient bucket needs
around a collective (cast to the wire dtype and back, scale by 1/world, NaN check).

Backed by precis_cast / precis_scale / precis_count_nonfinite (CPU) and their
precis_cuda_* twins; the ops are added to the "precis" namespace that ops.py
defines. Tensors are checked here, then C gets pointers, counts and dtype codes.

  cast_(dst, src)                    dst = src converted, rounding to nearest even
  scale_(buf, factor)                buf *= factor in fp32, rounded back (factor finite)
  count_nonfinite(buf) -> Tensor     0-dim int64 on buf's device: NaN/Inf elements
"""

import ctypes

import torch

from . import _lib, ops

SCHEMAS = (  # ops that write an input return nothing (see ops.py)
    "cast_(Tensor(a!) dst, Tensor src) -> ()",
    "scale_(Tensor(a!) buf, float factor) -> ()",
    "count_nonfinite(Tensor buf) -> Tensor",
)

# Kept at module level: dropping the library object would unregister the ops.
_fragment = None


def _arg(t, name, what):
    return _lib.tensor_arg(t, name, ops.DTYPES, what)


def _cast_cpu(dst, src):
    (dptr, n, dcode), (sptr, _, scode) = ops.check_pair(dst, src, "precis.cast_")
    if n > 0:
        _lib.check(_lib.lib().precis_cast(dptr, dcode, sptr, scode, n), "precis.cast_")


def _cast_cuda(dst, src):
    (dptr, n, dcode), (sptr, _, scode) = ops.check_pair(dst, src, "precis.cast_")
    if n > 0:
        ops.cuda_call("precis_cuda_cast", dst.device, "precis.cast_ (CUDA)",
                      dptr, dcode, sptr, scode, n)


def _cast_fake(dst, src):
    ops.check_pair(dst, src, "precis.cast_")


def _scale_cpu(buf, factor):
    ptr, n, code = _arg(buf, "buf", "precis.scale_")
    _lib.check(_lib.lib().precis_scale(ptr, code, factor, n), "precis.scale_")


def _scale_cuda(buf, factor):
    ptr, n, code = _arg(buf, "buf", "precis.scale_")
    ops.cuda_call("precis_cuda_scale", buf.device, "precis.scale_ (CUDA)", ptr, code, factor, n)


def _scale_fake(buf, factor):
    _arg(buf, "buf", "precis.scale_")


def _count_cpu(buf):
    ptr, n, code = _arg(buf, "buf", "precis.count_nonfinite")
    out = ctypes.c_int64(0)
    _lib.check(_lib.lib().precis_count_nonfinite(ptr, code, n, ctypes.byref(out)),
               "precis.count_nonfinite")
    return torch.tensor(out.value, dtype=torch.int64)


def _count_cuda(buf):
    ptr, n, code = _arg(buf, "buf", "precis.count_nonfinite")
    out = torch.zeros((), dtype=torch.int64, device=buf.device)  # the kernel adds to it
    ops.cuda_call("precis_cuda_count_nonfinite", buf.device, "precis.count_nonfinite (CUDA)",
                  ptr, code, n, out.data_ptr())
    return out


def _count_fake(buf):
    _arg(buf, "buf", "precis.count_nonfinite")
    return torch.empty((), dtype=torch.int64, device=buf.device)


def register():
    """Define and implement the ops once per process, however often this is imported."""
    global _fragment
    if _fragment is not None or ops.op_registered("cast_"):
        return
    fragment = ops.new_fragment()
    for schema in SCHEMAS:
        fragment.define(schema)
    for name, cpu, cuda, fake in (("cast_", _cast_cpu, _cast_cuda, _cast_fake),
                                  ("scale_", _scale_cpu, _scale_cuda, _scale_fake),
                                  ("count_nonfinite", _count_cpu, _count_cuda, _count_fake)):
        fragment.impl(name, cpu, "CPU")
        fragment.impl(name, cuda, "CUDA")
        ops.register_fake(fragment, name, fake)
    _fragment = fragment


register()


def cast_(dst, src):
    """dst = src converted to dst's dtype (rounding to nearest even); returns dst.

    Contiguous fp32/bf16/fp16 tensors with the same number of elements on the same
    device; they must not overlap unless they are the same tensor.
    """
    torch.ops.precis.cast_(dst, src)
    return dst


def scale_(buf, factor):
    """buf *= factor in place (product in fp32, rounded back); factor must be finite."""
    torch.ops.precis.scale_(buf, float(factor))
    return buf


def count_nonfinite(buf):
    """Number of NaN/Inf elements of buf, as a 0-dim int64 tensor on buf's device."""
    return torch.ops.precis.count_nonfinite(buf)
