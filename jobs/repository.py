"""The plain folder walk of a repository scan, for a folder that is not a git work tree: .gitignore files
honoured (the root's and nested ones), symlinks and vendored folders skipped, each file judged by the rules
of `jobs.scan_rules`. Also each file's language, for prompts and reports."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pathspec import GitIgnoreSpec

from jobs.scan_rules import HEAD_BYTES, Rules, ScanOptions, is_vendored

_LANGUAGES = {
    ".py": "Python", ".pyi": "Python", ".js": "JavaScript", ".mjs": "JavaScript", ".cjs": "JavaScript",
    ".jsx": "JavaScript", ".ts": "TypeScript", ".tsx": "TypeScript", ".go": "Go", ".rs": "Rust",
    ".java": "Java", ".kt": "Kotlin", ".scala": "Scala", ".swift": "Swift", ".c": "C", ".h": "C",
    ".cc": "C++", ".cpp": "C++", ".cxx": "C++", ".hpp": "C++", ".hh": "C++", ".cu": "CUDA", ".cs": "C#",
    ".rb": "Ruby", ".php": "PHP", ".pl": "Perl", ".lua": "Lua", ".r": "R", ".jl": "Julia",
    ".sh": "Shell", ".bash": "Shell", ".zsh": "Shell", ".ps1": "PowerShell", ".sql": "SQL",
    ".html": "HTML", ".htm": "HTML", ".css": "CSS", ".scss": "SCSS", ".vue": "Vue", ".svelte": "Svelte",
    ".md": "Markdown", ".rst": "reStructuredText", ".json": "JSON", ".yaml": "YAML", ".yml": "YAML",
    ".toml": "TOML", ".ini": "INI", ".cfg": "INI", ".xml": "XML", ".proto": "Protocol Buffers",
    ".tf": "Terraform", ".jinja": "Jinja", ".j2": "Jinja", ".ipynb": "Jupyter Notebook",
}  # fmt: skip
_FILE_NAMES = {"Dockerfile": "Dockerfile", "Makefile": "Makefile", "CMakeLists.txt": "CMake"}


@dataclass
class RepositoryFiles:
    """Files to review (posix paths relative to the root, sorted) and what was skipped, with why.

    Reasons: "vendored" (a directory, listed with a trailing /), "symlink", "unreadable", and those of
    `jobs.scan_rules` ("binary", "too large", "empty", "lockfile", "minified", "generated", "excluded"...).
    Files matched by .gitignore are left out silently.
    """

    files: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def walk_repository(root: Path, options: ScanOptions | None = None) -> RepositoryFiles:
    """Walk `root` without following symlinks, honouring the root's and nested .gitignore files; files are
    judged by the rules of `options` (default: `ScanOptions()`)."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    found = RepositoryFiles()
    _walk(root, "", [], found, Rules(options or ScanOptions()))
    found.files.sort()
    found.skipped.sort()
    return found


def language_of(path: str) -> str:
    """The language of a file, from its name or extension ("text" when unknown)."""
    name = PurePosixPath(path).name
    if name in _FILE_NAMES:
        return _FILE_NAMES[name]
    return _LANGUAGES.get(PurePosixPath(name).suffix.lower(), "text")


Specs = list[tuple[str, GitIgnoreSpec]]  # (directory prefix like "src/", its .gitignore), outermost first


def _walk(directory: Path, prefix: str, specs: Specs, found: RepositoryFiles, rules: Rules) -> None:
    gitignore = directory / ".gitignore"
    if gitignore.is_file() and not gitignore.is_symlink():
        try:
            lines = gitignore.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        specs = [*specs, (prefix, GitIgnoreSpec.from_lines(lines))]
    try:
        with os.scandir(directory) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
    except OSError:
        found.skipped.append((prefix or ".", "unreadable"))
        return
    for entry in entries:
        path = prefix + entry.name
        if entry.name == ".git":
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        if _ignored(specs, path, is_dir):
            continue
        if entry.is_symlink():
            found.skipped.append((path, "symlink"))
        elif is_dir and "vendored" in rules.options.skip and is_vendored(entry.name):
            found.skipped.append((path + "/", "vendored"))
        elif is_dir:
            _walk(Path(entry.path), path + "/", specs, found, rules)
        elif entry.is_file(follow_symlinks=False):
            reason = _skip_reason(entry, path, rules)
            if reason is None:
                found.files.append(path)
            else:
                found.skipped.append((path, reason))


def _ignored(specs: Specs, path: str, is_dir: bool) -> bool:
    """Git's rule: the deepest .gitignore with a matching pattern decides, and its last match wins."""
    ignored = False
    for prefix, spec in specs:
        if path.startswith(prefix):
            result = spec.check_file(path[len(prefix) :] + ("/" if is_dir else ""))
            if result.include is not None:
                ignored = result.include
    return ignored


def _skip_reason(entry: os.DirEntry, path: str, rules: Rules) -> str | None:
    if reason := rules.path_reason(path):
        return reason
    try:
        if reason := rules.size_reason(entry.stat(follow_symlinks=False).st_size):
            return reason
        with open(entry.path, "rb") as file:
            head = file.read(HEAD_BYTES)
    except OSError:
        return "unreadable"
    return rules.content_reason(head)
