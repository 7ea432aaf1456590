"""libprecis_torch.so on its own: the ops without the precis package, and bad
calls that leak nothing."""
import os
import subprocess
import sys
import textwrap

import pytest

import torch

import precis
from precis import _lib, ops, optim


def _glue_path():
    return _lib.torch_glue().precis_path


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = (1, 127, 4097)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g) for n in sizes] for _ in range(3)]
    return params, grads


def test_glue_alone_gives_the_bits_of_precis_optim(tmp_path):
    """A process that loads only the glue (torch.ops.load_library, never `import
    precis`) finds the ops with CPU kernels; three AdamW steps through
    torch.ops.precis.adam_step_ there equal precis.optim.AdamW's here, bit for bit."""
    params, grads = _inputs()
    torch.save({"params": params, "grads": grads}, tmp_path / "in.pt")
    script = textwrap.dedent("""
        import sys, torch
        torch.ops.load_library(sys.argv[1])
        assert "precis" not in sys.modules and "precis.ops" not in sys.modules
        data = torch.load(sys.argv[2])
        params = [p.clone() for p in data["params"]]
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        for k, grads in enumerate(data["grads"], start=1):
            torch.ops.precis.adam_step_(params, grads, [], m, v, [], [], [k] * len(params),
                                        1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, 1.0, False,
                                        0, [], [], [], [], False, [], [], False, [], [])
        assert "precis" not in sys.modules
        torch.save({"params": params, "m": m, "v": v}, sys.argv[3])
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no precis package
    subprocess.run([sys.executable, "-c", script, _glue_path(), str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], check=True, env=env, cwd=tmp_path, timeout=300)
    alone = torch.load(tmp_path / "out.pt")

    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = precis.optim.AdamW(mine, lr=1e-2, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(mine, step_grads):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(mine):
        assert torch.equal(p.detach().view(torch.int32), alone["params"][i].view(torch.int32)), i
        assert torch.equal(opt.state[p]["exp_avg"].view(torch.int32), alone["m"][i].view(torch.int32))
        assert torch.equal(opt.state[p]["exp_avg_sq"].view(torch.int32),
                           alone["v"][i].view(torch.int32))


def _bad_calls():
    p, g = torch.randn(64), torch.randn(64)
    m, v = torch.zeros(64), torch.zeros(64)
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, 1.0, False, 0, [], [], [], [], False, [],
             [], False)
    keyed = hyper[:-1] + (False,)  # streams and element_offsets follow
    wrong = [
        lambda: ops.accumulate_(p, torch.randn(63)),
        lambda: ops.cast_(p, torch.ones(64, dtype=torch.int32)),
        lambda: ops.scale_(p[::2], 2.0),
        lambda: ops.count_nonfinite(torch.ones(4, dtype=torch.float64)),
        lambda: torch.ops.precis.adam_step_([p, p], [g, g], [], [m, m], [v, v], [], [], [1, 1],
                                            *hyper, [], []),
        lambda: torch.ops.precis.adam_step_([p], [g], [], [m], [torch.zeros(63)], [], [], [1],
                                            *hyper, [], []),
        lambda: torch.ops.precis.adam_step_([p], [g], [], [m], [v], [], [], [0], *hyper, [], []),
        lambda: torch.ops.precis.adam_step_([p], [g], [], [m], [v], [], [], [1], *keyed, [1, 2],
                                            []),
        lambda: torch.ops.precis.adam_step_([p], [g], [], [m], [v], [], [], [1], *keyed, [],
                                            [-1]),
        lambda: ops.check_finite_([g, torch.ones(3, dtype=torch.int64)], torch.zeros(1)),
    ]
    return p, wrong


def test_bad_calls_raise_and_leak_nothing():
    """Every bad call raises RuntimeError naming the op, leaves the tensors as they
    were, and frees what it took: 25000 bad calls do not grow the process."""
    p, wrong = _bad_calls()
    before = p.clone()
    for call in wrong:
        try:
            call()
        except RuntimeError as e:
            assert str(e).startswith("precis."), str(e)
        else:
            raise AssertionError("no error")
    assert torch.equal(p, before)
    for _ in range(200):  # warm up allocator caches
        for call in wrong:
            try:
                call()
            except RuntimeError:
                pass
    start = _rss_bytes()
    for _ in range(2500):
        for call in wrong:
            try:
                call()
            except RuntimeError:
                pass
    grown = _rss_bytes() - start
    # 25000 calls that each took up to 10 tensor handles and a few tables: a leak of
    # one handle or table per call would be >= 1 MB.
    assert grown < (1 << 20), f"RSS grew by {grown} bytes over 25000 bad calls"


def test_none_for_a_tensor_names_the_argument():
    """None where a tensor is expected: an error naming the argument, nothing written
    (no AttributeError from deep inside, no dispatcher message without a name)."""
    p = torch.randn(8)
    before = p.clone()
    for call, words in [
            (lambda: torch.ops.precis.accumulate_(p, None), "precis.accumulate_: src is not a "
                                                            "defined tensor"),
            (lambda: torch.ops.precis.cast_(None, p), "precis.cast_: dst is not a defined tensor"),
            (lambda: torch.ops.precis.check_finite_([p], None),
             "precis.check_finite_: found_inf is not a defined tensor")]:
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value).startswith(words), str(e.value)
    for call, words in [
            (lambda: ops.scale_(None, 2.0), "precis.scale_: buf must be a torch.Tensor, got "
                                            "NoneType"),
            (lambda: ops.count_nonfinite(None), "precis.count_nonfinite: buf must be"),
            (lambda: optim.encode_moment(None, torch.float16, False),
             "precis.checkpoint.encode_moment: values must be"),
            (lambda: optim.decode_moment(None, None, False),
             "precis.checkpoint.decode_moment: stored"),
            (lambda: optim.decode_moment(torch.zeros(4, dtype=torch.float16), [1.0], False),
             "precis.checkpoint.decode_moment: scales must be a torch.Tensor, got list"),
            (lambda: optim.remainder_split(None), "precis.checkpoint.remainder_split: master"),
            (lambda: optim.remainder_join(None, torch.zeros(2, dtype=torch.int16)),
             "precis.checkpoint.remainder_join: param"),
            (lambda: optim.remainder_join(p.bfloat16(), None),
             "precis.checkpoint.remainder_join: remainder")]:
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value).startswith(words), str(e.value)
    assert torch.equal(p, before)


def _freed(t):
    """t with its storage freed (resized to 0 bytes, as FSDP frees an unsharded param)."""
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.parametrize("argument", ["found_inf", "lr_tensor", "inv_grad_scale_tensor",
                                      "step_tensors", "fingerprints", "check_finite_"])
def test_a_tensor_whose_storage_was_freed_is_named_not_read(argument):
    """A tensor of elements but no storage (its data pointer NULL): the op read or wrote
    through it (SIGSEGV) or took a freed found_inf for none; now refused naming it,
    nothing written."""
    z = torch.zeros
    params, grads = [z(5), z(5)], [torch.full((5,), float("nan")), z(5)]
    kw = dict(params=params, grads=grads, masters=[], exp_avgs=[z(5), z(5)],
              exp_avg_sqs=[z(5), z(5)], exp_avg_scales=[], exp_avg_sq_scales=[],
              steps=[1, 1], lr=1e-3)
    if argument == "found_inf":
        kw.update(found_inf=_freed(z(1)), check_finite=True)
    elif argument == "lr_tensor":
        kw.update(lr_tensor=_freed(z(1, dtype=torch.float64)))
    elif argument == "inv_grad_scale_tensor":
        kw.update(inv_grad_scale_tensor=_freed(z(1)))
    elif argument == "step_tensors":
        kw.update(steps=[], step_tensors=[_freed(torch.ones(1, dtype=torch.int64)),
                                          torch.ones(1, dtype=torch.int64)])
    elif argument == "fingerprints":
        kw.update(fingerprints=_freed(z(2, dtype=torch.int64)))
    before = [t.clone() for t in params + kw["exp_avgs"] + kw["exp_avg_sqs"]]
    with pytest.raises(RuntimeError, match=(
            rf"\[0\] has \d+ elements but no storage" if argument != "check_finite_" else
            r"precis.check_finite_: found_inf has 1 elements but no storage")):
        if argument == "check_finite_":
            torch.ops.precis.check_finite_([grads[0]], _freed(z(1)))
        else:
            ops.adam_step_(**kw)
    after = params + kw["exp_avgs"] + kw["exp_avg_sqs"]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# The op's aliasing check sorts the buffers' address ranges list by list, fast when
# a list comes in address order (ascending from the heap, descending as mmap'd blocks
# come); any other order is sorted too. Buffers are carved from one storage here, so
# each layout below puts them in a chosen address order.
_ALIAS_LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs")
_ALIAS_N, _ALIAS_NUMEL = 9, 16  # params per list, floats per buffer
_ALIAS_SLOT = 2 * _ALIAS_NUMEL  # a buffer moved half-way into another stays in its slot


def _alias_slots(order):
    """(list, param) -> slot index in the storage, for one address order."""
    n = _ALIAS_N
    if order == "ascending":
        return {(l, i): l * n + i for l in range(4) for i in range(n)}
    if order == "descending":
        return {(l, i): (3 - l) * n + (n - 1 - i) for l in range(4) for i in range(n)}
    if order == "runs":  # ascending runs with breaks, as a reused heap gives
        return {(l, i): l * n + (i + 4) % n for l in range(4) for i in range(n)}
    perm = torch.randperm(4 * n, generator=torch.Generator().manual_seed(7)).tolist()
    return {(l, i): perm[l * n + i] for l in range(4) for i in range(n)}


def _alias_call(storage, slots, moved=None):
    """The op on buffers of `storage` at `slots`; `moved` = ((l, i), (k, j)) starts
    buffer (l, i) half-way into buffer (k, j)."""
    def buf(l, i):
        start = slots[(l, i)] * _ALIAS_SLOT
        if moved is not None and moved[0] == (l, i):
            start = slots[moved[1]] * _ALIAS_SLOT + _ALIAS_NUMEL // 2
        return storage[start:start + _ALIAS_NUMEL]

    lists = [[buf(l, i) for i in range(_ALIAS_N)] for l in range(4)]
    ops.adam_step_(lists[0], lists[1], [], lists[2], lists[3], [], [], [1] * _ALIAS_N, 1e-3,
                   0.9, 0.999, 1e-8, 0.0)


@pytest.mark.parametrize("order", ["ascending", "descending", "runs", "shuffled"])
def test_aliasing_is_found_in_every_address_order(order):
    """Overlaps between a written buffer and any other are refused, naming both,
    before anything is written; grads (read only) may share memory; disjoint
    buffers pass. Checked for every pair position of every list."""
    slots = _alias_slots(order)
    g = torch.Generator().manual_seed(0)
    storage = torch.randn(4 * _ALIAS_N * _ALIAS_SLOT, generator=g).abs() + 0.5
    _alias_call(storage.clone(), slots)  # disjoint: accepted
    names = lambda l, i: f"{_ALIAS_LISTS[l]}[{i}]"  # noqa: E731
    pairs = [((l, i), (k, j)) for l in range(4) for k in range(4)
             for i in (0, _ALIAS_N // 2, _ALIAS_N - 1) for j in (0, 3, _ALIAS_N - 1)
             if (l, i) != (k, j)]
    for moved, into in pairs:
        mine = storage.clone()
        before = mine.clone()
        if moved[0] == into[0] == 1:  # two grads: both read only
            _alias_call(mine, slots, (moved, into))
            continue
        with pytest.raises(RuntimeError) as e:
            _alias_call(mine, slots, (moved, into))
        message = str(e.value)
        assert message.startswith("precis.adam_step_: ") and "share memory" in message, message
        assert names(*moved) in message and names(*into) in message, (moved, into, message)
        assert torch.equal(mine, before), (moved, into)


@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 4097, 1_000_003])
def test_scale_count_is_the_c_count(numel):
    """ops.scale_count is Python arithmetic (traceable by torch.compile): it must
    give precis_scale_count's number."""
    import ctypes
    out = ctypes.c_int64()
    _lib.check(_lib.lib().precis_scale_count(numel, ctypes.byref(out)), "precis_scale_count")
    assert ops.scale_count(numel) == out.value


@pytest.mark.parametrize("moments", ["bf16", "fp8"])
def test_slices_with_their_element_offsets_give_the_bits_of_the_whole(moments):
    """A bf16 param with no master (stochastically rounded) and stochastically rounded
    moments, stepped whole and as slices each handed with its element offset and the
    param's stream: the same bits (the CPU twin of test_cuda_adam.py's 2^31 test).
    fp8 blocks of 128 follow the tensor handed in, so its cuts fall on blocks."""
    n = 128 * 70 + 3
    moment = torch.uint8 if moments == "fp8" else torch.bfloat16
    cuts = [0, 1, 2000, 2001, 5000, n] if moments == "bf16" else [0, 128, 2048, 6400, n]
    g = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=g).bfloat16()
    grads = [(torch.randn(n, generator=g) * 0.1).bfloat16() for _ in range(3)]

    def run(pieces, stream):
        p = p0.clone()
        m, v = torch.zeros(n, dtype=moment), torch.zeros(n, dtype=moment)
        count = ops.scale_count(n) if moments == "fp8" else 0
        ms, vs = torch.zeros(count), torch.zeros(count)
        for step, grad in enumerate(grads, start=1):
            parts = list(zip(pieces, pieces[1:]))
            scaled = lambda t, a, b: t[a // 128:ops.scale_count(b)] if count else torch.empty(0)
            ops.adam_step_([p[a:b] for a, b in parts], [grad[a:b] for a, b in parts], [],
                           [m[a:b] for a, b in parts], [v[a:b] for a, b in parts],
                           [scaled(ms, a, b) for a, b in parts],
                           [scaled(vs, a, b) for a, b in parts], [step] * len(parts),
                           lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, seed=3,
                           streams=[stream] * len(parts), element_offsets=[a for a, _ in parts])
        return [t.view(torch.uint8) for t in (p, m, v)] + [ms, vs]

    whole = run([0, n], 11)
    for got, want in zip(run(cuts, 11), whole):
        assert torch.equal(got, want)
    other = run([0, n], 12)  # another stream: other numbers, other bits
    assert not all(torch.equal(a, b) for a, b in zip(other, whole))
