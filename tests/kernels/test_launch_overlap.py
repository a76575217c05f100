"""Launch options of launch_overlap.py (the kernels' PDL path runs on the GPU only:
bench/launch_overlap.py checks its outputs bit-exact there)."""

import pytest
import torch

from services.worker.kernels import launch_overlap
from services.worker.kernels.launch_overlap import (
    AFTER_WAIT_MAX_ROWS,
    PDL_MAX_ROWS,
    PDL_TRIGGERS,
    launch_kwargs,
    pdl_mode,
)

CUDA = torch.device("cuda", 0)
AFTER_WAIT, LATE = PDL_TRIGGERS["after_wait"], PDL_TRIGGERS["late"]


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(launch_overlap, "_pdl_supported", lambda index: True)
    for key in ("QSERVE_PDL", "QSERVE_PDL_MAX_ROWS", "QSERVE_PDL_TRIGGER"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_off_the_gpu_nothing_is_added():
    assert pdl_mode(torch.device("cpu"), 1) == 0
    assert launch_kwargs(torch.device("cpu"), 1) == {"PDL": 0}


def test_trigger_after_the_wait_for_small_launches_late_for_larger_none_for_prefill(hopper):
    assert launch_kwargs(CUDA, 1) == {"PDL": AFTER_WAIT, "launch_pdl": True}
    assert launch_kwargs(CUDA, AFTER_WAIT_MAX_ROWS) == {"PDL": AFTER_WAIT, "launch_pdl": True}
    assert launch_kwargs(CUDA, AFTER_WAIT_MAX_ROWS + 1) == {"PDL": LATE, "launch_pdl": True}  # after_wait lost at 64+
    assert launch_kwargs(CUDA, PDL_MAX_ROWS) == {"PDL": LATE, "launch_pdl": True}
    assert launch_kwargs(CUDA, PDL_MAX_ROWS + 1) == {"PDL": 0}


def test_switched_off_or_before_hopper_no_pdl(hopper):
    hopper.setenv("QSERVE_PDL", "0")
    assert launch_kwargs(CUDA, 1) == {"PDL": 0}
    hopper.delenv("QSERVE_PDL")
    hopper.setattr(launch_overlap, "_pdl_supported", lambda index: False)
    assert pdl_mode(CUDA, 1) == 0


def test_environment_overrides_the_rule_for_benchmarks(hopper):
    hopper.setenv("QSERVE_PDL_MAX_ROWS", "100000")
    hopper.setenv("QSERVE_PDL_TRIGGER", "early")
    assert launch_kwargs(CUDA, 4096) == {"PDL": PDL_TRIGGERS["early"], "launch_pdl": True}
    hopper.setenv("QSERVE_PDL_TRIGGER", "sideways")
    with pytest.raises(ValueError, match="QSERVE_PDL_TRIGGER"):
        launch_kwargs(CUDA, 1)
