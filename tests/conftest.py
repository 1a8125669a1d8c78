import logging
import os
import uuid

import pytest
import torch
from sqlalchemy import create_engine, text

from engine.env import reset_engine_env

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


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
