"""A runner whose steps can be made to block, as a step on a hung device would (the process, its heartbeats
and its health answers carry on)."""

from __future__ import annotations

import threading


def hang_steps(runner) -> tuple[threading.Event, threading.Event]:
    """(hang, release): once `hang` is set, the runner's next step blocks until `release` is set (60 s at
    most). Clear `hang` before setting `release` so that the steps after it run freely."""
    step, hang, release = runner.step, threading.Event(), threading.Event()

    def step_that_may_hang(batch):
        if hang.is_set():
            release.wait(60)
        return step(batch)

    runner.step = step_that_may_hang
    return hang, release
