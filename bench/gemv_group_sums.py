"""A/B in one run: the g128 dp4a GEMV at M = 1 with and without x8's 128-group sums, every M = 1
gemv variant of both formats, and cuBLAS fp16, on the Llama-2-7B shapes.

    python3 bench/gemv_group_sums.py --out bench/results/h200/gemv_group_sums.json

Timing as bench/kernels.py (CUDA graph of 4 calls on distinct weight / activation sets, L2
cleared before each replay, median per call). "nosums" passes group_sums=None, so the kernel
builds the zero term from per-word x byte sums as it did before session 24.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import gemm_calls, time_calls, w4a8_act_set, w4a8_weight_set, warm_gpu  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402

SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))
SETS = 4  # weight / activation sets per graph, as bench/kernels.py


def measure(dev, warmup: int, rep: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from services.worker.kernels import w4a8_gemm as gemm

    rows = []
    for n, k in SHAPES:
        ws = [w4a8_weight_set(n, k, dev) for _ in range(SETS)]
        acts = [w4a8_act_set(1, k, dev) for _ in range(SETS)]
        no_sums = [a | {"group_sums": None} for a in acts]
        xs, wf = [a["x"].half() for a in acts], [w["w"].half() for w in ws]
        row = {"N": n, "K": k, "us": {}}
        row["us"]["cublas_fp16"] = time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, wf)], warmup, rep) * 1e3
        for v in gemm.VARIANTS:
            if not (v.gemv and v.block_m == 1):
                continue
            row["us"][v.name] = time_calls(gemm_calls(gemm.w4a8_gemm, v.name, v.kind, ws, acts), warmup, rep) * 1e3
            if v.kind == "w4g128p":
                row["us"][v.name + ".nosums"] = time_calls(gemm_calls(gemm.w4a8_gemm, v.name, v.kind, ws, no_sums), warmup, rep) * 1e3
        row["best"] = {"g128": _best(row["us"], "g128.", nosums=False),
                       "g128_nosums": _best(row["us"], "g128.", nosums=True), "chn": _best(row["us"], "chn.", nosums=False)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _best(us: dict[str, float], prefix: str, nosums: bool) -> tuple[float, str]:
    """(us, name) of the fastest variant named prefix... with or without the .nosums suffix."""
    return min((t, name) for name, t in us.items() if name.startswith(prefix) and name.endswith(".nosums") == nosums)


def checks(rows: list[dict]) -> list[dict]:
    """The issue's M = 1 target (>= 3x cuBLAS fp16) for g128 with the sums, from this run."""
    out = []
    for row in rows:
        ratio = row["us"]["cublas_fp16"] / row["best"]["g128"][0]
        out.append({"name": f"w4g128p {row['N']}x{row['K']} M=1 best gemv (group sums) vs cuBLAS fp16",
                    "value": ratio, "target": 3.0, "op": ">=", "met": ratio >= 3.0})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=5, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=20, help="do_bench repetition, ms")
    a = p.parse_args()
    import torch

    dev = torch.device("cuda")
    warm_gpu(dev)
    rows = measure(dev, a.warmup, a.rep)
    result = {"command": "python3 " + " ".join(shlex.quote(t) for t in sys.argv), "machine": gpu_machine(dev),
              "timing": "as bench/kernels.py: median per call of a CUDA graph of 4 calls, L2 cleared per replay",
              "rows": rows, "checks": checks(rows)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
