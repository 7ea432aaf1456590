"""precis.optim.Adam / AdamW: torch parity, policies, the op, loss scaling, API behaviour."""
import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import precis
import precis.optim as optim
from precis import ops

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.uint8


def mlp(dtype=F32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    return model.to(dtype)


def batch(step, dtype=F32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def train_step(model, opt, step, closure=False, sign=1.0):
    """One step on the MSE loss; sign=-1 with maximize=True ascends -MSE (a stable
    trajectory, where ascending the MSE would diverge)."""
    x, y = batch(step, next(model.parameters()).dtype)

    def compute():
        opt.zero_grad()
        loss = sign * ((model(x).float() - y.float()) ** 2).mean()
        loss.backward()
        return loss

    if closure:
        return opt.step(compute)
    compute()
    opt.step()


def max_diff(model_a, model_b):
    return max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(model_a.parameters(), model_b.parameters()))


def bits(t):
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(as_int)


def snapshot(model, opt):
    """Everything that must stay put when a step is skipped, as raw bits."""
    params = [bits(p).clone() for p in model.parameters()]
    state = {i: {k: (bits(v).clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for i, p in enumerate(model.parameters()) if p in opt.state}
    return params, state


def same_snapshot(a, b):
    pa, sa = a
    pb, sb = b
    if len(pa) != len(pb) or not all(torch.equal(x, y) for x, y in zip(pa, pb)):
        return False
    if sa.keys() != sb.keys():
        return False
    for i in sa:
        if sa[i].keys() != sb[i].keys():
            return False
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            if torch.is_tensor(x) != torch.is_tensor(y):
                return False
            if (torch.equal(x, y) if torch.is_tensor(x) else x == y) is False:
                return False
    return True


# ---------------------------------------------------------------------------
# torch parity (fp32 params, default policy: fp32 everything, no master)
# ---------------------------------------------------------------------------

PARITY = [
    ("adamw", optim.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    ("adamw_wd", optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("adamw_max", optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, maximize=True)),
    ("adam", optim.Adam, torch.optim.Adam, dict(lr=1e-2)),
    ("adam_wd", optim.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    ("adam_max_wd", optim.Adam, torch.optim.Adam, dict(lr=1e-2, maximize=True,
                                                       weight_decay=0.05)),
    ("adamw_betas_eps", optim.AdamW, torch.optim.AdamW,
     dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.02)),
]


@pytest.mark.parametrize("name,ours,theirs,kw", PARITY, ids=[p[0] for p in PARITY])
def test_matches_torch_over_100_steps(name, ours, theirs, kw):
    a, b = mlp(), mlp()
    opt_a, opt_b = ours(a.parameters(), **kw), theirs(b.parameters(), **kw)
    sign = -1.0 if kw.get("maximize") else 1.0
    for step in range(100):
        train_step(a, opt_a, step, sign=sign)
        train_step(b, opt_b, step, sign=sign)
    # torch 2.13's arithmetic, op by op (tests/py/optimizers/test_torch_parity.py): the same bits
    for pa, pb in zip(a.parameters(), b.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa["step"] == 100 and float(sb["step"]) == 100
        assert "master" not in sa and "remainder" not in sa  # fp32: the param is its own master
        assert torch.equal(pa, pb)
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_defaults_match_torch():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert optim.AdamW(p).defaults["weight_decay"] == 0.01
    assert optim.Adam(p).defaults["weight_decay"] == 0.0
    for cls in (optim.AdamW, optim.Adam):
        d = cls(p).defaults
        assert (d["lr"], d["betas"], d["eps"], d["maximize"]) == (1e-3, (0.9, 0.999), 1e-8, False)
        assert isinstance(cls(p), torch.optim.Optimizer)


def test_param_groups_with_their_own_lr_and_weight_decay():
    a, b = mlp(), mlp()

    def groups(model):
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        return [{"params": layers[0].parameters(), "lr": 3e-2, "weight_decay": 0.0},
                {"params": layers[1].parameters()},
                {"params": layers[2].parameters(), "lr": 1e-3, "weight_decay": 0.5}]

    opt_a = optim.AdamW(groups(a), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(groups(b), lr=1e-2, weight_decay=0.1)
    for step in range(30):
        train_step(a, opt_a, step)
        train_step(b, opt_b, step)
    assert max_diff(a, b) == 0  # bit for bit with torch
    assert [g["lr"] for g in opt_a.param_groups] == [3e-2, 1e-2, 1e-3]


def test_add_param_group_mid_training():
    a, b = mlp(), mlp()
    opts = []
    for model, cls in ((a, optim.AdamW), (b, torch.optim.AdamW)):
        params = list(model.parameters())
        opt = cls(params[:2], lr=1e-2)
        opts.append((model, opt, params[2:]))
    for step in range(20):
        if step == 10:
            for _, opt, rest in opts:
                opt.add_param_group({"params": rest, "lr": 5e-3})
        for model, opt, _ in opts:
            train_step(model, opt, step)
    assert max_diff(a, b) == 0
    assert opts[0][1].state[opts[0][2][0]]["step"] == 10


def test_lr_scheduler_is_followed():
    a, b = mlp(), mlp()
    opt_a, opt_b = optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    sch_a = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 1.0 / (1 + s))
    sch_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0 / (1 + s))
    for step in range(20):
        train_step(a, opt_a, step)
        train_step(b, opt_b, step)
        sch_a.step()
        sch_b.step()
    assert opt_a.param_groups[0]["lr"] == pytest.approx(1e-2 / 21)
    assert max_diff(a, b) == 0


def test_lr_zero_freezes_params_and_lr_change_is_read_every_step():
    model = mlp()
    opt = optim.Adam(model.parameters(), lr=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, 0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.param_groups[0]["lr"] = 1e-2
    train_step(model, opt, 1)
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_closure():
    a, b = mlp(), mlp()
    opt_a, opt_b = optim.AdamW(a.parameters(), lr=1e-2), optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(5):
        loss = train_step(a, opt_a, step, closure=True)
        assert torch.is_tensor(loss) and loss.requires_grad
        train_step(b, opt_b, step)
    assert max_diff(a, b) == 0


def test_zero_grad():
    model = mlp()
    opt = optim.AdamW(model.parameters())
    train_step(model, opt, 0)
    opt.zero_grad()  # set_to_none=True by default
    assert all(p.grad is None for p in model.parameters())
    train_step(model, opt, 1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_params_without_grad_are_skipped():
    model = mlp()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    train_step(model, opt, 0)
    assert torch.equal(frozen, before)
    assert frozen not in opt.state or not opt.state[frozen]
    assert opt.state[model[0].bias]["step"] == 1


def test_empty_param_and_empty_optimizer_step():
    empty = torch.nn.Parameter(torch.zeros(0))
    other = torch.nn.Parameter(torch.ones(3))
    opt = optim.AdamW([empty, other], lr=0.1)
    empty.grad = torch.zeros(0)
    other.grad = torch.ones(3)
    opt.step()
    assert opt.state[empty]["step"] == 1 and opt.state[other]["step"] == 1
    assert bool((other < 1).all())
    opt.zero_grad()
    opt.step()  # no grads at all: nothing happens
    assert opt.state[other]["step"] == 1


@pytest.mark.parametrize("bits", [16, 8])
def test_deepcopy_continues_identically(bits):
    policy = {"store_param_remainders": True, "param_remainder_bits": bits}
    a = mlp(BF16)
    opt_a = optim.AdamW(a.parameters(), lr=1e-2, policy=policy)
    for step in range(3):
        train_step(a, opt_a, step)
    b = copy.deepcopy(a)
    opt_b = optim.AdamW(b.parameters(), lr=1e-2, policy=policy)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    opt_c = copy.deepcopy(opt_a)  # pickling path: __getstate__/__setstate__
    assert isinstance(opt_c, optim.AdamW)
    for step in range(3, 6):
        train_step(a, opt_a, step)
        train_step(b, opt_b, step)
    assert max_diff(a, b) == 0


# ---------------------------------------------------------------------------
# Policies and state
# ---------------------------------------------------------------------------


def state_dtypes(opt, p):
    return {k: v.dtype for k, v in opt.state[p].items()
            if torch.is_tensor(v) and k not in ("step", "stream")}  # counters


def test_default_policy_per_param_dtype():
    p32 = torch.nn.Parameter(torch.randn(300))
    p16 = torch.nn.Parameter(torch.randn(300).to(F16))
    pbf = torch.nn.Parameter(torch.randn(300).to(BF16))
    opt = optim.AdamW([p32, p16, pbf])
    for p in (p32, p16, pbf):
        p.grad = torch.randn(300).to(p.dtype)
    opt.step()
    assert state_dtypes(opt, p32) == {"exp_avg": F32, "exp_avg_sq": F32}
    assert state_dtypes(opt, p16) == {"exp_avg": F32, "exp_avg_sq": F32, "master": F32}
    assert state_dtypes(opt, pbf) == {"exp_avg": BF16, "exp_avg_sq": BF16, "master": F32}
    for p in (p32, p16, pbf):
        for t in opt.state[p].values():
            if torch.is_tensor(t):
                assert t.is_contiguous() and t.device == p.device


def test_overrides_mapping_and_policy_object():
    pbf = torch.nn.Parameter(torch.randn(1000).to(BF16))
    p32 = torch.nn.Parameter(torch.randn(1000))
    overrides = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": torch.float16,
                 "store_param_remainders": True}
    # the mapping applies per param dtype: remainders only make sense for bf16 params
    with pytest.raises(ValueError, match="store_param_remainders"):
        optim.AdamW([p32], policy=overrides)
    opt = optim.AdamW([pbf], policy=overrides)
    pbf.grad = torch.randn(1000).to(BF16)
    opt.step()
    st = opt.state[pbf]
    assert state_dtypes(opt, pbf) == {"exp_avg": FP8, "exp_avg_sq": F16, "remainder": torch.int16,
                                      "exp_avg_scale": F32, "exp_avg_sq_scale": F32}
    assert st["exp_avg_scale"].numel() == ops.scale_count(1000) == math.ceil(1000 / 128)
    assert overrides == {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": torch.float16,
                         "store_param_remainders": True}  # never mutated

    policy = precis.resolve_policy(BF16, {"exp_avg_dtype": "fp32"})
    opt2 = optim.AdamW([pbf], policy=policy)
    opt2.step()
    assert state_dtypes(opt2, pbf) == {"exp_avg": F32, "exp_avg_sq": BF16, "master": F32}
    with pytest.raises(ValueError, match="policy is for torch.bfloat16 params"):
        optim.AdamW([p32], policy=policy)


def test_remainders_reproduce_fp32_master_bit_for_bit():
    """bf16 params: the int16-remainder policy carries exactly the fp32 master that
    the explicit fp32-master policy keeps (same moments too), step after step."""
    n = 5000
    init = torch.randn(n).to(BF16)
    pa, pb = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt_a = optim.AdamW([pa], lr=1e-2, weight_decay=0.1)  # default: fp32 master
    opt_b = optim.AdamW([pb], lr=1e-2, weight_decay=0.1, policy={"store_param_remainders": True})
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        g = (torch.randn(n, generator=gen) * 1e-2).to(BF16)
        pa.grad, pb.grad = g, g.clone()
        opt_a.step()
        opt_b.step()
        master_a = opt_a.state[pa]["master"]
        master_b = opt_b.master_weight(pb)
        assert torch.equal(bits(master_a), bits(master_b))
        assert torch.equal(bits(opt_a.state[pa]["exp_avg"]), bits(opt_b.state[pb]["exp_avg"]))
        assert torch.equal(bits(opt_a.state[pa]["exp_avg_sq"]),
                           bits(opt_b.state[pb]["exp_avg_sq"]))
    # the params are both roundings of the same master (they may differ on exact ties)
    assert float((pa.detach().float() - pb.detach().float()).abs().max()) <= \
        float(pa.detach().float().abs().max()) * 2 ** -8


def test_8bit_corrections_step_as_an_fp32_master_rounded_to_24_bits():
    """bf16 params with 8-bit corrections step exactly as the fp32-master policy does
    from a master rounded to nearest even at 24 bits after each step: the kernel reads
    the 24-bit master, steps in fp32 and rounds it back (same moments too)."""
    n = 4097
    init = torch.randn(n).to(BF16)
    pa, pb = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt_a = optim.AdamW([pa], lr=1e-2, weight_decay=0.1)  # default: fp32 master
    opt_b = optim.AdamW([pb], lr=1e-2, weight_decay=0.1,
                        policy={"store_param_remainders": True, "param_remainder_bits": 8})
    gen = torch.Generator().manual_seed(0)
    rounded_away = 0
    for _ in range(20):
        g = (torch.randn(n, generator=gen) * 1e-2).to(BF16)
        pa.grad, pb.grad = g, g.clone()
        opt_a.step()
        opt_b.step()
        assert opt_b.state[pb]["remainder"].dtype == FP8
        master_a = opt_a.state[pa]["master"]
        high, low = optim.remainder_split(master_a, bits=8)
        master24 = optim.remainder_join(high, low)
        rounded_away += int((master24 != master_a).sum())
        assert torch.equal(bits(opt_b.master_weight(pb)), bits(master24))
        assert torch.equal(pb.detach(), high)
        assert torch.equal(bits(opt_a.state[pa]["exp_avg"]), bits(opt_b.state[pb]["exp_avg"]))
        assert torch.equal(bits(opt_a.state[pa]["exp_avg_sq"]),
                           bits(opt_b.state[pb]["exp_avg_sq"]))
        with torch.no_grad():  # a's next step starts from the 24-bit master too (its
            master_a.copy_(master24)  # param rounded to nearest: no resync)
            pa.copy_(master24.to(BF16))
    assert rounded_away > n  # the 24-bit rounding happened, step after step


def test_main_grad_is_used_instead_of_grad():
    n = 257
    init = torch.randn(n).to(BF16)
    g32 = torch.randn(n)
    pa, pb, pc = (torch.nn.Parameter(init.clone()) for _ in range(3))
    pa.main_grad, pa.grad = g32.clone(), torch.full((n,), 1e4, dtype=BF16)
    pb.main_grad = g32.clone()
    pc.grad = torch.full((n,), 1e4, dtype=BF16)
    opts = [optim.AdamW([p], lr=1e-2) for p in (pa, pb, pc)]
    for opt in opts:
        opt.step()
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)
    assert torch.equal(pa.main_grad, g32)  # gradients are read, never written


class _PrecisOpLog(TorchDispatchMode):
    """Records every torch.ops.precis.* call: (op name, dtypes of its first list)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "precis":
            self.calls.append((func.overloadpacket.__name__, [t.dtype for t in args[0]]))
        return func(*args, **(kwargs or {}))


def test_one_op_call_per_group():
    """A first step makes one op call per param group (per device), whatever dtypes the
    group mixes: the kernel groups them into one C call per dtype combination. From
    the second step the two groups (their hyperparameters agree but for lr) share a
    Plan of flat state, stepped by one adam_step_flat_ call per layout across both
    groups, each param with its group's lr (the bf16 params of both: one call; group_b's
    fp32 ones: another).
    With several calls, each but the first runs first with its found_inf flag set
    (its argument checks only: all or nothing over the calls; the first call checks
    its arguments before it writes, and runs before the others)."""
    group_a = [torch.nn.Parameter(torch.randn(10).to(BF16)) for _ in range(20)]
    group_b = [torch.nn.Parameter(torch.randn(10)) for _ in range(5)] + \
              [torch.nn.Parameter(torch.randn(10).to(BF16)) for _ in range(5)]
    opt = optim.AdamW([{"params": group_a}, {"params": group_b, "lr": 1e-4}])
    for p in group_a + group_b:
        p.grad = torch.randn(10).to(p.dtype)
    log = _PrecisOpLog()
    with log:
        for _ in range(3):
            opt.step()
    a, b = ("adam_step_", [BF16] * 20), ("adam_step_", [F32] * 5 + [BF16] * 5)
    flat_bf16, flat_f32 = ("adam_step_flat_", [BF16] * 25), ("adam_step_flat_", [F32] * 5)
    assert log.calls == [b, a, b] + [flat_f32, flat_bf16, flat_f32] * 2
    # with a loss scale over several calls, every gradient is checked first
    log.calls.clear()
    with log:
        opt.step(grad_scale=2.0)
    assert [name for name, _ in log.calls] == ["adam_step_flat_"] + ["check_finite_"] * 2 + \
        ["adam_step_flat_"] * 2
    assert all(opt.state[p]["step"] == 4 for p in group_a + group_b)


def test_memory_report():
    def report(dtype, policy=None, n=1 << 16, step=True, amsgrad=False):
        p = torch.nn.Parameter(torch.randn(n).to(dtype))
        opt = optim.AdamW([p], policy=policy, amsgrad=amsgrad)
        p.grad = torch.randn(n).to(dtype)
        if step:
            opt.step()
        return opt.memory_report()

    bf16 = report(BF16)
    assert bf16 == {"param": 2, "grad": 2, "master": 4, "exp_avg": 2, "exp_avg_sq": 2,
                    "max_exp_avg_sq": 0, "scales": 0, "total": 12, "numel": 1 << 16}
    ams = report(BF16, {"exp_avg_sq_dtype": "fp8"}, amsgrad=True)  # the max: v's dtype, scales
    assert (ams["exp_avg_sq"], ams["max_exp_avg_sq"]) == (1, 1)
    assert ams["scales"] == pytest.approx(2 * 4 / 128)
    assert ams["total"] == pytest.approx(2 + 2 + 4 + 2 + 1 + 1 + 8 / 128)
    fp32 = report(F32)
    assert (fp32["param"], fp32["master"], fp32["exp_avg"], fp32["exp_avg_sq"],
            fp32["total"]) == (4, 0, 4, 4, 16)
    fp8 = report(BF16, {"store_param_remainders": True, "exp_avg_dtype": "fp8",
                        "exp_avg_sq_dtype": "fp8"})
    assert (fp8["master"], fp8["exp_avg"], fp8["exp_avg_sq"]) == (2, 1, 1)
    assert fp8["scales"] == pytest.approx(2 * 4 / 128)
    assert fp8["total"] == pytest.approx(2 + 2 + 2 + 1 + 1 + 8 / 128)
    # 8-bit corrections (issue #34 item 2): fp8 m and v, one byte of master beside the
    # bf16 param: 5.0625 bytes of state and gradient, 7.0625 with the param
    policy8 = {"store_param_remainders": True, "param_remainder_bits": 8,
               "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
    fp8_8 = report(BF16, policy8)
    assert (fp8_8["master"], fp8_8["exp_avg"], fp8_8["exp_avg_sq"]) == (1, 1, 1)
    assert fp8_8["total"] - fp8_8["param"] == pytest.approx(5.0625)
    assert fp8_8["total"] == pytest.approx(7.0625)
    predicted8 = precis.resolve_policy(BF16, policy8).bytes_per_param()
    assert (fp8_8["master"], fp8_8["grad"]) == (predicted8["remainder"], predicted8["main_grad"])
    assert fp8_8["total"] == pytest.approx(predicted8["total"])
    fresh = report(BF16, step=False)  # state is allocated at the first step
    assert (fresh["master"], fresh["exp_avg"], fresh["total"]) == (0, 0, 4)
    # the measured numbers agree with what the policy predicts
    predicted = precis.resolve_policy(BF16).bytes_per_param()
    assert (bf16["master"], bf16["exp_avg"]) == (predicted["master"], predicted["exp_avg"])


# ---------------------------------------------------------------------------
# Loss scaling and found_inf
# ---------------------------------------------------------------------------


def two_group_model(dtype=BF16):
    model = mlp(dtype)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    opt = optim.AdamW([{"params": layers[0].parameters()},
                       {"params": list(layers[1].parameters()) + list(layers[2].parameters()),
                        "lr": 1e-3}], lr=1e-2)
    return model, opt


def test_found_inf_skips_step_and_touches_nothing():
    model, opt = two_group_model()
    for step in range(3):
        train_step(model, opt, step)
    x, y = batch(3, BF16)
    ((model(x).float() - y.float()) ** 2).mean().backward()
    before = snapshot(model, opt)
    flag = torch.tensor(1.0)
    opt.step(found_inf=flag)
    assert opt.last_step_skipped
    assert same_snapshot(before, snapshot(model, opt))
    opt.step(found_inf=torch.tensor(0.0))
    assert not opt.last_step_skipped
    assert not same_snapshot(before, snapshot(model, opt))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
def test_a_host_found_inf_skips_every_param(capturable, device):
    """found_inf=True (a host flag, known before anything runs) skips every param, the
    float64 ones torch's math steps included, capturable or not, and says so (torch's
    math takes capturable=True only off the CPU: no float64 param there)."""
    g = torch.Generator().manual_seed(3)
    dtypes = (torch.float32,) if capturable and device == "cpu" else (torch.float32,
                                                                       torch.float64)
    ps = [torch.nn.Parameter(torch.randn(127, generator=g).to(device, dtype)) for dtype in dtypes]
    opt = optim.AdamW(ps, lr=1e-2, capturable=capturable)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device, p.dtype)
    opt.step()
    before = [bits(p).clone() for p in ps]
    opt.step(found_inf=True)
    assert opt.last_step_skipped is True
    for p, b in zip(ps, before):
        assert torch.equal(bits(p), b), f"the {p.dtype} param was stepped"
        assert float(opt.state[p]["step"]) == 1.0


@pytest.mark.parametrize("where", ["first_group", "last_group"])
def test_inf_gradient_with_grad_scale_skips_every_group(where):
    model, opt = two_group_model()
    for step in range(3):
        train_step(model, opt, step)
    x, y = batch(3, BF16)
    ((model(x).float() - y.float()) ** 2).mean().backward()
    target = model[0].weight if where == "first_group" else model[4].bias
    target.grad[0] = float("inf") if where == "first_group" else float("nan")
    before = snapshot(model, opt)
    found = torch.tensor(0.0)
    opt.step(grad_scale=torch.tensor(1024.0), found_inf=found)
    assert opt.last_step_skipped and float(found) == 1.0
    assert same_snapshot(before, snapshot(model, opt))


def test_inf_gradient_single_call_is_caught_by_the_kernel():
    p = torch.nn.Parameter(torch.randn(1000).to(BF16))
    opt = optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(1000).to(BF16)
    opt.step()
    p.grad[500] = float("inf")
    before = (bits(p).clone(), {k: bits(v).clone() if torch.is_tensor(v) else v
                                for k, v in opt.state[p].items()})
    opt.step(grad_scale=2.0)
    assert opt.last_step_skipped
    assert torch.equal(bits(p), before[0])
    for k, v in opt.state[p].items():
        assert (torch.equal(bits(v), before[1][k]) if torch.is_tensor(v) else v == before[1][k])


def test_grad_scale_unscales_in_the_kernel():
    """Gradients scaled by a power of two and step(grad_scale=...) give exactly the
    step on unscaled gradients."""
    a, b = mlp(BF16), mlp(BF16)
    opt_a, opt_b = optim.AdamW(a.parameters(), lr=1e-2), optim.AdamW(b.parameters(), lr=1e-2)
    for step in range(5):
        train_step(a, opt_a, step)
        x, y = batch(step, BF16)
        opt_b.zero_grad()
        (((b(x).float() - y.float()) ** 2).mean() * 256.0).backward()
        opt_b.grad_scale = torch.tensor(256.0)  # as GradScaler sets it for fused optimizers
        opt_b.step()
        del opt_b.grad_scale
        assert not opt_b.last_step_skipped
    assert max_diff(a, b) == 0


def test_grad_scaler_drives_the_optimizer():
    """torch's GradScaler works with it as with any optimizer (it unscales and skips)."""
    model = mlp()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.state[model[0].weight]["step"] == 3
    # an Inf gradient: the scaler skips the step and lowers its scale
    assert scaler.is_enabled() and scaler.get_scale() == 1024.0
    x, y = batch(3)
    opt.zero_grad()
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    model[0].weight.grad[0, 0] = float("inf")
    after = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after))
    assert opt.state[model[0].weight]["step"] == 3 and scaler.get_scale() == 512.0
    with pytest.raises(TypeError, match="grad_scaler"):
        opt.step(grad_scaler=scaler)


# ---------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "learning rate"),
    (dict(lr=float("nan")), "learning rate"),
    (dict(eps=-1e-8), "epsilon"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    (dict(betas=(0.9,)), "betas"),
    (dict(seed=-1), "seed"),
    (dict(policy={"exp_avg_dtype": "bf17"}), "exp_avg_dtype"),
    (dict(policy={"main_params_dtype": "fp8"}), "main_params_dtype"),
    (dict(policy={"no_such_field": "fp32"}), "no_such_field"),
])
def test_bad_hyperparameters(kwargs, match):
    p = torch.nn.Parameter(torch.randn(4).to(BF16))
    with pytest.raises(ValueError, match=match):
        optim.AdamW([p], **kwargs)


def test_bad_params():
    with pytest.raises(TypeError, match="policy"):
        optim.AdamW([torch.nn.Parameter(torch.randn(4))], policy="bf16")
    # float64 / complex128 are stepped (torch's math: test_torch_optim_db). A trainable
    # param of a dtype no update writes is refused at construction and by add_param_group;
    # a frozen one is taken as torch takes it (test_dropin) and refused, by name, at the
    # first step that finds a gradient on it, before anything changes.
    with pytest.raises(ValueError, match="sharing memory"):
        optim.AdamW([torch.nn.Parameter(torch.randn(3).expand(4, 3))])
    fp8 = torch.nn.Parameter(torch.randn(4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        optim.AdamW([fp8])
    opt = optim.AdamW([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # add_param_group checks too ...
        opt.add_param_group({"params": [fp8]})
    assert len(opt.param_groups) == 1  # ... and leaves the groups as they were
    ints = torch.nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
    opt.add_param_group({"params": [ints]})
    first = opt.param_groups[0]["params"][0]
    first.grad = torch.ones(4)
    ints.grad = torch.ones(4, dtype=torch.int32)
    before = first.detach().clone()
    with pytest.raises(ValueError, match=r"param 0 of group 1 .*int32"):
        opt.step()
    assert torch.equal(first, before) and not opt.state


def test_overrides_that_do_not_fit_a_params_dtype_name_it_and_the_way_out():
    """A bf16 model with a norm kept in fp32 and the README's remainders override: the
    error names the fp32 param and says to give it a group of its own (it said only
    "store_param_remainders: needs param_dtype bf16"); with such a group it steps."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(BF16), torch.nn.LayerNorm(4))
    remainders = {"store_param_remainders": True}
    with pytest.raises(ValueError, match=r"AdamW param group 0: the policy "
                                         r"\{'store_param_remainders': True\} "
                                         r"applied to a torch.float32 param \(shape \(4,\)\).*"
                                         r"param_dtype bf16.*a param group of their own") as e:
        optim.AdamW(model.parameters(), policy=remainders)
    assert isinstance(e.value, precis.PrecisValueError)
    opt = optim.AdamW([{"params": model[0].parameters(), "policy": remainders},
                       {"params": model[1].parameters(), "policy": None}])
    model(torch.randn(2, 4).to(BF16)).float().sum().backward()
    opt.step()
    assert "remainder" in opt.state[model[0].weight] and "remainder" not in opt.state[model[1].weight]


@pytest.mark.parametrize("policy", [None, {"exp_avg_dtype": "fp8"}])
def test_params_sharing_memory_are_refused_by_name(policy):
    """Two params of a group that are views of one tensor, or a gradient that is a view
    of its param: the step refuses them naming the params by group and index (the op
    names only its own lists), before anything changes."""
    base = torch.randn(10)
    a, b = torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])
    c = torch.nn.Parameter(torch.randn(3))
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    before = base.clone()
    opt = optim.AdamW([{"params": [c]}, {"params": [b, c.new_zeros(1).requires_grad_(), a]}],
                      policy=policy)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\): param 2 of group 1 and param 0 "
                                           r"of group 1 share memory"):
        opt.step()
    assert torch.equal(base, before) and not opt.state
    x = torch.nn.Parameter(torch.randn(4))
    x.grad = x.detach()
    opt = optim.AdamW([x], policy=policy)
    with pytest.raises(RuntimeError, match=r"param 0 of group 0 and the gradient of param 0 "
                                           r"of group 0 share memory"):
        opt.step()
    assert not opt.state


def test_bad_gradients_and_step_arguments():
    p = torch.nn.Parameter(torch.randn(4))
    before = p.detach().clone()
    opt = optim.AdamW([p])
    p.main_grad = torch.zeros(5)
    with pytest.raises(ValueError, match=r"gradient has shape \(5,\) on cpu, the param \(4,\)"):
        opt.step()
    del p.main_grad
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    p.grad = torch.zeros(4)
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(grad_scale=0.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        opt.step(foo=1)
    p.main_grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"param 0 of group 0 \(shape \(4,\)\): its gradient "
                                         r"has dtype torch.float64; supported: float32"):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert not opt.state[p] or opt.state[p]["step"] == 0


def test_bad_gradient_in_a_later_group_steps_no_group():
    """Gradients are checked before any group's kernel runs: a bad one in the last
    group leaves the first group's params and state as they were (no half step)."""
    first = torch.nn.Parameter(torch.ones(3))
    ok, bad = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = optim.AdamW([{"params": [first]}, {"params": [ok, bad]}], lr=0.1)
    first.grad, ok.grad = torch.ones(3), torch.ones(4)
    bad.main_grad = torch.ones(4, dtype=torch.float64)
    before = [t.detach().clone() for t in (first, ok, bad)]
    with pytest.raises(ValueError, match=r"param 1 of group 1 .*its gradient has dtype "
                                         r"torch.float64"):
        opt.step()
    assert all(torch.equal(t.detach(), b) for t, b in zip((first, ok, bad), before))
    for t in (first, ok, bad):
        assert not opt.state[t] or (opt.state[t]["step"] == 0
                                    and not opt.state[t]["exp_avg"].any())
    del bad.main_grad
    bad.grad = torch.ones(4)
    opt.step()
    assert all(opt.state[t]["step"] == 1 for t in (first, ok, bad))
    # one step from the start (a half step before would have moved it twice)
    torch.testing.assert_close(first.detach(), torch.full((3,), 1.0 - 0.1 * 0.01 - 0.1))


# ---------------------------------------------------------------------------
# The op itself
# ---------------------------------------------------------------------------


def test_op_direct_call_matches_optimizer():
    n = 1000
    p_op = torch.randn(n)
    p_opt = torch.nn.Parameter(p_op.clone())
    m, v = torch.zeros(n), torch.zeros(n)
    opt = optim.AdamW([p_opt], lr=1e-2, weight_decay=0.1)
    for step in range(1, 4):
        g = torch.randn(n)
        # the schema's optional single tensors are lists of zero or one tensor; by keyword
        # or positionally, and through the wrapper: same bits
        twin = [p_op.clone(), m.clone(), v.clone()]
        torch.ops.precis.adam_step_([twin[0]], [g], [], [twin[1]], [twin[2]], [], [], [step],
                                    1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, 1.0, False, 0,
                                    found_inf=[], lr_tensor=[],
                                    inv_grad_scale_tensor=[], step_tensors=[], amsgrad=False,
                                    max_exp_avg_sqs=[], max_exp_avg_sq_scales=[],
                                    ieee_sqrt=False)
        twin2 = [p_op.clone(), m.clone(), v.clone()]
        assert ops.adam_step_([twin2[0]], [g], [], [twin2[1]], [twin2[2]], [], [], [step],
                              1e-2, 0.9, 0.999, 1e-8, 0.1) is None  # no found_inf: None
        out = torch.ops.precis.adam_step_([p_op], [g], [], [m], [v], [], [], [step], 1e-2, 0.9,
                                          0.999, 1e-8, 0.1, True, False, 1.0, False, 0,
                                          [], [], [], [], False, [], [], False)
        assert out is None  # writes its inputs, returns nothing
        assert all(torch.equal(a, b) for a, b in zip(twin, (p_op, m, v)))
        assert all(torch.equal(a, b) for a, b in zip(twin2, (p_op, m, v)))
        p_opt.grad = g
        opt.step()
    assert torch.equal(p_op, p_opt.detach())
    assert torch.equal(m, opt.state[p_opt]["exp_avg"])


OP_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
OP_ERROR = "precis.adam_step_: "  # every message of the kernel starts so


def test_op_checks_its_arguments():
    """The C kernel checks every argument before it writes anything: RuntimeError
    naming the bad argument, and no buffer touched."""
    p, g, m, v = torch.randn(8), torch.randn(8), torch.zeros(8), torch.zeros(8)

    def call(**kw):
        hyper = {k: kw.pop(k) for k in list(kw) if k in OP_HYPER or k == "inv_grad_scale"}
        lists = dict(params=[p], grads=[g], masters=[], exp_avgs=[m], exp_avg_sqs=[v],
                     exp_avg_scales=[], exp_avg_sq_scales=[], steps=[1])
        lists.update(kw)
        return ops.adam_step_(**lists, **{**OP_HYPER, **hyper})

    assert call() is None
    before = [t.clone() for t in (p, m, v)]
    for kw, message in [
            (dict(grads=[g, g]), "grads has 2 entries but params has 1"),
            (dict(exp_avg_scales=[torch.empty(0)] * 2),
             "exp_avg_scales has 2 entries but params has 1 (pass [] when no param has one)"),
            (dict(exp_avgs=[torch.zeros(7)]), "exp_avgs[0] has 7 elements, params[0] has 8"),
            (dict(grads=[torch.zeros(3)]), "grads[0] has 3 elements, params[0] has 8"),
            (dict(masters=[torch.zeros(9, dtype=F16)]), "masters[0] has 9 elements, params[0] has 8"),
            (dict(exp_avgs=[torch.zeros(8, dtype=F16)]),
             "exp_avg_scales[0]: float16 moments need 1 float32 block scales"),
            (dict(exp_avg_sqs=[torch.zeros(8, dtype=FP8)], exp_avg_sq_scales=[torch.zeros(2)]),
             "exp_avg_sq_scales[0]: uint8 moments need 1 float32 block scales "
             "(precis_scale_count(8)), got 2 float32 values"),
            (dict(exp_avg_sq_scales=[torch.zeros(1)]),
             "exp_avg_sq_scales[0] must be empty: float32 moments have no scales"),
            (dict(steps=[0]), "steps[0] is 0; it is the step number after this update (>= 1)"),
            (dict(steps=[]), "steps has 0 entries but params has 1 (pass [] only with "
                             "step_tensors)"),
            (dict(masters=[torch.zeros(8, dtype=torch.int16)]),
             "masters[0] holds int16 remainders, which need a bfloat16 param "
             "(params[0] is float32)"),
            (dict(masters=[torch.zeros(8, dtype=BF16)]),
             "masters[0] has dtype bfloat16; supported: float32, float16, int16"),
            (dict(masters=[torch.zeros(8)]),
             "masters[0] has dtype float32, that of params[0]: a param of its master's dtype "
             "is its own master and the tensor would be ignored; pass an empty tensor"),
            (dict(params=[torch.zeros(8, 2)[:, 0]]), "params[0] must be contiguous"),
            (dict(exp_avg_sqs=[torch.zeros(16)[::2]]), "exp_avg_sqs[0] must be contiguous"),
            (dict(params=[torch.zeros(8, dtype=torch.float64)]),
             "params[0] has dtype float64; supported: float32, float16, bfloat16"),
            (dict(grads=[torch.zeros(8, dtype=torch.float64)]),
             "grads[0] has dtype float64; supported: float32, float16, bfloat16"),
            (dict(exp_avgs=[torch.zeros(8, dtype=torch.int16)]),
             "exp_avgs[0] has dtype int16; supported: float32, float16, bfloat16, uint8"),
            (dict(masters=[m.view(F16)[:8]]), "masters[0] and exp_avgs[0] share memory; every "
                                               "buffer the step writes must be its own"),
            (dict(grads=[p]), "params[0] and grads[0] share memory"),
            (dict(exp_avg_sqs=[m]), "exp_avgs[0] and exp_avg_sqs[0] share memory"),
            (dict(found_inf=torch.zeros(1, dtype=torch.float64)),
             "found_inf must hold one float32 value, got 1 float64 values"),
            (dict(found_inf=torch.zeros(2)), "found_inf must hold one float32 value, got 2"),
            (dict(lr_tensor=torch.tensor(1e-3, dtype=F16)),
             "lr_tensor must hold one float64 or float32 value, got float16"),
            (dict(inv_grad_scale_tensor=torch.tensor([1.0, 2.0])),
             "inv_grad_scale_tensor must hold one float32 value, got 2 float32 values"),
            (dict(steps=[], step_tensors=[torch.tensor(1.0)]),
             "step_tensors[0] must hold one int64 value, got 1 float32 values"),
            (dict(steps=[], step_tensors=[torch.tensor(0)]),
             "step_tensors[0] holds 0; it is the step number after this update (>= 1)"),
            (dict(step_tensors=[torch.tensor(1), torch.tensor(1)]),
             "step_tensors has 2 entries but params has 1"),
            (dict(inv_grad_scale=float("nan")),
             "inv_grad_scale must be finite (a float32), got nan"),
            (dict(inv_grad_scale=1e300),  # finite, but no float32: refused, not cast
             "inv_grad_scale must be finite (a float32), got 1e+300"),
            (dict(beta1=1.0), "precis_step: cfg->beta1 is 1; must be in [0, 1)"),
            (dict(beta2=float("nan")), "precis_step: cfg->beta2 is nan; must be in [0, 1)"),
            (dict(lr=-1e-3), "precis_step: cfg->lr is -0.001; must be finite and >= 0"),
            (dict(eps=-1e-8), "precis_step: cfg->eps is -1e-08; must be finite and >= 0"),
            (dict(weight_decay=float("inf")),
             "precis_step: cfg->weight_decay is inf; must be finite and >= 0"),
            (dict(amsgrad=True), "amsgrad needs max_exp_avg_sqs, one per param: it has 0 "
                                 "entries but params has 1"),
            (dict(max_exp_avg_sqs=[torch.zeros(8)]),
             "max_exp_avg_sqs and max_exp_avg_sq_scales must be [] when amsgrad is false"),
            (dict(amsgrad=True, max_exp_avg_sqs=[torch.zeros(8, dtype=BF16)]),
             "max_exp_avg_sqs[0] has dtype bfloat16; the running max of amsgrad is kept in "
             "exp_avg_sqs[0]'s dtype, float32"),
            (dict(amsgrad=True, max_exp_avg_sqs=[torch.zeros(7)]),
             "max_exp_avg_sqs[0] has 7 elements, params[0] has 8"),
            (dict(amsgrad=True, max_exp_avg_sqs=[v]),
             "exp_avg_sqs[0] and max_exp_avg_sqs[0] share memory"),
            (dict(amsgrad=True, max_exp_avg_sqs=[torch.zeros(16)[::2]]),
             "max_exp_avg_sqs[0] must be contiguous"),
            (dict(amsgrad=True, exp_avg_sqs=[torch.zeros(8, dtype=F16)],
                  exp_avg_sq_scales=[torch.zeros(1)],
                  max_exp_avg_sqs=[torch.zeros(8, dtype=F16)]),
             "max_exp_avg_sq_scales[0]: float16 moments need 1 float32 block scales")]:
        with pytest.raises(RuntimeError) as e:
            call(**kw)
        assert str(e.value).startswith(OP_ERROR + message), (kw, str(e.value))
        for t, b in zip((p, m, v), before):
            assert torch.equal(t, b), kw
    # the dispatcher rejects a number for a Tensor[] argument itself
    with pytest.raises(RuntimeError, match="List\\[Tensor\\].*'lr_tensor'"):
        call(lr_tensor=1e-3)
    with pytest.raises(RuntimeError) as e:
        torch.ops.precis.adam_step_([p], [g], [], [m], [v], [], [], [1], 1e-3, 0.9, 0.999, 1e-8,
                                    0.0, True, False, 1.0, True, 0, [], [], [], [], False, [],
                                    [], False)
    assert str(e.value).startswith(OP_ERROR + "check_finite needs found_inf")
    with pytest.raises(RuntimeError) as e:
        torch.ops.precis.adam_step_([p], [g], [], [m], [v], [], [], [1], 1e-3, 0.9, 0.999, 1e-8,
                                    0.0, True, False, 1.0, False, 0, [torch.zeros(1)] * 2, [],
                                    [], [], False, [], [], False)
    assert str(e.value).startswith(OP_ERROR + "found_inf has 2 entries; pass [] or one tensor")
    for t, b in zip((p, m, v), before):
        assert torch.equal(t, b)
    # The wrapper makes the flag check_finite needs (zeroed), and returns it.
    found = call(check_finite=True, found_inf=None)
    assert found.dtype == torch.float32 and found.shape == (1,) and float(found) == 0.0
    assert not torch.equal(p, before[0])  # finite gradients: the step ran


def op_state(n_list, dtypes, gen):
    """Lists for adam_step_ over params of the given (param, moment) dtypes."""
    lists = dict(params=[], grads=[], masters=[], exp_avgs=[], exp_avg_sqs=[],
                 exp_avg_scales=[], exp_avg_sq_scales=[])
    for n, (pd, md) in zip(n_list, dtypes):
        lists["params"].append(torch.randn(n, generator=gen).to(pd))
        lists["grads"].append(torch.randn(n, generator=gen).to(pd))
        lists["masters"].append(torch.randn(n, generator=gen) if pd != F32 else torch.empty(0))
        for key in ("exp_avgs", "exp_avg_sqs"):
            lists[key].append(torch.zeros(n, dtype=md))
        for key in ("exp_avg_scales", "exp_avg_sq_scales"):
            lists[key].append(torch.zeros(ops.scale_count(n)) if md in (F16, FP8)
                              else torch.empty(0))
    for i, master in enumerate(lists["masters"]):  # masters hold the params' values
        if master.numel():
            master.copy_(lists["params"][i].float())
    return lists


def clone_lists(lists):
    return {k: [t.clone() for t in v] for k, v in lists.items()}


def same_lists(a, b):
    """Same bits in every list the step writes."""
    return all(torch.equal(bits(x), bits(y)) for k in a if k != "grads"
               for x, y in zip(a[k], b[k]))


MIXED = [(F32, F32), (BF16, BF16), (BF16, FP8)]  # three dtype combinations


@pytest.mark.parametrize("combos", [1, 3])
def test_op_device_values_equal_host_values(combos):
    """lr / inv_grad_scale / steps given as tensors (what CUDA graphs replay) give the
    bits of the same values given as numbers, on the CPU kernel too."""
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 127, 4097]
    host = op_state(sizes, MIXED[:combos] * (3 // combos), gen)
    dev = clone_lists(host)
    step_t = torch.tensor(0)
    lr_t = torch.zeros((), dtype=torch.float64)
    igs_t = torch.tensor([0.25])
    for k, lr in enumerate([1e-2, 3e-3, 1e-3], 1):
        grads = [torch.randn(n, generator=gen).to(p.dtype) for n, p in zip(sizes, host["params"])]
        host["grads"], dev["grads"] = grads, grads
        ops.adam_step_(**{**host, "grads": grads}, steps=[k] * 3, **{**OP_HYPER, "lr": lr},
                       inv_grad_scale=0.25, seed=11)
        step_t += 1
        lr_t.fill_(lr)
        ops.adam_step_(**{**dev, "grads": grads}, steps=[], **{**OP_HYPER, "lr": 99.0},
                       inv_grad_scale=8.0, seed=11, lr_tensor=lr_t,
                       inv_grad_scale_tensor=igs_t, step_tensors=[step_t] * 3)
    assert same_lists(host, dev)


@pytest.mark.parametrize("combos", [1, 3])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_op_found_inf_flag(combos, bad):
    """check_finite reports into found_inf and writes nothing, over several dtype
    combinations too; a found_inf already set skips the step."""
    gen = torch.Generator().manual_seed(6)
    lists = op_state([1, 4097, 127], MIXED[:combos] * (3 // combos), gen)
    lists["grads"][2][100] = bad
    before = clone_lists(lists)
    flag = torch.zeros(1)
    ops.adam_step_(**lists, steps=[1, 1, 1], **OP_HYPER, check_finite=True, found_inf=flag)
    assert float(flag) == 1.0 and same_lists(before, lists)
    lists["grads"][2][100] = 0.5
    ops.adam_step_(**lists, steps=[1, 1, 1], **OP_HYPER, found_inf=flag)  # still set
    assert same_lists(before, lists)
    flag.zero_()
    found = ops.adam_step_(**lists, steps=[1, 1, 1], **OP_HYPER, check_finite=True)
    assert float(found) == 0.0 and not same_lists(before, lists)


def test_check_finite_op():
    flag = torch.zeros(1)
    good = [torch.randn(5), torch.randn(3).to(BF16), torch.empty(0, dtype=F16)]
    assert ops.check_finite_(good, flag) is flag and float(flag) == 0.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.randn(7).to(F16)
        t[6] = bad
        flag.zero_()
        ops.check_finite_(good + [t], flag)
        assert float(flag) == 1.0
    flag.zero_()
    for grads, found_inf, message in [
            (good, torch.zeros(1, dtype=torch.float64),
             "found_inf must be a one-element float32 tensor, got 1 float64 values"),
            (good, torch.zeros(2), "found_inf must be a one-element float32 tensor, got 2 "
                                   "float32 values"),
            ([torch.randn(4), torch.zeros(4, dtype=torch.int16)], flag,
             "grads[1] has dtype int16; supported: float32, float16, bfloat16"),
            ([torch.zeros(4, 2)[:, 0]], flag, "grads[0] must be contiguous")]:
        with pytest.raises(RuntimeError) as e:
            ops.check_finite_(grads, found_inf)
        assert str(e.value).startswith("precis.check_finite_: " + message), str(e.value)
        assert not found_inf.any()


def _meta(n, dtype=F32):
    return torch.empty(n, dtype=dtype, device="meta")


def test_fake_kernels_on_meta_and_fake_tensors():
    """The registered fake kernels (what torch.compile traces with) answer meta and
    FakeTensor calls: no output for the ops that write their inputs, a 0-dim int64
    count on the input's device. They describe outputs only and check nothing: the
    real kernel checks the arguments when the traced code runs."""
    pm = _meta(10)
    args = ([pm], [_meta(10)], [], [_meta(10)], [_meta(10)], [], [], [1], 1e-3, 0.9, 0.999,
            1e-8, 0.0, True, False, 1.0, False, 0, [], [], [], [], False, [], [], False)
    assert torch.ops.precis.adam_step_(*args) is None
    assert torch.ops.precis.check_finite_([pm], _meta(1)) is None
    assert torch.ops.precis.accumulate_(pm, _meta(10, BF16)) is None
    assert torch.ops.precis.cast_(pm, _meta(10, F16)) is None
    assert torch.ops.precis.scale_(pm, 0.5) is None
    count = torch.ops.precis.count_nonfinite(_meta(10, BF16))
    assert count.device.type == "meta" and count.dtype == torch.int64 and count.shape == ()

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    real = torch.randn(10)
    want = real.clone()
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        assert ops.adam_step_([fake], [torch.ones(10)], [], [torch.zeros(10)],
                              [torch.zeros(10)], [], [], [1], **OP_HYPER) is None
        count = ops.count_nonfinite(fake)
        assert isinstance(count, FakeTensor) and count.dtype == torch.int64 and count.dim() == 0
    assert torch.equal(real, want)  # nothing ran on the real data


def test_torch_compile_traces_the_ops():
    """torch.compile (full graph, AOT autograd functionalizing the in-place ops) runs
    adam_step_, check_finite_ and count_nonfinite with the eager bits."""
    gen = torch.Generator().manual_seed(8)
    sizes = [1, 127, 4097]
    eager = op_state(sizes, MIXED, gen)
    traced = clone_lists(eager)

    def step(lists, k):
        found = ops.adam_step_(**lists, steps=[k] * 3, **OP_HYPER, inv_grad_scale=0.5,
                               check_finite=True, seed=3)
        return found, ops.count_nonfinite(lists["params"][0]) + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for k in (1, 2):
        grads = [torch.randn(n, generator=gen).to(p.dtype)
                 for n, p in zip(sizes, eager["params"])]
        eager["grads"], traced["grads"] = grads, grads
        want_found, want_count = step(eager, k)
        got_found, got_count = compiled(traced, k)
        assert torch.equal(got_found, want_found) and float(got_found) == 0.0
        assert int(got_count) == int(want_count) == 1
        assert same_lists(eager, traced)
    traced["grads"][1][5] = float("nan")
    snapshot = clone_lists(traced)
    got_found, _ = compiled(traced, 3)
    assert float(got_found) == 1.0 and same_lists(snapshot, traced)


# ---------------------------------------------------------------------------
# capturable=True (on the CPU here; CUDA graphs in test_cuda_adam.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,policy", [(F32, None), (BF16, None),
                                          (BF16, {"exp_avg_dtype": "fp8",
                                                  "store_param_remainders": True}),
                                          (BF16, {"exp_avg_dtype": "fp8",
                                                  "store_param_remainders": True,
                                                  "param_remainder_bits": 8})])
def test_capturable_equals_eager(dtype, policy):
    """Device steps, lr and loss scale give the eager optimizer's bits; an lr scheduler
    and a tensor lr changed in place are followed; state dicts cross between modes."""
    a, b = mlp(dtype), mlp(dtype)
    opt_a = optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, policy=policy)
    opt_b = optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, policy=policy,
                        capturable=True)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 2, gamma=0.5)
    for step in range(5):
        train_step(a, opt_a, step)
        train_step(b, opt_b, step)
        sched_a.step()
        sched_b.step()
        assert opt_b.last_step_skipped is None and opt_b.last_found_inf is None
    assert max_diff(a, b) == 0
    p = next(b.parameters())
    step = opt_b.state[p]["step"]  # torch's capturable step: float32 on the param's device
    assert step.dtype == torch.float32 and step.device == p.device and int(step) == 5
    # a tensor lr, written in place
    lr_t = torch.tensor(2e-3, dtype=torch.float64)
    opt_a.param_groups[0]["lr"] = 2e-3
    opt_b.param_groups[0]["lr"] = lr_t
    train_step(a, opt_a, 5)
    train_step(b, opt_b, 5)
    lr_t.fill_(1e-3)
    opt_a.param_groups[0]["lr"] = 1e-3
    train_step(a, opt_a, 6)
    train_step(b, opt_b, 6)
    assert max_diff(a, b) == 0
    # state dicts cross: capturable -> eager and eager -> capturable
    c, d = mlp(dtype, seed=3), mlp(dtype, seed=3)
    c.load_state_dict(b.state_dict())
    d.load_state_dict(a.state_dict())
    opt_c = optim.AdamW(c.parameters(), policy=policy)
    opt_d = optim.AdamW(d.parameters(), policy=policy, capturable=True)
    opt_c.load_state_dict(opt_b.state_dict())
    opt_d.load_state_dict(opt_a.state_dict())
    assert opt_d.param_groups[0]["capturable"] and not opt_c.param_groups[0]["capturable"]
    for step in range(7, 9):
        for model, opt in ((a, opt_a), (b, opt_b), (c, opt_c), (d, opt_d)):
            opt.param_groups[0]["lr"] = 1e-3
            train_step(model, opt, step)
    assert max_diff(a, b) == 0 and max_diff(a, c) == 0 and max_diff(a, d) == 0


def test_capturable_found_inf_and_grad_scale_stay_on_the_device():
    model, opt = two_group_model()
    for g in opt.param_groups:
        g["capturable"] = True
    ref, ref_opt = two_group_model()
    for step in range(2):
        train_step(model, opt, step)
        train_step(ref, ref_opt, step)
    x, y = batch(2, BF16)
    opt.zero_grad()
    ((model(x).float() - y.float()) ** 2).mean().backward()
    model[4].bias.grad[1] = float("nan")
    before = snapshot(model, opt)
    opt.step(grad_scale=torch.tensor([4.0]))
    assert opt.last_step_skipped is None and float(opt.last_found_inf) == 1.0
    assert same_snapshot(before, snapshot(model, opt))  # steps not counted either
    flag = torch.ones(1)  # a GradScaler's verdict
    model[4].bias.grad[1] = 0.0
    opt.step(found_inf=flag)
    assert opt.last_found_inf is flag and same_snapshot(before, snapshot(model, opt))
    # scaled gradients, unscaled in the kernel from a device scale: the eager bits
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        ((m(x).float() - y.float()) ** 2 * 64.0).mean().backward()
        o.step(grad_scale=torch.tensor([64.0]), found_inf=torch.zeros(1))
    assert float(opt.last_found_inf) == 0.0 and not ref_opt.last_step_skipped
    assert max_diff(model, ref) == 0
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())


def test_capturable_errors():
    model = mlp()
    with pytest.raises(ValueError, match="capturable must be a bool"):
        optim.AdamW(model.parameters(), capturable="yes")
    opt = optim.AdamW(model[0].parameters(), capturable=True)
    with pytest.raises(ValueError, match="capturable is False but True in group 0"):
        opt.add_param_group({"params": model[2].parameters(), "capturable": False})
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):  # torch's words
        optim.AdamW(model.parameters(), lr=torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="got 1 torch.bfloat16 values"):
        optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, dtype=torch.bfloat16))
    train_step_grads = torch.randn(32, 16)
    model[0].weight.grad = train_step_grads
    with pytest.raises(ValueError, match="found_inf must be one float32 value"):
        opt.step(found_inf=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad_scale must be one value"):
        opt.step(grad_scale=torch.ones(2))
    assert not opt.state[model[0].weight] or int(opt.state[model[0].weight]["step"]) == 0


LOST_POLICIES = {"bf16 default": {}, "int16 remainders": dict(store_param_remainders=True),
                 "fp8 m, v + 8-bit remainders": dict(
                     store_param_remainders=True, param_remainder_bits=8,
                     exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8")}


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("policy", sorted(LOST_POLICIES))
def test_a_lost_param_leaves_its_moments_finite(policy, path, monkeypatch):
    """A bf16 param with NaN and Inf elements (a step lost them), AdamW on three stores
    (an fp32 master, int16 remainders, fp8 m, v with 8-bit remainders), on the host and on
    the device path (emulated on the CPU): its moments stay finite, as torch's (AdamW adds
    no L2 term), and the finite elements step on as a finite param's; m and v were NaN
    (g + 0 * NaN) on every store before."""
    if path == "device":
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(4097, generator=gen).to(torch.bfloat16)
    lost = init.clone()
    lost[[0, 100, 4096]] = torch.tensor([float("nan"), float("inf"), -float("inf")],
                                        dtype=torch.bfloat16)
    a, b = torch.nn.Parameter(lost), torch.nn.Parameter(init.clone())
    opts = [optim.AdamW([p], lr=1e-3, weight_decay=0.1, policy=LOST_POLICIES[policy])
            for p in (a, b)]
    for _ in range(4):
        g = torch.randn(4097, generator=gen).to(torch.bfloat16)
        a.grad, b.grad = g.clone(), g.clone()
        for opt in opts:
            opt.step()
    for key in ("exp_avg", "exp_avg_sq"):
        ours, finite = opts[0].decoded_state(a)[key], opts[1].decoded_state(b)[key]
        assert bool(ours.isfinite().all()), (key, int((~ours.isfinite()).sum()))
        assert torch.equal(ours, finite), key  # (the moments never read the param)
    kept = torch.ones(4097, dtype=torch.bool)
    kept[[0, 100, 4096]] = False
    assert torch.equal(a.detach()[kept], b.detach()[kept])
    assert bool(a.detach()[0].isnan()) and bool(a.detach()[[100, 4096]].isinf().all())


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("before,after", [("fp32", "fp16"), ("fp16", "fp32")])
def test_a_master_dtype_changed_in_place_after_a_step_is_refused(before, after, path,
                                                                  monkeypatch):
    """A policy mapping is kept as given: main_params_dtype written into it after the
    masters were made is refused at the next step, naming the param and the way
    (state_dict() into an optimizer made with the new policy), before anything moves,
    as a moment dtype changed so is; the step stepped the old master on, the new
    policy saved beside it."""
    if path == "device":
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    gen = torch.Generator().manual_seed(9)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16))
              for n in (127, 4097)]
    policy = {"main_params_dtype": before}
    opt = optim.AdamW(params, lr=1e-2, policy=policy)
    for _ in range(3):  # (the steady path from the second step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
    policy["main_params_dtype"] = after
    kept = [p.detach().clone() for p in params]
    masters = [opt.state[p]["master"].clone() for p in params]
    with pytest.raises(RuntimeError, match=(
            rf"param 0 .*its master is torch.float{before[-2:]} but the policy now wants "
            rf"torch.float{after[-2:]} \(main_params_dtype\); convert the state through "
            rf"state_dict\(\) and load_state_dict\(\)")):
        opt.step()
    assert all(torch.equal(p, k) for p, k in zip(params, kept))
    assert all(torch.equal(opt.state[p]["master"], m) for p, m in zip(params, masters))
