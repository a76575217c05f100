"""Which Triton kernels compile during a timed region: a benchmark's run that compiles paid for it in its
time, and a worker that compiles while serving stalls every stream (the start-up is meant to compile all)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import triton


@contextlib.contextmanager
def recorded_compiles() -> Iterator[list[str]]:
    """Yields a list that receives one line per kernel specialization compiled (or loaded from Triton's
    disk cache: either is a first launch in this process) inside the block: the kernel's name and
    arguments as Triton prints them."""
    runtime = triton.knobs.runtime
    compiled: list[str] = []
    previous = runtime.jit_cache_hook

    def hook(*, repr: str, **_: object) -> bool:  # noqa: A002 (Triton's keyword)
        compiled.append(repr)
        return False  # go on compiling

    runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_cache_hook = previous
