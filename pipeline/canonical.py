"""The one canonical JSON encoding that Enclave hashes and signs: manifests, audit rows and checkpoints,
result statements and signed API requests all go through `canonical_json`."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Deterministic UTF-8 JSON (sorted keys, no spaces) for signing and hashing; no NaN or infinity."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")
