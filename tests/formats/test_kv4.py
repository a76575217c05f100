import torch

from shared.formats.kv4 import KV4_RANGE_RATIOS, decode_rows, dequantize_kv4, encode_rows, page_row_bytes, quantize_kv4


def _row_error(x, q, scale, zero):
    return ((dequantize_kv4(q, scale, zero) - x.float()) ** 2).sum(-1)


def test_kept_range_has_the_least_error_of_the_candidates():
    x = torch.randn(3, 5, 7, 128) * torch.linspace(0.1, 10, 128)  # uneven channel ranges
    q, scale, zero = quantize_kv4(x)
    assert q.max() <= 15 and scale.dtype == torch.float16 and zero.dtype == torch.float16
    err = _row_error(x, q, scale, zero)
    lo, hi = x.amin(-1), x.amax(-1)
    for ratio in KV4_RANGE_RATIOS:  # every candidate range, quantized the same way
        c_scale = ((hi - lo) * ratio / 15).clamp_min(1e-5).half()
        c_zero = (lo + (hi - lo) * ((1.0 - ratio) * 0.5)).half()
        c_q = torch.round((x - c_zero.float()[..., None]) * (1.0 / c_scale.float()[..., None])).clamp(0, 15)
        assert (err <= _row_error(x, c_q, c_scale, c_zero)).all()
    # Gaussian rows gain from a narrower range; the full min/max range alone would keep every
    # value within half a step.
    full_scale = ((hi - lo) / 15).half()
    assert (scale < full_scale).float().mean() > 0.5


def test_a_two_level_row_keeps_its_full_range():
    """Values only at the two ends: any narrower range clamps them all, so min/max is kept exactly."""
    x = torch.tensor([[-2.0, 5.0] * 32])
    q, scale, zero = quantize_kv4(x)
    assert zero.item() == -2.0 and scale.item() == torch.tensor(7.0 / 15).half().item()
    assert torch.allclose(dequantize_kv4(q, scale, zero), x, atol=15 * 2e-4)  # 15 x the fp16 scale rounding


def test_page_rows_hold_codes_then_scale_and_zero():
    x = torch.randn(4, 2, 64)
    rows = encode_rows(x)
    assert rows.shape == (4, 2, page_row_bytes(64)) and rows.dtype == torch.uint8
    q, scale, zero = quantize_kv4(x)
    assert torch.equal(rows[..., 32:34].contiguous().view(torch.float16)[..., 0], scale)
    assert torch.equal(rows[..., 34:36].contiguous().view(torch.float16)[..., 0], zero)
    assert torch.equal(decode_rows(rows), dequantize_kv4(q, scale, zero))


def test_constant_vector_does_not_divide_by_zero():
    x = torch.full((2, 64), 3.0)
    out = decode_rows(encode_rows(x))
    assert torch.isfinite(out).all() and torch.allclose(out, x, atol=1e-2)
