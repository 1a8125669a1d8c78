"""Each worker's small HTTP server: `/metrics` (Prometheus' text format, from the worker's registry) and
`/healthz` (200 while the worker takes tasks, 503 while it starts or once it is unhealthy, with a JSON body of
its state). It serves ids-free, content-free numbers only; bind it to loopback unless a Prometheus on another
host scrapes it (`ENCLAVE_METRICS_HOST`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: no access log
        pass


class MetricsServer:
    """Serves `registry` and `health()` (a dict with a boolean `ready`) on `host`:`port` (0: a free one)."""

    def __init__(self, registry: CollectorRegistry, health: Callable[[], dict], host: str, port: int) -> None:
        self.metrics = make_wsgi_app(registry)
        self.health = health
        self.server = make_server(host, port, self._app, server_class=_Server, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self.server.serve_forever, name="enclave-metrics", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self.metrics(environ, start_response)
        if path == "/healthz":
            state = self.health()
            status = "200 OK" if state.get("ready") else "503 Service Unavailable"
            body = json.dumps(state).encode()
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"/metrics or /healthz\n"]
