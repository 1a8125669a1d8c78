"""The README's "Production" section, followed step by step without Docker (issue 15, acceptance 6), and
`compose.yaml` checked against it.

Each `sh` block of the section is run in order, on the side its paragraph names (the service host or the
workstation). `docker compose run --rm SERVICE ARGS` runs that service's entrypoint from compose.yaml with
ARGS and the service's environment; `docker compose up -d` runs the migration step to its end, then starts
the API and the worker; other lines run in bash. What Docker would provide is translated, and only that:
a container's paths become host folders (its volumes), PostgreSQL and Redis are the local test servers (the
local Redis has no password: its URL drops the one compose gives it), the image's `enclave` is this
checkout's, the service's name `enclave.example` is `localhost` and its port 8443 a free one. Between the
blocks the test does what the people do: it carries service-public.json and tls/cert.pem to the workstation
and alice-public.json back, and puts two notes in notes/.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import yaml

from pipeline.settings import variables
from tests.e2e.conftest import NOTES, REDIS_DB, ROOT
from tests.e2e.test_service_api import _announced

README = ROOT / "README.md"
COMPOSE = ROOT / "compose.yaml"
SECRETS = ("ENCLAVE_DB_PASSWORD", "ENCLAVE_REDIS_PASSWORD")


def production_blocks() -> list[tuple[str, list[str]]]:
    """(side, command lines) of each sh block of the README's Production section, in order."""
    text = README.read_text()
    section = text[text.index("## Production\n") : text.index("\n## ", text.index("## Production\n") + 5)]
    blocks = []
    parts = section.split("```sh\n")
    for before, part in itertools.pairwise(parts):
        intro = before.split("```")[-1].strip().split("\n\n")[-1]  # the paragraph that leads to the block
        body = part.split("```")[0]
        side = "workstation" if "workstation" in intro else "service"
        assert "service host" in intro or side == "workstation", intro
        lines = [_strip_comment(x) for x in body.splitlines()]
        blocks.append((side, [x for x in lines if x]))
    return blocks


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${NAME}`, `${NAME:?message}` and `${NAME:-default}`."""

    def one(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"compose needs {name}: {arg}")
        return arg or ""

    return re.sub(r"\$\{(\w+)(?:(:\?|:-)([^}]*))?\}", one, value)


def test_compose_and_readme_agree():
    spec = compose()
    services = spec["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "cli"} <= set(services)
    steps = [line for _, lines in production_blocks() for line in lines]
    for line in steps:
        if line.startswith("docker compose run"):
            words = shlex.split(line.split(" < ")[0].split(" > ")[0])
            name = next(w for w in words[3:] if not w.startswith("-"))
            assert name in services, line
    assert "docker compose up -d" in steps
    # passwords: both servers need them, neither is published, the URLs carry them
    assert not services["postgres"].get("ports") and not services["redis"].get("ports")
    assert "${ENCLAVE_DB_PASSWORD" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert "--requirepass" in services["redis"]["command"]
    env = spec["x-enclave-env"]
    assert (
        "${ENCLAVE_DB_PASSWORD" in env["ENCLAVE_DATABASE_URL"]
        and "@postgres:5432/" in env["ENCLAVE_DATABASE_URL"]
    )
    assert (
        "${ENCLAVE_REDIS_PASSWORD" in env["ENCLAVE_BROKER_URL"]
        and "@redis:6379/" in env["ENCLAVE_BROKER_URL"]
    )
    known = {v.name for v in variables()}
    for name, service in services.items():
        for key in (
            service.get("environment", {}) if name.startswith(("cli", "migrate", "api", "worker")) else ()
        ):
            assert key in known, (name, key)
    # the API is the one port clients reach, on the port its command serves
    api = services["api"]
    assert api["ports"] == ["8443:8443"] and api["command"][api["command"].index("--port") + 1] == "8443"
    assert {"--cert", "--key"} <= set(api["command"])
    # the keys live in the volume the API, the worker and the one-off commands read
    for name in ("cli", "migrate", "api", "worker"):
        assert "enclave-home:/var/lib/enclave" in services[name]["volumes"], name
        assert services[name]["environment"]["ENCLAVE_HOME"] == "/var/lib/enclave"
    readme = README.read_text()
    for secret in SECRETS:
        assert f"export {secret}" in readme or f" {secret}=" in readme, secret


@dataclass
class Host:
    """The service host: compose's folder, its volumes and the processes `docker compose up` started."""

    root: Path
    env: dict[str, str]
    database_url: str
    broker_url: str
    model: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    url: str = ""

    def mounts(self, service: dict) -> dict[str, Path]:
        """Container path -> host path, from the service's volumes."""
        found = {}
        for volume in service.get("volumes", []):
            source, target = interpolate(volume, self.env).split(":")[:2]
            if source.startswith(("./", "/")):
                found[target] = (self.root / source).resolve()
            else:
                found[target] = self.root / "volumes" / source
                found[target].mkdir(parents=True, exist_ok=True)
        return found

    def command(self, name: str, args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The service's entrypoint and command (or `args`), with its environment, as they run here."""
        service = compose()["services"][name]
        mounts = self.mounts(service)

        def local(value: str) -> str:
            value = interpolate(value, self.env)
            for target, source in sorted(mounts.items(), key=lambda x: -len(x[0])):
                value = value.replace(target, str(source))
            return value

        argv = [
            local(a) for a in service["entrypoint"] + (service.get("command") or [] if args is None else args)
        ]
        assert argv[0] == "enclave", argv
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENCLAVE_")}
        env |= {k: local(str(v)) for k, v in service.get("environment", {}).items()}
        assert f":{self.env['ENCLAVE_DB_PASSWORD']}@postgres:5432/" in env["ENCLAVE_DATABASE_URL"]
        assert f":{self.env['ENCLAVE_REDIS_PASSWORD']}@redis:6379/" in env["ENCLAVE_BROKER_URL"]
        env |= {"ENCLAVE_DATABASE_URL": self.database_url, "ENCLAVE_BROKER_URL": self.broker_url}
        env |= {"ENCLAVE_DEVICE": "cpu", "ENCLAVE_DTYPE": "float32", "PYTHONPATH": str(ROOT)}
        env |= {"TMPDIR": str(self.root / "tmp"), "ENCLAVE_LEASE_SECONDS": "5"}
        if name == "worker":  # its metrics port (9464) is the host's to give too
            env["ENCLAVE_METRICS_PORT"] = "0"
        if name == "api":  # port 8443 is the host's to give; here any free one, announced
            argv[argv.index("--port") + 1] = "0"
            argv[argv.index("--host") + 1] = "127.0.0.1"
        return [sys.executable, "-m", "pipeline.cli", *argv[1:]], env


def exported(line: str, env: dict[str, str], cwd: Path) -> dict[str, str]:
    """The environment after an `export` line, run by bash (its `$(...)` included)."""
    proc = subprocess.run(
        ["bash", "-ec", f"{line}; env -0"], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert proc.returncode == 0, (line, proc.stderr)
    return dict(x.split("=", 1) for x in proc.stdout.split("\0") if "=" in x)


def run_service_line(host: Host, line: str) -> None:
    if line.startswith("export "):
        host.env = exported(line, host.env, host.root)
        return
    words = shlex.split(line)
    if words[:4] == ["docker", "compose", "up", "-d"]:
        return compose_up(host)
    if words[:3] != ["docker", "compose", "run"]:
        proc = subprocess.run(
            ["bash", "-ec", line], env=host.env, cwd=host.root, capture_output=True, text=True
        )
        assert proc.returncode == 0, (line, proc.stderr)
        return
    stdin = stdout = None
    if "<" in words:
        stdin = (host.root / words[words.index("<") + 1]).read_text()
        words = words[: words.index("<")]
    if ">" in words:
        stdout = host.root / words[words.index(">") + 1]
        words = words[: words.index(">")]
    rest = [w for w in words[3:] if w not in ("--rm", "-T")]
    argv, env = host.command(rest[0], rest[1:])
    proc = subprocess.run(
        argv, env=env, cwd=host.root, input=stdin, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (line, proc.stderr)
    if stdout is not None:
        stdout.write_text(proc.stdout)


def compose_up(host: Host) -> None:
    """`docker compose up -d`: the migration step to its end, then the API and the worker."""
    services = compose()["services"]
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    argv, env = host.command("migrate")
    proc = subprocess.run(argv, env=env, cwd=host.root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("api", "worker"):
        argv, env = host.command(name)
        if name == "worker":
            argv += ["--loglevel", "WARNING"]
        log = open(host.root / f"{name}.log", "w")  # noqa: SIM115 (closed by the OS at the end)
        proc = subprocess.Popen(
            argv, env=env, cwd=host.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        host.processes.append(proc)
    announced = _announced(host.root / "api.log", host.processes[0], "enclave serve: ")
    host.url = announced.replace("127.0.0.1", "localhost")  # the name its certificate carries


@pytest.fixture
def host(tmp_path, demo_model, pg_url):
    broker = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    broker.flushdb()
    root = tmp_path / "service-host"
    (root / "tmp").mkdir(parents=True)
    (root / "models").mkdir()
    (root / "models" / "Qwen3.6-35B-A3B").symlink_to(demo_model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCLAVE_")} | {
        "TMPDIR": str(root / "tmp")
    }
    h = Host(root, env, pg_url, f"redis://127.0.0.1:6379/{REDIS_DB}", demo_model)
    yield h
    for proc in h.processes:
        proc.terminate()
        proc.wait(timeout=30)
    broker.flushdb()


def test_the_production_section_works_as_written(host: Host, tmp_path):
    station = tmp_path / "workstation"
    (station / "notes").mkdir(parents=True)
    for name in ("note-01-chest-pain.txt", "note-03-fracture.txt"):
        (station / "notes" / name).write_bytes((NOTES / name).read_bytes())
    station_env = {k: v for k, v in os.environ.items() if not k.startswith("ENCLAVE_")}
    station_env |= {"ENCLAVE_HOME": str(station / "home"), "PYTHONPATH": str(ROOT), "TMPDIR": str(station)}
    job = None
    for side, lines in production_blocks():
        if side == "workstation" and (host.root / "service-public.json").exists():
            (station / "service-public.json").write_bytes((host.root / "service-public.json").read_bytes())
            (station / "cert.pem").write_bytes((host.root / "tls" / "cert.pem").read_bytes())
        if side == "service" and (station / "home" / "client" / "public.json").exists():
            (host.root / "alice-public.json").write_bytes(
                (station / "home" / "client" / "public.json").read_bytes()
            )
        for line in lines:
            line = line.replace("enclave.example", "localhost")
            if side == "service":
                run_service_line(host, line)
                continue
            if line.startswith("export "):
                station_env = exported(line.replace("https://localhost:8443", host.url), station_env, station)
                continue
            words = shlex.split(line.replace("JOB", job or "JOB"))
            assert words[0] == "enclave", line
            proc = subprocess.run(
                [sys.executable, "-m", "pipeline.cli", *words[1:]],
                env=station_env,
                cwd=station,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, (line, proc.stderr)
            if words[1] == "submit":
                job = proc.stdout.split()[0]
    assert job is not None and host.url.startswith("https://localhost:")
    results = (station / "results" / "results.jsonl").read_text().splitlines()
    assert len(results) == 2 and all('"status": "done"' in r for r in results)
    assert not {"ENCLAVE_DATABASE_URL", "ENCLAVE_BROKER_URL"} & set(station_env)
    assert not list((station / "home").rglob("*.db"))
