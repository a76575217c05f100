"""The start-up's attention warm-up (services/worker/kernel_warm_up.py): on a GPU it launches each attention
kernel in every row class and split form serving can reach (bench/results/h100/serving_compiles.json: none
compiled after it); here, that its steps are ones the runner runs, within the worker's limits, covering them."""

from __future__ import annotations

from services.worker.engine.reference_runner import ReferenceRunner
from services.worker.kernel_warm_up import ROW_CLASSES, warm_attention_kernels
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
