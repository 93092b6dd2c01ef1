"""Scoped API keys: hashed keys with an owner, a name and scopes; revoked keys are kept, marked.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIME = sa.DateTime(timezone=True)


def key(length: int) -> sa.String:
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "catalog_api_keys",
        sa.Column("id", ID, primary_key=True),
        sa.Column("key_id", key(32), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("owner", key(256), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("scopes", JSON, nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("revoked_at", TIME, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_api_keys"),
        sa.UniqueConstraint("key_id", name="uq_catalog_api_keys_key_id"),
    )
    op.create_index("ix_catalog_api_keys_owner_id", "catalog_api_keys", ["owner", "id"])


def downgrade() -> None:
    op.drop_table("catalog_api_keys")
