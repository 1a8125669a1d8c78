"""Records as documents (issue 16, acceptance 6): one document per row with its key; a bad row fails alone."""

from __future__ import annotations

import csv
import json

import pytest

from jobs.records import RecordsError, read_records


def test_ten_thousand_csv_rows_become_ten_thousand_documents_and_a_bad_row_fails_alone(tmp_path):
    path = tmp_path / "records.csv"
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["patient_id", "note", "age"])
        for i in range(10_000):
            if i == 4321:
                writer.writerow([f"P{i:05d}", "too", "many", "fields"])
            else:
                writer.writerow([f"P{i:05d}", f"chest pain, line one\nline two {i}", 40 + i % 50])
    records = list(read_records(path, key="patient_id"))
    assert len(records) == 10_000
    bad = [r for r in records if r.error]
    assert [(r.key, r.error) for r in bad] == [("row 4322", "row 4322: has 4 fields; the header has 3")]
    good = [r for r in records if not r.error]
    assert [r.key for r in good] == [f"P{i:05d}" for i in range(10_000) if i != 4321]
    assert good[7].data == b"patient_id: P00007\nnote: chest pain, line one\nline two 7\nage: 47\n"
    assert len({r.key for r in records}) == 10_000


def test_rows_are_numbered_without_a_key_and_keys_must_be_present_and_unique(tmp_path):
    path = tmp_path / "r.csv"
    path.write_bytes(b"\xef\xbb\xbfid,text\na,one\n,two\na,three\nb,\xff\xfe bad bytes\n")
    assert [(r.key, r.error) for r in read_records(path)][:2] == [("row 1", None), ("row 2", None)]
    assert [(r.key, r.error) for r in read_records(path, key="id")] == [
        ("a", None),
        ("row 2", "row 2: the key column is missing or empty"),
        ("row 3", "row 3: the key repeats row 1's"),
        ("row 4", "row 4: field 2 is not valid UTF-8"),
    ]


def test_jsonl_lines_fail_alone(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps({"id": "x1", "n": 1}), "{not json", "[1, 2]", "", json.dumps({"id": "x2", "n": [1]})]
    path.write_text("\n".join(lines) + "\n")
    records = list(read_records(path, key="id"))
    assert [r.key for r in records] == ["x1", "row 2", "row 3", "x2"]
    assert (
        records[1].error.startswith("row 2: the line")
        and records[2].error == "row 3: is array, not a JSON object"
    )
    assert records[3].data == b"id: x2\nn: [1]\n"


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "age": [30, 41, None]}), path)
    records = list(read_records(path, key="id"))
    assert [(r.key, r.data) for r in records] == [
        ("a", b"id: a\nage: 30\n"),
        ("b", b"id: b\nage: 41\n"),
        ("c", b"id: c\nage: null\n"),
    ]
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(RecordsError, match=r"bad\.parquet is not a readable Parquet file"):
        list(read_records(tmp_path / "bad.parquet"))


def test_unknown_formats_and_headerless_files_are_refused(tmp_path):
    (tmp_path / "r.xlsx").write_bytes(b"")
    with pytest.raises(RecordsError, match="records must be one of csv, jsonl, parquet"):
        list(read_records(tmp_path / "r.xlsx"))
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(RecordsError, match="has no header row"):
        list(read_records(tmp_path / "empty.csv"))
