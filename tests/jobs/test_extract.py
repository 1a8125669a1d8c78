import json

import pytest

from jobs import make_kind
from jobs.base import DocumentError
from jobs.params import JobParamError
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
        ({"fields": "a,b,a"}, "fields has the name 'a' twice"),
        ({"schema": '{"type": "object",'}, r"schema is not valid JSON \(.* at line 1, column 19\)"),
        ({"schema": '{"type": "strin"}'}, "schema is not a valid JSON Schema at"),
        ({"schema": '{"type": "array"}'}, 'schema must describe a JSON object, but its type is "array"'),
        ({"schema": "missing/schema.json"}, "schema file 'missing/schema.json' cannot be read: No such file"),
    ],
)
def test_bad_params_are_one_line(params, message):
    with pytest.raises(JobParamError, match=message) as caught:
        make_kind("extract", params)
    assert "\n" not in str(caught.value)


def test_schema_file_is_read_at_parameter_time(tmp_path, model):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    kind = make_kind("extract", {"schema": str(path)})
    path.unlink()
    assert kind.params["schema"] == SCHEMA
    kind.requests(doc("Jane, 54"), model)
    assert '"required": [' in model.rendered[0][0]["content"]


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
    assert cut.error.startswith("model output is not valid JSON; it stopped at max_tokens=512")


def test_schema_match_is_done():
    result = schema_kind().result(doc("x"), [make_output('{"name": "Jane", "age": 54, "weight": 61.5}')])
    assert (result.status, result.output) == ("done", {"name": "Jane", "age": 54, "weight": 61.5})


@pytest.mark.parametrize(
    ("output", "error"),
    [
        ({"name": "Jane", "age": "CANARY-123"}, "at $.age: expected integer"),
        ({"name": "CANARY-123"}, "at $: missing required property 'age'"),
        ({"name": "Jane", "age": -5}, "at $.age: violates minimum 0"),
        (
            {"name": "Jane", "age": 5, "sex": "CANARY-123"},
            'at $.sex: expected one of ["female", "male", "other"]',
        ),
        ({"name": "Jane", "age": 5, "CANARY-123": "CANARY-123"}, "at $.*: expected number"),
        ({"name": "Jane", "age": 5, "visits": [{"date": 20240101}]}, "at $.visits[0].date: expected string"),
    ],
)
def test_schema_failure_names_path_and_keyword_never_the_value(output, error):
    text = json.dumps(output)
    result = schema_kind().result(doc("x"), [make_output(text)])
    assert result.status == "failed"
    assert result.error == f"model output does not match the schema {error}"
    assert "CANARY" not in result.error
    assert result.raw == text


def test_draft7_schema_is_honoured():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "required": ["a"]}
    kind = make_kind("extract", {"schema": schema})
    assert kind.result(doc("x"), [make_output("{}")]).error.endswith("missing required property 'a'")


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
