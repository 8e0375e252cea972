"""KV offload to host memory in the engine: blocks the pool evicts come back from the tier for a later request
with the same prefix, and greedy fp32 outputs stay exactly HF's."""

import pytest

from kvyard import LLM, SamplingParams
from kvyard.errors import ConfigError
from kvyard.loader.checkpoint import load_checkpoint
from tests.conftest import hf_greedy, hf_reference

BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\nprint(add(3, 4))\n",
    "Paged attention keeps the KV cache in fixed-size blocks. Continuous batching admits requests.",
]


def _pool_bytes(path, blocks: int) -> int:
    cfg = load_checkpoint(path).config
    return blocks * BLOCK * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers


def _run(path, **kw) -> tuple[LLM, list[list[int]]]:
    """The first prompt, then the others (which evict its blocks from a 24-block pool), then the first again."""
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 24), **kw)
    prompts = [llm.tokenizer(t).input_ids for t in TEXTS]
    outs = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts + prompts[:1]]
    return llm, outs


def test_evicted_prefixes_come_back_from_host_memory_exactly(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    plain, want = _run(path)
    offloaded, got = _run(path, kv_offload_host_memory="4MiB")
    ref = hf_reference(path)
    prompts = [plain.tokenizer(t).input_ids for t in TEXTS]
    assert want == got == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts + prompts[:1]]
    offload = offloaded.engine.offload
    first = len(prompts[0])
    # Without the tier the first prompt's blocks were gone by its second turn; with it they came back.
    assert offload.restored_blocks == (first - 1) // BLOCK  # every block a hit may cover
    assert offload.tiers[0].stats.stored > 0 and offload.tiers[0].used_bytes <= offload.tiers[0].capacity_bytes
    gained = offloaded.engine.blocks.hit_tokens - plain.engine.blocks.hit_tokens
    assert gained >= offload.restored_blocks * BLOCK
    assert offloaded.engine.blocks.num_free_blocks == offloaded.engine.blocks.num_blocks


def test_offload_needs_the_prefix_cache(tiny_checkpoint):
    with pytest.raises(ConfigError, match="prefix cache"):
        LLM(str(tiny_checkpoint("llama")), dtype="float32", enable_prefix_caching=False,
            kv_offload_host_memory="1MiB")


def _disk_engine(path, disk, **options) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 24),
               kv_offload_disk=str(disk), kv_offload_write="through", **options)


def test_a_restarted_engine_finds_its_blocks_on_disk_and_damage_only_costs_a_recompute(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    ref = hf_reference(path)
    first = _disk_engine(path, tmp_path)
    prompt = first.tokenizer(TEXTS[1]).input_ids
    want = hf_greedy(ref, prompt, GREEDY.max_tokens)
    assert first.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    first.engine.offload.flush()
    usable = (len(prompt) - 1) // BLOCK
    # A new engine on the same directory (a restarted worker): the prompt's blocks come from disk.
    again = _disk_engine(path, tmp_path)
    assert again.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert again.engine.offload.restored == {"disk": usable}
    # Damage every block's record: the next restart recomputes, counts each, and answers the same.
    disk = again.engine.offload.tiers[0]
    again.engine.offload.close()
    assert len(disk.index) >= usable
    for seg, offset, length in disk.index.values():
        with open(seg.path, "r+b") as f:
            f.seek(offset + length - 1)
            last = f.read(1)
            f.seek(offset + length - 1)
            f.write(bytes([last[0] ^ 0xFF]))
    damaged = _disk_engine(path, tmp_path)
    assert damaged.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    disk = damaged.engine.offload.tiers[0]
    # Nothing after the first damaged block is restored; the reads already under way count what they found
    assert damaged.engine.offload.restored_blocks == 0 and 1 <= disk.stats.corrupt <= usable


def _redis_engine(path, url) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 24),
               kv_offload_redis=url, kv_offload_write="through")


def test_a_prefix_one_replica_computed_is_a_hit_on_another_through_redis(tiny_checkpoint, redis_server):
    path = tiny_checkpoint("llama")
    ref = hf_reference(path)
    a, b = _redis_engine(path, redis_server.url), _redis_engine(path, redis_server.url)
    prompt = a.tokenizer(TEXTS[2]).input_ids
    want = hf_greedy(ref, prompt, GREEDY.max_tokens)
    assert a.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    a.engine.offload.flush()
    assert b.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert b.engine.offload.restored == {"redis": (len(prompt) - 1) // BLOCK}
    # Redis gone in the middle of the run: the requests still complete, and the failure is counted.
    redis_server.stop()
    again = [a.tokenizer(t).input_ids for t in TEXTS[:2]]
    outs = [o.outputs[0].token_ids for o in b.generate(again, GREEDY)]
    assert outs == [hf_greedy(ref, p, GREEDY.max_tokens) for p in again]
    assert b.engine.offload.snapshot()["redis"]["fallback_unreachable"] >= 1


def test_forced_recompute_reads_no_tier_and_changes_no_token(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    _, want = _run(path)
    never, got = _run(path, kv_offload_host_memory="4MiB", kv_offload_decision="recompute")
    assert got == want
    offload = never.engine.offload
    assert offload.restored_blocks == 0 and offload.decide.decisions.recomputed > 0
    assert offload.tiers[0].stats.stored > 0  # still written


def test_a_one_off_prompt_that_waits_for_room_is_still_counted_once(tiny_checkpoint):
    """Prompts sharing nothing, more than the pool holds: those at the head of the queue are planned again at each
    step they wait, yet each carried its blocks once, so admission by reuse writes none of them."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(
        tiny_checkpoint("llama"), 24), kv_offload_host_memory="4MiB", kv_offload_admit_after=2)
    prompts = [[1 + i, *range(100 + 10 * i, 130 + 10 * i)] for i in range(8)]  # distinct from the first token
    llm.generate(prompts, GREEDY)
    offload = llm.engine.offload
    assert offload.not_admitted > 0 and offload.tiers[0].stats.stored == 0
    assert not offload.counted  # every request forgotten once finished


def test_admission_by_reuse_writes_only_blocks_that_prompts_carried_often_enough(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    ref = hf_reference(path)
    # Seen once, then evicted: not written, so its second turn recomputes.
    once, got = _run(path, kv_offload_host_memory="4MiB", kv_offload_admit_after=2)
    prompts = [once.tokenizer(t).input_ids for t in TEXTS]
    assert got == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts + prompts[:1]]
    assert once.engine.offload.restored_blocks == 0 and once.engine.offload.not_admitted > 0
    assert once.engine.offload.tiers[0].stats.stored == 0
    # Seen twice before the others evict it: written, and it comes back.
    twice = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 24),
                kv_offload_host_memory="4MiB", kv_offload_admit_after=2)
    outs = [twice.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts[:1] + prompts + prompts[:1]]
    assert outs[-1] == hf_greedy(ref, prompts[0], GREEDY.max_tokens)
    assert twice.engine.offload.restored_blocks == (len(prompts[0]) - 1) // BLOCK


def test_exclusive_tiers_demote_what_the_host_tier_evicts_to_disk(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    block = _pool_bytes(path, 1)
    with pytest.raises(ConfigError, match="larger than the host tier"):
        LLM(str(path), dtype="float32", block_size=BLOCK, kv_offload_host_memory=4 * block,
            kv_offload_disk=str(tmp_path), kv_offload_disk_capacity=4 * block)
    # A host tier of 6 blocks: the first prompt's blocks are pushed down to the disk by the later ones.
    llm, got = _run(path, kv_offload_host_memory=6 * block, kv_offload_disk=str(tmp_path / "d"),
                    kv_offload_disk_capacity="1MiB", kv_offload_tiers="exclusive")
    _, want = _run(path)
    assert got == want
    offload = llm.engine.offload
    host, disk = offload.tiers
    offload.flush()
    # The disk got what the host evicted or had no room for, never a block the host still holds
    assert host.stats.evicted > 0 and disk.stats.stored >= host.stats.evicted
    assert not set(host.entries) & set(disk.index)
    assert offload.restored["disk"] > 0 and offload.restored["host"] > 0
    assert len(host) + len(disk) > host.num_blocks  # the capacities add up


def test_the_tiers_kv_events_replay_to_exactly_what_each_tier_holds(tiny_checkpoint, tmp_path):
    from kvyard.engine.kv_events import apply_events

    path = tiny_checkpoint("llama")
    block = _pool_bytes(path, 1)
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 24),
              kv_offload_host_memory=6 * block, kv_offload_disk=str(tmp_path), kv_offload_disk_capacity=10 * block)
    eng = llm.engine
    pool: set[bytes] = set()
    tiers: dict[str, set[bytes]] = {}
    pool |= eng.enable_kv_events()
    for t in TEXTS + TEXTS[:1]:
        llm.generate([llm.tokenizer(t).input_ids], GREEDY)
        apply_events(pool, eng.take_kv_events(), tiers)
    eng.offload.flush()
    apply_events(pool, eng.take_kv_events(), tiers)
    host, disk = eng.offload.tiers
    assert host.stats.evicted > 0 and disk.stats.evicted > 0  # both had to make room: removals were sent too
    assert tiers == {"host": set(host.entries), "disk": set(disk.index)}
    assert pool == set(eng.blocks.cached)
    credits = eng.offload.credits()
    assert set(credits) == {"host", "disk"} and all(0.0 <= c <= 1.0 for c in credits.values())


@pytest.mark.parametrize("load", ["blocking", "overlap"])
def test_time_spent_restoring_is_not_taken_for_compute(tiny_checkpoint, tmp_path, load):
    """The decision weighs a tier's loads against the engine's compute: a slow restore inside a step must not
    make the engine look slow at computing (it would then never recompute). Overlapped, the engine thread does
    not wait for the reads at all."""
    import time

    path = tiny_checkpoint("llama")
    first = _disk_engine(path, tmp_path)
    first.generate([TEXTS[1]], GREEDY)
    first.engine.offload.flush()
    again = _disk_engine(path, tmp_path, kv_offload_load=load)
    disk = again.engine.offload.tiers[0]
    read = disk.get

    def slow_read(h, tokens):
        time.sleep(0.05)
        return read(h, tokens)

    disk.get = slow_read
    again.generate([TEXTS[1]], GREEDY)
    restored = again.engine.offload.restored_blocks
    assert restored > 0
    if load == "blocking":
        assert again.engine.offload.seconds_restoring >= 0.05 * restored
    else:
        assert again.engine.offload.seconds_restoring < 0.05 * restored / 2
    tokens = again.engine.stats["prompt_tokens"] + again.engine.stats["generation_tokens"]
    assert again.engine._seconds_per_token() < 0.05 * restored / tokens / 2


def test_a_restarted_engine_finds_its_host_tier_in_shared_memory(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    ref = hf_reference(path)
    segment = tmp_path / "kv-segment"

    def engine() -> LLM:
        return LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 24),
                   kv_offload_host_memory="1MiB", kv_offload_write="through", kv_offload_host_segment=str(segment))

    first = engine()
    prompt = first.tokenizer(TEXTS[0]).input_ids
    want = hf_greedy(ref, prompt, GREEDY.max_tokens)
    assert first.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert first.engine.offload.tiers[0].segment is not None
    first.engine.offload.close()  # the worker stops; its segment stays
    again = engine()
    assert again.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert again.engine.offload.restored == {"host": (len(prompt) - 1) // BLOCK}


def test_auto_puts_the_host_tier_in_the_shared_memory_directory(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KVYARD_SHM_DIR", str(tmp_path))
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_offload_host_memory="1MiB")
    host = llm.engine.offload.tiers[0]
    assert host.segment is not None and host.segment.path.parent == tmp_path
    assert host.segment.path.name.startswith("kvyard-kv-")
    off = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_offload_host_memory="1MiB",
              kv_offload_host_segment="off")
    assert off.engine.offload.tiers[0].segment is None


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_under_preemption_the_tiers_change_no_token(tiny_checkpoint, tmp_path, tier):
    path = tiny_checkpoint("llama")
    system = "Paged attention keeps the KV cache in fixed-size blocks. "
    prompts = [system + f"Variant {i}: item {i * 7}." for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tiers = {"host": {"kv_offload_host_memory": "4MiB"}, "disk": {"kv_offload_disk": str(tmp_path)}}[tier]
    runs = []
    for options in ({}, tiers):
        # 16 blocks of 4 tokens: far less than six prompts need, so blocks are evicted and requests preempted
        llm = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=_pool_bytes(path, 16),
                  max_num_batched_tokens=32, **options)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts + prompts[::-1], params)])
        assert llm.engine.scheduler.num_preemptions > 0
    assert runs[0] == runs[1]
    offload = llm.engine.offload
    assert offload.tiers[0].stats.stored > 0
    if tier == "host":  # (the disk's writes are asynchronous: how many land before they are asked for varies)
        assert offload.restored_blocks > 0
