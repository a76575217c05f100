"""The block allocator: free and used counts, growth to cover positions, release."""

import pytest

from services.worker.engine.block_manager import BlockManager, OutOfBlocks


def test_grow_covers_positions_and_release_returns_blocks():
    bm = BlockManager(num_blocks=5, block_size=4)
    table: list[int] = []
    assert bm.extra_blocks(table, 9) == 3
    bm.grow(table, 9)  # positions 0..8 need 3 blocks of 4
    assert len(table) == 3 and len(set(table)) == 3
    assert (bm.num_free, bm.num_used) == (2, 3)
    bm.grow(table, 12)  # still inside the third block
    assert len(table) == 3
    bm.grow(table, 13)
    assert len(table) == 4 and bm.num_free == 1
    other: list[int] = []
    assert not bm.can_grow(other, 5)  # 2 blocks needed, 1 free
    with pytest.raises(OutOfBlocks):
        bm.grow(other, 5)
    assert other == [] and bm.num_free == 1  # a refused grow takes nothing
    held = list(table)
    bm.release(table)
    assert table == held and (bm.num_free, bm.num_used) == (5, 0)  # a step in flight may still read it


def test_blocks_are_never_handed_out_twice():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = [], []
    bm.grow(a, 7)
    bm.grow(b, 8)
    assert not set(a) & set(b) and len(a) + len(b) == 8
    bm.release(a)
    c = []
    bm.grow(c, 8)
    assert not set(c) & set(b)


@pytest.mark.parametrize("blocks, size", [(0, 16), (4, 0)])
def test_sizes_must_be_positive(blocks, size):
    with pytest.raises(ValueError):
        BlockManager(blocks, size)
