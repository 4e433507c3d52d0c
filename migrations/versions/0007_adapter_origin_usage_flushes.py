"""Two robustness columns/tables, one revision:

* ``adapter.origin``: ``runtime_load`` for adapters created through vLLM's
  ``POST /v1/load_lora_adapter``, which tenant keys may replace and unload; NULL for the
  operator's (admin API, CLI, ``serve --lora-modules``), which those endpoints must not touch.
  Existing live adapters whose every live version was loaded by that endpoint (uploader
  ``load_lora_adapter``) are marked ``runtime_load``; every other adapter stays the operator's.
* ``usage_flushes``: the ids of usage batches already added to ``usage_hourly``, so a batch sent
  again after a commit whose acknowledgement was lost adds nothing.

Plain ADD/DROP COLUMN, as in 0006 (batch mode would rebuild ``adapter`` on SQLite).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

RUNTIME_ACTOR = "load_lora_adapter"  # AdapterVersion.uploader of runtime loads (runtime_lora_routes.LOAD_ACTOR)


def upgrade() -> None:
    op.add_column("adapter", sa.Column("origin", sa.String(length=16), nullable=True))
    op.execute(sa.text(
        "UPDATE adapter SET origin = 'runtime_load' WHERE deleted_at IS NULL"
        " AND EXISTS (SELECT 1 FROM adapter_version v WHERE v.adapter_id = adapter.id AND v.state = 'ready')"
        " AND NOT EXISTS (SELECT 1 FROM adapter_version v WHERE v.adapter_id = adapter.id"
        " AND v.state = 'ready' AND v.uploader <> :actor)"
    ).bindparams(actor=RUNTIME_ACTOR))
    op.create_table(
        "usage_flushes",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("flushed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("batch_id", name=op.f("pk_usage_flushes")),
    )
    op.create_index(op.f("ix_usage_flushes_flushed_at"), "usage_flushes", ["flushed_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_flushes_flushed_at"), table_name="usage_flushes")
    op.drop_table("usage_flushes")
    op.drop_column("adapter", "origin")
