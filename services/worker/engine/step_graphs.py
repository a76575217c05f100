"""Piecewise CUDA graphs of the steps that carry prompt tokens (prefill and mixed steps).

Such a step launched kernel by kernel costs the host ~500 Triton launches (11-16 a layer), about
60 ms of Python a step on the H100 host of bench/results/h100/step_profile_cprofile_512.json,
against 11 ms of GPU work at 512 tokens: small prefill and mixed steps waited on the host. Their
attention cannot sit in a graph (its grids follow the step's sequence lengths), everything else
can: the step is cut at each layer's attention into `layers + 1` pieces (TritonRunner._piece):

    piece 0:   embedding, layer 0 up to attention (norm, qkv GEMM, RoPE + KV cache write)
    piece k:   layer k-1 after attention (o GEMM, norm, gate_up, SiLU*mul, down), layer k up to attention
    piece L:   layer L-1 after attention, the last residual add

Each piece is captured per bucket of token counts; a step of t tokens replays the pieces of the
smallest bucket >= t and launches each layer's attention eagerly on its t real rows in between
(~1-3 launches a layer instead of ~15). Padding rows get slot -1 (no cache write) and position 0;
their outputs are never read. The logits (the rows that want them) are computed eagerly after.

What the pieces pass on lives in static buffers of the largest bucket (StepBuffers: residual
stream, qkv, rotated q/k, attention output) allocated outside the graphs, so one set serves every
bucket; what a piece allocates and frees inside comes from one memory pool shared by all pieces
of all buckets, which is safe because pieces never run concurrently and nothing a piece leaves in
the pool is read after it. Like the decode graphs, the pieces bake in the KV cache, weights and the
W4A8 workspace: the runner drops them when the cache is re-allocated, and `run` re-captures if the
workspace was re-allocated since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from services.worker.engine.cuda_graphs import BucketedGraphs
from services.worker.engine.step_inputs import StepTensors

# Token counts a captured step is padded to. Steps of 1-2k tokens are GPU-bound enough that
# padding shows (H200: 1104 tokens padded to 1536 took 31 ms a step, 2128 to 2560 took 45 ms
# against 50 kernel by kernel), so 128- and 256-token steps there; each bucket costs ~0.07 s to
# capture and no memory of its own (one pool for all). Above 4096 a step is GPU-bound anyway.
DEFAULT_STEP_GRAPH_TOKENS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
                             2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096, 5120, 6144, 7168, 8192)
# Up to this many tokens a graph wins even padded to its bucket: the host launches of a step kernel
# by kernel (~500, 20-50 ms of Python) outlast or rival its GPU work (H200: 3.2-3.8x at 96-144
# tokens; 2,128 tokens padded to 2,560 still took 45 ms against 50 kernel by kernel). Above it the GPU
# work dominates, the launches hide behind it, and the padding of the coarse buckets costs in
# proportion: 7,176-token steps padded to the 8,192 bucket made a chn batch-256 run's prompt phase
# 4.65 s against 4.31 s kernel by kernel (H100, session 40). So above it a step replays a graph only
# when the padding is a small share of its tokens.
LAUNCH_BOUND_TOKENS = 4096
MAX_PADDING_FRACTION = 1 / 32


def replays_graph(tokens: int, bucket: int | None) -> bool:
    """Whether a step of `tokens` runs through the graphs of `bucket` (the smallest >= tokens, None
    above the largest) rather than kernel by kernel."""
    if bucket is None:
        return False
    return tokens <= LAUNCH_BOUND_TOKENS or bucket - tokens <= tokens * MAX_PADDING_FRACTION


@dataclass(slots=True)
class StepBuffers:
    """The tensors a step's pieces hand on to attention and to the next piece (rows: tokens)."""

    x: torch.Tensor  # (T, hidden) fp16 residual stream
    qkv: torch.Tensor  # (T, q + 2 kv) fp16 qkv projection (attention reads V from it)
    rotated: torch.Tensor  # (T, heads + kv_heads, D) fp16 RoPE'd query and key
    attn: torch.Tensor  # (T, q) fp16 attention output

    @classmethod
    def empty(cls, t: int, hidden: int, heads: int, kv_heads: int, head_dim: int, device) -> StepBuffers:
        f16 = {"dtype": torch.float16, "device": device}
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls(x=torch.empty((t, hidden), **f16), qkv=torch.empty((t, q + 2 * kv), **f16),
                   rotated=torch.empty((t, heads + kv_heads, head_dim), **f16), attn=torch.empty((t, q), **f16))

    def rows(self, t: int) -> StepBuffers:
        return StepBuffers(self.x[:t], self.qkv[:t], self.rotated[:t], self.attn[:t])

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.x, self.qkv, self.rotated, self.attn))


Piece = Callable[[int, StepTensors, StepBuffers, bool], None]  # (k, inputs, buffers, rotate_keys)
Attend = Callable[[int, StepTensors, StepBuffers], None]  # (layer, step, buffers of its rows)


class CudaGraphPiece:
    """One captured piece; replay() runs it."""

    def __init__(self, fn: Callable[[], None], pool):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()
        self.pool = self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class StepGraphs(BucketedGraphs):
    def __init__(self, piece: Piece, attend: Attend, layers: int, buffers: StepBuffers, buckets: tuple[int, ...],
                 device: torch.device, capture_piece=CudaGraphPiece):
        super().__init__(buckets, device)
        self.piece, self.attend, self.layers = piece, attend, layers
        self.buffers = buffers  # the largest bucket's rows
        if buffers.x.shape[0] < self.buckets[-1]:
            raise ValueError(f"buffers of {buffers.x.shape[0]} rows cannot hold the {self.buckets[-1]}-token bucket")
        self.capture_piece = capture_piece  # (fn, pool) -> object with replay() and pool; tests replay eagerly
        b = self.buckets[-1]
        self.tokens = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int32, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        buffers.attn.zero_()  # read by the warm-up before any attention wrote it

    def _inputs(self, b: int) -> StepTensors:
        # The pieces read tokens, positions and slots; attention's fields belong to the eager part.
        return StepTensors(tokens=self.tokens[:b], positions=self.positions[:b], slots=self.slots[:b], num_prefill=0,
                           cu_seqlens=None, max_seqlen=0, block_tables=None, context_lens=None, max_context=0,
                           logit_rows=None)

    def capture(self, b: int) -> None:
        self.positions[:b].zero_()
        self.slots[:b].fill_(-1)  # capture-time inputs: no cache writes
        inputs, buffers = self._inputs(b), self.buffers.rows(b)
        self.warm_up(lambda: [self.piece(k, inputs, buffers, True) for k in range(self.layers + 1)])
        pieces = []
        for k in range(self.layers + 1):
            # Prefill attention reads the rotated keys: a captured piece always rotates them.
            captured = self.capture_piece(lambda k=k: self.piece(k, inputs, buffers, True), self.pool)
            self.pool = captured.pool
            pieces.append(captured)
        self.graphs[b] = pieces

    def run(self, st: StepTensors) -> StepBuffers:
        """A step of t <= the largest bucket tokens: its pieces replayed, its attention launched on
        its own rows between them -> the static buffers' first t rows (x: the final residual stream)."""
        t = st.tokens.shape[0]
        b = self.bucket_for(t)
        if b is None:
            raise ValueError(f"a step of {t} tokens is above the largest step graph ({self.buckets[-1]} tokens)")
        if b not in self.graphs or self.workspace_moved():
            self.capture(b)
        self.tokens[:t].copy_(st.tokens)
        self.positions[:t].copy_(st.positions)
        self.slots[:t].copy_(st.slots)
        if b > t:  # rows a bigger step left here: no cache write, a valid position
            self.positions[t:b].zero_()
            self.slots[t:b].fill_(-1)
        rows = self.buffers.rows(t)
        for k, piece in enumerate(self.graphs[b]):
            piece.replay()
            if k < self.layers:
                self.attend(k, st, rows)
        return rows
