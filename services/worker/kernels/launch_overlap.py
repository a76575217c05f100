"""Overlapping a kernel's start with the end of the one before it (Hopper and newer).

A decode step is a chain of short kernels (activation quant -> GEMM -> ...), a few microseconds
each at small batch, and every launch pays the grid's start-up while the SMs idle. With
programmatic dependent launch (PDL), a kernel launched with `launch_pdl=True` may start as soon as
every program of the kernel before it has executed `griddepcontrol.launch_dependents` (or exited);
it must then execute `griddepcontrol.wait` (which returns once the previous kernel has completed
and its writes are visible) before it reads anything that kernel wrote *or writes anything* (the
previous kernel may still be reading that buffer). Every worker kernel calls `_overlap_entry`
before its first load or store (the wait), and `_overlap_release` after its main loop.

Where the trigger sits decides whether PDL wins (H200, whole decode steps of the Llama-2-7B shape,
bench/results/h200/launch_overlap_triggers.json, speed-up over PDL off, chn / g128):

    trigger      batch 1       4             16            64            256
    early        1.01 / 1.02   0.67 / 0.91   0.76 / 0.91   0.87 / 0.91   0.88 / 0.90
    after_wait   1.05 / 1.07   1.08 / 1.06   1.06 / 1.02   0.99 / 0.90   0.89 / 0.90
    late         1.00 / 1.04   1.03 / 1.03   1.03 / 1.03   1.02 / 1.02   1.00 / 1.00

"early" (before the wait) lets a chain of kernels become resident at once, each waiting on the one
before, holding SM slots that the running kernel's later waves need. "after_wait" keeps at most
one kernel waiting: best while a kernel fits in one wave. With many programs (batch 64 and up)
the waiting programs still cost, and "late" (the next kernel starts while this one runs its
epilogue) is the one that never loses. Hence the rule: after_wait up to AFTER_WAIT_MAX_ROWS rows,
late up to PDL_MAX_ROWS, off above (prefill-sized launches were not measured). An L2 weight
prefetch before the wait (session 14) lost everywhere (up to 10%).

A kernel launched without the attribute waits for the previous kernel as usual, and the
instructions are no-ops then. In the interpreter (CPU tests) they are not emitted.
`QSERVE_PDL=0` turns PDL off (a driver without support, or an A/B); QSERVE_PDL_MAX_ROWS and
QSERVE_PDL_TRIGGER (early / after_wait / late) override the rule for bench/launch_overlap.py.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Where a kernel lets the next one launch (the kernels' PDL constexpr; 0 = PDL off):
#   early:      at its start, before waiting for the kernel before it (the next kernel may then be
#               resident and waiting while this one still waits: a chain of waiting kernels);
#   after_wait: at its start, once the kernel before it has completed (at most one waiting kernel);
#   late:       after its main loop, before its epilogue (kernels without a main loop: at exit).
PDL_TRIGGERS = {"early": 1, "after_wait": 2, "late": 3}
AFTER_WAIT_MAX_ROWS = 16  # after_wait up to here, late above
PDL_MAX_ROWS = 256  # no PDL above: prefill-sized launches were not measured


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_mode(device: torch.device, rows: int) -> int:
    """The kernels' PDL constexpr for a launch of `rows` rows on this device (0: no PDL).
    QSERVE_PDL=0 turns it off; QSERVE_PDL_MAX_ROWS and QSERVE_PDL_TRIGGER override the rule (A/B)."""
    if device.type != "cuda" or os.environ.get("QSERVE_PDL", "1") == "0":
        return 0
    if rows > int(os.environ.get("QSERVE_PDL_MAX_ROWS", PDL_MAX_ROWS)):
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _pdl_supported(index):
        return 0
    trigger = os.environ.get("QSERVE_PDL_TRIGGER", "after_wait" if rows <= AFTER_WAIT_MAX_ROWS else "late")
    if trigger not in PDL_TRIGGERS:
        raise ValueError(f"QSERVE_PDL_TRIGGER must be one of {', '.join(PDL_TRIGGERS)}, got {trigger!r}")
    return PDL_TRIGGERS[trigger]


def launch_kwargs(device: torch.device, rows: int) -> dict:
    """Extra keyword arguments for a Triton launch of `rows` rows: the kernel's PDL mode, and the
    launch attribute where it is not 0."""
    mode = pdl_mode(device, rows)
    return {"PDL": mode, **({"launch_pdl": True} if mode else {})}


@triton.jit
def _overlap_entry(PDL: tl.constexpr):
    """Wait for the previous kernel, and let the next one launch (early / after_wait; see the module docstring).
    PDL is a value of PDL_TRIGGERS: 1 early, 2 after_wait, 3 late (_overlap_release), 0 off."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _overlap_release(PDL: tl.constexpr):
    """After a kernel's main loop: let the next kernel launch (late)."""
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
