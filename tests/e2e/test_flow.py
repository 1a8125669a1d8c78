"""The full flow through the CLI with real worker processes, on both back-ends."""

import json

from tests.e2e.conftest import NOTES


def write_batch(path):
    lines = [
        {
            "custom_id": "chat-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "enclave-demo",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8,
            },
        },
        {
            "custom_id": "text-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.7, "seed": 3},
        },
        {"custom_id": "embed-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def small_repo(root):
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "README.md").write_text("# demo\n")
    (root / ".gitignore").write_text("build/\n*.log\n")
    (root / "build").mkdir()
    (root / "build" / "out.py").write_text("ignored = True\n")
    (root / "debug.log").write_text("ignored\n")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    return root


def test_full_flow(enclave, tmp_path):
    summarize = enclave.submit(
        str(NOTES), "--kind", "summarize", "--param", "max_tokens=16", "--name", "notes"
    )
    extract = enclave.submit(
        str(NOTES / "note-01-chest-pain.txt"),
        str(NOTES / "note-02-pneumonia.txt"),
        "--kind",
        "extract",
        "--param",
        "fields=patient,diagnosis",
        "--param",
        "max_tokens=12",
    )
    batch = enclave.submit("--openai-batch", str(write_batch(tmp_path / "batch.jsonl")))
    review = enclave.submit(
        str(small_repo(tmp_path / "repo")), "--kind", "code-review", "--param", "max_tokens=16"
    )
    queued = enclave.json("status", summarize)
    assert queued["status"] == "queued" and queued["total"] == 6 and queued["done"] == 0

    enclave.work()

    statuses = {j["job_id"]: j for j in enclave.json("jobs")}
    assert all(statuses[j]["status"] == "completed" for j in (summarize, extract, batch, review))
    s = enclave.json("status", summarize)
    assert (s["total"], s["done"], s["failed"]) == (6, 5, 1)

    out = tmp_path / "out-summarize"
    assert enclave.json("results", summarize, "--out", str(out))["documents"] == 6
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["document"] for r in records) == sorted(p.name for p in NOTES.iterdir())
    latin1 = next(r for r in records if r["document"] == "note-06-latin1-export.txt")
    assert latin1["status"] == "failed" and "not valid UTF-8" in latin1["error"] and latin1["output"] is None
    assert all(isinstance(r["output"], str) and r["output"] for r in records if r["status"] == "done")

    out = tmp_path / "out-extract"
    enclave.run("results", extract, "--out", str(out))
    for r in (json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()):
        # random weights: the model rarely writes JSON; unparsable output fails alone and keeps the raw text
        assert r["status"] == "done" or ("not valid JSON" in r["error"] and "raw" in r)

    out = tmp_path / "out-batch"
    enclave.run("results", batch, "--out", str(out))
    lines = {x["custom_id"]: x for x in map(json.loads, (out / "output.jsonl").read_text().splitlines())}
    assert lines["chat-1"]["response"]["status_code"] == 200 and lines["chat-1"]["error"] is None
    body = lines["chat-1"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 8
    assert lines["text-1"]["response"]["body"]["object"] == "text_completion"
    assert (
        lines["embed-1"]["response"] is None and lines["embed-1"]["error"]["code"] == "invalid_request_error"
    )

    out = tmp_path / "out-review"
    enclave.run("results", review, "--out", str(out))
    reviewed = {json.loads(line)["document"] for line in (out / "results.jsonl").read_text().splitlines()}
    assert reviewed == {"src/app.py", "README.md", ".gitignore"}  # build/, *.log and the PNG are skipped
    assert "src/app.py" in (out / "report.md").read_text()

    verify = enclave.run("audit", "verify", "--json")
    assert json.loads(verify.stdout)["ok"] is True
    actions = {e["action"] for e in enclave.json("audit", "log", "--limit", "1000")}
    assert {
        "client_added",
        "submitted",
        "started",
        "document_done",
        "document_failed",
        "completed",
        "results_fetched",
    } <= actions
    job_events = enclave.json("audit", "log", "--job", summarize)
    assert {e["job_id"] for e in job_events} == {summarize}
