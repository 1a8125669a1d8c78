"""`enclave worker`: a Celery worker in this process (thread pool sharing one engine), optionally exiting
once everything queued is finished."""

from __future__ import annotations

import logging
import socket
import threading
import time

from pipeline.celery_app import make_celery
from pipeline.settings import Settings, check_engine_env
from pipeline.worker import runtime_for

log = logging.getLogger("enclave.worker")


def run_worker(
    settings: Settings, concurrency: int = 2, until_idle: bool = False, loglevel: str = "INFO"
) -> int:
    """Serve shard tasks until stopped (SIGTERM/SIGINT), or, with `until_idle`, until no work is left."""
    check_engine_env()  # a bad ENCLAVE_KERNELS (say) stops the worker here, not in its first shard
    app = make_celery(settings)
    runtime = runtime_for(app)
    _ = runtime.identity  # the service keys now: a missing passphrase stops the worker in one line
    worker = app.Worker(
        pool="threads",
        concurrency=concurrency,
        loglevel=loglevel,
        hostname=f"enclave@{socket.gethostname()}",
        without_heartbeat=True,
        without_gossip=True,
        without_mingle=True,
        redirect_stdouts=False,
        quiet=True,
    )
    if until_idle:
        threading.Thread(
            target=_stop_when_idle, args=(runtime, worker), name="enclave-idle", daemon=True
        ).start()
    worker.start()
    runtime.stop_sweeper()
    return worker.exitcode or 0


def _stop_when_idle(runtime, worker, interval: float = 0.5, confirmations: int = 3) -> None:
    """Stop the worker after `confirmations` consecutive idle checks (nothing running, nothing left)."""
    idle_checks = 0
    runtime.start_sweeper()  # sweep at once: work whose messages were lost or whose leases expired
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
