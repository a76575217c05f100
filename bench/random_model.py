"""A random-weight Llama as an in-memory artifact (ArtifactReader's reading interface), made on the GPU.

For speed benchmarks only: weights are N(0, 1/fan_in) fp16, packed per format with the
round-to-nearest packers of shared/quant/weights.py on the device (no calibration, no QoQ
transforms), so a 7B-shaped model is ready in seconds without touching the disk. Every call of
`block(i)` returns the same weights (a per-layer seed), so a reference model built from the same
object matches the runner's.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from shared.formats.kv4 import FULL_KV_RANGE
from shared.formats.spec import format_spec
from shared.formats.weights import Fp16Weight
from shared.model.config import LlamaConfig, RopeConfig
from shared.quant.weights import WEIGHT_QUANTIZERS

LLAMA2_7B = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                        head_dim=128, vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=4096)
# Llama-3-8B's shape: grouped-query attention (8 KV heads for 32 query heads, the decode kernels'
# group 4), FFN 14336, a 128k vocabulary, RoPE theta 500000.
LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=8192,
                        rope=RopeConfig(theta=500000.0))
SHAPES = {"llama2-7b": LLAMA2_7B, "llama3-8b": LLAMA3_8B}


class RandomArtifact:
    def __init__(self, config: LlamaConfig, fmt: str, device: torch.device, seed: int = 0,
                 kernel_policy: dict | None = None):
        self.config = config
        self.spec = format_spec(fmt)
        self.device = torch.device(device)
        self.seed = seed
        self.manifest = SimpleNamespace(format=fmt, model_config=config.to_dict(), kernel_policy=kernel_policy)
        self._quantize = WEIGHT_QUANTIZERS[self.spec.weight_kind][0]

    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(self.seed * 100_003 + salt)

    def _rand(self, g, *shape, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32) * std).half()

    def embed(self) -> torch.Tensor:
        c = self.config
        return self._rand(self._gen(1), c.vocab_size, c.hidden_size, std=1.0)

    def head(self):
        c = self.config
        g = self._gen(2)
        final_norm = 1 + self._rand(g, c.hidden_size, std=0.05).float()
        return final_norm.half(), Fp16Weight(self._rand(g, c.vocab_size, c.hidden_size, std=c.hidden_size**-0.5))

    def block(self, i: int):
        c = self.config
        g = self._gen(10 + i)
        h, f = c.hidden_size, c.intermediate_size
        norms = {"attn_norm": 1 + self._rand(g, h, std=0.05), "mlp_norm": 1 + self._rand(g, h, std=0.05)}
        shapes = {"qkv": (c.q_size + 2 * c.kv_size, h), "o": (h, c.q_size), "gate_up": (2 * f, h), "down": (h, f)}
        linears = {}
        for name, (n, k) in shapes.items():
            w = self._rand(g, n, k, std=k**-0.5)
            linears[name] = self._quantize(w)
            del w
        return {k: v.half() for k, v in norms.items()}, linears

    def block_kv_range(self, i: int) -> tuple[float, float]:
        """K and V range ratios of a KV4 layer: those QoQ picks on the trained fixture (V narrowed to
        0.925 in every layer), so the benchmark's cache write takes the path real artifacts take."""
        return (1.0, 0.925) if self.spec.kv_bits == 4 else FULL_KV_RANGE

    def block_key_feedback(self, i: int) -> None:
        """No key error-feedback factor: keys rounded to nearest, as in a default (`qctl quantize`) artifact."""
        return None
