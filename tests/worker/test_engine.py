"""The engine with a scripted runner (no model): finish reasons, context limit, abort, step failures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.runner import StepBatch, resolve_token_ids
from services.worker.engine.sequence import FinishReason, SamplingOptions
from services.worker.errors import InvalidRequest
from shared.model.config import LlamaConfig

VOCAB = 16
EOS = 0


class ScriptedRunner:
    """The next token after position p is script[p % len(script)]; records each step's chunks."""

    config = LlamaConfig(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=8, vocab_size=VOCAB)
    format = "fp16"
    device = torch.device("cpu")
    block_size = 4

    def __init__(self, script: list[int], fail: bool = False):
        self.script = script
        self.fail = fail
        self.steps: list[StepBatch] = []

    def allocate_cache(self, num_blocks):
        self.num_blocks = num_blocks

    def step(self, batch: StepBatch) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("device lost")
        # The chunks' block tables are the sequences' own lists, valid during the step: keep a copy.
        self.steps.append(StepBatch([dataclasses.replace(c, block_table=list(c.block_table)) for c in batch.chunks]))
        rows = []
        for ch in batch.chunks:
            if ch.want_logits:
                row = torch.zeros(VOCAB)
                row[self.script[(ch.start_position + len(ch.token_ids) - 1) % len(self.script)]] = 10.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


class Text:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


OVERLAP = {"value": False}  # the engines built by this module's helpers: set per test below


@pytest.fixture(params=[False, True], ids=["in-step", "overlapped"], autouse=True)
def _overlap(request):
    """Every test runs with tokens read back in their own step and with the next step launched first."""
    OVERLAP["value"] = request.param


def _engine(script, max_context=64, fail=False):
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=max_context)
    return Engine(ScriptedRunner(script, fail), Text(), limits, eos_token_ids=(EOS,), overlap=OVERLAP["value"])


def _run(engine, prompt, **sampling):
    outs = []
    engine.add_request("r", prompt, SamplingOptions(**sampling), outs.append)
    while engine.step():
        pass
    return outs


def test_eos_ends_the_generation_and_its_text_is_not_output():
    outs = _run(_engine([3, 4, EOS, 5]), [1])  # positions 0.. -> after prompt token at 0: script[0] = 3
    assert [t for o in outs for t in o.token_ids] == [3, 4, EOS]
    assert "".join(o.text for o in outs) == "de"
    assert outs[-1].finish.reason is FinishReason.EOS and outs[-1].finish.generated_tokens == 3


def test_ignore_eos_runs_to_max_new_tokens():
    outs = _run(_engine([3, 4, EOS, 5]), [1], ignore_eos=True, max_new_tokens=6)
    assert len([t for o in outs for t in o.token_ids]) == 6 and outs[-1].finish.reason is FinishReason.LENGTH


def test_the_context_window_ends_an_unlimited_generation():
    outs = _run(_engine([3], max_context=10), [1, 2, 3])
    assert outs[-1].finish.reason is FinishReason.LENGTH and outs[-1].finish.generated_tokens == 7


def test_a_prompt_that_leaves_no_room_in_the_context_is_refused_not_queued_for_ever():
    engine = _engine([3], max_context=10)
    for prompt in ([], [1] * 10, [1] * 17):
        with pytest.raises(InvalidRequest, match="the engine takes 1 to 9"):
            engine.add_request("long", prompt, SamplingOptions(), lambda out: None)
    outs = _run(engine, [1] * 9)  # the longest it takes: one token, LENGTH at the window
    assert outs[-1].finish.reason is FinishReason.LENGTH and outs[-1].finish.generated_tokens == 1


def test_abort_frees_blocks_at_once_and_reports_abort():
    engine = _engine([3])
    outs = []
    engine.add_request("r", list(range(1, 10)), SamplingOptions(), outs.append)
    engine.step()
    assert engine.stats().kv_blocks_used == 3
    assert engine.abort("r") and engine.stats().kv_blocks_used == 0
    assert outs[-1].finish.reason is FinishReason.ABORT
    assert not engine.abort("r")
    if OVERLAP["value"]:
        assert engine.step()  # reads back the step launched before the abort ...
    assert not engine.step() and outs[-1].finish.reason is FinishReason.ABORT  # ... and outputs nothing more


def test_an_abort_during_a_step_leaves_the_steps_block_tables_intact():
    """The runner reads the sequences' own block tables outside the engine's lock: an abort from
    another thread mid-step frees the blocks but must not empty the list the step is reading."""
    engine = _engine([3])
    outs = []
    engine.add_request("r", list(range(1, 10)), SamplingOptions(), outs.append)
    engine.step()
    seen = {}
    plain_step = engine.runner.step

    def step_with_abort(batch):
        before = list(batch.chunks[0].block_table)
        assert engine.abort("r")  # as the servicer would, from the event loop's thread
        seen["table"] = (before, list(batch.chunks[0].block_table))
        return plain_step(batch)

    engine.runner.step = step_with_abort
    engine.step()
    before, during = seen["table"]
    assert len(before) == 3 and during == before
    assert engine.stats().kv_blocks_used == 0 and outs[-1].finish.reason is FinishReason.ABORT
    # The aborted step's token is dropped; overlapped, so is the first step's (not read back yet).
    assert [o.token_ids for o in outs if o.finish is None] == ([] if OVERLAP["value"] else [[3]])


def test_a_failing_step_ends_its_requests_with_an_error_and_frees_blocks():
    engine = _engine([3], fail=True)
    outs = _run(engine, [1, 2])
    assert outs[-1].error and "device lost" in outs[-1].error and outs[-1].finish is None
    assert engine.stats().kv_blocks_used == 0 and engine.num_in_flight == 0


class FailsOnceRunner(ScriptedRunner):
    def step(self, batch: StepBatch) -> torch.Tensor:
        self.fail, failing = False, self.fail
        if failing:
            raise RuntimeError("device lost")
        return super().step(batch)


def test_a_failed_step_does_not_stop_a_step_loop_with_requests_still_waiting():
    """step() returned False after a failed step (nothing launched), so `while engine.step()` stopped
    with the requests that had waited behind the failed ones never run."""
    limits = EngineLimits(num_blocks=32, max_running=2, max_waiting=4, max_batch_tokens=16, max_context=64)
    engine = Engine(FailsOnceRunner([3], fail=True), Text(), limits, eos_token_ids=(EOS,), overlap=OVERLAP["value"])
    outs = {}
    for i in range(4):
        outs[i] = []
        engine.add_request(f"r{i}", [1, 2], SamplingOptions(max_new_tokens=2), outs[i].append)
    while engine.step():
        pass
    assert engine.num_in_flight == 0 and engine.stats().kv_blocks_used == 0
    errors = [i for i in outs if outs[i][-1].error]
    assert errors == [0, 1]
    assert [[t for o in outs[i] for t in o.token_ids] for i in (2, 3)] == [[3, 3], [3, 3]]
    assert all(outs[i][-1].finish.reason is FinishReason.LENGTH and not outs[i][-1].error for i in (2, 3))


def test_chunks_given_to_the_runner_cover_the_prompt_then_one_token():
    engine = _engine([3])
    _run(engine, list(range(1, 21)), max_new_tokens=2)
    chunks = [(c.start_position, len(c.token_ids), c.want_logits) for s in engine.runner.steps for c in s.chunks]
    assert chunks == [(0, 16, False), (16, 4, True), (20, 1, True)]
    blocks = engine.runner.steps[1].chunks[0].block_table
    assert len(blocks) == 5  # 20 positions of 4 per block


class CountingRunner(ScriptedRunner):
    """The next token is the input token + 1 (mod VOCAB), read from the resolved token ids: a
    placeholder resolved to the wrong row shows in the output."""

    def step(self, batch: StepBatch) -> torch.Tensor:
        super().step(batch)
        ids = torch.tensor([t for c in batch.chunks for t in c.token_ids], dtype=torch.int64)
        ids = resolve_token_ids(ids, batch.previous_token_ids)
        rows, end = [], 0
        for c in batch.chunks:
            end += len(c.token_ids)
            if c.want_logits:
                row = torch.zeros(VOCAB)
                row[(int(ids[end - 1]) + 1) % VOCAB] = 10.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def _counting_engine():
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=64)
    return Engine(CountingRunner([0]), Text(), limits, eos_token_ids=(EOS,), overlap=OVERLAP["value"])


def test_each_step_feeds_the_tokens_sampled_by_the_step_before():
    engine = _counting_engine()
    outs = {}
    for rid, prompt in (("a", [1]), ("b", [5, 6, 7]), ("c", [9, 2])):
        outs[rid] = []
        engine.add_request(rid, prompt, SamplingOptions(max_new_tokens=5, ignore_eos=True), outs[rid].append)
    while engine.step():
        pass
    tokens = {rid: [t for o in got for t in o.token_ids] for rid, got in outs.items()}
    assert tokens == {"a": [2, 3, 4, 5, 6], "b": [8, 9, 10, 11, 12], "c": [3, 4, 5, 6, 7]}
    # Known limits stop a sequence before its last token is read back: no wasted step.
    assert len(engine.runner.steps) == 5
    assert engine.stats().kv_blocks_used == 0 and engine.num_in_flight == 0


def test_a_finish_found_on_read_back_drops_the_step_already_launched():
    engine = _counting_engine()
    outs = []
    engine.add_request("r", [12], SamplingOptions(), outs.append)  # 13, 14, 15, then EOS (0)
    while engine.step():
        pass
    assert [t for o in outs for t in o.token_ids] == [13, 14, 15, EOS]
    assert outs[-1].finish.reason is FinishReason.EOS and outs[-1].finish.generated_tokens == 4
    # Overlapped, the step after the EOS had been launched already: it ran, its token was dropped.
    assert len(engine.runner.steps) == (5 if OVERLAP["value"] else 4)
    assert engine.stats().kv_blocks_used == 0


class CheckingRunner(ScriptedRunner):
    """Refuses (as both real runners do) a chunk whose block table does not cover its positions."""

    def step(self, batch: StepBatch) -> torch.Tensor:
        for c in batch.chunks:
            if len(c.block_table) * self.block_size < c.start_position + len(c.token_ids):
                raise RuntimeError(f"sequence {c.seq_id}: block table {c.block_table} too short")
        return super().step(batch)


def test_an_abort_between_schedule_and_launch_does_not_fail_the_other_requests():
    """abort() (from the event loop's thread) can run after a step was scheduled but before the
    engine thread builds the step's chunks: the aborted sequence must not be handed to the runner
    with its new, empty block table, which fails the step for every request in the batch."""
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=64)
    engine = Engine(CheckingRunner([3]), Text(), limits, eos_token_ids=(EOS,), overlap=OVERLAP["value"])
    outs = {"a": [], "b": []}
    for rid in outs:
        engine.add_request(rid, [1, 2, 5], SamplingOptions(max_new_tokens=4), outs[rid].append)
    engine.step()
    plain_launch = engine._launch

    def launch_after_an_abort(*args, **kwargs):
        engine._launch = plain_launch
        assert engine.abort("a")  # the lock is free here: the event loop's thread may take it
        return plain_launch(*args, **kwargs)

    engine._launch = launch_after_an_abort
    while engine.step():
        pass
    assert outs["a"][-1].finish.reason is FinishReason.ABORT
    assert all(o.error is None for o in outs["b"]), outs["b"][-1].error
    assert outs["b"][-1].finish.reason is FinishReason.LENGTH and outs["b"][-1].finish.generated_tokens == 4
    assert engine.stats().kv_blocks_used == 0 and engine.num_in_flight == 0


def test_an_abort_counts_only_the_tokens_generated_so_far():
    """Overlapped, the step in flight has appended a placeholder for its not-yet-known token: an
    abort then must not count it in generated_tokens (nor in the time per output token)."""
    engine = _engine([3, 4, 5])
    outs = []
    engine.add_request("r", [1, 2], SamplingOptions(ignore_eos=True), outs.append)
    engine.step()
    engine.step()
    streamed = [t for o in outs for t in o.token_ids]
    assert engine.abort("r")
    finish = outs[-1].finish
    assert finish.reason is FinishReason.ABORT and finish.generated_tokens == len(streamed)


@pytest.mark.parametrize("how", ["abort", "stop"])
def test_an_abort_ends_the_stream_with_the_text_held_back_for_a_possible_stop_string(how):
    """Text that could start a stop string is held back; its tokens are streamed. An abort (the Abort rpc,
    a drain, the engine stopping) must send it, or the streamed text is not the text of the streamed ids."""
    engine = _engine([3, 4, 5])
    outs = []
    engine.add_request("r", [1, 2], SamplingOptions(ignore_eos=True, stop=("efdefdefdx",)), outs.append)
    for _ in range(4):
        engine.step()
    streamed = [t for o in outs for t in o.token_ids]
    assert len(streamed) >= 2 and "".join(o.text for o in outs) == ""  # "efd..." could start the stop string
    engine.abort("r") if how == "abort" else engine.stop()
    assert outs[-1].finish.reason is FinishReason.ABORT
    assert "".join(o.text for o in outs) == Text().decode(streamed)


class HalfCharacterText(Text):
    """Token 9 decodes to "j" and the first byte of a multi-byte character: its text is held back
    until the character completes, or until the end of the generation."""

    def decode(self, ids):
        return "".join("j\ufffd" if i == 9 else chr(ord("a") + i) for i in ids)


def test_a_stop_string_completed_only_by_the_final_flush_finishes_with_stop():
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=64)
    engine = Engine(ScriptedRunner([9, 3]), HalfCharacterText(), limits, eos_token_ids=(EOS,),
                    overlap=OVERLAP["value"])
    outs = []
    engine.add_request("r", [1, 2], SamplingOptions(max_new_tokens=2, stop=("dj",)), outs.append)
    while engine.step():
        pass
    assert "".join(o.text for o in outs) == ""  # the text before the stop string: none
    assert outs[-1].finish.reason is FinishReason.STOP



def test_a_sink_that_raises_loses_its_own_output_only():
    """A request whose caller is gone (its sink raises) must not fail the other requests of the step."""
    engine = _engine([3, 4, 5])
    outs = []

    def broken(out):
        raise RuntimeError("event loop is closed")

    engine.add_request("gone", [1, 2], SamplingOptions(max_new_tokens=3), broken)
    engine.add_request("r", [1, 2], SamplingOptions(max_new_tokens=3), outs.append)
    while engine.step():
        pass
    assert all(o.error is None for o in outs)
    assert outs[-1].finish.reason is FinishReason.LENGTH and outs[-1].finish.generated_tokens == 3
    assert engine.stats().kv_blocks_used == 0


class SpacedWords(Text):
    """Like a SentencePiece decoder: words joined by spaces, none before the first word decoded."""

    def decode(self, ids):
        return " ".join(chr(ord("a") + i) for i in ids)


def test_the_first_generated_word_keeps_its_space_after_the_prompt():
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=64)
    engine = Engine(ScriptedRunner([3, 4]), SpacedWords(), limits, eos_token_ids=(EOS,), overlap=OVERLAP["value"])
    outs = []
    engine.add_request("r", [1, 2], SamplingOptions(max_new_tokens=2), outs.append)
    while engine.step():
        pass
    assert "".join(o.text for o in outs) == " e d"  # "b c" + " e d", as decoding prompt and output together


def test_each_step_is_reported_once_with_its_kind_when_its_tokens_are_read_back():
    engine = _engine([3, 4, 5])
    steps = []
    engine.on_step = lambda kind, seconds: steps.append((kind, seconds))
    _run(engine, [1, 2], max_new_tokens=3)
    assert [kind for kind, _ in steps] == ["prompt", "decode", "decode"]
    assert all(seconds >= 0 for _, seconds in steps)


class NaNRunner(ScriptedRunner):
    """Scripted, except that a sequence whose prompt begins with POISON gets a NaN in its logits once
    its context passes NAN_AFTER tokens (a broken artifact's overflow)."""

    POISON, NAN_AFTER = 9, 4

    def __init__(self, script: list[int]):
        super().__init__(script)
        self.poisoned: set[int] = set()

    def step(self, batch: StepBatch) -> torch.Tensor:
        logits = super().step(batch)
        for row, ch in enumerate(c for c in batch.chunks if c.want_logits):
            if ch.start_position == 0 and ch.token_ids[0] == self.POISON:
                self.poisoned.add(ch.seq_id)
            if ch.seq_id in self.poisoned and ch.start_position + len(ch.token_ids) > self.NAN_AFTER:
                logits[row, 5] = float("nan")
        return logits


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_non_finite_logits_fail_their_request_alone(sampling, caplog):
    """A NaN row was streamed as its argmax (greedy: here the NaN's own index), or, sampled, failed the
    whole step in torch.multinomial (on CUDA a device-side assert that ends every request of the worker)."""
    limits = EngineLimits(num_blocks=32, max_running=4, max_waiting=4, max_batch_tokens=16, max_context=64)
    engine = Engine(NaNRunner([3]), Text(), limits, eos_token_ids=(EOS,), overlap=OVERLAP["value"])
    outs = {"bad": [], "good": []}
    engine.add_request("good", [1, 2], SamplingOptions(max_new_tokens=6, **sampling), outs["good"].append)
    engine.add_request("bad", [NaNRunner.POISON, 2], SamplingOptions(max_new_tokens=6, **sampling), outs["bad"].append)
    while engine.step():
        pass
    bad_tokens = [t for o in outs["bad"] for t in o.token_ids]
    assert outs["bad"][-1].error and "non-finite logits" in outs["bad"][-1].error and outs["bad"][-1].finish is None
    assert bad_tokens == [3, 3, 3]  # contexts of 2, 3 and 4 tokens; the 5-token context's logits hold the NaN
    assert [t for o in outs["good"] for t in o.token_ids] == [3] * 6 and outs["good"][-1].finish.reason is FinishReason.LENGTH
    assert engine.stats().kv_blocks_used == 0 and engine.num_in_flight == 0
    assert "held a NaN or an inf for 1 of 2 sequences ('bad')" in caplog.text
