"""Weight clipping: per output channel (or per group) the range shrink that minimizes output error.

Clipping a few outlier weights lets the other weights of the channel or group use finer steps.
For each candidate ratio the error is measured on calibration inputs, ||X_g (W_g - Q(W_g))^T||^2
per group g (per whole row for per-channel formats), and each group keeps its best ratio.
"""

from __future__ import annotations

import torch

from shared.formats.weights import GROUP_SIZE
from shared.quant.weights import WEIGHT_QUANTIZERS


def candidate_ratios(min_ratio: float, steps: int) -> list[float]:
    if steps == 1:
        return [1.0]
    return [1.0 - i * (1.0 - min_ratio) / (steps - 1) for i in range(steps)]


def search_clip_ratios(x: torch.Tensor, w: torch.Tensor, weight_kind: str, ratios: list[float]) -> torch.Tensor | None:
    """x (T, K), w (N, K) -> best ratios, (N, G) for group formats, (N,) otherwise; None if unclippable."""
    quantize, per_group = WEIGHT_QUANTIZERS[weight_kind]
    if weight_kind == "fp16":
        return None
    n, k = w.shape
    shape = (n, k // GROUP_SIZE) if per_group else (n,)
    best_err = torch.full(shape, float("inf"), device=w.device)
    best_ratio = torch.ones(shape, device=w.device)
    xg = x.view(x.shape[0], -1, GROUP_SIZE) if per_group else None  # (T, G, 128)
    for ratio in ratios:
        dq = w - quantize(w, torch.full(shape, ratio, device=w.device)).dequantize().to(w)  # (N, K)
        if per_group:
            # err[n, g] = sum_t (X[t, g, :] . dq[n, g, :])^2
            out = torch.einsum("tgj,ngj->ngt", xg, dq.view(n, -1, GROUP_SIZE))
            err = out.pow(2).sum(dim=-1)
        else:
            err = (x @ dq.t()).pow(2).sum(dim=0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio
