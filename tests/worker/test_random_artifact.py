"""bench/random_model.RandomArtifact stands in for ArtifactReader in the GPU speed benchmarks (bench/e2e.py,
bench/e2e_check.py), which CI never runs: this keeps it loadable by the engine on the CPU."""

from __future__ import annotations

import inspect

import torch

from bench.random_model import RandomArtifact
from services.worker.engine.gpu_weights import load_weights
from shared.formats.artifact import ArtifactReader
from shared.model.config import LlamaConfig

TINY = LlamaConfig(hidden_size=256, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                   vocab_size=64, rms_norm_eps=1e-5, max_position_embeddings=256)


def test_random_artifact_has_every_per_block_reader_of_the_real_one():
    """A per-block tensor added to artifacts (as the key feedback factor was, session 26) must be added here
    too: the weight loader asks every reader for it."""
    real = {n for n, _ in inspect.getmembers(ArtifactReader, inspect.isfunction) if n.startswith("block")}
    assert real and real <= set(dir(RandomArtifact)), sorted(real - set(dir(RandomArtifact)))


def test_the_engine_loads_a_random_artifact_of_each_served_format():
    for fmt in ("w4a8kv4-g128", "w4a8kv4-chn", "fp16"):
        weights = load_weights(RandomArtifact(TINY, fmt, torch.device("cpu")), torch.device("cpu"))
        assert len(weights.layers) == TINY.num_layers, fmt
        assert all(layer.key_feedback is None for layer in weights.layers)
