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

import torch
import torch.nn.functional as F

from shared.formats.artifact import BLOCK_LINEARS
from shared.formats.kv4 import FULL_KV_RANGE
from shared.model.config import LlamaConfig
from shared.model.llama import attention, rms_norm
from shared.quant.activations import fake_quantize_per_token
from shared.quant.block import WorkBlock

RIDGE = 0.1  # of the mean diagonal of H~, pulling W* toward W where X~ gives little information


def gemm_input(a: torch.Tensor, activation_bits: int) -> torch.Tensor:
    """A linear's input as its GEMM sees it: int8-rounded per token at 8 activation bits, else as is."""
    return fake_quantize_per_token(a) if activation_bits == 8 else a


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
    key_feedback: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (B, T, H) -> the input of linear `until` (B*T, K) as its GEMM sees it (int8-rounded when
    activation_bits is 8), or the block output (B, T, H) when until is None.

    weights: name -> (N, K) fp32, the dequantized weights of the linears before `until`.
    kv_range, key_feedback: the layer's KV4 write (shared.formats.kv4), as the cache write applies it.
    """
    c = config

    def quantize(a: torch.Tensor) -> torch.Tensor:
        return gemm_input(a, activation_bits)

    def linear(name: str, a: torch.Tensor) -> torch.Tensor:
        return quantize(a) @ weights[name].t()

    b, t, _ = x.shape
    h = rms_norm(x, work.attn_norm, c.rms_norm_eps)
    if until == "qkv":
        return quantize(h).reshape(b * t, -1)
    attn = attention(c, linear("qkv", h), cos, sin, kv_bits, kv_range=kv_range, key_feedback=key_feedback)  # as the reference block
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


def _add_stats(stats, xq: torch.Tensor, xf: torch.Tensor):
    """Adds one batch's X~^T X~ and X~^T X to stats (None at the first batch)."""
    hb, cb = xq.t() @ xq, xq.t() @ xf
    return (hb, cb) if stats is None else (stats[0] + hb, stats[1] + cb)


def compensated_weight(w: torch.Tensor, h_q: torch.Tensor, cross: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """w (N, K), H~ and C (K, K) -> W* = argmin ||X W^T - X~ W*^T||^2 + lam ||W* - W||^2 (fp32)."""
    h = h_q.double()
    lam = ridge * torch.diagonal(h).mean().clamp_min(1e-12)
    k = h.shape[0]
    rhs = cross.double() @ w.double().t() + lam * w.double().t()  # (K, N)
    sol = torch.linalg.solve(h + lam * torch.eye(k, dtype=h.dtype, device=h.device), rhs)
    return sol.t().float()


class BlockInputs:
    """H~ and C of each linear of a block, in forward order, over the calibration batches.

    block_forward_until gives the same inputs from scratch, which runs the block's prefix once per
    linear and per path (the attention up to six times per block). Here each path (fp, quantized)
    keeps, per batch, the input of the linear reached last and advances it past that linear once
    its quantized weight exists: one attention per path and block. What is kept is one tensor
    per path of the calibration x's size (the attention output or the MLP's normed input, H or
    heads * D wide); down_proj's wider input is made per batch and dropped.
    """

    def __init__(self, config: LlamaConfig, work: WorkBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 activation_bits: int, kv_bits: int, batch: int, kv_range: tuple[float, float] = FULL_KV_RANGE,
                 key_feedback: torch.Tensor | None = None):
        self.config, self.work, self.x, self.cos, self.sin = config, work, x, cos, sin
        self.activation_bits, self.kv_bits, self.kv_range = activation_bits, kv_bits, kv_range
        self.key_feedback = key_feedback  # the quantized path's KV4 keys, as the cache write rounds them
        self.batches = [slice(start, start + batch) for start in range(0, x.shape[0], batch)]
        self.fp_weights = {n: getattr(work, n) for n in BLOCK_LINEARS}
        normed = [rms_norm(x[sl], work.attn_norm, config.rms_norm_eps) for sl in self.batches]
        self.fp_inputs, self.q_inputs = normed, list(normed)  # qkv's input is the same in both paths
        self.reached = 0  # index in BLOCK_LINEARS of the linear whose inputs are kept

    def stats(self, name: str, quantized: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """H~, C (K, K) for linear `name`, the next in forward order; quantized holds the
        dequantized weights (N, K) fp32 of the linears before it."""
        index = BLOCK_LINEARS.index(name)
        if index not in (self.reached, self.reached + 1):
            raise ValueError(f"linear {name!r} asked out of forward order (inputs kept at {BLOCK_LINEARS[self.reached]!r})")
        if not self.fp_inputs:
            raise ValueError(f"the block's inputs were released after its last linear; {name!r} asked again")
        last = index == len(BLOCK_LINEARS) - 1  # no linear after it: its inputs are not kept
        stats = None
        for i, sl in enumerate(self.batches):
            xf, xq = self.fp_inputs[i], self.q_inputs[i]
            if index > self.reached:
                prev = BLOCK_LINEARS[self.reached]
                xf = self._advance(prev, xf, self.fp_weights, sl, 16, 16)
                xq = self._advance(prev, xq, quantized, sl, self.activation_bits, self.kv_bits)
                if not last:
                    self.fp_inputs[i], self.q_inputs[i] = xf, xq
            xq8 = gemm_input(xq, self.activation_bits)
            stats = _add_stats(stats, xq8.reshape(-1, xq8.shape[-1]), xf.reshape(-1, xf.shape[-1]))
        if last:
            self.fp_inputs = self.q_inputs = []
        self.reached = index
        return stats

    def _advance(self, done: str, a: torch.Tensor, weights: dict[str, torch.Tensor], sl: slice,
                 activation_bits: int, kv_bits: int) -> torch.Tensor:
        """a (B, T, K), linear `done`'s input -> the next linear's input, as block_forward_until
        (kv_bits 4: the quantized path, with the layer's KV4 write)."""
        c = self.config
        y = gemm_input(a, activation_bits) @ weights[done].t()
        if done == "qkv":
            if kv_bits != 4:
                return attention(c, y, self.cos, self.sin, kv_bits)
            return attention(c, y, self.cos, self.sin, kv_bits, kv_range=self.kv_range, key_feedback=self.key_feedback)
        if done == "o":
            return rms_norm(self.x[sl] + y, self.work.mlp_norm, c.rms_norm_eps)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
