"""`enclave submit`: the job id comes before the upload, a repeated submit with `--job-id` makes no second
job, and a file name that is not UTF-8 fails that file alone."""

import json
import os
import sys
import uuid

import pytest

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
