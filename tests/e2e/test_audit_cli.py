"""The audit commands through the CLI: `verify` is 0 when intact and 1 naming the first bad row after
tampering, and with `--against` the heads kept on a write-once mount it names the rows of a rollback;
`head`, `prove`, `consistency` and `export` give proofs that check out with the service's key alone."""

import json
from pathlib import Path

from sqlalchemy import text

from pipeline import keys, merkle
from pipeline.audit_heads import SignedHead
from tests.e2e.conftest import NOTES
from tests.pipeline.test_merkle import mth


def disable_guards(conn, postgresql: bool) -> None:
    """What an attacker with full database rights does first: drop the append-only triggers."""
    if postgresql:
        conn.execute(text("ALTER TABLE audit_events DISABLE TRIGGER USER"))
    else:
        for name in ("audit_events_no_update", "audit_events_no_delete"):
            conn.execute(text(f"DROP TRIGGER {name}"))


def test_verify_names_the_edited_and_the_deleted_row(enclave):
    enclave.submit(str(NOTES / "note-01-chest-pain.txt"), "--kind", "summarize", "--param", "max_tokens=8")
    enclave.work()
    assert enclave.json("audit", "verify")["ok"] is True
    db = enclave.database()
    with db.engine.begin() as c:
        disable_guards(c, db.is_postgresql)
        c.execute(text("UPDATE audit_events SET outcome = 'error' WHERE seq = 3"))
    proc = enclave.run("audit", "verify", check=False)
    assert proc.returncode == 1 and "first bad row 3" in proc.stderr
    with db.engine.begin() as c:
        c.execute(text("UPDATE audit_events SET outcome = 'ok' WHERE seq = 3"))
        c.execute(text("DELETE FROM audit_events WHERE seq = 2"))
    proc = enclave.run("audit", "verify", "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["first_bad_seq"] == 2 and not report["ok"]
    db.dispose()


def test_the_trigger_refuses_updates_through_the_application_role(enclave):
    db = enclave.database()
    with db.engine.connect() as c:
        try:
            c.execute(text("UPDATE audit_events SET actor = 'mallory'"))
            c.commit()
            refused = False
        except Exception as exc:
            refused = "append-only" in str(exc)
    db.dispose()
    assert refused


def _one_line_failure(proc) -> str:
    """A failing command: exit 1, one line on stderr, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def _heads(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_rolled_back_database_fails_against_the_heads_kept_outside(enclave, tmp_path):
    """Issue 17, acceptance 6. Everything the rollback leaves is valid: `audit verify` alone passes once the
    home is rolled back with the database (a host restored from its backup), and `--against` the heads file
    on the write-once mount names the missing rows. Proofs check out, and fail for tampered inputs."""
    worm = tmp_path / "worm" / "heads.jsonl"
    worm.parent.mkdir()
    enclave.env.update(ENCLAVE_AUDIT_HEADS_FILE=str(worm), ENCLAVE_CHECKPOINT_EVERY="2")
    local = enclave.home / "service" / "audit_heads.jsonl"
    notes = [str(NOTES / name) for name in ("note-01-chest-pain.txt", "note-02-pneumonia.txt")]
    enclave.submit(*notes, "--kind", "summarize", "--param", "max_tokens=4")
    enclave.work()
    assert enclave.json("audit", "verify")["ok"] is True
    early = tmp_path / "early-head.json"
    early.write_text(enclave.run("audit", "head", "--json").stdout)
    kept_size = json.loads(early.read_text())["tree_size"]
    home_backup = local.read_text()  # the home as a backup holds it, with the database at this head

    for name in ("bob", "carol"):  # later events (allow-list changes), each signed by `init` as it stands
        keys.save_public(keys.generate_identity().public, tmp_path / name)
        enclave.run("clients", "add", name, str(tmp_path / name / "public.json"))
        enclave.run("init", "--no-model")
    late = tmp_path / "late-head.json"
    late.write_text(enclave.run("audit", "head", "--json").stdout)
    signed_size = json.loads(late.read_text())["tree_size"]
    assert signed_size > kept_size and _heads(worm)[-1]["tree_size"] == signed_size
    assert "the log only grew" in enclave.run("audit", "consistency", str(early)).stdout
    proof = enclave.json("audit", "prove", "--event", "3")
    assert proof["event"]["seq"] == 3 and proof["head"]["tree_size"] == signed_size and proof["path"]

    tampered = tmp_path / "tampered-head.json"
    tampered.write_text(json.dumps(json.loads(early.read_text()) | {"root_hash": "00" * 32}))
    assert "valid signature" in _one_line_failure(
        enclave.run("audit", "consistency", str(tampered), check=False)
    )

    db = enclave.database()
    with db.engine.begin() as c:
        disable_guards(c, db.is_postgresql)
        if db.is_postgresql:
            c.execute(text("ALTER TABLE audit_checkpoints DISABLE TRIGGER USER"))
        else:
            c.execute(text("DROP TRIGGER audit_checkpoints_no_delete"))
        c.execute(text("DELETE FROM audit_events WHERE seq > :n"), {"n": kept_size})
        c.execute(text("DELETE FROM audit_checkpoints WHERE size > :n"), {"n": kept_size})
    db.dispose()
    missing = f"rows {kept_size + 1}..{signed_size} are missing"

    # The home still holds the later heads: `audit verify` alone names the rows.
    assert missing in _one_line_failure(enclave.run("audit", "verify", check=False))
    # The home rolled back too: everything left is valid, and only the write-once file tells.
    local.write_text(home_backup)
    assert enclave.json("audit", "verify")["ok"] is True
    line = _one_line_failure(enclave.run("audit", "verify", "--against", str(worm), check=False))
    assert missing in line and str(worm) in line and "first bad row" in line
    report = json.loads(enclave.run("audit", "verify", "--against", str(worm), "--json", check=False).stdout)
    assert report["ok"] is False and report["first_bad_seq"] == kept_size + 1
    # A client who kept the later head sees the rollback too.
    assert missing in _one_line_failure(enclave.run("audit", "consistency", str(late), check=False))


def test_export_lines_prove_each_event_with_the_service_key(embedded, tmp_path):
    """`audit export`: a SIEM recomputes every leaf from the exported event, checks each inclusion proof and
    the head's signature, and the tree of all exported events has the signed root (brute force here)."""
    embedded.env["ENCLAVE_CHECKPOINT_EVERY"] = "3"
    embedded.submit(str(NOTES / "note-01-chest-pain.txt"), "--kind", "summarize", "--param", "max_tokens=4")
    embedded.work()
    out = tmp_path / "audit.jsonl"
    embedded.run("audit", "export", "--out", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    head = SignedHead.from_json(lines[0]["head"], "line 1")
    service = keys.load_public(embedded.home / "service")
    assert lines[0]["type"] == "tree_head" and head.signed_by(
        lambda d, s: keys.verify_signature(service, d, s)
    )
    events = [line for line in lines[1:] if line["type"] == "event"]
    assert [e["event"]["seq"] for e in events] == list(range(1, head.tree_size + 1))
    leaves = [
        json.dumps(e["event"], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        for e in events
    ]
    assert mth(leaves).hex() == head.root_hash
    root = bytes.fromhex(head.root_hash)
    for e, data in zip(events, leaves, strict=True):
        path = [bytes.fromhex(p) for p in e["path"]]
        leaf = merkle.leaf_hash(data)
        assert merkle.verify_inclusion(e["leaf_index"], head.tree_size, leaf, path, root)
        assert not merkle.verify_inclusion(
            e["leaf_index"], head.tree_size, merkle.leaf_hash(data + b" "), path, root
        )
    following = tmp_path / "next.jsonl"
    embedded.run("audit", "export", "--out", str(following), "--after", str(head.tree_size - 2))
    again = [json.loads(line) for line in following.read_text().splitlines()]
    assert [x["type"] for x in again] == ["tree_head", "consistency", "event", "event"]
    proc = embedded.run("audit", "export", "--after", str(head.tree_size + 50), check=False)
    assert "beyond the latest signed head" in _one_line_failure(proc)
