"""Paged decode attention (Triton interpreter) against the fp32 reference over the decoded cache.

Awkward shapes: contexts ending mid-block, mixed lengths in one batch, shuffled physical blocks,
GQA groups 1/2/4/8 and MQA, head_dim 64 and 128, partitions small enough to take the split path.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels.attention_reference import build_rope_cache, paged_decode_reference
from services.worker.kernels.kv4_cache import write_kv4_cache
from services.worker.kernels.paged_attention import (
    WHOLE_CONTEXT_MAX,
    MMA_DEFAULTS,
    DecodeConfig,
    default_config,
    paged_decode_attention,
    partition_for,
)
from shared.formats.kv4 import page_row_bytes
from tests.kernels.conftest import BLOCK_SIZE, assert_attention_close as _assert_close, paged_batch as _paged_batch
from shared.model.config import LlamaConfig
from shared.model.llama import attention as llama_attention
from shared.model.rope import cos_sin, inverse_frequencies

CASES = [
    # kv4, variant, prefetch, head_dim, kv_heads, group, lengths, partition
    (True, "fma", True, 128, 2, 1, [1, 15, 17, 33, 100], 512),
    (True, "fma", False, 128, 2, 1, [1, 15, 17, 33, 100], 64),
    (True, "fma", True, 64, 2, 2, [1, 15, 17, 33, 100], 64),
    (True, "fma", True, 128, 1, 4, [17, 100, 3], 32),
    (True, "fma", False, 64, 2, 4, [33], 512),
    (True, "dot", False, 64, 1, 8, [15, 100, 1], 64),
    (True, "dot", False, 128, 2, 2, [33, 17], 512),
    (False, "fma", False, 128, 2, 1, [1, 15, 17, 33, 100], 64),
    (False, "fma", False, 64, 1, 4, [100, 15], 512),
]


def test_two_pages_a_tile_with_page_ahead():
    """32-token tiles over 16-token pages: two block-table entries a tile, both loaded a tile ahead."""
    q, k_cache, v_cache, tables, lens = _paged_batch([1, 15, 17, 33, 100, 161], 2, 1, 128, True, seed=9)
    config = DecodeConfig(block_n=32, partition_size=512, num_warps=1, prefetch=True, page_ahead=True)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize("kv4,variant,prefetch,head_dim,kv_heads,group,lengths,partition", CASES)
def test_decode_matches_reference(kv4, variant, prefetch, head_dim, kv_heads, group, lengths, partition):
    q, k_cache, v_cache, tables, lens = _paged_batch(lengths, kv_heads, group, head_dim, kv4, seed=head_dim + group)
    config = DecodeConfig(variant=variant, block_n=32, partition_size=partition, num_warps=1, prefetch=prefetch)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize(
    "head_dim,kv_heads,group,lengths,partition,prefetch,q_gain,page_ahead",
    [(128, 2, 1, [1, 15, 17, 33, 100], 64, True, 1.0, False), (64, 1, 4, [17, 100, 3], 512, False, 1.0, False),
     (64, 2, 2, [40, 0, 18], 32, True, 6.0, False), (128, 1, 4, [17, 100, 3, 161, 0], 512, True, 1.0, True)],
)
def test_int16_scores_match_reference(head_dim, kv_heads, group, lengths, partition, prefetch, q_gain, page_ahead):
    """qk_int16 (dp4a scores; the interpreter spells the byte products out): same tolerance as the
    fp32 planes, for large logits (q_gain 6: one token dominates) and an empty sequence too; and
    with the block-table entries loaded a tile ahead (page_ahead)."""
    q, k_cache, v_cache, tables, lens = _paged_batch(lengths, kv_heads, group, head_dim, True, seed=head_dim + group)
    q = (q.float() * q_gain).half()
    config = DecodeConfig(block_n=16, partition_size=partition, num_warps=1, prefetch=prefetch, qk_int16=True,
                          page_ahead=page_ahead)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize(
    "group,lengths,partition,prefetch,q_gain,page_ahead",
    [(1, [1, 15, 17, 33, 100, 0, 161], 512, True, 1.0, True), (1, [40, 64, 31, 96], 64, True, 1.0, False),
     (1, [1, 15, 17, 33, 100], 64, False, 6.0, False), (1, [130, 0, 7, 64], 64, True, 6.0, True),
     (2, [1, 15, 17, 33, 100, 0, 161], 512, True, 1.0, True), (4, [130, 0, 7, 64], 64, True, 6.0, True),
     (4, [33, 100, 1], 512, False, 1.0, False), (8, [1, 15, 17, 33, 100, 0, 161], 512, True, 1.0, True),
     (8, [130, 0, 7, 64], 64, False, 6.0, False)],
)
def test_mma_scores_match_reference(group, lengths, partition, prefetch, q_gain, page_ahead):
    """The 'mma' kernel (int8 tensor-core scores, written lane by lane; the interpreter emulates the
    MMA and the shuffles over the fragments): partial tiles, empty sequences, the split path
    (partitions of 64), large logits (q_gain 6), garbage rows past each context, the block-table
    entries loaded a tile ahead (page_ahead), and groups of 2, 4 and 8 query heads (one MMA column
    pair each; heads 4..7 of a group of 8 on a second set of MMAs)."""
    q, k_cache, v_cache, tables, lens = _paged_batch(lengths, 2, group, 128, True, seed=len(lengths) + partition)
    q = (q.float() * q_gain).half()
    config = DecodeConfig("mma", block_n=32, partition_size=partition, num_warps=1, prefetch=prefetch,
                          page_ahead=page_ahead)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize(
    "group,heads_per_program,lengths,partition,prefetch,page_ahead",
    [(8, 4, [1, 17, 100, 0], 64, True, True), (8, 4, [130, 0, 7, 64], 512, False, False),
     (4, 2, [33, 100, 1, 0], 64, True, False), (2, 1, [130, 7, 64], 512, False, False)],
)
def test_mma_heads_split_across_programs(group, heads_per_program, lengths, partition, prefetch, page_ahead):
    """heads_per_program below the group: several programs read one KV head, each writing its own
    slice of the query heads (on both the split path and the single-partition path)."""
    q, k_cache, v_cache, tables, lens = _paged_batch(lengths, 2, group, 128, True, seed=len(lengths) + group)
    config = DecodeConfig("mma", block_n=32, partition_size=partition, num_warps=1, prefetch=prefetch,
                          page_ahead=page_ahead, heads_per_program=heads_per_program)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize(
    "group,lengths,partition,prefetch,q_gain,heads_per_program",
    [(1, [1, 15, 17, 33, 100, 0, 161], 512, True, 1.0, None), (2, [130, 0, 7, 64], 64, True, 6.0, None),
     (4, [33, 100, 1], 512, False, 1.0, None), (8, [1, 17, 100, 0], 64, True, 1.0, None),
     (8, [130, 0, 7, 64], 512, False, 6.0, 4)],
)
def test_mma_value_sums_on_tensor_cores_match_reference(group, lengths, partition, prefetch, q_gain, heads_per_program):
    """pv_mma: the value sums as fp16 MMAs (codes as 1024 + c, weights rounded to fp16, the 1024s
    taken back out with the rounded weights' sum): every group, the split path, partial tiles, empty
    sequences, large logits, and a group split over programs."""
    q, k_cache, v_cache, tables, lens = _paged_batch(lengths, 2, group, 128, True, seed=len(lengths) + 10 * group)
    q = (q.float() * q_gain).half()
    config = DecodeConfig("mma", block_n=32, partition_size=partition, num_warps=1, prefetch=prefetch,
                          page_ahead=prefetch, heads_per_program=heads_per_program, pv_mma=True)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize(
    "group,lengths,partition,q_gain,prefetch",
    [(8, [1, 17, 100, 0], 64, 1.0, False), (8, [130, 0, 7, 64], 512, 6.0, False), (4, [33, 100, 1], 64, 1.0, False),
     (1, [1, 15, 161, 0], 512, 1.0, False), (8, [1, 17, 130, 0, 64], 64, 1.0, True), (4, [161, 31, 96], 512, 6.0, True)],
)
def test_head_rows_kernel_matches_reference(group, lengths, partition, q_gain, prefetch):
    """head_rows (paged_attention_head_rows.py): the query heads as the score MMA's rows (s8 x u8,
    emulated), the softmax over quads, the value MMAs fed from the score fragments: groups of 8, 4
    and 1, the split path, partial tiles, empty sequences, large logits, and with prefetch
    sequences of no, one and several full tiles."""
    q, k_cache, v_cache, tables, lens = _paged_batch(lengths, 2, group, 128, True, seed=len(lengths) + 20 * group)
    q = (q.float() * q_gain).half()
    config = DecodeConfig("mma", block_n=32, partition_size=partition, num_warps=1, prefetch=prefetch, head_rows=True)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


@pytest.mark.parametrize("group", [4, 8])
def test_group_4_and_8_defaults_are_head_rows_and_match_reference(group):
    """With no config, groups 4 and 8 at head_dim 128 get MMA_DEFAULTS (the head-rows kernel with
    prefetch), here over sequences of no, one and several full tiles."""
    q, k_cache, v_cache, tables, lens = _paged_batch([1, 40, 0, 100, 64], 2, group, 128, True, seed=group)
    config = default_config(True, group, 128, BLOCK_SIZE)
    assert config.head_rows and config.prefetch
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))


def test_partition_grows_while_every_sm_keeps_enough_programs():
    """max_partition_size: the H200 (132 SMs) points that chose the head-rows defaults'
    partitions (bench/results/h200/attention_head_rows_defaults.json)."""
    cfg = DecodeConfig("mma", block_n=32, partition_size=256, num_warps=1, prefetch=False, head_rows=True,
                       max_partition_size=1024)
    assert partition_for(cfg, 64 * 4, 1536, 132) == 256  # group 8, batch 64: 512 would leave 768 programs
    assert partition_for(cfg, 64 * 4, 4096, 132) == 512
    assert partition_for(cfg, 64 * 8, 1536, 132) == 512  # group 4
    assert partition_for(cfg, 64 * 8, 4096, 132) == 1024  # never beyond max_partition_size
    assert partition_for(cfg, 8, 1_000_000, 132) == 1024
    assert partition_for(cfg, 64 * 8, 4096, None) == 256  # not a GPU: the configured partition
    assert partition_for(MMA_DEFAULTS[8], 256 * 4, 1280, 132) == 512  # group 8 lost with 1024 at every point
    with pytest.raises(ValueError, match="max_partition_size"):
        DecodeConfig(block_n=32, partition_size=512, max_partition_size=256)


def test_mma_refuses_what_it_does_not_cover():
    q, k_cache, v_cache, tables, lens = _paged_batch([20], 1, 3, 128, True, seed=1)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 query heads per KV head"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, config=DecodeConfig("mma", block_n=32, num_warps=1))
    with pytest.raises(ValueError, match="32-token tiles"):
        DecodeConfig("mma", block_n=16, num_warps=1)
    with pytest.raises(ValueError, match="page_ahead"):
        DecodeConfig("mma", block_n=32, num_warps=1, prefetch=False, page_ahead=True)
    with pytest.raises(ValueError, match="heads_per_program"):
        DecodeConfig("fma", heads_per_program=2)
    with pytest.raises(ValueError, match="pv_mma"):
        DecodeConfig("dot", pv_mma=True)
    with pytest.raises(ValueError, match="head_rows"):
        DecodeConfig("mma", block_n=32, num_warps=1, page_ahead=True, head_rows=True)
    with pytest.raises(ValueError, match="heads_per_program"):
        DecodeConfig("mma", block_n=32, num_warps=1, heads_per_program=8)
    q, k_cache, v_cache, tables, lens = _paged_batch([20], 1, 2, 128, True, seed=1)
    with pytest.raises(ValueError, match="does not divide the group of 2"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens,
                               config=DecodeConfig("mma", block_n=32, num_warps=1, heads_per_program=4))


@pytest.mark.parametrize("kv4", [True, False])
def test_long_context_takes_the_split_path(kv4):
    """600 tokens over partitions of 128: five partials per head, the last one partial, reduced."""
    q, k_cache, v_cache, tables, lens = _paged_batch([600, 129], 1, 2, 64, kv4, seed=5)
    config = DecodeConfig(block_n=32, partition_size=128, num_warps=1)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config, max_context_len=600)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))
    # The default launch (one partition of 512 would not cover 600: it splits too) agrees.
    _assert_close(paged_decode_attention(q, k_cache, v_cache, tables, lens), out)


def test_peaked_scores_and_empty_sequences():
    """Large logits (one token dominates) stay accurate; a sequence of length 0 gives zeros."""
    q, k_cache, v_cache, tables, lens = _paged_batch([40, 0, 18], 2, 2, 64, True, seed=9)
    q = (q.float() * 6).half()
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=DecodeConfig(block_n=16, partition_size=32))
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))
    assert (out[1] == 0).all()


@pytest.mark.parametrize("kv4,variant", [(True, "fma"), (True, "dot"), (False, "fma")])
def test_empty_sequence_gives_zeros_without_a_split(kv4, variant, monkeypatch):
    """One partition (no reduction pass): the kernel itself must write the empty row, not leave
    the output's stale memory there (a decode graph's padding rows have context 0)."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(float("nan")))
    q, k_cache, v_cache, tables, lens = _paged_batch([40, 0, 18], 1, 2, 64, kv4, seed=11)
    config = DecodeConfig(variant=variant, block_n=16, partition_size=512, num_warps=1)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, config=config)
    _assert_close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens))
    assert (out[1] == 0).all()


def test_written_cache_attends_like_the_reference_model():
    """Prefill a sequence through write_kv4_cache; decoding its last token matches the reference
    Llama attention with a KV4 cache (shared.model.llama.attention, kv_bits=4) for that token."""
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=64, vocab_size=16)
    t = 37
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(1, t, config.q_size + 2 * config.kv_size, generator=g).half().float()
    inv_freq = inverse_frequencies(config.rope, config.head_dim)
    cos, sin = cos_sin(torch.arange(t), inv_freq)
    ref = llama_attention(config, qkv, cos, sin, kv_bits=4)[0, -1].view(config.num_heads, config.head_dim)

    q, k, v = qkv[0].half().split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    q = q.reshape(t, config.num_heads, config.head_dim)
    k = k.reshape(t, config.num_kv_heads, config.head_dim)
    v = v.reshape(t, config.num_kv_heads, config.head_dim)
    blocks = [5, 2, 7]  # physical blocks of the sequence, out of order
    slots = torch.tensor([blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(t)])
    shape = (8, config.num_kv_heads, BLOCK_SIZE, page_row_bytes(config.head_dim))
    k_cache = torch.full(shape, 0x77, dtype=torch.uint8)
    v_cache = k_cache.clone()
    rope = build_rope_cache(inv_freq, 64)
    q_rot = write_kv4_cache(k, v, torch.arange(t), slots, rope, k_cache, v_cache, query=q)
    out = paged_decode_attention(
        q_rot[-1:], k_cache, v_cache, torch.tensor([blocks], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    )
    assert torch.isfinite(out).all()
    # The reference rotates and quantizes fp32 keys; the cache holds fp16-rounded rotated keys.
    assert (out[0].float() - ref).norm() / ref.norm() < 1e-2


def test_whole_context_only_when_the_batch_fills_the_gpu():
    cfg = DecodeConfig(block_n=32, partition_size=512, whole_context=True)
    # 132 SMs: 1056 programs (8 each) are enough; the context is padded to a tile.
    assert partition_for(cfg, 2048, 1500, 132) == 1504
    assert partition_for(cfg, 2048, 300, 132) == 512  # never below the configured partition
    assert partition_for(cfg, 1055, 1500, 132) == 512  # too few programs: split the context
    assert partition_for(cfg, 2048, WHOLE_CONTEXT_MAX + 1, 132) == 512  # too long a context
    assert partition_for(cfg, 2048, 1500, None) == 512  # not a GPU
    assert partition_for(DecodeConfig(block_n=32, partition_size=512), 2048, 1500, 132) == 512  # not asked for


def test_bad_inputs_name_the_value():
    q, k_cache, v_cache, tables, lens = _paged_batch([5], 2, 2, 64, True, seed=1)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k_cache, v_cache, tables.long(), lens)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens.long())
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q, k_cache[..., :-4], v_cache[..., :-4], tables, lens)
    with pytest.raises(ValueError, match="partition_size"):
        DecodeConfig(block_n=64, partition_size=96)
    with pytest.raises(ValueError, match="qk_int16"):
        DecodeConfig(variant="dot", qk_int16=True)
    fp16_cache = torch.zeros(k_cache.shape[:3] + (64,), dtype=torch.float16)
    with pytest.raises(ValueError, match="only the 'fma' kernel"):
        paged_decode_attention(q, fp16_cache, fp16_cache.clone(), tables, lens, config=DecodeConfig(variant="dot"))
