"""Pieces the paged decode attention kernels share (paged_attention.py, paged_attention_mma.py)."""

from __future__ import annotations

import triton
import triton.language as tl

# Arguments of every decode kernel that Triton must not specialize on (a value of 1, a multiple of 16: each
# a compile of its own). The partition count follows each step's longest context: with it specialized, a
# worker compiled the split kernel again the first time a step's count was a multiple of 16 (or stopped
# being one): seconds to a minute, on a cold cache, with every stream of the worker stalled.
UNSPECIALIZED = ("num_partitions",)


@triton.jit
def _program_span(context_lens_ptr, num_kv_heads, partition_size, BLOCK_N: tl.constexpr):
    """This program's (sequence * KV head, partition), sequence, KV head, context length, and its
    tokens [start, end) of which [start, full_end) fill whole BLOCK_N tiles."""
    bh = tl.program_id(0)
    part = tl.program_id(1)
    b = bh // num_kv_heads
    kvh = bh % num_kv_heads
    ctx = tl.load(context_lens_ptr + b)
    start = part * partition_size
    end = tl.minimum(start + partition_size, ctx)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    return bh, part, b, kvh, ctx, start, end, full_end


@triton.jit
def _scale_zero(words):
    """(N,) int32 tail words -> fp16 scale (low half) and zero (high half), as fp32."""
    scale = (words & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    zero = ((words >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, zero


@triton.jit
def _bytes_at_15(w):
    """Each byte of code words w shifted to bits 15..22, where _nibble reads its two nibbles
    (byte 0, 1, 2, 3 in turn: planes 2 * byte and 2 * byte + 1)."""
    return w << 15, w << 7, w >> 1, w >> 9


@triton.jit
def _nibble(x, mask, one):
    """The nibble under `mask` (bits 15..18 or 19..22) of int32 x as fp32 1 + c * 2^-8 or 1 + c * 2^-4.

    One AND/OR (a LOP3) puts the nibble in the top of the mantissa of 1.0 (`one`): exact, and no
    int-to-float conversion. The 1 is taken back out through sums of the query (scores) and of
    the weights (values); with the nibble in the top mantissa bits that subtraction costs only a
    few bits of fp32.
    """
    return ((x & mask) | one).to(tl.float32, bitcast=True)
