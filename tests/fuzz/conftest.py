from pathlib import Path

import pytest

from tests.fuzz import harness

FOLDER = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The check of the total number of inputs runs after every fuzz test (in the same process: under
    pytest-xdist, tests/scheduling.py sends the folder whole to one worker)."""
    last = [item for item in items if item.name == "test_at_least_10000_inputs_were_fed"]
    items[:] = [item for item in items if item not in last] + last


@pytest.fixture(autouse=True)
def _ran_here(request):
    yield
    harness.RAN.add(request.node.nodeid)


def pytest_deselected(items: list[pytest.Item]) -> None:
    harness.DESELECTED += sum(Path(item.path).parent == FOLDER for item in items)
