"""Picks the torch device and GPU target when the user leaves them on 'auto'."""

from __future__ import annotations

from shared.config import check_device
from shared.formats.manifest import GPU_TARGETS


def resolve_device(device: str) -> str:
    """'auto' -> cuda when a GPU is visible, else cpu; cpu, cuda and cuda:N as given (ValueError otherwise).
    The torch reference backend runs on nothing else, and torch's own error for a name it does not know
    ('tpu', 'gpu') surfaced as a RuntimeError traceback once the checkpoint was loaded."""
    import torch  # here, not at the top: qctl imports this module for every command, --help included
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device, ("auto", "cpu", "cuda"), ValueError)  # the services' rule ('auto' is taken above)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but no CUDA GPU is visible; use --device cpu")
    return device


def resolve_gpu_target(target: str, device: str | None = None) -> str:
    """'auto' -> 'smXY' of the GPU `device` names ('cuda:1'; None or 'cuda': the current one) when the project
    has a target for it, else 'cpu'."""
    if target != "auto":
        return target
    import torch  # here, not at the top: see resolve_device
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        name = f"sm{major}{minor}"
        if name in GPU_TARGETS:
            return name
    return "cpu"
