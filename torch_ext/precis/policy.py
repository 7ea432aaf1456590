"""The precision policy, as seen from Python (docs/design.md section 3).

The defaults table, the legal sets and the combination rules live in C
(csrc/policy.c). This module only converts values to the strings C parses and
C's answers back to torch dtypes, so the two layers can never disagree.
"""

import ctypes
import dataclasses
import numbers
from collections.abc import Mapping

import torch

from . import _lib, op_constants

# Fields of a Policy, in precis_policy_t order.
FIELDS = ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype",
          "exp_avg_dtype", "exp_avg_sq_dtype", "store_param_remainders", "grad_sum_dtype",
          "param_remainder_bits", "momentum_dtype")
DTYPE_FIELDS = tuple(f for f in FIELDS if f.endswith("_dtype"))
# Fields from_dict() lets take their defaults when absent (dicts written before them).
LATER_FIELDS = ("grad_sum_dtype", "param_remainder_bits", "momentum_dtype")
# Derived values to_dict() writes; from_dict() accepts them when consistent.
DERIVED = ("grad_reduce_in_fp32", "precision_aware")


def _c_value(field, value):
    """An override value as the text precis_policy_set parses (numpy's bools and ints, as
    a config library may hand them, as Python's)."""
    if isinstance(value, bool) or _is_numpy_bool(value):  # (before int: bool is an int)
        return "true" if value else "false"
    if isinstance(value, torch.dtype):
        if value in op_constants.TORCH_TO_CODE:
            return _lib.dtype_name(op_constants.torch_to_code(value))
        return str(value)  # "torch.float64": C rejects it with the field's message
    if isinstance(value, (str, numbers.Integral)):
        return value if isinstance(value, str) else str(int(value))
    takes = {"store_param_remainders": "a bool", "grad_reduce_in_fp32": "a bool",
             "param_remainder_bits": "an int (16 or 8)"}.get(field.strip().lower(),
                                                            "a torch.dtype")
    raise TypeError(f"precis policy: {field} must be {takes}, a str or None, "
                    f"got {type(value).__name__} {value!r}")


def _is_numpy_bool(value):
    """numpy's bool scalar (np.True_), which is no bool and no numbers.Integral."""
    return type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and \
        getattr(value.dtype, "kind", None) == "b"


def _model_code(model_dtype):
    """The model dtype's code; C's resolve then checks it against param_dtype's legal set."""
    if isinstance(model_dtype, torch.dtype):
        name = str(model_dtype)  # "torch.bfloat16": C drops the "torch." prefix
    elif isinstance(model_dtype, str):
        name = model_dtype
    else:
        raise TypeError(f"precis policy: model_dtype must be a torch.dtype or a str, "
                        f"got {type(model_dtype).__name__} {model_dtype!r}")
    try:
        return _lib.dtype_from_name(name)
    except ValueError as e:
        raise ValueError(f"param_dtype: {model_dtype!r} is not a dtype; legal values: "
                         f"{', '.join(legal_dtypes('param_dtype'))}") from e


def _dtype_names(mask):
    return [_lib.dtype_name(code) for code in range(_lib.DTYPE_COUNT) if mask >> code & 1]


def legal_dtypes(field):
    """The canonical C names a dtype field accepts (param_dtype included), from C."""
    mask = ctypes.c_uint32()
    _lib.check(_lib.lib().precis_policy_legal_dtypes(_lib.c_string(field, "precis policy field"),
                                                     ctypes.byref(mask)),
               f"legal dtypes of {field!r}")
    return _dtype_names(mask.value)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtype of every training buffer. fp8 state is torch.uint8 (m8 / v8 code bytes).

    Build one with resolve_policy() or Policy.from_dict(); the constructor only
    checks the combination with C (precis_policy_validate).
    """
    param_dtype: torch.dtype
    main_params_dtype: torch.dtype  # == param_dtype: the param is its own master
    main_grads_dtype: torch.dtype
    grad_comm_dtype: torch.dtype
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    store_param_remainders: bool = False
    # the dtype the ranks' gradients are added in; None: grad_comm_dtype's
    grad_sum_dtype: torch.dtype = None
    # bits of a remainder (store_param_remainders): 16, or 8 (a 24-bit master)
    param_remainder_bits: int = 16
    # the one state of SGD, Lion and Muon (their momentum); None: exp_avg_dtype's
    momentum_dtype: torch.dtype = None

    def __post_init__(self):
        if self.grad_sum_dtype is None:
            object.__setattr__(self, "grad_sum_dtype", self.grad_comm_dtype)
        if self.momentum_dtype is None:
            object.__setattr__(self, "momentum_dtype", self.exp_avg_dtype)
        for name in DTYPE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, torch.dtype):
                raise TypeError(f"Policy.{name} must be a torch.dtype, got {value!r}")
        if not isinstance(self.store_param_remainders, bool):
            raise TypeError(f"Policy.store_param_remainders must be a bool, "
                            f"got {self.store_param_remainders!r}")
        if type(self.param_remainder_bits) is not int:
            raise TypeError(f"Policy.param_remainder_bits must be an int (16 or 8), "
                            f"got {self.param_remainder_bits!r}")
        _lib.check(_lib.lib().precis_policy_validate(ctypes.byref(self.to_struct())),
                   "precis policy")

    @property
    def grad_reduce_in_fp32(self):
        return self.main_grads_dtype == torch.float32

    @property
    def precision_aware(self):
        """True when any optimizer state (master, exp_avg, exp_avg_sq) is below fp32."""
        return any(d != torch.float32 for d in
                   (self.main_params_dtype, self.exp_avg_dtype, self.exp_avg_sq_dtype))

    @property
    def has_master(self):
        """A separate master copy exists (not the param itself, not remainders)."""
        return self.main_params_dtype != self.param_dtype and not self.store_param_remainders

    def to_struct(self):
        """This policy as a precis_policy_t (explicit_fields 0)."""
        kw = {name: op_constants.torch_to_code(getattr(self, name)) for name in DTYPE_FIELDS}
        return _lib.policy_struct(store_param_remainders=int(self.store_param_remainders),
                                  param_remainder_bits=self.param_remainder_bits, **kw)

    @classmethod
    def from_struct(cls, s):
        kw = {name: op_constants.code_to_torch(getattr(s, name)) for name in DTYPE_FIELDS}
        return cls(store_param_remainders=bool(s.store_param_remainders),
                   param_remainder_bits=int(s.param_remainder_bits), **kw)

    def to_dict(self):
        """Plain strings, bools and param_remainder_bits (an int), canonical C names, e.g.
        for YAML or JSON."""
        d = {name: _lib.dtype_name(op_constants.torch_to_code(getattr(self, name)))
             for name in DTYPE_FIELDS}
        d["store_param_remainders"] = self.store_param_remainders
        d["param_remainder_bits"] = self.param_remainder_bits
        d["grad_reduce_in_fp32"] = self.grad_reduce_in_fp32
        d["precision_aware"] = self.precision_aware
        return d

    @classmethod
    def from_dict(cls, d):
        """The policy a to_dict() output describes; every field must be present.

        Values go through C like overrides (so "bfloat16" or torch.bfloat16 work);
        derived keys, when present, must agree with the fields.
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"Policy.from_dict: expected a mapping, got {type(d).__name__}")
        bad = sorted(str(k) for k in d if k not in FIELDS and k not in DERIVED)
        if bad:
            raise ValueError(f"Policy.from_dict: unknown keys {', '.join(bad)}; "
                             f"accepted: {', '.join(FIELDS + DERIVED)}")
        missing = [k for k in FIELDS if k not in LATER_FIELDS and (k not in d or d[k] is None)]
        if missing:
            raise ValueError(f"Policy.from_dict: missing {', '.join(missing)}")
        # Derived keys are checked here, not passed to C: C reads grad_reduce_in_fp32=false
        # as "main grads in the model dtype", stricter than the derived meaning.
        policy = resolve_policy(d["param_dtype"], {k: d.get(k) for k in FIELDS[1:]})
        for key in DERIVED:
            if d.get(key) is not None and _flag(key, d[key]) != getattr(policy, key):
                raise ValueError(f"Policy.from_dict: {key}={d[key]!r} contradicts the fields "
                                 f"(they give {getattr(policy, key)})")
        return policy

    def bytes_per_param(self):
        """Bytes each parameter costs in every buffer (sizes from precis_dtype_size).

        fp16 and fp8 moments add one fp32 scale per PRECIS_SCALE_BLOCK elements.
        grad_comm_dtype is a transient buffer per bucket and is not counted.
        """
        def size(dtype):
            return _lib.dtype_size(op_constants.torch_to_code(dtype))

        def moment(dtype):
            scaled = dtype in op_constants.SCALED_MOMENT_DTYPES
            return size(dtype) + (4 / _lib.SCALE_BLOCK if scaled else 0)

        out = {
            "param": size(self.param_dtype),
            "master": size(self.main_params_dtype) if self.has_master else 0,
            "remainder": self.param_remainder_bits // 8 if self.store_param_remainders else 0,
            "main_grad": size(self.main_grads_dtype),
            "exp_avg": moment(self.exp_avg_dtype),
            "exp_avg_sq": moment(self.exp_avg_sq_dtype),
        }
        out["total"] = sum(out.values())
        return out


def _flag(key, value):
    """A derived key's value as a bool, read as C reads a boolean field's ("true", "off",
    ...: what a config's strings hold)."""
    try:  # (a bf16 model with remainders is legal: the text alone decides)
        return resolve_policy(torch.bfloat16, {"store_param_remainders": value}
                              ).store_param_remainders
    except TypeError:
        raise TypeError(f"Policy.from_dict: {key} must be a bool or a str, "
                        f"got {type(value).__name__} {value!r}") from None
    except ValueError as e:  # (C's words for one, without the field it was read as)
        words = str(e).partition("is not a boolean; ")[2].split(" [PRECIS_")[0] or str(e)
        raise ValueError(f"Policy.from_dict: {key}={value!r} is not a boolean; {words}") from None


def resolve_policy(model_dtype, overrides=None):
    """The policy for a model dtype, with overrides (field -> dtype | str | bool | None).

    None keeps the default. Resolution, legal sets and rules are C's
    (precis_policy_resolve); the mapping is only read, never changed.
    """
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"precis policy: overrides must be a mapping, "
                        f"got {type(overrides).__name__}")
    code = _model_code(model_dtype)
    fields, values = [], []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise TypeError(f"precis policy: override keys must be str, got {key!r}")
        if value is None:  # keeps the default; the key must be a field all the same (a
            _check_field(code, key)                   # misspelt YAML key with no value)
            continue
        fields.append(_lib.c_string(key, "precis policy field"))
        values.append(_lib.c_string(_c_value(key, value), f"precis policy {key}"))
    out = _lib.policy_struct()
    n = len(fields)
    _lib.check(_lib.lib().precis_policy_resolve(code, (ctypes.c_char_p * n)(*fields),
                                                (ctypes.c_char_p * n)(*values), n,
                                                ctypes.byref(out)),
               "precis policy")
    return Policy.from_struct(out)


def _check_field(code, key):
    """ValueError (C's words, which list the fields) unless key names a policy field: a
    dtype field has a legal set; any other is set in a scratch policy, which refuses a
    key that is no field as an invalid argument (a value it refuses: a field)."""
    if _legal_mask(key) is not None:
        return
    scratch = _lib.policy_struct()
    _lib.check(_lib.lib().precis_policy_defaults(code, ctypes.byref(scratch)), "precis policy")
    status = _lib.lib().precis_policy_set(ctypes.byref(scratch),
                                          _lib.c_string(key, "precis policy field"), b"false")
    if status == _lib.ERR_INVALID_ARGUMENT:
        _lib.check(status, "precis policy")


def policy_for(policy, dtype, who, hint="instead"):
    """The Policy of `dtype` params from a policy option as precis.optim and precis.ddp
    take it: None (the defaults), a Policy (for params of its param_dtype only), a whole
    policy as a mapping (whole_policy) or a mapping of overrides. Messages start with
    `who`; `hint` ends the dtype-mismatch one."""
    policy = whole_policy(policy, who)
    if policy is None:
        return resolve_policy(dtype)
    if isinstance(policy, Policy):
        if policy.param_dtype != dtype:
            raise ValueError(f"{who}: the policy is for {policy.param_dtype} params but a param "
                             f"is {dtype}; give a mapping of overrides (applied per param "
                             f"dtype) {hint}")
        return policy
    if isinstance(policy, Mapping):
        return resolve_policy(dtype, policy)
    raise _not_an_option(policy, who)


def _not_an_option(policy, who):
    return TypeError(f"{who}: policy must be None, a precis.Policy or a mapping of overrides, "
                     f"got {type(policy).__name__}")


def whole_policy(policy, who):
    """A policy option that is a whole policy written as a mapping (Policy.to_dict()'s,
    from YAML or a checkpoint: param_dtype set) as the Policy it describes; any other
    option as it is."""
    if not (isinstance(policy, Mapping) and policy.get("param_dtype") is not None):
        return policy
    try:
        return Policy.from_dict(policy)
    except (TypeError, ValueError) as error:
        raise _lib.reworded(error, (
            f"{who}: the policy mapping names param_dtype, so it is read as a whole policy "
            f"(as Policy.to_dict() writes one), not as overrides: {error}")) from None


def check_option(policy, who):
    """A policy option for params no policy applies to (float64, say: torch's math and
    state): read all the same, so that a misspelt key or value is refused, not ignored.
    Each override is checked alone (its key a field given once, its value one the field
    takes): the mapping may be meant for the group's other params, of another dtype."""
    policy = whole_policy(policy, who)
    if policy is None or isinstance(policy, Policy):
        return
    if not isinstance(policy, Mapping):
        raise _not_an_option(policy, who)
    seen = {}
    for key, value in policy.items():
        if not isinstance(key, str):
            raise TypeError(f"precis policy: override keys must be str, got {key!r}")
        if key.strip().lower() in seen:  # (C's folding: precis_policy_resolve refuses it)
            raise ValueError(f"precis policy: {seen[key.strip().lower()]!r} and {key!r} both "
                             f"name {key.strip().lower()}; give it once")
        seen[key.strip().lower()] = key
        if value is None:
            _check_field(_lib.DTYPE_BF16, key)
            continue
        scratch = _lib.policy_struct()
        _lib.check(_lib.lib().precis_policy_defaults(_lib.DTYPE_BF16, ctypes.byref(scratch)),
                   "precis policy")
        _lib.check(_lib.lib().precis_policy_set(
            ctypes.byref(scratch), _lib.c_string(key, "precis policy field"),
            _lib.c_string(_c_value(key, value), f"precis policy {key}")), "precis policy")


def _legal_mask(field):
    """The legal-dtype bit set C gives for a dtype field, or None if it is not one."""
    mask = ctypes.c_uint32()
    status = _lib.lib().precis_policy_legal_dtypes(_lib.c_string(field, "precis policy field"),
                                                   ctypes.byref(mask))
    return mask.value if status == _lib.OK else None


def coerce_dtype_kwargs(kwargs):
    """A copy of kwargs (e.g. optimizer kwargs from YAML) with `*_dtype` strings as dtypes.

    Known policy fields (and param_dtype) are checked against their legal set;
    other `*_dtype` keys are converted by name (C names, then torch's:
    "float64"). torch.dtype and None pass through; other keys are untouched.
    """
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"coerce_dtype_kwargs: expected a mapping, got {type(kwargs).__name__}")
    out = dict(kwargs)
    for key, value in kwargs.items():
        if not (isinstance(key, str) and key.endswith("_dtype")) or not isinstance(value, str):
            continue
        mask = _legal_mask(key)
        if mask is None:
            out[key] = _dtype_by_any_name(key, value)
            continue
        try:
            code = _lib.dtype_from_name(value)
        except ValueError:
            code = None
        if code is None or not mask >> code & 1:
            raise ValueError(f"{key}: {value!r} is not allowed; legal values: "
                             f"{', '.join(_dtype_names(mask))}")
        out[key] = op_constants.code_to_torch(code)
    return out


def _dtype_by_any_name(key, value):
    try:
        return op_constants.code_to_torch(_lib.dtype_from_name(value))
    except ValueError:
        pass
    name = value.strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    precis_names = [_lib.dtype_name(c) for c in range(_lib.DTYPE_COUNT)]
    raise ValueError(f"{key}: {value!r} is not a dtype; legal values: "
                     f"{', '.join(precis_names)} or a torch dtype name (float64, int32, ...)")
