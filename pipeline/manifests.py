"""Checking a job before anything of it is opened: the allow-list and revocation, the client's signature on
the manifest, that the manifest belongs to this job and lists exactly its documents, and that the sealed
parameters are the ones it signs. A job that fails any check is rejected whole (`JobRejected`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from pipeline import envelope, keys
from pipeline.models import Client, Document, Job

MAX_CACHED = 1024  # verified manifests kept per process


class JobRejected(Exception):
    """The job must not run: unsigned, forged, or from a client that is not allow-listed."""


@dataclass(frozen=True)
class VerifiedJob:
    """What a verified manifest tells a worker: its fields, each document's ciphertext hash, the job's
    opened parameters, and the X25519 key its results are sealed to."""

    manifest: dict
    hashes: dict[str, str]
    params: dict
    client_x25519: bytes


class ManifestVerifier:
    """Verifies jobs for one worker process. The allow-list is read for every shard (revocation takes effect
    at once); the signature and the document set are checked once per job and manifest, not per shard."""

    def __init__(self, service_identity: Callable[[], keys.Identity]) -> None:
        self._identity = service_identity
        self._verified: dict[tuple[str, str], tuple[dict, dict[str, str], dict]] = {}
        self._lock = threading.Lock()

    def verify(self, session: Session, job: Job) -> VerifiedJob:
        """The verified job, or `JobRejected` with a content-free reason."""
        client = session.get(Client, job.client_fingerprint)
        if client is None:
            raise JobRejected(f"client {job.client_fingerprint[:16]} is not on the allow-list")
        if client.revoked_at is not None:
            raise JobRejected(f"client {job.client_fingerprint[:16]} was revoked")
        signed = job.manifest.encode() + job.signature + (job.sealed_params or b"") + client.ed25519_public
        key = (job.id, envelope.sha256_hex(signed))
        with self._lock:
            verified = self._verified.get(key)
        if verified is None:
            identity = self._identity()  # first: a service key that cannot load is an outage, not a bad job
            try:
                manifest = _verify_manifest(session, job, client)
                params = _params(job, manifest, identity)
            except JobRejected:
                raise
            except Exception as exc:  # a parser bug must end the job, not leave it queued forever
                raise JobRejected(f"the manifest could not be checked ({type(exc).__name__})") from None
            verified = (manifest, {d["id"]: d["sha256"] for d in manifest["documents"]}, params)
            with self._lock:
                if len(self._verified) > MAX_CACHED:
                    self._verified.clear()
                self._verified[key] = verified
        return VerifiedJob(*verified, client.x25519_public)


def _params(job: Job, manifest: dict, identity: keys.Identity) -> dict:
    """The job's parameters: in clear in a version 1 manifest; else sealed to the service beside the job,
    with their hash signed in the manifest. Opened in memory only."""
    if manifest["version"] == 1:
        return manifest["params"]
    sealed = job.sealed_params
    if sealed is None or envelope.sha256_hex(sealed) != manifest["params_sha256"]:
        raise JobRejected("the job's sealed parameters do not match the signed manifest")
    try:
        return envelope.open_params(sealed, identity, job.id)
    except envelope.EnvelopeError as exc:
        raise JobRejected(str(exc)) from None


def _verify_manifest(session: Session, job: Job, client: Client) -> dict:
    public = keys.PublicIdentity(x25519=client.x25519_public, ed25519=client.ed25519_public)
    try:
        manifest = envelope.verify_manifest(job.manifest, job.signature, public)
    except envelope.ManifestError as exc:
        raise JobRejected(str(exc)) from None
    if (
        manifest["job_id"] != job.id
        or manifest["kind"] != job.kind
        or manifest["client"] != client.fingerprint
    ):
        raise JobRejected("the signed manifest belongs to another job")
    ids = {d.id for d in session.query(Document.id).filter(Document.job_id == job.id)}
    if ids != {d["id"] for d in manifest["documents"]}:
        raise JobRejected("the job's documents differ from the signed manifest")
    return manifest
