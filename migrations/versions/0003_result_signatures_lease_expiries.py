"""Service-signed results and crash counting: `results.signature` (the service's Ed25519 signature over the
job, document, sealed-result hash and status) and `documents.lease_expiries` (leases that expired without a
result: worker crashes, counted apart from the document's own failed `attempts`).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("documents", sa.Column("lease_expiries", sa.Integer(), nullable=False, server_default="0"))
    # Nullable: rows written before this revision have none, and the client refuses them as unsigned.
    op.add_column("results", sa.Column("signature", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column("results", "signature")
    op.drop_column("documents", "lease_expiries")
