"""torch.ops.precis.fingerprint.blocks and resync_masters_.blocks (issue 80 item 3): each
tensor cut into blocks in the glue, an entry a block, the tensors' blocks one after
another (the last of each shorter, one empty block for an empty tensor), bit for bit
what fingerprint and resync_masters_ give the blocks as tensors of their own; their
refusals name what is wrong and write nothing."""
import pytest
import torch

from precis import ops

cuda = pytest.mark.cuda  # skipped without a device (conftest.py)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
SIZES = [0, 1, 127, 4097]


def cut(t, block):
    """t (1-D) as the ops cut it: views of `block` elements, one empty view when empty."""
    return list(t.split(block)) if t.numel() else [t]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [1, 7, 64, 4096])
def test_fingerprint_blocks_are_the_fingerprints_of_the_blocks(device, block):
    gen = torch.Generator().manual_seed(block)
    bufs = [torch.randn(n, generator=gen).to(torch.bfloat16).to(device) for n in SIZES]
    bufs.append(torch.randint(0, 255, (33,), generator=gen, dtype=torch.uint8).to(device))
    got = ops.fingerprint_blocks(bufs, block)
    views = [v for b in bufs for v in cut(b.view(torch.uint8), block)]  # (blocks of bytes)
    assert got.device == bufs[0].device and got.dtype == torch.int64
    assert torch.equal(got.cpu(), ops.fingerprint(views).cpu())
    assert got.numel() == sum(ops.block_count(b.numel() * b.element_size(), block) for b in bufs)


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
