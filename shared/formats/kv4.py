"""KV4: the 4-bit KV cache (dynamic, asymmetric, one scale and zero per token and per head).

Values of one head vector x (D,) are stored as codes q in [0, 15] with
    x ~= q * scale + zero,    scale = r (max - min) / 15,    zero = min + (1 - r) (max - min) / 2,
scale and zero kept in fp16 beside the codes: the range [min, max] shrunk to a fraction r of its
width around its midpoint, r the candidate of KV4_RANGE_RATIOS with the least squared error for
this vector (values beyond a shrunk range clamp to its ends). The zero is kept in value units
(what code 0 means) rather than as a code offset: dequantization is one multiply-add, and a
vector whose range is tiny next to its values (min / scale beyond fp16) still round-trips.

Paged layout (one tensor per layer for K and one for V):
    page (num_blocks, num_kv_heads, block_size, D // 2 + 4) uint8
Row t of a block holds token t's D/2 code bytes (nibbles paired (j, j + D/2) as in
shared.formats.nibbles) followed by its fp16 scale and fp16 zero (4 bytes). Keeping the
scale and zero in the same row as the data means one contiguous read per token per head.
"""

from __future__ import annotations

import torch

from shared.formats.nibbles import pack_halves, unpack_halves

KV4_LEVELS = 15
SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero


# The candidate widths of the range search, widest first (a tie keeps the wider range). On the
# trained fixture (QoQ, 215 windows of 512) the search took perplexity from 5.1240 to 5.1150 (g128)
# and 5.1399 to 5.1295 (per-channel); the KV cache in fp16 would give 5.0727 (g128). Searching both
# ends independently for the least squared error lost instead (g128 5.1246): clipping one tail
# alone hurts attention more than the error says. services/worker/kernels/kv4_cache.py unrolls
# this tuple: change both together.
KV4_RANGE_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _candidate(xf: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, ratio: float):
    """Codes, fp16 scale and zero, and squared error of one candidate range. The operations (and
    their order) are what the Triton KV write does, so the two keep the same range."""
    scale = (width * ratio / KV4_LEVELS).clamp_min(1e-5).half()
    zero = (lo + width * ((1.0 - ratio) * 0.5)).half()
    scale_f, zero_f = scale.float()[..., None], zero.float()[..., None]
    # x * (1 / scale), not x / scale: one division per vector in the kernel instead of one per value.
    q = torch.round((xf - zero_f) * (1.0 / scale_f)).clamp_(0, KV4_LEVELS)
    err = ((q * scale_f + zero_f - xf) ** 2).sum(dim=-1)
    return q, scale, zero, err


def quantize_kv4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes (..., D) uint8, scale (...) fp16, zero (...) fp16."""
    xf = x.float()
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    width = hi - lo
    q, scale, zero, err = _candidate(xf, lo, width, KV4_RANGE_RATIOS[0])
    for ratio in KV4_RANGE_RATIOS[1:]:
        c_q, c_scale, c_zero, c_err = _candidate(xf, lo, width, ratio)
        better = c_err < err
        q = torch.where(better[..., None], c_q, q)
        scale, zero, err = torch.where(better, c_scale, scale), torch.where(better, c_zero, zero), torch.where(better, c_err, err)
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
