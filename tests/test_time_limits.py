"""The rule that decides whether the acceptance tests' time limits are asserted on this host."""

from __future__ import annotations

import pytest

from tests import time_limits


def test_a_fast_host_fails_a_slow_job(monkeypatch):
    monkeypatch.setattr(time_limits, "gemm_gflops", lambda: 250.0)
    time_limits.assert_within(90.0, 120.0, "quantize")
    with pytest.raises(AssertionError, match="quantize took 130 s .limit 120 s; host GEMM 250"):
        time_limits.assert_within(130.0, 120.0, "quantize")


def test_a_slow_host_reports_instead_of_asserting(monkeypatch):
    monkeypatch.setattr(time_limits, "gemm_gflops", lambda: 60.0)
    with pytest.warns(UserWarning, match="publish took 346 s against a limit of 180 s; not asserted.*60 GFLOP/s"):
        time_limits.assert_within(346.0, 180.0, "publish")


def test_the_gemm_rate_is_measured():
    assert 0 < time_limits.gemm_gflops() < 1e5
