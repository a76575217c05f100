"""The Llama architecture parameters, read once from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete or not a Llama-family model."""


def _check_keys(what: str, d: dict, cls: type) -> None:
    fields = cls.__dataclass_fields__
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise CheckpointError(f"{what} has keys this version does not know: {', '.join(unknown)} "
                              f"(written by a newer quantizer?); known: {', '.join(fields)}")
    required = [name for name, f in fields.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in d]
    if missing:
        raise CheckpointError(f"{what} lacks {', '.join(missing)}")


# This class's field names where config.json calls them otherwise, for messages.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default" (plain RoPE), "linear" (positions / factor) or "llama3" (Llama-3.1 frequency bands).
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        # A zero or negative value here gives inf/NaN RoPE frequencies, and a model that answers garbage
        # without any error: refuse it by its config.json name.
        _require_positive("rope_theta", self.theta)
        if self.type in ("linear", "llama3"):
            _require_positive("factor", self.factor)
        if self.type == "llama3":
            _check_llama3_bands(self)


def _require_positive(name: str, value) -> None:
    if not _is_number(value) or not value > 0:
        raise CheckpointError(f"{name}={value!r} must be a positive number")


def _check_llama3_bands(rope: RopeConfig) -> None:
    """Llama-3.1 RoPE divides by original_max_position_embeddings / low_freq_factor and by
    high_freq_factor - low_freq_factor: each must be positive for finite frequencies."""
    if not _is_positive_int(rope.original_max_position_embeddings):
        raise CheckpointError(f"original_max_position_embeddings={rope.original_max_position_embeddings!r} "
                              "must be a positive integer")
    _require_positive("low_freq_factor", rope.low_freq_factor)
    _require_positive("high_freq_factor", rope.high_freq_factor)
    if not rope.high_freq_factor > rope.low_freq_factor:
        raise CheckpointError(f"high_freq_factor={rope.high_freq_factor!r} must be greater than "
                              f"low_freq_factor={rope.low_freq_factor!r} for llama3 RoPE")


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        # config.json is user input: a string, a null or a zero here would fail later, deep in the arithmetic.
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise CheckpointError(f"{_HF_NAMES.get(name, name)}={value!r} must be a positive integer")
        if isinstance(self.rms_norm_eps, bool) or not isinstance(self.rms_norm_eps, (int, float)) \
                or not self.rms_norm_eps > 0:
            raise CheckpointError(f"rms_norm_eps={self.rms_norm_eps!r} must be a positive number")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim={self.head_dim} must be even for RoPE")
        if not isinstance(self.tie_word_embeddings, bool):
            # A string "false" is truthy: the model would read the embedding as its head and answer garbage.
            raise CheckpointError(f"tie_word_embeddings={self.tie_word_embeddings!r} must be true or false")
        if self.rope.type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"rope type {self.rope.type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        # Token ids index the embedding table: a negative one or one past it (or a string) passed the start-up
        # checks, which feed token ids, and failed every text prompt (BOS first) once the worker served.
        if self.bos_token_id is not None:
            _check_token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        for token in self.eos_token_ids:
            _check_token_id("eos_token_ids entry", token, self.vocab_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def window(self, asked: int | None, default: int, option: str, what: str) -> int:
        """A window of tokens to score or calibrate on (`what`: "an eval", "a calibration"): `asked` if the
        model serves that many positions, else refused naming `option` (positions past max_position_embeddings
        were never trained nor are they served: a perplexity or scales fitted over them would be plausible
        numbers about nothing); none asked: `default`, or the whole context if that is shorter."""
        context = self.max_position_embeddings
        if asked is None:
            return min(default, context)
        if asked > context:
            raise ValueError(f"{option} {asked}: {what} window of {asked} tokens exceeds the model's context of "
                             f"{context} tokens (config.json max_position_embeddings); give at most {context}")
        return asked

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """The inverse of to_dict (an artifact manifest's model_config). A key this code does not know (a
        newer quantizer's) or a missing one is refused by name: a guess could run the model wrongly."""
        d = dict(d)
        _check_keys("model_config", d, cls)
        rope, eos = d.get("rope", {}), d.get("eos_token_ids", ())
        # Other JSON types were TypeErrors below (iterating a number or a null): refused by name instead.
        if not isinstance(rope, dict):
            raise CheckpointError(f"model_config.rope={rope!r} must be an object")
        if not isinstance(eos, (list, tuple)):
            raise CheckpointError(f"model_config.eos_token_ids={eos!r} must be a list of token ids")
        _check_keys("model_config.rope", rope, RopeConfig)
        d["rope"] = RopeConfig(**rope)
        d["eos_token_ids"] = tuple(eos)
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        _check_llama_family(hf)
        _check_not_prequantized(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act={hf['hidden_act']!r} is not supported; expected 'silu'")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise CheckpointError("attention_bias / mlp_bias checkpoints are not supported")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or _per_head(hf["hidden_size"], heads),
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=False if hf.get("tie_word_embeddings") is None else hf["tie_word_embeddings"],
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope=_rope_from_hf(hf),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "LlamaConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} has no config.json; expected a Hugging Face checkpoint folder")
        try:
            hf = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(hf, dict):
            raise CheckpointError(f"{path} is not a JSON object; expected a Hugging Face model configuration")
        try:
            return cls.from_hf(hf)
        except KeyError as e:
            raise CheckpointError(f"{path} lacks required key {e.args[0]!r}") from e


def _check_token_id(name: str, value, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise CheckpointError(f"{name} {value!r} is not a token id of the vocabulary [0, {vocab_size})")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    """A finite JSON number (JSON's NaN and Infinity pass json.loads, and bool is an int in Python)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _per_head(hidden_size, heads) -> int:
    """hidden_size / heads; 0 (refused by LlamaConfig, naming the bad value) when either is not a positive int."""
    return hidden_size // heads if _is_positive_int(hidden_size) and _is_positive_int(heads) else 0


def _check_llama_family(hf: dict) -> None:
    """transformers builds the class that model_type names, whatever `architectures` says (a
    model_type 'mistral' folder listing LlamaForCausalLM runs as Mistral, sliding window and all):
    model_type must be 'llama'; only a config without one is judged by its architectures."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type == "llama" or (model_type is None and any(a in SUPPORTED_ARCHITECTURES for a in archs)):
        return
    raise CheckpointError(
        f"model_type={model_type!r} architectures={archs} is not a Llama-family "
        f"checkpoint; supported: model_type 'llama' ({', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _check_not_prequantized(hf: dict) -> None:
    """An FP8/GPTQ/AWQ/bitsandbytes checkpoint stores codes whose meaning is in scales beside them
    (or in other tensor names): read as plain weights they would be quantized and served as garbage."""
    qc = hf.get("quantization_config")
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise CheckpointError(
            f"config.json has a quantization_config (quant_method={method!r}): this is a pre-quantized checkpoint; "
            "give the original fp16/bf16/fp32 weights"
        )


def _rope_from_hf(hf: dict) -> RopeConfig:
    # transformers >= 5 nests everything under rope_parameters; older configs use rope_theta + rope_scaling.
    params = _rope_section(hf, "rope_parameters")
    scaling = _rope_section(hf, "rope_scaling")
    if params and scaling:
        # Both, e.g. a context extension added by the long-documented key to a transformers-5 config:
        # transformers 5 takes rope_scaling whole (rope_parameters' theta too is dropped), a merge would take
        # rope_parameters' entries. Unless both say the same, the model's RoPE is ambiguous: refused.
        from_params, from_scaling = _rope_of(hf, params, "rope_parameters"), _rope_of(hf, scaling, "rope_scaling")
        if from_params != from_scaling:
            raise CheckpointError(
                f"config.json gives RoPE twice, and differently: rope_parameters={params!r} and "
                f"rope_scaling={scaling!r} (read as {from_params} and {from_scaling}); versions of transformers "
                f"read such a config differently: keep one of the two")
        return from_params
    return _rope_of(hf, params, "rope_parameters") if params else _rope_of(hf, scaling, "rope_scaling")


def _rope_of(hf: dict, rope: dict, section: str) -> RopeConfig:
    def number(key: str, default) -> float:
        # Named as config.json places it, so the user knows which entry to fix.
        return _hf_number(f"{section}.{key}" if key in rope else key, rope.get(key, default))

    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _check_full_rotary(hf, rope)
    return RopeConfig(
        theta=number("rope_theta", hf.get("rope_theta", 10000.0)),
        type=rope_type,
        factor=number("factor", 1.0),
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        original_max_position_embeddings=_original_length(hf, rope),
    )


def _rope_section(hf: dict, key: str) -> dict:
    """rope_parameters / rope_scaling: an object, or null (or absent) for none."""
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{key}={value!r} must be a JSON object or null")
    return dict(value)


def _hf_number(name: str, value) -> float:
    """A RoPE number of config.json as float; a null, a string or a list would be a TypeError in float()."""
    if not _is_number(value):
        raise CheckpointError(f"{name}={value!r} must be a positive number")
    return float(value)


def _original_length(hf: dict, rope: dict) -> int:
    """The pre-training context length of llama3 RoPE, as transformers' standardize_rope_params
    resolves it: a top-level original_max_position_embeddings wins over the RoPE parameters' own,
    and with neither it is max_position_embeddings (not Llama-3.1's 8192)."""
    for value in (hf.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings")):
        if value is not None:
            return _hf_int("original_max_position_embeddings", value)
    return _hf_int("max_position_embeddings", hf.get("max_position_embeddings", 2048))


def _hf_int(name: str, value) -> int:
    """A positive whole number of config.json (8192.0 too, as int() took it before); refused by name otherwise."""
    if not _is_number(value) or not value > 0 or value != int(value):
        raise CheckpointError(f"{name}={value!r} must be a positive integer")
    return int(value)


def _check_full_rotary(hf: dict, rope: dict) -> None:
    """Llama rotates whole heads. transformers ignores partial_rotary_factor for default RoPE and
    fails on it for scaled RoPE, so a checkpoint carrying one was trained by other code: refuse it
    rather than rotate dimensions it never rotated."""
    for value in (rope.get("partial_rotary_factor"), hf.get("partial_rotary_factor")):
        if value is not None and value != 1.0:  # not float(value): a list or a string would be a TypeError
            raise CheckpointError(f"partial_rotary_factor={value} is not supported; Llama applies RoPE to the whole head")
