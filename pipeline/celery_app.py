"""The Celery application. `celery -A pipeline.celery_app worker` works (the threads pool is its default, and
the only pool it serves), as does `enclave worker`; both read settings once, at start-up, from the environment
and `enclave.toml`. Importing this module reads no settings: `app` is made on first access (the `celery -A`
path). Task events are on, so Flower sees the workers on brokers that carry events (Redis)."""

from __future__ import annotations

import sys

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES

from pipeline.settings import Settings, SettingsError, check_engine_env, load_settings

TRANSPORT_ALIASES["sqla"] = "pipeline.embedded_broker:EmbeddedTransport"

TASK_MODULES = ["pipeline.tasks"]


def make_celery(settings: Settings) -> Celery:
    """A Celery app whose messages carry ids only; the database decides what work exists."""
    app = Celery("enclave", broker=settings.broker_url, include=TASK_MODULES)
    options: dict = {}
    if settings.broker_url.startswith("redis"):
        # Redelivery of unacknowledged messages; leases, not the broker, guarantee exactly-once results.
        # Priority queues: Redis serves lower numbers first (dispatch.dispatch_shard maps ours onto that).
        options = {
            "visibility_timeout": max(60, int(3 * settings.limits.lease_seconds)),
            "queue_order_strategy": "priority",
            "priority_steps": list(range(10)),
        }
    app.conf.update(
        worker_pool="threads",  # one engine per process shared by its threads (worker_signals.py enforces it)
        worker_send_task_events=True,  # for Flower; Celery turns events off itself on the SQL transport
        task_send_sent_event=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options=options,
        task_serializer="json",
        accept_content=["json"],
    )
    app.enclave_settings = settings
    return app


def __getattr__(name: str) -> Celery:
    """`pipeline.celery_app.app`, for `celery -A pipeline.celery_app`: settings are read on first access."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        app = make_celery(load_settings())
        check_engine_env()
    except SettingsError as exc:  # one line, not Celery's "unable to load" traceback
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    globals()["app"] = app
    return app
