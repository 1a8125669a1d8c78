"""The device's own numbers: copy bandwidth (the roofline) and matrix rate; timing and synchronising."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.bench.measure import say


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def wall_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn` takes, host work included, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def device_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds the device spends on the work `fn` queues: CUDA events around it on CUDA, the wall clock
    elsewhere (for kernels launched back to back, not for host-bound loops)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Device-to-device copy of `nbytes`, best of `repeats`; bytes moved = read + written = 2 * nbytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = min(device_time(lambda: dst.copy_(src), device) for _ in range(repeats))
    return {"bytes_per_s": 2 * nbytes / best, "copy_bytes": nbytes, "best_s": best, "repeats": repeats}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> dict[str, Any]:
    """n x n x n GEMMs in `dtype`, best of `repeats`: FLOP/s = 2 n^3 / time."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.matmul(a, b)
    best = min(device_time(lambda: torch.matmul(a, b, out=out), device) for _ in range(repeats))
    return {"flop_per_s": 2 * n**3 / best, "n": n, "dtype": str(dtype), "best_s": best, "repeats": repeats}


def measure_device(device: torch.device, dtype: torch.dtype, quick: bool) -> tuple[dict, dict]:
    """The roofline's bandwidth (a 2 GiB copy on CUDA) and the matrix rate (8192^3 GEMMs on CUDA)."""
    say(f"measuring copy bandwidth and {dtype} matmul rate on {device}")
    on_gpu = device.type == "cuda"
    bandwidth = copy_bandwidth(device, (2048 if on_gpu else 64 if quick else 256) << 20)
    bandwidth["counted"] = "bytes read + bytes written by one device-to-device copy"
    matmul = matmul_rate(device, dtype, 8192 if on_gpu else 256 if quick else 1024)
    free(device)
    say(f"  {bandwidth['bytes_per_s'] / 1e9:,.0f} GB/s, {matmul['flop_per_s'] / 1e12:,.2f} TFLOP/s")
    return bandwidth, matmul
