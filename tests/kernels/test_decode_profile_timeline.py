"""bench/decode_profile.py's GPU timeline (used by engine_profile.py too) on hand-made profiler events:
kernels only, gaps attributed to the kernel pair around them, per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.decode_profile import timeline


class _Event:
    def __init__(self, name: str, start_ns: int, duration_ns: int, device: str = "CUDA", annotation: bool = False):
        self._name, self._start, self._duration = name, start_ns, duration_ns
        self._device, self._annotation = device, annotation

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def duration_ns(self):
        return self._duration

    def device_type(self):
        return SimpleNamespace(name=self._device)

    def is_user_annotation(self):
        return self._annotation


def _prof(events):
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))


def test_gaps_between_kernels_per_step():
    us = 1000  # ns
    events = [
        # step 1: gemm 0-10 us, gap 2, attention 12-30, gap 1, gemm 31-40
        _Event("gemm", 0, 10 * us), _Event("attention", 12 * us, 18 * us), _Event("gemm", 31 * us, 9 * us),
        # step 2 starts 4 us after step 1 ends: that gap belongs to the (gemm, gemm) pair
        _Event("gemm", 44 * us, 10 * us), _Event("attention", 56 * us, 18 * us), _Event("gemm", 75 * us, 9 * us),
        # not kernels: a host op, a profiler range's GPU span, a copy, an overlapping-free zero-length record
        _Event("aten::mm", 0, 50 * us, device="CPU"),
        _Event("engine:launch", 0, 84 * us, annotation=True),
        _Event("Memcpy HtoD (Pinned -> Device)", 40 * us, 1 * us),
        _Event("empty", 41 * us, 0),
    ]
    t = timeline(_prof(events), repeats=2)
    assert t["kernels_per_step"] == 3
    assert t["span_ms_per_step"] == pytest.approx(84e-3 / 2)
    assert t["busy_ms_per_step"] == pytest.approx(74e-3 / 2)
    assert t["idle_between_kernels_ms_per_step"] == pytest.approx((2 + 1 + 4 + 2 + 1) / 1e3 / 2)
    gaps = {(g["before"], g["after"]): g for g in t["largest_gaps"]}
    assert gaps[("gemm", "attention")] == {"before": "gemm", "after": "attention", "count_per_step": 1.0,
                                          "us_per_step": 2.0, "mean_us": 2.0}
    assert gaps[("gemm", "gemm")]["us_per_step"] == 2.0 and gaps[("gemm", "gemm")]["count_per_step"] == 0.5
    assert gaps[("attention", "gemm")]["us_per_step"] == 1.0
    assert t["largest_gaps"][0]["us_per_step"] == 2.0  # largest first


def test_no_kernels_is_an_empty_timeline():
    t = timeline(_prof([_Event("aten::mm", 0, 5, device="CPU")]), repeats=1)
    assert t["kernels_per_step"] == 0 and t["span_ms_per_step"] == 0.0 and t["largest_gaps"] == []


def test_ms_per_step_splits_kernels_from_host_work():
    """ms_per_step (decode_profile, engine_profile, step_profile): kernels by their own device time, host ops
    and ranges by inclusive CPU time, both per step; entries with no time of their side are left out."""
    from bench.decode_profile import ms_per_step

    def evt(key, device, self_device_us=0.0, cpu_us=0.0):
        return SimpleNamespace(key=key, device_type=SimpleNamespace(name=device),
                               self_device_time_total=self_device_us, cpu_time_total=cpu_us)

    prof = SimpleNamespace(key_averages=lambda: [
        evt("_int8_gemm_kernel", "CUDA", self_device_us=8000), evt("_act_quant_kernel", "CUDA", self_device_us=400),
        evt("aten::empty", "CPU", cpu_us=1200), evt("engine:launch", "CPU", cpu_us=3000), evt("aten::view", "CPU"),
        evt("idle", "CUDA"),
    ])
    gpu, host = ms_per_step(prof, steps=4)
    assert gpu == pytest.approx({"_int8_gemm_kernel": 2.0, "_act_quant_kernel": 0.1})
    assert host == pytest.approx({"aten::empty": 0.3, "engine:launch": 0.75})
