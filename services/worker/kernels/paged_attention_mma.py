"""KV4 paged decode attention for 1, 2, 4 or 8 query heads per KV head, scores on the int8 tensor cores.

The "fma" kernel of paged_attention.py is issue-bound, and most of its instructions outside the
value sums go to the scores: four dp4a per code word, then shuffles to add each row's words up
across 8 lanes, and a softmax computed 8 times over (every lane of a row holds its score). Here one
`mma.sync.m16n8k32` (u8 x s8 -> s32) takes 16 tokens x 32 dims of K codes against the query's
int16 bytes, and the scores come out whole in a quarter of the lanes.

Written lane by lane: with num_warps=1 a (32,) tensor holds one value per lane (element i in lane
i), so the kernel decides which lane holds what, as the MMA's fragments require (PTX ISA,
m16n8k32 with 8-bit operands; lane l, g = l // 4, t = l % 4):
    A (16 x 32, rows): a0 = row g, k 4t..4t+3 (one byte each); a1 = row g + 8; a2, a3 the same rows, k 16 + 4t..
    B (32 x 8, cols):  b0 = col g, k 4t..4t+3;  b1 = col g, k 16 + 4t..
    C (16 x 8):        c0, c1 = row g, cols 2t, 2t + 1;  c2, c3 = row g + 8
A's rows are the 16 slots of a page-aligned group of tokens. Byte j of K code word w holds dims
4w + j (low nibble) and 4w + j + D/2 (high nibble), so `word & 0x0F0F0F0F` of words 8c + t and
8c + 4 + t is the A fragment of dims 32c..32c + 31 in order, and the high nibbles (one shift more)
of dims D/2 + 32c... B's column 2h holds the high bytes and column 2h + 1 the low bytes of query head
h rounded to int16 (as the "fma" kernel's qk_int16), columns past the group zero: score = 256 c0 +
c1, exact, head t's in the lanes (g, t). The MMA has 8 columns, so a group of up to 4 heads costs
the same 4 MMAs per 16 tokens as one head; a group of 8 takes a second set of 4 for heads 4..7.
Four shuffles per head hand token n's score to lane n.

Per-head values are (GROUP, 32) tensors: row h, lane i (the default layout puts dim 1 across the
warp's lanes and dim 0 in registers), so lane i holds token i's scores and sums of every head.

The value sums stay on the CUDA cores (one LOP3 and one FFMA per code, as in the "fma" kernel,
whose docstring gives the 1 + c * 2^-k trick): lane l takes code word l % 16 of the 16 tokens of
MMA row group l // 16 of each 32-token tile, keeps 8 per-lane fp32 sums per head and adds the two
lanes of a word (l, l ^ 16) together once, at the end. Each V code is unpacked once for the whole
group, so a group of G heads costs G FFMAs per code and one LOP3. (Session 17's layout, two words
of 8 tokens per lane, kept 16 sums per head: 255 registers at group 4 with prefetch against 168
now, and 4-16% slower on GQA 32/8 on the H200, bench/results/h200/attention_v_word_ab.json.)

With pv_mma (PV_MMA) the value sums go to the fp16 tensor cores instead: out^T = V^T P^T, one
`mma.sync.m16n8k16` per 16 dims x 16 tokens for up to 8 heads (the MMA's 8 columns), the codes
turned into fp16 1024 + c by a PRMT and a LOP3 per pair of tokens, the weights rounded to fp16
(_pv_mma_block). A code then costs a few instructions for the whole group instead of an FFMA per
head: SASS with Triton 3.6 per 32-token tile, group 4 1090 -> 593 instructions, group 8 1843 -> 853
(168 registers instead of 255), group 1 542 -> 441. Measured on the H200 (session 20, paged_attention.py's
notes before MMA_DEFAULTS): a tie at group 1 (memory-bound already), mixed at group 4, so not a default;
groups 4 and 8 use the head-rows kernel instead.

On the GPU the MMA and the shuffles are inline PTX; under TRITON_INTERPRET they are emulated over
the 32 lanes with gathers, fragment layout included, so the CPU tests check the bookkeeping.
Head_dim 128, page sizes a multiple of 16, groups of 1, 2, 4 or 8 (launcher: paged_attention.py,
variant "mma").
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release
from services.worker.kernels.paged_decode_parts import UNSPECIALIZED, _bytes_at_15, _nibble, _program_span, _scale_zero

TILE = tl.constexpr(32)  # tokens per loop iteration: two MMA row groups of 16


# ---------------------------------------------------------------------------------------------
# warp primitives (inline PTX on the GPU, gathers over the lanes in the interpreter)


@triton.jit
def _shfl(x, src, FAST: tl.constexpr):
    """x (G, 32) or (32,) int32 of lane src[..., i], for every lane i (and row; shfl.sync.idx, one per row)."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm="shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
            constraints="=r,r,r", args=[x, src], dtype=tl.int32, is_pure=True, pack=1,
        )
    return tl.gather(x, src, len(x.shape) - 1)


@triton.jit
def _shfl_f32(x, src, FAST: tl.constexpr):
    return _shfl(x.to(tl.int32, bitcast=True), src, FAST).to(tl.float32, bitcast=True)


@triton.jit
def _bytes_of(regs, reg, lane, byte, R: tl.constexpr, SIGNED: tl.constexpr):
    """Byte `byte` of register `reg` of lane `lane` (all (E,) int32) from regs (32 * R,) laid out lane-major."""
    v = tl.gather(regs, lane * R + reg, 0) >> (8 * byte)
    if SIGNED:
        return (v << 24) >> 24
    return v & 0xFF


@triton.jit
def _add_product(a, b, c0, c1, c2, c3, K: tl.constexpr):
    """a (16 * K,) row-major times b (K * 8,) row-major, added to the lanes' C fragments: c0, c1 =
    row g, cols 2t, 2t + 1; c2, c3 = row g + 8 (lane l, g = l // 4, t = l % 4)."""
    d = tl.reshape(tl.sum(tl.reshape(a, (16, K, 1)) * tl.reshape(b, (1, K, 8)), axis=1), (128,))  # row * 8 + col
    lane = tl.arange(0, 32)
    at = (lane // 4) * 8 + 2 * (lane % 4)
    return (c0 + tl.gather(d, at, 0), c1 + tl.gather(d, at + 1, 0),
            c2 + tl.gather(d, at + 64, 0), c3 + tl.gather(d, at + 65, 0))


@triton.jit
def _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, A_SIGNED: tl.constexpr = False, B_SIGNED: tl.constexpr = True):
    """mma.m16n8k32 u8 x s8 (or s8 x u8) + s32 over the 32 lanes' fragments (see the module docstring)."""
    regs_a = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (128,))  # lane * 4 + register (join adds the last axis)
    e = tl.arange(0, 512)
    row, k = e // 32, e % 32
    a = _bytes_of(regs_a, (row // 8) + 2 * (k // 16), 4 * (row % 8) + (k % 16) // 4, k % 4, 4, A_SIGNED)
    regs_b = tl.reshape(tl.join(b0, b1), (64,))
    e = tl.arange(0, 256)
    k, col = e // 8, e % 8
    b = _bytes_of(regs_b, k // 16, 4 * col + (k % 16) // 4, k % 4, 2, B_SIGNED)
    return _add_product(a, b, c0, c1, c2, c3, 32)


# The int8 MMA, as the 'mma' kernel uses it (A: K codes, unsigned; B: query bytes, signed) and as the
# head-rows kernel does (A: query bytes; B: K codes).
_IMMA_U8_S8 = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                           "{$8, $9}, {$10, $11, $12, $13};")
_IMMA_S8_U8 = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                           "{$8, $9}, {$10, $11, $12, $13};")


@triton.jit
def _mma_i8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr, A_SIGNED: tl.constexpr, B_SIGNED: tl.constexpr,
            FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1,
        )
    return _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, A_SIGNED, B_SIGNED)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FAST: tl.constexpr):
    return _mma_i8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, _IMMA_U8_S8, False, True, FAST)


@triton.jit
def _mma_s8_u8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FAST: tl.constexpr):
    """As _mma with signed A (query bytes) and unsigned B (K codes): paged_attention_head_rows.py."""
    return _mma_i8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, _IMMA_S8_U8, True, False, FAST)


@triton.jit
def _prmt(a, b, sel, FAST: tl.constexpr):
    """prmt.b32: byte i of the result is byte (sel >> 4i) & 7 of the pair (b:a) (a bytes 0..3, b 4..7)."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm="prmt.b32 $0, $1, $2, $3;", constraints="=r,r,r,r", args=[a, b, sel], dtype=tl.int32,
            is_pure=True, pack=1,
        )
    out = tl.zeros(a.shape, tl.int32)
    for i in tl.static_range(4):
        idx = (sel >> (4 * i)) & 7
        byte = tl.where(idx < 4, a >> (8 * (idx & 3)), b >> (8 * (idx & 3))) & 0xFF
        out |= byte << (8 * i)
    return out


@triton.jit
def _pack_f16x2(lo, hi, FAST: tl.constexpr):
    """Two fp32 (32,) rounded to fp16 (to nearest even) in one int32: lo in bits 0..15, hi in 16..31."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,f,f", args=[lo, hi], dtype=tl.int32,
            is_pure=True, pack=1,
        )
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi16 << 16)


@triton.jit
def _half(regs, reg, lane, half, R: tl.constexpr):
    """fp16 half `half` of register `reg` of lane `lane` (all (E,) int32), from regs (32 * R,) lane-major, as fp32."""
    v = (tl.gather(regs, lane * R + reg, 0) >> (16 * half)) & 0xFFFF
    return v.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mma_f16_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.m16n8k16 f16 x f16 + f32 over the 32 lanes' (32,) fragments (PTX ISA; lane l, g = l // 4,
    t = l % 4; the lower half of a register holds the even k):
        A (16 x 16): a0 = row g, k 2t, 2t + 1; a1 = row g + 8; a2, a3 the same rows, k 8 + 2t, 9 + 2t
        B (16 x 8):  b0 = col g, k 2t, 2t + 1;  b1 = col g, k 8 + 2t, 9 + 2t
        C (16 x 8):  as the int8 MMA's."""
    regs_a = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (128,))  # lane * 4 + register
    e = tl.arange(0, 256)
    row, k = e // 16, e % 16
    a = _half(regs_a, (row // 8) + 2 * (k // 8), 4 * (row % 8) + (k % 8) // 2, k % 2, 4)
    regs_b = tl.reshape(tl.join(b0, b1), (64,))
    e = tl.arange(0, 128)
    k, col = e // 8, e % 8
    b = _half(regs_b, k // 8, 4 * col + (k % 8) // 2, k % 2, 2)
    return _add_product(a, b, c0, c1, c2, c3, 16)


@triton.jit
def _mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FAST: tl.constexpr):
    """One m16n8k16 MMA per row of the (R, 32) operands (b0, b1 (32,) shared by the rows)."""
    if FAST:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            asm="mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                "{$10, $11, $12, $13};",
            constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            args=[a0, a1, a2, a3, tl.broadcast_to(b0[None, :], a0.shape), tl.broadcast_to(b1[None, :], a0.shape),
                  c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
        )
    else:
        rows = tl.arange(0, a0.shape[0])[:, None]
        for r in tl.static_range(a0.shape[0]):
            d0, d1, d2, d3 = _mma_f16_emulated(_head_row(a0, r), _head_row(a1, r), _head_row(a2, r), _head_row(a3, r),
                                               b0, b1, _head_row(c0, r), _head_row(c1, r), _head_row(c2, r),
                                               _head_row(c3, r))
            c0 = tl.where(rows == r, d0[None, :], c0)
            c1 = tl.where(rows == r, d1[None, :], c1)
            c2 = tl.where(rows == r, d2[None, :], c2)
            c3 = tl.where(rows == r, d3[None, :], c3)
    return c0, c1, c2, c3


# ---------------------------------------------------------------------------------------------
# pieces


@triton.jit
def _int16_bytes(x, j: tl.constexpr):
    """x (query times its head's inv) rounded to int16, q16 = 256 hi + lo -> (hi, lo) as byte j of a register."""
    q16 = tl.floor(x + 0.5).to(tl.int32)
    hi = (q16 + 128) >> 8
    return (hi & 0xFF) << (8 * j), ((q16 - hi * 256) & 0xFF) << (8 * j)


@triton.jit
def _query_bytes(x0, x1, x2, x3):
    """Four consecutive query dims times their head's inv, as int16 (_int16_bytes) -> (hi, lo):
    registers whose byte j is the high / low byte of dim j (lo in [-128, 127])."""
    hi0, lo0 = _int16_bytes(x0, 0)
    hi1, lo1 = _int16_bytes(x1, 1)
    hi2, lo2 = _int16_bytes(x2, 2)
    hi3, lo3 = _int16_bytes(x3, 3)
    return hi0 | hi1 | hi2 | hi3, lo0 | lo1 | lo2 | lo3


@triton.jit
def _query_fragment(hi, lo, g, t, base: tl.constexpr, FIRST_HEAD: tl.constexpr, FAST: tl.constexpr):
    """B fragment register of query dims base + 4t .. base + 4t + 3: in column 2h (lanes g = 2h)
    head FIRST_HEAD + h's high bytes, in column 2h + 1 its low bytes; 0 in the columns past the group.
    hi, lo: (G, 32), row h, lane i head h's dims 4i .. 4i + 3 (_query_bytes). Taken by shuffles from
    lane base / 4 + t, which loaded those dims for the head's scale: the query is read
    from memory once, and every load is one more op for Triton's coalescing pass, whose time grows
    with the kernel's memory ops times its size (a worker's cold start-up compiles this kernel)."""
    src = tl.broadcast_to((base // 4 + t)[None, :], hi.shape)
    from_hi = _shfl(hi, src, FAST)
    from_lo = _shfl(lo, src, FAST)
    heads = tl.arange(0, hi.shape[0])
    mine = heads[:, None] == (FIRST_HEAD + g // 2)[None, :]
    return tl.sum(tl.where(mine, tl.where((g % 2 == 0)[None, :], from_hi, from_lo), 0), axis=0)


@triton.jit
def _query_fragments(hi, lo, g, t, HALF: tl.constexpr, FIRST_HEAD: tl.constexpr, FAST: tl.constexpr):
    """The 8 B fragments of heads FIRST_HEAD.. (_query_fragment): dims 0.., 16.., 32.., 48.. of each half."""
    return (_query_fragment(hi, lo, g, t, 0, FIRST_HEAD, FAST), _query_fragment(hi, lo, g, t, 16, FIRST_HEAD, FAST),
            _query_fragment(hi, lo, g, t, 32, FIRST_HEAD, FAST), _query_fragment(hi, lo, g, t, 48, FIRST_HEAD, FAST),
            _query_fragment(hi, lo, g, t, HALF, FIRST_HEAD, FAST),
            _query_fragment(hi, lo, g, t, HALF + 16, FIRST_HEAD, FAST),
            _query_fragment(hi, lo, g, t, HALF + 32, FIRST_HEAD, FAST),
            _query_fragment(hi, lo, g, t, HALF + 48, FIRST_HEAD, FAST))


@triton.jit
def _scores16(w0, w1, w2, w3, w4, w5, w6, w7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, FAST: tl.constexpr):
    """Integer scores of a group of 16 tokens from lane (g, t)'s K words t, 4 + t, 8 + t, 12 + t of
    slot g (w0..w3) and of slot g + 8 (w4..w7), against the query fragments
    qb[(half * 2 + c) * 2 + reg]: -> (slot g's, slot g + 8's) for head t, in the lanes with t < GROUP."""
    lo = 0x0F0F0F0F
    c0 = tl.zeros(w0.shape, tl.int32)
    c1 = c0
    c2 = c0
    c3 = c0
    # low nibbles: dims 0..31 (words 0..7), 32..63 (words 8..15); high nibbles: dims 64.., 96..
    c0, c1, c2, c3 = _mma(w0 & lo, w4 & lo, w1 & lo, w5 & lo, qb0, qb1, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma(w2 & lo, w6 & lo, w3 & lo, w7 & lo, qb2, qb3, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma((w0 >> 4) & lo, (w4 >> 4) & lo, (w1 >> 4) & lo, (w5 >> 4) & lo, qb4, qb5,
                          c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma((w2 >> 4) & lo, (w6 >> 4) & lo, (w3 >> 4) & lo, (w7 >> 4) & lo, qb6, qb7,
                          c0, c1, c2, c3, FAST)
    return c0 * 256 + c1, c2 * 256 + c3


@triton.jit
def _pv_word(w, pw, a0, a1, a2, a3, a4, a5, a6, a7, mask_lo, mask_hi, one):
    """The 8 planes of code word w (32,) (one token's) times the token's weights pw (G, 32) of each
    head, added to a0..a7 (G, 32): each plane unpacked once for the group."""
    x0, x1, x2, x3 = _bytes_at_15(w)
    a0 += pw * _nibble(x0, mask_lo, one)[None, :]
    a1 += pw * _nibble(x0, mask_hi, one)[None, :]
    a2 += pw * _nibble(x1, mask_lo, one)[None, :]
    a3 += pw * _nibble(x1, mask_hi, one)[None, :]
    a4 += pw * _nibble(x2, mask_lo, one)[None, :]
    a5 += pw * _nibble(x2, mask_hi, one)[None, :]
    a6 += pw * _nibble(x3, mask_lo, one)[None, :]
    a7 += pw * _nibble(x3, mask_hi, one)[None, :]
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _score_rows(s, u, GROUP: tl.constexpr):
    """(G, 32) with row h the (32,) MMA scores that hold head h: s for heads 0..3, u for heads 4..7
    (a group of 8 takes two sets of MMAs)."""
    if GROUP == 8:
        return tl.where(tl.arange(0, GROUP)[:, None] < 4, s[None, :], u[None, :])
    return tl.broadcast_to(s[None, :], (GROUP, s.shape[0]))


@triton.jit
def _head_row(x, h: tl.constexpr):
    """Row h of x (G, 32) as a (32,) tensor, lane for lane (a select and a sum within each lane)."""
    return tl.sum(tl.where(tl.arange(0, x.shape[0])[:, None] == h, x, 0), axis=0)


@triton.jit
def _store_plane(out_row, head_stride, lane, w, a, pw_sum, z_sum, denom, ok, S: tl.constexpr, HALF: tl.constexpr,
                 FAST: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr):
    """Adds the two token-group lanes (l, l ^ 16) of plane S of word w together; lanes 0..15 store its dim of
    head h's row (out_row + h * head_stride): (sum pw (1 + c 2^-k) - sum pw) * 2^k + sum p zero,
    over denom. The stores are 1D, one per head: see the kernel on why no memory op is (G, 32)."""
    a += _shfl_f32(a, tl.broadcast_to((lane ^ 16)[None, :], a.shape), FAST)
    val = ((a - pw_sum[:, None]) * (1 << (8 - 4 * (S % 2))) + z_sum[:, None]) / denom[:, None]
    offs = 4 * w + S // 2 + (S % 2) * HALF
    for h in tl.static_range(GROUP):
        ptrs = out_row + h * head_stride + offs
        if SPLIT:
            tl.store(ptrs, _head_row(val, h), mask=(lane < 16) & ok)
        else:
            tl.store(ptrs, _head_row(val, h).to(tl.float16), mask=lane < 16)


@triton.jit
def _store_word_planes(out_row, head_stride, lane, w, a0, a1, a2, a3, a4, a5, a6, a7, pw_sum, z_sum, denom, ok,
                       HALF: tl.constexpr, FAST: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr):
    _store_plane(out_row, head_stride, lane, w, a0, pw_sum, z_sum, denom, ok, 0, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a1, pw_sum, z_sum, denom, ok, 1, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a2, pw_sum, z_sum, denom, ok, 2, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a3, pw_sum, z_sum, denom, ok, 3, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a4, pw_sum, z_sum, denom, ok, 4, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a5, pw_sum, z_sum, denom, ok, 5, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a6, pw_sum, z_sum, denom, ok, 6, HALF, FAST, SPLIT, GROUP)
    _store_plane(out_row, head_stride, lane, w, a7, pw_sum, z_sum, denom, ok, 7, HALF, FAST, SPLIT, GROUP)


@triton.jit
def _lane_head(x, head):
    """x (G, 1) or (G, 32) per head -> (32,): lane i's value of head head[i] (0 for a head past the group)."""
    rows = tl.arange(0, x.shape[0])[:, None]
    return tl.sum(tl.where(rows == head[None, :], x, 0.0), axis=0)


@triton.jit
def _pv_mma_block(w16, first: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7, c0, c1, c2, c3, lane,
                  FAST: tl.constexpr):
    """Value sums of the 16 tokens first .. first + 15 of the tile on the fp16 tensor cores:
    out^T (dims x heads) += V^T (dims x tokens) P^T (tokens x heads), one m16n8k16 per 16 dims.

    B (P^T): lane (g, t) holds head g's fp16 weights of tokens 2t, 2t + 1 (b0) and 8 + 2t, 9 + 2t
    (b1); w16 (G, 32) has them in lanes first + token, so each comes over with a shuffle per head.
    A (V^T): row m of the (8, 32) operands is MMA m. Its row g is dim 4 (g + 8 (m // 4)) + m % 4 and
    its row g + 8 that dim + D/2: the low and high nibble of one byte of lane g's code word g or
    g + 8 (v0..v3: word g of tokens 2t, 2t + 1, 8 + 2t, 9 + 2t; v4..v7: word g + 8). A PRMT pairs
    the byte of two tokens, a LOP3 puts each nibble under the exponent of fp16 1024:
    0x6400 | c = 1024 + c (low nibble), 0x6400 | c << 4 = 1024 + 16 c (high), exact; the launcher's
    store takes 1024 * sum(w16) back out and divides the high dims by 16."""
    g = lane // 4
    t = lane % 4
    src = first + 2 * t  # row g of each (G, 32) shuffle result is this lane's head
    e0 = _lane_head(_shfl_f32(w16, tl.broadcast_to(src[None, :], w16.shape), FAST), g)
    e1 = _lane_head(_shfl_f32(w16, tl.broadcast_to((src + 1)[None, :], w16.shape), FAST), g)
    e2 = _lane_head(_shfl_f32(w16, tl.broadcast_to((src + 8)[None, :], w16.shape), FAST), g)
    e3 = _lane_head(_shfl_f32(w16, tl.broadcast_to((src + 9)[None, :], w16.shape), FAST), g)
    return _pv_mma_apply(_pack_f16x2(e0, e1, FAST), _pack_f16x2(e2, e3, FAST), v0, v1, v2, v3, v4, v5, v6, v7,
                         c0, c1, c2, c3, FAST)


@triton.jit
def _pv_mma_apply(b0, b1, v0, v1, v2, v3, v4, v5, v6, v7, c0, c1, c2, c3, FAST: tl.constexpr):
    """The 8 value MMAs of 16 tokens given their B fragments (fp16 weight pairs) and code words (see
    _pv_mma_block)."""
    m = tl.arange(0, 8)[:, None]
    j = m % 4
    sel = tl.broadcast_to(j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12), (8, 32))  # byte j of each token
    lo_pair = _prmt(tl.where(m < 4, v0[None, :], v4[None, :]), tl.where(m < 4, v1[None, :], v5[None, :]), sel, FAST)
    hi_pair = _prmt(tl.where(m < 4, v2[None, :], v6[None, :]), tl.where(m < 4, v3[None, :], v7[None, :]), sel, FAST)
    a0 = (lo_pair & 0x000F000F) | 0x64006400
    a1 = (lo_pair & 0x00F000F0) | 0x64006400
    a2 = (hi_pair & 0x000F000F) | 0x64006400
    a3 = (hi_pair & 0x00F000F0) | 0x64006400
    return _mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FAST)


@triton.jit
def _store_pv_mma(out_row, head_stride, lane, c0, c1, c2, c3, pw_sum, z_sum, denom, ok, HALF: tl.constexpr,
                  SPLIT: tl.constexpr, GROUP: tl.constexpr):
    """Stores the (8, 32) MMA sums of _pv_mma_block: lane (g, t) holds heads 2t (c0, c2) and 2t + 1
    (c1, c3) of dim 4 (g + 8 (m // 4)) + m % 4 (c0, c1) and that dim + D/2 (c2, c3), row m.
    value = ((c - 1024 sum w16) * (1 or 1/16) + sum p zero) / denom. Stores row by row, (32,) each
    (see the kernel on why no memory op is (G, 32))."""
    t = lane % 4
    he = 2 * t
    ho = 2 * t + 1
    _store_pv_rows(out_row, head_stride, lane, c0, c1, c2, c3,
                   _lane_head(pw_sum[:, None], he), _lane_head(pw_sum[:, None], ho),
                   _lane_head(z_sum[:, None], he), _lane_head(z_sum[:, None], ho),
                   _lane_head(denom[:, None], he), _lane_head(denom[:, None], ho), ok, HALF, SPLIT, GROUP)


@triton.jit
def _store_pv_rows(out_row, head_stride, lane, c0, c1, c2, c3, pw_e, pw_o, z_e, z_o, d_e, d_o, ok,
                   HALF: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr):
    """_store_pv_mma with lane (g, t)'s sums of weights, of p * zero and denominators of heads 2t (_e)
    and 2t + 1 (_o) given."""
    g = lane // 4
    t = lane % 4
    he = 2 * t
    ho = 2 * t + 1
    ok_e = he < GROUP
    ok_o = ho < GROUP
    if SPLIT:  # ok: per lane, whether the partition holds tokens
        ok_e = ok_e & ok
        ok_o = ok_o & ok
    for m in tl.static_range(8):
        dim = 4 * (g + 8 * (m // 4)) + m % 4
        v_lo_e = (_head_row(c0, m) - 1024.0 * pw_e + z_e) / d_e
        v_lo_o = (_head_row(c1, m) - 1024.0 * pw_o + z_o) / d_o
        v_hi_e = ((_head_row(c2, m) - 1024.0 * pw_e) * 0.0625 + z_e) / d_e
        v_hi_o = ((_head_row(c3, m) - 1024.0 * pw_o) * 0.0625 + z_o) / d_o
        if SPLIT:
            tl.store(out_row + he * head_stride + dim, v_lo_e, mask=ok_e)
            tl.store(out_row + ho * head_stride + dim, v_lo_o, mask=ok_o)
            tl.store(out_row + he * head_stride + dim + HALF, v_hi_e, mask=ok_e)
            tl.store(out_row + ho * head_stride + dim + HALF, v_hi_o, mask=ok_o)
        else:
            tl.store(out_row + he * head_stride + dim, v_lo_e.to(tl.float16), mask=ok_e)
            tl.store(out_row + ho * head_stride + dim, v_lo_o.to(tl.float16), mask=ok_o)
            tl.store(out_row + he * head_stride + dim + HALF, v_hi_e.to(tl.float16), mask=ok_e)
            tl.store(out_row + ho * head_stride + dim + HALF, v_hi_o.to(tl.float16), mask=ok_o)


# ---------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def _pages(bt_row, n0, end, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Physical pages of the tile's two groups of 16 tokens (page 0 past the context)."""
    if MASKED:
        page0 = tl.load(bt_row + n0 // BLOCK_SIZE, mask=n0 < end, other=0)
        page1 = tl.load(bt_row + (n0 + 16) // BLOCK_SIZE, mask=n0 + 16 < end, other=0)
    else:
        page0 = tl.load(bt_row + n0 // BLOCK_SIZE)
        page1 = tl.load(bt_row + (n0 + 16) // BLOCK_SIZE)
    return page0, page1


@triton.jit
def _tile_loads(k_ptr, v_ptr, page0, page1, head_off, n0, end, stride_cb, lane, g, t,
                BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, W: tl.constexpr, PV_MMA: tl.constexpr = False):
    """Every word a lane needs of tokens [n0, n0 + 32): its K words of the two MMA row groups
    (_scores16's w0..w7 each), its token's K and V scale/zero words (lane n: token n0 + n; 0 past
    the context, whose fp16 bits may be NaN), and its V word lane % 16 of tokens
    n0 + 16 (lane // 16) + i (x0..x7) and + 8 + i (y0..y7). Rows past the context are read
    unmasked (their page is a real one, page 0 at worst): their scores are masked and their
    weights are 0."""
    ROW: tl.constexpr = W + 1  # words per page row: W code words, then scale and zero
    base0 = page0 * stride_cb + head_off + (n0 % BLOCK_SIZE) * ROW  # word offset of the group's slot 0
    base1 = page1 * stride_cb + head_off + ((n0 + 16) % BLOCK_SIZE) * ROW
    r0 = base0 + g * ROW + t
    r1 = base1 + g * ROW + t
    k0 = tl.load(k_ptr + r0)
    k1 = tl.load(k_ptr + r0 + 4)
    k2 = tl.load(k_ptr + r0 + 8)
    k3 = tl.load(k_ptr + r0 + 12)
    k4 = tl.load(k_ptr + r0 + 8 * ROW)
    k5 = tl.load(k_ptr + r0 + 8 * ROW + 4)
    k6 = tl.load(k_ptr + r0 + 8 * ROW + 8)
    k7 = tl.load(k_ptr + r0 + 8 * ROW + 12)
    j0 = tl.load(k_ptr + r1)
    j1 = tl.load(k_ptr + r1 + 4)
    j2 = tl.load(k_ptr + r1 + 8)
    j3 = tl.load(k_ptr + r1 + 12)
    j4 = tl.load(k_ptr + r1 + 8 * ROW)
    j5 = tl.load(k_ptr + r1 + 8 * ROW + 4)
    j6 = tl.load(k_ptr + r1 + 8 * ROW + 8)
    j7 = tl.load(k_ptr + r1 + 8 * ROW + 12)
    my_row = tl.where(lane < 16, base0, base1) + (lane % 16) * ROW + W
    if MASKED:
        valid = n0 + lane < end
        ksz = tl.load(k_ptr + my_row, mask=valid, other=0)
        vsz = tl.load(v_ptr + my_row, mask=valid, other=0)
    else:
        ksz = tl.load(k_ptr + my_row)
        vsz = tl.load(v_ptr + my_row)
    if PV_MMA:  # _pv_mma_block's words: x of the first 16 tokens, y of the second
        x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7 = _pv_mma_loads(v_ptr, base0, base1, g, t, ROW)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7 = _pv_word_loads(v_ptr, base0, base1, lane, ROW)
    return (k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
            x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7)


@triton.jit
def _pv_word_loads(v_ptr, base0, base1, lane, ROW: tl.constexpr):
    """The CUDA-core value sums' words: word lane % 16 of tokens 16 (lane // 16) + i (x_i) and + 8 + i (y_i)."""
    vr = tl.where(lane < 16, base0, base1) + (lane % 16)
    x0 = tl.load(v_ptr + vr)
    x1 = tl.load(v_ptr + vr + ROW)
    x2 = tl.load(v_ptr + vr + 2 * ROW)
    x3 = tl.load(v_ptr + vr + 3 * ROW)
    x4 = tl.load(v_ptr + vr + 4 * ROW)
    x5 = tl.load(v_ptr + vr + 5 * ROW)
    x6 = tl.load(v_ptr + vr + 6 * ROW)
    x7 = tl.load(v_ptr + vr + 7 * ROW)
    y0 = tl.load(v_ptr + vr + 8 * ROW)
    y1 = tl.load(v_ptr + vr + 9 * ROW)
    y2 = tl.load(v_ptr + vr + 10 * ROW)
    y3 = tl.load(v_ptr + vr + 11 * ROW)
    y4 = tl.load(v_ptr + vr + 12 * ROW)
    y5 = tl.load(v_ptr + vr + 13 * ROW)
    y6 = tl.load(v_ptr + vr + 14 * ROW)
    y7 = tl.load(v_ptr + vr + 15 * ROW)
    return x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _pv_mma_loads(v_ptr, base0, base1, g, t, ROW: tl.constexpr):
    """The V words of _pv_mma_block: word g of tokens 2t, 2t + 1, 8 + 2t, 9 + 2t of each group of 16
    (x0..x3, y0..y3), then word g + 8 of them (x4..x7, y4..y7)."""
    r0 = base0 + (2 * t) * ROW + g
    r1 = base1 + (2 * t) * ROW + g
    x0 = tl.load(v_ptr + r0)
    x1 = tl.load(v_ptr + r0 + ROW)
    x2 = tl.load(v_ptr + r0 + 8 * ROW)
    x3 = tl.load(v_ptr + r0 + 9 * ROW)
    x4 = tl.load(v_ptr + r0 + 8)
    x5 = tl.load(v_ptr + r0 + ROW + 8)
    x6 = tl.load(v_ptr + r0 + 8 * ROW + 8)
    x7 = tl.load(v_ptr + r0 + 9 * ROW + 8)
    y0 = tl.load(v_ptr + r1)
    y1 = tl.load(v_ptr + r1 + ROW)
    y2 = tl.load(v_ptr + r1 + 8 * ROW)
    y3 = tl.load(v_ptr + r1 + 9 * ROW)
    y4 = tl.load(v_ptr + r1 + 8)
    y5 = tl.load(v_ptr + r1 + ROW + 8)
    y6 = tl.load(v_ptr + r1 + 8 * ROW + 8)
    y7 = tl.load(v_ptr + r1 + 9 * ROW + 8)
    return x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _pv_token(pw, i: tl.constexpr, x, y, a0, a1, a2, a3, a4, a5, a6, a7,
              lane, mask_lo, mask_hi, one, FAST: tl.constexpr):
    """Adds this lane's V word of tokens 16 (lane // 16) + i (x) and + 8 + i (y), weighted, per head."""
    first = 16 * (lane // 16) + i
    w_x = _shfl_f32(pw, tl.broadcast_to(first[None, :], pw.shape), FAST)
    w_y = _shfl_f32(pw, tl.broadcast_to((first + 8)[None, :], pw.shape), FAST)
    a0, a1, a2, a3, a4, a5, a6, a7 = _pv_word(x, w_x, a0, a1, a2, a3, a4, a5, a6, a7, mask_lo, mask_hi, one)
    a0, a1, a2, a3, a4, a5, a6, a7 = _pv_word(y, w_y, a0, a1, a2, a3, a4, a5, a6, a7, mask_lo, mask_hi, one)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _tile_math(
    k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
    x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
    n0, end, lane, mask_lo, mask_hi, one, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
    qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, q_step, q_sum,
    m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7,
    MASKED: tl.constexpr, FAST: tl.constexpr, GROUP: tl.constexpr, PV_MMA: tl.constexpr = False,
):
    """Online-softmax update with the words of tokens [n0, n0 + 32) (_tile_loads); MASKED only for
    a partial last tile. Per head (rows of (G, 32); m_i, q_step, q_sum (G,)): l_p, pw_p, z_p this
    lane's parts of the softmax sum, of sum p * v_scale and of sum p * v_zero; a0..a7 the plane
    sums of this lane's V word. qb0..qb7: the query fragments of heads 0..3; qc0..qc7 those of
    heads 4..7 (group 8 only)."""
    s00, s01 = _scores16(k0, k1, k2, k3, k4, k5, k6, k7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, FAST)
    s10, s11 = _scores16(j0, j1, j2, j3, j4, j5, j6, j7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7, FAST)
    if GROUP == 8:  # heads 4..7 on a second set of MMAs
        u00, u01 = _scores16(k0, k1, k2, k3, k4, k5, k6, k7, qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, FAST)
        u10, u11 = _scores16(j0, j1, j2, j3, j4, j5, j6, j7, qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, FAST)
    else:  # unused
        u00, u01, u10, u11 = s00, s01, s10, s11
    # lane n takes head h's score of token n from lane 4 (n % 8) + h % 4 (slot n % 8 or n % 8 + 8 of
    # its group) of the MMA that holds head h
    src = 4 * (lane % 8) + tl.arange(0, GROUP)[:, None] % 4  # (G, 32)
    x00 = _shfl(_score_rows(s00, u00, GROUP), src, FAST)
    x01 = _shfl(_score_rows(s01, u01, GROUP), src, FAST)
    x10 = _shfl(_score_rows(s10, u10, GROUP), src, FAST)
    x11 = _shfl(_score_rows(s11, u11, GROUP), src, FAST)
    score = tl.where(lane < 16, tl.where(lane < 8, x00, x01), tl.where(lane < 24, x10, x11))  # (G, 32)

    k_scale, k_zero = _scale_zero(ksz)
    v_scale, v_zero = _scale_zero(vsz)
    s = score.to(tl.float32) * q_step[:, None] * k_scale + q_sum[:, None] * k_zero  # log2 units
    if MASKED:
        s = tl.where(n0 + lane < end, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)[:, None]
    p = tl.exp2(s - m_new[:, None])
    pw = p * v_scale  # 0 past the context
    l_p = l_p * alpha + p
    z_p = z_p * alpha + p * v_zero
    if PV_MMA:  # a0..a3 are the (8, 32) MMA sums of _pv_mma_block
        w16 = pw.to(tl.float16).to(tl.float32)  # the weights the MMA sees: their sum takes the 1024s out exactly
        pw_p = pw_p * alpha + w16
        lane_t = lane % 4
        alpha_e = _lane_head(alpha, 2 * lane_t)[None, :]  # lane (g, t) sums heads 2t and 2t + 1
        alpha_o = _lane_head(alpha, 2 * lane_t + 1)[None, :]
        a0 = a0 * alpha_e
        a1 = a1 * alpha_o
        a2 = a2 * alpha_e
        a3 = a3 * alpha_o
        a0, a1, a2, a3 = _pv_mma_block(w16, 0, x0, x1, x2, x3, x4, x5, x6, x7, a0, a1, a2, a3, lane, FAST)
        a0, a1, a2, a3 = _pv_mma_block(w16, 16, y0, y1, y2, y3, y4, y5, y6, y7, a0, a1, a2, a3, lane, FAST)
    else:
        pw_p = pw_p * alpha + pw

        a0 *= alpha
        a1 *= alpha
        a2 *= alpha
        a3 *= alpha
        a4 *= alpha
        a5 *= alpha
        a6 *= alpha
        a7 *= alpha
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 0, x0, y0, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 1, x1, y1, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 2, x2, y2, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 3, x3, y3, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 4, x4, y4, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 5, x5, y5, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 6, x6, y6, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_token(
            pw, 7, x7, y7, a0, a1, a2, a3, a4, a5, a6, a7, lane, mask_lo, mask_hi, one, FAST)
    return m_new, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _kv4_decode_mma_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    # sizes
    qk_scale, num_kv_heads, num_partitions, partition_size, nibble_mask, nibble_one,
    # strides (q/out in elements, caches in int32 words; rows are W + 1 words apart)
    stride_qb, stride_qh, stride_cb, stride_ch, stride_bt, stride_ob, stride_oh,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, FAST: tl.constexpr,
    GROUP: tl.constexpr = 1, PAGE_AHEAD: tl.constexpr = False, PDL: tl.constexpr = 0, KV_SHARE: tl.constexpr = 1,
    PV_MMA: tl.constexpr = False,
):
    # KV_SHARE programs share one cache head, each taking GROUP of its query heads: the launcher
    # passes num_kv_heads = cache heads x KV_SHARE, so kvh below is a program's slice of heads and
    # kvh * GROUP its first query head either way; only the cache reads use kvh // KV_SHARE.
    _overlap_entry(PDL)
    W: tl.constexpr = HEAD_DIM // 8
    HALF: tl.constexpr = HEAD_DIM // 2
    tl.static_assert(HEAD_DIM == 128, "the mma decode kernel is written for head_dim 128")
    tl.static_assert(BLOCK_SIZE % 16 == 0, "the mma decode kernel needs pages of a multiple of 16 tokens")
    tl.static_assert(GROUP == 1 or GROUP == 2 or GROUP == 4 or GROUP == 8,
                     "the mma decode kernel takes groups of 1, 2, 4 or 8 heads")
    bh, part, b, kvh, ctx, start, end, full_end = _program_span(context_lens_ptr, num_kv_heads, partition_size, TILE)

    lane = tl.arange(0, 32)
    g = lane // 4
    t = lane % 4
    heads = tl.arange(0, GROUP)  # the group's query heads, kvh * GROUP + heads
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (kvh * GROUP) * stride_qh
    # No memory op of the kernel is (G, 32) or (G, 128): the compiler picks a layout for those from
    # their addresses (Triton 3.6 put 4 heads x 8 lanes across the warp, 3.9 vectorized the query
    # load 4 dims a lane), and it would spread to every (G, 32) tensor, while the shuffles need row
    # h, lane i in lane i. So lane i reads dims 4i .. 4i + 3 of each head with (32,) loads, and the
    # stores go out one head at a time (_store_plane). tests/kernels/test_sass_count.py checks the layout.
    q0 = tl.zeros((GROUP, 32), tl.float32)  # row h, lane i: head h's dim 4i (q1: 4i + 1, ...)
    q1 = q0
    q2 = q0
    q3 = q0
    for h in tl.static_range(GROUP):
        row = heads[:, None] == h
        q0 = tl.where(row, tl.load(q_row + h * stride_qh + 4 * lane).to(tl.float32)[None, :], q0)
        q1 = tl.where(row, tl.load(q_row + h * stride_qh + 4 * lane + 1).to(tl.float32)[None, :], q1)
        q2 = tl.where(row, tl.load(q_row + h * stride_qh + 4 * lane + 2).to(tl.float32)[None, :], q2)
        q3 = tl.where(row, tl.load(q_row + h * stride_qh + 4 * lane + 3).to(tl.float32)[None, :], q3)
    q_sum = tl.sum(q0 + q1 + q2 + q3, axis=1) * qk_scale  # (G,)
    q_max = tl.max(tl.maximum(tl.maximum(tl.abs(q0), tl.abs(q1)), tl.maximum(tl.abs(q2), tl.abs(q3))), axis=1)
    q_max = q_max * qk_scale
    q_step = tl.where(q_max > 0, q_max / 32512.0, 1.0)  # |q16| <= 32512 keeps the high byte in [-127, 127]
    inv = (qk_scale / q_step)[:, None]
    hi, lo = _query_bytes(q0 * inv, q1 * inv, q2 * inv, q3 * inv)  # row h, lane i: head h's dims 4i .. 4i + 3
    qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7 = _query_fragments(hi, lo, g, t, HALF, 0, FAST)
    if GROUP == 8:  # the MMA's 8 columns hold 4 heads: heads 4..7 get fragments of their own
        qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7 = _query_fragments(hi, lo, g, t, HALF, 4, FAST)
    else:  # unused
        qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7 = qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7

    m_i = tl.full((GROUP,), float("-inf"), tl.float32)
    zero = tl.zeros((GROUP, 32), tl.float32)
    l_p = zero
    pw_p = zero
    z_p = zero
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    a4 = zero
    a5 = zero
    a6 = zero
    a7 = zero
    if PV_MMA:  # the MMA sums of _pv_mma_block: row m of a0..a3 is MMA m's c0..c3
        a0 = tl.zeros((8, 32), tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = (kvh // KV_SHARE) * stride_ch
    mask_lo = nibble_mask
    mask_hi = nibble_mask << 4
    one = nibble_one
    if PREFETCH:
        # Software pipelining by one tile: tile i + 1's pages and words are in flight during tile
        # i's math. The prologue's loads are masked (there may be no full tile); the last
        # iteration reloads the last full tile (cache hits) instead of branching.
        page0, page1 = _pages(bt_row, start, end, BLOCK_SIZE, True)
        (k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
         x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7) = _tile_loads(
            k_ptr, v_ptr, page0, page1, head_off, start, end, stride_cb, lane, g, t, BLOCK_SIZE, True, W, PV_MMA)
        last_full = tl.maximum(full_end - TILE, start)
        if PAGE_AHEAD:
            # The block-table entries run one tile further ahead than the words, so the address
            # of tile i + 1's loads does not wait on a block-table load issued in iteration i.
            ahead0, ahead1 = _pages(bt_row, tl.minimum(start + TILE, last_full), end, BLOCK_SIZE, True)
        for n0 in range(start, full_end, TILE):
            nxt = tl.minimum(n0 + TILE, last_full)
            if PAGE_AHEAD:
                page0, page1 = ahead0, ahead1
                ahead0, ahead1 = _pages(bt_row, tl.minimum(n0 + 2 * TILE, last_full), end, BLOCK_SIZE, False)
            else:
                page0, page1 = _pages(bt_row, nxt, end, BLOCK_SIZE, False)
            (nk0, nk1, nk2, nk3, nk4, nk5, nk6, nk7, nj0, nj1, nj2, nj3, nj4, nj5, nj6, nj7, nksz, nvsz,
             nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7) = _tile_loads(
                k_ptr, v_ptr, page0, page1, head_off, nxt, end, stride_cb, lane, g, t, BLOCK_SIZE, False, W, PV_MMA)
            m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7 = _tile_math(
                k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
                x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                n0, end, lane, mask_lo, mask_hi, one, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
                qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, q_step, q_sum,
                m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7, False, FAST, GROUP, PV_MMA,
            )
            k0, k1, k2, k3, k4, k5, k6, k7 = nk0, nk1, nk2, nk3, nk4, nk5, nk6, nk7
            j0, j1, j2, j3, j4, j5, j6, j7 = nj0, nj1, nj2, nj3, nj4, nj5, nj6, nj7
            ksz, vsz = nksz, nvsz
            x0, x1, x2, x3, x4, x5, x6, x7 = nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7
            y0, y1, y2, y3, y4, y5, y6, y7 = ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7
    else:
        for n0 in range(start, full_end, TILE):
            page0, page1 = _pages(bt_row, n0, end, BLOCK_SIZE, False)
            (k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
             x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7) = _tile_loads(
                k_ptr, v_ptr, page0, page1, head_off, n0, end, stride_cb, lane, g, t, BLOCK_SIZE, False, W, PV_MMA)
            m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7 = _tile_math(
                k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
                x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                n0, end, lane, mask_lo, mask_hi, one, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
                qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, q_step, q_sum,
                m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7, False, FAST, GROUP, PV_MMA,
            )
    for n0 in range(full_end, end, TILE):  # at most one partial tile
        page0, page1 = _pages(bt_row, n0, end, BLOCK_SIZE, True)
        (k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
         x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7) = _tile_loads(
            k_ptr, v_ptr, page0, page1, head_off, n0, end, stride_cb, lane, g, t, BLOCK_SIZE, True, W, PV_MMA)
        m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7 = _tile_math(
            k0, k1, k2, k3, k4, k5, k6, k7, j0, j1, j2, j3, j4, j5, j6, j7, ksz, vsz,
            x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
            n0, end, lane, mask_lo, mask_hi, one, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
            qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, q_step, q_sum,
            m_i, l_p, pw_p, z_p, a0, a1, a2, a3, a4, a5, a6, a7, True, FAST, GROUP, PV_MMA,
        )
    _overlap_release(PDL)

    l_i = tl.sum(l_p, axis=1)  # (G,)
    pw_sum = tl.sum(pw_p, axis=1)
    z_sum = tl.sum(z_p, axis=1)
    ok = start < ctx  # a partition past the context stores nothing (the reduction never reads it)
    if SPLIT:
        idx = (bh.to(tl.int64) * GROUP) * num_partitions + part  # query head b * heads + kvh * GROUP + h is idx + h * parts
        for h in tl.static_range(GROUP):
            tl.store(part_m_ptr + idx + h * num_partitions, tl.max(tl.where(heads == h, m_i, float("-inf")), axis=0), mask=ok)
            tl.store(part_l_ptr + idx + h * num_partitions, tl.sum(tl.where(heads == h, l_i, 0.0), axis=0), mask=ok)
        ok = (lane * 0 + start) < ctx  # per lane, for the plane stores
        out_row = part_o_ptr + idx * HEAD_DIM
        head_stride = num_partitions * HEAD_DIM
        denom = tl.full((GROUP,), 1.0, tl.float32)
    else:
        out_row = out_ptr + b.to(tl.int64) * stride_ob + (kvh * GROUP) * stride_oh
        head_stride = stride_oh
        denom = tl.where(l_i > 0, l_i, 1.0)
    if PV_MMA:
        _store_pv_mma(out_row, head_stride, lane, a0, a1, a2, a3, pw_sum, z_sum, denom, ok, HALF, SPLIT, GROUP)
    else:
        _store_word_planes(out_row, head_stride, lane, lane % 16, a0, a1, a2, a3, a4, a5, a6, a7, pw_sum, z_sum,
                           denom, ok, HALF, FAST, SPLIT, GROUP)
