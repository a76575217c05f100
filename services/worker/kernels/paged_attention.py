"""Paged decode attention (one query token per sequence) over a KV4 or an fp16 paged cache.

Flash-decoding: the grid is (batch * kv_heads, partitions); a program attends its KV group's
query heads (loaded together, so each KV row is read once per group) to one partition of
`partition_size` tokens with an online softmax (fp32), walking the block table BLOCK_N tokens
at a time. With more than one partition per sequence, each program writes its partial
(max, sum, unnormalized output) and a reduction kernel combines them; with one partition the
program writes the final fp16 output itself.

Three KV4 kernels, chosen per group size (see default_config):
  * "fma": CUDA-core fp32 math on the page rows read as int32 words (a row is D/8 code words and
    one scale/zero word). Byte i of word w holds dims 4w + i (low nibble) and 4w + i + D/2 (high
    nibble): 8 "planes" per word. One shift puts a byte at bits 15..22 and one AND/OR per nibble
    turns it into the fp32 1 + c * 2^-k (the nibble lands in the top of 1.0's mantissa): no
    int-to-float conversion. The 2^k is folded into the query and the 1 is taken back out through
    sums: q.k = scale * (q.c) + zero * sum(q), and
    sum_n p_n (scale_n c_n + zero_n) = sum_n (p_n scale_n) c_n + sum_n p_n zero_n.
    With qk_int16 the scores are integer sums instead: the query rounded to int16 per head and
    split into high and low bytes meets each code word in four dp4a (4 byte products into int32):
    9 instructions per word where the fp32 planes take 20.
  * "mma" (paged_attention_mma.py): 1, 2, 4 or 8 query heads per KV head at head_dim 128: the
    scores on the int8 tensor cores (mma.sync, written lane by lane; a head per pair of the MMA's 8
    columns), the value sums as in "fma", each V code unpacked once for the group. The default
    for groups 1 and 2. Options: the value sums on the fp16 tensor cores (pv_mma), a group split
    over programs (heads_per_program), and the head-rows kernel (head_rows,
    paged_attention_head_rows.py: query heads as the score MMA's rows, value sums on the fp16
    tensor cores), the default for groups 4 and 8.
  * "dot": tensor cores (tl.dot) on nibble halves converted to fp16, query heads padded to 16
    (the default for groups of 5 to 8 the "mma" kernel does not take: head_dim 64, other page sizes,
    groups 5 to 7).
The fp16 cache has an "fma" kernel of the same structure (fp32 math on fp16 rows).

Layouts:
    query         (B, heads, D) fp16, already rotated; heads = kv_heads * group
    KV4 cache     (num_blocks, kv_heads, block_size, D/2 + 4) uint8 (shared/formats/kv4.py)
    fp16 cache    (num_blocks, kv_heads, block_size, D) fp16
    block_tables  (B, max_blocks) int32, physical block ids in sequence order
    context_lens  (B,) int32, tokens in the cache for each sequence (0 gives a zero output)
    output        (B, heads, D) fp16
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker.kernels.host_int import cdiv, next_power_of_2
from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release, launch_kwargs
from services.worker.kernels.paged_attention_head_rows import _kv4_decode_head_rows_kernel
from services.worker.kernels.paged_attention_mma import _kv4_decode_mma_kernel
from services.worker.kernels.paged_decode_parts import UNSPECIALIZED, _bytes_at_15, _nibble, _program_span, _scale_zero
from services.worker.kernels.prefill_attention import attention_output, check_index_vectors, check_one_device
from services.worker.kernels.w4a8_gemv import _dot_chn

LOG2E = 1.4426950408889634
# _nibble's operands, passed as kernel arguments rather than literals: a LOP3 takes one immediate,
# and with both as literals ptxas re-materializes one of them before every use (~20% more
# instructions in the inner loop); as arguments they stay in registers across the loop.
_NIBBLE_MASK = 0x78000  # bits 15..18; bits 19..22 is this << 4
_FP32_ONE_BITS = 0x3F800000


@dataclass(slots=True, frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels (tuned offline per GPU; see bench/attention.py)."""

    variant: str = "fma"  # "fma" (CUDA cores) or, KV4 only, "dot" (tensor cores) or "mma" (int8 MMA scores)
    block_n: int = 64  # tokens per inner-loop tile
    partition_size: int = 512  # tokens per program; a multiple of block_n
    num_warps: int = 4
    num_stages: int = 2
    prefetch: bool = True  # KV4 "fma": load tile i + 1 while computing tile i
    maxnreg: int | None = None  # register cap per thread (ptxas .maxnreg): occupancy against spills
    # KV4 "fma": scores as exact integer dot products of the K codes with the query rounded to
    # int16 (dp4a, 4 codes an instruction) instead of an fp32 FMA per code (see _qk_int16).
    qk_int16: bool = False
    # Take each sequence's whole context in one program (no partials, no reduction kernel) when
    # the batch alone gives every SM PROGRAMS_PER_SM programs; see partition_for.
    whole_context: bool = False
    # KV4 "fma" / "mma" with prefetch: block-table entries loaded a tile ahead of the words they
    # address, so tile i + 1's loads need not wait on a block-table load issued in iteration i.
    page_ahead: bool = False
    # "mma": query heads per program when fewer than the group's (a divisor of it), so several
    # programs read one KV head. Group 8 in one warp is bound by its instructions, not its bytes.
    heads_per_program: int | None = None
    # "mma": the value sums on the fp16 tensor cores (one m16n8k16 per 16 dims x 16 tokens for up to
    # 8 heads) instead of an FFMA per code and head on the CUDA cores.
    pv_mma: bool = False
    # "mma": the query heads as the score MMA's rows and the value sums on the fp16 tensor cores, no
    # shuffles between the two (paged_attention_head_rows.py; the default for groups 4 and 8, with prefetch under 128 registers).
    head_rows: bool = False
    # Let the partition grow from partition_size by doubling, up to this, while the grid keeps
    # PROGRAMS_PER_SM programs per SM: fewer partials to merge on long contexts, enough programs on
    # short ones (see partition_for).
    max_partition_size: int | None = None

    def __post_init__(self):
        if self.variant not in ("fma", "dot", "mma"):
            raise ValueError(f"variant {self.variant!r} is not one of 'fma', 'dot', 'mma'")
        if self.variant == "mma" and (self.block_n != 32 or self.num_warps != 1):
            raise ValueError(f"the 'mma' kernel runs one warp on 32-token tiles, not block_n {self.block_n} / "
                             f"num_warps {self.num_warps}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n {self.block_n} must be a power of two >= 16")
        if self.partition_size % self.block_n:
            raise ValueError(f"partition_size {self.partition_size} is not a multiple of block_n {self.block_n}")
        if self.page_ahead and not (self.variant in ("fma", "mma") and self.prefetch):
            raise ValueError("page_ahead is a mode of the KV4 'fma' and 'mma' kernels with prefetch")
        if self.heads_per_program is not None and (self.variant != "mma" or self.heads_per_program not in (1, 2, 4)):
            raise ValueError(f"heads_per_program is a mode of the 'mma' kernel (1, 2 or 4 heads), not {self.variant!r} "
                             f"with {self.heads_per_program}")
        if self.pv_mma and self.variant != "mma":
            raise ValueError(f"pv_mma is a mode of the 'mma' kernel, not of {self.variant!r}")
        if self.head_rows and (self.variant != "mma" or self.page_ahead or self.heads_per_program is not None):
            raise ValueError("head_rows is a mode of the 'mma' kernel without page_ahead or heads_per_program")
        if self.max_partition_size is not None and (self.max_partition_size < self.partition_size or self.whole_context):
            raise ValueError(f"max_partition_size {self.max_partition_size} must be >= partition_size "
                             f"{self.partition_size}, and not with whole_context")
        if self.qk_int16 and self.variant != "fma":
            raise ValueError(f"qk_int16 is a mode of the KV4 'fma' kernel, not of {self.variant!r}")


# Measured on the H200 (session 8, group 1, qk_int16): at batch 64 / context 1536 (2048 programs,
# 15.5 per SM) one partition per sequence took 128.0 us against 136.6 with partitions of 512; at
# batch 256 / context 1280, 398.0 against 409.7; at batch 8 / context 4096 (256 programs) the
# partitions of 512 are what keep the SMs busy. Contexts beyond WHOLE_CONTEXT_MAX keep splitting.
PROGRAMS_PER_SM = 8
WHOLE_CONTEXT_MAX = 4096


def partition_for(cfg: DecodeConfig, programs: int, max_context_len: int, sms: int | None) -> int:
    """Tokens per program: the whole (padded) context when cfg.whole_context and `programs`
    (sequences x KV heads) give every one of `sms` multiprocessors enough work; with
    cfg.max_partition_size, the largest doubling of cfg.partition_size that still gives them that
    work; else cfg.partition_size."""
    enough = PROGRAMS_PER_SM * sms if sms else None
    if cfg.whole_context and enough and programs >= enough and 0 < max_context_len <= WHOLE_CONTEXT_MAX:
        return max(cfg.partition_size, cdiv(max_context_len, cfg.block_n) * cfg.block_n)
    part = cfg.partition_size
    if cfg.max_partition_size and enough:
        while part * 2 <= cfg.max_partition_size and programs * cdiv(max_context_len, part * 2) >= enough:
            part *= 2
    return part


def programs_per_kv_head(cfg: DecodeConfig, group: int) -> int:
    """group / cfg.heads_per_program for the "mma" kernel (1 otherwise): the launch's programs per
    KV head, so the grid (and partition_for's `programs`) is sequences x KV heads x this."""
    heads_per_program = (cfg.heads_per_program or group) if cfg.variant == "mma" else group
    if group % heads_per_program:
        raise ValueError(f"heads_per_program {cfg.heads_per_program} does not divide the group of {group} query heads")
    return group // heads_per_program


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


# The launch the engine gets, per cache and group size (rounded up to a power of two, at most 8):
# the fastest configs measured by bench/attention.py on an H200 at head_dim 128
# (bench/results/h200/attention.json). Group 2 and 8 were not measured here: group 2 takes group
# 4's tile (the register budget of two query heads), group 8 the tensor-core kernel. Group 1 with
# integer scores (session 8): 160.4 -> 143.7 us at batch 64 / context 1536, 487.5 -> 437.2 us at
# batch 256 / context 1280 (bench/results/h200/attention_points.json). GQA 32/8 at batch 64 /
# context 1536 (512 programs): partitions of 256 took 107.6-107.9 us in three runs, 512 115-130
# (bench/results/h200/attention_points_gqa.json). Group 1 at head_dim 128 on pages of a multiple of
# 16 tokens takes the "mma" kernel (session 12, scores on the int8 tensor cores):
# MMA_DEFAULTS below, with the measurements; since session 17 so do groups 2 and 4, so the
# "fma" entries below serve head_dim 64, other page sizes and group 3 (rounded up to 4).
_DEFAULTS = {
    ("kv4", 1): DecodeConfig("fma", block_n=32, partition_size=512, num_warps=1, num_stages=1, prefetch=True, maxnreg=128,
                             qk_int16=True, whole_context=True),
    ("kv4", 2): DecodeConfig("fma", block_n=16, partition_size=256, num_warps=1, num_stages=1, prefetch=True, qk_int16=True,
                             whole_context=True),
    ("kv4", 4): DecodeConfig("fma", block_n=16, partition_size=256, num_warps=1, num_stages=1, prefetch=True, qk_int16=True,
                             whole_context=True),
    ("kv4", 8): DecodeConfig("dot", block_n=64, partition_size=512, num_warps=2, num_stages=1),
    ("fp16", 1): DecodeConfig("fma", block_n=32, partition_size=512, num_warps=1, num_stages=1),
}


# Session 12, one H200 run against the "fma" entry above: 134.6 -> 126.3 us at batch 64 / context
# 1536 and 417.0 -> 374.9 us at batch 256 / context 1280 (bench/results/h200/attention_points_mma.json);
# 123.3 us, 2.96x SDPA. page_ahead (session 16, two runs at batch 64 / context 1536):
# 123.65 -> 120.64 and 123.1 -> 121.34 us (bench/results/h200/attention_page_ahead.json); batch 256 /
# context 1280: 363.5 -> 354.6 us (attention_points_page_ahead.json).
# Groups of 2 and 4 on the same kernel (session 17: one MMA column pair per query head; H200,
# bench/results/h200/attention_gqa_mma*.json, `bench/attention.py --points ... --gqa-mma --sdpa`).
# Group 2 (32/16, batch 64, context 1536): 85.1 us against the "fma" entry's 142.9 and SDPA's 193.1.
# Group 4 (32/8): 4 heads' value sums take 255 registers with prefetch, and what paid depended on
# the point (prefetch capped at 168: 65.7 us at batch 64 / context 1536 but 223.2 at context 4096),
# so without prefetch, the steadiest: 67.9 us (context 1536), 160.4 (4096), 191.8 (batch 256 /
# context 1280) against the "fma" entry's 119.6, 254.1, 286.7 and SDPA's 106.3, 250.4, 309.9.
# Session 18: one V word per lane (8 sums per head) left group 4 at 168 registers with prefetch and
# took it to 65.1 us at context 1536, 144.2 at 4096 (graph-timed, bench/results/h200/attention_v_word_ab.json).
# Group 8 (Llama-2/3-70B's 64/8; session 19, 32/4 at batch 64, 4-call graph timing,
# bench/results/h200/attention_group8*.json): the whole group in one warp (a second set of MMAs for
# heads 4..7, 255 registers) took 76-77 us at context 1536 against the "dot" entry's 171.6, but one
# warp of 8 heads is bound by its instructions; two programs of 4 heads per KV head
# (heads_per_program=4, group 4's tile) took 55.3-57.0 us and 131-138 us at context 4096, against
# 77.3 and 153.0 whole-group in the same run. That is about SDPA fp16's 53.7 and 127.0 (cuDNN reads
# 8x fewer cache bytes here than at MHA, so KV4 wins capacity, not time, at group 8).
# Session 20: the head-rows kernel (query heads as the score MMA's rows, value sums on the fp16
# tensor cores) for groups 4 and 8, one run, 4-call graph timing, batch x context (us; SDPA fp16 beside;
# bench/results/h200/attention_head_rows_defaults.json, `--check-defaults`):
#   group 8: 64 x 1536: 31.7 (was 57.4; SDPA 52.8), 64 x 4096: 56.8 at p512 (135.3; 124.6),
#            256 x 1280: 78.6 at p512 (166.8; 157.1); partitions of 1024 lost at every point;
#   group 4: 64 x 1536: 47.5 (was 60.2; SDPA 97.3), 64 x 4096: 98.3 (138.1; 240.6),
#            256 x 1280: 124.8 (174.5; 301.0).
# Which partition paid followed the grid (max_partition_size): the largest doubling of 256 that
# still leaves PROGRAMS_PER_SM programs per SM. pv_mma on the 'mma' kernel (prefetch, 168 registers)
# took group 4 to 44.9 at 64 x 1536 but 112.6 / 144.3 at the other two points; at group 1 it
# measured 116.5 us against the default's 115.7 (memory-bound already: attention_pv_mma_mha.json).
# Session 21: head_rows with prefetch (tile i + 1's pages and words loaded before tile i's math),
# one run against the defaults above without it (bench/results/h200/attention_head_rows_prefetch.json):
# capped at 128 registers, group 4: 64 x 1536 43.4 us (was 50.1), 64 x 4096 92.3 (101.7),
# 256 x 1280 124.5 (138.7); group 8: 64 x 1536 29.8 (31.2), 64 x 4096 57.4 (57.1). Uncapped (168)
# prefetch lost at long contexts (group 4, 64 x 4096: 125.3; group 8: 68.5), hence the cap.
MMA_DEFAULTS = {  # group -> the "mma" kernel's launch
    1: DecodeConfig("mma", block_n=32, partition_size=512, num_warps=1, num_stages=1, prefetch=True, maxnreg=128,
                    whole_context=True, page_ahead=True),
    2: DecodeConfig("mma", block_n=32, partition_size=512, num_warps=1, num_stages=1, prefetch=True, maxnreg=128,
                    page_ahead=True),
    4: DecodeConfig("mma", block_n=32, partition_size=256, num_warps=1, num_stages=1, prefetch=True, maxnreg=128,
                    head_rows=True, max_partition_size=1024),
    8: DecodeConfig("mma", block_n=32, partition_size=256, num_warps=1, num_stages=1, prefetch=True, maxnreg=128,
                    head_rows=True, max_partition_size=512),
}
MMA_GROUPS = (1, 2, 4, 8)  # query heads per KV head the "mma" kernel takes (a config may ask for it)


def _mma_covers(group: int, head_dim: int, block_size: int) -> bool:
    """The shapes the "mma" kernel is written for (paged_attention_mma.py)."""
    return group in MMA_GROUPS and head_dim == 128 and block_size % 16 == 0


def default_config(kv4: bool, group: int, head_dim: int, block_size: int = 16) -> DecodeConfig:
    """The tuned launch for this cache, group size and page size (head_dim 64 uses the head_dim 128
    entries of the "fma" kernel)."""
    if not kv4:
        return _DEFAULTS[("fp16", 1)]
    if group in MMA_DEFAULTS and _mma_covers(group, head_dim, block_size):
        return MMA_DEFAULTS[group]
    return _DEFAULTS[("kv4", min(next_power_of_2(group), 8))]


# ---------------------------------------------------------------------------------------------
# shared pieces


@triton.jit
def _online_softmax(s, m_i, l_i):
    """s (G, N) fp32 scores in log2 units (masked = -inf) -> p, alpha, new max, new sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


# ---------------------------------------------------------------------------------------------
# KV4, CUDA cores


@triton.jit
def _plane_dims(offs_w, S: tl.constexpr, HALF: tl.constexpr):
    """Head dims of nibble plane S = 2 * byte + HI of words offs_w: byte j of a row is dims j, j + D/2."""
    return 4 * offs_w + (S // 2) + (S % 2) * HALF


@triton.jit
def _load_q_plane(q_rows, mask_g, offs_w, qk_scale, S: tl.constexpr, HALF: tl.constexpr):
    """Query dims of plane S times qk_scale * 2^(8 - 4 (S % 2)), undoing _nibble's scaling: (G, W) fp32."""
    q = tl.load(q_rows[:, None] + _plane_dims(offs_w, S, HALF)[None, :], mask=mask_g[:, None], other=0.0)
    return q.to(tl.float32) * (qk_scale * (1 << (8 - 4 * (S % 2))))


@triton.jit
def _pv_plane(acc, alpha, pw, f):
    """acc (G, W) * alpha + sum over tokens of pw (G, N) x f (1, N, W)."""
    return acc * alpha[:, None] + tl.sum(pw[:, :, None] * f, axis=1)


@triton.jit
def _split_int16(x):
    """fp32 x (|x| <= 32512) rounded to q16 and split into int8 parts: q16 = 256 * hi + lo."""
    q16 = tl.floor(x + 0.5).to(tl.int32)
    hi = (q16 + 128) >> 8  # arithmetic shift: hi in [-127, 127] and lo in [-128, 127]
    return hi, q16 - hi * 256


@triton.jit
def _q_int16_step(q_full, qk_scale):
    """(G,) int16 step of the query times qk_scale: its largest element over 32512 steps, which keeps
    the high byte in [-127, 127]; the rounding (2^-16 of the largest element) is far below the fp16
    query's own precision."""
    qmax = tl.max(tl.abs(q_full), axis=1) * qk_scale
    return tl.where(qmax > 0, qmax / 32512.0, 1.0)


@triton.jit
def _load_q_int16(q_rows, mask_g, offs_w, inv, BLOCK_G: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr):
    """The query times inv (G,) (qk_scale over the int16 step) rounded to int16, in the cache's word order.

    Returns four (G, W) int32 words of int8 bytes, byte b of word w for dim 4w + b (the dims of
    the low nibbles) or 4w + b + D/2 (high nibbles): the high bytes of q16 for the low-nibble dims,
    for the high-nibble dims, then the low bytes likewise.
    """
    hi_of_lo = tl.zeros((BLOCK_G, W), tl.int32)
    hi_of_hi = tl.zeros((BLOCK_G, W), tl.int32)
    lo_of_lo = tl.zeros((BLOCK_G, W), tl.int32)
    lo_of_hi = tl.zeros((BLOCK_G, W), tl.int32)
    for b in tl.static_range(4):
        ptrs = q_rows[:, None] + (4 * offs_w + b)[None, :]
        q_lo = tl.load(ptrs, mask=mask_g[:, None], other=0.0).to(tl.float32) * inv[:, None]
        q_hi = tl.load(ptrs + HALF, mask=mask_g[:, None], other=0.0).to(tl.float32) * inv[:, None]
        h, l = _split_int16(q_lo)
        hi_of_lo |= (h & 0xFF) << (8 * b)
        lo_of_lo |= (l & 0xFF) << (8 * b)
        h, l = _split_int16(q_hi)
        hi_of_hi |= (h & 0xFF) << (8 * b)
        lo_of_hi |= (l & 0xFF) << (8 * b)
    return hi_of_lo, hi_of_hi, lo_of_lo, lo_of_hi


@triton.jit
def _qk_int16(kw, q_hi_lo, q_hi_hi, q_lo_lo, q_lo_hi, FAST: tl.constexpr):
    """sum over the 8 codes of each K word of code * q16 (exact int32): 256 * (codes . high bytes)
    + (codes . low bytes), each dot two dp4a (low nibbles, high nibbles). All args one shape."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 l, h, x, y;
            and.b32 l, $1, 0x0F0F0F0F;
            shr.u32 h, $1, 4;
            and.b32 h, h, 0x0F0F0F0F;
            dp4a.u32.s32 x, l, $2, 0;
            dp4a.u32.s32 x, h, $3, x;
            dp4a.u32.s32 y, l, $4, 0;
            dp4a.u32.s32 y, h, $5, y;
            shl.b32 x, x, 8;
            add.s32 $0, x, y;
            }""",
            constraints="=r,r,r,r,r,r", args=[kw, q_hi_lo, q_hi_hi, q_lo_lo, q_lo_hi], dtype=tl.int32,
            is_pure=True, pack=1,
        )
    zero = tl.zeros(kw.shape, tl.int32)
    return _dot_chn(kw, q_hi_lo, q_hi_hi, zero, False) * 256 + _dot_chn(kw, q_lo_lo, q_lo_hi, zero, False)


@triton.jit
def _qk_int16_tile(kw, q_hi_lo, q_hi_hi, q_lo_lo, q_lo_hi, FAST: tl.constexpr):
    """_qk_int16 of K words kw (1, N, W') with the query words (G, W') of the same row part: (G, N, W')."""
    k, a = tl.broadcast(kw, q_hi_lo[:, None, :])
    b = tl.broadcast(k, q_hi_hi[:, None, :])[1]
    c = tl.broadcast(k, q_lo_lo[:, None, :])[1]
    d = tl.broadcast(k, q_lo_hi[:, None, :])[1]
    return _qk_int16(k, a, b, c, d, FAST)


@triton.jit
def _tile_page_slots(n0, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block-table index and slot in its page (1, N) of each token of [n0, n0 + BLOCK_N).

    n0 is a multiple of BLOCK_N (partitions are multiples of it). Both come from the token's place
    in the tile (loop-invariant, known non-negative: no signed division in the loop); a tile inside
    one page reads its block-table entry once.
    """
    local = tl.arange(0, BLOCK_N)[None, :]  # (1, N)
    if BLOCK_N % BLOCK_SIZE == 0:
        return n0 // BLOCK_SIZE + local // BLOCK_SIZE, local % BLOCK_SIZE
    elif BLOCK_SIZE % BLOCK_N == 0:
        return n0 // BLOCK_SIZE + local * 0, n0 % BLOCK_SIZE + local
    else:
        return (n0 + local) // BLOCK_SIZE, (n0 + local) % BLOCK_SIZE


@triton.jit
def _kv4_tile_pages(bt_row, n0, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Physical page (1, N) of each token of [n0, n0 + BLOCK_N) (page 0 past the context when MASKED)."""
    page_of, _ = _tile_page_slots(n0, BLOCK_SIZE, BLOCK_N)
    if MASKED:
        return tl.load(bt_row + page_of, mask=n0 + tl.arange(0, BLOCK_N)[None, :] < end, other=0)
    return tl.load(bt_row + page_of)


@triton.jit
def _kv4_load_tile(
    k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, offs_w,
    W: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    K_HALVES: tl.constexpr,
):
    """Raw KV4 words of tokens [n0, n0 + BLOCK_N): _kv4_load_words on the tile's own pages."""
    page = _kv4_tile_pages(bt_row, n0, end, BLOCK_SIZE, BLOCK_N, MASKED)
    return _kv4_load_words(k_ptr, v_ptr, page, head_off, n0, end, stride_cb, offs_w, W, BLOCK_SIZE, BLOCK_N,
                           MASKED, K_HALVES)


@triton.jit
def _kv4_load_words(
    k_ptr, v_ptr, page, head_off, n0, end, stride_cb, offs_w,
    W: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    K_HALVES: tl.constexpr,
):
    """Raw KV4 words of tokens [n0, n0 + BLOCK_N) on pages `page` (1, N) (_kv4_tile_pages): K codes,
    K scale/zero (1, N), V codes, V scale/zero.

    Tiles are 3D (group, tokens, words) from the load on, with the group axis of size 1 here: the
    layout stays the load's and the G query heads reuse each word in registers. The K codes are
    (1, N, W) int32, or with K_HALVES two (1, N, W/2) tiles (words below W/2, then the rest;
    otherwise the second is the first again): a half row spreads over 8 lanes instead of 16, so a
    score's sum over the row's words takes 3 rounds of shuffles instead of 4 on half the tokens.
    """
    mask_n = n0 + tl.arange(0, BLOCK_N)[None, :] < end  # (1, N)
    _, slot = _tile_page_slots(n0, BLOCK_SIZE, BLOCK_N)
    # int64 offsets, with the row stride (rows are W + 1 words: _check) a compile-time constant:
    # each thread's words then sit at constant distances from one address, which the loads take as
    # immediate offsets instead of a 64-bit address computed per word.
    rows = (page * stride_cb + head_off).to(tl.int64) + (slot * (W + 1)).to(tl.int64)  # (1, N) word offsets
    if K_HALVES:
        k_ptrs = k_ptr + (rows[:, :, None] + tl.arange(0, W // 2).to(tl.int64)[None, None, :])
    else:
        k_ptrs = k_ptr + (rows[:, :, None] + offs_w.to(tl.int64)[None, None, :])
    v_ptrs = v_ptr + (rows[:, :, None] + offs_w.to(tl.int64)[None, None, :])
    if MASKED:
        kw = tl.load(k_ptrs, mask=mask_n[:, :, None], other=0)
        if K_HALVES:
            kw2 = tl.load(k_ptrs + W // 2, mask=mask_n[:, :, None], other=0)
        ksz = tl.load(k_ptr + (rows + W), mask=mask_n, other=0)
        vw = tl.load(v_ptrs, mask=mask_n[:, :, None], other=0)
        vsz = tl.load(v_ptr + (rows + W), mask=mask_n, other=0)
    else:
        kw = tl.load(k_ptrs)
        if K_HALVES:
            kw2 = tl.load(k_ptrs + W // 2)
        ksz = tl.load(k_ptr + (rows + W))
        vw = tl.load(v_ptrs)
        vsz = tl.load(v_ptr + (rows + W))
    if not K_HALVES:
        kw2 = kw
    return kw, kw2, ksz, vw, vsz


@triton.jit
def _kv4_fma_tile(
    kw, kw2, ksz, vw, vsz, n0, end, mask_lo, mask_hi, one,
    q0, q1, q2, q3, q4, q5, q6, q7, q_bias, q_sum,
    m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, QK_INT: tl.constexpr, FAST: tl.constexpr,
):
    """Online-softmax update with one tile of raw KV4 words; MASKED only for a partial last tile.

    q0..q7, q_bias: the query's fp32 planes and what their 1.0s add (_load_q_plane); with QK_INT
    instead the int16 query's words (_load_q_int16) for the first half of each row (q0..q3, with
    K codes kw) and the second (q4..q7, kw2), and q_bias its step.
    """
    k_scale, k_zero = _scale_zero(ksz)  # (1, N)
    v_scale, v_zero = _scale_zero(vsz)
    if QK_INT:
        dots = _qk_int16_tile(kw, q0, q1, q2, q3, FAST) + _qk_int16_tile(kw2, q4, q5, q6, q7, FAST)  # (G, N, W / 2)
        qk = tl.sum(dots, axis=2).to(tl.float32) * q_bias[:, None]
    else:
        # Each byte in turn at bits 15..22; its two nibbles become planes 2 * byte and 2 * byte + 1.
        x0, x1, x2, x3 = _bytes_at_15(kw)
        t = _nibble(x0, mask_lo, one) * q0[:, None, :]  # (G, N, W)
        t += _nibble(x0, mask_hi, one) * q1[:, None, :]
        t += _nibble(x1, mask_lo, one) * q2[:, None, :]
        t += _nibble(x1, mask_hi, one) * q3[:, None, :]
        t += _nibble(x2, mask_lo, one) * q4[:, None, :]
        t += _nibble(x2, mask_hi, one) * q5[:, None, :]
        t += _nibble(x3, mask_lo, one) * q6[:, None, :]
        t += _nibble(x3, mask_hi, one) * q7[:, None, :]
        qk = tl.sum(t, axis=2) - q_bias[:, None]
    s = qk * k_scale + q_sum[:, None] * k_zero  # (G, N), log2 units
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)[None, :]
        s = tl.where(offs_n < end, s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)

    pw = p * v_scale  # (G, N)
    pw_sum = pw_sum * alpha + tl.sum(pw, axis=1)
    acc_z = acc_z * alpha + tl.sum(p * v_zero, axis=1)
    y0, y1, y2, y3 = _bytes_at_15(vw)
    acc0 = _pv_plane(acc0, alpha, pw, _nibble(y0, mask_lo, one))
    acc1 = _pv_plane(acc1, alpha, pw, _nibble(y0, mask_hi, one))
    acc2 = _pv_plane(acc2, alpha, pw, _nibble(y1, mask_lo, one))
    acc3 = _pv_plane(acc3, alpha, pw, _nibble(y1, mask_hi, one))
    acc4 = _pv_plane(acc4, alpha, pw, _nibble(y2, mask_lo, one))
    acc5 = _pv_plane(acc5, alpha, pw, _nibble(y2, mask_hi, one))
    acc6 = _pv_plane(acc6, alpha, pw, _nibble(y3, mask_lo, one))
    acc7 = _pv_plane(acc7, alpha, pw, _nibble(y3, mask_hi, one))
    return m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _kv4_decode_fma_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    # sizes
    qk_scale, num_kv_heads, num_partitions, partition_size, nibble_mask, nibble_one,
    # strides (q/out in elements, caches in int32 words; rows are W + 1 words apart: _check)
    stride_qb, stride_qh, stride_cb, stride_ch, stride_bt, stride_ob, stride_oh,
    # meta
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, QK_INT: tl.constexpr, FAST: tl.constexpr,
    PAGE_AHEAD: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    W: tl.constexpr = HEAD_DIM // 8  # int32 code words per row; word W holds scale and zero
    HALF: tl.constexpr = HEAD_DIM // 2
    bh, part, b, kvh, ctx, start, end, full_end = _program_span(context_lens_ptr, num_kv_heads, partition_size, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_w = tl.arange(0, W)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads * stride_qh  # (G,) pointers
    offs_d = tl.arange(0, HEAD_DIM)
    q_full = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask_g[:, None], other=0.0).to(tl.float32)
    q_sum = tl.sum(q_full, axis=1) * qk_scale  # (G,)
    if QK_INT:
        q_bias = _q_int16_step(q_full, qk_scale)  # (G,): what the integer scores are multiplied by
        inv = qk_scale / q_bias
        offs_half = tl.arange(0, W // 2)
        q0, q1, q2, q3 = _load_q_int16(q_rows, mask_g, offs_half, inv, BLOCK_G, W // 2, HALF)
        q4, q5, q6, q7 = _load_q_int16(q_rows, mask_g, offs_half + W // 2, inv, BLOCK_G, W // 2, HALF)
    else:
        q0 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 0, HALF)
        q1 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 1, HALF)
        q2 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 2, HALF)
        q3 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 3, HALF)
        q4 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 4, HALF)
        q5 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 5, HALF)
        q6 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 6, HALF)
        q7 = _load_q_plane(q_rows, mask_g, offs_w, qk_scale, 7, HALF)
        q_bias = tl.sum(q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7, axis=1)  # (G,): what the 1.0s of _nibble add

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    pw_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc_z = tl.zeros((BLOCK_G,), tl.float32)
    acc0 = tl.zeros((BLOCK_G, W), tl.float32)
    acc1 = tl.zeros((BLOCK_G, W), tl.float32)
    acc2 = tl.zeros((BLOCK_G, W), tl.float32)
    acc3 = tl.zeros((BLOCK_G, W), tl.float32)
    acc4 = tl.zeros((BLOCK_G, W), tl.float32)
    acc5 = tl.zeros((BLOCK_G, W), tl.float32)
    acc6 = tl.zeros((BLOCK_G, W), tl.float32)
    acc7 = tl.zeros((BLOCK_G, W), tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch
    mask_lo = nibble_mask
    mask_hi = nibble_mask << 4
    one = nibble_one
    if PREFETCH:
        # Software pipelining by one tile: the loads of tile i + 1 are in flight during tile i's
        # math. The prologue's load is masked (there may be no full tile); the last iteration
        # reloads the last full tile (a cache hit) instead of branching.
        kw, kw2, ksz, vw, vsz = _kv4_load_tile(
            k_ptr, v_ptr, bt_row, head_off, start, full_end, stride_cb, offs_w, W, BLOCK_SIZE, BLOCK_N, True, QK_INT
        )
        last_full = tl.maximum(full_end - BLOCK_N, start)
        if PAGE_AHEAD:
            # Block-table entries a tile ahead of the words (as the "mma" kernel's page_ahead).
            ahead = _kv4_tile_pages(bt_row, tl.minimum(start + BLOCK_N, last_full), end, BLOCK_SIZE, BLOCK_N, True)
        for n0 in range(start, full_end, BLOCK_N):
            nxt = tl.minimum(n0 + BLOCK_N, last_full)
            if PAGE_AHEAD:
                kw_n, kw2_n, ksz_n, vw_n, vsz_n = _kv4_load_words(
                    k_ptr, v_ptr, ahead, head_off, nxt, end, stride_cb, offs_w, W, BLOCK_SIZE, BLOCK_N, False, QK_INT
                )
                ahead = _kv4_tile_pages(bt_row, tl.minimum(n0 + 2 * BLOCK_N, last_full), end, BLOCK_SIZE, BLOCK_N, False)
            else:
                kw_n, kw2_n, ksz_n, vw_n, vsz_n = _kv4_load_tile(
                    k_ptr, v_ptr, bt_row, head_off, nxt, end, stride_cb, offs_w, W, BLOCK_SIZE, BLOCK_N, False, QK_INT
                )
            m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _kv4_fma_tile(
                kw, kw2, ksz, vw, vsz, n0, end, mask_lo, mask_hi, one, q0, q1, q2, q3, q4, q5, q6, q7, q_bias, q_sum,
                m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BLOCK_N, False, QK_INT, FAST,
            )
            kw, kw2, ksz, vw, vsz = kw_n, kw2_n, ksz_n, vw_n, vsz_n
    else:
        for n0 in range(start, full_end, BLOCK_N):
            kw, kw2, ksz, vw, vsz = _kv4_load_tile(
                k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, offs_w, W, BLOCK_SIZE, BLOCK_N, False, QK_INT
            )
            m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _kv4_fma_tile(
                kw, kw2, ksz, vw, vsz, n0, end, mask_lo, mask_hi, one, q0, q1, q2, q3, q4, q5, q6, q7, q_bias, q_sum,
                m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BLOCK_N, False, QK_INT, FAST,
            )
    for n0 in range(full_end, end, BLOCK_N):  # at most one partial tile
        kw, kw2, ksz, vw, vsz = _kv4_load_tile(
            k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, offs_w, W, BLOCK_SIZE, BLOCK_N, True, QK_INT
        )
        m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _kv4_fma_tile(
            kw, kw2, ksz, vw, vsz, n0, end, mask_lo, mask_hi, one, q0, q1, q2, q3, q4, q5, q6, q7, q_bias, q_sum,
            m_i, l_i, pw_sum, acc_z, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BLOCK_N, True, QK_INT, FAST,
        )
    _overlap_release(PDL)

    out_rows, denom, valid = _epilogue_rows(
        b, bh, offs_g, heads, mask_g, part, start, ctx, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        num_partitions, stride_ob, stride_oh, GROUP, HEAD_DIM, SPLIT,
    )
    _store_plane(out_rows, acc0, pw_sum, acc_z, denom, valid, offs_w, 0, HALF, SPLIT)
    _store_plane(out_rows, acc1, pw_sum, acc_z, denom, valid, offs_w, 1, HALF, SPLIT)
    _store_plane(out_rows, acc2, pw_sum, acc_z, denom, valid, offs_w, 2, HALF, SPLIT)
    _store_plane(out_rows, acc3, pw_sum, acc_z, denom, valid, offs_w, 3, HALF, SPLIT)
    _store_plane(out_rows, acc4, pw_sum, acc_z, denom, valid, offs_w, 4, HALF, SPLIT)
    _store_plane(out_rows, acc5, pw_sum, acc_z, denom, valid, offs_w, 5, HALF, SPLIT)
    _store_plane(out_rows, acc6, pw_sum, acc_z, denom, valid, offs_w, 6, HALF, SPLIT)
    _store_plane(out_rows, acc7, pw_sum, acc_z, denom, valid, offs_w, 7, HALF, SPLIT)


@triton.jit
def _epilogue_rows(
    b, bh, offs_g, heads, mask_g, part, start, ctx, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    num_partitions, stride_ob, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):
    """Where this program's output rows go, what to divide them by, and which rows to store.

    SPLIT: rows of the fp32 partial buffer (B * heads * partitions, D), stats stored here,
    no division; a partition past the context stores nothing (the reduction never reads it).
    Otherwise: rows of the fp16 output, divided by the softmax sum; every head's row is stored,
    so an empty context (a graph's padding row) gets zeros rather than stale memory.
    """
    if SPLIT:
        idx = (bh.to(tl.int64) * GROUP + offs_g) * num_partitions + part  # (G,)
        valid = mask_g & (offs_g * 0 + start < ctx)
        tl.store(part_m_ptr + idx, m_i, mask=valid)
        tl.store(part_l_ptr + idx, l_i, mask=valid)
        return part_o_ptr + idx * HEAD_DIM, tl.full(l_i.shape, 1.0, tl.float32), valid
    else:
        denom = tl.where(l_i > 0, l_i, 1.0)
        return out_ptr + b.to(tl.int64) * stride_ob + heads * stride_oh, denom, mask_g


@triton.jit
def _store_plane(
    out_rows, acc, pw_sum, acc_z, denom, valid, offs_w, S: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr
):
    """Plane S of the value sum: sum p scale c = (acc - sum pw) * 2^(8 - 4 (S % 2)), plus sum p zero."""
    vals = ((acc - pw_sum[:, None]) * (1 << (8 - 4 * (S % 2))) + acc_z[:, None]) / denom[:, None]
    ptrs = out_rows[:, None] + _plane_dims(offs_w, S, HALF)[None, :]
    if SPLIT:
        tl.store(ptrs, vals, mask=valid[:, None])
    else:
        tl.store(ptrs, vals.to(tl.float16), mask=valid[:, None])


# ---------------------------------------------------------------------------------------------
# fp16, CUDA cores


@triton.jit
def _fp16_fma_tile(
    k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, stride_cs, offs_d, q, m_i, l_i, acc,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    if MASKED:
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
    else:
        page = tl.load(bt_row + offs_n // BLOCK_SIZE)
    rows = page.to(tl.int64) * stride_cb + head_off + (offs_n % BLOCK_SIZE) * stride_cs  # (N,)
    k_ptrs = k_ptr + rows[:, None] + offs_d[None, :]
    v_ptrs = v_ptr + rows[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)  # (N, D) fp16
    else:
        k = tl.load(k_ptrs)
    s = tl.sum(k.to(tl.float32)[None, :, :] * q[:, None, :], axis=2)  # (G, N)
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    if MASKED:
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _fp16_decode_fma_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    # sizes
    qk_scale, num_kv_heads, num_partitions, partition_size,
    # strides (elements)
    stride_qb, stride_qh, stride_cb, stride_ch, stride_cs, stride_bt, stride_ob, stride_oh,
    # meta
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    bh, part, b, kvh, ctx, start, end, full_end = _program_span(context_lens_ptr, num_kv_heads, partition_size, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads * stride_qh
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=mask_g[:, None], other=0.0).to(tl.float32) * qk_scale

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _fp16_fma_tile(
            k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, stride_cs, offs_d, q, m_i, l_i, acc,
            BLOCK_SIZE, BLOCK_N, False,
        )
    for n0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _fp16_fma_tile(
            k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, stride_cs, offs_d, q, m_i, l_i, acc,
            BLOCK_SIZE, BLOCK_N, True,
        )
    _overlap_release(PDL)

    out_rows, denom, valid = _epilogue_rows(
        b, bh, offs_g, heads, mask_g, part, start, ctx, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        num_partitions, stride_ob, stride_oh, GROUP, HEAD_DIM, SPLIT,
    )
    valid = valid[:, None]
    vals = acc / denom[:, None]
    ptrs = out_rows[:, None] + offs_d[None, :]
    if SPLIT:
        tl.store(ptrs, vals, mask=valid)
    else:
        tl.store(ptrs, vals.to(tl.float16), mask=valid)


# ---------------------------------------------------------------------------------------------
# KV4, tensor cores


@triton.jit
def _nibbles_f16(x):
    """uint8 nibble values [0, 15] -> fp16 without an int-to-float conversion (0x6400 is 1024.0)."""
    return ((x.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0).to(tl.float16)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _kv4_decode_dot_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, k_words_ptr, v_words_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    # sizes
    qk_scale, num_kv_heads, num_partitions, partition_size,
    # strides (q/out in elements; caches in bytes)
    stride_qb, stride_qh, stride_cb, stride_ch, stride_cs, stride_bt, stride_ob, stride_oh,
    # meta
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    bh, part, b, kvh, ctx, start, end, _ = _program_span(context_lens_ptr, num_kv_heads, partition_size, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_h = tl.arange(0, HALF)
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_h[None, :]
    q_lo = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)  # (G, HALF) fp16
    q_hi = tl.load(q_ptrs + HALF, mask=mask_g[:, None], other=0.0)
    q_sum = tl.sum(q_lo.to(tl.float32), axis=1) + tl.sum(q_hi.to(tl.float32), axis=1)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc_z = tl.zeros((BLOCK_G,), tl.float32)
    acc_lo = tl.zeros((BLOCK_G, HALF), tl.float32)
    acc_hi = tl.zeros((BLOCK_G, HALF), tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        rows = page.to(tl.int64) * stride_cb + head_off + (offs_n % BLOCK_SIZE) * stride_cs  # (N,) bytes

        kb = tl.load(k_ptr + rows[:, None] + offs_h[None, :], mask=mask_n[:, None], other=0)  # (N, HALF) u8
        k_scale, k_zero = _scale_zero(tl.load(k_words_ptr + rows // 4 + HALF // 4, mask=mask_n, other=0))
        qk = tl.dot(q_lo, tl.trans(_nibbles_f16(kb & 0xF))) + tl.dot(q_hi, tl.trans(_nibbles_f16(kb >> 4)))
        s = (qk * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]) * qk_scale  # (G, N)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)

        vb = tl.load(v_ptr + rows[:, None] + offs_h[None, :], mask=mask_n[:, None], other=0)
        v_scale, v_zero = _scale_zero(tl.load(v_words_ptr + rows // 4 + HALF // 4, mask=mask_n, other=0))
        pw = (p * v_scale[None, :]).to(tl.float16)
        acc_z = acc_z * alpha + tl.sum(p * v_zero[None, :], axis=1)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(pw, _nibbles_f16(vb & 0xF))
        acc_hi = acc_hi * alpha[:, None] + tl.dot(pw, _nibbles_f16(vb >> 4))
    _overlap_release(PDL)

    out_rows, denom, valid = _epilogue_rows(
        b, bh, offs_g, heads, mask_g, part, start, ctx, m_i, l_i, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        num_partitions, stride_ob, stride_oh, GROUP, HEAD_DIM, SPLIT,
    )
    valid = valid[:, None]
    lo = (acc_lo + acc_z[:, None]) / denom[:, None]
    hi = (acc_hi + acc_z[:, None]) / denom[:, None]
    ptrs = out_rows[:, None] + offs_h[None, :]
    if SPLIT:
        tl.store(ptrs, lo, mask=valid)
        tl.store(ptrs + HALF, hi, mask=valid)
    else:
        tl.store(ptrs, lo.to(tl.float16), mask=valid)
        tl.store(ptrs + HALF, hi.to(tl.float16), mask=valid)


# ---------------------------------------------------------------------------------------------
# reduction over partitions


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _reduce_partitions_kernel(
    part_m_ptr, part_l_ptr, part_o_ptr, context_lens_ptr, out_ptr,
    num_heads, num_partitions, partition_size, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    n_parts = tl.cdiv(ctx, partition_size)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (b.to(tl.int64) * num_heads + h) * num_partitions
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.full([], 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for p in range(0, n_parts):
        m_p = tl.load(part_m_ptr + base + p)
        l_p = tl.load(part_l_ptr + base + p)
        o_p = tl.load(part_o_ptr + (base + p) * HEAD_DIM + offs_d)
        m_new = tl.maximum(m_run, m_p)
        a = tl.exp2(m_run - m_new)
        c = tl.exp2(m_p - m_new)
        acc = acc * a + o_p * c
        l_run = l_run * a + l_p * c
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(tl.float16))


# ---------------------------------------------------------------------------------------------
# launcher


def _check(query, k_cache, v_cache, block_tables, context_lens) -> tuple[bool, int, int]:
    if query.dim() != 3 or query.dtype != torch.float16 or query.stride(-1) != 1:
        raise ValueError(f"query must be (B, heads, D) fp16 with contiguous D, got {tuple(query.shape)} {query.dtype}")
    b, heads, d = query.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not supported: a power of two >= 16 (64 and 128 are tuned)")
    kv4 = k_cache.dtype == torch.uint8
    row = d // 2 + 4 if kv4 else d
    if k_cache.dtype not in (torch.uint8, torch.float16) or k_cache.dim() != 4 or k_cache.shape[3] != row:
        raise ValueError(
            f"k_cache must be (num_blocks, kv_heads, block_size, {d // 2 + 4}) uint8 (KV4) or "
            f"(num_blocks, kv_heads, block_size, {d}) fp16, got {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache {tuple(k_cache.shape)}")
    if k_cache.stride(3) != 1 or k_cache.stride(2) != row:
        raise ValueError(f"cache rows must be contiguous, got strides {k_cache.stride()}")
    if kv4 and any(s % 4 for s in k_cache.stride()[:3]):
        raise ValueError(f"KV4 cache strides {k_cache.stride()} must be multiples of 4 bytes")
    if kv4 and k_cache.numel() >= 2**33:
        raise ValueError(f"a KV4 cache of {k_cache.numel()} bytes is over the 8 GiB that int32 word offsets reach")
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of the cache's kv_heads {kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be ({b}, max_blocks) int32, got {tuple(block_tables.shape)} {block_tables.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    if context_lens.shape != (b,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be ({b},) int32, got {tuple(context_lens.shape)} {context_lens.dtype}")
    check_index_vectors(context_lens=context_lens)
    check_one_device("query", query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                     context_lens=context_lens)
    return kv4, kv_heads, heads // kv_heads


def _partitions(cfg: DecodeConfig, group: int, b: int, kv_heads: int, max_context_len: int,
                device: torch.device) -> tuple[int, int, int]:
    """A launch's programs per KV head, tokens per partition and partitions of the context (1: no split)."""
    kv_share = programs_per_kv_head(cfg, group)
    partition_size = partition_for(cfg, b * kv_heads * kv_share, max_context_len, multiprocessors(device))
    return kv_share, partition_size, max(1, cdiv(max_context_len, partition_size))


def decode_partitions(b: int, heads: int, head_dim: int, k_cache: torch.Tensor, max_context_len: int) -> int:
    """How many partitions of the context paged_decode_attention (default config) splits a launch of b
    sequences into (1: no split, the kernels' SPLIT form), without launching it."""
    kv4, kv_heads = k_cache.dtype == torch.uint8, k_cache.shape[1]
    group = heads // kv_heads
    cfg = default_config(kv4, group, head_dim, k_cache.shape[2])
    return _partitions(cfg, group, b, kv_heads, max_context_len, k_cache.device)[2]


# Every kernel paged_decode_attention may launch (kernel_warm_up compiles them ahead, several at once).
DECODE_KERNELS = (_fp16_decode_fma_kernel, _kv4_decode_fma_kernel, _kv4_decode_head_rows_kernel,
                  _kv4_decode_mma_kernel, _kv4_decode_dot_kernel, _reduce_partitions_kernel)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
    max_context_len: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV4 (uint8) or fp16 cache.

    query (B, heads, D) fp16 (rotated); caches as in the module docstring; block_tables (B,
    max_blocks) int32; context_lens (B,) int32. Returns (B, heads, D) fp16 (in `out` if given). sm_scale defaults to
    1/sqrt(D). max_context_len (>= every context length) sizes the partition grid; without it
    the launcher reads context_lens.max() (a device sync).
    """
    kv4, kv_heads, group = _check(query, k_cache, v_cache, block_tables, context_lens)
    b, heads, d = query.shape
    cfg = config or default_config(kv4, group, d, k_cache.shape[2])
    if not kv4 and (cfg.variant != "fma" or cfg.qk_int16 or cfg.page_ahead):
        raise ValueError(f"the fp16 cache has only the 'fma' kernel without qk_int16 or page_ahead, not {cfg}")
    if cfg.variant == "mma" and not _mma_covers(group, d, k_cache.shape[2]):
        raise ValueError(f"the 'mma' kernel takes 1, 2, 4 or 8 query heads per KV head, head_dim 128 and pages of a "
                         f"multiple of 16 tokens, not group {group}, head_dim {d}, pages of {k_cache.shape[2]}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if b else 0
    if max_context_len > block_tables.shape[1] * k_cache.shape[2]:
        # Tokens past the table's last entry would read the next row's entries (or past the table).
        raise ValueError(f"max_context_len {max_context_len} exceeds what block_tables of {block_tables.shape[1]} "
                         f"blocks of {k_cache.shape[2]} tokens address ({block_tables.shape[1] * k_cache.shape[2]})")
    out = attention_output(query, out, reads={"k_cache": k_cache, "v_cache": v_cache})
    if b == 0:
        return out
    kv_share, partition_size, num_partitions = _partitions(cfg, group, b, kv_heads, max_context_len, query.device)
    split = num_partitions > 1
    if split:
        part_m = torch.empty(b, heads, num_partitions, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(b, heads, num_partitions, d, dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_o = out  # unused
    grid = (b * kv_heads * kv_share, num_partitions)
    overlap = launch_kwargs(query.device, b)  # every launch below has the batch's rows
    common = dict(
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2], BLOCK_N=cfg.block_n,
        SPLIT=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **overlap,
    )
    sizes = (scale * LOG2E, kv_heads * kv_share, num_partitions, partition_size)  # the programs' "KV heads"
    if not kv4:
        _fp16_decode_fma_kernel[grid](
            query, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_o, *sizes,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_G=next_power_of_2(group), **common,
        )
    elif cfg.variant == "fma":
        k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)
        _kv4_decode_fma_kernel[grid](
            query, k_words, v_words, block_tables, context_lens, out, part_m, part_l, part_o, *sizes,
            _NIBBLE_MASK, _FP32_ONE_BITS,
            query.stride(0), query.stride(1), k_words.stride(0), k_words.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_G=next_power_of_2(group), PREFETCH=cfg.prefetch, QK_INT=cfg.qk_int16, FAST=query.is_cuda,
            PAGE_AHEAD=cfg.page_ahead, **common,
        )
    elif cfg.variant == "mma" and cfg.head_rows:
        k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)
        _kv4_decode_head_rows_kernel[grid](
            query, k_words, v_words, block_tables, context_lens, out, part_m, part_l, part_o, *sizes,
            query.stride(0), query.stride(1), k_words.stride(0), k_words.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2], SPLIT=split, FAST=query.is_cuda, GROUP=group,
            PREFETCH=cfg.prefetch, num_warps=1,
            num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **overlap,
        )
    elif cfg.variant == "mma":
        k_words, v_words = k_cache.view(torch.int32), v_cache.view(torch.int32)
        _kv4_decode_mma_kernel[grid](
            query, k_words, v_words, block_tables, context_lens, out, part_m, part_l, part_o, *sizes,
            _NIBBLE_MASK, _FP32_ONE_BITS,
            query.stride(0), query.stride(1), k_words.stride(0), k_words.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2], SPLIT=split, PREFETCH=cfg.prefetch, FAST=query.is_cuda,
            GROUP=group // kv_share, KV_SHARE=kv_share, PAGE_AHEAD=cfg.page_ahead, PV_MMA=cfg.pv_mma, num_warps=1,
            num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
            **overlap,
        )
    else:
        _kv4_decode_dot_kernel[grid](
            query, k_cache, v_cache, k_cache.view(torch.int32), v_cache.view(torch.int32), block_tables,
            context_lens, out, part_m, part_l, part_o, *sizes,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_G=max(16, next_power_of_2(group)), **common,
        )
    if split:
        _reduce_partitions_kernel[(b, heads)](
            part_m, part_l, part_o, context_lens, out, heads, num_partitions, partition_size,
            out.stride(0), out.stride(1), HEAD_DIM=d, num_warps=1, **overlap,
        )
    return out
