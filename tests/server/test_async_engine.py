"""AsyncEngine without HTTP: typed errors cross the thread, early exits abort, shutdown fails open requests."""

import asyncio
import contextlib
import threading

import pytest

from kvyard.engine.llm_engine import LLMEngine
from kvyard.errors import CheckpointError, EngineDeadError, InvalidRequestError, PromptTooLongError
from kvyard.sampling_params import SamplingParams
from kvyard.server.async_engine import AsyncEngine, RequestFailedError
from tests.server.harness import wait_until
from tests.server.test_load_and_cancel import engine_idle

from .conftest import slow_down, tiny_engine_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_generate_streams_to_the_final_output(engine):
    async def main():
        return [out async for out in engine.generate("The quick", GREEDY, "gen-1")]

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 8
    assert wait_until(lambda: engine_idle(engine))


def test_typed_errors_cross_the_thread(engine):
    async def first(prompt, params, rid):
        async for out in engine.generate(prompt, params, rid):
            return out

    with pytest.raises(PromptTooLongError):
        asyncio.run(first([5] * engine.max_model_len, GREEDY, "too-long"))
    with pytest.raises(InvalidRequestError):
        asyncio.run(first("", GREEDY, "empty"))

    async def duplicate():
        slow = SamplingParams(max_tokens=200, ignore_eos=True)
        await engine.add_request("The quick", slow, "dup")
        try:
            await engine.add_request("The quick", slow, "dup")
        finally:
            await engine.abort("dup")

    with pytest.raises(InvalidRequestError, match="already in use"):
        asyncio.run(duplicate())
    assert wait_until(lambda: engine_idle(engine))


def test_leaving_generate_early_aborts_the_request(make_engine):
    """The prefill role relies on this abort. 400 tokens at >= 20 ms a step would take 8 s: only the abort
    makes the engine idle within 2 s, with few tokens generated and the abort counted."""
    engine = make_engine()
    slow_down(engine, 0.02)

    async def main():
        gen = engine.generate("The quick", SamplingParams(max_tokens=400, ignore_eos=True), "early")
        async with contextlib.aclosing(gen):
            async for _ in gen:
                break
        assert await asyncio.to_thread(wait_until, lambda: engine_idle(engine), 2)

    asyncio.run(main())
    stats = engine.stats()
    assert stats.num_aborted == 1 and stats.generation_tokens < 100, stats


def test_cancelling_a_submission_leaves_nothing_behind(make_engine):
    eng = make_engine()
    slow_down(eng, 0.05)  # the engine thread is busy, so the add waits in the command queue

    async def main():
        busy = asyncio.ensure_future(eng.add_request("busy", SamplingParams(max_tokens=20, ignore_eos=True), "busy"))
        await asyncio.sleep(0.1)
        task = asyncio.ensure_future(eng.add_request("The quick", SamplingParams(max_tokens=400, ignore_eos=True), "c"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await busy

    asyncio.run(main())
    assert wait_until(lambda: engine_idle(eng), timeout=5)


def test_shutdown_fails_open_requests_and_refuses_new_ones(make_engine):
    eng = make_engine()
    slow_down(eng, 0.01)

    async def main():
        sink = await eng.add_request("The quick", SamplingParams(max_tokens=400, ignore_eos=True), "open")
        await asyncio.to_thread(eng.shutdown)
        items = [sink.get_nowait() for _ in range(sink.qsize())]
        assert isinstance(items[-1], RequestFailedError)
        with pytest.raises(EngineDeadError):
            await eng.add_request("The quick", GREEDY)

    asyncio.run(main())
    assert not eng.is_running


def test_the_engine_is_built_on_its_own_thread(tiny_path):
    # One thread makes every parallel torch call (one libgomp pool; see AsyncEngine.__init__).
    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(tiny_engine_config(tiny_path, num_threads=1))

    eng = AsyncEngine(build)
    try:
        assert built_on == [eng._thread] and built_on[0] is not threading.current_thread()

        async def main():
            return [out async for out in eng.generate("The quick", GREEDY, "on-its-thread")]

        assert len(asyncio.run(main())[-1].outputs[0].token_ids) == 8
    finally:
        eng.shutdown()


def test_a_failing_build_raises_in_the_caller():
    def build() -> LLMEngine:
        raise CheckpointError("model.safetensors: truncated")

    with pytest.raises(CheckpointError, match="truncated"):
        AsyncEngine(build)
