"""ctypes layer over the precis C ABI (csrc/include/precis/precis.h).

Everything that touches ctypes lives here: the prototype table, the struct
mirrors, the library loader and the status -> exception mapping. The rest of the
package (policy, optim) calls `lib()` and `check()`; ops.py calls `torch_glue()`,
which loads libprecis_torch.so, the C library that registers torch.ops.precis.*.
"""

import ctypes
import os
import threading
from ctypes import (POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_size_t,
                    c_uint32, c_void_p)

import torch

__version__ = "0.2.0"
EXPECTED_MAJOR = 0  # the loader refuses a library whose precis_version() major differs

LIBRARY_NAME = "libprecis.so"
TORCH_GLUE_NAME = "libprecis_torch.so"  # the glue: registers torch.ops.precis.*
WORKSPACE_NAME = "precis"  # Bazel runfiles: <runfiles>/precis/<library>

# ---------------------------------------------------------------------------
# Enums (explicit numbers, as in the header)
# ---------------------------------------------------------------------------

OK = 0
ERR_NULL_POINTER = 1
ERR_INVALID_ARGUMENT = 2
ERR_INVALID_DTYPE = 3
ERR_INVALID_POLICY = 4
ERR_SIZE_MISMATCH = 5
ERR_UNSUPPORTED = 6
ERR_CUDA = 7
ERR_OUT_OF_MEMORY = 8
STATUS_COUNT = 9

STATUS_NAMES = {
    OK: "PRECIS_OK",
    ERR_NULL_POINTER: "PRECIS_ERR_NULL_POINTER",
    ERR_INVALID_ARGUMENT: "PRECIS_ERR_INVALID_ARGUMENT",
    ERR_INVALID_DTYPE: "PRECIS_ERR_INVALID_DTYPE",
    ERR_INVALID_POLICY: "PRECIS_ERR_INVALID_POLICY",
    ERR_SIZE_MISMATCH: "PRECIS_ERR_SIZE_MISMATCH",
    ERR_UNSUPPORTED: "PRECIS_ERR_UNSUPPORTED",
    ERR_CUDA: "PRECIS_ERR_CUDA",
    ERR_OUT_OF_MEMORY: "PRECIS_ERR_OUT_OF_MEMORY",
}

DTYPE_FP32 = 0
DTYPE_FP16 = 1
DTYPE_BF16 = 2
DTYPE_FP8_E4M3 = 3  # stored as uint8 bytes
DTYPE_INT16 = 4  # param remainders
DTYPE_COUNT = 5

FIELD_MAIN_PARAMS_DTYPE = 0
FIELD_MAIN_GRADS_DTYPE = 1
FIELD_GRAD_COMM_DTYPE = 2
FIELD_EXP_AVG_DTYPE = 3
FIELD_EXP_AVG_SQ_DTYPE = 4
FIELD_STORE_PARAM_REMAINDERS = 5
FIELD_GRAD_REDUCE_IN_FP32 = 6
FIELD_GRAD_SUM_DTYPE = 7
FIELD_PARAM_REMAINDER_BITS = 8
FIELD_MOMENTUM_DTYPE = 9
FIELD_COUNT = 10

SCALE_BLOCK = 128  # PRECIS_SCALE_BLOCK

# C enums are ints on every ABI we target (GCC/Clang, x86-64 and aarch64).
c_status = c_int
c_dtype = c_int

# ---------------------------------------------------------------------------
# Struct mirrors. Field order and types must match precis.h exactly.
# ---------------------------------------------------------------------------


class PolicyStruct(Structure):
    """precis_policy_t."""
    _fields_ = [
        ("size", c_size_t),
        ("param_dtype", c_dtype),
        ("main_params_dtype", c_dtype),
        ("main_grads_dtype", c_dtype),
        ("grad_comm_dtype", c_dtype),
        ("exp_avg_dtype", c_dtype),
        ("exp_avg_sq_dtype", c_dtype),
        ("store_param_remainders", c_int32),
        ("explicit_fields", c_uint32),
        ("grad_sum_dtype", c_dtype),
        ("param_remainder_bits", c_int32),
        ("momentum_dtype", c_dtype),
    ]


def _filled(struct_type, defaults, overrides):
    s = struct_type()
    s.size = ctypes.sizeof(struct_type)
    for name, value in {**defaults, **overrides}.items():
        if name == "size" or not hasattr(s, name):
            raise TypeError(f"{struct_type.__name__} has no settable field {name!r}")
        setattr(s, name, value)
    return s


# Defaults of the ..._INIT macros (size is filled from sizeof).
POLICY_INIT = dict(param_dtype=DTYPE_FP32, main_params_dtype=DTYPE_FP32,
                   main_grads_dtype=DTYPE_FP32, grad_comm_dtype=DTYPE_FP32,
                   exp_avg_dtype=DTYPE_FP32, exp_avg_sq_dtype=DTYPE_FP32,
                   store_param_remainders=0, explicit_fields=0, grad_sum_dtype=DTYPE_FP32,
                   param_remainder_bits=16, momentum_dtype=DTYPE_FP32)


def policy_struct(**fields):
    """A precis_policy_t as PRECIS_POLICY_INIT makes it, with `fields` set."""
    return _filled(PolicyStruct, POLICY_INIT, fields)


# ---------------------------------------------------------------------------
# Prototypes, in header order. Tensor data pointers are declared c_void_p
# (C has float*, uint16_t*, ...) so callers can pass tensor.data_ptr() ints.
# ---------------------------------------------------------------------------

PROTOTYPES = [
    # Status and errors
    ("precis_status_string", c_char_p, [c_status]),
    ("precis_last_error", c_char_p, []),
    ("precis_version", c_int, []),
    # Dtypes
    ("precis_dtype_from_name", c_status, [c_char_p, POINTER(c_dtype)]),
    ("precis_dtype_name", c_status, [c_dtype, POINTER(c_char_p)]),
    ("precis_dtype_size", c_status, [c_dtype, POINTER(c_size_t)]),
    # Precision policy
    ("precis_policy_defaults", c_status, [c_dtype, POINTER(PolicyStruct)]),
    ("precis_policy_set", c_status, [POINTER(PolicyStruct), c_char_p, c_char_p]),
    ("precis_policy_validate", c_status, [POINTER(PolicyStruct)]),
    ("precis_policy_resolve", c_status,
     [c_dtype, POINTER(c_char_p), POINTER(c_char_p), c_size_t, POINTER(PolicyStruct)]),
    ("precis_policy_legal_dtypes", c_status, [c_char_p, POINTER(c_uint32)]),
    # What a param holds (precis.fingerprints)
    ("precis_fingerprint", c_status,
     [c_void_p, c_void_p, c_int64, c_void_p]),   # bufs void**, nbytes i64*, count, out u64*
    ("precis_fingerprint_blocks", c_status,
     [c_void_p, c_void_p, c_int64, c_int64, c_void_p]),  # ..., block bytes, out u64*
    # The update engine
    ("precis_rule_name", c_status, [c_int32, POINTER(c_char_p)]),
    ("precis_cpu_isa", c_status, [POINTER(c_char_p)]),
    ("precis_scale_count", c_status, [c_int64, POINTER(c_int64)]),
    ("precis_moment_encode", c_status,
     [c_void_p, c_int64, c_int32, c_void_p, c_dtype, c_void_p]),   # src f32*, dst, scales f32*
    ("precis_moment_decode", c_status,
     [c_void_p, c_void_p, c_int64, c_int32, c_dtype, c_void_p]),   # src, scales f32*, dst f32*
    ("precis_remainder_split", c_status,
     [c_void_p, c_int64, c_void_p, c_void_p]),   # master f32*, param u16*, remainder i16*
    ("precis_remainder_join", c_status,
     [c_void_p, c_void_p, c_int64, c_void_p]),   # param u16*, remainder i16*, master f32*
    ("precis_remainder8_split", c_status,
     [c_void_p, c_int64, c_void_p, c_void_p]),   # master f32*, param u16*, correction u8*
    ("precis_remainder8_join", c_status,
     [c_void_p, c_void_p, c_int64, c_void_p]),   # param u16*, correction u8*, master f32*
]

# What Python calls in libprecis.so: the policy, dtype names, and the conversions
# of checkpoints and state. The kernels are reached through torch.ops.precis.*
# (the glue, libprecis_torch.so), never from here.
_REQUIRED = {"precis_status_string", "precis_last_error", "precis_version"}

# libprecis_torch.so: registration status of the ops.
TORCH_GLUE_PROTOTYPES = [
    ("precis_torch_init", c_status, []),
    ("precis_torch_init_message", c_char_p, []),
    ("precis_torch_has_cuda", c_int, []),
    ("precis_torch_drop_held", None, [c_int64]),  # ops.HeldStep's
]

# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


class LibraryError(OSError):
    """libprecis.so / libprecis_torch.so could not be found, loaded or accepted."""


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def candidate_paths(filename, env_var):
    """Where to look, in order, as (description, path) pairs.

    An explicit env var wins alone: if it is set, nothing else is tried, so a
    typo never silently loads some other build.
    """
    explicit = os.environ.get(env_var)
    if explicit:
        return [(f"${env_var}", explicit)]
    found = [("beside the package", os.path.join(_package_dir(), filename))]
    for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
        root = os.environ.get(var)
        if root:
            found.append((f"Bazel runfiles (${var})",
                          os.path.join(root, WORKSPACE_NAME, filename)))
    # In a runfiles tree the package sits at <workspace>/torch_ext/precis and the
    # library at <workspace>/, even when no runfiles variable is set.
    workspace = os.path.dirname(os.path.dirname(_package_dir()))
    found.append(("the package's workspace root (runfiles)", os.path.join(workspace, filename)))
    d = _package_dir()
    while True:
        found.append(("bazel-bin", os.path.join(d, "bazel-bin", filename)))
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return found


def _load(filename, env_var, prototypes):
    tried = []
    for where, path in candidate_paths(filename, env_var):
        if not os.path.isfile(path):
            tried.append(f"{path} ({where})")
            continue
        try:
            # RTLD_LOCAL (the default): precis_* names stay out of the global scope.
            handle = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryError(f"precis: cannot load {path} ({where}): {e}") from e
        # Version first: a different major explains missing symbols better.
        if hasattr(handle, "precis_version"):
            _check_version(handle, path)
        _set_prototypes(handle, path, prototypes)
        handle.precis_path = path
        return handle
    raise LibraryError(
        f"precis: {filename} not found; reinstall precis (pip install precis-*.whl, or "
        f"pip install . from a clone), build it (bazel build //...) or set ${env_var} to "
        f"its path (looked in: {'; '.join(tried)})")


def _set_prototypes(handle, path, prototypes):
    missing = []
    required = _REQUIRED if prototypes is PROTOTYPES else {p[0] for p in prototypes}
    for name, restype, argtypes in prototypes:
        try:
            fn = getattr(handle, name)
        except AttributeError:
            missing.append(name)
            setattr(handle, name, _missing_function(name, path))
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    handle.precis_missing = missing
    if required & set(missing):
        raise LibraryError(f"precis: {path} lacks {', '.join(sorted(required & set(missing)))}; "
                           f"is it a precis library?")


def _missing_function(name, path):
    def call(*args):
        raise LibraryError(f"precis: {path} has no {name}; rebuild it from the sources that "
                           f"match this Python package ({__version__})")
    return call


def _check_version(handle, path):
    handle.precis_version.restype = c_int
    handle.precis_version.argtypes = []
    code = handle.precis_version()
    if code // 10000 != EXPECTED_MAJOR:
        raise LibraryError(
            f"precis: {path} is version {code // 10000}.{code // 100 % 100}.{code % 100} "
            f"(major {code // 10000}) but the Python package {__version__} needs major "
            f"{EXPECTED_MAJOR}; reinstall precis so that the package and its libraries "
            f"match, or point the $PRECIS_*LIBRARY variables at a matching build")


_lock = threading.Lock()
_lib = None
_glue = None


def lib():
    """libprecis.so, loaded once, prototypes set."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load(LIBRARY_NAME, "PRECIS_LIBRARY", PROTOTYPES)
    return _lib


def torch_glue():
    """libprecis_torch.so, loaded once with torch.ops.load_library: loading it
    registers the torch.ops.precis.* ops (CPU kernels, and CUDA kernels in a CUDA
    build of torch). libprecis.so is loaded first, so the glue uses that copy.
    Raises LibraryError when the ops could not be registered."""
    global _glue
    if _glue is None:
        lib()
        with _lock:
            if _glue is None:
                handle = _load(TORCH_GLUE_NAME, "PRECIS_TORCH_LIBRARY", TORCH_GLUE_PROTOTYPES)
                torch.ops.load_library(handle.precis_path)  # torch records it; same handle
                if handle.precis_torch_init() != OK:
                    raise LibraryError(f"precis: {handle.precis_path} could not register the "
                                       f"torch.ops.precis ops: "
                                       f"{handle.precis_torch_init_message().decode()}")
                _glue = handle
    return _glue


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class PrecisError(Exception):
    """Base of the errors raised for a non-zero precis_status_t; `.status` holds it."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class PrecisValueError(PrecisError, ValueError):
    """Bad input: invalid argument, dtype or policy, size mismatch, NULL pointer."""


class PrecisRuntimeError(PrecisError, RuntimeError):
    """Unsupported request, CUDA error, out of memory."""


def reworded(error, text):
    """An error of error's kind (its type, a PrecisError's status) saying text; error
    itself where its type takes other arguments (UnicodeEncodeError, say)."""
    if isinstance(error, PrecisError):
        return type(error)(text, error.status)
    return type(error)(text) if type(error) in (ValueError, TypeError) else error


_VALUE_ERRORS = {ERR_NULL_POINTER, ERR_INVALID_ARGUMENT, ERR_INVALID_DTYPE,
                 ERR_INVALID_POLICY, ERR_SIZE_MISMATCH}


def check(status, what, library=None):
    """Raise for a non-zero status, with the library's last-error text.

    Call it right after the failing call: the message is thread-local and the
    next precis call clears it. `library` is the handle that made the call
    (default lib()).
    """
    if status == OK:
        return
    handle = library if library is not None else lib()
    detail = (handle.precis_last_error() or b"").decode("utf-8", "replace")
    if not detail:
        detail = (handle.precis_status_string(status) or b"").decode("utf-8", "replace")
    name = STATUS_NAMES.get(status, f"status {status}")
    cls = PrecisValueError if status in _VALUE_ERRORS else PrecisRuntimeError
    # The C library's messages start with the function's name ("precis_moment_encode:
    # src is NULL"): `what` naming that function is not said twice.
    message = detail if detail.startswith(f"{what}:") else f"{what}: {detail}"
    raise cls(f"{message} [{name}]", status)


# ---------------------------------------------------------------------------
# Small wrappers used across the package
# ---------------------------------------------------------------------------


def version():
    """precis_version() of the loaded library, as (major, minor, patch)."""
    code = lib().precis_version()
    return (code // 10000, code // 100 % 100, code % 100)


def cpu_isa():
    """The SIMD path the CPU kernels use here: "avx512", "avx2", "sve", "neon" (aarch64) or
    "scalar"."""
    out = c_char_p()
    check(lib().precis_cpu_isa(ctypes.byref(out)), "precis_cpu_isa")
    return out.value.decode()


def c_string(text, what):
    """text as the bytes of a C string; ValueError if it holds a NUL byte, where C
    would stop reading ("fp8\\0junk" must not pass as "fp8")."""
    if "\0" in text:
        raise ValueError(f"{what}: {text!r} contains a NUL byte")
    return text.encode("utf-8")


def rule_names():
    """{name: value} of every update rule the library has (precis.h's precis_rule_t, in
    order; op_constants.RULES is its Python copy, which a test holds to this)."""
    names, out = {}, c_char_p()
    while lib().precis_rule_name(len(names), ctypes.byref(out)) == 0:
        names[out.value.decode()] = len(names)
    return names  # (the call past the last rule failed: PRECIS_ERR_INVALID_ARGUMENT)


def dtype_from_name(name):
    """C name (any alias, any case) -> dtype code; ValueError listing the names."""
    out = c_dtype()
    check(lib().precis_dtype_from_name(c_string(name, "dtype name"), ctypes.byref(out)),
          f"dtype {name!r}")
    return out.value


def dtype_name(code):
    """dtype code -> canonical C name ("fp32", "bf16", ...)."""
    out = c_char_p()
    check(lib().precis_dtype_name(code, ctypes.byref(out)), f"dtype code {code}")
    return out.value.decode()


def dtype_size(code):
    """Bytes per element of a dtype code."""
    out = c_size_t()
    check(lib().precis_dtype_size(code, ctypes.byref(out)), f"dtype code {code}")
    return out.value


def require_tensor(value, name, what="precis"):
    """TypeError naming the argument unless value is a torch.Tensor (None included)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(value).__name__}")
