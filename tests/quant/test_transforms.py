"""Every QoQ transform leaves the block's fp function unchanged (they are folded into weights)."""

import pytest
import torch

from shared.model.checkpoint import HfCheckpoint
from shared.model.llama import block_forward
from shared.model.rope import cos_sin, inverse_frequencies
from shared.quant.block import WorkBlock
from shared.quant.reorder import apply_down_reorder
from shared.quant.rotation import hadamard, rotation_matrix
from shared.quant.smooth_attention import apply_smooth_attention, smooth_attention_scales
from shared.quant.smoothing import apply_down_smoothing, apply_o_smoothing, tie_over_query_groups
from tests.conftest import write_random_llama


@pytest.fixture
def setup(tmp_path):
    ckpt = HfCheckpoint(write_random_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, ffn=384))
    cfg = ckpt.config
    x = torch.randn(2, 19, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = cos_sin(torch.arange(19), inverse_frequencies(cfg.rope, cfg.head_dim))
    return cfg, WorkBlock.from_fp(ckpt.block(0), "cpu"), x, cos, sin


def _run(cfg, work, x, cos, sin):
    return block_forward(cfg, work.as_fp_block(), x, cos, sin)


def _close(a, b):
    assert (a - b).abs().max() < 1e-4 * b.abs().max()


def test_hadamard_is_orthogonal_and_non_powers_of_two_fall_back():
    h = hadamard(64) / 8
    assert torch.allclose(h @ h.t(), torch.eye(64, dtype=h.dtype), atol=1e-12)
    for n in (256, 96):
        r = rotation_matrix(n, seed=3)
        assert torch.allclose(r @ r.t(), torch.eye(n, dtype=r.dtype), atol=1e-10)
        assert torch.equal(r, rotation_matrix(n, seed=3))


def test_rotation_of_block_inputs_and_outputs(setup):
    cfg, work, x, cos, sin = setup
    ref = _run(cfg, work, x, cos, sin)
    r = rotation_matrix(cfg.hidden_size).float()
    work.fold_norms()
    work.rotate(r)
    _close(_run(cfg, work, x @ r, cos, sin), ref @ r)


def test_value_rotation(setup):
    cfg, work, x, cos, sin = setup
    ref = _run(cfg, work, x, cos, sin)
    work.rotate_values(cfg, rotation_matrix(cfg.head_dim, seed=1).float())
    _close(_run(cfg, work, x, cos, sin), ref)


def test_smooth_attention_pairs_rope_halves_and_keeps_attention(setup):
    cfg, work, x, cos, sin = setup
    ref = _run(cfg, work, x, cos, sin)
    k_absmax = torch.rand(cfg.num_kv_heads, cfg.head_dim) * 10
    lam = smooth_attention_scales(cfg, k_absmax, 0.5)
    half = cfg.head_dim // 2
    assert torch.equal(lam[:, :half], lam[:, half:])
    assert torch.allclose(lam[:, :half] ** 2, torch.maximum(k_absmax[:, :half], k_absmax[:, half:]), rtol=1e-5)
    apply_smooth_attention(cfg, work, lam)
    _close(_run(cfg, work, x, cos, sin), ref)


def test_output_smoothing_ties_channels_of_a_query_group(setup):
    cfg, work, x, cos, sin = setup
    ref = _run(cfg, work, x, cos, sin)
    tie = tie_over_query_groups(cfg)
    s_o = tie(torch.rand(cfg.q_size) + 0.5)
    heads = s_o.view(cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
    assert torch.equal(heads[:, 0], heads[:, 1])
    apply_o_smoothing(cfg, work, s_o)
    apply_down_smoothing(work, torch.rand(cfg.intermediate_size) + 0.5)
    _close(_run(cfg, work, x, cos, sin), ref)


def test_down_reorder(setup):
    cfg, work, x, cos, sin = setup
    ref = _run(cfg, work, x, cos, sin)
    apply_down_reorder(work, torch.randperm(cfg.intermediate_size))
    _close(_run(cfg, work, x, cos, sin), ref)
