"""Per-tenant rate limits: max_requests_per_minute and max_tokens_per_minute (null: unlimited,
which every existing tenant keeps).

Plain ADD/DROP COLUMN, as in 0002: batch mode would rebuild the tenant table on SQLite, and
dropping it would cascade-delete every tenant's keys and adapters.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenant", sa.Column("max_requests_per_minute", sa.Integer(), nullable=True))
    op.add_column("tenant", sa.Column("max_tokens_per_minute", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("tenant", "max_tokens_per_minute")
    op.drop_column("tenant", "max_requests_per_minute")
