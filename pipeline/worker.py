"""The GPU worker: verify a job before opening anything, lease a shard's documents, open them in memory,
run the job kind through the engine, seal each result to the submitter and record it exactly once.

One `WorkerRuntime` per process (attached to the Celery app): the engine loads once, lazily, and shard tasks
running in threads share it. Logs carry ids, counts and timings only.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from celery import Celery

from engine import Engine, EngineError
from jobs import make_kind
from jobs.base import (
    INVALID_REQUEST,
    PROCESSING_ERROR,
    DocumentError,
    DocumentResult,
    EngineModel,
    EngineRequest,
    JobKind,
    JobParamError,
)
from jobs.base import Document as OpenedDocument
from pipeline import audit, envelope, keys, store
from pipeline.db import Database
from pipeline.errors import stack_without_message
from pipeline.models import Client, Document, Job
from pipeline.settings import Settings
from pipeline.tasks import dispatch_shard

log = logging.getLogger("enclave.worker")
_RUNTIME_LOCK = threading.Lock()


class JobRejected(Exception):
    """The job must not run: unsigned, forged, or from a client that is not allow-listed."""


@dataclass(frozen=True)
class Leased:
    """One leased document, copied out of its transaction."""

    id: str
    index: int
    sealed: bytes | None


@dataclass(frozen=True)
class Outcome:
    """A document's result, with the machine code of a failure (None when done)."""

    item: Leased
    result: DocumentResult
    code: str | None


MAX_CODE = 40  # a code is a short machine word ("invalid_request"), never text from the document


def _bounded_code(code: object) -> str:
    return code[:MAX_CODE] if isinstance(code, str) and code else PROCESSING_ERROR


def _code_of(result: DocumentResult) -> str | None:
    """The code of a failed result: its `output.code` where the kind sets one, else processing_error."""
    if result.status != "failed":
        return None
    output = result.output
    return _bounded_code(output.get("code") if isinstance(output, dict) else None)


ENGINE_REFUSED = "the engine refused the request (see the sealed detail)"


def _engine_refused(exc: EngineError) -> DocumentError:
    # The reason in clear is fixed; the engine's own message goes only into the sealed detail.
    return DocumentError(f"{ENGINE_REFUSED}: {type(exc).__name__}", code=INVALID_REQUEST, detail=str(exc))


def runtime_for(app: Celery) -> WorkerRuntime:
    """The process's runtime for `app`, created on first use."""
    with _RUNTIME_LOCK:
        runtime = getattr(app, "_enclave_runtime", None)
        if runtime is None:
            runtime = WorkerRuntime(app, app.enclave_settings)
            app._enclave_runtime = runtime
        return runtime


class WorkerRuntime:
    def __init__(self, app: Celery, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.db = Database(settings.database_url)
        self.worker_id = f"worker:{socket.gethostname()}:{os.getpid()}"
        self._identity: keys.Identity | None = None
        self._engine: Engine | None = None
        self._model: EngineModel | None = None
        self._load_lock = threading.Lock()
        self._active = 0
        self._active_lock = threading.Lock()
        self._engine_seconds = threading.local()  # time waiting on the engine's futures, per shard thread
        # (job, digest of manifest + signature + sealed params + client key) -> verified manifest, its
        # document hashes and the job's opened parameters
        self._verified: dict[tuple[str, str], tuple[dict, dict[str, str], dict]] = {}
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def identity(self) -> keys.Identity:
        with self._load_lock:
            if self._identity is None:
                self._identity = keys.load_identity(
                    self.settings.service_key_dir, self.settings.passphrase("service")
                )
            return self._identity

    @property
    def model(self) -> EngineModel:
        with self._load_lock:
            if self._engine is None:
                from pipeline.home import ensure_model

                path = ensure_model(self.settings)
                start = time.perf_counter()
                self._engine = Engine.from_pretrained(
                    path, device=self.settings.device, dtype=self.settings.dtype, **self.settings.engine
                )
                self._model = EngineModel(self._engine)
                log.info("engine loaded from %s in %.1fs", path, time.perf_counter() - start)
            return self._model

    def process_shard(self, job_id: str, shard: int) -> None:
        with self._active_lock:
            self._active += 1
        try:
            self._process_shard(job_id, shard)
        finally:
            with self._active_lock:
                self._active -= 1

    def _process_shard(self, job_id: str, shard: int) -> None:
        start = time.perf_counter()
        limits = self.settings.limits
        with self.db.transaction() as s:
            job = s.get(Job, job_id)
            if job is None or job.status not in store.ACTIVE_JOB:
                return
            priority = job.priority
            try:
                manifest, hashes, params, client_x25519 = self._verify(s, job)
            except JobRejected as exc:
                reason = str(exc)
            else:
                reason = None
        if reason is not None:
            with self.db.transaction() as s:
                store.fail_job(s, job_id, reason, self.worker_id)
                self._checkpoint(s, force=True)
            log.warning("job %s rejected: %s", job_id, store.bounded(reason))
            return
        with self.db.transaction() as s:
            leased, exhausted = store.lease(
                s, job_id, shard, self.worker_id, limits.lease_seconds, limits.max_attempts
            )
            for doc in exhausted:
                store.give_up(s, doc, limits.max_attempts, self.worker_id)
            if leased:
                store.start_job(s, job_id, self.worker_id)
            work = [Leased(d.id, d.index, d.sealed) for d in leased]
        if not work:
            return
        kind = self._kind(job_id, manifest["kind"], params)
        if kind is None:
            return
        outcomes = self._run(job_id, kind, work, hashes, priority)
        recorded = self._record(job_id, outcomes, client_x25519)
        done, failed = recorded.count("done"), recorded.count("failed")
        log.info(
            "job %s shard %d: %d documents, %d done, %d failed in %.3fs (engine %.3fs)",
            job_id,
            shard,
            len(work),
            done,
            failed,
            time.perf_counter() - start,
            getattr(self._engine_seconds, "value", 0.0),
        )

    def _kind(self, job_id: str, kind: str, params: dict) -> JobKind | None:
        """The job's kind from its signed parameters; None (and the job failed) when they are invalid."""
        try:
            return make_kind(kind, params)
        except JobParamError as exc:  # names the parameter
            reason = f"invalid job parameters: {exc}"
        except Exception as exc:
            reason = f"invalid job parameters ({type(exc).__name__})"
        with self.db.transaction() as s:
            store.fail_job(s, job_id, reason, self.worker_id)
            self._checkpoint(s, force=True)
        return None

    def _record(self, job_id: str, outcomes: list[Outcome], client_x25519: bytes) -> list[str | bool]:
        """Seal, sign and store each outcome, one commit for the shard. A document whose result cannot be
        sealed or stored is given back alone (a savepoint each); its neighbours are recorded."""
        prepared: list[tuple[Outcome, bytes, bytes]] = []
        for outcome in outcomes:
            try:
                sealed = self._seal(job_id, outcome.item, outcome.result, client_x25519)
                statement = store.result_statement(job_id, outcome.item.id, sealed, outcome.result.status)
                prepared.append((outcome, sealed, self.identity.sign(statement)))
            except Exception as exc:
                self._give_back(outcome.item, exc)
        recorded: list[str | bool] = []
        unrecorded: list[tuple[Leased, Exception]] = []
        with self.db.transaction() as s:  # one commit per shard; the lease check stays per document
            for outcome, sealed, signature in prepared:
                result = outcome.result
                details = {"code": outcome.code} if result.status == "failed" else None
                try:
                    with s.begin_nested():
                        ok = store.finish_document(
                            s,
                            outcome.item.id,
                            self.worker_id,
                            result.status,
                            sealed,
                            result.error,
                            self.worker_id,
                            details=details,
                            complete=False,
                            signature=signature,
                        )
                except Exception as exc:
                    unrecorded.append((outcome.item, exc))
                    continue
                recorded.append(ok and result.status)
            finished = store.complete_job_if_finished(s, job_id, self.worker_id)
            self._checkpoint(s, force=finished)
        for item, exc in unrecorded:
            self._give_back(item, exc)
        return recorded

    def _verify(self, session, job: Job) -> tuple[dict, dict[str, str], dict, bytes]:
        """Check the allow-list and the manifest signature before anything is opened; returns the manifest,
        its document hashes, the job's parameters and the client's X25519 key.

        The allow-list is read for every shard (revocation takes effect at once); the signature and the
        document set are checked once per job and manifest in this process, not once per shard.
        """
        client = session.get(Client, job.client_fingerprint)
        if client is None:
            raise JobRejected(f"client {job.client_fingerprint[:16]} is not on the allow-list")
        if client.revoked_at is not None:
            raise JobRejected(f"client {job.client_fingerprint[:16]} was revoked")
        signed = job.manifest.encode() + job.signature + (job.sealed_params or b"") + client.ed25519_public
        key = (job.id, envelope.sha256_hex(signed))
        verified = self._verified.get(key)
        if verified is None:
            identity = self.identity  # first: a service key that cannot load is an outage, not a bad job
            try:
                manifest = self._verify_manifest(session, job, client)
                params = self._params(job, manifest, identity)
            except JobRejected:
                raise
            except Exception as exc:  # a parser bug must end the job, not leave it queued forever
                raise JobRejected(f"the manifest could not be checked ({type(exc).__name__})") from None
            verified = (manifest, {d["id"]: d["sha256"] for d in manifest["documents"]}, params)
            if len(self._verified) > 1024:
                self._verified.clear()
            self._verified[key] = verified
        return (*verified, client.x25519_public)

    @staticmethod
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

    def _verify_manifest(self, session, job: Job, client: Client) -> dict:
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

    def _open(self, job_id: str, item: Leased, hashes: dict[str, str]) -> OpenedDocument:
        if item.sealed is None:
            raise DocumentError("document was never uploaded", code="not_uploaded")
        if envelope.sha256_hex(item.sealed) != hashes.get(item.id):
            raise DocumentError("ciphertext does not match the signed manifest", code="ciphertext_mismatch")
        try:
            path, data = envelope.unpack_document(
                envelope.open_document(item.sealed, self.identity, job_id, item.id)
            )
        except envelope.EnvelopeError as exc:
            raise DocumentError(str(exc), code="envelope_error") from None
        limit = self.settings.limits.max_document_bytes
        if len(data) > limit:
            raise DocumentError(f"document is {len(data)} bytes; the limit is {limit}", code="too_large")
        return OpenedDocument(path=path, data=data)

    def _run(
        self, job_id: str, kind: JobKind, work: list[Leased], hashes: dict[str, str], priority: int
    ) -> list[Outcome]:
        """Each document's outcome. Whatever one document raises stays with it: a `DocumentError` fails it,
        anything else gives it back for a retry (and it is left out here)."""
        outcomes: list[Outcome] = []
        ready: list[tuple[Leased, OpenedDocument, list[EngineRequest]]] = []
        for item in work:
            try:
                doc = self._open(job_id, item, hashes)
                ready.append((item, doc, kind.requests(doc, self.model)))
            except DocumentError as exc:
                self._fail(outcomes, kind, item, exc)
            except Exception as exc:  # a bug or an outage: retry later, keep the reason content-free
                self._give_back(item, exc)
        generated = self._generate([r for _, _, r in ready], priority)
        for (item, doc, _), outputs in zip(ready, generated, strict=True):
            if isinstance(outputs, DocumentError):
                self._fail(outcomes, kind, item, outputs)
                continue
            if isinstance(outputs, Exception):
                self._give_back(item, outputs)
                continue
            try:
                result = kind.result(doc, outputs)
            except DocumentError as exc:
                self._fail(outcomes, kind, item, exc)
                continue
            except Exception as exc:
                self._give_back(item, exc)
                continue
            outcomes.append(Outcome(item, result, _code_of(result)))
        return outcomes

    def _fail(self, outcomes: list[Outcome], kind: JobKind, item: Leased, error: DocumentError) -> None:
        try:
            outcomes.append(Outcome(item, kind.failure(error), _bounded_code(error.code)))
        except Exception as exc:
            self._give_back(item, exc)

    def _generate(self, batches: list[list[EngineRequest]], priority: int) -> list[list | Exception]:
        """Each document's outputs, through the engine's shared loop: requests from every shard and job
        in this process batch together. A request the engine refuses fails its document alone
        (DocumentError); any other failure gives the document back for a retry."""
        if not batches:
            return []
        engine = self.model.engine
        start = time.perf_counter()
        pending: list[list[Future] | Exception] = []
        for batch in batches:
            try:
                pending.append([self._submit(engine, r, priority) for r in batch])
            except EngineError as exc:  # invalid request: the document fails alone, with the reason
                pending.append(_engine_refused(exc))
            except Exception as exc:
                pending.append(exc)
        results: list[list | Exception] = []
        for futures in pending:
            if isinstance(futures, Exception):
                results.append(futures)
                continue
            try:
                results.append([f.result() for f in futures])
            except EngineError as exc:
                results.append(_engine_refused(exc))
            except Exception as exc:
                results.append(exc)
        self._engine_seconds.value = time.perf_counter() - start
        return results

    @staticmethod
    def _submit(engine: Engine, request: EngineRequest, priority: int) -> Future:
        # Chat-rendered text holds its special tokens already; the job's priority 0..9 (higher first)
        # becomes the engine's (lower first).
        return engine.submit(
            request.prompt,
            request.sampling,
            prefix=request.prefix,
            priority=9 - priority,
            add_special_tokens=request.add_special_tokens,
        )

    def _give_back(self, item: Leased, exc: Exception) -> None:
        reason = f"internal error ({type(exc).__name__})"
        log.error("document %s: %s: %s", item.id, reason, stack_without_message(exc))
        with self.db.transaction() as s:
            store.release(s, item.id, self.worker_id, reason)

    def _seal(self, job_id: str, item: Leased, result: DocumentResult, client_x25519: bytes) -> bytes:
        """The result record sealed to the submitter. `detail` is the full reason of a failure, which may
        quote the document: only the submitter can read it."""
        record = {
            "status": result.status,
            "output": result.output,
            "error": result.error,
            "detail": result.detail,
            "raw": result.raw,
            "usage": result.usage,
        }
        if result.reasoning is not None:  # asked for with include_reasoning: sealed like the rest
            record["reasoning"] = result.reasoning
        payload = json.dumps(record, ensure_ascii=True).encode()  # a lone surrogate travels as an escape
        return envelope.seal_result(payload, client_x25519, job_id, item.id)

    def _checkpoint(self, session, force: bool = False) -> None:
        identity = self.identity
        sign, fingerprint = identity.sign, identity.public.fingerprint
        if force:
            audit.checkpoint(session, sign=sign, key_fingerprint=fingerprint)
        else:
            audit.maybe_checkpoint(session, self.settings.limits.checkpoint_every, sign, fingerprint)

    def sweep(self) -> int:
        """Re-dispatch shards whose leases expired or whose messages may be lost. Returns how many."""
        with self.db.transaction() as s:
            pairs = store.shards_to_dispatch(s, self.settings.limits.lease_seconds)
            priorities = {j: s.get(Job, j).priority for j, _ in pairs}
            for job_id, shard in pairs:
                store.mark_dispatched(s, job_id, shard)
        for job_id, shard in pairs:
            dispatch_shard(self.app, job_id, shard, priorities[job_id])
        if pairs:
            log.info("sweeper re-dispatched %d shards", len(pairs))
        return len(pairs)

    def start_sweeper(self) -> None:
        if self._sweeper is not None:
            return
        interval = min(30.0, max(0.5, self.settings.limits.lease_seconds / 2))

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sweep()
                except Exception as exc:
                    log.error("sweeper: %s", stack_without_message(exc))
                self._stop.wait(interval)

        self._sweeper = threading.Thread(target=loop, name="enclave-sweeper", daemon=True)
        self._sweeper.start()

    def stop_sweeper(self) -> None:
        self._stop.set()

    def idle(self) -> bool:
        """No shard running here and no unfinished document in any active job."""
        with self._active_lock:
            if self._active:
                return False
        with self.db.transaction() as s:
            return not store.has_open_work(s)
