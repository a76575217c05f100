"""The artifact's kernel policy table: which W4A8 GEMM variant runs each (weight kind, N x K, M).

Schema (manifest.json `kernel_policy`, made offline per GPU by profiling; None or absent: the
kernels' defaults, `w4a8_gemm.default_variant_name`):

    {
      "gemm": {
        "<weight kind>": {                      # "w4g128p" (w4a8kv4-g128) or "w4chn" (w4a8kv4-chn)
          "<N>x<K>": [[max_M, "<variant>"],     # rows sorted by max_M; the first row with M <= max_M
                      ...,                      # wins; max_M null = no upper bound
                      [null, "<variant>"]]
        }
      }
    }

Variant names are those of services/worker/kernels/w4a8_gemm.VARIANTS. A shape or an M the table
does not cover falls back to the default. `from_best_variant` turns the `best_variant` record of
bench/kernels.py ({kind: {"NxK": {"M": variant}}}) into this table: each measured M covers the
Ms above the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.kernels import w4a8_gemm


class KernelPolicyError(ValueError):
    """A kernel_policy table that does not follow the schema above."""


@dataclass(slots=True)
class GemmPolicy:
    # (kind, N, K) -> [(max_M or None, variant name)], sorted by max_M, None last
    rows: dict[tuple[str, int, int], list[tuple[int | None, str]]] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, table: dict | None) -> "GemmPolicy":
        policy = cls()
        if not table:
            return policy
        gemm = table.get("gemm", {})
        if not isinstance(gemm, dict):
            raise KernelPolicyError(f"kernel_policy.gemm must be a mapping kind -> shapes, got {type(gemm).__name__}")
        for kind, shapes in gemm.items():
            if kind not in w4a8_gemm.KINDS:
                raise KernelPolicyError(f"kernel_policy.gemm: unknown weight kind {kind!r}; expected one of {w4a8_gemm.KINDS}")
            for shape, entries in shapes.items():
                try:
                    n, k = (int(v) for v in shape.split("x"))
                except ValueError:
                    raise KernelPolicyError(f"kernel_policy.gemm.{kind}: shape key {shape!r} is not '<N>x<K>'") from None
                rows = []
                for entry in entries:
                    if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
                        raise KernelPolicyError(f"kernel_policy.gemm.{kind}.{shape}: entry {entry!r} is not [max_M, variant]")
                    max_m, name = entry
                    variant = w4a8_gemm.get_variant(name)  # raises naming the known variants
                    if variant.kind != kind:
                        raise KernelPolicyError(f"kernel_policy.gemm.{kind}.{shape}: {name} reads {variant.kind} weights")
                    rows.append((None if max_m is None else int(max_m), name))
                rows.sort(key=lambda r: float("inf") if r[0] is None else r[0])
                policy.rows[(kind, n, k)] = rows
        return policy

    def variant(self, kind: str, n: int, k: int, m: int) -> str:
        """The variant name for an (M, N, K) GEMM on `kind` weights (the table's, else the default)."""
        for max_m, name in self.rows.get((kind, n, k), ()):
            if max_m is None or m <= max_m:
                if w4a8_gemm.get_variant(name).can_implement(m, n, k, kind)[0]:
                    return name
                break
        return w4a8_gemm.default_variant_name(m, kind)


def from_best_variant(best: dict) -> dict:
    """bench/kernels.py's best_variant {kind: {"NxK": {"M": name}}} -> a kernel_policy table."""
    gemm = {}
    for kind, shapes in best.items():
        gemm[kind] = {}
        for shape, by_m in shapes.items():
            ms = sorted(int(m) for m in by_m)
            rows = [[m, by_m[str(m)]] for m in ms[:-1]]
            rows.append([None, by_m[str(ms[-1])]])
            gemm[kind][shape] = rows
    return {"gemm": gemm}
