"""Text files read as data (calibration, evaluation): one rule for every reader.

The bytes are decoded as they are, strictly UTF-8: the sha256 recorded for a file (an artifact's calibration, an
eval's) is of those bytes, so the text scored must be theirs too. `qctl eval` once read with Python's universal
newlines (CRLF became LF) while the quantizer's eval kept the bytes: one CRLF file scored 7.16 in one and 93.45 in
the other. Bytes that are not UTF-8 were replaced by U+FFFD and scored without a word."""

from __future__ import annotations

from pathlib import Path


class TextFileError(ValueError):
    """A data file that is missing, empty, or not UTF-8 text; the message names it."""


def read_text_file(path: str | Path, what: str) -> tuple[bytes, str]:
    """-> (the file's bytes, its text). `what` names the file in errors, e.g. "calibration file"."""
    path = Path(path)
    if not path.is_file():
        raise TextFileError(f"{what} {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TextFileError(
            f"{what} {path} is not UTF-8 text: byte {exc.start} is 0x{raw[exc.start]:02x}; convert it first "
            f"(e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise TextFileError(f"{what} {path} is empty")
    return raw, text
