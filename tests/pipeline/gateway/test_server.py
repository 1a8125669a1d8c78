"""`enclave gateway` binds loopback addresses only, unless forced; its API key file is the user's alone."""

import socket

from pipeline.cli import main
from pipeline.gateway.server import api_key, listen, resolve


def test_a_non_loopback_bind_is_refused_in_one_line(tmp_path, capsys):
    for host in ("0.0.0.0", socket.gethostbyname(socket.gethostname())):
        if resolve(host, 0).loopback:  # a host whose name resolves to 127.0.1.1
            continue
        assert main(["--home", str(tmp_path), "gateway", "--host", host]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: refusing to bind {host}") and "--allow-remote" in err
        assert len(err.splitlines()) == 1


def test_an_unknown_host_is_one_line(tmp_path, capsys):
    assert main(["--home", str(tmp_path), "gateway", "--host", "no-such-host.invalid"]) == 1
    assert capsys.readouterr().err.strip() == "error: cannot resolve --host 'no-such-host.invalid'"


def test_loopback_addresses():
    assert resolve("127.0.0.1", 0).loopback and resolve("localhost", 0).loopback
    assert not resolve("0.0.0.0", 0).loopback
    assert resolve("127.0.0.1", 8787).url(8787) == "http://127.0.0.1:8787/v1"


def test_the_api_key_is_made_once_and_private(tmp_path):
    key, path = api_key(tmp_path)
    assert key.startswith("sk-enclave-") and len(key) > 40
    assert path.stat().st_mode & 0o777 == 0o600
    assert api_key(tmp_path) == (key, path)


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    taken = listen(resolve("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        taken.listen()
        assert main(["--home", str(tmp_path), "gateway", "--port", str(port)]) == 1
        assert (
            capsys.readouterr().err.strip()
            == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
        )
    finally:
        taken.close()
