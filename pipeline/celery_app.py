"""The Celery application. `celery -A pipeline.celery_app worker --pool threads` works, as does
`enclave worker`; both read settings once, from the environment and `enclave.toml`."""

from __future__ import annotations

from celery import Celery

from pipeline.settings import Settings, load_settings

TASK_MODULES = ["pipeline.tasks"]


def make_celery(settings: Settings) -> Celery:
    """A Celery app whose messages carry ids only; the database decides what work exists."""
    app = Celery("enclave", broker=settings.broker_url, include=TASK_MODULES)
    options: dict = {}
    if settings.broker_url.startswith("redis"):
        # Redelivery of unacknowledged messages; leases, not the broker, guarantee exactly-once results.
        options = {"visibility_timeout": max(60, int(3 * settings.limits.lease_seconds))}
    app.conf.update(
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


app = make_celery(load_settings())
