"""KV4: the 4-bit KV cache (dynamic, asymmetric, one scale and zero per token and per head).

Values of one head vector x (D,) are stored as codes q in [0, 15] with
    x ~= q * scale + zero,    scale = (max - min) / 15,    zero = min,
scale and zero kept in fp16 beside the codes. The zero is kept in value units (what code 0
means) rather than as a code offset: dequantization is one multiply-add, and a vector whose
range is tiny next to its values (min / scale beyond fp16) still round-trips.

Range ratio: a layer may quantize K or V over [min, max] shrunk around its midpoint to
`ratio` of its width (values outside clamp to codes 0 / 15). A 4-bit grid over the full range
of 64..128 roughly Gaussian values wastes levels on the two extremes; the quantizer picks V's
ratio per layer on calibration data, K keeps 1 (shared/quant/kv_range.py), and the artifact carries
both.
The arithmetic, for the Triton write to match bit for bit (fp32, no fused multiply-add):
    margin = (max - min) * c,  c = fp32((1 - ratio) / 2);  min' = min + margin;  max' = max - margin
ratio 1 skips it, so such a layer writes exactly the rows of the plain rule.

Key rounding with error feedback (optional, per layer; shared/quant/key_feedback.py): what a key
costs is its logit error q . (k - k'), not |k - k'|, so the codes of a key may be chosen GPTQ-style
against the layer's query covariance H (per KV head, from calibration). With U the upper Cholesky
factor of H^-1 and R = U with each row divided by its diagonal entry (the artifact carries R,
(kv_heads, D, D) fp32, upper triangular with a unit diagonal), dims are rounded in order and each
one's error is pushed onto the dims after it (GPTQ's update, e / U[i, i] * U[i, j] = e * R[i, j]):
    for i in 0 .. D-1:   q_i = clamp(round((w_i - zero) / scale), 0, 15)
                         e = w_i - (q_i * scale + zero);   w_j -= e * R[i, j] (j > i)
with w starting as the key and scale / zero those of the plain rule (the key's own [min, max]).
The row layout, scale and zero are unchanged: only which code each dim gets differs, so attention
reads such rows as any other. Each step is plain fp32 (a product, then a difference: no fused
multiply-add), the same in the Triton write.

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
FULL_KV_RANGE = (1.0, 1.0)  # (K, V) range ratios of a layer that narrows neither


def range_margin(ratio: float) -> float:
    """c of the range-ratio rule above, as the fp32 value both the reference and the kernel use."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"KV4 range ratio must be in (0, 1], got {ratio}")
    return torch.tensor((1.0 - ratio) / 2.0, dtype=torch.float32).item()


def check_key_feedback(u: torch.Tensor, kv_heads: int | None = None, head_dim: int | None = None,
                       values: bool = True) -> None:
    """ValueError unless u is a usable error-feedback factor R: (kv_heads, D, D) fp32, finite, upper
    triangular with a unit diagonal (the expected sizes checked where given). values False checks
    the shape and dtype only: no read of the data (no device sync in a cache write's launch)."""
    if u.dim() != 3 or u.shape[1] != u.shape[2] or u.dtype != torch.float32:
        raise ValueError(f"key_feedback must be (kv_heads, D, D) fp32, got {tuple(u.shape)} {u.dtype}")
    if (kv_heads is not None and u.shape[0] != kv_heads) or (head_dim is not None and u.shape[1] != head_dim):
        raise ValueError(f"key_feedback is {tuple(u.shape)}, the model's keys need ({kv_heads}, {head_dim}, {head_dim})")
    if not values:
        return
    if not torch.isfinite(u).all():
        raise ValueError("key_feedback holds NaN or inf")
    if not torch.equal(u, u.triu()) or not (u.diagonal(dim1=1, dim2=2) == 1).all():
        raise ValueError("key_feedback must be upper triangular with a unit diagonal")


def quantize_kv4(
    x: torch.Tensor, ratio: float = 1.0, feedback: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., D) -> codes (..., D) uint8, scale (...) fp16, zero (...) fp16.

    feedback: R (..., D, D) fp32 (above), broadcastable against x's leading dims (one per KV head):
    round with error feedback instead of to nearest."""
    xf = x.float()
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    if ratio != 1.0:
        margin = (hi - lo) * range_margin(ratio)
        lo, hi = lo + margin, hi - margin
    # Divided by a tensor: on CUDA, torch divides by a Python scalar through its reciprocal, which
    # rounds differently from the Triton write's IEEE division (tl.div_rn) once the range is
    # narrowed (measured on an H200: 60 of 524k rows a step apart in fp16 scale).
    scale = ((hi - lo) / torch.full_like(lo, KV4_LEVELS)).clamp_min(1e-5).half()
    zero = lo.half()
    if feedback is not None:
        return _round_with_feedback(xf, scale.float(), zero.float(), feedback), scale, zero
    q = torch.round((xf - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, KV4_LEVELS)
    return q.to(torch.uint8), scale, zero


def _round_with_feedback(xf: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The error-feedback codes (module doc) of xf (..., D) fp32 on its grid (scale, zero (...))."""
    d = xf.shape[-1]
    if r.shape[-2:] != (d, d):
        raise ValueError(f"KV4 feedback must be (..., {d}, {d}), got {tuple(r.shape)}")
    r = r.float()
    w = xf.clone()
    codes = torch.empty_like(xf)
    for i in range(d):
        # Plain tensor ops, each rounded once, in the Triton write's order (module doc).
        q = torch.round((w[..., i] - zero) / scale).clamp_(0, KV4_LEVELS)
        codes[..., i] = q
        err = w[..., i] - (q * scale + zero)
        if i + 1 < d:
            w[..., i + 1 :] -= err[..., None] * r[..., i, i + 1 :]
    return codes.to(torch.uint8)


def dequantize_kv4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes (..., D) uint8 -> (..., D) fp32."""
    return q.float() * scale.float()[..., None] + zero.float()[..., None]


def fake_quantize_kv4(x: torch.Tensor, ratio: float = 1.0, feedback: torch.Tensor | None = None) -> torch.Tensor:
    """What attention reads back after x went through the KV4 cache, in x's dtype."""
    return dequantize_kv4(*quantize_kv4(x, ratio, feedback)).to(x.dtype)


def page_row_bytes(head_dim: int) -> int:
    return head_dim // 2 + SCALE_ZERO_BYTES


def encode_rows(x: torch.Tensor, ratio: float = 1.0, feedback: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., D) -> page rows (..., D/2 + 4) uint8 in the layout above."""
    d = x.shape[-1]
    q, scale, zero = quantize_kv4(x, ratio, feedback)
    codes = pack_halves(q, d)
    tail = torch.stack([scale, zero], dim=-1).contiguous().view(torch.uint8)  # (..., 4)
    return torch.cat([codes, tail], dim=-1)


def decode_rows(rows: torch.Tensor) -> torch.Tensor:
    """page rows (..., D/2 + 4) uint8 -> (..., D) fp32."""
    d = (rows.shape[-1] - SCALE_ZERO_BYTES) * 2
    q = unpack_halves(rows[..., : d // 2], d)
    scale_zero = rows[..., d // 2 :].contiguous().view(torch.float16)  # (..., 2)
    return dequantize_kv4(q, scale_zero[..., 0], scale_zero[..., 1])
