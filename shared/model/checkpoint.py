"""Reads a Hugging Face Llama checkpoint one tensor at a time, so a block can be loaded alone."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.model.config import CheckpointError, LlamaConfig

# safetensors dtype codes of weights the loader takes as they are (cast to fp32 or fp16 later).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

HF_BLOCK_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


@dataclass(slots=True)
class FpBlock:
    """One decoder block's original weights, (out, in) as in nn.Linear."""

    input_norm: torch.Tensor  # (H,)
    post_attn_norm: torch.Tensor  # (H,)
    q: torch.Tensor  # (heads*D, H)
    k: torch.Tensor  # (kv_heads*D, H)
    v: torch.Tensor  # (kv_heads*D, H)
    o: torch.Tensor  # (H, heads*D)
    gate: torch.Tensor  # (F, H)
    up: torch.Tensor  # (F, H)
    down: torch.Tensor  # (H, F)

    def to(self, device=None, dtype=None) -> "FpBlock":
        return FpBlock(**{n: getattr(self, n).to(device=device, dtype=dtype) for n in HF_BLOCK_NAMES})


class HfCheckpoint:
    """A Llama checkpoint folder: config.json plus model.safetensors or sharded safetensors with an index."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"checkpoint folder {self.folder} does not exist")
        self.config = LlamaConfig.from_folder(self.folder)
        self._file_of = self._index_tensors()
        self._check_complete()

    def _index_tensors(self) -> dict[str, Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return {name: self.folder / fname for name, fname in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(
                    f"{index} is not a valid shard index (a JSON object whose weight_map maps tensor names "
                    f"to files): {type(e).__name__}: {e}"
                ) from e
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in self.folder.iterdir())
            raise CheckpointError(
                f"{self.folder} has no *.safetensors weights (found: {', '.join(found) or 'nothing'}); "
                "only safetensors checkpoints are supported"
            )
        mapping = {}
        for f in files:
            try:
                with safe_open(f, "pt") as st:
                    mapping.update({name: f for name in st.keys()})
            except Exception as e:  # safetensors raises several types for a damaged header
                raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from e
        return mapping

    def _check_complete(self) -> None:
        c = self.config
        required = ["model.embed_tokens.weight", "model.norm.weight"]
        required += [f"model.layers.{i}.{n}" for i in range(c.num_layers) for n in HF_BLOCK_NAMES.values()]
        if not c.tie_word_embeddings:
            required.append("lm_head.weight")
        missing = [n for n in required if n not in self._file_of]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise CheckpointError(f"{self.folder} lacks tensors {', '.join(missing[:3])}{more}")
        for f in set(self._file_of.values()):
            if not f.is_file():
                raise CheckpointError(f"{self.folder}: shard {f.name} named by the index is missing")
        self._check_dtypes(required)

    def _check_dtypes(self, names: list[str]) -> None:
        """Refuses integer or float8 weights from the headers, before a tensor is read: they are codes
        of a pre-quantized checkpoint whose scales live elsewhere, and a cast to float would take
        them for weights."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        for path, in_file in sorted(by_file.items()):
            try:
                with safe_open(path, "pt") as st:
                    dtypes = {name: st.get_slice(name).get_dtype() for name in in_file}
            except Exception as e:  # a damaged header, or an index naming a tensor its shard lacks
                raise CheckpointError(f"cannot read the tensor headers of {path}: {e}") from e
            for name, dtype in dtypes.items():
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(
                        f"{name} is stored as {dtype}; only {', '.join(FLOAT_DTYPES)} weights are supported "
                        "(a pre-quantized checkpoint?)"
                    )

    def tensor(self, name: str) -> torch.Tensor:
        try:
            with safe_open(self._file_of[name], "pt") as st:
                t = st.get_tensor(name)
        except KeyError:
            raise CheckpointError(f"{self.folder} has no tensor {name!r}") from None
        except Exception as e:
            raise CheckpointError(f"cannot read {name!r} from {self._file_of[name]}: {e}") from e
        expected = self._expected_shape(name)
        if expected is not None and tuple(t.shape) != expected:
            raise CheckpointError(f"{name} has shape {tuple(t.shape)}, config.json implies {expected}")
        return t

    def _expected_shape(self, name: str) -> tuple[int, ...] | None:
        c = self.config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, c.hidden_size)
        shapes = {
            "input_layernorm.weight": (c.hidden_size,),
            "post_attention_layernorm.weight": (c.hidden_size,),
            "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        for suffix, shape in shapes.items():
            if name.endswith(suffix):
                return shape
        return None

    def embed_tokens(self) -> torch.Tensor:
        return self.tensor("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        return self.tensor("model.norm.weight")

    def lm_head(self) -> torch.Tensor:
        if not self.config.tie_word_embeddings:
            return self.tensor("lm_head.weight")
        embed = self.embed_tokens()
        # Tied, yet holding a head of its own that differs: transformers 5 warns and runs that head, older
        # versions ran the embedding. Which model is meant is not ours to guess.
        if "lm_head.weight" in self._file_of and not torch.equal(self.tensor("lm_head.weight"), embed):
            raise CheckpointError(
                f"{self.folder / 'config.json'} ties the word embeddings (tie_word_embeddings: true), but the "
                f"checkpoint holds an lm_head.weight that differs from model.embed_tokens.weight: set "
                f"tie_word_embeddings to false to use that head, or remove it to use the embeddings")
        return embed

    def block(self, i: int) -> FpBlock:
        if not 0 <= i < self.config.num_layers:
            raise IndexError(f"block {i} out of range 0..{self.config.num_layers - 1}")
        return FpBlock(**{k: self.tensor(f"model.layers.{i}.{n}") for k, n in HF_BLOCK_NAMES.items()})

    def content_hash(self) -> str:
        """sha256 over config.json and every weight file: the model version an artifact is bound to."""
        h = hashlib.sha256()
        for path in [self.folder / "config.json", *sorted(set(self._file_of.values()))]:
            h.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()
