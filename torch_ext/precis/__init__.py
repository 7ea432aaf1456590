"""precis: precision policies and precision-aware kernels for PyTorch.

The C library (libprecis.so) is loaded lazily on first use, so importing the
package works before it is built; see _lib.candidate_paths for where it looks.
"""

from ._lib import __version__, cpu_isa, PrecisError, PrecisRuntimeError, PrecisValueError
from .ops import accumulate_
from .policy import Policy, coerce_dtype_kwargs, resolve_policy
from . import ops as _ops
from . import optim
from . import bucket_ops, ddp

_ops.register()

__all__ = ["Policy", "resolve_policy", "coerce_dtype_kwargs", "accumulate_", "optim", "ddp", "cpu_isa", "__version__",
           "PrecisError", "PrecisValueError", "PrecisRuntimeError"]
