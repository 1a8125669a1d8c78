"""The worker's small parts without a worker: its health (consecutive internal errors), its placement (device,
node name and metrics port from --gpu/--device), and the rate and time left that `status --watch` shows."""

import pytest

from pipeline.errors import UserError
from pipeline.fleet import place
from pipeline.health import Health
from pipeline.progress import Rate, clock, summary


def test_health_trips_once_after_consecutive_internal_errors():
    reasons = []
    health = Health(3, reasons.append)
    health.error("internal error (MemoryError)")
    health.error("internal error (MemoryError)")
    health.success()  # a document that ran resets the run of errors
    health.error("internal error (MemoryError)")
    health.error("internal error (MemoryError)")
    assert health.healthy and reasons == []
    health.error("internal error (RuntimeError)")
    health.error("internal error (RuntimeError)")
    assert not health.healthy and len(reasons) == 1
    assert (
        reasons[0]
        == "3 documents in a row failed with internal errors (the last: internal error (RuntimeError))"
    )
    assert (health.done, health.errors) == (1, 6)
    health.trip("another reason")
    assert health.reason == reasons[0]


def test_each_gpu_gets_its_own_device_node_name_and_metrics_port():
    zero = place(0, None, None, None, None, 9464, host="h", pid=10)
    one = place(1, None, None, None, None, 9464, host="h", pid=11)
    assert (zero.device, zero.node, zero.metrics_port) == ("cuda:0", "enclave-gpu0@h", 9464)
    assert (one.device, one.node, one.metrics_port) == ("cuda:1", "enclave-gpu1@h", 9465)
    assert place(1, None, None, None, None, 0, host="h").metrics_port == 0  # any free port stays any


def test_workers_without_a_gpu_are_told_apart_by_pid_and_options_win():
    a = place(None, "cpu", None, None, None, 0, host="h", pid=10)
    b = place(None, None, None, None, "cpu", 0, host="h", pid=11)
    assert (a.node, b.node) == ("enclave-cpu-10@h", "enclave-cpu-11@h")
    assert place(None, "cuda:1", None, None, None, 9464, host="h", pid=7).node == "enclave-cuda1-7@h"
    assert place(None, None, None, None, None, 9464, host="h", pid=7).node == "enclave-auto-7@h"
    named = place(2, None, "gpu-b", 9999, None, 9464, host="h")
    assert (named.node, named.metrics_port, named.device) == ("gpu-b@h", 9999, "cuda:2")
    assert place(None, None, "x@y", None, None, -1, host="h").node == "x@y"


def test_placement_refusals_are_one_line():
    with pytest.raises(UserError, match="--gpu N or --device DEVICE, not both"):
        place(0, "cpu", None, None, None, 9464)
    with pytest.raises(UserError, match="give --metrics-port"):
        place(1000, None, None, None, None, 65000)


def test_rate_settles_on_the_recent_window_and_gives_the_time_left():
    rate = Rate(window=10, settle=2)
    rate.add(0.0, 10)
    assert rate.per_second(10, elapsed=5.0) == 2.0  # too early for the window: the job's average
    rate.add(1.0, 12)
    rate.add(4.0, 20)
    assert rate.per_second(20, elapsed=9.0) == pytest.approx(2.5)
    for t in range(5, 30):
        rate.add(float(t), 20 + (t - 4) * 4)
    assert rate.per_second(120, elapsed=40.0) == pytest.approx(4.0)  # the old, slower part left the window
    assert summary(120, 200, 4.0, 40.0, active=True) == "4.0 docs/s · elapsed 0:00:40 · ETA 0:00:20"
    assert summary(200, 200, 4.0, 3725.0, active=False) == "4.0 docs/s · elapsed 1:02:05 · ETA done"
    assert summary(0, 200, None, 0.0, active=True) == "- docs/s · elapsed 0:00:00 · ETA -"
    assert clock(None) == "-"
