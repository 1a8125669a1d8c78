"""Result records -> lines of the output and error files, in OpenAI's `BatchRequestOutput` format."""

import pytest
from openai.types.chat import ChatCompletion

from pipeline.gateway.outputs import BATCH_CANCELLED, BATCH_EXPIRED, split_records

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
}


def records() -> list[dict]:
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    return [
        {"document": "done", "status": "done", "output": COMPLETION, "error": None, "usage": usage},
        {
            "document": "bad",
            "status": "failed",
            "output": {"code": "invalid_request_error"},
            "error": "invalid_request_error: body.n must be 1",
            "detail": "n=2 asked",
        },
        {
            "document": "submit",
            "status": "failed",
            "output": {"code": "invalid_request_error"},
            "error": "invalid_request_error: line 3: missing field 'body'",
        },
        {
            "document": "crash",
            "status": "failed",
            "output": {"code": "processing_error"},
            "error": "worker_crashed",
        },
        {"document": "old", "status": "failed", "output": None, "error": "gave up"},
        {"document": "late", "status": "cancelled", "output": None, "error": None},
        {"document": "forged", "status": "refused", "output": None, "error": "result of document 7 refused"},
    ]


def test_each_record_becomes_a_line_of_the_right_file():
    split = split_records(records(), BATCH_CANCELLED)
    assert [x.custom_id for x in split.output] == ["done"]
    lines = {x.custom_id: x.model_dump(mode="json") for x in split.output + split.errors}
    assert all(
        set(x) == {"id", "custom_id", "response", "error"} and x["id"].startswith("batch_req_")
        for x in lines.values()
    )
    done = lines["done"]["response"]
    assert done["status_code"] == 200 and done["request_id"] and lines["done"]["error"] is None
    ChatCompletion.model_validate(done["body"])
    for name, status, kind, message in [
        ("bad", 400, "invalid_request_error", "n=2 asked"),  # the sealed detail, opened on the client
        ("submit", 400, "invalid_request_error", "line 3: missing field 'body'"),
        ("crash", 500, "server_error", "worker_crashed"),
        ("old", 500, "server_error", "gave up"),
    ]:
        response = lines[name]["response"]
        assert (response["status_code"], lines[name]["error"]) == (status, None)
        assert response["body"] == {"error": {"message": message, "type": kind, "param": None, "code": None}}
    assert lines["late"]["response"] is None and lines["late"]["error"]["code"] == "batch_cancelled"
    assert lines["forged"]["error"] == {"code": "result_refused", "message": "result of document 7 refused"}
    assert split.usage.input_tokens == 5 and split.usage.output_tokens == 2 and split.usage.total_tokens == 7


@pytest.mark.parametrize("code", [BATCH_CANCELLED, BATCH_EXPIRED])
def test_requests_never_run_carry_the_batch_code(code):
    [line] = split_records([{"document": "x", "status": "cancelled", "output": None}], code).errors
    assert line.response is None and line.error.code == code and line.error.message
