"""Does a worker compile Triton kernels while serving? The start-up (load_served_model: CUDA graphs, the
self-check, the probe) is meant to compile every kernel the engine launches; one first launched by a request
compiles in the engine's step (a cold Triton cache: a second or more), stalling every stream on that worker.

    python3 bench/serving_compiles.py --artifact ARTIFACT_DIR [--artifact ...] --out bench/results/<gpu>/serving_compiles.json

Each artifact goes through the worker's own start-up, then through traffic of every kind a worker sees, phase
by phase (one short prompt; a burst of prompts of mixed lengths with greedy and sampled decoding; a prompt of
several step budgets; prompts sharing a start, i.e. chunks continuing a cached prefix of every size; decode
batches of every size up to --max-running-sequences): each phase lists the kernels first launched in it.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere, as the other bench scripts

from bench.jit_compiles import differences, recorded_compiles
from bench.machine import cpu_machine, gpu_machine
from services.worker.config import WorkerConfig
from services.worker.engine.sequence import SamplingOptions
from services.worker.serving import load_served_model


def run(engine, prompts: list[list[int]], options: list[SamplingOptions]) -> int:
    """Submits the prompts at once, steps the engine until all end; returns the tokens generated."""
    ends = []

    def sink(out) -> None:
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        if out.finish is not None:
            ends.append(out.finish.generated_tokens)

    for i, (prompt, option) in enumerate(zip(prompts, options)):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, option, sink)
    while engine.step():
        pass
    if len(ends) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(ends)} requests did not finish")
    return sum(ends)


def phases(vocab: int, context: int, step_tokens: int, max_running: int):
    """(name, prompts, sampling options) of each kind of traffic, sized to the worker's limits."""
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def greedy(n: int) -> SamplingOptions:
        return SamplingOptions(max_new_tokens=n, ignore_eos=True)

    yield "one short prompt", [prompt(5)], [greedy(8)]
    lengths = [rng.randint(1, min(context // 2, 300)) for _ in range(max_running)]
    sampled = [SamplingOptions(max_new_tokens=16, ignore_eos=True, temperature=0.8, top_k=40, top_p=0.9, seed=i)
               for i in range(max_running // 2)]
    yield ("a burst of mixed lengths, greedy and sampled", [prompt(n) for n in lengths],
           [greedy(16)] * (max_running - len(sampled)) + sampled)
    long = min(context - 16, 3 * step_tokens + 17)
    yield "a prompt of several step budgets", [prompt(long)], [greedy(4)]
    for own in (3, 40, 300):  # continuing chunks of every PDL class (<= 16, <= 256, more rows)
        start = prompt(min(512, context // 4))
        n = max(1, min(max_running, step_tokens // max(own, 1)))
        batch = [start + prompt(own) for _ in range(n)]
        yield f"{n} prompts sharing a {len(start)}-token start, {own} tokens of their own", batch, [greedy(4)] * n
    for b in sorted({1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 100, 128, 200, 256, max_running} & set(range(1, max_running + 1))):
        yield f"decode batch {b}", [prompt(rng.randint(1, 40)) for _ in range(b)], [greedy(24)] * b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, action="append", type=Path)
    p.add_argument("--max-running-sequences", type=int, default=256)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the phases on the reference runner")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    machine = gpu_machine(torch.device(args.device)) if args.device != "cpu" else cpu_machine()
    result = {"command": "python3 bench/serving_compiles.py " + shlex.join(sys.argv[1:]), "machine": machine,
              "artifacts": {}, "checks": []}
    for artifact in args.artifact:
        config = WorkerConfig(artifact=str(artifact), device=args.device, metrics_port=None,
                              max_running_sequences=args.max_running_sequences)
        t0 = time.perf_counter()
        with recorded_compiles() as at_start:
            served = load_served_model(config)
        engine = served.engine
        record = {"format": served.format, "start_up_s": time.perf_counter() - t0,
                  "kernels_compiled_at_start_up": at_start, "phases": []}
        late = 0
        for name, prompts, options in phases(served.vocab_size, engine.limits.max_context,
                                             engine.limits.max_batch_tokens, engine.limits.max_running):
            t1 = time.perf_counter()
            with recorded_compiles() as compiled:
                tokens = run(engine, prompts, options)
            late += len(compiled)
            for entry in compiled:
                entry["differs_from_start_up"] = differences(entry, at_start)
            record["phases"].append({"phase": name, "requests": len(prompts), "tokens": tokens,
                                     "seconds": time.perf_counter() - t1, "kernels_compiled": compiled})
            print(f"{artifact.name}: {name}: {len(compiled)} kernels compiled", flush=True)
            for entry in compiled:
                print("   ", entry["kernel"], entry["differs_from_start_up"], flush=True)
        result["artifacts"][str(artifact)] = record
        result["checks"].append({"name": f"kernels compiled while serving after the start-up ({served.format})",
                                 "value": late, "target": 0, "op": "<=", "met": late == 0})
        del served, engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["checks"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
