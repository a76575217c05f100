"""Block-input rotation: an orthogonal matrix R applied to the residual stream, folded into weights.

RMSNorm commutes with R once its weight is folded into the next linear (RMS is rotation
invariant), so the rotated model computes the same function while outlier channels of the
block inputs are spread over all channels, which makes per-token int8 activations far easier.
"""

from __future__ import annotations

import torch


def hadamard(n: int) -> torch.Tensor:
    """(n, n) Sylvester Hadamard matrix, n a power of two, entries +-1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation_matrix(n: int, seed: int = 0) -> torch.Tensor:
    """(n, n) fp64 orthogonal: a randomized Hadamard (random sign flips) for powers of two,
    a seeded random orthogonal matrix otherwise. Deterministic for a given (n, seed)."""
    g = torch.Generator().manual_seed(seed)
    if n & (n - 1) == 0:
        signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
        return signs[:, None] * hadamard(n) / n**0.5
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]
