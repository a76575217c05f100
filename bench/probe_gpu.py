"""The start-up probe's error on a GPU (services/worker/probe_check.py): how far the Triton runner's logits for
an artifact's probe lie from the quantizer's reference logits, against the worker's --probe-max-error.

    python3 bench/probe_gpu.py --artifacts DIR [DIR ...] --random llama2-7b --out bench/results/<gpu>/probe.json

DIR: artifacts made by `qctl quantize --gpu-target sm90` (their probe inside); --random: random-weight models of
that shape in each format, whose probe is computed here with the reference forward (streamed, on the GPU).
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

from bench.random_model import SHAPES, RandomArtifact
from services.worker.config import DEFAULT_PROBE_MAX_ERROR
from services.worker.engine.loading import load_runner
from services.worker.probe_check import probe_logits
from shared.formats.artifact import ArtifactReader
from shared.model.load import reference_probe

BLOCK = 16
FORMATS = ("w4a8kv4-g128", "w4a8kv4-chn", "fp16")


def measure(reader, probe, device: torch.device) -> dict:
    runner = load_runner(reader, device, BLOCK, max_batch_tokens=256, max_model_len=256, max_decode_batch=8)
    runner.allocate_cache(16)
    t0 = time.perf_counter()
    errors = probe.errors(probe_logits(runner, probe, 256))
    seconds = time.perf_counter() - t0
    rows = probe_logits(runner, probe, 256)  # again, now compiled: the time a warm worker's start-up pays
    top1 = (rows.argmax(-1).cpu() == probe.logits.argmax(-1)).float().mean().item()
    mean = sum(errors) / len(errors)
    del runner
    torch.cuda.empty_cache()
    return {"mean_rel_err": mean, "max_rel_err": max(errors), "errors": errors, "top1_agreement": top1,
            "first_run_s": seconds, "passes_default": mean <= DEFAULT_PROBE_MAX_ERROR}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", nargs="*", type=Path, default=[])
    p.add_argument("--random", choices=sorted(SHAPES), default=None)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    device = torch.device("cuda")
    results = []
    for folder in args.artifacts:
        reader = ArtifactReader(folder)
        result = {"artifact": folder.name, "format": reader.manifest.format, **measure(reader, reader.probe(), device)}
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.random:
        for fmt in FORMATS:
            reader = RandomArtifact(SHAPES[args.random], fmt, device, seed=3)
            probe = reference_probe(reader, device)
            result = {"artifact": f"random {args.random}", "format": fmt, **measure(reader, probe, device)}
            results.append(result)
            print(json.dumps(result), flush=True)
    out = {
        "command": "python3 bench/probe_gpu.py " + shlex.join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "probe_max_error_default": DEFAULT_PROBE_MAX_ERROR,
        "results": results,
        "checks": [{"name": f"probe of {r['artifact']} {r['format']} within the default threshold",
                    "value": r["mean_rel_err"], "target": DEFAULT_PROBE_MAX_ERROR, "op": "<=",
                    "met": r["passes_default"]} for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
