"""Initial registry schema: tenants, API keys, adapters, versions, audit events, registry state.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenant")),
        sa.UniqueConstraint("name", name=op.f("uq_tenant_name")),
    )
    op.create_table(
        "api_key",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_api_key_tenant_id_tenant"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_key")),
        sa.UniqueConstraint("secret_sha256", name=op.f("uq_api_key_secret_sha256")),
    )
    op.create_index(op.f("ix_api_key_tenant_id"), "api_key", ["tenant_id"], unique=False)
    op.create_table(
        "adapter",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("active_version", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_adapter_tenant_id_tenant"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_adapter_tenant_id_name")),
    )
    op.create_table(
        "adapter_version",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.String(length=255), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("blob_key", sa.String(length=512), nullable=False),
        sa.Column("uploader", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapter.id"], name=op.f("fk_adapter_version_adapter_id_adapter"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_version")),
        sa.UniqueConstraint("adapter_id", "number", name=op.f("uq_adapter_version_adapter_id_number")),
    )
    op.create_index(
        op.f("ix_adapter_version_adapter_id_sha256"), "adapter_version", ["adapter_id", "sha256"], unique=False
    )
    op.create_index(op.f("ix_adapter_version_blob_key"), "adapter_version", ["blob_key"], unique=False)
    op.create_table(
        "audit_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("object_type", sa.String(length=32), nullable=False),
        sa.Column("object_name", sa.String(length=255), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_event")),
    )
    op.create_index(op.f("ix_audit_event_tenant_id"), "audit_event", ["tenant", "id"], unique=False)
    registry_state = op.create_table(
        "registry_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("change_counter", sa.BigInteger(), nullable=False),
        sa.Column("admin_key_sha256", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_registry_state")),
    )
    # the single state row every process bumps/reads (REGISTRY_STATE_ID in models.py)
    op.bulk_insert(registry_state, [{"id": 1, "change_counter": 0, "admin_key_sha256": None}])


def downgrade() -> None:
    op.drop_table("registry_state")
    op.drop_index(op.f("ix_audit_event_tenant_id"), table_name="audit_event")
    op.drop_table("audit_event")
    op.drop_index(op.f("ix_adapter_version_blob_key"), table_name="adapter_version")
    op.drop_index(op.f("ix_adapter_version_adapter_id_sha256"), table_name="adapter_version")
    op.drop_table("adapter_version")
    op.drop_table("adapter")
    op.drop_index(op.f("ix_api_key_tenant_id"), table_name="api_key")
    op.drop_table("api_key")
    op.drop_table("tenant")
