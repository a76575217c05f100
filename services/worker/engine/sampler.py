"""Picks the next token of each sequence from its logits, on the runner's device.

Greedy rows take the argmax. Sampled rows scale by temperature, keep the top_k most likely
tokens, then the smallest set whose probability reaches top_p, and draw from what is left with
the request's own generator: a seeded request gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from services.worker.engine.sequence import SamplingOptions


def new_generator(options: SamplingOptions, device: torch.device) -> torch.Generator:
    """The RNG of one sampled request: seeded as asked, or from fresh entropy."""
    g = torch.Generator(device=device)
    if options.seed is None:
        g.seed()
    else:
        g.manual_seed(options.seed)
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits (V,) fp32 -> (V,) fp32 scaled by 1/temperature, -inf outside the top-k / top-p set."""
    # Shifted by the max first (the softmax is the same): a tiny temperature then sends the others
    # to -inf, never the max to +inf (inf - inf is NaN, and multinomial fails the whole step).
    scaled = (logits - logits.max()) / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely always stays.
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= top_p
        drop[0] = False
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    return scaled


def sample(logits: torch.Tensor, options: list[SamplingOptions], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits (n, V) fp32 on the runner's device, one row per sequence -> (n,) int64 token ids on
    that device (no read-back: the engine can launch the next step first)."""
    n = logits.shape[0]
    chosen = torch.argmax(logits, dim=-1)  # (n,) int64: the greedy answer for every row
    for i in range(n):
        opt = options[i]
        if opt.greedy:
            continue
        filtered = filter_logits(logits[i], opt.temperature, opt.top_k, opt.top_p)
        probs = torch.softmax(filtered, dim=-1)
        chosen[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return chosen
