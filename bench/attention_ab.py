"""Times the decode-attention defaults of the tree it runs from, at a few points, REPS times each:
half of an A/B of a kernel change. Run it from two trees in turn (A, B, A, B) in one device call,
so both sides see the same GPU state; bench/attention.py's full sweeps cost too much compile time
to repeat.

    cp -r . /tmp/A && <put the old kernel in /tmp/A>
    for i in 1 2; do (cd /tmp/A && python3 bench/attention_ab.py --tag A --out $OUT/A$i.json)
                     python3 bench/attention_ab.py --tag B --out $OUT/B$i.json; done

Per point: the default config, and for GQA points also the 'mma' kernel with prefetch (uncapped
registers); SDPA on the first repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attention import GQA_MMA_SWEEP, Bench, parse_points  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True, help="this tree's side of the A/B, e.g. A or B")
    parser.add_argument("--points", default="64:1536:8,64:4096:8,64:1536:32",
                        type=parse_points,
                        help="BATCH:CONTEXT:KV_HEADS points, 32 query heads, head_dim 128")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=25)
    parser.add_argument("--rep", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    bench = Bench(args)
    bench.copy_bandwidth()
    for batch, ctx, kv_heads in args.points:
        sweep = [GQA_MMA_SWEEP[0]] if kv_heads != 32 else []
        for rep in range(args.reps):
            print(f"{args.tag}: batch {batch}, context {ctx}, kv heads {kv_heads}, repeat {rep}", flush=True)
            bench.decode_point(f"{args.tag}_b{batch}_ctx{ctx}_kv{kv_heads}_{rep}", batch, 32, kv_heads, ctx, 128,
                               sweep=sweep, partitions=(), fp16=False, sdpa=rep == 0)
    bench.write()


if __name__ == "__main__":
    main()
