"""Input-error compensation: fit each linear to its fp output from the inputs the quantized model gives it.

GPTQ minimizes ||X W^T - X Q(W)^T||^2 with X the layer's fp inputs. The quantized model feeds the
layer other inputs, X~ = X + E: int8 activations, the KV4 cache inside attention (o_proj's input),
the already quantized linears before it in the block (q/k/v before o_proj, o_proj before
gate/up, gate/up before down_proj) and every quantized block before. The target that matters is

    min over Q(W) of ||X W^T - X~ Q(W)^T||^2.

With H~ = X~^T X~ and C = X~^T X, the least-squares weight is W* = W C^T H~^-1, and
||X W^T - X~ Q^T||^2 = ||X W^T - X~ W*^T||^2 + ||X~ (W* - Q)^T||^2 exactly (the residual of a
least-squares fit is orthogonal to X~'s columns). So rounding W* with GPTQ on H~ (and searching the
clip ratios on H~) minimizes the whole objective: the same quantizer, a corrected weight and Hessian.
The fit is regularized toward W (ridge on W* - W): H~ can be ill-conditioned, and a fitted
weight whose rows or groups grow their range gets a coarser grid (per-channel formats most).

The linears of a block are done in order, each with the quantized ones before it in the
forward. Blocks start from the fp model's input (the calibration x every step uses): measured on
the fixture, also carrying the quantized model's block outputs into the next block (so later
blocks fit away earlier blocks' error) cost perplexity, while the within-block fit gained.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from shared.formats.artifact import BLOCK_LINEARS
from shared.formats.kv4 import FULL_KV_RANGE
from shared.model.config import LlamaConfig
from shared.model.llama import attention, rms_norm
from shared.quant.activations import fake_quantize_per_token
from shared.quant.block import WorkBlock

RIDGE = 0.1  # of the mean diagonal of H~, pulling W* toward W where X~ gives little information


def block_forward_until(
    config: LlamaConfig,
    work: WorkBlock,
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    activation_bits: int,
    kv_bits: int,
    until: str | None = None,
    kv_range: tuple[float, float] = FULL_KV_RANGE,
) -> torch.Tensor:
    """x (B, T, H) -> the input of linear `until` (B*T, K) as its GEMM sees it (int8-rounded when
    activation_bits is 8), or the block output (B, T, H) when until is None.

    weights: name -> (N, K) fp32, the dequantized weights of the linears before `until`.
    kv_range: the layer's KV4 range ratios (shared.formats.kv4), as the cache write applies them.
    """
    c = config
    quantize = fake_quantize_per_token if activation_bits == 8 else (lambda a: a)

    def linear(name: str, a: torch.Tensor) -> torch.Tensor:
        return quantize(a) @ weights[name].t()

    b, t, _ = x.shape
    h = rms_norm(x, work.attn_norm, c.rms_norm_eps)
    if until == "qkv":
        return quantize(h).reshape(b * t, -1)
    attn = attention(c, linear("qkv", h), cos, sin, kv_bits, kv_range=kv_range)  # (B, T, heads * D), as the reference block
    if until == "o":
        return quantize(attn).reshape(b * t, -1)
    x = x + linear("o", attn)
    h2 = rms_norm(x, work.mlp_norm, c.rms_norm_eps)
    if until == "gate_up":
        return quantize(h2).reshape(b * t, -1)
    gate, up = linear("gate_up", h2).chunk(2, dim=-1)
    act = F.silu(gate) * up
    if until == "down":
        return quantize(act).reshape(b * t, -1)
    return x + linear("down", act)


def compensation_stats(
    inputs_fp: Callable[[slice], torch.Tensor],
    inputs_q: Callable[[slice], torch.Tensor],
    samples: int,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> H~ = X~^T X~ and C = X~^T X (K, K), accumulated over calibration batches of sequences."""
    h = c = None
    for start in range(0, samples, batch):
        sl = slice(start, start + batch)
        xf, xq = inputs_fp(sl), inputs_q(sl)
        hb, cb = xq.t() @ xq, xq.t() @ xf
        h = hb if h is None else h + hb
        c = cb if c is None else c + cb
    return h, c


def compensated_weight(w: torch.Tensor, h_q: torch.Tensor, cross: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """w (N, K), H~ and C (K, K) -> W* = argmin ||X W^T - X~ W*^T||^2 + lam ||W* - W||^2 (fp32)."""
    h = h_q.double()
    lam = ridge * torch.diagonal(h).mean().clamp_min(1e-12)
    k = h.shape[0]
    rhs = cross.double() @ w.double().t() + lam * w.double().t()  # (K, N)
    sol = torch.linalg.solve(h + lam * torch.eye(k, dtype=h.dtype, device=h.device), rhs)
    return sol.t().float()


def quantized_inputs_for(
    config: LlamaConfig,
    work: WorkBlock,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    activation_bits: int,
    kv_bits: int,
    quantized: dict[str, torch.Tensor],
    name: str,
    batch: int,
    kv_range: tuple[float, float] = FULL_KV_RANGE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """H~, C for linear `name` over calibration inputs x (N, T, H): X from the fp block, X~ from
    the quantized block (the dequantized `quantized` weights, int8 activations, KV4 with the
    layer's range ratios)."""
    fp_weights = {n: getattr(work, n) for n in BLOCK_LINEARS}

    def fp(sl):
        return block_forward_until(config, work, fp_weights, x[sl], cos, sin, 16, 16, name)

    def q(sl):
        return block_forward_until(config, work, quantized, x[sl], cos, sin, activation_bits, kv_bits, name, kv_range)

    return compensation_stats(fp, q, x.shape[0], batch)
