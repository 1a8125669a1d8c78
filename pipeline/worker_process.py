"""`enclave worker`: a Celery worker in this process (the threads pool, sharing one engine), placed on a
device with a node name and metrics port of its own (`fleet.py`), optionally exiting once everything queued
is finished."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from pipeline.celery_app import make_celery
from pipeline.fleet import place
from pipeline.settings import Settings, check_engine_env
from pipeline.worker import runtime_for

log = logging.getLogger("enclave.worker")


@dataclass(frozen=True)
class WorkerOptions:
    """`enclave worker`'s options."""

    concurrency: int = 2
    until_idle: bool = False
    loglevel: str = "INFO"
    gpu: int | None = None
    device: str | None = None
    name: str | None = None
    metrics_port: int | None = None


def run_worker(settings: Settings, options: WorkerOptions | None = None) -> int:
    """Serve shard tasks until stopped (SIGTERM/SIGINT), or, with `until_idle`, until no work is left. A
    worker that cannot serve (bad model, keys, port) exits 1 with one line before it takes any task."""
    options = options or WorkerOptions()
    check_engine_env()  # a bad ENCLAVE_KERNELS (say) stops the worker here, not in its first shard
    placement = place(
        options.gpu,
        options.device,
        options.name,
        options.metrics_port,
        settings.device,
        settings.worker.metrics_port,
    )
    worker_settings = dataclasses.replace(settings.worker, metrics_port=placement.metrics_port)
    settings = dataclasses.replace(settings, device=placement.device, worker=worker_settings)
    app = make_celery(settings)
    runtime = runtime_for(app)
    worker = app.Worker(  # Celery's worker_init runs `runtime.prepare` in here (worker_signals.py)
        pool="threads",
        concurrency=options.concurrency,
        loglevel=options.loglevel,
        hostname=placement.node,
        without_gossip=True,
        without_mingle=True,
        redirect_stdouts=False,
        quiet=True,
    )
    if options.until_idle:
        threading.Thread(
            target=_stop_when_idle, args=(runtime, worker), name="enclave-idle", daemon=True
        ).start()
    worker.start()
    runtime.stop_sweeper()
    return worker.exitcode or 0


def _stop_when_idle(runtime, worker, interval: float = 0.5, confirmations: int = 3) -> None:
    """Stop the worker after `confirmations` consecutive idle checks (nothing running, nothing left)."""
    idle_checks = 0
    runtime.start_sweeper()  # sweep at once: work whose messages were lost or whose leases lapsed
    while True:
        time.sleep(interval)
        try:
            idle_checks = idle_checks + 1 if runtime.idle() else 0
        except Exception as exc:  # database briefly unavailable: keep waiting
            log.warning("idle check failed: %s", type(exc).__name__)
            idle_checks = 0
        if idle_checks >= confirmations:
            log.info("no work left: stopping")
            worker.stop(in_sighandler=False)
            return
