"""`enclave gateway` against the real `openai` package (issue 15, acceptance 3, and the gateway's share of 4).

One gateway (`enclave gateway --port 0`, uvicorn on loopback) and one real worker on the embedded back-end
serve the whole module. An unchanged OpenAI-SDK batch script (`openai_batch_script.py`) uploads, creates,
polls to `completed`, downloads the output and error files, cancels a second batch and lists batches page
by page. Every object and line is then parsed with the openai package's own types and checked field by
field against OpenAI's documented schema; the gateway's refusals are checked for status and error codes.
A canary in metadata, file names, custom_ids and documents must appear nowhere in the gateway's store,
logs or temporary files, nor in the database or the broker, while the client still reads all of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types import Batch, FileDeleted, FileObject
from openai.types.chat import ChatCompletion

from tests.e2e.canary import Canaries, Findings
from tests.e2e.conftest import ROOT, Enclave, _env
from tests.e2e.test_canary import scan_stores, scan_system_temp

SCRIPT = Path(__file__).with_name("openai_batch_script.py")
CHAT = "/v1/chat/completions"
# The batch object's fields as OpenAI documents them: all are present in every answer (null when unset).
BATCH_FIELDS = {
    "id": str,
    "object": str,
    "endpoint": str,
    "errors": (dict, type(None)),
    "input_file_id": str,
    "completion_window": str,
    "status": str,
    "output_file_id": (str, type(None)),
    "error_file_id": (str, type(None)),
    "created_at": int,
    "in_progress_at": (int, type(None)),
    "expires_at": (int, type(None)),
    "finalizing_at": (int, type(None)),
    "completed_at": (int, type(None)),
    "failed_at": (int, type(None)),
    "expired_at": (int, type(None)),
    "cancelling_at": (int, type(None)),
    "cancelled_at": (int, type(None)),
    "request_counts": dict,
    "metadata": (dict, type(None)),
}
FILE_FIELDS = {
    "id": str,
    "object": str,
    "bytes": int,
    "created_at": int,
    "filename": str,
    "purpose": str,
    "status": str,
}
STATUSES = {
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
}


@dataclass
class Running:
    enclave: Enclave
    url: str
    key: str
    started: float
    canaries: Canaries

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=self.key, max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, demo_model):
    """A home, a worker and `enclave gateway` on an ephemeral loopback port, for the whole module."""
    started = time.time() - 1
    tmp = tmp_path_factory.mktemp("gateway")
    enclave = Enclave(_env(tmp, demo_model, {}), tmp, "embedded")
    enclave.run("init")
    worker = enclave.start_worker()
    out, err = tmp / "gateway.out", tmp / "gateway.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "gateway", "--port", "0", "--max-upload-mb", "1"],
            env=enclave.env,
            stdout=stdout,
            stderr=stderr,
            cwd=tmp,
            start_new_session=True,
        )
    try:
        url = _announced(out, proc)
        key = (enclave.home / "gateway" / "api_key").read_text().strip()
        yield Running(enclave, url, key, started, Canaries())
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down gracefully, then ends by the signal it caught
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM), err.read_text()[-3000:]
        assert "Finished server process" in err.read_text()
        Enclave.kill(worker)


def _announced(out: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in out.read_text().splitlines():
            if line.startswith("enclave gateway: "):
                return line.removeprefix("enclave gateway: ").strip()
        assert proc.poll() is None, f"the gateway exited {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError("the gateway did not announce its address")


def request_line(custom_id: str, content, **body) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"messages": messages, **body}}


def write_lines(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


@dataclass
class ScriptRun:
    summary: dict
    out: Path
    inputs: Path
    expected: dict  # custom_id -> "done" | "invalid" (a 400 line)


@pytest.fixture(scope="module")
def script(gateway: Running) -> ScriptRun:
    """The unchanged OpenAI-SDK script, run once against the gateway."""
    m = gateway.canaries
    inputs, out = gateway.enclave.tmp / "inputs", gateway.enclave.tmp / "script-out"
    lines = [
        request_line(m("cid_ok1"), m("doc_ok1"), model=m("model"), max_tokens=4),
        request_line(m("cid_ok2"), m("doc_ok2"), max_tokens=3, temperature=0),
        request_line(m("cid_n2"), m("doc_n2"), n=2, max_tokens=3),  # two choices
        request_line(m("cid_stream"), m("doc_stream"), stream=True),  # refused by the worker: 400 line
        request_line(
            m("cid_part"), [{"type": m("part_type"), "text": m("doc_part")}]
        ),  # idem, its detail quotes
        {
            "custom_id": m("cid_nobody"),
            "method": "POST",
            "url": CHAT,
            m("line_key"): m("line_value"),
        },  # at submit
    ]
    expected = {m("cid_ok1"): "done", m("cid_ok2"): "done", m("cid_n2"): "done"}
    expected |= {m(x): "invalid" for x in ("cid_stream", "cid_part", "cid_nobody")}
    requests = write_lines(inputs / f"{m('batch_file')}.jsonl", lines)
    second = [request_line(m(f"cid_cancel_{i}"), m(f"doc_cancel_{i}"), max_tokens=200) for i in range(12)]
    second_file = write_lines(inputs / f"{m('cancel_file')}.jsonl", second)
    metadata = {m("meta_key"): m("meta_value"), "purpose": m("meta_purpose")}
    env = gateway.enclave.env | {"OPENAI_BASE_URL": gateway.url, "OPENAI_API_KEY": gateway.key}
    env["POLL_SECONDS"] = "0.2"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(requests), str(second_file), str(out), json.dumps(metadata)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ScriptRun(json.loads((out / "summary.json").read_text()), out, inputs, expected)


def check_fields(raw: dict, fields: dict, model) -> None:
    """`raw` (an object as sent) has every documented field with its JSON type, no field the openai type
    does not know, and parses as `model`."""
    assert set(fields) <= set(raw), set(fields) - set(raw)
    assert set(raw) <= set(model.model_fields), set(raw) - set(model.model_fields)
    for name, kind in fields.items():
        assert isinstance(raw[name], kind) and not isinstance(raw[name], bool), (name, raw[name])
    model.model_validate(raw)


def check_batch(raw: dict) -> Batch:
    check_fields(raw, BATCH_FIELDS, Batch)
    assert raw["object"] == "batch" and raw["id"].startswith("batch_") and raw["status"] in STATUSES
    assert raw["input_file_id"].startswith("file-") and raw["completion_window"] == "24h"
    assert raw["expires_at"] == raw["created_at"] + 24 * 3600
    counts = raw["request_counts"]
    assert set(counts) == {"total", "completed", "failed"} and all(type(v) is int for v in counts.values())
    assert counts["completed"] + counts["failed"] <= counts["total"]
    if raw["errors"] is not None:
        assert raw["errors"]["object"] == "list" and raw["errors"]["data"]
    for file_id in (raw["output_file_id"], raw["error_file_id"]):
        assert file_id is None or file_id.startswith("file-")
    return Batch.model_validate(raw)


def check_file(raw: dict, purpose: str) -> FileObject:
    check_fields(raw, FILE_FIELDS, FileObject)
    assert raw["object"] == "file" and raw["id"].startswith("file-") and raw["purpose"] == purpose
    assert raw["status"] == "processed" and raw["bytes"] > 0
    return FileObject.model_validate(raw)


def check_line(line: dict) -> None:
    """One line of an output or error file, as OpenAI documents `BatchRequestOutput`."""
    assert set(line) == {"id", "custom_id", "response", "error"}, line
    assert line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str)
    if line["response"] is None:
        assert set(line["error"]) == {"code", "message"} and isinstance(line["error"]["message"], str)
        return
    assert line["error"] is None
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and type(response["status_code"]) is int
    assert isinstance(response["request_id"], str) and response["request_id"]
    if response["status_code"] == 200:
        completion = ChatCompletion.model_validate(response["body"])
        assert completion.object == "chat.completion" and completion.choices[0].message.role == "assistant"
    else:
        error = response["body"]["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def raw_json(response) -> dict:
    return json.loads(response.text)


def test_an_unchanged_openai_script_runs_end_to_end(script: ScriptRun):
    summary = script.summary
    batch = check_batch(summary["batch"])
    assert summary["statuses"][0] == "validating" and summary["statuses"][-1] == "completed"
    assert set(summary["statuses"]) <= {"validating", "in_progress", "finalizing", "completed"}
    assert batch.status == "completed" and batch.metadata == json.loads(json.dumps(batch.metadata))
    output, errors = read_lines(script.out / "output.jsonl"), read_lines(script.out / "errors.jsonl")
    for line in output + errors:
        check_line(line)
    assert {x["custom_id"] for x in output} == {c for c, how in script.expected.items() if how == "done"}
    assert {x["custom_id"] for x in errors} == {c for c, how in script.expected.items() if how == "invalid"}
    assert all(x["response"]["status_code"] == 200 for x in output)
    assert all(x["response"]["status_code"] == 400 for x in errors)
    assert {x["response"]["body"]["error"]["type"] for x in errors} == {"invalid_request_error"}
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, len(output), len(errors))
    (n2,) = [x for x in output if x["custom_id"].endswith("cid_n2")]
    assert [c["index"] for c in n2["response"]["body"]["choices"]] == [0, 1]
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.failed_at is batch.cancelled_at is batch.expired_at is None
    assert batch.usage is not None and batch.usage.output_tokens >= 1
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens


def test_the_second_batch_is_cancelled(script: ScriptRun):
    cancelled = check_batch(script.summary["cancelled"])
    assert script.summary["cancel_statuses"][0] == "cancelling"
    assert set(script.summary["cancel_statuses"]) <= {"cancelling", "cancelled"}
    assert cancelled.status == "cancelled" and cancelled.cancelling_at <= cancelled.cancelled_at
    assert cancelled.completed_at is None and cancelled.error_file_id is not None
    errors = read_lines(script.out / "cancelled-errors.jsonl")
    done = read_lines(script.out / "cancelled-output.jsonl") if cancelled.output_file_id else []
    for line in errors + done:
        check_line(line)
    never_run = [x for x in errors if x["response"] is None]
    assert never_run and {x["error"]["code"] for x in never_run} == {"batch_cancelled"}
    counts = cancelled.request_counts
    assert (counts.total, counts.completed, counts.failed) == (12, len(done), len(errors))


def test_batches_and_files_list_with_a_cursor(gateway: Running, script: ScriptRun):
    client = gateway.client()
    listed = script.summary["listed"]  # the script's SDK followed the cursor a batch at a time
    assert listed[:2] == [script.summary["cancelled"]["id"], script.summary["batch"]["id"]]  # newest first
    everything = [b.id for b in client.batches.list(limit=100)]
    assert everything[-len(listed) :] == listed  # batches made since come first
    first = raw_json(client.batches.with_raw_response.list(limit=1))
    assert set(first) == {"object", "data", "first_id", "last_id", "has_more"} and first["object"] == "list"
    assert [b["id"] for b in first["data"]] == [first["first_id"]] == [first["last_id"]] == everything[:1]
    assert first["has_more"] is True
    for raw in first["data"]:
        check_batch(raw)
    second = raw_json(client.batches.with_raw_response.list(limit=1, after=first["last_id"]))
    assert second["first_id"] == everything[1]
    files = raw_json(client.files.with_raw_response.list(order="asc", limit=2))
    assert files["object"] == "list" and files["has_more"] is True and len(files["data"]) == 2
    for raw in files["data"]:
        check_file(raw, raw["purpose"])
    paged = [f.id for f in client.files.list(order="asc", limit=2)]  # the SDK follows `after`
    whole = raw_json(client.files.with_raw_response.list(order="asc"))
    assert paged == [f["id"] for f in whole["data"]] and whole["has_more"] is False
    assert {f["purpose"] for f in whole["data"]} == {"batch", "batch_output"}
    newest_first = [f.id for f in client.files.list()]
    assert newest_first == paged[::-1]


def test_files_are_served_as_uploaded_and_made(gateway: Running, script: ScriptRun):
    client = gateway.client()
    uploaded = check_file(
        raw_json(client.files.with_raw_response.retrieve(script.summary["input_file"]["id"])), "batch"
    )
    requests = next(script.inputs.glob(f"{gateway.canaries('batch_file')}*"))
    assert uploaded.filename == requests.name and uploaded.bytes == requests.stat().st_size
    assert client.files.content(uploaded.id).content == requests.read_bytes()
    batch = client.batches.retrieve(script.summary["batch"]["id"])
    made = check_file(raw_json(client.files.with_raw_response.retrieve(batch.output_file_id)), "batch_output")
    assert made.filename == f"{batch.id}_output.jsonl"
    assert client.files.content(made.id).content == (script.out / "output.jsonl").read_bytes()
    assert made.bytes == len((script.out / "output.jsonl").read_bytes())
    detail = next(
        x for x in read_lines(script.out / "errors.jsonl") if x["custom_id"] == gateway.canaries("cid_part")
    )
    assert gateway.canaries.prefix in detail["response"]["body"]["error"]["message"]  # opened here only


def test_a_batch_whose_lines_do_not_match_its_endpoint_fails(gateway: Running):
    client = gateway.client()
    lines = [request_line("a", "hi"), request_line("b", "hi") | {"url": "/v1/completions"}]
    path = write_lines(gateway.enclave.tmp / "mismatch.jsonl", lines)
    batch = client.batches.create(
        input_file_id=client.files.create(file=path, purpose="batch").id,
        endpoint=CHAT,
        completion_window="24h",
    )
    while batch.status in ("validating",):
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    raw = check_batch(raw_json(client.batches.with_raw_response.retrieve(batch.id)))
    assert raw.status == "failed" and raw.failed_at is not None and raw.output_file_id is None
    assert [(e.code, e.line, e.param) for e in raw.errors.data] == [("invalid_url", 2, "url")]
    with pytest.raises(openai.ConflictError) as refused:
        client.batches.cancel(batch.id)
    assert refused.value.status_code == 409 and refused.value.response.headers["x-should-retry"] == "false"


def error_of(exc: openai.APIStatusError) -> dict:
    envelope = exc.response.json()
    assert set(envelope) == {"error"} and set(envelope["error"]) == {"message", "type", "param", "code"}
    return envelope["error"]


@pytest.mark.parametrize(
    "call, status, param, code",
    [
        (lambda c: c.files.retrieve("file-nope"), 404, "file_id", None),
        (lambda c: c.files.content("file-nope"), 404, "file_id", None),
        (lambda c: c.files.delete("file-nope"), 404, "file_id", None),
        (lambda c: c.batches.retrieve("batch_nope"), 404, "batch_id", None),
        (lambda c: c.batches.cancel("batch_nope"), 404, "batch_id", None),
        (
            lambda c: c.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h"),
            404,
            "input_file_id",
            None,
        ),
        (lambda c: c.files.create(file=("a.jsonl", b"\n\n"), purpose="batch"), 400, "file", "empty_file"),
        (
            lambda c: c.files.create(file=("a.jsonl", b'{"custom_id": "x"}\n' * 2), purpose="batch"),
            400,
            "file",
            "duplicate_custom_id",
        ),
        (
            lambda c: c.files.create(file=("a.pdf", b"x"), purpose="assistants"),
            400,
            "purpose",
            "invalid_value",
        ),
        (
            lambda c: c.files.create(file=("big.jsonl", b"x" * (2**20 + 1)), purpose="batch"),
            413,
            "file",
            "file_too_large",
        ),
        (lambda c: c.batches.list(limit=101), 400, "limit", "invalid_value"),
        (lambda c: c.batches.list(after="batch_nope"), 400, "after", "invalid_value"),
    ],
)
def test_refusals_have_openai_status_and_code(gateway: Running, call, status, param, code):
    with pytest.raises(openai.APIStatusError) as refused:
        call(gateway.client())
    assert refused.value.status_code == status
    error = error_of(refused.value)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert gateway.canaries.prefix not in error["message"]


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"endpoint": CHAT, "completion_window": "24h"}, "input_file_id", "missing_required_parameter"),
        (
            {"input_file_id": "f", "endpoint": "/v1/embeddings", "completion_window": "24h"},
            "endpoint",
            "invalid_value",
        ),
        (
            {"input_file_id": "f", "endpoint": CHAT, "completion_window": "1h"},
            "completion_window",
            "invalid_value",
        ),
        (
            {"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": 1}},
            "metadata",
            "invalid_type",
        ),
        (
            {"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k" * 65: "v"}},
            "metadata",
            "invalid_value",
        ),
        (
            {"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h", "model": "x"},
            "model",
            "unknown_parameter",
        ),
    ],
)
def test_create_refusals_name_the_parameter(gateway: Running, body, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.client().post("/batches", body=body, cast_to=Batch)
    error = error_of(refused.value)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def raw_request(gateway: Running, method: str, path: str, data: bytes | None = None, key: str | None = None):
    headers = {
        "Authorization": f"Bearer {gateway.key if key is None else key}",
        "Content-Type": "application/json",
    }
    request = urllib.request.Request(gateway.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_malformed_requests_unknown_routes_and_keys(gateway: Running):
    assert raw_request(gateway, "POST", "/batches", b'{"input_file_id": ')[0] == 400
    status, body = raw_request(gateway, "POST", "/batches", b"[1, 2]")
    assert (status, body["error"]["code"]) == (400, "invalid_type")
    status, body = raw_request(gateway, "GET", "/models")
    assert status == 404 and body["error"]["message"] == "Invalid URL (GET /v1/models)"
    status, body = raw_request(gateway, "GET", "/batches", key="")
    assert (status, body["error"]["type"]) == (401, "invalid_request_error")
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=gateway.url, api_key="sk-wrong", max_retries=0).batches.list()
    assert error_of(refused.value)["code"] == "invalid_api_key"


def test_a_deleted_file_is_gone(gateway: Running):
    client = gateway.client()
    uploaded = client.files.create(
        file=("d.jsonl", json.dumps(request_line("d", "hi")).encode()), purpose="batch"
    )
    deleted = raw_json(client.files.with_raw_response.delete(uploaded.id))
    assert deleted == {"id": uploaded.id, "object": "file", "deleted": True}
    FileDeleted.model_validate(deleted)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_no_canary_in_clear_outside_the_client(gateway: Running, script: ScriptRun):
    """Last in the module: the store, logs, temporary files, database and broker hold no marker, and the
    client still reads every one of them (metadata, file names, custom_ids, documents' details)."""
    m, enclave = gateway.canaries, gateway.enclave
    client = gateway.client()
    batch = client.batches.retrieve(script.summary["batch"]["id"])
    assert batch.metadata == {m("meta_key"): m("meta_value"), "purpose": m("meta_purpose")}
    control = Findings(m)
    control.scan_tree(script.out, "client-out")
    seen = set().union(*control.places.values())
    assert {t for t in m.tags if t.startswith("cid_")} <= seen, {
        t for t in m.tags if t.startswith("cid_")
    } - seen
    assert {"meta_key", "meta_value", "batch_file"} <= seen

    found = Findings(m)
    scan_stores(enclave, found)  # the home (gateway store, logs, database and broker files), row by row
    found.scan_tree(enclave.tmp, "files", skip=[script.inputs, script.out, enclave.home])  # TMPDIR, logs
    scan_system_temp(found, enclave.tmp, gateway.started)
    assert (enclave.home / "gateway" / "files").is_dir() and any(
        (enclave.home / "gateway" / "batches").iterdir()
    )
    assert not found.places, "markers in clear (place: field tags):\n" + found.report()
    assert os.stat(enclave.home / "gateway" / "api_key").st_mode & 0o077 == 0
