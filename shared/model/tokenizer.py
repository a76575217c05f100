"""Loads a checkpoint's tokenizer from its folder, offline."""

from __future__ import annotations

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
            from transformers import AutoTokenizer

            self._fast = None
            self._hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        else:
            raise CheckpointError(f"{folder} has no tokenizer.json or tokenizer.model")

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids)


def check_token_ids(ids: torch.Tensor, vocab_size: int, source: str) -> None:
    """A tokenizer of another model gives ids past the model's embedding table: say so instead of an
    IndexError deep inside the forward."""
    top = int(ids.max()) if ids.numel() else -1
    if top >= vocab_size:
        raise CheckpointError(f"the tokenizer gives token id {top} for {source}, beyond the model's vocabulary of "
                              f"{vocab_size} (config.json vocab_size): is the tokenizer another model's?")

