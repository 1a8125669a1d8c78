"""Apply the Alembic migrations in `migrations/` to a database (the only way the schema changes)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

# The repository's migrations/. An image or a non-editable install sets ENCLAVE_MIGRATIONS
# (Settings.migrations), which the callers pass as `migrations`.
MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"


def _config(engine: Engine, migrations: Path | None) -> Config:
    config = _config_without_engine(migrations)
    config.attributes["url"] = engine.url.render_as_string(hide_password=False)
    return config


def upgrade(engine: Engine, revision: str = "head", migrations: Path | None = None) -> None:
    """Apply the migrations in `migrations` (default: the repository's) up to `revision`."""
    with engine.begin() as connection:
        config = _config(engine, migrations)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def downgrade(engine: Engine, revision: str = "base", migrations: Path | None = None) -> None:
    """Revert the schema to `revision` with the migrations in `migrations` (default: the repository's)."""
    with engine.begin() as connection:
        config = _config(engine, migrations)
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision(migrations: Path | None = None) -> str:
    script = ScriptDirectory.from_config(_config_without_engine(migrations))
    return script.get_current_head() or ""


def _config_without_engine(migrations: Path | None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations or MIGRATIONS))
    return config
