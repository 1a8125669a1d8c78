import pytest

from engine import Engine
from engine.demo_model import write_demo_model
from engine.env import reset_engine_env


@pytest.fixture(autouse=True)
def _fresh_engine_env():
    """Each test reads the engine's variables afresh (a test's monkeypatch.setenv takes effect)."""
    reset_engine_env()
    yield
    reset_engine_env()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def mtp_dir(tmp_path_factory):
    """A tiny real-layout text checkpoint with an MTP head (read only by the tests that share it)."""
    from tests.engine.factories import add_mtp, save_text_model

    path = tmp_path_factory.mktemp("mtp-ckpt")
    save_text_model(path, seed=2)
    add_mtp(path, seed=9)
    return path


@pytest.fixture(scope="session")
def demo_engine(demo_dir):
    return Engine.from_pretrained(demo_dir, device="cpu", dtype="float32")
