"""The gateway's HTTP surface: a Starlette app with OpenAI's routes under `/v1`.

| route | does |
|---|---|
| `POST /v1/files` | upload a batch input file (multipart: `file`, `purpose=batch`) |
| `GET /v1/files`, `GET /v1/files/{id}`, `DELETE /v1/files/{id}` | list (cursor), retrieve, delete |
| `GET /v1/files/{id}/content` | the file, opened here one line at a time |
| `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}` | create, list (cursor), retrieve |
| `POST /v1/batches/{id}/cancel` | cancel |

Every request carries the gateway's API key as its Bearer token (`OPENAI_API_KEY`): on a shared workstation
the loopback address alone would let another local user read opened results. Bodies are read within bounds
and held in memory: an upload never spills into a temporary file (Starlette's multipart parser is given a
spool as large as the bound, so its in-memory file never rolls over to disk). Errors are OpenAI's envelope;
an unexpected one is logged by type and stack only (its message may quote data) and answered 500.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jobs.bounded_json import JSONInputError
from jobs.bounded_json import loads as load_json
from pipeline.errors import stack_without_message
from pipeline.gateway import errors
from pipeline.gateway.errors import GatewayError, bad_request
from pipeline.gateway.models import (
    COMPLETION_WINDOW,
    ENDPOINTS,
    METADATA_KEY,
    METADATA_PAIRS,
    METADATA_VALUE,
    CreateBatch,
)
from pipeline.gateway.service import Gateway

log = logging.getLogger("enclave.gateway")
MAX_UPLOAD_BYTES = 200 * 2**20  # OpenAI's limit for a batch input file
FORM_OVERHEAD = 64 * 2**10  # multipart boundaries and part headers, the purpose field
MAX_JSON_BYTES = 2**20  # a create request: ids, an endpoint and at most 16 short metadata pairs
NO_RETRY = {"x-should-retry": "false"}  # the OpenAI SDK retries a 409 unless told not to
Handler = Callable[[Request], Awaitable[BaseModel | Response]]


class _TooLarge(MultiPartException):
    """The body went past its bound (a MultiPartException, so the parser closes its files)."""


def create_app(gateway: Gateway, api_key: str, max_upload_bytes: int = MAX_UPLOAD_BYTES) -> Starlette:
    """The ASGI app serving `gateway` to requests that carry `api_key`."""
    api = _Api(gateway, api_key, max_upload_bytes)
    routes = [
        Route("/v1/files", api.endpoint(api.upload), methods=["POST"]),
        Route("/v1/files", api.endpoint(api.list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", api.endpoint(api.retrieve_file), methods=["GET"]),
        Route("/v1/files/{file_id}", api.endpoint(api.delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", api.endpoint(api.file_content), methods=["GET"]),
        Route("/v1/batches", api.endpoint(api.create_batch), methods=["POST"]),
        Route("/v1/batches", api.endpoint(api.list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", api.endpoint(api.retrieve_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", api.endpoint(api.cancel_batch), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _unrouted})


class _Api:
    def __init__(self, gateway: Gateway, api_key: str, max_upload_bytes: int) -> None:
        self.gateway = gateway
        self.key = api_key.encode()
        self.max_upload = max_upload_bytes

    def endpoint(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """`handler` behind the API key check, its answer as JSON, its refusals as OpenAI's envelope."""

        async def endpoint(request: Request) -> Response:
            try:
                self._authorize(request)
                answer = await handler(request)
            except GatewayError as exc:
                return _error(exc)
            except Exception as exc:
                log.error(
                    "internal error on %s %s: %s",
                    request.method,
                    request.url.path,
                    stack_without_message(exc),
                )
                return _error(errors.internal())
            return answer if isinstance(answer, Response) else JSONResponse(answer.model_dump(mode="json"))

        return endpoint

    def _authorize(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise GatewayError(
                401,
                "You didn't provide an API key: send the gateway's key (its file is named by `enclave "
                "gateway`) as a Bearer token, e.g. OPENAI_API_KEY.",
            )
        if not hmac.compare_digest(token.strip().encode(), self.key):
            raise GatewayError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def upload(self, request: Request) -> BaseModel:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("Expected a multipart/form-data body with the fields 'file' and 'purpose'.")
        bound = self.max_upload + FORM_OVERHEAD
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > bound:
            raise self._too_large()
        parser = MultiPartParser(
            request.headers, _bounded(request.stream(), bound), max_files=1, max_fields=8, max_part_size=4096
        )
        parser.spool_max_size = bound  # the file stays in memory: it can never grow past the bound
        try:
            form = await parser.parse()
        except _TooLarge:
            raise self._too_large() from None
        except MultiPartException as exc:
            raise bad_request(f"The multipart body is malformed: {exc.message}", "file") from None
        try:
            fields = dict(form.multi_items())
            if unknown := sorted(set(fields) - {"file", "purpose"}):
                raise errors.unknown_parameter(unknown[0])
            upload, purpose = fields.get("file"), fields.get("purpose")
            if not isinstance(upload, UploadFile):
                raise errors.missing("file")
            if not isinstance(purpose, str):
                raise errors.missing("purpose")
            data = await upload.read()
        finally:
            await form.close()
        if len(data) > self.max_upload:
            raise self._too_large()
        return await run_in_threadpool(self.gateway.upload, purpose, upload.filename or "upload.jsonl", data)

    async def list_files(self, request: Request) -> BaseModel:
        query = request.query_params
        limit = _int_param(query.get("limit"), "limit", 10_000, 1, 10_000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise errors.invalid_value("order", "expected 'asc' or 'desc'")
        args = (query.get("purpose"), query.get("after"), limit, order)
        return await run_in_threadpool(self.gateway.files, *args)

    async def retrieve_file(self, request: Request) -> BaseModel:
        return await run_in_threadpool(self.gateway.file, request.path_params["file_id"])

    async def delete_file(self, request: Request) -> BaseModel:
        return await run_in_threadpool(self.gateway.delete, request.path_params["file_id"])

    async def file_content(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        lines = await run_in_threadpool(self.gateway.content, file_id)
        return StreamingResponse(_logged(lines, file_id), media_type="application/octet-stream")

    async def create_batch(self, request: Request) -> BaseModel:
        body = await _json_body(request)
        return await run_in_threadpool(self.gateway.create, create_request(body))

    async def list_batches(self, request: Request) -> BaseModel:
        query = request.query_params
        limit = _int_param(query.get("limit"), "limit", 20, 1, 100)
        return await run_in_threadpool(self.gateway.batches, query.get("after"), limit)

    async def retrieve_batch(self, request: Request) -> BaseModel:
        return await run_in_threadpool(self.gateway.batch, request.path_params["batch_id"])

    async def cancel_batch(self, request: Request) -> BaseModel:
        return await run_in_threadpool(self.gateway.cancel, request.path_params["batch_id"])

    def _too_large(self) -> GatewayError:
        return GatewayError(
            413,
            f"The file is larger than the gateway's limit of {self.max_upload} bytes.",
            param="file",
            code="file_too_large",
        )


def create_request(body: Any) -> CreateBatch:
    """The body of `POST /v1/batches`, checked as OpenAI checks it; each refusal names its parameter."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_type")
    try:
        request = CreateBatch.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else "body"
        if first["type"] == "missing":
            raise errors.missing(param) from None
        if first["type"] == "extra_forbidden":
            raise errors.unknown_parameter(param) from None
        expected = "an object of string values" if param == "metadata" else "a string"
        raise errors.invalid_type(param, expected) from None
    if request.endpoint not in ENDPOINTS:
        raise errors.invalid_value("endpoint", f"supported values are {' and '.join(map(repr, ENDPOINTS))}")
    if request.completion_window != COMPLETION_WINDOW:
        raise errors.invalid_value("completion_window", f"the only supported value is '{COMPLETION_WINDOW}'")
    metadata = request.metadata or {}
    if len(metadata) > METADATA_PAIRS or any(
        len(k) > METADATA_KEY or len(v) > METADATA_VALUE for k, v in metadata.items()
    ):
        raise errors.invalid_value(
            "metadata",
            f"at most {METADATA_PAIRS} pairs, keys of at most {METADATA_KEY} characters and values of at "
            f"most {METADATA_VALUE}",
        )
    return request


async def _json_body(request: Request) -> Any:
    raw = b""
    async for chunk in _bounded(request.stream(), MAX_JSON_BYTES):
        raw += chunk
    try:
        return load_json(raw, "the request body")
    except JSONInputError as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}") from None


async def _bounded(stream: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """`stream`, refused with `_TooLarge` as soon as it passes `limit` bytes."""
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total > limit:
            raise _TooLarge(f"the body is larger than {limit} bytes")
        yield chunk


def _int_param(value: str | None, name: str, default: int, low: int, high: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or not low <= int(value) <= high:
        raise errors.invalid_value(name, f"expected a whole number between {low} and {high}")
    return int(value)


def _logged(lines: Iterator[bytes], file_id: str) -> Iterator[bytes]:
    """`lines`; a failure mid-way is logged by type and stack, and ends the response with a content-free
    error (the client sees a cut connection)."""
    try:
        yield from lines
    except Exception as exc:
        log.error("reading %s failed: %s", file_id, stack_without_message(exc))
        raise RuntimeError(f"reading {file_id} failed") from None


def _error(exc: GatewayError) -> JSONResponse:
    headers = NO_RETRY if exc.status < 500 else None
    return JSONResponse(exc.envelope().model_dump(mode="json"), status_code=exc.status, headers=headers)


async def _unrouted(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    message = f"Invalid URL ({request.method} {request.url.path})"
    return _error(GatewayError(status, message))
