"""Reasons stored in clear (`documents.error`, `jobs.error`, audit details) are clipped to `MAX_REASON`
characters, so the audit log's length rule can never refuse the event of a failing document; what goes in
them must be content-free already (codes, JSON paths, offsets, sizes, counts)."""

from __future__ import annotations

MAX_REASON = 160  # well under audit.MAX_STRING, with room for a prefix


def bounded(reason: str | None, limit: int = MAX_REASON) -> str | None:
    """`reason` clipped to `limit` characters (an ellipsis marks the cut)."""
    if reason is None or len(reason) <= limit:
        return reason
    return reason[: limit - 3] + "..."
