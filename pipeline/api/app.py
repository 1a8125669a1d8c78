"""The service API's Starlette app. Each route is thin: its body read within the size bound, the caller
authenticated from the request's signature, the body parsed into its message, one operation run in a thread
(database work), the answer serialised. Refusals are `{"error": {"code", "message"}}` with their status;
an unexpected error is logged by type and stack only (its message may quote data) and answered 500.

| route | who | does |
|---|---|---|
| `GET /v1/health` | anyone | liveness and the request size bound |
| `GET /metrics` | anyone | Prometheus: requests, jobs, documents, workers, queue depth (counts only) |
| `POST /v1/jobs`, `POST /v1/jobs/{id}/documents`, `POST /v1/jobs/{id}/submit` | clients | a chunked submit |
| `GET /v1/jobs`, `GET /v1/jobs/{id}` | clients | own jobs, one job's status (`id`: or a unique prefix) |
| `POST /v1/jobs/{id}/cancel` | clients | cancel an own job |
| `GET /v1/jobs/{id}/results?after=&limit=&partial=` | clients | sealed, signed results, a page at a time |
| `GET /v1/clients`, `POST /v1/clients`, `POST /v1/clients/{fingerprint}/revoke` | admins | the allow-list |
| `GET /v1/audit?after=&before=&limit=&job=&action=&since=&until=&order=` | admins | the log, page by page |
| `GET /v1/audit/head` | admins | the latest signed tree head |
| `GET /v1/audit/proof?event=`, `GET /v1/audit/consistency?from=` | admins | inclusion, consistency proofs |
| `POST /v1/purge` | admins | purge a job, or every job ended before a cut-off |
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jobs.bounded_json import JSONInputError
from jobs.bounded_json import loads as load_json
from pipeline import keys
from pipeline.api.admin import Admin
from pipeline.api.audit import AuditLog, AuditQuery
from pipeline.api.auth import Authenticator, Caller
from pipeline.api.errors import ApiError, malformed
from pipeline.api.jobs import Dispatcher, Jobs
from pipeline.broker_probe import BrokerProbe
from pipeline.db import Database
from pipeline.errors import database_message, stack_without_message
from pipeline.metrics import ServiceCollector
from pipeline.settings import Settings
from pipeline.wire import messages as m
from pipeline.wire import signing

log = logging.getLogger("enclave.api")
MAX_REQUEST_BYTES = 64 * 2**20  # a chunk of sealed documents, as base64 in JSON
M = TypeVar("M", bound=BaseModel)
Operation = Callable[[Request, Caller, bytes], Awaitable[BaseModel]]


class Service:
    """The API's state: the database, the dispatcher, the operations; closed with `close()`."""

    def __init__(self, settings: Settings, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.settings = settings
        self.max_request_bytes = max_request_bytes
        self.db = Database(settings.database_url)
        self.dispatcher = Dispatcher(settings)
        # Requests must be signed for this service: its fingerprint, from the home's service key.
        self.auth = Authenticator(self.db, keys.load_public(settings.service_key_dir).fingerprint)
        self.jobs = Jobs(self.db, settings, self.dispatcher)
        self.admin = Admin(self.db)
        self.audit = AuditLog(self.db)
        self.metrics = ApiMetrics(self)

    def close(self) -> None:
        self.dispatcher.close()
        self.db.dispose()


class ApiMetrics:
    """The API's Prometheus registry: requests by route template, method and status, their durations, and
    the service's state from the database and the broker (`metrics.ServiceCollector`)."""

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "enclave_api_requests",
            "API requests answered, by route template, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "enclave_api_request_duration_seconds",
            "Seconds to answer an API request, by route template.",
            ["route"],
            registry=self.registry,
        )
        probe = BrokerProbe(service.settings.broker_url)
        timeout = service.settings.worker.heartbeat_timeout
        self.registry.register(ServiceCollector(service.db, probe, timeout))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.seconds.labels(route).observe(seconds)


def create_app(service: Service) -> Starlette:
    """The ASGI app serving `service`."""
    api = _Routes(service)

    def route(path: str, operation: Operation, method: str) -> Route:
        return Route(path, api.signed(path, operation), methods=[method])

    routes = [
        Route("/v1/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        route("/v1/jobs", api.begin, "POST"),
        route("/v1/jobs", api.list_jobs, "GET"),
        route("/v1/jobs/{job}", api.status, "GET"),
        route("/v1/jobs/{job}/documents", api.documents, "POST"),
        route("/v1/jobs/{job}/submit", api.submit, "POST"),
        route("/v1/jobs/{job}/cancel", api.cancel, "POST"),
        route("/v1/jobs/{job}/results", api.results, "GET"),
        route("/v1/clients", api.clients, "GET"),
        route("/v1/clients", api.add_client, "POST"),
        route("/v1/clients/{fingerprint}/revoke", api.revoke, "POST"),
        route("/v1/audit", api.audit, "GET"),
        route("/v1/audit/head", api.audit_head, "GET"),
        route("/v1/audit/proof", api.audit_proof, "GET"),
        route("/v1/audit/consistency", api.audit_consistency, "GET"),
        route("/v1/purge", api.purge, "POST"),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _unrouted})


class _Routes:
    def __init__(self, service: Service) -> None:
        self.service = service

    def signed(self, path: str, operation: Operation) -> Callable[[Request], Awaitable[Response]]:
        """`operation` behind the size bound and the signature check, its refusals as JSON errors; counted
        under its route template `path` (never the request's own path, which holds ids)."""

        async def endpoint(request: Request) -> Response:
            start = time.perf_counter()
            response = await self._answer(request, operation)
            seconds = time.perf_counter() - start
            self.service.metrics.observe(path, request.method, response.status_code, seconds)
            return response

        return endpoint

    async def _answer(self, request: Request, operation: Operation) -> Response:
        try:
            body = await self._body(request)
            target = signing.target_of(
                request.url.path, request.scope.get("query_string", b"").decode("latin-1")
            )
            caller = await run_in_threadpool(
                self.service.auth.authenticate, request.method, target, request.headers, body
            )
            answer = await operation(request, caller, body)
        except ApiError as exc:
            return error(exc)
        except Exception as exc:
            return _unexpected(request, exc)
        return JSONResponse(answer.model_dump(mode="json"))

    async def _body(self, request: Request) -> bytes:
        limit = self.service.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
        return bytes(body)

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            m.Health(max_request_bytes=self.service.max_request_bytes).model_dump(mode="json")
        )

    async def metrics(self, request: Request) -> Response:
        """Prometheus' text format, unsigned like /v1/health: counts and states only, no ids, no content."""
        data = await run_in_threadpool(generate_latest, self.service.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    async def begin(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.jobs.begin, caller, parse(m.BeginUpload, body))

    async def list_jobs(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        limit = _int(request, "limit", 100, 1, 10_000)
        return await run_in_threadpool(self.service.jobs.list_jobs, caller, limit)

    async def status(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.jobs.status, caller, request.path_params["job"])

    async def documents(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        chunk = parse(m.DocumentChunk, body)
        return await run_in_threadpool(
            self.service.jobs.add_documents, caller, request.path_params["job"], chunk
        )

    async def submit(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        finish = parse(m.FinishUpload, body)
        return await run_in_threadpool(self.service.jobs.finish, caller, request.path_params["job"], finish)

    async def cancel(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.jobs.cancel, caller, request.path_params["job"])

    async def results(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        after = _int(request, "after", -1, -1, 2**31) if "after" in request.query_params else None
        limit = _int(request, "limit", 200, 1, m.MAX_ROWS)
        partial = request.query_params.get("partial", "0") == "1"
        job = request.path_params["job"]
        return await run_in_threadpool(self.service.jobs.results, caller, job, after, limit, partial)

    async def clients(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.admin.clients, caller)

    async def add_client(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.admin.add, caller, parse(m.AddClient, body))

    async def revoke(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.admin.revoke, caller, request.path_params["fingerprint"])

    async def audit(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        params = request.query_params
        order = params.get("order", "asc")
        if order not in ("asc", "desc"):
            raise malformed("the query parameter order must be asc or desc")
        query = AuditQuery(
            limit=_int(request, "limit", 1000, 1, 10_000),
            after=_int(request, "after", 0, 0, 2**62),
            before=_int(request, "before", 0, 1, 2**62) if "before" in params else None,
            job=params.get("job"),
            actions=tuple(a for a in params.get("action", "").split(",") if a),
            since=params.get("since"),
            until=params.get("until"),
            newest_first=order == "desc",
        )
        return await run_in_threadpool(self.service.audit.page, caller, query)

    async def audit_head(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.audit.head, caller)

    async def audit_proof(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        event = _int(request, "event", 0, 1, 2**62)
        return await run_in_threadpool(self.service.audit.proof, caller, event)

    async def audit_consistency(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        old_size = _int(request, "from", 0, 1, 2**62)
        return await run_in_threadpool(self.service.audit.consistency, caller, old_size)

    async def purge(self, request: Request, caller: Caller, body: bytes) -> BaseModel:
        return await run_in_threadpool(self.service.admin.purge, caller, parse(m.PurgeRequest, body))


def parse(model: type[M], body: bytes) -> M:
    """`body` as `model`; 400 naming the first bad field (never its value)."""
    try:
        data: Any = load_json(body, "the request body")
    except JSONInputError as exc:
        raise malformed(f"the request body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"]) or "the body"
        raise malformed(f"the request body is refused: {where}: {first['msg']}") from None


def error(exc: ApiError) -> JSONResponse:
    body = m.ErrorEnvelope(error=m.ErrorBody(code=exc.code, message=exc.message))
    return JSONResponse(body.model_dump(mode="json"), status_code=exc.status)


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    if not value.lstrip("-").isdigit() or not low <= int(value) <= high:
        raise malformed(f"the query parameter {name} must be a whole number between {low} and {high}")
    return int(value)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "too_large", f"the request body is larger than the service's limit of {limit} bytes")


def _unexpected(request: Request, exc: Exception) -> Response:
    if type(exc).__module__.startswith("sqlalchemy"):
        log.error("database error on %s %s: %s", request.method, request.url.path, stack_without_message(exc))
        return error(ApiError(503, "unavailable", database_message(exc)))
    log.error("internal error on %s %s: %s", request.method, request.url.path, stack_without_message(exc))
    return error(ApiError(500, "internal", "internal error in the service; its log has the stack trace"))


async def _unrouted(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    code = "not_found" if status == 404 else "method_not_allowed"
    return error(ApiError(status, code, f"no route {request.method} {request.url.path}"))
