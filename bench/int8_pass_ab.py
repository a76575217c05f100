"""How many rows and 128-groups one program of the int8 path's dequantization pass should take.

    python3 bench/int8_pass_ab.py --out bench/results/h200/int8_pass_ab.json

The pass (w4a8_int8_path._g128_to_int8_kernel) reads the packed g128 weight and its s2 / zero bytes
and writes the int8 weight, 1.5 bytes of traffic a weight plus 2 bytes a group: memory-bound, so
it is judged by GB/s against a device copy of the same bytes timed in the same run. One program a
group (64 bytes of each row) was the first choice; more groups a program read longer runs of a row.
Every output is checked against the weight's own int8 values (W4G128ProgressiveWeight.int8_weight).
Times: bench/kernels.py's time_calls (CUDA graph, L2 cleared by a read before each replay, median).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.kernels import time_calls, warm_gpu  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402
from services.worker.kernels.w4a8_int8_path import DEQUANT_BLOCK_N, DEQUANT_GROUPS, dequantize_g128_to_int8  # noqa: E402
from shared.quant.weights import quantize_w4_g128_progressive  # noqa: E402

# Llama-2-7B's four (N, K) and Llama-3-8B's three new ones.
SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (6144, 4096), (28672, 4096), (4096, 14336))
CONFIGS = ((64, 1), (32, 2), (64, 2), (16, 4), (32, 4), (16, 8))  # (rows, groups) a program


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    args = p.parse_args()
    dev = torch.device("cuda")
    warm_gpu(dev)
    rows = []
    for n, k in SHAPES:
        weight = quantize_w4_g128_progressive(torch.randn(n, k, device=dev) * 0.02)
        want = weight.int8_weight()
        nbytes = n * k // 2 + 2 * n * (k // 128) + n * k
        scratch = torch.empty(n * k, dtype=torch.int8, device=dev)
        src = torch.empty(nbytes // 2, dtype=torch.int8, device=dev)
        dst = torch.empty_like(src)
        copy_ms = time_calls([lambda: dst.copy_(src)], args.warmup, args.rep)
        row = {"N": n, "K": k, "bytes": nbytes, "copy_us": copy_ms * 1e3, "copy_gbps": nbytes / copy_ms / 1e6, "configs": {}}
        for block_n, groups in CONFIGS:
            scratch.fill_(0)
            exact = torch.equal(dequantize_g128_to_int8(weight, scratch, block_n=block_n, groups=groups), want)
            ms = time_calls([lambda: dequantize_g128_to_int8(weight, scratch, block_n=block_n, groups=groups)],
                            args.warmup, args.rep)
            row["configs"][f"n{block_n}g{groups}"] = {"exact": exact, "us": ms * 1e3, "gbps": nbytes / ms / 1e6,
                                                      "of_copy": copy_ms / ms}
        best = min(row["configs"], key=lambda c: row["configs"][c]["us"])
        row["best"] = best
        rows.append(row)
        print(f"N={n:6d} K={k:6d} copy {row['copy_us']:6.1f} us ({row['copy_gbps']:.0f} GB/s) | "
              + " ".join(f"{c}={v['us']:.1f}{'' if v['exact'] else '!WRONG'}" for c, v in row["configs"].items())
              + f" | best {best}", flush=True)
    current = f"n{DEQUANT_BLOCK_N}g{DEQUANT_GROUPS}"
    result = {
        "command": "python3 " + " ".join(sys.argv),
        "machine": gpu_machine(dev),
        "bytes": "packed N*K/2 + s2 and zero 2*N*K/128 read, N*K int8 written; the copy moves the same bytes "
                 "(half read, half written)",
        "current_default": current,
        "rows": rows,
    }
    wrong = sum(not c["exact"] for r in rows for c in r["configs"].values())
    result["checks"] = [
        {"name": "dequantization pass output equals the weight's int8 values (configs x shapes wrong)",
         "value": wrong, "target": 0, "op": "<=", "met": wrong == 0},
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}; wrong outputs: {wrong}")


if __name__ == "__main__":
    main()
