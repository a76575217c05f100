"""Error-compensated rounding (GPTQ) onto each format's grid.

Round-to-nearest treats every weight alone. GPTQ rounds one input column at a time and moves the
rounding error onto the columns not yet rounded, weighted by the inverse Hessian of the layer's
calibration inputs (H = X^T X), so the layer output, not the weights, stays close. The grids
are those of shared.quant.weights; group parameters are taken from the error-updated weights
when each group of 128 starts, with the group's searched clip ratio.

Once every code is fixed, each row's own fp16 scale (s1 of the progressive format, the per-channel
scale) is refitted by least squares in the same metric: the codes' rounding errors are not zero-mean
along a row once errors have been pushed onto later columns and clipped, and one free scalar per
row takes out the part of the output error parallel to the row (fixture, 2 CPU cores, session 14:
g128 5.1148 -> 5.1083, chn 5.1340 -> 5.1306, all else default).
"""

from __future__ import annotations

import torch

from shared.formats.weights import (
    GROUP_SIZE,
    PROTECTIVE_RANGE,
    PackedWeight,
    W4ChannelWeight,
    W4G128ProgressiveWeight,
    W4G128Weight,
    W8Weight,
    pack_codes,
)
from shared.quant.weights import (
    UINT4_MAX,
    asymmetric_uint4_params,
    int8_channel_scale,
    progressive_group_params,
    progressive_level1,
    progressive_safe_code_range,
)

DAMPING = 0.01  # of the mean Hessian diagonal, keeps the Cholesky factorization stable


class _Grid:
    """The quantization grid of one format: per-row parameters and per-group parameters."""

    def __init__(self, kind: str, w: torch.Tensor, clip: torch.Tensor | None):
        self.kind = kind
        n, k = w.shape
        self.clip = clip
        self._group_params: dict[int, tuple[torch.Tensor, ...]] = {}  # g -> fp32 columns round_column reuses
        self.codes = torch.zeros(n, k, dtype=torch.uint8, device=w.device)
        if kind == "w4g128p":
            self.s1 = progressive_level1(w)[1]
            self.s2 = torch.zeros(n, k // GROUP_SIZE, dtype=torch.uint8, device=w.device)
            self.zero = torch.zeros_like(self.s2)
        elif kind == "w4g128":
            self.scale = torch.zeros(n, k // GROUP_SIZE, dtype=torch.float16, device=w.device)
            self.zero = torch.zeros(n, k // GROUP_SIZE, dtype=torch.uint8, device=w.device)
        elif kind == "w4chn":
            self.scale, zero = asymmetric_uint4_params(w, clip if clip is not None else 1.0)
            self.zero = zero.half()
        elif kind == "w8":
            self.scale = int8_channel_scale(w, clip if clip is not None else 1.0)
        else:
            raise ValueError(f"GPTQ has no grid for weight kind {kind!r}")

    def start_group(self, g: int, wg: torch.Tensor) -> None:
        """wg (N, 128): the current (error-updated) weights of group g."""
        ratio = self.clip[:, g] if self.clip is not None else 1.0
        self._group_params.pop(g, None)
        if self.kind == "w4g128p":
            w8 = torch.round(wg / self.s1.float()[:, None]).clamp_(-PROTECTIVE_RANGE, PROTECTIVE_RANGE)
            s2, zero = progressive_group_params(w8, ratio)
            self.s2[:, g], self.zero[:, g] = s2.to(torch.uint8), zero.to(torch.uint8)
        elif self.kind == "w4g128":
            scale, zero = asymmetric_uint4_params(wg, ratio)
            self.scale[:, g], self.zero[:, g] = scale, zero.to(torch.uint8)

    def round_column(self, j: int, w: torch.Tensor) -> torch.Tensor:
        """Rounds column j (N,) onto the grid, records its codes, returns the dequantized column."""
        g = j // GROUP_SIZE
        if self.kind == "w4g128p":
            step, zero, q_lo, q_hi, s1 = self._progressive_params(g)
            q = torch.minimum(torch.maximum(torch.round(w / (s1 * step)) + zero, q_lo), q_hi)
            self.codes[:, j] = q.to(torch.uint8)
            return (q - zero) * step * s1
        if self.kind == "w8":
            q = torch.round(w / self.scale.float()).clamp_(-127, 127)
            self.codes[:, j] = q.to(torch.int8).view(torch.uint8)
            return q * self.scale.float()
        scale = (self.scale[:, g] if self.kind == "w4g128" else self.scale).float()
        zero = (self.zero[:, g] if self.kind == "w4g128" else self.zero).float()
        q = (torch.round(w / scale) + zero).clamp_(0, UINT4_MAX)
        self.codes[:, j] = q.to(torch.uint8)
        return (q - zero) * scale

    def _progressive_params(self, g: int) -> tuple[torch.Tensor, ...]:
        """(step, zero, q_lo, q_hi, s1) of group g as fp32 (N,), computed once per group: the 128
        columns of a group share them, and recomputing them per column was a tenth of quantizing."""
        if g not in self._group_params:
            q_lo, q_hi = progressive_safe_code_range(self.s2[:, g], self.zero[:, g])
            self._group_params[g] = (self.s2[:, g].float(), self.zero[:, g].float(), q_lo, q_hi, self.s1.float())
        return self._group_params[g]

    def refit_row_scales(self, w: torch.Tensor, h: torch.Tensor) -> None:
        """Each row's scale c minimizing (w - c u) H (w - c u)^T for its fixed integer row u:
        c = w H u^T / u H u^T (rows with u H u^T = 0, all-zero codes, keep theirs). Only the
        formats whose row scale is a free fp16 number; the codes and group parameters stay."""
        if self.kind == "w4g128p":
            zero = self.zero.float().repeat_interleave(GROUP_SIZE, 1)
            u = (self.codes.float() - zero) * self.s2.float().repeat_interleave(GROUP_SIZE, 1)
            old = self.s1
        elif self.kind == "w4chn":
            u = self.codes.float() - self.zero.float()[:, None]
            old = self.scale
        else:
            return
        uh = u @ h
        num = ((w @ h) * u).sum(1)
        den = (uh * u).sum(1)
        fitted = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), old.float()).half()
        if self.kind == "w4g128p":
            self.s1 = fitted
        else:
            self.scale = fitted

    def packed(self) -> PackedWeight:
        if self.kind == "w4g128p":
            return W4G128ProgressiveWeight(qweight=pack_codes(self.codes), s1=self.s1, s2=self.s2, zero=self.zero)
        if self.kind == "w4g128":
            return W4G128Weight(qweight=pack_codes(self.codes), scale=self.scale, zero=self.zero)
        if self.kind == "w4chn":
            return W4ChannelWeight(qweight=pack_codes(self.codes), scale=self.scale, zero=self.zero)
        return W8Weight(qweight=self.codes.view(torch.int8), scale=self.scale)


def gptq_quantize(
    w: torch.Tensor, hessian: torch.Tensor, kind: str, clip: torch.Tensor | None = None, act_order: bool = True
) -> PackedWeight:
    """w (N, K) fp32, hessian (K, K) = sum of x^T x over calibration tokens -> packed weight.

    act_order: round the columns with the largest Hessian diagonal (most active inputs) first,
    while their errors can still be compensated by many columns; group parameters are then
    fixed up front from the original weights, since groups are no longer visited in order.
    """
    w = w.float().clone()
    target = w.clone()  # the weights the refit of row scales aims at (w is error-updated below)
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMPING * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    grid = _Grid(kind, w, clip)
    grouped = kind in ("w4g128p", "w4g128")
    order = torch.arange(k, device=w.device)
    if act_order:
        if grouped:
            for g in range(k // GROUP_SIZE):
                grid.start_group(g, w[:, g * GROUP_SIZE : (g + 1) * GROUP_SIZE])
        order = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, order], h[order][:, order]
    # Upper Cholesky factor of H^-1: row j holds the update coefficients for columns after j.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    order = order.tolist()
    block = GROUP_SIZE if k % GROUP_SIZE == 0 else k
    for start in range(0, k, block):
        end = min(start + block, k)
        w_blk = w[:, start:end].clone()
        h_blk = hinv[start:end, start:end]
        err_blk = torch.zeros_like(w_blk)
        if grouped and not act_order:
            grid.start_group(start // GROUP_SIZE, w_blk)
        for i in range(end - start):
            col = w_blk[:, i]
            deq = grid.round_column(order[start + i], col)
            err = (col - deq) / h_blk[i, i]
            w_blk[:, i:] -= err[:, None] * h_blk[i, i:][None, :]
            err_blk[:, i] = err
        w[:, end:] -= err_blk @ hinv[start:end, end:]
    grid.refit_row_scales(target, hessian.float())
    return grid.packed()
