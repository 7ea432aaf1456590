"""The constants and pure helpers of the ops' arguments, apart from the op wrappers
(ops.py) so that the state modules need no op to read them: torch dtypes as the C ABI's
dtype codes (_lib's DTYPE_*: fp8 state is held in uint8 tensors of m8 / v8 code bytes,
int16 tensors hold the bf16 params' remainders), the dtypes the ops take, the rules'
numbers, block scales' counts, the seed mix, and the flat op's buffers and table
columns."""

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


# A remainder's dtype by its width (Policy.param_remainder_bits): int16, the master's
# low half (exact); uint8, an 8-bit correction (a 24-bit master, read as int8).
REMAINDER_DTYPES = {16: torch.int16, 8: torch.uint8}
REMAINDER_BITS = {dtype: bits for bits, dtype in REMAINDER_DTYPES.items()}

# What the element-wise ops take, on either side.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)


def keeps_block_scales(moments):
    """Whether a Policy or a Layout keeps a moment in fp16 / fp8, with block scales (a
    Policy's momentum_dtype too: the one-state optimizers' moment)."""
    return moments.exp_avg_dtype in SCALED_MOMENT_DTYPES or \
        moments.exp_avg_sq_dtype in SCALED_MOMENT_DTYPES or \
        getattr(moments, "momentum_dtype", None) in SCALED_MOMENT_DTYPES


_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


# The update rules (precis.h's precis_rule_t), by name.
RULES = {"adam": 0, "sgd": 1, "lion": 2, "muon_momentum": 3}


def block_count(n, block):
    """How many blocks of `block` a run of n takes (the last shorter; one for an empty
    run, so that every tensor has an entry): the entries of precis.fingerprint.blocks
    (bytes) and precis.resync_masters_.blocks (elements), as the glue counts them."""
    return max(1, -(-int(n) // int(block)))


def scale_count(numel):
    """precis_scale_count(numel): the fp32 block scales an fp16/fp8 moment of numel
    elements needs (one per _lib.SCALE_BLOCK). Python arithmetic, not a ctypes call, so a
    step traced by torch.compile needs no graph break for it."""
    if numel < 0:
        raise ValueError(f"scale_count: numel is {numel}; must be >= 0")
    return -(-int(numel) // _lib.SCALE_BLOCK)


def mix_seed(*values):
    """A 63-bit seed mixed from non-negative ints (splitmix64 finaliser, chained).

    Deterministic across runs and processes: a param group's seed= made the seed of
    its stochastic rounding (whose numbers follow each param's stream, not its group).
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & _MASK63


# adam_step_flat_'s buffers, in its schema's order, and the columns of its table.
FLAT_BUFFERS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale",
                "max_exp_avg_sq", "max_exp_avg_sq_scale")
(ROW_OFFSET, ROW_SCALE_OFFSET, ROW_NUMEL, ROW_STREAM, ROW_STEP, ROW_ELEMENT_OFFSET,
 ROW_SHAPE_KEY, ROW_DATA) = range(8)
ROW_WIDTH = 8


def shape_key(shape):
    """A shape as one int64, as the flat op's table holds it (flat_table.h's
    pr_shape_key: FNV-1a over 64-bit words, the dim then each size)."""
    h = 14695981039346656037
    for word in (len(shape), *shape):
        h = ((h ^ (word & _MASK64)) * 1099511628211) & _MASK64
    return _signed64(h)


def data_address(tensor):
    """tensor.data_ptr() as the flat op's table holds it: an int64 (an address
    with its top bit set, as tagged pointers have, wraps to a negative value)."""
    return _signed64(tensor.data_ptr())


def _signed64(word):
    return word - (1 << 64) if word >> 63 else word
