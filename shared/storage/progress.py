"""A transfer's progress as a storage Progress callback: counts the files and bytes moved and hands a one-line
summary to `report` at most every EVERY_S seconds, so that a multi-GB download (a worker's artifact, a
quantizer's source checkpoint) shows it is moving without a line per file."""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.disk_space import gib

from .base import ObjectInfo


class TransferProgress:
    EVERY_S = 10.0  # between reports

    def __init__(self, report: Callable[[str], None], total_bytes: int | None = None):
        self.report, self.total = report, total_bytes
        self.started = self.last_report = time.monotonic()
        self.bytes = self.files = 0

    def __call__(self, info: ObjectInfo) -> None:
        self.bytes += info.size
        self.files += 1
        now = time.monotonic()
        if now - self.last_report >= self.EVERY_S:
            self.last_report = now
            of_total = f" of {gib(self.total)}" if self.total is not None else ""
            self.report(f"{gib(self.bytes)}{of_total} ({self.files} files, {now - self.started:.0f} s)")

    def summary(self) -> str:
        seconds = time.monotonic() - self.started
        return f"{gib(self.bytes)} in {seconds:.1f} s ({self.bytes / max(seconds, 1e-9) / 1e6:.0f} MB/s)"
