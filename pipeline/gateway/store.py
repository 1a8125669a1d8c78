"""The gateway's local store (`$ENCLAVE_HOME/gateway/`): files sealed line by line with the client's own key,
and batch records whose content (the metadata) is sealed too.

Layout:
- `files/<file id>.json`: a `FileRecord` (purpose, size, times, line count; the file name sealed);
- `files/<file id>.lines`: each line sealed on its own, as 4-byte big-endian length + envelope, so a file
  is opened one line at a time when its content is read;
- `batches/<batch id>.json`: a `BatchRecord` (ids, times, counts, content-free errors; the metadata sealed).

Envelopes are HPKE (the suite of `pipeline.envelope`) to the client's X25519 key, bound through `info` to
`enclave-gateway/1`, the purpose (`line`, `filename`, `metadata`), the object's id and the line's index, so
a line opens only in its own place. Nothing is written in clear, and nothing goes through a temporary
folder: each file is written beside its final name and renamed over it.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from cryptography.exceptions import InvalidTag
from pydantic import BaseModel, ConfigDict, Field

from pipeline.envelope import SUITE
from pipeline.gateway.models import BatchError, BatchStatus, BatchUsage, FilePurpose, RequestCounts
from pipeline.keys import Identity

FORMAT = "enclave-gateway/1"
_LENGTH = struct.Struct(">I")


class StoreError(ValueError):
    """A stored object that does not open (altered, or sealed to another key); content-free."""


Sealed = bytes  # an envelope (a field named `bytes` shadows the type in FileRecord)
_SEALED_AS_BASE64 = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")  # in the JSON files only


class FileRecord(BaseModel):
    model_config = _SEALED_AS_BASE64

    id: str
    purpose: FilePurpose
    bytes: int
    created_at: int
    lines: int
    sealed_filename: Sealed


class BatchRecord(BaseModel):
    """A batch as the gateway keeps it. `phase`: `validating` until the lines are submitted, `submitted`
    while the Enclave job runs and its result files are prepared, `ended` once `status` is final."""

    model_config = _SEALED_AS_BASE64

    id: str
    job_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    sealed_metadata: Sealed | None = None
    phase: Literal["validating", "submitted", "ended"] = "validating"
    status: BatchStatus | None = None  # the final status, once ended
    expiring: bool = False  # the completion window passed: the job was cancelled, the batch ends expired
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    errors: list[BatchError] = Field(default_factory=list)
    counts: RequestCounts | None = None  # the final counts: the lines of the output and error files
    usage: BatchUsage | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None


class GatewayStore:
    """Files and batch records under `root`, sealed to `identity`'s public key and opened with it."""

    def __init__(self, root: Path, identity: Identity) -> None:
        self.root = root
        self.identity = identity
        self._public = identity.x25519_private.public_key()
        self._lock = threading.RLock()  # one writer at a time for read-modify-write of a record
        for folder in (root, root / "files", root / "batches"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def seal(self, purpose: str, object_id: str, index: int, data: bytes) -> bytes:
        return SUITE.encrypt(data, self._public, info=_info(purpose, object_id, index))

    def open(self, purpose: str, object_id: str, index: int, sealed: bytes) -> bytes:
        try:
            return SUITE.decrypt(sealed, self.identity.x25519_private, info=_info(purpose, object_id, index))
        except (InvalidTag, ValueError):
            raise StoreError(
                f"the stored {purpose} of {object_id} does not open with this client's key"
            ) from None

    def add_file(
        self,
        file_id: str,
        purpose: FilePurpose,
        filename: str,
        lines: Iterable[bytes],
        size: int,
        created_at: int,
    ) -> FileRecord:
        """Seal and store a file given as its lines (split on b"\\n", so joining them gives it back)."""
        with self.new_file(file_id, purpose, filename, created_at, size) as sink:
            for line in lines:
                sink.add(line)
        return sink.record

    @contextmanager
    def new_file(
        self, file_id: str, purpose: FilePurpose, filename: str, created_at: int, size: int | None = None
    ) -> Iterator[FileSink]:
        """A file written a line at a time, each line sealed as it comes (so a file larger than memory is
        stored whole); its record is stored when the block ends. `size`: the file's bytes, else the lines'
        bytes and the newlines between them."""
        with _writer(self.root / "files" / f"{file_id}.lines") as out:
            sink = FileSink(self, file_id, out)
            yield sink
        sealed_name = self.seal("filename", file_id, 0, filename.encode("utf-8", "surrogateescape"))
        sink.record = FileRecord(
            id=file_id,
            purpose=purpose,
            bytes=size if size is not None else sink.bytes + max(0, sink.lines - 1),
            created_at=created_at,
            lines=sink.lines,
            sealed_filename=sealed_name,
        )
        _write(self.root / "files" / f"{file_id}.json", sink.record.model_dump_json().encode())

    def file(self, file_id: str) -> FileRecord | None:
        return _read(self._path("files", file_id, ".json"), FileRecord)

    def files(self) -> list[FileRecord]:
        return _read_all(self.root / "files", FileRecord)

    def filename(self, record: FileRecord) -> str:
        return self.open("filename", record.id, 0, record.sealed_filename).decode("utf-8", "replace")

    def lines(self, record: FileRecord) -> Iterator[bytes]:
        """The file's lines, opened one at a time."""
        with open(self.root / "files" / f"{record.id}.lines", "rb") as f:
            for index in range(record.lines):
                (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
                yield self.open("line", record.id, index, f.read(length))

    def delete_file(self, file_id: str) -> bool:
        with self._lock:
            meta = self._path("files", file_id, ".json")
            if meta is None or not meta.exists():
                return False
            meta.unlink()
            (self.root / "files" / f"{file_id}.lines").unlink(missing_ok=True)
            return True

    def put_batch(self, record: BatchRecord) -> None:
        with self._lock:
            _write(self.root / "batches" / f"{record.id}.json", record.model_dump_json().encode())

    def batch(self, batch_id: str) -> BatchRecord | None:
        return _read(self._path("batches", batch_id, ".json"), BatchRecord)

    def batches(self) -> list[BatchRecord]:
        return _read_all(self.root / "batches", BatchRecord)

    def update_batch(self, batch_id: str, change: Callable[[BatchRecord], BatchRecord | None]) -> BatchRecord:
        """Apply `change` to the stored record under the store's lock; it returns the new record, or None
        to leave it as it is. Returns the record as stored afterwards."""
        with self._lock:
            record = self.batch(batch_id)
            if record is None:
                raise StoreError(f"no batch record {batch_id}")
            changed = change(record.model_copy(deep=True))
            if changed is not None:
                self.put_batch(changed)
                return changed
            return record

    def _path(self, folder: str, object_id: str, suffix: str) -> Path | None:
        """The path of an object, or None for an id that could name a path elsewhere."""
        if not object_id or not all(c.isalnum() or c in "-_" for c in object_id):
            return None
        return self.root / folder / f"{object_id}{suffix}"


class FileSink:
    """The lines of a file being stored (`GatewayStore.new_file`); `record` once it is stored."""

    def __init__(self, store: GatewayStore, file_id: str, out) -> None:
        self.store = store
        self.file_id = file_id
        self.out = out
        self.lines = 0
        self.bytes = 0
        self.record: FileRecord | None = None

    def add(self, line: bytes) -> None:
        sealed = self.store.seal("line", self.file_id, self.lines, line)
        self.out.write(_LENGTH.pack(len(sealed)) + sealed)
        self.lines += 1
        self.bytes += len(line)


def _info(purpose: str, object_id: str, index: int) -> bytes:
    return "\x00".join((FORMAT, purpose, object_id, str(index))).encode()


class _writer:
    """A file written beside `path` (0600) and renamed over it when the block ends without an error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.part = path.with_name(path.name + ".part")

    def __enter__(self):
        fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, kind, value, traceback) -> None:
        self.file.close()
        if kind is None:
            os.replace(self.part, self.path)
        else:
            self.part.unlink(missing_ok=True)


def _write(path: Path, data: bytes) -> None:
    with _writer(path) as out:
        out.write(data)


def _read(path: Path | None, model: type[BaseModel]):
    if path is None:
        return None
    try:
        return model.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None


def _read_all(folder: Path, model: type[BaseModel]) -> list:
    found = []
    for path in folder.glob("*.json"):
        if (record := _read(path, model)) is not None:
            found.append(record)
    return found
