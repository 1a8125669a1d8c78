"""A canary string in the submitted documents (and in a file name) never reaches the broker, the database,
logs or temporary files, on either back-end. Only the client's own --out folder holds plaintext."""

import json
from pathlib import Path

import redis
from sqlalchemy import create_engine, inspect, text

from tests.e2e.conftest import REDIS_DB

CANARY = "CANARY-7f3a9c1e-do-not-leak"


def leaks(data: bytes) -> bool:
    canary = CANARY.encode()
    return canary in data or canary.hex().encode() in data or CANARY.encode("utf-16-le") in data


def scan_files(root: Path, skip: Path) -> list[str]:
    found = []
    for file in root.rglob("*"):
        if file.is_file() and skip not in file.parents and leaks(file.read_bytes()):
            found.append(str(file))
    return found


def scan_redis() -> list[str]:
    client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    found = []
    for key in client.scan_iter():
        kind = client.type(key).decode()
        if kind == "string":
            values = [client.get(key)]
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind == "hash":
            values = [k + v for k, v in client.hgetall(key).items()]
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "zset":
            values = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        else:
            values = [client.dump(key) or b""]
        if leaks(key) or any(leaks(v or b"") for v in values):
            found.append(key.decode())
    return found


def scan_database(url: str) -> list[str]:
    engine = create_engine(url)
    found = []
    with engine.connect() as c:
        for table in inspect(c).get_table_names():
            for row in c.execute(text(f'SELECT * FROM "{table}"')):
                blob = b"".join(v if isinstance(v, bytes) else str(v).encode() for v in row)
                if leaks(blob):
                    found.append(table)
    engine.dispose()
    return found


def test_canary_never_leaves_the_client(enclave, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / f"{CANARY}.txt").write_text(f"Patient name {CANARY}. Diagnosis {CANARY}.\n" * 20)
    (docs / "other.txt").write_text(f"Second document mentions {CANARY} once.\n")
    (docs / "broken.txt").write_bytes(b"\xff\xfe" + CANARY.encode() + b"\xff")  # fails: not UTF-8
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        json.dumps(
            {
                "custom_id": f"id-{CANARY}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": CANARY}], "max_tokens": 4},
            }
        )
        + "\n"
    )
    jobs = [
        enclave.submit(str(docs), "--kind", "summarize", "--param", "max_tokens=8"),
        enclave.submit(str(docs), "--kind", "extract", "--param", "fields=name", "--param", "max_tokens=8"),
        enclave.submit("--openai-batch", str(batch)),
    ]
    worker = enclave.work()
    out = tmp_path / "client-out"
    for job in jobs:
        enclave.run("results", job, "--out", str(out / job))
    enclave.run("audit", "log")
    assert any(leaks(f.read_bytes()) for f in out.rglob("*.jsonl")), "the client sees its own plaintext"

    assert scan_files(enclave.home, skip=out) == []
    assert scan_files(tmp_path / "tmp", skip=out) == []  # TMPDIR of every CLI and worker process
    assert not leaks((worker.stdout + worker.stderr).encode())
    assert scan_files(enclave.home / "logs", skip=out) == [] if (enclave.home / "logs").exists() else True
    if enclave.backend == "servers":
        assert scan_redis() == []
        assert scan_database(enclave.env["ENCLAVE_DATABASE_URL"]) == []
    else:
        assert (enclave.home / "enclave.db").exists() and (enclave.home / "broker.db").exists()
        assert scan_database(f"sqlite:///{enclave.home / 'enclave.db'}") == []
