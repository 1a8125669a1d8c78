"""Kind "extract": one JSON object per document, with named fields or conforming to a JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

from jobs.base import (
    Document,
    DocumentResult,
    EngineRequest,
    JobKind,
    ModelInfo,
    decode_text,
    one_output,
    usage_of,
)
from jobs.json_output import describe_error, first_object, schema_names
from jobs.params import JobParamError, take_sampling, take_str

if TYPE_CHECKING:
    from engine import RequestOutput

INSTRUCTIONS = (
    "Extract information from the document. Reply with a single JSON object and nothing else: no prose, "
    "no code fences. Use null for a value the document does not state; never guess."
)


class Extract(JobKind):
    """Params: exactly one of `fields` (comma-separated names) or `schema` (a JSON Schema as a JSON string
    or a path to a .json file, read when the job is built); max_tokens (default 512), temperature, top_p,
    seed, instructions. The output is the extracted object; unparsable model text fails the document and
    is kept in `raw`."""

    name = "extract"
    param_names = ("fields", "instructions", "max_tokens", "schema", "seed", "temperature", "top_p")

    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        fields, schema = params.pop("fields", None), params.pop("schema", None)
        if (fields is None) == (schema is None):
            raise JobParamError("extract needs exactly one of the parameters fields or schema")
        parsed = take_sampling(params, default_max_tokens=512)
        if fields is not None:
            parsed["fields"] = _parse_fields(fields)
        else:
            parsed["schema"] = _parse_schema(schema)
        if (instructions := take_str(params, "instructions")) is not None:
            parsed["instructions"] = instructions
        return parsed

    def requests(self, doc: Document, model: ModelInfo) -> list[EngineRequest]:
        text = decode_text(doc)
        if "fields" in self._params:
            shape = (
                "Return a JSON object with exactly these keys: "
                + ", ".join(json.dumps(f) for f in self._params["fields"])
                + "."
            )
        else:
            shape = "The object must conform to this JSON Schema:\n" + json.dumps(
                self._params["schema"], indent=2
            )
        return [self.instructed_request(model, f"{INSTRUCTIONS}\n\n{shape}", text)]

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        out = one_output(outputs)
        text, usage = out.text or "", usage_of(outputs)
        found = first_object(text)
        if found is None:
            error = "model output is not valid JSON"
            if out.finish_reason == "length":
                error += f"; it stopped at max_tokens={self._params['max_tokens']}, try a larger max_tokens"
            return DocumentResult(status="failed", output=None, error=error, raw=text, usage=usage)
        if "fields" in self._params:
            return DocumentResult("done", {f: found.get(f) for f in self._params["fields"]}, usage=usage)
        schema = self._params["schema"]
        cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        if (error := best_match(validator.iter_errors(found))) is not None:
            message = describe_error(error, schema_names(schema))
            return DocumentResult(status="failed", output=None, error=message, raw=text, usage=usage)
        return DocumentResult(status="done", output=found, usage=usage)


def _parse_fields(value: Any) -> list[str]:
    if isinstance(value, str):
        names = [name.strip() for name in value.split(",")]
    elif isinstance(value, list) and all(isinstance(name, str) for name in value):
        names = [name.strip() for name in value]
    else:
        raise JobParamError("fields must be comma-separated names, e.g. fields=name,dob,diagnosis")
    if not names or not all(names):
        raise JobParamError("fields has an empty name; give comma-separated names, e.g. fields=name,dob")
    if duplicate := next((name for i, name in enumerate(names) if name in names[:i]), None):
        raise JobParamError(f"fields has the name '{duplicate}' twice")
    return names


def _parse_schema(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = _load_schema(value.strip())
    if not isinstance(value, dict):
        raise JobParamError("schema must be a JSON object (a JSON Schema)")
    try:
        jsonschema.validators.validator_for(value, default=Draft202012Validator).check_schema(value)
    except SchemaError as exc:
        message = exc.message.splitlines()[0]
        raise JobParamError(f"schema is not a valid JSON Schema at {exc.json_path}: {message}") from None
    declared = value.get("type", "object")
    if "object" not in ([declared] if isinstance(declared, str) else declared):
        raise JobParamError(f"schema must describe a JSON object, but its type is {json.dumps(declared)}")
    return value


def _load_schema(text: str) -> Any:
    source = "schema"
    if not text.startswith("{"):
        source = f"schema file '{text}'"
        try:
            text = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise JobParamError(f"{source} cannot be read: {reason}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobParamError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
