"""report.sarif: SARIF 2.1.0 validated against the official schema, and the findings it carries."""

import hashlib
from datetime import UTC, datetime

import jsonschema
import pytest

from jobs.sarif import TOOL_NAME, build_sarif
from jobs.scan_record import GIT_WORKING_TREE, ScanRecord, ScanSource
from tests.jobs.sarif_schema import SCHEMA, SCHEMA_FILE, SCHEMA_SHA256, validate_sarif


def done(path: str, findings: list[dict], model: str = "qwen3.5-demo") -> tuple[str, dict]:
    output = {"path": path, "language": "Python", "chunks": 1, "model": model, "findings": findings}
    return path, {"status": "done", "output": output, "error": None}


RESULTS = [
    done("app.py", [{"line": 3, "severity": "high", "issue": "SQL built from input"}]),
    done("my dir/x#1 ü.py", [{"line": None, "severity": "note", "issue": "free\ntext"}]),
    done(
        "b.py",
        [{"line": 9, "severity": "medium", "issue": "a"}, {"line": 1, "severity": "low", "issue": "b"}],
    ),
    (
        "bad.py",
        {"status": "failed", "output": None, "error": "document is not valid UTF-8 (first bad byte at 0)"},
    ),
]
SCAN = ScanRecord(
    scanned_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    sources=[
        ScanSource(repository="planted", method=GIT_WORKING_TREE, commit="a" * 40, path_in_repository="src/")
    ],
    skipped=[("uv.lock", "lockfile"), ("node_modules/", "vendored"), ("web/a.min.js", "minified")],
)


def test_the_vendored_schema_is_the_official_one():
    assert hashlib.sha256(SCHEMA_FILE.read_bytes()).hexdigest() == SCHEMA_SHA256
    assert SCHEMA["id"].endswith("/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json")


def test_sarif_validates_and_carries_every_finding():
    log = build_sarif(RESULTS, SCAN)
    validate_sarif(log)
    assert log["version"] == "2.1.0" and len(log["runs"]) == 1
    run = log["runs"][0]
    assert run["tool"]["driver"]["name"] == TOOL_NAME
    rules = [rule["id"] for rule in run["tool"]["driver"]["rules"]]
    found = {
        (
            r["ruleId"],
            r["level"],
            r["message"]["text"],
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
        )
        for r in run["results"]
    }
    assert found == {
        ("code-review/high", "error", "SQL built from input", "src/app.py"),
        ("code-review/note", "note", "free\ntext", "src/my%20dir/x%231%20%C3%BC.py"),
        ("code-review/medium", "warning", "a", "src/b.py"),
        ("code-review/low", "note", "b", "src/b.py"),
    }
    assert all(rules[r["ruleIndex"]] == r["ruleId"] for r in run["results"])
    regions = {
        r["message"]["text"]: r["locations"][0]["physicalLocation"].get("region") for r in run["results"]
    }
    assert regions == {
        "SQL built from input": {"startLine": 3},
        "free\ntext": None,
        "a": {"startLine": 9},
        "b": {"startLine": 1},
    }
    [failure] = run["invocations"][0]["toolExecutionNotifications"]
    assert failure["level"] == "error" and "not valid UTF-8" in failure["message"]["text"]
    assert run["invocations"][0]["executionSuccessful"] is False
    properties = run["properties"]
    assert properties["model"] == "qwen3.5-demo" and properties["scannedAt"] == "2026-01-02T03:04:05Z"
    assert properties["sources"] == [
        {"repository": "planted", "path": "src/", "commit": "a" * 40, "listedBy": "git ls-files"}
    ]
    assert properties["skipped"] == {"lockfile": 1, "minified": 1, "vendored": 1}


def test_sarif_without_a_scan_record_or_results_still_validates():
    log = build_sarif([], None)
    validate_sarif(log)
    assert log["runs"][0]["results"] == [] and "missing" in log["runs"][0]["properties"]["scanRecord"]


@pytest.mark.parametrize(
    "breakage",
    [
        lambda log: log["runs"][0]["results"][0].update(level="fatal"),
        lambda log: log["runs"][0]["results"][0]["locations"][0]["physicalLocation"].update(
            region={"startLine": 0}
        ),
        lambda log: log["runs"][0]["results"][0]["locations"][0]["physicalLocation"][
            "artifactLocation"
        ].update(uri="src/a b.py"),
        lambda log: log.update(version="2.0.0"),
        lambda log: log["runs"][0]["tool"].pop("driver"),
    ],
)
def test_the_validation_catches_a_broken_log(breakage):
    log = build_sarif(RESULTS, SCAN)
    breakage(log)
    with pytest.raises(jsonschema.ValidationError):
        validate_sarif(log)
