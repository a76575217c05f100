"""The SQL registry: models, versions, artifacts, quantization jobs, deployments and an append-only
event log. SQLite file by default, PostgreSQL by URL; alembic migrations ship in migrations/.

Repository functions take a Session and never commit: the caller owns the transaction
(`with registry.transaction() as session: ...`), so a change and its event commit together."""

from shared.registry.arm_reports import ArmSecond, ArmTotals, fleet_arm_totals, purge_arm_reports, write_arm_seconds
from shared.registry.artifacts import (
    Reservation,
    find_artifact,
    find_ready_by_digest,
    get_artifact,
    list_artifacts,
    mark_artifact_failed,
    mark_artifact_ready,
    object_prefix,
    prefix_served_by_another,
    reserve_artifact,
    retry_artifact,
)
from shared.registry.catalog import get_model_version, get_or_create_model, list_model_versions, register_model_version
from shared.registry.db import Registry, create_registry, make_engine, sqlite_url
from shared.registry.deployments import (
    abort_rollout,
    create_deployment,
    get_deployment,
    list_deployments,
    promote,
    set_baseline,
    set_canary_percent,
    set_fallback,
    start_rollout,
)
from shared.registry.errors import Conflict, InvalidState, InvalidValue, NotFound, RegistryError
from shared.registry.events import EventKind, EventRecord, append_event, last_rollout_event, list_events
from shared.registry.jobs import (
    cancel_job,
    cancel_requests,
    create_job,
    fail_job,
    fail_orphaned_jobs,
    finish_job,
    get_job,
    heartbeat,
    list_jobs,
    report_progress,
    start_job,
)
from shared.registry.migrate import current_revision, downgrade, head_revision, upgrade
from shared.registry.models import (
    Artifact,
    ArtifactState,
    Deployment,
    Event,
    JobState,
    Model,
    ModelVersion,
    QuantJob,
)

__all__ = [
    "ArmSecond", "ArmTotals", "fleet_arm_totals", "purge_arm_reports", "write_arm_seconds",
    "Artifact", "ArtifactState", "Conflict", "Deployment", "Event", "EventKind", "EventRecord", "InvalidState",
    "InvalidValue", "JobState", "Model", "ModelVersion", "NotFound", "QuantJob", "Registry", "RegistryError",
    "Reservation", "abort_rollout", "append_event", "cancel_job", "cancel_requests", "create_deployment", "create_job", "create_registry",
    "current_revision", "downgrade", "fail_job", "fail_orphaned_jobs", "find_artifact", "find_ready_by_digest", "prefix_served_by_another", "finish_job",
    "get_artifact", "get_deployment", "get_job", "get_model_version", "get_or_create_model", "head_revision",
    "heartbeat", "last_rollout_event", "list_artifacts", "list_deployments", "list_events", "list_jobs",
    "list_model_versions", "make_engine", "mark_artifact_failed", "mark_artifact_ready", "object_prefix", "promote",
    "register_model_version", "report_progress", "reserve_artifact", "retry_artifact", "set_baseline",
    "set_canary_percent", "set_fallback", "sqlite_url", "start_job", "start_rollout", "upgrade",
]
