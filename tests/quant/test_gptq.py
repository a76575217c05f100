"""GPTQ rounding (shared/quant/gptq.py): output error in the calibration metric, and the row-scale refit."""

import dataclasses

import pytest
import torch

from shared.quant.gptq import gptq_quantize
from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive

RTN = {"w4g128p": quantize_w4_g128_progressive, "w4chn": quantize_w4_channel}
SCALE_FIELD = {"w4g128p": "s1", "w4chn": "scale"}


def _problem(n=48, k=256, tokens=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)  # correlated inputs, as activations are
    x = torch.randn(tokens, k, generator=g) @ mix
    x[:, :4] *= 8  # a few outlier channels
    return torch.randn(n, k, generator=g) * 0.02, x.T @ x


def _row_errors(w, w_hat, h):
    d = (w - w_hat).double()
    return ((d @ h.double()) * d).sum(1)


@pytest.mark.parametrize("kind", sorted(RTN))
def test_gptq_output_error_is_below_round_to_nearest(kind):
    w, h = _problem()
    gptq = gptq_quantize(w, h, kind).dequantize().float()
    rtn = RTN[kind](w).dequantize().float()
    assert _row_errors(w, gptq, h).sum() < 0.7 * _row_errors(w, rtn, h).sum()


@pytest.mark.parametrize("kind", sorted(RTN))
def test_refitted_row_scales_are_the_least_squares_optimum(kind):
    w, h = _problem(seed=1)
    packed = gptq_quantize(w, h, kind)
    scale = getattr(packed, SCALE_FIELD[kind])
    best = _row_errors(w, packed.dequantize().float(), h)
    for factor in (0.99, 1.01):
        moved = dataclasses.replace(packed, **{SCALE_FIELD[kind]: (scale.float() * factor).half()})
        assert torch.all(_row_errors(w, moved.dequantize().float(), h) >= best * (1 - 1e-6))


def test_a_zero_row_keeps_a_finite_scale():
    w, h = _problem(seed=2)
    w[3] = 0.0
    for kind in RTN:
        packed = gptq_quantize(w, h, kind)
        assert torch.isfinite(getattr(packed, SCALE_FIELD[kind]).float()).all()
        assert packed.dequantize()[3].abs().max() == 0
