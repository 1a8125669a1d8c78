"""The suite's claim, checked: at least 10,000 inputs fed across the parsers when the whole folder runs."""

from pathlib import Path

import pytest

from tests.fuzz import harness

FOLDER = Path(__file__).parent


def test_at_least_10000_inputs_were_fed(request):
    ours = [item for item in request.session.items if Path(item.path).parent == FOLDER]
    collected = {Path(item.path) for item in ours}
    whole = all(path in collected for path in FOLDER.glob("test_*.py")) and not harness.DESELECTED
    if not whole or request.session.testsfailed:
        pytest.skip("the total is checked when the whole fuzz folder runs and passes")
    elsewhere = [item.nodeid for item in ours if item is not request.node and item.nodeid not in harness.RAN]
    # Under pytest-xdist, `--dist loadgroup` (as `make test` runs it) sends the folder whole to one worker
    # (tests/scheduling.py); another --dist mode spreads it, and no process sees the whole count.
    if elsewhere:
        pytest.skip(f"{len(elsewhere)} fuzz tests ran in another process: run with --dist loadgroup")
    total = sum(harness.FED.values())
    print(f"fuzz inputs fed: {total} {dict(harness.FED)}")
    assert total >= 10_000, dict(harness.FED)
