"""Launchers refuse inputs their kernels cannot read (instead of returning garbage), and a malformed
kernel policy table is refused with KernelPolicyError (instead of an AttributeError / TypeError).

The kernels read 1-D index tensors (context lengths, cu_seqlens, slots, row sums) and the block
tables' rows at unit stride; each case below gave wrong results before the launcher checked it.
Tiny shapes: the Triton interpreter runs only the reference side of these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.worker.engine.kernel_policy import GemmPolicy
from services.worker.kernels import w4a8_gemm
from services.worker.kernels.act_quant import quantize
from services.worker.kernels.attention_reference import build_rope_cache
from services.worker.kernels.kv4_cache import write_kv4_cache
from services.worker.kernels.paged_attention import DecodeConfig, paged_decode_attention
from services.worker.kernels.paged_prefill_attention import paged_prefill_attention
from services.worker.kernels.prefill_attention import prefill_attention
from shared.formats.kernel_policy import KernelPolicyError, parse_policy
from shared.formats.kv4 import page_row_bytes
from shared.formats.weights import W4ChannelWeight
from tests.kernels.conftest import BLOCK_SIZE, paged_batch


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as t (1-D), every other element of a larger buffer (stride 2)."""
    return torch.stack([t, torch.full_like(t, 3)], 1)[:, 0]


def test_decode_refuses_strided_context_lens():
    q, k_cache, v_cache, tables, lens = paged_batch([20, 5], 1, 1, 64, True, seed=1)
    with pytest.raises(ValueError, match="context_lens must be contiguous"):
        paged_decode_attention(q, k_cache, v_cache, tables, _strided(lens), config=DecodeConfig(block_n=16, partition_size=64))


def test_decode_refuses_a_block_table_shorter_than_the_context():
    q, k_cache, v_cache, tables, lens = paged_batch([20, 5], 1, 1, 64, True, seed=1)
    short = tables[:, :1].contiguous()  # one block of 16 tokens for a 20-token context
    with pytest.raises(ValueError, match="max_context_len 20 exceeds"):
        paged_decode_attention(q, k_cache, v_cache, short, lens, max_context_len=20)
    with pytest.raises(ValueError, match="max_context_len 20 exceeds"):
        paged_decode_attention(q, k_cache, v_cache, short, lens)  # read from context_lens


def test_decode_refuses_tensors_on_another_device():
    q, k_cache, v_cache, tables, lens = paged_batch([5], 1, 1, 64, True, seed=1)
    with pytest.raises(ValueError, match="block_tables is on meta"):
        paged_decode_attention(q, k_cache, v_cache, tables.to("meta"), lens, max_context_len=5)


def test_kv4_write_refuses_strided_slots_and_positions():
    d = 64
    rope = build_rope_cache(torch.ones(d // 2), 64)
    k, v = torch.randn(2, 1, d).half(), torch.randn(2, 1, d).half()
    positions, slots = torch.tensor([0, 1]), torch.tensor([3, 7])
    cache = torch.zeros(2, 1, BLOCK_SIZE, page_row_bytes(d), dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv4_cache(k, v, positions, _strided(slots), rope, cache, cache.clone())
    with pytest.raises(ValueError, match="positions must be contiguous"):
        write_kv4_cache(k, v, _strided(positions), slots, rope, cache, cache.clone())
    with pytest.raises(ValueError, match="k_cache / v_cache are on meta"):
        write_kv4_cache(k, v, positions, slots, rope, cache.to("meta"), cache.to("meta"))


def test_paged_prefill_refuses_strided_tables_and_offsets():
    _, k_cache, v_cache, tables, _ = paged_batch([40], 1, 1, 64, True, seed=3)
    query = torch.randn(8, 1, 64).half()
    cu, starts = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([32], dtype=torch.int32)
    strided_tables = torch.stack([tables, torch.zeros_like(tables)], 2)[:, :, 0]  # strides (2 * width, 2)
    with pytest.raises(ValueError, match="block_tables must be contiguous"):
        paged_prefill_attention(query, k_cache, v_cache, cu, starts, strided_tables, max_seqlen=8)
    with pytest.raises(ValueError, match="cu_seqlens must be contiguous"):
        paged_prefill_attention(query, k_cache, v_cache, _strided(cu), starts, tables, max_seqlen=8)
    # fp16 pages whose rows are not contiguous (a view over a wider row) would be read as neighbours.
    wide = torch.zeros(k_cache.shape[:3] + (128,), dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="cache rows must be contiguous"):
        paged_prefill_attention(query, wide, wide, cu, starts, tables, max_seqlen=8)


def test_prefill_refuses_strided_cu_seqlens():
    q, k, v = (torch.randn(12, 1, 64).half() for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be contiguous"):
        prefill_attention(q, k, v, _strided(cu), max_seqlen=7)


@pytest.mark.parametrize("variant", ["chn.gemv.n8m4g4", "chn.gemv.n8m1g16.xs"])
def test_word_gemm_refuses_a_strided_rowsum(variant):
    g = torch.Generator().manual_seed(0)
    n = k = 128
    weight = W4ChannelWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                             (torch.rand(n, generator=g) * 0.01).half(), torch.randint(0, 16, (n,), generator=g).half())
    act = quantize(torch.randn(2, k, generator=g).half())
    with pytest.raises(ValueError, match="rowsum must be contiguous"):
        w4a8_gemm.w4a8_gemm(act.x8, act.scale, weight, _strided(act.rowsum), variant=variant)
    with pytest.raises(ValueError, match="one device"):
        w4a8_gemm.w4a8_gemm(act.x8, act.scale, weight, act.rowsum.to("meta"), variant=variant)


@pytest.mark.parametrize("table", [
    ["not a mapping"],
    {"gemm": {"w4chn": ["4096x4096"]}},
    {"gemm": {"w4chn": None}},
    {"gemm": {"w4chn": {"4096x4096": 5}}},
    {"gemm": {"w4chn": {"4096x4096": [[True, "chn.n64m16.sk"]]}}},
])
def test_a_malformed_policy_table_is_refused_as_such(table):
    with pytest.raises(KernelPolicyError):
        parse_policy(table)
    with pytest.raises(KernelPolicyError):
        GemmPolicy.from_manifest(table)


def test_gemm_input_checks_are_value_errors_that_survive_python_dash_o():
    """They were asserts: `python -O` stripped them, and an `out` one column short was written past its end."""
    script = (
        "import torch; from services.worker.kernels import w4a8_gemm; from shared.formats.weights import W4ChannelWeight\n"
        "from services.worker.kernels.act_quant import quantize\n"
        "g = torch.Generator().manual_seed(0); n = k = 128\n"
        "w = W4ChannelWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),\n"
        "    (torch.rand(n, generator=g) * 0.01).half(), torch.randint(0, 16, (n,), generator=g).half())\n"
        "a = quantize(torch.randn(2, k, generator=g).half())\n"
        "try:\n"
        "    w4a8_gemm.w4a8_gemm(a.x8, a.scale, w, a.rowsum, out=torch.empty(2, n - 1, dtype=torch.float16))\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert "refused: out: expected (2, 128) fp16" in done.stdout, done.stdout + done.stderr


def test_an_output_over_what_the_kernel_still_reads_is_refused():
    """out=key was accepted: the kernel overwrote keys it still read (max |diff| 1.0 against out=None)."""
    q, k, v = (torch.randn(12, 2, 64).half() for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="out overlaps key in memory"):
        prefill_attention(q, k, v, cu, max_seqlen=7, out=k)
    buffer = torch.zeros(12, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="out overlaps value in memory"):
        prefill_attention(q, k, buffer[:, 2:], cu, max_seqlen=7, out=buffer[:, :2])  # interleaved rows: refused too
    out = torch.empty_like(q)
    assert prefill_attention(q, k, v, cu, max_seqlen=7, out=out) is out
