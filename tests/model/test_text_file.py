"""Data files (calibration and eval text) are read by one rule: their bytes, strictly UTF-8."""

from __future__ import annotations

import pytest

from shared.model.text_file import TextFileError, read_text_file
from shared.quant.calibration import CalibrationError, load_calibration


def test_the_bytes_are_the_text_crlf_included(tmp_path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"a = 1\r\nb = 2\r\n")
    assert read_text_file(path, "data file") == (b"a = 1\r\nb = 2\r\n", "a = 1\r\nb = 2\r\n")


@pytest.mark.parametrize("content, error", [
    (None, "calibration file .*missing.txt does not exist"),
    (b" \n\t\n", "calibration file .* is empty"),
    ("naïve\n".encode("latin-1"), r"calibration file .* is not UTF-8 text: byte 2 is 0xef; convert it first"),
])
def test_a_missing_empty_or_non_utf8_file_is_refused_naming_it(tmp_path, content, error):
    path = tmp_path / ("missing.txt" if content is None else "data.txt")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TextFileError, match=error):
        read_text_file(path, "calibration file")
    with pytest.raises(CalibrationError, match=error):  # the quantizer's reader: the same rule
        load_calibration(path, tokenizer=None)
