"""Per-second reports of what each gateway replica served per arm (deployment, artifact), so that the
automatic guard of every replica judges an arm on the fleet's traffic: behind a load balancer each replica
relays 1/N of it, and alone none might reach the guard's minimum of requests while the arm fails.

A replica writes the seconds that have ended, once each (a retry after a failed commit replaces them), and
reads the other replicas' sums over a window; rows older than the longest window anyone judges are purged.
Times per output token travel as counts per tenth of a millisecond, and times to the first token as counts per
millisecond, so that a 95th percentile can be taken over the fleet (exact to that step) without shipping every
request."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry._rows import check_key
from shared.registry.errors import InvalidValue
from shared.registry.models import ArmReport

TPOT_STEP_S = 1e-4  # tpot_counts' unit: a tenth of a millisecond
TTFT_STEP_S = 1e-3  # ttft_counts' unit: a millisecond


@dataclass(frozen=True, slots=True)
class ArmSecond:
    """One replica's requests of one arm that finished within one second."""

    deployment: str
    artifact_id: str
    second: int  # unix seconds (floor of the finish time)
    requests: int
    errors: int
    tpot_counts: Mapping[int, int] = field(default_factory=dict)  # TPOT in TPOT_STEP_S -> requests
    ttft_counts: Mapping[int, int] = field(default_factory=dict)  # TTFT in TTFT_STEP_S -> requests


@dataclass(frozen=True, slots=True)
class ArmTotals:
    """Sums over several replicas and seconds."""

    requests: int = 0
    errors: int = 0
    tpot_counts: Mapping[int, int] = field(default_factory=dict)
    ttft_counts: Mapping[int, int] = field(default_factory=dict)


def tpot_step(tpot_s: float) -> int:
    return max(0, round(tpot_s / TPOT_STEP_S))


def ttft_step(ttft_s: float) -> int:
    return max(0, round(ttft_s / TTFT_STEP_S))


def write_arm_seconds(session: Session, gateway_id: str, seconds: Iterable[ArmSecond]) -> int:
    """Stores this replica's reports (replacing any of the same gateway, arm and second); returns how many."""
    check_key("gateway id", gateway_id)
    written = 0
    for report in seconds:
        if report.requests < 0 or report.errors < 0 or report.errors > report.requests:
            raise InvalidValue(f"arm report {report!r}: requests and errors must be counts, errors <= requests")
        row = ArmReport(gateway_id=gateway_id, deployment=report.deployment, artifact_id=report.artifact_id,
                        second=report.second, requests=report.requests, errors=report.errors,
                        tpot_counts=_counts_json(report.tpot_counts), ttft_counts=_counts_json(report.ttft_counts))
        session.merge(row)
        written += 1
    session.flush()
    return written


def fleet_arm_totals(session: Session, deployment: str, artifact_id: str, since_second: int, until_second: int,
                     exclude_gateway: str | None = None) -> ArmTotals:
    """The sums of the reports of [since_second, until_second] for this arm, but those of exclude_gateway
    (the reader, which counts its own requests from memory, to the request)."""
    stmt = sa.select(ArmReport.requests, ArmReport.errors, ArmReport.tpot_counts, ArmReport.ttft_counts).where(
        ArmReport.deployment == deployment, ArmReport.artifact_id == artifact_id,
        ArmReport.second >= since_second, ArmReport.second <= until_second)
    if exclude_gateway is not None:
        stmt = stmt.where(ArmReport.gateway_id != exclude_gateway)
    requests = errors = 0
    tpots: Counter[int] = Counter()
    ttfts: Counter[int] = Counter()
    for row_requests, row_errors, tpot_counts, ttft_counts in session.execute(stmt):
        requests += row_requests
        errors += row_errors
        tpots.update(_counts(tpot_counts))
        ttfts.update(_counts(ttft_counts))
    return ArmTotals(requests, errors, dict(tpots), dict(ttfts))


def _counts_json(counts: Mapping[int, int]) -> str:
    return json.dumps({str(k): v for k, v in sorted(counts.items())})


def _counts(text: str | None) -> dict[int, int]:
    """A report's counts column; None (a report written before the column existed) holds none."""
    return {int(k): int(v) for k, v in json.loads(text).items()} if text else {}


def purge_arm_reports(session: Session, before_second: int) -> int:
    """Deletes every report of a second before before_second; returns how many."""
    result = session.execute(sa.delete(ArmReport).where(ArmReport.second < before_second))
    return result.rowcount or 0
