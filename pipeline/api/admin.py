"""Administrators' operations: the allow-list (list, add, revoke) and purging jobs (`pipeline/purge.py`);
the audit log's are in `audit.py`. Only callers with the `admin` role reach them (403 otherwise); each change
is audited with the administrator as actor."""

from __future__ import annotations

from sqlalchemy import select

from pipeline import audit, keys, purge
from pipeline.api.auth import Caller
from pipeline.api.errors import ApiError, conflict, malformed
from pipeline.db import Database
from pipeline.home import add_client
from pipeline.models import Client, Job, utcnow
from pipeline.wire import messages as m


def _info(client: Client) -> m.ClientInfo:
    return m.ClientInfo(
        name=client.name,
        fingerprint=client.fingerprint,
        role=client.role,
        created_at=client.created_at,
        revoked_at=client.revoked_at,
    )


class Admin:
    """The administrators' routes' operations."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    def check(caller: Caller) -> None:
        if not caller.admin:
            raise ApiError(
                403, "forbidden", "this needs an administrator's key (role admin on the allow-list)"
            )

    def clients(self, caller: Caller) -> m.ClientList:
        self.check(caller)
        with self.db.transaction() as s:
            rows = s.scalars(select(Client).order_by(Client.created_at, Client.fingerprint)).all()
            return m.ClientList(clients=[_info(c) for c in rows])

    def add(self, caller: Caller, request: m.AddClient) -> m.ClientInfo:
        self.check(caller)
        try:
            public = keys.PublicIdentity(x25519=request.x25519, ed25519=request.ed25519)
        except keys.KeyFileError as exc:
            raise malformed(f"the client's public keys are refused: {exc}") from None
        with self.db.transaction() as s:
            return _info(add_client(s, request.name, public, actor=caller.fingerprint, role=request.role))

    def revoke(self, caller: Caller, fingerprint: str) -> m.ClientInfo:
        self.check(caller)
        prefix = fingerprint.strip().lower()
        with self.db.transaction() as s:
            matches = s.scalars(
                select(Client).where(Client.fingerprint.startswith(prefix, autoescape=True)).limit(2)
            ).all()
            if len(matches) != 1 or not prefix:
                raise ApiError(
                    404 if not matches else 400,
                    "not_found" if not matches else "ambiguous_client",
                    f"{len(matches)} clients match {prefix[:64]!r}; give more of the fingerprint",
                )
            client = matches[0]
            client.revoked_at = utcnow()
            audit.append(
                s,
                actor=caller.fingerprint,
                action=audit.CLIENT_REVOKED,
                details={"client": client.fingerprint},
            )
            return _info(client)

    def purge(self, caller: Caller, request: m.PurgeRequest) -> m.PurgeReport:
        """Purge one job (any client's) or every job ended before the cut-off; each purge is audited."""
        self.check(caller)
        if request.job is not None:
            try:
                done = [purge.purge_job(self.db, self._job(request.job), caller.fingerprint)]
            except purge.PurgeRefused as exc:
                raise conflict(str(exc)) from None
        else:
            done = purge.purge_older_than(self.db, request.older_than_seconds, caller.fingerprint)
        jobs = [m.PurgedJob(job_id=p.job_id, documents=p.documents, results=p.results) for p in done]
        return m.PurgeReport(jobs=jobs, database=self.db.engine.dialect.name)

    def _job(self, ref: str) -> str:
        """The id of the one job `ref` (an id or a unique prefix) names, whoever submitted it."""
        ref = ref.strip().lower()
        with self.db.transaction() as s:
            matches = s.scalars(select(Job.id).where(Job.id.startswith(ref, autoescape=True)).limit(2)).all()
        if len(matches) != 1:
            raise ApiError(
                404 if not matches else 400,
                "not_found" if not matches else "ambiguous_job",
                f"{len(matches)} jobs match {ref[:36]!r}; give more of the id",
            )
        return matches[0]
