"""The worker's life as Celery sees it, for `enclave worker` and `celery -A pipeline.celery_app worker` alike:

- `worker_init` (before any task is consumed): only Celery's threads pool is served, since one engine per
  process is shared by its threads (prefork would load one per child). `worker_pool` is "threads" in the
  app's configuration, which Celery's CLI also applies to `-P prefork` (its default, which it cannot tell from
  an explicit one); any other pool is refused here. Then `WorkerRuntime.prepare` registers the worker, checks
  the broker and loads the engine. A worker that cannot serve prints one line and exits 1.
- `worker_ready`: the sweeper starts; an unhealthy worker's queues are cancelled from the consumer's thread.
- `worker_shutdown`: the threads stop and the worker's row says it stopped.
"""

from __future__ import annotations

import sys

from celery import signals


def _pool_name(pool) -> str:
    """Celery's name of a pool given by name or class: threads, prefork, solo, eventlet, gevent..."""
    if isinstance(pool, str):
        return pool
    name = pool.__module__.rsplit(".", 1)[-1]
    return "threads" if name == "thread" else name


@signals.worker_init.connect
def _prepare(sender=None, **_kwargs) -> None:
    from pipeline.errors import UserError, describe
    from pipeline.worker import runtime_for

    pool = _pool_name(sender.pool_cls)
    if pool != "threads":
        _refuse(
            f"enclave workers run Celery's threads pool (one engine per process, shared by its threads), "
            f"not {pool}: drop --pool, or give --pool threads"
        )
    runtime = runtime_for(sender.app)
    queues = ",".join(sorted(sender.app.amqp.queues.consume_from or ["celery"]))
    try:
        runtime.prepare(sender.hostname, int(sender.concurrency or 1), queues)
    except UserError as exc:
        _refuse(str(exc))
    except Exception as exc:
        _refuse(describe(exc, runtime.settings.home))


def _refuse(line: str) -> None:
    print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    raise SystemExit(1)


@signals.worker_ready.connect
def _ready(sender=None, **_kwargs) -> None:
    from pipeline.worker import runtime_for

    runtime_for(sender.app).ready(sender)


@signals.worker_shutdown.connect
def _shutdown(sender=None, **_kwargs) -> None:
    from pipeline.worker import runtime_for

    runtime_for(sender.app).stop()
