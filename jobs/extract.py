"""Kind "extract": one JSON object per document, with named fields or conforming to a JSON Schema."""

from __future__ import annotations

import json
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
from jobs.bounded_json import JSONInputError, json_type
from jobs.bounded_json import loads as load_json
from jobs.json_output import describe_error, first_object
from jobs.params import MAX_STRING_PARAM, JobParamError, take_sampling, take_str
from jobs.thinking import THINKING_PARAMS, reasoning_cut_off, take_thinking

if TYPE_CHECKING:
    from engine import RequestOutput
    from engine.constraints import Constraint

INSTRUCTIONS = (
    "Extract information from the document. Reply with a single JSON object and nothing else: no prose, "
    "no code fences. Use null for a value the document does not state; never guess."
)


class Extract(JobKind):
    """Params: exactly one of `fields` (comma-separated names) or `schema` (a JSON Schema: an object, or its
    JSON text; never a path, which the service would resolve on its own host: the client reads
    `--param schema=@file.json` itself); max_tokens (default 512), temperature, top_p, seed, instructions,
    enable_thinking (default off, `jobs.thinking`), include_reasoning.

    The answer is generated under constrained decoding: it is the schema's JSON (or an object with exactly
    the named fields), whatever the model would have written. The output is that object; text that still
    does not parse (cut at max_tokens) fails the document and is kept in `raw`."""

    name = "extract"
    param_names = (
        "fields", "instructions", "max_tokens", "schema", "seed", "temperature", "top_p", *THINKING_PARAMS
    )  # fmt: skip

    def parse_params(self, params: dict[str, Any]) -> dict[str, Any]:
        fields, schema = params.pop("fields", None), params.pop("schema", None)
        if (fields is None) == (schema is None):
            raise JobParamError("extract needs exactly one of the parameters fields or schema")
        parsed = take_sampling(params, default_max_tokens=512) | take_thinking(params, default=False)
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
        request = self.instructed_request(model, f"{INSTRUCTIONS}\n\n{shape}", text, self.constraint())
        return [request]

    def constraint(self) -> Constraint:
        """The answer's grammar: the schema, or an object with exactly the named fields (any JSON values)."""
        from engine.constraints import Constraint

        if "schema" in self._params:
            return Constraint.json_schema(self._params["schema"])
        names = self._params["fields"]
        return Constraint.json_schema(
            {"type": "object", "properties": {name: {} for name in names}, "required": names}
        )

    def result(self, doc: Document, outputs: list[RequestOutput]) -> DocumentResult:
        out = one_output(outputs)
        text, usage, reasoning = out.text or "", usage_of(outputs), self.reasoning_of(outputs)
        if cut := reasoning_cut_off(out):
            return DocumentResult("failed", None, error=cut, usage=usage, reasoning=reasoning)
        found = first_object(text)
        if found is None:
            error = "model output is not valid JSON"
            if out.finish_reason == "length":
                error += "; it stopped at max_tokens, try a larger max_tokens"
            return DocumentResult("failed", None, error=error, raw=text, usage=usage, reasoning=reasoning)
        if "fields" in self._params:
            output = {f: found.get(f) for f in self._params["fields"]}
            return DocumentResult("done", output, usage=usage, reasoning=reasoning)
        schema = self._params["schema"]
        cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        try:
            error = best_match(validator.iter_errors(found))
        except RecursionError:  # a schema that refers to itself without end
            reason = "the schema could not be checked: it recurses too deeply"
            return DocumentResult(status="failed", output=None, error=reason, raw=text, usage=usage)
        if error is not None:
            reason, detail = describe_error(error)
            return DocumentResult(
                "failed", None, error=reason, raw=text, usage=usage, detail=detail, reasoning=reasoning
            )
        return DocumentResult(status="done", output=found, usage=usage, reasoning=reasoning)


def _parse_fields(value: Any) -> list[str]:
    if isinstance(value, str) and len(value) <= MAX_STRING_PARAM:
        names = [name.strip() for name in value.split(",")]
    elif isinstance(value, list) and all(isinstance(name, str) for name in value):
        names = [name.strip() for name in value]
    else:
        raise JobParamError("fields must be comma-separated names, e.g. fields=name,dob,diagnosis")
    if not names or not all(names):
        raise JobParamError("fields has an empty name; give comma-separated names, e.g. fields=name,dob")
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            raise JobParamError(f"fields has one name twice (names {first[name] + 1} and {i + 1})")
        first[name] = i
    return names


def _parse_schema(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = _load_schema(value.strip())
    if not isinstance(value, dict):
        raise JobParamError(f"schema must be a JSON object (a JSON Schema), not {json_type(value)}")
    try:
        load_json(json.dumps(value), "schema")  # the same bounds as JSON text, for a manifest's value
        jsonschema.validators.validator_for(value, default=Draft202012Validator).check_schema(value)
    except JSONInputError as exc:
        raise JobParamError(str(exc)) from None
    except (TypeError, ValueError, RecursionError):  # a value JSON cannot carry; a runaway self-reference
        raise JobParamError("schema is not a valid JSON Schema (it cannot be checked)") from None
    except SchemaError as exc:
        depth = len(exc.absolute_path)
        raise JobParamError(
            f"schema is not a valid JSON Schema: rule '{exc.validator}' of the meta-schema fails "
            f"{depth} level{'s' * (depth != 1)} down"
        ) from None
    declared = value.get("type", "object")
    if "object" not in ([declared] if isinstance(declared, str) else declared):
        raise JobParamError('schema must describe a JSON object: its "type" must be or include "object"')
    return value


def _load_schema(text: str) -> Any:
    """The schema from its JSON text. Text that is no JSON object (a path, say) is refused, never opened."""
    if not text.startswith("{"):
        raise JobParamError(
            "schema must be JSON text of an object, not a path: the service never reads files; "
            "on the command line, --param schema=@file.json sends the file's content"
        )
    try:
        return load_json(text, "schema", max_bytes=MAX_STRING_PARAM)
    except JSONInputError as exc:
        raise JobParamError(str(exc)) from None
