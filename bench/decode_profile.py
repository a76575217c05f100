"""Where a decode step's GPU time goes: one eager decode step of a random model of a real shape
(Llama-2-7B unless --shape says otherwise) under the torch profiler, kernel time summed by kind
(GPU only). With --prefill, a prefill step instead: `batch` prompts of `context` tokens each from
position 0 (batch x context tokens in one step).

    python3 bench/decode_profile.py --format w4a8kv4-chn --batch 256 --context 1280 --out bench/results/h200/decode_profile.json
    python3 bench/decode_profile.py --prefill --batch 8 --context 1024 --out bench/results/h200/prefill_profile.json

Every sequence sits at `context` tokens (its KV on scattered blocks); the step is run eagerly
(the CUDA graph replays the same kernels without the launch gaps), a few times to warm up, then
`--repeats` times under torch.profiler. Kernels are grouped by name into attention, W4A8 GEMM,
fp16 GEMM (cuBLAS: lm_head, or every linear of the fp16 engine), KV write, activation quantization
and norms, and the rest; each group's share of the summed kernel time is reported beside the
step's wall time between CUDA events (kernel time + gaps).

With --graph the step is captured into a CUDA graph and replayed, as the engine's decode steps
are: the report adds the replay's wall time, the kernels' span on the GPU timeline, the idle time
between consecutive kernels and where the largest of those gaps sit (kernel before -> after).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import gpu_machine  # noqa: E402

GROUPS = (  # (group, substrings of the kernel name), first match wins
    ("attention: paged decode", ("decode", "reduce_partitions")),
    ("attention: prefill", ("prefill", "flash", "attn")),
    ("KV cache write + RoPE", ("cache",)),
    ("W4A8 GEMM", ("w4a8", "split_k", "int8_gemm", "to_int8")),  # the g128 int8 path: its pass and GEMM
    ("fp16 GEMM (cuBLAS)", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet")),
    ("activation quant / norm / SiLU", ("quant", "rms", "silu", "norm")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other (embedding, residual adds, copies)"


def ms_per_step(prof, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(GPU ms per step by kernel, host ms per step by CPU op or profiler range) of a torch profile of
    `steps` steps: kernels by their own device time, host entries by their inclusive CPU time."""
    gpu: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.self_device_time_total > 0:
            gpu[evt.key] += evt.self_device_time_total / 1e3 / steps
        elif evt.device_type.name == "CPU" and evt.cpu_time_total > 0:
            host[evt.key] += evt.cpu_time_total / 1e3 / steps
    return dict(gpu), dict(host)


def timeline(prof, repeats: int) -> dict:
    """GPU timeline of the profiled replays: kernels' span and busy time per step, the idle time between
    consecutive kernels, and the largest gaps by the (kernel before, kernel after) pair."""
    kernels = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        # Kernels only: not copies, and not the GPU-side spans of profiler ranges (record_function)
        if e.device_type().name == "CUDA" and e.duration_ns() > 0 and not e.is_user_annotation()
        and not e.name().startswith(("Memcpy", "Memset"))
    )
    busy = sum(end - start for start, end, _ in kernels)
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (_, prev_end, prev), (start, _, nxt) in zip(kernels, kernels[1:]):
        gaps[(prev[:60], nxt[:60])].append(max(0, start - prev_end) / 1e3)
    idle = sum(sum(v) for v in gaps.values())
    largest = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "kernels_per_step": len(kernels) / repeats,
        "span_ms_per_step": (kernels[-1][1] - kernels[0][0]) / 1e6 / repeats if kernels else 0.0,
        "busy_ms_per_step": busy / 1e6 / repeats,
        "idle_between_kernels_ms_per_step": idle / 1e3 / repeats,
        "largest_gaps": [{"before": b, "after": n, "count_per_step": len(v) / repeats,
                          "us_per_step": round(sum(v) / repeats, 2), "mean_us": round(sum(v) / len(v), 2)}
                         for (b, n), v in largest],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="w4a8kv4-chn", choices=("w4a8kv4-chn", "w4a8kv4-g128", "fp16"))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1280)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill", action="store_true", help="profile a prefill step of batch x context prompt tokens")
    p.add_argument("--graph", action="store_true", help="replay the step as a CUDA graph and report the gaps between its kernels")
    p.add_argument("--shape", default="llama2-7b", help="bench/random_model.py SHAPES key, e.g. llama3-8b")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.graph and a.prefill:
        p.error("--graph profiles decode steps (the engine runs prefill eagerly)")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.e2e import describe, random_artifact
    from services.worker.engine.runner import SequenceChunk, StepBatch
    from services.worker.engine.step_inputs import build_host_step, to_device
    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

    dev = torch.device("cuda")
    reader = random_artifact(a.format, dev, a.shape)
    max_len = a.context + 1
    runner = TritonRunner(reader, "cuda", 16, TritonRunnerSettings(max_model_len=max_len, cuda_graphs=False))
    per_seq = -(-max_len // runner.block_size)
    runner.allocate_cache(a.batch * per_seq)
    order = torch.randperm(a.batch * per_seq, generator=torch.Generator().manual_seed(0)).view(a.batch, per_seq).tolist()
    if a.prefill:
        chunks = [SequenceChunk(i, [(7 + i + t) % 1000 for t in range(a.context)], 0, order[i], True) for i in range(a.batch)]
    else:
        chunks = [SequenceChunk(i, [7 + i], a.context, order[i], True) for i in range(a.batch)]
    host = build_host_step(StepBatch(chunks), runner.block_size, runner.max_blocks, max_len)
    st = to_device(host, dev)
    for _ in range(3):
        runner._forward(st)
    torch.cuda.synchronize()
    step = lambda: runner._forward(st)  # noqa: E731
    if a.graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            runner._forward(st)
        step = graph.replay
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(a.repeats):
            step()
        end.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / a.repeats
    by_kernel, _ = ms_per_step(prof, a.repeats)
    total = sum(by_kernel.values())
    groups: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        groups[group_of(name)] += ms
    result = {
        "command": " ".join(["python3"] + sys.argv),
        "machine": gpu_machine(dev),
        "model": describe(a.shape) + ", random weights (bench/random_model.py)",
        "step": "prefill" if a.prefill else "decode", "format": a.format, "batch": a.batch, "context": a.context,
        ("step_wall_ms_graph" if a.graph else "step_wall_ms_eager"): round(step_ms, 3), "kernel_ms_per_step": round(total, 3),
        "groups": {g: {"ms": round(ms, 3), "share": round(ms / total, 3)} for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        "kernels": {k: round(v, 4) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]},
        "checks": [],
    }
    if a.graph:
        result["timeline"] = timeline(prof, a.repeats)
    print(json.dumps({k: v for k, v in result.items() if k not in ("command", "machine", "model", "checks")}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
