"""Where the engine's decode steps lose time outside the model: the worker's engine (scheduler,
CUDA-graph decode, sampling, read-back with overlap) on a Llama-2-7B-shaped model, profiled over
`--steps` decode-only iterations once every request has its first token.

    python3 bench/engine_profile.py --format w4a8kv4-chn --batch 256 --out bench/results/h200/engine_profile_chn.json

Reports the wall time per iteration, the GPU timeline over the same window (kernel busy time,
idle time between kernels and where the largest gaps sit: bench/decode_profile.py's timeline),
the graph replay alone at the same context, and the host time of each part of an iteration
(schedule, launch, read-back) from the torch profiler's CPU ranges.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.decode_profile import group_of, ms_per_step, timeline  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402


def _label_host_work(engine, runner, torch) -> None:
    """Wraps the parts of an engine iteration in profiler ranges ("engine:<part>")."""
    import services.worker.engine.triton_runner as triton_runner

    def labelled(fn, name):
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"engine:{name}"):
                return fn(*args, **kwargs)
        return call

    for name in ("_schedule", "_launch", "_read_back"):
        setattr(engine, name, labelled(getattr(engine, name), name.strip("_")))
    runner.step = labelled(runner.step, "runner.step")
    if runner.graphs is not None:
        runner.graphs.replay = labelled(runner.graphs.replay, "graphs.replay")
    triton_runner.build_host_step = labelled(triton_runner.build_host_step, "build_host_step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="w4a8kv4-chn", choices=("w4a8kv4-chn", "w4a8kv4-g128", "fp16"))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="decode iterations profiled")
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path)
    a = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.e2e import llama2_7b_artifact
    from bench.e2e_engine import make_engine
    from services.worker.engine.sequence import SamplingOptions
    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

    dev = torch.device("cuda")
    reader = llama2_7b_artifact(a.format, dev)
    # Long enough that no request finishes before the window ends: the first admitted ones decode
    # through the whole prefill phase (about batch x prompt / prefill_tokens steps) first.
    prefill_steps = -(-a.batch * a.prompt // a.prefill_tokens)
    out_len = a.steps + 16 + 2 * prefill_steps
    total = a.prompt + out_len
    runner = TritonRunner(reader, "cuda", 16, TritonRunnerSettings(max_model_len=total, max_batch_tokens=a.prefill_tokens))
    engine = make_engine(runner, a.batch, total, a.prefill_tokens)
    if runner.graphs is not None:
        top = runner.graphs.bucket_for(a.batch) or runner.graphs.buckets[-1]
        runner.capture_graphs(tuple(b for b in runner.graphs.buckets if b == top))
    _label_host_work(engine, runner, torch)
    g = torch.Generator().manual_seed(0)
    first: set[str] = set()
    sink = lambda out: first.add(out.request_id)  # noqa: E731
    options = SamplingOptions(max_new_tokens=out_len, ignore_eos=True)
    for i, prompt in enumerate(torch.randint(0, runner.config.vocab_size, (a.batch, a.prompt), generator=g).tolist()):
        engine.add_request(f"r{i}", prompt, options, sink)
    while len(first) < a.batch:
        engine.step()
    for _ in range(3):  # steady state: every step decode-only, graphs warm
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        wall = (time.perf_counter() - t0) / a.steps
        torch.cuda.synchronize()
    while engine.step():
        pass

    kernels, host = ms_per_step(prof, a.steps)  # host: ms per iteration (inclusive) by op or engine: range
    by_kernel: dict[str, float] = defaultdict(float)  # GPU ms per iteration by kernel group
    for name, ms in kernels.items():
        if not name.startswith("engine:"):  # the GPU-side spans of the engine: ranges, not kernels
            by_kernel[group_of(name)] += ms
    labelled = {k: v for k, v in host.items() if k.startswith("engine:")}

    # The graph replay alone at the profiled window's context, for comparison.
    graph_ms = None
    if runner.graphs is not None:
        from services.worker.engine.runner import SequenceChunk, StepBatch

        ctx = a.prompt + prefill_steps // 2 + 3 + a.steps // 2  # about the window's mean context
        per_seq = -(-total // runner.block_size)
        chunks = [SequenceChunk(i, [7], ctx, list(range(i * per_seq, (i + 1) * per_seq)), True) for i in range(a.batch)]
        batch = StepBatch(chunks)
        for _ in range(3):
            runner.step(batch)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            runner.step(batch)
        end.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(end) / 10

    result = {
        "command": " ".join(["python3"] + sys.argv),
        "machine": gpu_machine(dev),
        "model": "Llama-2-7B shape, random weights (bench/random_model.py)",
        "format": a.format, "batch": a.batch, "prompt": a.prompt, "steps": a.steps, "overlap": engine.overlap,
        "iteration_wall_ms": round(wall * 1e3, 3),
        "runner_step_ms_same_context_back_to_back": None if graph_ms is None else round(graph_ms, 3),
        "gpu_ms_per_iteration_by_group": {k: round(v, 3) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])},
        "timeline": timeline(prof, a.steps),
        "host_ms_per_iteration": {k: round(v, 3) for k, v in sorted(labelled.items(), key=lambda kv: -kv[1])},
        "host_ops_ms_per_iteration": {k: round(v, 3) for k, v in sorted(host.items(), key=lambda kv: -kv[1])[:25]},
        "checks": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("command", "machine", "model")}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
