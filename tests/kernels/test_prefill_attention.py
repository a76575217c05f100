"""Causal varlen prefill attention (Triton interpreter) against the fp32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.kernels.attention_reference import prefill_reference
from services.worker.kernels.prefill_attention import PrefillConfig, prefill_attention


def _batch(lengths, heads, kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q = (torch.randn(total, heads, head_dim, generator=g) * 1.5).half()
    k = (torch.randn(total, kv_heads, head_dim, generator=g) * 1.5).half()
    v = torch.randn(total, kv_heads, head_dim, generator=g).half()
    return q, k, v, cu


def _assert_close(out, ref):
    assert out.dtype == torch.float16 and out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs()
    assert (err <= 2e-3 + 4e-3 * ref.float().abs()).all(), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize(
    "lengths,heads,kv_heads,head_dim,config",
    [
        ([1, 15, 17, 33, 100], 4, 2, 64, PrefillConfig(block_m=32, block_n=16)),
        ([70, 0, 5], 4, 1, 128, PrefillConfig(block_m=16, block_n=16)),  # MQA, an empty sequence
        ([40], 2, 2, 64, PrefillConfig(block_m=64, block_n=32)),
        ([3, 64], 8, 2, 128, PrefillConfig(block_m=32, block_n=32)),
    ],
)
def test_prefill_matches_reference(lengths, heads, kv_heads, head_dim, config):
    q, k, v, cu = _batch(lengths, heads, kv_heads, head_dim, seed=len(lengths) + head_dim)
    out = prefill_attention(q, k, v, cu, config=config)
    _assert_close(out, prefill_reference(q, k, v, cu))


def test_prefill_matches_sdpa_per_sequence():
    """Same answer as torch's causal SDPA run on each sequence alone (GQA expanded)."""
    q, k, v, cu = _batch([9, 30], 4, 2, 64, seed=3)
    out = prefill_attention(q, k, v, cu, max_seqlen=30, config=PrefillConfig(block_m=16, block_n=16))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[s:e].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(2, dim=0), vs.repeat_interleave(2, dim=0)
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        _assert_close(out[s:e], ref.half())


def test_bad_inputs_name_the_value():
    q, k, v, cu = _batch([4], 4, 2, 64, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill_attention(q, k, v, cu.long())
    with pytest.raises(ValueError, match="not a multiple"):
        prefill_attention(q[:, :3], k, v, cu)
    with pytest.raises(ValueError, match="block_n"):
        PrefillConfig(block_m=16, block_n=32)


def test_writes_into_a_given_output_slice():
    """`out=` (the runner's mixed steps hand each attention kernel its rows of one step output): the
    kernel writes those rows and nothing around them, the same values as a fresh output; a wrong
    output is refused with what it must be."""
    q, k, v, cu = _batch([5, 12], 4, 2, 64, seed=4)
    config = PrefillConfig(block_m=16, block_n=16)
    step_out = torch.full((q.shape[0] + 5, 4, 64), 7.0, dtype=torch.float16)
    rows = step_out[2 : 2 + q.shape[0]]
    assert prefill_attention(q, k, v, cu, max_seqlen=12, config=config, out=rows) is rows
    assert torch.equal(rows, prefill_attention(q, k, v, cu, max_seqlen=12, config=config))
    assert (step_out[:2] == 7).all() and (step_out[2 + q.shape[0]:] == 7).all()
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention(q, k, v, cu, config=config, out=torch.empty(q.shape, dtype=torch.float32))
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention(q, k, v, cu, config=config, out=step_out[:3])
