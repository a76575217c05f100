"""Which Triton kernels compile during a timed region: a benchmark's run that compiles paid for it in its
time, and a worker that compiles while serving stalls every stream (the start-up is meant to compile all)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import triton


def _describe(repr_: str, fn, compile: dict) -> dict:
    """The kernel's name, its constexpr values and the arguments Triton specialized (a value of 1, a
    multiple of 16): what tells two compiles of one kernel apart."""
    try:
        names = [p.name for p in fn.jit_function.params]

        def name(k):
            return names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k)

        constexprs = {name(k): str(v) for k, v in compile["constants"].items()}
        specialized = {name(k): str(v) for k, v in compile["configs"][0].items()}
        return {"kernel": fn.name, "constexprs": constexprs, "specialized": specialized}
    except Exception:  # another Triton's hook arguments: the line Triton prints
        return {"kernel": repr_.split("[", 1)[0], "repr": repr_}


@contextlib.contextmanager
def recorded_compiles() -> Iterator[list[dict]]:
    """Yields a list that receives one entry per kernel specialization compiled (or loaded from Triton's
    disk cache: either is a first launch in this process) inside the block."""
    runtime = triton.knobs.runtime
    compiled: list[dict] = []
    previous = runtime.jit_cache_hook

    def hook(*, repr: str, fn, compile: dict, **_: object) -> bool:  # noqa: A002 (Triton's keyword)
        compiled.append(_describe(repr, fn, compile))
        return False  # go on compiling

    runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_cache_hook = previous


def differences(late: dict, earlier: list[dict]) -> dict:
    """What sets a compile apart from the closest earlier compile of the same kernel (fewest differing
    fields): {field: (earlier, late)}; {"kernel": ...} when the kernel never compiled before."""
    same = [e for e in earlier if e["kernel"] == late["kernel"]]
    if not same:
        return {"kernel": "first compile of this kernel"}
    best = None
    for e in same:
        diff = {}
        for group in ("constexprs", "specialized"):
            a, b = e.get(group, {}), late.get(group, {})
            diff.update({f"{group}.{k}": (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
        if best is None or len(diff) < len(best):
            best = diff
    return best
