import json

import pytest
import transformers

from kvyard.structured.compiler import GrammarCompiler


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.fixture(scope="session")
def tiny_vocab_size(tiny_checkpoint):
    return json.loads((tiny_checkpoint("llama") / "config.json").read_text())["vocab_size"]


@pytest.fixture
def compiler(tiny_tokenizer, tiny_vocab_size):
    return GrammarCompiler(tiny_tokenizer, tiny_vocab_size, [tiny_tokenizer.eos_token_id or 0])
