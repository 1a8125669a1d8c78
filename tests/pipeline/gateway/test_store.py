"""The gateway's local store: every line, file name and metadata sealed with the client's key at rest, each
envelope bound to its place, records written without a temporary file."""

import pytest

from pipeline import keys
from pipeline.gateway.store import BatchRecord, GatewayStore, StoreError
from tests.e2e.canary import Canaries, Findings


@pytest.fixture
def store(tmp_path) -> GatewayStore:
    return GatewayStore(tmp_path / "gateway", keys.generate_identity())


def test_lines_round_trip_and_nothing_is_stored_in_clear(store, tmp_path):
    m = Canaries()
    lines = [m("line_a").encode(), b"", m("line_b").encode() + b"\r", b""]
    record = store.add_file("file-a", "batch", m("filename") + ".jsonl", lines, 99, 7)
    assert list(store.lines(record)) == lines and record.lines == 4
    assert store.filename(record) == m("filename") + ".jsonl"
    sealed = store.seal("metadata", "batch_a", 0, m("metadata").encode())
    store.put_batch(
        BatchRecord(
            id="batch_a",
            job_id="j",
            input_file_id="file-a",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            created_at=1,
            expires_at=2,
            sealed_metadata=sealed,
        )
    )
    assert (
        store.open("metadata", "batch_a", 0, store.batch("batch_a").sealed_metadata) == m("metadata").encode()
    )
    found = Findings(m)
    found.scan_tree(tmp_path, "store")
    assert not found.places, found.report()
    assert sorted(p.name for p in (tmp_path / "gateway" / "files").iterdir()) == [
        "file-a.json",
        "file-a.lines",
    ]
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "gateway" / "files").iterdir()} == {"0o600"}


def test_an_envelope_opens_only_in_its_place_and_with_its_key(store, tmp_path):
    sealed = store.seal("line", "file-a", 0, b"x")
    for place in (("line", "file-a", 1), ("line", "file-b", 0), ("filename", "file-a", 0)):
        with pytest.raises(StoreError):
            store.open(*place, sealed)
    other = GatewayStore(tmp_path / "other", keys.generate_identity())
    with pytest.raises(StoreError) as refused:
        other.open("line", "file-a", 0, sealed)
    assert "file-a" in str(refused.value)


def test_ids_that_could_name_another_path_find_nothing(store):
    store.add_file("file-a", "batch", "a", [b"x"], 1, 1)
    for bad in ("../gateway/files/file-a", "file-a/../file-a", "", "file-a.json"):
        assert store.file(bad) is None and store.batch(bad) is None and not store.delete_file(bad)
    assert store.delete_file("file-a") and store.file("file-a") is None and not store.delete_file("file-a")


def test_update_batch_is_all_or_nothing(store):
    store.put_batch(
        BatchRecord(
            id="batch_a",
            job_id="j",
            input_file_id="f",
            endpoint="e",
            completion_window="24h",
            created_at=1,
            expires_at=2,
        )
    )

    def boom(record):
        record.phase = "ended"
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        store.update_batch("batch_a", boom)
    assert store.batch("batch_a").phase == "validating"
    changed = store.update_batch("batch_a", lambda r: r.model_copy(update={"phase": "submitted"}))
    assert changed.phase == store.batch("batch_a").phase == "submitted"
    assert store.update_batch("batch_a", lambda r: None).phase == "submitted"
    assert not list((store.root / "batches").glob("*.part"))
