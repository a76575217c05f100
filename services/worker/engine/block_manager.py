"""The paged KV cache's block allocator: which physical blocks are free, and how many a sequence needs.

Blocks are interchangeable (no prefix sharing), so a free list is all the state there is. The
engine calls it under its lock; the runner never allocates or frees.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """More blocks were asked for than are free (the scheduler checks first; this is a bug guard)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: the lowest ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens token slots."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to block_table so that it covers positions [0, num_tokens)."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.extra_blocks(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Appends free blocks to block_table (in place) until it covers num_tokens positions."""
        need = self.extra_blocks(block_table, num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"{need} blocks needed, {len(self._free)} free")
        for _ in range(need):
            block_table.append(self._free.pop())

    def release(self, block_table: list[int]) -> None:
        """Returns every block of block_table to the free list. The list itself is left as it is: a
        step in flight may still read it (the caller gives the sequence a new, empty table)."""
        self._free.extend(reversed(block_table))
