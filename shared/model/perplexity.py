"""Perplexity over a whole text in non-overlapping windows (the number every accuracy claim uses)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(slots=True, frozen=True)
class PerplexityResult:
    ppl: float
    tokens: int  # tokens of the text that were scored windows (windows * seq_len)
    windows: int

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "tokens": self.tokens, "windows": self.windows}


def windows_of(token_ids: list[int], seq_len: int) -> torch.Tensor:
    """(W, seq_len) int64: the whole token stream cut into non-overlapping windows, tail dropped."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    n = len(token_ids) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(token_ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)


@torch.no_grad()
def perplexity(
    forward: Callable[[torch.Tensor], torch.Tensor],
    windows: torch.Tensor,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """exp(mean next-token NLL) over every window; each window predicts its tokens 1..T-1."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    total_nll, total_count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        logits = forward(batch)  # (B, T, V)
        nll = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
        total_count += batch[:, 1:].numel()
        if progress:
            progress(min(start + batch_size, windows.shape[0]), windows.shape[0])
    return PerplexityResult(
        ppl=math.exp(total_nll / total_count), tokens=windows.numel(), windows=windows.shape[0]
    )
