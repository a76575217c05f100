"""CUDA graphs of the decode step at bucketed batch sizes, over static input buffers.

A decode step launches ~10 kernels per layer; replaying a captured graph removes the host's
launch cost (hundreds of microseconds of Python per step) from the critical path. A batch of n
decode tokens runs the graph of the smallest bucket >= n (a batch above the largest bucket runs in
pieces of it: TritonRunner._decode_through_graphs); the padding rows have slot -1 (no cache write)
and context 0 (zero attention output), and their logits are dropped.

Every graph bakes in the addresses it saw at capture: the KV cache, the weights, the static
buffers and the W4A8 split-K workspace. The runner drops the graphs when the cache is
re-allocated, and `replay` re-captures if the shared workspace was re-allocated since.
Graphs share one memory pool (they never run concurrently) and write their logits into one
static (largest bucket, vocab) fp32 buffer, so no graph keeps an output of its own alive in the
pool: per-bucket outputs would hold sum(buckets) rows of logits, 3.2 GB at Llama-3's vocabulary
with every bucket up to 1024 captured.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from services.worker.engine.runner import resolve_token_ids
from services.worker.engine.step_inputs import HostStep, StepTensors, host_tensor
from services.worker.kernels import w4a8_gemm

Forward = Callable[..., torch.Tensor]  # (StepTensors, logits_out=None) -> (rows, vocab) fp32 logits


class BucketedGraphs:
    """What the decode graphs and the step graphs (step_graphs.py) share: size buckets, one memory
    pool, and the W4A8 workspace address their captures baked in."""

    def __init__(self, buckets: tuple[int, ...], device: torch.device):
        self.buckets = tuple(sorted(set(buckets)))
        self.device = device
        self.graphs: dict[int, object] = {}
        self.pool = None
        self.workspace_ptr = None

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def workspace_moved(self) -> bool:
        """Whether the shared W4A8 workspace was re-allocated since the captures (they point at the old one)."""
        return w4a8_gemm.WORKSPACE.pointer(self.device) != self.workspace_ptr

    def warm_up(self, fn: Callable[[], object]):
        """Before a capture: fn() once on a side stream, waited for, which compiles the kernels and
        sizes the W4A8 workspace (neither may happen inside a capture; without a GPU, where the CPU
        tests' pieces replay eagerly, fn is not run); then every capture dropped if the workspace
        moved, before or during the warm-up, and its address recorded. Returns what fn returned."""
        out = None
        if self.device.type == "cuda":
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out = fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
        if self.workspace_moved():
            self.clear()
            self.workspace_ptr = w4a8_gemm.WORKSPACE.pointer(self.device)
        return out


class DecodeGraphs(BucketedGraphs):
    def __init__(self, forward: Forward, buckets: tuple[int, ...], max_blocks: int, max_model_len: int,
                 device: torch.device):
        super().__init__(buckets, device)
        self.forward = forward
        self.max_model_len = max_model_len
        b = self.buckets[-1]
        self.tokens = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int32, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None  # (largest bucket, vocab) fp32, allocated at the first capture

    def _inputs(self, b: int) -> StepTensors:
        # max_context = max_model_len: the decode kernel's partition grid is fixed at capture.
        return StepTensors(
            tokens=self.tokens[:b], positions=self.positions[:b], slots=self.slots[:b],
            num_prefill=0, cu_seqlens=None, max_seqlen=0,
            block_tables=self.block_tables[:b], context_lens=self.context_lens[:b],
            max_context=self.max_model_len, logit_rows=None,
        )

    def capture(self, b: int) -> None:
        # Padding inputs: no cache writes, zero-length contexts.
        self.slots[:b].fill_(-1)
        self.context_lens[:b].zero_()
        inputs = self._inputs(b)
        vocab = self.warm_up(lambda: self.forward(inputs)).shape[1]
        if self.logits is None:
            self.logits = torch.empty((self.buckets[-1], vocab), dtype=torch.float32, device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.forward(inputs, self.logits[:b])
        self.pool = graph.pool()
        self.graphs[b] = graph

    def replay(self, host: HostStep, previous_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """host: a decode-only step of n <= the largest bucket rows -> (n, vocab) fp32 logits (a copy).
        Placeholder token ids in host.tokens are resolved against previous_token_ids on the device."""
        n = len(host.tokens)
        b = self.bucket_for(n)
        if b not in self.graphs or self.workspace_moved():
            self.capture(b)
        pad = b - n
        tables = host.block_tables
        if tables.shape[1] != self.block_tables.shape[1]:
            raise ValueError(f"block tables of width {tables.shape[1]}, the graphs take {self.block_tables.shape[1]}")
        upload = lambda dst, a: dst.copy_(host_tensor(a, self.device), non_blocking=True)  # noqa: E731
        put = lambda dst, a, fill: upload(dst[:b], np.concatenate([a, np.full(pad, fill, a.dtype)]))  # noqa: E731
        put(self.tokens, host.tokens, 0)
        put(self.positions, host.positions, 0)
        put(self.slots, host.slots, -1)
        put(self.context_lens, host.context_lens, 0)
        upload(self.block_tables[:n], tables)
        if previous_token_ids is not None:
            self.tokens[:b] = resolve_token_ids(self.tokens[:b], previous_token_ids)
        self.graphs[b].replay()
        return self.logits[:n].clone()
