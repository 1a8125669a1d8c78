"""`enclave submit FILE --records`: each row of a record export (CSV, JSONL, Parquet) is one document named by
its key, sealed like a file; a row that cannot be read fails alone at submit, and the rest run."""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq


def write_csv(path, rows, header=("id", "note")):
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)


def test_ten_thousand_rows_become_ten_thousand_documents_and_a_bad_row_fails_alone(embedded, tmp_path):
    path = tmp_path / "records.csv"
    rows = [(f"P{i:05d}", f"Patient {i} reports mild pain.") for i in range(10_000)]
    rows[4_321] = ("P04321", "a row with", "one field too many")
    write_csv(path, rows)
    got = embedded.json("submit", str(path), "--records", "--key", "id", "--kind", "summarize")
    assert got["documents"] == 10_000
    assert got["rejected"] == [
        {"document": "row 4322", "error": "invalid_record: row 4322: has 3 fields; the header has 2"}
    ]
    (status,) = [j for j in embedded.json("jobs") if j["job_id"] == got["job_id"]]
    assert (status["total"], status["failed"], status["pending"]) == (10_000, 1, 9_999)


def test_rows_run_as_documents_named_by_their_keys(embedded, tmp_path):
    path = tmp_path / "visits.jsonl"
    lines = [
        {"visit": "v-1", "note": "Fever for two days."},
        {"visit": "v-2", "note": "Cough, no fever."},
        ["not", "an", "object"],
        {"visit": "v-1", "note": "A repeated key."},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = embedded.json(
        "submit", str(path), "--records", "--key", "visit", "--kind", "summarize", "--param", "max_tokens=4"
    )["job_id"]
    embedded.work()
    out = tmp_path / "out"
    summary = embedded.json("results", job, "--out", str(out))
    assert (summary["done"], summary["failed"]) == (2, 2)
    records = {r["document"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert {k: r["status"] for k, r in records.items()} == {
        "v-1": "done",
        "v-2": "done",
        "row 3": "failed",
        "row 4": "failed",
    }
    assert records["row 3"]["error"] == "invalid_record: row 3: is array, not a JSON object"
    assert records["row 4"]["error"] == "invalid_record: row 4: the key repeats row 1's"


def test_parquet_rows_and_refusals_in_one_line(embedded, tmp_path):
    table = pa.table({"mrn": ["A1", "B2"], "note": ["Stable.", "Discharged home."]})
    pq.write_table(table, tmp_path / "export.parquet")
    got = embedded.json("submit", str(tmp_path / "export.parquet"), "--records", "--key", "mrn",
                        "--kind", "extract", "--param", "fields=diagnosis")  # fmt: skip
    assert (got["documents"], got["rejected"]) == (2, [])
    for args, needle in (
        (["--records", "--kind", "code-review"], "--records takes --kind summarize or extract"),
        (["--kind", "summarize", "--key", "mrn"], "--key and --records-format go with --records"),
    ):
        run = embedded.run("submit", str(tmp_path / "export.parquet"), *args, check=False)
        assert run.returncode != 0 and needle in run.stderr and len(run.stderr.strip().splitlines()) == 1
    (tmp_path / "notes.txt").write_text("id,note\n1,x\n")
    run = embedded.run("submit", str(tmp_path / "notes.txt"), "--records", "--kind", "summarize", check=False)
    assert run.returncode != 0 and "records must be one of csv, jsonl, parquet" in run.stderr
    empty = tmp_path / "empty.csv"
    empty.write_text("id,note\n")
    run = embedded.run("submit", str(empty), "--records", "--kind", "summarize", check=False)
    assert run.returncode != 0 and "empty.csv has no rows" in run.stderr
