"""Round-to-nearest weight quantizers for each layout in shared.formats.weights.

Each takes an fp weight (N, K) and an optional clip ratio (per output channel, or per group
for group formats) that shrinks the quantization range; shared.quant.clipping searches it.
"""

from __future__ import annotations

import torch

from shared.formats.weights import (
    GROUP_SIZE,
    PROTECTIVE_RANGE,
    Fp16Weight,
    W4ChannelWeight,
    W4G128ProgressiveWeight,
    W4G128Weight,
    W8Weight,
    pack_codes,
)

UINT4_MAX = 15


# The smallest positive fp16 (a subnormal): a floor applied after the cast, so an all-zero row gets a
# nonzero scale (1e-8 before the cast rounded to 0 and its zero point became 0 / 0 = NaN).
FP16_SMALLEST = 2.0**-24


def _ratio(clip: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
    if clip is None:
        return torch.ones(shape, device=device)
    return clip.to(device=device, dtype=torch.float32).reshape(shape)


def quantize_fp16(w: torch.Tensor, clip=None) -> Fp16Weight:
    return Fp16Weight(weight=w.to(torch.float16))


def quantize_w8(w: torch.Tensor, clip: torch.Tensor | None = None) -> W8Weight:
    """Per-channel symmetric int8. clip: (N,) ratios."""
    w = w.float()
    scale = int8_channel_scale(w, _ratio(clip, (w.shape[0],), w.device))
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return W8Weight(qweight=q, scale=scale)


def int8_channel_scale(w: torch.Tensor, ratio) -> torch.Tensor:
    """(N,) fp16 symmetric int8 scale of each row of w (N, K), its range shrunk by ratio."""
    return (w.abs().amax(dim=1) * ratio / 127).half().clamp_min(FP16_SMALLEST)


def progressive_group_params(groups: torch.Tensor, ratio) -> tuple[torch.Tensor, torch.Tensor]:
    """groups (..., 128) of int8 values (as fp32) -> integer s2 in [1, 16] and zero in [0, 15] (fp32).

    The range is widened to include 0 so the zero point is a valid code.
    """
    lo = groups.amin(dim=-1).clamp(max=0) * ratio
    hi = groups.amax(dim=-1).clamp(min=0) * ratio
    s2 = torch.round((hi - lo) / UINT4_MAX).clamp_(1, 16)
    return s2, torch.round(-lo / s2).clamp_(0, UINT4_MAX)


def asymmetric_uint4_params(groups: torch.Tensor, ratio) -> tuple[torch.Tensor, torch.Tensor]:
    """groups (..., n) fp32 -> fp16 scale and integer zero in [0, 15] (fp32), 0 inside the range."""
    lo = groups.amin(dim=-1).clamp(max=0) * ratio
    hi = groups.amax(dim=-1).clamp(min=0) * ratio
    scale = ((hi - lo) / UINT4_MAX).half().clamp_min(FP16_SMALLEST)
    return scale, torch.round(-lo / scale.float()).clamp_(0, UINT4_MAX)


def progressive_level1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 1 of progressive quantization: per-channel symmetric int8 in [-119, 119].

    Returns w8 (N, K) int16 holding values in the protective range, and s1 (N,) fp16.
    """
    w = w.float()
    s1 = (w.abs().amax(dim=1) / PROTECTIVE_RANGE).half().clamp_min(FP16_SMALLEST)
    w8 = torch.round(w / s1.float()[:, None]).clamp_(-PROTECTIVE_RANGE, PROTECTIVE_RANGE)
    return w8.to(torch.int16), s1


def progressive_level2(w8: torch.Tensor, clip: torch.Tensor | None = None):
    """Level 2: groups of 128 of the int8 tensor -> uint4 codes with integer scale s2 and zero.

    With |w8| <= 119 the
    group range is <= 238, so s2 = round(range / 15) <= 16 and a produced code dequantizes to
    round(w8 / s2) * s2, which is within s2 / 2 <= 8 of w8: inside [-127, 127].
    Returns codes (N, K) uint8, s2 (N, G) uint8, zero (N, G) uint8.
    """
    n, k = w8.shape
    groups = w8.float().unflatten(1, (-1, GROUP_SIZE))  # (N, G, 128)
    s2, zero = progressive_group_params(groups, _ratio(clip, (n, k // GROUP_SIZE), w8.device))
    q = (torch.round(groups / s2[..., None]) + zero[..., None]).clamp_(0, UINT4_MAX)
    return q.flatten(1).to(torch.uint8), s2.to(torch.uint8), zero.to(torch.uint8)


def progressive_safe_code_range(s2: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q whose (q - zero) * s2 lies in [-128, 127], as fp32 bounds (q_lo, q_hi).

    Round-to-nearest never produces a code outside this range; error-compensated rounding
    (shared.quant.gptq) can push a weight past its group's range, so it clamps to it.
    """
    s2f, zf = s2.float(), zero.float()
    q_lo = (zf - torch.floor(128 / s2f)).clamp(min=0)
    q_hi = (zf + torch.floor(127 / s2f)).clamp(max=UINT4_MAX)
    return q_lo, q_hi


def quantize_w4_g128_progressive(w: torch.Tensor, clip: torch.Tensor | None = None) -> W4G128ProgressiveWeight:
    """clip: (N, G) ratios applied to the level-2 group range."""
    w8, s1 = progressive_level1(w)
    q, s2, zero = progressive_level2(w8, clip)
    return W4G128ProgressiveWeight(qweight=pack_codes(q), s1=s1, s2=s2, zero=zero)


def _asymmetric_uint4(groups: torch.Tensor, ratio: torch.Tensor):
    """groups (..., n) fp32, ratio broadcastable to (...) -> codes, scale fp16, integer zero (fp32)."""
    scale, zero = asymmetric_uint4_params(groups, ratio)
    q = (torch.round(groups / scale.float()[..., None]) + zero[..., None]).clamp_(0, UINT4_MAX)
    return q.to(torch.uint8), scale, zero


def quantize_w4_channel(w: torch.Tensor, clip: torch.Tensor | None = None) -> W4ChannelWeight:
    """Per-channel asymmetric uint4. clip: (N,) ratios."""
    w = w.float()
    q, scale, zero = _asymmetric_uint4(w, _ratio(clip, (w.shape[0],), w.device))
    return W4ChannelWeight(qweight=pack_codes(q), scale=scale, zero=zero.half())


def quantize_w4_g128(w: torch.Tensor, clip: torch.Tensor | None = None) -> W4G128Weight:
    """Per-group asymmetric uint4 with fp16 scales (weight-only). clip: (N, G) ratios."""
    w = w.float()
    n, k = w.shape
    groups = w.unflatten(1, (-1, GROUP_SIZE))
    q, scale, zero = _asymmetric_uint4(groups, _ratio(clip, (n, k // GROUP_SIZE), w.device))
    return W4G128Weight(qweight=pack_codes(q.flatten(1)), scale=scale, zero=zero.to(torch.uint8))


# weight kind -> (quantizer, whether its clip ratio is per group (True) or per channel (False))
WEIGHT_QUANTIZERS = {
    "fp16": (quantize_fp16, False),
    "w8": (quantize_w8, False),
    "w4g128p": (quantize_w4_g128_progressive, True),
    "w4chn": (quantize_w4_channel, False),
    "w4g128": (quantize_w4_g128, True),
}
