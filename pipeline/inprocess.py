"""The embedded default: with no `ENCLAVE_SERVICE_URL`, a client command runs the service API in its own
process, over this home's database and broker, and talks to it through the same signed HTTP messages as to
a remote `enclave serve` (no socket is opened).

`InProcessTransport` is a synchronous httpx transport that hands each request to the ASGI app on an event
loop in a helper thread (an anyio blocking portal). Responses are read whole, which the API keeps bounded:
uploads and results go a chunk or a page at a time.
"""

from __future__ import annotations

import logging

import anyio.from_thread
import httpx2 as httpx

from pipeline.logs import file_handler
from pipeline.settings import Settings


class InProcessTransport(httpx.BaseTransport):
    """Serves requests with an ASGI app in this process."""

    def __init__(self, app) -> None:
        self._inner = httpx.ASGITransport(app=app)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def call() -> tuple[int, list[tuple[bytes, bytes]], bytes]:
            inner = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            response = await self._inner.handle_async_request(inner)
            return response.status_code, response.headers.raw, await response.aread()

        status, headers, content = self._portal.call(call)
        return httpx.Response(status, headers=headers, content=content, request=request)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._portal_cm.__exit__(None, None, None)


class EmbeddedService:
    """The service API over `settings`' database and broker, and a transport to it; `close()` ends both."""

    BASE_URL = "http://enclave.invalid"  # never resolved: requests go to the app in this process

    def __init__(self, settings: Settings) -> None:
        # the database and broker code: imported in the embedded case only
        from pipeline.api.app import Service, create_app

        _log_to_home(settings)
        self.service = Service(settings)
        self.transport = InProcessTransport(create_app(self.service))

    def close(self) -> None:
        self.transport.close()
        self.service.close()


def _log_to_home(settings: Settings) -> None:
    """The in-process API logs (types and stacks of its internal errors, never messages) to the home's
    logs/enclave.log, as `enclave serve` does to its own log, not onto the command's terminal."""
    logger = logging.getLogger("enclave.api")
    logger.propagate = False
    file = settings.home / "logs" / "enclave.log"
    for handler in list(logger.handlers):
        if getattr(handler, "baseFilename", None) == str(file):
            return
        logger.removeHandler(handler)
        handler.close()
    try:
        handler: logging.Handler = file_handler(settings)  # rotated, in the configured format
    except OSError:  # an unwritable home: the command's own error says so; the API's log is dropped
        handler = logging.NullHandler()
    logger.addHandler(handler)
