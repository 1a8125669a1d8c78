"""`enclave init`: the home folder, a migrated database, service keys, a client identity on the allow-list,
a signed head of the audit log and the demo model. Every step is idempotent."""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline import audit, audit_anchor, keys, migrate
from pipeline.db import Database
from pipeline.models import Client
from pipeline.settings import Settings
from pipeline.status import Role


@dataclass(frozen=True)
class InitReport:
    home: Path
    database_url: str
    service_fingerprint: str
    client_fingerprint: str
    model: Path | None  # None: not prepared (`--no-model`, an API or migration host)
    created: tuple[str, ...]


def ensure_model(settings: Settings) -> Path:
    """The model directory to load; the random demo model is written into the home on first use."""
    if settings.model is not None:
        if not (settings.model / "config.json").exists():
            raise FileNotFoundError(f"ENCLAVE_MODEL {settings.model} has no config.json")
        return settings.model
    path = settings.model_path
    if not (path / "config.json").exists():
        from engine.demo_model import write_demo_model  # imports torch: only when the model is written

        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
        write_demo_model(staging)
        try:
            staging.rename(path)
        except OSError:  # another process won the race
            shutil.rmtree(staging, ignore_errors=True)
    return path


def init(settings: Settings, client_name: str | None = None, model: bool = True) -> InitReport:
    """Make the home, migrate the database, create the service keys and this home's client identity (an
    administrator on the allow-list) and, with `model`, the demo model a worker serves."""
    created: list[str] = []
    settings.home.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.home, 0o700)
    db = Database(settings.database_url)
    try:
        before = migrate.current_revision(db.engine)
        migrate.upgrade(db.engine, migrations=settings.migrations)
        if before != migrate.head_revision(settings.migrations):
            created.append("database")
        service = _identity(settings.service_key_dir, settings.passphrase("service"), created, "service keys")
        client = _identity(settings.client_key_dir, settings.passphrase("client"), created, "client identity")
        name = client_name or _login_name()
        with db.transaction() as s:  # this home's own client administers its service
            entry = s.get(Client, client.public.fingerprint)
            if entry is None or entry.role != Role.ADMIN:
                add_client(s, name, client.public, actor=service.public.fingerprint, role=Role.ADMIN)
                created.append("allow-list entry (admin)")
        with db.transaction() as s:  # a signed head from the start, kept in the home: a wiped log then fails
            publish = audit_anchor.publisher(settings)
            audit.checkpoint(
                s, sign=service.sign, key_fingerprint=service.public.fingerprint, publish=publish
            )
    finally:
        db.dispose()
    model_path = ensure_model(settings) if model else None
    return InitReport(
        settings.home,
        settings.database_url,
        service.public.fingerprint,
        client.public.fingerprint,
        model_path,
        tuple(created),
    )


def _login_name() -> str:
    """This machine's user name (the allow-list entry's default name), or "local" when it has none."""
    try:
        return getpass.getuser() or "local"
    except (OSError, KeyError):  # no LOGNAME/USER and no passwd entry (a bare container)
        return "local"


def _identity(directory: Path, secret: bytes | None, created: list[str], label: str) -> keys.Identity:
    if (directory / keys.X25519_FILE).exists():
        return keys.load_identity(directory, secret)
    identity = keys.generate_identity()
    keys.save_identity(identity, directory, secret)
    created.append(label)
    return identity


def add_client(
    session, name: str, public: keys.PublicIdentity, actor: str, role: str = Role.CLIENT
) -> Client:
    """Allow-list a client key with `role` (again, if it was revoked)."""
    client = session.get(Client, public.fingerprint)
    if client is None:
        client = Client(
            fingerprint=public.fingerprint,
            name=name,
            x25519_public=public.x25519,
            ed25519_public=public.ed25519,
            role=role,
        )
        session.add(client)
    else:
        client.revoked_at = None
        client.role = role
    session.flush()
    details = {"client": public.fingerprint, "name": name, "role": str(role)}
    audit.append(session, actor=actor, action=audit.CLIENT_ADDED, details=details)
    return client
