"""The operations behind the gateway's routes: OpenAI's Files API over the local sealed store, and its
Batch API over `pipeline.client` (through `lifecycle.Lifecycle`). Every answer is one of `models`' objects;
every refusal a `GatewayError`.

An uploaded file is checked with `jobs.openai_batch.read_batch_file`'s rules, as `enclave submit
--openai-batch` checks it: a file without requests, or with a custom_id used twice, is refused whole (400);
a malformed line is kept, and fails alone in the batch (a 400 line of its error file).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from jobs.openai_batch import BadLine, read_batch_file
from pipeline import client
from pipeline.gateway.errors import GatewayError, bad_request, invalid_value, no_such_batch, no_such_file
from pipeline.gateway.lifecycle import Lifecycle
from pipeline.gateway.models import (
    WINDOW_SECONDS,
    Batch,
    BatchErrors,
    CreateBatch,
    FileDeleted,
    FileObject,
    Page,
)
from pipeline.gateway.state import Observed
from pipeline.gateway.store import BatchRecord, FileRecord, GatewayStore

T = TypeVar("T", FileObject, Batch)
UNCANCELLABLE = ("finalizing", "completed", "failed", "expired")


class Gateway:
    """Files and batches of one client: `session` (its key, its service) and `store` (its sealed files)."""

    def __init__(
        self, session: client.ClientSession, store: GatewayStore, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.lifecycle = Lifecycle(session, store, clock)

    def upload(self, purpose: str, filename: str, data: bytes) -> FileObject:
        """Check a batch input file, seal it line by line and store it."""
        if purpose != "batch":
            raise invalid_value("purpose", "the gateway stores batch input files only ('batch')")
        lines = read_batch_file(data)
        if dupes := [x for x in lines if isinstance(x, BadLine) and x.duplicate]:
            first = dupes[0]
            raise bad_request(
                f"The file repeats a custom_id (line {first.line_no}: {first.problem}); each must be unique.",
                "file",
                "duplicate_custom_id",
            )
        if not lines:
            raise bad_request("The file has no requests.", "file", "empty_file")
        file_id = f"file-{uuid.uuid4().hex}"
        record = self.store.add_file(
            file_id, "batch", filename, data.split(b"\n"), len(data), self.lifecycle.now()
        )
        return self._file_object(record)

    def file(self, file_id: str) -> FileObject:
        return self._file_object(self._file(file_id))

    def files(self, purpose: str | None, after: str | None, limit: int, order: str) -> Page[FileObject]:
        records = [r for r in self.store.files() if purpose is None or r.purpose == purpose]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=order == "desc")
        ids = [r.id for r in records]
        chosen, has_more = _page(ids, after, limit)
        by_id = {r.id: r for r in records}
        return _listed([self._file_object(by_id[i]) for i in chosen], has_more)

    def content(self, file_id: str) -> Iterator[bytes]:
        """The file as uploaded (or as made, for output and error files), opened one line at a time."""
        record = self._file(file_id)

        def lines() -> Iterator[bytes]:
            for index, line in enumerate(self.store.lines(record)):
                yield (b"\n" if index else b"") + line

        return lines()

    def delete(self, file_id: str) -> FileDeleted:
        if not self.store.delete_file(file_id):
            raise no_such_file(file_id)
        return FileDeleted(id=file_id, deleted=True)

    def create(self, request: CreateBatch) -> Batch:
        """A new batch, `validating` while its lines are submitted in the background."""
        stored = self.store.file(request.input_file_id)
        if stored is None:
            raise no_such_file(request.input_file_id, "input_file_id")
        if stored.purpose != "batch":
            raise invalid_value("input_file_id", "the file must be uploaded with purpose 'batch'")
        now = self.lifecycle.now()
        batch_id = f"batch_{uuid.uuid4().hex}"
        metadata = None
        if request.metadata is not None:
            metadata = self.store.seal("metadata", batch_id, 0, json.dumps(request.metadata).encode())
        record = BatchRecord(
            id=batch_id,
            job_id=str(uuid.uuid4()),
            input_file_id=request.input_file_id,
            endpoint=request.endpoint,
            completion_window=request.completion_window,
            created_at=now,
            expires_at=now + WINDOW_SECONDS,
            sealed_metadata=metadata,
        )
        self.store.put_batch(record)
        return self._batch_object(*self.lifecycle.refresh(record))

    def batch(self, batch_id: str) -> Batch:
        return self._batch_object(*self.lifecycle.refresh(self._batch(batch_id)))

    def batches(self, after: str | None, limit: int) -> Page[Batch]:
        """Newest first, as OpenAI lists them."""
        records = sorted(self.store.batches(), key=lambda r: (r.created_at, r.id), reverse=True)
        chosen, has_more = _page([r.id for r in records], after, limit)
        by_id = {r.id: r for r in records}
        return _listed([self._batch_object(*self.lifecycle.refresh(by_id[i])) for i in chosen], has_more)

    def cancel(self, batch_id: str) -> Batch:
        """Cancel a batch: `cancelling` until the files of what finished are ready, then `cancelled`."""
        record, seen = self.lifecycle.refresh(self._batch(batch_id))
        if seen.status in UNCANCELLABLE:
            raise GatewayError(409, f"Cannot cancel a batch with status '{seen.status}'.", param="batch_id")
        if seen.status not in ("cancelling", "cancelled"):
            record, seen = self.lifecycle.refresh(self.lifecycle.cancel(record))
        return self._batch_object(record, seen)

    def _file(self, file_id: str) -> FileRecord:
        record = self.store.file(file_id)
        if record is None:
            raise no_such_file(file_id)
        return record

    def _batch(self, batch_id: str) -> BatchRecord:
        record = self.store.batch(batch_id)
        if record is None:
            raise no_such_batch(batch_id)
        return record

    def _file_object(self, record: FileRecord) -> FileObject:
        return FileObject(
            id=record.id,
            bytes=record.bytes,
            created_at=record.created_at,
            filename=self.store.filename(record),
            purpose=record.purpose,
        )

    def _batch_object(self, record: BatchRecord, seen: Observed) -> Batch:
        metadata = None
        if record.sealed_metadata is not None:
            metadata = json.loads(self.store.open("metadata", record.id, 0, record.sealed_metadata))
        return Batch(
            id=record.id,
            endpoint=record.endpoint,
            errors=BatchErrors(data=record.errors) if record.errors else None,
            input_file_id=record.input_file_id,
            completion_window=record.completion_window,
            status=seen.status,
            output_file_id=record.output_file_id,
            error_file_id=record.error_file_id,
            created_at=record.created_at,
            in_progress_at=record.in_progress_at,
            expires_at=record.expires_at,
            finalizing_at=record.finalizing_at,
            completed_at=record.completed_at,
            failed_at=record.failed_at,
            expired_at=record.expired_at,
            cancelling_at=record.cancelling_at,
            cancelled_at=record.cancelled_at,
            request_counts=seen.counts,
            usage=record.usage,
            metadata=metadata,
        )


def _page(ids: Sequence[str], after: str | None, limit: int) -> tuple[list[str], bool]:
    """The ids of one page: those following `after` (from the start without it), at most `limit`."""
    start = 0
    if after is not None:
        if after not in ids:
            raise invalid_value("after", "no object with this id is listed")
        start = ids.index(after) + 1
    chosen = list(ids[start : start + limit])
    return chosen, start + limit < len(ids)


def _listed(items: list[T], has_more: bool) -> Page[T]:
    first, last = (items[0].id, items[-1].id) if items else (None, None)
    return Page(data=items, first_id=first, last_id=last, has_more=has_more)
