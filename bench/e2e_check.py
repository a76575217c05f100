"""The GPU check before the e2e benchmark: TritonRunner against the reference forward.

A small random Llama (head_dim 128, 2 layers) per format; two sequences with scattered block
tables go through a position-0 chunk, a cached-prefix chunk (mixed with a position-0 chunk in one
step) and decode steps, the decode steps through the CUDA graphs. Every returned logits row is
compared with the reference model's full-sequence forward (relative L2 error); the tolerances are
those of tests/worker/test_triton_runner.py (its docstring says why).
"""

from __future__ import annotations

import torch

from bench.random_model import RandomArtifact
from services.worker.engine.runner import SequenceChunk, StepBatch
from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings
from shared.model.config import LlamaConfig
from shared.model.load import artifact_model

SMALL = LlamaConfig(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=128,
                    vocab_size=1024, rms_norm_eps=1e-5, max_position_embeddings=256)
TOLERANCE = {"fp16": 3e-3, "w4a8kv4-g128": 5e-2, "w4a8kv4-chn": 5e-2}
BLOCK = 16
SEQS = {0: (70, 41, [5, 2, 9, 11, 6]), 1: (50, 17, [3, 14, 0, 7, 12])}  # prompt, first chunk, blocks
DECODE = 6


def check_format(fmt: str, device: torch.device, kernel_policy: dict | None) -> dict:
    reader = RandomArtifact(SMALL, fmt, device, seed=7, kernel_policy=kernel_policy)
    runner = TritonRunner(reader, device, BLOCK, TritonRunnerSettings(max_model_len=128, graph_batch_sizes=(1, 2, 4)))
    runner.allocate_cache(16)
    g = torch.Generator().manual_seed(5)
    tokens = {s: torch.randint(0, SMALL.vocab_size, (n + DECODE,), generator=g).tolist() for s, (n, _, _) in SEQS.items()}
    (len0, first0, _), (len1, first1, _) = SEQS[0], SEQS[1]
    steps = [
        [(0, 0, first0, False)],
        [(1, 0, first1, False), (0, first0, len0 - first0, True)],
        [(1, first1, len1 - first1, True), (0, len0, 1, True)],
    ]
    steps += [[(0, len0 + i, 1, True), (1, len1 + i - 1, 1, True)] for i in range(1, DECODE)]
    steps.append([(1, len1 + DECODE - 1, 1, True)])
    got = {s: {} for s in SEQS}
    for step in steps:
        chunks = [SequenceChunk(s, tokens[s][a : a + n], a, SEQS[s][2], w) for s, a, n, w in step]
        logits = runner.step(StepBatch(chunks))
        for (s, pos), row in zip([(s, a + n - 1) for s, a, n, w in step if w], logits):
            got[s][pos] = row.float()
    reference = artifact_model(reader, device)
    errors = []
    for s in SEQS:
        ref = reference.forward(torch.tensor([tokens[s]], device=device))[0]
        errors += [((row - ref[p]).norm() / ref[p].norm()).item() for p, row in got[s].items()]
    worst = max(errors)
    graphs = sorted(runner.graphs.graphs) if runner.graphs else []
    return {"format": fmt, "max_rel_err": worst, "tolerance": TOLERANCE[fmt], "ok": worst < TOLERANCE[fmt],
            "rows": len(errors), "decode_graphs_used": graphs}


def check_policy_gemms(kernel_policy: dict, device: torch.device) -> list[dict]:
    """Every variant the policy names, once, bit-exact against the reference linear on its 7B shape."""
    from services.worker.kernels.w4a8_gemm import w4a8_gemm
    from shared.model.linear import reference_linear
    from shared.quant.activations import quantize_per_token
    from shared.quant.weights import WEIGHT_QUANTIZERS

    out = []
    for kind, shapes in kernel_policy["gemm"].items():
        for shape, rows in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            w = WEIGHT_QUANTIZERS[kind][0](torch.randn(n, k, device=device) * k**-0.5)
            ref_lin = reference_linear(w)
            for max_m, name in rows:
                m = max_m or 2048
                x = torch.randn(m, k, device=device)
                x8, sx = quantize_per_token(x)
                y = w4a8_gemm(x8, sx.reshape(-1).float(), w, x8.sum(-1, dtype=torch.int32), variant=name,
                              group_sums=x8.view(m, k // 128, 128).sum(-1, dtype=torch.int32))
                ref = ref_lin(x).half()
                out.append({"kind": kind, "shape": shape, "m": m, "variant": name,
                            "bit_exact": bool(torch.equal(y, ref))})
    return out


def check_engine_overlap(fmt: str, device: torch.device) -> dict:
    """The engine with overlapped steps (each launched before the previous one's tokens are read
    back, the GPU default) against the engine without: the same greedy tokens for requests of
    mixed lengths, one of them ended by a stop token found only on read-back."""
    from bench.e2e_engine import make_engine
    from services.worker.engine.sequence import SamplingOptions

    reader = RandomArtifact(SMALL, fmt, device, seed=11)
    runner = TritonRunner(reader, device, BLOCK, TritonRunnerSettings(max_model_len=128, graph_batch_sizes=(1, 2, 4, 8)))
    g = torch.Generator().manual_seed(3)
    lengths = [(9, 12), (40, 7), (23, 15), (5, 20), (31, 9), (17, 11)]  # (prompt, new tokens)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist() for n, _ in lengths]

    def run(overlap: bool, stop: tuple[int, ...]) -> tuple[list[list[int]], int]:
        engine = make_engine(runner, len(prompts), 64, max_batch_tokens=48, overlap=overlap)
        got = [[] for _ in prompts]
        for i, (prompt, (_, new)) in enumerate(zip(prompts, lengths)):
            options = SamplingOptions(max_new_tokens=new, ignore_eos=True, stop_token_ids=stop if i == 0 else ())
            engine.add_request(f"r{i}", prompt, options, lambda out, i=i: got[i].extend(out.token_ids))
        steps = 0
        while engine.step():
            steps += 1
        return got, steps

    plain, _ = run(False, ())
    stop = (plain[0][4],)  # request 0 stops at its 5th token (or earlier, at the same token)
    in_step, steps_in_step = run(False, stop)
    overlapped, steps_overlapped = run(True, stop)
    return {"format": fmt, "ok": overlapped == in_step and in_step[1:] == plain[1:] and len(in_step[0]) <= 5,
            "tokens_equal": overlapped == in_step, "iterations_in_step": steps_in_step,
            "iterations_overlapped": steps_overlapped}
