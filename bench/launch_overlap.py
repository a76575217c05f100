"""Programmatic dependent launch (services/worker/kernels/launch_overlap.py), on against off.

    python3 bench/launch_overlap.py --out bench/results/h200/launch_overlap.json

A decode layer's small-M chain, as the runner launches it: rmsnorm_quant -> W4A8 GEMM (qkv, N x 4096)
-> quantize -> GEMM (o, 4096 x 4096) -> rmsnorm_quant(add) -> GEMM (gate_up) -> silu_mul_quant ->
GEMM (down), LAYERS times, captured in one CUDA graph per setting and timed like bench/kernels.py
(do_bench median over replays, L2 cleared before each). Settings (--settings, named in SETTINGS):
"off" (QSERVE_PDL=0), "shipped" (the launcher's rule) and the trigger positions of
launch_overlap.py on every launch ("early_all", "after_wait_all", "late_all"), all read at each launch.
Each setting's graph output must equal the eager, PDL-off output bit for bit (a race between a
kernel and the one before it would show here). GEMM variants: kernels.json's best_variant.

With --decode FORMATS, whole decode steps of the Llama-2-7B-shaped model instead (as
bench/decode_profile.py builds them: every sequence at --context tokens, KV on scattered blocks),
one CUDA graph per setting and batch, timed the same way; the logits must match bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import gpu_machine  # noqa: E402

HIDDEN, FFN = 4096, 11008
# Named launch settings: the environment each one sets (launch_overlap.py reads it at every launch).
EVERY_ROW = "1000000"
SETTINGS = {
    "off": {"QSERVE_PDL": "0"},
    "shipped": {},  # the launcher's own rule
    "early_all": {"QSERVE_PDL_MAX_ROWS": EVERY_ROW, "QSERVE_PDL_TRIGGER": "early"},
    "after_wait_all": {"QSERVE_PDL_MAX_ROWS": EVERY_ROW, "QSERVE_PDL_TRIGGER": "after_wait"},
    "late_all": {"QSERVE_PDL_MAX_ROWS": EVERY_ROW, "QSERVE_PDL_TRIGGER": "late"},
}
PDL_ENV = ("QSERVE_PDL", "QSERVE_PDL_MAX_ROWS", "QSERVE_PDL_TRIGGER")


def use_setting(name: str) -> None:
    for key in PDL_ENV:
        os.environ.pop(key, None)
    os.environ.update(SETTINGS[name])


def _layer_weights(kind: str, dev, seed: int):
    import torch

    from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive

    quant = quantize_w4_g128_progressive if kind == "w4g128p" else quantize_w4_channel
    g = torch.Generator(device=dev).manual_seed(seed)
    shapes = {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * FFN, HIDDEN), "down": (HIDDEN, FFN)}
    return {name: quant(torch.randn(n, k, device=dev, generator=g) * 0.02) for name, (n, k) in shapes.items()}


def _variant(best: dict, kind: str, w, m: int) -> str:
    n, k = w.qweight.shape[0], w.qweight.shape[1] * 2
    return best[kind][f"{n}x{k}"][str(m)]


def chain(layers, best, kind, x, norm_w, m):
    """One pass of the layers' small-M chain; returns the residual stream."""
    import torch

    from services.worker.kernels.act_quant import quantize, rmsnorm_quant, silu_mul_quant
    from services.worker.kernels.w4a8_gemm import get_variant, w4a8_gemm

    def gemm(act, w):  # both sums, as the engine passes them
        return w4a8_gemm(act.x8, act.scale, w, act.rowsum, variant=_variant(best, kind, w, m), group_sums=act.group_sums)

    def sums(w):  # as the engine's W4A8Ops asks: when the GEMM's variant reads them
        return get_variant(_variant(best, kind, w, m)).takes_group_sums

    for w in layers:
        qkv = gemm(rmsnorm_quant(x, norm_w, 1e-5, group_sums=sums(w["qkv"])), w["qkv"])
        o = gemm(quantize(qkv[:, :HIDDEN].contiguous(), group_sums=sums(w["o"])), w["o"])  # stands in for attention's output
        gu = gemm(rmsnorm_quant(x, norm_w, 1e-5, add=o, group_sums=sums(w["gate_up"])), w["gate_up"])
        x = x + gemm(silu_mul_quant(gu, group_sums=sums(w["down"])), w["down"])
    return x


def decode_steps(fmt: str, batches: list[int], context: int, settings: list[str]) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from bench.e2e import llama2_7b_artifact
    from services.worker.engine.runner import SequenceChunk, StepBatch
    from services.worker.engine.step_inputs import build_host_step, to_device
    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

    dev = torch.device("cuda")
    reader = llama2_7b_artifact(fmt, dev)
    max_len = context + 1
    runner = TritonRunner(reader, "cuda", 16, TritonRunnerSettings(max_model_len=max_len, cuda_graphs=False))
    per_seq = -(-max_len // runner.block_size)
    runner.allocate_cache(max(batches) * per_seq)
    rows = []
    for batch in batches:
        order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(0)).view(batch, per_seq).tolist()
        chunks = [SequenceChunk(i, [7 + i], context, order[i], True) for i in range(batch)]
        st = to_device(build_host_step(StepBatch(chunks), runner.block_size, runner.max_blocks, max_len), dev)
        row = {"format": fmt, "batch": batch, "context": context, "ms_per_step": {}, "bit_exact": {}}
        want = None
        for name in settings:
            use_setting(name)
            for _ in range(2):
                runner._forward(st)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = runner._forward(st)
            graph.replay()
            torch.cuda.synchronize()
            want = logits.clone() if want is None else want
            row["bit_exact"][name] = bool(torch.equal(logits, want))
            row["ms_per_step"][name] = round(do_bench(graph.replay, warmup=25, rep=200, return_mode="median"), 4)
            del graph
        base = next(iter(row["ms_per_step"].values()))
        row["speedup_vs_first"] = {k: round(base / v, 4) for k, v in row["ms_per_step"].items()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ms", default="1,16,64", help="Ms with a best_variant in kernels.json")
    p.add_argument("--layers", type=int, default=4, help="layers per graph (distinct weights)")
    p.add_argument("--kinds", default="w4chn,w4g128p", help="GEMM chains of these weight kinds ('' for none)")
    p.add_argument("--decode", default="", help="formats of whole decode steps, e.g. w4a8kv4-chn,w4a8kv4-g128")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--settings", default="off,shipped", help=f"comma list of {', '.join(SETTINGS)} (the first is the base)")
    a = p.parse_args()
    settings = a.settings.split(",")
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        p.error(f"unknown settings {sorted(unknown)}; known: {', '.join(SETTINGS)}")

    import torch
    from triton.testing import do_bench

    from bench.kernels import warm_gpu

    dev = torch.device("cuda")
    best = json.loads((REPO / "bench/results/h200/kernels.json").read_text())["best_variant"]
    result = {"command": "python3 " + " ".join(sys.argv), "machine": gpu_machine(dev), "settings": {name: SETTINGS[name] for name in settings},
              "timing": "median of do_bench over CUDA-graph replays (L2 cleared before each) of LAYERS layers, per layer",
              "runs": [], "checks": []}
    t0 = time.perf_counter()
    warm_gpu(dev)
    for kind in filter(None, a.kinds.split(",")):
        layers = [_layer_weights(kind, dev, seed) for seed in range(a.layers)]
        norm_w = torch.rand(HIDDEN, device=dev, dtype=torch.float16) + 0.5
        for m in map(int, a.ms.split(",")):
            x0 = torch.randn(m, HIDDEN, device=dev, dtype=torch.float16)
            use_setting("off")
            want = chain(layers, best, kind, x0.clone(), norm_w, m)
            row = {"kind": kind, "M": m, "us_per_layer": {}, "bit_exact": {}}
            for name in settings:
                use_setting(name)
                x = x0.clone()
                chain(layers, best, kind, x.clone(), norm_w, m)  # compile outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = chain(layers, best, kind, x, norm_w, m)
                graph.replay()
                torch.cuda.synchronize()
                row["bit_exact"][name] = bool(torch.equal(y, want))
                row["us_per_layer"][name] = round(do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3 / a.layers, 2)
            base = row["us_per_layer"][settings[0]]
            row["speedup_vs_first"] = {k: round(base / v, 3) for k, v in row["us_per_layer"].items()}
            print(json.dumps(row), flush=True)
            result["runs"].append(row)
    for fmt in filter(None, a.decode.split(",")):
        result["runs"] += decode_steps(fmt, [int(b) for b in a.batches.split(",")], a.context, settings)
    exact = all(all(r["bit_exact"].values()) for r in result["runs"])
    result["checks"].append({"name": "every setting's graph output equals the PDL-off output bit for bit",
                             "value": exact, "target": True, "op": "==", "met": exact})
    result["seconds"] = round(time.perf_counter() - t0, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
