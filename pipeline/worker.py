"""The GPU worker process's runtime: its settings, database, service identity and one engine (loaded once,
lazily), the shard processor its Celery threads share (`shards.py`) and its sweeper (`sweeper.py`).

One `WorkerRuntime` per process, attached to the Celery app by `runtime_for`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from celery import Celery

from engine import Engine
from jobs.base import EngineModel
from pipeline import keys, store
from pipeline.db import Database
from pipeline.settings import Settings
from pipeline.shards import ShardProcessor
from pipeline.sweeper import Sweeper

log = logging.getLogger("enclave.worker")
_RUNTIME_LOCK = threading.Lock()


def runtime_for(app: Celery) -> WorkerRuntime:
    """The process's runtime for `app`, created on first use."""
    with _RUNTIME_LOCK:
        runtime = getattr(app, "_enclave_runtime", None)
        if runtime is None:
            runtime = WorkerRuntime(app, app.enclave_settings)
            app._enclave_runtime = runtime
        return runtime


class WorkerRuntime:
    """What one worker process holds: the database, the service keys, the engine, the shard processor and
    the sweeper."""

    def __init__(self, app: Celery, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.db = Database(settings.database_url)
        self.worker_id = f"worker:{socket.gethostname()}:{os.getpid()}"
        self._identity: keys.Identity | None = None
        self._engine: Engine | None = None
        self._model: EngineModel | None = None
        self._load_lock = threading.Lock()
        self._active = 0
        self._active_lock = threading.Lock()
        self.shards = ShardProcessor(self)
        self.sweeper = Sweeper(app, self.db, settings)

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

    def process_shard(self, job_id: str, shard: int) -> None:
        with self._active_lock:
            self._active += 1
        try:
            self.shards.process(job_id, shard)
        finally:
            with self._active_lock:
                self._active -= 1

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
