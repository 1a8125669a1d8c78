import logging
import os
import uuid

import pytest
import torch
from sqlalchemy import create_engine, text

from engine.env import reset_engine_env

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs pytest-xdist workers, one per core: each gets its share of the cores for torch, and so do
# the engine workers the end-to-end tests start (OMP_NUM_THREADS, inherited), or they would fight for them.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
TORCH_THREADS = max(1, min(4, (os.cpu_count() or 1) // XDIST_WORKERS))
torch.set_num_threads(TORCH_THREADS)
if XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(TORCH_THREADS))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller picks how to spread the tests
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.scheduling import FolderGroupScheduling

    return FolderGroupScheduling(config, log)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield


@pytest.fixture(autouse=True)
def _fresh_engine_env():
    """Each test reads the engine's variables afresh (a test's monkeypatch.setenv takes effect)."""
    reset_engine_env()
    yield
    reset_engine_env()


PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def postgres_available() -> bool:
    try:
        engine = create_engine(PG_ADMIN_URL)
        with engine.connect():
            pass
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture
def pg_url():
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    if not postgres_available():
        pytest.fail("PostgreSQL at 127.0.0.1:5432 is not reachable (.ci/run starts it)")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    yield f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    with admin.begin() as c:
        c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()
