"""A/B in one run: how the split-K epilogue kernel reads the K slices' partials, on the Llama-2-7B shapes.

    python3 bench/split_epilogue_ab.py --out bench/results/h200/split_epilogue_ab.json

For every split-K tile (w4a8_gemm.VARIANTS with split_k, not the dp4a ones) and M, at the tile's
automatic split factor (M and splits where it splits at all):
  loop      SPLIT_EPILOGUE_READS "loop", the default: the slices summed in a loop
  all       "all": one (slices, block) tile, every slice's loads in flight together
  none      the epilogue skipped (a wrong output): the first kernel alone, the floor of any epilogue
beside cuBLAS fp16. Each "all" output is first checked bit for bit against the reference linear; a
wrong one is listed under "wrong" and not timed. Timing as bench/kernels.py (CUDA graph of 4 calls on
distinct weight / activation sets, L2 cleared by a read before each replay, median per call). The
result decides SPLIT_EPILOGUE_READS (services/worker/kernels/w4a8_gemm.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import check_output, gemm_calls, time_calls, w4a8_act_set, w4a8_weight_set, warm_gpu  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402

SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))
SETS = 4  # weight / activation sets per graph, as bench/kernels.py


def measure(dev, ms: list[int], warmup: int, rep: int) -> tuple[list[dict], list[dict]]:
    import torch
    import torch.nn.functional as F

    from services.worker.kernels import w4a8_gemm as gemm
    from shared.model.linear import reference_linear

    epilogue = gemm._split_k_epilogue
    rows, wrong = [], []
    for n, k in SHAPES:
        ws = [w4a8_weight_set(n, k, dev) for _ in range(SETS)]
        for m in ms:
            acts = [w4a8_act_set(m, k, dev) for _ in range(SETS)]
            xs, wf = [a["x"].half() for a in acts], [w["w"].half() for w in ws]
            refs = {kind: reference_linear(ws[0][kind])(acts[0]["x"]) for kind in gemm.KINDS}  # once per kind, not per tile
            row = {"N": n, "K": k, "M": m, "us": {}}
            row["us"]["cublas_fp16"] = time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, wf)], warmup, rep) * 1e3
            for v in gemm.VARIANTS:
                if not v.split_k or v.gemv or not v.can_implement(m, n, k, v.kind)[0]:
                    continue
                split = gemm.split_factor(v, m, n, k, dev)
                if split == 1:
                    continue
                times = {}
                try:
                    gemm.SPLIT_EPILOGUE_READS = "all"
                    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=dev)
                    gemm.w4a8_gemm(acts[0]["x8"], acts[0]["sx"], ws[0][v.kind], rowsum=acts[0]["rowsum"],
                                   group_sums=acts[0]["group_sums"], variant=v.name, out=out)
                    check = check_output(out, refs[v.kind], v.dot_fp16)
                    if check["correct"]:
                        times["all"] = time_calls(gemm_calls(gemm.w4a8_gemm, v.name, v.kind, ws, acts), warmup, rep)
                    else:  # a wrong output is never timed
                        wrong.append({"N": n, "K": k, "M": m, "variant": v.name, **check})
                    gemm.SPLIT_EPILOGUE_READS = "loop"
                    times["loop"] = time_calls(gemm_calls(gemm.w4a8_gemm, v.name, v.kind, ws, acts), warmup, rep)
                    gemm._split_k_epilogue = lambda *args: None
                    times["none"] = time_calls(gemm_calls(gemm.w4a8_gemm, v.name, v.kind, ws, acts), warmup, rep)
                finally:
                    gemm.SPLIT_EPILOGUE_READS = "loop"
                    gemm._split_k_epilogue = epilogue
                row["us"][v.name] = {"split": split, **{key: t * 1e3 for key, t in times.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows, wrong


def best_ratio(rows: list[dict], mode: str) -> list[float]:
    """Per (shape, M): the fastest tile's time with the loop over its time read with `mode`."""
    ratios = []
    for r in rows:
        tiles = [t for t in r["us"].values() if isinstance(t, dict) and mode in t]
        if tiles:
            ratios.append(min(t["loop"] for t in tiles) / min(t[mode] for t in tiles))
    return ratios


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="4,16,32,64,128,256", help="comma list of M")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rep", type=int, default=20)
    a = p.parse_args()
    import statistics

    import torch

    dev = torch.device("cuda")
    warm_gpu(dev)
    rows, wrong = measure(dev, [int(m) for m in a.m.split(",")], a.warmup, a.rep)
    gain = best_ratio(rows, "all")
    result = {
        "command": "python3 bench/split_epilogue_ab.py " + shlex.join(sys.argv[1:]), "machine": gpu_machine(dev),
        "rows": rows, "wrong": wrong,
        "checks": [
            {"name": "epilogue reading all slices at once: outputs equal the reference bit for bit", "value": len(wrong),
             "target": 0, "op": "<=", "met": not wrong},
            {"name": "median over (shape, M) of the best split tile's loop time / its all-at-once time",
             "value": statistics.median(gain) if gain else None, "target": 1.0, "op": ">=",
             "met": bool(gain) and statistics.median(gain) >= 1.0},
        ],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}: {len(rows)} rows, {len(wrong)} wrong outputs")


if __name__ == "__main__":
    main()
