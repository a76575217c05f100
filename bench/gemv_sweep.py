"""The M = 1 dp4a GEMV against the floor of its own memory traffic, and a sweep of its launch
shape, in one run on the Llama-2-7B shapes.

    python3 bench/gemv_sweep.py --out bench/results/h200/gemv_sweep.json

"read_floor": a Triton kernel that only reads the packed weight words (the GEMV's bytes, less x
and the scales) and stores one xor per program, launched like the GEMV (PDL, first loads before
the wait); its best block size is what a perfect GEMV could approach in this harness. The sweep
times every (rows, groups per step) tile of the M = 1 GEMV's first loop (_row_sums, ".w<warps>")
at 2, 4 and 8 warps, and of the x-shared loop (".xs", session 25), warps fixed by the tile. (Session 25 also
tried the weight loads through L2 only, `.cg`, to keep L1 for x, which every weight row re-reads:
within 1% of the default everywhere, dropped.)
Timing as bench/kernels.py (CUDA graph of 4 calls on distinct weight / activation sets, L2
cleared before each replay, median per call); cuBLAS fp16 in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import FLUSHES, gemm_calls, time_calls, w4a8_act_set, w4a8_weight_set, warm_gpu  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402

SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))
SETS = 4
TILES = ((4, 16), (8, 16), (16, 8), (32, 4), (4, 32), (2, 32))  # (rows, 128-groups per step)
WARPS = (2, 4, 8)
# (rows, groups per step) of the x-shared loop (_row_sums_x_shared; warps = groups per step / 8)
X_SHARED = ((2, 32), (4, 32), (8, 32), (16, 32), (2, 16), (4, 16), (8, 16), (16, 16), (8, 8), (16, 8))
FLOOR_BLOCKS = (1024, 2048, 4096, 8192)  # int32 words per program


@triton.jit
def _read_floor_kernel(w_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(w, axis=0))


def read_floor_calls(ws: list, block: int) -> list:
    import torch

    words = [w["w4chn"].qweight.view(torch.int32).reshape(-1) for w in ws]
    outs = [torch.empty(triton.cdiv(v.numel(), block), dtype=torch.int32, device=v.device) for v in words]
    return [lambda v=v, o=o: _read_floor_kernel[(o.numel(),)](v, o, v.numel(), BLOCK=block, num_warps=4,
                                                              launch_pdl=True)
            for v, o in zip(words, outs)]


def gemv_calls(v, kind: str, ws: list, acts: list) -> list:
    """bench.kernels.gemm_calls with the GEMV launched on a GemmVariant object (the sweep's
    warp-count variants are not in VARIANTS, so they have no name to look up)."""
    from services.worker.kernels.w4a8_gemm import w4a8_word_gemm

    def launch(x8, sx, weight, rowsum=None, group_sums=None, variant=None, split_k=None, out=None):
        return w4a8_word_gemm(x8, sx, weight, v, rowsum, group_sums=group_sums, split_k=split_k, out=out)

    return gemm_calls(launch, v.name, kind, ws, acts)


def sweep_variants(tiles):
    from services.worker.kernels import w4a8_gemm as gemm

    for kind in gemm.KINDS:
        base = gemm._gemv(kind, 4, 1, 16)
        for (bn, gps) in tiles:
            for warps in WARPS:
                name = f"{base.name.split('.')[0]}.gemv.n{bn}m1g{gps}.w{warps}"
                yield dataclasses.replace(base, name=name, block_n=bn, groups_per_step=gps, num_warps=warps)
        for bn, gps in X_SHARED:
            yield gemm._gemv(kind, bn, 1, gps, x_shared=True)


def measure(dev, warmup: int, rep: int, flush: str, tiles) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from services.worker.kernels.w4a8_gemm import w4a8_gemm

    rows = []
    for n, k in SHAPES:
        ws = [w4a8_weight_set(n, k, dev) for _ in range(SETS)]
        acts = [w4a8_act_set(1, k, dev) for _ in range(SETS)]
        xs, wf = [a["x"].half() for a in acts], [w["w"].half() for w in ws]
        row = {"N": n, "K": k, "M": 1, "weight_bytes": n * k // 2, "us": {}}
        row["us"]["cublas_fp16"] = time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, wf)], warmup, rep, flush) * 1e3
        for block in FLOOR_BLOCKS:
            row["us"][f"read_floor.b{block}"] = time_calls(read_floor_calls(ws, block), warmup, rep, flush) * 1e3
        for v in sweep_variants(tiles):
            ref = w4a8_gemm(acts[0]["x8"], acts[0]["sx"], ws[0][v.kind], acts[0]["rowsum"],
                            group_sums=acts[0]["group_sums"], variant=f"{v.name.split('.')[0]}.gemv.n4m1g16")
            got = gemv_calls(v, v.kind, ws[:1], acts[:1])[0]()
            if not torch.equal(got, ref):
                row["us"][v.name] = None
                print(f"MISMATCH {v.name} {n}x{k}", flush=True)
                continue
            row["us"][v.name] = time_calls(gemv_calls(v, v.kind, ws, acts), warmup, rep, flush) * 1e3
        timed = {name: us for name, us in row["us"].items() if us is not None}
        row["best"] = {p: min((us, name) for name, us in timed.items() if name.startswith(p))
                       for p in ("read_floor", "g128.", "chn.")}
        row["weight_tb_per_s"] = {p: row["weight_bytes"] / (us * 1e-6) / 1e12 for p, (us, _) in row["best"].items()}
        row["vs_cublas_fp16"] = {p: row["us"]["cublas_fp16"] / us for p, (us, _) in row["best"].items()}
        print(json.dumps({key: row[key] for key in ("N", "K", "best", "weight_tb_per_s", "vs_cublas_fp16")}), flush=True)
        rows.append(row)
        del ws, acts
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=5, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=20, help="do_bench repetition, ms")
    p.add_argument("--flush", choices=FLUSHES, default="read", help="how the L2 is cleared (bench.kernels.time_calls)")
    p.add_argument("--tiles", default="", help="only these rows x groups-per-step tiles, e.g. 4x16,16x8")
    a = p.parse_args()
    import torch

    dev = torch.device("cuda")
    warm_gpu(dev)
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")] if a.tiles else TILES
    rows = measure(dev, a.warmup, a.rep, a.flush, tiles)
    result = {"command": "python3 " + " ".join(shlex.quote(t) for t in sys.argv), "machine": gpu_machine(dev),
              "timing": f"as bench/kernels.py: median per call of a CUDA graph of 4 calls, L2 cleared per replay ({a.flush})",
              "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
