"""KV4 range-ratio search (shared/quant/kv_range.py) and its path into the artifact."""

from __future__ import annotations

import dataclasses

import torch

from shared.formats.artifact import ArtifactReader
from shared.formats.kv4 import fake_quantize_kv4
from shared.model.config import LlamaConfig
from shared.quant.kv_range import RATIOS, search_value_ratio, value_channel_weights
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from tests.conftest import write_random_llama


def _config(heads=4, kv_heads=2, head_dim=64) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=heads * head_dim, intermediate_size=128, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=32,
    )


def test_ratios_are_fp32_exact_and_start_at_the_full_range():
    assert RATIOS[0] == 1.0 and all(torch.tensor(r, dtype=torch.float32).item() == r for r in RATIOS)


def test_value_ratio_narrows_gaussian_values_and_keeps_two_level_ones():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(512, 2, 64, generator=g)
    ones = torch.ones(2, 64)
    r = search_value_ratio(v, ones)
    assert r < 1.0
    errors = {c: (fake_quantize_kv4(v, c) - v).pow(2).sum().item() for c in RATIOS}
    assert errors[r] == min(errors.values())
    # Values at exactly two levels sit on the full-range grid: any narrowing only adds error.
    two_level = torch.where(torch.rand(512, 2, 64, generator=g) < 0.5, -1.0, 1.0)
    assert search_value_ratio(two_level, ones) == 1.0


def test_value_weights_follow_o_proj_columns_over_each_query_group():
    cfg = _config(heads=4, kv_heads=2, head_dim=8)
    o = torch.zeros(cfg.hidden_size, cfg.q_size)
    o[:, 8 + 3] = 2.0  # query head 1 (group of V head 0), channel 3
    w = value_channel_weights(cfg, o)
    assert w.shape == (2, 8) and w[0, 3] == 4.0 * cfg.hidden_size and w.sum() == w[0, 3]


def test_quantizer_writes_each_layers_ratios_and_rtn_writes_none(tmp_path, calib_text):
    model = write_random_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, ffn=384, layers=2)
    searched = tmp_path / "searched"
    options = dataclasses.replace(QoQOptions.rtn(), kv_range_search=True)
    quantize_checkpoint(QuantizeSettings(model, searched, "w4a8kv4-g128", options=options, calib_path=calib_text,
                                         calib_samples=4, calib_seq_len=128))
    ranges = [ArtifactReader(searched).block_kv_range(i) for i in range(2)]
    assert all(k == 1.0 and v in RATIOS for k, v in ranges)  # K keeps its full range (see kv_range.py)
    assert any(v < 1.0 for _, v in ranges)  # random, roughly Gaussian values narrow
    rtn = tmp_path / "rtn"
    quantize_checkpoint(QuantizeSettings(model, rtn, "w4a8kv4-g128", options=QoQOptions.rtn()))
    assert [ArtifactReader(rtn).block_kv_range(i) for i in range(2)] == [(1.0, 1.0)] * 2
