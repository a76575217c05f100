"""Initial registry schema: models, versions, artifacts, jobs, deployments, append-only events.

Revision ID: 0001
Revises:
Create Date: 2025-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)

_APPEND_ONLY_SQLITE = [
    "CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
    "BEGIN SELECT RAISE(ABORT, 'events are append-only: UPDATE is not allowed'); END",
    "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
    "BEGIN SELECT RAISE(ABORT, 'events are append-only: DELETE is not allowed'); END",
]
_APPEND_ONLY_POSTGRES = [
    "CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
    "BEGIN RAISE EXCEPTION 'events are append-only: % is not allowed', TG_OP; END $$",
    "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events "
    "FOR EACH ROW EXECUTE FUNCTION events_append_only()",
    "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
    "FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()",
]


def _state(name: str, values: tuple[str, ...]) -> sa.Column:
    return sa.Column(name, sa.Enum(*values, native_enum=False, create_constraint=False, length=16), nullable=False)


# The "ck" naming convention of models.Base (the target metadata) prefixes these names again: the
# CHECKs below are created as ck_<table>_ck_<table>_<name>, which is what models.py declares.
def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


ARTIFACT_STATES = ("PENDING", "READY", "FAILED")
JOB_STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED")


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_models"),
        sa.UniqueConstraint("name", name="uq_models_name"),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("model_id", sa.Integer, nullable=False),
        sa.Column("content_hash", sa.String(128), nullable=False),
        sa.Column("label", sa.String(128), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_versions"),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_model_versions_model_id_models"),
        sa.UniqueConstraint("model_id", "content_hash", name="uq_model_versions_model_id_content_hash"),
        sa.UniqueConstraint("model_id", "label", name="uq_model_versions_model_id_label"),
    )
    op.create_table(
        "artifacts",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("model_version_id", sa.Integer, nullable=False),
        sa.Column("format", sa.String(64), nullable=False),
        sa.Column("gpu", sa.String(64), nullable=False),
        _state("state", ARTIFACT_STATES),
        sa.Column("failure_reason", sa.Text, nullable=True),
        sa.Column("object_prefix", sa.String(512), nullable=False),
        sa.Column("manifest_sha256", sa.String(64), nullable=True),
        sa.Column("content_digest", sa.String(128), nullable=True),
        sa.Column("ppl_fp16", sa.Float, nullable=True),
        sa.Column("ppl_quant", sa.Float, nullable=True),
        sa.Column("eval_data", sa.String(256), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_artifacts"),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["model_versions.id"], name="fk_artifacts_model_version_id_model_versions"
        ),
        sa.UniqueConstraint("model_version_id", "format", "gpu", name="uq_artifacts_binding"),
        sa.CheckConstraint(_in("state", ARTIFACT_STATES), name="ck_artifacts_state"),
    )
    op.create_index("ix_artifacts_content_digest", "artifacts", ["content_digest"])
    op.create_table(
        "quant_jobs",
        sa.Column("id", sa.String(32), nullable=False),
        _state("state", JOB_STATES),
        sa.Column("stage", sa.String(64), nullable=True),
        sa.Column("block_index", sa.Integer, nullable=False),
        sa.Column("block_count", sa.Integer, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("artifact_id", sa.String(32), nullable=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("heartbeat_at", _TS, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("started_at", _TS, nullable=True),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_quant_jobs"),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"], name="fk_quant_jobs_artifact_id_artifacts"),
        sa.CheckConstraint(_in("state", JOB_STATES), name="ck_quant_jobs_state"),
        sa.CheckConstraint("block_index >= 0 AND block_index <= block_count", name="ck_quant_jobs_block_progress"),
    )
    op.create_index("ix_quant_jobs_state_owner", "quant_jobs", ["state", "owner"])
    op.create_table(
        "deployments",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("stable_artifact_id", sa.String(32), nullable=False),
        sa.Column("canary_artifact_id", sa.String(32), nullable=True),
        sa.Column("canary_percent", sa.Integer, nullable=False),
        sa.Column("baseline_artifact_id", sa.String(32), nullable=True),
        sa.Column("fallback", sa.Boolean, nullable=False),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_deployments"),
        sa.UniqueConstraint("name", name="uq_deployments_name"),
        sa.ForeignKeyConstraint(
            ["stable_artifact_id"], ["artifacts.id"], name="fk_deployments_stable_artifact_id_artifacts"
        ),
        sa.ForeignKeyConstraint(
            ["canary_artifact_id"], ["artifacts.id"], name="fk_deployments_canary_artifact_id_artifacts"
        ),
        sa.ForeignKeyConstraint(
            ["baseline_artifact_id"], ["artifacts.id"], name="fk_deployments_baseline_artifact_id_artifacts"
        ),
        sa.CheckConstraint("canary_percent >= 0 AND canary_percent <= 100", name="ck_deployments_canary_percent"),
        sa.CheckConstraint(
            "canary_artifact_id IS NOT NULL OR canary_percent = 0", name="ck_deployments_canary_needs_artifact"
        ),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("at", _TS, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("deployment_id", sa.Integer, nullable=True),
        sa.Column("artifact_id", sa.String(32), nullable=True),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"], name="fk_events_deployment_id_deployments"),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"], name="fk_events_artifact_id_artifacts"),
        sa.ForeignKeyConstraint(["job_id"], ["quant_jobs.id"], name="fk_events_job_id_quant_jobs"),
    )
    op.create_index("ix_events_at", "events", ["at"])
    op.create_index("ix_events_deployment_id", "events", ["deployment_id"])
    op.create_index("ix_events_artifact_id", "events", ["artifact_id"])
    dialect = op.get_bind().dialect.name
    for statement in _APPEND_ONLY_POSTGRES if dialect == "postgresql" else _APPEND_ONLY_SQLITE:
        op.execute(statement)


def downgrade() -> None:
    op.drop_table("events")  # takes its triggers with it
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION events_append_only()")
    for table in ("deployments", "quant_jobs", "artifacts", "model_versions", "models"):
        op.drop_table(table)
