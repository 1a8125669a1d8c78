"""The GPU worker process's runtime: its settings, database, service identity and one engine, the shard
processor its Celery threads share (`shards.py`), and the threads that keep it honest: the heartbeat
(`heartbeat.py`), the watchdog (`watchdog.py`), the sweeper (`sweeper.py`) and the metrics server.

`prepare` runs before the worker consumes anything (Celery's `worker_init`, `worker_signals.py`): it registers
the worker, serves its metrics, checks the broker and loads the engine, so a worker that cannot serve exits
with one line and never takes a task. One `WorkerRuntime` per process, attached to the Celery app by
`runtime_for`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from celery import Celery

from engine import Engine
from engine.outputs import EngineStats
from jobs.base import EngineModel
from pipeline import keys, rebuild, store, workers
from pipeline.broker_probe import BrokerProbe
from pipeline.db import Database
from pipeline.errors import UserError, describe
from pipeline.health import Health
from pipeline.heartbeat import Heartbeat
from pipeline.inflight import InFlight
from pipeline.metrics import (
    EngineCollector,
    ServiceCollector,
    WorkerMetrics,
    WorkerState,
    WorkerStateCollector,
)
from pipeline.metrics_server import MetricsServer
from pipeline.settings import Settings
from pipeline.shards import ShardProcessor
from pipeline.status import WorkerState as State
from pipeline.sweeper import Sweeper
from pipeline.watchdog import Watchdog

log = logging.getLogger("enclave.worker")
_RUNTIME_LOCK = threading.Lock()


class StartupError(UserError):
    """The worker cannot start serving; one line that says why (it took no task)."""


def runtime_for(app: Celery) -> WorkerRuntime:
    """The process's runtime for `app`, created on first use."""
    with _RUNTIME_LOCK:
        runtime = getattr(app, "_enclave_runtime", None)
        if runtime is None:
            runtime = WorkerRuntime(app, app.enclave_settings)
            app._enclave_runtime = runtime
        return runtime


class WorkerRuntime:
    """What one worker process holds: the database, the service keys, the engine, what is in flight, its
    health and metrics, and the threads that renew, watch and sweep."""

    def __init__(self, app: Celery | None, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.db = Database(settings.database_url)
        self.node = f"enclave-{os.getpid()}@{socket.gethostname()}"
        self.worker_id = workers.new_worker_id(self.node, os.getpid())
        self._identity: keys.Identity | None = None
        self._engine: Engine | None = None
        self._model: EngineModel | None = None
        self._load_lock = threading.Lock()
        self._active = 0
        self._active_lock = threading.Lock()
        self.inflight = InFlight()
        self.metrics = WorkerMetrics()
        self.health = Health(settings.worker.max_consecutive_errors, self._unhealthy)
        self.shards = ShardProcessor(self)
        self.sweeper = Sweeper(app, self.db, settings)
        self.threads: list[Heartbeat | Watchdog] = []
        self.server: MetricsServer | None = None
        self.consumer = None  # Celery's consumer once it is ready: an unhealthy worker cancels its queues
        self.state = State.STARTING

    @property
    def identity(self) -> keys.Identity:
        with self._load_lock:
            if self._identity is None:
                self._identity = keys.load_identity(
                    self.settings.service_key_dir, self.settings.passphrase("service")
                )
            return self._identity

    @property
    def model(self) -> EngineModel:
        with self._load_lock:
            if self._engine is None:
                from pipeline.home import ensure_model

                path = ensure_model(self.settings)
                start = time.perf_counter()
                self._engine = Engine.from_pretrained(
                    path, device=self.settings.device, dtype=self.settings.dtype, **self.settings.engine
                )
                self._model = EngineModel(self._engine)
                log.info("engine loaded from %s in %.1fs", path, time.perf_counter() - start)
            return self._model

    # ---- start and stop

    def prepare(self, node: str, concurrency: int, queues: str) -> None:
        """Everything before the first task: register, serve metrics, check the broker, load the engine.
        `StartupError` (one line, recorded as the worker's reason) when the worker cannot serve."""
        self.node = node
        self.worker_id = workers.new_worker_id(node, os.getpid())
        _ = self.identity  # the service keys: a missing passphrase stops the worker here, in one line
        device = self.settings.device or "auto"
        info = workers.WorkerInfo(
            self.worker_id, node, socket.gethostname(), os.getpid(), device, queues, concurrency
        )
        with self.db.transaction() as s:
            workers.register(s, info)
        try:
            self._serve_metrics()
            self.check_broker()
            _ = self.model
        except Exception as exc:
            reason = self._startup_reason(exc)
            self._set_state(State.FAILED, reason)
            self.stop_serving()
            raise StartupError(reason) from None
        self._set_state(State.READY, engine_loaded=True)
        self._start_threads()
        log.info("worker %s ready on %s (%s)", node, device, self.worker_id)

    def _startup_reason(self, exc: Exception) -> str:
        if isinstance(exc, StartupError):
            return str(exc)
        where, message = str(self.settings.model_path), describe(exc, self.settings.home)
        return (
            f"cannot load the model: {message}"
            if where in message
            else f"cannot load the model at {where}: {message}"
        )

    def _serve_metrics(self) -> None:
        port = self.settings.worker.metrics_port
        if port < 0:
            return
        registry = self.metrics.registry
        registry.register(EngineCollector(self.engine_stats))
        registry.register(WorkerStateCollector(self.worker_state))
        probe = BrokerProbe(self.settings.broker_url)
        registry.register(ServiceCollector(self.db, probe, self.settings.worker.heartbeat_timeout))
        host = self.settings.worker.metrics_host
        try:
            self.server = MetricsServer(registry, self.health_state, host, port)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or type(exc).__name__} (another "
                "worker there? give each its own --metrics-port, or --gpu N)"
            ) from None
        self.server.start()

    def check_broker(self) -> None:
        """A broker that lost its messages is rebuilt from the database before any task is taken."""
        if self.app is not None and rebuild.check(self.app, self.db, BrokerProbe(self.settings.broker_url)):
            self.metrics.broker_rebuilds.inc()

    def _start_threads(self) -> None:
        settings = self.settings
        heartbeat = Heartbeat(
            self.db,
            self.worker_id,
            self.inflight,
            self.health,
            settings.limits.lease_seconds,
            settings.heartbeat_interval,
            on_renewed=self.metrics.lease_renewals.inc,
        )
        watchdog = Watchdog(
            self.db,
            self.worker_id,
            self.inflight,
            self.health,
            settings.worker,
            self.abort,
            on_stopped=lambda why, n: self.metrics.aborted_requests.labels(str(why)).inc(n),
        )
        self.threads = [heartbeat, watchdog]
        for thread in self.threads:
            thread.start()

    def ready(self, consumer) -> None:
        """Celery's consumer is consuming: start sweeping (or, unhealthy already, stop consuming)."""
        self.consumer = consumer
        self.sweeper.start()
        if not self.health.healthy:
            self._stop_consuming()

    def stop(self) -> None:
        """The worker shuts down: its threads stop and its row says so (documents still leased are taken over
        as soon as other workers see it stopped)."""
        self.sweeper.stop()
        for thread in self.threads:
            thread.stop()
        self.stop_serving()
        if self.state not in (State.FAILED, State.STOPPED):
            try:
                self._set_state(State.STOPPED, self.health.reason)
            except Exception as exc:  # the database is away: the heartbeat timeout says it instead
                log.warning("could not record the stop (%s)", type(exc).__name__)

    def stop_serving(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # ---- health

    def _unhealthy(self, reason: str) -> None:
        self._set_state(State.UNHEALTHY, reason)
        self._stop_consuming()

    def _stop_consuming(self) -> None:
        consumer = self.consumer
        if consumer is None:
            return  # not consuming yet: `ready` does it
        queues = self.app.amqp.queues
        for queue in list(queues.consume_from or queues):
            consumer.call_soon(consumer.cancel_task_queue, queue)  # in the consumer's own thread

    def _set_state(self, state: State, reason: str | None = None, **values) -> None:
        self.state = state
        url = self.server.url if self.server is not None else None
        counts = {"done": self.health.done, "errors": self.health.errors}
        with self.db.transaction() as s:
            workers.set_state(s, self.worker_id, state, reason, metrics_url=url, **counts, **values)

    def health_state(self) -> dict:
        """`/healthz`: ready while the engine is loaded and the worker healthy."""
        return {
            "ready": self.state == State.READY and self.health.healthy,
            "state": str(self.state if self.health.healthy else State.UNHEALTHY),
            "reason": self.health.reason,
            "engine_loaded": self._engine is not None,
            "in_flight": self.inflight.documents(),
            "node": self.node,
        }

    def worker_state(self) -> WorkerState:
        return WorkerState(
            node=self.node,
            device=str(self._engine.device) if self._engine is not None else self.settings.device or "auto",
            healthy=self.health.healthy,
            engine_loaded=self._engine is not None,
            in_flight=self.inflight.documents(),
        )

    def engine_stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    def abort(self, futures: list) -> int:
        return self._engine.abort(futures) if self._engine is not None and futures else 0

    # ---- work

    def process_shard(self, job_id: str, shard: int) -> None:
        with self._active_lock:
            self._active += 1
        try:
            self.shards.process(job_id, shard)
        finally:
            with self._active_lock:
                self._active -= 1

    def observe_shard(self, seconds: float, outcomes: dict[str, int]) -> None:
        self.metrics.observe_shard(seconds, outcomes)

    def sweep(self) -> int:
        return self.sweeper.sweep()

    def start_sweeper(self) -> None:
        self.sweeper.start()

    def stop_sweeper(self) -> None:
        self.sweeper.stop()

    def idle(self) -> bool:
        """No shard running here and no unfinished document in any active job."""
        with self._active_lock:
            if self._active:
                return False
        with self.db.transaction() as s:
            return not store.has_open_work(s)
