"""Gradient sums wider than the wire: the policy's grad_sum_dtype fp32 with a 16-bit
grad_comm_dtype (Megatron-FSDP's "low-precision communication, high-precision
reduction"; docs/design.md section 5).

An all-reduce or a reduce-scatter adds in the wire's dtype: over W ranks a bf16
gradient is rounded W - 1 times, and the error grows with W. Here the 16-bit chunks
go all-to-all instead (chunk r of every rank to rank r: the bytes a reduce-scatter
sends) and each rank adds the W copies of its own chunk in fp32, in rank order (the
same bits on every rank and at every overlap), for one rounding at the end.
precis.ddp (all-reduce: these sums, then an all-gather of the rounded chunks;
reduce-scatter: these sums) and precis.fsdp (FSDP2's reduce-scatter) call it.
"""
import torch
import torch.distributed as dist

from . import ops


def start_chunk_sum(t, group, sum_dtype, scale):
    """Start summing the group's copies of this rank's chunk of t (t.numel() a
    multiple of the group size; chunk r is t's r-th equal part). Returns the
    collective's Work and finish(): once the Work is done, finish() gives
    scale * the sum as a fresh sum_dtype tensor of one chunk."""
    world = dist.get_world_size(group)
    if t.numel() % world:
        raise ValueError(f"precis gradient sums: {t.numel()} elements do not split into "
                         f"{world} equal chunks")
    chunk = t.numel() // world
    received = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    work = dist.all_to_all_single(received, t.reshape(-1), group=group, async_op=True)

    def finish():
        copies = received.view(world, chunk)
        # rank 0's copy converts exactly (16 bits into a wider sum), then the rest in
        # rank order: one pass less than adding into zeros, the same bits
        total = ops.cast_(torch.empty(chunk, dtype=sum_dtype, device=t.device), copies[0])
        for copy in copies[1:]:
            ops.accumulate_(total, copy)
        ops.scale_(total, scale)
        return total
    return work, finish


class FSDPReduceScatter:
    """FSDP2's reduce-scatter (FSDPModule.set_custom_reduce_scatter) with the sums in
    sum_dtype: FSDP2 hands over the wire-dtype input and output, and an op of SUM or
    AVG (its own choice by dtype and backend; a gradient divide factor set by hand
    becomes a PREMUL_SUM, whose factor torch does not expose, and is refused)."""

    def __init__(self, sum_dtype):
        self.sum_dtype = sum_dtype

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = dist.get_world_size(group)
        if op == dist.ReduceOp.SUM:
            scale = 1.0
        elif op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        else:
            raise ValueError(f"precis.fsdp: grad_sum_dtype {self.sum_dtype} sums FSDP2's "
                             f"SUM and AVG reduce-scatters, not {op}; drop the gradient "
                             f"divide factor, or set grad_sum_dtype to grad_comm_dtype")
        work, finish = start_chunk_sum(input_tensor, group, self.sum_dtype, scale)
        work.wait()
        ops.cast_(output_tensor, finish())
        return None
