"""The vocabulary digest of an artifact (sha256 of its tokenizer's id -> token table), so that a deployment's
arms can be checked to give token ids one meaning. Artifacts published before have none (NULL: not checked).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("vocabulary_digest", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("vocabulary_digest")
