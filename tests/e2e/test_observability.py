"""What an operator watches (issue 17 acceptance 3 and 4): `curl` of a worker's /metrics shows the engine, the
worker and the service by Prometheus' conventions, and no canary of a document, name or parameter ever
appears there (nor in the API's /metrics, nor a job id); a cancel stops generation: the engine's generated-
token counter stops growing within 2 s and its slots and blocks are freed; `status --watch` shows the rate,
elapsed time and ETA."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.canary import Canaries
from tests.e2e.conftest import NOTES
from tests.e2e.test_exactly_once import wait_for
from tests.pipeline.test_metrics import check_exposition, value

WORKER_METRICS = {
    "enclave_engine_prompt_tokens",
    "enclave_engine_generation_tokens",
    "enclave_engine_generation_tokens_per_second",
    "enclave_engine_tokens_per_second",
    "enclave_engine_requests_running",
    "enclave_engine_requests_waiting",
    "enclave_engine_batch_size",
    "enclave_engine_kv_blocks_used",
    "enclave_engine_kv_blocks",
    "enclave_engine_kv_cache_usage_ratio",
    "enclave_engine_slots_used",
    "enclave_engine_slots",
    "enclave_engine_slot_usage_ratio",
    "enclave_engine_preemptions",
    "enclave_engine_steps",
    "enclave_engine_aborted_requests",
    "enclave_shard_duration_seconds",
    "enclave_lease_renewals",
    "enclave_worker_documents",
    "enclave_worker_aborted_requests",
    "enclave_broker_rebuilds",
    "enclave_worker_info",
    "enclave_worker_healthy",
    "enclave_worker_engine_loaded",
    "enclave_worker_in_flight_documents",
    "enclave_database_up",
    "enclave_documents",
    "enclave_jobs",
    "enclave_workers",
    "enclave_broker_up",
    "enclave_queue_depth",
}
LONG = (NOTES / "note-04-diabetes-review.txt").read_text()  # no end of text in its first 1,700 tokens


def curl(url: str) -> str:
    return subprocess.run(["curl", "-sf", url], capture_output=True, text=True, timeout=30, check=True).stdout


def metrics_url(e) -> str:
    """The metrics URL of the one worker, once it is ready (it serves metrics while its engine loads too)."""
    assert wait_for(lambda: [w["health"] for w in e.json("workers")] == ["ready"], 60)
    [worker] = e.json("workers")
    return worker["metrics_url"]


def test_a_workers_metrics_show_the_engine_and_the_service_and_no_canary(enclave, tmp_path):
    canaries = Canaries()
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(6):
        (folder / f"{canaries('file_name')}-{i}.txt").write_text(f"{canaries('document')} {i}\n{LONG[:300]}")
    env = enclave.env | {"ENCLAVE_HEARTBEAT_SECONDS": "0.2"}  # leases renewed while the documents run
    worker = enclave.start_worker(env=env)
    try:
        job = enclave.submit(
            str(folder),
            "--kind",
            "summarize",
            "--name",
            canaries("job_name"),
            "--param",
            f"instructions={canaries('instructions')}",
            "--param",
            "max_tokens=200",
        )
        watch = enclave.run("status", job, "--watch", timeout=300)
        text = curl(metrics_url(enclave))
    finally:
        worker.terminate()
        worker.wait(60)
    assert (
        "completed" in watch.stdout
        and "docs/s · elapsed 0:00:" in watch.stdout
        and "ETA done" in watch.stdout
    )
    families = check_exposition(text)
    assert set(families) >= WORKER_METRICS, WORKER_METRICS - set(families)
    assert value(families, "enclave_worker_documents", outcome="done") == 6
    assert families["enclave_shard_duration_seconds"].samples  # three shards of two observed
    assert (
        sum(s.value for s in families["enclave_shard_duration_seconds"].samples if s.name.endswith("_count"))
        == 3
    )
    assert value(families, "enclave_engine_generation_tokens") > 0
    assert value(families, "enclave_lease_renewals") > 0
    assert value(families, "enclave_jobs", status="completed") == 1
    assert value(families, "enclave_worker_healthy") == 1 and value(families, "enclave_database_up") == 1
    assert canaries.tags_in(text) == set(), canaries.tags_in(text)
    assert job not in text and job[:8] not in text

    serve = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "serve", "--port", "0"],
        env=enclave.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=enclave.tmp,
    )
    try:
        url = serve.stdout.readline().split()[-1]  # announced once bound, a moment before it accepts
        assert wait_for(lambda: _answers(f"{url}/v1/health"), 30)
        api = curl(f"{url}/metrics")
    finally:
        serve.terminate()
        serve.wait(30)
    families = check_exposition(api)
    assert (
        value(families, "enclave_documents") == 0 and value(families, "enclave_jobs", status="completed") == 1
    )
    assert canaries.tags_in(api) == set() and job not in api


def test_cancel_stops_the_engines_generation_within_2_s(embedded, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(4):
        (folder / f"long-{i}.txt").write_text(LONG)
    env = embedded.env | {"ENCLAVE_SHARD_SIZE": "8"}
    job = embedded.json("submit", str(folder), "--kind", "summarize", "--param", "max_tokens=1700")["job_id"]
    worker = embedded.start_worker(env=env)
    try:
        url = metrics_url(embedded)
        assert wait_for(lambda: _generated(curl(url)) > 100, 60)
        families = {f.name: f for f in text_string_to_metric_families(curl(url))}
        blocks = value(families, "enclave_engine_kv_blocks_used")  # the four requests' and the prefix's
        embedded.run("cancel", job)
        cancelled = time.monotonic()
        samples = []  # (seconds after the cancel, generated tokens, running requests, KV blocks in use)
        while time.monotonic() - cancelled < 4.0:
            families = {f.name: f for f in text_string_to_metric_families(curl(url))}
            samples.append(
                (
                    time.monotonic() - cancelled,
                    value(families, "enclave_engine_generation_tokens"),
                    value(families, "enclave_engine_requests_running"),
                    value(families, "enclave_engine_kv_blocks_used"),
                )
            )
            time.sleep(0.1)
    finally:
        worker.terminate()
        worker.wait(60)
    after_2s = [s for s in samples if s[0] >= 2.0]
    assert after_2s and len({s[1] for s in after_2s}) == 1, f"still generating after 2 s: {samples}"
    # Its requests are gone and their KV blocks freed: what stays is the job's shared instruction prefix,
    # cached for the next request that names it.
    assert all(s[2] == 0 and s[3] <= blocks / 10 for s in after_2s), (blocks, samples)
    assert after_2s[0][1] < 4 * 1700  # it did stop early
    log = "".join(Path(p).read_text() for p in embedded.worker_logs)
    assert f"job {job} ended (cancelled): 4 engine requests aborted" in log
    status = embedded.json("status", job)
    assert (status["status"], status["cancelled"], status["done"]) == ("cancelled", 4, 0)


def _answers(url: str) -> bool:
    return subprocess.run(["curl", "-sf", url], capture_output=True, timeout=10).returncode == 0


def _generated(text: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return value(families, "enclave_engine_generation_tokens")
