"""Fused activation-quant kernels (Triton interpreter) against shared/quant/activations.py.

The scale must equal the reference to fp32 rounding (the sum of squares is reduced in another
order); an int8 code may differ by one only where x / scale sits on a rounding tie.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.kernels import act_quant
from services.worker.kernels.act_quant import quantize, rmsnorm_quant, silu_mul_quant
from shared.model.llama import rms_norm
from shared.quant.activations import quantize_per_token

SHAPES = [(1, 64), (3, 200), (129, 384)]


@pytest.fixture(autouse=True, params=["one_pass", "chunked"])
def _path(request, monkeypatch):
    """Every test runs both kernel paths: a row held in registers, and rows read in chunks of 128."""
    if request.param == "chunked":
        monkeypatch.setattr(act_quant, "ONE_PASS_MAX", 0)
        monkeypatch.setattr(act_quant, "CHUNK", 128)


def _assert_quantized(got: act_quant.QuantizedActivations, ref_input: torch.Tensor) -> None:
    x8, scale, rowsum, group_sums = got
    r8, rscale = quantize_per_token(ref_input)
    assert x8.dtype == torch.int8 and scale.dtype == torch.float32 and rowsum.dtype == torch.int32
    assert scale.shape == rowsum.shape == (x8.shape[0],)
    torch.testing.assert_close(scale, rscale[:, 0], rtol=4e-7, atol=0)
    diff = (x8.int() - r8.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-2
    assert torch.equal(rowsum, x8.int().sum(dim=1))
    # Group sums (when asked for) over 128 columns; a last partial group (K = 64, 200) sums what it has.
    if group_sums is not None:
        assert group_sums.dtype == torch.int32
        m, k = x8.shape
        padded = F.pad(x8.int(), (0, -k % 128))
        assert torch.equal(group_sums, padded.view(m, -1, 128).sum(dim=2))


def _input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", SHAPES)
def test_rmsnorm_quant(m, k, dtype):
    x = _input(m, k, dtype, seed=m * k)
    weight = 1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(1))
    got = rmsnorm_quant(x, weight, 1e-6, group_sums=True)
    assert got.group_sums is not None
    _assert_quantized(got, rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", SHAPES)
def test_rmsnorm_quant_adds_the_residual_first(m, k, dtype):
    """add=y: x becomes x + y in place (exactly torch's x += y in x's dtype, strided y too) and the
    quantized norm is that of the sum."""
    x = _input(m, k, dtype, seed=m * k + 1)
    y = _input(m, 2 * k, dtype, seed=m * k + 2)[:, ::2].contiguous()
    y = torch.cat([y, y], dim=1)[:, :k]  # rows k apart in a buffer 2k wide: a row stride unlike x's
    expected = x + y
    weight = 1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(1))
    got = rmsnorm_quant(x, weight, 1e-6, add=y, group_sums=True)
    assert torch.equal(x, expected)
    _assert_quantized(got, rms_norm(expected, weight, 1e-6))


def test_rmsnorm_quant_refuses_a_mismatched_add():
    x = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="add: expected shape"):
        rmsnorm_quant(x, torch.ones(64), 1e-6, add=torch.zeros(3, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,f", SHAPES)
def test_silu_mul_quant(m, f, dtype):
    gate_up = _input(m, 2 * f, dtype, seed=m + f)
    gate, up = gate_up.float().chunk(2, dim=-1)
    _assert_quantized(silu_mul_quant(gate_up, group_sums=True), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", SHAPES)
def test_quantize(m, k, dtype):
    x = _input(m, k, dtype, seed=m - k)
    _assert_quantized(quantize(x, group_sums=True), x.float())


def test_strided_rows_and_zero_rows():
    x = _input(4, 256, torch.float32, seed=2)[:, :200]  # row stride 256
    x[1] = 0
    act = quantize(x)
    assert act.group_sums is None  # not asked for
    _assert_quantized(act, x)
    assert act.scale[1] == torch.tensor(1e-8) and not act.x8[1].any()


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match="width 129 is odd"):
        silu_mul_quant(torch.zeros(2, 129))
    with pytest.raises(ValueError, match="int32"):
        quantize(torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        quantize(torch.zeros(64, 2).t())
