"""Calibration data: token windows sampled from a text file, and the record the manifest keeps."""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shared.model.text_file import TextFileError, read_text_file
from shared.model.tokenizer import Tokenizer
from shared.quant.options import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN  # noqa: F401  (re-exported)


class CalibrationError(ValueError):
    """Calibration text that cannot give the requested samples."""


@dataclass(slots=True, frozen=True)
class CalibrationRecord:
    data_name: str
    data_sha256: str
    samples: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def default_calibration_text(max_bytes: int = 2_000_000) -> tuple[str, str]:
    """-> (name, text): the running Python's standard library sources, read in a fixed order.

    Always present and offline, so a checkpoint can be quantized with no data at hand; pass a
    file of the model's own domain (--calib) for the best accuracy.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunk = path.read_text(encoding="utf-8", errors="replace")
        parts.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    return f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib", "\n".join(parts)


def load_calibration(
    path: str | Path | None,
    tokenizer: Tokenizer,
    samples: int = DEFAULT_SAMPLES,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> tuple[torch.Tensor, CalibrationRecord]:
    """-> token windows (samples, seq_len) int64 spread evenly over the text, and their record.

    path None takes default_calibration_text(). Fewer windows than asked for are used when the
    text is short (at least one is required).
    """
    if samples < 1 or seq_len < 2:
        raise CalibrationError(f"need samples >= 1 and seq_len >= 2, got samples={samples} seq_len={seq_len}")
    if path is None:
        name, text = default_calibration_text()
        raw = text.encode()
    else:
        path = Path(path)
        try:
            raw, text = read_text_file(path, "calibration file")
        except TextFileError as exc:
            raise CalibrationError(str(exc)) from None
        name = path.name
    if not text.strip():
        raise CalibrationError(f"calibration file {path} is empty")
    ids = tokenizer.encode(text)
    available = len(ids) // seq_len
    if available == 0:
        raise CalibrationError(
            f"calibration text {name} has {len(ids)} tokens, fewer than one window of seq_len={seq_len}"
        )
    take = min(samples, available)
    windows = torch.tensor(ids[: available * seq_len], dtype=torch.int64).view(available, seq_len)
    picked = windows[torch.linspace(0, available - 1, take).round().long()]
    record = CalibrationRecord(name, hashlib.sha256(raw).hexdigest(), take, seq_len)
    return picked, record
