"""bench/e2e.py's merge of part files (no GPU needed): the issue's checks belong to Llama-2-7B's
shape only, and parts of different shapes are never mixed."""

from __future__ import annotations

import json

import pytest

from bench.e2e import merge


def _part(tmp_path, name, shape=None, tokens_per_s=20000.0):
    run = {"engine": "g128", "batch": 64, "tokens_per_s": tokens_per_s, "ttft_s": 0.5, "tpot_s": 0.02,
           "peak_with_context_reserve_GB": 30.0}
    part = {"command": f"python3 bench/e2e.py --out {name}", "machine": {"gpu": "test"}, "driver": "engine",
            "runs": [run], "engines": {"g128/engine": {"sizing": {"48": {"max_batch": 64}, "80": {"max_batch": 64}}}}}
    if shape:
        part["shape"] = shape
    path = tmp_path / name
    path.write_text(json.dumps(part))
    return str(path)


def test_llama2_parts_get_the_issue_checks(tmp_path):
    result = merge([_part(tmp_path, "a.json")], str(tmp_path / "out.json"), "merge")
    assert result["shape"] == "llama2-7b"
    top = next(c for c in result["checks"] if "at the best batch" in c["name"])
    assert top["value"] == 20000.0 and top["met"]


def test_other_shapes_report_figures_not_checks(tmp_path):
    result = merge([_part(tmp_path, "a.json", "llama3-8b", 9000.0)], str(tmp_path / "out.json"), "merge")
    assert result["shape"] == "llama3-8b" and result["checks"] == []
    top = next(c for c in result["figures_at_the_targets"] if "at the best batch" in c["name"])
    assert top["value"] == 9000.0 and not top["met"]


def test_parts_of_different_shapes_are_refused(tmp_path):
    parts = [_part(tmp_path, "a.json"), _part(tmp_path, "b.json", "llama3-8b")]
    with pytest.raises(SystemExit, match="different model shapes"):
        merge(parts, str(tmp_path / "out.json"), "merge")
