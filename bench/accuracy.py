"""Perplexity table for every format and a QoQ ablation, on a trained checkpoint (CPU is fine).

    python bench/accuracy.py --model ../shared/models/tiny-llama-pystdlib \
        --eval ../shared/data/pystdlib-eval.txt --calib ../shared/data/pystdlib-calib.txt \
        --out bench/results/accuracy.json

fp16 is the checkpoint itself in fp32 on the CPU (the reference figure); every other row is an
artifact written by the quantizer and evaluated with the integer reference numerics (KV4 included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from shared.formats.artifact import ArtifactReader  # noqa: E402
from shared.model.checkpoint import HfCheckpoint  # noqa: E402
from shared.model.load import artifact_model, fp_model  # noqa: E402
from shared.model.perplexity import perplexity, windows_of  # noqa: E402
from shared.model.text_file import read_text_file  # noqa: E402
from shared.model.tokenizer import Tokenizer  # noqa: E402
from shared.quant.options import QoQOptions  # noqa: E402
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint  # noqa: E402

RTN = QoQOptions.rtn()
# One step added at a time, in the order the pipeline applies them; every step is on by default.
ABLATION_STEPS = ("rotation", "rotate_values", "smooth_attention", "smoothing", "kv_range_search", "reorder", "clipping",
                  "gptq", "compensate_inputs")
# Options beyond the default pipeline, each measured as the default QoQ row plus that one option.
EXTRA_STEPS = ("key_feedback",)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--eval", type=Path, required=True)
    p.add_argument("--calib", type=Path, required=True)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--reference-ppl", type=float, default=5.012, help="the published fp32 figure to reproduce")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="", help="only these rows (comma list of names as printed; default all); "
                   "a check is written where its rows are there")
    p.add_argument("--seeds", default="0", help="QoQ seeds (rotations and search-token sample), comma list: every "
                   "row with calibration runs once per seed, and the checks read the mean over seeds (RTN rows use "
                   "no seed and run once); default the product's seed 0 alone")
    a = p.parse_args()

    windows = windows_of(Tokenizer(a.model).encode(read_text_file(a.eval, "eval file")[1]), a.seq_len)
    rows: list[dict] = []

    def record(name: str, fmt: str, options: QoQOptions | None, ppl: float, quant_s: float | None,
               cpu_s: float | None = None) -> None:
        # quantize_cpu_seconds: this process's CPU time, all its threads. When quantize_seconds is far
        # above quantize_cpu_seconds / torch_threads, other load on the host stretched the wall clock.
        rows.append({"name": name, "format": fmt, "options": options.to_dict() if options else None,
                     "ppl": ppl, "quantize_seconds": quant_s, "quantize_cpu_seconds": cpu_s})
        seed = f"seed {options.seed}" if options else ""
        print(f"{name:<34} {seed:<8} {fmt:<14} ppl {ppl:.4f}" + (f"  (quantized in {quant_s:.0f} s)" if quant_s else ""),
              flush=True)

    wanted = {n.strip() for n in a.rows.split(",") if n.strip()}
    seeds = [int(v) for v in a.seeds.split(",") if v.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        p.error(f"--seeds must be distinct integers, got {a.seeds!r}")
    record("fp16", "fp16", None, perplexity(fp_model(HfCheckpoint(a.model)).forward, windows).ppl, None)
    with tempfile.TemporaryDirectory() as tmp:
        def run(name: str, fmt: str, options: QoQOptions) -> None:
            if wanted and name not in wanted:
                return
            # A seed changes nothing where no step uses calibration data or a rotation (RTN).
            row_seeds = seeds if dataclasses.replace(options, seed=0) != RTN else [0]
            for seed in row_seeds:
                seeded = dataclasses.replace(options, seed=seed)
                out = Path(tmp) / f"{name} seed {seed}"
                start, cpu_start = time.time(), time.process_time()
                quantize_checkpoint(QuantizeSettings(a.model, out, fmt, gpu_target="cpu", options=seeded, calib_path=a.calib))
                seconds, cpu_seconds = time.time() - start, time.process_time() - cpu_start
                ppl = perplexity(artifact_model(ArtifactReader(out)).forward, windows).ppl
                record(name, fmt, seeded, ppl, seconds, cpu_seconds)
                shutil.rmtree(out)  # a row's artifact is not read again; a 7B-sized one would fill the disk

        run("w8a8 rtn", "w8a8", RTN)
        run("w4a16-g128 rtn", "w4a16-g128", RTN)
        run("w4a8kv4-chn rtn", "w4a8kv4-chn", RTN)
        run("w4a8kv4-chn qoq", "w4a8kv4-chn", QoQOptions())
        for step in EXTRA_STEPS:
            run(f"w4a8kv4-chn qoq +{step}", "w4a8kv4-chn", dataclasses.replace(QoQOptions(), **{step: True}))
        run("w4a8kv4-g128 rtn", "w4a8kv4-g128", RTN)
        options = RTN
        for step in ABLATION_STEPS:
            options = dataclasses.replace(options, **{step: True})
            run(f"w4a8kv4-g128 +{step}" if step != ABLATION_STEPS[-1] else "w4a8kv4-g128 qoq", "w4a8kv4-g128", options)
        assert options == QoQOptions(), "the last ablation row must be the default QoQ pipeline"
        for step in EXTRA_STEPS:
            run(f"w4a8kv4-g128 qoq +{step}", "w4a8kv4-g128", dataclasses.replace(QoQOptions(), **{step: True}))

    ppl = {name: statistics.fmean(r["ppl"] for r in rows if r["name"] == name) for name in dict.fromkeys(r["name"] for r in rows)}
    fp = ppl["fp16"]

    def closed(fmt: str, qoq: str = "qoq") -> float:
        return (ppl[f"{fmt} rtn"] - ppl[f"{fmt} {qoq}"]) / (ppl[f"{fmt} rtn"] - fp)

    # The time target is for the fixture in general: the slower of the two QoQ formats.
    qoq_times = [r["quantize_seconds"] for r in rows if r["name"].endswith(" qoq")]
    checks = [
        ("fp16 perplexity reproduces the reference (abs diff)", lambda: abs(fp - a.reference_ppl), 0.01, "<="),
        ("QoQ w4a8kv4-g128 ppl / fp16", lambda: ppl["w4a8kv4-g128 qoq"] / fp, 1.02, "<="),
        ("QoQ w4a8kv4-chn ppl / fp16", lambda: ppl["w4a8kv4-chn qoq"] / fp, 1.03, "<="),
        ("g128: fraction of the RTN-to-fp16 gap closed by QoQ", lambda: closed("w4a8kv4-g128"), 0.5, ">="),
        ("chn: fraction of the RTN-to-fp16 gap closed by QoQ", lambda: closed("w4a8kv4-chn"), 0.5, ">="),
        ("seconds to quantize the fixture (QoQ, slower of g128 and chn)", lambda: max(qoq_times), 120.0, "<="),
    ]
    for step in EXTRA_STEPS:  # the same targets with an option beyond the defaults (reported, not the product's default)
        checks += [(f"g128: fraction of the RTN-to-fp16 gap closed by QoQ +{step}",
                    lambda s=step: closed("w4a8kv4-g128", f"qoq +{s}"), 0.5, ">="),
                   (f"chn: fraction of the RTN-to-fp16 gap closed by QoQ +{step}",
                    lambda s=step: closed("w4a8kv4-chn", f"qoq +{s}"), 0.5, ">=")]
    measured = []
    for name, value, target, op in checks:
        try:
            measured.append((name, value(), target, op))
        except (KeyError, ValueError):  # a row it needs was not run (--rows)
            pass
    result = {
        "command": "python3 " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "device": "cpu"},
        "model": str(a.model.name), "eval_data": a.eval.name, "calibration_data": a.calib.name,
        "seq_len": a.seq_len, "windows": windows.shape[0], "tokens": windows.numel(),
        "seeds": seeds,  # checks and ratios read each row's mean over these (the rows list every run)
        "rows": rows,
        "ratios": {name: value / fp for name, value in ppl.items()},
        "checks": [{"name": n, "value": v, "target": t, "op": op, "met": v <= t if op == "<=" else v >= t}
                   for n, v, t, op in measured],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    for c in result["checks"]:
        print(f"{'MET ' if c['met'] else 'MISS'} {c['name']}: {c['value']:.4f} {c['op']} {c['target']}")


if __name__ == "__main__":
    main()
