"""Prometheus metrics (prometheus_client): one registry per worker process and per API, never the global one.

Names follow Prometheus' conventions (`enclave_` prefix, base units, `_total` counters, `_ratio` fractions).
Labels carry only fixed words (statuses, outcomes, reasons, route templates, the worker's node and device):
never a job or document id, a name, or anything from a document.

- Worker instruments (`WorkerMetrics`): documents finished by outcome, shard durations, lease renewals,
  engine requests aborted, broker rebuilds.
- Read when scraped: the engine's counters and gauges (`EngineCollector`: tokens in and out, tok/s, running
  and waiting requests, batch size, KV blocks and state slots in use, preemptions), the worker's state
  (`WorkerStateCollector`) and, from the database and the broker, the service's (`ServiceCollector`:
  documents of active jobs by status, jobs by status, live workers, queue depth).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from pipeline.broker_probe import BrokerProbe, BrokerUnavailable, BrokerUnreadable
from pipeline.db import Database
from pipeline.models import Document, Job
from pipeline.status import ACTIVE_JOB
from pipeline.workers import listing

log = logging.getLogger("enclave.metrics")
SHARD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class WorkerMetrics:
    """The instruments a worker updates as it works, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.documents = Counter(
            "enclave_worker_documents",
            "Documents this worker leased, by outcome: done, failed, or not_recorded (given back after an "
            "internal error, cancelled, or taken over).",
            ["outcome"],
            registry=r,
        )
        self.shard_seconds = Histogram(
            "enclave_shard_duration_seconds",
            "Seconds from a shard's task start to its last document recorded.",
            buckets=SHARD_BUCKETS,
            registry=r,
        )
        self.lease_renewals = Counter(
            "enclave_lease_renewals", "Document leases renewed by this worker's heartbeats.", registry=r
        )
        self.aborted_requests = Counter(
            "enclave_worker_aborted_requests",
            "Engine requests this worker aborted, by reason (cancelled, soft_time_limit, hard_time_limit).",
            ["reason"],
            registry=r,
        )
        self.broker_rebuilds = Counter(
            "enclave_broker_rebuilds",
            "Times this worker found the broker without its marker and dispatched the open shards again.",
            registry=r,
        )

    def observe_shard(self, seconds: float, outcomes: dict[str, int]) -> None:
        self.shard_seconds.observe(seconds)
        for outcome, count in outcomes.items():
            if count:
                self.documents.labels(outcome).inc(count)


class EngineCollector(Collector):
    """The engine's counters and gauges (`Engine.stats()`), read when scraped; nothing before it loads."""

    def __init__(self, stats: Callable[[], object | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        counters = (
            ("prompt_tokens", "Prompt tokens the engine computed (prefill).", s.prompt_tokens),
            ("generation_tokens", "Tokens the engine generated.", s.generated_tokens),
            ("steps", "Engine steps run.", s.steps),
            ("preemptions", "Running requests preempted to free KV blocks.", s.num_preemptions),
            ("aborted_requests", "Requests aborted before they finished.", s.aborted_requests),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"enclave_engine_{name}", doc, value=value)
        slots = s.slots_used / s.slots_total if s.slots_total else 0.0
        blocks = s.blocks_used / s.blocks_total if s.blocks_total else 0.0
        gauges = (
            (
                "generation_tokens_per_second",
                "Generated tokens per second of engine busy time.",
                s.generated_tokens_per_s,
            ),
            (
                "tokens_per_second",
                "Prompt and generated tokens per second of engine busy time.",
                s.tokens_per_s,
            ),
            ("requests_running", "Requests the engine is generating for.", s.num_running),
            ("requests_waiting", "Requests waiting for a slot or KV blocks.", s.num_waiting),
            ("batch_size", "Sequences in the engine's last step.", s.batch_size),
            ("kv_blocks_used", "KV cache blocks in use.", s.blocks_used),
            ("kv_blocks", "KV cache blocks in the pool.", s.blocks_total),
            ("kv_cache_usage_ratio", "Fraction of the KV cache blocks in use.", blocks),
            ("slots_used", "Sequence state slots in use.", s.slots_used),
            ("slots", "Sequence state slots in the pool.", s.slots_total),
            ("slot_usage_ratio", "Fraction of the sequence state slots in use.", slots),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"enclave_engine_{name}", doc, value=value)


@dataclass(frozen=True)
class WorkerState:
    """What the worker says about itself when scraped."""

    node: str
    device: str
    healthy: bool
    engine_loaded: bool
    in_flight: int


class WorkerStateCollector(Collector):
    def __init__(self, state: Callable[[], WorkerState]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        w = self.state()
        yield InfoMetricFamily(
            "enclave_worker",
            "This worker's node name and device.",
            value={"node": w.node, "device": w.device},
        )
        yield GaugeMetricFamily(
            "enclave_worker_healthy",
            "1 while the worker takes tasks, 0 once unhealthy.",
            value=int(w.healthy),
        )
        yield GaugeMetricFamily(
            "enclave_worker_engine_loaded", "1 once the engine is loaded.", value=int(w.engine_loaded)
        )
        yield GaugeMetricFamily(
            "enclave_worker_in_flight_documents", "Documents this worker works on now.", value=w.in_flight
        )


class ServiceCollector(Collector):
    """The service as the database and the broker show it, read when scraped. A database or broker that
    cannot be read shows as `enclave_database_up 0` or `enclave_broker_up 0`, never as an error."""

    def __init__(self, db: Database, probe: BrokerProbe, heartbeat_timeout: float) -> None:
        self.db = db
        self.probe = probe
        self.heartbeat_timeout = heartbeat_timeout

    def collect(self) -> Iterator[Metric]:
        try:
            with self.db.transaction() as s:
                documents = s.execute(
                    select(Document.status, func.count())
                    .join(Job, Job.id == Document.job_id)
                    .where(Job.status.in_(ACTIVE_JOB))
                    .group_by(Document.status)
                ).all()
                jobs = s.execute(select(Job.status, func.count()).group_by(Job.status)).all()
                views = listing(s, self.heartbeat_timeout)
        except Exception as exc:
            log.warning("metrics: the database cannot be read (%s)", type(exc).__name__)
            yield GaugeMetricFamily(
                "enclave_database_up", "1 when the database answered this scrape.", value=0
            )
        else:
            yield GaugeMetricFamily(
                "enclave_database_up", "1 when the database answered this scrape.", value=1
            )
            by_status = GaugeMetricFamily(
                "enclave_documents", "Documents of queued and running jobs, by status.", labels=["status"]
            )
            for status, count in documents:
                by_status.add_metric([str(status)], count)
            yield by_status
            job_gauge = GaugeMetricFamily("enclave_jobs", "Jobs, by status.", labels=["status"])
            for status, count in jobs:
                job_gauge.add_metric([str(status)], count)
            yield job_gauge
            live = GaugeMetricFamily("enclave_workers", "Live workers, by state.", labels=["state"])
            for state in sorted({v.health for v in views}):
                live.add_metric([state], sum(1 for v in views if v.health == state))
            yield live
        yield from self._queue()

    def _queue(self) -> Iterator[Metric]:
        if not self.probe.supported:
            return
        try:
            depth = self.probe.queue_depth()
        except (BrokerUnavailable, BrokerUnreadable):
            yield GaugeMetricFamily("enclave_broker_up", "1 when the broker answered this scrape.", value=0)
            return
        yield GaugeMetricFamily("enclave_broker_up", "1 when the broker answered this scrape.", value=1)
        if depth is not None:
            yield GaugeMetricFamily(
                "enclave_queue_depth", "Shard messages waiting in the broker's queue.", value=depth
            )
