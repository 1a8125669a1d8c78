"""The service API in process (the embedded default: the CLI's path without a URL), on SQLite and
PostgreSQL, without a worker: results come a page at a time in submission order, a replayed or stale
request is refused, a request body that is not the route's message is a 400 naming the field, another
client's job is a 404 for every route, and a database that is not initialised is one line (its stack in the
home's log, not on the terminal)."""

from __future__ import annotations

import uuid

import httpx2 as httpx
import pytest

from pipeline import api_client, client, keys
from pipeline.wire import signing
from tests.pipeline.test_submit import make_session, notes


@pytest.fixture
def service(db_url):
    from pipeline import migrate
    from pipeline.db import Database

    db = Database(db_url)
    migrate.upgrade(db.engine)
    db.dispose()
    return keys.generate_identity()


@pytest.fixture
def alice(tmp_path, db_url, service):
    s = make_session(tmp_path / "alice", db_url, service)
    yield s
    s.close()


def test_results_come_a_page_at_a_time_in_submission_order(alice, tmp_path, monkeypatch):
    job = client.submit_files(alice, [notes(tmp_path / "docs", 7)], "summarize", {}).job_id
    pages = []
    fetch = alice.api.results_page
    monkeypatch.setattr(alice.api, "results_page", lambda *a: pages.append(a[1]) or fetch(*a))
    monkeypatch.setattr(client, "RESULTS_PAGE", 3)
    info, records = client.fetch_results(alice, job, partial=True)
    assert [r["document"] for r in records] == [f"note-{i:05d}.txt" for i in range(7)]
    assert {r["status"] for r in records} == {"pending"} and info.total == 7
    assert pages == [None, 2, 5]  # the cursor is the last index of the page before


def test_a_replayed_or_stale_request_is_refused(alice):
    identity = alice.identity
    headers = signing.sign(identity, alice.service.fingerprint, "GET", "/v1/jobs", b"")
    http = alice.api.http
    assert (
        http.send(
            httpx.Request("GET", http.base_url.join("/v1/jobs"), headers=headers), auth=None
        ).status_code
        == 200
    )
    again = http.send(httpx.Request("GET", http.base_url.join("/v1/jobs"), headers=headers), auth=None)
    assert (again.status_code, again.json()["error"]["code"]) == (401, "replayed")
    stale = signing.sign(identity, alice.service.fingerprint, "GET", "/v1/jobs", b"", now=0)
    answer = http.send(httpx.Request("GET", http.base_url.join("/v1/jobs"), headers=stale), auth=None)
    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "stale_request")


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b"[1", "not valid JSON"),
        (b"[]", "the body"),
        (b'{"job_id": "x", "kind": "summarize", "extra": 1}', "extra"),
    ],
)
def test_a_body_that_is_not_the_message_is_a_400_naming_the_field(alice, body, where):
    http = alice.api.http
    headers = signing.sign(alice.identity, alice.service.fingerprint, "POST", "/v1/jobs", body)
    answer = http.send(
        httpx.Request("POST", http.base_url.join("/v1/jobs"), content=body, headers=headers), auth=None
    )
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "malformed"
    assert where in answer.json()["error"]["message"]


def test_another_clients_job_is_not_found_by_any_route(alice, tmp_path, db_url, service):
    job = client.submit_files(alice, [notes(tmp_path / "docs", 2)], "summarize", {}).job_id
    bob = make_session(tmp_path / "bob", db_url, service)
    try:
        for call in (client.job_status, client.cancel_job, client.fetch_results):
            with pytest.raises(client.UnknownJob, match=f"no job {job} for this client"):
                call(bob, job)
        with pytest.raises(client.UnknownJob):
            client.job_status(bob, job[:8])  # a prefix of another client's id finds nothing either
        assert client.list_jobs(bob) == []
    finally:
        bob.close()
    assert client.job_status(alice, job[:8]).job_id == job


def test_an_uninitialised_database_is_one_line_and_its_stack_goes_to_the_log(tmp_path):
    from pipeline.settings import Settings

    settings = Settings(
        home=tmp_path, database_url=f"sqlite:///{tmp_path / 'empty.db'}", broker_url="memory://"
    )
    identity = keys.generate_identity()
    keys.save_identity(identity, settings.client_key_dir)
    keys.save_identity(keys.generate_identity(), settings.service_key_dir)
    session = client.ClientSession(settings)
    try:
        with pytest.raises(api_client.ServiceError) as refused:
            client.list_jobs(session)
    finally:
        session.close()
    assert refused.value.status == 503 and "not initialised: run `enclave init`" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert "OperationalError (message withheld" in (tmp_path / "logs" / "enclave.log").read_text()


def test_a_job_id_that_is_not_a_uuid_is_refused_by_the_service(alice):
    from pipeline.wire import messages as m

    with pytest.raises(api_client.ServiceError, match=r"\(400 malformed\): a job id must be a UUID"):
        alice.api.begin(m.BeginUpload(job_id="job-1", kind="summarize"))
    assert alice.api.begin(m.BeginUpload(job_id=str(uuid.uuid4()), kind="summarize")).state == "new"


def test_a_request_signed_as_documented_is_accepted(alice):
    """The scheme as ARCHITECTURE section 8 states it, built here with `cryptography` and `json` alone (not
    with pipeline.wire.signing): Ed25519 over the canonical JSON of the request's fields, in five headers."""
    import base64
    import hashlib
    import json
    import secrets
    import time

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    pem = (alice.settings.client_key_dir / "ed25519.pem").read_bytes()
    key = load_pem_private_key(pem, None)
    assert isinstance(key, Ed25519PrivateKey)
    body, nonce, now = b"", secrets.token_hex(16), int(time.time())
    fields = {
        "purpose": "enclave-request/2",
        "method": "GET",
        "target": "/v1/jobs?limit=5",
        "timestamp": now,
        "nonce": nonce,
        "body_sha256": hashlib.sha256(body).hexdigest(),
        "client": alice.fingerprint,
        "service": alice.service.fingerprint,
    }
    statement = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    headers = {
        "x-enclave-client": alice.fingerprint,
        "x-enclave-service": alice.service.fingerprint,
        "x-enclave-timestamp": str(now),
        "x-enclave-nonce": nonce,
        "x-enclave-content-sha256": fields["body_sha256"],
        "x-enclave-signature": base64.b64encode(key.sign(statement)).decode(),
    }
    http = alice.api.http
    answer = http.send(
        httpx.Request("GET", http.base_url.join("/v1/jobs?limit=5"), headers=headers), auth=None
    )
    assert answer.status_code == 200 and answer.json() == {"jobs": []}
    headers["x-enclave-nonce"] = secrets.token_hex(16)  # any field changed: the signature no longer holds
    answer = http.send(
        httpx.Request("GET", http.base_url.join("/v1/jobs?limit=5"), headers=headers), auth=None
    )
    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "bad_signature")


def test_a_request_signed_for_another_service_is_refused(alice):
    """The signature names the service it is for (the key the client imported): a request one service saw
    cannot be replayed to another that allows the same client. Claiming this service in the header while
    the signature names another fails the signature."""
    import secrets

    other = secrets.token_hex(32)  # another service's fingerprint
    http = alice.api.http
    url = http.base_url.join("/v1/jobs")
    headers = signing.sign(alice.identity, other, "GET", "/v1/jobs", b"")
    answer = http.send(httpx.Request("GET", url, headers=headers), auth=None)
    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "wrong_service")
    assert "signed for service" in answer.json()["error"]["message"]
    headers = signing.sign(alice.identity, other, "GET", "/v1/jobs", b"")
    headers[signing.SERVICE] = alice.service.fingerprint
    answer = http.send(httpx.Request("GET", url, headers=headers), auth=None)
    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "bad_signature")
