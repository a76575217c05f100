"""The KV cache is sized from the memory budget after the weights and one step's activations."""

import pytest

from services.worker.config import WorkerConfig
from services.worker.engine.capacity import CapacityError, plan_kv_blocks
from services.worker.engine.reference_runner import ReferenceRunner
from services.worker.server import BackgroundWorker
from shared.formats.artifact import ArtifactReader
from shared.rpc.qserve.v1 import worker_pb2
from tests.worker.conftest import stub


def test_plan_kv_blocks():
    assert plan_kv_blocks(budget_bytes=1000, weight_bytes=300, activation_bytes=200, block_bytes=50) == 10
    with pytest.raises(CapacityError, match="weights take .* activations .* one KV block 50 bytes"):
        plan_kv_blocks(budget_bytes=520, weight_bytes=300, activation_bytes=200, block_bytes=50)
    # A cache beyond what the running sequences can use is not allocated.
    assert plan_kv_blocks(1000, 300, 200, 50, max_useful_blocks=7) == 7


def _started_info(artifacts, **config) -> worker_pb2.WorkerInfo:
    """Info of a g128 worker started (and stopped) with these settings."""
    worker = BackgroundWorker(WorkerConfig(artifact=str(artifacts["w4a8kv4-g128"]), port=0, metrics_port=None, **config))
    try:
        channel, client = stub(worker)
        info = client.Info(worker_pb2.InfoRequest(), timeout=10)
        channel.close()
        return info
    finally:
        worker.stop(grace_s=0)


def test_a_small_model_takes_only_the_cache_its_sequences_can_use(artifacts):
    # 2 sequences of at most 64 tokens in blocks of 8: 2 x (8 + 1 spare) blocks, whatever the budget.
    info = _started_info(artifacts, gpu_memory_budget=2**30, block_size=8, max_running_sequences=2,
                         max_context_tokens=64)
    assert info.kv_blocks_total == 18


def test_the_worker_sizes_its_cache_from_the_budget(artifacts):
    reader = ArtifactReader(artifacts["w4a8kv4-g128"], verify=False)
    runner = ReferenceRunner(reader, "cpu", block_size=8)
    # KV4 pages: 6 layers x K and V x 2 heads x 8 tokens x (64 code bytes + fp16 scale and zero).
    assert runner.kv_block_bytes() == 6 * 2 * 2 * 8 * (128 // 2 + 4)
    budget = runner.weight_bytes() + runner.activation_bytes(64) + 37 * runner.kv_block_bytes() + 5
    info = _started_info(artifacts, gpu_memory_budget=budget, block_size=8, max_batch_tokens=64)
    assert (info.kv_blocks_total, info.kv_blocks_free, info.kv_block_size) == (37, 37, 8)
    assert info.max_context_tokens == 37 * 8  # one sequence must fit in the cache alone


def test_a_context_the_cache_cannot_hold_is_lowered_with_a_warning(artifacts, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="services.worker.serving"):
        info = _started_info(artifacts, kv_blocks=4, block_size=8, max_context_tokens=64)
    assert info.max_context_tokens == 32
    assert "--max-context-tokens 64 lowered to 32" in caplog.text


def test_decode_partials_are_reserved_for_the_rows_that_can_decode_only():
    """Decode attention's partial results (per row, per head, per 256-position partition) are taken by decode
    rows, one per running sequence at most: reserved for every token of a 4096-token step, a Llama-3.1-8B
    (128k context) estimate held ~32 GiB of the budget that the KV cache never got."""
    from types import SimpleNamespace

    from services.worker.engine.triton_runner import TritonRunner, TritonRunnerSettings
    from shared.model.config import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, vocab_size=128256, max_position_embeddings=131072)
    runner = SimpleNamespace(config=config, max_model_len=131072,
                             settings=TritonRunnerSettings(max_batch_tokens=4096, max_decode_batch=32))
    runner._token_bytes = lambda: TritonRunner._token_bytes(runner)
    partials_per_row = config.num_heads * (131072 // 256) * (config.head_dim + 2) * 4
    step = TritonRunner._step_bytes(runner, 4096)
    assert step == 4096 * runner._token_bytes() + 4096 * config.vocab_size * 6 + 32 * partials_per_row
    assert step < 4 * 2**30  # was ~36 GiB
    assert TritonRunner._step_bytes(runner, 8) - 8 * runner._token_bytes() - 8 * config.vocab_size * 6 \
        == 8 * partials_per_row  # a decode batch below the limit: its own rows


def test_attention_activations_are_sized_by_the_context_served(artifacts):
    """The CPU runner sized one step's attention by config.json's context window whatever --max-context-tokens
    said: a 1M-parameter model with a Llama-3.1-style 131,072-token window could not start in 2 GiB at all."""
    reader = ArtifactReader(artifacts["w4a8kv4-g128"], verify=False)
    window = ReferenceRunner(reader, "cpu", block_size=8)
    served = ReferenceRunner(reader, "cpu", block_size=8, max_model_len=64)
    assert window.max_model_len == window.config.max_position_embeddings > 64 == served.max_model_len
    blocks = 20
    budget = served.weight_bytes() + served.activation_bytes(64) + blocks * served.kv_block_bytes() + 5
    # At the whole window the same budget leaves no room for a single block.
    assert window.weight_bytes() + window.activation_bytes(64) > budget
    info = _started_info(artifacts, gpu_memory_budget=budget, block_size=8, max_batch_tokens=64,
                         max_context_tokens=64)
    assert (info.kv_blocks_total, info.max_context_tokens) == (blocks, 64)
