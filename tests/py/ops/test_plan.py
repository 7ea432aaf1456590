"""precis.optim's steady-state path (_Plan, docs/design.md section 7): once a param
group's steps repeat, a step checks identities, dtypes and contiguity per param
instead of everything. Every step here is compared bit for bit with a twin
optimizer that never makes a plan, through the disruptions the plan must notice."""
import copy
import warnings

import pytest
import torch

import precis.optim as optim
from precis import step_plan
from precis import fingerprints as precis_fingerprints
from precis.optim_state import ParamState
from state_snapshot import assert_same, snapshot

BF16 = torch.bfloat16
POLICIES = {  # name -> (param dtype, policy, amsgrad)
    "fp32": (torch.float32, None, False),
    "bf16": (BF16, None, False),
    "remainders": (BF16, {"store_param_remainders": True}, False),
    "remainders8_fp8": (BF16, {"store_param_remainders": True, "param_remainder_bits": 8,
                               "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}, False),
    "fp8": (BF16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}, False),
    "amsgrad_fp16_v": (BF16, {"exp_avg_sq_dtype": "fp16"}, True),
    # fp32 and bf16 params in each group: a plan of two parts (layouts), two op calls
    "mixed_fp32_bf16": ("mixed", None, False),
}


def model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1,), (127,), (33, 5), (4097,), (7, 11)]
    dtypes = [torch.float32, BF16] * 3 if dtype == "mixed" else [dtype] * len(shapes)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]


def grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in ps]


def build(dtype, policy, amsgrad, planned):
    ps = model(dtype)
    opt = optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], lr=1e-2,
                      weight_decay=0.05, policy=policy, amsgrad=amsgrad)
    if not planned:
        opt._books.plans = _NoPlans()
    return opt, ps


class _NoPlans(dict):
    """An optimizer's plans that keep none: every step takes the full path."""

    def __setitem__(self, key, value):
        pass


def step_twins(step, *twins, disrupt):
    """Step each (optimizer, its params) twin on the same gradients of `step`, after
    disrupt(step, opt, params, grads) did to it what a user does (grads: a list it may
    change, None: no grad)."""
    gs = grads(twins[0][1], step)
    for opt, params in twins:
        local = list(gs)
        disrupt(step, opt, params, local)
        for p, g in zip(params, local):
            p.grad = None if g is None else g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optim.StaleMasterWarning)
            opt.step()


def disrupt(step, opt, ps, gs):
    """What happens before step `step` (on both twins alike)."""
    if step == 3:
        gs[1] = None                                  # a param without a grad
    elif step == 4:
        gs[2] = gs[2].t().contiguous().t()            # a grad in other strides
    elif step == 5:
        with torch.no_grad():                         # weights loaded behind its back
            ps[3].copy_(torch.linspace(-1, 1, ps[3].numel()).to(ps[3].dtype))
    elif step == 6:
        opt.state[ps[4]]["step"] = torch.tensor(100.0)  # a user's step count
    elif step == 7:                                   # a state entry replaced, not written
        opt.state[ps[1]]["exp_avg"] = torch.zeros_like(opt.state[ps[1]]["exp_avg"])
    elif step == 8:
        opt.load_state_dict(opt.state_dict())
    elif step == 9:
        opt.param_groups[1]["params"].reverse()       # the same params, another order
    elif step == 10:
        opt.state[ps[0]] = {}                         # a param's state replaced: made anew
    elif step == 11:                                  # a grad of another dtype
        ps[2].main_grad = gs[2].half() if gs[2].dtype == torch.float32 else gs[2].float()
    elif step == 12:
        del ps[2].main_grad
    elif step == 13:                                  # a param's memory replaced: its version
        ps[3].data = torch.linspace(1, -1, ps[3].numel()).to(ps[3].dtype).view(ps[3].shape)


@pytest.mark.parametrize("name", POLICIES)
def test_planned_steps_equal_full_steps_through_disruptions(name):
    dtype, policy, amsgrad = POLICIES[name]
    planned, ps = build(dtype, policy, amsgrad, True)
    full, qs = build(dtype, policy, amsgrad, False)
    for step in range(14):  # (p.data = ... keeps it)
        step_twins(step, (planned, ps), (full, qs), disrupt=disrupt)
        assert_same(snapshot(planned), snapshot(full))
        if step in (2, 7, 9, 12):
            assert planned._books.plans, f"no plan at step {step}"
    assert not full._books.plans, "the full-path twin kept a plan: the test compared plans"
    for group in planned.param_groups:  # torch's float32 steps, views of a buffer per layout
        steps = [planned.state[p]["step"] for p in group["params"]]
        assert all(t.dtype == torch.float32 and t.dim() == 0 and t.is_cpu for t in steps)
        layouts = len({p.dtype for p in group["params"]})
        assert len({t.untyped_storage().data_ptr() for t in steps}) == layouts
        assert len(planned._books.plans[planned.param_groups.index(group)].parts) == layouts


def test_weights_loaded_in_the_steady_state_are_not_overwritten():
    opt, ps = build(BF16, None, False, True)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    assert opt._books.plans
    loaded = [torch.randn(p.shape).to(BF16) for p in ps]
    with torch.no_grad():
        for p, w in zip(ps, loaded):
            p.copy_(w)
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    with pytest.warns(optim.StaleMasterWarning):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(ps, loaded))


def fp32_in_steady_state():
    """An fp32 optimizer after three steps, stepping through its plans."""
    opt, ps = build(torch.float32, None, False, True)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    assert opt._books.plans
    return opt, ps


def test_a_bad_grad_in_the_steady_state_is_named_and_changes_nothing():
    opt, ps = fp32_in_steady_state()
    ps[3].main_grad = ps[3].grad.double()  # torch refuses a float64 .grad; main_grad is read first
    before = snapshot(opt)
    with pytest.raises(ValueError, match="param 1 of group 1 .*gradient has dtype torch.float64"):
        opt.step()
    assert_same(before, snapshot(opt))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_param_given_new_memory_keeps_the_plan_unless_a_master_goes_stale(dtype):
    """p.data = new values keeps the param's version. A param without a master (fp32) is
    stepped where it now lies, by the same plan; one with a master is refused by the
    op (its table row holds the address its master was synced at) and the full path
    resyncs the master from the new memory and makes a new plan."""
    opt, ps = build(dtype, None, False, True)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    plans = dict(opt._books.plans)
    ps[3].data = ps[3].data + 1  # new memory, new values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    stale = [w for w in caught if issubclass(w.category, optim.StaleMasterWarning)]
    if dtype == torch.float32:
        assert opt._books.plans.keys() == plans.keys() and all(
            opt._books.plans[gi] is plan for gi, plan in plans.items()), "a plan was remade"
        assert not stale
    else:
        assert opt._books.plans[1] is not plans[1] and stale, "the stale master went unseen"


def test_a_param_reshaped_in_the_steady_state_is_refused_as_by_the_full_path():
    """A param given another shape of the same size (p.data = ...) no longer fits
    its state: refused as on the full path, with nothing changed."""
    opt, ps = fp32_in_steady_state()
    ps[2].data = ps[2].data.reshape(5, 33)  # was (33, 5)
    ps[2].grad = ps[2].grad.reshape(5, 33)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=r"its exp_avg is .* of shape \(33, 5\)"):
        opt.step()
    assert_same(before, snapshot(opt))


@pytest.mark.parametrize("which", [0, 1])
def test_a_param_of_another_dtype_in_the_steady_state_is_refused_as_by_the_full_path(which):
    """A param given another dtype (p.data = ...) no longer fits its state: the plan sees
    it for a Part's first param, the op for the others (one call steps one dtype);
    either way the full path refuses it, with nothing changed."""
    opt, ps = fp32_in_steady_state()
    param = ps[2 + which]  # group 1's first param, or its second
    param.data = param.data.bfloat16()
    param.grad = param.grad.bfloat16()
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=f"param {which} of group 1 .*its exp_avg is "
                                           f"torch.float32 .* wants torch.bfloat16"):
        opt.step()
    assert_same(before, snapshot(opt))


def test_steady_state_steps_follow_torch_and_its_state_dict_loads_into_torch():
    ps = model(torch.float32)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.05)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05)
    for step in range(6):
        for a, b, g in zip(ps, ref, grads(ps, step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    assert opt._books.plans
    again = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2,
                              weight_decay=0.05)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch would share the steps
    for p, q in zip(again.param_groups[0]["params"], ref):
        p.grad = q.grad = torch.ones_like(q)
    again.step()
    torch_opt.step()
    for p, q in zip(again.param_groups[0]["params"], ref):
        assert torch.equal(p, q)
    for a, b in zip(ps, ref):
        assert torch.equal(opt.state[a]["step"], torch_opt.state[b]["step"] - 1)


def test_a_param_swapped_in_the_steady_state_steps_as_in_torch():
    """torch.utils.swap_tensors (nn.Module._apply's swap path, load_state_dict(assign=
    True) with swap_module_params_on_conversion) refuses a param that anything but its
    Python object holds in C++. A plan holds its params as torch.optim.AdamW does, by
    their Python objects only, so a swap in the steady state works and the steps go on
    as torch's (holding them in a C++ list as well, which saves ~0.1-0.2 ms a step at
    2,000 params, makes the swap fail)."""
    ps = model(torch.float32)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.05)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.05)
    for step in range(8):
        if step == 4:
            assert opt._books.plans
            for params in (ps, ref):
                torch.utils.swap_tensors(params[3], torch.nn.Parameter(
                    torch.linspace(-1, 1, params[3].numel()).view(params[3].shape)))
        for a, b, g in zip(ps, ref, grads(ps, step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ps, ref):  # the fp32 policy gives torch's for-loop bits on the CPU
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("name", ["bf16", "remainders"])
def test_reload_model_params_in_the_steady_state(name):
    """Weights loaded and reload_model_params() called while a plan holds: the plan
    hands its stamps back, so the next step neither warns nor resyncs again (which
    would zero the remainders the reload kept), and follows a twin without plans."""
    dtype, policy, amsgrad = POLICIES[name]
    planned, ps = build(dtype, policy, amsgrad, True)
    full, qs = build(dtype, policy, amsgrad, False)
    loaded = [torch.randn(p.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
              for p in ps]
    for step in range(6):
        for opt, params in ((planned, ps), (full, qs)):
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            if step == 3:
                with torch.no_grad():
                    for p, w in zip(params, loaded):
                        p.copy_(w)
                opt.reload_model_params()
            with warnings.catch_warnings():
                warnings.simplefilter("error", optim.StaleMasterWarning)
                opt.step()
        assert_same(snapshot(planned), snapshot(full))
    assert planned._books.plans


def test_a_plan_holds_when_the_op_bumps_its_params_versions(monkeypatch):
    """Plan.restamp reads the versions again only when the op call bumped the first
    param's (torch 2.13's dispatcher bumps none): with an op that bumps all of them
    the plan still holds, resyncs nothing and follows a twin without plans."""
    from precis import ops
    real = ops.adam_step_flat_

    def bumping(params, *args, **kwargs):
        found_inf = real(params, *args, **kwargs)
        torch.autograd.graph.increment_version(list(params))
        return found_inf

    monkeypatch.setattr(ops, "adam_step_flat_", bumping)
    dtype, policy, amsgrad = POLICIES["remainders"]
    planned, ps = build(dtype, policy, amsgrad, True)
    full, qs = build(dtype, policy, amsgrad, False)
    plans = []
    for step in range(6):
        for opt, params in ((planned, ps), (full, qs)):
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            with warnings.catch_warnings():
                warnings.simplefilter("error", optim.StaleMasterWarning)
                opt.step()
        assert_same(snapshot(planned), snapshot(full))
        plans.append(dict(planned._books.plans))
    assert plans[2] and all(p == plans[2] for p in plans[3:]), "a plan was dropped"


def test_a_group_of_empty_params_keeps_stepping():
    """Params with no elements (and a group of only such params beside a normal one):
    every step succeeds and counts, on the planned path (the two groups in one plan,
    their hyperparameters agreeing: the empty params' rows step nothing)."""
    empty = [torch.nn.Parameter(torch.zeros(0)) for _ in range(3)]
    full = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0)))
    opt = optim.AdamW([{"params": empty}, {"params": [full]}], lr=1e-2)
    ref = torch.optim.AdamW([full.detach().clone().requires_grad_()], lr=1e-2)
    for _ in range(4):
        for p in empty:
            p.grad = torch.zeros(0)
        full.grad = torch.ones(5)
        ref.param_groups[0]["params"][0].grad = torch.ones(5)
        opt.step()
        ref.step()
    assert [int(opt.state[p]["step"]) for p in empty] == [4, 4, 4]
    assert opt._books.plans[0] is opt._books.plans[1]
    torch.testing.assert_close(full.detach(), ref.param_groups[0]["params"][0].detach(),
                               rtol=0, atol=1e-6)


def test_amsgrad_turned_off_in_the_steady_state():
    """amsgrad on for two steps, then off (torch allows it): the max stays in the state,
    unread and unflattened, and the planned steps follow a twin without plans."""
    dtype, policy, _ = POLICIES["bf16"]
    planned, ps = build(dtype, policy, True, True)
    full, qs = build(dtype, policy, True, False)
    for step in range(6):
        for opt, params in ((planned, ps), (full, qs)):
            if step == 2:
                for group in opt.param_groups:
                    group["amsgrad"] = False
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            opt.step()
        assert_same(snapshot(planned), snapshot(full))
    assert planned._books.plans and all("max_exp_avg_sq" in planned.state[p] for p in ps)


def test_a_mixed_group_resumes_bit_exact():
    """A group of fp32 and bf16 params (a Plan of two Parts) saved mid-run and loaded
    into a fresh optimizer over copies of its params: the next steps give the bits of
    the run that never stopped, and the resumed run makes its Parts again."""
    run, ps = build("mixed", None, False, True)
    for step in range(4):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        run.step()
    saved = copy.deepcopy(run.state_dict())
    resumed, qs = build("mixed", None, False, True)
    with torch.no_grad():
        for p, q in zip(ps, qs):
            q.copy_(p)
    resumed.load_state_dict(saved)
    for step in range(4, 8):
        for opt, params in ((run, ps), (resumed, qs)):
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            opt.step()
        assert_same(snapshot(run), snapshot(resumed))
    assert [len(plan.parts) for plan in resumed._books.plans.values()] == [2, 2]


def test_a_grad_the_flat_op_refuses_sends_the_step_down_the_full_path(monkeypatch):
    """The plan does not look at the grads' strides, dtypes or sizes: the op does. A
    grad in other strides is refused by adam_step_flat_ before anything is written, and
    the step is taken again on the full path (which steps a contiguous copy), bit for
    bit as a twin without plans; a grad the full path refuses too is named by it."""
    from precis import ops
    real, refusals = ops.flat_call, []

    def recording(*args, **kwargs):  # (the op of every flat call, a steady step's too)
        op, op_args = real(*args, **kwargs)

        def call(*args):
            try:
                return op(*args)
            except RuntimeError as error:
                refusals.append(str(error))
                raise
        return call, op_args

    monkeypatch.setattr(ops, "flat_call", recording)
    planned, ps = build(BF16, None, False, True)
    full, qs = build(BF16, None, False, False)
    for step in range(5):
        gs = grads(ps, step)
        if step == 3:
            gs[2] = gs[2].t().contiguous().t()  # (33, 5) in column-major strides
        for opt, params in ((planned, ps), (full, qs)):
            for p, g in zip(params, gs):
                p.grad = g.clone() if g.is_contiguous() else g.t().clone().t()
            opt.step()
        assert_same(snapshot(planned), snapshot(full))
    # (group 1's param 0: the plan's third, after group 0's two)
    assert len(refusals) == 1 and "grads[2]" in refusals[0], refusals
    assert len(planned._books.plans) == 2  # made again after the full-path step
    ps[4].main_grad = torch.zeros(3, dtype=BF16)  # 3 elements for a (7, 11) param
    before = snapshot(planned)
    with pytest.raises(ValueError, match=r"param 2 of group 1 .*its gradient has shape \(3,\)"):
        planned.step()
    assert_same(before, snapshot(planned))
    assert len(refusals) == 2


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_counted_state_saves_as_plain_dicts_and_copies_keep_planning(how):
    """Each param's state is a ParamState counting its changes in the optimizer's
    CountedState. state_dict() hands out plain dicts (torch.load(weights_only=True)
    refuses other classes), an empty state too; a deep-copied or pickled optimizer
    gets ParamStates of its own CountedState, steps as the original and plans again."""
    import io
    opt, ps = build(BF16, None, False, True)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    idle = torch.nn.Parameter(torch.zeros(3, dtype=BF16))
    opt.add_param_group({"params": [idle]})
    assert opt.state[idle] == {}  # looked up: an empty state, as torch's defaultdict
    sd = opt.state_dict()
    assert all(type(st) is dict for st in sd["state"].values()), sd["state"]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["state"].keys() == sd["state"].keys()
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert all(type(st) is ParamState and st.owner is twin.state
               for st in twin.state.values())
    qs = [p for group in twin.param_groups for p in group["params"]][:len(ps)]
    for step in range(3, 6):
        for opt_, params in ((opt, ps), (twin, qs)):
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            opt_.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))
        assert_same(snapshot(opt), snapshot(twin))
    assert len(twin._books.plans) == 2  # group 2 (idle, no grad) has none
    twin.state[qs[0]]["exp_avg"] = torch.zeros_like(twin.state[qs[0]]["exp_avg"])
    assert twin._books.plans[0].changes != twin.state.changes  # seen: the plan is dropped


def test_a_retaken_step_still_warns_of_a_resync_and_names_the_callers_line():
    """A step whose planned call the op refuses is taken again on the full path; a
    master resynced in the refused try (a group without a plan: its param is not
    contiguous) is not resynced again, and the warning still comes, once, pointing at
    the line that called step()."""
    gen = torch.Generator().manual_seed(3)
    odd = torch.nn.Parameter(torch.randn(6, 5, generator=gen).to(BF16).t())  # no plan
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(BF16)) for n in (7, 33)]
    opt = optim.AdamW([{"params": [odd]}, {"params": ps}], lr=1e-2)
    for _ in range(3):
        for p in [odd] + ps:
            p.grad = torch.randn(p.shape, generator=gen).to(BF16)
        opt.step()
    assert list(opt._books.plans) == [1]
    with torch.no_grad():
        odd.copy_(torch.ones_like(odd))  # behind the optimizer's back
    ps[1].grad = torch.randn(33, 2, generator=gen).to(BF16).t()[0]  # strided: refused
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(); line = __import__("inspect").currentframe().f_lineno  # noqa: E702
    stale = [w for w in caught if issubclass(w.category, optim.StaleMasterWarning)]
    assert len(stale) == 1 and "group 0 param 0" in str(stale[0].message), stale
    assert (stale[0].filename, stale[0].lineno) == (__file__, line)


def test_a_param_state_copied_or_put_there_by_hand_is_counted_by_its_new_owner():
    """A copy of one param's state (copy, deepcopy) belongs to no optimizer and changes
    nothing in the one it came from; a plain dict (or such a copy) put into
    opt.state becomes that optimizer's ParamState holding its entries, so the group
    plans again and later replacements are seen."""
    opt, ps = build(BF16, None, False, True)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    changes, plans = opt.state.changes, dict(opt._books.plans)
    for copied in (copy.copy(opt.state[ps[0]]), copy.deepcopy(opt.state[ps[0]])):
        assert type(copied) is ParamState and copied.owner is None
        copied["exp_avg"] = torch.zeros(1)
    assert opt.state.changes == changes and opt._books.plans == plans
    assert ParamState.fromkeys(["step"]).owner is None
    opt.state[ps[0]] = dict(opt.state[ps[0]])         # a plain dict, by hand
    opt.state[ps[1]] = copy.deepcopy(opt.state[ps[1]])  # an ownerless copy
    assert all(type(opt.state[p]) is ParamState and opt.state[p].owner is opt.state
               for p in ps[:2])
    for step in range(3, 5):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    assert set(opt._books.plans) == {0, 1}
    opt.state[ps[1]]["exp_avg"] = torch.zeros_like(opt.state[ps[1]]["exp_avg"])
    assert opt._books.plans[0].changes != opt.state.changes


def test_the_plans_views_are_recorded_and_a_replaced_entry_drops_its_record():
    """Each entry a Plan made a view of its flat buffer is recorded in the ParamState's
    views (for a step traced by torch.compile: optim_state.op_entry), at its offset;
    replacing or removing the entry drops the record, and with it the buffer."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (127, 33, 4097)]
    opt = optim.AdamW(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    st = opt.state[params[1]]
    assert set(st.views) == {"step", "exp_avg", "exp_avg_sq"}
    view, flat, offset = st.views["exp_avg"]
    assert view is st["exp_avg"] and offset == 127
    assert torch.equal(flat[offset:offset + 33], st["exp_avg"])
    st["exp_avg"] = st["exp_avg"].clone()
    del st["exp_avg_sq"]
    st.pop("step")
    assert st.views == {}
    assert set(opt.state[params[2]].views) == {"step", "exp_avg", "exp_avg_sq"}
    opt.state[params[2]].clear()
    assert opt.state[params[2]].views == {}


@pytest.mark.parametrize("name", ["bf16", "remainders8_fp8", "mixed_fp32_bf16"])
def test_a_planned_cpu_step_records_its_params_fingerprints_from_the_op(name, monkeypatch):
    """On the CPU a planned step of params with remainders reads their fingerprints once
    (the check before it); the record of what it wrote comes from the op, summed as the
    kernel wrote them, and equals a pass over them: their blocks' record too (no pass of
    its own over their blocks after the step). Params with a master (Part.sees) are
    neither fingerprinted nor recorded: the op sees writes itself, its kept each param's
    numel while none is written. A step with a NaN gradient under a grad scale (skipped,
    nothing written) keeps the record, and a load behind the optimizer's back after it is
    still seen."""
    dtype, policy, amsgrad = POLICIES[name]
    opt, ps = build(dtype, policy, amsgrad, True)
    for step in range(2):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    plans = step_plan.distinct(opt._books.plans)
    parts = [part for plan in plans for part in plan.parts]
    assert parts and any(part.stamped for part in parts)
    passes = []
    real = precis_fingerprints.Ranges.fingerprints_now
    monkeypatch.setattr(precis_fingerprints.Ranges, "fingerprints_now",
                        lambda self: passes.append(self.count) or real(self))
    block_passes = []
    real_blocks = precis_fingerprints.Blocks.fingerprints_now
    monkeypatch.setattr(precis_fingerprints.Blocks, "fingerprints_now",
                        lambda self: block_passes.append(1) or real_blocks(self))
    for step in range(2, 5):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        passes.clear()
        block_passes.clear()
        opt.step()
        stamped = [part for part in parts if part.stamped and not part.sees]
        # one pass each, before the step; none after: the op recorded the params with
        # remainders block by block (fingerprints.BLOCK) as it wrote them
        assert len([n for n in passes if n]) == len(stamped)
        assert block_passes == []
        for part in stamped:
            assert part.written == precis_fingerprints.of(part.stamped)
            if part.blocks is not None:
                assert torch.equal(part.blocks.record,
                                   precis_fingerprints.of_blocks(list(part.blocks.blocks.flats)))
        for part in parts:  # (a master's: bf16 params, fp32 masters)
            assert part.sees == (part.stamped != () and part.blocks is None)
            if part.sees:
                assert part.written == [] and part.out().numel() == 0
                assert part.kept.tolist() == [p.numel() for p in part.stamped]
    records = [list(part.written) for part in parts]
    for part in stamped:
        part.fingerprints.fill_(12345)  # what a skipped step must not take for a record
    ps[3].grad[0] = float("nan")
    passes.clear()
    opt.step(grad_scale=2.0)
    assert opt.last_step_skipped
    assert [list(part.written) for part in parts] == records
    assert len([n for n in passes if n]) == len(stamped)  # the compare only
    ps[3].grad[0] = 0.5
    with torch.no_grad():
        ps[3].copy_(torch.linspace(-1, 1, ps[3].numel()).to(ps[3].dtype))
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    loaded = ps[3].detach().clone()
    with pytest.warns(optim.StaleMasterWarning):
        opt.step()
    assert torch.equal(ps[3], loaded)


@pytest.mark.parametrize("name", ["remainders", "bf16"])
def test_a_full_path_cpu_step_records_remainders_from_the_op_and_sees_masters(name,
                                                                              monkeypatch):
    """Without a plan (every step the full path, adam_step_), for plain, transposed
    (stepped in memory order) and strided params (with gaps: a contiguous copy stepped,
    written back) alike: params with remainders are recorded by the op as it writes them
    (equal to a pass over them), and the step reads their fingerprints once (the compare
    before it); params with a master are neither recorded nor compared (compared by
    rounding: the op sees writes into them itself, fingerprints [out, kept])."""
    _, policy, _ = POLICIES[name]
    gen = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(127, generator=gen).to(BF16)),
          torch.nn.Parameter(torch.randn(33, 5, generator=gen).to(BF16).t()),
          torch.nn.Parameter(torch.randn(70001, generator=gen).to(BF16)),
          torch.nn.Parameter(torch.randn(9, 14, generator=gen).to(BF16)[:, ::2])]
    opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.05, policy=policy)
    opt._books.plans = _NoPlans()
    reads = []
    real = precis_fingerprints.of
    monkeypatch.setattr(precis_fingerprints, "of",
                        lambda ts: (reads.append(len(ts)) if ts else None) or real(ts))
    recorded = name == "remainders"
    for step in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        reads.clear()
        opt.step()
        # the compare (none before a record)
        assert reads == ([len(ps)] if recorded and step else [])
        if recorded:
            assert [opt._books.written[id(p)] for p in ps] == real(ps)
        else:
            assert not any(id(p) in opt._books.written for p in ps)
            assert opt._books.written.by_rule == set(map(id, ps))
    with torch.no_grad():
        ps[0].copy_(torch.linspace(-1, 1, 127).to(BF16))
    for group in opt.param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    with pytest.warns(optim.StaleMasterWarning):
        opt.step()
    assert torch.equal(ps[0], torch.linspace(-1, 1, 127).to(BF16))


# ---- groups sharing a plan -----------------------------------------------------------

def three_groups(dtype, planned):
    """Three groups of a model's params (mixed: fp32 and bf16), their hyperparameters
    agreeing but for lr and weight decay: one plan when planned."""
    ps = model(dtype) + model(dtype, seed=1)
    opt = optim.AdamW([{"params": ps[:3]}, {"params": ps[3:6], "lr": 3e-3, "weight_decay": 0.0},
                       {"params": ps[6:], "lr": 2e-3}], lr=1e-2, weight_decay=0.05)
    if not planned:
        opt._books.plans = _NoPlans()
    return opt, ps


def change(which, step, opt, gs):
    """What a user does to the groups before step `step` (from 3 on, or at 3)."""
    groups = opt.param_groups
    if which == "schedules":  # lr and weight decay at every step
        groups[1]["lr"] = 1e-3 * (step + 1)
        groups[0]["weight_decay"] = 0.01 * step
    elif which == "betas in place" and step == 0:
        groups[1]["betas"] = [0.9, 0.999]  # a list, changed in place at step 3
    elif step != 3:
        return
    elif which == "betas in place":
        groups[1]["betas"][0] = 0.8
    elif which == "betas":  # no longer agreeing: calls apart
        groups[1]["betas"] = (0.8, 0.99)
    elif which == "maximize":
        groups[2]["maximize"] = True
    elif which == "tensor lr":
        groups[1]["lr"] = torch.tensor(4e-3)
    elif which == "swapped":
        groups[0], groups[1] = groups[1], groups[0]
    elif which == "popped":
        groups.pop(0)
    elif which == "moved":
        groups[1]["params"].append(groups[2]["params"].pop(0))
    elif which == "no grad":
        gs[7] = None
    elif which == "amsgrad":
        groups[2]["amsgrad"] = True


@pytest.mark.parametrize("which", ["nothing", "schedules", "betas", "betas in place", "maximize",
                                   "tensor lr", "swapped", "popped", "moved", "no grad",
                                   "amsgrad"])
@pytest.mark.parametrize("dtype", ["mixed", BF16, torch.float32])
def test_groups_sharing_a_plan_step_as_the_full_path(which, dtype):
    """Groups that agree but for lr and weight decay share one plan (one op call a layout,
    each param its group's lr and weight decay), bit for bit as a twin without plans,
    whatever a user changes between steps: a schedule, a hyperparameter that no longer
    agrees, a tensor lr, the groups' order or params, a param without a grad, amsgrad."""
    planned, ps = three_groups(dtype, True)
    full, qs = three_groups(dtype, False)
    for step in range(7):
        step_twins(step, (planned, ps), (full, qs),
                   disrupt=lambda step, opt, params, gs: change(which, step, opt, gs))
        assert_same(snapshot(planned), snapshot(full))
        if step == 2:  # one plan for the three groups before any change
            plans = planned._books.plans
            assert len(plans) == 3 and plans[0] is plans[1] is plans[2], step
    assert planned._books.plans, "no plan at the end"


def steady_optimizer():
    """three_groups' bf16 optimizer after four steps, its steady step's call made (the
    grads of the last step set; the helper's own references to them gone)."""
    opt, ps = three_groups(BF16, True)
    for step in range(4):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    assert opt._books.steady.calls, "the steady steps took no call"
    return opt, ps


def test_a_scheduled_lr_the_checks_refuse_is_refused_by_a_steady_step():
    """A steady step (step_plan.Steady: its op call made once) checks an lr a scheduler
    set as the groups' checks do: one beyond float32's range is refused with their
    message, before anything is written."""
    opt, ps = steady_optimizer()
    before = snapshot(opt)
    opt.param_groups[1]["lr"] = 1e39
    with pytest.raises(ValueError, match="overflows float32"):
        opt.step()
    assert_same(snapshot(opt), before)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_groups_whose_lrs_agree_take_one_lr_and_step_as_the_full_path(dtype):
    """A steady step whose groups' lrs agree bit for bit gives its call one lr for every
    row (no list of lrs; each row its group's weight decay still), and a list again when a
    schedule sets them apart (0.0 and -0.0 apart too): bit for bit as a twin without
    plans, and steady at the steps where nothing but the lrs changed."""
    def twins(planned):
        ps = model(dtype) + model(dtype, seed=1)
        opt = optim.AdamW([{"params": ps[:3]}, {"params": ps[3:6], "weight_decay": 0.0},
                           {"params": ps[6:]}], lr=1e-2, weight_decay=0.05)
        if not planned:
            opt._books.plans = _NoPlans()
        return opt, ps
    schedule = {4: [5e-3, 4e-3, 5e-3], 6: [3e-3] * 3, 8: [0.0, -0.0, 0.0], 10: [2e-3] * 3}
    (planned, ps), (full, qs) = twins(True), twins(False)
    took = []
    for step in range(12):
        def disrupt(step, opt, params, gs):
            for group, lr in zip(opt.param_groups, schedule.get(step, ())):
                group["lr"] = float(lr)  # (each twin its own float objects)
        steady = planned._books.steady
        step_twins(step, (planned, ps), (full, qs), disrupt=disrupt)
        took.append(steady is not None and planned._books.steady is steady)
        assert_same(snapshot(planned), snapshot(full))
        if planned._books.steady is not None and planned._books.steady.calls:
            one_lr = planned._books.steady.one_lr
            assert one_lr == (step not in (4, 5, 8, 9)), step
    assert all(took[4:]), took  # (a schedule leaves the steps steady)


def test_a_setting_set_anew_leaves_the_steps_steady(monkeypatch):
    """A setting given again (an equal value, another object) takes one step down the
    planned path, which checks it; the steps after it are steady again (no Plan checks)."""
    opt, ps = three_groups(BF16, True)
    planned = []
    real = step_plan.planned_calls
    monkeypatch.setattr(step_plan, "planned_calls",
                        lambda *args: planned.append(1) or real(*args))
    for step in range(8):
        if step == 4:
            opt.param_groups[1]["weight_decay"] = float("0.0")  # (a new float object)
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
        if step == 4:
            planned.clear()
    assert planned == [1], planned  # (step 5 made the steady call anew)


def test_a_tensor_lr_changed_in_place_is_read_at_every_step():
    """A tensor lr changed in place between steps (as torch's schedulers change one) is
    read at every step (copied into the call's lr_tensor: no steady call keeps it), bit
    for bit as a twin without plans."""
    ps, qs = model(BF16), model(BF16)
    lrs = [torch.tensor(1e-2, dtype=torch.float64) for _ in range(2)]
    planned, full = optim.AdamW(ps, lr=lrs[0]), optim.AdamW(qs, lr=lrs[1])
    full._books.plans = _NoPlans()
    for step in range(6):
        for lr in lrs:
            lr.fill_(1e-2 * (step + 1))
        for opt, params in ((planned, ps), (full, qs)):
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            opt.step()
        assert_same(snapshot(planned), snapshot(full))
    assert planned._books.plans, "no plan"


def test_a_param_without_a_grad_hands_the_steady_step_to_the_planned_path(monkeypatch):
    """A param whose grad is None at a steady step (torch's boxing refuses the op's call
    before it runs) hands the step back (False: the planned path, which steps the params
    that have a grad), not a refusal (Refused: every plan dropped first); nothing
    written by the refused call, the param without a grad not stepped."""
    opt, ps = steady_optimizer()
    calls = []
    real_steady = step_plan.Steady.step
    monkeypatch.setattr(step_plan.Steady, "step",
                        lambda *args: calls.append(real_steady(*args)) or calls[-1])
    for p, g in zip(ps, grads(ps, 4)):
        p.grad = g
    ps[2].grad = None
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert calls == [False], calls
    assert torch.equal(ps[2].detach(), before[2])
    assert any(not torch.equal(p.detach(), b) for p, b in zip(ps, before))  # (the others)


def test_main_grads_in_the_steady_state_are_read_as_the_full_path_reads_them(monkeypatch):
    """The steady step reads each param's main_grad, else its .grad, in one pass: a
    main_grad set is stepped from, a main_grad of None (a wrapper that keeps one only for
    some params) hands the step to the planned path (its None refused by torch's boxing
    before the op runs), which steps that param's .grad as grads_of reads it; the bits
    equal a full-path twin's at every step, and once no param has a main_grad of None the
    steps are steady again."""
    opt, ps = steady_optimizer()
    full, qs = three_groups(BF16, False)
    for step in range(4):
        for q, g in zip(qs, grads(qs, step)):
            q.grad = g
        full.step()
    calls = []
    real_steady = step_plan.Steady.step
    monkeypatch.setattr(step_plan.Steady, "step",
                        lambda *args: calls.append(real_steady(*args)) or calls[-1])
    for step in range(4, 9):
        main = grads(ps, 100 + step)
        for params in (ps, qs):
            for p, g in zip(params, grads(params, step)):
                p.grad = g
            if step in (5, 6, 7):
                params[1].main_grad = main[1].clone()  # stepped from, not .grad
            if step in (6, 7):
                params[4].main_grad = None  # its .grad stepped
            if step == 8:
                del params[1].main_grad, params[4].main_grad
        opt.step()
        full.step()
        assert_same(snapshot(opt), snapshot(full))
    assert calls == [True, True, False, False, True], calls


def test_a_steady_step_keeps_no_grad_alive():
    """The steady step's call, kept between steps, holds no grad: zero_grad(set_to_none)
    frees them before the next backward, as with torch's optimizers."""
    import weakref
    opt, ps = steady_optimizer()
    gone = [weakref.ref(p.grad) for p in ps]
    opt.zero_grad(set_to_none=True)
    assert all(ref() is None for ref in gone)


def test_a_loaded_state_dict_frees_the_steady_steps_state():
    """After load_state_dict the state a steady step's call was made on is freed (the
    call goes with it), not kept until the next step."""
    import gc
    import weakref
    opt, ps = steady_optimizer()
    old = weakref.ref(opt._books.steady.part.buffers["exp_avg"])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()  # (the old state's ParamStates name their owner: a cycle)
    assert old() is None


def test_a_group_that_comes_back_rejoins_its_plan():
    """A group whose param had no grad for a step takes its plan's groups to the full
    path; when it comes back the three share one plan again (one call a step), not one
    plan for two and another for it."""
    opt, ps = three_groups(BF16, True)
    for step in range(6):
        gs = grads(ps, step)
        if step == 2:
            gs[4] = None
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        shared = {id(plan): plan.groups for plan in opt._books.plans.values()}
        assert sorted(shared.values()) == ([(0, 2)] if step == 2 else [(0, 1, 2)]), step


def test_a_group_of_empty_params_keeps_its_partners_planned():
    """A group whose layout holds only empty params cannot be planned (the op reads an
    empty buffer as absent); the group it agrees with still gets a plan of its own."""
    empty = [torch.nn.Parameter(torch.zeros(0)) for _ in range(2)]
    full = [torch.nn.Parameter(torch.randn(5).to(BF16)) for _ in range(2)]
    opt = optim.AdamW([{"params": empty}, {"params": full}], lr=1e-2)
    for _ in range(4):
        for p in empty + full:
            p.grad = torch.zeros_like(p) if p.numel() == 0 else torch.ones_like(p)
        opt.step()
    assert list(opt._books.plans) == [1] and opt._books.plans[1].groups == (1,)


def stale_warnings(opt, **step):
    """The StaleMasterWarnings of a step and the state_dict() after it (which settles the
    device compare's flags, copied back without waiting)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(**step)
        opt.state_dict()
    return [str(w.message) for w in caught if issubclass(w.category, optim.StaleMasterWarning)]


@pytest.mark.parametrize("kind", ["mixed", BF16])
def test_a_write_into_a_later_parts_param_is_named_on_the_device_path(kind, monkeypatch):
    """On the device path (emulated) each Part's one op call compares and resyncs its own
    params; the checks-only run that calls after the first get (functional.check_calls)
    must not resync them first (a mixed plan's bf16 Part is its second call): the
    warning names the param, as the host's compare does."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    for compare in ("1", "0"):
        monkeypatch.setenv("PRECIS_COMPARE_ON_DEVICE", compare)
        ps = model(kind)
        opt = optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], lr=1e-2,
                          weight_decay=0.05)
        for seed in range(3):
            for p, g in zip(ps, grads(ps, seed)):
                p.grad = g
            opt.step()
        assert opt._books.plans
        with torch.no_grad():
            ps[1][5] = 3.0  # a bf16 param, one element, behind the optimizer's back
        for p, g in zip(ps, grads(ps, 5)):
            p.grad = g
        said = stale_warnings(opt)
        assert len(said) == 1 and "group 0 param 1: a partial write, 1 of 127" in said[0], \
            (compare, said)


def test_a_step_skipped_before_its_calls_warns_of_nothing(monkeypatch):
    """A step given a loss scale whose grads hold a NaN, with two calls (checked before
    either runs, then skipped): no op ran, so no compare's flags are read back, and
    nothing written behind the optimizer's back is named."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    g = torch.Generator().manual_seed(0)
    dtypes = [BF16, torch.float32] * 3  # the bf16 Part's call first
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(d))
          for s, d in zip([(1,), (127,), (33, 5), (4097,), (7, 11)], dtypes)]
    opt = optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], lr=1e-2,
                      weight_decay=0.05)
    for seed in range(4):
        for p, grad in zip(ps, grads(ps, seed)):
            p.grad = grad
        if seed == 3:
            ps[3].grad[0] = float("nan")
        assert stale_warnings(opt, grad_scale=2.0) == []
        assert opt.last_step_skipped == (seed == 3)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("name", ["bf16", "mixed_fp32_bf16"])
def test_steps_counted_by_the_op_equal_steps_counted_through_the_table(name, path,
                                                                      monkeypatch):
    """A Plan's call without a flag counts its steps in its op (adam_step_flat_.counted);
    with one (a clear found_inf, a grad_scale of 1) through its table: the same bits and
    counts after every step, on the host path and the device path, one Part or two."""
    if path == "device":
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    dtype, policy, amsgrad = POLICIES[name]
    twins = [build(dtype, policy, amsgrad, True) for _ in range(3)]
    flags = [{}, {"found_inf": torch.zeros(1)}, {"grad_scale": torch.tensor(1.0)}]
    for step in range(6):
        for (opt, ps), flag in zip(twins, flags):
            for p, g in zip(ps, grads(ps, step)):
                p.grad = g
            opt.step(**flag)
        for opt, _ in twins[1:]:
            assert_same(snapshot(twins[0][0]), snapshot(opt))
    opt, ps = twins[0]
    assert opt._books.plans and [float(opt.state[p]["step"]) for p in ps] == [6.0] * len(ps)


@pytest.mark.parametrize("flag", ["none", "found_inf", "grad_scale"])
def test_a_bad_count_in_a_later_part_is_refused_before_any_part_writes(flag, monkeypatch):
    """A step count edited in place to a value no step takes (-5: a Plan keeps holding, its
    change count does not move) in the second Part of a Plan: refused before the first
    Part's call writes anything (every Part's table holds its step numbers before the
    later calls' dry runs), with the flag (counted through the tables) or without it
    (counted by the op), params and counts left as they were."""
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")  # (a found_inf given goes to the op)
    opt, ps = build("mixed", None, False, True)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    plan = next(iter(opt._books.plans.values()))
    assert len(plan.parts) == 2
    opt.state[plan.parts[1].params[-1]]["step"].fill_(-5.0)
    before = snapshot(opt)
    for p, g in zip(ps, grads(ps, 9)):
        p.grad = g
    kwargs = {"none": {}, "found_inf": {"found_inf": torch.zeros(1)},
              "grad_scale": {"grad_scale": torch.tensor(1.0)}}[flag]
    with pytest.raises((RuntimeError, ValueError), match="-4|-5"):
        opt.step(**kwargs)
    assert_same(before, snapshot(opt))


@pytest.mark.parametrize("name", ["remainders8_fp8", "remainders", "bf16"])
def test_a_plan_made_anew_with_an_earlier_plans_groups_takes_their_newest_records(
        name, monkeypatch):
    """A Plan over two groups; at one step a param of the first has no gradient (that step
    takes the full path, the first group's plan made anew after it, then both groups'
    again): the plans made anew read the params' records the earlier plan held, not the
    older ones in the books, so on a GPU's path no step takes the plan's own steps for a
    write (a false StaleMasterWarning, remainders zeroed: found with two groups' params
    with 8-bit remainders), and the params and state keep the host path's bits. Nothing
    is written behind the optimizer."""
    dtype, policy, _ = POLICIES[name]

    def run(device_path):
        monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1" if device_path else "0")
        gen = torch.Generator().manual_seed(4)
        first = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (7, 3)]
        second = [torch.nn.Parameter(torch.randn(5, generator=gen).to(dtype))]
        opt = optim.AdamW([{"params": first}, {"params": second, "lr": 3e-3}], lr=1e-2,
                          weight_decay=0.1, policy=policy)
        grads = torch.Generator().manual_seed(9)
        with warnings.catch_warnings():
            warnings.simplefilter("error", optim.StaleMasterWarning)
            for step in range(7):
                for i, p in enumerate(first + second):
                    p.grad = None if (step == 3 and i == 1) else \
                        torch.randn(p.shape, generator=grads).to(dtype)
                opt.step()
        return first + second, opt
    (host, host_opt), (device, device_opt) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(host, device))
    for a, b in zip(host, device):
        assert host_opt.state[a].keys() == device_opt.state[b].keys()
        assert all(torch.equal(x, device_opt.state[b][k]) for k, x in host_opt.state[a].items())


def test_what_a_plans_op_found_is_named_when_a_later_call_raises(monkeypatch):
    """A Plan of two Parts on the device path (bf16 params with fp32 masters; fp32 params):
    a write into a bf16 param, then a step whose bf16 Part's call ran (its op found the
    write and resynced the master) and whose fp32 Part's call raised after it (a failure
    no check foresaw): what that op found is named at the next look (state_dict()), as
    after a step that ends."""
    from precis import ops
    monkeypatch.setenv("PRECIS_DEVICE_PATH_ON_CPU", "1")
    gen = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(d))  # (the bf16 Part first)
          for n, d in ((7, BF16), (5, torch.float32), (127, BF16), (3, torch.float32))]
    opt = optim.AdamW(ps, lr=1e-2)
    for step in range(3):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    plan, = step_plan.distinct(opt._books.plans)
    assert [part.dtype for part in plan.parts] == [BF16, torch.float32]
    ps[2].data.copy_(torch.randn(127, generator=gen).to(BF16))  # (group 0 param 2)
    real, ran = ops.adam_step_flat_, []

    def failing(params, *args, **kwargs):
        if kwargs.get("found_inf") is None:  # (a call, not check_calls' dry run)
            if ran:
                raise RuntimeError("a failure no check foresaw")
            ran.append(params[0].dtype)
        return real(params, *args, **kwargs)
    monkeypatch.setattr(ops, "adam_step_flat_", failing)
    for p, g in zip(ps, grads(ps, 7)):
        p.grad = g
    opt.param_groups[0].update(lr=0.0, weight_decay=0.0)  # (the master left as resynced)
    with pytest.raises(RuntimeError, match="no check foresaw"):
        opt.step()
    monkeypatch.setattr(ops, "adam_step_flat_", real)
    assert ran == [BF16]
    assert torch.equal(opt.master_weight(ps[2]), ps[2].detach().float())  # (resynced)
    with pytest.warns(optim.StaleMasterWarning, match="group 0 param 2: a whole load"):
        opt.state_dict()
