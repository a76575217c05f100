"""The reference W4A8 / W8A8 linears do the kernels' integer arithmetic exactly."""

import torch

from shared.model.linear import W4A8ChannelLinear, W4A8G128Linear, W8A8Linear, int8_matmul
from shared.quant.activations import quantize_per_token
from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive, quantize_w8


def test_int8_matmul_is_exact_at_awkward_shapes():
    for m, k, n in [(1, 128, 3), (3, 384, 129), (129, 1152, 67)]:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        expect = (a.long() @ b.long().t())
        assert torch.equal(int8_matmul(a, b).long(), expect)


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
