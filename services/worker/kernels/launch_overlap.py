"""Overlapping a kernel's start with the end of the one before it (Hopper and newer), at small batch.

A decode step at batch 1..16 is a chain of short kernels (activation quant -> GEMM -> ...), a few
microseconds each, and every launch pays the grid's start-up while the SMs idle. With
programmatic dependent launch (PDL), a kernel launched with `launch_pdl=True` may start as soon as
every program of the kernel before it has executed `griddepcontrol.launch_dependents`; it must
then execute `griddepcontrol.wait` (which returns once the previous kernel has completed and its
writes are visible) before it reads anything that kernel wrote *or writes anything* (the previous
kernel may still be reading that buffer). `_overlap_entry` does both at a program's start, so every
kernel that calls it first keeps the ordinary stream order for its data.

Measured on the H200 (bench/launch_overlap.py, bench/results/h200/launch_overlap.json): a whole
decode step of the Llama-2-7B-shaped model 6% faster at batch 1 (chn; g128 2%), but 24-33%
slower at batch 4 and 16 and 11-13% at 64 and 256 (cause not found yet: the early-launched
programs waiting in their prologue take SM slots, and some kernels run several waves); so PDL is
used only for single-row launches (PDL_MAX_ROWS: batch-1 decode). A weight prefetch into L2 before
the wait was tried too and lost everywhere (up to 10%).

A kernel launched without the attribute waits for the previous kernel as usual, and the two
instructions are no-ops then. In the interpreter (CPU tests) they are not emitted.
`QSERVE_PDL=0` turns PDL off (a driver without support, or an A/B).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_MAX_ROWS = 1


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device, rows: int) -> bool:
    """Whether a launch of `rows` rows on this device carries the programmatic-dependent-launch attribute."""
    if device.type != "cuda" or rows > PDL_MAX_ROWS or os.environ.get("QSERVE_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pdl_supported(index)


def launch_kwargs(device: torch.device, rows: int) -> dict:
    """Extra keyword arguments for a Triton launch of `rows` rows: PDL where enabled (the kernel's
    PDL=True and the launch attribute), else PDL=False."""
    on = pdl_enabled(device, rows)
    return {"PDL": on, **({"launch_pdl": True} if on else {})}


@triton.jit
def _overlap_entry(PDL: tl.constexpr):
    """Let the next kernel launch now, then wait for the previous one (see the module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
