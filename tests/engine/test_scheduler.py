from kvyard.config import ONLINE_TOKEN_BUDGET, ONLINE_TOKEN_BUDGET_NO_ITL_TARGET, EngineConfig
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.request import Request, Status
from kvyard.engine.scheduler import Scheduler
from kvyard.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(block_size=block_size, **cfg), BlockManager(num_blocks, block_size))


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100, temperature=0))


def run_step(s: Scheduler):
    """Pretend the model ran: advance computed tokens, append a token where one would be sampled."""
    batch = s.schedule()
    for r, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(7)
    return batch


def test_token_budget_mixes_decodes_and_prefill_chunks():
    s = make(max_num_batched_tokens=10)
    a, b = request("a", 3), request("b", 25)
    s.add(a)
    run_step(s)  # a prefilled
    s.add(b)
    batch = run_step(s)
    assert batch.requests == [a, b] and batch.num_new_tokens == [1, 9]
    batch = run_step(s)
    assert batch.num_new_tokens == [1, 9]
    assert run_step(s).num_new_tokens == [1, 7]  # last chunk of b
    assert run_step(s).num_new_tokens == [1, 1]  # both decoding


def test_whole_prompts_when_chunking_is_off():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(request("a", 4))
    s.add(request("b", 8))
    assert run_step(s).num_new_tokens == [4]  # b does not fit the rest of the budget
    assert run_step(s).num_new_tokens == [1, 8]
    s2 = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s2.add(request("long", 30))
    assert run_step(s2).num_new_tokens == [30]  # alone, a prompt may exceed the budget


def test_preempts_newest_when_blocks_run_out_and_resumes_it():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = request("a", 8), request("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)  # 2 blocks each, pool full; both now have 9 tokens
    batch = run_step(s)  # decode: each needs a 3rd block; b is preempted to let a grow
    assert batch.preempted == [b] and batch.requests == [a]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b
    s.finish(a, "stop")
    batch = run_step(s)
    assert batch.requests == [b] and batch.num_new_tokens == [9]  # recomputes prompt + its output


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(request(str(i), 2))
    assert len(run_step(s).requests) == 2 and len(s.waiting) == 1


def test_finish_returns_blocks():
    s = make(num_blocks=8)
    r = request("a", 10)
    s.add(r)
    run_step(s)
    assert s.blocks.num_free_blocks == 5
    s.finish(r, "abort")
    assert s.blocks.num_free_blocks == 8 and not s.has_work()


def test_token_budget_defaults_to_the_online_one():
    assert make().token_budget == ONLINE_TOKEN_BUDGET
    assert make(max_num_batched_tokens=10).token_budget == 10
    # Without an inter-token target the budget alone bounds how long a stream waits for a prompt chunk.
    assert make(max_itl_ms=0).token_budget == ONLINE_TOKEN_BUDGET_NO_ITL_TARGET < ONLINE_TOKEN_BUDGET
    assert make(enable_chunked_prefill=False).token_budget == ONLINE_TOKEN_BUDGET_NO_ITL_TARGET


class Loading:
    """A restorer whose reads for some requests are still in flight."""

    def __init__(self, loading: set[str]):
        self.loading = loading
        self.forgotten: list[str] = []

    def restore(self, req: Request) -> bool:
        return req.request_id not in self.loading

    def forget(self, req: Request) -> None:
        self.forgotten.append(req.request_id)


def test_a_request_waiting_on_its_blocks_lets_the_ones_behind_it_run():
    s = make()
    s.restorer = Loading({"a"})
    a, b = request("a", 6), request("b", 6)
    s.add(a)
    s.add(b)
    assert run_step(s).requests == [b] and list(s.waiting) == [a]
    assert run_step(s).requests == [b]  # still loading: b decodes on
    s.restorer.loading.clear()
    assert run_step(s).requests == [b, a] and not s.waiting  # its blocks arrived: admitted at the next step


def test_finishing_a_request_drops_its_pending_restore():
    s = make()
    s.restorer = Loading({"a"})
    a = request("a", 6)
    s.add(a)
    run_step(s)
    s.finish(a, "abort")
    assert s.restorer.forgotten == ["a"] and not s.has_work()
