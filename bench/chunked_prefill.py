"""Attention of a prompt chunk that continues a cached prefix, on the GPU: the chunk kernel
(paged_prefill_attention.py) against the paged decode kernel run one query per row (what the
runner did before), same inputs, same run.

    python3 bench/chunked_prefill.py --out bench/results/h200/chunked_prefill.json

Llama-2-7B attention shape (32 heads, 32 KV heads, head_dim 128), one sequence, pages of 16
tokens on shuffled blocks; for each (prefix, chunk) and cache kind (KV4, fp16): both kernels'
times (do_bench median, L2 cleared), their agreement, and the chunk kernel against the fp32
reference. `checks`: the chunk kernel matches the reference everywhere (max abs error < 2e-2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attention import paged_batch  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402

CASES = [(1024, 1024), (3072, 1024), (7168, 1024), (4096, 4096), (12288, 4096)]  # (prefix, chunk)
HEADS, HEAD_DIM = 32, 128


def main() -> None:
    import torch
    from triton.testing import do_bench

    from services.worker.kernels.attention_reference import paged_prefill_reference
    from services.worker.kernels.paged_attention import paged_decode_attention
    from services.worker.kernels.paged_prefill_attention import paged_prefill_attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default=",".join(f"{a}+{b}" for a, b in CASES), help="prefix+chunk, comma-separated")
    a = p.parse_args()
    dev = torch.device("cuda")
    result = {"command": " ".join(["python3"] + sys.argv), "machine": gpu_machine(dev),
              "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms), L2 cleared before each call",
              "shape": {"heads": HEADS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "block_size": 16}, "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    worst = 0.0
    for case in a.cases.split(","):
        prefix, chunk = map(int, case.split("+"))
        total = prefix + chunk
        for kv4 in (True, False):
            k_cache, v_cache, tables, _ = paged_batch(torch, dev, gen, 1, HEADS, total, HEAD_DIM, kv4)
            query = (torch.randn(chunk, HEADS, HEAD_DIM, device=dev, generator=gen) * 1.5).half()
            cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
            starts = torch.tensor([prefix], dtype=torch.int32, device=dev)
            row_tables = tables.expand(chunk, -1).contiguous()  # the old path: one decode query per row
            row_lens = torch.arange(prefix + 1, total + 1, dtype=torch.int32, device=dev)

            def chunk_kernel():
                return paged_prefill_attention(query, k_cache, v_cache, cu, starts, tables, max_seqlen=chunk,
                                               max_context_len=total)

            def per_row_decode():
                return paged_decode_attention(query, k_cache, v_cache, row_tables, row_lens, max_context_len=total)

            new, old = chunk_kernel(), per_row_decode()
            ref = paged_prefill_reference(query, k_cache, v_cache, cu.cpu(), starts.cpu(), tables)
            err_ref = (new.float() - ref.float()).abs().max().item()
            worst = max(worst, err_ref)
            row = {"prefix": prefix, "chunk": chunk, "cache": "kv4" if kv4 else "fp16",
                   "chunk_kernel_us": do_bench(chunk_kernel, warmup=25, rep=100) * 1e3,
                   "per_row_decode_us": do_bench(per_row_decode, warmup=25, rep=100) * 1e3,
                   "max_abs_err_vs_reference": err_ref,
                   "max_abs_diff_vs_per_row_decode": (new.float() - old.float()).abs().max().item()}
            row["speedup"] = row["per_row_decode_us"] / row["chunk_kernel_us"]
            # causal attention FLOPs of the chunk: QK^T and PV over prefix + half the chunk per row
            flop = 4 * HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
            row["chunk_kernel_tflops"] = flop / (row["chunk_kernel_us"] * 1e-6) / 1e12
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            del k_cache, v_cache, row_tables
    result["checks"] = [{"name": "chunk kernel vs fp32 reference, max abs error", "value": worst, "target": 2e-2,
                         "op": "<=", "met": worst <= 2e-2}]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
