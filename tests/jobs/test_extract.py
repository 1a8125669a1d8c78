import builtins
import io
import json
from pathlib import Path

import pytest

from jobs import make_kind
from jobs.base import DocumentError
from jobs.params import JobParamError, resolve_file_params
from tests.jobs.factories import doc, make_output

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "sex": {"enum": ["female", "male", "other"]},
        "visits": {"type": "array", "items": {"type": "object", "properties": {"date": {"type": "string"}}}},
    },
    "required": ["name", "age"],
    "additionalProperties": {"type": "number"},
}


def schema_kind():
    return make_kind("extract", {"schema": json.dumps(SCHEMA)})


def test_fields_are_parsed_and_the_prompt_names_them(model):
    kind = make_kind("extract", {"fields": " name, dob ,diagnosis"})
    assert kind.params["fields"] == ["name", "dob", "diagnosis"]
    assert kind.params["max_tokens"] == 512
    kind.requests(doc("Jane Doe, born 1970."), model)
    system = model.rendered[0][0]["content"]
    assert 'exactly these keys: "name", "dob", "diagnosis"' in system and "single JSON object" in system


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "extract needs exactly one of the parameters fields or schema"),
        ({"fields": "a", "schema": "{}"}, "extract needs exactly one of the parameters fields or schema"),
        ({"fields": "a,,b"}, "fields has an empty name"),
        ({"fields": "a,b,a"}, r"^fields has one name twice \(names 1 and 3\)$"),
        ({"schema": '{"type": "object",'}, r"^schema is not valid JSON \(.* at offset 18\)$"),
        (
            {"schema": '{"type": "strin"}'},
            r"^schema is not a valid JSON Schema: rule '\w+' of the meta-schema",
        ),
        (
            {"schema": '{"type": "array"}'},
            'schema must describe a JSON object: its "type" must be or include',
        ),
        ({"schema": '{"a": ' + "[" * 70 + "]" * 70 + "}"}, "^schema is nested more than 64 levels deep$"),
        ({"schema": '{"maximum": 1e400}'}, "^schema holds a number JSON cannot carry"),
        ({"schema": {"maximum": float("nan")}}, "^schema holds a number JSON cannot carry"),
        ({"schema": [1]}, "^schema must be a JSON object \\(a JSON Schema\\), not array$"),
        ({"schema": "missing/schema.json"}, "^schema must be JSON text of an object, not a path"),
    ],
)
def test_bad_params_are_one_line(params, message):
    with pytest.raises(JobParamError, match=message) as caught:
        make_kind("extract", params)
    assert "\n" not in str(caught.value)


def test_a_schema_path_is_refused_and_the_file_never_opened(tmp_path, monkeypatch):
    """Parameters are values: a path names a file on the worker's host, which must never be read."""
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    opened = []
    real_open, real_read_text = builtins.open, Path.read_text

    def spy_open(file, *args, **kwargs):
        if str(file) == str(path):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    def spy_read_text(self, *args, **kwargs):
        if str(self) == str(path):
            opened.append(self)
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(Path, "read_text", spy_read_text)
    monkeypatch.setattr(io, "open", spy_open)
    for value in (str(path), f" {path} ", f"@{path}", path.as_uri()):
        with pytest.raises(
            JobParamError, match=r"^schema must be JSON text of an object, not a path"
        ) as caught:
            make_kind("extract", {"schema": value})
        assert str(path) not in str(caught.value)
    assert opened == []


def test_the_client_sends_a_schema_file_as_its_content(tmp_path, model):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    params = resolve_file_params({"schema": f"@{path}", "instructions": "@@home"})
    assert params == {"schema": json.dumps(SCHEMA), "instructions": "@home"}
    kind = make_kind("extract", params)
    assert kind.params["schema"] == SCHEMA
    kind.requests(doc("Jane, 54"), model)
    assert '"required": [' in model.rendered[0][0]["content"]
    with pytest.raises(
        JobParamError, match=r"^the file given for schema with @ cannot be read: No such file"
    ):
        resolve_file_params({"schema": f"@{tmp_path / 'missing.json'}"})


def test_fields_keep_exactly_the_requested_keys():
    kind = make_kind("extract", {"fields": "name,dob,diagnosis"})
    text = 'Here you go:\n```json\n{"name": "Jane {Doe}", "diagnosis": "flu", "extra": 1}\n```'
    result = kind.result(doc("x"), [make_output(text)])
    assert result.status == "done"
    assert result.output == {"name": "Jane {Doe}", "dob": None, "diagnosis": "flu"}


def test_unparsable_output_fails_and_keeps_the_raw_text():
    kind = make_kind("extract", {"fields": "name"})
    result = kind.result(doc("x"), [make_output("name: Jane {not json")])
    assert (result.status, result.error, result.raw) == (
        "failed",
        "model output is not valid JSON",
        "name: Jane {not json",
    )
    cut = kind.result(doc("x"), [make_output('{"name": "Ja', finish_reason="length")])
    assert cut.error == "model output is not valid JSON; it stopped at max_tokens, try a larger max_tokens"


def test_schema_match_is_done():
    result = schema_kind().result(doc("x"), [make_output('{"name": "Jane", "age": 54, "weight": 61.5}')])
    assert (result.status, result.output) == ("done", {"name": "Jane", "age": 54, "weight": 61.5})


@pytest.mark.parametrize(
    ("output", "error", "detail"),
    [
        ({"name": "Jane", "age": "CANARY-123"}, "at $.*: expected integer", "at $.age: 'CANARY-123' is not"),
        ({"name": "CANARY-123"}, "at $: missing 1 required property", "at $: 'age' is a required property"),
        (
            {"name": "Jane", "age": -5},
            "at $.*: violates minimum",
            "at $.age: -5 is less than the minimum of 0",
        ),
        (
            {"name": "Jane", "age": 5, "sex": "CANARY-123"},
            "at $.*: expected one of 3 values",
            "at $.sex: 'CANARY",
        ),
        ({"name": "Jane", "age": 5, "CANARY-123": "CANARY-123"}, "at $.*: expected number", None),
        (
            {"name": "Jane", "age": 5, "visits": [{"date": 20240101}]},
            "at $.*[0].*: expected string",
            "visits[0].date",
        ),
    ],
)
def test_schema_failure_names_no_value_and_no_name_of_the_schema(output, error, detail):
    """Property names come from the schema, a job parameter: the stored reason masks them; the sealed
    detail names them and quotes the value."""
    text = json.dumps(output)
    result = schema_kind().result(doc("x"), [make_output(text)])
    assert result.status == "failed"
    assert result.error == f"model output does not match the schema {error}"
    assert "CANARY" not in result.error
    assert not any(name in result.error for name in ("age", "sex", "visits", "date", "female"))
    assert result.raw == text
    assert detail is None or detail in result.detail


def test_draft7_schema_is_honoured():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "required": ["a"]}
    kind = make_kind("extract", {"schema": schema})
    assert kind.result(doc("x"), [make_output("{}")]).error.endswith("missing 1 required property")


def test_additional_properties_false_does_not_name_the_property():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    result = make_kind("extract", {"schema": schema}).result(doc("x"), [make_output('{"CANARY-123": 1}')])
    assert (
        result.error
        == "model output does not match the schema at $: has properties the schema does not allow"
    )


def test_nullable_object_schema_is_accepted():
    assert make_kind("extract", {"schema": {"type": ["object", "null"]}}).params["schema"]["type"] == [
        "object",
        "null",
    ]


def test_non_utf8_document_fails(model):
    with pytest.raises(DocumentError, match="not valid UTF-8"):
        make_kind("extract", {"fields": "a"}).requests(doc(b"\xff"), model)


def test_a_self_referencing_schema_fails_the_document_cleanly():
    kind = make_kind(
        "extract", {"schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "$ref": "#"}}
    )
    result = kind.result(doc("x"), [make_output('{"a": {"a": {}}}')])
    assert result.status in ("done", "failed") and (result.error is None or "\n" not in result.error)


def test_deeply_nested_model_output_is_skipped_not_a_crash():
    kind = make_kind("extract", {"fields": "a"})
    text = "[" * 100_000 + "]" * 100_000 + ' then {"a": 1}'
    result = kind.result(doc("x"), [make_output(text)])
    assert (result.status, result.output) == ("done", {"a": 1})
