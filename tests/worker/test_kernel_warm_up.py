"""The start-up's attention warm-up (services/worker/kernel_warm_up.py): on a GPU it launches each attention
kernel in every row class and split form serving can reach (bench/results/h100/serving_compiles.json: none
compiled after it); here, that its steps are ones the runner runs, within the worker's limits, covering them."""

from __future__ import annotations

import torch

from services.worker.engine.reference_runner import ReferenceRunner
from services.worker.kernel_warm_up import ROW_CLASSES, decode_attention_forms, warm_attention_kernels
from services.worker.kernels import paged_attention
from services.worker.kernels.paged_attention import decode_partitions
from services.worker.kernels.launch_overlap import AFTER_WAIT_MAX_ROWS, PDL_MAX_ROWS
from shared.formats.artifact import ArtifactReader

BLOCK = 4


class _Recorder:
    """Records the steps; runs them on the tiny model's reference runner when given one."""

    block_size = BLOCK

    def __init__(self, runner=None):
        self.runner, self.steps = runner, []

    def step(self, batch):
        if self.runner is not None:  # the reference runner checks the batch against its cache
            assert self.runner.step(batch).shape[0] == len(batch.chunks)
        self.steps.append(batch)


def _recorded_steps(artifacts, num_blocks, max_context, max_batch_tokens, max_running, run=False):
    runner = None
    if run:
        runner = ReferenceRunner(ArtifactReader(artifacts["fp16"], verify=False), "cpu", block_size=BLOCK)
        runner.allocate_cache(num_blocks)
    recorder = _Recorder(runner)
    warm_attention_kernels(recorder, num_blocks, max_context, max_batch_tokens, max_running)
    return recorder.steps


def _row_class(rows: int) -> int:
    return 0 if rows <= AFTER_WAIT_MAX_ROWS else 1 if rows <= PDL_MAX_ROWS else 2


def test_every_row_class_within_the_limits_is_launched_and_no_step_leaves_them():
    num_blocks, max_context, max_batch_tokens, max_running = 80, 300, 300, 20
    steps = _recorded_steps(None, num_blocks, max_context, max_batch_tokens, max_running)
    firsts, continuing, decodes = set(), set(), set()
    for batch in steps:
        assert batch.num_tokens <= max_batch_tokens
        prompt = [c for c in batch.chunks if len(c.token_ids) > 1 or c.start_position == 0]
        decode = [c for c in batch.chunks if c not in prompt]
        assert prompt, "a step without prompt tokens would run the CUDA graphs, which compiled at capture"
        assert len(decode) <= max_running
        for c in batch.chunks:
            end = c.start_position + len(c.token_ids)
            assert end <= max_context and max(c.block_table) < num_blocks
            assert len(c.block_table) * BLOCK >= end
        for c in prompt:
            (continuing if c.start_position else firsts).add(_row_class(len(c.token_ids)))
        if decode:
            decodes.add((_row_class(len(decode)), max(c.start_position + 1 for c in decode)))
    assert firsts == continuing == {0, 1, 2}
    # Decode rows: at most max_running (20) of them, so classes 0 and 1, each at the shortest and longest context.
    assert decodes == {(0, 2), (0, max_context), (1, 2), (1, max_context)}


def test_classes_the_limits_never_reach_are_skipped_and_the_steps_run(artifacts):
    steps = _recorded_steps(artifacts, num_blocks=8, max_context=20, max_batch_tokens=12, max_running=4, run=True)
    assert steps and max(b.num_tokens for b in steps) <= 12  # 17 or 257 rows: over the step budget
    assert max(len(b.chunks) for b in steps) <= 1 + 4  # one prompt token and at most max_running decode rows
    assert {b.num_tokens for b in steps} == {ROW_CLASSES[0], ROW_CLASSES[0] + 1}


def _forms(max_running, max_context, graph_batches=(), graph_context=0, split_from=None):
    """decode_attention_forms under the launcher's row classes, with contexts split past 64 tokens, or past
    split_from(rows) when given (more rows: longer partitions, as partition_for's whole-context rule)."""
    return decode_attention_forms(
        _row_class, lambda rows, context: 1 + (context > (split_from(rows) if split_from else 64)),
        max_running, max_context, graph_batches, graph_context,
    )


def test_every_decode_attention_form_serving_reaches_is_compiled_once():
    # Eager steps reach each row class up to max_running, split or not; the graphs add nothing new here.
    forms = _forms(max_running=300, max_context=200, graph_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                   graph_context=200)
    assert set(forms) == {(k, s) for k in (0, 1, 2) for s in (False, True)}
    for (row_class, split), (rows, context) in forms.items():  # each a launch in its own form
        assert _row_class(rows) == row_class and (context > 64) == split and rows <= 300 and context <= 200
    # Within the limits only: 20 running sequences reach classes 0 and 1; a context of 64 never splits.
    assert set(_forms(max_running=20, max_context=64)) == {(0, False), (1, False)}
    assert set(_forms(max_running=1, max_context=1000)) == {(0, False), (0, True)}


def test_decode_graph_forms_count_even_when_eager_steps_never_split_them():
    # Many rows take the whole context in one partition (partition_for): the eager launches of class 1 at
    # the engine's context do not split, a graph captured at the runner's longer context does.
    forms = _forms(max_running=64, max_context=100, graph_batches=(17, 32, 64), graph_context=2048,
                   split_from=lambda rows: 1000 if rows > 16 else 64)
    assert forms[(1, True)] == (17, 2048)
    assert set(forms) == {(0, False), (0, True), (1, False), (1, True)}


class _LaunchSpy:
    """Stands in for a decode kernel: records each launch's grid and SPLIT form instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((grid, meta.get("SPLIT")))  # the reduction has none


def test_decode_partitions_is_the_launchers_split(monkeypatch):
    """The warm-up predicts each launch's form with decode_partitions: it must be the partition grid and the
    SPLIT form paged_decode_attention then launches."""
    heads, kv_heads, d, block = 4, 2, 64, 16
    k_cache = torch.zeros((12, kv_heads, block, d // 2 + 4), dtype=torch.uint8)
    spy = _LaunchSpy()
    for name in ("_kv4_decode_fma_kernel", "_kv4_decode_mma_kernel", "_kv4_decode_head_rows_kernel",
                 "_kv4_decode_dot_kernel", "_reduce_partitions_kernel"):
        monkeypatch.setattr(paged_attention, name, spy)
    predicted = []
    for rows, context in ((1, 1), (2, 40), (3, 300), (5, 513), (2, 64 * block)):
        query = torch.zeros((rows, heads, d), dtype=torch.float16)
        tables = torch.zeros((rows, 64), dtype=torch.int32)  # every entry block 0
        lens = torch.full((rows,), context, dtype=torch.int32)
        paged_attention.paged_decode_attention(query, k_cache, k_cache, tables, lens, max_context_len=context)
        predicted.append(decode_partitions(rows, heads, d, k_cache, context))
    decode = [(grid[1], split) for grid, split in spy.launches if split is not None]
    assert decode == [(n, n > 1) for n in predicted]
    assert predicted[0] == 1 and predicted[-1] > 1  # both forms seen
