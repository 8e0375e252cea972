from kvyard.bench.decode_steps import decode_token_rate, interleaved_decode_steps
from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def test_interleaved_steps_time_every_engine_and_leave_them_empty(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    llms = {name: LLM(config=EngineConfig(model=path, dtype="float32", kv_cache_memory="16MiB")) for name in "ab"}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    times = interleaved_decode_steps(llms, ["hello world", "one two three"], params, steps=5)
    assert set(times) == {"a", "b"} and all(len(t) == 5 and min(t) > 0 for t in times.values())
    for llm in llms.values():  # the timed requests were aborted and their blocks freed
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.scheduler.blocks.num_blocks
    # a request that finishes ends the timing early, for every engine alike
    short = interleaved_decode_steps(llms, ["hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), 10)
    assert len(short["a"]) == len(short["b"]) < 10


def test_a_pipelines_decode_rate_counts_tokens_not_steps(tiny_checkpoint):
    """With two stages overlapping, a step carries one micro-batch: the rate counts the tokens the requests
    gained, and the engine is left empty."""
    with LLM(str(tiny_checkpoint("llama")), dtype="float32", pipeline_parallel_size=2) as llm:
        prompts = [f"prompt number {i}" for i in range(4)]
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        overlapped_before = llm.engine.stats["overlapped_steps"]
        assert decode_token_rate(llm, prompts, params, steps=8) > 0
        assert llm.engine.stats["overlapped_steps"] > overlapped_before  # the stages did overlap
        llm.generate(["drain"], SamplingParams(max_tokens=1))  # any batch still in flight lands
        assert not llm.engine.has_unfinished_requests()
