"""What ListJobs and CancelJob accept: their requests, checked, as domain values."""

from __future__ import annotations

from dataclasses import dataclass

from services.quantizer.errors import InvalidRequest
from services.quantizer.views import job_state_from_pb
from shared.registry import JobState
from shared.registry.jobs import MAX_CANCEL_REASON
from shared.registry.models import MAX_ACTOR
from shared.rpc.qserve.v1 import quantizer_pb2

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000  # the cap ListEvents has: an answer of at most a few MB


@dataclass(slots=True, frozen=True)
class JobFilter:
    states: tuple[JobState, ...] = ()  # empty = any state
    model_name: str = ""  # empty = any model
    limit: int = DEFAULT_LIMIT

    @classmethod
    def from_pb(cls, request: quantizer_pb2.ListJobsRequest) -> JobFilter:
        if request.limit > MAX_LIMIT:
            raise InvalidRequest(f"limit {request.limit} is above {MAX_LIMIT}; filter by state or model_name instead")
        states = []
        for value in request.states:
            state = job_state_from_pb(value)
            if state is None:  # UNSPECIFIED would silently match nothing; an unknown number is a newer client's
                accepted = ", ".join(quantizer_pb2.JobState.Name(v) for v in quantizer_pb2.JobState.values() if v)
                raise InvalidRequest(f"states holds {_state_name(value)}, not a job state to filter by; accepted: "
                                     f"{accepted} (leave states empty for any state)")
            states.append(state)
        return cls(tuple(dict.fromkeys(states)), request.model_name, request.limit or DEFAULT_LIMIT)


@dataclass(slots=True, frozen=True)
class CancelOrder:
    job_id: str
    actor: str  # who asks: recorded in the job's error and the event log
    reason: str

    @classmethod
    def from_pb(cls, request: quantizer_pb2.CancelJobRequest, peer: str, caller: str | None = None) -> CancelOrder:
        """`caller`: the name of the caller's token (None with tokens off), the actor; requested_by then goes
        into the reason ("cancelled by <token name>: for <requested_by>: <reason>"). With tokens off the actor
        is requested_by, or `peer` (the caller's address) for an empty one."""
        if not request.job_id:
            raise InvalidRequest("job_id is required")
        requested_by = request.requested_by.strip()
        who = requested_by or ("" if caller else peer or "unknown caller")  # the actor with tokens off
        if len(who) > MAX_ACTOR:
            raise InvalidRequest(f"requested_by has {len(who)} characters; at most {MAX_ACTOR} are accepted")
        if len(request.reason) > MAX_CANCEL_REASON:
            raise InvalidRequest(f"reason has {len(request.reason)} characters; at most {MAX_CANCEL_REASON} are "
                                 f"accepted")
        if caller is None:
            return cls(request.job_id, who, request.reason)
        reason = request.reason.strip()
        if requested_by:
            reason = f"for {requested_by}" + (f": {reason}" if reason else "")
            # The registry caps the stored reason; cut the operator's text, never who asked.
            reason = reason if len(reason) <= MAX_CANCEL_REASON else reason[:MAX_CANCEL_REASON - 3] + "..."
        return cls(request.job_id, caller, reason)


def _state_name(value: int) -> str:
    try:
        return quantizer_pb2.JobState.Name(value)
    except ValueError:
        return f"unknown value {value}"
