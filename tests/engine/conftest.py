import pytest

from engine import Engine
from engine.demo_model import write_demo_model


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def demo_engine(demo_dir):
    return Engine.from_pretrained(demo_dir, device="cpu", dtype="float32")
