"""What KV4 key error feedback costs in the cache write (RoPE + KV4 + paged write), on the GPU.

    python bench/kv_write_feedback.py --out bench/results/h200/kv_write_feedback.json

Llama-2-7B attention shapes (32 KV heads, head_dim 128, 32 layers): the write of T tokens with and
without a key feedback factor (shared.quant.key_feedback), decode batches and prefill chunks, the
query rotated in the same launch as the worker does.
Times are triton.testing.do_bench medians.
Rows are also checked against the reference write (write_kv4_cache_reference) byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.machine import gpu_machine  # noqa: E402
from services.worker.kernels.attention_reference import build_rope_cache, write_kv4_cache_reference  # noqa: E402
from services.worker.kernels.kv4_cache import write_kv4_cache  # noqa: E402
from shared.formats.kv4 import page_row_bytes  # noqa: E402
from shared.model.config import RopeConfig  # noqa: E402
from shared.model.rope import inverse_frequencies  # noqa: E402
from shared.quant.key_feedback import feedback_factor  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 32, 32, 128, 32, 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    mix = torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=g)
    factor = feedback_factor(mix @ mix.transpose(1, 2) / HEAD_DIM).to(dev)
    rope = build_rope_cache(inverse_frequencies(RopeConfig(theta=10000.0), HEAD_DIM).to(dev), 8192)
    rows = []
    for t in [int(v) for v in a.tokens.split(",")]:
        k = torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=torch.float16)
        positions = torch.arange(t, device=dev) + 100
        slots = torch.arange(t, device=dev, dtype=torch.int64)
        blocks = (t + BLOCK - 1) // BLOCK
        shape = (blocks, KV_HEADS, BLOCK, page_row_bytes(HEAD_DIM))
        kc, vc = torch.zeros(shape, dtype=torch.uint8, device=dev), torch.zeros(shape, dtype=torch.uint8, device=dev)
        row = {"tokens": t}
        for name, fb in (("plain", None), ("key_feedback", factor)):
            row[f"{name}_us"] = 1000 * do_bench(
                lambda: write_kv4_cache(k, v, positions, slots, rope, kc, vc, query=q, key_feedback=fb),
                warmup=5, rep=50, return_mode="median")
            if t <= 256:  # the reference write is a per-dim Python loop: checked on the small ones
                # kc / vc hold this write's rows: do_bench's calls wrote them (the same rows each time).
                kr, vr = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
                write_kv4_cache_reference(k.cpu(), v.cpu(), positions.cpu(), slots.cpu(), rope.cpu(), kr, vr,
                                          key_feedback=None if fb is None else fb.cpu())
                row[f"{name}_k_bytes_differing"] = int((kc.cpu() != kr).sum())
                row[f"{name}_v_bytes_differing"] = int((vc.cpu() != vr).sum())
        row["key_feedback_ratio"] = row["key_feedback_us"] / row["plain_us"]
        row["key_feedback_added_us_per_32_layers"] = LAYERS * (row["key_feedback_us"] - row["plain_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"command": "python3 bench/kv_write_feedback.py " + " ".join(sys.argv[1:]), "machine": gpu_machine(dev),
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "layers": LAYERS, "block_size": BLOCK},
              "timing": "triton.testing.do_bench median, warmup 5 ms, rep 50 ms", "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
