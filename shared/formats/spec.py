"""The artifact formats: which weight layout, activation precision and KV cache each one uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class FormatSpec:
    name: str
    weight_kind: str  # a key of shared.formats.weights.WEIGHT_KINDS
    activation_bits: int  # 8: per-token symmetric int8 before every GEMM; 16: fp16 activations
    kv_bits: int  # 4: KV4 cache (shared.formats.kv4); 16: fp16 cache
    needs_groups: bool  # hidden and FFN sizes must be multiples of the group size
    description: str


FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in (
        FormatSpec("w4a8kv4-g128", "w4g128p", 8, 4, True, "QoQ: progressive int8->uint4 groups of 128, int8 activations, KV4"),
        FormatSpec("w4a8kv4-chn", "w4chn", 8, 4, True, "QoQ: per-channel uint4, int8 activations, KV4"),
        FormatSpec("w8a8", "w8", 8, 16, False, "per-channel int8 weights, int8 activations, fp16 KV"),
        FormatSpec("w4a16-g128", "w4g128", 16, 16, True, "weight-only uint4 groups of 128, fp16 activations and KV"),
        FormatSpec("fp16", "fp16", 16, 16, False, "the unquantized baseline"),
    )
}


def format_spec(name: str) -> FormatSpec:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of: {', '.join(FORMATS)}") from None
