"""The gateway's HTTP surface on a real uvicorn (in a thread, on an ephemeral loopback port): uploads held
in memory (no temporary file, even past Starlette's 1 MiB spool), bodies bounded, the API key required."""

from __future__ import annotations

import http.client
import json
import socket
import tempfile
import threading

import openai
import pytest
import uvicorn

from pipeline.gateway.routes import FORM_OVERHEAD, create_app

KEY = "sk-enclave-test"
LIMIT = 4 * 2**20


@pytest.fixture
def url(gateway):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(gateway, KEY, LIMIT), log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server.should_exit = True
    thread.join(10)


def big_line(i: int, size: int) -> bytes:
    body = {"messages": [{"role": "user", "content": "x" * size}]}
    return json.dumps(
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    ).encode()


def test_an_upload_larger_than_the_spool_never_touches_a_temporary_file(url, monkeypatch):
    made = []

    def refuse(*args, **kwargs):
        made.append(args)
        raise AssertionError("a temporary file was made")

    for name in ("TemporaryFile", "NamedTemporaryFile", "mkstemp", "mkdtemp"):
        monkeypatch.setattr(tempfile, name, refuse)
    data = b"\n".join(big_line(i, 2**20) for i in range(3)) + b"\n"  # 3 MiB: three times Starlette's spool
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    uploaded = client.files.create(file=("big.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and not made
    assert client.files.content(uploaded.id).content == data


def test_a_body_declared_past_the_bound_is_refused_before_it_is_read(url):
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v1/files")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=x")
    conn.putheader("Content-Length", str(LIMIT + FORM_OVERHEAD + 1))
    conn.endheaders()  # no body sent: the answer must not wait for it
    answer = conn.getresponse()
    assert answer.status == 413
    assert json.loads(answer.read())["error"]["code"] == "file_too_large"


def test_every_route_wants_the_key(url):
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    for method, path in [
        ("GET", "/v1/files"),
        ("POST", "/v1/files"),
        ("GET", "/v1/batches/batch_x"),
        ("POST", "/v1/batches/batch_x/cancel"),
        ("DELETE", "/v1/files/file-x"),
    ]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request(method, path, headers={"Authorization": "Bearer nope"})
        answer = conn.getresponse()
        assert answer.status == 401, (method, path)
        assert json.loads(answer.read())["error"]["code"] == "invalid_api_key"
