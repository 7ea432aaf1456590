"""The precision policy through Python: defaults, overrides, rejections, round trips."""
import dataclasses
import json
import types

import pytest
import torch

import precis
from precis import Policy, coerce_dtype_kwargs, resolve_policy
from precis.policy import legal_dtypes

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8

# docs/design.md section 3: model -> (master, main grads, comm, exp_avg, exp_avg_sq, remainders)
DEFAULTS = {
    BF16: (F32, BF16, BF16, BF16, BF16, False),
    F16: (F32, F32, F32, F32, F32, False),
    F32: (F32, F32, F32, F32, F32, False),  # master == param: the param is its own master
}
SPELLINGS = {
    BF16: [BF16, "bf16", "bfloat16", " BF16 ", "BFloat16", "torch.bfloat16"],
    F16: [F16, "fp16", "float16", "half", " Half\t", "torch.float16"],
    F32: [F32, "fp32", "float32", "float", "FLOAT32 ", "torch.float32"],
}
# Legal sets as C defines them (DESIGN lists master {fp32, fp16}; C adds bf16 for a
# bf16 model with no master, i.e. stochastic rounding).
LEGAL = {
    "param_dtype": ["fp32", "fp16", "bf16"],
    "main_params_dtype": ["fp32", "fp16", "bf16"],
    "main_grads_dtype": ["fp32", "fp16", "bf16"],
    "grad_comm_dtype": ["fp32", "fp16", "bf16"],
    "grad_sum_dtype": ["fp32", "fp16", "bf16"],
    "exp_avg_dtype": ["fp32", "fp16", "bf16", "fp8"],
    "exp_avg_sq_dtype": ["fp32", "fp16", "bf16", "fp8"],
    "momentum_dtype": ["fp32", "fp16", "bf16", "fp8"],
}


def expected(model, **changes):
    master, grads, comm, m, v, rem = DEFAULTS[model]
    fields = dict(param_dtype=model, main_params_dtype=master, main_grads_dtype=grads,
                  grad_comm_dtype=comm, exp_avg_dtype=m, exp_avg_sq_dtype=v,
                  store_param_remainders=rem)
    fields.update(changes)
    return Policy(**fields)


@pytest.mark.parametrize("model", list(DEFAULTS), ids=str)
def test_defaults_matrix(model):
    for spelling in SPELLINGS[model]:
        p = resolve_policy(spelling)
        assert p == expected(model), spelling
        assert resolve_policy(spelling, {}) == p
        assert resolve_policy(spelling, None) == p
    p = resolve_policy(model)
    assert p.momentum_dtype == DEFAULTS[model][3]  # C's default: exp_avg_dtype's
    assert p.grad_reduce_in_fp32 == (model != BF16)  # = !bf16
    assert p.precision_aware == (model == BF16)
    assert p.has_master == (model != F32)


@pytest.mark.parametrize("field", LEGAL)
def test_legal_sets_come_from_c(field):
    assert sorted(legal_dtypes(field)) == sorted(LEGAL[field])


@pytest.mark.parametrize("model", list(DEFAULTS), ids=str)
@pytest.mark.parametrize("field,value,want", [
    ("exp_avg_dtype", "fp8", FP8),
    ("exp_avg_dtype", FP8, FP8),
    ("exp_avg_dtype", "uint8", FP8),
    ("exp_avg_sq_dtype", " FP16 ", F16),
    ("exp_avg_sq_dtype", BF16, BF16),
    ("grad_comm_dtype", "bf16", BF16),
    ("grad_comm_dtype", F16, F16),
    ("momentum_dtype", "fp8", FP8),
    ("momentum_dtype", FP8, FP8),
    ("momentum_dtype", " Half ", F16),
    ("momentum_dtype", F32, F32),
])
def test_override_one_field_keeps_the_rest(model, field, value, want):
    overrides = {field: value}
    assert resolve_policy(model, overrides) == expected(model, **{field: want})
    assert overrides == {field: value}  # never mutated


def test_override_precedence_and_followers():
    # grad_comm follows main grads unless set itself, whatever the order.
    assert resolve_policy("bf16", {"main_grads_dtype": "fp32"}) == expected(
        BF16, main_grads_dtype=F32, grad_comm_dtype=F32)
    for overrides in ({"grad_comm_dtype": "bf16", "main_grads_dtype": "fp32"},
                      {"main_grads_dtype": "fp32", "grad_comm_dtype": "bf16"}):
        assert resolve_policy("bf16", overrides) == expected(
            BF16, main_grads_dtype=F32, grad_comm_dtype=BF16)
    # grad_reduce_in_fp32 as a bool.
    assert resolve_policy("bf16", {"grad_reduce_in_fp32": True}) == expected(
        BF16, main_grads_dtype=F32, grad_comm_dtype=F32)
    assert resolve_policy("fp16", {"grad_reduce_in_fp32": False}) == expected(
        F16, main_grads_dtype=F16, grad_comm_dtype=F16)
    assert resolve_policy("bf16", {"grad_reduce_in_fp32": True,
                                   "main_grads_dtype": "fp32"}).grad_reduce_in_fp32
    # None keeps the default.
    assert resolve_policy("bf16", {"exp_avg_dtype": None, "main_grads_dtype": None,
                                   "store_param_remainders": None}) == expected(BF16)
    # Remainders, bool or string.
    for flag in (True, "true", "ON", "yes", 1):
        assert resolve_policy("bf16", {"store_param_remainders": flag}) == expected(
            BF16, store_param_remainders=True)
    for flag in (False, "false", "off", 0):
        assert resolve_policy("bf16", {"store_param_remainders": flag}) == expected(BF16)
    # A master override, and a bf16 model with no master (stochastic rounding).
    assert resolve_policy("fp16", {"main_params_dtype": "half"}) == expected(
        F16, main_params_dtype=F16)
    p = resolve_policy("bf16", {"main_params_dtype": "bf16"})
    assert not p.has_master and p.precision_aware
    # Everything at once.
    p = resolve_policy(torch.bfloat16, {
        "main_params_dtype": "fp32", "main_grads_dtype": torch.float32,
        "grad_comm_dtype": "BF16", "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16",
        "store_param_remainders": True})
    assert p == Policy(BF16, F32, F32, BF16, FP8, F16, True)


def test_fp32_model_is_not_precision_aware_unless_state_is_narrow():
    assert not resolve_policy("fp32").precision_aware
    assert resolve_policy("fp32", {"exp_avg_sq_dtype": "bf16"}).precision_aware
    assert not resolve_policy("fp32", {"main_grads_dtype": "bf16"}).precision_aware


def test_read_only_mapping_is_accepted():
    ro = types.MappingProxyType({"exp_avg_dtype": "fp32"})
    assert resolve_policy("bf16", ro).exp_avg_dtype == F32


def assert_names(excinfo, *parts):
    msg = str(excinfo.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


@pytest.mark.parametrize("field", [f for f in LEGAL if f != "param_dtype"])
def test_unknown_dtype_name_is_rejected(field):
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {field: "bf17"})
    assert_names(e, field, "bf17", *LEGAL[field])


@pytest.mark.parametrize("field,value", [
    ("main_params_dtype", "fp8"), ("main_params_dtype", "int16"),
    ("main_grads_dtype", "fp8"), ("main_grads_dtype", "uint8"),
    ("grad_comm_dtype", "float8"), ("exp_avg_dtype", "int16"), ("exp_avg_sq_dtype", "int16"),
    ("momentum_dtype", "int16"), ("momentum_dtype", torch.int16),
])
def test_illegal_dtype_is_rejected(field, value):
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {field: value})
    assert_names(e, field, str(value).replace("torch.", ""), *LEGAL[field])


def test_torch_dtype_outside_precis_is_rejected():
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {"exp_avg_dtype": torch.float64})
    assert_names(e, "exp_avg_dtype", "float64", *LEGAL["exp_avg_dtype"])


@pytest.mark.parametrize("model", ["fp8", "int16", "bf17", torch.float64, torch.uint8])
def test_bad_model_dtype(model):
    with pytest.raises(ValueError) as e:
        resolve_policy(model)
    assert_names(e, "param_dtype", *LEGAL["param_dtype"])


def test_unknown_field_and_bad_bool():
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {"exp_avg_dtpye": "fp32"})
    assert_names(e, "exp_avg_dtpye", "exp_avg_dtype", "store_param_remainders")
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {"param_dtype": "bf16"})  # given as model_dtype, not here
    assert_names(e, "param_dtype")
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {"store_param_remainders": "maybe"})
    assert_names(e, "store_param_remainders", "maybe", "true", "false")


def test_a_field_without_a_value_keeps_its_default_but_a_misspelt_one_is_refused():
    """YAML gives None for a key written without a value: a field keeps its default
    (dtype, boolean and int fields alike), a key that is no field is refused as with a
    value (it was dropped silently, by resolve_policy and the optimizers alike)."""
    default = resolve_policy("bf16")
    for field in ("exp_avg_dtype", "store_param_remainders", "Param_Remainder_Bits",
                  "momentum_dtype", "grad_reduce_in_fp32"):
        assert resolve_policy("bf16", {field: None}) == default, field
    for make in (lambda: resolve_policy("bf16", {"exp_avg_dtpye": None}),
                 lambda: precis.optim.AdamW([torch.nn.Parameter(torch.zeros(2))],
                                            policy={"exp_avg_dtpye": None})):
        with pytest.raises(ValueError) as e:
            make()
        assert_names(e, "exp_avg_dtpye", "is not a policy field", "exp_avg_dtype")


@pytest.mark.parametrize("model,overrides,field,value", [
    ("fp32", {"main_params_dtype": "fp16"}, "main_params_dtype", "fp16"),
    ("fp16", {"main_params_dtype": "bf16"}, "main_params_dtype", "bf16"),
    ("fp16", {"store_param_remainders": True}, "store_param_remainders", "fp16"),
    ("fp32", {"store_param_remainders": True}, "store_param_remainders", "fp32"),
    ("bf16", {"store_param_remainders": True, "main_params_dtype": "bf16"},
     "store_param_remainders", "bf16"),
    ("bf16", {"grad_reduce_in_fp32": True, "main_grads_dtype": "bf16"},
     "main_grads_dtype", "grad_reduce_in_fp32"),
    ("bf16", {"main_grads_dtype": "fp16", "grad_reduce_in_fp32": True},
     "grad_reduce_in_fp32", "main_grads_dtype"),
    ("bf16", {"grad_sum_dtype": "fp16"}, "grad_sum_dtype", "fp16"),
    ("fp32", {"grad_sum_dtype": "bf16"}, "grad_sum_dtype", "bf16"),
])
def test_bad_combinations(model, overrides, field, value):
    before = dict(overrides)
    with pytest.raises(ValueError) as e:
        resolve_policy(model, overrides)
    assert_names(e, field, value)
    assert overrides == before


def test_type_errors():
    with pytest.raises(TypeError, match="mapping"):
        resolve_policy("bf16", [("exp_avg_dtype", "fp32")])
    with pytest.raises(TypeError, match="keys must be str"):
        resolve_policy("bf16", {1: "fp32"})
    with pytest.raises(TypeError, match="exp_avg_dtype"):
        resolve_policy("bf16", {"exp_avg_dtype": ["fp32"]})
    with pytest.raises(TypeError, match="model_dtype"):
        resolve_policy(16)


def test_precis_errors_carry_the_status():
    with pytest.raises(precis.PrecisValueError) as e:
        resolve_policy("bf16", {"exp_avg_dtype": "int16"})
    assert e.value.status == 4  # PRECIS_ERR_INVALID_POLICY


ROUND_TRIP = [
    ("bf16", {}), ("fp16", {}), ("fp32", {}),
    ("bf16", {"store_param_remainders": True, "exp_avg_dtype": "fp8"}),
    ("bf16", {"main_grads_dtype": "fp16"}),  # grad_reduce_in_fp32 False, grads not in bf16
    ("bf16", {"main_params_dtype": "bf16", "grad_comm_dtype": "fp32"}),
    ("fp16", {"main_params_dtype": "fp16", "exp_avg_sq_dtype": "fp8"}),
    ("fp32", {"exp_avg_dtype": "bf16", "main_grads_dtype": "bf16", "grad_comm_dtype": "fp16"}),
    ("bf16", {"grad_sum_dtype": "fp32"}),
    ("fp32", {"grad_comm_dtype": "bf16", "grad_sum_dtype": "fp32"}),
    ("bf16", {"store_param_remainders": True, "param_remainder_bits": 8,
              "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}),
    ("bf16", {"exp_avg_dtype": "fp8", "momentum_dtype": "bf16"}),
    ("fp16", {"momentum_dtype": "fp8"}),
    ("fp32", {"exp_avg_dtype": "fp16"}),  # a momentum that follows
]


@pytest.mark.parametrize("model,overrides", ROUND_TRIP)
def test_dict_round_trip_json(model, overrides):
    p = resolve_policy(model, overrides)
    d = p.to_dict()
    # plain strings and bools, and the remainder's bit count
    assert all(isinstance(v, (str, bool)) for k, v in d.items() if k != "param_remainder_bits")
    assert type(d["param_remainder_bits"]) is int
    assert d["param_dtype"] == model
    assert Policy.from_dict(json.loads(json.dumps(d))) == p
    # The dict works without its derived keys too.
    core = {k: v for k, v in d.items() if k not in ("grad_reduce_in_fp32", "precision_aware")}
    assert Policy.from_dict(core) == p
    assert p.to_dict() == d  # from_dict did not touch anything


@pytest.mark.parametrize("model,overrides", ROUND_TRIP)
def test_dict_round_trip_yaml(model, overrides):
    yaml = pytest.importorskip("yaml")
    p = resolve_policy(model, overrides)
    text = yaml.safe_dump(p.to_dict())
    assert "torch" not in text  # plain strings, bools and an int
    assert Policy.from_dict(yaml.safe_load(text)) == p


def test_from_dict_rejections():
    d = resolve_policy("bf16").to_dict()
    with pytest.raises(ValueError, match="unknown keys.*(?=.*bogus)(?=.*lr)"):
        Policy.from_dict({**d, "bogus": 1, "lr": 2})
    with pytest.raises(ValueError, match="missing exp_avg_dtype"):
        Policy.from_dict({k: v for k, v in d.items() if k != "exp_avg_dtype"})
    with pytest.raises(ValueError, match="grad_reduce_in_fp32"):
        Policy.from_dict({**d, "grad_reduce_in_fp32": True})
    with pytest.raises(ValueError, match="precision_aware"):
        Policy.from_dict({**d, "precision_aware": False})
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        Policy.from_dict({**d, "exp_avg_dtype": "int16"})
    with pytest.raises(TypeError):
        Policy.from_dict("bf16")


def test_grad_sums_follow_the_wire_unless_set():
    assert resolve_policy("bf16").grad_sum_dtype == BF16
    assert resolve_policy("bf16", {"grad_comm_dtype": "fp32"}).grad_sum_dtype == F32
    p = resolve_policy("bf16", {"grad_sum_dtype": "fp32"})
    assert (p.grad_comm_dtype, p.grad_sum_dtype) == (BF16, F32)
    assert p.to_dict()["grad_sum_dtype"] == "fp32"
    # The constructor's default follows grad_comm_dtype, as C's does.
    assert Policy(BF16, F32, BF16, BF16, BF16, BF16).grad_sum_dtype == BF16
    assert Policy(BF16, F32, F32, BF16, BF16, BF16, False, F32) == resolve_policy(
        "bf16", {"main_grads_dtype": "fp32", "grad_comm_dtype": "bf16", "grad_sum_dtype": "fp32"})
    # A dict written before grad_sum_dtype existed (a checkpoint's group policy) loads.
    old = {k: v for k, v in resolve_policy("bf16", {"grad_comm_dtype": "fp32"}).to_dict().items()
           if k != "grad_sum_dtype"}
    assert Policy.from_dict(old).grad_sum_dtype == F32
    with pytest.raises(ValueError, match="grad_sum_dtype: bf16 with grad_comm_dtype fp32"):
        Policy(BF16, F32, F32, F32, BF16, BF16, False, BF16)


def test_policy_constructor_validates():
    with pytest.raises(ValueError, match="main_params_dtype"):
        Policy(F32, F16, F32, F32, F32, F32)
    with pytest.raises(TypeError):
        Policy("bf16", F32, BF16, BF16, BF16, BF16)
    p = resolve_policy("bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.exp_avg_dtype = F32
    assert hash(p) == hash(resolve_policy(BF16))


def test_bytes_per_param():
    assert resolve_policy("fp32").bytes_per_param() == dict(
        param=4, master=0, remainder=0, main_grad=4, exp_avg=4, exp_avg_sq=4, total=16)
    assert resolve_policy("bf16").bytes_per_param() == dict(
        param=2, master=4, remainder=0, main_grad=2, exp_avg=2, exp_avg_sq=2, total=12)
    assert resolve_policy("fp16").bytes_per_param()["total"] == 18
    b = resolve_policy("bf16", {"store_param_remainders": True, "exp_avg_dtype": "fp8",
                                "exp_avg_sq_dtype": "fp16"}).bytes_per_param()
    assert b == dict(param=2, master=0, remainder=2, main_grad=2, exp_avg=1 + 4 / 128,
                     exp_avg_sq=2 + 4 / 128, total=2 + 2 + 2 + 1 + 2 + 8 / 128)
    assert resolve_policy("bf16", {"main_params_dtype": "bf16"}).bytes_per_param()["master"] == 0


# --- coerce_dtype_kwargs ------------------------------------------------------

def test_coerce_converts_strings_and_leaves_the_rest():
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.95), "exp_avg_dtype": "bf16",
              "exp_avg_sq_dtype": " FP8 ", "main_params_dtype": torch.float32,
              "main_grads_dtype": None, "param_dtype": "half", "name": "fp16",
              "store_param_remainders": "true", "foo_dtype": "float64",
              "bar_dtype": "bfloat16", "baz_dtype": "torch.int32"}
    before = dict(kwargs)
    out = coerce_dtype_kwargs(kwargs)
    assert kwargs == before and out is not kwargs
    assert out == {"lr": 1e-3, "betas": (0.9, 0.95), "exp_avg_dtype": BF16,
                   "exp_avg_sq_dtype": FP8, "main_params_dtype": F32,
                   "main_grads_dtype": None, "param_dtype": F16, "name": "fp16",
                   "store_param_remainders": "true", "foo_dtype": torch.float64,
                   "bar_dtype": BF16, "baz_dtype": torch.int32}
    assert coerce_dtype_kwargs({}) == {}


@pytest.mark.parametrize("key,value", [
    ("exp_avg_dtype", "bf17"), ("exp_avg_dtype", "int16"), ("main_grads_dtype", "fp8"),
    ("grad_comm_dtype", "uint8"), ("main_params_dtype", "int16"), ("param_dtype", "fp8"),
    ("param_dtype", "float64"),
])
def test_coerce_rejects_outside_the_legal_set(key, value):
    kwargs = {key: value}
    with pytest.raises(ValueError) as e:
        coerce_dtype_kwargs(kwargs)
    assert_names(e, key, repr(value), *LEGAL[key])
    assert kwargs == {key: value}


def test_coerce_rejects_unknown_names_for_other_keys():
    with pytest.raises(ValueError) as e:
        coerce_dtype_kwargs({"foo_dtype": "float65"})
    assert_names(e, "foo_dtype", "float65", "fp32", "bf16")
    with pytest.raises(TypeError):
        coerce_dtype_kwargs([("exp_avg_dtype", "bf16")])


def test_coerced_kwargs_feed_resolve_policy():
    out = coerce_dtype_kwargs({"exp_avg_dtype": "fp8", "main_grads_dtype": "fp32"})
    assert resolve_policy("bf16", out) == expected(BF16, exp_avg_dtype=FP8,
                                                   main_grads_dtype=F32, grad_comm_dtype=F32)


# --- momentum_dtype: the one state of SGD, Lion and Muon ---------------------------

def test_momentum_follows_exp_avg_unless_set():
    for model in DEFAULTS:
        for m in ("fp32", "fp16", "bf16", "fp8", F16, FP8, "torch.bfloat16"):
            p = resolve_policy(model, {"exp_avg_dtype": m})
            assert p.momentum_dtype == p.exp_avg_dtype, (model, m)
    # An explicit momentum wins over exp_avg, whatever the order of the mapping.
    for overrides in ({"exp_avg_dtype": "fp8", "momentum_dtype": "bf16"},
                      {"momentum_dtype": "bf16", "exp_avg_dtype": "fp8"},
                      {"momentum_dtype": BF16, "exp_avg_dtype": torch.uint8}):
        p = resolve_policy("fp16", overrides)
        assert (p.exp_avg_dtype, p.momentum_dtype) == (FP8, BF16), overrides
        assert p == expected(F16, exp_avg_dtype=FP8, momentum_dtype=BF16)
    # Explicitly the same as exp_avg, or None (the default: follows).
    assert resolve_policy("bf16", {"momentum_dtype": "bf16"}) == resolve_policy("bf16")
    assert resolve_policy("bf16", {"momentum_dtype": None, "exp_avg_dtype": "fp8"}
                          ).momentum_dtype == FP8
    # Other overrides leave it with exp_avg.
    p = resolve_policy("bf16", {"grad_reduce_in_fp32": True, "exp_avg_sq_dtype": "fp8"})
    assert p.momentum_dtype == BF16


def test_momentum_from_yaml_style_mapping():
    yaml = pytest.importorskip("yaml")
    for text, want in [("exp_avg_dtype: fp8\n", (FP8, FP8)),
                       ("exp_avg_dtype: fp8\nmomentum_dtype: bfloat16\n", (FP8, BF16)),
                       ("momentum_dtype: uint8\nexp_avg_dtype: fp32\n", (F32, FP8)),
                       ("momentum_dtype: null\n", (BF16, BF16))]:
        overrides = yaml.safe_load(text)
        p = resolve_policy("bf16", overrides)
        assert (p.exp_avg_dtype, p.momentum_dtype) == want, text
    # Strings through coerce_dtype_kwargs, then resolve: the same policy.
    out = coerce_dtype_kwargs({"momentum_dtype": "fp8", "lr": 0.1})
    assert out == {"momentum_dtype": FP8, "lr": 0.1}
    out.pop("lr")
    assert resolve_policy("bf16", out).momentum_dtype == FP8


def test_momentum_errors_name_the_field():
    for value in ("int16", "uint16", torch.float64, " fp 8"):
        with pytest.raises(ValueError) as e:
            resolve_policy("bf16", {"exp_avg_dtype": "fp8", "momentum_dtype": value})
        assert_names(e, "momentum_dtype", "fp32", "fp16", "bf16", "fp8")
    with pytest.raises(precis.PrecisValueError) as e:
        resolve_policy("bf16", {"momentum_dtype": "int16"})
    assert e.value.status == 4  # PRECIS_ERR_INVALID_POLICY
    assert_names(e, "momentum_dtype: int16 is not allowed; legal: fp32, fp16, bf16, fp8")
    with pytest.raises(precis.PrecisValueError) as e:
        resolve_policy("bf16", {"momentum_dtype": "bf17"})
    assert e.value.status == 3  # PRECIS_ERR_INVALID_DTYPE
    assert_names(e, "momentum_dtype", "'bf17' is not a dtype")
    with pytest.raises(ValueError) as e:
        coerce_dtype_kwargs({"momentum_dtype": "int16"})
    assert_names(e, "momentum_dtype", "'int16'", *LEGAL["momentum_dtype"])
    with pytest.raises(TypeError, match="momentum_dtype"):
        resolve_policy("bf16", {"momentum_dtype": 3.5})
    with pytest.raises(ValueError, match="unknown keys.*momentum"):
        Policy.from_dict({**resolve_policy("bf16").to_dict(), "momentum": "fp32"})


def test_momentum_in_the_policy_object():
    p = resolve_policy("bf16", {"momentum_dtype": "fp8"})
    assert p.momentum_dtype is torch.uint8  # fp8 state is uint8 bytes, as for exp_avg
    assert "momentum_dtype=torch.uint8" in repr(p)
    assert p != resolve_policy("bf16") and hash(p) != hash(resolve_policy("bf16"))
    assert p == dataclasses.replace(resolve_policy("bf16"), momentum_dtype=FP8)
    assert p.to_dict()["momentum_dtype"] == "fp8"
    assert p.to_struct().momentum_dtype == precis._lib.DTYPE_FP8_E4M3
    assert Policy.from_struct(p.to_struct()) == p
    # The constructor: None follows exp_avg_dtype (as C does); C checks the legal set.
    assert Policy(BF16, F32, BF16, BF16, FP8, BF16).momentum_dtype == FP8
    assert Policy(BF16, F32, BF16, BF16, FP8, BF16, momentum_dtype=F16).momentum_dtype == F16
    with pytest.raises(ValueError, match="momentum_dtype: int16 is not allowed"):
        Policy(BF16, F32, BF16, BF16, BF16, BF16, momentum_dtype=torch.int16)
    with pytest.raises(TypeError, match="momentum_dtype"):
        Policy(BF16, F32, BF16, BF16, BF16, BF16, momentum_dtype="fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.momentum_dtype = F32
    # A dict written before momentum_dtype existed loads, the momentum following exp_avg.
    old = {k: v for k, v in resolve_policy("fp16", {"exp_avg_dtype": "fp8"}).to_dict().items()
           if k != "momentum_dtype"}
    assert Policy.from_dict(old).momentum_dtype == FP8
    # The struct mirror has the member, where C puts it.
    assert precis._lib.PolicyStruct.momentum_dtype.offset == (
        precis._lib.PolicyStruct.param_remainder_bits.offset + 4)
    assert precis._lib.FIELD_MOMENTUM_DTYPE == 9
