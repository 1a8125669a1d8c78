"""Fixtures for the pipeline: real SQLite files and a real PostgreSQL (see tests/conftest.py)."""

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'enclave.db'}"
    return request.getfixturevalue("pg_url")
