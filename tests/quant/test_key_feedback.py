"""Key error-feedback factors (shared/quant/key_feedback.py) and their path into the artifact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.formats.artifact import ArtifactError, ArtifactReader, block_file
from shared.formats.kv4 import check_key_feedback
from shared.model.load import artifact_model
from shared.model.perplexity import perplexity
from shared.quant.key_feedback import feedback_factor, query_moment_of, query_second_moment
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from tests.conftest import write_random_llama
from tests.quant.test_kv_range import _config


def test_factor_is_the_inverse_cholesky_factor_over_its_diagonal():
    """R = diag(U)^-1 U with U^T U = (H + damping)^-1: R^T diag(U)^2 R inverts the damped H."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(2, 16, 16, generator=g)
    h = mix @ mix.transpose(1, 2)
    r = feedback_factor(h, damping=0.1)
    check_key_feedback(r, 2, 16)
    damped = h.double() + 0.1 * h.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(16, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    scaled = u.diagonal(dim1=1, dim2=2)[..., :, None] * r.double()  # back to U
    torch.testing.assert_close(scaled, u, atol=1e-5, rtol=1e-4)


def test_second_moment_sums_each_kv_heads_query_group():
    config = _config(heads=4, kv_heads=2, head_dim=8)
    q = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(1))
    m = query_second_moment(config, q)
    torch.testing.assert_close(m[1], q[:, 2].t() @ q[:, 2] + q[:, 3].t() @ q[:, 3])
    # The capture's layout (B, heads, T, D): the same sums.
    batched = query_moment_of(config, q.view(1, 5, 4, 8).transpose(1, 2))
    torch.testing.assert_close(batched, m.double(), rtol=1e-5, atol=1e-5)


def test_quantizer_writes_factors_only_when_asked_and_the_model_reads_them(tmp_path, calib_text):
    model = write_random_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, ffn=384, layers=2)
    out = tmp_path / "feedback"
    options = dataclasses.replace(QoQOptions.rtn(), smooth_attention=True, key_feedback=True)
    quantize_checkpoint(QuantizeSettings(model, out, "w4a8kv4-g128", options=options, calib_path=calib_text,
                                         calib_samples=4, calib_seq_len=128))
    reader = ArtifactReader(out)
    factors = [reader.block_key_feedback(i) for i in range(2)]
    assert all(u is not None and u.shape == (2, 64, 64) for u in factors)
    net = artifact_model(reader)
    assert all(torch.equal(b.key_feedback, u) for b, u in zip(net.blocks, factors))
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(2))
    with_feedback = perplexity(net.forward, tokens).ppl
    for block in net.blocks:
        block.key_feedback = None
    assert perplexity(net.forward, tokens).ppl != with_feedback  # the factors change what attention reads

    plain = tmp_path / "plain"
    quantize_checkpoint(QuantizeSettings(model, plain, "w4a8kv4-g128", options=QoQOptions.rtn()))
    assert ArtifactReader(plain).block_key_feedback(0) is None
    w8 = tmp_path / "w8a8"  # no KV4: nothing to round
    quantize_checkpoint(QuantizeSettings(model, w8, "w8a8", options=options, calib_path=calib_text,
                                         calib_samples=4, calib_seq_len=128))
    assert ArtifactReader(w8).block_key_feedback(0) is None


def test_a_corrupt_factor_is_an_artifact_error(tmp_path, calib_text):
    model = write_random_llama(tmp_path / "m", hidden=128, heads=2, kv_heads=1, ffn=256, layers=1)
    out = tmp_path / "a"
    options = dataclasses.replace(QoQOptions.rtn(), key_feedback=True)
    quantize_checkpoint(QuantizeSettings(model, out, "w4a8kv4-g128", options=options, calib_path=calib_text,
                                         calib_samples=2, calib_seq_len=64))
    path = out / block_file(0)
    tensors = load_file(str(path))
    tensors["key_feedback"] = tensors["key_feedback"].transpose(1, 2).contiguous()  # lower triangular
    save_file(tensors, str(path))
    reader = ArtifactReader(out, verify=False)
    with pytest.raises(ArtifactError, match="upper triangular"):
        reader.block_key_feedback(0)
    # A well-formed factor for another model: checked against the manifest's KV heads.
    tensors["key_feedback"] = torch.eye(64).expand(2, 64, 64).contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ArtifactError, match=r"the model's keys need \(1, 64, 64\)"):
        ArtifactReader(out, verify=False).block_key_feedback(0)
