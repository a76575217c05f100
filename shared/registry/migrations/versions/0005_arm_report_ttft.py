"""Times to the first token in the gateway replicas' per-second arm reports, so that the automatic guard can hold
an arm to a TTFT budget over the whole fleet. Reports written before carry none (NULL: counted as no times).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("arm_reports") as batch:
        batch.add_column(sa.Column("ttft_counts", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("arm_reports") as batch:
        batch.drop_column("ttft_counts")
