"""Fuzz every parser of untrusted input: each input ends in a value or a clean error (see harness)."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs import KINDS, make_kind
from jobs.base import MAX_REASON, Document, DocumentError
from jobs.bounded_json import loads, nesting_depth
from jobs.findings import parse_findings
from jobs.json_output import json_values
from jobs.openai_batch import BadLine, BatchLine, output_line, parse_line, read_batch_file
from jobs.openai_request import RequestRefused
from pipeline import audit, audit_anchor
from pipeline.audit_heads import SignedHead
from pipeline.envelope import (
    canonical_json,
    open_document,
    seal_document,
    unpack_document,
    verify_manifest,
)
from pipeline.keys import generate_identity
from tests.fuzz.harness import (
    MARKER,
    check_message,
    clean,
    deep,
    dumps,
    fed,
    json_like,
    marked,
    mutate,
    numbers,
    profile,
    sealable,
    variants,
)
from tests.jobs.factories import FakeModel, make_output

SERVICE = generate_identity()
CLIENT = generate_identity()
URLS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/embeddings/" + MARKER * 40]


# -- bounded JSON -------------------------------------------------------------------------------------


@profile(800)
@given(
    st.one_of(json_like.map(dumps), st.text(max_size=80).map(lambda t: t + MARKER)),
    st.randoms(use_true_random=False),
)
def test_bounded_json(text, rnd):
    inputs = [text, *variants(text.encode("utf-8", "surrogatepass"), rnd, 3)]
    fed("bounded_json", len(inputs))
    for data in inputs:
        value = clean(loads, data, "input")
        if not isinstance(value, Exception):
            sealable(value)  # no NaN, no infinity, no lone surrogate: nothing JSON cannot carry on
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        assert nesting_depth(text)[1] >= 0


# -- OpenAI batch lines, on the client and in the worker's chat kind -------------------------------------

_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", MARKER]) | json_like},
        optional={"text": marked | json_like},
    ),
    max_size=3,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", MARKER]) | json_like},
    optional={"content": marked | _parts | json_like},
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "model": marked | json_like,
        "messages": st.lists(_message, max_size=3) | json_like,
        "prompt": marked | st.lists(numbers, max_size=3) | json_like,
        "max_tokens": numbers | json_like,
        "max_completion_tokens": numbers,
        "temperature": numbers,
        "top_p": numbers,
        "seed": numbers | marked,
        "stop": marked | st.lists(marked, max_size=5) | json_like,
        "n": numbers,
    },
).flatmap(lambda body: st.dictionaries(marked, json_like, max_size=2).map(lambda extra: extra | body))
_line = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": marked | json_like | st.just(MARKER * 100),
        "method": st.sampled_from(["POST", "GET"]) | json_like,
        "url": st.sampled_from(URLS) | marked | json_like,
        "body": _body | json_like,
    },
)
batch_lines = _line.map(dumps).map(lambda text: text.encode("utf-8", "surrogatepass"))


def _check_line(line: BatchLine | BadLine) -> None:
    if isinstance(line, BadLine):
        check_message(line.problem)


@profile(600)
@given(batch_lines, st.randoms(use_true_random=False))
def test_batch_file_lines(line, rnd):
    lines = variants(line, rnd, 4)
    fed("batch_file_lines", len(lines))
    for raw in lines:
        _check_line(parse_line(raw))
    for parsed in clean(read_batch_file, b"\n".join(lines)):
        _check_line(parsed)


@profile(1000)
@given(batch_lines, st.randoms(use_true_random=False))
def test_chat_kind_runs_or_fails_each_line_alone(line, rnd):
    lines = variants(line, rnd, 2)
    fed("chat_kind", len(lines))
    for raw in lines:
        _run_chat_line(raw)


def _run_chat_line(raw: bytes) -> None:
    line = parse_line(raw)
    _check_line(line)
    kind, model = make_kind("chat", {}), FakeModel()
    document = Document(line.custom_id or "line", raw)
    try:
        requests = kind.requests(document, model)
    except DocumentError as error:
        check_message(error.reason)
        assert len(error.reason) <= MAX_REASON
        result = kind.failure(error)
        expected = {"code": error.code}
        if isinstance(error, RequestRefused):  # an OpenAI 400 names its parameter (jobs/chat.py, issue 16)
            expected |= {"status_code": 400, "type": "invalid_request_error", "param": error.param}
        assert result.error == error.reason and result.output == expected
        record = {
            "status": result.status,
            "output": result.output,
            "error": result.error,
            "detail": result.detail,
        }
        sealable(output_line(document.path, record) | {"detail": result.detail})
        return
    assert isinstance(line, BatchLine) and len(requests) == 1
    result = kind.result(document, [make_output("Fine.")])
    sealable(result.output)


# -- job parameters of every kind ----------------------------------------------------------------------

_values = st.one_of(
    marked,
    json_like,
    numbers,
    numbers.map(str),
    st.sampled_from(
        ["nan", "inf", "-inf", "1e400", "0x10", " 12 ", "1_000", "--5", "٣", "", "   ", str(2**70)]
    ),
)
_schemas = st.one_of(
    st.dictionaries(marked, json_like, max_size=3).map(lambda p: {"type": "object", "properties": p}),
    json_like,
    json_like.map(dumps),
    st.just("/etc/passwd"),
    st.just('{"type": "object", "properties": {"a": ' + deep(100_000, "[", "]") + "}}"),
    st.just({"$ref": "#", "type": "object"}),
)


@pytest.mark.parametrize("name", sorted(KINDS))
@profile(600)
@given(data=st.data())
def test_job_params(name, data):
    fed(f"job_params[{name}]")
    known = KINDS[name].param_names
    params = data.draw(st.dictionaries(st.sampled_from(known) | marked, _values, max_size=4))
    if name == "extract" and data.draw(st.booleans()):
        params = {k: v for k, v in params.items() if k not in ("fields", "schema")} | {
            "schema": data.draw(_schemas)
        }
    kind = clean(make_kind, name, params)
    if isinstance(kind, Exception):
        return
    normalised = kind.params
    sealable(normalised)
    assert make_kind(name, json.loads(json.dumps(normalised))).params == normalised
    kind.sampling()  # the engine accepts what parameters accept


# -- manifests and document payloads ------------------------------------------------------------------


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _manifest() -> dict:
    return {
        "version": 1,
        "job_id": "job-1",
        "kind": "summarize",
        "params": {"max_tokens": 5},
        "client": CLIENT.public.fingerprint,
        "documents": [{"id": "doc-1", "sha256": "ab" * 32}],
        "created_at": "2025-01-01T00:00:00Z",
    }


@profile(1200)
@given(
    field=st.sampled_from([*_manifest(), "documents.0.id", "documents.0", "params.x", "extra " + MARKER]),
    value=json_like | st.just(json.loads(deep(63))),
    signed=st.booleans(),
    rnd=st.randoms(use_true_random=False),
)
def test_manifests(field, value, signed, rnd):
    fed("manifests", 2)
    manifest = _manifest()
    if field.startswith("documents.0"):
        target = manifest["documents"] if field == "documents.0" else manifest["documents"][0]
        if field == "documents.0":
            target[0] = value
        else:
            target["id"] = value
    elif field == "params.x":
        manifest["params"]["x"] = value
    else:
        manifest[field] = value
    text = dumps(manifest)
    try:
        signature = CLIENT.sign(canonical_json(manifest)) if signed else b"\x00" * 64
    except (ValueError, TypeError):
        signature = b"\x00" * 64
    mutation = mutate(text.encode("utf-8", "surrogatepass"), rnd).decode("utf-8", "replace")
    for candidate in (text, mutation):
        result = clean(verify_manifest, candidate, signature, CLIENT.public)
        if not isinstance(result, Exception):
            assert result["client"] == CLIENT.public.fingerprint


@profile(1000)
@given(
    header=st.one_of(
        st.fixed_dictionaries({"path": marked | json_like})
        .map(dumps)
        .map(lambda t: t.encode("utf-8", "surrogatepass")),
        json_like.map(dumps).map(lambda t: t.encode("utf-8", "surrogatepass")),
    ),
    length=st.none() | st.integers(0, 2**32 - 1),
    body=st.binary(max_size=32),
    rnd=st.randoms(use_true_random=False),
)
def test_document_payloads(header, length, body, rnd):
    fed("document_payloads", 2)
    for head in (header, mutate(header, rnd)):
        payload = struct.pack(">I", len(head) if length is None else length) + head + body
        result = clean(unpack_document, payload)
        if not isinstance(result, Exception):
            path, data = result
            sealable({"path": path})
            assert data == body


@profile(300)
@given(st.binary(max_size=200), st.booleans())
def test_sealed_documents(garbage, real):
    fed("sealed_documents")
    sealed = seal_document(garbage, SERVICE.public.x25519, "j", "d")[: len(garbage)] if real else garbage
    clean(open_document, sealed, SERVICE, "j", "d")


# -- model output (untrusted: a document can steer the model) ------------------------------------------

# Decoded by a tokenizer, model text is valid Unicode; it may still write "\ud800" escapes, NaN or 1e400.
_ascii_json = json_like.map(lambda value: json.dumps(value, allow_nan=True))
_model_text = st.one_of(
    _ascii_json.map(lambda t: f"Here: ```json\n{t}\n``` {MARKER}"),
    st.text(alphabet=st.sampled_from('[]{}":,0123456789.eE-truefalsn \\ud' + MARKER), max_size=120),
    _ascii_json,
)
EXTRACT = make_kind(
    "extract",
    {
        "schema": {
            "type": "object",
            "properties": {MARKER: {"type": "integer", "minimum": 0}, "b": {"enum": [MARKER, 1]}},
            "required": [MARKER],
        }
    },
)


@profile(700)
@given(_model_text, st.randoms(use_true_random=False))
def test_model_output(text, rnd):
    mutation = mutate(text.encode("utf-8", "surrogatepass"), rnd).decode("utf-8", "replace")
    fed("model_output", 2)
    for candidate in (text, mutation):
        for value, _ in json_values(candidate):
            sealable(value)
        for finding in parse_findings(candidate):
            sealable(finding)
        result = EXTRACT.result(Document("a", b"x"), [make_output(candidate)])
        sealable(result.output)
        if result.status == "failed":
            check_message(result.error)


# -- audit details ---------------------------------------------------------------------------------------


@profile(600)
@given(st.text(max_size=600) | marked | st.just("x" * 10_000), json_like)
def test_audit_bounded_details_always_pass(text, other):
    fed("audit_details")
    bounded = audit.bounded(text)
    assert audit._details_text({"error": bounded, "n": 3}) is not None
    try:
        audit._details_text({"value": other})
    except ValueError as exc:  # the checks that keep content out: a ValueError naming the rule
        assert "audit details" in str(exc)


# -- signed tree heads of the audit log: a kept head file, the heads files' lines ----------------------------

_HEAD = SignedHead(
    7, "11" * 32, "22" * 32, "2026-01-01T00:00:00.000000Z", SERVICE.public.fingerprint, b"\x01" * 64
)


@profile(600)
@given(
    field=st.sampled_from([*_HEAD.to_json(), MARKER]),
    value=json_like | marked,
    rnd=st.randoms(use_true_random=False),
)
def test_signed_heads(field, value, rnd, tmp_path_factory):
    fed("signed_heads", 3)
    text = dumps(_HEAD.to_json() | {field: value})
    mutation = mutate(text.encode("utf-8", "surrogatepass"), rnd)
    for candidate in (text, mutation, "[" * (rnd.randrange(1024) + 1)):
        head = clean(SignedHead.parse, candidate, "the head file")
        if not isinstance(head, Exception):
            assert SignedHead.parse(head.line(), "again") == head
    path = tmp_path_factory.mktemp("heads") / "heads.jsonl"
    path.write_bytes(_HEAD.line() + mutation + b"\n" + _HEAD.line())
    kept = clean(audit_anchor.read, path)
    if not isinstance(kept, Exception):
        assert kept[0].head == _HEAD and kept[-1].head == _HEAD
