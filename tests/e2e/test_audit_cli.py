"""`enclave audit verify` through the CLI: 0 when intact, 1 naming the first bad row after tampering."""

import json

from sqlalchemy import text

from tests.e2e.conftest import NOTES


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
