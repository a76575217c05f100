"""What a benchmark records about the machine it ran on (the same keys in every results file of a kind)."""

from __future__ import annotations

import platform


def gpu_machine(device) -> dict:
    import torch
    import triton

    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "platform": platform.platform(),
    }


def cpu_machine() -> dict:
    """The CPU benchmarks' record: the processor, the cores this process may use, and the software."""
    import os

    import torch

    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:  # not Linux
        model = platform.processor()
    return {
        "cpu": model or platform.machine(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(),
    }


def compiled_kernels(fn):
    """(key, compiled kernel) of every specialization of a Triton JIT function compiled in this
    process (its per-device cache: a dict, or a tuple holding the dict, by Triton version)."""
    for cache in getattr(fn, "device_caches", {}).values():
        yield from (cache[0] if isinstance(cache, tuple) else cache).items()
