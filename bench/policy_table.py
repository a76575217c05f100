"""Writes the kernel policy table a GPU target ships with, from a kernel benchmark's results.

    python bench/policy_table.py bench/results/h200/kernels.json --target sm90

reads `best_variant` (the fastest correct W4A8 GEMM variant per weight kind, N x K and M, measured
by bench/kernels.py) and writes shared/formats/kernel_policies/<target>.json, the table the quantizer
puts into every artifact for that target (schema: shared/formats/kernel_policy.py).
bench/tune.py measures a model's full (N, K) x M grid and writes such a table directly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shared.formats.kernel_policy import from_best_variant
from shared.formats.manifest import GPU_TARGETS

POLICY_DIR = Path(__file__).resolve().parents[1] / "shared" / "formats" / "kernel_policies"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a bench/kernels.py results JSON")
    p.add_argument("--target", required=True, choices=[t for t in GPU_TARGETS if t != "cpu"])
    args = p.parse_args()
    results = json.loads(args.results.read_text())
    if "best_variant" not in results:
        raise SystemExit(f"{args.results} has no best_variant: run bench/kernels.py with its correctness sweep")
    table = from_best_variant(results["best_variant"])
    table["source"] = {"results": str(args.results), "gpu": results.get("machine", {}).get("gpu")}
    write_policy(table, POLICY_DIR / f"{args.target}.json")


def write_policy(table: dict, out: Path) -> None:
    """Checks the table against the schema (and the kernels' variant names), then writes it as JSON."""
    from services.worker.engine.kernel_policy import GemmPolicy

    GemmPolicy.from_manifest(table)  # parse_policy, plus every name is a variant of its weight kind
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    shapes = sum(len(s) for s in table["gemm"].values())
    print(f"wrote {out}: {shapes} (kind, N x K) entries")


if __name__ == "__main__":
    main()
