"""Resumable, lock-free submits: `jobs.upload_token`, set while a job is `uploading` to the token of the
submit that owns the upload (a resubmit with the same job id takes it over), cleared when the job is queued.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("upload_token", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "upload_token")
