"""The engine: admission, one scheduling step at a time, sampling, finishing, and its own thread.

The model step blocks (seconds on a CPU), so the loop runs in a thread of its own. Everything the
loop shares with callers (the scheduler, the block manager, the live requests) is guarded by one
lock, held only while scheduling and while applying a step's results; the forward pass itself runs
without it, so add_request and abort (from the grpc.aio event loop) never wait for a step. Abort
frees the request's blocks at once: a block freed during a step is not handed out before the next
schedule, and the step's result for the aborted sequence is dropped.

Outputs go to each request's `sink`, called on the engine thread; it must not block (the servicer
passes one that hands the output to its asyncio queue with loop.call_soon_threadsafe).

Overlap (on by default on a GPU): the host work between two steps (reading back the sampled
tokens, stop checks, detokenizing, outputs, the next schedule and its inputs: 1-2 ms at a batch of
256) would leave the GPU idle for that long each step. Instead, step N + 1 is scheduled and
launched before step N's tokens are read back: N's sampled ids stay on the device and N + 1 takes
them from there (a due sequence gets a placeholder token, `placeholder(row)`, that the runner
resolves against `StepBatch.previous_token_ids`). A sequence that turns out to have finished at step N
(EOS, a stop string) has run one step too many; that step's token is dropped, as for an abort.
A sequence never runs past its max_new_tokens or the context, known before its tokens are.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.detokenizer import Decoder, IncrementalDetokenizer
from services.worker.engine.outputs import EngineStats, FinishInfo, RequestOutput
from services.worker.engine.runner import ModelRunner, SequenceChunk, StepBatch
from services.worker.engine.sampler import NON_FINITE, finite_rows, ids_for_host, new_generator, sample
from services.worker.engine.scheduler import Schedule, Scheduler
from services.worker.engine.sequence import FinishReason, SamplingOptions, Sequence
from services.worker.errors import DuplicateRequest, InvalidRequest, QueueFull

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]


@dataclass(slots=True, frozen=True)
class EngineLimits:
    num_blocks: int
    max_running: int  # sequences in one step
    max_waiting: int  # admitted but not running; beyond it add_request raises QueueFull
    max_batch_tokens: int  # tokens in one step (the chunked-prefill budget)
    max_context: int  # prompt + generated tokens of one sequence


def placeholder(row: int) -> int:
    """The token id standing for row `row` of the previous step's sampled ids (see the runner contract)."""
    return -(row + 1)


class _HostIds:
    """A step's sampled ids on their way to the host: a non-blocking copy into pinned memory on a
    GPU (so launching the next step does not wait for it), the tensor itself on a CPU."""

    def __init__(self, ids: torch.Tensor):
        if ids.device.type == "cuda":
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = ids, None

    def wait(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclass(slots=True)
class _InFlight:
    """A launched step whose tokens have not been read back yet."""

    token_ids: torch.Tensor  # (rows,) int64 sampled ids on the runner's device
    host_ids: _HostIds
    placed: list[tuple[Sequence, int, int]]  # (sequence, index in its output_ids, row) per placeholder
    seqs: list[Sequence]  # every sequence of the step (failed together if the read-back fails)
    kind: str  # "decode" (one new token per sequence) or "prompt" (prompt tokens in it)
    launched_at: float  # time.monotonic() when the step began to launch
    # Sequences whose prompt this step completed, with their block tables: their blocks enter the prefix
    # cache once the step's logits come back finite (Scheduler.name_prompt_blocks).
    completed_prompts: list[tuple[Sequence, list[int]]]


@dataclass(slots=True)
class _Live:
    seq: Sequence
    detok: IncrementalDetokenizer
    sink: Sink


class Engine:
    def __init__(self, runner: ModelRunner, decoder: Decoder, limits: EngineLimits, eos_token_ids: tuple[int, ...],
                 overlap: bool | None = None, prefix_caching: bool = False):
        self.runner = runner
        # None: overlap where it pays, on a GPU (on a CPU the forward itself runs on the host).
        self.overlap = runner.device.type == "cuda" if overlap is None else overlap
        self._in_flight: _InFlight | None = None
        self.decoder = decoder
        # One sequence must always fit in the cache on its own: one that outgrows it preempts itself
        # and waits for room that never comes, and every request behind it waits too.
        if limits.max_context > limits.num_blocks * runner.block_size:
            raise ValueError(f"max_context={limits.max_context} tokens do not fit the KV cache's {limits.num_blocks} "
                             f"blocks of {runner.block_size}")
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        # Prefix caching: prompts starting with the same blocks of tokens (a system prompt, a conversation so
        # far) share the cached K/V of those blocks instead of computing them again (see block_manager).
        self.blocks = BlockManager(limits.num_blocks, runner.block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, limits.max_running, limits.max_batch_tokens)
        runner.allocate_cache(limits.num_blocks)
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._stopping = False
        self._preemptions = 0
        # When the engine last moved: a step launched or read back, or work arriving at an idle engine.
        self._last_progress = time.monotonic()
        # True while an iteration runs (a step launching, or its tokens being read back). A step that hangs
        # keeps the engine stalled after every request in it was aborted (the gateway ends a stalled
        # worker's streams): otherwise the worker would read as idle and take new requests into the hang.
        self._in_iteration = False
        self._thread: threading.Thread | None = None
        # Called with (kind, seconds) once a step's tokens are read back: launch to tokens on the host, the
        # GPU time included (with overlap, the next step's launch too). The worker's metrics set it.
        self.on_step: Callable[[str, float], None] | None = None

    # ---- called from any thread ----

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingOptions, sink: Sink,
                    arrival: float | None = None, cache_scope: str = "") -> None:
        """Queues a validated request; arrival (time.monotonic()) is when its caller got it, now if None: a
        server's time to first token starts before its tokenizing. Raises DuplicateRequest, QueueFull, or
        InvalidRequest for a prompt that leaves no room for a token in the context window (requests.py refuses those first, with the wording a
        client sees; the engine's own callers, the start-up checks and benchmarks, get it here: queued, such a
        prompt could never be admitted and every request behind it would wait for ever)."""
        if not 0 < len(prompt_ids) < self.limits.max_context:
            raise InvalidRequest(f"a prompt of {len(prompt_ids)} tokens: the engine takes 1 to "
                                 f"{self.limits.max_context - 1} (its context window is {self.limits.max_context})")
        with self._cond:
            if request_id in self._live:
                raise DuplicateRequest(f"request_id {request_id!r} is already in flight on this worker")
            # Requests that arrived since the last step sit in the waiting list until the next schedule
            # moves them into the batch's free slots: as many as there are free slots do not count
            # against the queue. So a burst that fits the free slots plus the queue is taken (the
            # gateway routes up to max_running + max_waiting requests to a worker), not refused for
            # arriving within one step.
            free_slots = max(0, self.limits.max_running - len(self.scheduler.running))
            if len(self.scheduler.waiting) >= self.limits.max_waiting + free_slots:
                raise QueueFull(
                    f"the waiting queue is full ({self.limits.max_waiting} requests); retry later or use another worker"
                )
            max_tokens = self.limits.max_context
            if sampling.max_new_tokens:
                max_tokens = min(max_tokens, len(prompt_ids) + sampling.max_new_tokens)
            seq = Sequence(next(self._ids), request_id, list(prompt_ids), sampling, max_tokens=max_tokens)
            if arrival is not None:
                seq.arrival = arrival
            if cache_scope:  # its prefix-cache blocks are shared with requests of this scope only
                seq.cache_salt = hashlib.sha256(b"qserve cache scope\0" + cache_scope.encode()).digest()
            if not sampling.greedy:
                seq.generator = new_generator(sampling, self.runner.device)
            if not self._live and not self._in_iteration:  # an idle engine was waiting for work, not stalled
                self._last_progress = time.monotonic()
            self._live[request_id] = _Live(seq, IncrementalDetokenizer(self.decoder, sampling.stop, prompt_ids), sink)
            self.scheduler.add(seq)
            self._cond.notify()

    def abort(self, request_id: str) -> bool:
        """Ends the request with reason ABORT and frees its blocks now; False when it is not in flight."""
        with self._cond:
            live = self._live.get(request_id)
            if live is None:
                return False
            self._abort(live)
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
                kv_blocks_cached=self.blocks.num_cached,
                prefix_cache_queried_tokens=self.scheduler.prefix_queried_tokens,
                prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            )

    def forget_start_up_checks(self) -> None:
        """After the start-up checks, before serving: K/V they wrote behind the engine's back (the probe, the
        warm-up) may sit in blocks the self-check's prompt left named in the prefix cache, so none is reused;
        and the counters start from nothing (a fresh worker's prefix cache had "queried" the self-check)."""
        with self._cond:
            self.blocks.forget_cached()
            self.scheduler.prefix_queried_tokens = self.scheduler.prefix_hit_tokens = 0
            self._preemptions = 0

    def stalled_s(self) -> float:
        """How long requests have been in flight, or an iteration has been running, with no step launched or
        read back (0 when idle): a device that hangs shows here, while the process and its heartbeats carry on."""
        with self._cond:
            return time.monotonic() - self._last_progress if self._live or self._in_iteration else 0.0

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
                self._abort(live)
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                with self._cond:
                    while not self._stopping and not self.scheduler.has_work and self._in_flight is None:
                        self._cond.wait()
                    if self._stopping:
                        return
                if not self._iterate():  # cannot happen with a cache that holds one full context; be safe
                    time.sleep(0.001)
            except Exception as exc:  # an engine bug: end what is in flight, keep the loop (and worker) alive
                log.exception("engine loop error")
                self._in_flight = None
                with self._cond:
                    seqs = [live.seq for live in self._live.values()]
                self._fail(seqs, f"engine error: {type(exc).__name__}: {exc}")

    def step(self) -> bool:
        """One iteration on the caller's thread (tests and benchmarks drive the engine without its
        thread): schedule and launch a step, then read back the previous step's tokens (with
        overlap) or this one's. False when there was nothing to schedule or read back (a step that
        was scheduled and failed counts as work done: its requests ended, others may be waiting)."""
        return self._iterate()

    def _iterate(self) -> bool:
        self._in_iteration = True
        try:
            return self._iterate_once()
        finally:
            self._in_iteration = False

    def _iterate_once(self) -> bool:
        with self._cond:
            schedule = self._schedule()
            # Under the same lock as the schedule: an abort right after it gives the sequence a new,
            # empty block table, and the step must still get the table it was scheduled with.
            chunks = self._chunks(schedule)
        previous = self._in_flight
        launched = self._launch(schedule, chunks, previous) if schedule.chunks else None
        self._in_flight = launched if self.overlap else None
        if previous is not None:
            self._read_back(previous)
        if launched is not None and not self.overlap:
            self._read_back(launched)
        moved = bool(schedule.chunks) or previous is not None
        if moved:
            self._last_progress = time.monotonic()
        return moved

    def _chunks(self, schedule: Schedule) -> list[SequenceChunk]:
        """The runner's chunks of a schedule (with the lock held)."""
        now = time.monotonic()
        chunks = []
        for c in schedule.chunks:
            seq = c.seq
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            # The block table is passed as is: an abort during the step gives the sequence a new
            # table (Scheduler._release), and growth happens only in schedule(), on this thread.
            chunks.append(SequenceChunk(seq.seq_id, seq.token_at(c.start, c.num_tokens), c.start, seq.block_table,
                                        c.completes))
        return chunks

    def _launch(self, schedule: Schedule, chunks: list[SequenceChunk], previous: _InFlight | None) -> _InFlight | None:
        """Queues one model step and its sampling on the device, then books its effect as if done:
        the chunks count as computed and each due sequence gets a placeholder token, so the next
        schedule can be made (and the next step launched) before this one's tokens are known."""
        launched_at = time.monotonic()
        due = [c for c, chunk in zip(schedule.chunks, chunks) if chunk.want_logits]
        batch = StepBatch(chunks, previous.token_ids if previous is not None else None)
        try:
            logits = self.runner.step(batch)  # (len(due), V) fp32 on the runner's device
            finite = finite_rows(logits)
            ids = sample(logits, [c.seq.sampling for c in due], [c.seq.generator for c in due], finite)
            host_ids = _HostIds(ids_for_host(ids, finite))
        except Exception as exc:  # a failed step ends its requests, never the worker
            log.exception("model step failed for %d sequences", len(schedule.chunks))
            self._fail([c.seq for c in schedule.chunks], f"model step failed: {type(exc).__name__}: {exc}")
            return None
        placed = []
        completed_prompts = [(c.seq, c.seq.block_table) for c in due if c.start < len(c.seq.prompt_ids)]
        with self._cond:
            for chunk in schedule.chunks:
                self.scheduler.on_computed(chunk)
            for row, chunk in enumerate(due):
                seq = chunk.seq
                live = self._live.get(seq.request_id)
                if live is not None and live.seq is seq and seq.num_computed == seq.num_tokens:
                    seq.output_ids.append(placeholder(row))
                    placed.append((seq, len(seq.output_ids) - 1, row))
        return _InFlight(ids, host_ids, placed, [c.seq for c in schedule.chunks],
                         "decode" if batch.is_decode_only else "prompt", launched_at, completed_prompts)

    def _read_back(self, step: _InFlight) -> None:
        """Waits for a launched step's tokens and puts them in place of its placeholders: stop
        checks, text, outputs. A sequence that finished or was aborted meanwhile is skipped."""
        try:
            tokens = step.host_ids.wait()
        except Exception as exc:
            log.exception("reading back a step's tokens failed")
            self._fail(step.seqs, f"model step failed: {type(exc).__name__}: {exc}")
            return
        if self.on_step is not None:
            self.on_step(step.kind, time.monotonic() - step.launched_at)
        with self._cond:
            if NON_FINITE not in tokens:  # before the tokens below end sequences and release their tables
                for seq, table in step.completed_prompts:
                    self.scheduler.name_prompt_blocks(seq, table)
            broken = []
            for seq, index, row in step.placed:
                live = self._live.get(seq.request_id)
                if live is None or live.seq is not seq or seq.output_ids[index] != placeholder(row):
                    continue
                if tokens[row] == NON_FINITE:
                    broken.append(seq)
                    continue
                seq.output_ids[index] = tokens[row]
                self._on_token(live, index)
            if broken:
                log.error("the model's logits held a NaN or an inf for %d of %d sequences (%s); failing them",
                          len(broken), len(step.placed), ", ".join(repr(seq.request_id) for seq in broken[:8]))
                self._fail(broken, "the model produced non-finite logits (NaN or inf): the artifact or the "
                                   "device is broken", non_finite=True)

    # ---- with the lock held ----

    def _schedule(self) -> Schedule:
        schedule = self.scheduler.schedule()
        self._preemptions += len(schedule.preempted)
        for seq in schedule.preempted:
            log.debug("preempted %s (%d tokens to recompute)", seq.request_id, seq.num_tokens)
        return schedule

    def _on_token(self, live: _Live, index: int) -> None:
        """Output token `index` of the sequence is now known: stream it or finish the request. Later
        entries of output_ids, if any, are placeholders of a step still in flight."""
        seq, opt = live.seq, live.seq.sampling
        token = seq.output_ids[index]
        generated = index + 1
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
        elif reason is None and len(seq.prompt_ids) + generated >= seq.max_tokens:  # max_new_tokens or the context
            reason = FinishReason.LENGTH
        if reason is None:
            _deliver(live, RequestOutput(seq.request_id, [token], text))
        else:
            del seq.output_ids[generated:]  # a step in flight may have appended a placeholder after it
            text += live.detok.flush()
            if live.detok.stopped and reason in (FinishReason.LENGTH, FinishReason.EOS):
                # The held-back tail (text before an incomplete character) completed a stop string,
                # which came before the length limit or the EOS in the text.
                reason = FinishReason.STOP
            # The last token was sampled, never fed: the K/V of every token before it are written, by steps
            # read back (the one that fed the token before it is the one that sampled this one).
            self.scheduler.name_finished_blocks(seq, len(seq.prompt_ids) + generated - 1)
            self._finish(live, reason, [token], text)

    def _finish(self, live: _Live, reason: FinishReason, token_ids: list[int], text: str) -> None:
        seq = live.seq
        self._live.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        _deliver(live, RequestOutput(seq.request_id, token_ids, text, _finish_info(seq, reason)))

    def _abort(self, live: _Live) -> None:
        # The text the detokenizer held back (a possible start of a stop string, a character still
        # incomplete) belongs to tokens already streamed: it ends the stream, as at any other finish.
        self._finish(live, FinishReason.ABORT, [], live.detok.flush())

    def _fail(self, seqs: list[Sequence], message: str, non_finite: bool = False) -> None:
        with self._cond:
            for seq in seqs:
                live = self._live.get(seq.request_id)
                if live is None or live.seq is not seq:
                    continue
                self._live.pop(seq.request_id)
                self.scheduler.finish(seq)
                _deliver(live, RequestOutput(seq.request_id, error=message, non_finite=non_finite,
                                             generated_tokens=_generated(seq)))
            # A failed step (or NaN logits) may have left wrong or unwritten K/V in blocks already named for
            # the prefix cache: none of them is handed to another request.
            self.blocks.forget_cached()


def _deliver(live: _Live, out: RequestOutput) -> None:
    """Hands one output to its request's sink. A sink that raises (its caller's event loop closed) loses
    that output only: it must not fail the other requests of the step, nor end the engine's thread."""
    try:
        live.sink(out)
    except Exception:
        log.exception("request %s: its output could not be delivered", out.request_id)


def _generated(seq: Sequence) -> int:
    return sum(1 for t in seq.output_ids if t >= 0)  # not the placeholder of a step in flight (abort)


def _finish_info(seq: Sequence, reason: FinishReason) -> FinishInfo:
    end = time.monotonic()
    total = end - seq.arrival
    ttft = seq.first_token - seq.arrival if seq.first_token is not None else 0.0
    generated = _generated(seq)
    tpot = (total - ttft) / (generated - 1) if generated >= 2 else 0.0
    queue = (seq.first_scheduled if seq.first_scheduled is not None else end) - seq.arrival
    return FinishInfo(reason, len(seq.prompt_ids), generated, queue, ttft, tpot, total)
