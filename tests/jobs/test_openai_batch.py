import json

import pytest

from jobs.openai_batch import BatchFileError, output_file, output_line, parse_batch_file, read_batch_file


def line(custom_id="req-1", url="/v1/chat/completions", **extra) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body} | extra


def jsonl(*items) -> bytes:
    return b"".join(
        (item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in items
    )


def test_parse_keeps_order_raw_lines_and_skips_blank_lines():
    data = b"\xef\xbb\xbf" + jsonl(line("a"), b"", b"  ", line("b", url="/v1/embeddings")) + b"\r\n"
    lines = parse_batch_file(data)
    assert [(x.line_no, x.custom_id, x.url) for x in lines] == [
        (1, "a", "/v1/chat/completions"),
        (4, "b", "/v1/embeddings"),
    ]
    assert json.loads(lines[1].raw) == line("b", url="/v1/embeddings")
    assert lines[0].method == "POST" and lines[0].body["model"] == "m"


def test_every_bad_line_is_reported():
    data = jsonl(
        line("req-1"),
        line("req-2"),
        b'{"custom_id": "x", ',
        {k: v for k, v in line("req-4").items() if k != "custom_id"},
        line("req-1"),
        line("req-6", method="GET"),
        line("req-7") | {"body": "text"},
        b"[1, 2]",
        b"\xff\xfe",
        line("") | {"url": 5},
    )
    with pytest.raises(BatchFileError) as caught:
        parse_batch_file(data)
    errors = caught.value.errors
    assert errors == [
        "line 3: is not valid JSON (Expecting property name enclosed in double quotes at offset 19)",
        "line 4: missing field 'custom_id'",
        "line 5: duplicate custom_id (first on line 1)",
        "line 6: method must be POST",
        "line 7: body must be an object, not string",
        "line 8: must be a JSON object, not array",
        "line 9: is not valid UTF-8 (first bad byte at offset 0)",
        "line 10: custom_id must be a non-empty string of at most 512 characters; "
        "url must be a string, not number",
    ]
    message = str(caught.value)
    assert message.startswith("the batch file has 8 problems: line 3: is not valid JSON")
    assert "\n" not in message and len(message) <= 300 and message.endswith(" more)")
    assert "req-1" not in message


def test_read_batch_file_keeps_bad_lines_to_fail_alone():
    deep = b"[" * 100_000 + b"]" * 100_000
    data = jsonl(
        line("a"),
        b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": ' + deep + b"}",
        b"[" * 100_000,
        line("a"),
        line("c", url="/v1/" + "CANARY" * 100),
        line("d") | {"body": {"seed": 2**70}},
        line("e") | {"method": "GET"},
    )
    lines = read_batch_file(data)
    kinds = ["BatchLine", "BadLine", "BadLine", "BadLine", "BatchLine", "BatchLine", "BadLine"]
    assert [type(x).__name__ for x in lines] == kinds
    assert [x.custom_id for x in lines] == ["a", "b", None, None, "c", "d", "e"]
    assert lines[1].problem == "body is nested more than 63 levels deep"
    assert lines[2].problem == "is nested more than 64 levels deep"
    assert lines[3].problem == "duplicate custom_id (first on line 1)"
    assert lines[6].problem == "method must be POST"
    assert lines[5].body == {"seed": 2**70}  # a well-formed line: the seed fails it alone when run


def test_empty_file_is_refused():
    with pytest.raises(BatchFileError, match="the batch file has 1 problem: the file has no requests"):
        parse_batch_file(b"\n \n")


def test_output_line_for_a_done_record():
    body = {"id": "chatcmpl-1", "object": "chat.completion"}
    out = output_line("req-1", {"status": "done", "output": body, "error": None})
    assert out["id"].startswith("batch_req_") and out["custom_id"] == "req-1"
    assert out["response"]["status_code"] == 200 and out["response"]["body"] == body
    assert len(out["response"]["request_id"]) == 32
    assert out["error"] is None


@pytest.mark.parametrize(
    ("output", "code"),
    [
        ({"code": "invalid_request_error"}, "invalid_request_error"),
        ({"code": "invalid_request"}, "invalid_request_error"),  # sealed before codes followed OpenAI
        (None, "processing_error"),
        ("x", "processing_error"),
    ],
)
def test_output_line_for_a_failed_record(output, code):
    out = output_line("req-2", {"status": "failed", "output": output, "error": "boom"})
    assert out["response"] is None
    assert out["error"] == {"code": code, "message": "boom"}
    out = output_line("req-2", {"status": "failed", "output": output, "error": "boom", "detail": "full"})
    assert out["error"] == {"code": code, "message": "full"}


def test_output_file_is_jsonl():
    data = output_file([("a", {"status": "done", "output": {}}), ("b", {"status": "failed", "error": "e"})])
    assert [json.loads(x)["custom_id"] for x in data.splitlines()] == ["a", "b"]
