"""bench/sass_count.py's loop finder on a hand-written disassembly (the compile step needs only the
triton wheel's ptxas; it is exercised by running the tool, not here)."""

from __future__ import annotations

import re

import pytest

from bench.sass_count import loops

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   IDP.4A.U8.S8 R3, R4, R5, R3 ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
        /*0040*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0050*/                   EXIT ;
"""


def test_loops_are_backward_branches_with_their_bodies():
    (body,) = loops(SASS)  # the forward branch to .L_x_1 is not a loop
    assert body == ["IADD3 R2, R2, 0x1, RZ", "IDP.4A.U8.S8 R3, R4, R5, R3", "BRA `(.L_x_0)"]



def _sass_count(*args: str, tool: str = "sass_count.py") -> str:
    """bench/sass_count.py's report (or another bench tool's), in a process without the interpreter that
    this directory's conftest turns on (ptxas from the triton wheel assembles for sm_90; no GPU needed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = Path(__file__).resolve().parents[2] / "bench" / tool
    return subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True, check=True,
                          timeout=300).stdout


def test_mma_attention_assembles_for_sm90():
    """The 'mma' decode kernel's inline PTX (mma.sync, shfl.sync) runs only on a GPU: here it is
    assembled for sm_90 as the MHA default launches it: 8 IMMAs per 32-token tile, no spills."""
    out = _sass_count("attention", "--mma", "--maxnreg", "128", "--page-ahead")
    assert "0 bytes of stack" in out, out
    assert "IMMA.16832.U8.S8 8 " in out and "SHFL.IDX" in out, out


@pytest.mark.parametrize("group,value_sums", [("4", ["--no-prefetch"]), ("8", ["--no-prefetch"]),
                                              ("4", ["--no-prefetch", "--pv-mma"]), ("8", ["--no-prefetch", "--pv-mma"]),
                                              ("8", ["--no-prefetch", "--head-rows"]), ("8", ["--head-rows"]),
                                              ("4", ["--head-rows", "--maxnreg", "128"]),
                                              ("8", ["--head-rows", "--maxnreg", "128"])])
def test_mma_attention_keeps_each_head_row_in_one_lane_per_token(group, value_sums):
    """With 4 or 8 query heads per KV head the kernel's (G, 32) tensors (and pv_mma's (8, 32) MMA
    operands, and the head-rows kernel's) must put row h, column i in lane i (the shuffles' source lanes and the MMA fragments
    assume it; the interpreter cannot tell). Triton picks the layout: 3.6 once spread 4 heads x 8
    lanes across the warp and the GPU results were garbage. Every layout of the compiled kernel is
    one element per lane along its last axis; no spills."""
    out = _sass_count("attention", "--mma", "--group", group, "--split", *value_sums)
    layouts = [line.split("layout ", 1)[1] for line in out.splitlines() if line.strip().startswith("layout ")]
    assert layouts, out
    for layout in layouts:
        assert re.search(r"sizePerThread = \[(1, )*1\], threadsPerWarp = \[(1, )*32\]", layout), layout
    assert "0 bytes of stack" in out, out


def test_gemv_loop_keeps_x_in_the_weights_layout():
    """The dp4a GEMV at M = 1 loads x in the weight words' register layout; if Triton moved it
    through shared memory (as the broadcast over M does), the loop would gain barriers every step
    (w4a8_gemv._row_sums). Per-channel weights, sm_90."""
    out = _sass_count("--loop-min", "50", "gemv", "--block-n", "16", "--groups-per-step", "8")
    (loop,) = [line for line in out.splitlines() if line.strip().startswith("loop of")]
    assert "IDP.4A" in loop and "BAR.SYNC" not in loop and " STS" not in loop, loop
    assert "0 bytes of stack" in out, out


@pytest.mark.parametrize("variant", ["chn.n64m16.sk", "g128.n64m64.sk.swar"])
def test_gemm_tiles_stream_weights_through_async_copies(variant):
    """The W4A8 tensor-core loops (sm_90): weight and x tiles arrive by 16-byte cp.async and meet
    wgmma; byte-wide global loads in the loop would mean the unit strides were not specialized
    (they are at launch; bench/sass_count.py must pass them so) or the pipelining was lost."""
    out = _sass_count("--loop-min", "50", "--ops", "100", "gemm", variant)
    (loop,) = [line for line in out.splitlines() if line.strip().startswith("loop of")]
    assert "LDGSTS.E.BYPASS.128" in loop and "IGMMA" in loop, loop
    if variant.startswith("chn"):
        assert "LDG.E.U8" not in loop, loop  # g128 reads its per-group s2 / zero bytes one step ahead
    assert "0 bytes of stack" in out, out


def test_int8_path_gemm_meets_wgmma_with_tma_loads():
    """The int8 path's GEMM (sm_90): in every loop that issues wgmma, the x and weight tiles arrive
    by TMA (UTMALDG), not cp.async; the dequantization pass beside it compiles without spills."""
    out = _sass_count("--loop-min", "50", "--ops", "100", "gemm", "g128.i8.n256m128")
    mma_loops = [line for line in out.splitlines() if line.strip().startswith("loop of") and "IGMMA" in line]
    assert mma_loops and all("UTMALDG" in loop and "LDGSTS" not in loop for loop in mma_loops), out
    assert "0 bytes of stack" in out, out
    assert "0 bytes of stack" in _sass_count("gemm", "g128.i8.n256m128", "--dequant")


def _overlapped_loop(first: str) -> str:
    """A loop that waits for the previous wgmma only after its first instruction."""
    return f"""
.L_x_0:
        /*0000*/                   {first} ;
        /*0010*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0020*/                   WARPGROUP.ARRIVE ;
        /*0030*/                   IGMMA.64x64x32.S8.S8 R24, R56, gdesc[UR8], R24, gsb0 ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
"""


@pytest.mark.parametrize("first,hazard", [("LDG.E R8, desc[UR4][R2.64]", False),
                                          ("LDG.E R57, desc[UR4][R2.64]", True),
                                          ("LDG.E.128 R52, desc[UR4][R2.64]", False),  # R52..R55
                                          ("LDG.E.64 R58, desc[UR4][R2.64]", True),  # R58..R59
                                          ("STS.128 [R56], R8", False)])  # reads R56
def test_register_operand_hazards_follow_the_loop_around(first, hazard):
    """A write to a wgmma's A registers (R56..R59) before the wait that covers it, reached by going
    around the loop, is what bench/gluon_probe.py must report; reads and other registers are not."""
    from bench.gluon_probe import register_operand_hazards

    found = register_operand_hazards(_overlapped_loop(first))
    assert bool(found) == hazard, found


def test_gluon_gemm_experiment_compiles_for_sm90():
    """bench/gluon_g128.py's kernels (Gluon, GPU-only: the interpreter does not run Gluon) assemble for
    sm_90 under this Triton, the loop kernel in its three modes and the warp-specialized one, and the
    safe loop mode (weight through shared memory) leaves no wgmma register operand that a later
    instruction overwrites before its wait."""
    out = _sass_count(tool="gluon_probe.py")
    modes = [line for line in out.splitlines() if line.startswith("--- ")]
    assert len(modes) == 5 and "IGMMA" in out, out  # three loop modes, two warp-specialized kernels
    smem = out.split("W_SMEM=True")[1]
    assert "register-operand hazards: 0" in smem.splitlines()[2], out
