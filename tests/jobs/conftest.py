import pytest

from engine import Engine
from engine.demo_model import write_demo_model
from tests.jobs.factories import FakeModel


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture(scope="session")
def demo_engine(tmp_path_factory) -> Engine:
    return Engine.from_pretrained(
        write_demo_model(tmp_path_factory.mktemp("demo-model")), device="cpu", dtype="float32"
    )
