import pytest

from kvyard.config import EngineConfig
from kvyard.server.async_engine import AsyncEngine


def tiny_engine_config(path, **overrides) -> EngineConfig:
    # A small KV budget: 256 blocks of 16 tokens, so block accounting is easy to check.
    options = dict(model=str(path), dtype="float32", kv_cache_memory="2MiB", max_num_batched_tokens=256,
                   max_num_seqs=64, num_threads=2)
    options.update(overrides)
    return EngineConfig(**options)


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def engine(tiny_path):
    eng = AsyncEngine.from_config(tiny_engine_config(tiny_path))
    yield eng
    eng.shutdown()


def slow_down(engine: AsyncEngine, seconds: float) -> None:
    """Make every forward pass of this (test-owned) engine take at least `seconds`: long requests on demand."""
    import time

    runner = engine._engine.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    runner.execute = slow_execute


@pytest.fixture
def make_engine(tiny_path):
    """make_engine(**engine_overrides) -> a private AsyncEngine, shut down after the test."""
    made = []

    def make(**overrides) -> AsyncEngine:
        eng = AsyncEngine.from_config(tiny_engine_config(tiny_path, **overrides))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="module")
def smol_server(smollm2_engine):
    """SmolLM2 behind a real HTTP server, for tests that need a model that writes text."""
    from tests.server.harness import running_server

    with running_server(smollm2_engine, served_model_name="smol") as srv:
        yield srv


@pytest.fixture(scope="module")
def smol_client(smol_server):
    import openai

    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
