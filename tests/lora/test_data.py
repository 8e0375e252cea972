"""Training files for `kvyard lora train`: capture records, chats and prompt/completion pairs become token ids
of a prompt and the completion to learn; what cannot be read is refused with the file and line."""

import json

import pytest

from kvyard.errors import InvalidRequestError
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.lora.data import KEEP, read_examples, split

SYSTEM = "Answer in JSON."


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint("llama")).tokenizer


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_a_chat_learns_the_assistant_turn_as_the_template_renders_it(tokenizer, tmp_path):
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": '{"a": 1}'}]
    [example] = read_examples(_write(tmp_path / "d.jsonl", [{"messages": chat}]), tokenizer)
    whole = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert example.prompt_ids + example.completion_ids == whole
    assert example.prompt_ids == tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True,
                                                               tokenize=True, return_dict=False)
    assert example.completion == '{"a": 1}'


def test_drop_removes_the_instruction_and_an_emptied_system_turn(tokenizer, tmp_path):
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}]
    [example] = read_examples(_write(tmp_path / "d.jsonl", [{"messages": chat}]), tokenizer, drop=(SYSTEM,))
    bare = tokenizer.apply_chat_template(chat[1:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert example.prompt_ids == bare


def test_a_capture_record_ends_with_eos_only_when_it_stopped(tokenizer, tmp_path):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    record = {"hash_ids": [0], "prompt": prompt, "output": "hello there", "gen_ai.response.finish_reasons": ["stop"]}
    cut = {**record, "gen_ai.response.finish_reasons": ["length"]}
    stopped, truncated = read_examples(_write(tmp_path / "c.jsonl", [record, cut]), tokenizer)
    assert stopped.prompt_ids == tokenizer(prompt, add_special_tokens=False).input_ids
    assert stopped.completion_ids == tokenizer("hello there", add_special_tokens=False).input_ids + [
        tokenizer.eos_token_id]
    assert truncated.completion_ids == stopped.completion_ids[:-1]


def test_prompt_and_completion_pairs_go_through_the_template_unless_raw(tokenizer, tmp_path):
    templated, raw = read_examples(_write(tmp_path / "p.jsonl", [
        {"prompt": "2+2=", "completion": "4"}, {"prompt": "2+2=", "completion": "4", "raw": True}]), tokenizer)
    assert templated.prompt_ids == tokenizer.apply_chat_template([{"role": "user", "content": "2+2="}],
                                                                 add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)
    assert raw.prompt_ids == tokenizer("2+2=").input_ids
    assert raw.completion_ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not JSON"),
    ({"hash_ids": [1], "input_length": 3}, "redacted"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "must end with the assistant"),
    ({"text": "hello"}, "expected a capture record"),
])
def test_unreadable_lines_are_refused_with_file_and_line(tokenizer, tmp_path, line, reason):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, line])
    with pytest.raises(InvalidRequestError, match=rf"bad.jsonl:2: .*{reason}"):
        read_examples(path, tokenizer)


def test_keep_json_and_the_held_out_split():
    assert KEEP["json"]('{"a": 1}') and not KEEP["json"]("{'a': 1}") and KEEP["all"]("anything")
    train, held = split(list(range(20)), 0.1, seed=3)
    assert len(held) == 2 and sorted(train + held) == list(range(20))
    assert split(list(range(20)), 0.1, seed=3) == (train, held)  # seeded
