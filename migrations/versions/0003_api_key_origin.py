"""API keys remember who manages them: ``origin`` is ``serve_flag`` for keys stored from
``loraplex serve --api-key`` (revoked at a later start that no longer lists them), NULL for keys
made through the admin API or the CLI (never touched by start-up).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable, no server default: every existing key is one of loraplex's own (NULL)
    with op.batch_alter_table("api_key") as batch:
        batch.add_column(sa.Column("origin", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_key") as batch:
        batch.drop_column("origin")
