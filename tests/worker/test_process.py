"""`python -m services.worker.server` as a process: SIGTERM drains (the in-flight request finishes)
and the process exits 0; a second SIGTERM during the drain ends it at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from shared.rpc.qserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import REPO


def _start(artifact, kv_blocks: int):
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker.server", "--artifact", str(artifact), "--port", "0",
         "--metrics-port", "-1", "--kv-blocks", str(kv_blocks), "--block-size", "4", "--drain-grace-seconds", "60",
         "--torch-threads", "1"],
        cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    port_seen = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "worker serving" in line:
                port_seen.set()

    threading.Thread(target=read, daemon=True).start()
    if not port_seen.wait(120):
        proc.kill()
        proc.wait()
        raise AssertionError("".join(lines))
    return proc, lines, int(re.search(r"on port (\d+)", "".join(lines)).group(1))


def _generate(channel, max_new_tokens: int, timeout_s: float):
    request = worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
                                         sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return iter(worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=timeout_s))


def test_sigterm_drains_then_exits(artifacts):
    proc, lines, port = _start(artifacts["fp16"], 32)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = _generate(channel, 8, timeout_s=60)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            last = list(stream)[-1]
        assert last.finish.reason == common_pb2.FINISH_REASON_LENGTH and last.finish.generated_tokens == 8
        assert proc.wait(60) == 0
        assert any("draining" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_during_the_drain_exits_at_once(artifacts):
    """The second signal was swallowed: the worker went on draining (up to its 60 s grace here) with no
    way to stop it short of SIGKILL."""
    proc, lines, port = _start(artifacts["fp16"], 512)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = _generate(channel, 2000, timeout_s=120)  # ~2,000 tokens: far longer than this test waits
            next(stream)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while not any("draining" in line for line in lines) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any("draining" in line for line in lines), "".join(lines)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10  # the reader thread may not have the last line yet
        while not any("second SIGTERM" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("second SIGTERM" in line for line in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
