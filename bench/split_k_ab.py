"""A/B in one run: how the split-K tiles reduce their K slices, on the Llama-2-7B shapes.

    python3 bench/split_k_ab.py --out bench/results/h200/split_k_ab.json

For every split-K variant with a fused twin (`.skf`, w4a8_gemm._fused) and M:
  two_launch  the slices' partials stored, a second kernel sums them and runs the epilogue
  main_only   the same first kernel with the second launch skipped (a wrong output: the floor
              that any one-launch reduction could reach)
  fused       one launch: the slices add into zeroed int32 sums, each tile's last slice runs the
              epilogue
each at the variant's automatic split factor, beside cuBLAS fp16. The fused outputs are checked bit
for bit against the reference linear first; a wrong one is listed under "wrong" and not timed. Timing as bench/kernels.py (CUDA graph
of 4 calls on distinct weight / activation sets, L2 cleared by a read before each replay, median).
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

    pairs = [(v.name.replace(".skf", ".sk"), v.name) for v in gemm.VARIANTS if v.fused_split]
    two_launch_epilogue = gemm._split_k_epilogue
    rows, wrong = [], []
    for n, k in SHAPES:
        ws = [w4a8_weight_set(n, k, dev) for _ in range(SETS)]
        for m in ms:
            acts = [w4a8_act_set(m, k, dev) for _ in range(SETS)]
            xs, wf = [a["x"].half() for a in acts], [w["w"].half() for w in ws]
            row = {"N": n, "K": k, "M": m, "us": {}}
            row["us"]["cublas_fp16"] = time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, wf)], warmup, rep) * 1e3
            for split_name, fused_name in pairs:
                v = gemm.get_variant(fused_name)
                if not v.can_implement(m, n, k, v.kind)[0]:
                    continue
                split = gemm.split_factor(v, m, n, k, dev)
                ref = reference_linear(ws[0][v.kind])(acts[0]["x"])
                out = torch.full((m, n), float("nan"), dtype=torch.float16, device=dev)
                gemm.w4a8_gemm(acts[0]["x8"], acts[0]["sx"], ws[0][v.kind], variant=fused_name,
                               rowsum=acts[0]["rowsum"], group_sums=acts[0]["group_sums"], out=out)
                check = check_output(out, ref, v.dot_fp16)
                times = {"two_launch": time_calls(gemm_calls(gemm.w4a8_gemm, split_name, v.kind, ws, acts), warmup, rep)}
                if check["correct"]:
                    times["fused"] = time_calls(gemm_calls(gemm.w4a8_gemm, fused_name, v.kind, ws, acts), warmup, rep)
                else:  # a wrong output is never timed
                    wrong.append({"N": n, "K": k, "M": m, "variant": fused_name, **check})
                gemm._split_k_epilogue = lambda *args: None
                try:
                    times["main_only"] = time_calls(gemm_calls(gemm.w4a8_gemm, split_name, v.kind, ws, acts), warmup, rep)
                finally:
                    gemm._split_k_epilogue = two_launch_epilogue
                row["us"][split_name] = {"split": split, **{key: ms_ * 1e3 for key, ms_ in times.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows, wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="4,16,32,64,128,256", help="comma list of M")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rep", type=int, default=20)
    a = p.parse_args()
    import torch

    dev = torch.device("cuda")
    warm_gpu(dev)
    rows, wrong = measure(dev, [int(m) for m in a.m.split(",")], a.warmup, a.rep)
    result = {"command": "python3 bench/split_k_ab.py " + shlex.join(sys.argv[1:]), "machine": gpu_machine(dev),
              "rows": rows, "wrong": wrong,
              "checks": [{"name": "fused split-K outputs equal the reference bit for bit", "value": len(wrong),
                          "target": 0, "op": "<=", "met": not wrong}]}
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}: {len(rows)} rows, {len(wrong)} wrong fused outputs")


if __name__ == "__main__":
    main()
