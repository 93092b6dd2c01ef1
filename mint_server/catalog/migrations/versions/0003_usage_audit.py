"""Usage by tenant and hour (what the billing usage routes sum) and the audit log.

Revision ID: 0003
Revises: 0002
Create Date: 2027-01-10
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIME = sa.DateTime(timezone=True)


def key(length: int) -> sa.String:
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "catalog_usage",
        sa.Column("id", ID, primary_key=True),
        sa.Column("owner", key(256), nullable=False),
        sa.Column("bucket_start", TIME, nullable=False),
        sa.Column("kind", key(32), nullable=False),
        sa.Column("session_id", key(64), nullable=False),
        sa.Column("project_id", key(128), nullable=False),
        sa.Column("base_model", key(512), nullable=False),
        sa.Column("quantity", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_usage"),
        sa.UniqueConstraint("owner", "bucket_start", "kind", "session_id", "project_id", "base_model",
                            name="uq_catalog_usage_bucket"),
    )
    op.create_table(
        "catalog_audit_events",
        sa.Column("id", ID, primary_key=True),
        sa.Column("owner", key(256), nullable=False),
        sa.Column("at", TIME, nullable=False),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("details", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_audit_events"),
    )
    op.create_index("ix_catalog_audit_events_owner_at", "catalog_audit_events", ["owner", "at"])


def downgrade() -> None:
    op.drop_table("catalog_audit_events")
    op.drop_table("catalog_usage")
