"""Where a decode step's GPU time goes: one eager decode step of a Llama-2-7B-shaped model under the
torch profiler, kernel time summed by kind (GPU only). With --prefill, a prefill step instead:
`batch` prompts of `context` tokens each from position 0 (batch x context tokens in one step).

    python3 bench/decode_profile.py --format w4a8kv4-chn --batch 256 --context 1280 --out bench/results/h200/decode_profile.json
    python3 bench/decode_profile.py --prefill --batch 8 --context 1024 --out bench/results/h200/prefill_profile.json

Every sequence sits at `context` tokens (its KV on scattered blocks); the step is run eagerly
(the CUDA graph replays the same kernels without the launch gaps), a few times to warm up, then
`--repeats` times under torch.profiler. Kernels are grouped by name into attention, W4A8 GEMM,
fp16 GEMM (cuBLAS: lm_head, or every linear of the fp16 engine), KV write, activation quantization
and norms, and the rest; each group's share of the summed kernel time is reported beside the
step's wall time between CUDA events (kernel time + gaps).
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
    ("W4A8 GEMM", ("w4a8", "split_k")),
    ("fp16 GEMM (cuBLAS)", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet")),
    ("activation quant / norm / SiLU", ("quant", "rms", "silu", "norm")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other (embedding, residual adds, copies)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="w4a8kv4-chn", choices=("w4a8kv4-chn", "w4a8kv4-g128", "fp16"))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1280)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill", action="store_true", help="profile a prefill step of batch x context prompt tokens")
    p.add_argument("--out", type=Path)
    a = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.e2e import kernel_policy
    from bench.random_model import LLAMA2_7B, RandomArtifact
    from services.worker.engine.runner import SequenceChunk, StepBatch
    from services.worker.engine.step_inputs import build_host_step, to_device
    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

    dev = torch.device("cuda")
    reader = RandomArtifact(LLAMA2_7B, a.format, dev, kernel_policy=kernel_policy() if a.format != "fp16" else None)
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(a.repeats):
            runner._forward(st)
        end.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / a.repeats
    by_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.self_device_time_total > 0:
            by_kernel[evt.key] += evt.self_device_time_total / 1e3 / a.repeats  # ms per step
    total = sum(by_kernel.values())
    groups: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        groups[group_of(name)] += ms
    result = {
        "command": " ".join(["python3"] + sys.argv),
        "machine": gpu_machine(dev),
        "model": "Llama-2-7B shape, random weights (bench/random_model.py)",
        "step": "prefill" if a.prefill else "decode", "format": a.format, "batch": a.batch, "context": a.context,
        "step_wall_ms_eager": round(step_ms, 3), "kernel_ms_per_step": round(total, 3),
        "groups": {g: {"ms": round(ms, 3), "share": round(ms / total, 3)} for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        "kernels": {k: round(v, 4) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]},
        "checks": [],
    }
    print(json.dumps({k: result[k] for k in ("step", "format", "batch", "context", "step_wall_ms_eager", "kernel_ms_per_step", "groups", "kernels")}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
