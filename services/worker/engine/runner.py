"""The contract between the engine (scheduler, block manager, sampler) and a model runner.

A runner owns the weights and the paged KV cache of one artifact and runs one forward step over a
batch of sequence chunks; everything about which sequences run, where their tokens live in the
cache and which token comes next is the engine's. Two runners implement it:

* `reference_runner.ReferenceRunner`: the torch reference numerics (shared/model), any device;
  the CPU backend and the ground truth the GPU runner is checked against.
* `triton_runner.TritonRunner`: the Triton kernels of services/worker/kernels on an NVIDIA GPU.

Paged cache layout (both runners): `num_blocks` blocks of `block_size` token slots. Token `p` of
a sequence lives in physical block `block_table[p // block_size]`, slot `p % block_size`, in every
layer. Physical block ids are the engine's; a runner never allocates or frees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shared.model.config import LlamaConfig


@dataclass(slots=True)
class SequenceChunk:
    """The tokens of one sequence that this step feeds through the model."""

    seq_id: int
    token_ids: list[int]  # a prompt chunk (chunked prefill / recompute), or the one newest token
    start_position: int  # position of token_ids[0]; the cache holds positions [0, start_position)
    # Physical blocks covering positions [0, start_position + len(token_ids)): the sequence's own
    # list, not a copy (read-only for the runner; the engine never changes it during the step).
    block_table: list[int]
    want_logits: bool  # True: return the logits of the chunk's last token (the next token is due)


@dataclass(slots=True)
class StepBatch:
    chunks: list[SequenceChunk]
    # The previous step's sampled ids (rows, on the runner's device), when the engine launched this
    # step before reading them back: a negative token id -(r + 1) in a chunk stands for row r.
    previous_token_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(len(c.token_ids) == 1 and c.start_position > 0 for c in self.chunks)


def resolve_token_ids(tokens: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """tokens (T,) int64 on the device, with -(r + 1) standing for previous[r] -> the real ids
    (device work only: no read-back of `previous`)."""
    if previous is None or previous.numel() == 0:
        return tokens
    rows = (-tokens - 1).clamp(min=0, max=previous.numel() - 1)
    return torch.where(tokens < 0, previous[rows], tokens)


class ModelRunner(Protocol):
    config: LlamaConfig
    format: str  # the artifact's format, e.g. "w4a8kv4-g128" or "fp16"
    device: torch.device
    block_size: int  # token slots per KV block

    def weight_bytes(self) -> int:
        """Device memory the loaded weights take."""

    def kv_block_bytes(self) -> int:
        """Device memory one KV block takes over all layers (K and V, scales and zeros included)."""

    def activation_bytes(self, max_batch_tokens: int) -> int:
        """Peak device memory of the activations of one step of max_batch_tokens tokens."""

    def allocate_cache(self, num_blocks: int) -> None:
        """Allocates (or re-allocates, dropping its contents) the paged KV cache."""

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Resolves placeholder token ids (resolve_token_ids), writes every chunk's K/V into its blocks and returns fp32 logits (n, vocab), on the
        runner's device, for the chunks with want_logits, in batch order (the sampler runs where
        the logits are, so only sampled token ids cross to the host)."""
