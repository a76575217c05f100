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
