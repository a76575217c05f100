"""TritonRunner under the Triton interpreter (CPU) against the reference forward of the artifact.

Two sequences with different, scattered block tables go through a first prompt chunk, a second
chunk at start_position > 0 (in steps that mix position-0 chunks with cached-prefix chunks and
decode tokens) and three decode steps each; the logits of every step must match the reference
model's full-sequence forward at the same positions.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (see tests/kernels/conftest.py)
for _name in (
    "services.worker.kernels.act_quant", "services.worker.kernels.w4a8_gemm", "services.worker.kernels.kv4_cache",
    "services.worker.kernels.paged_attention", "services.worker.kernels.prefill_attention",
    "services.worker.engine.gpu_layers", "services.worker.engine.triton_runner",
):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])

import pytest  # noqa: E402
import torch  # noqa: E402

from services.worker.engine.runner import SequenceChunk, StepBatch  # noqa: E402
from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from shared.formats.artifact import ArtifactReader, ArtifactWriter  # noqa: E402
from shared.model.load import artifact_model  # noqa: E402
from shared.quant.options import QoQOptions  # noqa: E402
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint  # noqa: E402
from tests.conftest import write_random_llama  # noqa: E402
from tests.worker.conftest import EagerPiece  # noqa: E402

BLOCK = 4
# seq id -> (prompt length, first chunk length, physical blocks (scattered, never shared))
SEQS = {0: (13, 9, [5, 2, 9, 11]), 1: (12, 7, [3, 14, 0, 7])}
DECODE_STEPS = 3
# Relative L2 error of a logits row. The GEMMs are bit-exact given equal inputs; what differs is the
# fp16 residual stream and fp16 attention outputs (the reference keeps fp32), which flip int8
# activation codes by one step here and there, and for KV4 the position-0 prefill reading
# unquantized K/V where the reference reads KV4-rounded K/V. Measured on this model: fp16 <= 6.5e-4;
# W4A8KV4 <= 3.2e-2 (<= 1.9e-2 with the first chunks forced through the KV4 cache, so about half
# is the unquantized prefill K/V). A wrong position, slot or block table gives errors of order 1.
TOLERANCE = {"fp16": 3e-3, "w4a8kv4-g128": 5e-2}


def _steps(tokens: dict[int, list[int]]) -> list[list[tuple[int, int, int, bool]]]:
    """Steps as (seq, start, length, want_logits): seq 0 starts first, seq 1 joins one step later."""
    (len0, first0, _), (len1, first1, _) = SEQS[0], SEQS[1]
    steps = [
        [(0, 0, first0, False)],
        [(1, 0, first1, False), (0, first0, len0 - first0, True)],  # position-0 chunk + cached-prefix chunk
        [(1, first1, len1 - first1, True), (0, len0, 1, True)],  # cached-prefix chunk + decode token
    ]
    for i in range(1, DECODE_STEPS):
        steps.append([(0, len0 + i, 1, True), (1, len1 + i - 1, 1, True)])
    steps.append([(1, len1 + DECODE_STEPS - 1, 1, True)])
    return steps


@pytest.fixture(scope="module")
def tiny_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-runner")
    model = write_random_llama(root / "model", hidden=256, ffn=384, layers=2, heads=4, kv_heads=2, vocab=512,
                               tokenizer_from=None)
    out = {}
    for fmt in TOLERANCE:
        folder = root / fmt
        quantize_checkpoint(QuantizeSettings(model_dir=model, out_dir=folder, format=fmt, options=QoQOptions.rtn()))
        out[fmt] = folder
    return out


@pytest.fixture(scope="module")
def g128_steps(tiny_artifacts):
    """(tokens, logits) of the g128 artifact's steps as the runner takes them by default."""
    return _run_steps(ArtifactReader(tiny_artifacts["w4a8kv4-g128"]))


def _run_steps(reader: ArtifactReader, block: int = BLOCK, install=None) -> tuple[dict[int, list[int]], dict[int, dict[int, torch.Tensor]]]:
    """The steps of _steps through a TritonRunner -> (tokens per seq, seq -> position -> logits).
    install(runner), if given, runs after the cache is allocated."""
    runner = TritonRunner(reader, "cpu", block, TritonRunnerSettings(max_model_len=32, cuda_graphs=False))
    runner.allocate_cache(16)
    if install is not None:
        install(runner)
    g = torch.Generator().manual_seed(3)
    tokens = {s: torch.randint(0, 512, (n + DECODE_STEPS,), generator=g).tolist() for s, (n, _, _) in SEQS.items()}

    got = {s: {} for s in SEQS}  # seq -> position of the token whose logits came back -> logits
    for step in _steps(tokens):
        chunks = [
            SequenceChunk(seq_id=s, token_ids=tokens[s][start : start + n], start_position=start,
                          block_table=SEQS[s][2], want_logits=want)
            for s, start, n, want in step
        ]
        logits = runner.step(StepBatch(chunks))
        wanted = [(s, start + n - 1) for s, start, n, want in step if want]
        assert logits.shape == (len(wanted), 512) and logits.dtype == torch.float32
        for (s, pos), row in zip(wanted, logits):
            got[s][pos] = row
    return tokens, got


def _errors(reference, tokens, got) -> dict[tuple[int, int], float]:
    """(seq, position) -> relative L2 error of the runner's logits row against the reference forward."""
    out = {}
    for s in SEQS:
        ref = reference.forward(torch.tensor([tokens[s]]))[0]  # (L, V) fp32
        assert sorted(got[s]) == list(range(SEQS[s][0] - 1, len(tokens[s])))
        for pos, row in got[s].items():
            out[s, pos] = ((row - ref[pos]).norm() / ref[pos].norm()).item()
    return out


@pytest.mark.parametrize("fmt", list(TOLERANCE))
def test_chunked_prefill_and_decode_match_reference(tiny_artifacts, fmt, monkeypatch):
    from services.worker.kernels import paged_prefill_attention as ppa

    chunked_calls = []
    real = ppa.paged_prefill_attention
    monkeypatch.setattr(ppa, "paged_prefill_attention", lambda *a, **k: chunked_calls.append(a[0].shape[0]) or real(*a, **k))
    reader = ArtifactReader(tiny_artifacts[fmt])
    tokens, got = _run_steps(reader)
    # The cached-prefix chunks (4 and 5 rows, steps 2 and 3) went through the chunk kernel, per layer.
    assert chunked_calls == [4, 4, 5, 5]
    for (s, pos), err in _errors(artifact_model(reader), tokens, got).items():
        assert err < TOLERANCE[fmt], f"{fmt} seq {s} position {pos}: relative error {err:.2e}"


def _with_kv_range(src: Path, dst: Path, kv_range: tuple[float, float], key_feedback: torch.Tensor | None = None) -> Path:
    """A copy of artifact src whose every block carries the given KV4 range ratios (and key
    error-feedback factor)."""
    reader = ArtifactReader(src)
    with ArtifactWriter(dst, identity={}) as writer:
        for entry in reader.manifest.files:
            if entry.path.startswith("weights/block_"):
                tensors = load_file(str(src / entry.path))
                tensors["kv_range"] = torch.tensor(kv_range, dtype=torch.float32)
                if key_feedback is not None:
                    tensors["key_feedback"] = key_feedback
                writer.write_tensors(entry.path, tensors)
            else:
                writer.copy_file(src / entry.path, entry.path)
        return writer.finish(reader.manifest)


def test_gqa_at_head_dim_128_decodes_on_the_mma_kernel(tmp_path, monkeypatch):
    """Two query heads per KV head at head_dim 128 on pages of 16 tokens: the engine's decode steps
    take the "mma" kernel (its default there, session 17), and the logits still match."""
    from services.worker.kernels import paged_attention as pa

    model = write_random_llama(tmp_path / "model", hidden=256, ffn=384, layers=2, heads=2, kv_heads=1, vocab=512,
                               tokenizer_from=None)
    quantize_checkpoint(QuantizeSettings(model_dir=model, out_dir=tmp_path / "art", format="w4a8kv4-g128",
                                         options=QoQOptions.rtn()))
    variants = []
    real = pa.default_config
    monkeypatch.setattr(pa, "default_config", lambda *a, **k: variants.append(real(*a, **k).variant) or real(*a, **k))
    reader = ArtifactReader(tmp_path / "art")
    tokens, got = _run_steps(reader, block=16)
    assert variants and set(variants) == {"mma"}
    for (s, pos), err in _errors(artifact_model(reader), tokens, got).items():
        assert err < TOLERANCE["w4a8kv4-g128"], f"seq {s} position {pos}: relative error {err:.2e}"


def test_layer_kv_write_parameters_reach_the_cache_write(tiny_artifacts, tmp_path, monkeypatch):
    """An artifact's per-layer KV4 range ratios (exaggerated here) and key error-feedback factors are
    what the Triton cache write uses: the runner matches the reference that applies them, not the
    one that ignores the ratios, and every write gets its layer's factor (the kernel's rows with a
    factor equal the reference's bit for bit: tests/kernels/test_kv4_cache.py; a code the fp16 key
    rounds differently moves the later ones, so the logits alone cannot tell the factor apart)."""
    from services.worker.kernels import kv4_cache
    from shared.quant.key_feedback import feedback_factor

    src = tiny_artifacts["w4a8kv4-g128"]
    config = ArtifactReader(src).manifest.model_config
    kv_heads, d = config["num_kv_heads"], config["head_dim"]
    mix = torch.randn(kv_heads, d, d, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.05, 4.0, d)
    u = feedback_factor(mix @ mix.transpose(1, 2))
    reader = ArtifactReader(_with_kv_range(src, tmp_path / "kv-range", (0.75, 0.5), u))
    assert [reader.block_kv_range(i) for i in range(2)] == [(0.75, 0.5)] * 2
    factors = []
    real_write = kv4_cache.write_kv4_cache
    monkeypatch.setattr(kv4_cache, "write_kv4_cache",
                        lambda *a, **k: factors.append(k.get("key_feedback")) or real_write(*a, **k))
    tokens, got = _run_steps(reader)
    assert factors and all(f is not None and torch.equal(f.cpu(), u) for f in factors)
    applied = artifact_model(reader)
    worst = max(_errors(applied, tokens, got).values())
    assert worst < TOLERANCE["w4a8kv4-g128"]
    for block in applied.blocks:
        block.kv_range = (1.0, 1.0)
        block.key_feedback = None
    assert max(_errors(applied, tokens, got).values()) > 2 * max(worst, TOLERANCE["w4a8kv4-g128"])


def test_cpu_needs_the_interpreter(tiny_artifacts, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        TritonRunner(ArtifactReader(tiny_artifacts["fp16"]), "cpu")


@pytest.mark.parametrize("max_decode_batch,largest", [(None, 1024), (1, 1), (32, 32), (33, 48), (600, 640), (5000, 1024)])
def test_decode_graphs_stop_at_the_engines_largest_batch(max_decode_batch, largest):
    """Graphs for batches the engine never runs would still reserve their pool and logits."""
    buckets = TritonRunnerSettings(max_decode_batch=max_decode_batch).decode_buckets()
    assert buckets[-1] == largest
    assert buckets == tuple(sorted(buckets)) and buckets[0] == 1


def test_decode_batch_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_decode_batch 0"):
        TritonRunnerSettings(max_decode_batch=0)


@pytest.mark.parametrize("max_batch_tokens,largest", [(4096, 4096), (512, 512), (500, 512), (100, 128), (20000, 8192)])
def test_step_graphs_stop_at_the_first_bucket_covering_the_step_budget(max_batch_tokens, largest):
    """Every step of at most max_batch_tokens tokens has a bucket (up to the largest, 8192: larger steps
    run kernel by kernel), and no bucket above that one is captured."""
    buckets = TritonRunnerSettings(max_batch_tokens=max_batch_tokens).step_buckets()
    assert buckets[-1] == largest and buckets == tuple(sorted(buckets))
    with pytest.raises(ValueError, match="step_graph_tokens"):
        TritonRunnerSettings(step_graph_tokens=(0, 16))


class _EagerGraphs:
    """DecodeGraphs' interface on the CPU: each "replay" is an eager step of the rows it is given."""

    def __init__(self, runner: TritonRunner, largest: int):
        self.runner, self.buckets, self.pieces = runner, (largest,), []

    def replay(self, host, previous_token_ids):
        self.pieces.append(len(host.tokens))
        return self.runner._prompt_step(host, previous_token_ids)


def test_a_decode_batch_above_the_largest_graph_runs_in_pieces(tiny_artifacts, g128_steps):
    """Two-row decode steps with graphs of at most one row: each row replayed on its own, logits in
    row order and equal to the unsplit step's."""
    reader = ArtifactReader(tiny_artifacts["w4a8kv4-g128"])
    stand_ins = []

    def one_row_graphs(runner: TritonRunner) -> None:
        runner.graphs = _EagerGraphs(runner, largest=1)
        stand_ins.append(runner.graphs)

    _, split = _run_steps(reader, install=one_row_graphs)
    _, whole = g128_steps
    assert stand_ins[0].pieces == [1] * (2 * (DECODE_STEPS - 1) + 1)  # the decode-only steps, a row per piece
    for s in SEQS:
        assert sorted(split[s]) == sorted(whole[s])
        for pos, row in whole[s].items():
            torch.testing.assert_close(split[s][pos], row, rtol=1e-4, atol=1e-4)


def test_g128_activations_carry_group_sums_exactly_when_the_gemm_reads_them(tiny_artifacts, g128_steps, monkeypatch):
    """With a policy naming the dp4a GEMV at M = 1, the x-shared one (a program per token) at M = 2,
    the .zp kernel at odd M and the SWAR kernel at other even M, each quantization writes x8's group sums exactly when the GEMM it feeds takes them, and
    the logits equal the default policy's (every variant's sums are exact)."""
    from services.worker.kernels import w4a8_gemm

    reader = ArtifactReader(tiny_artifacts["w4a8kv4-g128"])
    _, default = g128_steps
    calls = []
    real = w4a8_gemm.w4a8_gemm

    def spy(x8, sx, weight, rowsum=None, variant=None, **kw):
        calls.append((variant, kw.get("group_sums") is not None))
        return real(x8, sx, weight, rowsum, variant, **kw)

    class MixedPolicy:
        def variant(self, kind, n, k, m):
            if m <= 2:
                return "g128.gemv.n32m1g4" if m == 1 else "g128.gemv.n16m1g8.xs"
            return "g128.n128m16.sk.zp" if m % 2 else "g128.n64m16.sk.swar"

    def mixed(runner: TritonRunner) -> None:
        runner.ops.policy = MixedPolicy()

    monkeypatch.setattr(w4a8_gemm, "w4a8_gemm", spy)
    _, mixed_run = _run_steps(reader, install=mixed)
    assert {variant for variant, _ in calls} == {"g128.gemv.n32m1g4", "g128.gemv.n16m1g8.xs", "g128.n128m16.sk.zp",
                                                 "g128.n64m16.sk.swar"}
    assert all(sums == w4a8_gemm.get_variant(variant).takes_group_sums for variant, sums in calls)
    for s in SEQS:
        for pos, row in default[s].items():
            torch.testing.assert_close(mixed_run[s][pos], row, rtol=1e-5, atol=1e-5)


def test_int8_path_workspace_is_reserved_up_front_and_logits_match(tiny_artifacts, g128_steps, monkeypatch):
    """A policy naming the g128 int8 path from M = 8: the runner reserves its weight copy (the largest
    layer's N * K bytes) when it is built, the prefill steps of 9 and 11 rows go through it without
    growing the workspace (captured graphs keep its address), and the logits equal the default
    policy's (the path is bit-exact)."""
    from services.worker.engine.kernel_policy import GemmPolicy
    from services.worker.kernels import w4a8_gemm

    class Int8PathFrom8:
        def variant(self, kind, n, k, m):
            return "g128.i8.n128m128" if m >= 8 else w4a8_gemm.default_variant_name(m, kind)

    monkeypatch.setattr(GemmPolicy, "from_manifest", classmethod(lambda cls, table: Int8PathFrom8()))
    int8_rows = []
    real = w4a8_gemm.int8_path_gemm
    monkeypatch.setattr(w4a8_gemm, "int8_path_gemm", lambda x8, *a, **k: int8_rows.append(x8.shape[0]) or real(x8, *a, **k))
    seen = {}

    def record(runner: TritonRunner) -> None:
        layer = runner.weights.layers[0]
        seen["largest"] = max(w.qweight.shape[0] * w.qweight.shape[1] * 2 for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        seen["bytes"] = runner.workspace_bytes
        seen["address"] = w4a8_gemm.WORKSPACE.pointer(runner.device)

    _, default = g128_steps
    _, got = _run_steps(ArtifactReader(tiny_artifacts["w4a8kv4-g128"]), install=record)
    assert seen["bytes"] == seen["largest"]
    assert w4a8_gemm.WORKSPACE.pointer("cpu") == seen["address"]
    assert sorted(set(int8_rows)) == [9, 11]  # the two prefill steps, every linear of every layer
    for s in SEQS:
        for pos, row in default[s].items():
            torch.testing.assert_close(got[s][pos], row, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", list(TOLERANCE))
def test_prompt_steps_replay_padded_step_graphs_like_kernel_by_kernel_steps(tiny_artifacts, g128_steps, fmt):
    """Step graphs of 8 and 10 tokens (pieces replayed eagerly): the prompt steps of 9 and 6 tokens
    run padded (padding rows write no cache slot: blocks no table names stay zero) with each layer's
    attention between the pieces, the 11-token step above the largest bucket kernel by kernel, and
    all give the kernel-by-kernel steps' logits."""
    reader = ArtifactReader(tiny_artifacts[fmt])
    runners = []

    def step_graphs(runner: TritonRunner) -> None:
        runner.settings = replace(runner.settings, step_graph_tokens=(8, 10))
        runner.step_graphs = runner._make_step_graphs(capture_piece=EagerPiece)
        runners.append(runner)

    _, padded = _run_steps(reader, install=step_graphs)
    _, whole = g128_steps if fmt == "w4a8kv4-g128" else _run_steps(reader)
    runner = runners[0]
    assert sorted(runner.step_graphs.graphs) == [8, 10]
    assert all(len(pieces) == 3 for pieces in runner.step_graphs.graphs.values())  # 2 layers + 1
    unused = sorted(set(range(16)) - {b for _, _, table in SEQS.values() for b in table})
    assert not runner.k_cache[:, unused].any() and not runner.v_cache[:, unused].any()
    for s in SEQS:
        assert sorted(padded[s]) == sorted(whole[s])
        for pos, row in whole[s].items():
            torch.testing.assert_close(padded[s][pos], row, rtol=0, atol=0)


def test_decode_attention_compiles_ahead_on_the_runners_own_layout(tiny_artifacts, caplog):
    """The start-up's compile_decode_attention (on a GPU: every form at once, one thread each) launches decode
    attention with the runner's cache, table width and query layout; here, on the interpreter, one at a time."""
    from services.worker.kernel_warm_up import compile_decode_attention

    runner = TritonRunner(ArtifactReader(tiny_artifacts["w4a8kv4-g128"]), "cpu", BLOCK,
                          TritonRunnerSettings(max_model_len=600, cuda_graphs=False))
    runner.allocate_cache(16)  # every table entry of the launches is block 0
    with caplog.at_level("WARNING"):
        forms = compile_decode_attention(runner, max_context=600, max_running=20)
    assert "failed" not in caplog.text
    assert forms == 2  # off a GPU no launch-overlap classes: a context of 1 unsplit, one of 600 split
