"""How many KV blocks fit: the memory budget minus the weights and one step's activations."""

from __future__ import annotations


class CapacityError(ValueError):
    """The memory budget does not leave room for a KV cache; the message gives the figures."""


def plan_kv_blocks(budget_bytes: int, weight_bytes: int, activation_bytes: int, block_bytes: int,
                   max_useful_blocks: int | None = None) -> int:
    """KV blocks that fit in the budget after weights and activations, at most max_useful_blocks."""
    left = budget_bytes - weight_bytes - activation_bytes
    blocks = left // block_bytes
    if blocks < 1:
        raise CapacityError(
            f"memory budget {_gib(budget_bytes)} leaves no room for the KV cache: weights take "
            f"{_gib(weight_bytes)}, activations {_gib(activation_bytes)}, one KV block {block_bytes} bytes; "
            "raise --gpu-memory-budget, or lower --max-batch-tokens or --max-context-tokens (activations hold "
            "one step's attention over the longest context), or set --kv-blocks"
        )
    return int(blocks if max_useful_blocks is None else min(blocks, max_useful_blocks))


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"
