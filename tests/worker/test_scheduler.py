"""The scheduler: continuous batching in arrival order, chunked prefill under a token budget,
the running limit, and preemption of the latest arrival when blocks run out."""

from types import SimpleNamespace

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import SamplingOptions, Sequence, SeqState


def _seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_ids=list(range(1, prompt_len + 1)),
                    sampling=SamplingOptions(), arrival=float(i))


def _step(sched: Scheduler, new_token: int = 7):
    """Schedules, marks the chunks computed, and appends a token to sequences whose turn it was."""
    schedule = sched.schedule()
    due = [c.completes for c in schedule.chunks]  # before the new tokens change the sequences
    for chunk, is_due in zip(schedule.chunks, due):
        sched.on_computed(chunk)
        if is_due:
            chunk.seq.output_ids.append(new_token)
    return SimpleNamespace(chunks=schedule.chunks, preempted=schedule.preempted, due=due,
                           num_tokens=schedule.num_tokens)


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    sched = Scheduler(BlockManager(64, 4), max_running=4, max_batch_tokens=8)
    seq = _seq(1, 20)
    sched.add(seq)
    sizes = []
    for _ in range(3):
        out = _step(sched)
        sizes.append([(c.start, c.num_tokens, due) for c, due in zip(out.chunks, out.due)])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert seq.output_ids == [7] and seq.num_computed == 20
    out = _step(sched)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(20, 1)]  # then one token per step


def test_decodes_run_before_prefill_chunks_and_budget_is_shared():
    sched = Scheduler(BlockManager(64, 4), max_running=4, max_batch_tokens=6)
    a, b = _seq(1, 3), _seq(2, 30)
    sched.add(a)
    _step(sched)  # a prefilled; b not yet arrived
    sched.add(b)
    out = _step(sched)
    # a's decode token first, then as much of b's prompt as the budget leaves.
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 5)]
    assert out.num_tokens == 6


def test_a_prompt_is_cut_only_when_the_step_has_no_prefill_yet():
    """Two 6-token prompts under a budget of 10: the second does not fit whole behind the first and
    waits for the next step rather than being cut (its rest would attend row by row)."""
    sched = Scheduler(BlockManager(64, 4), max_running=4, max_batch_tokens=10)
    a, b, c = _seq(1, 6), _seq(2, 6), _seq(3, 30)
    for s in (a, b):
        sched.add(s)
    out = _step(sched)
    assert [(x.seq.seq_id, x.start, x.num_tokens) for x in out.chunks] == [(1, 0, 6)]
    sched.add(c)
    out = _step(sched)
    # a's decode, b whole; c would only fit cut and the step already prefills: it waits.
    assert [(x.seq.seq_id, x.start, x.num_tokens) for x in out.chunks] == [(1, 6, 1), (2, 0, 6)]
    out = _step(sched)
    # Only decodes so far: c is cut to the rest of the budget, and its next chunk continues it.
    assert [(x.seq.seq_id, x.start, x.num_tokens) for x in out.chunks] == [(1, 7, 1), (2, 6, 1), (3, 0, 8)]
    out = _step(sched)
    assert [(x.seq.seq_id, x.start, x.num_tokens) for x in out.chunks] == [(1, 8, 1), (2, 7, 1), (3, 8, 8)]


def test_max_running_and_first_come_first_served():
    sched = Scheduler(BlockManager(64, 4), max_running=2, max_batch_tokens=100)
    seqs = [_seq(i, 4) for i in range(1, 5)]
    for s in seqs:
        sched.add(s)
    _step(sched)
    assert [s.seq_id for s in sched.running] == [1, 2]
    assert [s.seq_id for s in sched.waiting] == [3, 4]
    sched.finish(seqs[0])
    out = _step(sched)
    assert 3 in [c.seq.seq_id for c in out.chunks] and 4 not in [c.seq.seq_id for c in out.chunks]
    assert seqs[0].state is SeqState.FINISHED and not seqs[0].block_table


def test_a_waiting_request_is_not_overtaken_when_it_does_not_fit():
    sched = Scheduler(BlockManager(6, 4), max_running=4, max_batch_tokens=100)
    big, small = _seq(2, 20), _seq(3, 2)
    running = _seq(1, 4)
    sched.add(running)
    _step(sched)
    sched.add(big)
    sched.add(small)
    out = _step(sched)
    # big needs 5 blocks (+1 spare for the running sequence): it waits, and small waits behind it.
    assert [c.seq.seq_id for c in out.chunks] == [1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]


def test_preemption_takes_the_latest_arrival_and_recomputes_it_later():
    sched = Scheduler(BlockManager(5, 2), max_running=4, max_batch_tokens=100)
    old, new = _seq(1, 3), _seq(2, 3)
    sched.add(old)
    sched.add(new)
    _step(sched)  # each holds 2 blocks (3 prompt tokens); new was admitted with one spare block left
    assert sched.blocks.num_free == 1
    _step(sched)  # the sampled tokens at positions 3 still fit in the second blocks
    out = _step(sched)  # position 4 needs a third block each: old takes the spare, new gives its blocks up
    assert out.preempted == [new]
    assert new.state is SeqState.WAITING and new.num_computed == 0 and not new.block_table
    assert [c.seq.seq_id for c in out.chunks] == [1]
    assert new.output_ids == [7, 7]  # its generated tokens are kept and recomputed with the prompt
    sched.finish(old)
    out = _step(sched)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [(2, 0, 5)] and out.due == [True]
