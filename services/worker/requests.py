"""From a GenerateRequest to the engine's inputs, refusing what cannot be served (INVALID_ARGUMENT)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from services.worker.engine.sequence import SamplingOptions
from services.worker.errors import InvalidRequest
from shared.rpc.qserve.v1 import common_pb2, worker_pb2

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Each generated token is checked against them on the engine's thread, which every request shares.
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SCOPE_CHARS = 128


@dataclass(slots=True, frozen=True)
class PromptLimits:
    vocab_size: int
    max_context: int  # prompt + generated tokens
    add_bos: bool
    bos_token_id: int | None
    # Longer prompt texts are refused before tokenizing: they cannot fit max_context (the context window
    # times the vocabulary's longest token), and encoding megabytes only to refuse them costs seconds.
    max_text_chars: int


@dataclass(slots=True, frozen=True)
class Generation:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingOptions
    cache_scope: str = ""  # GenerateRequest.cache_scope


def generation_from_pb(request: worker_pb2.GenerateRequest, limits: PromptLimits, encode) -> Generation:
    """`encode(text) -> ids` is the artifact's tokenizer (no special tokens; BOS is added here)."""
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("no prompt: set text or token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("the prompt text is empty")
        if len(request.text) > limits.max_text_chars:
            raise InvalidRequest(
                f"the prompt text has {len(request.text)} characters: more than this worker's context window of "
                f"{limits.max_context} tokens can hold (at most {limits.max_text_chars} characters)"
            )
        ids = list(encode(request.text))
        if limits.add_bos and limits.bos_token_id is not None:
            ids = [limits.bos_token_id] + ids
        if not ids:
            raise InvalidRequest(f"the prompt text {request.text[:40]!r} encodes to no tokens")
        # Checked like token_ids: an id past the embedding table fails the whole engine step, and with it
        # every other request in the batch. The artifact's tokenizer should never give one; if it does,
        # this request is refused alone, with the reason.
        _check_vocab("token id", ids, limits.vocab_size,
                     " (from the prompt text: this artifact's tokenizer or BOS id does not match its model)")
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("the prompt token_ids are empty")
        _check_vocab("prompt token id", ids, limits.vocab_size)
    if len(ids) >= limits.max_context:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens; this worker's context window is {limits.max_context} tokens "
            f"(prompt + generated), so a prompt may have at most {limits.max_context - 1}"
        )
    if len(request.cache_scope) > MAX_CACHE_SCOPE_CHARS:
        raise InvalidRequest(f"cache_scope has {len(request.cache_scope)} characters; at most {MAX_CACHE_SCOPE_CHARS}")
    return Generation(request_id, ids, sampling_from_pb(request.sampling, limits.vocab_size), request.cache_scope)


def sampling_from_pb(pb: common_pb2.SamplingParams, vocab_size: int) -> SamplingOptions:
    if not math.isfinite(pb.temperature) or pb.temperature < 0:
        raise InvalidRequest(f"temperature={pb.temperature} must be a finite number >= 0 (0 = greedy)")
    if not math.isfinite(pb.top_p) or not 0 <= pb.top_p <= 1:
        raise InvalidRequest(f"top_p={pb.top_p} must be in (0, 1], or 0 for no limit")
    stop_ids = tuple(dict.fromkeys(pb.stop_token_ids))
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"{len(stop_ids)} stop token ids given; at most {MAX_STOP_TOKEN_IDS}")
    _check_vocab("stop token id", stop_ids, vocab_size)
    if len(pb.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{len(pb.stop)} stop strings given; at most {MAX_STOP_STRINGS}")
    for s in pb.stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop string {s!r} must have 1 to {MAX_STOP_CHARS} characters")
    return SamplingOptions(
        temperature=float(pb.temperature),
        top_k=pb.top_k,
        top_p=float(pb.top_p) if pb.top_p > 0 else 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        max_new_tokens=pb.max_new_tokens,
        stop_token_ids=stop_ids,
        stop=tuple(pb.stop),
        ignore_eos=pb.ignore_eos,
    )


def _check_vocab(what: str, ids, vocab_size: int, why: str = "") -> None:
    # Negative too: the wire's ids are unsigned, but a text prompt's BOS and the tokenizer's ids are not, and a
    # negative id fails the detokenizer (or indexes the embedding table from its end).
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{what} {bad} is outside the vocabulary: ids are 0..{vocab_size - 1}{why}")
