"""SASS of bench/gluon_g128.py's Gluon kernels, compiled for sm_90 on a machine without a GPU.

Shows whether the loop keeps its wgmma in flight while it loads and unpacks the next group: with
OVERLAP the loop's `WARPGROUP.DEPBAR` should sit right before its MMAs, after the loads and the
unpacking, instead of right after the MMAs (what Triton 3.6 emits for the Triton kernel, see
services/worker/kernels/README.md, "Where the time goes"). Compare with
`python3 bench/sass_count.py --loop-min 50 gemm g128.n128m64.sk.swar`.

    python3 bench/gluon_probe.py [--block-n 128 --block-m 64 --warps 8]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def summarize(sass: str) -> str:
    """The main loop's length and where its loads, barriers and wgmma sit (instruction indices)."""
    from bench.sass_count import loops

    body = max(loops(sass), key=len)
    marks = [f"{i}:{ins.split()[0]}" for i, ins in enumerate(body)
             if re.match(r"(IGMMA|WARPGROUP|BAR\.|STS|LDS|LDG)", ins)]
    return f"loop {len(body)} instructions\n  " + " ".join(marks)


_NO_DEST = ("ST", "BAR", "WARPGROUP", "BRA", "MEMBAR", "FENCE", "RED", "EXIT", "NOP", "DEPBAR", "ARRIVES", "SYNCS")


def _written(ins: str) -> set[int]:
    """General registers an instruction writes (its first operand, widened by .64 / .128)."""
    op = ins.split()[0]
    if op.startswith(_NO_DEST) or "IGMMA" in op:
        return set()
    first = re.match(r"\S+\s+R(\d+)\b", ins)
    if not first:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or "WIDE" in op) else 1
    return set(range(int(first.group(1)), int(first.group(1)) + width))


def register_operand_hazards(sass: str) -> list[str]:
    """Instructions that overwrite a wgmma's register A operand (4 registers from its second
    operand) before the `WARPGROUP.DEPBAR` that waits for it, following the loop around: PTX calls
    that undefined, so an overlapped loop is only safe where this list is empty."""
    from bench.sass_count import loops

    body = max(loops(sass), key=len)
    hazards = []
    for i, ins in enumerate(body):
        a = re.match(r"IGMMA\S*\s+R\d+,\s+R(\d+),", ins)
        if not a:
            continue
        regs = set(range(int(a.group(1)), int(a.group(1)) + 4))
        for step in range(1, len(body)):
            later = body[(i + step) % len(body)]
            if later.startswith("WARPGROUP.DEPBAR"):
                break
            if _written(later) & regs:
                hazards.append(f"{ins}  <- overwritten by  {later}")
                break
    return hazards


def main():
    import triton

    from bench.gluon_g128 import _g128_kernel, _g128_ws_kernel
    from bench.sass_count import compile_sass, loops

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--chn", action="store_true", help="the per-channel format's loop instead of g128's")
    a = p.parse_args()
    pointers = {"x_ptr": "*i8", "sx_ptr": "*fp32", "qw_ptr": "*u8", "s2_ptr": "*u8", "zero_ptr": "*u8",
                "s1_ptr": "*fp16", "out_ptr": "*fp16", "ws_ptr": "*i32", "rowsum_ptr": "*i32"}
    print("triton", triton.__version__)
    for overlap, w_smem in ((False, False), (True, False), (True, True)):
        consts = {"BLOCK_N": a.block_n, "BLOCK_M": a.block_m, "OVERLAP": overlap, "USE_SPLIT": False, "W_SMEM": w_smem,
                  "CHN": a.chn, "STAGES": 3}
        r = compile_sass(_g128_kernel, pointers, consts, num_warps=a.warps, gluon=True)
        print(f"--- OVERLAP={overlap} W_SMEM={w_smem}: {r['regs']} registers, {summarize(r['sass'])}")
        hazards = register_operand_hazards(r["sass"])
        print(f"  register-operand hazards: {len(hazards)}" + "".join(f"\n    {h}" for h in hazards[:8]))
    for producers in (4, 8):  # warp-specialized: the consumer warpgroup's loop is the shortest one with wgmma
        consts = {"BLOCK_N": a.block_n, "BLOCK_M": a.block_m, "USE_SPLIT": False, "CHN": a.chn, "STAGES": 4,
                  "PRODUCER_WARPS": producers, "PRODUCER_REGS": 128 if producers > 4 else 152}
        r = compile_sass(_g128_ws_kernel, pointers, consts, num_warps=4, gluon=True)
        mma_loops = [body for body in loops(r["sass"]) if any("IGMMA" in ins for ins in body)]
        print(f"--- warp-specialized, {producers} producer warps: {r['regs']} registers; wgmma loop "
              f"{min(map(len, mma_loops))} instructions")


if __name__ == "__main__":
    main()
