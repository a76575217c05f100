"""QoQ options: which steps run and with what settings. Parsed once (CLI or gRPC), passed down."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Calibration windows sampled from the text, and their length in tokens. Here, beside the other
# options, rather than in shared.quant.calibration (which re-exports them): that module imports torch,
# and qctl's option defaults must not load it into every command.
DEFAULT_SAMPLES = 64
DEFAULT_SEQ_LEN = 512


@dataclass(slots=True, frozen=True)
class QoQOptions:
    rotation: bool = True  # Hadamard rotation of block inputs, folded into weights
    rotate_values: bool = True  # per-head rotation of V folded into v_proj / o_proj (beyond QServe)
    smooth_attention: bool = True  # scale K channels down (and Q up) before KV4
    smooth_attention_alpha: float = 0.5
    # Search lambda = max|K|^a / max|Q|^b per layer for the least KV4 logit error (beyond QServe,
    # which fixes a = smooth_attention_alpha, b = 0); off: the fixed QServe rule.
    smooth_attention_search: bool = True
    # Per-layer KV4 range ratio of V, searched on calibration tokens (beyond QServe; see
    # shared/quant/kv_range.py). Costs nothing at run time: a multiply and an add in the cache write.
    kv_range_search: bool = True
    # KV4 keys rounded with error feedback against the layer's query statistics (beyond QServe; see
    # shared/quant/key_feedback.py). Off by default: the cache write then runs a D-step dependent
    # loop per key, measured on an H200 at 2.9x / 9.4x the plain write for 1024 / 4096-token prefill
    # chunks (bench/results/h200/kv_write_feedback.json). Fixture, mean of seeds 0-2: g128 5.1105 ->
    # 5.1022, chn 5.1313 -> 5.1229 (bench/results/accuracy_seeds.json).
    key_feedback: bool = False
    smoothing: bool = True  # per-channel smoothing of o_proj and down_proj inputs, alpha searched
    reorder: bool = True  # activation-aware channel reordering of down_proj inputs (group formats)
    clipping: bool = True  # weight clip ratios searched to minimize output error
    gptq: bool = True  # error-compensated rounding (beyond QServe's recipe; measured in the accuracy table)
    gptq_act_order: bool = True  # GPTQ rounds the most active input channels first
    # Fit each linear to its fp output from the quantized block's own inputs to it (int8
    # activations, KV4 with the layer's range ratios, the block's linears before it already
    # quantized), then round (beyond QServe). Measured on the fixture (session 7): g128 5.1167 ->
    # 5.1108 (1.0193 x fp16), chn 5.1311 -> 5.1293, for ~2x the quantize time (74 s vs 37 s, 2 cores).
    compensate_inputs: bool = True
    # Ridge of that fit toward the original weight, of the mean Hessian diagonal. Measured on the
    # fixture: 0.01 gains more on g128 (5.1155 vs 5.1228) but loses on chn (5.1411 vs 5.1343).
    compensate_ridge: float = 0.1
    clip_min_ratio: float = 0.5
    clip_steps: int = 20  # candidate ratios between clip_min_ratio and 1
    search_tokens: int = 2048  # calibration tokens used by the smoothing and clipping searches
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.smooth_attention_alpha <= 1.0:
            raise ValueError(f"smooth_attention_alpha must be in [0, 1], got {self.smooth_attention_alpha}")
        if not 0.0 < self.clip_min_ratio <= 1.0:
            raise ValueError(f"clip_min_ratio must be in (0, 1], got {self.clip_min_ratio}")
        if self.compensate_ridge <= 0:
            raise ValueError(f"compensate_ridge must be positive, got {self.compensate_ridge}")
        if self.clip_steps < 1 or self.search_tokens < 1:
            raise ValueError("clip_steps and search_tokens must be positive")

    @classmethod
    def rtn(cls) -> "QoQOptions":
        """Plain round-to-nearest: every QoQ step off."""
        return cls(rotation=False, rotate_values=False, smooth_attention=False, kv_range_search=False, smoothing=False,
                   reorder=False, clipping=False, gptq=False, compensate_inputs=False, key_feedback=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QoQOptions":
        return cls(**d)
