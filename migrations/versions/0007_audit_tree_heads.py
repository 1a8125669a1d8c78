"""Signed tree heads of the audit log (RFC 9162 style): each checkpoint also records the Merkle root of the
events it covers (`audit_checkpoints.root_hash`, signed with the size, the chain's head hash and the time)
and the tree's compact range (`tree_state`: the perfect subtrees' hashes, so the next head extends the tree
without rereading the log). Checkpoints from before this revision keep both empty and their old signature.
An index on `audit_events.at` serves `enclave audit log --since/--until`. The audit tables stay
append-only: adding columns and an index fires no row trigger.

Downgrading drops the index and keeps both columns, with their values: the audit tables are append-only,
across migrations too, and older code ignores the columns (its `audit verify` reads a tree head's signature
as a forgery until the database is upgraded again). Upgrading again finds them in place.

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
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("audit_checkpoints")}
    if "root_hash" not in present:  # absent unless a downgrade below 0007 kept them
        op.add_column("audit_checkpoints", sa.Column("root_hash", sa.String(64), nullable=True))
    if "tree_state" not in present:
        op.add_column("audit_checkpoints", sa.Column("tree_state", sa.Text(), nullable=True))
    op.create_index("ix_audit_events_at", "audit_events", ["at"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_at", "audit_events")
