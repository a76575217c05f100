"""A worker start given up on (Ctrl-C in `qctl up`, or its start-up deadline) does not hold the process: the
blocking load (minutes on a GPU: downloads, Triton compiles, CUDA graph captures) ran on the event loop's
executor, whose threads the interpreter joins at exit, and `qctl up` hung after "stopping the stack" until the
abandoned load finished."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tests.conftest import REPO

LOAD_S = 60

# In a process of its own: its exit is what is measured. The load is stood in for by a sleep.
SCRIPT = textwrap.dedent(f"""
    import concurrent.futures, sys, threading, time
    import services.worker.server as server
    from services.worker.config import WorkerConfig

    started = threading.Event()

    def slow_load(config):
        started.set()
        time.sleep({LOAD_S})

    server.load_served_model = slow_load
    try:
        server.BackgroundWorker(WorkerConfig(artifact="unused", port=0, metrics_port=None), timeout_s=1.0)
    except concurrent.futures.TimeoutError:
        assert started.is_set()
        print("gave up on the start", flush=True)
        sys.exit(0)
    sys.exit("the worker started")
""")


def test_a_process_that_gave_up_on_a_worker_start_exits_without_waiting_for_the_load():
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=LOAD_S + 60,
                          cwd=REPO)
    took = time.monotonic() - began
    assert done.returncode == 0 and done.stdout.strip() == "gave up on the start", done.stderr
    assert took < LOAD_S / 2, f"the process took {took:.0f} s to exit: it waited for the abandoned load"
