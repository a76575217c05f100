import torch

import pytest

from shared.formats.kv4 import (
    check_key_feedback,
    decode_rows,
    dequantize_kv4,
    encode_rows,
    fake_quantize_kv4,
    page_row_bytes,
    quantize_kv4,
    range_margin,
)


def test_error_within_half_a_step_per_token_and_head():
    x = torch.randn(3, 5, 7, 128) * torch.linspace(0.1, 10, 128)  # uneven channel ranges
    q, scale, zero = quantize_kv4(x)
    assert q.max() <= 15 and scale.dtype == torch.float16 and zero.dtype == torch.float16
    err = (dequantize_kv4(q, scale, zero) - x).abs()
    assert (err <= scale.float()[..., None] * 0.5 + 1e-3 * x.abs().amax(-1, keepdim=True)).all()


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


def test_range_ratio_one_is_the_plain_rule_and_below_one_narrows_the_grid():
    x = torch.randn(64, 4, 128)
    assert torch.equal(encode_rows(x, 1.0), encode_rows(x))
    q, scale, zero = quantize_kv4(x, 0.8)
    lo, hi = x.amin(-1), x.amax(-1)
    # scale and zero follow the narrowed range [lo + 0.1 w, hi - 0.1 w] (to fp16 rounding).
    assert torch.allclose(scale.float(), (hi - lo) * 0.8 / 15, rtol=2e-3)
    assert torch.allclose(zero.float(), lo + 0.1 * (hi - lo), rtol=2e-3, atol=1e-3)
    # Both ends clamp onto the grid; every code is still in [0, 15].
    assert q.max() <= 15 and (q == 0).any(-1).all() and (q == 15).any(-1).all()
    # On Gaussian vectors the narrowed grid has the smaller squared error: why the search picks it.
    err = lambda r: (fake_quantize_kv4(x, r) - x).pow(2).sum()
    assert err(0.95) < err(1.0) < err(0.8)


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.01])
def test_range_ratio_outside_zero_one_is_refused(ratio):
    with pytest.raises(ValueError, match="range ratio"):
        range_margin(ratio)


def _query_statistics(kv_heads: int, d: int, seed: int) -> torch.Tensor:
    """Correlated second moments, as queries after RoPE and SmoothAttention have them."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(kv_heads, d, d, generator=g) * torch.linspace(0.1, 3.0, d)
    return mix @ mix.transpose(1, 2) / d


def test_key_feedback_lowers_the_logit_error_on_the_same_grid():
    """Error-feedback rounding against H keeps each key's scale and zero and lowers e^T H e, the
    expected squared logit error, against rounding to nearest; without it the rows are as before."""
    from shared.quant.key_feedback import feedback_factor

    kv_heads, d = 2, 64
    h = _query_statistics(kv_heads, d, seed=3)
    u = feedback_factor(h)
    k = torch.randn(300, kv_heads, d, generator=torch.Generator().manual_seed(4)) * 2
    q_near, s_near, z_near = quantize_kv4(k)
    q_fb, s_fb, z_fb = quantize_kv4(k, feedback=u)
    assert torch.equal(s_near, s_fb) and torch.equal(z_near, z_fb)
    assert q_fb.max() <= 15 and not torch.equal(q_near, q_fb)

    def logit_error(codes):
        e = dequantize_kv4(codes, s_near, z_near) - k  # (300, kv_heads, D)
        return torch.einsum("thd,hde,the->", e, h, e).item()

    assert logit_error(q_fb) < 0.8 * logit_error(q_near)
    assert torch.equal(encode_rows(k), encode_rows(k, feedback=None))
    assert torch.equal(decode_rows(encode_rows(k, feedback=u)), dequantize_kv4(q_fb, s_fb, z_fb))


def test_key_feedback_identity_factor_is_rounding_to_nearest():
    """R = I pushes no error anywhere: the codes are the plain rule's."""
    k = torch.randn(40, 3, 32, generator=torch.Generator().manual_seed(5))
    assert torch.equal(quantize_kv4(k, feedback=torch.eye(32).expand(3, 32, 32))[0], quantize_kv4(k)[0])


@pytest.mark.parametrize("bad,match", [
    (torch.ones(2, 8, 8), "upper triangular"),
    (torch.eye(8).expand(2, 8, 8).double(), "fp32"),
    (torch.eye(8)[None].repeat(2, 1, 1) * float("nan"), "NaN"),
    (torch.eye(8).expand(2, 8, 8) * 2, "unit diagonal"),
])
def test_bad_key_feedback_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        check_key_feedback(bad, 2, 8)
    with pytest.raises(ValueError, match=r"\(3, 8, 8\)"):
        check_key_feedback(torch.eye(8).expand(2, 8, 8).contiguous(), 3, 8)
