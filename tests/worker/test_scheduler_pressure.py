"""The engine under KV-cache pressure and mixed load: preemption makes progress and changes no
token, limits hold in every step, and every block comes back however requests end."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.reference_runner import ReferenceRunner
from services.worker.engine.runner import StepBatch, resolve_token_ids
from services.worker.engine.sequence import FinishReason, SamplingOptions
from services.worker.errors import QueueFull
from shared.formats.artifact import ArtifactReader
from shared.model.config import LlamaConfig

VOCAB = 16
BLOCK = 4


class CountingRunner:
    """The next token is the last input token + 1 (mod VOCAB), read from the resolved ids, so a lost,
    repeated or misplaced token shows in the output. Refuses, as the real runners do, a chunk whose
    block table does not cover its positions, and records each step's chunks."""

    config = LlamaConfig(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=8, vocab_size=VOCAB)
    format = "fp16"
    device = torch.device("cpu")
    block_size = BLOCK

    def __init__(self, before_step=lambda batch: None):
        self.before_step = before_step
        self.steps: list[list[tuple[int, int, int]]] = []  # (seq_id, start, tokens) per chunk, per step

    def allocate_cache(self, num_blocks):
        pass

    def step(self, batch: StepBatch) -> torch.Tensor:
        for c in batch.chunks:
            if len(c.block_table) * BLOCK < c.start_position + len(c.token_ids):
                raise AssertionError(f"sequence {c.seq_id}: block table {c.block_table} too short")
        self.steps.append([(c.seq_id, c.start_position, len(c.token_ids)) for c in batch.chunks])
        self.before_step(batch)
        ids = resolve_token_ids(torch.tensor([t for c in batch.chunks for t in c.token_ids]), batch.previous_token_ids)
        rows, end = [], 0
        for c in batch.chunks:
            end += len(c.token_ids)
            if c.want_logits:
                rows.append(torch.nn.functional.one_hot((ids[end - 1] + 1) % VOCAB, VOCAB).float())
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class Letters:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def _counted(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + i) % VOCAB for i in range(1, n + 1)]


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlapped"])
def test_a_long_prompt_is_not_let_in_only_to_be_preempted_again_and_again(overlap):
    """A 40-token prompt arrives while a short request decodes in a 13-block cache. It used to be
    let in as soon as its first 16-token chunk fitted; the decodes took the blocks its later chunks
    needed, it was preempted, let in again at once, and prefilled its start over and over (ten
    preemptions, 263 prompt tokens computed for 40) until the short request ended. It now waits
    until the cache holds its whole prompt."""
    limits = EngineLimits(num_blocks=13, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=52)
    engine = Engine(CountingRunner(), Letters(), limits, eos_token_ids=(), overlap=overlap)
    outs = {"short": [], "long": []}
    short_prompt, long_prompt = [1] * 7, [2] * 40
    engine.add_request("short", short_prompt, SamplingOptions(max_new_tokens=27), outs["short"].append)
    engine.step()
    engine.add_request("long", long_prompt, SamplingOptions(max_new_tokens=4), outs["long"].append)
    long_seq = engine.scheduler.waiting[0]
    while engine.step():
        pass
    assert long_seq.num_preemptions <= 1
    computed = sum(n for step in engine.runner.steps for seq_id, _, n in step if seq_id == long_seq.seq_id)
    assert computed <= 2 * (len(long_prompt) + 4)
    assert _tokens(outs["short"]) == _counted(short_prompt, 27)
    assert _tokens(outs["long"]) == _counted(long_prompt, 4)
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlapped"])
def test_the_earlier_arrival_keeps_running_when_it_was_admitted_second(overlap):
    """Arrival is stamped before tokenizing: a request that came first with a longer prompt reaches the engine
    after a later, shorter one. It ran behind it, and when blocks ran out it was the one preempted (the later
    one was already scheduled in the step) and computed its tokens again, against first come, first served."""
    limits = EngineLimits(num_blocks=6, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=24)
    engine = Engine(CountingRunner(), Letters(), limits, eos_token_ids=(), overlap=overlap)
    outs = {"later": [], "earlier": []}
    engine.add_request("later", [1, 2, 3], SamplingOptions(max_new_tokens=18), outs["later"].append, arrival=2.0)
    engine.step()
    engine.add_request("earlier", [4, 5, 6, 7, 8], SamplingOptions(max_new_tokens=18), outs["earlier"].append,
                       arrival=1.0)
    earlier = engine.scheduler.waiting[0]
    later = engine.scheduler.running[0]
    while engine.step():
        pass
    assert earlier.num_preemptions == 0 and later.num_preemptions > 0
    assert _tokens(outs["earlier"]) == _counted([4, 5, 6, 7, 8], 18)
    assert _tokens(outs["later"]) == _counted([1, 2, 3], 18)
    assert engine.stats().kv_blocks_used == 0


def test_an_engine_whose_cache_cannot_hold_one_whole_context_is_refused():
    """With 16 slots of cache and a context of 20, a lone request reached the cache's end, preempted
    itself, and then waited for ever (with every request behind it) for room to be recomputed in:
    step() found nothing to do and the request never ended. Such limits are refused up front (the
    worker lowers its context to the cache; the engine must not rely on every caller doing so)."""
    limits = EngineLimits(num_blocks=4, max_running=2, max_waiting=2, max_batch_tokens=16, max_context=20)
    with pytest.raises(ValueError, match="max_context=20"):
        Engine(CountingRunner(), Letters(), limits, eos_token_ids=())
    Engine(CountingRunner(), Letters(), EngineLimits(4, 2, 2, 16, 16), eos_token_ids=())  # just fits


@pytest.mark.parametrize("seed", range(16))
def test_mixed_load_with_aborts_and_failed_steps_keeps_every_token_and_block(seed, caplog):
    """Random arrivals into a small cache (preemptions), aborts between steps and from inside a step,
    failing steps, with and without overlap: every step stays within max_batch_tokens and covers its
    positions with blocks, every request gets its tokens in order (none lost or repeated) and ends
    exactly once with the right length, nothing waits for ever, and every block comes back."""
    caplog.set_level(logging.CRITICAL)  # the failing steps' tracebacks
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 12)
    limits = EngineLimits(num_blocks=num_blocks, max_running=rng.randint(2, 5), max_waiting=rng.randint(2, 8),
                          max_batch_tokens=rng.choice([2, 4, 8, 16]), max_context=num_blocks * BLOCK)
    engine = None

    def before_step(batch):
        if rng.random() < 0.03:
            raise RuntimeError("device lost")
        if rng.random() < 0.05 and engine.in_flight():
            engine.abort(rng.choice(engine.in_flight()))  # as the servicer would, from its own thread

    engine = Engine(CountingRunner(before_step), Letters(), limits, eos_token_ids=(0,), overlap=seed % 2 == 1)
    outs, requests = {}, {}
    for i in range(200):
        if rng.random() < 0.6:
            rid = f"r{i}"
            prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 30))]
            sampling = SamplingOptions(max_new_tokens=rng.choice([0, 1, 5, 20, 40, 60]), ignore_eos=rng.random() < 0.7)
            outs[rid] = []
            try:
                engine.add_request(rid, prompt, sampling, outs[rid].append)
                requests[rid] = (prompt, sampling)
            except QueueFull:
                del outs[rid]
        if rng.random() < 0.03 and engine.in_flight():
            engine.abort(rng.choice(engine.in_flight()))
        engine.step()
    for _ in range(5000):  # a failed step launches nothing: False then does not mean the work is done
        if not engine.step() and engine.num_in_flight == 0:
            break
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used, engine.num_in_flight) == (0, 0, 0, 0)
    assert stats.preemptions > 0  # the cache is small enough for every seed here
    assert all(sum(n for _, _, n in step) <= limits.max_batch_tokens for step in engine.runner.steps)
    for rid, got in outs.items():
        prompt, sampling = requests[rid]
        ends = [o.finish is not None or o.error is not None for o in got]
        assert ends.count(True) == 1 and ends[-1], rid
        tokens = _tokens(got)
        assert tokens == _counted(prompt, len(tokens))
        finish = got[-1].finish
        shown = tokens[:-1] if finish is not None and finish.reason is FinishReason.EOS else tokens
        assert "".join(o.text for o in got) == Letters().decode(shown)
        if finish is None:
            continue
        assert finish.generated_tokens == len(tokens)
        if finish.reason is FinishReason.LENGTH:
            limit = limits.max_context if not sampling.max_new_tokens else min(
                limits.max_context, len(prompt) + sampling.max_new_tokens)
            assert len(prompt) + len(tokens) == limit
        elif finish.reason is FinishReason.EOS:
            assert tokens[-1] == 0 and not sampling.ignore_eos


class Chars:
    def decode(self, ids):
        return "".join(chr(0x4E00 + i) for i in ids)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlapped"])
def test_preempted_requests_give_the_tokens_of_an_uninterrupted_run(artifacts, overlap):
    """The tiny model in a 12-block cache: five requests (greedy and seeded sampled) are preempted and
    recomputed, and each streams exactly the tokens and text it streams from a cache that never runs
    out; a stop token id and a stop string met after a preemption still end their requests."""
    reader = ArtifactReader(artifacts["w4a8kv4-g128"], verify=False)
    runner = ReferenceRunner(reader, "cpu", block_size=BLOCK)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 4096, (n,), generator=g).tolist() for n in (10, 11, 9, 12, 8)]
    sampling = [SamplingOptions(temperature=0.0 if i % 2 == 0 else 0.8, top_k=0 if i < 3 else 40, seed=100 + i,
                                max_new_tokens=24, ignore_eos=True) for i in range(5)]

    def run(num_blocks, sampling):
        limits = EngineLimits(num_blocks=num_blocks, max_running=5, max_waiting=8, max_batch_tokens=16, max_context=48)
        engine = Engine(runner, Chars(), limits, eos_token_ids=(), overlap=overlap)
        outs, seqs = {}, {}
        for i, (prompt, options) in enumerate(zip(prompts, sampling)):
            outs[i] = []
            engine.add_request(f"r{i}", prompt, options, outs[i].append)
            seqs[i] = engine.scheduler.waiting[-1]
        while engine.step():
            pass
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and engine.num_in_flight == 0
        return outs, seqs, stats.preemptions

    roomy, _, preemptions = run(64, sampling)
    assert preemptions == 0
    expected = {i: _tokens(o) for i, o in roomy.items()}
    # Stops late in the generations of two requests that the small cache preempts (checked below):
    # a stop token id for a sampled one, a stop string for a greedy one.
    stop_at = {i: _first_new_token_from(expected[i], 16) for i in (1, 2)}
    sampling[1] = SamplingOptions(**{**_fields(sampling[1]), "stop_token_ids": (expected[1][stop_at[1]],)})
    sampling[2] = SamplingOptions(**{**_fields(sampling[2]), "stop": (Chars().decode([expected[2][stop_at[2]]]),)})
    tight, seqs, preemptions = run(12, sampling)
    assert preemptions >= 3
    assert seqs[1].num_preemptions > 0 and seqs[2].num_preemptions > 0
    for i, outs in tight.items():
        tokens = _tokens(outs)
        assert [o.finish is not None for o in outs].count(True) == 1 and outs[-1].finish is not None
        if i in stop_at:
            assert tokens == expected[i][:stop_at[i] + 1] and outs[-1].finish.reason is FinishReason.STOP
            assert "".join(o.text for o in outs) == Chars().decode(tokens[:-1])  # not the stop's text
        else:
            assert tokens == expected[i] and outs[-1].finish.reason is FinishReason.LENGTH
            assert "".join(o.text for o in outs) == "".join(o.text for o in roomy[i])


def _first_new_token_from(tokens: list[int], start: int) -> int:
    """The first index from start whose token does not occur before it (a stop there ends there)."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def _fields(options: SamplingOptions) -> dict:
    return {name: getattr(options, name) for name in options.__dataclass_fields__}
