"""The cancels a quantizer has noticed for the jobs it runs.

CancelJob may reach any quantizer sharing the registry, but only the one running a job can stop its
pipeline and clean up after it; the registry holds the request (shared.registry.cancel_job). The runner
notes a request here when it sees it (the CancelJob reached this process, a progress report read it, or the
heartbeat loop polled for it), and the job's pipeline raises JobCancelled at its next check."""

from __future__ import annotations

import threading

from services.quantizer.errors import JobCancelled


class Cancels:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: dict[str, str] = {}  # job id -> "cancelled by <who>: <why>"

    def note(self, job_id: str, reason: str) -> bool:
        """Records a cancel of the job; True when it was not noted before."""
        with self._lock:
            new = job_id not in self._reasons
            self._reasons.setdefault(job_id, reason)
            return new

    def check(self, job_id: str) -> None:
        """Raises JobCancelled when the job was cancelled."""
        with self._lock:
            reason = self._reasons.get(job_id)
        if reason is not None:
            raise JobCancelled(reason)

    def forget(self, job_id: str) -> None:
        """The job has ended: nothing left to stop."""
        with self._lock:
            self._reasons.pop(job_id, None)
