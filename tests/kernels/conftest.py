"""Kernel tests run Triton's interpreter on the CPU (CI has no GPU).

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated, that is when its module is imported,
so the variable is set here, at this conftest's import, before the test modules import the kernels.
A kernel module some earlier test already imported in compiled mode is imported again.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

from shared.formats.kv4 import encode_rows

os.environ["TRITON_INTERPRET"] = "1"

for _name in ("services.worker.kernels.w4a8_gemm", "services.worker.kernels.act_quant"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


# Shared by the paged attention tests (decode and chunk-continuation prefill).
BLOCK_SIZE = 16


def paged_batch(lengths, kv_heads, group, head_dim, kv4, seed, spare_blocks=3):
    """Random caches whose sequences sit on shuffled blocks; blocks no table names are NaN/garbage."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lengths), max(per_seq + [1]) + 1), num_blocks - 1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[start : start + n]
        start += n
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    offsets = torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, 1, generator=g)
    x = torch.randn(2, *shape, generator=g) * torch.rand(2, *shape[:-1], 1, generator=g) * 3 + offsets
    if kv4:
        k_cache, v_cache = encode_rows(x[0].half()), encode_rows(x[1].half())
    else:
        k_cache, v_cache = x[0].half(), x[1].half()
    # Rows past each sequence's end (inside its last block) and unused blocks hold garbage.
    for b, n in enumerate(lengths):
        if n % BLOCK_SIZE:
            last = tables[b, per_seq[b] - 1]
            for cache in (k_cache, v_cache):
                cache[last, :, n % BLOCK_SIZE :] = 0xFF if kv4 else float("nan")
    query = (torch.randn(len(lengths), kv_heads * group, head_dim, generator=g) * 1.5).half()
    return query, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs()
    assert (err <= 2e-3 + 4e-3 * ref.float().abs()).all(), f"max error {err.max().item():.3g}"
    assert err.norm() / ref.float().norm().clamp_min(1e-6) < 2e-3
