"""What a request's output must match: a JSON Schema, any JSON object, a regular expression or one of a list
of strings. Plain data, checked when made; `engine/grammar.py` compiles it into a token mask.

This module imports nothing heavy: `jobs` builds constraints without torch or the grammar library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice")
MAX_SPEC_CHARS = 1_000_000  # a schema's JSON text, a pattern, or all choices together
MAX_CHOICES = 4096


@dataclass(frozen=True)
class Constraint:
    """`kind` is one of KINDS; `spec` is the JSON Schema (a dict) for "json_schema", the pattern for
    "regex", the tuple of allowed strings for "choice" and None for "json_object".

    The output is generated so that it matches: every token outside the grammar is masked before
    sampling. JSON is written compactly on one line (", " and ": " separators), and a schema is applied
    strictly: properties or items it does not name are not generated (as OpenAI's strict mode).
    """

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"constraint kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.kind == "json_schema":
            if not isinstance(self.spec, dict):
                raise RequestError("a json_schema constraint needs the schema as a JSON object")
            if len(self.key) > MAX_SPEC_CHARS:
                raise RequestError(f"the schema is over {MAX_SPEC_CHARS} characters of JSON")
        elif self.kind == "regex":
            if not isinstance(self.spec, str) or not self.spec:
                raise RequestError("a regex constraint needs a non-empty pattern string")
            if len(self.spec) > MAX_SPEC_CHARS:
                raise RequestError(f"the pattern is over {MAX_SPEC_CHARS} characters")
        elif self.kind == "choice":
            choices = tuple(self.spec) if isinstance(self.spec, list | tuple) else None
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestError("a choice constraint needs a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES or sum(map(len, choices)) > MAX_SPEC_CHARS:
                raise RequestError(f"a choice constraint takes at most {MAX_CHOICES} strings")
            object.__setattr__(self, "spec", choices)
        elif self.spec is not None:
            raise RequestError("a json_object constraint takes no spec")

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal constraints share one compiled grammar."""
        return f"{self.kind}:{json.dumps(self.spec, sort_keys=True, ensure_ascii=False)}"

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> Constraint:
        return cls("choice", tuple(choices))
