"""ctypes mirrors of the C ABI's Adam structs and entry points, for the tests that
call libprecis.so / libprecis_cuda.so directly (csrc/include/precis/precis.h).

The Python package no longer calls these (the kernels are reached through
torch.ops.precis.*, i.e. the glue libprecis_torch.so); tests that check the C
entry points themselves build their arguments here. test_loader.py checks these
mirrors against the header (field offsets, sizes, the ..._INIT macros, arities).
"""
import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_double, c_float, c_int32, c_int64,
                    c_size_t, c_uint64, c_void_p)

from precis import _lib

c_status = _lib.c_status
c_dtype = _lib.c_dtype


# precis_sqrt_fn_t: void (*)(const float* in, float* out, int64_t n)
SqrtFn = CFUNCTYPE(None, POINTER(c_float), POINTER(c_float), c_int64)


class AdamConfig(Structure):
    """precis_adam_config_t."""
    _fields_ = [
        ("size", c_size_t),
        ("lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("decoupled_weight_decay", c_int32),
        ("maximize", c_int32),
        ("inv_grad_scale", c_float),
        ("check_finite", c_int32),
        ("seed", c_uint64),
        ("lr_float32", c_int32),
        ("cpu_sqrt", SqrtFn),
        ("num_threads", c_int32),
        ("amsgrad", c_int32),
        ("rule", c_int32),            # precis_rule_t: 0 adam, 1 sgd, 2 lion, 3 muon_momentum
        ("nesterov", c_int32),
        ("momentum", c_double),
        ("dampening", c_double),
        ("rule_hyper", c_double * 4),  # PRECIS_RULE_HYPER_MAX: a rule's own (zeros)
    ]


class AdamTensors(Structure):
    """precis_adam_tensors_t. The pointer tables are declared void** / int64_t*: C's
    `float* const*` etc. differ only in constness and pointee type (same ABI)."""
    _fields_ = [
        ("size", c_size_t),
        ("count", c_size_t),
        ("param_dtype", c_dtype),
        ("grad_dtype", c_dtype),
        ("master_dtype", c_dtype),
        ("exp_avg_dtype", c_dtype),
        ("exp_avg_sq_dtype", c_dtype),
        ("params", POINTER(c_void_p)),
        ("grads", POINTER(c_void_p)),
        ("masters", POINTER(c_void_p)),
        ("exp_avgs", POINTER(c_void_p)),
        ("exp_avg_sqs", POINTER(c_void_p)),
        ("exp_avg_scales", POINTER(c_void_p)),
        ("exp_avg_sq_scales", POINTER(c_void_p)),
        ("numels", POINTER(c_int64)),
        ("steps", POINTER(c_int64)),
        ("max_exp_avg_sqs", POINTER(c_void_p)),
        ("max_exp_avg_sq_scales", POINTER(c_void_p)),
        ("streams", POINTER(c_uint64)),
        ("element_offsets", POINTER(c_int64)),
        ("outputs", POINTER(c_void_p)),
        ("output_dtype", c_dtype),
        ("lr_scales", POINTER(c_double)),
        ("param_fingerprints", POINTER(c_uint64)),
        ("param_kept", POINTER(c_int64)),
        ("param_block_fingerprints", POINTER(c_uint64)),
        ("param_block_records", POINTER(c_uint64)),
        ("param_blocks_kept", POINTER(c_int64)),
    ]


class CudaAdamDeviceArgs(Structure):
    """precis_cuda_adam_device_args_t: device addresses (ints or None); steps is a
    host table of int64_t* device pointers (pointer_array)."""
    _fields_ = [
        ("size", c_size_t),
        ("lr", c_void_p),
        ("inv_grad_scale", c_void_p),
        ("steps", POINTER(c_void_p)),
        ("found_inf", c_void_p),
        ("fingerprints_zeroed", c_int32),
        ("stale", c_void_p),
        ("kept", c_void_p),
    ]


# Defaults of the ..._INIT macros (size is filled from sizeof; pointers start NULL).
ADAM_CONFIG_INIT = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                        decoupled_weight_decay=1, maximize=0, inv_grad_scale=1.0,
                        check_finite=0, seed=0, lr_float32=0, num_threads=0, amsgrad=0,
                        rule=0, nesterov=0, momentum=0.0, dampening=0.0)
ADAM_TENSORS_INIT = dict(count=0, param_dtype=_lib.DTYPE_FP32, grad_dtype=_lib.DTYPE_FP32,
                         master_dtype=_lib.DTYPE_FP32, exp_avg_dtype=_lib.DTYPE_FP32,
                         exp_avg_sq_dtype=_lib.DTYPE_FP32, output_dtype=_lib.DTYPE_FP32)
STRUCTS = {"precis_adam_config_t": AdamConfig, "precis_adam_tensors_t": AdamTensors,
           "precis_cuda_adam_device_args_t": CudaAdamDeviceArgs}


_filled = _lib._filled  # one struct filler: the package's, as for precis_policy_t


def adam_config(**fields):
    """A precis_adam_config_t as PRECIS_ADAM_CONFIG_INIT makes it, with `fields` set."""
    return _filled(AdamConfig, ADAM_CONFIG_INIT, fields)


def adam_tensors(**fields):
    """A precis_adam_tensors_t as PRECIS_ADAM_TENSORS_INIT makes it, with `fields` set
    (ctypes arrays assigned to pointer fields stay alive with the struct)."""
    return _filled(AdamTensors, ADAM_TENSORS_INIT, fields)


def cuda_adam_device_args(**fields):
    """A precis_cuda_adam_device_args_t as PRECIS_CUDA_ADAM_DEVICE_ARGS_INIT makes it."""
    return _filled(CudaAdamDeviceArgs, {}, fields)


def pointer_array(items):
    """A void* table: tensors (their data_ptr()), ints (addresses) or None."""
    return (c_void_p * len(items))(*[None if t is None else (t if isinstance(t, int)
                                                             else t.data_ptr()) for t in items])


def int64_array(values):
    return (c_int64 * len(values))(*[int(v) for v in values])


# The step's entry points of libprecis.so that the package does not declare, under their
# names and under those before issue #66 (precis.h keeps both).
CPU_PROTOTYPES = [
    ("precis_step", c_status,
     [POINTER(AdamConfig), POINTER(AdamTensors), POINTER(c_int32)]),
    ("precis_step_check_finite", c_status, [POINTER(AdamTensors), POINTER(c_int32)]),
    ("precis_step_skipped", c_status, [POINTER(AdamConfig), POINTER(AdamTensors)]),
    ("precis_adam_step", c_status,
     [POINTER(AdamConfig), POINTER(AdamTensors), POINTER(c_int32)]),
    ("precis_adam_check_finite", c_status, [POINTER(AdamTensors), POINTER(c_int32)]),
]

# libprecis_cuda.so: the CUDA twins (stream last), and its own copy of the
# status/error/version functions (its thread-local last error is its own).
CUDA_PROTOTYPES = [
    ("precis_cuda_accumulate", c_status,
     [c_void_p, c_dtype, c_void_p, c_dtype, c_int64, c_void_p]),
    ("precis_cuda_cast", c_status,
     [c_void_p, c_dtype, c_void_p, c_dtype, c_int64, c_void_p]),
    ("precis_cuda_scale", c_status, [c_void_p, c_dtype, c_float, c_int64, c_void_p]),
    ("precis_cuda_count_nonfinite", c_status,
     [c_void_p, c_dtype, c_int64, c_void_p, c_void_p]),   # out_count: device int64_t*
    ("precis_cuda_fingerprint", c_status,
     [c_void_p, c_void_p, c_int64, c_void_p, c_void_p]),   # out: device uint64_t[count]
    ("precis_cuda_fingerprint_blocks", c_status,   # block bytes; out: device uint64_t[blocks]
     [c_void_p, c_void_p, c_int64, c_int64, c_void_p, c_void_p]),
    ("precis_cuda_resync_masters", c_status,   # stale, kept: device memory
     [c_void_p, c_dtype, c_void_p, c_dtype, c_void_p, c_void_p, c_void_p, c_int64, c_void_p]),
    ("precis_cuda_resync_changed", c_status,   # records, stale, kept: device memory
     [c_void_p, c_dtype, c_void_p, c_dtype, c_void_p, c_void_p, c_void_p, c_void_p, c_int64,
      c_void_p]),
    ("precis_cuda_resync_compared", c_status,   # records, stale, kept, sums, zeroed: device
     [c_void_p, c_dtype, c_void_p, c_dtype, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
      c_void_p, c_int64, c_void_p]),
    ("precis_cuda_compare_params", c_status,   # as precis_cuda_resync_compared
     [c_void_p, c_dtype, c_void_p, c_dtype, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
      c_void_p, c_int64, c_void_p]),
    ("precis_cuda_step", c_status,
     [POINTER(AdamConfig), POINTER(AdamTensors), POINTER(CudaAdamDeviceArgs), c_void_p]),
    ("precis_cuda_step_check_finite", c_status,
     [POINTER(AdamTensors), c_void_p, c_void_p]),   # found_inf: device float*
    # (the names before issue #66, at the header's end)
    ("precis_cuda_adam_step", c_status,
     [POINTER(AdamConfig), POINTER(AdamTensors), POINTER(CudaAdamDeviceArgs), c_void_p]),
    ("precis_cuda_adam_check_finite", c_status,
     [POINTER(AdamTensors), c_void_p, c_void_p]),
]
_COMMON = [p for p in _lib.PROTOTYPES
           if p[0] in ("precis_status_string", "precis_last_error", "precis_version")]


def _declare(handle, prototypes):
    for name, restype, argtypes in prototypes:
        fn = getattr(handle, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return handle


_cpu = None
_cuda = None


def cpu_lib():
    """libprecis.so (the copy the package loaded) with the Adam prototypes: a CDLL of
    its own, so the package's handle is left as it is."""
    global _cpu
    if _cpu is None:
        _cpu = _declare(ctypes.CDLL(_lib.lib().precis_path), _COMMON + CPU_PROTOTYPES)
    return _cpu


def cuda_library_candidates():
    """Where the glue would find libprecis_cuda.so ($PRECIS_CUDA_LIBRARY alone, else
    beside the glue), then the package's usual places."""
    env = os.environ.get("PRECIS_CUDA_LIBRARY")
    if env:
        return [env]
    glue_dir = os.path.dirname(_lib.torch_glue().precis_path)
    return [os.path.join(glue_dir, "libprecis_cuda.so")] + [
        p for _, p in _lib.candidate_paths("libprecis_cuda.so", "PRECIS_CUDA_LIBRARY")]


def cuda_lib():
    """libprecis_cuda.so loaded with ctypes (no GPU needed to load it), prototypes set;
    raises _lib.LibraryError naming where it looked."""
    global _cuda
    if _cuda is None:
        tried = cuda_library_candidates()
        for path in tried:
            if os.path.isfile(path):
                try:
                    handle = ctypes.CDLL(path)
                except OSError as e:
                    raise _lib.LibraryError(f"cannot load {path}: {e}") from e
                _cuda = _declare(handle, _COMMON + CUDA_PROTOTYPES)
                _cuda.precis_path = path
                break
        else:
            raise _lib.LibraryError("libprecis_cuda.so not found in " + ", ".join(tried))
    return _cuda
