"""Bad settings, through the real CLI: one line naming the key, a non-zero exit, and nothing touched.

Each command runs as its own process against a home holding a job submitted with good settings; the job's
rows, the audit log and the broker's messages must be exactly as they were, and a good worker then finishes
the job."""

from __future__ import annotations

import subprocess
import sys

from sqlalchemy import text

from tests.e2e.conftest import NOTES, ROOT

BAD = ["1e12", "nan", "inf", "-1", "1e400", "abc"]
VARIABLES = ["ENCLAVE_LEASE_SECONDS", "ENCLAVE_MAX_NUM_SEQS", "ENCLAVE_MAX_ATTEMPTS"]
# The engine's variables (engine/env.py), checked when a worker starts rather than in its first shard.
ENGINE_BAD = {"ENCLAVE_KERNELS": "cuda", "ENCLAVE_DELTANET_V_SPLITS": "3", "ENCLAVE_PDL": "yes"}
# Unknown keys in each part of enclave.toml, and a bad value in the file: (file, the name its error gives).
BAD_FILES = [
    ('lease_secnds = 5\ndatabase_url = "sqlite:///elsewhere.db"\n', "lease_secnds"),
    ("[limits]\nmax_attemps = 2\n", "max_attemps"),
    ("[engine]\nmax_num_seq = 8\n", "max_num_seq"),
    ("[limit]\nlease_seconds = 5\n", "limit"),
    ("[limits]\nmax_attempts = nan\n", "[limits] max_attempts"),  # ENCLAVE_LEASE_SECONDS is set: it wins
    ("[engine]\nmax_num_seqs = 1e400\n", "[engine] max_num_seqs"),
]


def snapshot(enclave) -> dict:
    """Every row that a worker or submit would change: documents, jobs, results, audit, broker messages."""
    db = enclave.database()
    try:
        with db.engine.connect() as c:
            state = {
                table: sorted(map(tuple, c.execute(text(f"SELECT * FROM {table}")).all()))
                for table in ("jobs", "documents", "results", "audit_events")
            }
    finally:
        db.dispose()
    import sqlite3

    broker = sqlite3.connect(enclave.home / "broker.db")
    try:
        state["broker"] = broker.execute(
            "SELECT id, visible, payload FROM kombu_message ORDER BY id"
        ).fetchall()
    finally:
        broker.close()
    return state


def run_all(enclave, commands: list[tuple[list[str], dict[str, str]]], at_once: int = 4) -> list:
    """Run the commands, `at_once` processes at a time, and return their completed processes."""
    results = []
    for start in range(0, len(commands), at_once):
        procs = [
            subprocess.Popen(
                argv,
                env={**enclave.env, **env},
                cwd=enclave.tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for argv, env in commands[start : start + at_once]
        ]
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:  # the defect this guards against: a worker that never exits
                proc.kill()
                stdout, stderr = proc.communicate()
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def assert_one_line_naming(proc, name: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode not in (0, None, -9), (proc.args, proc.returncode, proc.stderr)
    assert len(lines) == 1, (proc.args, proc.stderr)
    assert "Traceback" not in proc.stderr and name in lines[0], (proc.args, proc.stderr)


ENCLAVE = [sys.executable, "-m", "pipeline.cli"]
WORKER = [*ENCLAVE, "worker", "--until-idle", "--concurrency", "2"]


def test_each_bad_setting_stops_every_command_before_any_work(embedded):
    job = embedded.submit(
        str(NOTES / "note-03-fracture.txt"), "--kind", "summarize", "--param", "max_tokens=8"
    )
    before = snapshot(embedded)
    assert [row for row in before["documents"] if "pending" in row] and before["broker"]

    commands = [(WORKER, {var: value}) for var in VARIABLES for value in BAD]
    others = [
        ["status", job],
        ["jobs"],
        ["submit", str(NOTES / "note-01-chest-pain.txt"), "--kind", "summarize"],
        ["results", job, "--out", str(embedded.tmp / "out")],
        ["cancel", job],
        ["init"],
    ]
    commands += [([*ENCLAVE, *args], {"ENCLAVE_LEASE_SECONDS": "nan"}) for args in others]
    commands += [(WORKER, {var: value}) for var, value in ENGINE_BAD.items()]
    commands.append(([*ENCLAVE, "demo"], {"ENCLAVE_KERNELS": "cuda"}))
    celery = [sys.executable, "-m", "celery", "-A", "pipeline.celery_app", "worker"]
    commands += [(celery, {"ENCLAVE_MAX_NUM_SEQS": "1e400"}), (celery, {"ENCLAVE_PDL": "yes"})]
    for proc, (argv, env) in zip(run_all(embedded, commands), commands, strict=True):
        (name,) = env
        assert_one_line_naming(proc, name)
        if argv[2] == "pipeline.cli":
            assert proc.returncode == 2 and proc.stderr.startswith(f"error: {name} must be ")
            assert f"got '{env[name]}'" in proc.stderr
            assert name in ENGINE_BAD or "between" in proc.stderr
    assert snapshot(embedded) == before

    for toml, name in BAD_FILES:
        (embedded.home / "enclave.toml").write_text(toml)
        (proc,) = run_all(embedded, [(WORKER, {})])
        assert_one_line_naming(proc, name)
        assert "enclave.toml" in proc.stderr
    assert snapshot(embedded) == before

    (embedded.home / "enclave.toml").unlink()
    embedded.work()
    assert embedded.json("status", job)["done"] == 1


def test_importing_the_pipeline_reads_no_settings(embedded):
    """Settings are read by the command that needs them, so a bad one cannot break imports (or `--help`)."""
    modules = ("celery_app", "client", "tasks", "worker_process", "errors", "cli")
    code = "; ".join(f"import pipeline.{m}" for m in modules)
    bad = {"ENCLAVE_LEASE_SECONDS": "nan", "ENCLAVE_MAX_NUM_SEQS": "1e400"}
    imported, helped = run_all(
        embedded, [([sys.executable, "-c", code], bad), ([*ENCLAVE, "worker", "--help"], bad)]
    )
    assert imported.returncode == 0 and imported.stderr == "", imported.stderr
    assert helped.returncode == 0 and "--until-idle" in helped.stdout


def test_home_option_is_the_home_whose_file_is_read(tmp_path):
    """`--home` wins over ENCLAVE_HOME: its enclave.toml is the one checked, an unknown key is one line."""
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    (home / "enclave.toml").write_text("[limits]\nmax_attemps = 2\n")
    env = {"ENCLAVE_HOME": str(other), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [*ENCLAVE, "--home", str(home), "jobs"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: enclave.toml: unknown setting 'max_attemps'") and not other.exists()
