"""`enclave submit`: the job id comes before the upload, a repeated submit with `--job-id` makes no second
job, a file name that is not UTF-8 fails that file alone, and `--param key=@file` is read by the client."""

import json
import os
import sys
import uuid

import pytest
from sqlalchemy import text

from pipeline import envelope, keys
from tests.e2e.conftest import NOTES


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS refuses file names that are not UTF-8")
def test_submit_can_be_repeated_and_a_bad_name_fails_alone(embedded, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "note.txt").write_bytes((NOTES / "note-03-fracture.txt").read_bytes())
    (docs / os.fsdecode(b"bad-\xff.txt")).write_text("Patient is well.\n")
    args = ["submit", str(docs), "--kind", "summarize", "--param", "max_tokens=4"]

    first = embedded.run(*args)
    job = first.stdout.split()[0]
    lines = first.stderr.strip().splitlines()
    assert lines[0] == f"job {job}: uploading (if interrupted, submit again with --job-id {job})"
    assert (
        lines[1]
        == "2 documents, 1 refused at submit (e.g. the file name is not valid UTF-8; rename the file "
        "and submit it again)"
    )

    again = embedded.json(*args, "--job-id", job)
    assert (again["job_id"], again["existing"], again["documents"]) == (job, True, 2)
    assert [j["job_id"] for j in embedded.json("jobs")] == [job]

    bad_id = embedded.run(*args, "--job-id", "not-a-uuid", check=False)
    assert bad_id.returncode == 1 and "a job id must be a UUID" in bad_id.stderr
    chosen = str(uuid.uuid4())
    assert embedded.json(*args, "--job-id", chosen)["existing"] is False

    embedded.work()
    out = tmp_path / "out"
    summary = embedded.json("results", job, "--out", str(out))
    assert (summary["done"], summary["failed"]) == (1, 1)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["document"], r["status"]) for r in records] == [
        ("bad-\\xff.txt", "failed"),
        ("note.txt", "done"),
    ]
    assert records[0]["error"].startswith("the file name is not valid UTF-8")


def test_a_param_file_is_read_by_the_client_and_name_and_params_are_sealed(embedded, tmp_path):
    """`--param schema=@file` sends the file's text (the worker never reads a path); the job's name and its
    parameters reach the database sealed only, and the submitter's own commands open the name."""
    schema = {"type": "object", "properties": {"diagnosis": {"type": "string"}}, "required": ["diagnosis"]}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    note = NOTES / "note-03-fracture.txt"
    args = [str(note), "--kind", "extract", "--param", f"schema=@{schema_file}"]
    job = embedded.submit(*args, "--param", "max_tokens=8", "--name", "fracture notes")
    schema_file.unlink()  # gone before any worker runs: the job carries the schema itself

    db = embedded.database()
    with db.engine.connect() as c:
        name, sealed_name, manifest, sealed_params = c.execute(
            text("SELECT name, sealed_name, manifest, sealed_params FROM jobs WHERE id = :j"), {"j": job}
        ).one()
    db.dispose()
    manifest = json.loads(manifest)
    assert name == "" and b"fracture" not in bytes(sealed_name) and "params" not in manifest
    assert manifest["version"] == 2 and manifest["params_sha256"] == envelope.sha256_hex(bytes(sealed_params))
    service = keys.load_identity(embedded.home / "service")
    assert envelope.open_params(bytes(sealed_params), service, job)["schema"] == schema

    embedded.work()
    assert embedded.json("status", job)["name"] == "fracture notes"
    assert [j["name"] for j in embedded.json("jobs")] == ["fracture notes"]
    summary = embedded.json("results", job, "--out", str(tmp_path / "out"))
    assert (summary["name"], summary["done"] + summary["failed"]) == ("fracture notes", 1)

    missing = embedded.run("submit", *args[:3], "--param", "schema=@/nonexistent/schema.json", check=False)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "the file given for schema with @ cannot be read" in missing.stderr
