"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (max_batch_tokens, the chunked-prefill budget). Running sequences
go first, decodes (one token each) before prefill chunks so a long prompt cannot stall the tokens
of sequences already generating; then waiting sequences are admitted in arrival order while the
budget, the running limit and the free blocks allow (the blocks of the whole prompt, not only of
its first chunk). A prompt is cut to the rest of the budget only when the step has no prefill
tokens yet (a prompt longer than the budget, or one behind many decodes): otherwise it waits whole
for the next step, because the rest of a cut prompt attends over the paged cache as a continuing
chunk (paged_prefill_attention), dearer than plain prefill attention. Order is by arrival
everywhere (first come, first served): a waiting request is never overtaken by a later one, and
when blocks run out the latest-arrived running sequence is preempted (its blocks freed, its tokens
recomputed later).

Prefix caching (BlockManager.prefix_caching): a sequence admitted with nothing computed (new, or
preempted) first takes the cached blocks of its prompt's longest cached prefix and starts computing
after them, always leaving at least its last token to compute (its logits are needed). It pays for
only the blocks it still needs; the shared ones it holds are not free any more if nobody held them.
A prompt's blocks are named (name_prompt_blocks) by the engine once the step that completed the
prompt has come back with finite logits, not when it is launched: a step's NaN, or a failed step,
is known only then, and a request admitted meanwhile must not take blocks that may be broken. When a
sequence finishes, the blocks of its generated tokens are named too (name_finished_blocks): a
conversation's next turn starts with this turn's prompt and answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.engine.block_manager import BlockManager, prefix_block_hashes
from services.worker.engine.sequence import Sequence, SeqState


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position this step computes (== seq.num_computed)
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when the chunk reaches the sequence's last token, so its next token is due."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class Schedule:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_batch_tokens: int):
        if max_running < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_running={max_running} and max_batch_tokens={max_batch_tokens} must be >= 1")
        self.blocks = blocks
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.waiting: list[Sequence] = []  # by arrival
        # By arrival too: a request stamped earlier can be admitted later (its longer prompt was still being
        # tokenized), and the step visits, and preemption spares, the earliest first.
        self.running: list[Sequence] = []
        # Prompt tokens looked up in the prefix cache at admission, and those found (not computed again).
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.state = SeqState.WAITING
        self._enqueue(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes seq out of the queues and frees its blocks at once (finished, aborted or cancelled)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.state = SeqState.FINISHED

    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()
        decodes, prefills = [], []
        for s in self.running:
            if s.at_token_limit:  # its last token is still being read back; no step is needed
                continue
            (decodes if s.num_uncomputed == 1 else prefills).append(s)
        slots_per_block = self.blocks.block_size
        prefilling = False  # does the step carry prefill tokens yet
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.state is not SeqState.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            end = seq.num_computed + n
            if end > len(seq.block_table) * slots_per_block:  # needs a new block (most steps do not)
                if not self._make_room(seq, n, scheduled, out):
                    continue
                self.blocks.grow(seq.block_table, end)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            scheduled.add(seq.seq_id)
            budget -= n
            prefilling |= seq.num_uncomputed > 1
        # After a preemption the cache is full: admitting now would only preempt again.
        while not out.preempted and self.waiting and len(self.running) < self.max_running and budget > 0:
            seq = self.waiting[0]
            shared = self._cached_prefix(seq)
            start = len(shared) * slots_per_block
            n = min(seq.num_tokens - start, budget)
            if n < seq.num_tokens - start and prefilling:
                break  # waits whole for the next step (see the module docstring)
            # Keep one spare block per running sequence so that admitting does not force the
            # running ones to preempt each other on their next block boundary.
            reserve = len(self.running)
            # The blocks of all its tokens, not only this step's chunk: a prompt let in on its first
            # chunk's blocks, while decodes take the rest, is preempted at a later chunk and let in
            # again as soon as that chunk fits, prefilling its start over and over for nothing.
            need = self.blocks.blocks_for(seq.num_tokens) - len(shared)
            if need + reserve > self.blocks.num_free - self.blocks.num_unheld(shared):
                break  # first come, first served: later arrivals wait behind it
            self.waiting.pop(0)
            seq.state = SeqState.RUNNING
            _insert_by_arrival(self.running, seq)
            if self.blocks.prefix_caching and not seq.num_preemptions:  # a prompt's first lookup only
                self.prefix_queried_tokens += len(seq.prompt_ids)
                self.prefix_hit_tokens += start
            self.blocks.share(seq.block_table, shared)
            seq.num_computed = start
            self.blocks.grow(seq.block_table, start + n)
            out.chunks.append(ScheduledChunk(seq, start, n))
            budget -= n
            prefilling = True
        return out

    def on_computed(self, chunk: ScheduledChunk) -> None:
        """Records that the step wrote the chunk's K/V (unless the sequence left in the meantime)."""
        if chunk.seq.state is SeqState.RUNNING and chunk.seq.num_computed == chunk.start:
            chunk.seq.num_computed += chunk.num_tokens

    def name_prompt_blocks(self, seq: Sequence, table: list[int]) -> None:
        """Enters the full blocks of seq's computed prompt in the prefix cache, if seq still holds `table`
        (the table of the step that computed them: a sequence preempted or ended since has another)."""
        if seq.prompt_hashes and seq.block_table is table and seq.state is SeqState.RUNNING:
            for block, name in zip(table, seq.prompt_hashes):
                self.blocks.name(block, name)

    def name_finished_blocks(self, seq: Sequence, known: int) -> None:
        """Enters the full blocks of seq's first `known` tokens (prompt and generated) in the prefix cache, as
        it finishes: tokens whose K/V steps already read back have written."""
        if self.blocks.prefix_caching and seq.state is SeqState.RUNNING:
            # The prompt's names were made at admission: only the generated blocks are hashed here.
            names = prefix_block_hashes(seq.token_at(0, known), self.blocks.block_size, seq.prompt_hashes or (),
                                        seq.cache_salt)
            for block, name in zip(seq.block_table, names):
                self.blocks.name(block, name)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence can start from: its prompt's longest cached prefix, short of
        its last token (whose logits must be computed)."""
        if not self.blocks.prefix_caching:
            return []
        if seq.prompt_hashes is None:
            seq.prompt_hashes = prefix_block_hashes(seq.prompt_ids, self.blocks.block_size, salt=seq.cache_salt)
        return self.blocks.cached_prefix(seq.prompt_hashes[: (seq.num_tokens - 1) // self.blocks.block_size])

    def _make_room(self, seq: Sequence, n: int, scheduled: set[int], out: Schedule) -> bool:
        """Preempts the latest arrivals until seq can grow by n tokens (one scheduled earlier in this step, a
        decode visited before seq's prefill, loses its chunk); False when seq itself is the latest and was
        preempted."""
        while not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
            victim = max(self.running, key=lambda s: (s.arrival, s.seq_id))
            if victim.seq_id in scheduled:
                out.chunks = [chunk for chunk in out.chunks if chunk.seq is not victim]
                scheduled.discard(victim.seq_id)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _release(self, seq: Sequence) -> None:
        """Frees seq's blocks. It gets a new, empty table: the step in flight (the runner reads the
        old list outside the engine's lock) keeps a consistent view, and the freed blocks are only
        handed out at the next schedule, after that step."""
        self.blocks.release(seq.block_table)
        seq.block_table = []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.state = SeqState.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        _insert_by_arrival(self.waiting, seq)


def _insert_by_arrival(queue: list[Sequence], seq: Sequence) -> None:
    key = (seq.arrival, seq.seq_id)
    i = len(queue)
    while i > 0 and (queue[i - 1].arrival, queue[i - 1].seq_id) > key:
        i -= 1
    queue.insert(i, seq)
