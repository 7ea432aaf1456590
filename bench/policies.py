"""The precis policies the CPU benchmarks time, by the names their tables print:
name -> (param and grad dtype, precis.optim policy overrides)."""
import torch

FP8 = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
FP16 = {"exp_avg_dtype": "fp16", "exp_avg_sq_dtype": "fp16"}
REMAINDERS = {"store_param_remainders": True}

POLICIES = {
    "fp32": (torch.float32, {}),
    "bf16 default": (torch.bfloat16, {}),
    "bf16 remainders": (torch.bfloat16, REMAINDERS),
    "bf16 fp8 moments": (torch.bfloat16, FP8),
    "fp8 + remainders": (torch.bfloat16, {**FP8, **REMAINDERS}),
    "bf16 fp16 moments": (torch.bfloat16, FP16),
    "fp8 + 8-bit remainders": (torch.bfloat16, {**FP8, **REMAINDERS, "param_remainder_bits": 8}),
    # layouts without a fused kernel of their own (the generic, staged one)
    "fp32 bf16 moments": (torch.float32, {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}),
    "fp32 fp8 moments": (torch.float32, FP8),
}
