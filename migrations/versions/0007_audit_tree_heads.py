"""Signed tree heads of the audit log (RFC 9162 style): each checkpoint also records the Merkle root of the
events it covers (`audit_checkpoints.root_hash`, signed with the size, the chain's head hash and the time)
and the tree's compact range (`tree_state`: the perfect subtrees' hashes, so the next head extends the tree
without rereading the log). Checkpoints from before this revision keep both empty and their old signature.
An index on `audit_events.at` serves `enclave audit log --since/--until`. The audit tables stay
append-only: adding columns and an index fires no row trigger.

Downgrading is refused once a tree head is signed: the older code would take its signature for a forgery.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_checkpoints", sa.Column("root_hash", sa.String(64), nullable=True))
    op.add_column("audit_checkpoints", sa.Column("tree_state", sa.Text(), nullable=True))
    op.create_index("ix_audit_events_at", "audit_events", ["at"])


def downgrade() -> None:
    signed = (
        op.get_bind()
        .execute(sa.text("SELECT COUNT(*) FROM audit_checkpoints WHERE root_hash IS NOT NULL"))
        .scalar_one()
    )
    if signed:
        raise RuntimeError(
            f"refusing to downgrade below 0007: {signed} signed tree heads of the audit log would lose their "
            "roots, and `enclave audit verify` of older code would report them as forged"
        )
    op.drop_index("ix_audit_events_at", "audit_events")
    op.drop_column("audit_checkpoints", "tree_state")
    op.drop_column("audit_checkpoints", "root_hash")
