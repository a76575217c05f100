"""Peak memory of quantizing a Llama-2-7B-shaped checkpoint (random weights), block by block.

    python bench/quantize_memory.py --device cuda --out bench/results/h200/quantize_memory.json

Makes the checkpoint (fp16, 13.5 GB), then quantizes it in a child process and reads the
child's peak resident set size from the kernel (getrusage), so the checkpoint generation does
not count. The claim checked: peak RSS stays far below the model's fp32 size.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def child(model: Path, out: Path, fmt: str, device: str, gpu_target: str) -> None:
    import torch

    from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint

    start = time.time()
    blocks = []
    manifest = quantize_checkpoint(
        QuantizeSettings(model_dir=model, out_dir=out, format=fmt, gpu_target=gpu_target, device=device),
        lambda stage, done, total: blocks.append(time.time()) if stage == "quantize" else None,
    )
    gpu_peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    print(json.dumps({
        "seconds": time.time() - start, "gpu_peak_bytes": gpu_peak, "artifact_id": manifest.artifact_id,
        "seconds_per_block": (blocks[-1] - blocks[0]) / max(len(blocks) - 1, 1),
        "calibration": manifest.calibration,
    }))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--format", default="w4a8kv4-g128")
    p.add_argument("--gpu-target", default="sm90")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/qmem"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    model, art = a.workdir / "llama2-7b-random", a.workdir / "artifact"
    if a.child:
        child(model, art, a.format, a.device, a.gpu_target)
        return
    from shared.model.demo import SHAPES, write_demo_checkpoint

    t = time.time()
    if not (model / "config.json").is_file():
        write_demo_checkpoint(model, "llama2-7b")
    gen_s = time.time() - t
    cmd = [sys.executable, __file__, "--child", "--device", a.device, "--format", a.format,
           "--gpu-target", a.gpu_target, "--workdir", str(a.workdir), "--out", str(a.out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"quantization failed:\n{proc.stderr[-4000:]}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
    s = SHAPES["llama2-7b"]
    params = s.vocab * s.hidden * 2 + s.layers * (4 * s.hidden * s.hidden + 3 * s.hidden * s.ffn) + (2 * s.layers + 1) * s.hidden
    fp32_bytes = params * 4
    import torch

    result = {
        "command": "python3 " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "torch": torch.__version__},
        "model": {"shape": "llama2-7b", "parameters": params, "fp32_bytes": fp32_bytes, "generate_seconds": gen_s},
        "format": a.format, "device": a.device,
        "peak_rss_bytes": peak_rss, "peak_rss_gib": peak_rss / 2**30, **stats,
        "checks": [{"name": "peak RSS / fp32 model size", "value": peak_rss / fp32_bytes, "target": 0.25, "op": "<=",
                    "met": peak_rss / fp32_bytes <= 0.25}],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
