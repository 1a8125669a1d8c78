"""The service API (`enclave serve`): a role on the allow-list (`clients.role`: `client`, or `admin`, who
manages clients and reads the audit log) and the nonces of signed requests seen within the timestamp window
(`request_nonces`), so that a replayed request is refused.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("clients", sa.Column("role", sa.String(16), nullable=False, server_default="client"))
    op.create_table(
        "request_nonces",
        sa.Column("nonce", sa.String(64), primary_key=True),
        sa.Column("client", sa.String(64), nullable=False),
        sa.Column("seen_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_request_nonces_seen_at", "request_nonces", ["seen_at"])


def downgrade() -> None:
    op.drop_index("ix_request_nonces_seen_at", "request_nonces")
    op.drop_table("request_nonces")
    with op.batch_alter_table("clients") as batch:
        batch.drop_column("role")
