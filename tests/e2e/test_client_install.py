"""A client-only install (issue 15, acceptance 2): `pip install` of the project without extras, into a
fresh virtual environment, has no torch, triton, SQLAlchemy or Celery, and its `enclave` submits and
fetches a job through `enclave serve` (run, with a worker, from the project's own environment)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from tests.e2e.conftest import NOTES, ROOT, Enclave, _env
from tests.e2e.test_service_api import _announced

SOURCES = ("pyproject.toml", "README.md", "engine", "pipeline", "jobs", "migrations")
ABSENT = ("torch", "triton", "sqlalchemy", "celery", "kombu", "alembic", "psycopg", "numpy")


def client_venv(where: Path) -> Path:
    """A fresh venv with the project installed without extras, from a copy of its sources (no build files
    land in the work tree). pip's cache makes repeats quick; the registry is reached otherwise."""
    src = where / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    venv.create(where / "venv", with_pip=True)
    python = where / "venv" / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        timeout=540,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python


@pytest.mark.slow  # about 30 s with pip's cache warm (installing from the registry is slower)
def test_a_client_only_install_submits_and_fetches_through_enclave_serve(tmp_path, demo_model):
    python = client_venv(tmp_path / "client-install")
    missing = subprocess.run(
        [str(python), "-c", f"import importlib.util as u; print([m for m in {ABSENT!r} if u.find_spec(m)])"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    )
    assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr

    service = Enclave(_env(tmp_path / "service", demo_model, {}), tmp_path / "service", "embedded")
    service.run("init")
    worker = service.start_worker()
    out = tmp_path / "serve.out"
    with open(out, "w") as stdout:
        server = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", "--port", "0"],
            env=service.env,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            cwd=service.tmp,
            start_new_session=True,
        )
    try:
        url = _announced(out, server, "enclave serve: ")
        home = tmp_path / "workstation"
        env = {"PATH": os.environ["PATH"], "ENCLAVE_HOME": str(home), "ENCLAVE_SERVICE_URL": url}
        enclave = [str(python.parent / "enclave")]

        def run(*args: str) -> str:
            proc = subprocess.run(
                enclave + list(args), env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120
            )
            assert proc.returncode == 0, (args, proc.stderr)
            return proc.stdout

        run("keys", "create")
        run("keys", "import-service", str(service.home / "service" / "public.json"))
        service.run("clients", "add", "workstation", str(home / "client" / "public.json"))
        job = json.loads(
            run(
                "submit",
                str(NOTES / "note-01-chest-pain.txt"),
                "--kind",
                "summarize",
                "--param",
                "max_tokens=4",
                "--json",
            )
        )["job_id"]
        deadline = time.monotonic() + 120
        while json.loads(run("status", job, "--json"))["status"] != "completed":
            assert time.monotonic() < deadline, "the job did not complete"
            time.sleep(0.5)
        summary = json.loads(run("results", job, "--out", str(tmp_path / "out"), "--json"))
        assert (summary["documents"], summary["done"]) == (1, 1)
        record = json.loads((tmp_path / "out" / "results.jsonl").read_text())
        assert record["document"] == "note-01-chest-pain.txt" and record["output"]
        assert not list(home.rglob("*.db"))
    finally:
        server.terminate()
        server.wait(timeout=30)
        Enclave.kill(worker)
