"""4-bit packing, defined once for weights and the KV cache.

Two nibbles share a byte, and the pair is (i, i + HALF) inside a chunk rather than (2i, 2i + 1):
a kernel then unpacks a loaded tile into two contiguous halves with a mask and a shift, and
multiplies each half by its own slice of the other operand, with no interleaving shuffle.
"""

from __future__ import annotations

import torch

# Weights are packed in chunks of 128 along K (the quantization group size, and a kernel's K tile).
WEIGHT_PACK_CHUNK = 128


def pack_halves(q: torch.Tensor, chunk: int) -> torch.Tensor:
    """q (..., K) uint8 in [0, 15] -> (..., K // 2) uint8.

    Layout: within each chunk of `chunk` values along the last axis, byte j holds value j in its
    low nibble and value j + chunk/2 in its high nibble.
    """
    if q.shape[-1] % chunk:
        raise ValueError(f"last dimension {q.shape[-1]} is not a multiple of the pack chunk {chunk}")
    if q.dtype != torch.uint8:
        raise TypeError(f"expected uint8 values in [0, 15], got {q.dtype}")
    lead = q.shape[:-1]
    chunks = q.reshape(*lead, -1, 2, chunk // 2)  # (..., K/chunk, {low half, high half}, chunk/2)
    packed = chunks[..., 0, :] | (chunks[..., 1, :] << 4)
    return packed.reshape(*lead, q.shape[-1] // 2)


def unpack_halves(packed: torch.Tensor, chunk: int) -> torch.Tensor:
    """Inverse of pack_halves: (..., K // 2) uint8 -> (..., K) uint8 in [0, 15]."""
    lead = packed.shape[:-1]
    half = chunk // 2
    if packed.shape[-1] % half:
        raise ValueError(f"packed last dimension {packed.shape[-1]} is not a multiple of {half}")
    chunks = packed.reshape(*lead, -1, half)
    low, high = chunks & 0xF, chunks >> 4
    return torch.stack([low, high], dim=-2).reshape(*lead, packed.shape[-1] * 2)
