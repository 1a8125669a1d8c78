"""Alembic environment: the database URL comes from the caller (`pipeline.migrate`) or `-x url=...`."""

from alembic import context
from sqlalchemy import create_engine

from pipeline.models import Base

config = context.config
url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
if not url:
    raise SystemExit("no database URL: run `enclave db upgrade` or pass `-x url=...`")

connection = config.attributes.get("connection")
if connection is not None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(url)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
