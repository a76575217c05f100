"""bench/sass_count.py's loop finder on a hand-written disassembly (the compile step needs only the
triton wheel's ptxas; it is exercised by running the tool, not here)."""

from __future__ import annotations

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



def test_mma_attention_assembles_for_sm90():
    """The 'mma' decode kernel's inline PTX (mma.sync, shfl.sync) runs only on a GPU; here ptxas
    (from the triton wheel) assembles it for sm_90, in a process without the interpreter that this
    directory's conftest turns on: 8 IMMAs per 32-token tile, no spills."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = Path(__file__).resolve().parents[2] / "bench" / "sass_count.py"
    out = subprocess.run([sys.executable, str(tool), "attention", "--mma", "--maxnreg", "128"], env=env,
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert "0 bytes of stack" in out, out
    assert "IMMA.16832.U8.S8 8 " in out and "SHFL.IDX" in out, out
