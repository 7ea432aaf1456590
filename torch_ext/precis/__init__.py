"""precis: precision policies and precision-aware kernels for PyTorch (2.10 or newer).

Importing the package loads libprecis.so and libprecis_torch.so, which registers
the torch.ops.precis.* ops; see _lib.candidate_paths for where they are looked for.
"""

import torch as _torch

_NEEDED = (2, 10)
_found = tuple(int(part) for part in _torch.__version__.split("+")[0].split(".")[:2])
if _found < _NEEDED:
    raise ImportError(f"precis needs torch {_NEEDED[0]}.{_NEEDED[1]} or newer (its ops are "
                      f"registered through libtorch's stable C ABI); found torch "
                      f"{_torch.__version__}: pip install 'torch>={_NEEDED[0]}.{_NEEDED[1]}'")

from ._lib import __version__, cpu_isa, PrecisError, PrecisRuntimeError, PrecisValueError  # noqa: E402
from .ops import accumulate_  # noqa: E402
from .policy import Policy, coerce_dtype_kwargs, resolve_policy  # noqa: E402
from . import optim  # noqa: E402
from . import ddp  # noqa: E402
from . import fsdp  # noqa: E402

__all__ = ["Policy", "resolve_policy", "coerce_dtype_kwargs", "accumulate_", "optim", "ddp", "fsdp", "cpu_isa", "__version__",
           "PrecisError", "PrecisValueError", "PrecisRuntimeError"]
