"""What a GPU benchmark records about the machine it ran on (the same keys in every results file)."""

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
