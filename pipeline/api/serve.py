"""`enclave serve`: the service API on uvicorn. The socket is bound here, before uvicorn starts, so that
`--port 0` can be announced and a bad address is one line. Plain HTTP is served on loopback addresses only,
unless `--allow-http` says a TLS-terminating proxy stands in front; with `--cert` and `--key` it is HTTPS.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from pipeline.api.app import Service, create_app
from pipeline.settings import Settings


class ServeError(ValueError):
    """The address cannot be served: it does not resolve, cannot be bound, or needs TLS."""


@dataclass(frozen=True)
class Address:
    family: socket.AddressFamily
    host: str
    tls: bool

    def url(self, port: int) -> str:
        host = f"[{self.host}]" if self.family == socket.AF_INET6 else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{port}"


def listen(host: str, port: int, tls: bool, allow_http: bool) -> tuple[socket.socket, Address]:
    """A listening socket for `host`:`port` and its address; `ServeError` (one line) when it cannot be."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        raise ServeError(f"cannot resolve --host {host!r}") from None
    address = Address(family, sockaddr[0], tls)
    if not (tls or allow_http or ipaddress.ip_address(address.host).is_loopback):
        raise ServeError(
            f"refusing plain HTTP on {address.host}: give --cert and --key (TLS), or --allow-http behind a "
            "proxy that terminates TLS"
        )
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address.host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {address.host}:{port}: {exc.strerror or type(exc).__name__}"
        ) from None
    return sock, address


def serve(
    settings: Settings,
    sock: socket.socket,
    address: Address,
    cert: Path | None,
    key: Path | None,
    max_request_bytes: int,
    ready: Callable[[str], None],
) -> None:
    """Serve the API on `sock` until interrupted (SIGINT, SIGTERM); `ready(url)` once it listens."""
    service = Service(settings, max_request_bytes)
    try:
        tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)} if cert and key else {}
        config = uvicorn.Config(
            create_app(service), log_config=None, lifespan="off", timeout_graceful_shutdown=5, **tls
        )
        server = uvicorn.Server(config)
        ready(address.url(sock.getsockname()[1]))
        server.run(sockets=[sock])
    finally:
        service.close()
        sock.close()
