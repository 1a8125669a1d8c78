import os

import pytest

from jobs.repository import language_of, walk_repository
from jobs.scan_rules import ScanOptions


def write(root, path, data: bytes | str = "x = 1\n"):
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture
def repo(tmp_path):
    write(tmp_path, ".gitignore", "*.log\n/secrets.txt\nout/\n")
    write(tmp_path, "main.py")
    write(tmp_path, "app.log")
    write(tmp_path, "secrets.txt")
    write(tmp_path, "out/gen.py")
    write(tmp_path, "src/secrets.txt")  # "/secrets.txt" is anchored to the root
    write(tmp_path, "src/.gitignore", "*.tmp\n!keep.log\n")
    write(tmp_path, "src/lib.py")
    write(tmp_path, "src/scratch.tmp")
    write(tmp_path, "src/keep.log")  # re-included by the nested .gitignore
    write(tmp_path, "scratch.tmp")  # the nested .gitignore does not reach the root
    write(tmp_path, "node_modules/pkg/index.js")
    write(tmp_path, "pkg.egg-info/PKG-INFO")
    write(tmp_path, "src/__pycache__/lib.cpython-311.pyc", b"\x00\x01")
    write(tmp_path, ".git/config")
    write(tmp_path, "logo.png", b"\x89PNG")
    write(tmp_path, "data.dat", b"abc\x00def")
    write(tmp_path, "big.py", "x" * 2000)
    write(tmp_path, "empty.py", "")
    os.symlink(tmp_path / "main.py", tmp_path / "link.py")
    os.symlink(tmp_path / "src", tmp_path / "linked_dir")
    return tmp_path


def test_walk_honours_gitignore_and_skips_what_is_not_source(repo):
    found = walk_repository(repo, ScanOptions(max_file_bytes=1000))
    assert found.files == [
        ".gitignore",
        "main.py",
        "scratch.tmp",
        "src/.gitignore",
        "src/keep.log",
        "src/lib.py",
        "src/secrets.txt",
    ]
    assert found.skipped == [
        ("big.py", "too large"),
        ("data.dat", "binary"),
        ("empty.py", "empty"),
        ("link.py", "symlink"),
        ("linked_dir", "symlink"),
        ("logo.png", "binary"),
        ("node_modules/", "vendored"),
        ("pkg.egg-info/", "vendored"),
        ("src/__pycache__/", "vendored"),
    ]


def test_ignored_vendored_directory_is_silent(tmp_path):
    write(tmp_path, ".gitignore", "node_modules\n")
    write(tmp_path, "node_modules/a.js")
    write(tmp_path, "a.js")
    found = walk_repository(tmp_path)
    assert (found.files, found.skipped) == ([".gitignore", "a.js"], [])


def test_walk_needs_a_directory(tmp_path):
    with pytest.raises(NotADirectoryError):
        walk_repository(tmp_path / "nope")


@pytest.mark.parametrize(
    ("path", "language"),
    [("a/b.py", "Python"), ("x.TS", "TypeScript"), ("Dockerfile", "Dockerfile"), ("notes", "text")],
)
def test_language_of(path, language):
    assert language_of(path) == language
