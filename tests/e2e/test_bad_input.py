"""Bad input: each gives a clear one-line error; other documents still complete; nothing is lost."""

import json

from sqlalchemy import text

from pipeline import envelope, keys
from tests.e2e.conftest import NOTES, Enclave

GOOD = [str(NOTES / "note-01-chest-pain.txt"), str(NOTES / "note-02-pneumonia.txt")]


def one_line_error(proc):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def statuses(enclave, job):
    out = enclave.tmp / f"out-{job[:8]}"
    enclave.run("results", job, "--out", str(out))
    return {r["document"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def test_corrupted_ciphertext_fails_that_document_alone(embedded):
    job = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    db = embedded.database()
    with db.engine.begin() as c:
        doc_id, sealed = c.execute(
            text('SELECT id, sealed FROM documents WHERE job_id = :j AND "index" = 0'), {"j": job}
        ).one()
        tampered = bytes(sealed[:-1]) + bytes([sealed[-1] ^ 1])
        c.execute(text("UPDATE documents SET sealed = :s WHERE id = :i"), {"s": tampered, "i": doc_id})
    db.dispose()
    embedded.work()
    docs = statuses(embedded, job)
    assert docs["note-01-chest-pain.txt"]["status"] == "failed"
    assert "does not match the signed manifest" in docs["note-01-chest-pain.txt"]["error"]
    assert docs["note-02-pneumonia.txt"]["status"] == "done"


def test_documents_sealed_to_the_wrong_key_fail_and_other_jobs_complete(embedded):
    service_public = embedded.home / "service" / "public.json"
    genuine = service_public.read_text()
    service_public.write_text(json.dumps(keys.generate_identity().public.to_json()))
    wrong = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    service_public.write_text(genuine)
    right = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    embedded.work()
    assert all("wrong key or corrupted ciphertext" in d["error"] for d in statuses(embedded, wrong).values())
    assert all(d["status"] == "done" for d in statuses(embedded, right).values())


def test_forged_and_unsigned_manifests_are_refused_before_anything_is_opened(embedded):
    forged = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    unsigned = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    swapped = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    fine = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    service = keys.load_public(embedded.home / "service")
    db = embedded.database()
    with db.engine.begin() as c:
        # Other parameters, sealed to the service: with the manifest's hash changed to match (the signature
        # no longer verifies), or in place of the signed ones (their hash no longer matches).
        for job in (forged, swapped):
            other = envelope.seal_params({"max_tokens": 9}, service.x25519, job)
            c.execute(text("UPDATE jobs SET sealed_params = :p WHERE id = :j"), {"p": other, "j": job})
        manifest = c.execute(text("SELECT manifest FROM jobs WHERE id = :j"), {"j": forged}).scalar_one()
        signed_hash = json.loads(manifest)["params_sha256"]
        c.execute(
            text("UPDATE jobs SET manifest = :m WHERE id = :j"),
            {"m": manifest.replace(signed_hash, envelope.sha256_hex(other)), "j": forged},
        )
        c.execute(text("UPDATE jobs SET signature = :s WHERE id = :j"), {"s": b"", "j": unsigned})
    embedded.work()
    expected = {forged: "signature", unsigned: "signature", swapped: "sealed parameters do not match"}
    with db.engine.connect() as c:
        for job, reason in expected.items():
            status, error = c.execute(text("SELECT status, error FROM jobs WHERE id = :j"), {"j": job}).one()
            assert status == "failed" and reason in error
            assert (
                c.execute(text("SELECT count(*) FROM results WHERE job_id = :j"), {"j": job}).scalar_one()
                == 0
            )
    db.dispose()
    assert embedded.json("status", fine)["status"] == "completed"
    rejected = [e for e in embedded.json("audit", "log", "--limit", "500") if e["action"] == "rejected"]
    assert {e["job_id"] for e in rejected} == {forged, unsigned, swapped}


def test_a_job_of_manifest_version_1_with_clear_params_still_runs(embedded):
    """Jobs stored before parameters were sealed (manifest version 1) run as they did."""
    job = embedded.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    client = keys.load_identity(embedded.home / "client")
    db = embedded.database()
    with db.engine.begin() as c:
        manifest = json.loads(
            c.execute(text("SELECT manifest FROM jobs WHERE id = :j"), {"j": job}).scalar_one()
        )
        del manifest["params_sha256"]
        manifest |= {"version": 1, "params": {"max_tokens": 8}}
        c.execute(
            text("UPDATE jobs SET manifest = :m, signature = :s, sealed_params = NULL WHERE id = :j"),
            {"m": json.dumps(manifest), "s": envelope.sign_manifest(manifest, client), "j": job},
        )
    db.dispose()
    embedded.work()
    status = embedded.json("status", job)
    assert (status["status"], status["done"]) == ("completed", 2)


def test_unknown_and_revoked_clients(embedded, tmp_path):
    """A second client of the same embedded service: unknown until an administrator adds it; once revoked,
    the service refuses its requests and the worker its queued job; re-added, it submits again."""
    home = tmp_path / "bob-home"
    service = {"ENCLAVE_DATABASE_URL": f"sqlite:///{embedded.home / 'enclave.db'}"}
    service["ENCLAVE_BROKER_URL"] = f"sqla+sqlite:///{embedded.home / 'broker.db'}"
    bob = Enclave(embedded.env | service | {"ENCLAVE_HOME": str(home)}, tmp_path, "embedded")
    bob.run("keys", "create")
    bob.run("keys", "import-service", str(embedded.home / "service" / "public.json"))
    unknown = bob.run("submit", *GOOD, "--kind", "summarize", check=False)
    assert "not on the service's allow-list" in one_line_error(unknown)
    embedded.run("clients", "add", "bob", str(home / "client" / "public.json"))
    job = bob.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    fingerprint = keys.load_public(home / "client").fingerprint
    embedded.run("clients", "revoke", fingerprint[:12])
    embedded.work()
    db = embedded.database()
    with db.engine.connect() as c:
        status = c.execute(text("SELECT status FROM jobs WHERE id = :j"), {"j": job}).scalar_one()
    db.dispose()
    assert status == "failed"  # the worker refused the revoked client's queued job
    refused = bob.run("submit", *GOOD, "--kind", "summarize", check=False)
    assert "(401 revoked_client)" in one_line_error(refused)
    assert "no job" in one_line_error(embedded.run("status", job, check=False))  # not the admin's job either
    # Re-adding the client (an administrator's decision) lets it submit again.
    embedded.run("clients", "add", "bob", str(home / "client" / "public.json"))
    bob.submit(*GOOD, "--kind", "summarize", "--param", "max_tokens=8")


def test_oversize_document_fails_at_submit_and_the_rest_complete(embedded, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("word " * 400)
    embedded.env["ENCLAVE_MAX_DOCUMENT_BYTES"] = "1500"
    job = embedded.submit(*GOOD, str(big), "--kind", "summarize", "--param", "max_tokens=8")
    embedded.work()
    docs = statuses(embedded, job)
    assert docs["big.txt"]["status"] == "failed" and docs["big.txt"]["error"] == (
        "document is 2000 bytes; the limit is 1500"
    )
    assert [docs[n]["status"] for n in ("note-01-chest-pain.txt", "note-02-pneumonia.txt")] == [
        "done",
        "done",
    ]


def test_document_longer_than_the_context(embedded, tmp_path):
    long = tmp_path / "long.py"
    # About 13,000 tokens of the demo tokenizer: over its 8192-token context, and two chunks to review (each
    # chunk a prefill of thousands of tokens on the CPU: 2,500 lines made 14 of them, a minute of the suite).
    long.write_text(
        "".join(f"value_{i} = compute({i}, 'padding text for the context test')\n" for i in range(300))
    )
    summary = embedded.submit(str(long), *GOOD, "--kind", "summarize", "--param", "max_tokens=8")
    review = embedded.submit(str(long), "--kind", "code-review", "--param", "max_tokens=8")
    embedded.work()
    docs = statuses(embedded, summary)
    assert docs["long.py"]["status"] == "failed" and "the model's context is 8192" in docs["long.py"]["error"]
    assert docs["note-01-chest-pain.txt"]["status"] == "done"
    reviewed = statuses(embedded, review)["long.py"]
    assert reviewed["status"] == "done" and reviewed["output"]["chunks"] > 1


def test_malformed_batch_lines_fail_alone_and_a_duplicate_custom_id_refuses_the_file(embedded, tmp_path):
    lines = [
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}),
    ]
    dupes = tmp_path / "dupes.jsonl"
    dupes.write_text("\n".join(lines) + "\n")
    message = one_line_error(embedded.run("submit", "--openai-batch", str(dupes), check=False))
    assert message.endswith("nothing was stored: line 4: duplicate custom_id (first on line 1)")
    assert embedded.json("jobs") == []

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:3]) + "\n")
    submitted = embedded.json("submit", "--openai-batch", str(bad))
    assert submitted["documents"] == 3
    assert [r["document"] for r in submitted["rejected"]] == ["line 2", "line 3"]
    embedded.work()
    status = embedded.json("status", submitted["job_id"])
    assert (status["status"], status["done"], status["failed"]) == ("completed", 1, 2)
    out = tmp_path / "out"
    embedded.run("results", submitted["job_id"], "--out", str(out))
    written = {x["custom_id"]: x for x in map(json.loads, (out / "output.jsonl").read_text().splitlines())}
    assert written["a"]["response"]["status_code"] == 200
    for cid, problem in (("line 2", "is not valid JSON ("), ("line 3", "missing field 'custom_id'")):
        error = written[cid]["error"]
        assert error["code"] == "invalid_request_error" and f"{cid}: {problem}" in error["message"]


def test_unknown_kind_parameter_and_paths(embedded, tmp_path):
    assert "unknown kind (known: " in one_line_error(
        embedded.run("submit", *GOOD, "--kind", "translate", check=False)
    )
    assert "unknown parameter for kind 'summarize'" in one_line_error(
        embedded.run("submit", *GOOD, "--kind", "summarize", "--param", "colour=blue", check=False)
    )
    assert "max_tokens" in one_line_error(
        embedded.run("submit", *GOOD, "--kind", "summarize", "--param", "max_tokens=lots", check=False)
    )
    assert "does not exist" in one_line_error(
        embedded.run("submit", str(tmp_path / "missing.txt"), "--kind", "summarize", check=False)
    )
    assert "no job" in one_line_error(embedded.run("status", "ffffffff", check=False))
    assert embedded.json("jobs") == []


def test_commands_before_init_say_what_to_do(tmp_path, demo_model):
    from tests.e2e.conftest import Enclave, _env

    fresh = Enclave(_env(tmp_path, demo_model, {}), tmp_path, "embedded")
    assert "enclave init" in one_line_error(fresh.run("jobs", check=False))
    assert "enclave init" in one_line_error(fresh.run("submit", *GOOD, "--kind", "summarize", check=False))
