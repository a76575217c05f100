"""Launch options of launch_overlap.py (the kernels' PDL path runs on the GPU only:
bench/launch_overlap.py checks its outputs bit-exact there)."""

import torch

from services.worker.kernels import launch_overlap
from services.worker.kernels.launch_overlap import PDL_MAX_ROWS, launch_kwargs, pdl_enabled

CUDA = torch.device("cuda", 0)


def test_off_the_gpu_nothing_is_added():
    assert not pdl_enabled(torch.device("cpu"), 1)
    assert launch_kwargs(torch.device("cpu"), 1) == {"PDL": False}


def test_pdl_only_for_small_launches_on_hopper_unless_switched_off(monkeypatch):
    monkeypatch.setattr(launch_overlap, "_pdl_supported", lambda index: True)
    monkeypatch.delenv("QSERVE_PDL", raising=False)
    assert launch_kwargs(CUDA, 1) == {"PDL": True, "launch_pdl": True}
    assert launch_kwargs(CUDA, PDL_MAX_ROWS) == {"PDL": True, "launch_pdl": True}
    assert launch_kwargs(CUDA, PDL_MAX_ROWS + 1) == {"PDL": False}  # batch 4..256 steps lost with it
    monkeypatch.setenv("QSERVE_PDL", "0")
    assert launch_kwargs(CUDA, 1) == {"PDL": False}
    monkeypatch.setattr(launch_overlap, "_pdl_supported", lambda index: False)  # pre-Hopper
    monkeypatch.delenv("QSERVE_PDL")
    assert not pdl_enabled(CUDA, 1)
