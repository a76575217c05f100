"""Input-error compensation (options.compensate_inputs): the least-squares fit and its use in a block."""

import dataclasses
import inspect

import pytest
import torch

import shared.quant.qoq as qoq
from shared.formats.spec import format_spec
from shared.formats.weights import W4ChannelWeight, W4G128ProgressiveWeight
from shared.model.checkpoint import HfCheckpoint
from shared.model.llama import block_forward
from shared.model.rope import cos_sin, inverse_frequencies
from shared.quant.block import WorkBlock
from shared.quant.compensation import BlockInputs, block_forward_until, compensated_weight
from shared.quant.key_feedback import feedback_factor
from shared.quant.options import QoQOptions
from shared.quant.rotation import rotation_matrix
from tests.conftest import write_random_llama


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_no_input_error_keeps_the_weight():
    x = torch.randn(4000, 64, generator=_gen(0))
    w = torch.randn(32, 64, generator=_gen(1))
    w_star = compensated_weight(w, x.t() @ x, x.t() @ x)
    assert torch.allclose(w_star, w, atol=1e-4)


def test_fit_lowers_the_error_and_splits_it_exactly():
    g = _gen(2)
    x = torch.randn(4000, 64, generator=g)
    mix = torch.eye(64) + 0.3 * torch.randn(64, 64, generator=g) / 8
    xq = x @ mix + 0.1 * torch.randn(4000, 64, generator=g)  # a correlated distortion plus noise
    w = torch.randn(32, 64, generator=g)
    h, c = xq.t() @ xq, xq.t() @ x
    w_star = compensated_weight(w, h, c, ridge=0.0)
    ref = x @ w.t()
    plain = (ref - xq @ w.t()).pow(2).sum()
    fitted = (ref - xq @ w_star.t()).pow(2).sum()
    assert fitted < 0.5 * plain
    # ||X W^T - X~ Q^T||^2 = ||X W^T - X~ W*^T||^2 + ||X~ (W* - Q)^T||^2 for any Q
    q = w_star + 0.05 * torch.randn(w.shape, generator=g)
    whole = (ref - xq @ q.t()).double().pow(2).sum()
    split = fitted.double() + (xq @ (w_star - q).t()).double().pow(2).sum()
    assert torch.isclose(whole, split, rtol=1e-3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_random_llama(tmp_path_factory.mktemp("m"), hidden=256, heads=2, kv_heads=1, ffn=384)
    ckpt = HfCheckpoint(folder)
    cfg = ckpt.config
    t = 64
    cos, sin = cos_sin(torch.arange(t), inverse_frequencies(cfg.rope, cfg.head_dim))
    x = torch.randn(8, t, cfg.hidden_size, generator=_gen(3))
    return cfg, ckpt, x, cos, sin


def test_forward_until_matches_the_reference_block(setup):
    cfg, ckpt, x, cos, sin = setup
    work = WorkBlock.from_fp(ckpt.block(0), "cpu")
    weights = {n: getattr(work, n) for n in ("qkv", "o", "gate_up", "down")}
    ref = block_forward(cfg, work.as_fp_block(), x, cos, sin)
    assert torch.allclose(block_forward_until(cfg, work, weights, x, cos, sin, 16, 16), ref, atol=1e-4)
    cap = {}
    block_forward(cfg, work.as_fp_block(), x, cos, sin, capture=cap)
    down_in = block_forward_until(cfg, work, weights, x, cos, sin, 16, 16, "down")
    assert torch.allclose(down_in, cap["down_in"].reshape(-1, cap["down_in"].shape[-1]), atol=1e-5)


def _quantize(setup, fmt, options):
    cfg, ckpt, x, cos, sin = setup
    work = WorkBlock.from_fp(ckpt.block(0), "cpu")
    rot = rotation_matrix(cfg.hidden_size).float()
    xr = x @ rot
    token_idx = torch.arange(0, xr.shape[0] * xr.shape[1], 4)
    qb, out = qoq.quantize_block(cfg, work, xr, cos, sin, format_spec(fmt), options, rot, token_idx,
                                 rotation_matrix(cfg.head_dim, 1).float())
    return cfg, work, qb, xr, out, cos, sin


@pytest.mark.parametrize("fmt", ["w4a8kv4-g128", "w4a8kv4-chn"])
def test_compensation_lowers_the_quantized_block_error(setup, fmt):
    base = QoQOptions()
    errors, blocks = {}, {}
    for on in (False, True):
        cfg, work, qb, xr, out, cos, sin = _quantize(setup, fmt, dataclasses.replace(base, compensate_inputs=on))
        deq = {n: p.dequantize() for n, p in qb.linears.items()}
        y = block_forward_until(cfg, work, deq, xr, cos, sin, 8, 4)
        errors[on] = (y - out).pow(2).mean().item()
        blocks[on] = qb
    assert errors[True] < errors[False]
    # the same formats and grids' rules: packed weights of the format's kind, int8 range respected
    kind = W4G128ProgressiveWeight if fmt.endswith("g128") else W4ChannelWeight
    for p in blocks[True].linears.values():
        assert isinstance(p, kind)
        if kind is W4G128ProgressiveWeight:
            w8 = (p.codes().to(torch.int16).unflatten(1, (-1, 128)) - p.zero.to(torch.int16)[..., None]) \
                * p.s2.to(torch.int16)[..., None]
            assert w8.abs().max() <= 128 and w8.min() >= -128 and w8.max() <= 127


def test_off_leaves_the_pipeline_as_before(setup, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("compensation ran with the option off")

    monkeypatch.setattr(qoq, "BlockInputs", fail)
    monkeypatch.setattr(qoq, "compensated_weight", fail)
    _quantize(setup, "w4a8kv4-g128", QoQOptions(compensate_inputs=False))


def test_ridge_must_be_positive():
    with pytest.raises(ValueError):
        QoQOptions(compensate_ridge=0.0)
    assert QoQOptions.rtn().compensate_inputs is False


def test_the_fit_sees_the_layers_kv_range(setup, monkeypatch):
    # The quantized block's o_proj input goes through KV4 as the cache write does it: with the V
    # range ratio the layer was given, not the full range.
    cfg, ckpt, x, cos, sin = setup
    work = WorkBlock.from_fp(ckpt.block(0), "cpu")
    weights = {n: getattr(work, n) for n in ("qkv", "o", "gate_up", "down")}
    full = block_forward_until(cfg, work, weights, x, cos, sin, 8, 4, "o")
    narrowed = block_forward_until(cfg, work, weights, x, cos, sin, 8, 4, "o", kv_range=(1.0, 0.85))
    assert not torch.equal(full, narrowed)

    seen = []
    real = qoq.BlockInputs

    def spy(*args, **kwargs):
        arguments = inspect.signature(real).bind(*args, **kwargs).arguments
        seen.append((arguments.get("kv_range"), arguments.get("key_feedback")))
        return real(*args, **kwargs)

    monkeypatch.setattr(qoq, "BlockInputs", spy)
    monkeypatch.setattr(qoq, "search_value_ratio", lambda *a, **k: 0.85)
    _quantize(setup, "w4a8kv4-g128", QoQOptions(compensate_inputs=True))
    assert seen and all(r == (1.0, 0.85) and u is None for r, u in seen)
    seen.clear()  # with key feedback on, the fit's KV4 keys are rounded with the block's factor
    _quantize(setup, "w4a8kv4-g128", QoQOptions(compensate_inputs=True, key_feedback=True))
    assert seen and all(u is not None and u.shape == (cfg.num_kv_heads, cfg.head_dim, cfg.head_dim) for _, u in seen)


def test_block_inputs_advance_to_what_the_forward_from_scratch_gives(setup):
    # BlockInputs keeps each path's inputs and advances them one linear at a time; the stats must
    # be those of block_forward_until (the block's prefix run from scratch) for every linear.
    cfg, ckpt, x, cos, sin = setup
    work = WorkBlock.from_fp(ckpt.block(0), "cpu")
    fp = {n: getattr(work, n) for n in ("qkv", "o", "gate_up", "down")}
    g = _gen(5)
    deq = {n: w + 0.01 * w.abs().mean() * torch.randn(w.shape, generator=g) for n, w in fp.items()}
    kv_range = (1.0, 0.85)
    mix = torch.randn(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, generator=g)
    u = feedback_factor(mix @ mix.transpose(1, 2))
    # 8 samples: batches of 3, 3, 2
    inputs = BlockInputs(cfg, work, x, cos, sin, 8, 4, batch=3, kv_range=kv_range, key_feedback=u)
    for name in ("qkv", "o", "gate_up", "down"):
        h, c = inputs.stats(name, deq)
        xf = block_forward_until(cfg, work, fp, x, cos, sin, 16, 16, name)
        xq = block_forward_until(cfg, work, deq, x, cos, sin, 8, 4, name, kv_range, key_feedback=u)
        assert torch.allclose(h, xq.t() @ xq, rtol=1e-4, atol=1e-2)
        assert torch.allclose(c, xq.t() @ xf, rtol=1e-4, atol=1e-2)
    with pytest.raises(ValueError, match="released"):
        inputs.stats("down", deq)


def test_block_inputs_refuse_a_linear_out_of_order(setup):
    cfg, ckpt, x, cos, sin = setup
    work = WorkBlock.from_fp(ckpt.block(0), "cpu")
    inputs = BlockInputs(cfg, work, x, cos, sin, 8, 4, batch=4)
    with pytest.raises(ValueError, match="out of forward order"):
        inputs.stats("gate_up", {})
