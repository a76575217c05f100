"""RoPE + paged cache write kernels (Triton interpreter) against attention_reference.

The KV4 rows must decode (shared.formats.kv4.decode_rows) to what the reference quantization
gives: fp16 scale and zero exactly, codes exactly except where (x - zero) / scale sits on a
rounding tie. Blocks the slot mapping does not name must keep their poison.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels.attention_reference import (
    build_rope_cache,
    rope_reference,
    write_fp16_cache_reference,
    write_kv4_cache_reference,
)
from services.worker.kernels.kv4_cache import write_fp16_cache, write_kv4_cache
from shared.formats.kv4 import decode_rows, page_row_bytes, quantize_kv4
from shared.formats.nibbles import unpack_halves
from shared.model.config import RopeConfig
from shared.model.rope import inverse_frequencies

POISON = 0xA5
BLOCK_SIZE = 16


def _rope_cache(head_dim: int, max_positions: int = 4096) -> torch.Tensor:
    return build_rope_cache(inverse_frequencies(RopeConfig(theta=10000.0), head_dim), max_positions)


def _kv(t: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Uneven channel ranges and per-token offsets, like real keys and values.
    spread = torch.linspace(0.2, 4.0, d)[torch.randperm(d, generator=g)]
    k = (torch.randn(t, kv_heads, d, generator=g) * spread + torch.randn(t, kv_heads, 1, generator=g)).half()
    v = (torch.randn(t, kv_heads, d, generator=g) * 2).half()
    return k, v


def _prefill_slots(lengths: list[int], num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """Positions and slots of sequences laid on shuffled physical blocks; returns the blocks used."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    positions, slots, used = [], [], set()
    for n in lengths:
        blocks = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        used.update(blocks)
        positions += list(range(n))
        slots += [blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(n)]
    return torch.tensor(positions), torch.tensor(slots, dtype=torch.int64), used


def _assert_rows_match(got: torch.Tensor, ref: torch.Tensor, rotated: torch.Tensor, ratio: float = 1.0) -> None:
    """got/ref (T, kv_heads, D/2 + 4) uint8 rows; rotated (T, kv_heads, D) fp16: what was encoded."""
    d = rotated.shape[-1]
    assert torch.equal(got[..., d // 2 :], ref[..., d // 2 :]), "fp16 scale/zero differ"
    codes, ref_codes = unpack_halves(got[..., : d // 2], d).int(), unpack_halves(ref[..., : d // 2], d).int()
    _, scale, zero = quantize_kv4(rotated, ratio)
    x = (rotated.float() - zero.float()[..., None]) / scale.float()[..., None]
    on_tie = ((x - x.floor()) - 0.5).abs() < 1e-4
    diff = (codes - ref_codes).abs()
    assert diff.max() <= 1 and not (diff.bool() & ~on_tie).any(), "codes differ off a rounding tie"
    assert torch.allclose(decode_rows(got), decode_rows(ref), atol=scale.float().max().item() * 1.01)


def _slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return cache[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE]  # (T, kv_heads, R)


# kv_heads 20 / 6 x group 4: two head tiles per token (HEADS_PER_PROGRAM), the last one partial;
# 3 x group 3: one tile with a masked KV head and padded groups.
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 2, 2), (128, 1, 4), (128, 2, 1), (64, 20, 1), (64, 6, 4), (64, 3, 3)])
def test_kv4_prefill_write_matches_reference(head_dim, kv_heads, group):
    lengths = [1, 15, 17, 33]
    num_blocks = 12
    positions, slots, used = _prefill_slots(lengths, num_blocks, seed=head_dim + group)
    k, v = _kv(len(slots), kv_heads, head_dim, seed=1)
    q = torch.randn(len(slots), kv_heads * group, head_dim).half()
    rope = _rope_cache(head_dim)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, page_row_bytes(head_dim))
    k_cache = torch.full(shape, POISON, dtype=torch.uint8)
    v_cache = k_cache.clone()

    q_rot = write_kv4_cache(k, v, positions, slots, rope, k_cache, v_cache, query=q)

    k_ref, v_ref = k_cache.clone().fill_(POISON), v_cache.clone().fill_(POISON)
    write_kv4_cache_reference(k, v, positions, slots, rope, k_ref, v_ref)
    k_rot = rope_reference(k, positions, rope)
    _assert_rows_match(_slot_rows(k_cache, slots), _slot_rows(k_ref, slots), k_rot)
    _assert_rows_match(_slot_rows(v_cache, slots), _slot_rows(v_ref, slots), v)
    assert torch.equal(q_rot, rope_reference(q, positions, rope))
    # Written rows decode close to the rotated keys (half a step), and nothing else was touched.
    step = quantize_kv4(k_rot)[1].float()[..., None]
    assert ((decode_rows(_slot_rows(k_cache, slots)) - k_rot.float()).abs() <= step * 0.5 + 1e-3).all()
    unused = sorted(set(range(num_blocks)) - used)
    assert (k_cache[unused] == POISON).all() and (v_cache[unused] == POISON).all()
    # Rows past each sequence's end inside its last block are untouched too.
    written = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    written[slots] = True
    untouched = k_cache.transpose(1, 2).reshape(num_blocks * BLOCK_SIZE, -1)[~written]
    assert (untouched == POISON).all()


def test_kv4_decode_step_writes_one_token_per_sequence():
    """Decode: one new token per sequence at its own position, next to rows written before."""
    head_dim, kv_heads, num_blocks = 128, 2, 8
    rope = _rope_cache(head_dim)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, page_row_bytes(head_dim))
    k_cache = torch.full(shape, POISON, dtype=torch.uint8)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # Three sequences at lengths 16, 33 and 5 on blocks (3), (6, 0, 5), (1): the next slot of each.
    positions = torch.tensor([16, 33, 5], dtype=torch.int32)
    slots = torch.tensor([3 * BLOCK_SIZE + 0, 5 * BLOCK_SIZE + 1, 1 * BLOCK_SIZE + 5], dtype=torch.int64)
    k, v = _kv(3, kv_heads, head_dim, seed=7)

    assert write_kv4_cache(k, v, positions, slots, rope, k_cache, v_cache) is None
    write_kv4_cache_reference(k, v, positions, slots, rope, k_ref, v_ref)

    _assert_rows_match(_slot_rows(k_cache, slots), _slot_rows(k_ref, slots), rope_reference(k, positions, rope))
    _assert_rows_match(_slot_rows(v_cache, slots), _slot_rows(v_ref, slots), v)
    others = torch.ones(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    others[slots] = False
    assert (k_cache.transpose(1, 2).reshape(num_blocks * BLOCK_SIZE, -1)[others] == POISON).all()


@pytest.mark.parametrize("head_dim,kv_range", [(128, (0.9, 0.75)), (64, (1.0, 0.85))])
def test_kv4_write_with_range_ratios_matches_reference(head_dim, kv_range):
    """A layer's K and V range ratios: the kernel narrows [min, max] exactly as the reference does."""
    kv_heads, num_blocks = 2, 6
    positions, slots, _ = _prefill_slots([5, 31, 19], num_blocks, seed=11)
    k, v = _kv(len(slots), kv_heads, head_dim, seed=5)
    rope = _rope_cache(head_dim)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, page_row_bytes(head_dim))
    k_cache, v_cache = torch.full(shape, POISON, dtype=torch.uint8), torch.full(shape, POISON, dtype=torch.uint8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv4_cache(k, v, positions, slots, rope, k_cache, v_cache, kv_range=kv_range)
    write_kv4_cache_reference(k, v, positions, slots, rope, k_ref, v_ref, kv_range=kv_range)

    k_rot = rope_reference(k, positions, rope)
    _assert_rows_match(_slot_rows(k_cache, slots), _slot_rows(k_ref, slots), k_rot, kv_range[0])
    _assert_rows_match(_slot_rows(v_cache, slots), _slot_rows(v_ref, slots), v, kv_range[1])
    # A ratio below 1 takes effect: a finer step than the full range's, the extremes clamped.
    full_step = quantize_kv4(v)[1].float()
    v_step = decode_rows(_slot_rows(v_cache, slots))  # values on the narrowed grid
    assert (v_step.amax(-1) - v_step.amin(-1) < (v.float().amax(-1) - v.float().amin(-1)) - full_step).all()


def test_negative_slots_are_skipped_and_constant_rows_stay_finite():
    head_dim, kv_heads, num_blocks = 64, 1, 2
    rope = _rope_cache(head_dim)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, page_row_bytes(head_dim))
    k_cache = torch.full(shape, POISON, dtype=torch.uint8)
    v_cache = k_cache.clone()
    k = torch.full((3, kv_heads, head_dim), 2.5).half()  # a constant row: scale clamps, no 0/0
    v = torch.zeros(3, kv_heads, head_dim).half()
    slots = torch.tensor([4, -1, 20], dtype=torch.int64)
    write_kv4_cache(k, v, torch.zeros(3, dtype=torch.int64), slots, rope, k_cache, v_cache)
    rows = k_cache.view(-1, kv_heads, k_cache.shape[-1]).clone()
    assert (rows[[i for i in range(num_blocks * BLOCK_SIZE) if i not in (4, 20)]] == POISON).all()
    decoded = decode_rows(rows[[4, 20]])
    assert torch.isfinite(decoded).all() and torch.allclose(decoded, torch.full_like(decoded, 2.5), atol=1e-2)
    assert torch.equal(decode_rows(v_cache.view(-1, kv_heads, v_cache.shape[-1])[[4, 20]]), torch.zeros(2, 1, head_dim))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp16_write_matches_reference(head_dim):
    kv_heads, num_blocks = 2, 10
    positions, slots, used = _prefill_slots([17, 2, 33], num_blocks, seed=3)
    k, v = _kv(len(slots), kv_heads, head_dim, seed=2)
    rope = _rope_cache(head_dim)
    nan = torch.full((num_blocks, kv_heads, BLOCK_SIZE, head_dim), float("nan"), dtype=torch.float16)
    k_cache, v_cache, k_ref, v_ref = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    write_fp16_cache(k, v, positions, slots, rope, k_cache, v_cache)
    write_fp16_cache_reference(k, v, positions, slots, rope, k_ref, v_ref)
    assert torch.equal(_slot_rows(k_cache, slots), _slot_rows(k_ref, slots))
    assert torch.equal(_slot_rows(v_cache, slots), v)
    unused = sorted(set(range(num_blocks)) - used)
    assert k_cache[unused].isnan().all() and v_cache[unused].isnan().all()


def test_bad_inputs_name_the_value():
    rope = _rope_cache(64)
    k = torch.zeros(2, 1, 64, dtype=torch.float16)
    cache = torch.zeros(2, 1, BLOCK_SIZE, page_row_bytes(64), dtype=torch.uint8)
    slots, positions = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32"):
        write_kv4_cache(k.float(), k.float(), positions, slots, rope, cache, cache.clone())
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv4_cache(k, k, positions, slots.int(), rope, cache, cache.clone())
    with pytest.raises(ValueError, match="k_cache"):
        write_kv4_cache(k, k, positions, slots, rope, cache[..., :-1], cache.clone())
    with pytest.raises(ValueError, match="k_cache must be .* torch.float16"):
        write_fp16_cache(k, k, positions, slots, rope, cache, cache.clone())


def _feedback_factor(kv_heads: int, d: int, seed: int) -> torch.Tensor:
    """A U as the quantizer makes it: from correlated query statistics (shared.quant.key_feedback)."""
    from shared.quant.key_feedback import feedback_factor

    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(kv_heads, d, d, generator=g)
    return feedback_factor(mix @ mix.transpose(1, 2) / d)


@pytest.mark.parametrize("head_dim,kv_heads,kv_range", [(128, 2, (1.0, 0.8)), (64, 3, (0.9, 1.0))])
def test_kv4_write_with_key_feedback_matches_reference_bit_for_bit(head_dim, kv_heads, kv_range):
    """Error-feedback rounding of the keys: every step's error moves the later dims, so one code
    off would move the rest; the kernel's rows equal the reference's byte for byte (keys and values).
    18 tokens, one of them padding (slot -1), which is not written."""
    num_blocks = 5
    positions, slots, _ = _prefill_slots([5, 11, 2], num_blocks, seed=21)
    slots[6] = -1
    k, v = _kv(len(slots), kv_heads, head_dim, seed=9)
    rope = _rope_cache(head_dim)
    u = _feedback_factor(kv_heads, head_dim, seed=4)
    shape = (num_blocks, kv_heads, BLOCK_SIZE, page_row_bytes(head_dim))
    k_cache, v_cache = torch.full(shape, POISON, dtype=torch.uint8), torch.full(shape, POISON, dtype=torch.uint8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv4_cache(k, v, positions, slots, rope, k_cache, v_cache, kv_range=kv_range, key_feedback=u)
    write_kv4_cache_reference(k, v, positions, slots, rope, k_ref, v_ref, kv_range=kv_range, key_feedback=u)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots[slots >= 0]
    plain = k_cache.clone()
    write_kv4_cache_reference(k, v, positions, slots, rope, plain, v_ref.clone(), kv_range=kv_range)
    assert not torch.equal(plain, k_cache)  # the feedback changed codes (same scale and zero bytes)
    d = head_dim
    assert torch.equal(_slot_rows(plain, written)[..., d // 2 :], _slot_rows(k_cache, written)[..., d // 2 :])


def test_key_feedback_write_on_extreme_keys():
    """The kernel reads each code back from the dim's final value (w - e, _feedback_codes): exact
    for empty ranges (all-zero and constant keys, at position 0 where RoPE is the identity), a lone
    outlier, a narrow range far from zero, and clamping everywhere (K range ratio 0.6)."""
    d, kv_heads = 64, 2
    g = torch.Generator().manual_seed(5)
    k = torch.randn(6, kv_heads, d, generator=g)
    k[0] = 0.0
    k[1] = 7.5
    k[2] = -300.0
    k[3] = torch.randn(kv_heads, d, generator=g) * 1e-3
    k[3, :, 17] = 1000.0
    k[4] = 2000.0 + torch.randn(kv_heads, d, generator=g) * 4
    k = k.half()
    positions = torch.tensor([0, 0, 0, 3, 0, 9])
    slots = torch.arange(6, dtype=torch.int64)
    rope = _rope_cache(d)
    u = _feedback_factor(kv_heads, d, seed=8)
    shape = (1, kv_heads, BLOCK_SIZE, page_row_bytes(d))
    k_cache, v_cache = torch.full(shape, POISON, dtype=torch.uint8), torch.full(shape, POISON, dtype=torch.uint8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv4_cache(k, k, positions, slots, rope, k_cache, v_cache, kv_range=(0.6, 1.0), key_feedback=u)
    write_kv4_cache_reference(k, k, positions, slots, rope, k_ref, v_ref, kv_range=(0.6, 1.0), key_feedback=u)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    codes = unpack_halves(_slot_rows(k_cache, slots)[..., : d // 2], d)
    assert (codes[:3] == 0).all() and (codes == 15).any() and (codes == 0).any()



def test_key_feedback_of_the_wrong_shape_is_refused():
    k, v = _kv(2, 2, 64, seed=1)
    rope = _rope_cache(64)
    cache = torch.zeros(1, 2, BLOCK_SIZE, page_row_bytes(64), dtype=torch.uint8)
    slots = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(ValueError, match="key_feedback"):
        write_kv4_cache(k, v, torch.arange(2), slots, rope, cache, cache.clone(), key_feedback=torch.eye(64)[None])
    with pytest.raises(ValueError, match="contiguous"):
        write_kv4_cache(k, v, torch.arange(2), slots, rope, cache, cache.clone(),
                        key_feedback=torch.eye(64).expand(2, 64, 64))


def test_rotated_query_goes_into_the_given_rows_of_a_larger_buffer():
    """query_out: the runner's step buffer holds (T, heads + kv_heads, D) rows and takes the rotated
    query in its first heads; the kernel writes exactly those, bit-equal to its own output."""
    d, kv_heads, heads, t = 64, 2, 4, 5
    rope = _rope_cache(d)
    k, v = _kv(t, kv_heads, d, seed=7)
    q = (torch.randn(t, heads, d, generator=torch.Generator().manual_seed(8)) * 2).half()
    positions, slots, _ = _prefill_slots([t], 4, seed=9)
    cache = lambda: torch.full((4, kv_heads, BLOCK_SIZE, page_row_bytes(d)), POISON, dtype=torch.uint8)  # noqa: E731
    own = write_kv4_cache(k, v, positions, slots, rope, cache(), cache(), query=q)
    buffer = torch.full((t, heads + kv_heads, d), 7.0, dtype=torch.float16)
    got = write_kv4_cache(k, v, positions, slots, rope, cache(), cache(), query=q, query_out=buffer[:, :heads])
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :heads], own) and (buffer[:, heads:] == 7.0).all()
    with pytest.raises(ValueError, match="query_out"):
        write_kv4_cache(k, v, positions, slots, rope, cache(), cache(), query=q, query_out=buffer[:, : heads - 1])
    with pytest.raises(ValueError, match="query_out"):
        write_fp16_cache(k, v, positions, slots, rope, torch.zeros(4, kv_heads, BLOCK_SIZE, d, dtype=torch.float16),
                         torch.zeros(4, kv_heads, BLOCK_SIZE, d, dtype=torch.float16), query_out=buffer[:, :heads])
