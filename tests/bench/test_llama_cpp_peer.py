"""The llama.cpp peer's process protocol, against a stand-in `llama_cpp` module (llama-cpp-python itself is built
only by `make peers`, which CI does not run)."""

import sys
import textwrap

import pytest

from kvyard.bench import peers
from kvyard.bench.workload import Workload

# Counts up from the prompt's last token forever, as llama_cpp.Llama.generate streams tokens until stopped.
STAND_IN = textwrap.dedent('''
    import os

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_batch, verbose):
            if not os.path.exists(model_path):
                raise ValueError(f"Model path does not exist: {model_path}")

        def generate(self, tokens, temp, top_k, reset):
            assert temp == 0.0 and top_k == 1 and reset
            t = tokens[-1]
            while True:
                t += 1
                yield t
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


def test_a_python_that_imports_llama_cpp_is_found(stand_in):
    assert peers.llama_cpp_python() == sys.executable


def test_the_peer_generates_each_prompt_to_its_length(stand_in):
    peer = peers.LlamaCppPeer(stand_in, threads=1, python=sys.executable)
    try:
        result = peer.batch1(Workload([[1, 2, 3], [40]], [5, 3]))
        again = peer.batch1(Workload([[7]], [2]))  # the process serves request after request
    finally:
        peer.close()
    assert result["output_tokens"] == 8 and again["output_tokens"] == 2
    assert result["output_tokens_per_s"] > 0 and result["itl_ms_p50"] >= 0


def test_a_failed_load_is_raised_with_its_reason(stand_in, tmp_path):
    with pytest.raises(RuntimeError, match="Model path does not exist"):
        peers.LlamaCppPeer(tmp_path / "missing.gguf", threads=1, python=sys.executable)
