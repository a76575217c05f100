"""Launch plans of the activation-quant kernel over M: one pass (row in registers) or chunks, and warps.

    python3 bench/act_quant_paths.py --out bench/results/h200/act_quant_paths.json

For each op at Llama-2-7B widths (rmsnorm_quant K 4096, also with the residual add fused;
silu_mul_quant F 11008; quantize K 4096) and each M, every plan (services/worker/kernels/
act_quant.py launch_plan's choice, one pass with 4 / 8 / 16 warps, chunks of 2048 with 4 / 8
warps) is checked against the default plan's output (codes within one, same scales to fp32
rounding) and timed the way bench/kernels.py times kernels (a CUDA graph of calls on distinct
inputs, L2 cleared before each replay). The fastest plan per (op, M) is what launch_plan's
rules (ONE_PASS_MAX, the warps per block) should encode. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kernels import ROTATE, time_calls, warm_gpu  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402

MS = [1, 16, 256, 1024, 4096, 8192]
HIDDEN, FFN = 4096, 11008
OPS = {"rmsnorm": (1, HIDDEN, False), "rmsnorm+add": (1, HIDDEN, True), "silu": (2, FFN, False), "quantize": (0, HIDDEN, False)}


def plans(k: int) -> dict[str, tuple[bool, int, int]]:
    import triton

    block = triton.next_power_of_2(k)
    return {**{f"one_pass.w{w}": (True, block, w) for w in (4, 8, 16)},
            **{f"chunked2048.w{w}": (False, 2048, w) for w in (4, 8)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ms", type=lambda t: [int(v) for v in t.split(",")], default=MS)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rep", type=int, default=20)
    a = p.parse_args()

    import torch

    from services.worker.kernels import act_quant

    dev = torch.device("cuda")
    warm_gpu(dev)
    result = {"command": "python3 bench/act_quant_paths.py " + " ".join(sys.argv[1:]), "machine": gpu_machine(dev),
              "timing": f"median us per call, CUDA graph of {ROTATE} calls on distinct inputs, L2 cleared per replay",
              "rows": [], "best": {}, "checks": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=gen)).half()
    for name, (op, k, fused_add) in OPS.items():
        for m in a.ms:
            width = 2 * k if op == 2 else k
            srcs = [(torch.randn(m, width, device=dev, generator=gen) * 3).half() for _ in range(ROTATE)]
            adds = [(torch.randn(m, k, device=dev, generator=gen)).half() for _ in range(ROTATE)] if fused_add else [None] * ROTATE

            def call(i, plan):
                return act_quant._launch(op, srcs[i], weight if op == 1 else None, k, 1e-6, adds[i], plan)

            default = act_quant.launch_plan(k)
            # The fused add writes x: check on copies so every plan quantizes the same sums.
            keep = [s.clone() for s in srcs]
            ref = call(0, default)
            times = {}
            for label, plan in {"default": default, **plans(k)}.items():
                for s, orig in zip(srcs, keep):
                    s.copy_(orig)
                got = call(0, plan)
                codes_ok = bool((got[0].int() - ref[0].int()).abs().max() <= 1)
                scales_ok = bool(torch.allclose(got[1], ref[1], rtol=1e-6, atol=0))
                if not (codes_ok and scales_ok):
                    result["checks"].append({"name": f"{name} M={m} {label} matches the default plan", "value": 0,
                                             "target": 1, "op": ">=", "met": False})
                    print(f"{name} M={m} {label}: WRONG", flush=True)
                    continue
                us = 1000 * time_calls([lambda i=i, plan=plan: call(i, plan) for i in range(ROTATE)], a.warmup, a.rep)
                nbytes = m * width * 2 + m * k + (2 * m * k * 2 if fused_add else 0)  # in, codes, y + x written
                times[label] = us
                result["rows"].append({"op": name, "M": m, "plan": label, "one_pass": plan[0], "block": plan[1],
                                       "num_warps": plan[2], "us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)})
                print(f"{name:12s} M={m:5d} {label:18s} {us:8.2f} us {nbytes / us / 1e3:7.0f} GB/s", flush=True)
            best = min((t, lbl) for lbl, t in times.items() if lbl != "default")
            result["best"][f"{name} M={m}"] = {"plan": best[1], "us": round(best[0], 2),
                                              "default_us": round(times.get("default", float("nan")), 2),
                                              "default_plan": list(default)}
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1))
    result["checks"].append({"name": "every plan matches the default plan's output", "value": int(not result["checks"]),
                             "target": 1, "op": ">=", "met": not result["checks"]})
    a.out.write_text(json.dumps(result, indent=1))
    for key, b in result["best"].items():
        print(f"{key:24s} best {b['plan']:18s} {b['us']:8.2f} us (default {b['default_us']} us)")


if __name__ == "__main__":
    main()
