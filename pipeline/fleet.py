"""Where a worker runs and what it is called: `enclave worker --gpu N` (or `--device DEV`) picks the engine's
device, and every worker on a host gets its own Celery node name and metrics port, so that one worker per GPU
runs side by side without node-name clashes (Celery's DuplicateNodenameWarning, Flower's views) or port
clashes."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from pipeline.errors import UserError


@dataclass(frozen=True)
class Placement:
    """A worker's device (None: the settings' choice, CUDA when available), node name and metrics port."""

    device: str | None
    node: str
    metrics_port: int


def place(
    gpu: int | None,
    device: str | None,
    name: str | None,
    metrics_port: int | None,
    settings_device: str | None,
    settings_port: int,
    host: str | None = None,
    pid: int | None = None,
) -> Placement:
    """The placement for `enclave worker`'s options.

    `--gpu N` is `--device cuda:N`, named `enclave-gpuN@host` (one worker per GPU: the name stays the same
    across restarts), with its metrics on the configured port + N. Otherwise the node is
    `enclave-<device>-<pid>@host` (unique on the host) on the configured port. `--name` and `--metrics-port`
    override either; a name without `@` gets `@host`.
    """
    if gpu is not None and device is not None:
        raise UserError("give --gpu N or --device DEVICE, not both")
    host = host or socket.gethostname()
    pid = os.getpid() if pid is None else pid
    if gpu is not None:
        device, slug = f"cuda:{gpu}", f"gpu{gpu}"
    else:
        device = device or settings_device
        slug = f"{re.sub(r'[^a-z0-9]+', '', (device or 'auto').lower()) or 'device'}-{pid}"
    node = name or f"enclave-{slug}"
    if "@" not in node:
        node = f"{node}@{host}"
    if metrics_port is None:
        metrics_port = settings_port + gpu if gpu is not None and settings_port > 0 else settings_port
    if metrics_port > 65535:
        raise UserError(f"the metrics port for --gpu {gpu} would be {metrics_port}; give --metrics-port")
    return Placement(device, node, metrics_port)
