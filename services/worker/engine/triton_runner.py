"""TritonRunner: the ModelRunner contract (runner.py) on an NVIDIA GPU with our Triton kernels.

Per layer, on the fp16 residual stream x (T, H):

    (x += previous down) + rmsnorm_quant -> W4A8 GEMM qkv -> RoPE + KV4 cache write (q rotated
      in the same launch)
      -> attention: varlen prefill over the chunk's own K/V (chunks at position 0), paged prefill
         over the cache (chunks continuing a cached prefix), or paged decode attention (decode tokens)
      -> quantize -> W4A8 GEMM o ; (x += o) + rmsnorm_quant -> W4A8 GEMM gate_up
      -> silu_mul_quant -> W4A8 GEMM down (added to x by the next layer's norm kernel)

The fp16 format (the baseline engine) runs the same graph with fp16 RMSNorm / SiLU*mul kernels,
cuBLAS fp16 GEMMs and an fp16 paged cache. GEMM variants come from the artifact's
`kernel_policy` (schema in kernel_policy.py), else the kernels' defaults. Decode-only steps
replay CUDA graphs at bucketed batch sizes (cuda_graphs.py); steps with prompt tokens replay
piecewise graphs at bucketed token counts with each layer's attention launched between the
pieces (step_graphs.py).

Numerics against the reference (shared/model, the artifact's full-sequence forward): the GEMMs
are bit-exact given the same input; the differences are the fp16 residual stream (the reference
keeps fp32), fp16 attention outputs, and prefill attention at position 0 reading the chunk's
unquantized K/V where the reference reads KV4-rounded K/V (later tokens read the KV4 cache, as
the reference does).

Constructed with `TritonRunner(reader, device="cuda", block_size=None, settings=TritonRunnerSettings(...))`
(block_size, when given, overrides the settings' one: the engine's loader passes it positionally);
device "cpu" works only under the Triton interpreter (TRITON_INTERPRET=1, the CPU tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from services.worker.engine.cuda_graphs import DecodeGraphs
from services.worker.engine.gpu_layers import Fp16Ops, W4A8Ops, rmsnorm_fp16
from services.worker.engine.gpu_weights import LayerWeights, load_weights
from services.worker.engine.kernel_policy import GemmPolicy
from services.worker.engine.runner import StepBatch, resolve_token_ids
from services.worker.engine.step_graphs import DEFAULT_STEP_GRAPH_TOKENS, StepBuffers, StepGraphs, replays_graph
from services.worker.engine.step_inputs import HostStep, StepTensors, build_host_step, decode_rows, to_device, upload
from services.worker.kernels import kv4_cache, paged_attention, paged_prefill_attention, prefill_attention, w4a8_gemm
from services.worker.kernels.attention_reference import build_rope_cache
from services.worker.kernels.host_int import cdiv
from shared.formats.kv4 import page_row_bytes
from shared.model.config import LlamaConfig
from shared.model.rope import inverse_frequencies

# Up to 1024: before, a batch above 512 decoded eagerly, and on the H200 that launch cost was ~13 ms
# a step at batch 603 of Llama-3-8B (a 19.6 ms graph step; session 23, bench/e2e.py). A batch above
# the largest bucket now replays in pieces of it (_decode_through_graphs).
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                             640, 768, 896, 1024)


@dataclass(slots=True, frozen=True)
class TritonRunnerSettings:
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_batch_tokens: int = 8192  # largest step (tokens) the activation estimate and workspace cover
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    # The engine's most running sequences: graphs for larger batches would never run, yet their
    # private pool and logits buffer are reserved (activation_bytes). None: every bucket.
    max_decode_batch: int | None = None
    # Steps with prompt tokens replay piecewise graphs (step_graphs.py) at these token counts, up to
    # the first that covers max_batch_tokens; off: they launch kernel by kernel.
    step_graphs: bool = True
    step_graph_tokens: tuple[int, ...] = DEFAULT_STEP_GRAPH_TOKENS

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size {self.block_size} must be a power of two")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} must be positive")
        if not self.graph_batch_sizes or min(self.graph_batch_sizes) < 1:
            raise ValueError(f"graph_batch_sizes {self.graph_batch_sizes} must be positive batch sizes")
        if self.max_decode_batch is not None and self.max_decode_batch < 1:
            raise ValueError(f"max_decode_batch {self.max_decode_batch} must be positive")
        if not self.step_graph_tokens or min(self.step_graph_tokens) < 1:
            raise ValueError(f"step_graph_tokens {self.step_graph_tokens} must be positive token counts")

    def decode_buckets(self) -> tuple[int, ...]:
        """The graph batch sizes a decode batch of at most max_decode_batch rows can use."""
        return _buckets_up_to(self.graph_batch_sizes, self.max_decode_batch)

    def step_buckets(self) -> tuple[int, ...]:
        """The step graphs' token counts a step of at most max_batch_tokens tokens can use."""
        return _buckets_up_to(self.step_graph_tokens, self.max_batch_tokens)


def _buckets_up_to(sizes: tuple[int, ...], most: int | None) -> tuple[int, ...]:
    """The sizes below `most` and the first that covers it (all of them when most is None)."""
    sizes = sorted(set(sizes))
    if most is None:
        return tuple(sizes)
    covering = [b for b in sizes if b >= most][:1]
    return tuple(b for b in sizes if b < most) + tuple(covering)


def check_head_dim(head_dim: int) -> None:
    """Refuses at start a head_dim some attention kernel cannot take: each kernel checks its own only
    when first launched, so a worker would start and then fail requests (head_dim 16 serves first
    prompts and fails at the first cached-prefix chunk). The cache write and the decode and prefill
    kernels take powers of two >= 16; the cached-prefix chunk kernel (paged_prefill_attention) >= 32."""
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not supported by the GPU attention kernels: a power of two >= 32")


class TritonRunner:
    def __init__(
        self,
        reader,
        device: str | torch.device = "cuda",
        block_size: int | None = None,
        settings: TritonRunnerSettings | None = None,
    ):
        settings = settings or TritonRunnerSettings()
        if block_size is not None and block_size != settings.block_size:
            settings = replace(settings, block_size=block_size)
        self.settings = settings
        self.device = torch.device(device)
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("TritonRunner on device 'cpu' needs the Triton interpreter (TRITON_INTERPRET=1); "
                             "serve on the CPU with the reference runner")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"TritonRunner runs on an NVIDIA GPU ('cuda'), not {self.device}")
        # With its index: the split-K workspace and the graphs' check of it are keyed by device.
        self.device = w4a8_gemm.canonical_device(self.device)
        self.format = reader.spec.name
        self.kv4 = reader.spec.kv_bits == 4
        if reader.spec.weight_kind != "fp16" and (reader.spec.activation_bits != 8 or not self.kv4):
            raise ValueError(f"the Triton runner serves w4a8kv4-g128, w4a8kv4-chn and fp16, not {self.format}")
        self.config = LlamaConfig.from_dict(reader.manifest.model_config)
        check_head_dim(self.config.head_dim)
        self.block_size = self.settings.block_size
        self.max_model_len = self.settings.max_model_len or self.config.max_position_embeddings
        self.max_blocks = cdiv(self.max_model_len, self.block_size)
        self.weights = load_weights(reader, self.device)
        if reader.spec.weight_kind == "fp16":
            self.ops = Fp16Ops()
        else:
            self.ops = W4A8Ops(GemmPolicy.from_manifest(reader.manifest.kernel_policy))
        inv_freq = inverse_frequencies(self.config.rope, self.config.head_dim).to(self.device)
        self.rope_cache = build_rope_cache(inv_freq, self.max_model_len)  # (P, D) fp32 [cos | sin]
        self.k_cache = self.v_cache = None  # (layers, blocks, kv_heads, block_size, row)
        use_graphs = self.settings.cuda_graphs and self.device.type == "cuda"
        self.graphs = (
            DecodeGraphs(self._forward, self.settings.decode_buckets(), self.max_blocks, self.max_model_len, self.device)
            if use_graphs else None
        )
        self.step_graphs = self._make_step_graphs() if use_graphs and self.settings.step_graphs else None
        self._reserve_workspace()

    def _make_step_graphs(self, capture_piece=None) -> StepGraphs:
        c = self.config
        buckets = self.settings.step_buckets()
        buffers = StepBuffers.empty(buckets[-1], c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, self.device)
        extra = {} if capture_piece is None else {"capture_piece": capture_piece}
        return StepGraphs(self._piece, self._attend, c.num_layers, buffers, buckets, self.device, **extra)

    # ------------------------------------------------------------------ memory

    def weight_bytes(self) -> int:
        return self.weights.nbytes() + self.rope_cache.numel() * 4

    def kv_row_bytes(self) -> int:
        """Bytes of one token of one KV head in one of K or V (KV4: D/2 codes + scale + zero; fp16: 2D)."""
        d = self.config.head_dim
        return page_row_bytes(d) if self.kv4 else 2 * d

    def kv_block_bytes(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * self.block_size * self.kv_row_bytes()

    def _workspace_elements(self, max_tokens: int) -> int:
        """The largest W4A8 workspace (int32 elements: split-K partials, or the int8 path's weight copy)
        any GEMM of up to max_tokens rows asks for."""
        if not isinstance(self.ops, W4A8Ops):
            return 0
        layer = self.weights.layers[0]
        most = 1
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            n, k = w.qweight.shape[0], w.qweight.shape[1] * 2
            for m in range(1, max_tokens + 1):
                variant = w4a8_gemm.get_variant(self.ops.policy.variant(w.kind, n, k, m))
                most = max(most, w4a8_gemm.workspace_elements(variant, m, n, k, self.device))
        return most

    def _reserve_workspace(self) -> None:
        # Sized once for every step up to max_batch_tokens, so an eager prefill never re-allocates
        # the workspace under captured graphs.
        elements = self._workspace_elements(max(self.settings.max_batch_tokens, max(self.settings.decode_buckets())))
        self.workspace_bytes = 4 * elements if elements > 1 else 0
        if elements > 1:
            w4a8_gemm.WORKSPACE.get(self.device, elements)

    def activation_bytes(self, max_batch_tokens: int) -> int:
        """An upper bound of the memory besides weights and KV cache: one eager step's transient
        buffers (the graphs' warm-ups run eagerly too, and the caching allocator keeps what they
        took), the W4A8 workspace, and with CUDA graphs their private pools (the largest decode
        bucket's step, which the caching allocator cannot lend to eager steps; a step piece of the
        largest step bucket), the decode graphs' shared logits and the step graphs' static buffers."""
        total = self._step_bytes(max_batch_tokens) + self.workspace_bytes
        if self.graphs is not None:
            b = self.graphs.buckets[-1]
            total += self._step_bytes(b, decode_rows=b) + b * self.config.vocab_size * 4  # padded to the bucket
        if self.step_graphs is not None:
            # The static buffers, and the pool of what a piece allocates (no attention, no logits).
            b = self.step_graphs.buckets[-1]
            total += self.step_graphs.buffers.nbytes() + b * self._token_bytes()
        return total

    def _step_bytes(self, t: int, decode_rows: int | None = None) -> int:
        """Buffers that can be live at once in a step of t tokens, of which decode_rows decode (default: as many
        as can, one per running sequence at most)."""
        c = self.config
        v = c.vocab_size
        parts = cdiv(self.max_model_len, 256)  # decode partials: the smallest tuned partition
        # Only decode rows take partials: counted for every token of a 4096-token step, a 128k-context model's
        # estimate held ~32 GiB that the KV cache never got.
        rows = min(t, self.settings.max_decode_batch or t) if decode_rows is None else decode_rows
        partials = rows * c.num_heads * parts * (c.head_dim + 2) * 4
        logits = t * v * (4 + 2)  # fp16 GEMM output, fp32 copy
        return t * self._token_bytes() + partials + logits

    def _token_bytes(self) -> int:
        """A step's buffers per token, attention's partials and the logits aside."""
        c = self.config
        h, q, kv, f = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        return 2 * (
            h  # residual stream
            + (q + 2 * kv)  # qkv
            + (q + kv)  # rotated q and k
            + 2 * q  # attention output (+ a gathered copy in mixed steps)
            + 2 * f  # gate_up
            + h  # GEMM output before the residual add
        ) + max(h, f) + 8 + 4 * cdiv(max(h, f), 128)  # int8 activations + scale + rowsum + group sums
        # (fp16: the normed input, 2 * h <= max(h, f) + h)

    def allocate_cache(self, num_blocks: int) -> None:
        c = self.config
        self.k_cache = self.v_cache = None
        for graphs in (self.graphs, self.step_graphs):
            if graphs is not None:
                graphs.clear()  # graphs hold the old cache's addresses
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = (c.num_layers, num_blocks, c.num_kv_heads, self.block_size, self.kv_row_bytes() if self.kv4 else c.head_dim)
        dtype = torch.uint8 if self.kv4 else torch.float16
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.num_blocks = num_blocks

    def capture_graphs(self, batch_sizes: tuple[int, ...] | None = None,
                       progress: Callable[[int, int], None] | None = None) -> None:
        """Captures the decode graphs (at batch_sizes, default all) and every step graph now (else
        each is captured at its first use, which a benchmark would time). progress(done, total) is
        called after each capture: the first ones compile the kernels, minutes on a cold Triton cache."""
        if self.k_cache is None:
            return
        captures = []
        if self.graphs is not None:
            captures += [(self.graphs, b) for b in sorted(batch_sizes or self.graphs.buckets, reverse=True)
                         if self.graphs.bucket_for(b) == b]
        if self.step_graphs is not None:
            captures += [(self.step_graphs, b) for b in reversed(self.step_graphs.buckets)
                         if b not in self.step_graphs.graphs]
        for done, (graphs, b) in enumerate(captures, 1):
            graphs.capture(b)
            if progress is not None:
                progress(done, len(captures))

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, batch: StepBatch) -> torch.Tensor:
        if self.k_cache is None:
            raise RuntimeError("allocate_cache(num_blocks) must run before step()")
        if not batch.chunks:
            return torch.zeros((0, self.config.vocab_size), dtype=torch.float32, device=self.device)
        host = build_host_step(batch, self.block_size, self.max_blocks, self.max_model_len)
        if self.graphs is not None and batch.is_decode_only:
            logits = self._decode_through_graphs(host, batch.previous_token_ids)
            if len(host.logit_rows) != len(host.tokens):
                logits = logits[upload(host.logit_rows, self.device)]
            return logits
        if len(host.tokens) > self.settings.max_batch_tokens:
            raise ValueError(f"a step of {len(host.tokens)} tokens exceeds max_batch_tokens={self.settings.max_batch_tokens}")
        return self._prompt_step(host, batch.previous_token_ids)

    def _prompt_step(self, host: HostStep, previous_token_ids: torch.Tensor | None) -> torch.Tensor:
        """A step with prompt tokens: its pieces replayed from the step graphs with attention launched
        between them, or (no step graphs, a step above their largest bucket, or a large step its bucket
        would pad by more than a few percent: step_graphs.replays_graph) every kernel launched from the host."""
        st = to_device(host, self.device)
        st.tokens = resolve_token_ids(st.tokens, previous_token_ids)
        t = len(host.tokens)
        if self.step_graphs is None or not replays_graph(t, self.step_graphs.bucket_for(t)):
            return self._forward(st)  # a large step far below its bucket: the GPU work dominates (replays_graph)
        return self._logits(self.step_graphs.run(st).x, st)

    def _decode_through_graphs(self, host: HostStep, previous_token_ids: torch.Tensor | None) -> torch.Tensor:
        """A decode step by graph replay; a batch above the largest bucket in pieces of that size
        (decode_rows), not eagerly: an eager decode step pays every launch from the host, ~13 ms a
        step at batch 603 of Llama-3-8B on the H200 (session 23)."""
        piece = self.graphs.buckets[-1]
        n = len(host.tokens)
        if n <= piece:
            return self.graphs.replay(host, previous_token_ids)
        return torch.cat([self.graphs.replay(decode_rows(host, start, min(start + piece, n)), previous_token_ids)
                          for start in range(0, n, piece)])

    def _forward(self, st: StepTensors, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """-> (rows, vocab) fp32 logits of st.logit_rows (all rows when None), in logits_out if given.
        The pieces and attentions in turn, as step_graphs.StepGraphs replays them."""
        c = self.config
        buffers = StepBuffers.empty(st.tokens.shape[0], c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                    self.device)
        rotate_keys = st.cu_seqlens is not None
        for k in range(c.num_layers + 1):
            self._piece(k, st, buffers, rotate_keys)
            if k < c.num_layers:
                self._attend(k, st, buffers)
        return self._logits(buffers.x, st, logits_out)

    def _logits(self, x: torch.Tensor, st: StepTensors, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        if st.logit_rows is not None:
            x = x.index_select(0, st.logit_rows)
        h = rmsnorm_fp16(x, self.weights.final_norm, self.config.rms_norm_eps)  # (n, H) fp16
        logits = F.linear(h, self.weights.lm_head)  # (n, V) fp16
        return logits.float() if logits_out is None else logits_out.copy_(logits)

    def _piece(self, k: int, st: StepTensors, buf: StepBuffers, rotate_keys: bool) -> None:
        """The work between attention k - 1 and attention k (k = 0 .. layers), in place on buf.

        A residual add is either done by the GEMM (fp16: cuBLAS's epilogue) or left pending for the
        next norm's kernel (W4A8: the add fused into rmsnorm_quant): layer k - 1's down projection
        is added by layer k's first norm, the last layer's by the final add here.
        """
        layers = self.weights.layers
        if k == 0:
            torch.index_select(self.weights.embed, 0, st.tokens, out=buf.x)
            pending = None
        else:
            pending = self._after_attention(layers[k - 1], buf)
        if k == len(layers):
            if pending is not None:
                buf.x += pending
            return
        self._before_attention(k, layers[k], buf, pending, st, rotate_keys)

    def _before_attention(self, i: int, w: LayerWeights, buf: StepBuffers, pending: torch.Tensor | None,
                          st: StepTensors, rotate_keys: bool) -> None:
        """x += pending, RMSNorm, qkv GEMM -> buf.qkv, RoPE + KV cache write -> buf.rotated (q, and k
        when rotate_keys: prefill attention reads the chunk's own rotated keys)."""
        c, ops = self.config, self.ops
        # Each activation is quantized for the GEMM it feeds (which sums of x8 that GEMM reads).
        ops.linear(ops.norm(buf.x, w.attn_norm, c.rms_norm_eps, add=pending, feeds=w.qkv), w.qkv, out=buf.qkv)
        t, heads, kvh, d = buf.qkv.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        k = buf.qkv[:, c.q_size : c.q_size + c.kv_size].view(t, kvh, d)  # (T, kv_heads, D), pre-RoPE
        v = buf.qkv[:, c.q_size + c.kv_size :].view(t, kvh, d)
        # Passing q and k as one (T, heads + kv_heads, D) "query" makes the cache-write kernel rotate
        # both (every head shares the token's angles).
        rotated = heads + kvh if rotate_keys else heads
        query = buf.qkv[:, : c.q_size + c.kv_size] if rotate_keys else buf.qkv[:, : c.q_size]
        write = kv4_cache.write_kv4_cache if self.kv4 else kv4_cache.write_fp16_cache
        ranges = {"kv_range": w.kv_range, "key_feedback": w.key_feedback} if self.kv4 else {}  # the layer's KV4 write
        write(k, v, st.positions, st.slots, self.rope_cache, self.k_cache[i], self.v_cache[i],
              query=query.view(t, rotated, d), query_out=buf.rotated[:, :rotated], **ranges)

    def _after_attention(self, w: LayerWeights, buf: StepBuffers) -> torch.Tensor | None:
        """o GEMM (x += o), RMSNorm, gate_up GEMM, SiLU * up, down GEMM -> the down output still to
        be added to x (None when the GEMM added it)."""
        eps, ops = self.config.rms_norm_eps, self.ops
        pending = ops.linear_into_residual(ops.plain(buf.attn, feeds=w.o), w.o, buf.x)  # x += o(attn), now or in the next norm
        gate_up = ops.linear(ops.norm(buf.x, w.mlp_norm, eps, add=pending, feeds=w.gate_up), w.gate_up)  # (T, 2F) fp16
        return ops.linear_into_residual(ops.silu_mul(gate_up, feeds=w.down), w.down, buf.x)

    def _attend(self, i: int, st: StepTensors, buf: StepBuffers) -> None:
        """Layer i's attention over the step's rows -> buf.attn."""
        c = self.config
        t, heads, kvh, d = buf.qkv.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        v = buf.qkv[:, c.q_size + c.kv_size :].view(t, kvh, d)
        q_rot, k_rot = buf.rotated[:, :heads], buf.rotated[:, heads:]  # k_rot: written only for prefill rows
        out = buf.attn.view(t, heads, d)
        # Rows come grouped (build_host_step): prefill [0, p), continuing chunks [p, p + n), decode rows;
        # each kernel writes its rows of the one output.
        p, n = st.num_prefill, st.num_chunked
        if p:
            prefill_attention.prefill_attention(q_rot[:p], k_rot[:p], v[:p], st.cu_seqlens, max_seqlen=st.max_seqlen,
                                                out=out[:p])
        if n:
            paged_prefill_attention.paged_prefill_attention(
                q_rot[p : p + n], self.k_cache[i], self.v_cache[i], st.chunk_cu, st.chunk_starts, st.chunk_tables,
                max_seqlen=st.max_chunk, out=out[p : p + n],
                max_context_len=self.max_model_len,  # the tables' width covers it: no sync to read the chunks' ends
            )
        if p + n < t:
            self._paged(i, q_rot[p + n :], st, out=out[p + n :])

    def _paged(self, i: int, q: torch.Tensor, st: StepTensors, out: torch.Tensor) -> torch.Tensor:
        return paged_attention.paged_decode_attention(
            q, self.k_cache[i], self.v_cache[i], st.block_tables, st.context_lens, max_context_len=st.max_context,
            out=out,
        )
