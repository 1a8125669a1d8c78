"""The official SARIF 2.1.0 schema (OASIS errata 01, vendored in tests/jobs/data with its provenance) and a
validator that also checks the URI and date formats (jsonschema checks none without optional packages)."""

import json
import re
from datetime import datetime
from pathlib import Path

import jsonschema

SCHEMA_FILE = Path(__file__).parent / "data" / "sarif-schema-2.1.0.json"
SCHEMA_SHA256 = (
    "c3b4bb2d6093897483348925aaa73af03b3e3f4bd4ca38cef26dcb4212a2682e"  # tests/jobs/data/README.md
)
SCHEMA = json.loads(SCHEMA_FILE.read_text())
# RFC 3986 URI-reference characters: unreserved, reserved and percent-escapes only.
_URI_REFERENCE = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")
FORMATS = jsonschema.FormatChecker()
FORMATS.checks("uri-reference")(lambda value: bool(_URI_REFERENCE.fullmatch(value)))
FORMATS.checks("uri")(lambda value: bool(_URI_REFERENCE.fullmatch(value)) and ":" in value.split("/")[0])
FORMATS.checks("date-time")(lambda value: datetime.fromisoformat(value) is not None)


def validate_sarif(log: dict) -> None:
    """Raise `jsonschema.ValidationError` unless `log` is valid SARIF 2.1.0."""
    jsonschema.Draft4Validator(SCHEMA, format_checker=FORMATS).validate(log)
