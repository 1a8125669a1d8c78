"""A batch's life through `pipeline.client`: its lines submitted as an Enclave job, its state followed, the
job cancelled, its results fetched, opened and stored as the output and error files.

Submitting and preparing the result files run in a background thread per batch (at most one at a time),
so `create` answers at once with `validating` and a poll sees `finalizing` while the files are made. The
rest happens when a client looks (`refresh`, from retrieve, list and cancel): a gateway restarted mid-way
picks each batch up where its record says (a submit repeated with the batch's job id resumes the upload).
Expected refusals become the batch's `errors`; any other failure is logged by type and stack only
(`pipeline.errors.describe`), and the step is tried again at the next look.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from jobs.openai_batch import BadLine, BatchFileError, read_batch_file
from pipeline import client
from pipeline.errors import describe
from pipeline.gateway.models import BatchError, OutputLine, RequestCounts
from pipeline.gateway.outputs import BATCH_CANCELLED, BATCH_EXPIRED, route_records
from pipeline.gateway.state import JobView, Observed, observe
from pipeline.gateway.store import BatchRecord, GatewayStore

log = logging.getLogger("enclave.gateway")
INVALID_URL = "The URL provided for this request does not match the batch endpoint."


class Lifecycle:
    """Moves batches on: submit, cancel, expire, finalize, each through `pipeline.client`."""

    def __init__(
        self, session: client.ClientSession, store: GatewayStore, clock: Callable[[], float]
    ) -> None:
        self.session = session
        self.store = store
        self.clock = clock
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}

    def now(self) -> int:
        return int(self.clock())

    def refresh(self, record: BatchRecord) -> tuple[BatchRecord, Observed]:
        """The batch as it is now, after taking the step its state calls for."""
        seen = observe(record, self._job(record), self.now())
        if seen.step == "submit" and record.phase == "validating":
            self._start(record.id, self._submit)
        elif seen.step == "cancel":
            client.cancel_job(self.session, record.job_id)
        elif seen.step == "expire":
            client.cancel_job(self.session, record.job_id)
            record = self.store.update_batch(record.id, _expiring)
            seen = observe(record, self._job(record), self.now())
        if seen.step == "finalize":
            record = self.store.update_batch(record.id, lambda r: _finalizing(r, seen, self.now()))
            final = seen.final
            self._start(record.id, lambda batch_id: self._finalize(batch_id, final))
        elif seen.step == "fail":
            record = self._end_failed(record.id, self._failure(record))
            seen = observe(record, None, self.now())
        return record, seen

    def cancel(self, record: BatchRecord) -> BatchRecord:
        """Ask for the batch's cancellation: the job now if it runs, else once its upload ends."""
        now = self.now()
        record = self.store.update_batch(
            record.id,
            lambda r: r.model_copy(update={"cancelling_at": now}) if r.cancelling_at is None else None,
        )
        if record.phase == "submitted":
            client.cancel_job(self.session, record.job_id)
        return record

    def resume(self) -> None:
        """Start again the submits a stopped gateway left half done."""
        for record in self.store.batches():
            if record.phase == "validating":
                self._start(record.id, self._submit)

    def _job(self, record: BatchRecord) -> JobView | None:
        if record.phase != "submitted":
            return None
        try:
            status = client.job_status(self.session, record.job_id)
        except client.UnknownJob:  # any other failure (an outage) is not the job's: the next look retries
            return None
        counts = status.counts
        return JobView(
            status.status, status.total, status.done, status.failed, counts.get("cancelled", 0), status.error
        )

    def _start(self, batch_id: str, work: Callable[[str], None]) -> None:
        with self._lock:
            if batch_id in self._running:
                return
            thread = threading.Thread(target=self._run, args=(batch_id, work), daemon=True)
            self._running[batch_id] = thread
        thread.start()

    def _run(self, batch_id: str, work: Callable[[str], None]) -> None:
        try:
            work(batch_id)
        except Exception as exc:  # logged by type and stack only; the next look tries again
            log.warning("batch %s: %s", batch_id, describe(exc, self.session.settings.home))
        finally:
            with self._lock:
                self._running.pop(batch_id, None)

    def _submit(self, batch_id: str) -> None:
        """Check the lines against the batch's endpoint, then submit them as the batch's Enclave job."""
        record = self.store.batch(batch_id)
        if record is None or record.phase != "validating":
            return
        if record.cancelling_at is not None:  # cancelled before its upload began: nothing was sent
            self.store.update_batch(batch_id, lambda r: _ended(r, "cancelled", self.now(), RequestCounts()))
            return
        data = self._input(record)
        if data is None:
            return
        try:
            submitted = client.submit_openai_batch(self.session, data, name=batch_id, job_id=record.job_id)
        except BatchFileError as exc:
            self._end_failed(batch_id, [_line_error(problem) for problem in exc.errors])
            return
        except client.ClientError as exc:
            self._end_failed(batch_id, [BatchError(code="invalid_request", message=str(exc))])
            return
        log.info(
            "batch %s: submitted as job %s (%d requests)", batch_id, submitted.job_id, submitted.documents
        )
        now = self.now()
        record = self.store.update_batch(
            batch_id, lambda r: r.model_copy(update={"phase": "submitted", "in_progress_at": now})
        )
        if record.cancelling_at is not None:
            client.cancel_job(self.session, record.job_id)

    def _input(self, record: BatchRecord) -> bytes | None:
        """The input file's bytes, opened in memory, if every request is for the batch's endpoint."""
        stored = self.store.file(record.input_file_id)
        if stored is None:
            message = "The input file was deleted before the batch could read it."
            self._end_failed(
                record.id, [BatchError(code="invalid_request", message=message, param="input_file_id")]
            )
            return None
        data = b"\n".join(self.store.lines(stored))
        wrong = [
            BatchError(code="invalid_url", message=INVALID_URL, param="url", line=line.line_no)
            for line in read_batch_file(data)
            if not isinstance(line, BadLine) and line.url != record.endpoint
        ]
        if wrong:
            self._end_failed(record.id, wrong)
            return None
        return data

    def _finalize(self, batch_id: str, final: str) -> None:
        """Fetch and open the job's results, store them as the output and error files, end the batch."""
        record = self.store.batch(batch_id)
        if record is None or record.phase != "submitted":
            return
        _, records = client.iter_results(self.session, record.job_id)  # a page at a time
        unrun = BATCH_EXPIRED if final == "expired" else BATCH_CANCELLED
        output, errors, now = _file_id(), _file_id(), self.now()
        with (
            self.store.new_file(output, "batch_output", f"{batch_id}_output.jsonl", now) as out,
            self.store.new_file(errors, "batch_output", f"{batch_id}_error.jsonl", now) as err,
        ):
            usage = route_records(records, unrun, _line_to(out), _line_to(err))
            done, failed = out.lines, err.lines
            for sink in (out, err):
                if sink.lines:
                    sink.add(b"")  # a newline ends every line
        output = self._kept(output, done)
        errors = self._kept(errors, failed)
        counts = RequestCounts(total=done + failed, completed=done, failed=failed)
        now = self.now()

        def end(r: BatchRecord) -> BatchRecord:
            ended = _ended(r, final, now, counts)
            return ended.model_copy(
                update={"output_file_id": output, "error_file_id": errors, "usage": usage}
            )

        self.store.update_batch(batch_id, end)
        log.info("batch %s: %s (%d completed, %d failed)", batch_id, final, counts.completed, counts.failed)

    def _kept(self, file_id: str, lines: int) -> str | None:
        """The file's id, or None (and the file deleted) when it got no line: OpenAI gives no empty file."""
        if lines:
            return file_id
        self.store.delete_file(file_id)
        return None

    def _failure(self, record: BatchRecord) -> list[BatchError]:
        job = self._job(record)
        if job is None:
            return [
                BatchError(
                    code="job_not_found", message=f"Enclave has no job {record.job_id} for this client."
                )
            ]
        return [BatchError(code="job_failed", message=job.error or "the Enclave job failed")]

    def _end_failed(self, batch_id: str, errors: list[BatchError]) -> BatchRecord:
        now = self.now()
        return self.store.update_batch(
            batch_id,
            lambda r: _ended(r, "failed", now, r.counts or RequestCounts()).model_copy(
                update={"errors": errors}
            ),
        )


def _line_to(sink) -> Callable[[OutputLine], None]:
    return lambda line: sink.add(line.model_dump_json().encode())


def _file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def _ended(record: BatchRecord, status: str, now: int, counts: RequestCounts) -> BatchRecord:
    stamp = {
        "completed": "completed_at",
        "cancelled": "cancelled_at",
        "expired": "expired_at",
        "failed": "failed_at",
    }
    update = {"phase": "ended", "status": status, "counts": counts, stamp[status]: now}
    if status == "cancelled" and record.cancelling_at is None:  # cancelled outside the gateway
        update["cancelling_at"] = now
    return record.model_copy(update=update)


def _finalizing(record: BatchRecord, seen: Observed, now: int) -> BatchRecord | None:
    update = {}
    if seen.status == "finalizing" and record.finalizing_at is None:
        update["finalizing_at"] = now
    if seen.status == "cancelling" and record.cancelling_at is None:  # cancelled outside the gateway
        update["cancelling_at"] = now
    return record.model_copy(update=update) if update else None


def _expiring(record: BatchRecord) -> BatchRecord:
    return record.model_copy(update={"expiring": True})


def _line_error(problem: str) -> BatchError:
    """A whole-file refusal of `pipeline.client` ("line 3: duplicate custom_id ...") as a batch error."""
    head, sep, rest = problem.partition(": ")
    number = head.removeprefix("line ")
    if sep and number.isdigit():
        code = "duplicate_custom_id" if rest.startswith("duplicate custom_id") else "invalid_request"
        return BatchError(code=code, message=rest, line=int(number))
    return BatchError(code="empty_file" if "no requests" in problem else "invalid_request", message=problem)
