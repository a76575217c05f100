"""Perplexity of the source checkpoint (fp16) and of the artifact on the eval text.

The fp16 number depends only on the checkpoint and the eval windows, so it is cached by
(model version, text sha256, seq_len, windows): a retry or another format of the same version
does not pay for it again.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.formats.artifact import ArtifactReader
from shared.model.checkpoint import HfCheckpoint
from shared.model.load import artifact_model, fp_model
from shared.model.perplexity import perplexity, windows_of
from shared.model.text_file import TextFileError, read_text_file
from shared.model.tokenizer import Tokenizer, check_token_ids

WindowProgress = Callable[[int, int], None]  # (windows done, windows total)


class EvalDataError(ValueError):
    """Eval text that cannot give one window."""


@dataclass(slots=True, frozen=True)
class EvalWindows:
    name: str
    sha256: str  # of the text file's bytes
    seq_len: int
    tokens: torch.Tensor  # (W, seq_len) int64

    @property
    def count(self) -> int:
        return self.tokens.shape[0]

    @property
    def tokens_sha256(self) -> str:
        """Of the token ids themselves: the text, the tokenizer that cut it, the window length and count."""
        shape = f"{self.count}x{self.seq_len}:".encode()
        return hashlib.sha256(shape + self.tokens.contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def eval_windows(text_file: Path, name: str, tokenizer_dir: Path, seq_len: int, max_windows: int) -> EvalWindows:
    """The text tokenized at once (no special tokens), cut into windows; the first max_windows (0 = all)."""
    try:
        raw, text = read_text_file(text_file, f"eval text {name!r}")
    except TextFileError as exc:
        raise EvalDataError(str(exc)) from None
    ids = Tokenizer(tokenizer_dir).encode(text)
    try:
        windows = windows_of(ids, seq_len)
    except ValueError as exc:
        raise EvalDataError(f"eval text {name!r}: {exc}; use a longer text or a smaller eval seq_len") from exc
    if max_windows > 0:
        windows = windows[:max_windows]
    return EvalWindows(name, hashlib.sha256(raw).hexdigest(), seq_len, windows)


def checkpoint_perplexity(checkpoint: HfCheckpoint, windows: EvalWindows, device: str,
                          progress: WindowProgress | None = None) -> float:
    check_token_ids(windows.tokens, checkpoint.config.vocab_size, f"the eval text {windows.name!r}")
    model = fp_model(checkpoint, device)
    return perplexity(model.forward, windows.tokens, device=device, progress=progress).ppl


def artifact_perplexity(artifact_dir: Path, windows: EvalWindows, device: str,
                        progress: WindowProgress | None = None) -> float:
    model = artifact_model(ArtifactReader(artifact_dir), device)  # verifies every file's sha256 first
    return perplexity(model.forward, windows.tokens, device=device, progress=progress).ppl


class Fp16PerplexityCache:
    """A small JSON file of fp16 perplexities; safe to share between the jobs of one process."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    @staticmethod
    def key(model_version: str, windows: EvalWindows) -> str:
        # The tokens, not the text: a checkpoint's model_version covers its config and weights only, and one
        # with the same weights but another tokenizer got the first one's fp16 perplexity on other tokens.
        return f"{model_version}:{windows.tokens_sha256}"

    def get(self, key: str) -> float | None:
        with self._lock:
            return self._read().get(key)

    def put(self, key: str, ppl: float) -> None:
        with self._lock:
            entries = self._read()
            entries[key] = ppl
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            tmp.replace(self.path)

    def _read(self) -> dict[str, float]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # absent or damaged: a cache miss, recomputed
            return {}
