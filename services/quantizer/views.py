"""What the quantizer answers with: domain snapshots of artifacts, models and jobs, each owning to_pb()."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from services.quantizer.errors import InvalidRequest
from services.quantizer.publish_spec import PublishSpec
from shared.registry import Artifact, ArtifactState, JobState, QuantJob
from shared.registry.models import utcnow
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2


class Stage(str, enum.Enum):
    """The pipeline stages, in order; the value is what the registry records."""

    LOAD = "load"
    CALIBRATE = "calibrate"
    QUANTIZE = "quantize"
    PACK = "pack"
    EVAL = "eval"
    UPLOAD = "upload"
    REGISTER = "register"

    def to_pb(self) -> int:
        return quantizer_pb2.JobStage.Value(f"JOB_STAGE_{self.name}")


_ARTIFACT_STATES = {state: common_pb2.ArtifactState.Value(f"ARTIFACT_STATE_{state.name}") for state in ArtifactState}
_JOB_STATES = {state: quantizer_pb2.JobState.Value(f"JOB_STATE_{state.name}") for state in JobState}
TERMINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


def job_state_from_pb(value: int) -> JobState | None:
    """None for UNSPECIFIED or a number this version does not know."""
    return next((state for state, pb in _JOB_STATES.items() if pb == value), None)


def artifact_state_from_pb(value: int) -> ArtifactState | None:
    """None for UNSPECIFIED (any state); InvalidRequest for a number this version does not know (a newer
    client's state: read as "any", its filter would list every artifact)."""
    if value == common_pb2.ARTIFACT_STATE_UNSPECIFIED:
        return None
    for state, pb in _ARTIFACT_STATES.items():
        if pb == value:
            return state
    accepted = ", ".join(common_pb2.ArtifactState.Name(pb) for pb in _ARTIFACT_STATES.values())
    raise InvalidRequest(f"state {value} is not an artifact state to filter by; accepted: {accepted} (or none for "
                         f"any state)")


@dataclass(slots=True, frozen=True)
class EvaluationView:
    data_name: str
    ppl_fp16: float
    ppl_quantized: float
    seq_len: int = 0  # 0 where only the registry's record is at hand (it keeps name and perplexities)
    windows: int = 0
    budget: float = 0.0

    def to_pb(self) -> common_pb2.Evaluation:
        return common_pb2.Evaluation(
            data_name=self.data_name, perplexity_fp16=self.ppl_fp16, perplexity_quantized=self.ppl_quantized,
            seq_len=self.seq_len, num_windows=self.windows, max_relative_increase=self.budget,
        )


@dataclass(slots=True, frozen=True)
class ArtifactDetails:
    """What the registry does not keep, known for artifacts this process published or read back."""

    size_bytes: int
    evaluation: EvaluationView | None


@dataclass(slots=True, frozen=True)
class ArtifactView:
    artifact_id: str
    model_name: str
    model_version: str
    version_label: str
    format: str
    gpu_target: str
    state: ArtifactState
    failure_reason: str
    object_prefix: str
    evaluation: EvaluationView | None
    size_bytes: int
    created_at: datetime
    vocabulary_digest: str

    @classmethod
    def from_row(cls, row: Artifact, details: ArtifactDetails | None = None) -> ArtifactView:
        evaluation = None
        if row.state != ArtifactState.PENDING and row.ppl_fp16 is not None and row.ppl_quant is not None:
            evaluation = EvaluationView(row.eval_data or "", row.ppl_fp16, row.ppl_quant)
            known = details.evaluation if details is not None else None
            # Only what describes these numbers: an artifact that reuses an identical one's stored files (its
            # content_digest) reads that one's manifest, whose evaluation may be on other windows.
            if known is not None and _same(known.ppl_fp16, row.ppl_fp16) and _same(known.ppl_quantized, row.ppl_quant):
                evaluation = replace(evaluation, seq_len=known.seq_len, windows=known.windows, budget=known.budget)
        return cls(
            artifact_id=row.id,
            model_name=row.model_version.model.name,
            model_version=row.model_version.content_hash,
            version_label=row.model_version.label,
            format=row.format,
            gpu_target=row.gpu,
            state=row.state,
            failure_reason=row.failure_reason or "",
            object_prefix=row.object_prefix,
            evaluation=evaluation,
            size_bytes=details.size_bytes if details is not None and row.state == ArtifactState.READY else 0,
            created_at=row.created_at,
            vocabulary_digest=row.vocabulary_digest or "",
        )

    def to_pb(self) -> common_pb2.ArtifactInfo:
        info = common_pb2.ArtifactInfo(
            artifact_id=self.artifact_id, model_name=self.model_name, model_version=self.model_version,
            version_label=self.version_label, format=self.format, gpu_target=self.gpu_target,
            state=_ARTIFACT_STATES[self.state], failure_reason=self.failure_reason,
            object_key_prefix=self.object_prefix, size_bytes=self.size_bytes, created_at=_timestamp(self.created_at),
            vocabulary_digest=self.vocabulary_digest,
        )
        if self.evaluation is not None:
            info.evaluation.CopyFrom(self.evaluation.to_pb())
        return info

    def ref_pb(self) -> common_pb2.ArtifactRef:
        return common_pb2.ArtifactRef(
            artifact_id=self.artifact_id, model_name=self.model_name, model_version=self.model_version,
            format=self.format, gpu_target=self.gpu_target,
        )


@dataclass(slots=True, frozen=True)
class VersionView:
    model_version: str
    version_label: str
    created_at: datetime
    artifacts: tuple[ArtifactView, ...]

    def to_pb(self) -> quantizer_pb2.ModelVersion:
        return quantizer_pb2.ModelVersion(
            model_version=self.model_version, version_label=self.version_label,
            created_at=_timestamp(self.created_at), artifacts=[a.ref_pb() for a in self.artifacts],
        )


@dataclass(slots=True, frozen=True)
class ModelView:
    model_name: str
    created_at: datetime
    versions: tuple[VersionView, ...]  # newest first

    def to_pb(self) -> quantizer_pb2.ModelInfo:
        return quantizer_pb2.ModelInfo(
            model_name=self.model_name, created_at=_timestamp(self.created_at),
            versions=[v.to_pb() for v in self.versions],
        )


@dataclass(slots=True, frozen=True)
class JobView:
    job_id: str
    state: JobState
    stage: Stage | None
    block_index: int
    block_count: int
    elapsed: timedelta
    remaining: timedelta | None
    error: str
    artifact: ArtifactView | None
    request: PublishSpec | None  # None for a job this process did not accept (another quantizer's)
    created_at: datetime
    model_name: str = ""
    cancel_requested_at: datetime | None = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def from_row(cls, job: QuantJob, artifact: ArtifactView | None, request: PublishSpec | None,
                 remaining_s: float | None = None) -> JobView:
        end = job.finished_at or utcnow()
        elapsed = end - job.started_at if job.started_at is not None else timedelta(0)
        running = job.state == JobState.RUNNING
        return cls(
            job_id=job.id,
            state=job.state,
            stage=Stage(job.stage) if job.stage else None,
            block_index=job.block_index,
            block_count=job.block_count,
            elapsed=max(elapsed, timedelta(0)),
            remaining=timedelta(seconds=remaining_s) if running and remaining_s is not None else None,
            # A pending cancel shows who asked and why before the job has ended (CANCELLED keeps the same text).
            error=job.error or job.cancel_reason or "",
            artifact=artifact,
            request=request,
            created_at=job.created_at,
            model_name=job.model_name or (artifact.model_name if artifact is not None else ""),
            cancel_requested_at=job.cancel_requested_at,
        )

    def to_pb(self) -> quantizer_pb2.Job:
        job = quantizer_pb2.Job(
            job_id=self.job_id, state=_JOB_STATES[self.state],
            stage=self.stage.to_pb() if self.stage else quantizer_pb2.JOB_STAGE_UNSPECIFIED,
            block_index=self.block_index, block_count=self.block_count, error=self.error,
            elapsed=_duration(self.elapsed), created_at=_timestamp(self.created_at), model_name=self.model_name,
        )
        if self.cancel_requested_at is not None:
            job.cancel_requested_at.CopyFrom(_timestamp(self.cancel_requested_at))
        if self.remaining is not None:
            job.estimated_remaining.CopyFrom(_duration(self.remaining))
        if self.artifact is not None:
            job.artifact.CopyFrom(self.artifact.to_pb())
        if self.request is not None:
            job.request.CopyFrom(self.request.to_pb())
        return job


def _timestamp(at: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ts


def _duration(delta: timedelta) -> Duration:
    d = Duration()
    d.FromTimedelta(delta)
    return d


def _same(a: float, b: float) -> bool:
    """The same perplexity, as a manifest's JSON and the registry's float column each keep it."""
    return math.isclose(a, b, rel_tol=1e-9)

