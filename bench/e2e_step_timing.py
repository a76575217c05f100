"""bench/e2e.py (its arguments passed through) with each engine step's host phases timed:

    python3 bench/e2e_step_timing.py --driver engine --parts chn --batches 256 --out $OUT/e2e.json

Engine._launch (schedule -> the step's kernels queued; a hidden GPU sync shows as a launch as long as
the step in flight) and Engine._read_back (waiting for the tokens). Prints one DIAG line of per-kind
statistics for the last timed run (the records after the last gap of 3 s: warm-up and graph capture
come before it). Run from a checkout's root: the engine of the current directory's tree is the one
timed, so the same file times an older commit's engine (session 40's bisect of the prompt-step
regression, bench/results/h100/prefill_regression_ab/session40/).
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

from services.worker.engine import engine as engine_module  # noqa: E402

PROMPT_STEP_TOKENS = 1024  # launches of more tokens than this count as prompt steps
records: list[tuple[str, int, float, float]] = []  # (phase, tokens, seconds, start)
_launch, _read_back = engine_module.Engine._launch, engine_module.Engine._read_back


def timed_launch(self, schedule, *args, **kwargs):
    t0 = time.perf_counter()
    result = _launch(self, schedule, *args, **kwargs)
    records.append(("launch", sum(c.num_tokens for c in schedule.chunks), time.perf_counter() - t0, t0))
    return result


def timed_read_back(self, *args, **kwargs):
    t0 = time.perf_counter()
    result = _read_back(self, *args, **kwargs)
    records.append(("read", -1, time.perf_counter() - t0, t0))
    return result


def stats(rows) -> dict:
    ms = [r[2] * 1e3 for r in rows]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "mean_ms": round(statistics.mean(ms), 2), "median_ms": round(statistics.median(ms), 2),
            "max_ms": round(max(ms), 2)}


def report() -> None:
    cut = max((i for i in range(1, len(records)) if records[i][3] - records[i - 1][3] > 3.0), default=0)
    last = records[cut:]
    prompt = [r for r in last if r[0] == "launch" and r[1] > PROMPT_STEP_TOKENS]
    print("DIAG", json.dumps({
        "prompt_launch": stats(prompt),
        "decode_launch": stats([r for r in last if r[0] == "launch" and 0 < r[1] <= PROMPT_STEP_TOKENS]),
        "read_back": stats([r for r in last if r[0] == "read"]),
        "first_prompt_launches_ms": [round(r[2] * 1e3, 1) for r in prompt[:12]],
        "first_prompt_tokens": [r[1] for r in prompt[:12]],
    }), flush=True)


if __name__ == "__main__":
    engine_module.Engine._launch, engine_module.Engine._read_back = timed_launch, timed_read_back
    sys.argv = ["bench/e2e.py", *sys.argv[1:]]
    try:
        runpy.run_path("bench/e2e.py", run_name="__main__")
    finally:
        report()
