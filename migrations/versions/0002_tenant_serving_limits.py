"""Per-tenant serving limits: max_concurrent_requests (null: the server's default) and
scheduling_weight (the tenant's share under the fair policy, 1 for every existing tenant).

Plain ADD/DROP COLUMN, not batch mode: on SQLite batch mode rebuilds the tenant table, and
dropping it would cascade-delete every tenant's keys and adapters (foreign keys are on).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenant", sa.Column("max_concurrent_requests", sa.Integer(), nullable=True))
    op.add_column(
        "tenant", sa.Column("scheduling_weight", sa.Float(), server_default=sa.text("1"), nullable=False)
    )


def downgrade() -> None:
    op.drop_column("tenant", "scheduling_weight")
    op.drop_column("tenant", "max_concurrent_requests")
