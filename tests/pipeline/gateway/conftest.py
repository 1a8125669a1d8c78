"""A client session on a real SQLite database and broker (no worker: jobs stay queued), and its gateway."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from pipeline import keys, migrate
from pipeline.db import Database
from pipeline.gateway.service import Gateway
from pipeline.gateway.store import GatewayStore
from tests.pipeline.test_submit import make_session


class Clock:
    """A clock the test moves: past a batch's completion window without waiting a day."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def db_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'enclave.db'}"
    db = Database(url)
    migrate.upgrade(db.engine)
    db.dispose()
    return url


@pytest.fixture
def service() -> keys.Identity:
    return keys.generate_identity()


@pytest.fixture
def session(tmp_path, db_url, service):
    s = make_session(tmp_path / "alice", db_url, service, shard_size=2)
    yield s
    s.close()


@pytest.fixture
def gateway(session, clock) -> Gateway:
    return Gateway(session, GatewayStore(session.settings.home / "gateway", session.identity), clock)


def batch_file(n: int, url: str = "/v1/chat/completions") -> bytes:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": url,
            "body": {"messages": [{"role": "user", "content": "x"}]},
        }
        for i in range(n)
    ]
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def until(check: Callable[[], object], timeout: float = 30) -> object:
    """`check()` once it is truthy (the gateway's background steps run in threads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError(f"still not so after {timeout} s")
