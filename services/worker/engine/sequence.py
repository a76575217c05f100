"""One request inside the engine: its tokens, cache blocks, sampling settings and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


class FinishReason(enum.IntEnum):
    """Values equal common.proto's FinishReason, so the servicer converts by value."""

    LENGTH = 1
    EOS = 2
    STOP = 3
    ABORT = 4


@dataclass(slots=True, frozen=True)
class SamplingOptions:
    """Validated sampling settings (the servicer checks the proto's before building one)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # 1.0 = no limit
    seed: int | None = None  # None = a fresh random seed
    max_new_tokens: int = 0  # 0 = until EOS, a stop condition or the context is full
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted and waiting to recompute)
    RUNNING = "running"  # in the running batch, holding cache blocks
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int  # the engine's id, also the runner's SequenceChunk.seq_id
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingOptions
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Preemption sets it back to 0: the prompt and the tokens
    # generated so far are then recomputed as one long prefill (chunked like any other).
    num_computed: int = 0
    state: SeqState = SeqState.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled: float | None = None  # monotonic time of the first step that ran it
    first_token: float | None = None  # monotonic time of the first generated token
    num_preemptions: int = 0
    # prompt + generated tokens at which the generation ends for certain (max_new_tokens, the
    # context): a sequence there needs no further step, even while its last token is unknown.
    max_tokens: int = 1 << 62
    generator: torch.Generator | None = None  # per-request RNG for sampled requests (made by the engine)
    # The names of the prompt's full blocks (block_manager.prefix_block_hashes), made at first admission
    # when prefix caching is on.
    prompt_hashes: list[bytes] | None = None
    cache_salt: bytes = b""  # of its cache scope (Engine.add_request): its blocks are named apart from others'

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt + output."""
        p = len(self.prompt_ids)
        if start + count <= p:
            return self.prompt_ids[start : start + count]
        if start >= p:  # decode steps: no copy of the whole sequence per token
            return self.output_ids[start - p : start - p + count]
        return self.prompt_ids[start:] + self.output_ids[: start + count - p]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def at_token_limit(self) -> bool:
        return self.num_tokens >= self.max_tokens and bool(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED
