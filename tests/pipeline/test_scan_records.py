"""The client's scan records: sealed to its own key in the home, opened only by it and only as their job's."""

import stat
import uuid

from jobs.scan_record import GIT_WORKING_TREE, ScanRecord, ScanSource
from pipeline import scan_records
from pipeline.keys import generate_identity

MARKER = "scan-record-marker-7f3a"


def record() -> ScanRecord:
    source = ScanSource(repository=f"{MARKER}-repo", method=GIT_WORKING_TREE, commit="b" * 40)
    return ScanRecord(
        sources=[source], skipped=[(f"{MARKER}/uv.lock", "lockfile"), ("bad\udcff.py", "binary")]
    )


def test_saved_sealed_and_loaded_back(tmp_path):
    identity, job = generate_identity(), str(uuid.uuid4())
    path = scan_records.save(tmp_path, identity, job, record())
    assert path == tmp_path / "scans" / f"{job}.scan"
    assert MARKER.encode() not in path.read_bytes()  # sealed: no file name in clear
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    loaded = scan_records.load(tmp_path, identity, job)
    assert loaded.sources == record().sources
    assert loaded.skipped == [
        (f"{MARKER}/uv.lock", "lockfile"),
        ("bad\\xff.py", "binary"),
    ]  # as documents are named
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging file left behind


def test_missing_foreign_or_moved_records_are_none(tmp_path):
    identity, job, other_job = generate_identity(), str(uuid.uuid4()), str(uuid.uuid4())
    assert scan_records.load(tmp_path, identity, job) is None
    path = scan_records.save(tmp_path, identity, job, record())
    assert scan_records.load(tmp_path, generate_identity(), job) is None  # another client's key
    path.rename(path.with_name(f"{other_job}.scan"))
    assert scan_records.load(tmp_path, identity, other_job) is None  # bound to its own job
    path.write_bytes(b"not sealed")
    assert scan_records.load(tmp_path, identity, job) is None
