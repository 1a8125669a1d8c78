"""Processing one shard: verify its job, lease its documents, open them in memory, run the job kind through
the engine, then seal, sign and record each result exactly once. Whatever one document raises stays with
it: it fails alone, or is given back for a retry. Logs carry ids, counts and timings only."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from engine.errors import EngineError
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
from pipeline.db import Database
from pipeline.errors import stack_without_message
from pipeline.manifests import JobRejected, ManifestVerifier
from pipeline.models import Job
from pipeline.settings import Settings
from pipeline.status import ACTIVE_JOB, DocState

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


def _engine_refused(exc: EngineError) -> DocumentError:
    # The reason in clear is fixed; the engine's own message goes only into the sealed detail.
    return DocumentError(f"{ENGINE_REFUSED}: {type(exc).__name__}", code=INVALID_REQUEST, detail=str(exc))


class Resources(Protocol):
    """What shard processing needs from its worker process (`worker.WorkerRuntime`)."""

    settings: Settings
    db: Database
    worker_id: str

    @property
    def identity(self) -> keys.Identity: ...

    @property
    def model(self) -> EngineModel: ...


class ShardProcessor:
    """Runs shard tasks for one worker process; any number of threads may call `process` at once."""

    def __init__(self, resources: Resources) -> None:
        self.res = resources
        self.settings = resources.settings
        self.db = resources.db
        self.worker_id = resources.worker_id
        self.verifier = ManifestVerifier(lambda: resources.identity)
        self._engine_seconds = threading.local()  # time waiting on the engine's futures, per shard thread

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
                s, job_id, shard, self.worker_id, limits.lease_seconds, limits.max_attempts
            )
            for doc in exhausted:
                store.give_up(s, doc, limits.max_attempts, self.worker_id)
            if leased:
                store.start_job(s, job_id, self.worker_id)
            work = [Leased(d.id, d.index, d.sealed) for d in leased]
        if not work:
            return
        kind = self._kind(job_id, verified.manifest["kind"], verified.params)
        if kind is None:
            return
        outcomes = self._run(job_id, kind, work, verified.hashes, priority)
        recorded = self._record(job_id, outcomes, verified.client_x25519)
        done, failed = recorded.count(DocState.DONE), recorded.count(DocState.FAILED)
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
                    unrecorded.append((outcome.item, exc))
                    continue
                recorded.append(ok and result.status)
            finished = store.complete_job_if_finished(s, job_id, self.worker_id)
            self._checkpoint(s, force=finished)
        for item, exc in unrecorded:
            self._give_back(item, exc)
        return recorded

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
        publish = audit_anchor.publisher(self.settings)  # copies each signed head outside, after commit
        if force:
            audit.checkpoint(session, sign=sign, key_fingerprint=fingerprint, publish=publish)
        else:
            every = self.settings.limits.checkpoint_every
            audit.maybe_checkpoint(session, every, sign, fingerprint, publish=publish)
