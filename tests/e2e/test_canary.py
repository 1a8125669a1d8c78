"""The canary suite (issue 12): a unique marker in every field a client sends (each field of OpenAI batch
lines, every job parameter, job names, file and folder names, document contents, malformed lines and
documents so that the error paths run). Jobs of every kind go through `enclave submit` and a real worker on
both back-ends; then every place plaintext must never reach is scanned: every column of every table, the
raw database and broker files (with -wal/-shm), Redis, the outputs of every CLI command and worker, the
logs, TMPDIR (where the service API, run in-process by each command, would write its temporary files) and
the system temporary folders (tests/e2e/test_service_api.py scans those of a separate `enclave serve`). No
marker may be found. The submitter still sees every name and every full failure reason in its sealed
results.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.e2e.canary import Canaries, Findings
from tests.e2e.conftest import REDIS_DB, Enclave

LIMIT = 3000  # ENCLAVE_MAX_DOCUMENT_BYTES: the "big" inputs exceed it, every other input fits


@dataclass
class Expect:
    """What the submitter must see for one document: its name, its status (None: either, as the demo
    model's output decides) and, when failed, its reason. Where the reason in clear had to leave out what
    the input said, the sealed `detail` must still quote it: `detail_tags`, the markers it must hold."""

    status: str | None = None
    detail_tags: tuple[str, ...] = ()


@dataclass
class Submission:
    label: str  # names its results folder and its lines in the report
    args: list[str]
    documents: dict[str, Expect] = field(default_factory=dict)  # document name -> what the submitter sees
    may_refuse: bool = False  # a hostile input the client may refuse whole, with a one-line error


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions", **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


def write_lines(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def write(path: Path, data: bytes | str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path.name


def summarize_job(m: Canaries, root: Path) -> Submission:
    good, sub = f"{m('sum_name_good')}.txt", f"{m('sum_dir')}/{m('sum_name_sub')}.md"
    bad, empty, big = (f"{m(f'sum_name_{x}')}.txt" for x in ("badutf8", "empty", "big"))
    write(root / good, f"Patient {m('sum_content_good')} has chest pain.\n" * 3)
    write(root / sub, f"# {m('sum_content_sub')}\nNotes in a subfolder.\n")
    write(root / bad, b"\xff\xfe" + m("sum_content_badutf8").encode() + b"\xff")
    write(root / empty, " \n\t\n")
    write(root / big, (m("sum_content_big") + " ") * (LIMIT // 40))
    args = [str(root), "--kind", "summarize", "--name", m("sum_jobname")]
    args += ["--param", f"instructions={m('sum_instructions')}", "--param", "max_tokens=4"]
    done, worker_failed = Expect("done"), Expect("failed")
    docs = {good: done, sub: done, bad: worker_failed, empty: worker_failed, big: Expect("failed")}
    return Submission("summarize", args, docs)


def extract_fields_job(m: Canaries, root: Path) -> Submission:
    good, bad = f"{m('ext_name_good')}.txt", f"{m('ext_name_badutf8')}.txt"
    write(root / good, f"Name: {m('ext_content_good')}. Born 1960.\n")
    write(root / bad, b"Name: \xc3\x28" + m("ext_content_badutf8").encode())
    args = [str(root), "--kind", "extract", "--name", m("ext_jobname")]
    args += ["--param", f"fields={m('ext_field_a')},{m('ext_field_b')}"]
    args += ["--param", f"instructions={m('ext_instructions')}", "--param", "max_tokens=8"]
    return Submission("extract-fields", args, {good: Expect(), bad: Expect("failed")})


def extract_schema_job(m: Canaries, root: Path) -> Submission:
    name = f"{m('schema_name_doc')}.txt"
    write(root / name, f"Diagnosis: {m('schema_content')}.\n")
    prop = {"type": "string", "description": m("schema_prop_desc"), "enum": [m("schema_enum")]}
    schema = {
        "type": "object",
        "title": m("schema_title"),
        "description": m("schema_desc"),
        "properties": {m("schema_prop"): prop},
        "required": [m("schema_prop")],
    }
    args = [str(root / name), "--kind", "extract", "--name", m("schema_jobname")]
    args += ["--param", f"schema={json.dumps(schema)}", "--param", "max_tokens=8"]
    return Submission("extract-schema", args, {name: Expect()})


def code_review_job(m: Canaries, root: Path) -> Submission:
    top, sub = f"{m('cr_name_top')}.py", f"{m('cr_dir')}/{m('cr_name_sub')}.py"
    bad = f"{m('cr_name_badutf8')}.py"
    write(root / top, f"SECRET = '{m('cr_content_top')}'\n\ndef f(x):\n    return x - 1\n")
    write(root / sub, f"# {m('cr_content_sub')}\nimport os\n")
    write(root / bad, b"x = '\xff" + m("cr_content_badutf8").encode() + b"'\n")
    write(root / f"{m('cr_name_binary')}.png", b"\x89PNG\r\n\x1a\n" + m("cr_content_binary").encode())
    write(root / ".gitignore", f"{m('cr_ignored')}*\n")
    write(root / f"{m('cr_ignored')}.py", f"# {m('cr_content_ignored')}\n")
    args = [str(root), "--kind", "code-review", "--name", m("cr_jobname")]
    args += ["--param", f"focus={m('cr_focus')}", "--param", "max_tokens=4"]
    return Submission("code-review", args, {top: Expect(), sub: Expect(), bad: Expect("failed")})


def context_job(m: Canaries, root: Path) -> Submission:
    """A document too long for the context once 8190 output tokens are asked for."""
    name = f"{m('ctx_name')}.txt"
    write(root / name, f"Patient {m('ctx_content')} is well.\n")
    args = [str(root / name), "--kind", "summarize", "--name", m("ctx_jobname")]
    args += ["--param", f"instructions={m('ctx_instructions')}", "--param", "max_tokens=8190"]
    return Submission("context", args, {name: Expect("failed")})


def batch_job(m: Canaries, root: Path) -> Submission:
    """An OpenAI batch file whose name is the job's name, a marker in every field of its lines."""
    sink = {
        "model": m("model"),
        "messages": [
            {"role": "system", "content": m("msg_system"), "name": m("msg_name")},
            {"role": "user", "content": [{"type": "text", "text": m("part_text")}]},
        ],
        "max_tokens": 4,
        "stop": [m("stop")],
        "user": m("user"),
        "metadata": {m("meta_key"): m("meta_value")},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": m("tool_name"),
                    "description": m("tool_desc"),
                    "parameters": {"type": "object", "properties": {m("tool_param"): {"type": "string"}}},
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": m("tool_choice")}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": m("rf_name"), "schema": {"type": "object", "description": m("rf_desc")}},
        },
        m("body_key"): m("body_value"),
    }
    numbers = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n"]
    lines = [
        line(m("cid_min"), user(m("msg_min"))),
        line(m("cid_sink"), sink, **{m("line_key"): m("line_value")}),
        line(m("cid_prompt"), {"prompt": m("prompt"), "max_tokens": 4}, url="/v1/completions"),
        line(m("cid_url"), user("hi"), url=f"/v1/embeddings/{m('url')}"),
        line(m("cid_part"), user([{"type": m("part_type"), m("part_key"): m("part_value")}])),
        *(line(m(f"cid_num_{k}"), user("hi") | {k: m(f"num_{k}")}) for k in numbers),
        line(m("cid_stop"), user("hi") | {"stop": {m("stop_key"): 1}}),
        line(m("cid_role"), {"messages": [{"role": m("role"), "content": m("role_content")}]}),
        line(m("cid_messages"), {"messages": m("messages_str")}),
        line(m("cid_message"), {"messages": [m("message_str")]}),
        line(m("cid_content"), user({m("content_key"): m("content_value")})),
        line(m("cid_prompt_obj"), {"prompt": {m("prompt_key"): 1}}, url="/v1/completions"),
        line(m("cid_big"), user(m("big_content") + " " + "x" * LIMIT)),
        line(m("cid_token_ids"), {"prompt": [m.number("token_id")], "max_tokens": 4}, url="/v1/completions"),
        line(m("cid_huge_max_tokens"), user("hi") | {"max_tokens": m.number("huge_max_tokens")}),
        line(m("cid_huge_seed"), user("hi") | {"seed": m.number("huge_seed", digits=22)}),
    ]
    path = write_lines(root / f"{m('batch_file')}.jsonl", lines)
    failed = Expect("failed")
    docs = {
        m(x): failed for x in ("cid_role", "cid_messages", "cid_message", "cid_content", "cid_prompt_obj")
    }
    docs |= {m(f"cid_num_{k}"): failed for k in numbers}
    docs |= {m("cid_min"): Expect("done"), m("cid_sink"): Expect(), m("cid_prompt"): Expect("done")}
    docs |= {m("cid_url"): Expect("failed", ("url",))}
    docs |= {m("cid_part"): Expect("failed", ("part_type",))}
    docs |= {m("cid_big"): Expect("failed"), m("cid_huge_seed"): Expect()}
    return Submission("batch", ["--openai-batch", str(path)], docs)


def long_reason_job(m: Canaries, root: Path) -> Submission:
    """Lines whose reasons quoted input past the audit log's 200-character rule, each beside a good line
    in its shard (shards of 2): each must fail alone."""
    lines = [
        line(m("cid_long_url"), user("hi"), url=f"/v1/embeddings/{m('long_url')}{'u' * 300}"),
        line(m("cid_long_ok1"), user(m("long_ok1"))),
        line(m("cid_long_part"), user([{"type": m("long_part") + "p" * 300, "text": "x"}])),
        line(m("cid_long_ok2"), user(m("long_ok2"))),
    ]
    path = write_lines(root / "long.jsonl", lines)
    docs = {m(f"cid_long_ok{i}"): Expect("done") for i in (1, 2)}
    docs |= {m("cid_long_url"): Expect("failed", ("long_url",))}
    docs |= {m("cid_long_part"): Expect("failed", ("long_part",))}
    return Submission("long-reasons", ["--openai-batch", str(path), "--name", m("long_jobname")], docs)


def nested_job(m: Canaries, root: Path) -> Submission:
    """A line nested 5,000 deep: the client may refuse the file whole (one line), or the line fails alone."""
    depth = 5000
    nested = b'{"role": "user", "content": ' + b"[" * depth + json.dumps(m("nested")).encode() + b"]" * depth
    raw = (
        json.dumps(line(m("cid_nested"), {"messages": []}))
        .encode()
        .replace(b'"messages": []', b'"messages": [' + nested + b"}]")
    )
    path = write_lines(root / "nested.jsonl", [raw, line(m("cid_nested_ok"), user(m("nested_ok")))])
    docs = {m("cid_nested"): Expect("failed"), m("cid_nested_ok"): Expect("done")}
    return Submission("nested", ["--openai-batch", str(path), "--name", m("nested_jobname")], docs, True)


def bad_name_job(m: Canaries, root: Path) -> Submission:
    """A file name that is not UTF-8 beside a good file: it may be refused, or fail alone."""
    good = f"{m('badname_ok')}.txt"
    write(root / good, f"Patient {m('badname_ok_content')}.\n")
    bad = os.fsdecode(m("badname_undecodable").encode() + b"-\xff.txt")
    write(root / bad, f"Patient {m('badname_content')}.\n")
    args = [str(root), "--kind", "summarize", "--name", m("badname_jobname"), "--param", "max_tokens=4"]
    return Submission("bad-name", args, {good: Expect("done")}, may_refuse=True)


def refused_submits(m: Canaries, root: Path) -> list[list[str]]:
    """Submits the client must refuse whole, before anything is stored or dispatched."""
    doc = root / "doc.txt"
    write(doc, f"Patient {m('refused_content')}.\n")
    bad_schema = json.dumps({"type": m("refused_schema_type"), "description": m("refused_schema_desc")})
    dupes = [line(m("dup_cid"), user(m("dup_content"))), line(m("dup_cid"), user("hi"))]
    dupes += [b'{"custom_id": "' + m("badjson_cid").encode() + b'", "body": ']
    return [
        [str(doc), "--kind", "summarize", "--param", f"max_tokens={m('refused_max_tokens')}"],
        [str(doc), "--kind", "summarize", "--param", f"temperature={m('refused_temperature')}"],
        [str(doc), "--kind", "summarize", "--param", f"{m('refused_param_key')}=1"],
        [str(doc), "--kind", m("refused_kind")],
        [str(doc), "--kind", "extract", "--param", f"schema={bad_schema}"],
        ["--openai-batch", str(write_lines(root / "dupes.jsonl", dupes))],
    ]


def sealed_problems(m: Canaries, sub: Submission, records: list[dict]) -> list[str]:
    """What the submitter cannot see in its sealed results that it should."""
    problems = []
    by_name = {r["document"]: r for r in records}
    for name, expect in sub.documents.items():
        record = by_name.get(name)
        if record is None:
            problems.append(f"{sub.label}: no result for {name!r} (have {sorted(by_name)})")
            continue
        if expect.status and record["status"] != expect.status:
            problems.append(f"{sub.label}: {name}: status {record['status']}, expected {expect.status}")
        if record["status"] != "failed":
            continue
        if not record.get("error"):
            problems.append(f"{sub.label}: {name}: failed without an error")
        detail = record.get("detail")
        if "detail" in record and not (isinstance(detail, str) and detail):
            problems.append(f"{sub.label}: {name}: an empty sealed `detail`: {detail!r}")
        if expect.detail_tags and detail is None:
            problems.append(f"{sub.label}: {name}: no sealed `detail` (error {record.get('error')!r})")
        elif missing := set(expect.detail_tags) - m.tags_in(detail or ""):
            problems.append(f"{sub.label}: {name}: sealed detail {detail!r} does not quote {missing}")
    return problems


def submit_all(enclave: Enclave, submissions: list[Submission], found: Findings) -> dict[str, str]:
    """Submit each job through the CLI; label -> job id of those stored."""
    jobs = {}
    for sub in submissions:
        proc = enclave.run("submit", *sub.args, check=False)
        found.scan(f"cli:submit {sub.label} output", proc.stdout + proc.stderr)
        if proc.returncode == 0:
            jobs[sub.label] = proc.stdout.split()[0]
            continue
        assert sub.may_refuse, f"submit {sub.label} refused: {proc.stderr}"
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        print(f"submit {sub.label} refused whole: {proc.stderr.strip()}")
    return jobs


def scan_stores(enclave: Enclave, found: Findings, label: str = "") -> dict[str, int]:
    """The database and the broker, row by row and key by key, and the raw files of the home."""
    found.scan_tree(enclave.home, f"home{label}")
    if enclave.backend == "servers":
        found.scan_redis(redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB), f"redis{label}")
        found.scan_sql(enclave.env["ENCLAVE_DATABASE_URL"], f"postgresql{label}")
        return {}
    found.scan_sql(f"sqlite:///{enclave.home / 'enclave.db'}", f"sqlite{label}")
    return found.scan_sql(f"sqlite:///{enclave.home / 'broker.db'}", f"broker.db{label}")


def scan_system_temp(found: Findings, skip: Path, since: float) -> None:
    """Files written since `since` in the shared temporary folders: a process that ignored TMPDIR."""
    for system in ("/tmp", "/var/tmp", "/dev/shm", str(Path.home() / ".cache")):
        found.scan_tree(Path(system), system, skip=[skip], since=since, deep=False)


def test_no_canary_in_clear_anywhere(enclave: Enclave, tmp_path):
    started = time.time() - 1
    m = Canaries()
    found = Findings(m)
    enclave.env["ENCLAVE_MAX_DOCUMENT_BYTES"] = str(LIMIT)
    inputs, out = tmp_path / "inputs", tmp_path / "client-out"
    builders = [summarize_job, extract_fields_job, extract_schema_job, code_review_job, context_job]
    builders += [batch_job, long_reason_job, nested_job, bad_name_job]
    submissions = {build.__name__: build(m, inputs / build.__name__) for build in builders}
    jobs = submit_all(enclave, list(submissions.values()), found)
    queued = scan_stores(enclave, found, " (queued)")  # while queued, the broker holds the messages
    assert enclave.backend == "servers" or queued["kombu_message"] > 0, "the broker was scanned empty"

    worker = enclave.work()
    found.scan("worker output", worker.stdout + worker.stderr)
    problems = []
    for sub in submissions.values():
        if sub.label in jobs:
            proc = enclave.run("results", jobs[sub.label], "--out", str(out / sub.label))
            found.scan(f"cli:results {sub.label} output", proc.stdout + proc.stderr)
            records = [json.loads(x) for x in (out / sub.label / "results.jsonl").read_text().splitlines()]
            problems += sealed_problems(m, sub, records)
    # What an administrator reads through the API: the audit log (the home's own client administers its
    # service). Every other client-facing answer is the submitter's own, checked below.
    proc = enclave.run("audit", "log", "--json", "--limit", "100000")
    found.scan("cli:audit log output (administrator)", proc.stdout + proc.stderr)
    assert json.loads(proc.stdout), "the administrator read nothing"
    proc = enclave.run("audit", "verify")
    found.scan("cli:audit verify output", proc.stdout + proc.stderr)

    # The positive control: the scanners find the markers where plaintext belongs, the client's --out, and
    # the job names the submitter's own `enclave jobs` opens with its key.
    control = Findings(m)
    control.scan_tree(out, "client-out")
    names = {t for t in m.tags if "_name_" in t and "ignored" not in t and "binary" not in t}
    assert names <= set().union(*control.places.values()), names - set().union(*control.places.values())
    control.scan("cli:jobs output (submitter)", enclave.run("jobs", "--json").stdout)
    job_names = {
        sub.args[sub.args.index("--name") + 1].removeprefix(m.prefix)
        for sub in submissions.values()
        if sub.label in jobs and "--name" in sub.args
    }
    assert job_names and job_names <= control.places["cli:jobs output (submitter)"], job_names

    scan_stores(enclave, found)
    found.scan_tree(tmp_path, "files", skip=[inputs, out, enclave.home])  # TMPDIR, the processes' cwd
    scan_system_temp(found, tmp_path, started)
    if found.places:
        problems.insert(0, "markers in clear (place: field tags):\n" + found.report())
    print("\n".join(problems))  # in full: pytest cuts a long assertion message
    assert not problems, "\n".join(problems)


def test_refused_submits_store_and_log_nothing(embedded: Enclave, tmp_path):
    """Submits refused whole (bad parameters, kind or batch file) exit with one line and leave no trace
    outside the client's terminal. What that line quotes back to its own user is printed, not failed."""
    started = time.time() - 1
    m = Canaries()
    inputs = tmp_path / "inputs"
    terminal, found = Findings(m), Findings(m)
    for i, args in enumerate(refused_submits(m, inputs)):
        proc = embedded.run("submit", *args, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        terminal.scan(f"refused submit {i} stderr", proc.stdout + proc.stderr)
    assert embedded.json("jobs") == []
    scan_stores(embedded, found)
    found.scan_tree(tmp_path, "files", skip=[inputs, embedded.home])
    scan_system_temp(found, tmp_path, started)
    if terminal.places:
        print("refused submits quote their input back to their own user:\n" + terminal.report())
    assert not found.places, found.report()
