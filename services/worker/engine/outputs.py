"""What the engine reports to a request's stream: new tokens and text, then how it finished."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.engine.sequence import FinishReason


@dataclass(slots=True, frozen=True)
class FinishInfo:
    reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    queue_s: float  # arrival -> first step that ran it
    time_to_first_token_s: float  # arrival -> first generated token (0 when none was generated)
    time_per_output_token_s: float  # (total - ttft) / (generated - 1); 0 below two tokens
    total_s: float  # arrival -> the end


@dataclass(slots=True, frozen=True)
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishInfo | None = None  # set on the last output only
    error: str | None = None  # the step failed for this request (the last output; no finish)
    non_finite: bool = False  # the error is the model's NaN / inf logits (the metrics count those apart)
    generated_tokens: int = 0  # with an error: the tokens generated (and streamed) before it, for the metrics


@dataclass(slots=True, frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    preemptions: int  # since start: sequences whose blocks were taken back to be recomputed later
    kv_blocks_cached: int = 0  # blocks holding a cached prompt prefix (held by sequences or free to reuse)
    prefix_cache_queried_tokens: int = 0  # since start: prompt tokens looked up in the prefix cache at admission
    prefix_cache_hit_tokens: int = 0  # since start: of those, tokens found cached (not computed again)
