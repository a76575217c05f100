"""The kernel policy table: its schema, the table shipped for the H200, and artifacts carrying it."""

from __future__ import annotations

import re

import pytest

from services.worker.engine.kernel_policy import GemmPolicy
from services.worker.kernels import w4a8_gemm
from shared.formats.artifact import ArtifactReader
from shared.formats.kernel_policy import KernelPolicyError, from_best_variant, parse_policy, shipped_policy
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from tests.conftest import write_random_llama


def test_best_variants_become_rows_covering_every_m():
    best = {"w4chn": {"4096x4096": {"16": "chn.n128m16.sk", "1": "chn.n64m16.sk", "256": "chn.n128m128"}}}
    table = from_best_variant(best)
    assert table["gemm"]["w4chn"]["4096x4096"] == [[1, "chn.n64m16.sk"], [16, "chn.n128m16.sk"], [None, "chn.n128m128"]]
    policy = GemmPolicy.from_manifest(table)
    assert [policy.variant("w4chn", 4096, 4096, m) for m in (1, 2, 16, 17, 5000)] == [
        "chn.n64m16.sk", "chn.n128m16.sk", "chn.n128m16.sk", "chn.n128m128", "chn.n128m128"]
    # A shape the table does not cover gets the kernels' default.
    assert policy.variant("w4chn", 1024, 4096, 16) == w4a8_gemm.default_variant_name(16, "w4chn")


@pytest.mark.parametrize("table, says", [
    ({"gemm": {"w9": {}}}, "unknown weight kind 'w9'"),
    ({"gemm": {"w4chn": {"4096by4096": []}}}, "shape key '4096by4096' is not '<N>x<K>'"),
    ({"gemm": {"w4chn": {"64x64": [[1]]}}}, "entry [1] is not [max_M or null, variant]"),
    ({"gemm": []}, "must be a mapping"),
])
def test_a_malformed_table_is_refused_naming_the_entry(table, says):
    with pytest.raises(KernelPolicyError, match=re.escape(says)):
        parse_policy(table)


def test_the_worker_refuses_a_variant_of_another_weight_kind():
    with pytest.raises(KernelPolicyError, match="reads w4g128p weights"):
        GemmPolicy.from_manifest({"gemm": {"w4chn": {"64x64": [[None, "g128.n128m16.sk.zp"]]}}})


def test_the_h200_table_names_only_variants_the_kernels_have():
    table = shipped_policy("sm90")
    assert table is not None and set(table["gemm"]) == {"w4g128p", "w4chn"}
    policy = GemmPolicy.from_manifest(table)  # raises on an unknown variant
    assert ("w4chn", 22016, 4096) in policy.rows and ("w4g128p", 4096, 11008) in policy.rows
    assert shipped_policy("cpu") is None


@pytest.mark.parametrize("target, fmt, expect_table", [("sm90", "w4a8kv4-chn", True), ("cpu", "w4a8kv4-chn", False),
                                                        ("sm90", "fp16", False)])
def test_the_quantizer_puts_the_targets_table_into_the_manifest(tmp_path, target, fmt, expect_table):
    model = write_random_llama(tmp_path / "model")
    out = tmp_path / "artifact"
    quantize_checkpoint(QuantizeSettings(model, out, fmt, gpu_target=target, options=QoQOptions.rtn(),
                                         calib_samples=2, calib_seq_len=32))
    manifest = ArtifactReader(out).manifest
    assert (manifest.kernel_policy == shipped_policy(target)) if expect_table else manifest.kernel_policy is None


def test_a_shape_or_m_the_table_misses_gets_the_default_and_one_log_line(caplog):
    table = {"gemm": {"w4chn": {"4096x4096": [[16, "chn.n64m16.sk"]]}}}
    policy = GemmPolicy.from_manifest(table)
    with caplog.at_level("WARNING", logger="services.worker.engine.kernel_policy"):
        assert policy.variant("w4chn", 4096, 4096, 8) == "chn.n64m16.sk"
        assert not caplog.records
        assert policy.variant("w4chn", 4096, 4096, 300) == w4a8_gemm.default_variant_name(300, "w4chn")
        assert policy.variant("w4chn", 4096, 4096, 400) == w4a8_gemm.default_variant_name(400, "w4chn")
        assert policy.variant("w4chn", 1024, 4096, 1) == w4a8_gemm.default_variant_name(1, "w4chn")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # once per shape, not once per call
    assert "4096x4096" in lines[0] and "covers no M = 300" in lines[0]
    assert "1024x4096" in lines[1] and "has no rows" in lines[1]


def test_a_row_naming_a_variant_that_cannot_run_its_m_says_so(caplog):
    """A table row whose variant cannot take that M (here a GEMV for a 32-token step) falls back to the default;
    the log line named it "covers no M", sending the reader to the wrong row."""
    table = {"gemm": {"w4g128p": {"4096x4096": [[64, "g128.gemv.n4m1g16"]]}}}
    policy = GemmPolicy.from_manifest(table)
    with caplog.at_level("WARNING", logger="services.worker.engine.kernel_policy"):
        assert policy.variant("w4g128p", 4096, 4096, 32) == w4a8_gemm.default_variant_name(32, "w4g128p")
    (line,) = [r.getMessage() for r in caplog.records]
    assert "names g128.gemv.n4m1g16 for M = 32, which cannot run it" in line and "exceeds 1" in line


@pytest.mark.parametrize("table, complaint", [
    ({"Gemm": {}}, "unknown key"),  # misspelt: an empty table, every shape on the default
    ({"gemm": {"w4chn": {"04096x4096": [[None, "chn.n128m128"]]}}}, "leading zeros"),
    ({"gemm": {"w4chn": {"0x4096": [[None, "chn.n128m128"]]}}}, "positive"),
    ({"gemm": {"w4chn": {"4096x4096": [[0, "chn.n128m16.sk"], [None, "chn.n128m128"]]}}}, "at least 1"),
    ({"gemm": {"w4chn": {"4096x4096": [[16, "chn.n128m16.sk"], [16, "chn.n128m128"]]}}}, "distinct"),
    ({"gemm": {"w4chn": {"4096x4096": [[None, "chn.n128m16.sk"], [None, "chn.n128m128"]]}}}, "at most one null"),
])
def test_tables_with_rows_that_cannot_mean_what_they_say_are_refused(table, complaint):
    with pytest.raises(KernelPolicyError, match=complaint):
        parse_policy(table)


def test_an_unknown_variant_is_refused_naming_its_entry():
    with pytest.raises(KernelPolicyError, match=r"kernel_policy.gemm.w4chn.4096x4096: unknown variant 'chn.n1m1'"):
        GemmPolicy.from_manifest({"gemm": {"w4chn": {"4096x4096": [[None, "chn.n1m1"]]}}})
