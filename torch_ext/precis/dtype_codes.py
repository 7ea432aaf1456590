"""torch dtypes as the C ABI's dtype codes (_lib's DTYPE_*): fp8 state is held in uint8
tensors (m8 / v8 code bytes), int16 tensors hold the bf16 param remainders."""

import torch

from . import _lib

TORCH_TO_CODE = {
    torch.float32: _lib.DTYPE_FP32,
    torch.float16: _lib.DTYPE_FP16,
    torch.bfloat16: _lib.DTYPE_BF16,
    torch.uint8: _lib.DTYPE_FP8_E4M3,
    torch.int16: _lib.DTYPE_INT16,
}
CODE_TO_TORCH = {v: k for k, v in TORCH_TO_CODE.items()}
# Moment dtypes stored with fp32 block scales (one per _lib.SCALE_BLOCK elements).
SCALED_MOMENT_DTYPES = (torch.float16, torch.uint8)


def torch_to_code(dtype):
    try:
        return TORCH_TO_CODE[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"precis: no precis dtype for {dtype!r}; supported: "
                         f"{', '.join(str(d) for d in TORCH_TO_CODE)}") from None


def code_to_torch(code):
    try:
        return CODE_TO_TORCH[code]
    except KeyError:
        raise ValueError(f"precis: invalid dtype code {code!r}") from None
