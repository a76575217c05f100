"""The engine: admission, one scheduling step at a time, sampling, finishing, and its own thread.

The model step blocks (seconds on a CPU), so the loop runs in a thread of its own. Everything the
loop shares with callers (the scheduler, the block manager, the live requests) is guarded by one
lock, held only while scheduling and while applying a step's results; the forward pass itself runs
without it, so add_request and abort (from the grpc.aio event loop) never wait for a step. Abort
frees the request's blocks at once: a block freed during a step is not handed out before the next
schedule, and the step's result for the aborted sequence is dropped.

Outputs go to each request's `sink`, called on the engine thread; it must not block (the servicer
passes one that hands the output to its asyncio queue with loop.call_soon_threadsafe).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.detokenizer import Decoder, IncrementalDetokenizer
from services.worker.engine.outputs import EngineStats, FinishInfo, RequestOutput
from services.worker.engine.runner import ModelRunner, SequenceChunk, StepBatch
from services.worker.engine.sampler import new_generator, sample
from services.worker.engine.scheduler import Schedule, Scheduler
from services.worker.engine.sequence import FinishReason, SamplingOptions, Sequence
from services.worker.errors import DuplicateRequest, QueueFull

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


@dataclass(slots=True, frozen=True)
class EngineLimits:
    num_blocks: int
    max_running: int  # sequences in one step
    max_waiting: int  # admitted but not running; beyond it add_request raises QueueFull
    max_batch_tokens: int  # tokens in one step (the chunked-prefill budget)
    max_context: int  # prompt + generated tokens of one sequence


@dataclass(slots=True)
class _Live:
    seq: Sequence
    detok: IncrementalDetokenizer
    sink: Sink


class Engine:
    def __init__(self, runner: ModelRunner, decoder: Decoder, limits: EngineLimits, eos_token_ids: tuple[int, ...]):
        self.runner = runner
        self.decoder = decoder
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.blocks = BlockManager(limits.num_blocks, runner.block_size)
        self.scheduler = Scheduler(self.blocks, limits.max_running, limits.max_batch_tokens)
        runner.allocate_cache(limits.num_blocks)
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._stopping = False
        self._preemptions = 0
        self._thread: threading.Thread | None = None

    # ---- called from any thread ----

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingOptions, sink: Sink) -> None:
        """Queues a validated request. Raises DuplicateRequest or QueueFull."""
        with self._cond:
            if request_id in self._live:
                raise DuplicateRequest(f"request_id {request_id!r} is already in flight on this worker")
            if len(self.scheduler.waiting) >= self.limits.max_waiting:
                raise QueueFull(
                    f"the waiting queue is full ({self.limits.max_waiting} requests); retry later or use another worker"
                )
            seq = Sequence(next(self._ids), request_id, list(prompt_ids), sampling)
            if not sampling.greedy:
                seq.generator = new_generator(sampling, self.runner.device)
            self._live[request_id] = _Live(seq, IncrementalDetokenizer(self.decoder, sampling.stop), sink)
            self.scheduler.add(seq)
            self._cond.notify()

    def abort(self, request_id: str) -> bool:
        """Ends the request with reason ABORT and frees its blocks now; False when it is not in flight."""
        with self._cond:
            live = self._live.get(request_id)
            if live is None:
                return False
            self._finish(live, FinishReason.ABORT, [], "")
            return True

    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                kv_blocks_total=self.blocks.num_blocks,
                kv_blocks_free=self.blocks.num_free,
                kv_blocks_used=self.blocks.num_used,
                preemptions=self._preemptions,
            )

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._live)

    def in_flight(self) -> list[str]:
        with self._cond:
            return list(self._live)

    # ---- the loop ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="worker-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Aborts what is in flight and ends the loop (after the step in progress)."""
        with self._cond:
            for live in list(self._live.values()):
                self._finish(live, FinishReason.ABORT, [], "")
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                with self._cond:
                    while not self._stopping and not self.scheduler.has_work:
                        self._cond.wait()
                    if self._stopping:
                        return
                    schedule = self._schedule()
                if not schedule.chunks:  # cannot happen with a cache that holds one full context; be safe
                    time.sleep(0.001)
                    continue
                self.step_once(schedule)
            except Exception as exc:  # an engine bug: end what is in flight, keep the loop (and worker) alive
                log.exception("engine loop error")
                with self._cond:
                    seqs = [live.seq for live in self._live.values()]
                self._fail(seqs, f"engine error: {type(exc).__name__}: {exc}")

    def step(self) -> bool:
        """One scheduling step on the caller's thread (tests drive the engine without its thread)."""
        with self._cond:
            schedule = self._schedule()
        if not schedule.chunks:
            return False
        self.step_once(schedule)
        return True

    def step_once(self, schedule: Schedule) -> None:
        now = time.monotonic()
        for chunk in schedule.chunks:
            if chunk.seq.first_scheduled is None:
                chunk.seq.first_scheduled = now
        due = []
        chunks = []
        for c in schedule.chunks:
            seq, completes = c.seq, c.completes
            if completes:
                due.append(c)
            # The block table is passed as is: an abort during the step gives the sequence a new
            # table (Scheduler._release), and growth happens only in schedule(), on this thread.
            chunks.append(SequenceChunk(seq.seq_id, seq.token_at(c.start, c.num_tokens), c.start, seq.block_table,
                                        completes))
        batch = StepBatch(chunks)
        try:
            logits = self.runner.step(batch)  # (len(due), V) fp32 on the runner's device
            next_ids = sample(logits, [c.seq.sampling for c in due], [c.seq.generator for c in due])
        except Exception as exc:  # a failed step ends its requests, never the worker
            log.exception("model step failed for %d sequences", len(schedule.chunks))
            self._fail([c.seq for c in schedule.chunks], f"model step failed: {type(exc).__name__}: {exc}")
            return
        with self._cond:
            for chunk in schedule.chunks:
                self.scheduler.on_computed(chunk)
            for chunk, token in zip(due, next_ids):
                live = self._live.get(chunk.seq.request_id)
                if live is not None and live.seq is chunk.seq and chunk.seq.num_computed == chunk.seq.num_tokens:
                    self._append(live, token)

    # ---- with the lock held ----

    def _schedule(self) -> Schedule:
        schedule = self.scheduler.schedule()
        self._preemptions += len(schedule.preempted)
        for seq in schedule.preempted:
            log.debug("preempted %s (%d tokens to recompute)", seq.request_id, seq.num_tokens)
        return schedule

    def _append(self, live: _Live, token: int) -> None:
        seq, opt = live.seq, live.seq.sampling
        seq.output_ids.append(token)
        if seq.first_token is None:
            seq.first_token = time.monotonic()
        reason = None
        if token in opt.stop_token_ids:
            reason = FinishReason.STOP
        elif token in self.eos_token_ids and not opt.ignore_eos:
            reason = FinishReason.EOS
        # The text of a token that ends the generation (EOS, a stop token id) is not part of the output.
        text = live.detok.add([token]) if reason is None else ""
        if reason is None and live.detok.stopped:
            reason = FinishReason.STOP
        elif reason is None and opt.max_new_tokens and len(seq.output_ids) >= opt.max_new_tokens:
            reason = FinishReason.LENGTH
        elif reason is None and seq.num_tokens >= self.limits.max_context:
            reason = FinishReason.LENGTH
        if reason is None:
            live.sink(RequestOutput(seq.request_id, [token], text))
        else:
            self._finish(live, reason, [token], text + live.detok.flush())

    def _finish(self, live: _Live, reason: FinishReason, token_ids: list[int], text: str) -> None:
        seq = live.seq
        self._live.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        live.sink(RequestOutput(seq.request_id, token_ids, text, _finish_info(seq, reason)))

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        with self._cond:
            for seq in seqs:
                live = self._live.get(seq.request_id)
                if live is None or live.seq is not seq:
                    continue
                self._live.pop(seq.request_id)
                self.scheduler.finish(seq)
                live.sink(RequestOutput(seq.request_id, error=message))


def _finish_info(seq: Sequence, reason: FinishReason) -> FinishInfo:
    end = time.monotonic()
    total = end - seq.arrival
    ttft = seq.first_token - seq.arrival if seq.first_token is not None else 0.0
    generated = len(seq.output_ids)
    tpot = (total - ttft) / (generated - 1) if generated >= 2 else 0.0
    queue = (seq.first_scheduled if seq.first_scheduled is not None else end) - seq.arrival
    return FinishInfo(reason, len(seq.prompt_ids), generated, queue, ttft, tpot, total)
