"""A broker that lost its messages is rebuilt from the database. The embedded broker's file deleted or its
first page overwritten while in use: the next operation works on a fresh file (the unreadable one moved
aside), and the marker check dispatches every open shard again, once, with one log line. The same on Redis
after a FLUSHDB (what a restart without persistence leaves)."""

import logging

import pytest
import redis
from kombu import Connection

from pipeline import migrate, rebuild
from pipeline.broker_probe import BrokerProbe
from pipeline.celery_app import make_celery
from pipeline.db import Database
from pipeline.settings import load_settings
from tests.e2e.conftest import REDIS_DB
from tests.pipeline.test_store import make_job


@pytest.fixture
def db(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'enclave.db'}")
    migrate.upgrade(database.engine)
    yield database
    database.dispose()


def app_for(tmp_path, broker_url=None):
    env = {"ENCLAVE_HOME": str(tmp_path)} | ({"ENCLAVE_BROKER_URL": broker_url} if broker_url else {})
    return make_celery(load_settings(env))


def take(app, count: int) -> list:
    """Up to `count` shard messages from the broker's queue, as (job, shard)."""
    taken = []
    with Connection(app.conf.broker_url) as conn:
        queue = conn.SimpleQueue("celery")
        for _ in range(count):
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                break
            taken.append(tuple(message.payload[0]))
            message.ack()
        queue.close()
    return taken


def corrupt(path):
    with open(path, "r+b") as f:
        f.write(b"\xde\xad" * 2048)  # the first page, header included


def test_the_embedded_broker_survives_its_file_deleted_and_corrupted(tmp_path, caplog):
    app = app_for(tmp_path)
    path = tmp_path / "broker.db"
    app.send_task("enclave.process_shard", args=["job-a", 0])
    assert take(app, 1) == [("job-a", 0)]
    path.unlink()
    app.send_task("enclave.process_shard", args=["job-b", 1])  # a fresh file, with its tables
    assert take(app, 1) == [("job-b", 1)]
    corrupt(path)
    with caplog.at_level(logging.WARNING, logger="enclave.broker"):
        app.send_task("enclave.process_shard", args=["job-c", 2])
    assert take(app, 1) == [("job-c", 2)]
    moved = list(tmp_path.glob("broker.db.unreadable-*"))
    assert len(moved) == 1 and moved[0].read_bytes()[:4] == b"\xde\xad\xde\xad"
    [line] = [r.getMessage() for r in caplog.records]
    assert "could not be read" in line and moved[0].name in line


@pytest.mark.parametrize("fault", ["deleted", "corrupted"])
def test_a_lost_embedded_broker_gets_every_open_shard_again_once(tmp_path, db, caplog, fault):
    app = app_for(tmp_path)
    probe = BrokerProbe(app.conf.broker_url)
    job = make_job(db, documents=6, shard_size=2)
    assert rebuild.check(app, db, probe) == 0  # the first look adopts a marker
    assert rebuild.check(app, db, probe) == 0  # intact
    if fault == "deleted":
        (tmp_path / "broker.db").unlink()
    else:
        corrupt(tmp_path / "broker.db")
    with caplog.at_level(logging.WARNING, logger="enclave.broker"):
        assert rebuild.check(app, db, probe) == 3
        assert rebuild.check(app, db, probe) == 0  # rebuilt once, not at every look
    assert sorted(take(app, 10)) == [(job, 0), (job, 1), (job, 2)]
    lines = [r.getMessage() for r in caplog.records if "lost its messages" in r.getMessage()]
    assert lines == [
        "the broker lost its messages (its marker is gone: deleted, replaced, corrupted or "
        "restarted without persistence): 3 open shards dispatched again from the database"
    ]


def test_a_flushed_redis_gets_every_open_shard_again(tmp_path, db):
    client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    client.flushdb()
    try:
        app = app_for(tmp_path, f"redis://127.0.0.1:6379/{REDIS_DB}")
        probe = BrokerProbe(app.conf.broker_url)
        job = make_job(db, documents=4, shard_size=2)
        assert rebuild.check(app, db, probe) == 0
        client.flushdb()  # what a restart without persistence leaves
        assert rebuild.check(app, db, probe) == 2
        assert probe.queue_depth() == 2
        assert sorted(take(app, 10)) == [(job, 0), (job, 1)]
        assert rebuild.check(app, db, probe) == 0
    finally:
        client.flushdb()


def test_enclave_broker_rebuild_dispatches_every_open_shard_and_replaces_an_unreadable_file(
    tmp_path, db, monkeypatch, capsys
):
    from pipeline.cli import main

    app = app_for(tmp_path)
    job = make_job(db, documents=4, shard_size=2)
    (tmp_path / "broker.db").write_bytes(b"\xde\xad" * 4096)  # not a database at all
    monkeypatch.setenv("ENCLAVE_HOME", str(tmp_path))
    assert main(["broker", "rebuild"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "2 open shards dispatched again from the database"
    assert "the embedded broker could not be read: moved it to" in err
    assert sorted(take(app, 10)) == [(job, 0), (job, 1)]
