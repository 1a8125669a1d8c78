"""What a code-review job's scan found, kept by the client for the report: the folders scanned (repository,
commit, how its files were listed) and the files skipped, with why. The client stores it when it submits
the job (`pipeline.scan_records`, sealed to itself) and reads it back to write report.md and report.sarif.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.bounded_json import loads

GIT_WORKING_TREE = "git ls-files"  # the tracked files, as they are in the working tree
GIT_COMMIT = "git ls-tree"  # the files of a commit, read from git
FOLDER_WALK = "folder walk"  # not a git work tree: the folder walked, its .gitignore files honoured
MAX_RECORD_BYTES = 256 * 2**20


class ScanSource(BaseModel):
    """One scanned folder. `name_prefix` starts the names of its documents ("" for one folder, "name/" when
    several were submitted); `path_in_repository` is the folder's path in its work tree ("" at the top, else
    like "src/"); `commit` is HEAD's SHA for the working tree (None before the first commit) or the SHA of
    the commit scanned; `changed` counts tracked files whose content differs from it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repository: str
    method: Literal["git ls-files", "git ls-tree", "folder walk"]
    commit: str | None = None
    changed: int = 0
    path_in_repository: str = ""
    name_prefix: str = ""


class ScanRecord(BaseModel):
    """The scan of a job: when, which folders, and the skipped (document name, reason) pairs."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    scanned_at: datetime = Field(default_factory=lambda: datetime.now(UTC).replace(microsecond=0))
    sources: list[ScanSource] = Field(default_factory=list)
    skipped: list[tuple[str, str]] = Field(default_factory=list)

    def to_json(self) -> bytes:
        """The record as UTF-8 JSON; a file name that is not UTF-8 shows its bytes as \\xNN, as the
        documents' names do."""
        record = self.model_copy(update={"skipped": [(printable(n), r) for n, r in self.skipped]})
        return record.model_dump_json().encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> ScanRecord:
        """A record from `to_json`'s bytes; `ValueError` (one line, content-free) when they are not one."""
        return cls.model_validate(loads(data, "scan record", max_bytes=MAX_RECORD_BYTES))

    def source_of(self, name: str) -> tuple[ScanSource | None, str]:
        """The source a document `name` came from (the one with the longest matching prefix) and the name
        within it; (None, name) for a file submitted on its own."""
        matches = [s for s in self.sources if name.startswith(s.name_prefix)]
        if not matches:
            return None, name
        source = max(matches, key=lambda s: len(s.name_prefix))
        return source, name[len(source.name_prefix) :]

    def repository_path(self, name: str) -> str:
        """Where document `name` sits in its repository (the scanned folder's path prepended)."""
        source, rel = self.source_of(name)
        return (source.path_in_repository if source else "") + rel


def printable(name: str) -> str:
    """`name` as valid Unicode: bytes of a file name that are not UTF-8 show as \\xNN (as the client names
    documents)."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is no file-name byte
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
