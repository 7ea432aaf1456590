"""precis.optim state dicts through plain torch.distributed.checkpoint (issue 80): every
optimizer and policy saved with dcp.save({"optim": opt.state_dict()}), loaded with
dcp.load into a template from a new optimizer's state_dict() and load_state_dict, continues
bit for bit, as torch.optim's do. dcp.load copies tensors into the template's in place
but sets any other value (the step marker's bytes, fp8 codes, fingerprints, streams) at
a path of str keys: beside a param's int id 3 it leaves an entry '3' holding them, which
load_state_dict merges back (checkpoint.dcp_merged)."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import precis  # noqa: F401
import precis.optim as optim
from precis.checkpoint import STEP_MARKER

F32, BF16 = torch.float32, torch.bfloat16

POLICIES = {
    "fp32": (F32, None),
    "bf16_default": (BF16, None),  # fp32 masters
    "remainders16": (BF16, {"store_param_remainders": True}),
    "fp8_remainders8": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
                               "store_param_remainders": True, "param_remainder_bits": 8}),
}


def make_model(dtype, seed):
    torch.manual_seed(seed)
    # odd sizes: a 127 x 33 matrix, a 1-element bias, a 4097-element vector
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(33, 127), "b": torch.nn.Linear(127, 1)})
    model.register_parameter("v", torch.nn.Parameter(torch.randn(4097) * 0.1))
    return model.to(dtype)


def forward(model, step):
    g = torch.Generator().manual_seed(step)
    dtype = model.v.dtype
    x = torch.randn(5, 33, generator=g).to(dtype)
    return (model["b"](torch.tanh(model["a"](x))).float() ** 2).mean() + \
        (model.v.float() * torch.randn(4097, generator=g)).sum() * 1e-3


def make_opt(name, model, policy):
    matrices = [model["a"].weight, model["b"].weight]
    others = [model["a"].bias, model["b"].bias, model.v]
    if name in ("Muon", "NorMuon"):  # one object: an "adamw" group for the rest
        return getattr(optim, name)([{"params": others, "algorithm": "adamw", "lr": 3e-3},
                                     {"params": matrices}], lr=0.02, policy=policy)
    kw = {"AdamW": dict(lr=1e-2, weight_decay=0.05), "SGD": dict(lr=1e-2, momentum=0.9),
          "Lion": dict(lr=1e-3, weight_decay=0.1)}[name]
    return getattr(optim, name)([{"params": matrices, "lr": kw["lr"] * 2},
                                 {"params": others}], policy=policy, **kw)


def train(model, opt, steps, start):
    for step in range(start, start + steps):
        opt.zero_grad()
        forward(model, step).backward()
        opt.step()


def bits(t):
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(as_int)


def assert_same(model_a, opt_a, model_b, opt_b):
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(bits(pa), bits(pb)), name
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for pa, pb in zip(params_a, params_b):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(bits(sa[k]), bits(sb[k])), k


def non_tensors(sd):
    return {(pid, k): v for pid, st in sd["state"].items() for k, v in st.items()
            if not isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "Muon", "NorMuon"])
def test_plain_dcp_round_trip_continues_bit_for_bit(tmp_path, name, policy):
    dtype, pol = POLICIES[policy]
    straight = make_model(dtype, 0)
    opt_straight = make_opt(name, straight, pol)
    train(straight, opt_straight, 6, 0)

    first = make_model(dtype, 0)
    opt_first = make_opt(name, first, pol)
    train(first, opt_first, 3, 0)
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    saved = opt_first.state_dict()
    with warnings.catch_warnings():  # (no process group: DCP says it saves in one process)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path))

    # A new run: its optimizer stepped once (so that its state_dict() is a template
    # holding every param's state), then the model's weights and the optimizer loaded.
    resumed = make_model(dtype, 1)
    opt_resumed = make_opt(name, resumed, pol)
    train(resumed, opt_resumed, 1, 100)
    resumed.load_state_dict(weights)
    template = {"optim": opt_resumed.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, checkpoint_id=str(tmp_path))
    loaded = template["optim"]
    # What DCP gives back: each non-tensor value, exactly as saved, under its id as a str.
    expected = {(str(pid), k): v for (pid, k), v in non_tensors(saved).items()}
    got = {key: v for key, v in non_tensors(loaded).items() if isinstance(key[0], str)}
    assert got == expected
    assert all(type(got[key]) is type(v) for key, v in expected.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a proper resume warns of nothing
        opt_resumed.load_state_dict(loaded)
        train(resumed, opt_resumed, 3, 3)
    assert_same(straight, opt_straight, resumed, opt_resumed)


def test_a_str_id_no_group_lists_is_refused_naming_what_to_call():
    model = make_model(BF16, 0)
    opt = make_opt("AdamW", model, None)
    train(model, opt, 1, 0)
    sd = opt.state_dict()
    assert sd["state"][0]["step"] == STEP_MARKER
    sd["state"]["9"] = {"step": STEP_MARKER}  # as dcp.load leaves it, for an id not listed
    with pytest.raises(ValueError, match=r"param id '9', which no param group lists.*"
                                         r"torch.distributed.checkpoint.load.*state_dict\(\)"):
        opt.load_state_dict(sd)
