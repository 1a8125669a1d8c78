"""Apply the Alembic migrations in `migrations/` to a database (the only way the schema changes)."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

# The repository's migrations/ (an image or a non-editable install points ENCLAVE_MIGRATIONS at its copy).
MIGRATIONS = Path(os.environ.get("ENCLAVE_MIGRATIONS") or Path(__file__).resolve().parents[1] / "migrations")


def _config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["url"] = engine.url.render_as_string(hide_password=False)
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    with engine.begin() as connection:
        config = _config(engine)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    with engine.begin() as connection:
        config = _config(engine)
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    script = ScriptDirectory.from_config(_config_without_engine())
    return script.get_current_head() or ""


def _config_without_engine() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config
