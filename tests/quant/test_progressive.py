"""Progressive group quantization: the protective range keeps the int8 dequantization in range."""

import itertools

import torch

from shared.formats.weights import GROUP_SIZE, PROTECTIVE_RANGE
from shared.quant.weights import progressive_level2, progressive_safe_code_range, quantize_w4_g128_progressive


def _groups_for_every_range() -> torch.Tensor:
    """One group of 128 int8 values per (lo, hi) with -119 <= lo <= hi <= 119, holding lo, hi and
    values spread between them (dequantization is monotonic, so the ends bound every value)."""
    pairs = [(lo, hi) for lo, hi in itertools.combinations_with_replacement(range(-PROTECTIVE_RANGE, PROTECTIVE_RANGE + 1), 2)]
    lo = torch.tensor([p[0] for p in pairs], dtype=torch.float32)[:, None]
    hi = torch.tensor([p[1] for p in pairs], dtype=torch.float32)[:, None]
    t = torch.linspace(0, 1, GROUP_SIZE)[None, :]
    return torch.round(lo + (hi - lo) * t).to(torch.int16)  # (pairs, 128), first = lo, last = hi


def test_dequantization_never_leaves_int8_for_any_group_range():
    w8 = _groups_for_every_range()
    assert w8.shape[0] == (2 * PROTECTIVE_RANGE + 1) * (2 * PROTECTIVE_RANGE + 2) // 2
    for ratio in (1.0, 0.8, 0.5):
        q, s2, zero = progressive_level2(w8, torch.full((w8.shape[0], 1), ratio))
        deq = (q.to(torch.int32) - zero.to(torch.int32)) * s2.to(torch.int32)
        assert deq.min().item() >= -128 and deq.max().item() <= 127, f"ratio {ratio}"
        assert s2.min().item() >= 1 and s2.max().item() <= 16
        # every produced code also lies inside the safe code range the GPTQ rounding clamps to
        q_lo, q_hi = progressive_safe_code_range(s2[:, 0], zero[:, 0])
        assert (q.float() >= q_lo[:, None]).all() and (q.float() <= q_hi[:, None]).all()


def test_safe_code_range_bounds_every_code_it_admits():
    s2 = torch.arange(1, 17, dtype=torch.uint8).repeat_interleave(16)
    zero = torch.arange(16, dtype=torch.uint8).repeat(16)
    q_lo, q_hi = progressive_safe_code_range(s2, zero)
    assert ((q_lo - zero.float()) * s2.float()).min() >= -128
    assert ((q_hi - zero.float()) * s2.float()).max() <= 127


def test_full_weight_round_trip_is_close():
    w = torch.randn(96, 384, generator=torch.Generator().manual_seed(0))
    packed = quantize_w4_g128_progressive(w)
    int8 = packed.int8_weight()
    assert int8.dtype == torch.int8
    err = (packed.dequantize() - w).abs().max() / w.abs().max()
    assert err < 0.1
