"""Key error-feedback factors: the KV4 keys' codes chosen against the layer's query statistics.

A key's KV4 error matters through the logits it feeds, q . (k - k'), summed over the queries
that will read it. With H = E[q q^T] per KV head (the post-RoPE, SmoothAttention-scaled queries of
the head's group, over every calibration token), the expected squared logit error of a key error e is
e^T H e, and rounding the key's dims in order with each dim's error pushed onto the dims after it
(GPTQ's rule, here for one vector at a time; shared/formats/kv4.py has the exact arithmetic)
lowers it where round-to-nearest treats every dim alike. The cache write needs R, the upper
Cholesky factor of (H + damping)^-1 with its rows divided by their diagonal, per KV head: the
artifact carries it.

Measured on the fixture (session 26, whole eval file, AMD EPYC host): first as an evaluation-only
patch on a g128 QoQ artifact, H from 32 calibration windows of the quantized model: 5.1139 ->
5.1042 (damping 0.1 of the mean diagonal; 0.01: 5.1046); the dims in H's diagonal order instead
5.1049; V rounded the same way against o_proj's per-head Gram as well 5.1028 (within noise of keys
alone, so values keep nearest rounding). In the quantizer, H from the 2048 search tokens gave
5.1051, from every calibration token 5.1044 (bench/results/accuracy_key_feedback.json has the rows).
Over seeds 0-2 (session 27, Intel Xeon host, bench/results/accuracy_seeds.json): g128 mean 5.1105 ->
5.1022, chn 5.1313 -> 5.1229, lower on every seed. Weighting each query's q q^T by how far a key
error moves its attention output did not help on average (mean 5.1020), and a block-diagonal R
(feedback within runs of 32 dims) keeps about three quarters of the gain (README, "Accuracy").
"""

from __future__ import annotations

import torch

from shared.model.config import LlamaConfig

DAMPING = 0.1  # of the mean diagonal of H, added to it before the inverse


def query_second_moment(config: LlamaConfig, q_scaled: torch.Tensor) -> torch.Tensor:
    """q_scaled (S, heads, D) post-RoPE, SmoothAttention-scaled queries -> (kv_heads, D, D): the sum
    of q q^T over the tokens and the query heads of each KV head's group."""
    q = q_scaled.reshape(q_scaled.shape[0], config.num_kv_heads, config.group_size, -1)
    return torch.einsum("sgjd,sgje->gde", q, q)


def feedback_factor(second_moment: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """(kv_heads, D, D) query second moments H -> R (kv_heads, D, D) fp32: U with each row divided by
    its diagonal entry, U upper triangular with U^T U = (H + damping * mean(diag H) * I)^-1 (what
    shared.formats.kv4's feedback rounding takes; dividing here keeps a division out of the cache
    write's per-dim loop)."""
    h = second_moment.double()
    d = h.shape[-1]
    diag_mean = h.diagonal(dim1=-2, dim2=-1).mean(dim=-1).clamp_min(1e-12)  # (kv_heads,)
    h = h + damping * diag_mean[:, None, None] * torch.eye(d, dtype=h.dtype, device=h.device)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(inverse, upper=True)
    r = (u / u.diagonal(dim1=-2, dim2=-1)[..., :, None]).float().triu()
    r.diagonal(dim1=-2, dim2=-1).fill_(1.0)  # exactly 1 (the format's rule), whatever the division rounded to
    return r


def query_moment_of(config: LlamaConfig, q_rope: torch.Tensor) -> torch.Tensor:
    """q_rope (B, heads, T, D) post-RoPE queries, as the attention capture holds them -> their
    (kv_heads, D, D) second moment (fp64), as query_second_moment."""
    heads, d = q_rope.shape[1], q_rope.shape[3]
    return query_second_moment(config, q_rope.double().transpose(1, 2).reshape(-1, heads, d))


def key_feedback_for_block(query_moment: torch.Tensor, lam: torch.Tensor | None, damping: float = DAMPING) -> torch.Tensor:
    """The block's R from its queries' second moment (kv_heads, D, D) over every calibration token
    (post-RoPE, before SmoothAttention), scaled by SmoothAttention's lambda (kv_heads, D) when the
    block applies it: the queries that meet the cached keys are q * lambda."""
    if lam is not None:
        query_moment = query_moment * (lam[:, :, None] * lam[:, None, :]).to(query_moment.dtype)
    return feedback_factor(query_moment, damping)
