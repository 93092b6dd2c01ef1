"""Initial catalog schema: policies, revisions, manifest entries, aliases, alias events, evals.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Types are spelled out here rather than imported from schema.py so that this migration keeps
meaning what it meant when it was written, whatever schema.py later becomes.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIME = sa.DateTime(timezone=True)


def key(length: int) -> sa.String:
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "catalog_policies",
        sa.Column("id", ID, primary_key=True),
        sa.Column("owner", key(256), nullable=False),
        sa.Column("name", key(128), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("lora_config", JSON, nullable=False),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_policies"),
        sa.UniqueConstraint("owner", "name", name="uq_catalog_policies_owner_name"),
    )
    op.create_table(
        "catalog_revisions",
        sa.Column("id", ID, primary_key=True),
        sa.Column("policy_id", ID, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("sha256", key(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("parent_id", ID, nullable=True),
        sa.Column("training_run", sa.String(256), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_revisions"),
        sa.ForeignKeyConstraint(
            ["policy_id"], ["catalog_policies.id"], name="fk_catalog_revisions_policy_id_catalog_policies"
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["catalog_revisions.id"], name="fk_catalog_revisions_parent_id_catalog_revisions"
        ),
        sa.UniqueConstraint("policy_id", "number", name="uq_catalog_revisions_policy_id_number"),
    )
    op.create_index("ix_catalog_revisions_policy_id_sha256", "catalog_revisions", ["policy_id", "sha256"])
    op.create_table(
        "catalog_manifest_entries",
        sa.Column("manifest_sha256", key(64), nullable=False),
        sa.Column("name", key(255), nullable=False),
        sa.Column("blob_sha256", key(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("manifest_sha256", "name", name="pk_catalog_manifest_entries"),
    )
    op.create_index("ix_catalog_manifest_entries_blob_sha256", "catalog_manifest_entries", ["blob_sha256"])
    op.create_table(
        "catalog_aliases",
        sa.Column("policy_id", ID, nullable=False),
        sa.Column("name", key(64), nullable=False),
        sa.Column("revision_id", ID, nullable=False),
        sa.Column("updated_at", TIME, nullable=False),
        sa.PrimaryKeyConstraint("policy_id", "name", name="pk_catalog_aliases"),
        sa.ForeignKeyConstraint(
            ["policy_id"], ["catalog_policies.id"], name="fk_catalog_aliases_policy_id_catalog_policies"
        ),
        sa.ForeignKeyConstraint(
            ["revision_id"], ["catalog_revisions.id"], name="fk_catalog_aliases_revision_id_catalog_revisions"
        ),
    )
    op.create_table(
        "catalog_alias_events",
        sa.Column("id", ID, primary_key=True),
        sa.Column("policy_id", ID, nullable=False),
        sa.Column("alias", key(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("from_revision_id", ID, nullable=True),
        sa.Column("to_revision_id", ID, nullable=False),
        sa.Column("actor", sa.String(256), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("at", TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_alias_events"),
        sa.ForeignKeyConstraint(
            ["policy_id"], ["catalog_policies.id"], name="fk_catalog_alias_events_policy_id_catalog_policies"
        ),
        sa.ForeignKeyConstraint(
            ["from_revision_id"],
            ["catalog_revisions.id"],
            name="fk_catalog_alias_events_from_revision_id_catalog_revisions",
        ),
        sa.ForeignKeyConstraint(
            ["to_revision_id"],
            ["catalog_revisions.id"],
            name="fk_catalog_alias_events_to_revision_id_catalog_revisions",
        ),
    )
    op.create_index(
        "ix_catalog_alias_events_policy_id_alias_id", "catalog_alias_events", ["policy_id", "alias", "id"]
    )
    op.create_table(
        "catalog_evals",
        sa.Column("id", ID, primary_key=True),
        sa.Column("revision_id", ID, nullable=False),
        sa.Column("metric", sa.String(128), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("dataset", sa.String(256), nullable=True),
        sa.Column("created_at", TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_evals"),
        sa.ForeignKeyConstraint(
            ["revision_id"], ["catalog_revisions.id"], name="fk_catalog_evals_revision_id_catalog_revisions"
        ),
    )
    op.create_index("ix_catalog_evals_revision_id_id", "catalog_evals", ["revision_id", "id"])


def downgrade() -> None:
    for table in (
        "catalog_evals",
        "catalog_alias_events",
        "catalog_aliases",
        "catalog_manifest_entries",
        "catalog_revisions",
        "catalog_policies",
    ):
        op.drop_table(table)
