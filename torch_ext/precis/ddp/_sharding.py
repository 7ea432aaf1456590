"""The sharding strategy: one value; what it shards and when it reduces are derived."""

import enum


class Sharding(enum.Enum):
    """How much of the training state each data-parallel rank keeps (Megatron-FSDP's
    names; the ZeRO stage in brackets):

      NO_SHARD            all of it; gradients are all-reduced
      OPTIM               optimizer state sharded (1): gradients reduce-scattered on
                          the last micro-batch, params all-gathered after the step
      OPTIM_GRADS         as OPTIM, and the gradients (2): reduce-scattered on every
                          micro-batch into a persistent shard
      OPTIM_GRADS_PARAMS  as OPTIM_GRADS, and the params (3): not precis.ddp's (it
                          keeps whole params on every rank); named here so that
                          every strategy is one value

    Users and YAML give strings: Sharding.parse("optim_grads").
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @classmethod
    def parse(cls, value, who="sharding"):
        """A Sharding from itself or its name (case and surrounding whitespace
        ignored); anything else raises, naming the value and the accepted names."""
        if isinstance(value, cls):
            return value
        accepted = ", ".join(s.value for s in cls)
        if not isinstance(value, str):
            raise TypeError(f"{who}: sharding must be a precis.ddp.Sharding or one of the "
                            f"strings {accepted}; got {type(value).__name__} {value!r}")
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ValueError(f"{who}: sharding={value!r} is not a strategy; accepted: "
                             f"{accepted}") from None

    @property
    def shards_optimizer_state(self):
        """Each rank steps (and keeps state for) only its shard of the params."""
        return self is not Sharding.NO_SHARD

    @property
    def shards_grads(self):
        """Only the rank's reduced shard of the gradients persists between
        micro-batches; a full-size gradient buffer lives only until it is reduced."""
        return self in (Sharding.OPTIM_GRADS, Sharding.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self):
        """Each rank keeps only its shard of the params between uses."""
        return self is Sharding.OPTIM_GRADS_PARAMS

    @property
    def reduces_every_micro_batch(self):
        """Gradients are reduced on every micro-batch (no_sync() does not hold them
        back): with sharded gradients no full-size buffer is kept to accumulate in."""
        return self.shards_grads


# The strategies precis.ddp.DistributedDataParallel serves, by name.
STRATEGIES = tuple(s.value for s in Sharding if not s.shards_params)
