"""`enclave gateway`: the gateway's app on uvicorn, bound to a loopback address unless forced otherwise.

The socket is bound here, before uvicorn starts, so that `--port 0` (an ephemeral port, as the tests use)
can be announced, and so that the address is checked once: a non-loopback bind serves opened results to the
network and is refused unless `--allow-remote` is given. The API key lives in `$ENCLAVE_HOME/gateway/
api_key` (0600, made on first start); the OpenAI SDK sends it as `OPENAI_API_KEY`.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from pipeline import client
from pipeline.gateway.routes import create_app
from pipeline.gateway.service import Gateway
from pipeline.gateway.store import GatewayStore
from pipeline.settings import Settings

DEFAULT_PORT = 8787
KEY_FILE = "api_key"


@dataclass(frozen=True)
class Address:
    """Where to listen: the resolved socket address and whether it is a loopback one."""

    family: socket.AddressFamily
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    def url(self, port: int) -> str:
        host = f"[{self.host}]" if self.family == socket.AF_INET6 else self.host
        return f"http://{host}:{port}/v1"


def resolve(host: str, port: int) -> Address:
    """`host` (a name or an address) as the socket address it binds; OSError when it does not resolve."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return Address(family, sockaddr[0], port)


def api_key(folder: Path) -> tuple[str, Path]:
    """The gateway's API key and its file, made (0600) on first use."""
    path = folder / KEY_FILE
    if not path.exists():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another gateway of this home made it first
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(f"sk-enclave-{secrets.token_urlsafe(32)}\n")
    return path.read_text().strip(), path


def listen(address: Address) -> socket.socket:
    """A socket bound to `address` (OSError when it cannot be: in use, not this host's)."""
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # a restart reuses its port at once; on Windows the option lets others share it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address.host, address.port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    settings: Settings,
    address: Address,
    sock: socket.socket,
    max_upload_bytes: int,
    ready: Callable[[str, Path], None],
) -> None:
    """Serve on `sock` until interrupted (SIGINT, SIGTERM); `ready(url, key file)` once it is ready."""
    session = client.ClientSession(settings)
    try:
        store = GatewayStore(settings.home / "gateway", session.identity)
        gateway = Gateway(session, store)
        key, key_file = api_key(store.root)
        app = create_app(gateway, key, max_upload_bytes)
        config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=5)
        gateway.lifecycle.resume()
        ready(address.url(sock.getsockname()[1]), key_file)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        session.close()
        sock.close()
