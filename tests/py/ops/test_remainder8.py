"""8-bit master corrections (param_remainder_bits 8): the split of an fp32 master into
a bf16 param and one uint8 byte (a 24-bit master), its join, and the conversions
between them and int16 remainders, against an integer model of the rule
(csrc/stores.h precis_master24_bits / precis_remainder8_*)."""
import pytest
import torch

import precis  # noqa: F401
from precis import stored_forms
from precis.checkpoint import remainder_join, remainder_split

F32, BF16, U8, I16 = torch.float32, torch.bfloat16, torch.uint8, torch.int16
M32 = 0xFFFFFFFF


def f32_bits(x):
    return x.contiguous().view(torch.int32).to(torch.int64) & M32


def from_bits(u):
    return (u & M32).to(torch.int64).sub(((u & M32) >> 31) << 32).to(torch.int32).view(F32)


def bf16_bits(p):
    return p.contiguous().view(I16).to(torch.int64) & 0xFFFF


def master24(x):
    """The fp32 master's bits rounded to nearest even at bit 8 (NaN: quiet, kept)."""
    u = f32_bits(x)
    rounded = u + 0x7F + ((u >> 8) & 1)
    return torch.where(torch.isnan(x), u | 0x00400000, rounded) & 0xFFFFFF00


def split_model(x):
    """(param bits, correction byte) of the rule: the 24-bit value's high half rounded
    to nearest (ties up), its low byte."""
    u = master24(x)
    return ((u >> 16) + ((u >> 15) & 1)) & 0xFFFF, (u >> 8) & 0xFF


def join_model(param_bits, corr):
    """The master bits a (param, correction) pair encodes."""
    negative = (corr >= 0x80).to(torch.int64)
    return ((((param_bits - negative) & 0xFFFF) << 16) | (corr << 8)) & M32


def every_pair():
    """Every bf16 bit pattern with every correction byte (2^24 pairs)."""
    pb = torch.arange(1 << 16, dtype=torch.int64).repeat_interleave(256)
    corr = torch.arange(256, dtype=torch.int64).repeat(1 << 16)
    param = pb.to(torch.int32).to(I16).view(BF16)
    return pb, corr, param, corr.to(U8)


def test_join_is_the_rule_and_split_inverts_it_for_every_pair():
    pb, corr, param, c8 = every_pair()
    master = remainder_join(param, c8)
    assert master.dtype == F32
    want = join_model(pb, corr)
    assert torch.equal(f32_bits(master), want)
    high, low = remainder_split(master, bits=8)
    assert high.dtype == BF16 and low.dtype == U8
    # Identity, except where the pair encodes a signalling NaN (an inf or NaN param with
    # a correction below its quiet bit): the split quiets it and keeps the rest.
    signalling = torch.isnan(master) & ((want & 0x00400000) == 0)
    assert int(signalling.sum()) > 0
    same = ~signalling
    assert torch.equal(bf16_bits(high)[same], pb[same])
    assert torch.equal(low.to(torch.int64)[same], corr[same])
    quieted = f32_bits(remainder_join(high[signalling], low[signalling]))
    assert torch.equal(quieted, want[signalling] | 0x00400000)


def interesting_masters():
    """Random fp32 bit patterns of every exponent, ties at bit 8 and at bit 16, the
    bf16 range's edges, zeros, subnormals, infinities and NaNs."""
    gen = torch.Generator().manual_seed(34)
    rand = torch.randint(0, 1 << 32, (1 << 20,), generator=gen, dtype=torch.int64)
    ties8 = (rand & ~0xFF) | 0x80
    ties16 = (rand & ~0xFFFF) | 0x8000
    near16 = (rand & ~0xFFFF) | torch.tensor([0x7F7F, 0x7F80, 0x7F81, 0x7FFF, 0x80FF, 0x8080])\
        .repeat((1 << 20) // 6 + 1)[:1 << 20]
    edges = torch.tensor([0, 0x80000000, 1, 0x80, 0x7F, 0xFF, 0x180, 0x007FFFFF, 0x00800000,
                          0x7F7FFFFF, 0x7F7F7F80, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,
                          0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF,
                          0x7FBFFFFF, 0x3F800080, 0x3F800180, 0xBF800080, 0xBF800180],
                         dtype=torch.int64)
    return from_bits(torch.cat([rand, ties8, ties16, near16, edges]))


def test_split_is_the_rule_and_rounds_to_nearest_even():
    x = interesting_masters()
    high, low = remainder_split(x, bits=8)
    want_param, want_corr = split_model(x)
    assert torch.equal(bf16_bits(high), want_param)
    assert torch.equal(low.to(torch.int64), want_corr)
    back = remainder_join(high, low)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(back), nan)  # NaN stays NaN, nothing else becomes one
    assert torch.equal(f32_bits(back)[~nan], master24(x)[~nan])  # exact for the 24-bit value
    fin = torch.isfinite(x) & torch.isfinite(back)
    err = (back.double() - x.double()).abs()[fin]
    ax = x.double().abs()[fin]
    normal = ax >= 2.0 ** -126
    # half a spacing of 15 stored mantissa bits: 2^-16 of |x| at worst (x just above a
    # power of two), which the ties at bit 8 reach
    assert bool((err[normal] <= 2.0 ** -16 * ax[normal]).all())
    assert float((err[normal] / ax[normal]).max()) > 2.0 ** -17
    assert bool((err[~normal] <= 2.0 ** -142).all())  # subnormals: half of 256 * 2^-149
    # ties at bit 8 go to the even neighbour (bit 8 clear), everything else to the nearer
    u = f32_bits(x)[fin]
    tie = (u & 0xFF) == 0x80
    assert bool(((f32_bits(back)[fin][tie] >> 8) & 1 == 0).all())
    # signs and zeros are kept, infinities stay infinite
    assert torch.equal(torch.signbit(back[~nan]), torch.signbit(x[~nan]))
    assert torch.equal(f32_bits(back[x == 0]), f32_bits(x[x == 0]))


def test_remainder_dtypes_and_errors():
    x = torch.randn(7)
    assert remainder_split(x)[1].dtype == I16  # the default stays 16 bits
    p16, r16 = remainder_split(x, bits=16)
    assert torch.equal(remainder_join(p16, r16), x)
    with pytest.raises(ValueError, match="bits must be 16 or 8"):
        remainder_split(x, bits=12)
    with pytest.raises(ValueError, match="int16 remainder .*uint8 8-bit correction.*torch.int8"):
        remainder_join(p16, r16.to(torch.int8))
    with pytest.raises(ValueError, match="shape"):
        remainder_join(p16, torch.zeros(6, dtype=U8))
    assert stored_forms.REMAINDER_DTYPES == {16: I16, 8: U8}


@pytest.mark.parametrize("n", [1, 127, 4097])
def test_remainders_for_keeps_a_round_to_nearest_param(n):
    """A master saved by an fp32-master policy (its param rounded to nearest even) gets
    8-bit corrections beside that very param: at a tie of the 24-bit value (low byte
    0x80, where the split would move the param up one) 0x7F, one 24-bit ulp below."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    x[: n // 2] = from_bits((f32_bits(x[: n // 2]) & ~0xFFFF) | 0x7FC0)  # rounds to ties
    p = x.to(BF16)
    high, low = stored_forms.remainders_for(p, x, bits=8)
    assert torch.equal(high, p) and low.dtype == U8
    m24 = master24(x)
    tie = ((m24 & 0xFF00) == 0x8000) & ((m24 >> 16) == bf16_bits(p))
    if n > 1:
        assert bool(tie.any())
    want = torch.where(tie, m24 - 0x100, m24)
    assert torch.equal(f32_bits(remainder_join(high, low)), want)


def test_width_conversions_through_the_master():
    """int16 -> uint8 rounds the master to 24 bits (keeping the param, ties included);
    uint8 -> int16 is exact; neither moves the param."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(100_000, generator=gen) * torch.exp(torch.randn(100_000, generator=gen))
    p, r16 = remainder_split(x, bits=16)
    p8, c8 = stored_forms.remainders_for(p, remainder_join(p, r16), bits=8)
    assert torch.equal(p8, p)
    m24 = master24(x)
    tie = ((m24 & 0xFF00) == 0x8000) & ((m24 >> 16) == bf16_bits(p))
    assert bool(tie.any())
    assert torch.equal(f32_bits(remainder_join(p, c8)), torch.where(tie, m24 - 0x100, m24))
    p16, back16 = stored_forms.remainders_for(p, remainder_join(p, c8), bits=16)
    assert torch.equal(p16, p)
    assert torch.equal(remainder_join(p, back16), remainder_join(p, c8))
