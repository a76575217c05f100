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


def test_pages_hold_a_codes_plane_then_a_tails_plane():
    """Rows go in and out of pages unchanged; each token's codes start on a 16-byte boundary."""
    from shared.formats.kv4 import kv4_cache_shape, page_planes, page_rows, rows_to_pages, write_page_rows

    head_dim, block_size = 128, 16
    rows = encode_rows(torch.randn(3, 2, block_size, head_dim) * 3)  # (blocks, kv_heads, block_size, 68)
    pages = rows_to_pages(rows)
    assert pages.shape == kv4_cache_shape(3, 2, block_size, head_dim) == (3, 2, block_size * 68)
    assert torch.equal(page_rows(pages, head_dim), rows)
    codes, tails = page_planes(pages, head_dim)
    assert codes.data_ptr() - pages.data_ptr() == 0 and codes.stride()[-2:] == (64, 1)
    assert tails.data_ptr() - pages.data_ptr() == block_size * 64 and tails.stride()[-2:] == (4, 1)
    assert pages.stride(1) % 16 == 0  # every page, and so every 64-byte code row, 16-byte aligned
    # Token 5 of block 1, head 0: codes at 5 * 64, scale/zero at 16 * 64 + 5 * 4 of its page.
    page = pages[1, 0]
    assert torch.equal(page[5 * 64 : 6 * 64], rows[1, 0, 5, :64])
    assert torch.equal(page[16 * 64 + 20 : 16 * 64 + 24], rows[1, 0, 5, 64:])
    fresh = torch.zeros_like(pages)
    write_page_rows(fresh, head_dim, torch.tensor([1, 2]), torch.tensor([5, 15]), rows[[1, 2], :, [5, 15]])
    assert torch.equal(page_rows(fresh, head_dim)[[1, 2], :, [5, 15]], rows[[1, 2], :, [5, 15]])
    assert torch.equal(fresh[0], torch.zeros_like(fresh[0]))
