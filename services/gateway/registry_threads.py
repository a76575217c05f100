"""Threads for the gateway's registry calls (SQLAlchemy blocks the calling thread), a pool per kind of caller.

Routing's reads (the deployment cache) and admin changes each have their own: both once ran on the event loop's
default executor (a handful of threads), and admin changes waiting on a row lock (another replica
mid-transaction, a session left open in psql) took every thread of it, so that every Generate whose deployment
was due a re-read waited behind them until its deadline."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class RegistryThreads:
    def __init__(self, name: str, threads: int = 4):
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on one of these threads, with the caller's context variables (as asyncio.to_thread)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                functools.partial(context.run, fn, *args))

    async def close(self) -> None:
        """Drops the calls not started; waits for those running (a lock wait is bounded: LOCK_WAIT_S), so that
        the registry is closed only once no thread uses it."""
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
