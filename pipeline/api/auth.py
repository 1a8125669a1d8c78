"""Who is asking: every request but the health check is signed (`pipeline.wire.signing`) by an allow-listed,
unrevoked client. The allow-list and revocation are read at every request; each nonce is stored once, in the
same transaction as the check, so a replay (even one racing the original) is refused. Nonces older than the
window are deleted as requests come; a request outside the window is refused on its timestamp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError

from pipeline import keys
from pipeline.api.errors import ApiError
from pipeline.db import Database
from pipeline.models import Client, RequestNonce, utcnow
from pipeline.status import Role
from pipeline.wire import signing


@dataclass(frozen=True)
class Caller:
    """The authenticated client of a request."""

    fingerprint: str
    role: str
    public: keys.PublicIdentity

    @property
    def admin(self) -> bool:
        return self.role == Role.ADMIN


class Authenticator:
    """Checks signed requests against the database's allow-list and nonce store."""

    def __init__(self, db: Database, service: str, clock=time.time) -> None:
        self.db = db
        self.service = service  # this service's fingerprint: the audience a request must be signed for
        self.clock = clock

    def authenticate(self, method: str, target: str, headers, body: bytes) -> Caller:
        """The caller, or `ApiError` 401 naming why: unsigned, bad_signature, wrong_service, stale_request,
        unknown_client, revoked_client or replayed."""
        try:
            signed = signing.parse(headers)
            signing.check_service(signed, self.service)
        except signing.SignatureError as exc:
            raise ApiError(401, exc.code, str(exc)) from None
        now = self.clock()
        try:
            with self.db.transaction() as s:
                client = s.get(Client, signed.client)
                if client is None:
                    raise ApiError(
                        401,
                        "unknown_client",
                        f"client {signed.client[:16]} is not on the service's allow-list: an administrator "
                        "must run `enclave clients add NAME PUBLIC_FILE` with its public.json",
                    )
                if client.revoked_at is not None:
                    raise ApiError(
                        401, "revoked_client", f"client {signed.client[:16]} was revoked by an administrator"
                    )
                public = keys.PublicIdentity(x25519=client.x25519_public, ed25519=client.ed25519_public)
                try:
                    signing.verify(signed, public, method, target, body, now)
                except signing.SignatureError as exc:
                    raise ApiError(401, exc.code, str(exc)) from None
                cutoff = utcnow() - timedelta(seconds=2 * signing.WINDOW_SECONDS)
                s.execute(delete(RequestNonce).where(RequestNonce.seen_at < cutoff))
                s.add(RequestNonce(nonce=signed.nonce, client=signed.client, seen_at=utcnow()))
                s.flush()
                caller = Caller(client.fingerprint, client.role, public)
        except IntegrityError:
            raise ApiError(
                401, "replayed", "the request was already received once (a replay): refused"
            ) from None
        return caller
