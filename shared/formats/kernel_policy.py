"""The manifest's kernel policy table: which W4A8 GEMM variant runs each (weight kind, N x K, M).

Schema (manifest.json `kernel_policy`; None or absent: the kernels' defaults):

    {
      "gemm": {
        "<weight kind>": {                      # "w4g128p" (w4a8kv4-g128) or "w4chn" (w4a8kv4-chn)
          "<N>x<K>": [[max_M, "<variant>"],     # rows sorted by max_M; the first row with M <= max_M
                      ...,                      # wins; max_M null = no upper bound
                      [null, "<variant>"]]
        }
      }
    }

Variant names are those of services/worker/kernels/w4a8_gemm.VARIANTS (the worker checks them
when it loads the artifact; a shape or an M the table does not cover falls back to the default).
Tables are measured offline per GPU by bench/tune.py (every variant over a model's (N, K) set and
M = 1..8192, checked bit-exact first) and shipped as data in kernel_policies/<gpu_target>.json; the
quantizer puts the table of the artifact's GPU target into its manifest, so the choice travels with
the artifact and is never tuned at serve time. A shape or M the table misses runs the kernels'
default variant, logged once per shape by the worker (services/worker/engine/kernel_policy.py).
"""

from __future__ import annotations

import json
from importlib import resources

from shared.formats.weights import W4ChannelWeight, W4G128ProgressiveWeight

POLICY_KINDS = (W4G128ProgressiveWeight.kind, W4ChannelWeight.kind)


class KernelPolicyError(ValueError):
    """A kernel_policy table that does not follow the schema above."""


Rows = list[tuple[int | None, str]]


def parse_policy(table: dict | None) -> dict[tuple[str, int, int], Rows]:
    """The table as {(kind, N, K): [(max_M or None, variant name)]}, rows sorted by max_M (None last).
    Raises KernelPolicyError naming the first entry that does not follow the schema."""
    if not table:
        return {}
    if not isinstance(table, dict):
        raise KernelPolicyError(f"kernel_policy must be a mapping, got {type(table).__name__}")
    unknown = sorted(set(table) - {"gemm", "source"})
    if unknown:  # a misspelt "Gemm" read as an empty table: every shape on the default, silently
        raise KernelPolicyError(f"kernel_policy: unknown key(s) {unknown}; expected 'gemm' (and 'source')")
    gemm = table.get("gemm", {})
    if not isinstance(gemm, dict):
        raise KernelPolicyError(f"kernel_policy.gemm must be a mapping kind -> shapes, got {type(gemm).__name__}")
    parsed: dict[tuple[str, int, int], Rows] = {}
    for kind, shapes in gemm.items():
        if kind not in POLICY_KINDS:
            raise KernelPolicyError(f"kernel_policy.gemm: unknown weight kind {kind!r}; expected one of {POLICY_KINDS}")
        if not isinstance(shapes, dict):
            raise KernelPolicyError(f"kernel_policy.gemm.{kind} must be a mapping '<N>x<K>' -> rows, "
                                    f"got {type(shapes).__name__}")
        for shape, entries in shapes.items():
            try:
                n, k = (int(v) for v in shape.split("x"))
            except (ValueError, AttributeError):
                raise KernelPolicyError(f"kernel_policy.gemm.{kind}: shape key {shape!r} is not '<N>x<K>'") from None
            if n < 1 or k < 1 or shape != f"{n}x{k}":  # '04096x4096' beside '4096x4096': the later one won
                raise KernelPolicyError(f"kernel_policy.gemm.{kind}: shape key {shape!r} is not '<N>x<K>' with N "
                                        f"and K positive, written without leading zeros")
            if not isinstance(entries, list):
                raise KernelPolicyError(f"kernel_policy.gemm.{kind}.{shape} must be a list of [max_M or null, variant], "
                                        f"got {type(entries).__name__}")
            rows: Rows = []
            for entry in entries:
                # bool is an int: [true, "..."] would silently mean max_M = 1.
                if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)
                        and (entry[0] is None or (isinstance(entry[0], int) and not isinstance(entry[0], bool)))):
                    raise KernelPolicyError(
                        f"kernel_policy.gemm.{kind}.{shape}: entry {entry!r} is not [max_M or null, variant]")
                rows.append((entry[0], entry[1]))
            rows.sort(key=lambda r: float("inf") if r[0] is None else r[0])
            bounds = [r[0] for r in rows if r[0] is not None]
            # A row that can never be reached (a repeated bound, a second null) is a table made wrongly.
            if any(m < 1 for m in bounds) or len(set(bounds)) != len(bounds) or len(rows) - len(bounds) > 1:
                raise KernelPolicyError(f"kernel_policy.gemm.{kind}.{shape}: rows {entries!r} need distinct "
                                        f"max_M of at least 1 and at most one null")
            parsed[(kind, n, k)] = rows
    return parsed


def from_best_variant(best: dict) -> dict:
    """bench/kernels.py's best_variant {kind: {"NxK": {"M": name}}} -> a kernel_policy table: each
    measured M covers the Ms above the previous one; the largest covers everything above."""
    gemm = {}
    for kind, shapes in best.items():
        gemm[kind] = {}
        for shape, by_m in shapes.items():
            ms = sorted(int(m) for m in by_m)
            rows = [[m, by_m[str(m)]] for m in ms[:-1]]
            rows.append([None, by_m[str(ms[-1])]])
            gemm[kind][shape] = rows
    table = {"gemm": gemm}
    parse_policy(table)
    return table


def shipped_policy(gpu_target: str) -> dict | None:
    """The table measured for this GPU target (kernel_policies/<target>.json), or None when there is
    none (the CPU reference backend, or a GPU not profiled yet: the kernels' defaults apply)."""
    path = resources.files("shared.formats").joinpath("kernel_policies", f"{gpu_target}.json")
    if not path.is_file():
        return None
    table = json.loads(path.read_text(encoding="utf-8"))
    parse_policy(table)
    return table
