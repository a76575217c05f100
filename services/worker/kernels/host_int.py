"""Helpers for launchers' host code: grids, block sizes, partition counts, input checks.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.6+, and a call from
the host goes through their wrapper (argument unwrapping; ~5 us a call here, ~6.6 us under cProfile
on the H100 host, about 1,000 calls in a kernel-by-kernel 512-token step:
bench/results/h100/step_profile_cprofile_512.json). Kernel bodies keep tl.cdiv.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def require(condition: bool, message: str) -> None:
    """A launcher's input check: a ValueError naming the problem. Not `assert`: `python -O` strips those, and an
    `out` one column short was then written past its end."""
    if not condition:
        raise ValueError(message)
