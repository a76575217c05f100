"""Cancelling quantization jobs: the CANCELLED state, the cancel request of a running job, and the
job's model name (so that jobs can be listed by model before their artifact exists).

Revision ID: 0002
Revises: 0001
Create Date: 2026-01-20
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The name 0001 gave the CHECK (see models._ck_name); op.f() keeps the naming convention off it.
STATE_CHECK = "ck_quant_jobs_ck_quant_jobs_state"
OLD_STATES = ("QUEUED", "RUNNING", "SUCCEEDED", "FAILED")
NEW_STATES = (*OLD_STATES, "CANCELLED")

# Jobs that got an artifact know their model through it; later jobs record it at creation.
_BACKFILL_MODEL_NAME = """
UPDATE quant_jobs SET model_name = (
    SELECT models.name FROM artifacts
    JOIN model_versions ON model_versions.id = artifacts.model_version_id
    JOIN models ON models.id = model_versions.model_id
    WHERE artifacts.id = quant_jobs.artifact_id)
WHERE artifact_id IS NOT NULL
"""


def _in(values: tuple[str, ...]) -> str:
    return f"state IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    # Batch mode: SQLite swaps a CHECK by rebuilding the table (PostgreSQL alters it in place).
    with op.batch_alter_table("quant_jobs") as batch:
        batch.add_column(sa.Column("model_name", sa.String(128), nullable=True))
        batch.add_column(sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("cancel_reason", sa.Text, nullable=True))
        batch.drop_constraint(op.f(STATE_CHECK), type_="check")
        batch.create_check_constraint(op.f(STATE_CHECK), _in(NEW_STATES))
    op.execute(_BACKFILL_MODEL_NAME)


def downgrade() -> None:
    # The old schema has no CANCELLED: such a job reads as the FAILED it would have been, its error kept.
    op.execute("UPDATE quant_jobs SET state = 'FAILED' WHERE state = 'CANCELLED'")
    with op.batch_alter_table("quant_jobs") as batch:
        batch.drop_constraint(op.f(STATE_CHECK), type_="check")
        batch.create_check_constraint(op.f(STATE_CHECK), _in(OLD_STATES))
        batch.drop_column("cancel_reason")
        batch.drop_column("cancel_requested_at")
        batch.drop_column("model_name")
