"""What ListJobs and CancelJob accept: their requests, checked, as domain values."""

from __future__ import annotations

from dataclasses import dataclass

from services.quantizer.errors import InvalidRequest
from services.quantizer.views import job_state_from_pb
from shared.registry import JobState
from shared.registry.jobs import MAX_CANCEL_REASON
from shared.rpc.qserve.v1 import quantizer_pb2

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000  # the cap ListEvents has: an answer of at most a few MB
MAX_ACTOR = 128  # the registry's actor column


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
    def from_pb(cls, request: quantizer_pb2.CancelJobRequest, peer: str) -> CancelOrder:
        """`peer` (the caller's address) stands in for an empty requested_by."""
        if not request.job_id:
            raise InvalidRequest("job_id is required")
        actor = request.requested_by.strip() or peer or "unknown caller"
        if len(actor) > MAX_ACTOR:
            raise InvalidRequest(f"requested_by has {len(actor)} characters; at most {MAX_ACTOR} are accepted")
        if len(request.reason) > MAX_CANCEL_REASON:
            raise InvalidRequest(f"reason has {len(request.reason)} characters; at most {MAX_CANCEL_REASON} are "
                                 f"accepted")
        return cls(request.job_id, actor, request.reason)


def _state_name(value: int) -> str:
    try:
        return quantizer_pb2.JobState.Name(value)
    except ValueError:
        return f"unknown value {value}"
