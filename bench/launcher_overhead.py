"""Host time of the attention launchers' own Python, the kernels stubbed out (CPU only).

    python3 bench/launcher_overhead.py --out bench/results/cpu/launcher_overhead.json

A step that replays the step graphs (services/worker/engine/step_graphs.py) still launches each
layer's attention from the host: this times the launchers' checks, config and grid arithmetic per
call (Llama-2-7B's 32 heads of 128, batch 64 decode rows at context 1024, a 512-token prefill of two
sequences) with every Triton kernel's launch replaced by a no-op, and Triton's host-side
`triton.cdiv` against the plain one the launchers use (kernels/host_int.py). Triton's own launch
path (argument binding, cache lookup, the driver call) comes on top on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_machine  # noqa: E402


def per_call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import torch
    import triton
    import triton.runtime.jit as jit

    from services.worker.kernels import host_int, paged_attention, paged_prefill_attention, prefill_attention

    jit.JITFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)  # every launch a no-op
    for module in (paged_attention, prefill_attention, paged_prefill_attention):
        module.launch_kwargs = lambda *args, **kwargs: {}  # asks the GPU for PDL support
    paged_attention.multiprocessors = lambda device: 132

    batch, heads, kv_heads, d, block = 64, 32, 32, 128, 16
    q = torch.randn(batch, heads, d).half()
    k_cache = torch.zeros(400, kv_heads, block, d // 2 + 4, dtype=torch.uint8)
    v_cache = k_cache.clone()
    tables = torch.zeros(batch, 80, dtype=torch.int32)
    context = torch.full((batch,), 1024, dtype=torch.int32)
    out = torch.empty_like(q)
    t = 512
    qp, kp = torch.randn(t, heads, d).half(), torch.randn(t, kv_heads, d).half()
    cu = torch.tensor([0, 256, t], dtype=torch.int32)
    outp = torch.empty_like(qp)
    chunk_cu, chunk_starts = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([512], dtype=torch.int32)
    chunk_tables = torch.zeros(1, 80, dtype=torch.int32)
    rows = {
        "paged_decode_attention": per_call_us(lambda: paged_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, context, max_context_len=1280, out=out)),
        "prefill_attention": per_call_us(lambda: prefill_attention.prefill_attention(
            qp, kp, kp, cu, max_seqlen=256, out=outp)),
        "paged_prefill_attention": per_call_us(lambda: paged_prefill_attention.paged_prefill_attention(
            qp[:16], k_cache, v_cache, chunk_cu, chunk_starts, chunk_tables, max_seqlen=16, out=outp[:16],
            max_context_len=528)),
        "triton.cdiv": per_call_us(lambda: triton.cdiv(1280, 512), calls=20000),
        "host_int.cdiv": per_call_us(lambda: host_int.cdiv(1280, 512), calls=20000),
    }
    result = {
        "command": " ".join(["python3"] + sys.argv),
        "machine": cpu_machine(),
        "triton": triton.__version__,
        "us_per_call": rows,
        "checks": [],  # a diagnosis: no target of an issue is measured here
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
