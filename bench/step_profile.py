"""Where an engine step with prompt tokens goes: host wall time against GPU kernel time.

    python3 bench/step_profile.py --prefill-tokens 512 --out bench/results/h100/step_profile_512.json

The worker's engine on a Llama-2-7B-shaped random model (g128 by default): `--batch` requests of
`--prompt` tokens are run once to compile every kernel, then again; the second run's first
`--steps` steps (prompt chunks of `--prefill-tokens` tokens, with the decode tokens of requests
that already have their first token) are timed one by one, and the next `--steps` profiled: GPU
time by kernel group (bench/decode_profile.group_of) and by kernel, the host's torch ops. A step
whose wall time is far above its GPU time waits on the host (session 32 measured steps launched
kernel by kernel; since session 33 prompt steps replay the runner's step graphs, with each layer's
attention launched between the pieces, and `--no-step-graphs` times them kernel by kernel again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.decode_profile import group_of, ms_per_step  # noqa: E402
from bench.machine import gpu_machine  # noqa: E402


def python_functions(engine, steps: int, n: int = 40) -> dict[str, dict[str, float]]:
    """The host's Python functions over `steps` engine steps under cProfile, by own time: ms per
    step of own and cumulative time (cProfile's own overhead inflates both; read them as shares)."""
    import cProfile
    import pstats

    import torch

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return {f"{Path(f).name}:{line}({name})": {"calls": calls / steps, "own_ms": round(own / steps * 1e3, 3),
                                               "cum_ms": round(cum / steps * 1e3, 3)}
            for (f, line, name), (calls, _, own, cum, _) in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="w4a8kv4-g128", choices=("w4a8kv4-chn", "w4a8kv4-g128", "fp16"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=512, help="the engine's tokens per step")
    p.add_argument("--steps", type=int, default=10, help="steps timed, then steps profiled")
    p.add_argument("--no-step-graphs", action="store_true", help="launch prompt steps kernel by kernel")
    p.add_argument("--cprofile", action="store_true",
                   help="also run --steps steps under cProfile: the host's Python functions by own time")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.e2e import llama2_7b_artifact
    from bench.e2e_engine import make_engine
    from services.worker.engine.sequence import SamplingOptions
    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

    dev = torch.device("cuda")
    total = a.prompt + a.output
    runner = TritonRunner(llama2_7b_artifact(a.format, dev), "cuda", 16,
                          TritonRunnerSettings(max_model_len=total, max_batch_tokens=a.prefill_tokens,
                                                               step_graphs=not a.no_step_graphs))
    engine = make_engine(runner, a.batch, total, a.prefill_tokens)
    g = torch.Generator().manual_seed(0)
    options = SamplingOptions(max_new_tokens=a.output, ignore_eos=True)

    def add(tag: str) -> None:
        for i, prompt in enumerate(torch.randint(0, runner.config.vocab_size, (a.batch, a.prompt), generator=g).tolist()):
            engine.add_request(f"{tag}{i}", prompt, options, lambda out: None)

    add("warm")  # compiles every kernel and captures the graphs it uses
    while engine.step():
        pass
    torch.cuda.synchronize()
    add("run")
    step_ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
    python_top = python_functions(engine, a.steps) if a.cprofile else None
    while engine.step():
        pass

    kernels, host_ops = ms_per_step(prof, a.steps)
    by_group: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_group[group_of(name)] += ms

    def top(d: dict, n: int = 25) -> dict:
        """The n largest entries, names cut to 90 characters (entries whose cut names agree summed)."""
        cut: dict[str, float] = defaultdict(float)
        for name, ms in d.items():
            cut[name[:90]] += ms
        return {k: round(v, 3) for k, v in sorted(cut.items(), key=lambda kv: -kv[1])[:n]}

    result = {
        "command": " ".join(["python3"] + sys.argv),
        "machine": gpu_machine(dev),
        "model": "Llama-2-7B shape, random weights (bench/random_model.py)",
        "format": a.format, "batch": a.batch, "prompt": a.prompt, "output": a.output, "prefill_tokens": a.prefill_tokens,
        "step_wall_ms_unprofiled": [round(x, 2) for x in step_ms],
        "step_wall_ms_profiled": round(wall_ms, 2),
        "gpu_ms_per_step": round(sum(by_group.values()), 3),
        "gpu_ms_per_step_by_group": top(by_group),
        "gpu_ms_per_step_top_kernels": top(kernels),
        "host_ms_per_step_top_ops": top(host_ops),
        **({"host_python_ms_per_step_top_functions": python_top} if python_top else {}),
        "checks": [],  # a diagnosis: no target of an issue is measured here
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("prefill_tokens", "step_wall_ms_unprofiled", "step_wall_ms_profiled",
                                            "gpu_ms_per_step", "gpu_ms_per_step_by_group")}))


if __name__ == "__main__":
    main()
