"""precis.ddp: data parallelism with gradient buckets in the policy's dtypes, and the
distributed (sharded) optimizer (docs/design.md section 5).

    dist.init_process_group("gloo")            # or "nccl"; launched with torchrun
    model = precis.ddp.DistributedDataParallel(model, sharding="optim")
    opt = precis.optim.AdamW(model.parameters(), lr=1e-3)
    precis.ddp.attach_optimizer(opt)           # once, before the first step
    for batch in data:
        for micro in batch[:-1]:
            with model.no_sync():
                model(micro).backward()
        model(batch[-1]).backward()
        opt.step()
        opt.zero_grad()

Gradient buffers. The params of the wrapped module are grouped by (param dtype,
main_grads_dtype, grad_comm_dtype, device), the dtypes coming from the precision
policy (`policy` as in precis.optim: None = the defaults for each param's dtype, so
a bf16 model gets a bf16 buffer; a mapping of overrides; or a precis.Policy). Each
group has one contiguous buffer in main_grads_dtype and every param gets
`param.main_grad`, a view into it. A hook after gradient accumulation adds
`param.grad` into `main_grad` (torch.ops.precis.accumulate_) and frees `param.grad`.
The buffer is cut into buckets of about `bucket_size` elements (default 40M, as in
Megatron-LM), in reverse order of the params (the order backward produces grads).

Reduction. On the last micro-batch (outside no_sync()), a bucket is reduced as soon
as all its params have their gradient, asynchronously, while backward goes on:
cast into a temporary buffer in grad_comm_dtype if that differs from
main_grads_dtype, scaled by 1/world once (in the wider of the two dtypes), then
all-reduced (no_shard) or reduce-scattered (optim, optim_grads) and cast back (with
the policy's grad_sum_dtype fp32 and a 16-bit wire, the buckets are padded to a
multiple of the world and the sums are taken in fp32 instead: precis.grad_sums). The
end of backward waits for everything (finish_grad_sync(), also callable by hand),
so after loss.backward() the gradients are synchronized, as with torch's DDP.
Buckets are launched in a fixed order, the same on every rank. With a world of one
process nothing is communicated.

Sharding strategies (Megatron-FSDP's names): `sharding` is a precis.ddp.Sharding,
or its name as a string (from a command line or YAML; case is ignored, anything
else raises ValueError naming the accepted names). Code asks the value what it
does (shards_optimizer_state, shards_grads, reduces_every_micro_batch, ...).

  no_shard     all-reduce; every rank steps the whole model.
  optim        reduce-scatter; the params live in one contiguous buffer per group,
               each bucket padded to a multiple of the world size and split into
               equal shards (with fp16 / fp8 moments in the policy, params and
               shards start at multiples of their 128-element scale blocks); rank
               r keeps optimizer state (master weights, moments) only for shard r
               of every bucket, steps it, and the updated params
               are all-gathered right after optimizer.step(). Only this rank's
               shard of `main_grad` holds the reduced gradient.
  optim_grads  as optim, and gradients are reduce-scattered on every micro-batch
               (no_sync() does not hold them back) into a persistent shard buffer:
               the full-size buffer of a bucket only lives from its first gradient
               to its reduce-scatter, and `param.main_grad` only in between.

Sharding.OPTIM_GRADS_PARAMS (ZeRO-3: params sharded too) is not served by the
wrapper, which refuses it: data_parallel(module, sharding, policy) takes every
strategy and gives that one to torch's FSDP2 through precis.fsdp.fully_shard.

The optimizer. attach_optimizer(opt) ties an optimizer to every wrapper owning one
of its params (all model chunks) through torch's optimizer hooks; nothing of the
optimizer is replaced, so LR schedulers, checkpoint code and anything else see the
optimizer as built. For params of a sharded wrapper the optimizer then steps,
instead of the param, its intersection with this rank's shards, a flat view of the
param whose `main_grad` is the matching view of the reduced gradient shard (one
piece per param and bucket at most, so param groups, weight decay and learning
rates keep working). optimizer.step() first finishes the gradient sync of every
wrapper, steps, then all-gathers the params. With a loss scale (step(grad_scale=...)
or the optimizer's grad_scale attribute) and no found_inf of the caller's, the
ranks agree on skipping: the NaN/Inf counts of every rank's shard are all-reduced on
the device and handed to step() as found_inf, a device tensor (nothing is read back
to the host for it; precis optimizers take found_inf=, and with capturable=True
their whole step stays on the device). After a step the gradients are consumed: the
next backward starts the buffers from zero (zero_grad_buffer() or the wrapper's
zero_grad() clears them at any time; optimizer.zero_grad() clears only
param.grad, as always). Build the wrapper, then the optimizer, then attach it
before its first step. An optimizer that steps a wrapper's params without being
attached raises at its first step (it would step unreduced gradients). Any
optimizer that steps `main_grad`, as precis's do, can be attached. precis's Muon,
whose step needs whole matrices, gets a piece of every matrix on every rank (empty
where the matrix lies in other ranks' shards): its step assembles each whole
direction from the pieces (ddp/_whole.py), so the bits are one process's.

Clipping: after backward the gradients are in main_grad and param.grad is None, so
torch.nn.utils.clip_grad_norm_(model.parameters(), ...) finds none, returns 0 and clips
nothing. The wrapper's clip_grad_norm_(max_norm, norm_type) clips the reduced gradient
the optimizer steps (this rank's shards, their norm agreed by one all-reduce on the
device) and returns the total norm, as torch's does in one process.

Sharded optimizer checkpoints: every rank saves its own
`optimizer.state_dict()` and loads it back with `optimizer.load_state_dict()` into
a run with the same world size, rank, model and strategy. The dict is the
optimizer's own ({'state', 'param_groups'}, state indexed by position in the param
groups, which list this rank's pieces) plus one key, added by a state-dict hook:

  'precis_ddp': {'format': 1, 'world_size': W, 'rank': r,
                 'sharding': [strategy name of each wrapper],
                 'pieces': [[param name, start, stop], ...]}

where each piece is elements [start, stop) of the flattened param, in param-group
order (a param stepped whole has start 0 and stop numel, Muon's empty piece start
and stop 0; optimizer_pieces(opt)
gives this list). load_state_dict checks this key (a load hook) and raises
ValueError on any mismatch, before anything is loaded. Under no_shard the state is
the same on every rank and the state dict is the plain one, loadable without DDP.
Model weights are the same on every rank after each step: save them from rank 0.

Backends. Every collective is the backend's own, in the buffer's dtype: all-reduce,
reduce-scatter and all-gather into one tensor (torch.distributed's
reduce_scatter_single / all_gather_single, reduce_scatter_tensor /
all_gather_into_tensor before torch 2.13), which NCCL and gloo have for fp32,
bf16 and fp16 (gloo checked on torch 2.13); so bf16 or fp16 on the wire is also
summed in that dtype, as NCCL does. NCCL reduce-scatters and all-gathers in place;
elsewhere the output gets its own memory (one shard). The construction-time
broadcast moves raw bytes, so module buffers of any dtype travel (gloo still has no
int16, uint16 or fp8 collectives). The process group needs no other operation.

Limits: every rank must produce gradients for the same params in a step (as torch
DDP without find_unused_parameters; a param frozen after wrapping or not used gets
none: it is warned of, and stepped with the reduced gradient all the same, zero
where no rank gave one); module buffers are broadcast from rank 0 once,
at construction; one backward per micro-batch (use no_sync() for all but the last);
move the model to its device and dtype before wrapping it (the buffers are views);
params added to the optimizer after attach_optimizer() are stepped whole (no_shard;
a sharded wrapper's, whose gradients are reduced in shards, are refused at the step).

comm_hook(policy) is a communication hook for torch.nn.parallel.DistributedDataParallel
that reduces its buckets in grad_comm_dtype.

Files, each one concern, imported in this order (none imports a later one):
_sharding.py (the Sharding value), _comm.py (collectives: _Comm, _Pending),
_buffers.py (buffers and buckets), _module.py (the module wrapper),
_optimizer.py (attachment, sharded state dict), _comm_hook.py (stock DDP's hook).
"""

# torch._dynamo is imported here, before any process group exists, because importing
# it later (any torch optimizer's constructor does) keeps references to the live
# default group (torch 2.13): destroy_process_group() then no longer stops gloo's
# worker threads, which release their last tensors while the interpreter shuts
# down and abort the process ("terminate called without an active exception").
import torch._dynamo  # noqa: F401

from ._sharding import STRATEGIES, Sharding
from ._buffers import DEFAULT_BUCKET_SIZE
from ._module import DistributedDataParallel
from ._optimizer import attach_optimizer, optimizer_pieces
from ._comm_hook import comm_hook
from ._data_parallel import data_parallel

__all__ = ["data_parallel", "DistributedDataParallel", "attach_optimizer", "optimizer_pieces",
           "comm_hook",
           "Sharding", "STRATEGIES", "DEFAULT_BUCKET_SIZE"]
