"""KV4: the 4-bit KV cache (dynamic, asymmetric, one scale and zero per token and per head).

Values of one head vector x (D,) are stored as codes q in [0, 15] with
    x ~= q * scale + zero,    scale = (max - min) / 15,    zero = min,
scale and zero kept in fp16 beside the codes. The zero is kept in value units (what code 0
means) rather than as a code offset: dequantization is one multiply-add, and a vector whose
range is tiny next to its values (min / scale beyond fp16) still round-trips.

Paged layout (one tensor per layer for K and one for V):
    cache (num_blocks, num_kv_heads, page_bytes) uint8,  page_bytes = block_size * (D/2 + 4)
One page holds block_size tokens of one KV head in two planes:
    bytes [0, block_size * D/2)                 codes: token t's D/2 bytes at t * D/2 (nibbles
                                                paired (j, j + D/2) as in shared.formats.nibbles)
    bytes [block_size * D/2, page_bytes)        tails: token t's fp16 scale and fp16 zero at
                                                block_size * D/2 + 4 t
Splitting the planes keeps every token's codes on a 16-byte boundary (D/2 = 64 bytes at head_dim
128), so the decode kernels read them with 16-byte vector loads; rows of D/2 + 4 = 68 bytes would
only be 4-byte aligned. A "row" (D/2 codes + 4 tail bytes, encode_rows) is the unit the quantizer
and the references work in; write_page_rows / page_rows move rows in and out of pages.
"""

from __future__ import annotations

import torch

from shared.formats.nibbles import pack_halves, unpack_halves

KV4_LEVELS = 15
SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero


def quantize_kv4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes (..., D) uint8, scale (...) fp16, zero (...) fp16."""
    xf = x.float()
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    scale = ((hi - lo) / KV4_LEVELS).clamp_min(1e-5).half()
    zero = lo.half()
    q = torch.round((xf - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, KV4_LEVELS)
    return q.to(torch.uint8), scale, zero


def dequantize_kv4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes (..., D) uint8 -> (..., D) fp32."""
    return q.float() * scale.float()[..., None] + zero.float()[..., None]


def fake_quantize_kv4(x: torch.Tensor) -> torch.Tensor:
    """What attention reads back after x went through the KV4 cache, in x's dtype."""
    return dequantize_kv4(*quantize_kv4(x)).to(x.dtype)


def page_row_bytes(head_dim: int) -> int:
    return head_dim // 2 + SCALE_ZERO_BYTES


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> page rows (..., D/2 + 4) uint8 in the layout above."""
    d = x.shape[-1]
    q, scale, zero = quantize_kv4(x)
    codes = pack_halves(q, d)
    tail = torch.stack([scale, zero], dim=-1).contiguous().view(torch.uint8)  # (..., 4)
    return torch.cat([codes, tail], dim=-1)


def decode_rows(rows: torch.Tensor) -> torch.Tensor:
    """page rows (..., D/2 + 4) uint8 -> (..., D) fp32."""
    d = (rows.shape[-1] - SCALE_ZERO_BYTES) * 2
    q = unpack_halves(rows[..., : d // 2], d)
    scale_zero = rows[..., d // 2 :].contiguous().view(torch.float16)  # (..., 2)
    return dequantize_kv4(q, scale_zero[..., 0], scale_zero[..., 1])


def page_bytes(head_dim: int, block_size: int) -> int:
    return block_size * page_row_bytes(head_dim)


def kv4_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
    return (num_blocks, num_kv_heads, page_bytes(head_dim, block_size))


def page_block_size(cache: torch.Tensor, head_dim: int) -> int:
    """Tokens per page of a KV4 cache (num_blocks, kv_heads, page_bytes) for this head_dim."""
    row = page_row_bytes(head_dim)
    if cache.dim() != 3 or cache.dtype != torch.uint8 or cache.shape[-1] % row:
        raise ValueError(
            f"a KV4 cache is (num_blocks, kv_heads, block_size * {row}) uint8 for head_dim {head_dim}, "
            f"got {tuple(cache.shape)} {cache.dtype}"
        )
    return cache.shape[-1] // row


def page_planes(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a KV4 cache's planes: codes (num_blocks, kv_heads, block_size, D/2) and tails
    (num_blocks, kv_heads, block_size, 4) uint8. Writing into them writes the cache."""
    bs = page_block_size(cache, head_dim)
    half = head_dim // 2
    codes = cache[..., : bs * half].unflatten(-1, (bs, half))
    tails = cache[..., bs * half :].unflatten(-1, (bs, SCALE_ZERO_BYTES))
    return codes, tails


def page_rows(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A KV4 cache as rows (num_blocks, kv_heads, block_size, D/2 + 4) uint8 (a copy)."""
    codes, tails = page_planes(cache, head_dim)
    return torch.cat([codes, tails], dim=-1)


def rows_to_pages(rows: torch.Tensor) -> torch.Tensor:
    """Rows (num_blocks, kv_heads, block_size, D/2 + 4) uint8 -> a KV4 cache (num_blocks, kv_heads, page_bytes)."""
    half = rows.shape[-1] - SCALE_ZERO_BYTES
    codes = rows[..., :half].flatten(-2)
    tails = rows[..., half:].flatten(-2)
    return torch.cat([codes, tails], dim=-1).contiguous()


def write_page_rows(cache: torch.Tensor, head_dim: int, blocks: torch.Tensor, offsets: torch.Tensor,
                    rows: torch.Tensor) -> None:
    """rows (T, kv_heads, D/2 + 4) uint8 -> token slots (blocks[i], offsets[i]) of the cache, in place."""
    codes, tails = page_planes(cache, head_dim)
    codes[blocks, :, offsets] = rows[..., : head_dim // 2]
    tails[blocks, :, offsets] = rows[..., head_dim // 2 :]
