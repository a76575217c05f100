"""The latest snapshot of each job and its watchers: worker threads post, asyncio watchers read."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass

from services.quantizer.views import JobView

KEEP_FINISHED = 1000  # snapshots of ended jobs kept for late watchers (older ones come from the registry)


@dataclass(slots=True, frozen=True)
class Update:
    job: JobView
    message: str = ""


class JobBoard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: OrderedDict[str, Update] = OrderedDict()
        self._watchers: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Update]]]] = {}

    def post(self, update: Update) -> None:
        """Thread-safe: records the snapshot and hands it to every watcher of the job. A snapshot of a job that
        has ended is final: one read before the end and posted after it (a cancel's "stopping" snapshot, read
        before the job thread stopped and posted its end) is dropped, or every later watcher would see the job
        running and wait for an end that was already posted."""
        job_id = update.job.job_id
        with self._lock:
            previous = self._latest.get(job_id)
            if previous is not None and previous.job.done and not update.job.done:
                return
            self._latest[job_id] = update
            self._latest.move_to_end(job_id)
            self._trim()
            watchers = list(self._watchers.get(job_id, ()))
        for loop, queue in watchers:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, update)
            except RuntimeError:  # the watcher's loop has closed
                pass

    def latest(self, job_id: str) -> Update | None:
        with self._lock:
            return self._latest.get(job_id)

    def watch(self, job_id: str) -> tuple[Update | None, asyncio.Queue[Update]]:
        """Call on the watcher's event loop: the current snapshot (None if this process has none) and a
        queue of every later one. Pair with unwatch()."""
        queue: asyncio.Queue[Update] = asyncio.Queue()
        with self._lock:
            self._watchers.setdefault(job_id, []).append((asyncio.get_running_loop(), queue))
            return self._latest.get(job_id), queue

    def unwatch(self, job_id: str, queue: asyncio.Queue[Update]) -> None:
        with self._lock:
            watchers = [w for w in self._watchers.get(job_id, ()) if w[1] is not queue]
            if watchers:
                self._watchers[job_id] = watchers
            else:
                self._watchers.pop(job_id, None)

    def _trim(self) -> None:
        finished = [job_id for job_id, update in self._latest.items() if update.job.done]
        for job_id in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._latest[job_id]
