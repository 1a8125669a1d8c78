"""Processing one shard: verify its job, lease its documents, open them in memory, run the job kind through
the engine, then seal, sign and record each result exactly once, as each document finishes (so progress moves
per document, not per shard). Whatever one document raises stays with it: it fails alone, or is given back
for a retry. A shard whose job ends (cancelled) or that runs past the soft time limit has its engine requests
aborted by the watchdog (`watchdog.py`): a cancelled job's documents are left as the cancel made them, a timed
out shard's fail with a `time_limit` reason. Logs carry ids, counts and timings only."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Protocol

from engine.errors import RequestAborted, RequestError
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
from pipeline import audit, audit_anchor, envelope, keys, store
from pipeline.db import Database, is_retryable
from pipeline.errors import stack_without_message
from pipeline.health import Health
from pipeline.inflight import InFlight, ShardRun, Stop
from pipeline.manifests import JobRejected, ManifestVerifier
from pipeline.models import Job
from pipeline.settings import Settings
from pipeline.status import ACTIVE_JOB, DocState
from pipeline.watchdog import time_limit_reason

log = logging.getLogger("enclave.worker")


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


RECORD_RETRIES = 3  # new transactions for documents whose recording lost a database race (a deadlock)
RECORD_BACKOFF_S = 0.05  # ... after this many seconds times the attempt
MAX_CODE = 40  # a code is a short machine word ("invalid_request"), never text from the document


def _bounded_code(code: object) -> str:
    return code[:MAX_CODE] if isinstance(code, str) and code else PROCESSING_ERROR


def _code_of(result: DocumentResult) -> str | None:
    """The code of a failed result: its `output.code` where the kind sets one, else processing_error."""
    if result.status != DocState.FAILED:
        return None
    output = result.output
    return _bounded_code(output.get("code") if isinstance(output, dict) else None)


ENGINE_REFUSED = "the engine refused the request (see the sealed detail)"


def _engine_refused(exc: RequestError) -> DocumentError:
    # The reason in clear is fixed; the engine's own message goes only into the sealed detail.
    return DocumentError(f"{ENGINE_REFUSED}: {type(exc).__name__}", code=INVALID_REQUEST, detail=str(exc))


class Resources(Protocol):
    """What shard processing needs from its worker process (`worker.WorkerRuntime`)."""

    settings: Settings
    db: Database
    worker_id: str
    inflight: InFlight
    health: Health

    @property
    def identity(self) -> keys.Identity: ...

    @property
    def model(self) -> EngineModel: ...

    def observe_shard(self, seconds: float, outcomes: dict[str, int]) -> None: ...


@dataclass(eq=False)
class _Pending:
    """A document whose engine requests are submitted: its futures, or the error that stopped them."""

    item: Leased
    doc: OpenedDocument
    futures: list[Future] | Exception


class ShardProcessor:
    """Runs shard tasks for one worker process; any number of threads may call `process` at once."""

    def __init__(self, resources: Resources) -> None:
        self.res = resources
        self.settings = resources.settings
        self.db = resources.db
        self.verifier = ManifestVerifier(lambda: resources.identity)

    @property
    def worker_id(self) -> str:
        return self.res.worker_id

    @property
    def identity(self) -> keys.Identity:
        return self.res.identity

    @property
    def model(self) -> EngineModel:
        return self.res.model

    def process(self, job_id: str, shard: int) -> None:
        """Process the unfinished documents of one shard of a job."""
        start = time.perf_counter()
        limits = self.settings.limits
        with self.db.transaction() as s:
            job = s.get(Job, job_id)
            if job is None or job.status not in ACTIVE_JOB:
                return
            priority = job.priority
            try:
                verified = self.verifier.verify(s, job)
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
                s,
                job_id,
                shard,
                self.worker_id,
                limits.lease_seconds,
                limits.max_attempts,
                heartbeat_timeout=self.settings.worker.heartbeat_timeout,
            )
            for doc in exhausted:
                store.give_up(s, doc, limits.max_attempts, self.worker_id)
            if leased:
                store.start_job(s, job_id, self.worker_id)
            work = [Leased(d.id, d.index, d.sealed) for d in leased]
        if not work:
            return
        run = self.res.inflight.begin(job_id, shard, [w.id for w in work])
        try:
            kind = self._kind(job_id, verified.manifest["kind"], verified.params)
            if kind is None:
                return
            recorded = self._run(run, job_id, kind, work, verified.hashes, priority, verified.client_x25519)
        finally:
            self.res.inflight.end(run)
        done, failed = recorded.count(DocState.DONE), recorded.count(DocState.FAILED)
        # not recorded here: given back after an internal error, cancelled, or taken over by another worker
        counts = {"done": done, "failed": failed, "not_recorded": len(work) - done - failed}
        seconds = time.perf_counter() - start
        self.res.observe_shard(seconds, counts)
        log.info(
            "job %s shard %d: %d documents, %d done, %d failed, %d not recorded in %.3fs%s",
            job_id,
            shard,
            len(work),
            counts["done"],
            counts["failed"],
            counts["not_recorded"],
            seconds,
            f" ({run.stopped})" if run.stopped else "",
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

    def _run(
        self,
        run: ShardRun,
        job_id: str,
        kind: JobKind,
        work: list[Leased],
        hashes: dict[str, str],
        priority: int,
        client_x25519: bytes,
    ) -> list[str | bool]:
        """Open, submit and record the shard's documents, each as soon as its requests finish; what was
        recorded for each (see `_record`). Whatever one document raises stays with it: a `DocumentError` fails
        it, anything else gives it back for a retry."""
        early: list[Outcome] = []
        pending: list[_Pending] = []
        for item in work:
            try:
                doc = self._open(job_id, item, hashes)
                requests = kind.requests(doc, self.model)
            except DocumentError as exc:
                self._fail(early, kind, item, exc)
                continue
            except Exception as exc:  # a bug or an outage: retry later, keep the reason content-free
                self._give_back(run, item, exc)
                continue
            pending.append(_Pending(item, doc, self._submit_all(run, self.model.engine, requests, priority)))
        recorded = self._record(run, job_id, early, client_x25519)
        while pending:
            running = [f for p in pending if isinstance(p.futures, list) for f in p.futures if not f.done()]
            if running:  # the documents whose requests are all done are recorded below, without waiting
                wait(running, return_when=FIRST_COMPLETED)
            ready = [
                p for p in pending if not isinstance(p.futures, list) or all(f.done() for f in p.futures)
            ]
            pending = [p for p in pending if p not in ready]
            outcomes = [o for p in ready if (o := self._outcome(run, kind, p)) is not None]
            recorded += self._record(run, job_id, outcomes, client_x25519)
        return recorded

    def _submit_all(self, run: ShardRun, engine, requests: list[EngineRequest], priority: int):
        """A document's requests submitted to the engine's shared loop (requests from every shard and job in
        this process batch together), or the error that stopped them. A shard stopped meanwhile gets its
        requests aborted at once."""
        futures: list[Future] = []
        try:
            for request in requests:
                futures.append(self._submit(engine, request, priority))
        except RequestError as exc:  # invalid request: the document fails alone, with the reason
            engine.abort(futures)
            return _engine_refused(exc)
        except Exception as exc:
            engine.abort(futures)
            return exc
        if not self.res.inflight.add_futures(run, futures):
            engine.abort(futures)
        return futures

    def _outcome(self, run: ShardRun, kind: JobKind, pending: _Pending) -> Outcome | None:
        """The outcome of a document whose requests all finished; None when it is given back or left alone
        (its job was cancelled, or its shard abandoned past the hard time limit)."""
        item = pending.item
        try:
            if isinstance(pending.futures, Exception):
                raise pending.futures
            outputs = [f.result() for f in pending.futures]
            result = kind.result(pending.doc, outputs)
        except RequestAborted:
            if run.stopped is Stop.SOFT_TIME_LIMIT:
                reason = time_limit_reason("soft", self.settings.worker.soft_time_limit)
                return self._failure(kind, item, DocumentError(reason, code="time_limit"))
            return None
        except RequestError as exc:
            return self._failure(kind, item, _engine_refused(exc))
        except DocumentError as exc:
            return self._failure(kind, item, exc)
        except Exception as exc:
            self._give_back(run, item, exc)
            return None
        return Outcome(item, result, _code_of(result))

    def _failure(self, kind: JobKind, item: Leased, error: DocumentError) -> Outcome | None:
        try:
            return Outcome(item, kind.failure(error), _bounded_code(error.code))
        except Exception as exc:
            self._give_back(None, item, exc)
            return None

    def _fail(self, outcomes: list[Outcome], kind: JobKind, item: Leased, error: DocumentError) -> None:
        if (outcome := self._failure(kind, item, error)) is not None:
            outcomes.append(outcome)

    def _record(
        self, run: ShardRun, job_id: str, outcomes: list[Outcome], client_x25519: bytes
    ) -> list[str | bool]:
        """Seal, sign and store each outcome, one commit for them all. A document whose result cannot be
        sealed or stored is given back alone (a savepoint each); its neighbours are recorded. Returns, per
        document recorded, its status, or False when its lease was no longer this worker's."""
        if not outcomes or run.stopped is Stop.HARD_TIME_LIMIT:
            return []
        prepared: list[tuple[Outcome, bytes, bytes]] = []
        for outcome in outcomes:
            try:
                sealed = self._seal(job_id, outcome.item, outcome.result, client_x25519)
                statement = store.result_statement(job_id, outcome.item.id, sealed, outcome.result.status)
                prepared.append((outcome, sealed, self.identity.sign(statement)))
            except Exception as exc:
                self._give_back(run, outcome.item, exc)
        recorded: list[str | bool] = []
        pending, unrecorded = prepared, []
        for attempt in range(RECORD_RETRIES + 1):
            last = attempt == RECORD_RETRIES
            try:
                done, failed = self._store(job_id, pending)
            except Exception as exc:  # the transaction as a whole (job completion, checkpoint, commit)
                if last or not is_retryable(exc):
                    raise
                done, failed = [], [(outcome, exc) for outcome, _, _ in pending]
            recorded += done
            # A deadlock or serialization failure (another worker's or the sweeper's transaction won a
            # race on the same rows) is run again in a new transaction, once this one's locks are gone.
            again = {id(o) for o, exc in failed if is_retryable(exc)} if not last else set()
            unrecorded = [(o.item, exc) for o, exc in failed if id(o) not in again]
            if not again:
                break
            log.warning("job %s: %d documents lost a database race; recording them again", job_id, len(again))
            time.sleep(RECORD_BACKOFF_S * (attempt + 1))
            pending = [p for p in pending if id(p[0]) in again]
        self.res.inflight.finished(run, [o.item.id for o, _, _ in prepared])
        self.res.health.success(len(recorded))
        for item, exc in unrecorded:
            self._give_back(run, item, exc)
        return recorded

    def _store(
        self, job_id: str, prepared: list[tuple[Outcome, bytes, bytes]]
    ) -> tuple[list[str | bool], list[tuple[Outcome, Exception]]]:
        """One transaction storing the prepared outcomes, a savepoint each: per document stored, its status
        (False when its lease was no longer this worker's), and the outcomes whose savepoint failed."""
        recorded: list[str | bool] = []
        failed: list[tuple[Outcome, Exception]] = []
        with self.db.transaction() as s:  # one commit; the lease check stays per document
            for outcome, sealed, signature in prepared:
                result = outcome.result
                details = {"code": outcome.code} if result.status == DocState.FAILED else None
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
                    failed.append((outcome, exc))
                    continue
                recorded.append(ok and result.status)
            finished = store.complete_job_if_finished(s, job_id, self.worker_id)
            self._checkpoint(s, force=finished)
        return recorded, failed

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

    @staticmethod
    def _submit(engine, request: EngineRequest, priority: int) -> Future:
        # Chat-rendered text holds its special tokens already; the job's priority 0..9 (higher first)
        # becomes the engine's (lower first).
        return engine.submit(
            request.prompt,
            request.sampling,
            prefix=request.prefix,
            priority=9 - priority,
            add_special_tokens=request.add_special_tokens,
        )

    def _give_back(self, run: ShardRun | None, item: Leased, exc: Exception) -> None:
        """Return a document for a retry after an internal error (one attempt counted); the worker's health
        counts it."""
        reason = f"internal error ({type(exc).__name__})"
        log.error("document %s: %s: %s", item.id, reason, stack_without_message(exc))
        with self.db.transaction() as s:
            store.release(s, item.id, self.worker_id, reason)
        if run is not None:
            self.res.inflight.finished(run, [item.id])
        self.res.health.error(reason)

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
        publish = audit_anchor.publisher(self.settings)  # copies each signed head outside, after commit
        if force:
            audit.checkpoint(session, sign=sign, key_fingerprint=fingerprint, publish=publish)
        else:
            every = self.settings.limits.checkpoint_every
            audit.maybe_checkpoint(session, every, sign, fingerprint, publish=publish)
