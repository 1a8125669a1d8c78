"""The `enclave` command line. Human output by default, `--json` for scripts; a user error is one line on
stderr and a non-zero exit, never a traceback (internals go to the log without document content)."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from pipeline.settings import Settings, SettingsError, home_of, load_settings

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("enclave.cli")


class UserError(click.ClickException):
    """One line for the user, exit status 1."""


@dataclass
class Invocation:
    """One run of the CLI (click's `obj`): the `--home` given, and the settings once read."""

    home: Path | None = None
    settings: Settings | None = None

    def log_home(self) -> Path:
        """Where an internal error's stack goes: the settings' home, else --home or ENCLAVE_HOME."""
        return self.settings.home if self.settings is not None else home_of(self.home)


def emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, ensure_ascii=False))


@click.group()
@click.option("--home", type=click.Path(path_type=Path), help="Enclave home (default: $ENCLAVE_HOME).")
@click.pass_context
def cli(ctx: click.Context, home: Path | None) -> None:
    """Enclave: encrypted batch LLM jobs on private data, on your own hardware."""
    ctx.ensure_object(Invocation).home = home


def settings_of(ctx: click.Context) -> Settings:
    """The settings, read and checked once per process by the first command that needs them (so `--help`,
    `demo` and `bench` work whatever the environment holds); a bad one raises SettingsError."""
    invocation = ctx.find_root().ensure_object(Invocation)
    if invocation.settings is None:
        invocation.settings = load_settings(home=invocation.home)
    return invocation.settings


@cli.command()
@click.option("--name", help="Name of this home's client identity on the allow-list (default: $USER).")
@click.option(
    "--no-model", is_flag=True, help="Skip the model (a host that runs no worker: the API, a migration)."
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def init(ctx: click.Context, name: str | None, no_model: bool, as_json: bool) -> None:
    """On the service host: create the home, database, service keys, this home's client identity (an
    administrator on the allow-list) and the demo model (idempotent)."""
    from pipeline.home import init as do_init

    report = do_init(settings_of(ctx), name, model=not no_model)
    data = {
        "home": str(report.home),
        "database": _safe_url(report.database_url),
        "service_fingerprint": report.service_fingerprint,
        "client_fingerprint": report.client_fingerprint,
        "model": str(report.model) if report.model else None,
        "created": list(report.created),
    }
    if as_json:
        return emit(data)
    out.print(f"Enclave home {report.home} ready ({', '.join(report.created) or 'nothing new'} created).")
    out.print(
        f"  service key  {report.service_fingerprint[:16]}   client key  {report.client_fingerprint[:16]}"
    )
    out.print(f"  model        {report.model or 'not prepared (--no-model)'}")


@cli.group()
def keys() -> None:
    """Service and client keys."""


@keys.command("create")
@click.option("--service", is_flag=True, help="Create the service keys instead of this client's.")
@click.option("--passphrase", is_flag=True, help="Protect the private keys with a passphrase (prompted).")
@click.option("--force", is_flag=True, help="Replace existing keys (old results can no longer be opened).")
@click.pass_context
def keys_create(ctx: click.Context, service: bool, passphrase: bool, force: bool) -> None:
    """Create a key pair set (X25519 + Ed25519) with 0600 private key files."""
    from pipeline import keys as k

    settings = settings_of(ctx)
    directory = settings.service_key_dir if service else settings.client_key_dir
    secret = (
        click.prompt("Passphrase", hide_input=True, confirmation_prompt=True).encode() if passphrase else None
    )
    identity = k.generate_identity()
    k.save_identity(identity, directory, secret, overwrite=force)
    out.print(
        f"created {'service' if service else 'client'} keys in {directory}: {identity.public.fingerprint}"
    )


@keys.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def keys_show(ctx: click.Context, as_json: bool) -> None:
    """Show the public keys and fingerprints in this home."""
    from pipeline import keys as k

    settings = settings_of(ctx)
    data = {}
    for label, directory in (("service", settings.service_key_dir), ("client", settings.client_key_dir)):
        if (directory / k.PUBLIC_FILE).exists():
            data[label] = {
                **k.load_public(directory).to_json(),
                "public_file": str(directory / k.PUBLIC_FILE),
            }
    if not data:
        raise UserError(f"no keys in {settings.home}; run `enclave init`")
    if as_json:
        return emit(data)
    for label, item in data.items():
        out.print(f"{label:8} {item['fingerprint']}  ({item['public_file']})")


@keys.command("import-service")
@click.argument("public_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace a different service key already imported.")
@click.pass_context
def keys_import_service(ctx: click.Context, public_file: Path, force: bool) -> None:
    """Trust the service whose public.json is PUBLIC_FILE: documents are sealed to it, results checked
    against it. Compare the fingerprint printed with the one its administrator gives you."""
    from pipeline import keys as k

    settings = settings_of(ctx)
    public = k.load_public(public_file)
    target = settings.service_key_dir / k.PUBLIC_FILE
    if target.exists() and k.load_public(target) != public and not force:
        raise UserError(f"{target} holds another service's key; pass --force to replace it")
    if (settings.service_key_dir / k.X25519_FILE).exists() and k.load_public(target) != public:
        raise UserError(f"{settings.service_key_dir} holds this host's own service keys; use another home")
    k.save_public(public, settings.service_key_dir)
    out.print(f"service key {public.fingerprint} imported into {target}")


@keys.command("export-service")
@click.pass_context
def keys_export_service(ctx: click.Context) -> None:
    """Print the service's public.json, for clients' `enclave keys import-service`."""
    from pipeline import keys as k

    settings = settings_of(ctx)
    click.echo(json.dumps(k.load_public(settings.service_key_dir).to_json(), indent=2, sort_keys=True))


@cli.group()
def clients() -> None:
    """The allow-list of client keys that may call the service (administrators)."""


@clients.command("add")
@click.argument("name")
@click.argument("public_file", type=click.Path(exists=True, allow_dash=True, path_type=Path))
@click.option("--admin", is_flag=True, help="An administrator: manages clients and reads the audit log.")
@click.pass_context
def clients_add(ctx: click.Context, name: str, public_file: Path, admin: bool) -> None:
    """Allow-list the client whose public.json is PUBLIC_FILE (`-`: read it from standard input)."""
    from pipeline import keys as k
    from pipeline.wire.messages import AddClient

    if str(public_file) == "-":
        public = k.parse_public(click.get_text_stream("stdin").read(), "standard input")
    else:
        public = k.load_public(public_file)
    request = AddClient(
        name=name, x25519=public.x25519, ed25519=public.ed25519, role="admin" if admin else "client"
    )
    added = _session(ctx).api.add_client(request)
    out.print(f"allow-listed {added.name} ({added.role}): {added.fingerprint}")


@clients.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def clients_list(ctx: click.Context, as_json: bool) -> None:
    """List allow-listed (and revoked) clients."""
    rows = [c.model_dump(mode="json") for c in _session(ctx).api.clients().clients]
    if as_json:
        return emit(rows)
    table = Table("name", "role", "fingerprint", "added", "revoked")
    for r in rows:
        table.add_row(r["name"], r["role"], r["fingerprint"], _when(r["created_at"]), _when(r["revoked_at"]))
    out.print(table)


@clients.command("revoke")
@click.argument("fingerprint")
@click.pass_context
def clients_revoke(ctx: click.Context, fingerprint: str) -> None:
    """Revoke a client: the service refuses its requests and workers its jobs from now on."""
    revoked = _session(ctx).api.revoke(fingerprint)
    out.print(f"revoked {revoked.name}: {revoked.fingerprint}")


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--kind", help="summarize | extract | code-review | chat")
@click.option(
    "--openai-batch", "batch", type=click.Path(path_type=Path), help="An OpenAI Batch API JSONL file."
)
@click.option(
    "--records",
    is_flag=True,
    help="PATH is a CSV, JSONL or Parquet file: one document per row (summarize, extract).",
)
@click.option("--key", "record_key", help="With --records: the column naming each row (default: row N).")
@click.option(
    "--records-format",
    type=click.Choice(["csv", "jsonl", "parquet"]),
    help="With --records: the file's format when its extension does not say.",
)
@click.option("--name", default="", help="A label for the job (sealed to this client, like file names).")
@click.option(
    "--param",
    "params",
    multiple=True,
    help="key=value parameter of the job kind (repeatable); key=@FILE sends the text of FILE, read here "
    "(@@ keeps a literal @). Parameters are sealed to the service.",
)
@click.option("--priority", type=click.IntRange(0, 9), default=0, help="0..9, higher first.")
@click.option(
    "--job-id",
    help="A UUID for the job (default: a new one, printed before the upload). Submitting again with the same "
    "id never makes a second job: a submitted job is returned, an interrupted upload starts over.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def submit(
    ctx, paths, kind, batch, records, record_key, records_format, name, params, priority, job_id, as_json
) -> None:
    """Seal documents on this machine and submit them as one job."""
    from jobs.params import resolve_file_params
    from pipeline import client as c

    if batch and (paths or kind):
        raise UserError("give either --openai-batch FILE or PATH... --kind KIND, not both")
    if not batch and not (paths and kind):
        raise UserError("give PATH... and --kind KIND (or --openai-batch FILE)")
    if (record_key or records_format) and not records:
        raise UserError("--key and --records-format go with --records")
    if records and (batch or len(paths) != 1):
        raise UserError("--records takes one CSV, JSONL or Parquet file")
    chosen = job_id is not None

    def announce(claimed: str) -> None:
        if not chosen:  # printed before the upload, so an interrupted submit can be repeated with this id
            err.print(f"job {claimed}: uploading (if interrupted, submit again with --job-id {claimed})")

    session = _session(ctx)
    if batch:
        result = c.submit_openai_batch(session, batch, name, priority, job_id, announce)
    elif records:
        params = resolve_file_params(_params(params))
        result = c.submit_records(
            session, paths[0], kind, params, record_key, records_format, name, priority, job_id, announce
        )
    else:
        params = resolve_file_params(_params(params))
        result = c.submit_files(session, list(paths), kind, params, name, priority, job_id, announce)
    if as_json:
        return emit(
            {
                "job_id": result.job_id,
                "kind": result.kind,
                "documents": result.documents,
                "rejected": [{"document": p, "error": e} for p, e in result.rejected],
                "skipped": [{"document": p, "reason": e} for p, e in result.skipped],
                "dispatched": result.dispatched,
                "existing": result.existing,
            }
        )
    out.print(result.job_id)
    if result.existing:
        return err.print(
            f"job {result.job_id} was already submitted ({result.documents} documents); nothing new"
        )
    note = f"{result.documents} documents"
    if result.rejected:
        note += f", {len(result.rejected)} refused at submit (e.g. {result.rejected[0][1]})"
    if result.skipped:
        note += f", {len(result.skipped)} files skipped (report.md lists them with why)"
    if not result.dispatched:
        note += "; broker unreachable: workers pick the job up when it is back"
    err.print(note)


def _params(pairs: tuple[str, ...]) -> dict[str, str]:
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--param must be key=value, got {pair!r}")
        params[key.strip()] = value
    return params


@cli.command()
@click.argument("job", required=False)
@click.option("--watch", is_flag=True, help="Follow progress until the job finishes.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx: click.Context, job: str | None, watch: bool, as_json: bool) -> None:
    """A job's status and progress (without JOB: all jobs)."""
    from pipeline import client as c

    if job is None:
        return ctx.invoke(jobs, as_json=as_json)
    session = _session(ctx)
    current = c.job_status(session, job)
    if watch and not as_json:
        current = _watch(session, current.job_id)
    if as_json:
        return emit(_job_json(current, c.job_name(session, current)))
    _print_status([(current, c.job_name(session, current))])
    if note := _stalled(current):
        err.print(note)


def _stalled(job) -> str | None:
    """The line that says an active job has nothing to run it (no worker beat within its timeout)."""
    from pipeline.status import ACTIVE_JOB

    if job.status in ACTIVE_JOB and job.workers == 0:
        return "no worker is running: nothing processes this job until one starts (`enclave worker`)"
    return None


def _watch(session, job_id: str, interval: float = 1.0):
    """Follow a job until it ends: a bar of finished documents, the rate, the time since it started and the
    time left, refreshed every `interval` seconds (workers record each document as it finishes)."""
    from pipeline import client as c
    from pipeline.progress import Rate, elapsed, summary
    from pipeline.status import ACTIVE_JOB

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}"),
    )
    rate = Rate()
    with Progress(*columns, console=out) as progress:
        task = progress.add_task(job_id[:8], total=None, state="")
        while True:
            current = c.job_status(session, job_id)
            finished = current.done + current.failed
            active = current.status in ACTIVE_JOB
            rate.add(time.monotonic(), finished)
            seconds = elapsed(current.started_at, current.finished_at)
            speed = summary(finished, current.total, rate.per_second(finished, seconds), seconds, active)
            note = " · no worker running" if _stalled(current) else ""
            progress.update(
                task,
                total=current.total,
                completed=finished,
                state=f"{current.status}, {current.failed} failed · {speed}{note}",
            )
            if not active:
                return current
            time.sleep(interval)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def jobs(ctx: click.Context, as_json: bool) -> None:
    """This client's recent jobs, newest first."""
    from pipeline import client as c

    session = _session(ctx)
    rows = [(job, c.job_name(session, job)) for job in c.list_jobs(session)]
    if as_json:
        return emit([_job_json(job, name) for job, name in rows])
    _print_status(rows)


def _job_json(job, name: str) -> dict:
    """A job (`JobInfo`) as `--json` prints it, its name opened with this client's key."""
    counts = job.counts
    return {
        "job_id": job.job_id,
        "name": name,
        "kind": job.kind,
        "status": job.status,
        "priority": job.priority,
        "total": job.total,
        "done": job.done,
        "failed": job.failed,
        "pending": counts.get("pending", 0) + counts.get("leased", 0),
        "cancelled": counts.get("cancelled", 0),
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "purged_at": _iso(job.purged_at),
        "error": job.error,
        "workers": job.workers,
    }


def _iso(value) -> str | None:
    return value.isoformat(timespec="seconds") + "Z" if value else None


def _print_status(rows) -> None:
    table = Table("job", "name", "kind", "status", "done", "failed", "total", "created")
    for r, name in rows:
        status = f"{r.status} (purged)" if r.purged_at else r.status
        table.add_row(
            r.job_id, name, r.kind, status, str(r.done), str(r.failed), str(r.total), _when(r.created_at)
        )
    out.print(table)


@cli.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def cancel(ctx: click.Context, job: str, as_json: bool) -> None:
    """Cancel a queued or running job; documents already finished keep their results."""
    from pipeline import client as c

    session = _session(ctx)
    answer = c.cancel(session, job)
    current = answer.job
    if not answer.cancelled:
        raise UserError(f"job {current.job_id} is already {current.status}")
    if as_json:
        return emit(_job_json(current, c.job_name(session, current)))
    done, cancelled = current.done, current.counts.get("cancelled", 0)
    out.print(f"cancelled {current.job_id} ({done} done, {cancelled} cancelled)")


@cli.command()
@click.argument("job")
@click.option(
    "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Folder for the results."
)
@click.option("--partial", is_flag=True, help="Write what is finished even if the job is still running.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def results(ctx: click.Context, job: str, out_dir: Path, partial: bool, as_json: bool) -> None:
    """Open a job's results with this client's key and write them to --out.

    A result without the service's valid signature is refused (named, not opened); the others are written,
    and the command exits non-zero.
    """
    from collections import Counter

    from pipeline import client as c
    from pipeline import scan_records
    from pipeline.results_files import write_results

    session = _session(ctx)
    job_info, records = c.iter_results(session, job, partial)
    counts: Counter[str] = Counter()
    refused: list[str] = []

    def counted():
        for record in records:
            counts[record["status"]] += 1
            if record["status"] == "refused":
                refused.append(record["error"])
            yield record

    scan = scan_records.load(session.settings.home, session.identity, job_info.job_id)
    files = write_results(out_dir, job_info.kind, counted(), scan)
    total = sum(counts.values())
    summary = {
        "job_id": job_info.job_id,
        "name": c.job_name(session, job_info),
        "status": job_info.status,
        "documents": total,
        "done": counts["done"],
        "failed": counts["failed"],
        "refused": len(refused),
        "files": [str(f) for f in files],
    }
    if as_json:
        emit(summary)
    else:
        out.print(f"{summary['done']} done, {summary['failed']} failed -> {', '.join(summary['files'])}")
    if refused:
        more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
        raise UserError(
            f"{len(refused)} of {total} results refused (not opened): {'; '.join(refused[:3])}{more}"
        )


@cli.command()
@click.option("--job", "job", help="Purge this job (its id, or a unique prefix).")
@click.option(
    "--older-than", "older_than", help="Purge every job that ended longer ago than this: 30d, 12h, 90m."
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def purge(ctx: click.Context, job: str | None, older_than: str | None, yes: bool, as_json: bool) -> None:
    """Delete jobs' documents and results for good (administrators); the audit log keeps every event and
    records the purge."""
    from pipeline.wire.messages import PurgeRequest

    if (job is None) == (older_than is None):
        raise UserError("give --job ID or --older-than AGE (e.g. 30d)")
    request = PurgeRequest(job=job, older_than_seconds=None if older_than is None else _age(older_than))
    what = f"job {job}" if job else f"every job that ended more than {older_than} ago"
    if not yes and not click.confirm(f"Delete the documents and results of {what}? This cannot be undone"):
        raise click.exceptions.Abort()
    report = _session(ctx).api.purge(request)
    if as_json:
        return emit(report.model_dump(mode="json"))
    documents = sum(j.documents for j in report.jobs)
    results = sum(j.results for j in report.jobs)
    out.print(f"purged {len(report.jobs)} jobs: {documents} documents and {results} results deleted")
    if report.jobs and report.database == "postgresql":
        err.print("PostgreSQL frees the space at its next VACUUM (autovacuum); VACUUM FULL rewrites it now")


def _age(text: str) -> int:
    """ "30d", "12h", "90m" or "45s" in seconds."""
    units = {"d": 86_400, "h": 3_600, "m": 60, "s": 1}
    number, unit = text.strip()[:-1], text.strip()[-1:].lower()
    if unit not in units or not number.isdigit():
        raise UserError(
            f"--older-than must be a number of days, hours, minutes or seconds (30d, 12h), got {text!r}"
        )
    return int(number) * units[unit]


@cli.group()
def audit() -> None:
    """The tamper-evident audit log: its events, signed tree heads and proofs."""


@audit.command("log")
@click.option("--job", help="Only this job's events (its id, or a prefix).")
@click.option("--action", "actions", multiple=True, help="Only events of this action (repeat for several).")
@click.option(
    "--since",
    help="Only events at or after this time: ISO 8601 (UTC unless it says), or an age: 30m, 12h, 7d.",
)
@click.option("--until", help="Only events before this time (as --since).")
@click.option("--newest-first", is_flag=True, help="Newest first (with --limit: the latest events).")
@click.option("--limit", type=click.IntRange(1, 10_000_000), default=200)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_log(
    ctx: click.Context,
    job: str | None,
    actions: tuple[str, ...],
    since: str | None,
    until: str | None,
    newest_first: bool,
    limit: int,
    as_json: bool,
) -> None:
    """Show audit events, oldest first unless --newest-first (administrators)."""
    now = time.time()
    filters = {
        "job": job,
        "actions": actions,
        "since": _log_time(since, now, "--since"),
        "until": _log_time(until, now, "--until"),
        "newest_first": newest_first,
    }
    api = _session(ctx).api
    rows: list[dict] = []
    cursor: dict[str, int] = {}
    while len(rows) < limit:
        page = api.audit(**filters, **cursor, limit=min(1000, limit - len(rows)))
        rows += [e.model_dump(mode="json") for e in page.events]
        following = page.next_before if newest_first else page.next_after
        if following is None:
            break
        cursor = {"before": following} if newest_first else {"after": following}
    if as_json:
        return emit(rows)
    table = Table("seq", "at", "actor", "action", "job", "document", "outcome")
    for r in rows:
        table.add_row(
            str(r["seq"]),
            r["at"][:19],
            r["actor"][:16],
            r["action"],
            (r["job_id"] or "")[:8],
            (r["document_id"] or "")[:8],
            r["outcome"],
        )
    out.print(table)


def _log_time(text: str | None, now: float, option: str) -> str | None:
    """`--since`/`--until` as the log's UTC time format: an ISO 8601 time (naive means UTC) or an age."""
    from datetime import UTC, datetime, timedelta

    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    try:
        if text[:-1].isdigit() and text[-1:] in units:
            when = datetime.fromtimestamp(now, UTC) - timedelta(seconds=int(text[:-1]) * units[text[-1]])
        else:
            when = datetime.fromisoformat(text)
            when = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    except (ValueError, OverflowError):
        raise UserError(
            f"{option} must be an ISO 8601 time (2026-05-01, 2026-05-01T08:00Z) or an age (30m, 12h, 7d)"
        ) from None
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@audit.command("verify")
@click.option(
    "--against",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also check every signed head in this file (ENCLAVE_AUDIT_HEADS_FILE, kept on a write-once mount): "
    "a database rolled back or cut short fails, naming the missing rows.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_verify(ctx: click.Context, against: Path | None, as_json: bool) -> None:
    """Recompute the hash chain and the Merkle tree and check every signed head: the database's, those kept in
    this home (service/audit_heads.jsonl) and --against's; exit 1 naming the first bad row. A good result
    records the latest head in the home, so a later rollback past it fails here too."""
    from pipeline import audit as a
    from pipeline import audit_anchor, audit_tree
    from pipeline import keys as k

    settings = settings_of(ctx)
    service = k.load_public(settings.service_key_dir)
    local = audit_anchor.local_path(settings.service_key_dir)
    kept = audit_anchor.read(local) if local.exists() else []
    external = audit_anchor.read(against) if against is not None else []
    with _db(settings).transaction() as s:
        report = a.verify(
            s,
            verify_signature=lambda data, sig: k.verify_signature(service, data, sig),
            kept=[*kept, *external],
        )
        latest = audit_tree.latest_head(s) if report.ok else None
    if latest is not None and not any(h.head == latest for h in kept):
        with contextlib.suppress(OSError):  # a read-only home still verifies; it only keeps nothing new
            audit_anchor.append(local, latest)
    data = {
        "ok": report.ok,
        "rows": report.rows,
        "checkpoints": report.checkpoints,
        "first_bad_seq": report.first_bad_seq,
        "reason": report.reason,
        "kept_heads": len(kept),
        "against_heads": len(external),
    }
    if as_json:
        emit(data)
    elif report.ok:
        outside = f"; {len(kept)} heads kept in the home match" if kept else ""
        outside += f"; {len(external)} heads in {against} match" if against is not None else ""
        out.print(f"audit log intact: {report.rows} events, {report.checkpoints} signed heads{outside}")
    else:
        click.echo(f"audit log TAMPERED: first bad row {report.first_bad_seq}: {report.reason}", err=True)
    if not report.ok:
        raise SystemExit(1)


@audit.command("head")
@click.option("--json", "as_json", is_flag=True, help="The head itself, to keep in a file.")
@click.pass_context
def audit_head(ctx: click.Context, as_json: bool) -> None:
    """The service's latest signed tree head, checked with the service's public key. Keep it (`--json >
    FILE`): `enclave audit consistency FILE` later proves the log only grew from it (administrators)."""
    from pipeline import audit_proofs

    session = _session(ctx)
    head = _signed_head(session.api.audit_head().model_dump(), "the service's head")
    audit_proofs.check_head(head, _service_verifier(ctx), "the service's latest signed head")
    if as_json:
        return emit(head.to_json())
    out.print(
        f"signed tree head: {head.tree_size} events, root {head.root_hash[:16]}..., signed "
        f"{_when(head.timestamp)} by {head.key_fingerprint[:16]}"
    )


@audit.command("prove")
@click.option("--event", "seq", type=click.IntRange(1, 2**62), required=True, help="The event's seq.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_prove(ctx: click.Context, seq: int, as_json: bool) -> None:
    """Prove that event N is in the log: its inclusion proof against the service's latest signed tree head,
    checked here with the service's public key (administrators)."""
    from pipeline import audit_proofs

    answer = _session(ctx).api.audit_proof(seq)
    head = _signed_head(answer.head.model_dump(), "the service's head")
    event = answer.event.model_dump()
    if event["seq"] != seq:
        raise audit_proofs.ProofError(f"the service answered with event {event['seq']}, not event {seq}")
    audit_proofs.check_inclusion(event, head, answer.path, _service_verifier(ctx))
    if as_json:
        return emit({"event": event, "head": head.to_json(), "leaf_index": seq - 1, "path": answer.path})
    out.print(
        f"event {seq} ({event['action']}, {_when(event['at'])}) is in the signed tree head of "
        f"{head.tree_size} events (signed {_when(head.timestamp)}): its {len(answer.path)}-hash inclusion "
        "proof checks out"
    )


@audit.command("consistency")
@click.argument("old_head", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_consistency(ctx: click.Context, old_head: Path, as_json: bool) -> None:
    """Prove the log only grew since OLD_HEAD, a signed head you kept (`enclave audit head --json`, or a heads
    file: its largest head): the service's latest head must extend it (administrators)."""
    from pipeline import audit_proofs

    old = _kept_head(old_head)
    answer = _session(ctx).api.audit_consistency(old.tree_size)
    new = _signed_head(answer.head.model_dump(), "the service's head")
    if answer.old_size != old.tree_size:
        raise audit_proofs.ProofError(
            f"the service proved from {answer.old_size} events, not {old.tree_size}"
        )
    audit_proofs.check_consistency(old, new, answer.path, _service_verifier(ctx))
    if as_json:
        return emit({"old": old.to_json(), "head": new.to_json(), "path": answer.path, "consistent": True})
    out.print(
        f"the log only grew: the service's latest signed head ({new.tree_size} events, "
        f"{_when(new.timestamp)}) extends the head you kept ({old.tree_size} events, {_when(old.timestamp)})"
    )


@audit.command("export")
@click.option(
    "--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default: stdout)."
)
@click.option(
    "--after",
    type=click.IntRange(0, 2**62),
    default=0,
    help="Only events after this seq: the previous export's head size (its first line), which this export "
    "then proves its head extends.",
)
@click.pass_context
def audit_export(ctx: click.Context, out_file: Path | None, after: int) -> None:
    """On the service host: the audit log as JSON lines for a SIEM: the latest signed tree head, then each
    event with its inclusion proof (with --after, also a consistency proof from the previous export's
    head)."""
    from pipeline.audit_export import export

    settings = settings_of(ctx)
    with _db(settings).transaction() as s:
        if out_file is None:
            summary = export(s, sys.stdout.write, after)
        else:
            partial = out_file.with_name(f".{out_file.name}.partial")
            with partial.open("w", encoding="utf-8") as f:
                summary = export(s, f.write, after)
            partial.replace(out_file)
    size = summary.head.tree_size
    later = (
        f"; {summary.left} newer events wait for the next head (then: --after {size})" if summary.left else ""
    )
    err.print(f"exported {summary.events} events, proven against the signed head of {size} events{later}")


def _signed_head(data: dict, where: str):
    from pipeline.audit_heads import SignedHead

    return SignedHead.from_json(data, where)


def _kept_head(path: Path):
    """The head in a file: one JSON head, or the largest of a heads file's lines."""
    from pipeline import audit_anchor
    from pipeline.audit_heads import HeadError, SignedHead

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise UserError(f"cannot read the head file {path}") from None
    try:
        return SignedHead.parse(text, str(path))
    except HeadError:
        heads = audit_anchor.read(path)  # a heads file: each line a head
    if not heads:
        raise UserError(f"{path} holds no signed head")
    return max(heads, key=lambda k: k.head.tree_size).head


def _service_verifier(ctx: click.Context):
    """Checks signatures with the service's public key in this home (`keys import-service` on a client)."""
    from pipeline import keys as k

    service = k.load_public(settings_of(ctx).service_key_dir)
    return lambda data, sig: k.verify_signature(service, data, sig)


@cli.command()
@click.option("--concurrency", type=click.IntRange(1, 64), default=2, help="Shard tasks run in threads.")
@click.option("--until-idle", is_flag=True, help="Process everything queued, then exit 0.")
@click.option(
    "--gpu", type=click.IntRange(0, 1023), help="Serve on CUDA device N (its node name: enclave-gpuN)."
)
@click.option(
    "--device", help="Serve on this torch device instead (cpu, cuda:1...; default: ENCLAVE_DEVICE)."
)
@click.option("--name", help="Celery node name (default: enclave-gpuN@host, or enclave-<device>-<pid>@host).")
@click.option(
    "--metrics-port",
    type=click.IntRange(-1, 65535),
    help="Port of /metrics and /healthz (default: ENCLAVE_METRICS_PORT, +N with --gpu; 0: any; -1: none).",
)
@click.option("--loglevel", default="INFO")
@click.pass_context
def worker(
    ctx: click.Context,
    concurrency: int,
    until_idle: bool,
    gpu: int | None,
    device: str | None,
    name: str | None,
    metrics_port: int | None,
    loglevel: str,
) -> None:
    """Run a GPU worker: load the engine, then serve shard tasks from the broker."""
    # First: a bad setting stops the worker before it imports or consumes anything.
    settings = settings_of(ctx)
    from pipeline.worker_process import WorkerOptions, run_worker

    _configure_logging(settings, loglevel)
    options = WorkerOptions(concurrency, until_idle, loglevel, gpu, device, name, metrics_port)
    raise SystemExit(run_worker(settings, options))


@cli.command()
@click.option("--all", "show_all", is_flag=True, help="Also workers that stopped or went silent (a week).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def workers(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """On the service host: the workers' health (state, engine, device, queue, documents in flight,
    heartbeat), from the database."""
    from pipeline import workers as w

    settings = settings_of(ctx)
    with _db(settings).transaction() as s:
        views = w.listing(s, settings.worker.heartbeat_timeout, include_gone=show_all)
        rows = [_worker_json(v) for v in views]
    if as_json:
        return emit(rows)
    if not rows:
        return err.print("no worker is running (`enclave worker` starts one; --all shows past ones)")
    table = Table(
        "node", "health", "engine", "device", "queues", "in flight", "done", "errors", "heartbeat", "reason"
    )
    for r in rows:
        table.add_row(
            r["node"],
            r["health"],
            "loaded" if r["engine_loaded"] else "-",
            r["device"] or "",
            r["queues"],
            str(r["in_flight"]),
            str(r["done"]),
            str(r["errors"]),
            f"{r['heartbeat_age_s']:.0f}s ago",
            r["reason"] or "",
        )
    out.print(table)


def _worker_json(view) -> dict:
    row = view.row
    return {
        "id": row.id,
        "node": row.node,
        "host": row.host,
        "pid": row.pid,
        "health": view.health,
        "alive": view.alive,
        "engine_loaded": row.engine_loaded,
        "device": row.device,
        "queues": row.queues,
        "concurrency": row.concurrency,
        "in_flight": row.in_flight,
        "done": row.done,
        "errors": row.errors,
        "reason": row.reason,
        "metrics_url": row.metrics_url,
        "started_at": _iso(row.started_at),
        "heartbeat_age_s": round(view.silent_s, 1),
        "stopped_at": _iso(row.stopped_at),
    }


@cli.group()
def broker() -> None:
    """The broker, which only carries shard ids (the database is the source of truth)."""


@broker.command("rebuild")
@click.pass_context
def broker_rebuild(ctx: click.Context) -> None:
    """Dispatch every open shard again, from the database, with a new marker (a broker that lost or corrupted
    its messages; workers also do it themselves when they see the marker gone)."""
    from pipeline import embedded_broker, rebuild
    from pipeline.broker_probe import BrokerProbe
    from pipeline.celery_app import make_celery

    settings = settings_of(ctx)
    probe = BrokerProbe(settings.broker_url)
    if probe.path is not None and (moved := embedded_broker.move_aside_if_unreadable(probe.path)):
        err.print(f"the embedded broker could not be read: moved it to {moved}")
    count = rebuild.rebuild(make_celery(settings), _db(settings), probe)
    out.print(f"{count} open shards dispatched again from the database")


@cli.command()
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8787, show_default=True, help="0: any free port."
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="A loopback address (see --allow-remote)."
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Bind a non-loopback address: whoever reaches it with the gateway's key reads opened results.",
)
@click.option(
    "--max-upload-mb",
    type=click.IntRange(1, 4096),
    default=200,
    show_default=True,
    help="Largest input file.",
)
@click.pass_context
def gateway(ctx: click.Context, port: int, host: str, allow_remote: bool, max_upload_mb: int) -> None:
    """OpenAI's Files and Batch API on this workstation, for the OpenAI SDK (`base_url`): uploaded lines are
    sealed here, results opened here."""
    settings = settings_of(ctx)
    from pipeline.gateway.server import listen, resolve, serve

    try:
        address = resolve(host, port)
    except OSError:
        raise UserError(f"cannot resolve --host {host!r}") from None
    if not (address.loopback or allow_remote):
        raise UserError(
            f"refusing to bind {address.host}: the gateway serves opened results; use a loopback address "
            "(127.0.0.1), or pass --allow-remote"
        )
    try:
        sock = listen(address)
    except OSError as exc:
        raise UserError(
            f"cannot listen on {address.host}:{port}: {exc.strerror or type(exc).__name__}"
        ) from None
    _configure_logging(settings)

    def ready(url: str, key_file: Path) -> None:
        click.echo(f"enclave gateway: {url}", nl=True)
        err.print(f"  export OPENAI_BASE_URL={url}")
        err.print(f'  export OPENAI_API_KEY="$(cat {key_file})"')
        sys.stdout.flush()

    serve(settings, address, sock, max_upload_mb * 2**20, ready)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8443, show_default=True, help="0: any free port."
)
@click.option(
    "--cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="TLS certificate (PEM)."
)
@click.option(
    "--key", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="TLS private key (PEM)."
)
@click.option(
    "--allow-http",
    is_flag=True,
    help="Serve plain HTTP on a non-loopback address (only behind a proxy that terminates TLS).",
)
@click.option(
    "--max-request-mb",
    type=click.IntRange(1, 4096),
    default=64,
    show_default=True,
    help="Largest request body.",
)
@click.pass_context
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    cert: Path | None,
    key: Path | None,
    allow_http: bool,
    max_request_mb: int,
) -> None:
    """The service API: clients submit, follow, cancel and fetch their own jobs with signed requests; it
    holds the database and broker credentials, which client machines then never see."""
    settings = settings_of(ctx)
    from pipeline.api.serve import ServeError, listen
    from pipeline.api.serve import serve as run_server

    if (cert is None) != (key is None):
        raise UserError("give both --cert and --key (TLS), or neither")
    try:
        sock, address = listen(host, port, tls=cert is not None, allow_http=allow_http)
    except ServeError as exc:
        raise UserError(str(exc)) from None
    _configure_logging(settings)

    def ready(url: str) -> None:
        click.echo(f"enclave serve: {url}")
        sys.stdout.flush()

    run_server(settings, sock, address, cert, key, max_request_mb * 2**20, ready)


@cli.group()
def db() -> None:
    """The database: its schema (migrations) and backups."""


@db.command("upgrade")
@click.option("--revision", default="head")
@click.pass_context
def db_upgrade(ctx: click.Context, revision: str) -> None:
    """Apply the migrations (the only way the schema changes)."""
    from pipeline import migrate

    settings = settings_of(ctx)
    database = _db(settings)
    migrate.upgrade(database.engine, revision, settings.migrations)
    out.print(f"database at revision {migrate.current_revision(database.engine)}")


@db.command("downgrade")
@click.argument("revision")
@click.pass_context
def db_downgrade(ctx: click.Context, revision: str) -> None:
    """Revert the schema to REVISION (`base` removes every table)."""
    from pipeline import migrate

    settings = settings_of(ctx)
    database = _db(settings)
    migrate.downgrade(database.engine, revision, settings.migrations)
    out.print(f"database at revision {migrate.current_revision(database.engine) or 'base'}")


@db.command("backup")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace FILE if it exists.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def db_backup(ctx: click.Context, file: Path, force: bool, as_json: bool) -> None:
    """Copy the embedded SQLite database to FILE, consistently, while it is in use (SQLite's backup API;
    PostgreSQL: pg_dump). The service keys (the home's service/ folder) are not in it: back them up too."""
    from pipeline.backup import backup

    copy = backup(settings_of(ctx).database_url, file, force)
    data = {"file": str(copy.path), "bytes": copy.size, "audit_events": copy.audit_events}
    if as_json:
        return emit(data)
    out.print(f"backed up to {copy.path} ({copy.size} bytes, {copy.audit_events} audit events); 0600")


@cli.command()
@click.option("--keep", is_flag=True, help="Keep the temporary home afterwards and print its path.")
def demo(keep: bool) -> None:
    """The full encrypted flow on this machine: notes + this repository's jobs package, worker, results,
    audit."""
    from pipeline.demo import run_demo

    raise SystemExit(run_demo(keep=keep))


@cli.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """GPU benchmark of the engine against the memory roofline (`enclave bench --help` for options)."""
    from engine.bench import main as bench_main

    raise SystemExit(bench_main(list(args)))


def _db(settings: Settings):
    """The command's database, disposed of when the command ends."""
    from pipeline.db import Database

    ctx = click.get_current_context()
    database = Database(settings.database_url)
    ctx.call_on_close(database.dispose)
    return database


def _session(ctx: click.Context):
    """The command's client session (this home's key, the service API), closed when the command ends."""
    from pipeline.client import ClientSession

    session = ClientSession(settings_of(ctx))
    click.get_current_context().call_on_close(session.close)
    return session


def _when(value) -> str:
    """A timestamp (a datetime, or ISO text from a JSON answer) to the second."""
    if not value:
        return ""
    text = value if isinstance(value, str) else value.isoformat(timespec="seconds")
    return text.replace("T", " ")[:19]


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _configure_logging(settings: Settings, level: str = "INFO") -> Path:
    from pipeline.logs import configure

    return configure(settings, level)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, turning every failure into one line and an exit status."""
    from pipeline.errors import describe

    invocation = Invocation()
    try:
        cli.main(args=argv, prog_name="enclave", standalone_mode=False, obj=invocation)
    except SettingsError as exc:  # before any work: a usage error, exit 2 like click's
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        return 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    except click.ClickException as exc:
        click.echo(f"error: {_one_line(exc.format_message())}", err=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        click.echo(f"error: {_one_line(describe(exc, invocation.log_home()))}", err=True)
        return 1
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
