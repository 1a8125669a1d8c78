"""`enclave serve` end to end (issue 15, acceptance 1, 4 and 5): a real uvicorn on loopback, on the embedded
back-end and on PostgreSQL + Redis, with a real worker beside it. Clients are homes that hold their keys
and the service's public key, and `ENCLAVE_SERVICE_URL`, but no database or broker URL at all.

- submit, status, results and cancel through the API with the CLI;
- each refusal with its status code (raw signed requests) and, where the CLI can meet it, its one-line
  error: unsigned, badly signed, replayed, stale, revoked, unknown client, another client's job, not an
  administrator, an oversize upload, malformed JSON;
- an audit event naming the authenticated client for each state-changing call, and `audit verify`;
- canaries in the job name, parameters, batch file name, custom_ids and documents appear nowhere in the
  database, the broker, the server's and the worker's logs, or the temporary files of either side.

One server and one worker per back-end serve the whole module (kept on one pytest-xdist worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import pytest
import redis
from sqlalchemy import create_engine, text

from pipeline import keys
from pipeline.wire import signing
from tests.conftest import PG_ADMIN_URL, postgres_available
from tests.e2e.canary import Canaries, Findings
from tests.e2e.conftest import NOTES, REDIS_DB, Enclave, _env
from tests.e2e.test_canary import scan_stores, scan_system_temp

MAX_REQUEST_MB = 1


@dataclass
class Served:
    service: Enclave  # the service host's home: its database, broker and keys
    admin: Enclave  # the service home's own client (an administrator), through the URL
    url: str
    clients: dict[str, Enclave] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)
    canaries: Canaries = field(default_factory=Canaries)
    started: float = 0.0

    def fingerprint(self, name: str) -> str:
        return keys.load_public(self.clients[name].home / "client").fingerprint


def _schema() -> tuple[str, str]:
    if not postgres_available():
        pytest.fail("PostgreSQL at 127.0.0.1:5432 is not reachable (.ci/run starts it)")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with create_engine(PG_ADMIN_URL).begin() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    return schema, f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"


def _announced(out: Path, proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in out.read_text().splitlines():
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
        assert proc.poll() is None, f"{prefix} exited {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"no {prefix!r} line")


@pytest.fixture(scope="module", params=["embedded", "servers"])
def served(request, tmp_path_factory, demo_model):
    """A service home, `enclave serve --port 0`, a worker, and client homes with the URL only."""
    started = time.time() - 1
    tmp = tmp_path_factory.mktemp(f"served-{request.param}")
    extra, schema, broker = {}, None, None
    if request.param == "servers":
        broker = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        broker.flushdb()
        schema, url = _schema()
        extra = {"ENCLAVE_DATABASE_URL": url, "ENCLAVE_BROKER_URL": f"redis://127.0.0.1:6379/{REDIS_DB}"}
    for name in ("service", "alice", "bob", "carol", "dave"):
        (tmp / name).mkdir()
    service = Enclave(_env(tmp / "service", demo_model, extra), tmp / "service", request.param)
    service.run("init")
    worker = service.start_worker()
    out, err = tmp / "serve.out", tmp / "serve.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.cli",
                "serve",
                "--port",
                "0",
                "--max-request-mb",
                str(MAX_REQUEST_MB),
            ],
            env=service.env,
            stdout=stdout,
            stderr=stderr,
            cwd=service.tmp,
            start_new_session=True,
        )
    try:
        url = _announced(out, server, "enclave serve: ")
        admin = Enclave(service.env | {"ENCLAVE_SERVICE_URL": url}, service.tmp, request.param)
        served = Served(service, admin, url, logs=[out, err, service.tmp / "worker-0.log"], started=started)
        for name in ("alice", "bob", "carol", "dave"):
            client = Enclave(
                _env(tmp / name, demo_model, {"ENCLAVE_SERVICE_URL": url}), tmp / name, request.param
            )
            assert not {"ENCLAVE_DATABASE_URL", "ENCLAVE_BROKER_URL"} & set(client.env)
            client.run("keys", "create")
            client.run("keys", "import-service", str(service.home / "service" / "public.json"))
            if name != "dave":  # dave is never allow-listed
                admin.run("clients", "add", name, str(client.home / "client" / "public.json"))
            served.clients[name] = client
        admin.run("clients", "revoke", served.fingerprint("carol")[:20])
        yield served
    finally:
        server.terminate()
        assert server.wait(timeout=30) in (0, -15), err.read_text()[-3000:]
        Enclave.kill(worker)
        if broker is not None:
            broker.flushdb()
        if schema is not None:
            with create_engine(PG_ADMIN_URL).begin() as c:
                c.execute(text(f"DROP SCHEMA {schema} CASCADE"))


def wait_for(client: Enclave, job: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.json("status", job)
        if status["status"] not in ("queued", "running"):
            return status
        time.sleep(0.3)
    raise AssertionError(f"job {job} still {status['status']}")


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The command's error: one line (after the job id a submit announces before its upload)."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "uploading (if interrupted" not in x]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_submit_status_results_and_cancel_through_the_api(served: Served, tmp_path):
    alice = served.clients["alice"]
    notes = [str(NOTES / n) for n in ("note-01-chest-pain.txt", "note-06-latin1-export.txt")]
    job = alice.submit(*notes, "--kind", "summarize", "--param", "max_tokens=8", "--name", "ward 3")
    status = wait_for(alice, job)
    assert (status["status"], status["total"], status["done"], status["failed"]) == ("completed", 2, 1, 1)
    assert status["name"] == "ward 3"  # sealed to alice, opened by her CLI
    assert [j["job_id"] for j in alice.json("jobs")] == [job]
    summary = alice.json("results", job[:8], "--out", str(tmp_path / "out"))
    assert (summary["documents"], summary["done"], summary["failed"], summary["refused"]) == (2, 1, 1, 0)
    records = {
        r["document"]: r
        for r in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())
    }
    assert (
        records["note-01-chest-pain.txt"]["status"] == "done" and records["note-01-chest-pain.txt"]["output"]
    )
    assert "not valid UTF-8" in records["note-06-latin1-export.txt"]["error"]

    many = [str(p) for p in sorted(NOTES.iterdir())] * 1
    slow = alice.submit(*many, "--kind", "summarize", "--param", "max_tokens=400")
    cancelled = alice.json("cancel", slow)
    assert (
        cancelled["status"] == "cancelled"
        and cancelled["cancelled"] + cancelled["done"] + cancelled["failed"] == 6
    )
    again = alice.run("cancel", slow, check=False)
    assert "is already cancelled" in one_line_error(again)

    # a client home holds keys and the URL only: no database, no broker, nothing of the service
    assert not list(alice.home.rglob("*.db")) and not (alice.home / "enclave.toml").exists()
    assert sorted(p.name for p in (alice.home / "service").iterdir()) == ["public.json"]


def signed_request(
    served: Served, who: str, method: str, path: str, body: bytes = b"", **tamper
) -> httpx.Request:
    identity = keys.load_identity(served.clients[who].home / "client")
    service = keys.load_public(served.clients[who].home / "service").fingerprint
    headers = signing.sign(identity, service, method, path, body, now=tamper.pop("now", None))
    headers |= tamper
    return httpx.Request(method, served.url + path, content=body, headers=headers)


def send(request: httpx.Request) -> tuple[int, str]:
    with httpx.Client(timeout=30) as client:
        response = client.send(request)
    return response.status_code, response.json()["error"]["code"] if response.status_code >= 400 else ""


def test_each_refusal_has_its_status_code(served: Served):
    assert send(httpx.Request("GET", served.url + "/v1/jobs")) == (401, "unsigned")
    request = signed_request(served, "alice", "GET", "/v1/jobs")
    assert send(request)[0] == 200
    assert send(request) == (401, "replayed")  # the same signed request again
    bad = signed_request(served, "alice", "GET", "/v1/jobs")
    bad.headers[signing.SIGNATURE] = signed_request(served, "bob", "GET", "/v1/jobs").headers[
        signing.SIGNATURE
    ]
    assert send(bad) == (401, "bad_signature")
    other_body = signed_request(served, "alice", "POST", "/v1/jobs", b"{}")
    assert send(
        httpx.Request("POST", served.url + "/v1/jobs", content=b"[]", headers=other_body.headers)
    ) == (
        401,
        "bad_signature",
    )
    assert send(signed_request(served, "alice", "GET", "/v1/jobs", now=time.time() - 3600)) == (
        401,
        "stale_request",
    )
    assert send(signed_request(served, "carol", "GET", "/v1/jobs")) == (401, "revoked_client")
    assert send(signed_request(served, "dave", "GET", "/v1/jobs")) == (401, "unknown_client")
    assert send(signed_request(served, "alice", "POST", "/v1/jobs", b'{"job_id": ')) == (400, "malformed")
    assert send(signed_request(served, "alice", "POST", "/v1/jobs", b'{"job_id": 1}')) == (400, "malformed")
    assert send(signed_request(served, "alice", "GET", "/v1/audit")) == (403, "forbidden")
    assert send(signed_request(served, "alice", "GET", "/v1/clients")) == (403, "forbidden")
    assert send(signed_request(served, "alice", "GET", f"/v1/jobs/{uuid.uuid4()}")) == (404, "not_found")
    huge = b"x" * (MAX_REQUEST_MB * 2**20 + 1)
    assert send(signed_request(served, "alice", "POST", "/v1/jobs", huge)) == (413, "too_large")
    health = httpx.get(served.url + "/v1/health").json()
    assert health == {"status": "ok", "max_request_bytes": MAX_REQUEST_MB * 2**20}


def test_each_refusal_is_one_line_in_the_cli(served: Served, tmp_path):
    alice, bob = served.clients["alice"], served.clients["bob"]
    note = str(NOTES / "note-03-fracture.txt")
    job = alice.submit(note, "--kind", "summarize", "--param", "max_tokens=4")
    for args in (["status", job], ["cancel", job], ["results", job, "--out", str(tmp_path / "bob")]):
        line = one_line_error(bob.run(*args, check=False))
        assert line == f"error: no job {job} for this client", line
    stolen = bob.run("submit", note, "--kind", "summarize", "--job-id", job, check=False)
    assert "belongs to another client's job" in one_line_error(stolen)
    assert "(401 revoked_client)" in one_line_error(served.clients["carol"].run("jobs", check=False))
    line = one_line_error(served.clients["dave"].run("submit", note, "--kind", "summarize", check=False))
    assert "(401 unknown_client)" in line and "enclave clients add" in line
    assert "(403 forbidden)" in one_line_error(alice.run("audit", "log", check=False))
    big = tmp_path / "big.txt"
    big.write_text("x" * (MAX_REQUEST_MB * 2**20))  # within the document limit, over the request bound
    line = one_line_error(alice.run("submit", str(big), "--kind", "summarize", check=False))
    assert "(413 too_large)" in line and "document 0 alone is larger" in line
    down = alice.run("jobs", check=False, env=alice.env | {"ENCLAVE_SERVICE_URL": "http://127.0.0.1:9"})
    assert "cannot reach the service at http://127.0.0.1:9" in one_line_error(down)


def test_every_state_change_is_audited_with_its_client(served: Served, tmp_path):
    alice, bob = served.clients["alice"], served.clients["bob"]
    job = bob.submit(str(NOTES / "note-02-pneumonia.txt"), "--kind", "summarize", "--param", "max_tokens=4")
    wait_for(bob, job)
    bob.run("results", job, "--out", str(tmp_path / "out"))
    cancelled = bob.submit(
        *[str(p) for p in sorted(NOTES.iterdir())], "--kind", "summarize", "--param", "max_tokens=400"
    )
    bob.run("cancel", cancelled)
    events = served.admin.json("audit", "log", "--limit", "100000")
    mine = [e for e in events if e["job_id"] in (job, cancelled) and not e["actor"].startswith("worker:")]
    bob_fp = served.fingerprint("bob")
    assert {e["actor"] for e in mine} == {bob_fp}
    by_action = {(e["job_id"], e["action"]) for e in mine}
    for expected in ("upload_started", "documents_stored", "submitted", "results_fetched"):
        assert (job, expected) in by_action, expected
    assert (cancelled, "cancelled") in by_action
    admin_fp = served.admin.json("keys", "show")["client"]["fingerprint"]
    added = {e["details"]["client"]: e["actor"] for e in events if e["action"] == "client_added"}
    assert added[bob_fp] == admin_fp and added[served.fingerprint("alice")] == admin_fp
    revoked = [e for e in events if e["action"] == "client_revoked"]
    assert [(e["details"]["client"], e["actor"]) for e in revoked] == [
        (served.fingerprint("carol"), admin_fp)
    ]
    assert alice.json("jobs") and all(j["job_id"] not in (job, cancelled) for j in alice.json("jobs"))
    assert served.service.json("audit", "verify")["ok"] is True


def test_no_canary_reaches_the_service_in_clear(served: Served, tmp_path):
    """Canaries in a job's name, its parameters, file names, a batch file's name, custom_ids and documents,
    sent through the API: none in the database, the broker, the server's or worker's logs, or the temporary
    files of the server, the worker or the client; the client still reads its names back."""
    m, alice = served.canaries, served.clients["alice"]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / f"{m('file_name')}.txt").write_text(f"Patient {m('document')} is well.\n")
    args = [str(inputs), "--kind", "summarize", "--name", m("job_name")]
    job = alice.submit(*args, "--param", f"instructions={m('instructions')}", "--param", "max_tokens=4")
    line = {
        "custom_id": m("custom_id"),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": m("batch_content")}], "max_tokens": 4},
    }
    batch = tmp_path / f"{m('batch_file_name')}.jsonl"
    batch.write_text(json.dumps(line) + "\n")
    batch_job = alice.submit("--openai-batch", str(batch), "--name", m("batch_job_name"))
    for j in (job, batch_job):
        wait_for(alice, j)
    out = tmp_path / "out"
    alice.run("results", batch_job, "--out", str(out))
    assert m("custom_id") in (out / "output.jsonl").read_text()  # the control: the client reads it back
    assert alice.json("status", job)["name"] == m("job_name")
    found = Findings(m)
    scan_stores(served.service, found)
    for log in served.logs:
        found.scan(f"log {log.name}", log.read_bytes())
    found.scan_tree(served.service.tmp / "tmp", "service TMPDIR")
    found.scan_tree(alice.tmp / "tmp", "client TMPDIR")
    scan_system_temp(found, tmp_path, served.started)
    assert not found.places, found.report()
