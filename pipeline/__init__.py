"""Enclave's service side: settings, database, envelopes, keys, audit log, Celery tasks, the `enclave` CLI.

Nothing lives here yet: the pipeline is issue 3 (encrypted document jobs through Celery into the engine).
"""
