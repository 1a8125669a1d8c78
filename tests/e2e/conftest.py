"""End-to-end harness: the real `enclave` CLI and real worker processes, on the embedded back-end (SQLite
database + SQLite broker) and on the servers (PostgreSQL + Redis on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import text

from engine.demo_model import write_demo_model
from pipeline.db import Database

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "pipeline" / "demo_notes"


def _redis_db() -> int:
    """The Redis database these tests own, flushed before and after each test: one per pytest-xdist worker
    (gw0 -> 8 ... gw7 -> 15; 8 without xdist), so that no worker flushes another's broker mid-test."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    if index > 7:
        raise pytest.UsageError("tests/e2e own Redis databases 8-15, one per worker: run at most 8 (-n 8)")
    return 8 + index


REDIS_DB = _redis_db()


class Enclave:
    """Runs `enclave` commands and workers as separate processes with one test's environment."""

    def __init__(self, env: dict[str, str], tmp: Path, backend: str) -> None:
        self.env = env
        self.tmp = tmp
        self.backend = backend
        self.worker_logs: list[str] = []

    def run(
        self, *args: str, check: bool = True, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", *args],
            env=self.env if env is None else env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.tmp,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"enclave {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)

    def submit(self, *args: str) -> str:
        return self.json("submit", *args)["job_id"]

    def work(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """A worker process until nothing is left to do."""
        proc = self.run("worker", "--until-idle", "--concurrency", "2", check=False, timeout=timeout)
        self.worker_logs.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    def start_worker(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"worker-{len(self.worker_logs)}.log", "w")  # noqa: SIM115 (closed by the OS at kill)
        self.worker_logs.append(str(log.name))
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "worker", "--concurrency", "2", *args],
            env=self.env if env is None else env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.tmp,
            start_new_session=True,
        )

    def worker_id(self, pid: int) -> str | None:
        """The lease owner of the worker process `pid` once it registered (`workers.id`), else None."""
        db = self.database()
        try:
            with db.engine.connect() as c:
                return c.execute(
                    text("SELECT id FROM workers WHERE pid = :pid ORDER BY started_at DESC"), {"pid": pid}
                ).scalar()
        except Exception:  # not initialised yet, or busy: not registered as far as we can tell
            return None
        finally:
            db.dispose()

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def database(self) -> Database:
        return Database(self.env.get("ENCLAVE_DATABASE_URL") or f"sqlite:///{self.home / 'enclave.db'}")

    @property
    def home(self) -> Path:
        return Path(self.env["ENCLAVE_HOME"])


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("model"))


def _env(tmp: Path, model: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCLAVE_")}
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(
        ENCLAVE_HOME=str(tmp / "home"),
        ENCLAVE_MODEL=str(model),
        ENCLAVE_DEVICE="cpu",
        ENCLAVE_DTYPE="float32",
        ENCLAVE_LEASE_SECONDS="3",
        ENCLAVE_SHARD_SIZE="2",
        ENCLAVE_METRICS_PORT="0",  # any free port: workers of parallel tests must not share one
        TMPDIR=str(tmp / "tmp"),  # every temporary file of these processes lands here, for the privacy scan
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


@pytest.fixture(params=["embedded", "servers"])
def enclave(request, tmp_path, demo_model) -> Enclave:
    """An initialised Enclave on each back-end."""
    extra: dict[str, str] = {}
    client = None
    if request.param == "servers":
        client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        client.ping()
        client.flushdb()
        extra = {
            "ENCLAVE_DATABASE_URL": request.getfixturevalue("pg_url"),
            "ENCLAVE_BROKER_URL": f"redis://127.0.0.1:6379/{REDIS_DB}",
        }
    e = Enclave(_env(tmp_path, demo_model, extra), tmp_path, request.param)
    e.run("init")
    yield e
    if client is not None:
        client.flushdb()


@pytest.fixture
def embedded(tmp_path, demo_model) -> Enclave:
    """An initialised Enclave on the embedded back-end only."""
    e = Enclave(_env(tmp_path, demo_model, {}), tmp_path, "embedded")
    e.run("init")
    return e
