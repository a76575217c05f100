"""Picks the torch device and GPU target when the user leaves them on 'auto'."""

from __future__ import annotations

import torch

from shared.formats.manifest import GPU_TARGETS


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but no CUDA GPU is visible; use --device cpu")
    return device


def resolve_gpu_target(target: str) -> str:
    """'auto' -> 'smXY' of the visible GPU (when the project has a target for it), else 'cpu'."""
    if target != "auto":
        return target
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        name = f"sm{major}{minor}"
        if name in GPU_TARGETS:
            return name
    return "cpu"
