import pytest

from kvyard.router.server import load_tokenizer
from kvyard.server.async_engine import AsyncEngine
from tests.server.conftest import tiny_engine_config


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    return load_tokenizer(str(tiny_path))


@pytest.fixture
def make_engine(tiny_path):
    made = []

    def make(**overrides) -> AsyncEngine:
        eng = AsyncEngine.from_config(tiny_engine_config(tiny_path, num_threads=1, **overrides))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()
