"""ORM tables of the registry. The alembic migrations in migrations/versions are the schema of
record; tests/registry checks that these classes and the migrated schema do not drift apart."""

from __future__ import annotations

import enum
from datetime import datetime, timezone

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from shared.registry.errors import InvalidState

# Fixed names for every constraint so that migrations can address them on both backends.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

MAX_ACTOR = 128  # characters of an event's actor (who made the change: a token's name, a quantizer owner)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both backends (SQLite stores naive text and forgets the zone)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the registry stores timezone-aware UTC times")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class ArtifactState(str, enum.Enum):
    PENDING = "PENDING"
    READY = "READY"
    FAILED = "FAILED"


class JobState(str, enum.Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"  # an operator cancelled it (migration 0002)


def _state_type(enum_cls: type[enum.Enum]) -> sa.Enum:
    # Stored as VARCHAR plus a named CHECK (declared in __table_args__), never a native enum type,
    # so adding a state later is a plain constraint swap on both backends.
    return sa.Enum(enum_cls, native_enum=False, create_constraint=False, length=16)


def _in_check(column: str, enum_cls: type[enum.Enum]) -> str:
    return f"{column} IN ({', '.join(repr(m.value) for m in enum_cls)})"


def _ck_name(table: str, name: str) -> sa.sql.elements.conv:
    # The name migration 0001 gave the CHECK: it passed the full "ck_<table>_<name>" through the
    # "ck" convention above, which prefixed it again. Databases carry this name, so the models do too
    # (a later migration that swaps a CHECK must address it by it).
    return sa.sql.elements.conv(f"ck_{table}_ck_{table}_{name}")


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class Model(Base):
    __tablename__ = "models"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    versions: Mapped[list[ModelVersion]] = relationship(back_populates="model")


class ModelVersion(Base):
    """One source checkpoint of a model: `content_hash` identifies it, `label` is for humans."""

    __tablename__ = "model_versions"
    __table_args__ = (
        sa.UniqueConstraint("model_id", "content_hash"),
        sa.UniqueConstraint("model_id", "label"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(sa.ForeignKey("models.id"))
    content_hash: Mapped[str] = mapped_column(sa.String(128))
    label: Mapped[str] = mapped_column(sa.String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    model: Mapped[Model] = relationship(back_populates="versions", lazy="joined", innerjoin=True)


class Artifact(Base):
    """A quantized (or fp16 baseline) build of one model version, bound to a format and GPU target."""

    __tablename__ = "artifacts"
    __table_args__ = (
        sa.UniqueConstraint("model_version_id", "format", "gpu", name="uq_artifacts_binding"),
        sa.CheckConstraint(_in_check("state", ArtifactState), name=_ck_name("artifacts", "state")),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)  # uuid4 hex, known before insert
    model_version_id: Mapped[int] = mapped_column(sa.ForeignKey("model_versions.id"))
    format: Mapped[str] = mapped_column(sa.String(64))
    gpu: Mapped[str] = mapped_column(sa.String(64))
    state: Mapped[ArtifactState] = mapped_column(_state_type(ArtifactState))
    failure_reason: Mapped[str | None] = mapped_column(sa.Text)
    # `<model>/<model_version>/<format>/<gpu>/<artifact_id>/`, or the prefix of an identical READY artifact.
    object_prefix: Mapped[str] = mapped_column(sa.String(512))
    manifest_sha256: Mapped[str | None] = mapped_column(sa.String(64))
    content_digest: Mapped[str | None] = mapped_column(sa.String(128), index=True)
    ppl_fp16: Mapped[float | None] = mapped_column(sa.Float)
    ppl_quant: Mapped[float | None] = mapped_column(sa.Float)
    eval_data: Mapped[str | None] = mapped_column(sa.String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    # sha256 of its tokenizer's id -> token table (migration 0003; NULL for artifacts published before):
    # the arms of a deployment must agree on it, or token ids would mean other tokens on another arm.
    vocabulary_digest: Mapped[str | None] = mapped_column(sa.String(64))

    model_version: Mapped[ModelVersion] = relationship(lazy="joined", innerjoin=True)


class QuantJob(Base):
    """A quantization run. `owner` names the quantizer process (host, pid, boot id) that holds it;
    `heartbeat_at` is refreshed while that process lives (by the database's clock), so a restart can fail
    what a dead one left.
    A cancel of a RUNNING job is a request (`cancel_requested_at`, `cancel_reason`) that its owner acts
    on, since only the owner can stop its pipeline and clean up after it."""

    __tablename__ = "quant_jobs"
    __table_args__ = (
        sa.CheckConstraint(_in_check("state", JobState), name=_ck_name("quant_jobs", "state")),
        sa.CheckConstraint(
            "block_index >= 0 AND block_index <= block_count", name=_ck_name("quant_jobs", "block_progress")
        ),
        sa.Index("ix_quant_jobs_state_owner", "state", "owner"),
    )

    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)  # uuid4 hex
    state: Mapped[JobState] = mapped_column(_state_type(JobState))
    stage: Mapped[str | None] = mapped_column(sa.String(64))
    block_index: Mapped[int] = mapped_column(default=0)
    block_count: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(sa.Text)
    artifact_id: Mapped[str | None] = mapped_column(sa.ForeignKey("artifacts.id"))
    owner: Mapped[str] = mapped_column(sa.String(256))
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The model the job publishes, known before its artifact is (ListJobs filters on it across quantizers).
    # NULL only for jobs created before migration 0002 without an artifact.
    model_name: Mapped[str | None] = mapped_column(sa.String(128))
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancel_reason: Mapped[str | None] = mapped_column(sa.Text)  # "cancelled by <who>[: <why>]": the end error


class Deployment(Base):
    """What the gateway serves under one name: stable, an optional canary with its traffic share,
    the fp16 baseline, and the switch that sends everything to the baseline."""

    __tablename__ = "deployments"
    __table_args__ = (
        sa.CheckConstraint(
            "canary_percent >= 0 AND canary_percent <= 100", name=_ck_name("deployments", "canary_percent")
        ),
        sa.CheckConstraint(
            "canary_artifact_id IS NOT NULL OR canary_percent = 0",
            name=_ck_name("deployments", "canary_needs_artifact"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128), unique=True)
    stable_artifact_id: Mapped[str] = mapped_column(sa.ForeignKey("artifacts.id"))
    canary_artifact_id: Mapped[str | None] = mapped_column(sa.ForeignKey("artifacts.id"))
    canary_percent: Mapped[int] = mapped_column(default=0)
    baseline_artifact_id: Mapped[str | None] = mapped_column(sa.ForeignKey("artifacts.id"))
    fallback: Mapped[bool] = mapped_column(default=False)
    # Bumped on every change so that a watcher (the gateway) can tell it has the latest.
    revision: Mapped[int] = mapped_column(default=1)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class Event(Base):
    """Append-only log of every change. The API only inserts and reads; the ORM refuses to flush an
    update or delete (see events.py) and database triggers refuse them too (migration 0001)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(sa.String(32))
    deployment_id: Mapped[int | None] = mapped_column(sa.ForeignKey("deployments.id"), index=True)
    artifact_id: Mapped[str | None] = mapped_column(sa.ForeignKey("artifacts.id"), index=True)
    job_id: Mapped[str | None] = mapped_column(sa.ForeignKey("quant_jobs.id"))
    detail: Mapped[str] = mapped_column(sa.Text, default="{}")  # JSON object
    actor: Mapped[str] = mapped_column(sa.String(MAX_ACTOR))


@sa.event.listens_for(Event, "before_update")
def _refuse_event_update(mapper, connection, target: Event) -> None:
    raise InvalidState(f"event {target.id} is append-only: it cannot be updated, only new events appended")


@sa.event.listens_for(Event, "before_delete")
def _refuse_event_delete(mapper, connection, target: Event) -> None:
    raise InvalidState(f"event {target.id} is append-only: it cannot be deleted, only new events appended")


class ArmReport(Base):
    """What one gateway replica served for one arm (deployment, artifact) in one second of wall time, so that
    every replica's automatic guard can judge an arm on the whole fleet's traffic (arm_reports.py). Written
    once per (gateway, second) after the second ended; deleted after a while (migration 0004)."""

    __tablename__ = "arm_reports"
    __table_args__ = (sa.Index("ix_arm_reports_arm_second", "deployment", "artifact_id", "second"),)

    gateway_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)  # a replica's process, uuid4 hex
    deployment: Mapped[str] = mapped_column(sa.String(128), primary_key=True)  # its name
    artifact_id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    second: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)  # unix seconds, floor of the finish time
    requests: Mapped[int] = mapped_column(sa.Integer)
    errors: Mapped[int] = mapped_column(sa.Integer)  # failed on the serving side
    # JSON object: time per output token in tenths of a millisecond -> requests (those not failed).
    tpot_counts: Mapped[str] = mapped_column(sa.Text)
    # JSON object: time to the first token in milliseconds -> requests (those not failed with a first token);
    # NULL in reports written before migration 0005.
    ttft_counts: Mapped[str | None] = mapped_column(sa.Text)
