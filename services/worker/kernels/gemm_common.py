"""Pieces the W4A8 tile GEMMs share (w4a8_gemm.py, w4a8_int8_path.py): the order of output tiles, the
packed weight's unpacking into int8 MMA operands (nibble split, SWAR dequantization), the SM count and
operand alignment."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.swar_ptx import SWAR_REGISTERS, high_plane, low_plane, swar_plane, swar_setup


def _num_sms(device: torch.device) -> int:
    """SMs of a GPU; 4 on the CPU interpreter (small grids, yet several programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _rows_aligned(t: torch.Tensor, alignment: int, one_row_stride: bool = False) -> torch.Tensor:
    """t (rows, bytes), or a copy of it, whose base and row stride are multiples of alignment bytes. A single
    row's stride is never used, but a TMA descriptor checks it all the same (one_row_stride)."""
    if t.data_ptr() % alignment or ((t.shape[0] > 1 or one_row_stride) and t.stride(0) * t.element_size() % alignment):
        # Fresh and packed: clone() keeps a one-row view's stride (torch counts it as contiguous).
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pid_n, pid_m), GROUP_M row blocks of x sweeping N together (L2 reuse)."""
    return _tile_at(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def _tile_at(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile number pid -> (pid_n, pid_m) in _tile_ids' order (persistent kernels walk several)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_n, pid_m


# $0 / $1: the low / high nibble planes of packed word $2 (four bytes at once).
_SPLIT_NIBBLES_PTX = tl.constexpr("and.b32 $0, $2, 0x0F0F0F0F;\n\tshr.u32 $1, $2, 4;\n\tand.b32 $1, $1, 0x0F0F0F0F;")


@triton.jit
def _split_nibbles(packed, OP_DTYPE: tl.constexpr, FAST_UNPACK: tl.constexpr):
    """(BLOCK_N, 64) uint8 -> the codes of k .. k+63 (low nibbles) and k+64 .. k+127 (high nibbles)."""
    if FAST_UNPACK:
        # Four bytes per 32-bit register, split with two masks and a shift (no per-byte unpacking).
        lo, hi = tl.inline_asm_elementwise(
            asm=_SPLIT_NIBBLES_PTX, constraints="=r,=r,r", args=[packed], dtype=(tl.int8, tl.int8), is_pure=True,
            pack=4,
        )
    else:
        lo = (packed & 0xF).to(tl.int8)
        hi = (packed >> 4).to(tl.int8)
    return lo.to(OP_DTYPE), hi.to(OP_DTYPE)


# $0 / $1: the low / high nibble planes of packed word $2 as int8 (q - z) * s2; $3 s2, $4 zs.
_DEQUANT_SWAR_PTX = tl.constexpr(
    "{\n        .reg .b32 " + SWAR_REGISTERS + ";" + swar_setup("$3", "$4")
    + low_plane("$2") + swar_plane("$0") + high_plane("$2") + swar_plane("$1") + "\n        }"
)


@triton.jit
def _dequant_swar(packed, s2, zs):
    """(BLOCK_N, 64) packed bytes, s2 and zs = (z * s2) mod 256 per row -> int8 (q - z) * s2, both halves.

    Four bytes of one row share a 32-bit register (the 4 consecutive K values of an int8 MMA
    operand), so the row's s2 and zs are taken from byte 0 of their registers.
    """
    return tl.inline_asm_elementwise(
        asm=_DEQUANT_SWAR_PTX,
        constraints="=r,=r,r,r,r", args=[packed, s2, zs], dtype=(tl.int8, tl.int8), is_pure=True, pack=4,
    )
