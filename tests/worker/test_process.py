"""`python -m services.worker.server` as a process: SIGTERM drains (the in-flight request finishes)
and the process exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import grpc

from shared.rpc.qserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import REPO


def test_sigterm_drains_then_exits(artifacts):
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker.server", "--artifact", str(artifacts["fp16"]), "--port", "0",
         "--metrics-port", "-1", "--kv-blocks", "32", "--block-size", "4", "--drain-grace-seconds", "60",
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
    try:
        assert port_seen.wait(120), "".join(lines)
        port = int(re.search(r"on port (\d+)", "".join(lines)).group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = worker_pb2_grpc.WorkerStub(channel)
            request = worker_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
                sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True))
            stream = iter(client.Generate(request, timeout=60))
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
