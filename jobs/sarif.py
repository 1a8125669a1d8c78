"""SARIF 2.1.0 for a code-review job, written beside report.md for code-scanning dashboards: one run of the
tool "Enclave code-review", one result per finding.

Each severity is a rule (`code-review/high`, ...) whose level is the finding's (high: error, medium:
warning, low and note: note); a result's location is the file, as a URI relative to the repository's root
(`%SRCROOT%`: a sub-folder's path put back in front), with the finding's line as its region when it has
one. Files that failed are the invocation's error notifications; the repository, commit, model, scan date
and skipped counts are the run's properties (a commit without a repository URI cannot be
`versionControlProvenance`).
"""

from __future__ import annotations

from collections import Counter
from importlib import metadata
from typing import Any
from urllib.parse import quote

from jobs.findings import SEVERITIES
from jobs.review_report import models_of
from jobs.scan_record import ScanRecord

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
TOOL_NAME = "Enclave code-review"
LEVELS = {"high": "error", "medium": "warning", "low": "note", "note": "note"}
_RULE_TEXT = {
    "high": "A likely bug or security problem, found by the model's review.",
    "medium": "A probable problem or fragile code, found by the model's review.",
    "low": "A minor problem or unclear code, found by the model's review.",
    "note": "The model's review as free text: it held no findings that could be parsed.",
}


def build_sarif(results: list[tuple[str, dict[str, Any]]], scan: ScanRecord | None) -> dict[str, Any]:
    """The SARIF log of `results` ((document name, record) pairs, as for `build_report`)."""
    ordered = sorted(results, key=lambda item: item[0])
    rules = [_rule(severity) for severity in SEVERITIES]
    found, failed = [], []
    for name, record in ordered:
        location = _location(name, scan)
        if record.get("status") != "done":
            text = f"Not reviewed: {record.get('error') or 'unknown error'}"
            failed.append({"level": "error", "message": {"text": text}, "locations": [location]})
            continue
        output = record.get("output") if isinstance(record.get("output"), dict) else {}
        for finding in output.get("findings", []):
            if isinstance(finding, dict) and finding.get("severity") in SEVERITIES:
                found.append(_result(finding, location))
    invocation = {"executionSuccessful": not failed, "toolExecutionNotifications": failed}
    run = {
        "tool": {"driver": {"name": TOOL_NAME, "version": _version(), "rules": rules}},
        "invocations": [invocation],
        "results": found,
        "properties": _properties(ordered, scan),
    }
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def _rule(severity: str) -> dict[str, Any]:
    return {
        "id": f"code-review/{severity}",
        "name": f"{severity.capitalize()}Finding",
        "shortDescription": {"text": _RULE_TEXT[severity]},
        "defaultConfiguration": {"level": LEVELS[severity]},
    }


def _result(finding: dict[str, Any], location: dict[str, Any]) -> dict[str, Any]:
    severity = finding["severity"]
    line = finding.get("line")
    if isinstance(line, int) and not isinstance(line, bool) and line >= 1:
        location = {"physicalLocation": location["physicalLocation"] | {"region": {"startLine": line}}}
    return {
        "ruleId": f"code-review/{severity}",
        "ruleIndex": SEVERITIES.index(severity),
        "level": LEVELS[severity],
        "message": {"text": str(finding.get("issue") or "(no text)")},
        "locations": [location],
    }


def _location(name: str, scan: ScanRecord | None) -> dict[str, Any]:
    path = scan.repository_path(name) if scan is not None else name
    uri = quote(path, safe="/", errors="backslashreplace")  # a URI reference: spaces, %, #, : encoded
    return {"physicalLocation": {"artifactLocation": {"uri": uri, "uriBaseId": "%SRCROOT%"}}}


def _properties(results: list[tuple[str, dict[str, Any]]], scan: ScanRecord | None) -> dict[str, Any]:
    properties: dict[str, Any] = {"model": ", ".join(models_of(results)) or None}
    if scan is None:
        return properties | {"scanRecord": "missing: the repository, commit and skipped files are unknown"}
    sources = [
        {"repository": s.repository, "path": s.path_in_repository, "commit": s.commit, "listedBy": s.method}
        for s in scan.sources
    ]
    skipped = dict(sorted(Counter(reason for _, reason in scan.skipped).items()))
    scanned = scan.scanned_at.isoformat().replace("+00:00", "Z")
    return properties | {"sources": sources, "scannedAt": scanned, "skipped": skipped}


def _version() -> str:
    try:
        return metadata.version("enclave")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
