"""Chunk-continuation prefill attention over the paged cache (Triton interpreter) against its reference."""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels.attention_reference import paged_prefill_reference
from services.worker.kernels.paged_prefill_attention import paged_prefill_attention
from services.worker.kernels.prefill_attention import PrefillConfig
from tests.kernels.conftest import paged_batch


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Looser elementwise than the decode kernels' check: the kernel rounds each decoded K/V value
    (up to ~8 here) to fp16 for the tensor cores, ~4e-3 absolute, against a KV4 step of ~0.4."""
    assert out.dtype == torch.float16 and out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs()
    assert (err <= 1e-2 + 4e-3 * ref.float().abs()).all(), f"max error {err.max().item():.3g}"
    assert err.norm() / ref.float().norm().clamp_min(1e-6) < 2e-3

CASES = [
    # kv4, head_dim, kv_heads, group, (start, length) per chunk, config
    (True, 128, 2, 2, [(5, 1), (17, 40), (0, 19), (33, 64)], None),
    (True, 64, 1, 4, [(16, 16), (1, 70)], PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)),
    (True, 128, 2, 1, [(100, 3), (31, 33)], PrefillConfig(block_m=16, block_n=16, num_warps=2, num_stages=1)),
    (False, 128, 2, 2, [(5, 1), (17, 40), (0, 19)], None),
    (False, 64, 2, 3, [(48, 17), (7, 9)], PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)),
]


@pytest.mark.parametrize("kv4, head_dim, kv_heads, group, chunks, config", CASES)
def test_chunks_over_cached_prefixes_match_reference(kv4, head_dim, kv_heads, group, chunks, config):
    # Every chunk's positions [0, start + length) are in the cache (the runner writes the chunk's
    # K/V before attention); rows past each end and unnamed blocks hold NaN / 0xFF garbage.
    _, k_cache, v_cache, tables, _ = paged_batch([s + n for s, n in chunks], kv_heads, group, head_dim, kv4, seed=len(chunks))
    g = torch.Generator().manual_seed(7)
    total = sum(n for _, n in chunks)
    query = (torch.randn(total, kv_heads * group, head_dim, generator=g) * 1.5).half()
    cu = torch.tensor([0] + [sum(n for _, n in chunks[: i + 1]) for i in range(len(chunks))], dtype=torch.int32)
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32)
    out = paged_prefill_attention(query, k_cache, v_cache, cu, starts, tables, max_seqlen=max(n for _, n in chunks),
                                  config=config)
    assert_attention_close(out, paged_prefill_reference(query, k_cache, v_cache, cu, starts, tables))


def test_a_chunk_row_equals_a_decode_query_at_its_position():
    # The last row of a chunk sees exactly what a decode token at that position sees.
    from services.worker.kernels.attention_reference import paged_decode_reference

    _, k_cache, v_cache, tables, _ = paged_batch([50], 2, 2, 128, True, seed=3)
    query = (torch.randn(20, 4, 128, generator=torch.Generator().manual_seed(4)) * 1.5).half()
    cu, starts = torch.tensor([0, 20], dtype=torch.int32), torch.tensor([30], dtype=torch.int32)
    out = paged_prefill_attention(query, k_cache, v_cache, cu, starts, tables, max_seqlen=20)
    ref = paged_decode_reference(query[-1:], k_cache, v_cache, tables, torch.tensor([50], dtype=torch.int32))
    assert_attention_close(out[-1:], ref)


def test_bad_inputs_are_refused_with_the_reason():
    _, k_cache, v_cache, tables, _ = paged_batch([20], 2, 2, 128, True, seed=5)
    query = torch.zeros(4, 4, 128, dtype=torch.float16)
    cu, starts = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([16], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim 64"):
        paged_prefill_attention(query[..., :64].contiguous(), k_cache, v_cache, cu, starts, tables, max_seqlen=4)
    with pytest.raises(ValueError, match="kv_heads 2"):
        paged_prefill_attention(query[:, :3].contiguous(), k_cache, v_cache, cu, starts, tables, max_seqlen=4)
    with pytest.raises(ValueError, match="starts must be"):
        paged_prefill_attention(query, k_cache, v_cache, cu, starts.long(), tables, max_seqlen=4)
    assert paged_prefill_attention(query[:0], k_cache, v_cache, cu[:1], starts[:0], tables[:0], max_seqlen=0).shape == (0, 4, 128)


def test_chunks_past_what_their_block_tables_address_are_refused():
    """A table one block short for 40-token contexts was accepted: the kernel read the next row's entries
    (or past the table), garbage that changed from run to run."""
    _, k_cache, v_cache, tables, _ = paged_batch([40, 40], 2, 2, 128, True, seed=6)
    query = torch.zeros(8, 4, 128, dtype=torch.float16)
    cu, starts = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([36, 36], dtype=torch.int32)
    short = tables[:, :1].contiguous()  # 1 block of 16 tokens
    with pytest.raises(ValueError, match="chunks end at up to 40 tokens, past what block_tables of 1 blocks"):
        paged_prefill_attention(query, k_cache, v_cache, cu, starts, short, max_seqlen=4)  # read from the tensors
    with pytest.raises(ValueError, match="past what block_tables of 1 blocks"):
        paged_prefill_attention(query, k_cache, v_cache, cu, starts, short, max_seqlen=4, max_context_len=40)


@pytest.mark.parametrize("cu", [[0, 4, 12], [1, 4, 8], [0, 6, 4]])
def test_offsets_past_the_rows_or_out_of_order_are_refused_when_read(cu):
    """Read to size the grid (no max_seqlen / max_context_len), they are checked: an end past the rows had the
    kernels read and write beyond the tensors (rows of a larger buffer behind `out` overwritten)."""
    from services.worker.kernels.prefill_attention import prefill_attention

    _, k_cache, v_cache, tables, _ = paged_batch([40, 40], 2, 2, 128, True, seed=6)
    query = torch.zeros(8, 4, 128, dtype=torch.float16)
    offsets, starts = torch.tensor(cu, dtype=torch.int32), torch.tensor([16, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to at most the 8 rows"):
        paged_prefill_attention(query, k_cache, v_cache, offsets, starts, tables, max_seqlen=8)
    key = torch.zeros(8, 2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to at most the 8 rows"):
        prefill_attention(query, key, key, offsets)
