"""The `enclave` command line. Human output by default, `--json` for scripts; a user error is one line on
stderr and a non-zero exit, never a traceback (internals go to the log without document content)."""

from __future__ import annotations

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
@click.option("--name", help="Name of this machine's client identity on the allow-list (default: $USER).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def init(ctx: click.Context, name: str | None, as_json: bool) -> None:
    """Create the home, database, keys, allow-list entry and demo model (idempotent)."""
    from pipeline.home import init as do_init

    report = do_init(settings_of(ctx), name)
    data = {
        "home": str(report.home),
        "database": _safe_url(report.database_url),
        "service_fingerprint": report.service_fingerprint,
        "client_fingerprint": report.client_fingerprint,
        "model": str(report.model),
        "created": list(report.created),
    }
    if as_json:
        return emit(data)
    out.print(f"Enclave home {report.home} ready ({', '.join(report.created) or 'nothing new'} created).")
    out.print(
        f"  service key  {report.service_fingerprint[:16]}   client key  {report.client_fingerprint[:16]}"
    )
    out.print(f"  model        {report.model}")


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


@cli.group()
def clients() -> None:
    """The allow-list of client keys that may submit jobs."""


@clients.command("add")
@click.argument("name")
@click.argument("public_file", type=click.Path(exists=True, path_type=Path))
@click.pass_context
def clients_add(ctx: click.Context, name: str, public_file: Path) -> None:
    """Allow-list the client whose public.json is PUBLIC_FILE."""
    from pipeline import keys as k
    from pipeline.home import add_client

    settings = settings_of(ctx)
    public = k.load_public(public_file)
    with _db(settings).transaction() as s:
        add_client(s, name, public, actor=_service_actor(settings))
    out.print(f"allow-listed {name}: {public.fingerprint}")


@clients.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def clients_list(ctx: click.Context, as_json: bool) -> None:
    """List allow-listed (and revoked) clients."""
    from pipeline.models import Client

    with _db(settings_of(ctx)).transaction() as s:
        rows = [
            {
                "name": c.name,
                "fingerprint": c.fingerprint,
                "created_at": c.created_at,
                "revoked_at": c.revoked_at,
            }
            for c in s.query(Client).order_by(Client.created_at)
        ]
    if as_json:
        return emit(rows)
    table = Table("name", "fingerprint", "added", "revoked")
    for r in rows:
        table.add_row(r["name"], r["fingerprint"], _when(r["created_at"]), _when(r["revoked_at"]) or "")
    out.print(table)


@clients.command("revoke")
@click.argument("fingerprint")
@click.pass_context
def clients_revoke(ctx: click.Context, fingerprint: str) -> None:
    """Revoke a client: workers refuse its jobs from now on."""
    from pipeline import audit
    from pipeline.models import Client, utcnow

    settings = settings_of(ctx)
    with _db(settings).transaction() as s:
        matches = [c for c in s.query(Client) if c.fingerprint.startswith(fingerprint.lower())]
        if len(matches) != 1:
            raise UserError(f"{len(matches)} clients match {fingerprint!r}; give more of the fingerprint")
        matches[0].revoked_at = utcnow()
        audit.append(
            s,
            actor=_service_actor(settings),
            action="client_revoked",
            details={"client": matches[0].fingerprint},
        )
    out.print(f"revoked {matches[0].name}: {matches[0].fingerprint}")


@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--kind", help="summarize | extract | code-review | chat")
@click.option(
    "--openai-batch", "batch", type=click.Path(path_type=Path), help="An OpenAI Batch API JSONL file."
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
def submit(ctx, paths, kind, batch, name, params, priority, job_id, as_json) -> None:
    """Seal documents on this machine and submit them as one job."""
    from jobs.params import resolve_file_params
    from pipeline import client as c

    settings = settings_of(ctx)
    if batch and (paths or kind):
        raise UserError("give either --openai-batch FILE or PATH... --kind KIND, not both")
    if not batch and not (paths and kind):
        raise UserError("give PATH... and --kind KIND (or --openai-batch FILE)")
    chosen = job_id is not None

    def announce(claimed: str) -> None:
        if not chosen:  # printed before the upload, so an interrupted submit can be repeated with this id
            err.print(f"job {claimed}: uploading (if interrupted, submit again with --job-id {claimed})")

    session = c.ClientSession(settings)
    try:
        if batch:
            result = c.submit_openai_batch(session, batch, name, priority, job_id, announce)
        else:
            params = resolve_file_params(_params(params))
            result = c.submit_files(session, list(paths), kind, params, name, priority, job_id, announce)
    finally:
        session.close()
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
    from pipeline import store

    settings = settings_of(ctx)
    db = _db(settings)
    if job is None:
        return ctx.invoke(jobs, as_json=as_json)
    with db.transaction() as s:
        job_id = _resolve(s, job)
        current = store.job_status(s, job_id)
    if watch and not as_json:
        current = _watch(db, job_id)
    [current] = _named(settings, [current])
    if as_json:
        return emit(current.as_json())
    _print_status([current])


def _watch(db, job_id: str):
    from pipeline import store

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}"),
    )
    with Progress(*columns, console=out) as progress:
        task = progress.add_task(job_id[:8], total=None, state="")
        while True:
            with db.transaction() as s:
                current = store.job_status(s, job_id)
            finished = current.done + current.failed
            progress.update(
                task,
                total=current.total,
                completed=finished,
                state=f"{current.status}, {current.failed} failed",
            )
            if current.status not in store.ACTIVE_JOB:
                return current
            time.sleep(1.0)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def jobs(ctx: click.Context, as_json: bool) -> None:
    """Recent jobs, newest first."""
    from pipeline import store

    settings = settings_of(ctx)
    with _db(settings).transaction() as s:
        rows = _named(settings, store.list_jobs(s))
    if as_json:
        return emit([r.as_json() for r in rows])
    _print_status(rows)


def _named(settings: Settings, rows: list) -> list:
    """`rows` (store.JobStatus) with each job's name opened with this client's key, locally; a name this
    client cannot open (another client's, or no client key here) shows as empty."""
    from dataclasses import replace

    from pipeline.client import open_job_name

    identity = _client_identity(settings) if any(r.sealed_name for r in rows) else None
    return [replace(r, name=open_job_name(identity, r.job_id, r.sealed_name, r.name)) for r in rows]


def _client_identity(settings: Settings):
    from pipeline import keys as k

    try:
        return k.load_identity(settings.client_key_dir, settings.passphrase("client"))
    except k.KeyFileError:  # no client key on this host, or its passphrase is not set: names stay hidden
        return None


def _print_status(rows) -> None:
    table = Table("job", "name", "kind", "status", "done", "failed", "total", "created")
    for r in rows:
        table.add_row(
            r.job_id, r.name, r.kind, r.status, str(r.done), str(r.failed), str(r.total), _when(r.created_at)
        )
    out.print(table)


@cli.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def cancel(ctx: click.Context, job: str, as_json: bool) -> None:
    """Cancel a queued or running job; documents already finished keep their results."""
    from pipeline import store
    from pipeline.client import ClientSession

    settings = settings_of(ctx)
    session = ClientSession(settings)
    try:
        with session.db.transaction() as s:
            job_id = _resolve(s, job)
            ok = store.cancel_job(s, job_id, session.fingerprint)
            current = store.job_status(s, job_id)
        [current] = _named(settings, [current])
    finally:
        session.close()
    if not ok:
        raise UserError(f"job {job_id} is already {current.status}")
    if as_json:
        return emit(current.as_json())
    out.print(f"cancelled {job_id} ({current.done} done, {current.counts.get('cancelled', 0)} cancelled)")


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
    from pipeline import client as c
    from pipeline import scan_records
    from pipeline.results_files import write_results

    session = c.ClientSession(settings_of(ctx))
    try:
        with session.db.transaction() as s:
            job_id = _resolve(s, job)
        job_row, records = c.fetch_results(session, job_id, partial)
        name = c.job_name(session, job_row)
    finally:
        session.close()
    scan = scan_records.load(session.settings.home, session.identity, job_id)
    files = write_results(out_dir, job_row.kind, records, scan)
    refused = [r["error"] for r in records if r["status"] == "refused"]
    summary = {
        "job_id": job_id,
        "name": name,
        "status": job_row.status,
        "documents": len(records),
        "done": sum(r["status"] == "done" for r in records),
        "failed": sum(r["status"] == "failed" for r in records),
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
            f"{len(refused)} of {len(records)} results refused (not opened): {'; '.join(refused[:3])}{more}"
        )


@cli.group()
def audit() -> None:
    """The tamper-evident audit log."""


@audit.command("log")
@click.option("--job", help="Only this job's events.")
@click.option("--limit", type=int, default=200)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_log(ctx: click.Context, job: str | None, limit: int, as_json: bool) -> None:
    """Show audit events, oldest first."""
    from pipeline.models import AuditEvent

    with _db(settings_of(ctx)).transaction() as s:
        query = s.query(AuditEvent).order_by(AuditEvent.seq)
        if job:
            query = query.filter(AuditEvent.job_id == _resolve(s, job))
        rows = [
            {
                "seq": e.seq,
                "at": e.at,
                "actor": e.actor,
                "action": e.action,
                "job_id": e.job_id,
                "document_id": e.document_id,
                "outcome": e.outcome,
                "details": json.loads(e.details),
                "hash": e.hash,
            }
            for e in query.limit(limit)
        ]
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


@audit.command("verify")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_verify(ctx: click.Context, as_json: bool) -> None:
    """Recompute the hash chain and check the signed checkpoints; exit 1 naming the first bad row."""
    from pipeline import audit as a
    from pipeline import keys as k

    settings = settings_of(ctx)
    service = k.load_public(settings.service_key_dir)
    with _db(settings).transaction() as s:
        report = a.verify(s, verify_signature=lambda data, sig: k.verify_signature(service, data, sig))
    data = {
        "ok": report.ok,
        "rows": report.rows,
        "checkpoints": report.checkpoints,
        "first_bad_seq": report.first_bad_seq,
        "reason": report.reason,
    }
    if as_json:
        emit(data)
    elif report.ok:
        out.print(f"audit log intact: {report.rows} events, {report.checkpoints} signed checkpoints")
    else:
        click.echo(f"audit log TAMPERED: first bad row {report.first_bad_seq}: {report.reason}", err=True)
    if not report.ok:
        raise SystemExit(1)


@cli.command()
@click.option("--concurrency", type=click.IntRange(1, 64), default=2, help="Shard tasks run in threads.")
@click.option("--until-idle", is_flag=True, help="Process everything queued, then exit 0.")
@click.option("--loglevel", default="INFO")
@click.pass_context
def worker(ctx: click.Context, concurrency: int, until_idle: bool, loglevel: str) -> None:
    """Run a GPU worker: serve shard tasks from the broker."""
    # First: a bad setting stops the worker before it imports or consumes anything.
    settings = settings_of(ctx)
    from pipeline.worker_process import run_worker

    _configure_logging(settings, loglevel)
    raise SystemExit(run_worker(settings, concurrency, until_idle, loglevel))


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


@cli.group()
def db() -> None:
    """Database schema."""


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


def _resolve(session, job: str) -> str:
    """A job id from an id or a unique prefix of one."""
    from pipeline.models import Job

    matches = [j for (j,) in session.query(Job.id).filter(Job.id.startswith(job.lower())).limit(2)]
    if not matches:
        raise UserError(f"no job {job}")
    if len(matches) > 1:
        raise UserError(f"{job} matches several jobs; give more of the id")
    return matches[0]


def _service_actor(settings: Settings) -> str:
    from pipeline import keys as k

    try:
        return k.load_public(settings.service_key_dir).fingerprint
    except k.KeyFileError:
        return "admin"


def _when(value) -> str:
    return value.isoformat(sep=" ", timespec="seconds") if value else ""


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _configure_logging(settings: Settings, level: str = "INFO") -> Path:
    logs = settings.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    file = logs / "enclave.log"
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(file), logging.StreamHandler(sys.stderr)],
        force=True,
    )
    return file


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
