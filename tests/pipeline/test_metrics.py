"""The API's /metrics (in process, on SQLite and PostgreSQL) follow Prometheus' conventions: `enclave_`
names in base units, counters ending in `_total`, labels from a fixed set of words, routes by their template
(never a job id); they count requests, jobs and documents by status, workers and the broker's queue.
`check_exposition` is shared with the worker's end-to-end test."""

import re

from prometheus_client.parser import text_string_to_metric_families

from pipeline import client
from tests.pipeline.test_submit import make_session, notes, service  # noqa: F401 (a fixture)

NAME = re.compile(r"^enclave_[a-z][a-z0-9_]*$")
LABELS = {"status", "route", "method", "outcome", "reason", "state", "node", "device", "le"}
UNITS = ("_seconds", "_bytes", "_ratio", "_total", "_per_second")


def check_exposition(text: str) -> dict[str, object]:
    """Every family of a /metrics answer, by name, after checking Prometheus' naming conventions: a
    counter's samples end in _total (or _created), a histogram is in seconds, a gauge never ends in _total,
    and labels come from the fixed set (statuses, outcomes, routes: never an id, a name or content)."""
    families = {}
    for family in text_string_to_metric_families(text):
        assert NAME.match(family.name), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= LABELS, (family.name, sample.labels)
        families[family.name] = family
    return families


def value(families, name: str, **labels) -> float:
    return sum(
        s.value
        for s in families[name].samples
        if s.name in (name, f"{name}_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_the_apis_metrics_count_requests_jobs_documents_and_the_queue(tmp_path, db_url, service):  # noqa: F811
    session = make_session(tmp_path / "alice", db_url, service)
    job = client.submit_files(session, [notes(tmp_path / "docs", 5)], "summarize", {}).job_id
    client.job_status(session, job)
    answer = session.api.http.get("/metrics")  # unsigned, as a scraper asks
    session.close()
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    families = check_exposition(text)
    assert value(families, "enclave_api_requests", route="/v1/jobs/{job}", method="GET", status="200") == 1
    assert value(families, "enclave_api_requests", route="/v1/jobs/{job}/submit", status="200") == 1
    assert families["enclave_api_request_duration_seconds"].type == "histogram"
    assert value(families, "enclave_documents", status="pending") == 5
    assert value(families, "enclave_jobs", status="queued") == 1
    assert value(families, "enclave_database_up") == 1
    assert value(families, "enclave_queue_depth") == 1  # one shard of 8: its message waits
    assert job not in text and job[:8] not in text
