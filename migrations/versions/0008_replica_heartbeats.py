"""``replica_heartbeats``: the serving replicas that share cluster-wide tenant limits
(``--tenant-limits-scope cluster``), each with the database time it last checked in.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replica_heartbeats",
        sa.Column("replica_id", sa.String(length=64), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("replica_id", name=op.f("pk_replica_heartbeats")),
    )
    op.create_index(op.f("ix_replica_heartbeats_last_seen"), "replica_heartbeats", ["last_seen"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_replica_heartbeats_last_seen"), table_name="replica_heartbeats")
    op.drop_table("replica_heartbeats")
