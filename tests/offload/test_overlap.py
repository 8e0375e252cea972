"""Loads overlap compute: while a request's blocks are read from the disk on the reader thread, the engine
keeps stepping the running streams, and the waiting request is admitted once they arrive, with HF's tokens."""

import threading

from kvyard import SamplingParams
from tests.conftest import hf_greedy, hf_reference
from tests.offload.test_offload_engine import BLOCK, GREEDY, TEXTS, _disk_engine

STREAM = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def _gated_disk(tiny_checkpoint, tmp_path):
    """A restarted engine whose disk holds TEXTS[1]'s blocks, and whose disk reads wait for the returned gate."""
    path = tiny_checkpoint("llama")
    first = _disk_engine(path, tmp_path)
    first.generate([TEXTS[1]], GREEDY)
    first.engine.offload.flush()
    llm = _disk_engine(path, tmp_path, kv_offload_load="overlap")
    disk, gate = llm.engine.offload.tiers[0], threading.Event()
    read = disk.get

    def gated_read(h, tokens):
        assert gate.wait(30), "the test never opened the gate"
        return read(h, tokens)

    disk.get = gated_read
    return path, llm, gate


def _finish(engine, outs: dict, steps: int = 500) -> None:
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            return
        for o in engine.step():
            outs[o.request_id] = o
    raise AssertionError("the engine did not finish its requests")


def test_a_stream_keeps_decoding_while_another_request_waits_on_its_reads(tiny_checkpoint, tmp_path):
    path, llm, gate = _gated_disk(tiny_checkpoint, tmp_path)
    engine, offload = llm.engine, llm.engine.offload
    stream_prompt, loaded_prompt = (llm.tokenizer(t).input_ids for t in (TEXTS[0], TEXTS[1]))
    outs: dict = {}
    stream = engine.add_request(stream_prompt, STREAM)
    waiting = engine.add_request(loaded_prompt, GREEDY)
    for _ in range(10):
        for o in engine.step():
            outs[o.request_id] = o
    # Ten steps in, the reads are still held: the stream decoded on, the other request was never scheduled
    assert len(outs[stream].outputs[0].token_ids) >= 9 and waiting not in outs
    assert waiting in offload.pending and offload.restored_blocks == 0
    gate.set()
    _finish(engine, outs)
    ref = hf_reference(path)
    assert outs[stream].outputs[0].token_ids == hf_greedy(ref, stream_prompt, STREAM.max_tokens)
    assert outs[waiting].outputs[0].token_ids == hf_greedy(ref, loaded_prompt, GREEDY.max_tokens)
    assert offload.restored == {"disk": (len(loaded_prompt) - 1) // BLOCK} and not offload.pending


def test_aborting_a_request_that_waits_on_its_reads_loses_nothing(tiny_checkpoint, tmp_path):
    path, llm, gate = _gated_disk(tiny_checkpoint, tmp_path)
    engine, offload = llm.engine, llm.engine.offload
    loaded_prompt = llm.tokenizer(TEXTS[1]).input_ids
    waiting = engine.add_request(loaded_prompt, GREEDY)
    engine.step()
    assert waiting in offload.pending
    assert engine.abort_request(waiting)
    assert not offload.pending
    gate.set()  # the abandoned reads finish on the reader thread; a new request with the prompt still loads it
    outs: dict = {}
    again = engine.add_request(loaded_prompt, GREEDY)
    _finish(engine, outs)
    assert outs[again].outputs[0].token_ids == hf_greedy(hf_reference(path), loaded_prompt, GREEDY.max_tokens)
    assert offload.restored_blocks > 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
