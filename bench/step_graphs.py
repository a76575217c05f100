"""Steps with prompt tokens, kernel by kernel against the piecewise step graphs (step_graphs.py).

    python3 bench/step_graphs.py --out bench/results/h100/step_graphs.json

A Llama-2-7B-shaped random model (g128 by default). Each step is a mixed step: one prompt chunk
of `t` tokens at position 0, one continuing chunk of 16 tokens after a 512-token prefix, and
`--decode-rows` decode tokens at context `--context` (the batch a serving engine carries while a
new request's prompt comes in). Each step runs the same inputs both ways; reported: median wall ms
a step (synchronized), the ratio, and the largest logits difference between the two relative to
the logits' largest magnitude (the graphs pad to their bucket, where the GEMM policy may pick
another variant, so equal up to fp32 epilogue rounding rather than bit-exact).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import gpu_machine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="w4a8kv4-g128", choices=("w4a8kv4-chn", "w4a8kv4-g128", "fp16"))
    p.add_argument("--tokens", default="16,64,256,512,1024,2048,4000", help="prompt tokens of the steps")
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="the decode rows' context length")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import torch

    from bench.e2e import describe, llama2_7b_artifact
    from services.worker.engine.runner import SequenceChunk, StepBatch
    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings

    dev = torch.device("cuda")
    sizes = [int(x) for x in a.tokens.split(",")]
    block, chunk, prefix = 16, 16, 512
    most = max(sizes) + chunk + a.decode_rows
    max_len = max(max(sizes), a.context + 1, prefix + chunk)
    runner = TritonRunner(llama2_7b_artifact(a.format, dev), "cuda", block,
                          TritonRunnerSettings(max_model_len=max_len, max_batch_tokens=most))
    blocks_per_seq = -(-max_len // block)
    runner.allocate_cache(blocks_per_seq * (a.decode_rows + 2))
    table = lambda i: list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, runner.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731

    def batch(t: int) -> StepBatch:
        chunks = [SequenceChunk(seq_id=0, token_ids=ids(t), start_position=0, block_table=table(0), want_logits=True),
                  SequenceChunk(seq_id=1, token_ids=ids(chunk), start_position=prefix, block_table=table(1),
                                want_logits=True)]
        chunks += [SequenceChunk(seq_id=2 + i, token_ids=ids(1), start_position=a.context, block_table=table(2 + i),
                                 want_logits=True) for i in range(a.decode_rows)]
        return StepBatch(chunks)

    graphs = runner.step_graphs
    capture_s = {}
    for b in reversed(graphs.buckets):  # as TritonRunner.capture_graphs does, largest first
        t0 = time.perf_counter()
        graphs.capture(b)
        torch.cuda.synchronize()
        capture_s[b] = round(time.perf_counter() - t0, 3)
    print("capture s:", json.dumps(capture_s), flush=True)

    def timed(step: StepBatch, with_graphs: bool) -> tuple[float, torch.Tensor]:
        runner.step_graphs = graphs if with_graphs else None
        logits = runner.step(step)  # compiles, captures
        torch.cuda.synchronize()
        ms = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            runner.step(step)
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ms), logits

    rows = []
    for t in sizes:
        step = batch(t)
        eager_ms, eager = timed(step, False)
        graph_ms, graphed = timed(step, True)
        diff = ((graphed - eager).abs().max() / eager.abs().max()).item()
        row = {"prompt_tokens": t, "step_tokens": step.num_tokens, "bucket": graphs.bucket_for(step.num_tokens),
               "kernel_by_kernel_ms": round(eager_ms, 2), "step_graphs_ms": round(graph_ms, 2),
               "speedup": round(eager_ms / graph_ms, 3), "logits_max_rel_diff": diff}
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = {
        "command": " ".join(["python3"] + sys.argv),
        "machine": gpu_machine(dev),
        "model": describe("llama2-7b"),
        "format": a.format, "decode_rows": a.decode_rows, "context": a.context,
        "continuing_chunk": {"tokens": chunk, "after": prefix},
        "capture_s_by_bucket": capture_s,
        "rows": rows,
        "checks": [],  # a diagnosis: no target of an issue is measured here
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
