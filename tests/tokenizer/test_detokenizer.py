import pytest

from kvyard.loader.gguf_file import load_gguf
from kvyard.tokenizer.detokenizer import Detokenizer

TEXT = "Grüße aus Köln! 日本語のテキスト 🙂🚀 done."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_gguf(smollm2_path).tokenizer


def feed(tok, ids, stop=(), finish=True):
    d = Detokenizer(tok.backend_tokenizer, [1], list(stop), skip_special_tokens=True)
    chunks = []
    for t in ids:
        d.add(t)
        chunks.append(d.take_delta(finished=False))
        if d.stop_hit:
            break
    chunks.append(d.take_delta(finished=finish))
    return d, chunks


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert len(ids) > len(TEXT.split())  # emoji and CJK span several byte-level tokens
    d, chunks = feed(tokenizer, ids)
    assert "".join(chunks) == TEXT == d.text
    assert not any("\ufffd" in c for c in chunks)


def test_stop_string_is_held_back_then_cut(tokenizer):
    ids = tokenizer("alpha beta STOP gamma", add_special_tokens=False).input_ids
    d, chunks = feed(tokenizer, ids, stop=["STOP"])
    assert d.stop_hit == "STOP"
    assert "".join(chunks) == "alpha beta " and not any("ST" in c for c in chunks)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer("one two three four", add_special_tokens=False).input_ids
    d, _ = feed(tokenizer, ids, stop=["four", "two"])
    assert d.stop_hit == "two" and d.text == "one "
