"""Start-up: the artifact, its runner and tokenizer, and an engine sized to the memory budget."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.worker.config import CPU_DEFAULT_BUDGET, GPU_DEFAULT_FRACTION, ConfigError, WorkerConfig
from services.worker.engine.capacity import plan_kv_blocks
from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.loading import LoadedArtifact, load_runner, open_artifact, runner_formats, worker_gpu_target
from services.worker.engine.sequence import SamplingOptions
from services.worker.errors import ArtifactBroken, ArtifactCorrupt
from services.worker.kernel_warm_up import compile_decode_attention, warm_attention_kernels
from services.worker.probe_check import check_probe
from shared.formats.artifact import ArtifactError
from shared.model.config import CheckpointError
from shared.model.tokenizer import Tokenizer, generation_eos_ids, prompt_adds_bos

log = logging.getLogger(__name__)
# How often a start-up that is still capturing CUDA graphs says how far it is.
GRAPH_PROGRESS_LOG_S = 15.0
# The start-up self-check: a prompt of this many token ids spread over the vocabulary, then greedy tokens.
SELF_CHECK_PROMPT_TOKENS = 16
SELF_CHECK_NEW_TOKENS = 4


@dataclass(slots=True)
class ServedModel:
    artifact: LoadedArtifact
    engine: Engine
    tokenizer: Tokenizer
    add_bos: bool  # prepend bos_token_id to text prompts (as transformers' tokenizer(prompt) would: prompt_adds_bos)
    bos_token_id: int | None
    vocab_size: int
    gpu_target: str
    gpu_name: str
    vocabulary_digest: str  # the tokenizer's (Tokenizer.vocabulary_digest), as the registry records it
    probe_error: float | None = None  # the start-up probe's (probe_check.check_probe); None when not checked

    @property
    def format(self) -> str:
        return self.artifact.reader.manifest.format


def load_served_model(config: WorkerConfig) -> ServedModel:
    """Blocking (downloads, hashes every file, loads weights): run it off the event loop."""
    device = torch.device(config.device)
    gpu_target, gpu_name = worker_gpu_target(device)
    artifact = open_artifact(
        config.artifact, gpu_target=gpu_target, formats=runner_formats(device), expected_format=config.format,
        store=config.store, registry_url=config.registry_url, cache_dir=config.cache_dir,
    )
    reader = artifact.reader
    budget = _budget(config, device)  # before loading: the default is a share of what is free now
    try:
        runner = load_runner(reader, device, config.block_size, max_batch_tokens=config.max_batch_tokens,
                             max_model_len=config.max_context_tokens, max_decode_batch=config.max_running_sequences)
    # ArtifactError: tensors missing, or not the shapes the manifest's model_config says; CheckpointError:
    # a model_config no Llama can have (e.g. an odd head_dim). Either is the artifact's fault, refused as
    # such: not a traceback from deep inside the model.
    except (ArtifactError, CheckpointError) as exc:
        raise ArtifactCorrupt(f"artifact {reader.manifest.artifact_id} cannot be loaded: {exc}") from exc
    model_config = runner.config
    num_blocks = config.kv_blocks or plan_kv_blocks(
        budget, runner.weight_bytes(), runner.activation_bytes(config.max_batch_tokens), runner.kv_block_bytes(),
        max_useful_blocks=_max_useful_blocks(config, model_config.max_position_embeddings),
    )
    # One sequence must always fit in the cache on its own, or preemption could never make room.
    max_context = min(model_config.max_position_embeddings, num_blocks * config.block_size,
                      config.max_context_tokens or model_config.max_position_embeddings)
    if max_context < 2:
        # As --max-context-tokens 1 is refused: no prompt and generated token fit, and a worker that started would
        # announce itself and refuse every request, each refusal counted as the client's fault.
        raise ConfigError(f"the KV cache holds {num_blocks * config.block_size} token(s) ({num_blocks} blocks of "
                          f"{config.block_size}): no prompt and generated token fit; raise --kv-blocks, --block-size "
                          f"or the memory budget")
    if config.max_context_tokens is not None and max_context < config.max_context_tokens:
        log.warning("--max-context-tokens %d lowered to %d: the model's context window is %d and the KV cache "
                    "holds %d tokens", config.max_context_tokens, max_context,
                    model_config.max_position_embeddings, num_blocks * config.block_size)
    limits = EngineLimits(
        num_blocks=num_blocks,
        max_running=config.max_running_sequences,
        max_waiting=config.max_waiting_requests,
        max_batch_tokens=config.max_batch_tokens,
        max_context=max_context,
    )
    tokenizer, eos_token_ids, add_bos = _text_conventions(reader, model_config)
    engine = Engine(runner, tokenizer, limits, eos_token_ids, overlap=config.overlap_steps,
                    prefix_caching=config.prefix_caching)
    if device.type == "cuda":
        compile_decode_attention(runner, max_context, config.max_running_sequences)  # before the graphs need it
    if config.capture_graphs:
        _capture_graphs(runner)
    _self_check(engine, reader.manifest.artifact_id, model_config.vocab_size)
    probe_error = check_probe(runner, reader, num_blocks, max_context, config.max_batch_tokens,
                              config.probe_max_error)
    if device.type == "cuda":
        warm_attention_kernels(runner, num_blocks, max_context, config.max_batch_tokens, config.max_running_sequences)
    engine.forget_start_up_checks()  # the probe and warm-up wrote K/V behind its back; counters from zero
    log.info("artifact %s (%s, %s) on %s: %d KV blocks of %d tokens, context %d",
             reader.manifest.artifact_id, reader.manifest.format, reader.manifest.gpu_target, gpu_name,
             num_blocks, config.block_size, max_context)
    return ServedModel(
        artifact=artifact, engine=engine, tokenizer=tokenizer,
        add_bos=add_bos,
        bos_token_id=model_config.bos_token_id, vocab_size=model_config.vocab_size,
        gpu_target=gpu_target, gpu_name=gpu_name, vocabulary_digest=tokenizer.vocabulary_digest(),
        probe_error=probe_error,
    )


def _text_conventions(reader, model_config) -> tuple[Tokenizer, tuple[int, ...], bool]:
    """The artifact's tokenizer, the ids that end a generation (config.json's and generation_config.json's,
    as transformers' generate stops on both: Llama-3 Instruct's <|eot_id|> may be only in the latter) and
    whether text prompts get BOS first (as transformers' tokenizer(prompt) gives them)."""
    try:
        tokenizer = Tokenizer(reader.tokenizer_dir)
        eos_token_ids = tuple(dict.fromkeys(model_config.eos_token_ids + generation_eos_ids(reader.tokenizer_dir)))
        add_bos = prompt_adds_bos(reader.tokenizer_dir, tokenizer, model_config.bos_token_id)
    except CheckpointError as exc:
        raise ArtifactCorrupt(f"artifact {reader.manifest.artifact_id}: {exc}") from exc
    # No BOS check here: LlamaConfig refused a BOS id outside the vocabulary (a worker reporting SERVING and
    # refusing every text prompt) with the model_config.
    return tokenizer, eos_token_ids, add_bos


def _self_check(engine: Engine, artifact_id: str, vocab_size: int) -> None:
    """Generates a few tokens through the engine, on the kernels and graphs it will serve with, before
    the worker is announced: an artifact whose logits come out NaN / inf (the quantizer's accuracy check
    ran the reference numerics, not this GPU's kernels) or whose steps fail is refused here, instead of
    registering and failing (or garbling) every request routed to it. Raises ArtifactBroken."""
    # A context window shorter than the check (a toy model, a tiny --kv-blocks) gets a shorter prompt.
    length = max(1, min(SELF_CHECK_PROMPT_TOKENS, engine.limits.max_context - SELF_CHECK_NEW_TOKENS))
    step = max(1, vocab_size // length)
    prompt = [(1 + i * step) % vocab_size for i in range(length)]
    outputs = []
    engine.add_request("start-up-self-check", prompt,
                       SamplingOptions(max_new_tokens=SELF_CHECK_NEW_TOKENS, ignore_eos=True), outputs.append)
    t0 = time.perf_counter()
    while engine.step():  # on this thread: the engine's own thread starts once the worker serves
        pass
    last = outputs[-1] if outputs else None
    if last is None or last.error is not None or last.finish is None:
        why = last.error if last is not None and last.error else "it did not finish"
        raise ArtifactBroken(f"artifact {artifact_id} failed the start-up self-check ({SELF_CHECK_NEW_TOKENS} "
                             f"greedy tokens after a {len(prompt)}-token prompt): {why}")
    log.info("self-check: %d tokens generated in %.2f s", last.finish.generated_tokens, time.perf_counter() - t0)


def _capture_graphs(runner) -> None:
    """Compiles the kernels and captures the runner's CUDA graphs (after the engine allocated the KV
    cache they point at), before the worker reports SERVING: otherwise the first step of each decode
    batch size and step token count pays ~0.1-0.6 s of capture, and on a cold Triton cache minutes
    of compiling. The CPU reference runner has no graphs."""
    capture = getattr(runner, "capture_graphs", None)
    if capture is None:
        return
    t0 = last_log = time.perf_counter()
    log.info("compiling kernels and capturing CUDA graphs (minutes on a first start: Triton compiles every kernel)")

    def progress(done: int, total: int) -> None:
        # An operator watching a silent start-up for minutes cannot tell progress from a hang.
        nonlocal last_log
        now = time.perf_counter()
        if now - last_log >= GRAPH_PROGRESS_LOG_S and done < total:
            log.info("captured %d of %d CUDA graphs (%.0f s)", done, total, now - t0)
            last_log = now

    capture(progress=progress)
    log.info("kernels compiled and CUDA graphs captured in %.1f s", time.perf_counter() - t0)


def _budget(config: WorkerConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_DEFAULT_BUDGET if config.gpu_memory_budget is None else config.gpu_memory_budget
    free, total = torch.cuda.mem_get_info(device)  # other processes and workers on this GPU keep theirs
    if config.gpu_memory_budget is None:
        return int(free * GPU_DEFAULT_FRACTION)
    budget = config.gpu_memory_budget
    if budget > total:
        raise ConfigError(f"--gpu-memory-budget {budget / 2**30:.3f} GiB is more than {device}'s "
                          f"{total / 2**30:.3f} GiB; lower it")
    if budget > free:  # a cache planned past what is free would fail to allocate
        log.warning("--gpu-memory-budget %.3f GiB is more than the %.3f GiB free on %s: using %.3f GiB",
                    budget / 2**30, free / 2**30, device, free / 2**30)
        return int(free)
    return budget


def _max_useful_blocks(config: WorkerConfig, model_context: int) -> int:
    """Every running sequence at its full context, plus the scheduler's spare block each: a cache
    beyond this is never used, so a small model does not take a whole GPU's budget."""
    context = min(model_context, config.max_context_tokens or model_context)
    per_sequence = -(-context // config.block_size) + 1
    return config.max_running_sequences * per_sequence


