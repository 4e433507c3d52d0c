"""Usage accounting: ``usage_hourly`` counts requests and tokens per tenant, adapter ('' for the
base model) and UTC hour, for billing. Names, not foreign keys: usage outlives what it counts.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COUNTERS = ("requests", "prompt_tokens", "completion_tokens",
            "failed_requests", "failed_prompt_tokens", "failed_completion_tokens")


def upgrade() -> None:
    op.create_table(
        "usage_hourly",
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("adapter", sa.String(length=63), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in COUNTERS),
        sa.PrimaryKeyConstraint("tenant", "adapter", "hour", name=op.f("pk_usage_hourly")),
    )
    op.create_index(op.f("ix_usage_hourly_hour"), "usage_hourly", ["hour"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_hourly_hour"), table_name="usage_hourly")
    op.drop_table("usage_hourly")
