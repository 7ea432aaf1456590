"""torch.ops.precis.fingerprint.blocks and resync_masters_.blocks (issue 80 item 3): each
tensor cut into blocks, an entry a block, the tensors' blocks one after another (the last
of each shorter, one empty block for an empty tensor). A block's fingerprint is
precis_fingerprint_blocks': its words' terms at their place in the tensor (so that a step
records its params' blocks as it writes them), which with the length's term sum to the
tensor's fingerprint; resync_masters_.blocks is bit for bit what resync_masters_ gives
the blocks as tensors of their own; their refusals name what is wrong and write
nothing."""
import pytest
import torch

from precis import ops

cuda = pytest.mark.cuda  # skipped without a device (conftest.py)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
SIZES = [0, 1, 127, 4097]
WORD = 1 << 64
LENGTH = 0x9E3779B97F4A7C15  # fingerprint.h's length weight


def cut(t, block):
    """t (1-D) as the ops cut it: views of `block` elements, one empty view when empty."""
    return list(t.split(block)) if t.numel() else [t]


def blocks_by_formula(buf, block):
    """Each block's value from its bytes: words (little-endian, the last zero-padded)
    times 2 * (their index in buf) + 1, mod 2^64, the padded word the last block's."""
    data = bytes(buf.cpu().view(torch.uint8).numpy())
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
    count = max(1, -(-len(data) // block))
    values = [0] * count
    for i, word in enumerate(words):
        values[i * 8 // block] += word * (2 * i + 1)
    return [v % WORD for v in values]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [8, 16, 64, 4096])
def test_fingerprint_blocks_are_their_words_at_their_place(device, block):
    gen = torch.Generator().manual_seed(block)
    bufs = [torch.randn(n, generator=gen).to(torch.bfloat16).to(device) for n in SIZES]
    bufs.append(torch.randint(0, 255, (33,), generator=gen, dtype=torch.uint8).to(device))
    got = ops.fingerprint_blocks(bufs, block)
    assert got.device == bufs[0].device and got.dtype == torch.int64
    counts = [ops.block_count(b.numel() * b.element_size(), block) for b in bufs]
    assert got.numel() == sum(counts)
    values = [v % WORD for v in got.cpu().tolist()]
    assert values == [v for b in bufs for v in blocks_by_formula(b, block)]
    at = 0
    for b, whole, count in zip(bufs, ops.fingerprint(bufs).cpu().tolist(), counts):
        nbytes = b.numel() * b.element_size()
        assert (sum(values[at:at + count]) + nbytes * LENGTH) % WORD == whole % WORD
        at += count


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_changes_only_its_blocks_fingerprint(device):
    p = torch.randn(4097).to(torch.bfloat16).to(device)
    before = ops.fingerprint_blocks([p], 2048)
    p[1500] += 1
    after = ops.fingerprint_blocks([p], 2048)
    assert before.ne(after).tolist() == [False, True, False, False, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("remainder_dtype", [torch.int16, torch.uint8])
def test_resync_masters_blocks_zero_the_remainders_of_the_blocks_flagged(device,
                                                                         remainder_dtype):
    gen = torch.Generator().manual_seed(2)
    block = 50
    params = [torch.randn(n, generator=gen).to(torch.bfloat16).to(device) for n in SIZES]
    remainders = [torch.randint(1, 100, (n,), generator=gen).to(remainder_dtype).to(device)
                  for n in SIZES]
    entries = sum(ops.block_count(p.numel(), block) for p in params)
    stale = (torch.arange(entries) % 3 == 1).to(torch.uint8).to(device)
    kept = torch.full((entries,), -1, dtype=torch.int64, device=device)
    want = [r.clone() for r in remainders]
    want_views = [v for r in want for v in cut(r, block)]
    want_kept = ops.resync_masters_(want_views, [v for p in params for v in cut(p, block)],
                                    stale.clone())
    ops.resync_masters_blocks_(remainders, params, stale, kept, block)
    assert all(torch.equal(r.cpu(), w.cpu()) for r, w in zip(remainders, want))
    assert torch.equal(kept.cpu(), want_kept.cpu())
    assert any(r.ne(0).any() for r in remainders) and any(not r.all() for r in remainders)


@pytest.mark.parametrize("device", DEVICES)
def test_block_ops_refuse_bad_input_before_writing(device):
    p = torch.randn(100).to(torch.bfloat16).to(device)
    r = torch.ones(100, dtype=torch.int16, device=device)
    with pytest.raises(RuntimeError, match=r"block is 0 bytes, must be > 0"):
        ops.fingerprint_blocks([p], 0)
    with pytest.raises(RuntimeError, match=r"block is 7 bytes, must be > 0 and a multiple "
                                           r"of 8"):
        ops.fingerprint_blocks([p], 7)
    stale = torch.ones(2, dtype=torch.uint8, device=device)
    kept = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=r"block is -3 elements, must be > 0"):
        ops.resync_masters_blocks_([r], [p], stale, kept, -3)
    with pytest.raises(RuntimeError, match=r"stale must hold 3 uint8 values \(a flag per "
                                           r"block of 40 elements\), got 2"):
        ops.resync_masters_blocks_([r], [p], stale, kept, 40)
    with pytest.raises(RuntimeError, match=r"kept must hold 2 int64 values \(one per block "
                                           r"of 50 elements\), got 3"):
        ops.resync_masters_blocks_([r], [p], stale, torch.zeros(3, dtype=torch.int64,
                                                                  device=device), 50)
    assert bool(r.eq(1).all()) and bool(kept.eq(0).all())
    # A tensor where a list of them is taken: refused (its rows were taken for tensors).
    rows = torch.ones(3, 8, device=device)
    for call in (lambda: ops.fingerprint(rows), lambda: ops.fingerprint_blocks(rows, 8),
                 lambda: ops.resync_masters_(r, [p], stale[:1]),
                 lambda: ops.resync_masters_blocks_([r], p, stale, kept, 50)):
        with pytest.raises(TypeError, match=r"must be a list of tensors, got a tensor of "
                                            r"shape \((3, 8|100,)\); give \[t\] for one"):
            call()
    assert bool(r.eq(1).all()) and bool(kept.eq(0).all())
    assert ops.fingerprint([rows]).shape == (1,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("skipped", [False, True])
def test_the_step_op_records_its_params_blocks_after_their_entries(device, skipped):
    """adam_step_'s fingerprints out, longer by the params' blocks: an entry a param
    (fingerprint), then each param's blocks (fingerprint.blocks of BLOCK elements of its
    dtype), as the step leaves them, or as found when found_inf skips it; params of two
    dtypes (two C calls) and an empty one among them. An out of another length is
    refused, naming both lengths it takes."""
    from precis import fingerprints
    gen = torch.Generator().manual_seed(5)
    sizes = [127, 0, fingerprints.BLOCK + 1, 5]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    params = [torch.randn(n, generator=gen).to(dt).to(device) for n, dt in zip(sizes, dtypes)]
    grads = [torch.randn(n, generator=gen).to(dt).to(device) for n, dt in zip(sizes, dtypes)]
    masters = [p.float() if p.dtype == torch.bfloat16 else torch.empty(0, device=device)
               for p in params]
    moments = [[torch.zeros(n, dtype=torch.bfloat16, device=device) for n in sizes]
               for _ in range(2)]
    counts = [fingerprints.block_count(n) for n in sizes]
    out = torch.full((len(sizes) + sum(counts),), 7, dtype=torch.int64, device=device)
    before = [p.clone() for p in params]
    ops.adam_step_(params, grads, masters, *moments, [], [], [1] * len(sizes), 1e-3,
                   fingerprints=out, found_inf=torch.tensor([float(skipped)], device=device))
    assert all(torch.equal(p, b) for p, b in zip(params, before)) == skipped
    assert fingerprints.unsigned(out[:len(sizes)]) == fingerprints.of(params)
    got = out[len(sizes):].split(counts)
    assert all(torch.equal(g.cpu(), fingerprints.of_blocks([p]).cpu())
               for g, p in zip(got, params))
    with pytest.raises(RuntimeError, match=rf"fingerprints must be a contiguous int64 .* of "
                                           rf"{len(sizes)} values \(one per param\), or "
                                           rf"{len(sizes) + sum(counts)} \(then each param's "
                                           rf"blocks of {fingerprints.BLOCK} elements\)"):
        ops.adam_step_(params, grads, masters, *moments, [], [], [2] * len(sizes), 1e-3,
                       fingerprints=out[:-1])
