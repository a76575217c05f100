"""PTX text for the g128 weight's int8 value (q - z) * s2 on the 4 bytes of one 32-bit register.

Used by gemm_common._dequant_swar (the MMA operand; the dp4a GEMV of w4a8_gemv.py needs no int8 weight).
Per byte q is a code in [0, 15] and s2 <= 16, so q * s2 <= 240: one 32-bit multiply by s2 never
carries into the next byte. Subtracting z * s2 bytewise without borrows: set bit 7 of every byte
of q * s2, subtract (z * s2) with its bit 7 cleared, then fix bit 7 with the sign rule of a
subtraction (SWAR). The protective range keeps every true result in [-128, 127].

Registers: declare SWAR_REGISTERS in the asm block, run swar_setup once, then swar_plane for each
nibble plane (its codes in the low 4 bits of each byte, in register `q`).
"""

from __future__ import annotations

SWAR_REGISTERS = "s, y, yl, q, x, t, m"


def swar_setup(s2: str, zs: str) -> str:
    """s = s2 (from byte 0 of `s2`), y = zs = (z * s2) mod 256 in all 4 bytes, yl = y without bit 7."""
    return f"""
        and.b32 s, {s2}, 0xFF;
        prmt.b32 y, {zs}, 0, 0x0000;
        and.b32 yl, y, 0x7F7F7F7F;"""


def swar_plane(out: str) -> str:
    """out = (q - z) * s2 on each byte of register q (codes 0..15 a byte), after swar_setup."""
    return f"""
        mul.lo.u32 x, q, s;
        or.b32 t, x, 0x80808080;
        sub.u32 t, t, yl;
        xor.b32 m, x, y;
        and.b32 m, m, 0x80808080;
        xor.b32 m, m, 0x80808080;
        xor.b32 {out}, t, m;"""


def low_plane(word: str) -> str:
    """q = the low nibble of each byte of `word`."""
    return f"""
        and.b32 q, {word}, 0x0F0F0F0F;"""


def high_plane(word: str) -> str:
    """q = the high nibble of each byte of `word`."""
    return f"""
        shr.u32 q, {word}, 4;
        and.b32 q, q, 0x0F0F0F0F;"""
