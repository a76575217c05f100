"""Loads a checkpoint's tokenizer from its folder, offline."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import torch

from shared.model.config import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "generation_config.json")


class Tokenizer:
    """encode(text) -> ids with no special tokens added; decode(ids) -> text."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as FastTokenizer

            try:
                self._fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
                raise CheckpointError(f"{folder / 'tokenizer.json'} is not a readable tokenizer: {e}") from e
            self._hf = None
        elif (folder / "tokenizer.model").is_file() or (folder / "tokenizer_config.json").is_file():
            self._fast = None
            self._hf = _transformers_tokenizer(folder)
        else:
            raise CheckpointError(f"{folder} has no tokenizer.json or tokenizer.model")
        self._check_encodes(folder)

    def _check_encodes(self, folder: Path) -> None:
        """A tokenizer with no vocabulary (transformers builds one from a lone tokenizer_config.json) encodes
        every text to no ids: calibration and eval would then fail far from the cause, or score nothing."""
        if not self.encode(_PROBE_TEXT):
            raise CheckpointError(f"the tokenizer of {folder} encodes {_PROBE_TEXT!r} to no tokens: it has no "
                                  "vocabulary; add the checkpoint's tokenizer.json")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def template_adds_bos(self, bos_token_id: int) -> bool:
        """Whether encoding with special tokens (what transformers' tokenizer(prompt) does) starts the
        ids with BOS: Llama-3's tokenizer.json adds <|begin_of_text|> in its post-processor, and its
        tokenizer_config.json says nothing about it."""
        with_template = self.encode("a", add_special_tokens=True)
        return with_template[:1] == [bos_token_id] and self.encode("a")[:1] != [bos_token_id]

    def vocabulary_digest(self) -> str:
        """sha256 of the id -> token table, added tokens included: two tokenizers with the same digest give
        token ids the same meaning, whatever else their files say (a chat template, a default length)."""
        table = json.dumps(sorted((int(i), str(t)) for t, i in self._vocab().items()), ensure_ascii=False)
        return hashlib.sha256(table.encode()).hexdigest()

    def longest_token_chars(self) -> int:
        """The most characters one token of the vocabulary stands for (its table's longest entry, at least 1):
        a text longer than the context window times this cannot fit the window, however it encodes."""
        return max((len(t) for t in self._vocab()), default=1) or 1

    def _vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        return self._fast.get_vocab(with_added_tokens=True) if self._fast is not None else self._hf.get_vocab()

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids)


_PROBE_TEXT = "def main():"


def _transformers_tokenizer(folder: Path):
    """A tokenizer without tokenizer.json, through transformers. Its SentencePiece reader needs the
    sentencepiece package, which is no dependency of ours; without it transformers falls back to a tiktoken
    reader and fails with a message about tiktoken, so say what is really missing."""
    if (folder / "tokenizer.model").is_file() and importlib.util.find_spec("sentencepiece") is None:
        raise CheckpointError(f"{folder} has only tokenizer.model (SentencePiece) and no tokenizer.json: install the "
                              "sentencepiece package, or add the checkpoint's tokenizer.json")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises ValueError, OSError, ImportError... with multi-line messages
        raise CheckpointError(f"{folder} has no tokenizer.json and transformers cannot load its tokenizer: "
                              f"{' '.join(str(e).split())}") from e


def check_token_ids(ids: torch.Tensor, vocab_size: int, source: str) -> None:
    """A tokenizer of another model gives ids past the model's embedding table: say so instead of an
    IndexError deep inside the forward."""
    top = int(ids.max()) if ids.numel() else -1
    if top >= vocab_size:
        raise CheckpointError(f"the tokenizer gives token id {top} for {source}, beyond the model's vocabulary of "
                              f"{vocab_size} (config.json vocab_size): is the tokenizer another model's?")



def prompt_adds_bos(folder: str | Path, tokenizer: Tokenizer, bos_token_id: int | None) -> bool:
    """Whether a text prompt gets BOS in front, as transformers' tokenizer(prompt) would give the model:
    tokenizer_config.json's add_bos_token where it says (Llama-2), else the tokenizer's own template
    (Llama-3). A model that was trained with BOS first and is served without it answers worse."""
    if bos_token_id is None:
        return False
    config = _json_object(Path(folder) / "tokenizer_config.json")
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    return tokenizer.template_adds_bos(bos_token_id)


def generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids of generation_config.json, which transformers' generate stops on and
    config.json may lack: Llama-3 Instruct ends a turn with <|eot_id|>, which only the generation config
    of some checkpoints names."""
    eos = _json_object(Path(folder) / "generation_config.json").get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _json_object(path: Path) -> dict:
    """A tokenizer-side JSON file's object; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value
