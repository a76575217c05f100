"""Host time of the worker's engine per decode step (CPU only, no model): what the GPU waits for.

    python bench/engine_host.py --batch 256 --tokenizer ../shared/models/tiny-llama-pystdlib \
        --out bench/results/cpu/engine_host.json

The engine (scheduler, block manager, step batch, sampler bookkeeping, detokenizer, sinks) runs
with a runner that only builds the GPU runner's host-side step inputs (step_inputs.build_host_step)
and a sampler that returns fixed token ids, so the figure is the Python work between two decode
steps. With --tokenizer the detokenizer decodes real text (a fast tokenizer); without, a decoder
that returns no text. The minimum over repeats is reported (the machine's other load only adds).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import services.worker.engine.engine as engine_module  # noqa: E402
from services.worker.engine.engine import Engine, EngineLimits  # noqa: E402
from services.worker.engine.sequence import SamplingOptions  # noqa: E402
from services.worker.engine.step_inputs import build_host_step  # noqa: E402

BLOCK_SIZE = 16


class HostOnlyRunner:
    block_size = BLOCK_SIZE
    device = torch.device("cpu")

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // BLOCK_SIZE)

    def allocate_cache(self, num_blocks: int) -> None:
        pass

    def step(self, batch):
        build_host_step(batch, BLOCK_SIZE, self.max_blocks, self.max_model_len)
        return torch.empty(sum(1 for c in batch.chunks if c.want_logits), 1)


class NoText:
    def decode(self, ids: list[int]) -> str:
        return ""


def fixed_tokens(vocab: int):
    """A sampler stand-in: token ids spread over the vocabulary, different every step."""
    step = [0]

    def sample(logits, options, generators):
        step[0] += 1
        return torch.tensor([(i * 37 + step[0] * 11) % vocab for i in range(len(options))], dtype=torch.int64)

    return sample


def decode_step_ms(batch: int, prompt: int, output: int, decoder) -> float:
    runner = HostOnlyRunner(prompt + output)
    per_seq = -(-(prompt + output) // BLOCK_SIZE) + 1
    engine = Engine(runner, decoder, EngineLimits(batch * per_seq, batch, batch, 8192, prompt + output), ())
    options = SamplingOptions(max_new_tokens=output, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i + j) % 15 for j in range(prompt)], options, lambda out: None)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefill, not timed
    steps, start = 0, time.perf_counter()
    while engine.step():
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--tokenizer", type=Path, help="a checkpoint folder whose tokenizer decodes the text")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    decoders = {"no text": NoText()}
    if a.tokenizer:
        from shared.model.tokenizer import Tokenizer

        decoders[f"tokenizer of {a.tokenizer.name}"] = Tokenizer(a.tokenizer)
    engine_module.sample = fixed_tokens(4096)
    rows = []
    for name, decoder in decoders.items():
        ms = min(decode_step_ms(a.batch, a.prompt, a.output, decoder) for _ in range(a.repeats))
        rows.append({"decoder": name, "batch": a.batch, "host_ms_per_decode_step": round(ms, 3)})
        print(f"batch {a.batch}, {name}: {ms:.2f} ms of host work per decode step", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]),
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version()},
            "method": __doc__.split("\n\n", 2)[2].strip(),
            "rows": rows,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
