"""Git as a program, run with fixed argument lists (never through a shell): the work tree holding a folder,
its tracked files or a commit's, their linguist attributes, and the blobs of a commit.

Every call runs `git -C <top of the work tree>` with the environment's repository redirections removed
(GIT_DIR and the like, which a git hook would set), English messages, no optional locks, and fsmonitor off:
a repository's own config cannot make a scan start another program. A revision given by the user reaches
git only after `--end-of-options`; everything later names the commit by its SHA.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from jobs.scan_rules import Attributes

LINGUIST = ("linguist-generated", "linguist-vendored")
SYMLINK, SUBMODULE = "120000", "160000"  # git's modes of a symlink and of a submodule (gitlink)
_NOT_A_REPOSITORY = "not a git repository"


class GitError(ValueError):
    """Git cannot list what a scan needs; the one-line message says what to do."""


@dataclass(frozen=True)
class WorkTree:
    """The git work tree holding a scanned folder: its top, its git directory, and the folder's path in it
    ("" for the top, else like "src/")."""

    top: Path
    git_dir: Path
    prefix: str


@dataclass(frozen=True)
class GitEntry:
    """One file as git lists it: path from the top of the work tree, mode, blob SHA, and size (known from
    `ls-tree -l`; None for the index)."""

    path: str
    mode: str
    sha: str
    size: int | None = None


class BlobStat(NamedTuple):
    st_size: int


@dataclass(frozen=True)
class GitBlob:
    """A file of a commit, read from git only when its turn comes. It answers the two calls the client
    makes of a file path (`stat().st_size`, `read_bytes()`), so a commit's files are submitted like files
    on disk."""

    top: Path
    sha: str
    size: int

    def stat(self) -> BlobStat:
        return BlobStat(self.size)

    def read_bytes(self) -> bytes:
        return _git(self.top, "cat-file", "blob", self.sha, text=False).stdout


def find_work_tree(folder: Path) -> WorkTree | None:
    """The work tree holding `folder`, or None when it is in none. `GitError` when it is in one (a `.git`
    here or above) but git is not installed, or when git refuses the repository (unsafe owner, say)."""
    folder = Path(folder).resolve()
    if shutil.which("git") is None:
        if any((parent / ".git").exists() for parent in (folder, *folder.parents)):
            raise GitError(
                f"{folder} is in a git work tree but the git program is not installed; install git, so that "
                "only committed files are reviewed"
            )
        return None
    proc = _git(folder, "rev-parse", "--show-toplevel", "--absolute-git-dir", "--show-prefix", check=False)
    if proc.returncode != 0:
        if _NOT_A_REPOSITORY in proc.stderr:
            return None
        if "dubious ownership" in proc.stderr:  # the repository belongs to another user
            raise GitError(
                f"git refuses the repository holding {folder}: it belongs to another user; if you trust it, "
                "run git config --global --add safe.directory with its path, then submit again"
            )
        raise GitError(f"git cannot read the repository holding {folder}: {_first_line(proc.stderr)}")
    top, git_dir, prefix = proc.stdout.split("\n")[:3]
    return WorkTree(Path(top), Path(git_dir), prefix)


def resolve_commit(tree: WorkTree, revision: str) -> str:
    """The full SHA of the commit `revision` names; `GitError` when it names none."""
    proc = _git(
        tree.top,
        "rev-parse",
        "--verify",
        "--quiet",
        "--end-of-options",
        f"{revision}^{{commit}}",
        check=False,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise GitError(f"{revision!r} names no commit in {tree.top}; give a SHA, a branch or a tag")
    return proc.stdout.strip()


def head_commit(tree: WorkTree) -> str | None:
    """The SHA of HEAD's commit, or None in a repository without commits."""
    proc = _git(tree.top, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def tracked_files(tree: WorkTree) -> list[GitEntry]:
    """The files of the index (what is tracked), sorted; a path in a merge conflict is listed once."""
    entries: dict[str, GitEntry] = {}
    for record in _records(_git(tree.top, "ls-files", "-z", "--stage", "--full-name").stdout):
        info, _, path = record.partition("\t")
        mode, sha, _stage = info.split(" ")
        entries.setdefault(path, GitEntry(path, mode, sha))
    return sorted(entries.values(), key=lambda entry: entry.path)


def committed_files(tree: WorkTree, commit: str) -> list[GitEntry]:
    """The files of `commit` (a SHA), with their sizes, sorted."""
    entries = []
    for record in _records(_git(tree.top, "ls-tree", "-r", "-z", "-l", "--full-tree", commit).stdout):
        info, _, path = record.partition("\t")
        mode, _type, sha, size = info.split()
        entries.append(GitEntry(path, mode, sha, int(size) if size.isdigit() else None))
    return sorted(entries, key=lambda entry: entry.path)


def changed_files(tree: WorkTree) -> list[str]:
    """Tracked files whose working-tree or staged content differs from HEAD (paths from the top)."""
    out = _git(
        tree.top, "status", "--porcelain=v1", "-z", "--untracked-files=no", "--ignore-submodules=all"
    ).stdout
    records, paths = iter(_records(out)), []
    for record in records:
        paths.append(record[3:])
        if record[0] in "RC":  # a rename or copy: its source path follows as its own record
            next(records, None)
    return paths


def attributes(tree: WorkTree, paths: list[str], commit: str | None = None) -> dict[str, Attributes]:
    """The linguist attributes of `paths` (from the top): from the working tree's .gitattributes (and
    .git/info/attributes), or with `commit`, from that commit's. git 2.39 has no `check-attr --source`, so a
    commit's attributes are read through a temporary index of it, kept in the git directory (it lists file
    names: never in a shared temporary folder) and removed at once."""
    if not paths:
        return {}
    if commit is None:
        return _check_attr(tree, paths, cached=False, env={})
    index = tree.git_dir / f"enclave-scan-{uuid.uuid4().hex}.index"
    try:
        _git(tree.top, "read-tree", commit, env={"GIT_INDEX_FILE": str(index)})
        return _check_attr(tree, paths, cached=True, env={"GIT_INDEX_FILE": str(index)})
    finally:
        index.unlink(missing_ok=True)
        index.with_name(index.name + ".lock").unlink(missing_ok=True)


def blob_heads(tree: WorkTree, shas: list[str], limit: int) -> Iterator[bytes | None]:
    """The first `limit` bytes of each blob, in order (None for one git does not have), from one
    `cat-file --batch` process that reads each request as it is written."""
    with subprocess.Popen(
        [_program(), "-C", str(tree.top), *_CONFIG, "cat-file", "--batch"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_environment({}),
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for sha in shas:
                proc.stdin.write(sha.encode("ascii") + b"\n")
                proc.stdin.flush()
                header = proc.stdout.readline().split()  # <sha> <type> <size>, or <sha> missing
                if len(header) != 3 or not header[2].isdigit():
                    yield None
                    continue
                data = proc.stdout.read(int(header[2]) + 1)  # the content, then a newline
                yield data[: min(limit, int(header[2]))]
        finally:
            proc.stdin.close()


_CONFIG = ("-c", "core.fsmonitor=false", "-c", "core.quotePath=false")


def _check_attr(tree: WorkTree, paths: list[str], cached: bool, env: dict[str, str]) -> dict[str, Attributes]:
    args = ["check-attr", "-z", "--stdin", *(["--cached"] if cached else []), *LINGUIST]
    stdin = "".join(path + "\0" for path in paths)
    fields = _git(tree.top, *args, stdin=stdin, env=env).stdout.split("\0")
    values: dict[str, dict[str, bool | None]] = {path: {} for path in paths}
    for at in range(0, len(fields) - 2, 3):  # <path> NUL <attribute> NUL <value> NUL
        path, attribute, value = fields[at : at + 3]
        values.setdefault(path, {})[attribute] = _truth(value)
    return {
        path: Attributes(generated=found.get(LINGUIST[0]), vendored=found.get(LINGUIST[1]))
        for path, found in values.items()
    }


def _truth(value: str) -> bool | None:
    """A check-attr value: "set" or "true" is True, "unset" or "false" False, anything else unspecified."""
    if value in ("set", "true"):
        return True
    if value in ("unset", "false"):
        return False
    return None


def _git(
    cwd: Path,
    *args: str,
    check: bool = True,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """Run `git -C cwd args...`; `GitError` with git's first line of complaint when `check` and it fails."""
    proc = subprocess.run(
        [_program(), "-C", str(cwd), *_CONFIG, *args],
        input=stdin.encode("utf-8", "surrogateescape") if stdin is not None else None,
        capture_output=True,
        env=_environment(env or {}),
    )
    stdout = proc.stdout.decode("utf-8", "surrogateescape") if text else proc.stdout
    stderr = proc.stderr.decode("utf-8", "replace")
    if check and proc.returncode != 0:
        raise GitError(f"git {args[0]} failed in {cwd}: {_first_line(stderr) or f'exit {proc.returncode}'}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _program() -> str:
    program = shutil.which("git")
    if program is None:
        raise GitError("the git program is not installed; install git to scan a repository")
    return program


def _environment(extra: dict[str, str]) -> dict[str, str]:
    """git's whole environment, made here rather than inherited: no GIT_DIR, GIT_INDEX_FILE or other
    redirect set in the caller's shell, no system or user configuration (a scan lists what is committed,
    whatever this user's git config says), and the environment registries stay the only readers of ours."""
    fixed = {"LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "PATH": os.defpath}
    return fixed | {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull} | extra


def _records(output: str) -> list[str]:
    """The NUL-terminated records of a `-z` listing."""
    return [record for record in output.split("\0") if record]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
