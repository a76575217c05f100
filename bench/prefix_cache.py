"""Prefix caching on a GPU: requests sharing a long start (a system prompt) through the worker's engine, with
the prefix cache off and on, on a random-weight model of a real shape.

    python3 bench/prefix_cache.py --format w4a8kv4-chn --batch 64 --prefix 1024 --unique 64 --output 128 \
        --out bench/results/<gpu>/prefix_cache.json

Each run submits `batch` requests at once (the shared prefix + `unique` random tokens of its own, greedy,
`output` new tokens), after warm-up runs (with the cache on, twice: the second finds the start cached and
compiles the continuing-chunk attention kernel) and the decode graphs' capture. Runs alternate off / on / off /
on (the second pair shows the spread). Reported: total time, output tokens per second, mean and worst TTFT, the
prefix cache's hit tokens, and how many requests generated the same greedy tokens: on against off, with the
controls off against off and on against on. On against off need not agree: a prompt's first chunk attends over
its own fp16 K/V, a chunk continuing a cached prefix over the KV4 cache (as chunked prompts always have), and a
random-weight model's near-tied logits flip on such a difference.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere, as the other bench scripts

from bench.e2e import random_artifact
from bench.e2e_engine import make_engine, run_requests
from bench.jit_compiles import recorded_compiles
from bench.machine import gpu_machine
from bench.random_model import SHAPES
from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="w4a8kv4-chn")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefix", type=int, default=1024, help="tokens every prompt starts with")
    p.add_argument("--unique", type=int, default=64, help="tokens of each prompt's own after the prefix")
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per step (the chunked-prefill budget)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    total = args.prefix + args.unique + args.output
    reader = random_artifact(args.format, device, args.shape)  # with the policy table the e2e benchmark uses
    runner = TritonRunner(reader, "cuda", 16, TritonRunnerSettings(max_model_len=total,
                                                                   max_batch_tokens=args.prefill_tokens))
    g = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prefix = torch.randint(0, vocab, (args.prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, vocab, (args.unique,), generator=g).tolist() for _ in range(args.batch)]
    result = {"command": "python3 bench/prefix_cache.py " + shlex.join(sys.argv[1:]), "machine": gpu_machine(device),
              "format": args.format, "shape": args.shape, "batch": args.batch, "prefix": args.prefix,
              "unique": args.unique, "output": args.output, "prefill_tokens": args.prefill_tokens, "runs": []}
    tokens: list[tuple[bool, dict[int, list[int]]]] = []
    for prefix_caching in (False, True, False, True):
        engine = make_engine(runner, args.batch, total, args.prefill_tokens, prefix_caching=prefix_caching)
        t0 = time.perf_counter()
        warm = [p[:] for p in prompts[: max(1, args.prefill_tokens // len(prompts[0]))]]
        run_requests(engine, warm, 3, "warm")
        if prefix_caching:  # once more: the prompts now find their start cached, as the run's later ones will
            run_requests(engine, warm, 3, "warm-again")
        if runner.graphs is not None:
            top = runner.graphs.bucket_for(args.batch) or runner.graphs.buckets[-1]
            runner.capture_graphs(tuple(b for b in runner.graphs.buckets if b <= top))
        warm_s = time.perf_counter() - t0
        engine.blocks.forget_cached()  # the warm-up's prompts share the prefix: the run starts from an empty cache
        before = engine.stats()
        got: dict[int, list[int]] = {}
        with recorded_compiles() as compiled:  # a kernel first launched in the timed run paid its compile there
            run = run_requests(engine, prompts, args.output, "run", got)
        after = engine.stats()
        run.update(prefix_caching=prefix_caching, warm_up_s=warm_s, tokens_per_s=run["output_tokens"] / run["total_s"],
                   prefix_cache_hit_tokens=after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
                   prefix_cache_queried_tokens=after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens,
                   kernels_compiled=compiled)
        tokens.append((prefix_caching, got))
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    off = [r for r in result["runs"] if not r["prefix_caching"]]
    on = [r for r in result["runs"] if r["prefix_caching"]]
    best_off, best_on = min(r["total_s"] for r in off), min(r["total_s"] for r in on)
    (_, off_1), (_, on_1), (_, off_2), (_, on_2) = tokens

    def equal(a: dict[int, list[int]], b: dict[int, list[int]]) -> int:
        return sum(a[i] == b[i] for i in range(args.batch))

    # Off against off is the control: the same batch twice (random weights' near-tied logits flip on any
    # change of arithmetic, so on against off is read against it).
    result["summary"] = {
        "speedup_total": best_off / best_on,
        "ttft_mean_ratio": min(r["ttft_mean_s"] for r in off) / min(r["ttft_mean_s"] for r in on),
        "requests_with_equal_tokens": equal(on_1, off_1), "requests_equal_off_vs_off": equal(off_1, off_2),
        "requests_equal_on_vs_on": equal(on_1, on_2), "requests": args.batch,
    }
    print(json.dumps(result["summary"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
