"""Holding a real pipeline at one step, so that a test can act (cancel) while it is there."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from services.quantizer.jobs import JobRunner
from services.quantizer.views import Stage


@dataclass
class Pause:
    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    job_id: str = ""

    def wait_reached(self, timeout_s: float = 120.0) -> str:
        assert self.reached.wait(timeout_s), "the pipeline never reached the pause"
        return self.job_id


def pause_after_progress(monkeypatch: pytest.MonkeyPatch, stage: Stage, block_index: int = 0,
                         then: Callable[[JobRunner, str], None] | None = None) -> Pause:
    """The first job to report (stage, block_index) waits, once its report is in the registry, until
    pause.go is set; then runs then(runner, job_id) before going on to its next check."""
    pause = Pause()
    real = JobRunner._progress

    def progress(self, job_id, stage_, index, count, message, remaining_s):
        real(self, job_id, stage_, index, count, message, remaining_s)
        if (stage_, index) == (stage, block_index) and not pause.reached.is_set():
            pause.job_id = job_id
            pause.reached.set()
            assert pause.go.wait(120), "the test never let the pipeline go on"
            if then is not None:
                then(self, job_id)

    monkeypatch.setattr(JobRunner, "_progress", progress)
    return pause
