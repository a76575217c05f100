import torch

from shared.formats.kv4 import decode_rows, encode_rows, page_row_bytes, quantize_kv4, dequantize_kv4


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
