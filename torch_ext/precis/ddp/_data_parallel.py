"""data_parallel(): one entry point for every sharding strategy, params sharded too."""
from .. import fsdp
from ._module import DistributedDataParallel
from ._sharding import Sharding


def data_parallel(module, sharding="no_shard", policy=None, **kwargs):
    """`module` made data parallel with `sharding` (a Sharding or its name).

    no_shard, optim, optim_grads: a DistributedDataParallel wrapper of it (attach the
    optimizer with attach_optimizer). optim_grads_params: the module itself (or the
    list of model chunks), sharded with torch's FSDP2 by precis.fsdp.fully_shard with
    the policy's mixed precision; the optimizer steps its DTensor params directly, so
    there is nothing to attach. kwargs go to the one chosen (e.g. bucket_size, or
    units and mesh).
    """
    sharding = Sharding.parse(sharding, "precis.ddp.data_parallel")
    if sharding.shards_params:
        return fsdp.fully_shard(module, policy=policy, **kwargs)
    return DistributedDataParallel(module, policy=policy, sharding=sharding, **kwargs)
