"""A repository scan for code review: which files of a folder are submitted, which are skipped and why.

In a git work tree the files come from git, so only what is committed is reviewed: the tracked files as
they are in the working tree (`git ls-files`), or with `commit=` the files of that commit, read from git
(`git ls-tree`, `git cat-file`). Untracked files, a planted `.env` say, are never listed, and neither are
those .gitignore or .git/info/exclude ignore, since git tracks neither (a tracked file that a later
.gitignore line matches is still tracked, and reviewed). `linguist-generated` and `linguist-vendored` come
from `git check-attr`. A folder in no work tree is walked (`jobs.repository`). Both judge files by the
rules of `jobs.scan_rules`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from jobs.git_files import (
    SUBMODULE,
    SYMLINK,
    GitBlob,
    GitEntry,
    GitError,
    WorkTree,
    attributes,
    blob_heads,
    changed_files,
    committed_files,
    find_work_tree,
    head_commit,
    resolve_commit,
    tracked_files,
)
from jobs.repository import walk_repository
from jobs.scan_record import FOLDER_WALK, GIT_COMMIT, GIT_WORKING_TREE, ScanSource
from jobs.scan_rules import HEAD_BYTES, Attributes, Rules, ScanOptions, vendored_folder

__all__ = ["GitBlob", "GitError", "Scan", "ScanOptions", "scan_folder"]


@dataclass
class Scan:
    """The files to submit, as (name relative to the folder, where to read it: a path or a commit's blob),
    sorted; the skipped (name, reason) pairs, sorted; and what was scanned."""

    files: list[tuple[str, Path | GitBlob]]
    skipped: list[tuple[str, str]]
    source: ScanSource


def scan_folder(folder: Path, options: ScanOptions | None = None) -> Scan:
    """Scan `folder` with `options`; `GitError` (one line, says what to do) when git cannot list it."""
    folder, options = Path(folder), options or ScanOptions()
    tree = find_work_tree(folder)
    if tree is None:
        if options.commit is not None:
            raise GitError(
                f"{folder} is not in a git work tree, so it has no commit to scan; leave out commit="
            )
        found = walk_repository(folder, options)
        source = ScanSource(repository=folder.resolve().name, method=FOLDER_WALK)
        return Scan([(rel, folder / rel) for rel in found.files], found.skipped, source)
    return _git_scan(folder, tree, options)


def _git_scan(folder: Path, tree: WorkTree, options: ScanOptions) -> Scan:
    committed = options.commit is not None
    if committed:
        commit = resolve_commit(tree, options.commit)
        entries, changed = committed_files(tree, commit), 0
    else:
        commit, entries = head_commit(tree), tracked_files(tree)
        changed = sum(path.startswith(tree.prefix) for path in changed_files(tree))
    entries = [entry for entry in entries if entry.path.startswith(tree.prefix)]
    if not entries:
        where = f"at commit {commit}" if committed else "in the index"
        raise GitError(
            f"{folder} holds no files tracked by git {where}; commit them, or copy the folder out of the "
            "work tree to review it as plain files"
        )
    attrs = attributes(tree, [e.path for e in entries], commit if committed else None)
    files, skipped = _judge(tree, entries, attrs, Rules(options), committed)
    method = GIT_COMMIT if committed else GIT_WORKING_TREE
    source = ScanSource(
        repository=tree.top.name,
        method=method,
        commit=commit,
        changed=changed,
        path_in_repository=tree.prefix,
    )
    return Scan(files, skipped, source)


Head = tuple[bytes | None, str | None]  # a file's first HEAD_BYTES, or the reason it cannot be reviewed
Candidate = tuple[str, GitEntry, Attributes]  # (name in the folder, git's entry, its attributes)


def _judge(
    tree: WorkTree, entries: list[GitEntry], attrs: dict[str, Attributes], rules: Rules, committed: bool
) -> tuple[list[tuple[str, Path | GitBlob]], list[tuple[str, str]]]:
    """The files to submit and the skipped ones: by mode and name first, then by size and content."""
    skipped: set[tuple[str, str]] = set()
    candidates: list[Candidate] = []
    for entry in entries:
        name, found = entry.path[len(tree.prefix) :], attrs.get(entry.path, Attributes())
        reason = _mode_reason(entry) or rules.path_reason(name, found)
        if reason == "vendored" and found.vendored is None:  # a vendored folder: listed once
            skipped.add((vendored_folder(name) or name, reason))
        elif reason is not None:
            skipped.add((name, reason))
        else:
            candidates.append((name, entry, found))
    read = _read_committed if committed else _read_working_tree
    files: list[tuple[str, Path | GitBlob]] = []
    with closing(read(tree, candidates, rules)) as heads:  # one file's head in memory at a time
        for (name, entry, found), (head, reason) in zip(candidates, heads, strict=True):
            if reason is None and head is not None:
                reason = rules.content_reason(head, found)
            if reason is not None:
                skipped.add((name, reason))
            elif committed:
                files.append((name, GitBlob(tree.top, entry.sha, entry.size or 0)))
            else:
                files.append((name, tree.top / entry.path))
    return files, sorted(skipped)


def _mode_reason(entry: GitEntry) -> str | None:
    if entry.mode == SUBMODULE:
        return "submodule"
    return "symlink" if entry.mode == SYMLINK else None


def _read_working_tree(tree: WorkTree, candidates: list[Candidate], rules: Rules) -> Iterator[Head]:
    """Each candidate's head from the working tree, in order."""
    for _, entry, _ in candidates:
        path = tree.top / entry.path
        try:
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                yield None, "symlink"
            elif not stat.S_ISREG(info.st_mode):
                yield None, "not a file in the working tree"
            elif reason := rules.size_reason(info.st_size):
                yield None, reason
            else:
                with open(path, "rb") as file:
                    yield file.read(HEAD_BYTES), None
        except FileNotFoundError:
            yield None, "deleted in the working tree"
        except OSError:
            yield None, "unreadable"


def _read_committed(tree: WorkTree, candidates: list[Candidate], rules: Rules) -> Iterator[Head]:
    """Each candidate's head from the commit, in order, through one git process."""
    reasons = [rules.size_reason(entry.size or 0) for _, entry, _ in candidates]
    wanted = [entry.sha for (_, entry, _), reason in zip(candidates, reasons, strict=True) if reason is None]
    with closing(blob_heads(tree, wanted, HEAD_BYTES)) as heads:
        for reason in reasons:
            if reason is not None:
                yield None, reason
            elif (head := next(heads)) is None:
                yield None, "unreadable"
            else:
                yield head, None
