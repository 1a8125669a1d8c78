"""Job names and parameters leave the database's clear columns: `jobs.sealed_name` (the name sealed to the
submitter) and `jobs.sealed_params` (the parameters sealed to the service, their hash signed in the manifest,
version 2). `jobs.name` stays for jobs submitted before; new jobs store "" there.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("sealed_name", sa.LargeBinary(), nullable=True))
    op.add_column("jobs", sa.Column("sealed_params", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "sealed_params")
    op.drop_column("jobs", "sealed_name")
