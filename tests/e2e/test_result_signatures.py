"""Service-signed results: a result row that the service did not write (re-sealed by an attacker to the
client's key, copied from another document, or unsigned) is refused by `enclave results`, by name, while the
other documents are still written."""

import json

from sqlalchemy import text

from pipeline import envelope, keys
from tests.e2e.conftest import NOTES

NAMES = [
    "note-01-chest-pain.txt",
    "note-02-pneumonia.txt",
    "note-03-fracture.txt",
    "note-04-diabetes-review.txt",
]
FORGED = "HIV negative, discharge today"


def rows(db, job):
    with db.engine.connect() as c:
        found = c.execute(
            text(
                'SELECT d."index", d.id, r.sealed, r.signature FROM documents d '
                "JOIN results r ON r.document_id = d.id WHERE d.job_id = :j"
            ),
            {"j": job},
        ).all()
    return {index: (doc_id, bytes(sealed), bytes(signature)) for index, doc_id, sealed, signature in found}


def test_forged_swapped_and_unsigned_results_are_refused_by_name(embedded, tmp_path):
    job = embedded.submit(*(str(NOTES / n) for n in NAMES), "--kind", "summarize", "--param", "max_tokens=8")
    embedded.work()
    out = tmp_path / "genuine"
    assert embedded.json("results", job, "--out", str(out))["refused"] == 0

    client_public = keys.load_public(embedded.home / "client")
    db = embedded.database()
    before = rows(db, job)
    assert sorted(before) == [0, 1, 2, 3]
    forged_id, _, kept_signature = before[0]
    record = {"status": "done", "output": FORGED, "error": None, "raw": None, "usage": None}
    resealed = envelope.seal_result(json.dumps(record).encode(), client_public.x25519, job, forged_id)
    with db.engine.begin() as c:
        update = "UPDATE results SET sealed = :s, signature = :g WHERE document_id = :d"
        # 0: an attacker's result sealed to the client's public key, under the genuine signature
        c.execute(text(update), {"s": resealed, "g": kept_signature, "d": forged_id})
        # 1: document 2's valid row copied in (it does not even open under document 1's binding)
        c.execute(text(update), {"s": before[2][1], "g": before[2][2], "d": before[1][0]})
        # 2: no signature
        c.execute(text("UPDATE results SET signature = NULL WHERE document_id = :d"), {"d": before[2][0]})
    db.dispose()

    out = tmp_path / "tampered"
    proc = embedded.run("results", job, "--out", str(out), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error: 3 of 4 results refused")
    for index in (0, 1, 2):
        assert f"document {index} ('{NAMES[index]}')" in line
    written = {r["document"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert [written[n]["status"] for n in NAMES] == ["refused", "refused", "refused", "done"]
    assert "signature does not verify" in written[NAMES[0]]["error"]
    assert "signature does not verify" in written[NAMES[1]]["error"]
    assert "not signed by the service" in written[NAMES[2]]["error"]
    assert written[NAMES[3]]["output"]  # the genuine document is still written
    assert FORGED not in (out / "results.jsonl").read_text()


def test_a_failed_document_is_signed_too_and_its_status_cannot_be_flipped(embedded, tmp_path):
    latin1 = str(NOTES / "note-06-latin1-export.txt")
    job = embedded.submit(latin1, str(NOTES / NAMES[0]), "--kind", "summarize", "--param", "max_tokens=8")
    embedded.work()
    db = embedded.database()
    with db.engine.begin() as c:
        c.execute(
            text("UPDATE documents SET status = 'done' WHERE job_id = :j AND status = 'failed'"), {"j": job}
        )
    db.dispose()
    out = tmp_path / "out"
    proc = embedded.run("results", job, "--out", str(out), check=False)
    assert proc.returncode != 0
    assert "1 of 2 results refused" in proc.stderr and "note-06-latin1-export.txt" in proc.stderr
    written = {r["document"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert written["note-06-latin1-export.txt"]["status"] == "refused"
    assert written[NAMES[0]]["status"] == "done"
