"""Per-second reports of what each gateway replica served per arm, for a guard that judges the fleet.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "arm_reports",
        sa.Column("gateway_id", sa.String(32), nullable=False),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("artifact_id", sa.String(32), nullable=False),
        sa.Column("second", sa.BigInteger, nullable=False),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("errors", sa.Integer, nullable=False),
        sa.Column("tpot_counts", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("gateway_id", "deployment", "artifact_id", "second", name=op.f("pk_arm_reports")),
    )
    op.create_index("ix_arm_reports_arm_second", "arm_reports", ["deployment", "artifact_id", "second"])


def downgrade() -> None:
    op.drop_index("ix_arm_reports_arm_second", table_name="arm_reports")
    op.drop_table("arm_reports")
