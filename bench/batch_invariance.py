"""Does a request get the same tokens alone as inside a batch, on the GPU's kernels?

sampler.py draws each request's tokens from its own generator, so on the CPU reference a seeded (or greedy)
request's tokens do not depend on what else is in the batch. On a GPU the W4A8 GEMM, attention and the
fp16 path pick kernels and tile shapes by the batch's row count (the policy table, split-K, CUDA graphs of
padded batch sizes), which can change logits in the last bits and so, at a near tie, a token. This measures
how often that happens: each of REQUESTS requests alone twice (run to run determinism), then inside batches
of 8 and 24, on a random-weight Llama-2-7B of each format; per request, whether the tokens agree and where
they first part.

    PYTHONPATH=. python3 bench/batch_invariance.py --out bench/results/h100/batch_invariance.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.e2e import random_artifact
from bench.machine import gpu_machine
from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.sequence import SamplingOptions
from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

REQUESTS = 4
BATCHES = (8, 24)
NEW_TOKENS = 48


class NoText:
    def decode(self, ids):
        return ""


def prompt(i: int) -> list[int]:
    return [1] + [(i * 7919 + j * 104729) % 31000 + 1 for j in range(40 + i)]


def options(i: int, greedy: bool) -> SamplingOptions:
    if greedy:
        return SamplingOptions(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return SamplingOptions(temperature=1.0, top_p=0.9, seed=77 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def run(engine: Engine, requests: list[tuple[str, list[int], SamplingOptions]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for request_id, ids, opts in requests:
        engine.add_request(request_id, ids, opts, lambda out, rid=request_id: tokens.setdefault(rid, []).extend(
            out.token_ids))
    while engine.step():
        pass
    return tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def measure(fmt: str) -> list[dict]:
    runner = TritonRunner(random_artifact(fmt, torch.device("cuda"), "llama2-7b"), "cuda", 16,
                          TritonRunnerSettings(max_model_len=256, max_batch_tokens=2048))
    engine = Engine(runner, NoText(), EngineLimits(num_blocks=200, max_running=32, max_waiting=64,
                                                   max_batch_tokens=2048, max_context=256), eos_token_ids=())
    rows = []
    for greedy in (True, False):
        alone = {i: run(engine, [(f"a{i}", prompt(i), options(i, greedy))])[f"a{i}"] for i in range(REQUESTS)}
        again = {i: run(engine, [(f"b{i}", prompt(i), options(i, greedy))])[f"b{i}"] for i in range(REQUESTS)}
        for size in BATCHES:
            batch = run(engine, [(f"c{i}", prompt(i), options(i, greedy)) for i in range(size)])
            for i in range(REQUESTS):
                row = {"format": fmt, "sampling": "greedy" if greedy else "seeded", "request": i, "batch": size,
                       "alone_twice_equal": alone[i] == again[i], "batch_equals_alone": batch[f"c{i}"] == alone[i],
                       "first_difference": first_difference(alone[i], batch[f"c{i}"])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    del engine, runner
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--formats", default="w4a8kv4-g128,w4a8kv4-chn,fp16")
    args = parser.parse_args()
    started = time.time()
    rows = [row for fmt in args.formats.split(",") for row in measure(fmt)]
    summary = {f"{fmt} {kind}": f"{sum(r['batch_equals_alone'] for r in rows if r['format'] == fmt and r['sampling'] == kind)}"
               f" of {sum(1 for r in rows if r['format'] == fmt and r['sampling'] == kind)} equal"
               for fmt in args.formats.split(",") for kind in ("greedy", "seeded")}
    result = {"command": "python3 " + " ".join(sys.argv), "machine": gpu_machine(torch.device("cuda")), "new_tokens": NEW_TOKENS,
              "rows": rows, "summary": summary, "seconds": round(time.time() - started, 1)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
