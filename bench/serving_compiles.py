"""Does a worker compile Triton kernels while serving? The start-up (load_served_model: CUDA graphs, the
self-check, the probe) is meant to compile every kernel the engine launches; one first launched by a request
compiles in the engine's step (a cold Triton cache: a second or more), stalling every stream on that worker.

    python3 bench/serving_compiles.py --artifact ARTIFACT_DIR [--artifact ...] --out bench/results/<gpu>/serving_compiles.json

Each artifact goes through the worker's own start-up, then through traffic of every kind a worker sees, phase
by phase (one short prompt; a burst of prompts of mixed lengths with greedy and sampled decoding; a prompt of
several step budgets; prompts sharing a start, i.e. chunks continuing a cached prefix of every size; decode
batches of every size up to --max-running-sequences): each phase lists the kernels first launched in it.
Then decode attention is launched directly at 3, 16 and 32 partitions of the context (a compile at 16 or 32 is
one a long-context model would pay while serving), and "forks" lists kernels compiled twice with the same
constexprs. --serial-compile (an A/B) leaves out the start-up's compiling of decode attention's forms at once:
run each side in its own process with its own empty TRITON_CACHE_DIR to time a cold start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from services.worker import serving
from services.worker.kernels import paged_attention
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


def partition_counts(served) -> dict:
    """Decode attention launched directly at contexts split into 3, then 16 and 32 partitions (partitions of 32
    tokens: the fixture's context is too short to reach 16 at the defaults). Triton specializes an integer
    argument on being a multiple of 16: unless the kernels opt out, 16 and 32 compile a form of their own, as a
    long-context model's steps would while serving."""
    runner = served.engine.runner
    c = runner.config
    cache = runner.k_cache[0]
    defaults = paged_attention.default_config(cache.dtype == torch.uint8, c.num_heads // c.num_kv_heads, c.head_dim,
                                              cache.shape[2])
    config = dataclasses.replace(defaults, partition_size=32, whole_context=False, max_partition_size=None)
    query = torch.zeros((2, c.num_heads, c.head_dim), dtype=torch.float16, device=cache.device)
    tables = torch.zeros((2, runner.max_blocks), dtype=torch.int32, device=cache.device)
    compiled_at = {}
    for partitions in (3, 16, 32):
        lens = torch.full((2,), 32 * partitions, dtype=torch.int32, device=cache.device)
        with recorded_compiles() as compiled:
            paged_attention.paged_decode_attention(query, cache, runner.v_cache[0], tables, lens, config=config,
                                                   max_context_len=32 * partitions)
            torch.cuda.synchronize()
        compiled_at[partitions] = [e["kernel"] for e in compiled]
    return compiled_at


def forks(compiles: list[dict]) -> list[dict]:
    """Kernels compiled more than once with the same constexprs: only Triton's specialization of an argument
    (alignment, a value of 1, a multiple of 16) told the compiles apart."""
    seen, twice = {}, []
    for entry in compiles:
        key = (entry["kernel"], json.dumps(entry.get("constexprs", entry.get("repr")), sort_keys=True))
        if key in seen:
            twice.append({"kernel": entry["kernel"], "first": seen[key].get("specialized"),
                          "again": entry.get("specialized")})
        else:
            seen[key] = entry
    return twice


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, action="append", type=Path)
    p.add_argument("--max-running-sequences", type=int, default=256)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the phases on the reference runner")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--serial-compile", action="store_true",
                   help="A/B: the start-up without compiling decode attention's forms at once (one after another)")
    args = p.parse_args()
    if args.serial_compile:
        serving.compile_decode_attention = lambda *_, **__: 0
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
        if args.device != "cpu":
            record["decode_attention_compiled_at_partitions"] = partition_counts(served)
            refork = sum(len(v) for p, v in record["decode_attention_compiled_at_partitions"].items() if p != 3)
            result["checks"].append({"name": f"decode attention compiled again at 16 and 32 partitions ({served.format})",
                                     "value": refork, "target": 0, "op": "<=", "met": refork == 0})
        record["forks"] = forks(at_start + [e for phase in record["phases"] for e in phase["kernels_compiled"]])
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
