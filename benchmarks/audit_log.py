"""Benchmark: what the audit log costs as it grows: appending events with a signed tree head every 100,
`verify` (chain, tree, every head), one inclusion proof, one consistency proof and a full export.

    python benchmarks/audit_log.py [--events 20000] [--database-url URL] [--json F]

Runs on the CPU, on SQLite in a temporary folder unless given a URL (an empty database). Prints one line per
step and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline import audit, audit_tree
from pipeline.audit_export import export
from pipeline.db import Database
from pipeline.models import Base

BATCH = 1000  # events per transaction


def run(db: Database, events: int) -> dict[str, float]:
    key = Ed25519PrivateKey.generate()

    def verify_signature(data: bytes, signature: bytes) -> bool:
        try:
            key.public_key().verify(signature, data)
        except InvalidSignature:
            return False
        return True

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    for first in range(0, events, BATCH):
        with db.transaction() as s:
            for i in range(first, min(first + BATCH, events)):
                details = {"n": i, "tokens": [i, 2 * i]}
                audit.append(s, actor="w", action=audit.DOCUMENT_DONE, job_id="j" * 36, details=details)
                if i % 100 == 99:
                    audit.checkpoint(s, sign=key.sign, key_fingerprint="f" * 64)
    seconds["append_and_sign"] = time.perf_counter() - start
    with db.transaction() as s:
        start = time.perf_counter()
        assert audit.verify(s, verify_signature=verify_signature).ok
        seconds["verify"] = time.perf_counter() - start
        head = audit_tree.require_head(s)
        start = time.perf_counter()
        audit_tree.inclusion_path(s, 7, head.tree_size)
        seconds["inclusion_proof"] = time.perf_counter() - start
        start = time.perf_counter()
        audit_tree.consistency_path(s, head.tree_size // 3, head.tree_size)
        seconds["consistency_proof"] = time.perf_counter() - start
        start = time.perf_counter()
        written = [0]
        export(s, lambda line: written.__setitem__(0, written[0] + len(line)), 0)
        seconds["export"] = time.perf_counter() - start
    seconds["export_mb"] = written[0] / 1e6
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--database-url", help="an empty database (default: SQLite in a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        db = Database(args.database_url or f"sqlite:///{folder}/audit.db")
        Base.metadata.create_all(db.engine)
        try:
            seconds = run(db, args.events)
        finally:
            db.dispose()
    for name, value in seconds.items():
        print(f"{name:20} {value:8.2f}")
    result = {
        "benchmark": "audit_log",
        "events": args.events,
        "database": "sqlite" if not args.database_url else args.database_url.split(":")[0],
        "seconds": seconds,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
