"""Acceptance: a batch of 50 good and 50 malformed OpenAI lines, each crashing input of the fuzz run among
them, completes with exactly 50 done and 50 failed; each failure has its own code, no stored reason quotes
a line, and the audit log stays intact."""

import json

from sqlalchemy import text

from pipeline import envelope, keys

CANARY = "CANARY-7f3a"  # in every malformed field; must never reach a clear column
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat_body(content, **extra):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def deep_line(custom_id):
    """A line whose body is nested 100,000 levels deep (json.loads raises RecursionError on it)."""
    deep = "[" * 100_000 + "]" * 100_000
    return f'{{"custom_id": "{custom_id}", "method": "POST", "url": "{CHAT}", "body": {deep}}}'


def malformed_lines():
    """(custom_id, raw line) for each kind of bad line, cycled to 50."""
    kinds = [
        lambda i: deep_line(f"bad-{i}"),
        lambda i: (CHAT, {"messages": [{"role": "user", "content": "x"}]}, f"/v1/embeddings/{CANARY}" * 300),
        lambda i: (CHAT, chat_body("hello", seed=2**70), None),
        lambda i: (CHAT, chat_body([{"type": f"{CANARY}-part" * 40, "text": "x"}]), None),
        lambda i: (CHAT, chat_body([{"type": "image_url", "image_url": {"url": CANARY}}]), None),
        lambda i: (CHAT, {"messages": [{"role": CANARY * 30, "content": "x"}]}, None),
        lambda i: (CHAT, chat_body(f"{CANARY}\ud800"), None),
        lambda i: (CHAT, chat_body("hello", stream=True), None),
        lambda i: (CHAT, chat_body("hello", temperature=CANARY), None),
        lambda i: (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, None),
        lambda i: (COMPLETIONS, {"prompt": {CANARY: 1}}, None),
        lambda i: (CHAT, {"messages": []}, None),
    ]
    lines = []
    for i in range(50):
        made = kinds[i % len(kinds)](i)
        if isinstance(made, str):
            lines.append((f"bad-{i}", made))
            continue
        url, body, other_url = made
        line = {"custom_id": f"bad-{i}", "method": "POST", "url": other_url or url, "body": body}
        lines.append((f"bad-{i}", json.dumps(line)))
    return lines


def good_lines():
    lines = []
    for i in range(50):
        if i % 2:
            body = {"prompt": f"Count {i}", "max_tokens": 3, "seed": i}
            line = {"custom_id": f"good-{i}", "method": "POST", "url": COMPLETIONS, "body": body}
        else:
            line = {"custom_id": f"good-{i}", "method": "POST", "url": CHAT, "body": chat_body(f"Hi {i}")}
        lines.append((f"good-{i}", json.dumps(line)))
    return lines


def test_50_good_and_50_malformed_lines(embedded, tmp_path):
    good, bad = good_lines(), malformed_lines()
    mixed = [x for pair in zip(good, bad, strict=True) for x in pair]  # neighbours share every shard
    batch = tmp_path / "mixed.jsonl"
    batch.write_text("".join(raw + "\n" for _, raw in mixed))
    embedded.env["ENCLAVE_SHARD_SIZE"] = "8"
    job = embedded.submit("--openai-batch", str(batch))
    embedded.work()

    status = embedded.json("status", job)
    assert status["status"] == "completed"
    assert (status["done"], status["failed"]) == (50, 50)
    out = tmp_path / "out"
    embedded.run("results", job, "--out", str(out))
    lines = {x["custom_id"]: x for x in map(json.loads, (out / "output.jsonl").read_text().splitlines())}
    assert all(lines[cid]["response"]["status_code"] == 200 for cid, _ in good)
    for cid, _ in bad:
        line = lines[cid]
        if line["response"] is not None:  # refused by the worker: OpenAI's 400, the error as its body
            assert line["error"] is None and line["response"]["status_code"] == 400, cid
            error = line["response"]["body"]["error"]
            assert error["type"] == "invalid_request_error", cid
        else:  # refused at submit (the line could not be read as a request): the line's error
            error = line["error"]
        assert error["code"] and error["message"], cid

    db = embedded.database()
    with db.engine.connect() as c:
        failed = c.execute(
            text("SELECT id, error, attempts FROM documents WHERE job_id = :j AND status = 'failed'"),
            {"j": job},
        ).all()
        failures = "SELECT document_id, details FROM audit_events WHERE job_id = :j AND action = :a"
        events = c.execute(text(failures), {"j": job, "a": "document_failed"}).all()
        everything = [
            *c.execute(text("SELECT error FROM documents WHERE error IS NOT NULL")).scalars(),
            *c.execute(text("SELECT details FROM audit_events")).scalars(),
            *c.execute(text("SELECT coalesce(error, '') FROM jobs")).scalars(),
        ]
    db.dispose()
    assert len(failed) == 50 and all(error and len(error) <= 200 for _, error, _ in failed)
    assert all(attempts <= 1 for *_, attempts in failed)  # failed alone, at once: no retries, no crash
    codes = {doc_id: json.loads(details).get("code") for doc_id, details in events}
    worker_failed = {doc_id for doc_id, _, _ in failed} & set(codes)
    assert all(codes[d] for d in worker_failed)  # each failure in the worker recorded with its code
    assert not any(CANARY in value for value in everything)
    assert embedded.json("audit", "verify")["ok"] is True


def test_lines_a_client_did_not_check_fail_alone_in_the_worker(embedded, tmp_path):
    """The worker does not trust the client's parser: lines it would refuse at submit (a body 100,000 levels
    deep, not JSON at all), sealed and signed by a client that skipped the check, fail alone."""
    lines = good_lines()[:8]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(raw + "\n" for _, raw in lines))
    embedded.env["ENCLAVE_SHARD_SIZE"] = "8"
    job = embedded.submit("--openai-batch", str(batch))
    replace = {2: deep_line("good-2").encode(), 5: b'{"custom_id": "good-5", ' + CANARY.encode()}
    client = keys.load_identity(embedded.home / "client")
    service = keys.load_public(embedded.home / "service")
    db = embedded.database()
    with db.engine.begin() as c:
        manifest = json.loads(
            c.execute(text("SELECT manifest FROM jobs WHERE id = :j"), {"j": job}).scalar_one()
        )
        for index, raw in replace.items():
            doc_id = c.execute(
                text('SELECT id FROM documents WHERE job_id = :j AND "index" = :i'), {"j": job, "i": index}
            ).scalar_one()
            sealed = envelope.seal_document(
                envelope.pack_document(f"good-{index}", raw), service.x25519, job, doc_id
            )
            digest = envelope.sha256_hex(sealed)
            c.execute(
                text("UPDATE documents SET sealed = :s, sha256 = :h WHERE id = :d"),
                {"s": sealed, "h": digest, "d": doc_id},
            )
            next(d for d in manifest["documents"] if d["id"] == doc_id)["sha256"] = digest
        c.execute(
            text("UPDATE jobs SET manifest = :m, signature = :g WHERE id = :j"),
            {
                "m": envelope.canonical_json(manifest).decode(),
                "g": envelope.sign_manifest(manifest, client),
                "j": job,
            },
        )
    db.dispose()
    embedded.work()
    status = embedded.json("status", job)
    assert (status["status"], status["done"], status["failed"]) == ("completed", 6, 2)
    out = tmp_path / "out"
    embedded.run("results", job, "--out", str(out))
    written = {x["custom_id"]: x for x in map(json.loads, (out / "output.jsonl").read_text().splitlines())}
    assert {cid for cid, x in written.items() if x["error"]} == {"good-2", "good-5"}
    assert all(written[cid]["error"]["code"] for cid in ("good-2", "good-5"))
