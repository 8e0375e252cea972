from tests.router.conftest import tiny_path, tokenizer  # noqa: F401 - the same tiny model and tokenizer
