"""Prefix caching: prompts sharing leading blocks reuse their cached K/V (block_manager, scheduler), and no
request's tokens change for it, under preemption, eviction, aborts and overlapped steps."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from services.worker.engine.block_manager import BlockManager, prefix_block_hashes
from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.reference_runner import ReferenceRunner
from services.worker.engine.runner import StepBatch, resolve_token_ids
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import FinishReason, SamplingOptions, Sequence
from shared.formats.artifact import ArtifactReader
from shared.model.config import LlamaConfig

BLOCK = 4


# ---- the block manager ----

def test_a_block_is_named_by_its_whole_prefix():
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    c = prefix_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and a == b  # full blocks only
    assert c[1] != a[1]  # the same tokens after another first block are another prefix
    assert prefix_block_hashes([1, 2, 3], BLOCK) == []


def test_released_named_blocks_stay_cached_until_the_space_is_needed_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=BLOCK, prefix_caching=True)
    names = prefix_block_hashes(list(range(1, 13)), BLOCK)
    table: list[int] = []
    bm.grow(table, 12)
    for block, name in zip(table, names):
        bm.name(block, name)
    assert (bm.num_free, bm.num_used, bm.num_cached) == (1, 3, 3)
    bm.release(table)
    assert (bm.num_free, bm.num_used, bm.num_cached) == (4, 0, 3)  # free, and still cached
    assert bm.cached_prefix(names) == table
    other: list[int] = []
    bm.grow(other, 8)  # the never-used block first, then the cached one released first: the prefix's last
    assert other == [3, table[2]]
    assert bm.cached_prefix(names) == table[:2] and bm.num_cached == 2
    sharer: list[int] = []
    assert bm.num_unheld(table[:2]) == 2
    bm.share(sharer, table[:2])
    assert sharer == table[:2] and (bm.num_free, bm.num_used) == (0, 4)
    bm.release(sharer)
    bm.release(other)
    bm.forget_cached()
    assert (bm.num_free, bm.num_cached) == (4, 0) and bm.cached_prefix(names) == []


def test_a_shared_block_is_free_only_once_every_holder_released_it():
    bm = BlockManager(num_blocks=3, block_size=BLOCK, prefix_caching=True)
    name = prefix_block_hashes([5, 6, 7, 8], BLOCK)[0]
    first: list[int] = []
    bm.grow(first, 4)
    bm.name(first[0], name)
    second: list[int] = []
    bm.share(second, bm.cached_prefix([name]))
    assert second == first and bm.num_used == 1
    bm.release(first)
    assert bm.num_used == 1  # the second still holds it
    bm.release(second)
    assert bm.num_used == 0 and bm.cached_prefix([name]) == first


def test_with_prefix_caching_off_nothing_is_named():
    bm = BlockManager(num_blocks=2, block_size=BLOCK)
    table: list[int] = []
    bm.grow(table, 4)
    name = prefix_block_hashes([1, 2, 3, 4], BLOCK)[0]
    bm.name(table[0], name)
    assert bm.num_cached == 0 and bm.cached_prefix([name]) == []


# ---- the scheduler ----

def _seq(i: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_ids=prompt, sampling=SamplingOptions(), arrival=float(i))


def _run_to_completion(sched: Scheduler, seq: Sequence) -> list[int]:
    """Computes the prompt and finishes the sequence; returns the block table it had."""
    while seq.num_computed < seq.num_tokens:
        for chunk in sched.schedule().chunks:
            sched.on_computed(chunk)
    table = seq.block_table
    sched.name_prompt_blocks(seq, table)  # as the engine does once the step's logits come back finite
    sched.finish(seq)
    return table


def test_a_prompt_starts_after_its_cached_prefix_and_always_computes_its_last_token():
    sched = Scheduler(BlockManager(16, BLOCK, prefix_caching=True), max_running=4, max_batch_tokens=64)
    system = list(range(1, 11))  # two full blocks and two tokens
    first = _seq(1, system + [20, 21])
    sched.add(first)
    first_table = _run_to_completion(sched, first)
    assert sched.prefix_hit_tokens == 0 and sched.prefix_queried_tokens == 12
    second = _seq(2, system + [30, 31, 32])  # shares the two full blocks (the third differs)
    sched.add(second)
    chunk = sched.schedule().chunks[0]
    assert (chunk.start, chunk.num_tokens) == (8, 5) and second.block_table[:2] == first_table[:2]
    assert sched.prefix_hit_tokens == 8
    # The first prompt again: all 3 of its blocks are cached, but its last token must be computed (its
    # logits are needed), so it starts at the third block, in a new block of its own.
    same = _seq(3, system + [20, 21])
    sched.add(same)
    chunk = sched.schedule().chunks[-1]
    assert chunk.seq is same and (chunk.start, chunk.num_tokens) == (8, 4) and chunk.completes
    assert same.block_table[:2] == first_table[:2] and same.block_table[2] != first_table[2]


def test_admission_counts_the_cached_blocks_it_takes_from_the_free_ones():
    """A prompt whose cached prefix nobody holds takes those blocks out of the free count: admitting it on
    the assumption that they are still free would over-commit the cache."""
    bm = BlockManager(6, BLOCK, prefix_caching=True)
    sched = Scheduler(bm, max_running=4, max_batch_tokens=64)
    first = _seq(1, list(range(1, 17)))  # 4 blocks, all named
    sched.add(first)
    _run_to_completion(sched, first)
    assert (bm.num_free, bm.num_cached) == (6, 4)
    # 3 cached blocks + 3 new (5 prompt tokens past them): 6 blocks, with 6 free; admitted
    fits = _seq(2, list(range(1, 13)) + [40, 41, 42, 43, 44, 45, 46, 47, 48])
    sched.add(fits)
    assert sched.schedule().chunks[0].start == 12 and bm.num_free == 0
    sched.finish(fits)
    # 3 cached blocks + 4 new = 7 > 6 blocks: waits, though 6 are "free"
    too_big = _seq(3, list(range(1, 13)) + list(range(50, 63)))
    sched.add(too_big)
    assert sched.schedule().chunks == [] and too_big.block_table == []


def test_a_preempted_sequence_reuses_its_own_cached_prompt():
    bm = BlockManager(8, BLOCK, prefix_caching=True)
    sched = Scheduler(bm, max_running=2, max_batch_tokens=64)
    seq = _seq(1, list(range(1, 14)))  # 3 full prompt blocks
    sched.add(seq)
    for chunk in sched.schedule().chunks:
        sched.on_computed(chunk)
    sched.name_prompt_blocks(seq, seq.block_table)
    seq.output_ids.append(7)
    sched._preempt(seq)
    chunk = sched.schedule().chunks[0]
    assert (chunk.start, chunk.num_tokens) == (12, 2)  # the prompt's 3 blocks back from the cache


# ---- the engine, end to end ----

V = 37
EOS = 0


def _next_token(tokens: list[int]) -> int:
    digest = hashlib.sha1(repr(tokens).encode()).digest()
    return 1 + digest[0] % (V - 1) if len(tokens) % 11 else digest[1] % V


class CacheReadingRunner:
    """Keeps a paged cache of token ids: each chunk writes its tokens into its slots, and a sequence's next
    token is a hash of every token read back from its block table. A block shared with the wrong content,
    or overwritten while another sequence still reads it, changes that sequence's tokens."""

    config = LlamaConfig(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=8, vocab_size=V)
    format = "fp16"
    device = torch.device("cpu")
    block_size = BLOCK

    def __init__(self, faulty_steps: int = 0):
        self.faulty_steps = faulty_steps  # the first steps write broken K/V ("nan"): a transient device fault

    def allocate_cache(self, num_blocks: int) -> None:
        self.cache = [[None] * BLOCK for _ in range(num_blocks)]

    def step(self, batch: StepBatch) -> torch.Tensor:
        ids = resolve_token_ids(torch.tensor([t for c in batch.chunks for t in c.token_ids]),
                                batch.previous_token_ids).tolist()
        faulty, self.faulty_steps = self.faulty_steps > 0, self.faulty_steps - 1
        offset = 0
        for c in batch.chunks:
            for i in range(len(c.token_ids)):
                p = c.start_position + i
                self.cache[c.block_table[p // BLOCK]][p % BLOCK] = "nan" if faulty else ids[offset + i]
            offset += len(c.token_ids)
        rows = []
        for c in batch.chunks:
            if c.want_logits:
                tokens = [self.cache[c.block_table[p // BLOCK]][p % BLOCK]
                          for p in range(c.start_position + len(c.token_ids))]
                if "nan" in tokens:
                    rows.append(torch.full((V,), float("nan")))
                else:
                    rows.append(torch.nn.functional.one_hot(torch.tensor(_next_token(tokens)), V).float() * 10)
        return torch.stack(rows) if rows else torch.empty(0, V)


class Letters:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _expected(prompt: list[int], options: SamplingOptions, max_context: int) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        t = _next_token(tokens)
        out.append(t)
        tokens.append(t)
        if (t == EOS and not options.ignore_eos) or len(out) == options.max_new_tokens or len(tokens) >= max_context:
            return out


@pytest.mark.parametrize("seed", range(12))
def test_shared_prefixes_under_pressure_give_every_request_its_own_tokens(seed):
    """Prompts built from a few shared starts (system prompts) arriving over time into small caches:
    prefixes are reused, evicted and recomputed, sequences preempted and aborted, steps overlapped or not;
    every request streams the tokens its own prompt gives, and every block comes back."""
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 20)
    context = min(num_blocks * BLOCK, rng.randint(16, 60))
    limits = EngineLimits(num_blocks=num_blocks, max_running=rng.randint(1, 6), max_waiting=100,
                          max_batch_tokens=rng.randint(2, 24), max_context=context)
    engine = Engine(CacheReadingRunner(), Letters(), limits, eos_token_ids=(EOS,), overlap=seed % 2 == 1,
                    prefix_caching=True)
    starts = [[rng.randint(1, V - 1) for _ in range(rng.randint(4, context // 2))] for _ in range(3)]
    arrivals = []
    for i in range(rng.randint(6, 14)):
        options = SamplingOptions(max_new_tokens=rng.choice([1, 2, 5, 20]), ignore_eos=rng.random() < 0.5)
        if arrivals and rng.random() < 0.3:  # a conversation's next turn: an earlier prompt, its answer, more
            at, _, before, before_options = rng.choice(arrivals)
            start = before + _expected(before, before_options, context)
            at += rng.randint(5, 30)
        else:
            start, at = rng.choice(starts), rng.randint(0, 40)
        prompt = (start + [rng.randint(1, V - 1) for _ in range(rng.randint(0, 8))])[: context - 1]
        arrivals.append((at, f"r{i}", prompt, options))
    outs, aborted, step = {}, set(), 0
    while True:
        for at, rid, prompt, options in arrivals:
            if at == step:
                outs[rid] = []
                engine.add_request(rid, prompt, options, outs[rid].append)
        if rng.random() < 0.03 and engine.in_flight():
            rid = rng.choice(engine.in_flight())
            engine.abort(rid)
            aborted.add(rid)
        moved = engine.step()
        step += 1
        if not moved and step > max(at for at, *_ in arrivals):
            break
        assert step < 5000, engine.stats()
    stats = engine.stats()
    assert (stats.kv_blocks_used, engine.num_in_flight) == (0, 0)
    assert stats.prefix_cache_hit_tokens > 0 and stats.prefix_cache_queried_tokens >= stats.prefix_cache_hit_tokens
    for _, rid, prompt, options in arrivals:
        got = outs[rid]
        assert [o.finish is not None for o in got].count(True) == 1 and got[-1].finish is not None
        tokens = [t for o in got for t in o.token_ids]
        expected = _expected(prompt, options, context)
        if rid in aborted and got[-1].finish.reason is FinishReason.ABORT:
            expected = expected[: len(tokens)]
        assert tokens == expected, (rid, prompt)


def test_the_reference_model_gives_the_same_tokens_with_prefix_caching(artifacts):
    """The tiny model's KV4 cache: requests sharing a 13-token start, one after another (so the later ones
    find it cached), greedy and seeded sampled, give the tokens of a worker without prefix caching."""
    reader = ArtifactReader(artifacts["w4a8kv4-g128"], verify=False)
    runner = ReferenceRunner(reader, "cpu", block_size=BLOCK)
    g = torch.Generator().manual_seed(11)
    start = torch.randint(1, 4096, (13,), generator=g).tolist()
    prompts = [start + torch.randint(1, 4096, (n,), generator=g).tolist() for n in (2, 0, 5, 3)]
    prompts.append(list(prompts[0]))  # the same prompt again: everything but its last block cached
    options = [SamplingOptions(temperature=0.0 if i % 2 == 0 else 0.8, seed=7 + i, max_new_tokens=6, ignore_eos=True)
               for i in range(len(prompts))]

    def run(prefix_caching: bool):
        limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=8, max_batch_tokens=16, max_context=48)
        engine = Engine(runner, Letters(), limits, eos_token_ids=(), prefix_caching=prefix_caching)
        tokens = []
        for i, (prompt, option) in enumerate(zip(prompts, options)):
            out = []
            engine.add_request(f"r{i}", prompt, option, out.append)
            while engine.step():
                pass
            tokens.append([t for o in out for t in o.token_ids])
        return tokens, engine.stats()

    plain, plain_stats = run(False)
    cached, stats = run(True)
    assert cached == plain and plain_stats.prefix_cache_hit_tokens == 0
    # 12 of the start's tokens (3 blocks) for each later prompt; the repeated prompt's 15 tokens: 12 too
    assert stats.prefix_cache_hit_tokens == 4 * 12


def test_a_failed_step_forgets_the_cached_prefixes():
    """A step that fails (a device error, read back or raised) may leave wrong or unwritten K/V in blocks the
    cache already names: none of them is handed to a later request."""
    runner = CacheReadingRunner()
    limits = EngineLimits(num_blocks=16, max_running=4, max_waiting=8, max_batch_tokens=16, max_context=32)
    engine = Engine(runner, Letters(), limits, eos_token_ids=(), prefix_caching=True)
    prompt = list(range(1, 11))
    done = []
    engine.add_request("first", prompt, SamplingOptions(max_new_tokens=2, ignore_eos=True), done.append)
    while engine.step():
        pass
    assert engine.stats().kv_blocks_cached == 2
    real_step = runner.step

    def failing(batch):
        raise RuntimeError("device lost")

    runner.step = failing
    failed = []
    engine.add_request("second", prompt + [12], SamplingOptions(max_new_tokens=2, ignore_eos=True), failed.append)
    engine.step()
    assert failed[-1].error and engine.stats().kv_blocks_cached == 0
    runner.step = real_step
    again = []
    engine.add_request("third", prompt, SamplingOptions(max_new_tokens=2, ignore_eos=True), again.append)
    while engine.step():
        pass
    assert [t for o in again for t in o.token_ids] == [t for o in done for t in o.token_ids]
    assert engine.stats().prefix_cache_hit_tokens == 8  # the second's lookup only: the third found nothing


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlapped"])
def test_a_prompt_whose_step_came_back_nan_is_never_shared(overlap):
    """A prompt's blocks are named once its step's logits are back and finite: with overlapped steps, the next
    step is scheduled before this one's NaN is seen, and a request admitted then took the broken blocks."""
    limits = EngineLimits(num_blocks=16, max_running=4, max_waiting=8, max_batch_tokens=64, max_context=32)
    engine = Engine(CacheReadingRunner(faulty_steps=1), Letters(), limits, eos_token_ids=(), overlap=overlap,
                    prefix_caching=True)
    prompt, options = list(range(1, 9)), SamplingOptions(max_new_tokens=2, ignore_eos=True)
    first, second = [], []
    engine.add_request("first", prompt, options, first.append)
    engine.step()  # its prefill is launched, writing broken K/V
    engine.add_request("second", prompt + [20, 21, 22], options, second.append)
    while engine.step():
        pass
    assert first[-1].error and first[-1].non_finite
    assert second[-1].error is None and second[-1].finish is not None
    assert [t for o in second for t in o.token_ids] == _expected(prompt + [20, 21, 22], options, 32)


def test_a_preempted_prompt_is_looked_up_once_in_the_hit_rate():
    """The queried / hit counters are the prompts' first lookups: a preempted sequence coming back (its
    generated tokens included, its own blocks found) inflated both and made a thrashing cache look good."""
    sched = Scheduler(BlockManager(8, BLOCK, prefix_caching=True), max_running=2, max_batch_tokens=64)
    seq = _seq(1, list(range(1, 14)))
    sched.add(seq)
    for chunk in sched.schedule().chunks:
        sched.on_computed(chunk)
    sched.name_prompt_blocks(seq, seq.block_table)
    seq.output_ids += [7, 8, 9]
    sched._preempt(seq)
    assert sched.schedule().chunks[0].start == 12  # its own blocks found again
    assert (sched.prefix_queried_tokens, sched.prefix_hit_tokens) == (13, 0)


def test_a_conversations_next_turn_finds_the_previous_answer_cached():
    """A finished sequence's generated tokens are named too: the next turn's prompt (this prompt, this answer,
    a new message) finds every full block before the answer's last token, whose K/V was never written."""
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=8, max_batch_tokens=64, max_context=64)
    engine = Engine(CacheReadingRunner(), Letters(), limits, eos_token_ids=(), prefix_caching=True)
    prompt, options = list(range(1, 7)), SamplingOptions(max_new_tokens=12, ignore_eos=True)
    first = []
    engine.add_request("turn-1", prompt, options, first.append)
    while engine.step():
        pass
    answer = [t for o in first for t in o.token_ids]
    assert answer == _expected(prompt, options, 64)
    second_prompt = prompt + answer + [30, 31, 32]
    second = []
    engine.add_request("turn-2", second_prompt, options, second.append)
    while engine.step():
        pass
    # 6 + 12 tokens, the last never fed: 17 written, 4 full blocks of 4
    assert engine.stats().prefix_cache_hit_tokens == 16
    assert [t for o in second for t in o.token_ids] == _expected(second_prompt, options, 64)
