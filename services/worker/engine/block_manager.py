"""The paged KV cache's block allocator: which physical blocks are free, which are shared, and which
still hold a prompt prefix that a later request may reuse (prefix caching).

A block's K/V depend only on the tokens up to and including its own (and their positions), so a
full block of a prompt is named by the hash of every token from the start of the sequence to its
end (`prefix_block_hashes`, a chain: each block's hash covers its parent's). Once such a block has
been computed it is entered in the cache under that name; a later prompt with the same prefix takes
the block (its reference count goes up) and computes only what follows. A block no sequence holds
any more keeps its content while nothing else needs the space: it is counted free, and handed out
again (its name forgotten) only when no never-used block is left, least recently released first.
Only full blocks are named (a prompt's once computed, and a finished sequence's generated ones): a
sequence writes only past its shared blocks, so no block is ever written while shared.

The engine calls it under its lock; the runner never allocates or frees.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """More blocks were asked for than are free (the scheduler checks first; this is a bug guard)."""


def prefix_block_hashes(token_ids: list[int], block_size: int, known: list[bytes] = (),
                        salt: bytes = b"") -> list[bytes]:
    """The name of each full block of token_ids: sha256 of the previous block's name and this block's
    ids. A cryptographic hash, not Python's: a collision would hand one request another's K/V, and
    Python's hash of integers is predictable enough for a client to aim at one. `known`: the names of
    the first blocks, already computed (they are returned, and only the blocks after them hashed). `salt`
    stands before the first block: requests of another cache scope (Sequence.cache_salt) name blocks apart."""
    hashes, parent = list(known), known[-1] if known else salt
    for start in range(len(known) * block_size, len(token_ids) // block_size * block_size, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start : start + block_size]).tobytes()).digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Never used, or holding nothing worth keeping. Popped from the end: the lowest ids are handed
        # out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks  # sequences holding each block
        self._cached: dict[bytes, int] = {}  # prefix name -> the block holding its K/V
        self._name_of: dict[int, bytes] = {}  # the reverse, for every named block
        self._unheld: OrderedDict[int, None] = OrderedDict()  # named blocks nobody holds, least recently released first

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never used, or kept only for a prefix nobody holds now."""
        return len(self._free) + len(self._unheld)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a named prefix (held by sequences or not)."""
        return len(self._name_of)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens token slots."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to block_table so that it covers positions [0, num_tokens)."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.extra_blocks(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Appends free blocks to block_table (in place) until it covers num_tokens positions."""
        need = self.extra_blocks(block_table, num_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"{need} blocks needed, {self.num_free} free")
        for _ in range(need):
            block = self._free.pop() if self._free else self._evict()
            self._refs[block] = 1
            block_table.append(block)

    def release(self, block_table: list[int]) -> None:
        """Drops the sequence's hold on every block of block_table. The list itself is left as it is: a
        step in flight may still read it (the caller gives the sequence a new, empty table). The last
        blocks go first, so they are the first evicted: a prefix is useless without its start."""
        for block in reversed(block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._name_of:
                    self._unheld[block] = None
                else:
                    self._free.append(block)

    # ---- prefix caching ----

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest run of the named blocks, from the first (none when off)."""
        blocks = []
        for name in hashes:
            block = self._cached.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of blocks nobody holds: taking them leaves that many fewer free."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def share(self, block_table: list[int], blocks: list[int]) -> None:
        """Appends cached blocks (cached_prefix's) to an empty block_table, holding them."""
        assert not block_table, "cached blocks start a sequence's table"
        for block in blocks:
            if self._refs[block] == 0:
                del self._unheld[block]
            self._refs[block] += 1
            block_table.append(block)

    def name(self, block: int, name: bytes) -> None:
        """Records that the (held) block now holds the K/V of the prefix `name`. A prefix already cached
        in another block (two requests computed it side by side) keeps that one."""
        if self.prefix_caching and name not in self._cached and block not in self._name_of:
            self._cached[name] = block
            self._name_of[block] = name

    def forget_cached(self) -> None:
        """Forgets every cached prefix (their content is in doubt); held blocks stay held."""
        self._free.extend(reversed(self._unheld))
        self._unheld.clear()
        self._cached.clear()
        self._name_of.clear()

    def _evict(self) -> int:
        block, _ = self._unheld.popitem(last=False)
        del self._cached[self._name_of.pop(block)]
        return block
