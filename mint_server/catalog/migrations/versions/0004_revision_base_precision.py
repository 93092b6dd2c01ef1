"""A revision records the precision of the base its adapter was trained on (serving warns on another).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable: revisions published before, and imported adapters, have no known base precision.
    op.add_column("catalog_revisions", sa.Column("base_precision", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("catalog_revisions") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("base_precision")
