"""The artifact's kernel policy table (schema: shared/formats/kernel_policy.py) resolved against the
GEMM variants this worker's kernels have: which variant runs each (weight kind, N x K, M)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.worker.kernels import w4a8_gemm
from shared.formats.kernel_policy import KernelPolicyError, Rows, parse_policy

__all__ = ["GemmPolicy", "KernelPolicyError"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GemmPolicy:
    rows: dict[tuple[str, int, int], Rows] = field(default_factory=dict)  # (kind, N, K) -> [(max_M, name)]
    # (kind, N, K) whose fallback to the default has been logged: once each, not once per step.
    logged_misses: set[tuple[str, int, int]] = field(default_factory=set)

    @classmethod
    def from_manifest(cls, table: dict | None) -> "GemmPolicy":
        """Raises KernelPolicyError for a malformed table, a variant these kernels do not have, or one for
        another weight kind, naming the entry."""
        rows = parse_policy(table)
        for (kind, n, k), entries in rows.items():
            for _, name in entries:
                try:
                    variant = w4a8_gemm.get_variant(name)
                except ValueError:  # its own message lists every variant (1,300 characters) and names no entry
                    raise KernelPolicyError(
                        f"kernel_policy.gemm.{kind}.{n}x{k}: unknown variant {name!r} (a table for other kernels: "
                        f"`python3 bench/tune.py` makes one for these)") from None
                if variant.kind != kind:
                    raise KernelPolicyError(f"kernel_policy.gemm.{kind}.{n}x{k}: {name} reads {variant.kind} weights")
        return cls(rows)

    def variant(self, kind: str, n: int, k: int, m: int) -> str:
        """The variant name for an (M, N, K) GEMM on `kind` weights (the table's, else the default)."""
        why = "has no rows for this shape" if (kind, n, k) not in self.rows else f"covers no M = {m}"
        for max_m, name in self.rows.get((kind, n, k), ()):
            if max_m is None or m <= max_m:
                runs, reason = w4a8_gemm.get_variant(name).can_implement(m, n, k, kind)
                if runs:
                    return name
                why = f"names {name} for M = {m}, which cannot run it ({reason})"
                break
        default = w4a8_gemm.default_variant_name(m, kind)
        if (kind, n, k) not in self.logged_misses:
            self.logged_misses.add((kind, n, k))
            log.warning("kernel policy %s %s %dx%d: the table %s; using the default %s (logged once per shape)",
                        "gemm", kind, n, k, why, default)
        return default
