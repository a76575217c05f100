"""Weight clipping: per output channel (or per group) the range shrink that minimizes output error.

Clipping a few outlier weights lets the other weights of the channel or group use finer steps.
For each candidate ratio the error is measured on calibration inputs, ||X_g (W_g - Q(W_g))^T||^2
per group g (per whole row for per-channel formats), and each group keeps its best ratio. The
error is computed from the layer's Hessian H = X^T X over every calibration token
(d^T H_g d per group of 128), which costs 128 multiply-adds per weight instead of one per token.
"""

from __future__ import annotations

import torch

from shared.formats.weights import GROUP_SIZE
from shared.quant.weights import WEIGHT_QUANTIZERS


def candidate_ratios(min_ratio: float, steps: int) -> list[float]:
    if steps == 1:
        return [1.0]
    return [1.0 - i * (1.0 - min_ratio) / (steps - 1) for i in range(steps)]


def search_clip_ratios(hessian: torch.Tensor, w: torch.Tensor, weight_kind: str, ratios: list[float]) -> torch.Tensor | None:
    """hessian (K, K) = X^T X, w (N, K) -> best ratios, (N, G) for group formats, (N,) otherwise;
    None if the kind has nothing to clip."""
    quantize, per_group = WEIGHT_QUANTIZERS[weight_kind]
    if weight_kind == "fp16":
        return None
    n, k = w.shape
    shape = (n, k // GROUP_SIZE) if per_group else (n,)
    best_err = torch.full(shape, float("inf"), device=w.device)
    best_ratio = torch.ones(shape, device=w.device)
    groups = k // GROUP_SIZE
    if per_group:  # the diagonal (128, 128) blocks of H, one per group: (G, 128, 128)
        blocks = hessian.view(groups, GROUP_SIZE, groups, GROUP_SIZE).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    for ratio in ratios:
        dq = w - quantize(w, torch.full(shape, ratio, device=w.device)).dequantize().to(w)  # (N, K)
        if per_group:
            d = dq.view(n, groups, GROUP_SIZE)
            err = (torch.einsum("ngi,gij->ngj", d, blocks) * d).sum(dim=-1)  # (N, G): d^T H_g d
        else:
            err = ((dq @ hessian) * dq).sum(dim=-1)  # (N,)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio
