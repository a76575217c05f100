"""The Triton runner (under the interpreter) on checkpoints whose config reaches its kernels: RoPE
scaling and a head_dim other than hidden_size / heads. It computes what the reference forward
computes, or refuses the artifact when it is constructed (the worker's start), never at a request.

Reuses the chunked-prefill-and-decode steps of test_triton_runner.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_triton_runner import TOLERANCE, _errors, _run_steps  # noqa: E402  (sets TRITON_INTERPRET)

from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings  # noqa: E402
from shared.formats.artifact import ArtifactReader  # noqa: E402
from shared.model.load import artifact_model  # noqa: E402
from shared.quant.options import QoQOptions  # noqa: E402
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint  # noqa: E402
from tests.model.test_checkpoint_families import save_hf_llama  # noqa: E402

# _run_steps draws tokens below 512 and serves 32 positions.
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _artifact(tmp_path, fmt: str, **config) -> ArtifactReader:
    model = save_hf_llama(tmp_path / "model", scale=0.05, **{**SHAPE, **config})
    quantize_checkpoint(QuantizeSettings(model_dir=model, out_dir=tmp_path / "art", format=fmt, options=QoQOptions.rtn()))
    return ArtifactReader(tmp_path / "art")


@pytest.mark.parametrize(
    "fmt,config",
    [
        ("fp16", dict(rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0})),
        # original length 8 puts every frequency of the 32 served positions in a scaled or blended band
        ("fp16", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
        ("fp16", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)),
        ("w4a8kv4-g128", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                              rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0})),
    ],
    ids=["fp16-rope-linear", "fp16-rope-llama3", "fp16-explicit-head-dim", "g128-explicit-head-dim-rope-linear"],
)
def test_rope_scaling_and_explicit_head_dim_match_reference(tmp_path, fmt, config):
    reader = _artifact(tmp_path, fmt, **config)
    tokens, got = _run_steps(reader)
    for (s, pos), err in _errors(artifact_model(reader), tokens, got).items():
        assert err < TOLERANCE[fmt], f"seq {s} position {pos}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "config",
    [dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2),  # head_dim 16: the chunk kernel needs >= 32
     dict(hidden_size=96, num_attention_heads=2, num_key_value_heads=1)],  # head_dim 48: not a power of two
    ids=["head-dim-16", "head-dim-48"],
)
def test_head_dims_the_kernels_cannot_take_are_refused_at_start(tmp_path, config):
    """Before the check, head_dim 16 served first prompts and then failed at the first cached-prefix
    chunk, and head_dim 48 failed at the first request."""
    reader = _artifact(tmp_path, "fp16", **config)
    with pytest.raises(ValueError, match=f"head_dim {reader.manifest.model_config['head_dim']} is not supported"):
        TritonRunner(reader, "cpu", 4, TritonRunnerSettings(max_model_len=32, cuda_graphs=False))
