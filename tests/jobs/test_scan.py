"""Repository scans (issue 16 item 4) on real git repositories: what is committed is reviewed, what git does
not track never is, and each skip rule gives its reason."""

import os
from pathlib import Path

import pytest

from jobs import git_files
from jobs.git_files import GitBlob, GitError
from jobs.scan import scan_folder
from jobs.scan_record import FOLDER_WALK, GIT_COMMIT, GIT_WORKING_TREE
from jobs.scan_rules import ScanOptions
from tests.git_repo import REVIEWED, SECRET, SKIPPED, GitRepo, planted_repository

DEFAULT = ScanOptions(exclude=("docs/",))


@pytest.fixture
def planted(tmp_path):
    return planted_repository(tmp_path / "planted")


def names(scan) -> set[str]:
    return {name for name, _ in scan.files}


def test_working_tree_scan_reviews_the_tracked_files_and_skips_each_planted_case(planted):
    repo, first = planted
    scan = scan_folder(repo.root, DEFAULT)
    assert names(scan) == REVIEWED  # no .env, scratch/ (.git/info/exclude) or debug.log (.gitignore)
    assert set(scan.skipped) == SKIPPED and len(scan.skipped) == len(SKIPPED)
    assert (scan.source.method, scan.source.commit, scan.source.changed) == (GIT_WORKING_TREE, first, 1)
    assert (scan.source.repository, scan.source.path_in_repository) == ("planted", "")
    sources = dict(scan.files)
    assert sources["src/util.py"].read_bytes().endswith(b"x // 2\n")  # the working tree's content
    assert all(SECRET.encode() not in source.read_bytes() for source in sources.values())


def test_the_old_folder_walk_would_have_reviewed_the_untracked_secrets(planted):
    """Why git decides: walked as a plain folder, the same tree sends the .env and the excluded file."""
    repo, _ = planted
    (repo.root / ".git").rename(repo.root / "git-dir-moved-away")
    scan = scan_folder(repo.root, ScanOptions(exclude=("docs/", "git-dir-moved-away/")))
    assert scan.source.method == FOLDER_WALK
    assert {".env", "scratch/notes.py"} <= names(scan)
    assert "keep.log" not in names(scan)  # the walk drops a tracked file that .gitignore matches


def test_commit_scan_reads_files_and_attributes_from_the_commit(planted):
    repo, first = planted
    repo.write(".gitattributes", "third/** linguist-vendored\n")  # gen/ no longer generated...
    repo.write("src/app.py", "def add(a, b):\n    return a + b\n")
    repo.write("src/new.py", "NEW = 1\n")
    second = repo.commit("second")
    scan = scan_folder(repo.root, ScanOptions(exclude=("docs/",), commit=first[:10]))
    assert (scan.source.method, scan.source.commit, scan.source.changed) == (GIT_COMMIT, first, 0)
    assert names(scan) == REVIEWED  # ...at `second`, but still at `first`; src/new.py is not in `first`
    blobs = dict(scan.files)
    assert all(isinstance(blob, GitBlob) for blob in blobs.values())
    assert blobs["src/app.py"].read_bytes() == b"def add(a, b):\n    return a - b\n"
    assert blobs["src/util.py"].stat().st_size == len(b"def half(x):\n    return x / 2\n")
    latest = scan_folder(repo.root, ScanOptions(exclude=("docs/",), commit="main"))
    assert latest.source.commit == second
    assert {"src/new.py", "gen/client.py"} <= names(latest)


def test_include_and_exclude_are_gitignore_style_globs(planted):
    repo, _ = planted
    scan = scan_folder(repo.root, ScanOptions(include=("src/", "/*.md"), exclude=("util.py",)))
    assert names(scan) == {"README.md", "src/app.py"}
    reasons = dict(scan.skipped)
    assert reasons["src/util.py"] == "excluded"  # exclude wins over include; no slash: any depth
    assert reasons["docs/guide.md"] == "not included"  # a leading slash anchors at the folder
    assert reasons["uv.lock"] == reasons["keep.log"] == "not included"
    assert dict(scan_folder(repo.root, ScanOptions(include=("*.md",))).skipped).get("docs/guide.md") is None
    negated = scan_folder(repo.root, ScanOptions(include=("*.py", "!gen/**")))  # ! re-excludes
    assert "gen/client.py" not in names(negated) and dict(negated.skipped)["gen/client.py"] == "not included"


def test_skip_none_reviews_lockfiles_minified_generated_and_vendored(planted):
    repo, _ = planted
    scan = scan_folder(repo.root, ScanOptions(skip=frozenset()))
    expected = {"uv.lock", "web/app.min.js", "web/bundle.js", "gen/client.py", "api/types.go"}
    assert expected | {"third/lib.py", "node_modules/left-pad/index.js", "docs/guide.md"} <= names(scan)
    assert dict(scan.skipped) == {"logo.png": "binary"}


def test_max_file_bytes(planted):
    repo, _ = planted
    scan = scan_folder(repo.root, ScanOptions(max_file_bytes=20, include=("*.py",)))
    reasons = dict(scan.skipped)
    assert reasons["src/app.py"] == reasons["src/util.py"] == "too large"  # 34 and 32 bytes
    assert "gen/client.py" in reasons and names(scan) == set()


def test_attribute_false_keeps_what_a_name_rule_would_skip(planted):
    repo, _ = planted
    repo.write(".gitattributes", "node_modules/** -linguist-vendored\ngen/** linguist-generated\n")
    scan = scan_folder(repo.root, ScanOptions(include=("*.js", "*.py")))
    assert "node_modules/left-pad/index.js" in names(scan)
    assert "third/lib.py" in names(scan)  # its linguist-vendored line is gone from the working tree


def test_a_sub_folder_is_scanned_with_names_relative_to_it(planted):
    repo, first = planted
    scan = scan_folder(repo.root / "src")
    assert names(scan) == {"app.py", "util.py"}
    assert (scan.source.path_in_repository, scan.source.commit, scan.source.changed) == ("src/", first, 1)


def test_tracked_symlinks_and_deleted_files(planted):
    repo, _ = planted
    os.symlink("src/app.py", repo.root / "link.py")
    repo.commit("link")
    (repo.root / "README.md").unlink()
    reasons = dict(scan_folder(repo.root).skipped)
    assert reasons["link.py"] == "symlink"
    assert reasons["README.md"] == "deleted in the working tree"


def test_git_is_not_misled_by_the_environment(planted, tmp_path, monkeypatch):
    repo, _ = planted
    other = GitRepo(tmp_path / "other")
    other.write("other.py")
    other.commit()
    monkeypatch.setenv("GIT_DIR", str(other.root / ".git"))  # as a git hook would set it
    monkeypatch.setenv("GIT_INDEX_FILE", str(other.root / ".git" / "index"))
    assert names(scan_folder(repo.root, DEFAULT)) == REVIEWED


def test_a_commit_that_does_not_exist(planted):
    repo, _ = planted
    with pytest.raises(
        GitError, match=r"^'no-such-branch' names no commit in .*; give a SHA, a branch or a tag$"
    ):
        scan_folder(repo.root, ScanOptions(commit="no-such-branch"))


def test_a_folder_without_tracked_files_says_what_to_do(planted):
    repo, _ = planted
    with pytest.raises(GitError, match="holds no files tracked by git in the index; commit them, or copy"):
        scan_folder(repo.root / "scratch")


def test_a_repository_without_commits(tmp_path):
    repo = GitRepo(tmp_path / "fresh")
    repo.write("a.py")
    repo.git("add", "a.py")
    scan = scan_folder(repo.root)
    assert names(scan) == {"a.py"} and (scan.source.commit, scan.source.changed) == (None, 1)


def test_without_git_a_work_tree_is_refused_and_a_plain_folder_walked(planted, tmp_path, monkeypatch):
    repo, _ = planted
    monkeypatch.setattr(git_files.shutil, "which", lambda name: None)
    with pytest.raises(
        GitError, match=r"is in a git work tree but the git program is not installed; install git"
    ):
        scan_folder(repo.root / "src")
    plain = tmp_path / "plain"
    (plain / "web").mkdir(parents=True)
    (plain / "a.py").write_text("x = 1\n")
    (plain / "web" / "yarn.lock").write_text("# yarn lockfile v1\n")
    scan = scan_folder(plain)
    assert (names(scan), scan.skipped, scan.source.method) == (
        {"a.py"},
        [("web/yarn.lock", "lockfile")],
        FOLDER_WALK,
    )


def test_commit_needs_a_work_tree(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(
        GitError, match="is not in a git work tree, so it has no commit to scan; leave out commit="
    ):
        scan_folder(tmp_path, ScanOptions(commit="HEAD"))


def test_commit_attributes_leave_no_temporary_index(planted):
    repo, first = planted
    scan_folder(repo.root, ScanOptions(commit=first))
    assert not [p for p in Path(repo.root / ".git").iterdir() if p.name.startswith("enclave-scan-")]


@pytest.mark.skipif(os.geteuid() != 0, reason="handing the repository to another user needs root")
def test_a_repository_of_another_user_is_refused_with_what_to_do(planted, monkeypatch):
    repo, _ = planted
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)  # no safe.directory of the machine's
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for folder, _, files in os.walk(repo.root):
        for name in [".", *files]:
            os.lchown(os.path.join(folder, name), 65534, 65534)
    with pytest.raises(GitError, match="belongs to another user; if you trust it, run git config --global"):
        scan_folder(repo.root)
