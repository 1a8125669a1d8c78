"""Operations (issue 17): `workers` (each worker's heartbeat, state and counts: a gone worker's documents run
elsewhere within the heartbeat timeout, and `enclave workers` shows health), `broker_marker` (the marker a
broker that lost its messages no longer holds) and `jobs.purged_at` (`enclave purge`).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(64), nullable=True),
        sa.Column("queues", sa.String(200), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("engine_loaded", sa.Boolean(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False),
        sa.Column("errors", sa.Integer(), nullable=False),
        sa.Column("metrics_url", sa.String(200), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_workers_heartbeat_at", "workers", ["heartbeat_at"])
    op.create_table(
        "broker_marker",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("marker", sa.String(64), nullable=False),
        sa.Column("set_at", sa.DateTime(), nullable=False),
    )
    op.add_column("jobs", sa.Column("purged_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("purged_at")
    op.drop_table("broker_marker")
    op.drop_index("ix_workers_heartbeat_at", "workers")
    op.drop_table("workers")
