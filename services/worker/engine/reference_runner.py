"""The torch reference model runner: LlamaModel's numerics over a paged KV cache, on any device.

The weights and linears are shared.model.load.artifact_model's, and every step repeats
LlamaModel.forward's arithmetic per token (fp32 residual stream, the format's reference linears,
RoPE from shared.model.rope, SDPA). Attention runs in float64: a decode token or a later prompt
chunk attends over the cached prefix in another summation order than one forward over the whole
sequence, and in fp32 that difference (~1e-7 relative) can push a per-token int8 activation or a
4-bit K/V code across a rounding boundary and flip a near-tied greedy token. In float64 the order
no longer shows after rounding to fp32, so this backend's greedy tokens equal those of
LlamaModel(attention_dtype=float64).forward re-run on the growing sequence (tests/worker). The cache is the contract's paged layout:

    KV4 formats       k_cache[l], v_cache[l]  (num_blocks, kv_heads, block_size, D/2 + 4) uint8,
                      rows as shared.formats.kv4.encode_rows (codes, fp16 scale, fp16 zero); the
                      same per-token per-head 4-bit values LlamaModel's fake_quantize_kv4 produces
    16-bit-KV formats k_cache[l], v_cache[l]  (num_blocks, kv_heads, block_size, D) fp16, as the
                      GPU runner stores them (LlamaModel keeps K/V in fp32: a rounding of ~5e-4
                      relative that the full forward does not have)
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import torch
import torch.nn.functional as F

from services.worker.engine.runner import SequenceChunk, StepBatch, resolve_token_ids
from services.worker.kernels.attention_reference import gather_sequence
from shared.formats.artifact import ArtifactReader
from shared.formats.kv4 import encode_rows, page_row_bytes
from shared.formats.spec import FORMATS
from shared.model.llama import rms_norm
from shared.model.load import artifact_model
from shared.model.rope import apply_rope, cos_sin

FP32_BYTES = 4


class ReferenceRunner:
    SUPPORTED_FORMATS = tuple(FORMATS)  # the reference linears cover every format

    def __init__(self, reader: ArtifactReader, device: torch.device | str = "cpu", block_size: int = 16,
                 max_model_len: int | None = None):
        self.device = torch.device(device)
        self.block_size = block_size
        self.format = reader.manifest.format
        self.model = artifact_model(reader, self.device)
        self.config = self.model.config
        self.kv_bits = reader.spec.kv_bits
        # The longest context served (--max-context-tokens), which activation_bytes sizes attention by: a
        # Llama-3.1-style 131,072-token window took 2 GiB for a 1M-parameter model whatever the worker served.
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    # ---- memory accounting ----

    def weight_bytes(self) -> int:
        m = self.model
        parts = [m.embed, m.final_norm, m.lm_head]
        for b in m.blocks:
            parts += [b.attn_norm, b.mlp_norm, b.qkv, b.o, b.gate_up, b.down]
        return sum(_tensor_bytes(p) for p in parts)

    def kv_block_bytes(self) -> int:
        c = self.config
        row = page_row_bytes(c.head_dim) if self.kv_bits == 4 else 2 * c.head_dim
        return 2 * c.num_layers * c.num_kv_heads * self.block_size * row

    def activation_bytes(self, max_batch_tokens: int) -> int:
        c = self.config
        n, ctx = max_batch_tokens, self.max_model_len
        per_token = 4 * c.hidden_size + 3 * c.q_size + 4 * c.kv_size + 3 * c.intermediate_size + c.vocab_size
        # One chunk of n queries against a full context: scores and probabilities, and the
        # gathered K/V widened to fp32 and repeated over the query heads.
        attention = 2 * c.num_heads * n * ctx + 2 * c.num_heads * ctx * c.head_dim
        return FP32_BYTES * (n * per_token + attention)

    def allocate_cache(self, num_blocks: int) -> None:
        c = self.config
        if self.kv_bits == 4:
            shape, dtype = (num_blocks, c.num_kv_heads, self.block_size, page_row_bytes(c.head_dim)), torch.uint8
        else:
            shape, dtype = (num_blocks, c.num_kv_heads, self.block_size, c.head_dim), torch.float16
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]

    # ---- the step ----

    @torch.no_grad()
    def step(self, batch: StepBatch) -> torch.Tensor:
        c, m = self.config, self.model
        chunks = batch.chunks
        dev = self.device
        tokens = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.long, device=dev)  # (N,)
        tokens = resolve_token_ids(tokens, batch.previous_token_ids)
        positions = torch.cat([_positions(ch, dev) for ch in chunks])  # (N,)
        slots = torch.cat([_slots(ch, self.block_size, dev) for ch in chunks])  # (N,)
        cos, sin = cos_sin(positions, m.inv_freq)  # (N, D) fp32
        n = tokens.shape[0]
        x = m.embed[tokens].float()  # (N, H) fp32 residual stream
        for layer, block in enumerate(m.blocks):
            h = rms_norm(x, block.attn_norm, c.rms_norm_eps)
            q, k, v = block.qkv(h).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rope(q.view(n, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)  # (heads, N, D)
            k = apply_rope(k.view(n, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)  # (kv_heads, N, D)
            self._write(layer, k.transpose(0, 1), v.view(n, c.num_kv_heads, c.head_dim), slots)
            attn = self._attend(layer, q, chunks)  # (N, heads * D) fp32
            x = x + block.o(attn)
            h2 = rms_norm(x, block.mlp_norm, c.rms_norm_eps)
            gate, up = block.gate_up(h2).chunk(2, dim=-1)
            x = x + block.down(F.silu(gate) * up)
        ends = torch.tensor(_logit_rows(chunks), dtype=torch.long, device=dev)  # (n_logits,)
        if ends.numel() == 0:  # only partial prompt chunks this step: no token is due
            return torch.empty(0, c.vocab_size, device=dev)
        return m.lm_head(rms_norm(x[ends], m.final_norm, c.rms_norm_eps))  # (n_logits, V) fp32

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v (N, kv_heads, D) fp32 (k after RoPE) -> their rows at slots, in both caches."""
        if self.kv_bits == 4:
            block = self.model.blocks[layer]
            k_range, v_range = block.kv_range
            k_rows = encode_rows(k, k_range, block.key_feedback)  # (N, kv_heads, D/2 + 4) uint8
            v_rows = encode_rows(v, v_range)
        else:
            k_rows, v_rows = k.half(), v.half()  # (N, kv_heads, D) fp16
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.k_cache[layer][blocks, :, offsets] = k_rows
        self.v_cache[layer][blocks, :, offsets] = v_rows

    def _attend(self, layer: int, q: torch.Tensor, chunks: list[SequenceChunk]) -> torch.Tensor:
        """q (heads, N, D) fp32 -> (N, heads * D) fp32: each chunk's queries over its sequence's cache."""
        c = self.config
        outs = []
        start = 0
        for ch in chunks:
            t = len(ch.token_ids)
            length = ch.start_position + t
            table = torch.tensor(ch.block_table, dtype=torch.long, device=self.device)
            k = gather_sequence(self.k_cache[layer], table, length)  # (kv_heads, L, D) fp32
            v = gather_sequence(self.v_cache[layer], table, length)
            k = k.repeat_interleave(c.group_size, dim=0)  # (heads, L, D)
            v = v.repeat_interleave(c.group_size, dim=0)
            qc = q[:, start : start + t]  # (heads, t, D)
            out = _causal_attention(qc, k, v, ch.start_position)  # (heads, t, D)
            outs.append(out.transpose(0, 1).reshape(t, c.q_size))
            start += t
        return torch.cat(outs)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q (heads, t, D) at positions [start, start + t); k, v (heads, start + t, D) -> (heads, t, D) fp32,
    summed in float64 (see the module docstring)."""
    t, length = q.shape[1], k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    if start == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0].float()
    if t == 1:
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0].float()
    # Query i sits at position start + i and sees keys [0, start + i].
    visible = torch.ones(t, length, dtype=torch.bool, device=q.device).tril(start)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible)[0].float()


def _positions(ch: SequenceChunk, device: torch.device) -> torch.Tensor:
    return torch.arange(ch.start_position, ch.start_position + len(ch.token_ids), device=device)


def _slots(ch: SequenceChunk, block_size: int, device: torch.device) -> torch.Tensor:
    """(t,) slot = physical block * block_size + offset, for each of the chunk's positions."""
    pos = range(ch.start_position, ch.start_position + len(ch.token_ids))
    return torch.tensor([ch.block_table[p // block_size] * block_size + p % block_size for p in pos],
                        dtype=torch.long, device=device)


def _logit_rows(chunks: list[SequenceChunk]) -> list[int]:
    rows, end = [], 0
    for ch in chunks:
        end += len(ch.token_ids)
        if ch.want_logits:
            rows.append(end - 1)
    return rows


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors an object holds: a tensor, a list of them, or an object's attributes
    (a dataclass, a linear, the linear's prepared GEMM weights), followed one level at a time."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if is_dataclass(obj):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in fields(obj))
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v) for v in vars(obj).values())
    return 0
