"""The worker's start-up self-check on a GPU (TritonRunner, CUDA graphs): an artifact loads through
load_served_model (which generates a few tokens before serving), then a copy whose final RMSNorm weight
holds an inf (every file's sha256 re-listed, so only the self-check can catch it) must be refused.

    python3 bench/self_check_gpu.py --artifact ARTIFACT_DIR --out bench/results/<gpu>/worker_self_check.json

ARTIFACT_DIR: any artifact bound to this GPU (e.g. `qctl quantize --model ... --gpu-target sm90`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere, as the other bench scripts

from services.worker.config import WorkerConfig
from services.worker.errors import ArtifactBroken
from services.worker.serving import load_served_model
from shared.formats.artifact import HEAD_FILE
from shared.storage.hashing import sha256_file


def poison_final_norm(artifact: Path) -> None:
    """Puts an inf in the artifact's final norm weight, in place, and lists the file's new sha256 and size in
    its manifest: every file check passes, and only running the model shows it broken (inf * 0 and
    inf - inf make the logits NaN). tests/worker/test_start_up_refusals.py uses it too."""
    tensors = load_file(artifact / HEAD_FILE)
    name = next(k for k in tensors if "norm" in k)
    tensors[name][0] = float("inf")
    save_file(tensors, artifact / HEAD_FILE)
    size, digest = sha256_file(artifact / HEAD_FILE)
    manifest = json.loads((artifact / "manifest.json").read_text())
    next(f for f in manifest["files"] if f["path"] == HEAD_FILE).update(size=size, sha256=digest)
    (artifact / "manifest.json").write_text(json.dumps(manifest))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    t0 = time.perf_counter()
    served = load_served_model(WorkerConfig(artifact=str(args.artifact), device="cuda", metrics_port=None))
    load_s = time.perf_counter() - t0
    del served
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(shutil.copytree(args.artifact, Path(tmp) / "poisoned"))
        poison_final_norm(bad)
        try:
            load_served_model(WorkerConfig(artifact=str(bad), device="cuda", metrics_port=None))
            refusal = None
        except ArtifactBroken as exc:
            refusal = str(exc)
    result = {
        "command": "python3 bench/self_check_gpu.py " + shlex.join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "artifact": str(args.artifact),
        "load_with_self_check_s": load_s,
        "poisoned_refusal": refusal,
        "checks": [{"name": "an artifact whose logits are not finite is refused at start-up", "value": int(refusal is not None),
                    "target": 1, "op": ">=", "met": refusal is not None}],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if refusal is not None else 1


if __name__ == "__main__":
    sys.exit(main())
