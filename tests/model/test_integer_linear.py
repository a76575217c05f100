"""The reference W4A8 / W8A8 linears do the kernels' integer arithmetic exactly."""

import os
import subprocess
import sys

import pytest
import torch

from shared.model.linear import (
    CPU_BACKENDS,
    Int8Gemm,
    W4A8ChannelLinear,
    W4A8G128Linear,
    W8A8Linear,
    int8_matmul,
    _cpu_int8_gemm_is_exact,
    measured_cpu_backend,
)
from shared.quant.activations import quantize_per_token
from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive, quantize_w8


def _usable_backends() -> list[str]:
    # "int8" is only ever chosen where it is exact (measured_cpu_backend); elsewhere it is not tested
    return [b for b in CPU_BACKENDS if b != "int8" or _cpu_int8_gemm_is_exact()]


@pytest.mark.parametrize("backend", _usable_backends())
def test_int8_matmul_is_exact_at_awkward_shapes(backend):
    # K = 2304 spans three fp32 chunks; the extreme codes give sums past 2^24 in one chunk's worth
    for m, k, n in [(1, 128, 3), (3, 384, 129), (129, 1152, 67), (5, 2304, 9)]:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        a[0], b[0] = -127, -128  # the largest product, K times: 37M for K = 2304
        expect = (a.long() @ b.long().t())
        assert torch.equal(int8_matmul(a, b, backend).long(), expect)
        gemm = Int8Gemm(b, backend)
        assert torch.equal(gemm.as_float(a.float()), expect.float())  # fp32 codes, rounded once as the kernels do
        small = (b // 16).to(torch.int8)  # |w8| <= 8: one fp32 chunk covers K = 2304 exactly
        assert torch.equal(int8_matmul(a, small, backend).long(), a.long() @ small.long().t())


def test_fp32_backend_takes_k_in_one_chunk_only_where_the_weight_bounds_its_sums():
    codes = torch.randint(0, 16, (8, 4096), dtype=torch.int8)  # 4-bit codes: 128 * 15 * 4096 < 2^24
    assert len(Int8Gemm(codes, "fp32")._chunks) == 1
    extreme = torch.full((8, 1025), -128, dtype=torch.int8)  # 128 * 128 * 1025 > 2^24
    assert [c.shape[1] for c in Int8Gemm(extreme, "fp32")._chunks] == [1024, 1]


def test_cpu_backend_is_measured_once_and_unknown_ones_are_refused():
    assert measured_cpu_backend() in _usable_backends()
    assert measured_cpu_backend.cache_info().misses == 1
    with pytest.raises(ValueError, match="unknown CPU int8 GEMM backend 'fp64'"):
        Int8Gemm(torch.zeros(2, 2, dtype=torch.int8), "fp64")


def test_measuring_the_backend_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    measured_cpu_backend.__wrapped__()  # the measurement itself, past the per-process cache
    assert torch.equal(torch.rand(4), expected)


def test_default_backend_stays_exact_where_the_cpu_int8_gemm_saturates():
    # oneDNN held to AVX2 (no VNNI) sums int8 pairs in saturating int16: torch._int_mm is then off
    # by millions on rows of 127s, and the default backend must notice and stay on fp32.
    script = (
        "import torch\n"
        "from shared.model.linear import int8_matmul\n"
        "x = torch.full((4, 512), 127, dtype=torch.int8); w = torch.full((8, 512), 127, dtype=torch.int8)\n"
        "w[1] = -128\n"
        "assert torch.equal(int8_matmul(x, w).long(), x.long() @ w.long().t())\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_g128_linear_is_int32_dot_then_scales():
    w, x = torch.randn(67, 384), torch.randn(5, 384)
    packed = quantize_w4_g128_progressive(w)
    y = W4A8G128Linear(packed)(x)
    x8, sx = quantize_per_token(x)
    acc = x8.long() @ packed.int8_weight().long().t()  # exact int64
    expect = (acc.double() * sx.double() * packed.s1.double()).half().float()
    assert torch.allclose(y, expect, rtol=2e-3, atol=1e-3)
    assert (y - x @ w.t()).norm() / (x @ w.t()).norm() < 0.15


def test_channel_linear_moves_the_zero_into_the_epilogue():
    w, x = torch.randn(33, 256), torch.randn(4, 256)
    packed = quantize_w4_channel(w)
    y = W4A8ChannelLinear(packed)(x)
    x8, sx = quantize_per_token(x)
    expect = (x8.double() * sx.double()) @ packed.dequantize().double().t()
    assert torch.allclose(y.double(), expect, rtol=3e-3, atol=1e-2)


def test_w8a8_linear_close_to_fp():
    w, x = torch.randn(16, 128), torch.randn(3, 128)
    y = W8A8Linear(quantize_w8(w))(x)
    assert (y - x @ w.t()).norm() / (x @ w.t()).norm() < 0.02
