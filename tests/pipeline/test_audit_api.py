"""The audit log's routes of the service API, in process, on SQLite and PostgreSQL: pages newest or oldest
first, filtered by action, time and job; the latest signed head; inclusion and consistency proofs that the
client checks with the service's public key; refusals for clients, unknown actions and unsigned events."""

from __future__ import annotations

import pytest

from pipeline import audit, audit_proofs, audit_tree, keys
from pipeline.api_client import ServiceError
from pipeline.audit_heads import SignedHead
from pipeline.db import Database
from pipeline.home import add_client
from pipeline.models import AuditCheckpoint
from pipeline.status import Role
from tests.pipeline.test_submit import make_session

ACTIONS = (audit.SUBMITTED, audit.STARTED, audit.DOCUMENT_DONE, audit.COMPLETED)


@pytest.fixture
def service(db_url):
    from pipeline import migrate

    db = Database(db_url)
    migrate.upgrade(db.engine)
    db.dispose()
    return keys.generate_identity()


@pytest.fixture
def admin(tmp_path, db_url, service):
    s = make_session(tmp_path / "admin", db_url, service)
    db = Database(db_url)
    with db.transaction() as t:  # event 2: the home's client made an administrator
        add_client(t, "admin", s.identity.public, actor=service.public.fingerprint, role=Role.ADMIN)
    db.dispose()
    yield s
    s.close()


def _events(db_url: str, service: keys.Identity, n: int, monkeypatch, sign_every: int = 0) -> None:
    """Events 3..n+2 at 2026-01-01 00:00:01, :02, ..., cycling through ACTIONS, two per job."""
    clock = iter(f"2026-01-01T00:00:{i:02d}.000000Z" for i in range(1, 60))
    monkeypatch.setattr(audit, "_now", lambda: next(clock))
    db = Database(db_url)
    for i in range(n):
        with db.transaction() as s:
            job = f"{i // 2:08d}-0000-0000-0000-000000000000"
            audit.append(s, actor="w", action=ACTIONS[i % 4], job_id=job)
            if sign_every and (i + 1) % sign_every == 0:
                audit.checkpoint(s, sign=service.sign, key_fingerprint=service.public.fingerprint)
    db.dispose()
    monkeypatch.undo()


def _verifier(service: keys.Identity):
    return lambda data, sig: keys.verify_signature(service.public, data, sig)


def test_pages_newest_first_by_action_time_and_job(admin, db_url, service, monkeypatch):
    _events(db_url, service, 20, monkeypatch)
    api = admin.api
    page = api.audit(limit=3, newest_first=True)
    assert [e.seq for e in page.events] == [22, 21, 20] and page.next_before == 20 and page.next_after is None
    page = api.audit(limit=3, newest_first=True, before=page.next_before)
    assert [e.seq for e in page.events] == [19, 18, 17]
    done = api.audit(actions=(audit.DOCUMENT_DONE, audit.COMPLETED), limit=100)
    assert [e.seq for e in done.events] == [s for s in range(3, 23) if (s - 3) % 4 in (2, 3)]
    window = api.audit(since="2026-01-01T00:00:05.000000Z", until="2026-01-01T00:00:08.000000Z")
    assert [e.at[17:19] for e in window.events] == ["05", "06", "07"]
    assert [e.seq for e in window.events] == [7, 8, 9]
    job = api.audit(job="00000003", newest_first=True)
    assert [e.seq for e in job.events] == [10, 9]
    everything = api.audit(limit=5)
    assert [e.seq for e in everything.events] == [1, 2, 3, 4, 5] and everything.next_after == 5


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"actions": ("deleted-everything",)}, "unknown action"),
        ({"since": "yesterday"}, "since must read"),
        ({"until": "2026-01-01"}, "until must read"),
    ],
)
def test_a_bad_filter_is_a_400_that_quotes_nothing(admin, params, words):
    with pytest.raises(ServiceError, match=words) as caught:
        admin.api.audit(**params)
    assert caught.value.status == 400 and "deleted-everything" not in str(caught.value)
    assert "yesterday" not in str(caught.value)


def test_head_and_proofs_check_out_with_the_service_key(admin, db_url, service, monkeypatch):
    api, verify = admin.api, _verifier(service)
    with pytest.raises(ServiceError, match="no signed tree head yet") as caught:
        api.audit_head()
    assert caught.value.status == 409
    _events(db_url, service, 11, monkeypatch, sign_every=4)  # heads at 6, 10 (events 1..2 came first)
    head = SignedHead.from_json(api.audit_head().model_dump(), "head")
    assert head.tree_size == 10
    audit_proofs.check_head(head, verify, "head")
    for seq in range(1, 11):
        answer = api.audit_proof(seq)
        assert answer.event.seq == seq and answer.head.tree_size == 10
        audit_proofs.check_inclusion(answer.event.model_dump(), head, answer.path, verify)
    with pytest.raises(ServiceError, match="comes after the latest signed head") as caught:
        api.audit_proof(13)
    assert caught.value.status == 409
    with pytest.raises(ServiceError, match="no event 99") as caught:
        api.audit_proof(99)
    assert caught.value.status == 404
    first = api.audit_consistency(6)
    db = Database(db_url)
    with db.transaction() as s:
        old = audit_tree.head_of(s.get(AuditCheckpoint, 6))
    db.dispose()
    audit_proofs.check_consistency(old, head, first.path, verify)
    later = api.audit_consistency(12)  # a head larger than the service's: the client names the missing rows
    assert later.path == [] and later.head.tree_size == 10
    unsigned = SignedHead(**{**old.__dict__, "tree_size": 12, "signature": b""})
    kept = SignedHead(**{**unsigned.__dict__, "signature": service.sign(unsigned.payload())})
    with pytest.raises(audit_proofs.ProofError, match=r"rows 11\.\.12 are missing"):
        audit_proofs.check_consistency(
            kept, SignedHead.from_json(later.head.model_dump(), "x"), later.path, verify
        )
    with pytest.raises(audit_proofs.ProofError, match="valid signature"):
        audit_proofs.check_consistency(unsigned, head, later.path, verify)


def test_a_client_cannot_read_the_audit_routes(tmp_path, db_url, service):
    alice = make_session(tmp_path / "alice", db_url, service)
    try:
        for call in (alice.api.audit, alice.api.audit_head, lambda: alice.api.audit_proof(1)):
            with pytest.raises(ServiceError, match="403 forbidden"):
                call()
        with pytest.raises(ServiceError, match="403 forbidden"):
            alice.api.audit_consistency(1)
    finally:
        alice.close()
