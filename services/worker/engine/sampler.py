"""Picks the next token of each sequence from its logits, on the runner's device.

Greedy rows take the argmax. Sampled rows scale by temperature, keep the top_k most likely
tokens, then the smallest set whose probability reaches top_p, and draw from what is left with
the request's own generator: a seeded request gets the same tokens whatever else is in the batch, as far as
its logits do not depend on the batch. On the CPU reference and in the W4A8 formats (integer accumulation)
they do not: on an H100, greedy and seeded requests alone and inside batches of 8 and 24 gave the same 48
tokens in every case (bench/batch_invariance.py, bench/results/h100/batch_invariance.json). The fp16
baseline's cuBLAS GEMMs choose kernels by row count: there one seeded request parted at token 22 in a batch.

A row whose logits hold a NaN or an inf (a broken artifact, an overflow, a failing device) is marked
NON_FINITE in the ids read back to the host, and the engine fails that request alone: streaming its
argmax would hand the client garbage that no health check or canary guard sees. Its sampled rows draw
from a harmless stand-in row meanwhile: torch.multinomial over NaN probabilities is a device-side
assert on CUDA, which would end every request of the worker, not just this one.
"""

from __future__ import annotations

import hashlib

import torch

from services.worker.engine.sequence import SamplingOptions

NON_FINITE = -1  # a read-back id: the row's logits were not finite (never a token id, nor fed to a step)


def new_generator(options: SamplingOptions, device: torch.device) -> torch.Generator:
    """The RNG of one sampled request: seeded as asked, or from fresh entropy."""
    g = torch.Generator(device=device)
    if options.seed is None:
        g.seed()
    else:
        g.manual_seed(mixed_seed(options.seed))
    return g


def mixed_seed(seed: int) -> int:
    """The request's 64-bit seed, hashed: the CPU generator (a Mersenne twister) keeps only the low 32 bits
    of its seed, so seeds a client derives from a counter or a 64-bit hash (1 and 2**32 + 1) drew the same
    tokens. Hashed, seeds differing anywhere give different streams (but for chance collisions)."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


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


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """(n, V) -> (n,) bool, on the logits' device without a sync: True where the row holds no NaN or inf.
    One row sum is enough (a NaN or an inf anywhere makes it non-finite; finite logits cannot overflow
    fp32 in a sum over a vocabulary)."""
    return torch.isfinite(logits.sum(dim=-1))


def ids_for_host(ids: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The ids to read back: NON_FINITE where the row's logits were not (the device ids, fed to the next
    step, stay valid token ids: argmax of a NaN row is still an index)."""
    return torch.where(finite, ids, NON_FINITE)


def sample(logits: torch.Tensor, options: list[SamplingOptions], generators: list[torch.Generator | None],
           finite: torch.Tensor | None = None) -> torch.Tensor:
    """logits (n, V) fp32 on the runner's device, one row per sequence -> (n,) int64 token ids on
    that device (no read-back: the engine can launch the next step first). finite: finite_rows(logits),
    computed here when a row is sampled and it is not given."""
    n = logits.shape[0]
    chosen = torch.argmax(logits, dim=-1)  # (n,) int64: the greedy answer for every row
    for i in range(n):
        opt = options[i]
        if opt.greedy:
            continue
        if finite is None:
            finite = finite_rows(logits)
        row = torch.where(finite[i], logits[i], 0.0)  # a non-finite row: uniform, its request fails on read-back
        filtered = filter_logits(row, opt.temperature, opt.top_k, opt.top_p)
        probs = torch.softmax(filtered, dim=-1)
        chosen[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return chosen
