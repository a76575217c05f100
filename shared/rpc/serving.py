"""What every one of our grpc.aio servers needs around it: its ports opened (plaintext, or TLS when
configured) with an error that names the setting, waiting for SIGTERM/SIGINT in a process, and its own
event loop on a thread when synchronous code embeds it (`qctl up`, tests)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from http.server import HTTPServer
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from shared.rpc.malformed import MalformedRequests
from shared.rpc.tls import ServerTls

T = TypeVar("T")
log = logging.getLogger(__name__)


# gRPC sets SO_REUSEPORT on Linux by default: a second server on a port in use bound it too, and the kernel split
# new connections between the two processes (a worker of another artifact answered half of this one's requests;
# a second gateway with other tokens refused half the calls). Off, a port in use is refused (listen below).
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def grpc_server() -> grpc.aio.Server:
    """A grpc.aio server for one of our services (SERVER_OPTIONS; a request that cannot be parsed answers
    INVALID_ARGUMENT, shared/rpc/malformed.py)."""
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=[MalformedRequests()])


def listen(server: grpc.aio.Server, address: str, setting: str, error: type[Exception],
           tls: ServerTls | None = None) -> int:
    """Opens address: over TLS with `tls` (shared.rpc.tls.load_server_tls), plaintext without. A port that
    cannot be opened raises `error` naming the setting (grpc's own RuntimeError says only "Failed to bind",
    and would reach the user as a traceback)."""
    try:
        if tls is not None:
            return server.add_secure_port(address, tls.credentials())
        return server.add_insecure_port(address)
    except RuntimeError:
        raise error(f"cannot listen on {address} ({setting}): the port is in use or the address is not one "
                    f"of this host's") from None


def serve_metrics(registry: CollectorRegistry, host: str, port: int, setting: str,
                  error: type[Exception]) -> HTTPServer:
    """Prometheus /metrics over HTTP on a daemon thread; a port that cannot be opened raises `error`. `host` as
    gRPC takes it: an IPv6 address in brackets ([::]) is given to the HTTP server without them."""
    try:
        server, _thread = start_http_server(port, addr=host.removeprefix("[").removesuffix("]"), registry=registry)
    except OSError as exc:
        raise error(f"cannot serve metrics on {host}:{port} ({setting}): {exc.strerror or exc}") from None
    return server


async def wait_for_stop_signal() -> None:
    """Returns at the first SIGTERM or SIGINT (a process's cue to drain and stop). A second one, during
    the graceful stop that follows, ends the process at once: an operator who asks twice (Ctrl-C twice,
    or a second `kill`) means now, not after the drain grace."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop_now, sig)


def _stop_now(sig: signal.Signals) -> None:
    # os._exit: unwinding would wait on the very work (streams, jobs, threads) the operator cut short.
    log.warning("second %s during the graceful stop: exiting now, without finishing it", sig.name)
    sys.stderr.flush()
    os._exit(128 + sig)


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a daemon thread of its own, awaited: for a blocking call of minutes that nothing can interrupt
    (a worker's start-up load). asyncio.to_thread runs it on the loop's executor, whose threads the interpreter
    joins at exit: a process stopped meanwhile (Ctrl-C while `qctl up` starts a worker) waited for the load to
    finish. A cancelled await, or a loop closed under it, leaves the call to run on alone; its result is dropped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled: nothing waits for it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop was closed: the server was given up on
            pass

    threading.Thread(target=run, name=getattr(fn, "__name__", "in_daemon_thread"), daemon=True).start()
    return await future


class BackgroundLoop:
    """An asyncio event loop running on a daemon thread; `call` runs a coroutine on it and waits."""

    def __init__(self, name: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def start_server(self, start: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """Runs start() on the loop; when it fails the loop is closed before the error propagates."""
        try:
            return self.call(start(), timeout_s)
        except BaseException:
            self.close()
            raise

    def stop_server(self, stop: Callable[[], Awaitable[None]], timeout_s: float) -> None:
        """Runs stop() on the loop, then closes the loop whatever stop() did."""
        try:
            self.call(stop(), timeout_s)
        finally:
            self.close()
