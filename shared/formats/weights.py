"""On-disk layouts of a linear layer's weight, one class per format, and what each one means.

Every class names its tensors (the safetensors keys under a layer prefix), checks shapes and dtypes
when built, and gives the reference meaning of its bits with `dequantize()`. The quantizer makes
them (shared/quant), the reference model and the kernels read them; nothing else decides a layout.
Shapes: N = output features, K = input features, G = K // GROUP_SIZE.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from shared.formats.nibbles import WEIGHT_PACK_CHUNK, pack_halves, unpack_halves

GROUP_SIZE = 128
# Level-1 int8 range of progressive group quantization: narrower than [-127, 127] so that the
# level-2 dequantization (q - z) * s2 of any produced code stays inside int8 (QServe's protective range).
PROTECTIVE_RANGE = 119


class FormatError(ValueError):
    """Tensors that do not have the shape or dtype the format defines."""


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise FormatError(f"{name}: expected {tuple(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")


def _matrix(name: str, t: torch.Tensor) -> tuple[int, int]:
    """t's (rows, columns); a FormatError for another rank (unpacking its shape would be a bare ValueError)."""
    if t.dim() != 2:
        raise FormatError(f"{name}: expected a 2-D tensor, got {tuple(t.shape)} {t.dtype}")
    return tuple(t.shape)


def _check_groups(half_k: int) -> None:
    """4-bit kinds pack K in chunks of WEIGHT_PACK_CHUNK (= GROUP_SIZE): K must be a multiple of it."""
    if (half_k * 2) % WEIGHT_PACK_CHUNK:
        raise FormatError(f"qweight: K = {half_k * 2} is not a multiple of the group / pack size {WEIGHT_PACK_CHUNK}")


@dataclass(slots=True)
class PackedWeight:
    kind: ClassVar[str]
    codes_per_byte: ClassVar[int] = 1  # along K in the first tensor: 2 for the 4-bit kinds' (N, K // 2) qweight

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{f.name}": getattr(self, f.name).contiguous() for f in fields(self)}

    @classmethod
    def from_tensors(cls, prefix: str, tensors: dict[str, torch.Tensor]):
        try:
            return cls(**{f.name: tensors[f"{prefix}.{f.name}"] for f in fields(cls)})
        except KeyError as e:
            raise FormatError(f"{cls.kind} weight {prefix!r} lacks tensor {e.args[0]!r}") from None

    @property
    def out_features(self) -> int:
        return getattr(self, fields(self)[0].name).shape[0]

    @property
    def in_features(self) -> int:
        return getattr(self, fields(self)[0].name).shape[1] * self.codes_per_byte

    @classmethod
    def stored_bytes(cls, n: int, k: int) -> int:
        """Bytes of this kind's tensors for an (n, k) linear: what a free-space check adds up before quantizing."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError


@dataclass(slots=True)
class Fp16Weight(PackedWeight):
    kind: ClassVar[str] = "fp16"
    weight: torch.Tensor  # (N, K) fp16

    def __post_init__(self):
        if self.weight.dim() != 2 or self.weight.dtype != torch.float16:
            raise FormatError(f"fp16 weight: expected 2-D float16, got {tuple(self.weight.shape)} {self.weight.dtype}")

    @classmethod
    def stored_bytes(cls, n: int, k: int) -> int:
        return 2 * n * k

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()


@dataclass(slots=True)
class W8Weight(PackedWeight):
    """Per-output-channel symmetric int8 (W8A8): w = qweight * scale."""

    kind: ClassVar[str] = "w8"
    qweight: torch.Tensor  # (N, K) int8 in [-127, 127]
    scale: torch.Tensor  # (N,) fp16

    def __post_init__(self):
        n, k = _matrix("qweight", self.qweight)
        _check("qweight", self.qweight, (n, k), torch.int8)
        _check("scale", self.scale, (n,), torch.float16)

    @classmethod
    def stored_bytes(cls, n: int, k: int) -> int:
        return n * k + 2 * n

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]


@dataclass(slots=True)
class W4G128ProgressiveWeight(PackedWeight):
    """QoQ progressive group quantization (w4a8kv4-g128).

    w8 = (q - zero) * s2  exactly, in int8 (codes never leave [-128, 127], see PROTECTIVE_RANGE);
    w  = w8 * s1.  The GEMM runs int8 x int8 -> int32 on w8 and multiplies s1 in the epilogue.
    """

    kind: ClassVar[str] = "w4g128p"
    codes_per_byte: ClassVar[int] = 2
    qweight: torch.Tensor  # (N, K // 2) uint8, nibbles packed by nibbles.pack_halves in chunks of 128
    s1: torch.Tensor  # (N,) fp16, level-1 per-channel scale
    s2: torch.Tensor  # (N, G) uint8 in [1, 16], level-2 group scale (an integer on the int8 grid)
    zero: torch.Tensor  # (N, G) uint8 in [0, 15], level-2 group zero point

    def __post_init__(self):
        n, half_k = _matrix("qweight", self.qweight)
        g = half_k * 2 // GROUP_SIZE
        _check_groups(half_k)
        _check("qweight", self.qweight, (n, half_k), torch.uint8)
        _check("s1", self.s1, (n,), torch.float16)
        _check("s2", self.s2, (n, g), torch.uint8)
        _check("zero", self.zero, (n, g), torch.uint8)

    def codes(self) -> torch.Tensor:
        return unpack_halves(self.qweight, WEIGHT_PACK_CHUNK)  # (N, K) uint8

    def int8_weight(self) -> torch.Tensor:
        """(N, K) int8: the level-2 dequantization a kernel does in registers."""
        q = self.codes().to(torch.int16).unflatten(1, (-1, GROUP_SIZE))  # (N, G, 128)
        w8 = (q - self.zero.to(torch.int16)[..., None]) * self.s2.to(torch.int16)[..., None]
        return w8.flatten(1).to(torch.int8)

    @classmethod
    def stored_bytes(cls, n: int, k: int) -> int:
        return n * k // 2 + 2 * n + 2 * n * (k // GROUP_SIZE)

    def dequantize(self) -> torch.Tensor:
        return self.int8_weight().float() * self.s1.float()[:, None]


@dataclass(slots=True)
class W4ChannelWeight(PackedWeight):
    """Per-channel asymmetric uint4 (w4a8kv4-chn): w = (q - zero) * scale.

    The GEMM multiplies the raw codes q (as int8) by int8 activations and subtracts
    zero * rowsum(x8) in the epilogue, so no per-element zero subtraction happens in the main loop.
    """

    kind: ClassVar[str] = "w4chn"
    codes_per_byte: ClassVar[int] = 2
    qweight: torch.Tensor  # (N, K // 2) uint8, nibbles packed by nibbles.pack_halves in chunks of 128
    scale: torch.Tensor  # (N,) fp16
    zero: torch.Tensor  # (N,) fp16, an integer in [0, 15]

    def __post_init__(self):
        n, half_k = _matrix("qweight", self.qweight)
        _check_groups(half_k)
        _check("qweight", self.qweight, (n, half_k), torch.uint8)
        _check("scale", self.scale, (n,), torch.float16)
        _check("zero", self.zero, (n,), torch.float16)

    def codes(self) -> torch.Tensor:
        return unpack_halves(self.qweight, WEIGHT_PACK_CHUNK)

    @classmethod
    def stored_bytes(cls, n: int, k: int) -> int:
        return n * k // 2 + 4 * n

    def dequantize(self) -> torch.Tensor:
        return (self.codes().float() - self.zero.float()[:, None]) * self.scale.float()[:, None]


@dataclass(slots=True)
class W4G128Weight(PackedWeight):
    """Per-group asymmetric uint4 with fp16 scales (w4a16-g128, weight-only): w = (q - zero) * scale."""

    kind: ClassVar[str] = "w4g128"
    codes_per_byte: ClassVar[int] = 2
    qweight: torch.Tensor  # (N, K // 2) uint8, nibbles packed by nibbles.pack_halves in chunks of 128
    scale: torch.Tensor  # (N, G) fp16
    zero: torch.Tensor  # (N, G) uint8 in [0, 15]

    def __post_init__(self):
        n, half_k = _matrix("qweight", self.qweight)
        g = half_k * 2 // GROUP_SIZE
        _check_groups(half_k)
        _check("qweight", self.qweight, (n, half_k), torch.uint8)
        _check("scale", self.scale, (n, g), torch.float16)
        _check("zero", self.zero, (n, g), torch.uint8)

    @classmethod
    def stored_bytes(cls, n: int, k: int) -> int:
        return n * k // 2 + 3 * n * (k // GROUP_SIZE)

    def dequantize(self) -> torch.Tensor:
        q = unpack_halves(self.qweight, WEIGHT_PACK_CHUNK).float().unflatten(1, (-1, GROUP_SIZE))
        w = (q - self.zero.float()[..., None]) * self.scale.float()[..., None]
        return w.flatten(1)


WEIGHT_KINDS: dict[str, type[PackedWeight]] = {
    cls.kind: cls for cls in (Fp16Weight, W8Weight, W4G128ProgressiveWeight, W4ChannelWeight, W4G128Weight)
}


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes in [0, 15] -> qweight (N, K // 2) in the layout every 4-bit kind uses."""
    return pack_halves(q, WEIGHT_PACK_CHUNK)
