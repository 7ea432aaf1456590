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


def _stepped_state(policy, dtype=BF16, numel=129):
    """The state dtypes of one AdamW step over a param of `dtype` under `policy`."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(numel, dtype=dtype))
    opt = precis.optim.AdamW([w], policy=policy)
    w.grad = torch.randn_like(w)
    opt.step()
    return {k: v.dtype for k, v in opt.state[w].items() if torch.is_tensor(v) and v.dim() > 0}


@pytest.mark.parametrize("model,overrides", ROUND_TRIP[:4] + ROUND_TRIP[-3:-1])
def test_a_whole_policy_written_by_to_dict_is_taken_as_policy(model, overrides):
    """policy=p.to_dict() (a policy saved to YAML or JSON and read back) is the policy p,
    not a mapping of overrides that C refused for its param_dtype key; for params of
    another dtype it is refused as the Policy itself is."""
    p = resolve_policy(model, overrides)
    dtype = p.param_dtype
    for given in (p.to_dict(), json.loads(json.dumps(p.to_dict()))):
        assert _stepped_state(given, dtype) == _stepped_state(p, dtype)
    other = F32 if dtype != F32 else BF16
    for given in (p, p.to_dict()):
        with pytest.raises(ValueError) as e:
            precis.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=other))], policy=given)
        assert_names(e, f"the policy is for {dtype} params but a param is {other}")
    # A whole one is read whole: a field left out is named, not taken as its default,
    # and a bad one is not answered as overrides' (a param group of their own).
    partial = {k: v for k, v in p.to_dict().items() if k != "exp_avg_sq_dtype"}
    with pytest.raises(ValueError, match="read as a whole policy .as Policy.to_dict.. writes "
                                         "one., not as overrides: .*missing exp_avg_sq_dtype"):
        precis.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=dtype))], policy=partial)
    bad = {**p.to_dict(), "param_remainder_bits": 8, "store_param_remainders": False}
    with pytest.raises(ValueError) as e:
        precis.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=dtype)),
                            torch.nn.Parameter(torch.zeros(3, dtype=other))], policy=bad)
    assert_names(e, "read as a whole policy", "param_remainder_bits")
    assert "a param group of their own" not in str(e.value)
    assert e.value.status == precis._lib.ERR_INVALID_POLICY
    # A param_dtype left blank (YAML's None) is no whole policy: overrides, as before.
    blank = {"param_dtype": None, "exp_avg_dtype": "fp32"}
    assert _stepped_state(blank, dtype)["exp_avg"] == F32


def test_derived_keys_are_read_as_booleans_from_a_configs_strings():
    """from_dict's grad_reduce_in_fp32 and precision_aware, given as strings (a config
    system's), are read as C reads a boolean field, not compared as strings."""
    for model in ("bf16", "fp16"):
        p = resolve_policy(model)
        d = p.to_dict()
        words = {True: ("true", "1", " Yes ", "on"), False: ("false", "0", "no", "OFF")}
        for key in ("grad_reduce_in_fp32", "precision_aware"):
            for word in words[getattr(p, key)]:
                assert Policy.from_dict({**d, key: word}) == p, (model, key, word)
            for word in words[not getattr(p, key)]:
                with pytest.raises(ValueError) as e:
                    Policy.from_dict({**d, key: word})
                assert_names(e, key, "contradicts the fields")
            with pytest.raises(ValueError) as e:
                Policy.from_dict({**d, key: "maybe"})
            assert_names(e, f"{key}='maybe' is not a boolean", "true", "false")
            assert Policy.from_dict({**d, key: None}) == p  # (left blank: not there)


def test_numpy_scalars_are_read_as_pythons():
    """A config library's numpy bool and int (np.True_, np.int64(8)) are the policy their
    Python values give; an unsupported type is named with what the field takes."""
    np = pytest.importorskip("numpy")
    want = resolve_policy("bf16", {"store_param_remainders": True, "param_remainder_bits": 8})
    for rem, bits in ((np.True_, np.int64(8)), (np.bool_(True), np.int32(8)), (True, 8)):
        got = resolve_policy("bf16", {"store_param_remainders": rem, "param_remainder_bits": bits})
        assert got == want, (rem, bits)
    assert not resolve_policy("bf16", {"store_param_remainders": np.False_}).store_param_remainders
    with pytest.raises(TypeError, match="param_remainder_bits must be an int .16 or 8., a str"):
        resolve_policy("bf16", {"store_param_remainders": True, "param_remainder_bits": 8.0})
    with pytest.raises(TypeError, match="store_param_remainders must be a bool, a str"):
        resolve_policy("bf16", {"store_param_remainders": np.array([True, False])})
    with pytest.raises(TypeError, match="exp_avg_dtype must be a torch.dtype, a str"):
        resolve_policy("bf16", {"exp_avg_dtype": np.float32})
    with pytest.raises(TypeError, match="STORE_PARAM_REMAINDERS must be a bool, a str"):
        resolve_policy("bf16", {"STORE_PARAM_REMAINDERS": 1.0})  # (C folds the key's case)


def test_a_field_named_twice_in_any_case_is_refused():
    """"exp_avg_dtype" and "EXP_AVG_DTYPE" in one mapping (C folds case): refused naming
    both spellings, where the later one silently won."""
    for overrides in ({"exp_avg_dtype": "fp32", "EXP_AVG_DTYPE": "fp8"},
                      {" store_param_remainders": True, "Store_Param_Remainders": False}):
        first, second = overrides
        with pytest.raises(ValueError) as e:
            resolve_policy("bf16", overrides)
        assert_names(e, f"'{first}'", f"'{second}'", first.strip().lower(), "give it once")
        with pytest.raises(ValueError) as e:
            precis.optim.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=BF16))], policy=overrides)
        assert_names(e, "AdamW param group 0", f"'{second}'")


def test_an_unknown_dtype_name_lists_only_what_its_field_takes():
    """The names listed for a misspelt dtype are its field's (every spelling), not every
    dtype's: no int16 for a moment, no fp8 or int16 for a master."""
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {"exp_avg_dtype": "int7"})
    assert_names(e, "exp_avg_dtype: 'int7' is not a dtype; accepted: fp32, float32, float, "
                    "fp16, float16, half, bf16, bfloat16, fp8, float8, fp8_e4m3, e4m3, uint8 ")
    with pytest.raises(ValueError) as e:
        resolve_policy("bf16", {"main_params_dtype": "fp64"})
    assert_names(e, "main_params_dtype: 'fp64' is not a dtype; accepted: fp32, float32, float, "
                    "fp16, float16, half, bf16, bfloat16 ")


@pytest.mark.parametrize("make", [
    lambda params, policy: precis.optim.AdamW(params, policy=policy),
    lambda params, policy: precis.optim.SGD(params, lr=0.1, momentum=0.9, policy=policy),
])
def test_a_policy_is_read_for_params_it_does_not_apply_to(make):
    """A group of float64 params (torch's math and state) never resolved its policy: a
    misspelt key or value passed silently. Each override is now checked alone (the
    mapping may be meant for the group's bf16 params), the param group named."""
    f64 = [torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))]
    mixed = f64 + [torch.nn.Parameter(torch.zeros(5, dtype=BF16))]
    for bad, names in (({"exp_avg_dtpye": "bf16"}, ("'exp_avg_dtpye' is not a policy field",)),
                       ({"momentum_dtyp": None}, ("'momentum_dtyp' is not a policy field",)),
                       ({"exp_avg_dtype": "int7"}, ("exp_avg_dtype: 'int7' is not a dtype",)),
                       ({"exp_avg_sq_dtype": "int16"}, ("exp_avg_sq_dtype: int16 is not allowed",)),
                       ({"store_param_remainders": "maybe"}, ("'maybe' is not a boolean",)),
                       ({"param_remainder_bits": 12}, ("param_remainder_bits: '12'",))):
        with pytest.raises(ValueError) as e:
            make(f64, bad)
        assert_names(e, "param group 0", *names)
    # What is meant for the group's bf16 params, each field alone legal, is taken.
    for good in ({"store_param_remainders": "true", "param_remainder_bits": 8,
                  "exp_avg_dtype": "fp8", "momentum_dtype": None},
                 resolve_policy("bf16", {"exp_avg_sq_dtype": "fp8"}),
                 resolve_policy("bf16").to_dict()):
        make(f64, good)
    make(mixed, {"store_param_remainders": True})
    # A key given twice (two cases) is refused as for bf16 params.
    with pytest.raises(ValueError, match="'exp_avg_dtype' and 'EXP_AVG_DTYPE' both name"):
        make(f64, {"exp_avg_dtype": "fp32", "EXP_AVG_DTYPE": "bf16"})
    # A whole policy's fields are checked whole.
    with pytest.raises(ValueError, match="missing exp_avg_dtype"):
        make(f64, {k: v for k, v in resolve_policy("bf16").to_dict().items()
                   if k != "exp_avg_dtype"})


def test_a_refused_policy_names_its_param_group():
    """A policy refused at add_param_group (or construction) names the group, once, and
    the optimizer is left as it was."""
    w = torch.nn.Parameter(torch.zeros(4, dtype=BF16))
    opt = precis.optim.AdamW([w], policy={"exp_avg_dtype": "fp8"})
    v = torch.nn.Parameter(torch.zeros(4, dtype=BF16))
    with pytest.raises(ValueError) as e:
        opt.add_param_group({"params": [v], "policy": {"exp_avg_dtype": "int7"}})
    assert str(e.value).startswith("AdamW param group 1: ")
    assert_names(e, "exp_avg_dtype: 'int7'")
    assert e.value.status == precis._lib.ERR_INVALID_DTYPE  # (C's status kept)
    h = torch.nn.Parameter(torch.zeros(4, dtype=F16))  # remainders need bf16 params
    with pytest.raises(ValueError) as e:
        opt.add_param_group({"params": [h], "policy": {"store_param_remainders": True}})
    assert str(e.value).startswith("AdamW param group 1: the policy ")
    assert "AdamW: " not in str(e.value)
    with pytest.raises(ValueError) as e:
        precis.optim.AdamW([{"params": [w]}, {"params": [v], "policy": {"bogus": 1}}])
    assert str(e.value).startswith("AdamW param group 1: ")
    # An error whose type takes other arguments keeps its own (a ValueError all the same).
    with pytest.raises(UnicodeEncodeError):
        opt.add_param_group({"params": [v], "policy": {"exp_avg_dtype": "bf\ud800"}})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [w]
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.state[w]["exp_avg"].dtype == torch.uint8
