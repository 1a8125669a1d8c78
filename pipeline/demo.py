"""`enclave demo` (what `make demo` runs): the whole encrypted flow on this machine, in a temporary home,
on the embedded defaults (SQLite database, SQLite broker, CPU, random-weight demo model)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.demo_model import LABEL
from pipeline import audit, keys, scan_records
from pipeline.client import ClientSession, fetch_results, submit_files
from pipeline.db import Database
from pipeline.home import init
from pipeline.results_files import write_results
from pipeline.settings import Limits, check_engine_env, load_settings
from pipeline.worker_process import WorkerOptions, run_worker

NOTES = Path(__file__).resolve().parent / "demo_notes"
# A sample of this repository for the code-review job: the `jobs` package (about 20 files). The whole tree
# is about 280 files and took the demo from about a minute to 4-8 minutes on 2 CPU cores.
REPOSITORY = Path(__file__).resolve().parents[1] / "jobs"


def run_demo(keep: bool = False) -> int:
    check_engine_env()  # before the temporary home: a bad engine variable is one line, nothing made
    console = Console()
    home = Path(tempfile.mkdtemp(prefix="enclave-demo-"))
    settings = replace(
        load_settings({"ENCLAVE_HOME": str(home)}),
        device="cpu",
        dtype="float32",
        limits=Limits(lease_seconds=60, shard_size=8),
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    # The demo may run as root in a container; Celery's warning about that is not news here.
    warnings.filterwarnings("ignore", message=".*superuser privileges.*")
    console.print(f"[bold]Enclave demo[/bold] in {home} (SQLite database and broker, CPU). {LABEL}.")
    start = time.perf_counter()
    try:
        report = init(settings, client_name="demo")
        console.print(
            f"1. init: service key {report.service_fingerprint[:12]}, client key "
            f"{report.client_fingerprint[:12]}, demo model written"
        )
        session = ClientSession(settings)
        jobs = [
            (
                "summarize",
                submit_files(session, [NOTES], "summarize", {"max_tokens": "48"}, name="clinical notes"),
            ),
            (
                "code-review",
                submit_files(
                    session, [REPOSITORY], "code-review", {"max_tokens": "32"}, name="the jobs package"
                ),
            ),
        ]
        for kind, job in jobs:
            console.print(
                f"2. submitted {kind}: job {job.job_id[:8]}, {job.documents} documents sealed "
                f"on the client and sent through the service API, here in-process ({len(job.skipped)} files "
                "skipped)"
            )
        console.print("3. worker: opening envelopes in memory, batching documents through the engine ...")
        t0 = time.perf_counter()
        # no metrics server: the demo is one process that exits when the work is done
        run_worker(
            settings, WorkerOptions(concurrency=2, until_idle=True, loglevel="WARNING", metrics_port=-1)
        )
        console.print(f"   worker finished in {time.perf_counter() - t0:.1f}s")
        table = Table("job", "kind", "documents", "done", "failed", "results")
        failures = []
        for kind, job in jobs:
            _, records = fetch_results(session, job.job_id)
            scan = scan_records.load(settings.home, session.identity, job.job_id)
            files = write_results(home / "results" / job.job_id[:8], kind, records, scan)
            done = sum(r["status"] == "done" for r in records)
            failed = [r for r in records if r["status"] == "failed"]
            failures += [(kind, r["document"], r["error"]) for r in failed]
            table.add_row(
                job.job_id[:8],
                kind,
                str(len(records)),
                str(done),
                str(len(failed)),
                ", ".join(f.name for f in files),
            )
        session.close()
        console.print("4. results opened on the client with its own key:")
        console.print(table)
        for kind, document, error in failures:
            console.print(f"   failed alone ({kind}): {document}: {error}")
        ok = _verify(settings, console)
        console.print(f"done in {time.perf_counter() - start:.0f}s")
        return 0 if ok else 1
    finally:
        if keep:
            console.print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def _verify(settings, console: Console) -> bool:
    service = keys.load_public(settings.service_key_dir)
    db = Database(settings.database_url)
    try:
        with db.transaction() as s:
            report = audit.verify(
                s, verify_signature=lambda data, sig: keys.verify_signature(service, data, sig)
            )
    finally:
        db.dispose()
    if report.ok:
        console.print(
            f"5. audit verify: intact, {report.rows} events, {report.checkpoints} signed checkpoints"
        )
    else:
        console.print(f"5. audit verify: FAILED at row {report.first_bad_seq}: {report.reason}")
    return report.ok
