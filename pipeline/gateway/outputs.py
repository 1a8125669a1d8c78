"""Opened result records (`pipeline.client.iter_results`, one at a time) -> the lines of a batch's output
and error files, in OpenAI's format: `{"id": "batch_req_...", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`.

- A document done: `response` 200 with the completion as `body`, in the output file.
- A document failed: in the error file, as the HTTP answer OpenAI gives such a request: 400 with an
  `invalid_request_error` body for bad request content (refused at submit or by the worker), 500 with a
  `server_error` body for anything else. The message is the submitter's full reason (the sealed `detail`
  when there is one), opened here.
- A document never run: `response` null and `error` `{code, message}`: `batch_cancelled` or
  `batch_expired` (OpenAI's codes); `result_refused` (Enclave's) for a result whose service signature did
  not verify.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from jobs.base import INVALID_REQUEST
from pipeline.gateway.models import BatchUsage, LineError, OutputLine, Response
from pipeline.results_files import REFUSED_CODE

BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"
_NEVER_RUN = {
    BATCH_CANCELLED: "The batch was cancelled before this request executed.",
    BATCH_EXPIRED: "This request could not be executed before the completion window expired.",
}


@dataclass
class Split:
    """The lines of the output file and of the error file, and the tokens the done requests used."""

    output: list[OutputLine] = field(default_factory=list)
    errors: list[OutputLine] = field(default_factory=list)
    usage: BatchUsage = field(default_factory=BatchUsage)


def split_records(records: Iterable[dict[str, Any]], unrun_code: str) -> Split:
    """Each record as a line of the output or the error file; `unrun_code` names documents never run."""
    split = Split()
    split.usage = route_records(records, unrun_code, split.output.append, split.errors.append)
    return split


def route_records(
    records: Iterable[dict[str, Any]],
    unrun_code: str,
    output: Callable[[OutputLine], None],
    error: Callable[[OutputLine], None],
) -> BatchUsage:
    """Hand each record, as it comes, to `output` (done) or `error` (the rest) as its line; the tokens the
    done requests used. Nothing is held: a job's results stream from the service into the files."""
    usage = BatchUsage()
    for record in records:
        line = output_line(record, unrun_code)
        if record["status"] == "done":
            output(line)
            _add_usage(usage, record.get("usage"))
        else:
            error(line)
    usage.total_tokens = usage.input_tokens + usage.output_tokens
    return usage


def output_line(record: dict[str, Any], unrun_code: str) -> OutputLine:
    """One record as an output or error line (`record["document"]` is the request's custom_id)."""
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": record["document"]}
    status = record["status"]
    if status == "done":
        return OutputLine(**line, response=_response(200, record.get("output") or {}), error=None)
    if status == "failed":
        output = record.get("output")
        code = output.get("code") if isinstance(output, dict) else None
        message = record.get("detail") or record.get("error") or "the request failed"
        message = message.removeprefix(f"{code}: ") if isinstance(code, str) else message
        # Refused by the worker (the chat kind's output says 400, with OpenAI's type, param and code) or at
        # submit (code invalid_request_error): OpenAI's 400 answer; anything else a 500.
        refused = isinstance(output, dict) and output.get("status_code") == 400
        invalid = refused or code == INVALID_REQUEST
        kind = INVALID_REQUEST if invalid else "server_error"
        error = {"message": message, "type": kind, "param": None, "code": None}
        if refused:
            error |= {"type": output.get("type") or kind, "param": output.get("param"), "code": code}
        return OutputLine(**line, response=_response(400 if invalid else 500, {"error": error}), error=None)
    if status == "refused":
        message = record.get("error") or "the result was refused"
        return OutputLine(**line, response=None, error=LineError(code=REFUSED_CODE, message=message))
    return OutputLine(**line, response=None, error=LineError(code=unrun_code, message=_NEVER_RUN[unrun_code]))


def _response(status_code: int, body: dict[str, Any]) -> Response:
    return Response(status_code=status_code, request_id=uuid.uuid4().hex, body=body)


def _add_usage(usage: BatchUsage, used: Any) -> None:
    if isinstance(used, dict):
        usage.input_tokens += int(used.get("prompt_tokens") or 0)
        usage.output_tokens += int(used.get("completion_tokens") or 0)
