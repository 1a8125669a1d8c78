"""Read code-review findings out of model text, tolerating prose, fences, JSON lines and odd keys."""

from __future__ import annotations

from typing import Any

from jobs.json_output import json_values

SEVERITIES = ("high", "medium", "low", "note")  # "note": model text that held no parsable findings
MAX_FINDINGS = 8  # per reviewed chunk
MAX_ISSUE = 240  # characters of one finding's text
# What the model's answer is held to by constrained decoding: a JSON list of findings, each bounded, so
# that any model (a random one included) ends its answer well within the default max_tokens.
FINDINGS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "line": {"type": "integer", "minimum": 1, "maximum": 10_000_000},
            "severity": {"enum": list(SEVERITIES[:3])},
            "issue": {"type": "string", "minLength": 1, "maxLength": MAX_ISSUE},
        },
        "required": ["line", "severity", "issue"],
        "additionalProperties": False,
    },
    "maxItems": MAX_FINDINGS,
}
_SEVERITY_ALIASES = {
    "critical": "high",
    "blocker": "high",
    "error": "high",
    "major": "high",
    "warning": "medium",
    "moderate": "medium",
    "minor": "low",
    "info": "low",
    "nit": "low",
    "style": "low",
}
_ISSUE_KEYS = ("issue", "message", "description", "finding", "title")


def parse_findings(text: str) -> list[dict[str, Any]]:
    """Findings `{"line": int | None, "severity": str, "issue": str}` found in a reply.

    JSON lists of findings, `{"findings": [...]}` objects and one finding object per line are read; when
    none is found, non-empty text becomes one free-text finding of severity "note".
    """
    findings: list[dict[str, Any]] = []
    found_json = False
    for value, _ in json_values(text):
        if isinstance(value, dict) and isinstance(value.get("findings"), list):
            value = value["findings"]
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and value and not any(isinstance(item, dict) for item in value):
            continue  # e.g. [1, 2]: not a list of findings
        for item in items:
            if isinstance(item, dict) and (finding := _finding(item)) is not None:
                findings.append(finding)
                found_json = True
        if isinstance(value, list) and not value:
            found_json = True  # "[]": the model found nothing
    if found_json:
        return findings
    text = text.strip()
    return [{"line": None, "severity": "note", "issue": text}] if text else []


def _finding(item: dict[str, Any]) -> dict[str, Any] | None:
    issue = next(
        (item[key] for key in _ISSUE_KEYS if isinstance(item.get(key), str) and item[key].strip()), None
    )
    if issue is None:
        return None
    return {
        "line": _line(item.get("line")),
        "severity": _severity(item.get("severity")),
        "issue": issue.strip(),
    }


def _line(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip()) or None
    if isinstance(value, list) and value:  # a range such as [12, 15]: its first line
        return _line(value[0])
    return None


def _severity(value: Any) -> str:
    if not isinstance(value, str):
        return "medium"
    value = value.strip().lower()
    if value in SEVERITIES[:3]:
        return value
    return _SEVERITY_ALIASES.get(value, "medium")
