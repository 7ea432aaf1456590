"""torch.ops.precis.adam_step_flat_ on its own: flat buffers and a table give the bits
of adam_step_ on the same state as lists, and a malformed table (offsets out of range,
overlapping rows, a numel that overflows, a wrong step) is refused before anything
is written: a randomized sweep against an independent check of the table."""
import random
import re

import pytest
import torch

import precis  # noqa: F401  (registers the ops)
from precis import ops

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.uint8
SIZES = (1, 127, 0, 4097, 300)
LAYOUTS = {  # name -> (param dtype, master dtype or None, exp_avg dtype, exp_avg_sq dtype, amsgrad)
    "fp32": (F32, None, F32, F32, False),
    "bf16_default": (BF16, F32, BF16, BF16, False),
    "fp8_remainders": (BF16, torch.int16, FP8, FP8, False),
    "amsgrad_fp16_v": (BF16, F32, BF16, torch.float16, True),
}
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, seed=5)


def flat_problem(name, seed=0):
    """params, grads, the flat buffers by name and a valid table (rows in order)."""
    pd, md, ed, sd, amsgrad = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(pd) for n in SIZES]
    grads = [torch.randn(n, generator=g).to(pd) for n in SIZES]
    total = sum(SIZES)
    blocks = [ops.scale_count(n) for n in SIZES]
    buffers = {"exp_avg": torch.zeros(total, dtype=ed), "exp_avg_sq": torch.zeros(total, dtype=sd)}
    if md is not None:
        buffers["master"] = torch.cat(params).float() if md == F32 else \
            torch.zeros(total, dtype=md)
    for key, dtype in (("exp_avg", ed), ("exp_avg_sq", sd)):
        if dtype in ops.SCALED_MOMENT_DTYPES:
            buffers[key + "_scale"] = torch.zeros(sum(blocks))
    if amsgrad:
        buffers["max_exp_avg_sq"] = torch.zeros(total, dtype=sd)
        if "exp_avg_sq_scale" in buffers:
            buffers["max_exp_avg_sq_scale"] = torch.zeros(sum(blocks))
    table = torch.zeros(len(SIZES), ops.ROW_WIDTH, dtype=torch.int64)
    table[:, ops.ROW_NUMEL] = torch.tensor(SIZES)
    table[1:, ops.ROW_OFFSET] = torch.tensor(SIZES).cumsum(0)[:-1]
    table[1:, ops.ROW_SCALE_OFFSET] = torch.tensor(blocks).cumsum(0)[:-1]
    table[:, ops.ROW_STREAM] = torch.arange(len(SIZES)) * 3 + 1
    table[:, ops.ROW_STEP] = 1
    table[:, ops.ROW_ELEMENT_OFFSET] = torch.arange(len(SIZES)) * 1000  # slices of wholes
    identify(table, params)
    return params, grads, buffers, table, amsgrad


def identify(table, params):
    """The columns that name each row's param: its shape key and data address."""
    table[:, ops.ROW_SHAPE_KEY] = torch.tensor([ops.shape_key(p.shape) for p in params],
                                               dtype=torch.int64)
    table[:, ops.ROW_DATA] = torch.tensor([ops.data_address(p) for p in params],
                                          dtype=torch.int64)


def views(buffers, table):
    """The state as adam_step_'s lists: each row's range of each buffer."""
    lists = {}
    for name, buf in buffers.items():
        col = ops.ROW_SCALE_OFFSET if name.endswith("_scale") else ops.ROW_OFFSET
        lists[name] = [buf[int(r[col]):int(r[col]) + (ops.scale_count(int(r[ops.ROW_NUMEL]))
                                                      if name.endswith("_scale")
                                                      else int(r[ops.ROW_NUMEL]))]
                       for r in table]
    return lists


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flat_buffers_give_the_bits_of_the_lists(name):
    params, grads, buffers, table, amsgrad = flat_problem(name)
    twin_params = [p.clone() for p in params]
    twin = {k: b.clone() for k, b in buffers.items()}
    lists = views(twin, table)
    for step in (1, 2, 3):
        table[:, ops.ROW_STEP] = step
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, amsgrad=amsgrad)
        ops.adam_step_(twin_params, grads, lists.get("master", []), lists["exp_avg"],
                       lists["exp_avg_sq"], lists.get("exp_avg_scale", []),
                       lists.get("exp_avg_sq_scale", []), [step] * len(SIZES), **HYPER,
                       amsgrad=amsgrad, max_exp_avg_sqs=lists.get("max_exp_avg_sq", []),
                       max_exp_avg_sq_scales=lists.get("max_exp_avg_sq_scale", []),
                       streams=table[:, ops.ROW_STREAM].tolist(),
                       element_offsets=table[:, ops.ROW_ELEMENT_OFFSET].tolist())
    for a, b in zip(params, twin_params):
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b)
    for key in buffers:
        assert torch.equal(buffers[key].view(torch.uint8), twin[key].view(torch.uint8)), key
    assert any(bool(p.ne(q).any()) for p, q in zip(params, flat_problem(name)[0]))  # moved


def table_is_valid(table, params, buffers):
    """The op's contract for a table, checked independently of the glue."""
    spans = {}
    for i, row in enumerate(table.tolist()):
        offset, scale_offset, numel, _, step, element_offset, shape, address = row
        if numel != params[i].numel() or (numel > 0 and step < 1) or element_offset < 0 or \
                shape != ops.shape_key(params[i].shape) or \
                address not in (0, ops.data_address(params[i])):
            return False
        for name, buf in buffers.items():
            scaled = name.endswith("_scale")
            first, count = (scale_offset, ops.scale_count(numel) if numel >= 0 else -1) \
                if scaled else (offset, numel)
            if first < 0 or count < 0 or first + count > buf.numel():
                return False
            if count:
                spans.setdefault(name, []).append((first, first + count))
    for ranges in spans.values():
        ranges.sort()
        if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            return False  # two rows share memory
    return True


def test_malformed_tables_are_refused_and_write_nothing():
    """2,000 tables, each a valid one with one to three values replaced by edge values
    (negative, past the end, near 2^63, another row's offset): the op steps exactly
    when the table is valid, and otherwise raises and leaves every buffer as it was."""
    rng = random.Random(11)
    params, grads, buffers, good, _ = flat_problem("fp8_remainders")
    total, blocks = buffers["exp_avg"].numel(), buffers["exp_avg_scale"].numel()
    edges = [-1, -(1 << 63), (1 << 63) - 1, (1 << 62), total, total + 1, blocks, blocks - 1, 0,
             1, 127, 128]
    refused = 0
    for _ in range(2000):
        table = good.clone()
        for _ in range(rng.randint(1, 3)):
            row, col = rng.randrange(len(SIZES)), rng.randrange(ops.ROW_WIDTH)
            value = rng.choice(edges + [int(good[rng.randrange(len(SIZES)), col])])
            table[row, col] = value
        before = [t.clone() for t in list(buffers.values()) + params]
        valid = table_is_valid(table, params, buffers)
        try:
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER)
        except RuntimeError as e:
            assert not valid, (table.tolist(), str(e))
            assert str(e).startswith("precis.adam_step_flat_"), str(e)
            after = list(buffers.values()) + params
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(before, after) if a.numel())
            refused += 1
        else:
            assert valid, table.tolist()
    assert 500 < refused < 2000  # both kinds were drawn


def test_bad_table_tensors_are_named():
    params, grads, buffers, table, _ = flat_problem("bf16_default")
    for bad, match in ((table.float(), "table must be a contiguous int64 CPU tensor"),
                       (table[:-1], "table must be"),
                       (table.t().contiguous().t(), "not contiguous")):
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, bad, **HYPER)
    short = dict(buffers, exp_avg=buffers["exp_avg"][:-1])
    with pytest.raises(RuntimeError, match="lie outside exp_avg"):
        ops.adam_step_flat_(params, grads, short, table, **HYPER)
    # An amsgrad buffer without amsgrad is refused, not ignored.
    with pytest.raises(RuntimeError, match="max_exp_avg_sq must be an empty tensor when "
                                           "amsgrad is False"):
        ops.adam_step_flat_(params, grads, dict(buffers, max_exp_avg_sq=torch.zeros(3)), table,
                            **HYPER)
    # A refusal in adam_step_'s words says how they map to the table's rows (the rows'
    # overlap is named in the first element buffer present: masters here).
    overlapping = table.clone()
    overlapping[1, ops.ROW_OFFSET] = 0
    shared = r"(masters|exp_avgs|exp_avg_sqs)\[0\] and \1\[1\] share memory"
    with pytest.raises(RuntimeError, match=shared + r".*entry \[i\] is table row i"):
        ops.adam_step_flat_(params, grads, buffers, overlapping, **HYPER)


@pytest.mark.parametrize("name", ["bf16_default", "fp8_remainders"])
def test_element_offset_column_gives_the_bits_of_the_whole(name):
    """A param stepped in pieces, one table row each with its element offset (pieces
    of 128-element blocks), gets the bits of the whole param stepped as one row; with
    the offsets left at 0 the stochastic rounding differs."""
    pd, md, ed, sd, _ = LAYOUTS[name]
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(4097, generator=g).to(pd)
    grad = torch.randn(4097, generator=g).to(pd)
    cuts = [0, 1024, 1152, 4096, 4097]
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]

    def problem(rows):
        buffers = {"exp_avg": torch.zeros(4097, dtype=ed),
                   "exp_avg_sq": torch.zeros(4097, dtype=sd),
                   "master": torch.zeros(4097, dtype=md)}
        if ed in ops.SCALED_MOMENT_DTYPES:
            blocks = sum(ops.scale_count(n) for n in rows)
            buffers["exp_avg_scale"], buffers["exp_avg_sq_scale"] = torch.zeros(blocks), \
                torch.zeros(blocks)
        if md == F32:
            buffers["master"] = whole.float()
        table = torch.zeros(len(rows), ops.ROW_WIDTH, dtype=torch.int64)
        table[:, ops.ROW_NUMEL] = torch.tensor(rows)
        table[1:, ops.ROW_OFFSET] = torch.tensor(rows).cumsum(0)[:-1]
        table[1:, ops.ROW_SCALE_OFFSET] = torch.tensor(
            [ops.scale_count(n) for n in rows]).cumsum(0)[:-1]
        table[:, ops.ROW_STREAM] = 9  # the same param
        return buffers, table

    def run(rows, offsets):
        buffers, table = problem(rows)
        params = list(whole.clone().split(rows))
        grads = list(grad.split(rows))
        table[:, ops.ROW_ELEMENT_OFFSET] = torch.tensor(offsets)
        identify(table, params)
        for step in (1, 2, 3):
            table[:, ops.ROW_STEP] = step
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER)
        return torch.cat(params), buffers["exp_avg_sq"]

    want = run([4097], [0])
    got = run(sizes, cuts[:-1])
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    unkeyed = run(sizes, [0] * len(sizes))
    assert not torch.equal(unkeyed[0].view(torch.int16), want[0].view(torch.int16))


def test_a_param_of_another_shape_dtype_or_address_than_its_row_is_refused():
    """The table's shape key is its param's (ops.shape_key, flat_table.h's pr_shape_key:
    0-dim, 1-, 2- and 3-dim shapes accepted) and so is its data address; a param given
    another shape of its size, a dtype unlike params[0]'s (one call steps one layout),
    or other memory of its shape and dtype (a copy: `p.data = ...`) is refused with
    nothing written."""
    shapes = [(), (4, 3), (2, 3, 5), (7,)]
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    numels = [p.numel() for p in params]
    buffers = {"exp_avg": torch.zeros(sum(numels)), "exp_avg_sq": torch.zeros(sum(numels))}
    table = torch.zeros(len(shapes), ops.ROW_WIDTH, dtype=torch.int64)
    table[:, ops.ROW_NUMEL] = torch.tensor(numels)
    table[1:, ops.ROW_OFFSET] = torch.tensor(numels).cumsum(0)[:-1]
    table[:, ops.ROW_STEP] = 1
    identify(table, params)
    assert len(set(table[:, ops.ROW_SHAPE_KEY].tolist())) == len(shapes)
    for bad, message in ((params[:1] + [params[1].reshape(3, 4)] + params[2:],
                          r"params\[1\] has shape \(3, 4\), not that of the param table "
                          r"row 1 was made for"),
                         (params[:2] + [params[2].double()] + params[3:],
                          r"params\[2\] has dtype float64, params\[0\] float32"),
                         (params[:3] + [params[3].bfloat16()],
                          r"params\[3\] has dtype bfloat16, params\[0\] float32"),
                         (params[:1] + [params[1].clone()] + params[2:],
                          r"params\[1\] lies at another address than the one table row 1 "
                          r"was made for")):
        before = [t.clone() for t in list(buffers.values()) + bad]
        with pytest.raises(RuntimeError, match=message):
            ops.adam_step_flat_(bad, grads, buffers, table, **HYPER)
        assert all(torch.equal(a, b) for a, b in zip(before, list(buffers.values()) + bad))
    ops.adam_step_flat_(params, grads, buffers, table, **HYPER)  # the params it was made for
    assert buffers["exp_avg"].count_nonzero() == sum(numels)
    anywhere = table.clone()
    anywhere[1, ops.ROW_DATA] = 0  # a row that names no address takes its param anywhere
    moved = params[:1] + [params[1].clone()] + params[2:]
    ops.adam_step_flat_(moved, grads, buffers, anywhere, **{**HYPER, "lr": 0.0})


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
def test_fingerprints_are_those_of_the_written_params(name, rule):
    """fingerprints: after each step, entry i is precis.fingerprints.of([params[i]]) (as
    an int64) for every param, an empty one's 0; a skipped step (found_inf given set, or
    a non-finite gradient with check_finite) fills it with the params as they are, as the
    CUDA kernels do (a caller that reads the verdict later keeps it either way); a
    refused call leaves it as it was."""
    params, grads, buffers, table, amsgrad = flat_problem(name)
    if rule != "adam":
        buffers = {k: v for k, v in buffers.items() if not k.startswith(("exp_avg_sq", "max_"))}
        amsgrad = False
    out = torch.full((len(params),), 77, dtype=torch.int64)
    for step in (1, 2):
        table[:, ops.ROW_STEP] = step
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, amsgrad=amsgrad, rule=rule,
                            momentum=0.9, fingerprints=out)
        want = [f - (1 << 64) if f >> 63 else f for f in precis.fingerprints.of(params)]
        assert out.tolist() == want
        assert want[SIZES.index(0)] == 0 and len(set(want)) == len(want)
    before = out.clone()
    stepped = [t.clone() for t in params]
    bad = [g.clone() for g in grads]
    bad[SIZES.index(max(SIZES))][-1] = float("nan")
    for skip in (dict(found_inf=torch.ones(1)), dict(check_finite=True, grads=bad)):
        out.fill_(77)
        ops.adam_step_flat_(params, skip.pop("grads", grads), buffers, table, **HYPER,
                            amsgrad=amsgrad, rule=rule, momentum=0.9, fingerprints=out, **skip)
        assert all(torch.equal(a, b) for a, b in zip(params, stepped))  # nothing written
        assert torch.equal(out, before), skip  # the params as they are
    with pytest.raises(RuntimeError, match="lie outside exp_avg"):
        ops.adam_step_flat_(params, grads, dict(buffers, exp_avg=buffers["exp_avg"][:-1]), table,
                            **HYPER, amsgrad=amsgrad, rule=rule, momentum=0.9, fingerprints=out)
    assert torch.equal(out, before)


def test_bad_fingerprints_tensors_are_named_and_nothing_is_written():
    params, grads, buffers, table, _ = flat_problem("fp8_remainders")
    n = len(params)
    before = [t.clone() for t in list(buffers.values()) + params]
    bad = [(torch.zeros(n), "fingerprints must be a contiguous int64 CPU tensor of 5 values"),
           (torch.zeros(n + 1, dtype=torch.int64), "got 6 int64 values"),
           (torch.zeros(2 * n, dtype=torch.int64)[::2], "not contiguous"),
           # the tensor shares memory with what the step writes (the master buffer)
           (buffers["master"][:4 * n].view(torch.int64), "share memory")]
    for out, match in bad:
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out)
    after = list(buffers.values()) + params
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, after) if a.numel())


def test_the_list_op_writes_fingerprints_too_empty_params_included():
    """adam_step_ takes fingerprints as adam_step_flat_ does: entry i is params[i]'s after
    the step, an empty param's 0, also in a call of empty params only (no C call at all)."""
    params, grads, buffers, table, _ = flat_problem("bf16_default")
    lists = views(buffers, table)
    out = torch.full((len(params),), 77, dtype=torch.int64)
    ops.adam_step_(params, grads, lists["master"], lists["exp_avg"], lists["exp_avg_sq"], [],
                   [], [1] * len(params), **HYPER, fingerprints=out)
    assert out.tolist() == [f - (1 << 64) if f >> 63 else f
                            for f in precis.fingerprints.of(params)]
    empty = [torch.zeros(0, dtype=BF16) for _ in range(3)]
    out = torch.full((3,), 77, dtype=torch.int64)
    ops.adam_step_(empty, [e.clone() for e in empty], [torch.zeros(0)] * 3,
                   [torch.zeros(0, dtype=BF16) for _ in range(3)],
                   [torch.zeros(0, dtype=BF16) for _ in range(3)], [], [], [1] * 3, **HYPER,
                   fingerprints=out)
    assert out.tolist() == [0, 0, 0]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
GROUPS = {"runs": [0, 0, 1, 1, 1],  # each row's group: a run each (two param groups' rows)
          "interleaved": [0, 1, 0, 1, 1]}
GROUP_HYPER = [(1e-2, 0.1), (3e-3, 0.0)]  # each group's (lr, weight decay)


def on(device, tensors):
    return [t.to(device) for t in tensors]


def rule_problem(name, rule, device):
    """flat_problem's on device, for rule: the buffers it reads (sgd and lion no exp_avg_sq,
    no amsgrad)."""
    params, grads, buffers, table, amsgrad = flat_problem(name)
    if rule != "adam":
        buffers = {k: v for k, v in buffers.items() if not k.startswith(("exp_avg_sq", "max_"))}
        amsgrad = False
    params, grads = on(device, params), on(device, grads)
    buffers = {k: v.to(device) for k, v in buffers.items()}
    identify(table, params)
    return params, grads, buffers, table, amsgrad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", list(GROUPS))
@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rows_lr_and_weight_decay_give_the_bits_of_a_call_per_group(name, rule, rows,
                                                                         device):
    """lrs and weight_decays (one a row) step each row as a call of its group's lr and
    weight decay alone would, bit for bit: params, every buffer and the fingerprints,
    over three steps, rows of a group in a run or interleaved with the other's."""
    params, grads, buffers, table, amsgrad = rule_problem(name, rule, device)
    twin_params = [p.clone() for p in params]
    twin = {k: b.clone() for k, b in buffers.items()}
    twin_table = table.clone()
    identify(twin_table, twin_params)
    group_of = GROUPS[rows]
    common = dict(beta1=0.9, beta2=0.999, eps=1e-8, seed=5, amsgrad=amsgrad, rule=rule,
                  momentum=0.9)
    out = torch.zeros(len(params), dtype=torch.int64, device=device)
    twin_out = torch.zeros(len(params), dtype=torch.int64, device=device)
    for step in (1, 2, 3):
        table[:, ops.ROW_STEP] = twin_table[:, ops.ROW_STEP] = step
        ops.adam_step_flat_(params, grads, buffers, table, lr=0.5, weight_decay=0.5,
                            lrs=[GROUP_HYPER[g][0] for g in group_of],
                            weight_decays=[GROUP_HYPER[g][1] for g in group_of],
                            fingerprints=out, **common)
        for g, (lr, wd) in enumerate(GROUP_HYPER):
            mine = [i for i, h in enumerate(group_of) if h == g]
            part_out = torch.zeros(len(mine), dtype=torch.int64, device=device)
            ops.adam_step_flat_([twin_params[i] for i in mine], [grads[i] for i in mine], twin,
                                twin_table[mine].contiguous(), lr=lr, weight_decay=wd,
                                fingerprints=part_out, **common)
            twin_out[mine] = part_out
        assert torch.equal(out, twin_out), step
    for a, b in zip(params, twin_params):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for key in buffers:
        assert torch.equal(buffers[key].view(torch.uint8), twin[key].view(torch.uint8)), key
    assert not torch.equal(params[0], flat_problem(name)[0][0].to(device))  # moved


@pytest.mark.parametrize("device", DEVICES)
def test_a_nonfinite_grad_in_one_group_skips_every_rows_step(device):
    """check_finite over rows of several lrs (several C calls): a NaN in one group's grad
    skips the step of every row, the other group's too (the flag set, nothing written)."""
    params, grads, buffers, table, _ = flat_problem("bf16_default")
    params, grads = on(device, params), on(device, grads)
    buffers = {k: v.to(device) for k, v in buffers.items()}
    identify(table, params)
    grads[3][5] = float("nan")
    before = [t.clone() for t in list(buffers.values()) + params]
    found = ops.adam_step_flat_(params, grads, buffers, table, lr=1e-2, check_finite=True,
                                lrs=[1e-2, 1e-2, 3e-3, 3e-3, 3e-3],
                                weight_decays=[0.1, 0.1, 0.0, 0.0, 0.0])
    assert float(found) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, list(buffers.values()) + params))


def test_bad_lrs_and_weight_decays_are_named_and_nothing_is_written():
    params, grads, buffers, table, _ = flat_problem("fp8_remainders")
    n = len(params)
    before = [t.clone() for t in list(buffers.values()) + params]
    good = [1e-3] * n
    bad = [(dict(lrs=good[:-1]), "lrs has 4 entries but params has 5"),
           (dict(weight_decays=good + [0.0]), "weight_decays has 6 entries but params has 5"),
           (dict(lrs=good[:3] + [float("nan"), 1e-3]), r"lrs\[3\] is nan; must be finite"),
           (dict(weight_decays=[0.0] * (n - 1) + [-0.1]), r"weight_decays\[4\] is -0.1"),
           (dict(lrs=good[:2] + [float("inf")] + good[3:]), r"lrs\[2\] is inf"),
           (dict(lrs=good, lr_tensor=torch.tensor(1e-3, dtype=torch.float64)),
            "lrs has 5 entries and lr_tensor is given")]
    for kwargs, match in bad:
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, table, **dict(HYPER, **kwargs))
    after = list(buffers.values()) + params
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, after) if a.numel())


def test_the_default_overload_takes_lrs_and_leaves_them_optional():
    """adam_step_flat_ (the default overload) takes lrs and weight_decays too, and a call
    without them (a caller, or a saved program, from before them) is the scalars'."""
    schema = str(torch.ops.precis.adam_step_flat_.default._schema)
    assert schema.endswith("float[] lrs=[], float[] weight_decays=[]) -> ()"), schema
    lrs, wds = [1e-2, 1e-2, 3e-3, 3e-3, 3e-3], [0.1, 0.1, 0.0, 0.0, 0.0]
    results = []
    for how in ("default", "default_without", "rule"):
        params, grads, buffers, table, _ = flat_problem("bf16_default")
        flat = [buffers.get(k, torch.empty(0)) for k in ops.FLAT_BUFFERS]
        args = (params, grads, *flat, table, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, 1.0,
                False, 5, [], [], [], False, False)
        if how == "default":
            torch.ops.precis.adam_step_flat_.default(*args, lrs=lrs, weight_decays=wds)
        elif how == "default_without":  # every row the scalars' (group 0's)
            torch.ops.precis.adam_step_flat_.default(*args)
        else:
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER, lrs=lrs,
                                weight_decays=wds)
        results.append(torch.cat([p.float() for p in params]))
    assert torch.equal(results[0], results[2])
    assert torch.equal(results[0][:128], results[1][:128])  # group 0's rows alike ...
    assert not torch.equal(results[0][128:], results[1][128:])  # ... group 1's not


def written_behind(params, seed):
    """Writes into params as a load or a mask would, behind the optimizer's back: a whole
    load of params[0] and params[3] (new values), one element of params[1]; params[2]
    (empty) and params[4] left alone."""
    g = torch.Generator().manual_seed(seed)
    for i in (0, 3):
        params[i].copy_(torch.randn(params[i].shape, generator=g).to(params[i].dtype))
    params[1][7] = 3.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
@pytest.mark.parametrize("name", ["bf16_default", "fp8_remainders", "amsgrad_fp16_v"])
def test_the_calls_compare_gives_the_bits_of_the_resync_op_then_the_step(name, rule, device):
    """fingerprints [out, records, kept, sums]: the params compared with records in the
    call and those written since resynced (a whole load's master taken whole, one
    element's alone, remainders zeroed), then the step: the bits of resync_masters_ given
    the flags (fingerprints now != records) followed by the same call without them; kept
    as resync_masters_'s (a param not written: its numel); sums left zero (on CUDA the
    compare's kernel counts in it). Twice, the second time with nothing written (each
    param its numel). out holds garbage before each call: the call zeroes it (on CUDA
    the compare's kernel, the update then adding to it without a memset)."""
    params, grads, buffers, table, amsgrad = rule_problem(name, rule, device)
    kw = dict(HYPER, amsgrad=amsgrad, rule=rule, momentum=0.9)
    out = torch.zeros(len(params), dtype=torch.int64, device=device)
    ops.adam_step_flat_(params, grads, buffers, table, **kw, fingerprints=out)
    twin = ([p.clone() for p in params], {k: v.clone() for k, v in buffers.items()})
    twin_table = table.clone()
    identify(twin_table, twin[0])
    sums = torch.zeros(2 * len(params), dtype=torch.int64, device=device)
    for step, write in ((2, True), (3, False)):
        records, out = out, torch.full_like(out, -7)
        if write:
            written_behind(params, step)
            written_behind(twin[0], step)
        table[:, ops.ROW_STEP] = twin_table[:, ops.ROW_STEP] = step
        kept = torch.full_like(out, -5)
        ops.adam_step_flat_(params, grads, buffers, table, **kw, fingerprints=out,
                            resync=(records, kept, sums))
        assert not sums.any()
        stale = ops.fingerprint(twin[0]) != records
        want_kept = ops.resync_masters_(views(twin[1], twin_table)["master"], twin[0], stale)
        twin_out = torch.zeros_like(out)
        ops.adam_step_flat_(twin[0], grads, twin[1], twin_table, **kw, fingerprints=twin_out)
        assert kept.tolist() == want_kept.tolist()
        assert (kept.tolist() == list(SIZES)) == (not write)
        assert torch.equal(out, twin_out)
        for a, b in zip(params + list(buffers.values()), twin[0] + list(twin[1].values())):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
@pytest.mark.parametrize("name", ["bf16_default", "amsgrad_fp16_v"])
@pytest.mark.parametrize("record", [False, True])
def test_the_cpu_step_that_sees_writes_gives_the_bits_of_the_resync_op_then_the_step(
        name, rule, record):
    """fingerprints [out, kept] on the CPU (out empty: no record): the step itself takes
    each element written since the last step as its master (a whole load whole, one
    element alone), with no records to compare: the bits of resync_masters_ of every
    param followed by the same call without it; kept as resync_masters_'s (a param not
    written: its numel). Twice, the second time with nothing written. With a full out, the
    record too, as the call without kept writes it."""
    params, grads, buffers, table, amsgrad = rule_problem(name, rule, "cpu")
    kw = dict(HYPER, amsgrad=amsgrad, rule=rule, momentum=0.9)
    ops.adam_step_flat_(params, grads, buffers, table, **kw)
    twin = ([p.clone() for p in params], {k: v.clone() for k, v in buffers.items()})
    twin_table = table.clone()
    identify(twin_table, twin[0])
    for step, write in ((2, True), (3, False)):
        if write:
            written_behind(params, step)
            written_behind(twin[0], step)
        table[:, ops.ROW_STEP] = twin_table[:, ops.ROW_STEP] = step
        kept = torch.full((len(params),), -5, dtype=torch.int64)
        out = torch.full((len(params),), -7, dtype=torch.int64) if record else \
            torch.empty(0, dtype=torch.int64)
        ops.adam_step_flat_(params, grads, buffers, table, **kw, fingerprints=out,
                            resync=(kept,))
        stale = torch.ones(len(params), dtype=torch.bool)
        want_kept = ops.resync_masters_(views(twin[1], twin_table)["master"], twin[0], stale)
        twin_out = torch.zeros(len(params), dtype=torch.int64)
        ops.adam_step_flat_(twin[0], grads, twin[1], twin_table, **kw, fingerprints=twin_out)
        assert kept.tolist() == want_kept.tolist()
        assert (kept.tolist() == list(SIZES)) == (not write)
        if record:
            assert torch.equal(out, twin_out)
        for a, b in zip(params + list(buffers.values()), twin[0] + list(twin[1].values())):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def list_call(params, grads, lists, table, step, **kw):
    """adam_step_ (lists) over the flat state's per-row views (`lists`), at step."""
    ops.adam_step_(params, grads, lists.get("master", []), lists["exp_avg"],
                   lists.get("exp_avg_sq", []), lists.get("exp_avg_scale", []),
                   lists.get("exp_avg_sq_scale", []), [step] * len(params), **kw,
                   max_exp_avg_sqs=lists.get("max_exp_avg_sq", []),
                   max_exp_avg_sq_scales=lists.get("max_exp_avg_sq_scale", []),
                   streams=table[:, ops.ROW_STREAM].tolist(),
                   element_offsets=table[:, ops.ROW_ELEMENT_OFFSET].tolist())


@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
@pytest.mark.parametrize("name", ["bf16_default", "amsgrad_fp16_v"])
def test_the_list_ops_cpu_step_that_sees_writes_gives_the_bits_of_the_resync_op_then_the_step(
        name, rule):
    """adam_step_ (the full path's op) with fingerprints [empty, kept] on the CPU: as the
    flat op's, the bits of resync_masters_ of every param followed by the same call
    without kept, kept as resync_masters_'s; twice, the second time nothing written. A
    call the found_inf flag skips writes nothing, kept included."""
    params, grads, buffers, table, amsgrad = rule_problem(name, rule, "cpu")
    kw = dict(HYPER, amsgrad=amsgrad, rule=rule, momentum=0.9)
    twin = ([p.clone() for p in params], {k: v.clone() for k, v in buffers.items()})
    lists, twin_lists = views(buffers, table), views(twin[1], table)
    empty = torch.empty(0, dtype=torch.int64)
    list_call(params, grads, lists, table, 1, **kw)
    list_call(twin[0], grads, twin_lists, table, 1, **kw)
    for step, write in ((2, True), (3, False)):
        if write:
            written_behind(params, step)
            written_behind(twin[0], step)
        kept = torch.full((len(params),), -5, dtype=torch.int64)
        list_call(params, grads, lists, table, step, **kw, fingerprints=[empty, kept])
        stale = torch.ones(len(params), dtype=torch.bool)
        want_kept = ops.resync_masters_(twin_lists["master"], twin[0], stale)
        list_call(twin[0], grads, twin_lists, table, step, **kw)
        assert kept.tolist() == want_kept.tolist()
        assert (kept.tolist() == list(SIZES)) == (not write)
        for a, b in zip(params + list(buffers.values()), twin[0] + list(twin[1].values())):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    written_behind(params, 4)
    before = [t.clone() for t in params + list(buffers.values())]
    kept = torch.full((len(params),), -5, dtype=torch.int64)
    list_call(params, grads, lists, table, 4, **kw, fingerprints=[empty, kept],
              found_inf=torch.ones(1))
    assert kept.tolist() == [-5] * len(params)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, params + list(buffers.values())))


def test_the_cpu_steps_kept_is_checked_and_nothing_is_written():
    """fingerprints [out, kept] refused before anything is written: kept of another size
    or dtype, or in the master buffer's memory. Beside remainders or fp32 params (no
    master to take from) the step is as without, each param's kept its numel."""
    params, grads, buffers, table, _ = flat_problem("bf16_default")
    n = len(params)
    empty = torch.empty(0, dtype=torch.int64)
    before = [t.clone() for t in list(buffers.values()) + params]
    for kept, match in ((torch.zeros(n + 1, dtype=torch.int64),
                         r"fingerprints\[1\] \(kept\) must be a contiguous int64 CPU tensor "
                         r"of 5 values .* got 6 int64"),
                        (torch.zeros(n, dtype=torch.int32), r"got 5 int32 values"),
                        (buffers["master"][:2 * n].view(torch.int64), "share memory")):
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=empty,
                                resync=(kept,))
    after = list(buffers.values()) + params
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, after) if a.numel())
    for name in ("fp8_remainders", "fp32"):
        params, grads, buffers, table, _ = flat_problem(name)
        before = [t.clone() for t in list(buffers.values()) + params]
        kept = torch.full((n,), -5, dtype=torch.int64)
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=empty,
                            resync=(kept,))
        # no master to take from: every param's kept is its numel, the step as without
        assert kept.tolist() == list(SIZES), name


def test_bad_records_and_kept_are_named_and_nothing_is_written():
    """fingerprints [out, records, kept, sums] refused before anything is written (params,
    buffers, out, kept): records, kept or sums of another dtype or size, kept or sums in
    the records', each other's, the master buffer's, lr_tensor's or the table's memory,
    the three-entry form of before (no sums), a hyperparameter the C step refuses (after
    a write behind the op's back, which the compare would resync), and fp32 params (no
    master to resync)."""
    params, grads, buffers, table, _ = flat_problem("bf16_default")
    n = len(params)
    out = torch.zeros(n, dtype=torch.int64)
    ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out)
    records, spare = out.clone(), torch.zeros(2 * n, dtype=torch.int64)

    def sums():
        return torch.zeros(2 * n, dtype=torch.int64)
    kept_spare = torch.zeros(3 * n, dtype=torch.int64)
    bad = [((records.float(), torch.zeros(n, dtype=torch.int64), sums()),
            r"fingerprints\[1\] \(records\) must be a contiguous int64 tensor of 5 values"),
           ((records, torch.zeros(n + 1, dtype=torch.int64), sums()),
            r"fingerprints\[2\] \(kept\) .* got 6 int64 values"),
           ((records, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)),
            r"fingerprints\[3\] \(sums\) must be a contiguous int64 tensor of 10 values \(two "
            r"a param.* got 5 int64 values"),
           ((records, torch.zeros(n, dtype=torch.int64), sums().float()),
            r"fingerprints\[3\] \(sums\) .* got 10 float32 values"),
           ((spare[:n], spare[1:n + 1], sums()), "share memory"),
           ((records, kept_spare[:n], kept_spare[n - 1:3 * n - 1]),
            r"fingerprints\[2\] \(kept\) and fingerprints\[3\] \(sums\) share memory"),
           ((records, buffers["master"][:2 * n].view(torch.int64), sums()), "share memory"),
           ((records, torch.zeros(n, dtype=torch.int64),
             buffers["master"][:4 * n].view(torch.int64)),
            r"fingerprints\[3\] \(sums\) share memory|and fingerprints\[3\] \(sums\) share")]
    before = [t.clone() for t in list(buffers.values()) + params + [out]]
    for resync, match in bad:
        kept_before, sums_before = resync[1].clone(), resync[2].clone()
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                                resync=resync)
        assert torch.equal(resync[1].view(torch.uint8), kept_before.view(torch.uint8))
        assert torch.equal(resync[2].view(torch.uint8), sums_before.view(torch.uint8))
    with pytest.raises(RuntimeError, match=r"fingerprints\[1\] \(kept\) must be a contiguous "
                                           r"int64 CPU tensor of 5 values"):  # [out, kept]
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER,
                            resync=(records, torch.zeros(n + 1, dtype=torch.int64)))
    with pytest.raises(RuntimeError, match=r"fingerprints \[out, records, kept\] needs bf16 "
                                           r"params with remainders"):  # (the blocks' form)
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                            resync=(records, torch.zeros(n, dtype=torch.int64)))
    after = list(buffers.values()) + params + [out]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, after) if a.numel())
    # the compare's kept is written before the step reads the scalar tensors and the
    # table: it must not lie in them
    lr = torch.zeros(n, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"fingerprints\[2\] \(kept\) and lr_tensor share"):
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                            resync=(records, lr, sums()), lr_tensor=lr[:1].view(torch.float64))
    with pytest.raises(RuntimeError, match=r"fingerprints\[2\] \(kept\) and the table share"):
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                            resync=(records, table.view(-1)[:n], sums()))
    with pytest.raises(RuntimeError, match=r"fingerprints\[3\] \(sums\) and the table share"):
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                            resync=(records, torch.zeros(n, dtype=torch.int64),
                                    table.view(-1)[:2 * n]))
    # a hyperparameter the C step refuses is refused before the compare writes
    written_behind(params, 3)
    before = [t.clone() for t in list(buffers.values()) + params + [out]]
    kept = torch.full((n,), -5, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="beta1 is 1.5"):
        ops.adam_step_flat_(params, grads, buffers, table, **dict(HYPER, beta1=1.5),
                            fingerprints=out, resync=(records, kept, sums()))
    assert kept.tolist() == [-5] * n
    after = list(buffers.values()) + params + [out]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, after) if a.numel())
    params, grads, buffers, table, _ = flat_problem("fp32")
    with pytest.raises(RuntimeError, match="need params with a master or remainders"):
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                            resync=(records, torch.zeros(n, dtype=torch.int64), sums()))


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_counted_steps_give_the_bits_of_the_tables_steps_and_advance(name, rule):
    """adam_step_flat_.counted (step_counts: each row's float32 count so far) steps each row with
    its count + 1, torch's float32 `step += 1` (the table's step column unread: it holds
    0 here), as .rule does with those numbers in the table, and adds 1 to each count once
    it has run; a count at 2^24 stays there, as torch's float32 step does."""
    params, grads, buffers, table, amsgrad = flat_problem(name)
    if rule != "adam":
        buffers = {k: v for k, v in buffers.items() if not k.startswith(("exp_avg_sq", "max_"))}
        amsgrad = False
    twin_params = [p.clone() for p in params]
    twin = {k: b.clone() for k, b in buffers.items()}
    twin_table = table.clone()
    identify(twin_table, twin_params)
    counts = torch.tensor([0.0, 6.0, 2.0 ** 24 - 1, 2.0 ** 24, 41.0])
    hyper = dict(HYPER, amsgrad=amsgrad, rule=rule, momentum=0.9)
    table[:, ops.ROW_STEP] = 0
    for _ in range(3):
        twin_table[:, ops.ROW_STEP] = (counts + 1.0).long()  # (float32, as torch adds)
        before = counts.clone()
        ops.adam_step_flat_(params, grads, buffers, table, **hyper, step_counts=counts)
        ops.adam_step_flat_(twin_params, grads, twin, twin_table, **hyper)
        assert torch.equal(counts, before + 1.0)  # (float32: 2^24 + 1 is 2^24)
    assert counts.tolist() == [3.0, 9.0, 2.0 ** 24, 2.0 ** 24, 44.0]
    for a, b in zip(params, twin_params):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for key in buffers:
        assert torch.equal(buffers[key].view(torch.uint8), twin[key].view(torch.uint8)), key
    assert any(bool(p.ne(q).any()) for p, q in zip(params, flat_problem(name)[0]))  # moved
    schema = str(torch.ops.precis.adam_step_flat_.counted._schema)
    assert "Tensor(j!)[] fingerprints, Tensor(k!)[] step_counts, float[] lrs=[]" in schema, schema


def test_bad_steps_are_named_and_nothing_is_written():
    """.counted refuses, before anything is written (params, state, counts): step_counts of
    another dtype, length or layout, a count that is not a number in [0, 2^63), step_counts
    sharing memory with a tensor of the call (they are written after the step), good
    steps in a call refused for another argument (not advanced), and steps with
    found_inf or check_finite (whose step the caller counts once it reads the flag)."""
    params, grads, buffers, table, _ = flat_problem("bf16_default")
    n = len(params)
    good = torch.full((n,), 3.0)
    nan = good.clone()
    nan[2] = float("nan")
    bad = [(dict(step_counts=good.double()), r"step_counts must be one contiguous float32 CPU tensor of 5 "
                                       r"counts \(one a table row\), got 5 float64 values "
                                       r"on cpu$"),
           (dict(step_counts=good[:-1]), "got 4 float32 values on cpu"),
           (dict(step_counts=torch.full((2 * n,), 3.0)[::2]), "got 5 float32 values on cpu, not "
                                                         "contiguous"),
           (dict(step_counts=nan), r"step_counts\[2\] is nan; must be a count in \[0, 2\^63\)"),
           (dict(step_counts=torch.tensor([3.0, 3.0, 3.0, -1.0, 3.0])), r"step_counts\[3\] is -1"),
           (dict(step_counts=torch.tensor([3.0, 2.0 ** 63, 3.0, 3.0, 3.0])), r"step_counts\[1\] is 9\.2"),
           (dict(step_counts=torch.tensor([3.0, 3.0, float("inf"), 3.0, 3.0])), r"step_counts\[2\] is inf"),
           (dict(step_counts=buffers["master"][2:2 + n].fill_(3.0)), "the buffer of masters and "
                                                                "step_counts share memory"),
           (dict(step_counts=table.view(torch.float32)[0, :n]), "step_counts and the table share memory"),
           (dict(step_counts=good, lrs=[1e-3] * (n - 1)), "lrs has 4 entries but params has 5"),
           (dict(step_counts=good, found_inf=torch.zeros(1)), "step_counts cannot be given with found_inf"),
           (dict(step_counts=good, check_finite=True), "step_counts cannot be given with found_inf or "
                                                 "check_finite")]
    for kwargs, match in bad:
        kept = kwargs["step_counts"].clone()
        before = [t.clone() for t in list(buffers.values()) + params]
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, table, **dict(HYPER, **kwargs))
        after = list(buffers.values()) + params
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(before, after) if a.numel())
        assert torch.equal(kwargs["step_counts"].view(torch.int32), kept.view(torch.int32))
    fp32 = flat_problem("fp32")  # (a param's own floats as the counts)
    fp32[0][3][:n] = 3.0
    with pytest.raises(RuntimeError, match=r"params\[3\] and step_counts share memory"):
        ops.adam_step_flat_(*fp32[:4], **HYPER, step_counts=fp32[0][3][:n])
    assert fp32[0][3][:n].tolist() == [3.0] * n
    flat = [buffers.get(k, torch.empty(0)) for k in ops.FLAT_BUFFERS]
    with pytest.raises(RuntimeError, match=r"step_counts must be one contiguous .*got 0 tensors"):
        torch.ops.precis.adam_step_flat_.counted(
            params, grads, *flat, table, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, 1.0,
            False, 5, [], [], [], False, False, 0, 0.0, 0.0, False, [], [])


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
def test_the_hyper_overloads_carry_a_rules_own_hyperparameters(rule, counted):
    """adam_step_.hyper and adam_step_flat_.hyper (.rule / .counted with rule_hyper: a
    rule's own hyperparameters, precis_step_config_t.rule_hyper, so that a rule with new
    ones needs no new overload): zeros give .rule's bits (and .counted's counts); an entry
    a rule does not take is refused by the C step naming it, more than 4 by the op, and
    nothing is written."""
    name = list(LAYOUTS)[0]
    params, grads, buffers, table, amsgrad = rule_problem(name, rule, "cpu")
    twin_params = [p.clone() for p in params]
    twin = {k: b.clone() for k, b in buffers.items()}
    twin_table = table.clone()
    identify(twin_table, twin_params)
    hyper = dict(HYPER, amsgrad=amsgrad, rule=rule, momentum=0.9)
    counts = torch.tensor([0.0, 6.0, 2.0, 9.0, 41.0]) if counted else None
    twin_counts = counts.clone() if counted else None
    for _ in range(2):
        ops.adam_step_flat_(params, grads, buffers, table, **hyper, step_counts=counts,
                            rule_hyper=(0.0, 0.0))
        ops.adam_step_flat_(twin_params, grads, twin, twin_table, **hyper,
                            step_counts=twin_counts)
    for a, b in zip(params, twin_params):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for key in buffers:
        assert torch.equal(buffers[key].view(torch.uint8), twin[key].view(torch.uint8)), key
    if counted:
        assert torch.equal(counts, twin_counts) and counts.tolist()[0] == 2.0
    assert any(bool(p.ne(q).any()) for p, q in zip(params, rule_problem(name, rule, "cpu")[0]))
    before = ([p.clone() for p in params], {k: b.clone() for k, b in buffers.items()})
    for given, message in [((0.0, 0.25), f"cfg->rule_hyper[1] is 0.25; rule {rule} takes 0"),
                           ((0.0,) * 5, "rule_hyper has 5 entries; a rule takes at most 4")]:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.adam_step_flat_(params, grads, buffers, table, **hyper, step_counts=counts,
                                rule_hyper=given)
    for a, b in zip(params, before[0]):
        assert torch.equal(a, b)
    for key in buffers:
        assert torch.equal(buffers[key], before[1][key]), key
    # the list op: the same
    p, g, m = torch.zeros(3), torch.ones(3), torch.zeros(3)
    v = [torch.zeros(3)] if rule == "adam" else []
    ops.adam_step_([p], [g], [], [m], v, [], [], [1], 1e-3, rule=rule, momentum=0.9,
                   rule_hyper=[0.0])
    q = torch.zeros(3)
    ops.adam_step_([q], [g], [], [torch.zeros(3)], [torch.zeros(3)] if v else [], [], [], [1],
                   1e-3, rule=rule, momentum=0.9)
    assert torch.equal(p, q) and bool(p.ne(0).all())
    with pytest.raises(RuntimeError, match=re.escape(f"cfg->rule_hyper[0] is 1; rule {rule}")):
        ops.adam_step_([p], [g], [], [m], v, [], [], [1], 1e-3, rule=rule, momentum=0.9,
                       rule_hyper=[1.0])
    assert torch.equal(p, q)
    assert "float[] rule_hyper" in str(torch.ops.precis.adam_step_.hyper._schema)
    assert "Tensor(k!)[] step_counts, float[] rule_hyper, float[] lrs=[]" in str(
        torch.ops.precis.adam_step_flat_.hyper._schema)


def test_op_calls_from_threads_give_each_its_bits_and_free_their_tensors():
    """Op calls on four Python threads at once (each its own optimizer: the glue takes the
    GIL once per call to let go of its tensors, pr_python_hold) give the bits of the
    same steps taken one after another, and hold no tensor after the call (weakrefs)."""
    import threading
    import weakref

    def problem(seed):
        g = torch.Generator().manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(BF16)) for n in (1, 127, 4097)]
        return ps, precis.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)

    def run(ps, opt, seed):
        g = torch.Generator().manual_seed(100 + seed)
        for _ in range(12):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(BF16)
            opt.step()

    alone = [problem(seed) for seed in range(4)]
    for seed, (ps, opt) in enumerate(alone):
        run(ps, opt, seed)
    together = [problem(seed) for seed in range(4)]
    threads = [threading.Thread(target=run, args=(ps, opt, seed))
               for seed, (ps, opt) in enumerate(together)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (ps, _), (qs, _) in zip(alone, together):
        assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(ps, qs))
    gone = [weakref.ref(p.grad) for ps, _ in together for p in ps]
    for ps, opt in together:
        opt.zero_grad(set_to_none=True)
    assert all(ref() is None for ref in gone)


def blocks_problem(remainder, device, sizes):
    """bf16 params of `sizes` with int16 or uint8 remainders and fp8 moments, flat, on
    device; rows 0-1 one group's, the rest another's (two lrs: two C calls)."""
    params, grads, buffers, table, _ = rule_problem("fp8_remainders", "adam", device)
    g = torch.Generator().manual_seed(9)
    params = [torch.randn(n, generator=g).to(BF16).to(device) for n in sizes]
    grads = [torch.randn(n, generator=g).to(BF16).to(device) for n in sizes]
    total = sum(sizes)
    scales = [ops.scale_count(n) for n in sizes]
    buffers = {"master": torch.zeros(total, dtype=remainder, device=device),
               "exp_avg": torch.zeros(total, dtype=FP8, device=device),
               "exp_avg_sq": torch.zeros(total, dtype=FP8, device=device),
               "exp_avg_scale": torch.zeros(sum(scales), device=device),
               "exp_avg_sq_scale": torch.zeros(sum(scales), device=device)}
    table = torch.zeros(len(sizes), ops.ROW_WIDTH, dtype=torch.int64)
    table[:, ops.ROW_NUMEL] = torch.tensor(sizes)
    table[1:, ops.ROW_OFFSET] = torch.tensor(sizes).cumsum(0)[:-1]
    table[1:, ops.ROW_SCALE_OFFSET] = torch.tensor(scales).cumsum(0)[:-1]
    table[:, ops.ROW_STREAM] = torch.arange(len(sizes)) + 1
    table[:, ops.ROW_STEP] = 1
    identify(table, params)
    lrs = dict(lrs=[1e-2, 1e-2] + [3e-3] * (len(sizes) - 2),
               weight_decays=[0.1, 0.1] + [0.0] * (len(sizes) - 2))
    return params, grads, buffers, table, lrs


def blocks_by_hand(params, buffers, table, records):
    """What a resync of the blocks written since `records` (an op's out: an entry a param,
    then their blocks) does, by the ops of before: each block's fingerprint now against
    its record, resync_masters_.blocks of those that differ. Returns each param's kept
    (its elements in the blocks that matched)."""
    from precis import fingerprints
    n = len(params)
    stale = (ops.fingerprint_blocks(params, fingerprints.BLOCK * 2) != records[n:])
    kept = torch.zeros_like(records[n:])
    ops.resync_masters_blocks_(views(buffers, table)["master"], params, stale.view(torch.uint8),
                               kept, fingerprints.BLOCK)
    counts = [fingerprints.block_count(p.numel()) for p in params]
    return [int(k.sum()) for k in kept.cpu().split(counts)]


def same_bits(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", ["runs", "interleaved"])
@pytest.mark.parametrize("remainder", [torch.int16, torch.uint8])
def test_the_blocks_compare_gives_the_bits_of_the_resync_blocks_op_then_the_step(remainder,
                                                                                 rows, device):
    """fingerprints [out, records, kept] (params with remainders, out with their blocks):
    each block compared with records' before it is stepped and those written since have
    their remainders zeroed: the bits (params, every buffer, out) of the ops of before
    (fingerprint.blocks against the records, resync_masters_.blocks of those that differ)
    then the same call without the compare; kept each param's elements in the blocks that
    matched. Over two groups' lrs (two C calls), their rows in runs or interleaved (a
    group's rows then several runs: on a GPU the update kernels take each run's records),
    at 1, 127, a block and 5, three blocks and 1, 300 elements; a step with nothing
    written keeps every param's numel."""
    from precis import fingerprints
    block = fingerprints.BLOCK
    sizes = [1, 127, block + 5, 3 * block + 1, 300]
    params, grads, buffers, table, lrs = blocks_problem(remainder, device, sizes)
    if rows == "interleaved":
        lrs = dict(lrs=[1e-2, 3e-3, 1e-2, 3e-3, 1e-2], weight_decays=[0.1, 0.0, 0.1, 0.0, 0.1])
    n, entries = len(sizes), len(sizes) + sum(map(fingerprints.block_count, sizes))
    out = torch.zeros(entries, dtype=torch.int64, device=device)
    ops.adam_step_flat_(params, grads, buffers, table, **HYPER, **lrs, fingerprints=out)
    twin = [p.clone() for p in params], {k: v.clone() for k, v in buffers.items()}
    twin_table = table.clone()
    identify(twin_table, twin[0])
    for step, write in ((2, True), (3, False)):
        records, out = out, torch.full_like(out, -7)
        if write:
            for ps in (params, twin[0]):
                ps[1][100] += 1.0
                ps[3][block + 17:block + 40] *= 0.5
                ps[3][-1] = 2.0  # (the last block: one element)
        table[:, ops.ROW_STEP] = twin_table[:, ops.ROW_STEP] = step
        kept = torch.full((n,), -5, dtype=torch.int64, device=device)
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, **lrs, fingerprints=out,
                            resync=(records, kept))
        want_kept = blocks_by_hand(twin[0], twin[1], twin_table, records)
        twin_out = torch.zeros_like(out)
        ops.adam_step_flat_(twin[0], grads, twin[1], twin_table, **HYPER, **lrs,
                            fingerprints=twin_out)
        assert kept.tolist() == want_kept
        assert (want_kept == sizes) == (not write)
        if write:
            assert want_kept == [1, 0, block + 5, 3 * block + 1 - block - 1, 300]
        assert torch.equal(out, twin_out)
        assert same_bits(params + list(buffers.values()), twin[0] + list(twin[1].values()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("remainder", [torch.int16, torch.uint8])
def test_the_list_op_compares_the_blocks_as_the_flat_op(remainder, device):
    """adam_step_'s fingerprints [out, records, kept] (a released param's kept call): the
    bits, out and kept of adam_step_flat_'s over the same params and state (one lr: one C
    call), a param at a time as a release calls it and all together, at 1, 127, a block
    and 5, three blocks and 1 elements, with writes in some blocks since the records."""
    from precis import fingerprints
    block = fingerprints.BLOCK
    sizes = [1, 127, block + 5, 3 * block + 1]
    params, grads, buffers, table, _ = blocks_problem(remainder, device, sizes)
    n, entries = len(sizes), len(sizes) + sum(map(fingerprints.block_count, sizes))
    records = torch.zeros(entries, dtype=torch.int64, device=device)
    ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=records)
    params[1][100] += 1.0  # (written since the records)
    params[3][block + 17:block + 40] *= 0.5
    counts = [fingerprints.block_count(k) for k in sizes]
    for together in (True, False):
        flat = [p.clone() for p in params], {k: v.clone() for k, v in buffers.items()}
        flat_table = table.clone()
        identify(flat_table, flat[0])
        flat_table[:, ops.ROW_STEP] = 2
        out, kept = torch.zeros_like(records), torch.zeros(n, dtype=torch.int64, device=device)
        ops.adam_step_flat_(flat[0], grads, flat[1], flat_table, **HYPER, fingerprints=out,
                            resync=(records, kept))
        ps, state = [p.clone() for p in params], {k: v.clone() for k, v in buffers.items()}
        lists = views(state, table)
        args = [ps, grads, lists["master"], lists["exp_avg"], lists["exp_avg_sq"],
                lists["exp_avg_scale"], lists["exp_avg_sq_scale"]]
        streams = table[:, ops.ROW_STREAM].tolist()
        rows = [list(range(n))] if together else [[i] for i in range(n)]
        outs, kepts = [], []
        for row in rows:  # each call's out: its params' entries, then their blocks
            first = [sum(counts[:i]) for i in row]
            row_records = torch.cat([records[row]] + [records[n + f:n + f + counts[i]]
                                                      for i, f in zip(row, first)])
            row_out = torch.full_like(row_records, -7)
            row_kept = torch.full((len(row),), -5, dtype=torch.int64, device=device)
            ops.adam_step_(*[[a[i] for i in row] for a in args], [2] * len(row), **HYPER,
                           streams=[streams[i] for i in row],
                           fingerprints=[row_out, row_records, row_kept])
            outs.append(row_out)
            kepts += row_kept.tolist()
        heads = torch.cat([o[:len(row)] for o, row in zip(outs, rows)])
        tails = torch.cat([o[len(row):] for o, row in zip(outs, rows)])
        assert kepts == kept.tolist() and kepts[1] == 0 and kepts[0] == 1, together
        assert torch.equal(torch.cat([heads, tails]), out), together
        assert same_bits(ps + list(state.values()), flat[0] + list(flat[1].values())), together


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["found_inf given", "a NaN in one of two calls"])
def test_a_skipped_step_still_resyncs_the_written_blocks(how, device):
    """A step skipped before its C calls (found_inf given set, or check_finite finding a
    NaN in one group of two lrs: all or nothing) still resyncs the written blocks, as the
    resync before it did, counts kept and records the params as found; nothing else
    written."""
    from precis import fingerprints
    block = fingerprints.BLOCK
    sizes = [127, 2 * block + 3, 300]
    params, grads, buffers, table, lrs = blocks_problem(torch.uint8, device, sizes)
    n, entries = len(sizes), len(sizes) + sum(map(fingerprints.block_count, sizes))
    records = torch.zeros(entries, dtype=torch.int64, device=device)
    ops.adam_step_flat_(params, grads, buffers, table, **HYPER, **lrs, fingerprints=records)
    params[1][block + 1] += 1.0
    twin = [p.clone() for p in params], {k: v.clone() for k, v in buffers.items()}
    twin_table = table.clone()
    identify(twin_table, twin[0])
    want_kept = blocks_by_hand(twin[0], twin[1], twin_table, records)
    assert want_kept == [127, 2 * block + 3 - block, 300]
    table[:, ops.ROW_STEP] = 2
    out = torch.full_like(records, -7)
    kept = torch.full((n,), -5, dtype=torch.int64, device=device)
    if how == "found_inf given":
        found = torch.ones(1, device=device)
        ops.adam_step_flat_(params, grads, buffers, table, **HYPER, **lrs, fingerprints=out,
                            resync=(records, kept), found_inf=found)
    else:
        grads[2][5] = float("nan")
        found = ops.adam_step_flat_(params, grads, buffers, table, **HYPER, **lrs,
                                    fingerprints=out, resync=(records, kept),
                                    check_finite=True)
    assert float(found) == 1.0
    assert kept.tolist() == want_kept
    assert same_bits(params + list(buffers.values()), twin[0] + list(twin[1].values()))
    assert torch.equal(out[:n], ops.fingerprint(params))
    assert torch.equal(out[n:], ops.fingerprint_blocks(params, 2 * block))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_blocks_compare_arguments_are_named_and_nothing_is_written(device):
    """[out, records, kept]: records or kept of another length, dtype or device, an out
    without the blocks, records lying in out or in a state buffer, params without
    remainders; on a GPU an empty param among them (its update kernels compare): each
    refused, naming it, nothing written."""
    from precis import fingerprints
    block = fingerprints.BLOCK
    sizes = [127, block + 3, 300]
    params, grads, buffers, table, lrs = blocks_problem(torch.int16, device, sizes)
    n, entries = len(sizes), len(sizes) + sum(map(fingerprints.block_count, sizes))
    out = torch.zeros(entries, dtype=torch.int64, device=device)
    records = torch.zeros(entries, dtype=torch.int64, device=device)
    kept = torch.zeros(n, dtype=torch.int64, device=device)
    big = torch.zeros(2 * entries, dtype=torch.int64, device=device)
    bad = [(dict(fingerprints=out, resync=(records[:-1], kept)),
            r"fingerprints\[1\] \(records\) must be a contiguous int64 tensor of "
            rf"{entries} values"),
           (dict(fingerprints=out, resync=(records, kept[:-1])),
            rf"fingerprints\[2\] \(kept\) must be a contiguous int64 tensor of {n} values"),
           (dict(fingerprints=out, resync=(records.float(), kept)), r"fingerprints\[1\]"),
           (dict(fingerprints=out[:n], resync=(records[:n], kept)),
            rf"needs out of {entries} values"),
           (dict(fingerprints=big[:entries], resync=(big[entries - 1:-1], kept)),
            "share memory"),
           (dict(fingerprints=out, resync=(records, buffers["master"][:4 * n].view(torch.int64))),
            "share memory"),
           (dict(fingerprints=out, resync=(records, kept.int())), r"fingerprints\[2\] \(kept\)")]
    before = [t.clone() for t in list(buffers.values()) + params]
    for kw, match in bad:
        with pytest.raises(RuntimeError, match=match):
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER, **lrs, **kw)
        assert same_bits(before, list(buffers.values()) + params), match
    masters = dict(buffers, master=torch.cat(params).float())  # a master, not remainders
    with pytest.raises(RuntimeError, match=r"needs bf16 params with remainders"):
        ops.adam_step_flat_(params, grads, masters, table, **HYPER, **lrs, fingerprints=out,
                            resync=(records, kept))
    if device == "cuda":  # an empty param: refused, the update kernels compare the blocks
        sizes = [127, 0, 300]
        params, grads, buffers, table, lrs = blocks_problem(torch.int16, device, sizes)
        entries = len(sizes) + sum(map(fingerprints.block_count, sizes))
        out = torch.zeros(entries, dtype=torch.int64, device=device)
        before = [t.clone() for t in list(buffers.values()) + params]
        with pytest.raises(RuntimeError, match=r"no empty param"):
            ops.adam_step_flat_(params, grads, buffers, table, **HYPER, fingerprints=out,
                                resync=(torch.zeros_like(out), kept))
        assert same_bits(before, list(buffers.values()) + params)
