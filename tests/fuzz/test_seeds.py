"""The inputs that crashed the parsers in the fuzz and privacy run of issue 12, fed explicitly."""

from __future__ import annotations

import json

import pytest

from jobs import make_kind
from jobs.base import Document, DocumentError
from jobs.openai_batch import MAX_LINE_BYTES, BadLine, BatchLine, parse_batch_file, read_batch_file
from pipeline.envelope import pack_document, unpack_document, verify_manifest
from pipeline.keys import generate_identity
from tests.fuzz.harness import MARKER, check_message, clean, deep, fed, sealable
from tests.jobs.factories import FakeModel, make_output

CHAT = "/v1/chat/completions"


def _line(custom_id: str = "c", url: str = CHAT, **body) -> bytes:
    body = {"messages": [{"role": "user", "content": "hi " + MARKER}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


SEEDS = {
    "100k-deep body": b'{"custom_id": "c", "method": "POST", "url": "'
    + CHAT.encode()
    + b'", "body": '
    + deep(100_000, "[", "]").encode()
    + b"}",
    "100k-deep object body": b'{"custom_id": "c", "method": "POST", "url": "'
    + CHAT.encode()
    + b'", "body": '
    + ('{"a":' * 100_000 + "1" + "}" * 100_000).encode()
    + b"}",
    "100k-deep line": deep(100_000).encode(),
    "unclosed 100k-deep body": b'{"custom_id": "c", "body": ' + b"[" * 100_000,
    "long unsupported url": _line(url="/v1/embeddings/" + MARKER * 50),
    "long part type": json.dumps(
        {
            "custom_id": "c",
            "method": "POST",
            "url": CHAT,
            "body": {"messages": [{"role": "user", "content": [{"type": MARKER * 50}]}]},
        }
    ).encode(),
    "content quoted in old reasons": json.dumps(
        {
            "custom_id": "c",
            "method": "POST",
            "url": CHAT,
            "body": {"messages": [{"role": "user", "content": [{"type": "input_" + MARKER, "x": MARKER}]}]},
        }
    ).encode(),
    "seed 2**70": _line(seed=2**70),
    "seed -2**64": _line(seed=-(2**64)),
    "seed float": _line(seed=1.5),
    "seed string": _line(seed=MARKER),
    "temperature nan": _line().replace(b'"body": {', b'"body": {"temperature": NaN, '),
    "temperature inf": _line().replace(b'"body": {', b'"body": {"temperature": Infinity, '),
    "top_p 1e400": _line().replace(b'"body": {', b'"body": {"top_p": 1e400, '),
    "max_tokens of 5000 digits": _line().replace(
        b'"body": {', b'"body": {"max_tokens": ' + b"9" * 5000 + b", "
    ),
    "max_tokens 2**70": _line(max_tokens=2**70),
    "role list": _line().replace(b'"role": "user"', b'"role": ["user"]'),
    "lone surrogate": _line().replace(b"hi ", b"\\ud800 "),
    "model with a lone surrogate": _line(model="\ud800" + MARKER),
    "non-UTF-8": b"\xff\xfe" + MARKER.encode() + b"\x80",
    "non-UTF-8 in a string": _line().replace(b"hi ", b"\xc3\x28 "),
    "huge line (20 MB)": _line(pad=MARKER * (20 * 2**20 // len(MARKER))),
    "token ids out of range": json.dumps(
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [2**70, -1]}}
    ).encode(),
}


@pytest.mark.parametrize("name", SEEDS)
def test_crashing_lines_fail_alone_and_cleanly(name):
    raw = SEEDS[name]
    fed("seeds")
    lines = read_batch_file(raw + b"\n" + _line("good"))
    assert len(lines) == 2 and isinstance(lines[1], BatchLine)  # the good neighbour survives
    if isinstance(lines[0], BadLine):
        check_message(lines[0].problem)
    clean(parse_batch_file, raw)
    kind = make_kind("chat", {})
    try:
        kind.requests(Document("c", raw), FakeModel())
    except DocumentError as error:
        check_message(error.reason)
        assert kind.failure(error).error == error.reason
    else:
        sealable(kind.result(Document("c", raw), [make_output("ok")]).output)


def test_a_line_over_the_size_bound_is_a_bad_line():
    fed("seeds")
    [line] = read_batch_file(b"x" * (MAX_LINE_BYTES + 1))
    assert (
        isinstance(line, BadLine)
        and line.problem == f"is {MAX_LINE_BYTES + 1} bytes; the limit is {MAX_LINE_BYTES}"
    )


@pytest.mark.parametrize(
    "params",
    [
        {"seed": 2**70},
        {"seed": str(2**70)},
        {"seed": "nan"},
        {"temperature": float("nan")},
        {"temperature": "inf"},
        {"temperature": 10**400},
        {"max_tokens": "9" * 5000},
        {"max_tokens": 2**70},
        {"instructions": MARKER * 300_000},
        {MARKER: 1},
        {"top_p": [MARKER]},
    ],
)
@pytest.mark.parametrize("kind", ["summarize", "code-review", "extract"])
def test_crashing_params_are_clean_param_errors(kind, params):
    fed("seeds")
    params = params | ({"fields": "a"} if kind == "extract" else {})
    result = clean(make_kind, kind, params)
    assert isinstance(result, Exception), "each of these values is out of range"


@pytest.mark.parametrize(
    "text",
    [
        deep(100_000),
        '{"params": ' + deep(100_000) + "}",
        '{"version": ' + "9" * 5000 + "}",
        '{"version": NaN}',
        '{"job_id": "' + MARKER + '\\ud800"}',
        MARKER,
    ],
)
def test_crashing_manifests_are_clean_manifest_errors(text):
    fed("seeds")
    client = generate_identity()
    assert isinstance(clean(verify_manifest, text, b"\x00" * 64, client.public), Exception)


@pytest.mark.parametrize(
    "header",
    [deep(100_000).encode(), b'{"path": "' + MARKER.encode() + b'\\udc80"}', b"\xff" + MARKER.encode()],
)
def test_crashing_payloads_are_clean_envelope_errors(header):
    fed("seeds")
    payload = len(header).to_bytes(4, "big") + header + b"data"
    assert isinstance(clean(unpack_document, payload), Exception)
    assert unpack_document(pack_document("a/" + MARKER, b"data")) == ("a/" + MARKER, b"data")
