"""The start-up probe: this worker's logits for the artifact's probe tokens against the quantizer's reference
logits (shared.formats.probe), before the worker serves.

The quantizer's accuracy gate ran the reference numerics; the NaN self-check (serving._self_check) catches
only non-finite logits. A kernel that computes finite but wrong numbers on this GPU would serve fluent-looking
garbage that no error rate or latency budget sees. The probe feeds its prompt in two chunks (the second
continuing the first through the paged cache, the path of a chunked prompt or a cached prefix) and then its decode
tokens one at a time (teacher-forced, so one wrong token does not change the rest) through the runner the worker
serves with: GEMMs at the prompt's M and at M = 1, prefill and paged decode attention, the KV4 cache writes and
the decode CUDA graphs."""

from __future__ import annotations

import logging
import math
import time

import torch

from services.worker.engine.runner import SequenceChunk, StepBatch
from services.worker.errors import ArtifactBroken, ArtifactCorrupt
from shared.formats.artifact import ArtifactError, ArtifactReader
from shared.formats.probe import Probe

log = logging.getLogger(__name__)
PROBE_SEQ_ID = 0  # the engine has not started: no request holds an id or a block yet


def check_probe(runner, reader: ArtifactReader, num_blocks: int, max_context: int, max_batch_tokens: int,
                max_error: float) -> float | None:
    """The mean relative L2 error of the probe's logits rows; ArtifactBroken when it exceeds max_error.
    None when not checked: max_error 0, an artifact without a probe, or a probe longer than this worker's
    context window or KV cache (logged)."""
    artifact_id = reader.manifest.artifact_id
    if max_error == 0:
        return None
    try:
        probe = reader.probe()
    except ArtifactError as exc:  # listed with its sha256, so the quantizer wrote it so
        raise ArtifactCorrupt(str(exc)) from exc
    if probe is None:
        log.warning("artifact %s has no probe (made before probes): its logits on this worker's kernels are not "
                    "checked against the quantizer's reference", artifact_id)
        return None
    _check_fits(probe, reader.manifest.model_config["vocab_size"], artifact_id)
    length = len(probe.token_ids)
    if length > max_context or math.ceil(length / runner.block_size) > num_blocks:
        log.warning("artifact %s: the probe's %d tokens do not fit this worker's context (%d tokens, %d KV blocks); "
                    "not checked", artifact_id, length, max_context, num_blocks)
        return None
    started = time.perf_counter()
    errors = probe.errors(probe_logits(runner, probe, max_batch_tokens))
    prompt = len(probe.prompt_ids)
    mean, worst = sum(errors) / len(errors), max(errors)
    if not math.isfinite(mean) or mean > max_error:
        raise ArtifactBroken(
            f"artifact {artifact_id} failed the start-up probe: this worker's logits differ from the quantizer's "
            f"reference by {mean:.3f} on average (relative L2; at most {worst:.3f}, over {len(errors)} positions: a "
            f"prompt of {prompt} tokens, then {len(errors) - 1} decode steps), above --probe-max-error {max_error:g}: "
            f"its kernels do not compute the artifact's format on this device"
        )
    log.info("probe: logits within %.4f of the reference on average (relative L2; at most %.4f, %d positions; "
             "limit %g) in %.2f s", mean, worst, len(errors), max_error, time.perf_counter() - started)
    return mean


def _check_fits(probe: Probe, vocab_size: int, artifact_id: str) -> None:
    """ArtifactCorrupt unless the probe is of the model's vocabulary: Probe.read checks only its own rows, and
    a token id or logits width of another vocabulary would crash the runner or the comparison with a traceback."""
    if probe.logits.dim() != 2 or probe.logits.shape[1] != vocab_size:
        raise ArtifactCorrupt(f"artifact {artifact_id}: the probe's logits are {tuple(probe.logits.shape)}, not "
                              f"(rows, {vocab_size}): the model's vocab_size is {vocab_size}")
    outside = [token for token in probe.token_ids if not 0 <= token < vocab_size]
    if outside:
        raise ArtifactCorrupt(f"artifact {artifact_id}: the probe's token id {outside[0]} is outside the model's "
                              f"vocabulary [0, {vocab_size})")


def probe_logits(runner, probe: Probe, max_batch_tokens: int) -> torch.Tensor:
    """The runner's logits rows for the probe: the prompt in two chunks (or more, of at most max_batch_tokens:
    the step's budget sizes the GPU runner's workspace), so that the kernel of a chunk continuing a cached
    prefix (prefix caching, chunked prompts) is checked and compiled before serving too; then each decode token
    on its own (teacher-forced), in blocks 0.. of the cache (before the engine serves, every block is free)."""
    tokens, prompt = probe.token_ids, len(probe.prompt_ids)
    table = list(range(math.ceil(len(tokens) / runner.block_size)))
    chunk = min(max_batch_tokens, max(1, prompt // 2))
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        last = runner.step(StepBatch([SequenceChunk(PROBE_SEQ_ID, tokens[start:end], start, table, end == prompt)]))
    rows = [last]
    for position in range(prompt, len(tokens)):
        rows.append(runner.step(StepBatch([SequenceChunk(PROBE_SEQ_ID, [tokens[position]], position, table, True)])))
    return torch.cat(rows)
