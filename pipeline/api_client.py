"""The service API's client: every call signed with this home's client key (`pipeline.wire.signing`), each
answer parsed into its message (`pipeline.wire.messages`), each refusal one `ServiceError` line.

`connect(settings, identity, service)` talks to `ENCLAVE_SERVICE_URL` when it is set (https with the system's
trust store, or `ENCLAVE_SERVICE_CA`), else to the same API run in this process over the home's database and
broker (`pipeline.inprocess`). Nothing here imports a database driver, a broker or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

import httpx2 as httpx
from pydantic import BaseModel, ValidationError

from pipeline.errors import UserError
from pipeline.keys import Identity
from pipeline.settings import Settings
from pipeline.wire import messages as m
from pipeline.wire import signing

M = TypeVar("M", bound=BaseModel)
TIMEOUT = httpx.Timeout(120.0, connect=10.0)


class ServiceError(UserError):
    """The service refused a request: its HTTP status, its code and its one-line reason."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"the service refused the request ({status} {code}): {message}")
        self.status = status
        self.code = code
        self.reason = message


class NotFound(ServiceError):
    """404: no such job for this client (none by that id, or another client's)."""


class Unreachable(UserError):
    """The service did not answer (down, wrong URL, TLS failure)."""


class SignedAuth(httpx.Auth):
    """Adds the signature headers of `identity`, for the service whose fingerprint is `service`, to every
    request."""

    requires_request_body = True

    def __init__(self, identity: Identity, service: str) -> None:
        self.identity = identity
        self.service = service

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = signing.target_of(request.url.path, request.url.query.decode("ascii"))
        headers = signing.sign(self.identity, self.service, request.method, target, request.content)
        request.headers.update(headers)
        yield request


class ServiceClient:
    """The API's routes as methods: one signed request each, answers as messages."""

    def __init__(self, http: httpx.Client, where: str, on_close: Callable[[], None] | None = None) -> None:
        self.http = http
        self.where = where  # for errors: the URL, or "the in-process service"
        self._on_close = on_close

    def close(self) -> None:
        self.http.close()
        if self._on_close is not None:
            self._on_close()

    def health(self) -> m.Health:
        return self._call("GET", "/v1/health", m.Health)

    def begin(self, request: m.BeginUpload) -> m.UploadClaim:
        return self._call("POST", "/v1/jobs", m.UploadClaim, request)

    def add_documents(self, job_id: str, chunk: m.DocumentChunk) -> m.ChunkStored:
        return self._call("POST", f"/v1/jobs/{job_id}/documents", m.ChunkStored, chunk)

    def finish(self, job_id: str, request: m.FinishUpload) -> m.Submitted:
        return self._call("POST", f"/v1/jobs/{job_id}/submit", m.Submitted, request)

    def jobs(self, limit: int = 100) -> m.JobList:
        return self._call("GET", "/v1/jobs", m.JobList, params={"limit": limit})

    def job(self, ref: str) -> m.JobInfo:
        return self._call("GET", f"/v1/jobs/{_segment(ref)}", m.JobInfo)

    def cancel(self, ref: str) -> m.Cancelled:
        return self._call("POST", f"/v1/jobs/{_segment(ref)}/cancel", m.Cancelled)

    def results_page(self, ref: str, after: int | None, limit: int, partial: bool) -> m.ResultsPage:
        params = {"limit": limit, "partial": int(partial)} | ({} if after is None else {"after": after})
        return self._call("GET", f"/v1/jobs/{_segment(ref)}/results", m.ResultsPage, params=params)

    def clients(self) -> m.ClientList:
        return self._call("GET", "/v1/clients", m.ClientList)

    def add_client(self, request: m.AddClient) -> m.ClientInfo:
        return self._call("POST", "/v1/clients", m.ClientInfo, request)

    def revoke(self, fingerprint: str) -> m.ClientInfo:
        return self._call("POST", f"/v1/clients/{_segment(fingerprint)}/revoke", m.ClientInfo)

    def purge(self, request: m.PurgeRequest) -> m.PurgeReport:
        return self._call("POST", "/v1/purge", m.PurgeReport, request)

    def audit(
        self,
        *,
        after: int = 0,
        before: int | None = None,
        limit: int = 1000,
        job: str | None = None,
        actions: tuple[str, ...] = (),
        since: str | None = None,
        until: str | None = None,
        newest_first: bool = False,
    ) -> m.AuditPage:
        """A page of the audit log; `after` (oldest first) or `before` (newest first) is the cursor."""
        given = {"before": before, "job": job, "action": ",".join(actions), "since": since, "until": until}
        params = {"after": after, "limit": limit, "order": "desc" if newest_first else "asc"}
        params |= {name: value for name, value in given.items() if value}
        return self._call("GET", "/v1/audit", m.AuditPage, params=params)

    def audit_head(self) -> m.TreeHead:
        return self._call("GET", "/v1/audit/head", m.TreeHead)

    def audit_proof(self, event: int) -> m.AuditProof:
        return self._call("GET", "/v1/audit/proof", m.AuditProof, params={"event": event})

    def audit_consistency(self, old_size: int) -> m.AuditConsistency:
        return self._call("GET", "/v1/audit/consistency", m.AuditConsistency, params={"from": old_size})

    def _call(
        self,
        method: str,
        path: str,
        answer: type[M],
        body: BaseModel | None = None,
        params: dict | None = None,
    ) -> M:
        content = body.model_dump_json().encode() if body is not None else b""
        try:
            response = self.http.request(method, path, content=content, params=params)
        except httpx.TransportError as exc:
            raise Unreachable(
                f"cannot reach the service at {self.where} ({type(exc).__name__}): {exc}"
            ) from None
        if response.status_code >= 400:
            raise _refusal(response)
        try:
            return answer.model_validate_json(response.content)
        except ValidationError:
            raise UserError(
                f"the service at {self.where} answered {method} {path} with something that is not an Enclave "
                "answer: is ENCLAVE_SERVICE_URL right?"
            ) from None


def _segment(value: str) -> str:
    """`value` as one path segment: refused (as a user error) if it holds anything but id characters."""
    if not value or not all(c.isalnum() or c == "-" for c in value):
        raise UserError(f"{value[:64]!r} is not a job id or fingerprint (letters, digits and '-' only)")
    return value


def _refusal(response: httpx.Response) -> ServiceError:
    try:
        body = m.ErrorEnvelope.model_validate_json(response.content).error
        code, message = body.code, " ".join(body.message.split())
    except ValidationError:
        code, message = "http_error", f"HTTP {response.status_code} without an Enclave error body"
    cls = NotFound if response.status_code == 404 else ServiceError
    return cls(response.status_code, code, message)


def connect(settings: Settings, identity: Identity, service: str) -> ServiceClient:
    """A client of `settings.service_url` signing as `identity` for the service whose fingerprint is
    `service` (the key this home imported); without a URL, of the API in this process."""
    auth = SignedAuth(identity, service)
    if settings.service_url:
        verify = str(settings.service_ca) if settings.service_ca else True
        http = httpx.Client(base_url=settings.service_url, auth=auth, timeout=TIMEOUT, verify=verify)
        return ServiceClient(http, settings.service_url)
    from pipeline.inprocess import EmbeddedService  # the database and broker: only without a URL

    embedded = EmbeddedService(settings)
    http = httpx.Client(base_url=embedded.BASE_URL, auth=auth, transport=embedded.transport, timeout=TIMEOUT)
    return ServiceClient(http, "the in-process service (no ENCLAVE_SERVICE_URL)", embedded.close)
