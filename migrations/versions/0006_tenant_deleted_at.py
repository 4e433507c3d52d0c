"""Tenant offboarding: tenant.deleted_at (null: live, which every existing tenant stays).

A deleted tenant stays as a tombstone row so its name is never reused (usage rows are kept by
name for billing; see loraplex/registry/tenant_delete.py). Plain ADD/DROP COLUMN, as in 0002 and
0005: batch mode would rebuild the tenant table on SQLite, and dropping it would cascade-delete
every tenant's keys and adapters. A downgrade drops the column, so a deleted tenant's name lists
again (with its keys revoked and its adapters deleted).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenant", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("tenant", "deleted_at")
