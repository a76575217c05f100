"""QoQ on one decoder block: transform the fp weights with calibration activations, then quantize.

Order: fold norms + rotate (block inputs) -> one fp forward capturing every GEMM input ->
SmoothAttention (K) -> smoothing (o_proj, down_proj inputs) -> KV4 range ratios and key feedback ->
reorder (down_proj input) -> clip search -> rounding of each linear (GPTQ error compensation, or round-to-nearest). Every transform keeps the block's fp function unchanged,
so the block output of the capture forward is the next block's calibration input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.formats.artifact import BLOCK_LINEARS
from shared.formats.kv4 import FULL_KV_RANGE
from shared.formats.spec import FormatSpec
from shared.formats.weights import PackedWeight
from shared.model.config import LlamaConfig
from shared.model.llama import block_forward
from shared.quant.block import WorkBlock
from shared.quant.compensation import BlockInputs, compensated_weight
from shared.quant.gptq import gptq_quantize
from shared.quant.clipping import candidate_ratios, search_clip_ratios
from shared.quant.options import QoQOptions
from shared.quant.reorder import apply_down_reorder, salience_order
from shared.model.rope import apply_rope
from shared.quant.key_feedback import key_feedback_for_block, query_moment_of
from shared.quant.kv_range import search_value_ratio, value_channel_weights
from shared.quant.smooth_attention import apply_smooth_attention, search_smooth_attention, smooth_attention_scales
from shared.quant.smoothing import apply_down_smoothing, apply_o_smoothing, search_scales, tie_over_query_groups
from shared.quant.weights import WEIGHT_QUANTIZERS

FORWARD_BATCH = 8  # calibration samples per capture forward; bounds activation memory


@dataclass(slots=True)
class Captured:
    """What the searches need: smoothed GEMM inputs on a token subsample, maxima, Hessians."""

    o_in: torch.Tensor  # (S, heads*D)
    down_in: torch.Tensor  # (S, F)
    k_absmax: torch.Tensor  # (kv_heads, D) over every calibration token, pre-RoPE
    q_absmax: torch.Tensor  # (heads, D) likewise
    q_sub: torch.Tensor  # (S, heads, D) pre-RoPE queries of the subsampled tokens
    k_sub: torch.Tensor  # (S, kv_heads, D) pre-RoPE keys of the subsampled tokens
    v_sub: torch.Tensor  # (S, kv_heads, D) values of the subsampled tokens
    positions: torch.Tensor  # (S,) their positions
    # Per linear: sum of x^T x over every calibration token (K, K). Empty when input-error
    # compensation is on: it builds each linear's Hessian from the quantized block's inputs instead.
    hessians: dict[str, torch.Tensor]
    # (kv_heads, D, D): sum of q q^T over every calibration token and each KV head's query heads,
    # post-RoPE, before SmoothAttention (shared.quant.key_feedback); None unless asked for.
    query_moment: torch.Tensor | None = None


@dataclass(slots=True)
class QuantizedBlock:
    norms: dict[str, torch.Tensor]  # attn_norm, mlp_norm (H,)
    linears: dict[str, PackedWeight]  # qkv, o, gate_up, down
    kv_range: tuple[float, float] = FULL_KV_RANGE  # KV4 range ratios of K and V (shared.quant.kv_range)
    key_feedback: torch.Tensor | None = None  # KV4 keys' error-feedback factor (shared.quant.key_feedback)


def capture(
    config: LlamaConfig, work: WorkBlock, x: torch.Tensor, cos, sin, token_idx: torch.Tensor, with_hessians: bool = True,
    with_query_moment: bool = False,
) -> tuple[Captured, torch.Tensor]:
    """Runs the fp block over x (N, T, H); returns captures and the block output (N, T, H).
    with_hessians False skips the fp Hessians (a tenth of quantizing, unused under compensation);
    with_query_moment adds the queries' second moment (key feedback)."""
    block = work.as_fp_block()
    outs, subs = [], {"o_in": [], "down_in": []}
    inputs = dict(zip(("qkv_in", "o_in", "gate_up_in", "down_in"), BLOCK_LINEARS))  # capture key -> linear
    hessians: dict[str, torch.Tensor] = {}
    k_absmax = q_absmax = query_moment = None
    q_sub, k_sub, v_sub = [], [], []
    t = x.shape[1]
    for start in range(0, x.shape[0], FORWARD_BATCH):
        cap: dict = {}
        xb = x[start : start + FORWARD_BATCH]
        outs.append(block_forward(config, block, xb, cos, sin, capture=cap))
        kmax = cap["k_pre_rope"].abs().amax(dim=(0, 2))
        qmax = cap["q_pre_rope"].abs().amax(dim=(0, 2))
        k_absmax = kmax if k_absmax is None else torch.maximum(k_absmax, kmax)
        q_absmax = qmax if q_absmax is None else torch.maximum(q_absmax, qmax)
        if with_query_moment:
            moment = query_moment_of(config, apply_rope(cap["q_pre_rope"], cos, sin))
            query_moment = moment if query_moment is None else query_moment + moment
        # Keep only the subsampled tokens that fall in this batch.
        lo, hi = start * t, (start + xb.shape[0]) * t
        local = token_idx[(token_idx >= lo) & (token_idx < hi)] - lo
        q_sub.append(cap["q_pre_rope"].transpose(1, 2).reshape(-1, *qmax.shape)[local])
        k_sub.append(cap["k_pre_rope"].transpose(1, 2).reshape(-1, *kmax.shape)[local])
        v_sub.append(cap["v"].transpose(1, 2).reshape(-1, *kmax.shape)[local])
        for name, linear in inputs.items():
            flat = cap[name].reshape(-1, cap[name].shape[-1])
            if name in subs:
                subs[name].append(flat[local])
            if not with_hessians:
                continue
            xtx = flat.t() @ flat
            hessians[linear] = hessians[linear] + xtx if linear in hessians else xtx
    captured = Captured(
        **{k: torch.cat(v) for k, v in subs.items()}, k_absmax=k_absmax, q_absmax=q_absmax,
        q_sub=torch.cat(q_sub), k_sub=torch.cat(k_sub), v_sub=torch.cat(v_sub), positions=token_idx % t, hessians=hessians,
        query_moment=query_moment,
    )
    return captured, torch.cat(outs)


def quantize_block(
    config: LlamaConfig,
    work: WorkBlock,
    x: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    spec: FormatSpec,
    options: QoQOptions,
    rotation: torch.Tensor | None,
    token_idx: torch.Tensor | None,
    value_rotation: torch.Tensor | None = None,
) -> tuple[QuantizedBlock, torch.Tensor | None]:
    """x (N, T, H) calibration inputs (already rotated if rotation is on) -> (quantized block, next x).

    x None (no data-driven step enabled): rotation, if any, then round-to-nearest.
    """
    if rotation is not None:
        work.fold_norms()
        work.rotate(rotation)
    if value_rotation is not None:
        work.rotate_values(config, value_rotation)
    kind, bits = spec.weight_kind, spec.activation_bits
    quantize = WEIGHT_QUANTIZERS[kind][0]
    norms = {"attn_norm": work.attn_norm, "mlp_norm": work.mlp_norm}
    if x is None:
        return QuantizedBlock(norms, {n: quantize(getattr(work, n)) for n in BLOCK_LINEARS}), None
    with_feedback = options.key_feedback and spec.kv_bits == 4
    cap, out = capture(config, work, x, cos, sin, token_idx, with_hessians=not options.compensate_inputs,
                       with_query_moment=with_feedback)

    lam = None
    if options.smooth_attention and spec.kv_bits == 4:
        if options.smooth_attention_search:
            lam = search_smooth_attention(config, cap.q_sub, cap.k_sub, cap.positions, cap.q_absmax, cap.k_absmax, cos, sin)
        else:
            lam = smooth_attention_scales(config, cap.k_absmax, options.smooth_attention_alpha)
        apply_smooth_attention(config, work, lam)
    if options.smoothing:
        s = search_scales(cap.o_in, work.o, kind, bits, tie=tie_over_query_groups(config))
        apply_o_smoothing(config, work, s)
        cap.o_in = cap.o_in / s
        cap.v_sub = cap.v_sub / s.view(config.num_kv_heads, config.group_size, config.head_dim)[:, 0]
        if cap.hessians:
            cap.hessians["o"] = cap.hessians["o"] / s[:, None] / s[None, :]
        s = search_scales(cap.down_in, work.down, kind, bits)
        apply_down_smoothing(work, s)
        cap.down_in = cap.down_in / s
        if cap.hessians:
            cap.hessians["down"] = cap.hessians["down"] / s[:, None] / s[None, :]
    kv_range = FULL_KV_RANGE  # K keeps its full range: see shared/quant/kv_range.py
    if options.kv_range_search and spec.kv_bits == 4:
        kv_range = (1.0, search_value_ratio(cap.v_sub, value_channel_weights(config, work.o)))
    key_feedback = key_feedback_for_block(cap.query_moment, lam) if with_feedback else None
    if options.reorder and spec.needs_groups and kind != "w4chn":
        perm = salience_order(cap.down_in)
        apply_down_reorder(work, perm)
        cap.down_in = cap.down_in[:, perm]
        if cap.hessians:
            cap.hessians["down"] = cap.hessians["down"][perm][:, perm]

    ratios = candidate_ratios(options.clip_min_ratio, options.clip_steps)
    linears, dequantized = {}, {}
    if options.compensate_inputs:
        inputs = BlockInputs(config, work, x, cos, sin, bits, spec.kv_bits, FORWARD_BATCH, kv_range, key_feedback)
    for name in BLOCK_LINEARS:
        w, hessian = getattr(work, name), cap.hessians.get(name)
        if options.compensate_inputs:
            # The quantized block's own input to this linear, fitted to the fp block's output of it.
            hessian, cross = inputs.stats(name, dequantized)
            w = compensated_weight(w, hessian, cross, options.compensate_ridge)
        clip = search_clip_ratios(hessian, w, kind, ratios) if options.clipping else None
        if name == "qkv" and clip is not None:
            # Clipping shrinks q and k outputs, which sharpens or flattens every attention
            # distribution; like AWQ, only V's rows are clipped (measured: clipping q/k costs ppl).
            clip[: config.q_size + config.kv_size] = 1.0
        if options.gptq:
            linears[name] = gptq_quantize(w, hessian, kind, clip, options.gptq_act_order)
        else:
            linears[name] = quantize(w, clip)
        if options.compensate_inputs:
            dequantized[name] = linears[name].dequantize()
    return QuantizedBlock(norms, linears, kv_range, key_feedback), out
