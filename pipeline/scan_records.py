"""The client's scan records (`$ENCLAVE_HOME/scans/<job id>.scan`): what the scan of a code-review job found
(`jobs.scan_record`: repository, commit, skipped files), kept by the client that submitted the job so that
`enclave results` can write them into report.md and report.sarif.

A record names files, so it is sealed to the client's own X25519 key (HPKE, the suite of
`pipeline.envelope`, bound through `info` to `enclave-scan/1` and the job id: it opens as no other job's),
written beside its final name and renamed over it, 0600 in a 0700 folder. Results opened in another home
have no record: the report says so.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from cryptography.exceptions import InvalidTag

from jobs.scan_record import ScanRecord
from pipeline.envelope import SUITE
from pipeline.keys import Identity

FORMAT = "enclave-scan/1"


def save(home: Path, identity: Identity, job_id: str, record: ScanRecord) -> Path:
    """Seal `record` to `identity` and store it as job `job_id`'s (replacing an earlier one)."""
    path = _path(home, job_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    public = identity.x25519_private.public_key()
    sealed = SUITE.encrypt(record.to_json(), public, info=_info(job_id))
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(sealed)
    os.replace(staging, path)
    return path


def load(home: Path, identity: Identity, job_id: str) -> ScanRecord | None:
    """Job `job_id`'s record, or None when this home has none, or one that does not open with `identity`
    or is not a record (the report then says that what was skipped is unknown)."""
    try:
        sealed = _path(home, job_id).read_bytes()
    except OSError:
        return None
    try:
        return ScanRecord.from_json(SUITE.decrypt(sealed, identity.x25519_private, info=_info(job_id)))
    except (InvalidTag, ValueError):  # altered, another key's, or not a record: no usable record
        return None


def _path(home: Path, job_id: str) -> Path:
    return home / "scans" / f"{uuid.UUID(job_id)}.scan"  # a UUID: never a path of its own


def _info(job_id: str) -> bytes:
    return f"{FORMAT}\0{uuid.UUID(job_id)}".encode()
