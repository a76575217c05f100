"""Reading a service's /metrics page as Prometheus does, and the naming conventions every family must
keep (https://prometheus.io/docs/practices/naming/)."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# Non-base units an exporter must not use: seconds, bytes, ratios are the base ones.
_NON_BASE_UNITS = frozenset({"milliseconds", "ms", "microseconds", "us", "nanoseconds", "ns", "minutes", "hours",
                             "kilobytes", "megabytes", "gigabytes", "kib", "mib", "gib", "percent"})
_DEFAULT_COLLECTOR_PREFIXES = ("python_", "process_", "platform_")


def scrape_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def families(text: str) -> dict:
    """Family name -> family; a family exposed twice fails here (Prometheus would reject the page)."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"metric family {family.name} is exposed twice"
        out[family.name] = family
    return out


def value(fams: dict, sample_name: str, **labels) -> float | None:
    """One sample's value (None when the series is not exported)."""
    for family in fams.values():
        for sample in family.samples:
            if sample.name == sample_name and sample.labels == labels:
                return sample.value
    return None


def series_labels(fams: dict, sample_name: str) -> list[dict]:
    return [s.labels for f in fams.values() for s in f.samples if s.name == sample_name]


def bucket_bounds(fams: dict, family_name: str) -> list[float]:
    """The finite `le` bounds of a histogram family (its first series)."""
    bounds = []
    for sample in fams[family_name].samples:
        if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
            bound = float(sample.labels["le"])
            if bound in bounds:
                break  # the next series starts
            bounds.append(bound)
    return bounds


def check_conventions(fams: dict, prefix: str) -> None:
    """snake_case names under the service's prefix, help on every family, counters as *_total samples,
    base units only, and time families in seconds."""
    ours = {name: f for name, f in fams.items() if not name.startswith(_DEFAULT_COLLECTOR_PREFIXES)}
    assert ours, "no metric family of the service on the page"
    for name, family in ours.items():
        assert name.startswith(prefix), f"{name}: not under the service's prefix {prefix}"
        assert _SNAKE.match(name), f"{name}: not snake_case"
        assert family.documentation.strip(), f"{name}: no help text"
        assert not _NON_BASE_UNITS & set(name.split("_")), f"{name}: not in base units"
        if family.type == "counter":
            assert all(s.name in (f"{name}_total", f"{name}_created") for s in family.samples), name
        if "time" in name and family.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: a duration not in seconds"
