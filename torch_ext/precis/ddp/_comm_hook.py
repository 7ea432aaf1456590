"""A communication hook for torch.nn.parallel.DistributedDataParallel (stock DDP)."""

import torch

from .. import ops
from ..policy import policy_for
from ._comm import _Comm, _scale_into


def comm_hook(policy=None):
    """A hook for torch DDP's register_comm_hook that all-reduces each bucket in the
    policy's grad_comm_dtype (resolved per bucket dtype, `policy` as in precis.optim),
    averaged over the group, and writes the result back into the bucket in its own
    dtype. The comm-dtype copy lives only until its all-reduce is done. With a
    grad_sum_dtype wider than the wire, the copies are added in it (an all-to-all, the
    sums, an all-gather: precis.ddp._comm), synchronously, inside the hook.

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(process_group, precis.ddp.comm_hook({"grad_comm_dtype": "bf16"}))

    The hook's state is the process group (None: the world).
    """
    comms = {}
    dtypes = {}

    def hook(state, bucket):
        buf = bucket.buffer()
        comm = comms.get(id(state))
        if comm is None:
            comm = comms[id(state)] = _Comm(state)
        if buf.dtype not in dtypes:
            pol = policy_for(policy, buf.dtype, "precis DDP")
            dtypes[buf.dtype] = pol.grad_comm_dtype, pol.grad_sum_dtype
        comm_dtype, sum_dtype = dtypes[buf.dtype]
        if comm.world == 1 or sum_dtype != comm_dtype:
            if comm.world > 1:
                _all_reduce_wide(comm, buf, comm_dtype, sum_dtype)
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut
        tmp = buf
        if comm_dtype != buf.dtype:
            tmp = torch.empty(buf.shape, dtype=comm_dtype, device=buf.device)
        _scale_into(buf, tmp, 1.0 / comm.world)
        (work,) = comm.all_reduce(tmp).works
        held = [tmp]

        def done(fut):
            fut.wait()  # surfaces an error of the collective
            tmp_ = held.pop()  # drop the comm-dtype copy as soon as it is written back
            if tmp_ is not buf:
                ops.cast_(buf, tmp_)
            return buf

        return work.get_future().then(done)

    return hook


def _all_reduce_wide(comm, buf, comm_dtype, sum_dtype):
    """buf = its average over the group, sent in comm_dtype, added in sum_dtype."""
    n = buf.numel()
    wire = torch.zeros(-(-n // comm.world) * comm.world, dtype=comm_dtype, device=buf.device)
    ops.cast_(wire[:n], buf.view(-1))
    comm.all_reduce_wide(wire, sum_dtype, 1.0 / comm.world).wait()
    ops.cast_(buf.view(-1), wire[:n])
