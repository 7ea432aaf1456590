"""precis.optim with offload="cpu" (precis.offload). On the CPU the "device" param and
its host copy are separate tensors, so the copies, the rereads after loads, the
hooks and the write-back all run; bit-for-bit against the same optimizer without
offload, which steps with the same kernel. The CUDA cases skip without a GPU.
"""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import ddp_worker as w
import precis.fingerprints
import precis.ops
import precis.optim
from precis.optim import StaleMasterWarning

SIZES = (1, 127, 4097, 30)
POLICIES = {  # name -> (param dtype, policy)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "remainders": (torch.bfloat16, {"store_param_remainders": True}),
    "remainders8": (torch.bfloat16, {"store_param_remainders": True, "param_remainder_bits": 8}),
    "fp8": (torch.bfloat16, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}),
    "stochastic_rounding": (torch.bfloat16, {"main_params_dtype": "bf16"}),
}
KW = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def make_params(dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g).to(device=device, dtype=dtype))
            for n in SIZES]


def grads_for(params, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
            for p in params]


def train(params, opt, steps, first=0):
    for s in range(first, first + steps):
        for p, g in zip(params, grads_for(params, s)):
            p.grad = g
        opt.step()
        opt.zero_grad()


def bits(t):
    return t.detach().cpu().reshape(-1).view({1: torch.uint8, 2: torch.int16,
                                             4: torch.int32}[t.element_size()])


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_params_equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert same_bits(x, y), f"param {i} differs"


def assert_state_dicts_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index in a["state"]:
        sa, sb = a["state"][index], b["state"][index]
        assert sa.keys() == sb.keys(), index
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert same_bits(sa[key], sb[key]), (index, key)
            else:
                assert sa[key] == sb[key], (index, key)


def opt_for(params, policy, offload, **kw):
    return precis.optim.AdamW(params, policy=policy, offload=offload, **{**KW, **kw})


# ---------------------------------------------------------------------------
# Trajectories, copies, selection
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("name", POLICIES)
def test_offloaded_run_follows_the_on_device_run_bit_for_bit(name, fraction):
    dtype, policy = POLICIES[name]
    ref, off = make_params(dtype), make_params(dtype)
    opt_ref = opt_for(ref, policy, False)
    opt_off = opt_for(off, policy, True, offload_fraction=fraction)
    train(ref, opt_ref, 5)
    train(off, opt_off, 5)
    assert_params_equal(ref, off)
    assert_state_dicts_equal(opt_ref.state_dict(), opt_off.state_dict())


def strided_params(dtype, seed=0):
    """A channels_last 4-D param, a transposed one and a gapped view (every 2nd column)."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 5, 7, 11, generator=g).to(dtype).to(
                memory_format=torch.channels_last)),
            nn.Parameter(torch.randn(33, 17, generator=g).to(dtype).t()),
            nn.Parameter(torch.randn(9, 30, generator=g).to(dtype)[:, ::2])]


@pytest.mark.parametrize("name", POLICIES)
def test_strided_params_offloaded_follow_the_on_device_run_bit_for_bit(name):
    # The host copies keep a dense param's strides, so fp16/fp8 scale blocks (which
    # follow memory order) cover the same elements on both sides.
    dtype, policy = POLICIES[name]
    ref, off = strided_params(dtype), strided_params(dtype)
    opt_ref = opt_for(ref, policy, False)
    opt_off = opt_for(off, policy, True)
    train(ref, opt_ref, 4)
    train(off, opt_off, 4)
    assert_params_equal(ref, off)
    for p in off[:2]:
        assert opt_off.state[p]["exp_avg"].stride() == p.stride()
    assert_state_dicts_equal(opt_ref.state_dict(), opt_off.state_dict())


@pytest.mark.parametrize("buckets", [1, 3])
@pytest.mark.parametrize("name", ["bf16", "remainders", "fp32"])
def test_the_records_of_offloaded_params_come_from_the_op(name, buckets, monkeypatch):
    """The record of what an offloaded step left in each param is the op's sum of its host
    copy as the kernel wrote it (each piece its view of the call's output), equal to a
    pass over the params after their write-back, for plain and strided params; the step
    reads the params' fingerprints once (the compare before it), not again after it. A
    write into a param is then seen at the next step, as with a record made by a pass."""
    dtype, policy = POLICIES[name]
    params = make_params(dtype) + strided_params(dtype)
    opt = opt_for(params, policy, True)
    opt._books.offload.buckets = buckets
    reads = []  # the lengths of the lists of params fingerprinted (fingerprints.split)
    real = precis.fingerprints.split
    monkeypatch.setattr(precis.fingerprints, "split",
                        lambda ts: reads.append(len(ts)) or real(ts))
    for step in range(3):
        reads.clear()
        train(params, opt, 1, first=step)
        assert reads == ([len(params)] if step else [])  # the compare (none before a record)
        assert [opt._books.written[id(p)] for p in params] == precis.fingerprints.of(params)
    twin = make_params(dtype) + strided_params(dtype)  # stepped on the params' device
    opt_twin = opt_for(twin, policy, False)
    train(twin, opt_twin, 3)
    for ps in (params, twin):
        with torch.no_grad():
            ps[1].fill_(0.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(params, opt, 1, first=3)
    with warnings.catch_warnings(record=True):  # (the twin's own warning, unread)
        warnings.simplefilter("always")
        train(twin, opt_twin, 1, first=3)
    assert_params_equal(twin, params)
    stale = [str(w.message) for w in seen if w.category is StaleMasterWarning]
    if name == "fp32":  # no master: the host copy reread, nothing to warn of
        assert stale == []
    else:
        assert len(stale) == 1 and "group 0 param 1: " in stale[0], stale


def test_host_copies_are_separate_and_written_back():
    params = make_params(torch.bfloat16)
    opt = opt_for(params, None, "cpu")
    train(params, opt, 2)
    for p in params:
        host = opt._books.offload.host(p)
        assert host.data_ptr() != p.data_ptr()
        assert same_bits(host, p)  # the step's result reached the param
        for key, t in opt.state[p].items():
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cpu" and t.data_ptr() != p.data_ptr(), key


def test_selection_follows_param_order_within_the_fraction():
    params = make_params(torch.float32)  # 1, 127, 4097, 30 elements: 4255 in all
    for fraction, want in ((1.0, [1, 1, 1, 1]), (0.5, [1, 1, 0, 1]), (0.995, [1, 1, 1, 0]),
                           (0.0, [0, 0, 0, 0])):
        opt = opt_for(params, None, True, offload_fraction=fraction)
        assert [int(opt._books.offload.selected(p)) for p in params] == want, fraction


def test_bad_options_raise_before_anything_is_built():
    params = make_params(torch.float32)
    for kw, match in ((dict(offload="gpu"), "offload must be"),
                      (dict(offload=True, offload_fraction=1.5), "offload_fraction"),
                      (dict(offload=True, offload_fraction="all"), "offload_fraction"),
                      (dict(offload=True, capturable=True), "capturable")):
        with pytest.raises(ValueError, match=match):
            precis.optim.Adam(params, **kw)


def test_a_fraction_without_offload_is_warned_of_at_the_users_line():
    """offload_fraction given with offload off (a config that toggled offload alone)
    offloads nothing: a warning names both, at the line that made the optimizer; the
    default fraction, or offload on, warns of nothing. Still refused when out of range."""
    params = make_params(torch.float32)
    for offload in (False, None):
        with pytest.warns(UserWarning, match=rf"offload_fraction=0.5 is given but offload is "
                                             rf"{offload}: nothing is offloaded") as record:
            opt = precis.optim.AdamW(params, offload=offload, offload_fraction=0.5)
        assert [w.filename for w in record] == [__file__]
        assert opt._books.offload is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precis.optim.AdamW(params, offload=False, offload_fraction=1.0)
        precis.optim.AdamW(params, offload=False)
        precis.optim.AdamW(params, offload=True, offload_fraction=0.5)
        precis.optim.AdamW(params, offload=False, offload_fraction=0.0)  # (none, as said)
    with pytest.raises(ValueError, match="offload_fraction must be a number"):
        precis.optim.AdamW(params, offload=False, offload_fraction=2)


def test_tensor_subclass_params_are_refused():
    class Sub(torch.Tensor):
        pass
    p = torch.randn(5).as_subclass(Sub).requires_grad_()
    with pytest.raises(ValueError, match="Sub param .* cannot be offloaded"):
        precis.optim.AdamW([p], offload=True)


def test_added_param_group_is_offloaded_and_stepped():
    a, b = make_params(torch.bfloat16), make_params(torch.bfloat16)
    opt_a = opt_for(a[:2], None, False)
    opt_b = opt_for(b[:2], None, True)
    opt_a.add_param_group({"params": a[2:], "lr": 3e-3})
    opt_b.add_param_group({"params": b[2:], "lr": 3e-3})
    train(a, opt_a, 3)
    train(b, opt_b, 3)
    assert_params_equal(a, b)
    assert all(opt_b._books.offload.selected(p) for p in b)


# ---------------------------------------------------------------------------
# Gradients: hooks, accumulation, in-place changes, loss scaling
# ---------------------------------------------------------------------------


def tiny_model(dtype=torch.bfloat16):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(7, 127), nn.Tanh(), nn.Linear(127, 1)).to(dtype)


def backward(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=g).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def test_grads_reach_the_host_during_backward():
    model = tiny_model()
    opt = opt_for(model.parameters(), None, True)
    backward(model, 0)
    for p in model.parameters():  # copied by the hook, before any step
        assert same_bits(opt._books.offload._grad[p], p.grad)


@pytest.mark.parametrize("change", ["accumulate", "scale_in_place", "scale_through_data",
                                    "replace", "clip"])
def test_the_grad_stepped_is_the_grad_at_step_time(change):
    """Several backward passes, in-place changes after backward (clip_grad_norm_,
    unscaling) and a replaced .grad: the host steps what the param holds at step()."""
    models = [tiny_model(), tiny_model()]
    opts = [opt_for(models[0].parameters(), None, False),
            opt_for(models[1].parameters(), None, True)]
    for step in range(3):
        for m in models:
            backward(m, step)
            if change == "accumulate":
                backward(m, step + 10)
            elif change == "scale_in_place":
                for p in m.parameters():
                    p.grad.mul_(0.25)
            elif change == "scale_through_data":  # no version counted, as GradScaler's
                for p in m.parameters():
                    p.grad.data.mul_(0.75)
            elif change == "replace":
                for p in m.parameters():
                    p.grad = p.grad * -1
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
        for o in opts:
            o.step()
            o.zero_grad()
    assert_params_equal(list(models[0].parameters()), list(models[1].parameters()))


def snapshot(params, opt):
    return ([p.detach().clone() for p in params],
            [opt._books.offload.host(p).clone() for p in params],
            copy.deepcopy(opt.state_dict()))


def assert_untouched(before, params, opt):
    params0, hosts0, sd0 = before
    assert_params_equal(params0, params)
    assert_params_equal(hosts0, [opt._books.offload._host[p] for p in params])
    assert_state_dicts_equal(sd0, opt.state_dict())


@pytest.mark.parametrize("buckets", [1, 4])  # 1: the kernel checks its one call itself
@pytest.mark.parametrize("how", ["found_inf", "grad_scale", "grad_scaler"])
def test_a_skipped_step_touches_nothing(how, buckets):
    params = make_params(torch.bfloat16)
    opt = opt_for(params, {"store_param_remainders": True}, True)
    opt._books.offload.buckets = buckets
    train(params, opt, 2)
    before = snapshot(params, opt)
    for p, g in zip(params, grads_for(params, 7)):
        p.grad = g
    params[2].grad[5] = float("inf")
    if how == "found_inf":
        params[2].grad[5] = 0.0
        opt.step(found_inf=torch.ones(1))
    elif how == "grad_scale":
        opt.step(grad_scale=torch.tensor(64.0))
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        scaler.scale(torch.zeros(()))  # as scaling the loss would: the scale exists
        scaler.step(opt)
        scaler.update()
    if how != "grad_scaler":  # a GradScaler does not call step() at all
        assert opt.last_step_skipped
    assert_untouched(before, params, opt)


def test_grad_scaler_steps_match_the_on_device_optimizer():
    """GradScaler unscales the grads in place after the hook copied them: the copy
    is redone at step()."""
    models = [tiny_model(torch.float32), tiny_model(torch.float32)]
    opts = [opt_for(models[0].parameters(), None, False),
            opt_for(models[1].parameters(), None, True)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in models]
    for step in range(3):
        for m, o, s in zip(models, opts, scalers):
            g = torch.Generator().manual_seed(step)
            s.scale(m(torch.randn(5, 7, generator=g)).square().mean()).backward()
            s.step(o)
            s.update()
            o.zero_grad()
    assert_params_equal(list(models[0].parameters()), list(models[1].parameters()))


def test_params_without_grad_are_not_stepped_after_zero_grad():
    """zero_grad() leaves the host grad buffers as they are: a param whose .grad is
    None is not stepped, whatever its host buffer holds."""
    params = make_params(torch.bfloat16)
    opt = opt_for(params, None, True)
    train(params, opt, 2)
    before = [p.detach().clone() for p in params]
    params[1].grad = grads_for(params, 9)[1]
    opt.step()
    assert [opt.state[p]["step"] for p in params] == [2, 3, 2, 2]
    assert_params_equal([before[i] for i in (0, 2, 3)], [params[i] for i in (0, 2, 3)])
    assert not same_bits(before[1], params[1])


@pytest.mark.parametrize("change", ["rescale", "sign of half", "one ulp"])
def test_grads_unchanged_since_backward_are_not_copied_again(monkeypatch, change):
    """At step() the hook's copies are checked by the grads' bit sums, and only
    changed grads are copied again: writes through .data count no version, and a
    norm would miss a flipped sign or round a tiny change away."""
    model = tiny_model()
    opt = opt_for(model.parameters(), None, True)
    params = list(model.parameters())
    backward(model, 0)
    g = params[2].grad.data.view(-1)
    if change == "rescale":
        g.mul_(0.5)
    elif change == "sign of half":
        g[: g.numel() // 2].neg_()
    else:
        g[0] = torch.nextafter(g[0], torch.tensor(float("inf"), dtype=g.dtype))
    copied = []
    off = opt._books.offload
    copy_grad = off._copy_grad
    monkeypatch.setattr(off, "_copy_grad",
                        lambda p, grad: copied.append(p) or copy_grad(p, grad))
    opt.step()
    assert [id(p) for p in copied] == [id(params[2])]
    assert same_bits(off._grad[params[2]], params[2].grad)


# ---------------------------------------------------------------------------
# The pipelined step: pieces of the host calls, each written back when stepped
# ---------------------------------------------------------------------------


def record_calls(monkeypatch, opt):
    """Log of the step's work in order: ("ready", [numels]) per wait for host grads,
    ("step", [numels]) per op call that steps (check-only calls, with their
    found_inf flag set, are left out) and ("write_back", [numels]) per write-back,
    numels of the offloaded params only."""
    log = []
    real_op = precis.ops.adam_step_

    def step(**kw):
        flag = kw.get("found_inf")
        if flag is None or not float(flag):
            log.append(("step", [t.numel() for t in kw["params"]]))
        return real_op(**kw)
    monkeypatch.setattr(precis.ops, "adam_step_", step)
    for name in ("ready", "write_back"):
        def logged(params, name=name, method=getattr(opt._books.offload, name)):
            params = [p for p in params if opt._books.offload.selected(p)]
            log.append((name, [p.numel() for p in params]))
            return method(params)
        monkeypatch.setattr(opt._books.offload, name, logged)
    return log


@pytest.mark.parametrize("buckets,pieces", [
    (1, [[1, 127, 4097, 30]]),
    (2, [[1, 127, 4097], [30]]),  # a piece ends where its share of the bytes is reached
    (4, [[1, 127, 4097], [30]]),
    (100, [[1, 127], [4097], [30]])])  # more buckets than params: 1 falls short of its share
def test_pieces_are_stepped_then_written_back_in_turn(monkeypatch, buckets, pieces):
    params = make_params(torch.float32)
    opt = opt_for(params, None, True)
    opt._books.offload.buckets = buckets
    log = record_calls(monkeypatch, opt)
    train(params, opt, 1)
    assert log == [(kind, piece) for piece in pieces
                   for kind in ("ready", "step", "write_back")]


def test_with_grad_scale_every_piece_is_checked_before_the_first_is_stepped(monkeypatch):
    """The NaN/Inf verdict covers all pieces: each piece's grads are waited for and
    checked first, then the pieces are stepped and written back in turn."""
    params = make_params(torch.float32)
    opt = opt_for(params, None, True)
    opt._books.offload.buckets = 2
    log = record_calls(monkeypatch, opt)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    opt.step(grad_scale=4.0)
    pieces = [[1, 127, 4097], [30]]
    assert log == [("ready", piece) for piece in pieces] + \
        [(kind, piece) for piece in pieces for kind in ("ready", "step", "write_back")]


def test_pieces_are_balanced_by_bytes(monkeypatch):
    """bf16 params with fp32 masters and bf16 moments (12 bytes per element) and fp32
    params (16): pieces of about a quarter of the bytes each."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n, dtype in
              ((3000, torch.bfloat16), (1000, torch.float32), (1001, torch.float32),
               (2000, torch.bfloat16), (999, torch.bfloat16), (5, torch.bfloat16))]
    opt = precis.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}],
                             offload=True, lr=1e-3)
    opt._books.offload.buckets = 4  # the default for host copies of CUDA params
    log = record_calls(monkeypatch, opt)
    train(params, opt, 1)
    # 36000 + 32016 bytes in group 0, 24000 + 11988 + 60 in group 1 (104064 in
    # all): pieces end at the first param reaching 26016, 52032 and 78048 bytes,
    # and at the end of each group's call
    assert [piece for kind, piece in log if kind == "step"] == \
        [[3000], [1000, 1001], [2000], [999, 5]]


def test_host_copies_of_cpu_params_are_stepped_in_one_call_by_default(monkeypatch):
    """Copies between CPU tensors overlap nothing: by default a group's host copies
    of CPU params are one op call, not precis.offload.BUCKETS pieces."""
    params = make_params(torch.float32)  # odd sizes
    opt = precis.optim.AdamW(params, offload=True, lr=1e-3)
    log = record_calls(monkeypatch, opt)
    train(params, opt, 2)
    steps = [piece for kind, piece in log if kind == "step"]
    assert precis.offload.BUCKETS > 1 and opt._books.offload.buckets is None
    assert steps == [[p.numel() for p in params]] * 2


def test_device_calls_run_before_the_host_pieces(monkeypatch):
    """offload_fraction: the group left on the device is stepped first, though it
    comes second."""
    params = make_params(torch.float32)[:3]  # 1, 127, 4097 elements
    opt = precis.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}],
                             offload=True, offload_fraction=0.1, lr=1e-3)
    assert [opt._books.offload.selected(p) for p in params] == [True, True, False]
    log = record_calls(monkeypatch, opt)
    train(params, opt, 1)
    assert log == [("ready", []), ("step", [4097]), ("write_back", []),
                   ("ready", [1, 127]), ("step", [1, 127]), ("write_back", [1, 127])]


@pytest.mark.parametrize("buckets", [1, 2, 3, 100])
@pytest.mark.parametrize("name", POLICIES)
def test_pieces_give_the_bits_of_one_call(name, buckets):
    """Several pieces, one, or one per param: the bits of the on-device run (one
    call per group), step after step, through a second group and amsgrad."""
    dtype, policy = POLICIES[name]
    runs = []
    for offload in (False, True):
        params = make_params(dtype) + make_params(dtype, seed=1)
        opt = precis.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 3e-3}],
                                 policy=policy, offload=offload, amsgrad=True, **KW)
        if offload:
            opt._books.offload.buckets = buckets
        train(params, opt, 4)
        runs.append((params, opt))
    (ref, opt_ref), (off, opt_off) = runs
    assert_params_equal(ref, off)
    assert_state_dicts_equal(opt_ref.state_dict(), opt_off.state_dict())


@pytest.mark.parametrize("buckets", [2, 100])
def test_a_piece_refused_by_the_op_leaves_everything_untouched(buckets):
    """The last piece's call refuses (its state aliased); all pieces are checked
    before the first is stepped, so no param, host copy or state changed."""
    params = make_params(torch.bfloat16)
    opt = opt_for(params, None, True)
    opt._books.offload.buckets = buckets
    train(params, opt, 2)
    st = opt.state[params[3]]
    st["exp_avg_sq"] = st["exp_avg"]
    before = snapshot(params, opt)
    for p, g in zip(params, grads_for(params, 7)):
        p.grad = g
    with pytest.raises(RuntimeError, match="exp_avg"):
        opt.step()
    assert_untouched(before, params, opt)


@pytest.mark.parametrize("buckets", [1, 4, 100])
def test_state_shared_across_pieces_is_refused(buckets):
    """A state buffer shared by params of different pieces is refused as in one
    call (each piece is checked as the call it was cut from), before anything is
    touched."""
    params = make_params(torch.bfloat16)  # 1, 127, 4097, 30 elements: 4 pieces
    params[3] = nn.Parameter(torch.randn(1, dtype=torch.bfloat16))  # numel of params[0]
    opt = opt_for(params, None, True)
    opt._books.offload.buckets = buckets
    train(params, opt, 2)
    opt.state[params[3]]["exp_avg"] = opt.state[params[0]]["exp_avg"]
    before = snapshot(params, opt)
    for p, g in zip(params, grads_for(params, 7)):
        p.grad = g
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] and exp_avgs\[3\] share memory"):
        opt.step()
    assert_untouched(before, params, opt)


# ---------------------------------------------------------------------------
# Weights loaded after the optimizer was built (the Megatron-Bridge trap)
# ---------------------------------------------------------------------------


def load_weights(params, seed):
    loaded = make_params(params[0].dtype, seed=seed)
    with torch.no_grad():
        for p, q in zip(params, loaded):
            p.copy_(q)
    return loaded


def step_with_lr_zero(opt, how, step):
    """After a weights load: reload_model_params() (or rely on the automatic
    detection), then step() with lr 0 and no weight decay."""
    if how == "reload_model_params":
        opt.reload_model_params()
    for group in opt.param_groups:
        group.update(lr=0.0, weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleMasterWarning)
        step()


@pytest.mark.parametrize("how", ["reload_model_params", "automatic"])
@pytest.mark.parametrize("stepped", [False, True])
@pytest.mark.parametrize("name", ["bf16", "remainders", "fp32"])
def test_loaded_weights_are_never_overwritten(name, stepped, how):
    """Weights loaded after the optimizer was built (and stepped), then an lr-0
    step: the params, their host copies and the masters all hold the loaded weights."""
    dtype, policy = POLICIES[name]
    params = make_params(dtype)
    opt = opt_for(params, policy, True)
    if stepped:
        train(params, opt, 2)
    loaded = load_weights(params, 9)
    step_with_lr_zero(opt, how, lambda: train(params, opt, 1, first=5))
    assert_params_equal(loaded, params)
    for p, q in zip(params, loaded):  # every CPU copy holds the loaded weights
        assert same_bits(opt._books.offload._host[p], q)
        assert torch.equal(opt.master_weight(p), q.float())


@pytest.mark.parametrize("how", ["reload_model_params", "automatic"])
@pytest.mark.parametrize("name", ["bf16", "remainders", "fp32"])
def test_weights_loaded_after_building_train_as_a_fresh_optimizer(name, how):
    dtype, policy = POLICIES[name]
    params = make_params(dtype)
    opt = opt_for(params, policy, True)
    load_weights(params, 9)
    if how == "reload_model_params":
        opt.reload_model_params()
    fresh = make_params(dtype, seed=9)
    opt_fresh = opt_for(fresh, policy, True)
    train(params, opt, 3)
    train(fresh, opt_fresh, 3)
    assert_params_equal(fresh, params)


def test_automatic_detection_warns_once_and_writes_through_data_need_reload():
    params = make_params(torch.bfloat16)
    opt = opt_for(params, None, True)
    train(params, opt, 1)
    loaded = make_params(torch.bfloat16, seed=9)
    with torch.no_grad():
        params[1].copy_(loaded[1])
    with pytest.warns(StaleMasterWarning):
        train(params, opt, 1, first=1)
    # .data writes bypass the version counter: reload_model_params() rereads anyway.
    for p, q in zip(params, loaded):
        p.data.copy_(q)
    opt.reload_model_params()
    for group in opt.param_groups:
        group.update(lr=0.0, weight_decay=0.0)
    train(params, opt, 1, first=2)
    assert_params_equal(loaded, params)


# ---------------------------------------------------------------------------
# Checkpoints: one format with and without offload
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
@pytest.mark.parametrize("name", ["bf16", "remainders", "fp8"])
def test_checkpoint_switches_offload_bit_for_bit(name, first, second):
    dtype, policy = POLICIES[name]
    whole = make_params(dtype)
    opt_whole = opt_for(whole, policy, False)
    train(whole, opt_whole, 6)

    a = make_params(dtype)
    opt_a = opt_for(a, policy, first)
    train(a, opt_a, 3)
    saved = copy.deepcopy(opt_a.state_dict())
    model_saved = [p.detach().clone() for p in a]

    b = make_params(dtype, seed=5)  # built before the weights are loaded, as in a resume
    opt_b = opt_for(b, policy, second)
    opt_b.load_state_dict(saved)
    with torch.no_grad():
        for p, q in zip(b, model_saved):
            p.copy_(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleMasterWarning)
        train(b, opt_b, 3, first=3)
    assert_params_equal(whole, b)
    assert_state_dicts_equal(opt_whole.state_dict(), opt_b.state_dict())


# ---------------------------------------------------------------------------
# precis.ddp, optim sharding, world size 2: each rank offloads its shard
# ---------------------------------------------------------------------------

BF16_MASTERS = {"main_params_dtype": "fp32"}


def ddp_build(dtype, offload, model=None, optimizer="adamw", policy=BF16_MASTERS):
    """optimizer: a name of ddp_worker.OPTIMIZERS."""
    import precis.ddp
    model = w.make_model(dtype) if model is None else model
    ddp = precis.ddp.DistributedDataParallel(model, policy=policy,
                                             sharding="optim", bucket_size=50)
    opt = w.make_optimizer(optimizer, ddp.parameters(), policy=policy, offload=offload)
    return ddp, precis.ddp.attach_optimizer(opt)


def ddp_train(ddp, opt, rank, world_size, steps, first=0):
    per_rank = w.GLOBAL_BATCH // world_size
    for x, y in w.make_batches(first + steps)[first:]:
        for i, (xm, ym) in enumerate(w.local_micro_batches(x, y, rank, world_size, 2)):
            with ddp.no_sync() if i == 0 else contextlib.nullcontext():
                w.loss_fn(ddp, xm, ym, per_rank).backward()
        opt.step()
        opt.zero_grad()


def case_ddp_trajectory(rank, world_size, optimizer="adamw", policy=BF16_MASTERS):
    out = []
    for offload in (False, True):
        ddp, opt = ddp_build(torch.bfloat16, offload, optimizer=optimizer, policy=policy)
        ddp_train(ddp, opt, rank, world_size, 4)
        out.append(w.flat_params(ddp.module))
    return out


def case_ddp_trap(rank, world_size, stepped, how):
    """Weights loaded after the optimizer was built (and stepped): an lr-0 step keeps
    them, in the params and every host copy."""
    ddp, opt = ddp_build(torch.bfloat16, True)
    if stepped:
        ddp_train(ddp, opt, rank, world_size, 2)
    loaded = w.make_model(torch.bfloat16, seed=7)
    ddp.module.load_state_dict(loaded.state_dict())
    step_with_lr_zero(opt, how, lambda: ddp_train(ddp, opt, rank, world_size, 1, first=3))
    pieces = [p for g in opt.param_groups for p in g["params"]]
    return {"kept": w.flat_params(ddp.module), "loaded": w.flat_params(loaded),
            "hosts": [torch.equal(opt._books.offload._host[p], p.detach()) for p in pieces],
            "masters": [torch.equal(opt.state[p]["master"], p.detach().float())
                        for p in pieces]}


def case_ddp_fresh(rank, world_size, how):
    """Weights loaded after the optimizer was built: training matches an optimizer
    built after the load."""
    ddp, opt = ddp_build(torch.bfloat16, True)
    loaded = w.make_model(torch.bfloat16, seed=7)
    ddp.module.load_state_dict(loaded.state_dict())
    if how == "reload_model_params":
        opt.reload_model_params()
    ref, ref_opt = ddp_build(torch.bfloat16, True, model=loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleMasterWarning)
        ddp_train(ddp, opt, rank, world_size, 3)
    ddp_train(ref, ref_opt, rank, world_size, 3)
    return [w.flat_params(ddp.module), w.flat_params(ref.module)]


DDP_CASES = {"trajectory": (case_ddp_trajectory, ())}
# SGD and Lion (issue #44), fp8 momentum + 8-bit remainders (the wrapper cuts shards at
# the momentum's blocks)
DDP_CASES.update({("trajectory", opt): (case_ddp_trajectory, (opt, w.FP8_MOMENTUM_REM8))
                  for opt in w.ONE_STATE})
DDP_CASES.update({("trap", stepped, how): (case_ddp_trap, (stepped, how))
                  for stepped in (False, True) for how in ("reload_model_params", "automatic")})
DDP_CASES.update({("fresh", how): (case_ddp_fresh, (how,))
                  for how in ("reload_model_params", "automatic")})


def test_ddp_optim_sharding_offloaded_follows_on_device_bit_for_bit():
    for rank, (on_device, offloaded) in enumerate(w.case_result(DDP_CASES, 2, "trajectory")):
        assert same_bits(on_device, offloaded), rank


@pytest.mark.parametrize("how", ["reload_model_params", "automatic"])
@pytest.mark.parametrize("stepped", [False, True])
def test_ddp_loaded_weights_are_never_overwritten(stepped, how):
    for rank, r in enumerate(w.case_result(DDP_CASES, 2, ("trap", stepped, how))):
        assert torch.equal(r["kept"], r["loaded"]), rank
        assert r["hosts"] and all(r["hosts"]) and all(r["masters"]), rank


@pytest.mark.parametrize("how", ["reload_model_params", "automatic"])
def test_ddp_weights_loaded_after_building_train_as_a_fresh_optimizer(how):
    for rank, (got, want) in enumerate(w.case_result(DDP_CASES, 2, ("fresh", how))):
        assert torch.equal(got, want), rank


# ---------------------------------------------------------------------------
# CUDA: pinned host copies, side streams, events (skip without a GPU)
# ---------------------------------------------------------------------------

needs_cuda = pytest.mark.cuda  # skipped without a device (conftest.py)


def cuda_model_run(offload, device, policy, dtype, steps=4, step_kw=None, optimizer="adamw",
                   **kw):
    """A model trained by backward passes (the hooks copy the grads during backward);
    kw go to the optimizer (optimizer: a name of ddp_worker.OPTIMIZERS), step_kw to
    step()."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(7, 4097), nn.Tanh(), nn.Linear(4097, 127), nn.Tanh(),
                          nn.Linear(127, 1)).to(device=device, dtype=dtype)
    opt = opt_for(model.parameters(), policy, offload, **kw) if optimizer == "adamw" else \
        w.make_optimizer(optimizer, model.parameters(), policy=policy, offload=offload, **kw)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(9, 7, generator=g).to(device=device, dtype=dtype)
        model(x).float().square().mean().backward()
        opt.step(**(step_kw or {}))
        opt.zero_grad()
    return model, opt


@needs_cuda
@pytest.mark.parametrize("name", POLICIES)
def test_cuda_offload_steps_as_the_cpu_kernel_would(name, monkeypatch):
    """The host steps with the CPU kernel and IEEE sqrt: a CUDA model offloaded ends
    with the bits of a CPU step on the same grads (the grads come from the CUDA
    backward, so the reference steps copies of them on the CPU each step)."""
    monkeypatch.setenv("PRECIS_CPU_SQRT", "ieee")  # the reference's sqrt
    dtype, policy = POLICIES[name]
    model, opt = cuda_model_run(True, "cuda", policy, dtype, steps=0)
    ref = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
    opt_ref = opt_for(ref, policy, False)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(9, 7, generator=g).to(device="cuda", dtype=dtype)
        model(x).float().square().mean().backward()
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.cpu()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        torch.cuda.synchronize()
        assert_params_equal(ref, list(model.parameters()))
    for p in model.parameters():
        assert opt._books.offload.host(p).is_pinned()
        assert all(t.device.type == "cpu" for t in opt.state[p].values()
                   if isinstance(t, torch.Tensor))


@needs_cuda
@pytest.mark.parametrize("name", POLICIES)
def test_cuda_offloaded_run_follows_the_on_device_run_bit_for_bit(name):
    """The host copies of CUDA params step with IEEE sqrt (ieee_sqrt=True), as the
    CUDA kernel does, so the CPU kernel writes the CUDA kernel's bits. Whole model
    offloaded: the same dtype combinations in the same order, one call each."""
    dtype, policy = POLICIES[name]
    a, opt_a = cuda_model_run(False, "cuda", policy, dtype)
    b, opt_b = cuda_model_run(True, "cuda", policy, dtype)
    torch.cuda.synchronize()
    assert_params_equal(list(a.parameters()), list(b.parameters()))
    assert_state_dicts_equal(opt_a.state_dict(), opt_b.state_dict())


@needs_cuda
@pytest.mark.parametrize("name", list(POLICIES))
def test_cuda_partly_offloaded_pipelined_run_follows_the_on_device_run(name):
    """offload_fraction 0.5: the device call is queued first and the host pieces are
    written back beside it (after a fence, not after the device call); with
    grad_scale every piece's and the device's grads are checked before any step."""
    dtype, policy = POLICIES[name]
    step_kw = dict(grad_scale=8.0)
    a, opt_a = cuda_model_run(False, "cuda", policy, dtype, step_kw=step_kw)
    b, opt_b = cuda_model_run(True, "cuda", policy, dtype, step_kw=step_kw,
                              offload_fraction=0.5)
    torch.cuda.synchronize()
    assert {opt_b._books.offload.selected(p) for p in b.parameters()} == {True, False}
    assert_params_equal(list(a.parameters()), list(b.parameters()))
    assert_state_dicts_equal(opt_a.state_dict(), opt_b.state_dict())


@needs_cuda
def test_cuda_loaded_weights_are_never_overwritten():
    model, opt = cuda_model_run(True, "cuda", None, torch.bfloat16, steps=2)
    torch.manual_seed(11)
    loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    for group in opt.param_groups:
        group.update(lr=0.0, weight_decay=0.0)
    model(torch.randn(9, 7, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    with pytest.warns(StaleMasterWarning):
        opt.step()
    torch.cuda.synchronize()
    for k, v in model.state_dict().items():
        assert same_bits(v, loaded[k]), k


@needs_cuda
def test_cuda_state_dict_loads_where_each_optimizer_keeps_its_state():
    model, opt = cuda_model_run(True, "cuda", None, torch.bfloat16, steps=2)
    sd = opt.state_dict()
    for offload, device in ((True, "cpu"), (False, "cuda")):
        other = opt_for(model.parameters(), None, offload)
        other.load_state_dict(sd)
        for p in model.parameters():  # 'step' is torch's CPU tensor on either side
            assert other.state[p]["step"].is_cpu
            assert all(t.device.type == device for k, t in other.state[p].items()
                       if isinstance(t, torch.Tensor) and k != "step"), offload
        assert_state_dicts_equal(
            {"param_groups": sd["param_groups"], "state": {
                i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for i, s in other.state_dict()["state"].items()}}, sd)


@needs_cuda
def test_cuda_a_new_group_moving_a_stepped_param_across_the_cut_raises():
    params = make_params(torch.bfloat16, device="cuda")  # 1, 127, 4097, 30 elements
    opt = opt_for(params, None, True, offload_fraction=0.5)
    train(params, opt, 1)
    assert not opt._books.offload.selected(params[2])  # its state is on the GPU
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1, device="cuda"))]})  # no move
    assert not opt._books.offload.selected(params[2]) and len(opt.param_groups) == 2
    with pytest.raises(RuntimeError, match="moved across offload_fraction's cut"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(10000, device="cuda"))]})
    assert len(opt.param_groups) == 2


# ---------------------------------------------------------------------------
# SGD and Lion (issue #44): the same offload, the same bits
# ---------------------------------------------------------------------------

ONE_STATE_POLICIES = {  # name -> (param dtype, policy)
    "bf16": (torch.bfloat16, None),
    "fp8m_rem8": (torch.bfloat16, w.FP8_MOMENTUM_REM8),
}


def one_state_opt(optimizer, params, policy, offload, **kw):
    return w.make_optimizer(optimizer, params, policy=policy, offload=offload, **kw)


@pytest.mark.parametrize("fraction,buckets", [(1.0, None), (0.5, None), (1.0, 3)])
@pytest.mark.parametrize("name", ONE_STATE_POLICIES)
@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_offloaded_run_follows_the_on_device_run_bit_for_bit(optimizer, name,
                                                                      fraction, buckets):
    """SGD and Lion offloaded (all params, half of them, or in 3 pieces of the host call):
    the params and state dict of the on-device run, bit for bit, after each of 5 steps."""
    dtype, policy = ONE_STATE_POLICIES[name]
    ref, off = make_params(dtype), make_params(dtype)
    opt_ref = one_state_opt(optimizer, ref, policy, False)
    opt_off = one_state_opt(optimizer, off, policy, True, offload_fraction=fraction)
    if buckets is not None:
        opt_off._books.offload.buckets = buckets
    selected = [opt_off._books.offload.selected(p) for p in off]
    assert all(selected) if fraction == 1.0 else (any(selected) and not all(selected))
    for step in range(5):
        train(ref, opt_ref, 1, first=step)
        train(off, opt_off, 1, first=step)
        assert_params_equal(ref, off)
    assert_state_dicts_equal(opt_ref.state_dict(), opt_off.state_dict())
    state = opt_off.state[off[2]]
    assert "exp_avg" in state and "exp_avg_sq" not in state
    assert state["exp_avg"].dtype == (torch.uint8 if policy else torch.bfloat16)
    for p in off:
        if opt_off._books.offload.selected(p):
            assert opt_off._books.offload.host(p).data_ptr() != p.data_ptr()
            assert all(t.device.type == "cpu" for t in opt_off.state[p].values()
                       if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_strided_params_offloaded_follow_the_on_device_run(optimizer):
    """channels_last, transposed and gapped params with fp8 momentum (its blocks follow
    memory order on both sides)."""
    dtype, policy = ONE_STATE_POLICIES["fp8m_rem8"]
    ref, off = strided_params(dtype), strided_params(dtype)
    opt_ref = one_state_opt(optimizer, ref, policy, False)
    opt_off = one_state_opt(optimizer, off, policy, True)
    train(ref, opt_ref, 4)
    train(off, opt_off, 4)
    assert_params_equal(ref, off)
    assert_state_dicts_equal(opt_ref.state_dict(), opt_off.state_dict())


@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_checkpoint_switches_offload_bit_for_bit(optimizer, first, second):
    """Saved with offload and loaded without it (or the other way): the 6 steps of one
    uninterrupted run, fp8 momentum + 8-bit remainders."""
    dtype, policy = ONE_STATE_POLICIES["fp8m_rem8"]
    whole = make_params(dtype)
    opt_whole = one_state_opt(optimizer, whole, policy, False)
    train(whole, opt_whole, 6)
    a = make_params(dtype)
    opt_a = one_state_opt(optimizer, a, policy, first)
    train(a, opt_a, 3)
    saved = copy.deepcopy(opt_a.state_dict())
    model_saved = [p.detach().clone() for p in a]
    b = make_params(dtype, seed=5)
    opt_b = one_state_opt(optimizer, b, policy, second)
    opt_b.load_state_dict(saved)
    with torch.no_grad():
        for p, q in zip(b, model_saved):
            p.copy_(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleMasterWarning)
        train(b, opt_b, 3, first=3)
    assert_params_equal(whole, b)
    assert_state_dicts_equal(opt_whole.state_dict(), opt_b.state_dict())


@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_skipped_offloaded_step_touches_nothing(optimizer):
    """An Inf under grad_scale in the third param of four host pieces: no param, host
    copy or state changes."""
    dtype, policy = ONE_STATE_POLICIES["fp8m_rem8"]
    params = make_params(dtype)
    opt = one_state_opt(optimizer, params, policy, True)
    opt._books.offload.buckets = 4
    train(params, opt, 2)
    before = snapshot(params, opt)
    for p, g in zip(params, grads_for(params, 7)):
        p.grad = g
    params[2].grad[5] = float("inf")
    opt.step(grad_scale=torch.tensor(64.0))
    assert opt.last_step_skipped
    assert_untouched(before, params, opt)


@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_one_state_ddp_optim_sharding_offloaded_follows_on_device(optimizer):
    """precis.ddp `optim` at world 2, each rank offloading its pieces: the on-device bits."""
    for rank, (on_device, offloaded) in enumerate(
            w.case_result(DDP_CASES, 2, ("trajectory", optimizer))):
        assert same_bits(on_device, offloaded), rank


# Muon: its momentum and apply on the host copies, Newton-Schulz on the param's device
MUON_SHAPES = ((127, 33), (33, 127), (1, 5), (64, 64))


def muon_matrices(dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g).to(device=device, dtype=dtype))
            for shape in MUON_SHAPES]


@pytest.mark.parametrize("optimizer", w.WHOLE_MATRIX)
@pytest.mark.parametrize("fraction,buckets", [(1.0, None), (0.5, None), (1.0, 3)])
@pytest.mark.parametrize("name", ONE_STATE_POLICIES)
def test_muon_offloaded_run_follows_the_on_device_run_bit_for_bit(name, fraction, buckets,
                                                                  optimizer):
    """Muon and NorMuon offloaded (all matrices, half of them, or in 3 pieces of the host
    call), tall, wide and square: the params and state dict (NorMuon's row state on the
    host with the rest) of the on-device run after each of 4 steps."""
    dtype, policy = ONE_STATE_POLICIES[name]
    ref, off = muon_matrices(dtype), muon_matrices(dtype)
    opt_ref = w.make_optimizer(optimizer, ref, policy=policy)
    opt_off = w.make_optimizer(optimizer, off, policy=policy, offload=True,
                               offload_fraction=fraction)
    if buckets is not None:
        opt_off._books.offload.buckets = buckets
    selected = [opt_off._books.offload.selected(p) for p in off]
    assert all(selected) if fraction == 1.0 else (any(selected) and not all(selected))
    for step in range(4):
        train(ref, opt_ref, 1, first=step)
        train(off, opt_off, 1, first=step)
        assert_params_equal(ref, off)
    assert_state_dicts_equal(opt_ref.state_dict(), opt_off.state_dict())
    for p in off:
        if opt_off._books.offload.selected(p):
            assert all(t.device.type == "cpu" for t in opt_off.state[p].values()
                       if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("optimizer", w.WHOLE_MATRIX)
def test_muon_skipped_offloaded_step_touches_nothing(optimizer):
    """An Inf under grad_scale in one matrix of four host pieces: no param, host copy or
    state (NorMuon's row state too) changes; the next step is the on-device run's."""
    dtype, policy = ONE_STATE_POLICIES["fp8m_rem8"]
    params, ref = muon_matrices(dtype), muon_matrices(dtype)
    opt = w.make_optimizer(optimizer, params, policy=policy, offload=True)
    opt_ref = w.make_optimizer(optimizer, ref, policy=policy)
    opt._books.offload.buckets = 4
    train(params, opt, 2)
    train(ref, opt_ref, 2)
    before = snapshot(params, opt)
    for p, g in zip(params, grads_for(params, 7)):
        p.grad = g
    params[2].grad[0, 3] = float("inf")
    opt.step(grad_scale=torch.tensor(64.0))
    assert opt.last_step_skipped
    assert_untouched(before, params, opt)
    opt.zero_grad()
    train(params, opt, 1, first=2)
    train(ref, opt_ref, 1, first=2)
    assert_params_equal(ref, params)


@needs_cuda
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", ONE_STATE_POLICIES)
@pytest.mark.parametrize("optimizer", w.ONE_STATE)
def test_cuda_one_state_offloaded_run_follows_the_on_device_run(optimizer, name, fraction):
    """SGD and Lion on CUDA params, offloaded (all, or half with the device call
    pipelined beside the host pieces): the CUDA kernel's bits."""
    dtype, policy = ONE_STATE_POLICIES[name]
    a, opt_a = cuda_model_run(False, "cuda", policy, dtype, optimizer=optimizer)
    b, opt_b = cuda_model_run(True, "cuda", policy, dtype, optimizer=optimizer,
                              offload_fraction=fraction)
    torch.cuda.synchronize()
    assert_params_equal(list(a.parameters()), list(b.parameters()))
    assert_state_dicts_equal(opt_a.state_dict(), opt_b.state_dict())
