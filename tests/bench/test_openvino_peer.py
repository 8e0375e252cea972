"""The OpenVINO peer: its formats, its export command, and its worker's protocol against stand-in `openvino` and
`openvino_genai` modules (the real ones live only in `make openvino-peer`'s venv, which CI does not build)."""

import sys
import textwrap

import pytest

from kvyard.bench import offline, openvino_peer
from kvyard.bench.offline import _openvino_kv_precision
from kvyard.bench.workload import Workload
from kvyard.config import EngineConfig

STAND_IN_OPENVINO = textwrap.dedent('''
    class Tensor:
        def __init__(self, array):
            self.data = array

    class _Type:
        def get_type_name(self):
            return "f32"

    class _Port:
        def __init__(self, name):
            self.name = name

        def get_names(self):
            return {self.name}

    class _Request:
        """Logits [1, n, 5]: position t scores token v as (ids[t] + v) % 5, plus the calls since the last reset
        (a stateful model must be reset between sequences)."""
        def __init__(self):
            self.calls = 0

        def reset_state(self):
            self.calls = 0

        def infer(self, inputs):
            import numpy as np
            assert set(inputs) == {"input_ids", "attention_mask", "position_ids", "beam_idx"}
            ids = inputs["input_ids"][0]
            self.out = ((ids[:, None] + np.arange(5)[None]) % 5 + self.calls).astype(np.float32)[None]
            self.calls += 1

        def get_tensor(self, name):
            assert name == "logits"
            return Tensor(self.out)

    class _Compiled:
        inputs = [_Port(n) for n in ("input_ids", "attention_mask", "position_ids", "beam_idx")]

        def create_infer_request(self):
            return _Request()

        def get_property(self, name):
            assert name == "INFERENCE_PRECISION_HINT"
            return _Type()

    class Core:
        def get_property(self, device, name):
            assert (device, name) == ("CPU", "INFERENCE_PRECISION_HINT")
            return _Type()

        def read_model(self, path):
            import os
            if not os.path.exists(path):
                raise RuntimeError(f"Exception from src/frontends: {path} does not exist")
            return path

        def compile_model(self, model, device, properties):
            assert device == "CPU" and properties == {"INFERENCE_NUM_THREADS": 1}
            return _Compiled()
''')

# Greedy "generation" counts up from the prompt's last token, so the protocol's results can be checked exactly.
STAND_IN_GENAI = textwrap.dedent('''
    import os

    class GenerationConfig:
        pass

    class SchedulerConfig:
        pass

    class _Result:
        def __init__(self, ids):
            self.m_generation_ids = [ids]

    class _Output:
        def __init__(self, ids):
            self.generated_ids = ids

    class _Handle:
        def __init__(self, last, n):
            self.last, self.left, self.pending = last, n, []

        def can_read(self):
            return bool(self.pending)

        def read(self):
            out, self.pending = {0: _Output(self.pending)}, []
            return out

    def _check(config):
        assert config.ignore_eos and not config.do_sample and config.min_new_tokens == config.max_new_tokens

    class ContinuousBatchingPipeline:
        def __init__(self, model_dir, scheduler, device, properties):
            if not os.path.isdir(model_dir):
                raise RuntimeError(f"Exception from src/core: {model_dir} does not exist")
            assert scheduler.max_num_batched_tokens == 256 and scheduler.cache_size == 1 and device == "CPU"
            if properties.get("KV_CACHE_PRECISION", "u8") not in ("u8", "bf16", "f16", "f32"):
                raise RuntimeError(f"Unsupported KV_CACHE_PRECISION {properties['KV_CACHE_PRECISION']}")
            self.handles = []

        def generate(self, inputs, configs):
            for c in configs:
                _check(c)
            return [_Result(list(range(int(t.data[0, -1]) + 1, int(t.data[0, -1]) + 1 + c.max_new_tokens)))
                    for t, c in zip(inputs, configs)]

        def add_request(self, request_id, tensor, config):
            _check(config)
            self.handles.append(_Handle(int(tensor.data[0, -1]), config.max_new_tokens))
            return self.handles[-1]

        def has_non_finished_requests(self):
            return any(h.left for h in self.handles)

        def step(self):
            for h in self.handles:
                if h.left:
                    h.last += 1
                    h.pending.append(h.last)
                    h.left -= 1
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    for name, text in (("openvino", STAND_IN_OPENVINO), ("openvino_genai", STAND_IN_GENAI)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(openvino_peer, "python", lambda: sys.executable)
    (tmp_path / "ir").mkdir()
    return tmp_path / "ir"


def test_the_formats_pair_with_what_kvyard_runs():
    assert openvino_peer.parse_formats("auto", None) == ("fp16", "int8")
    assert openvino_peer.parse_formats("auto", "gguf") == ("int4",)
    assert openvino_peer.parse_formats("int4, fp16", None) == ("int4", "fp16")
    with pytest.raises(ValueError, match="unknown.*int3"):
        openvino_peer.parse_formats("fp16,int3", None)


def test_int4_is_exported_in_groups_of_32_on_every_layer(tmp_path):
    cmd = openvino_peer.export_command(tmp_path / "hf", "int4", tmp_path / "out")
    assert cmd[1:4] == ["export", "openvino", "--model"]
    flags = cmd[cmd.index("--weight-format"):-1]
    assert flags == ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"]
    assert "--sym" not in cmd  # asymmetric, as the GGUF's Q4_1 blocks
    assert cmd[-1] == str(tmp_path / "out")


def test_export_without_the_venv_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setattr(openvino_peer, "VENV", tmp_path / "nowhere")
    with pytest.raises(RuntimeError, match="make openvino-peer"):
        openvino_peer.export("smollm2-135m", ("fp16",))


def test_the_peer_generates_a_batch_and_one_at_a_time(stand_in):
    peer = openvino_peer.OpenVINOPeer(stand_in, threads=1, max_num_batched_tokens=256, kv_cache_gb=1)
    try:
        assert peer.inference_precision == "f32"
        seconds, ids = peer.batch(Workload([[1, 2, 3], [40]], [4, 2]))
        single = peer.batch1(Workload([[7], [9]], [3, 5]))  # the process serves job after job
    finally:
        peer.close()
    assert seconds >= 0 and ids == [[4, 5, 6, 7], [41, 42]]
    assert single["output_tokens"] == 8 and single["output_tokens_per_s"] > 0 and single["itl_ms_p50"] >= 0


def test_the_kv_cache_precision_reaches_the_pipeline(stand_in):
    peers = [openvino_peer.OpenVINOPeer(stand_in, 1, 256, 1, kv) for kv in (None, "bf16")]
    try:
        assert [p.kv_cache_precision for p in peers] == ["default", "bf16"]
    finally:
        for p in peers:
            p.close()
    with pytest.raises(RuntimeError, match="KV_CACHE_PRECISION bogus"):
        openvino_peer.OpenVINOPeer(stand_in, 1, 256, 1, "bogus")


def test_openvino_keeps_the_kv_cache_as_kvyard_does_unless_told_otherwise():
    bf16, fp32 = EngineConfig(model="m", dtype="bfloat16"), EngineConfig(model="m", dtype="float32")
    assert _openvino_kv_precision("match", bf16) == "bf16" and _openvino_kv_precision("match", fp32) == "f32"
    assert _openvino_kv_precision("match", EngineConfig(model="m", kv_cache_dtype="int8")) == "u8"
    assert _openvino_kv_precision("default", bf16) is None and _openvino_kv_precision("f16", bf16) == "f16"


def test_a_failed_load_is_raised_with_its_reason(stand_in, tmp_path):
    with pytest.raises(RuntimeError, match="does not exist"):
        openvino_peer.OpenVINOPeer(tmp_path / "missing", threads=1, max_num_batched_tokens=256, kv_cache_gb=1)


def test_greedy_agreement_counts_identical_outputs_and_common_prefixes():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    agreement = offline.greedy_agreement(ours, theirs)
    assert agreement["identical_share"] == pytest.approx(1 / 3)
    assert agreement["mean_common_prefix_tokens"] == pytest.approx((4 + 2 + 0) / 3)


def test_ratios_pair_kvyard_with_each_openvino_format():
    rounds = [{"kvyard.batch.tok_s": 300.0, "kvyard.batch1.tok_s": 60.0, "openvino-int4.batch.tok_s": 250.0,
               "openvino-int4.batch1.tok_s": 40.0}]
    ratios = offline._ratios(rounds, rounds[0])
    assert ratios["batch_throughput_vs_openvino_int4"]["median"] == pytest.approx(1.2)
    assert ratios["batch1_throughput_vs_openvino_int4"]["per_round"] == [1.5]


def test_ratios_pair_the_dynamic_quant_variant_with_kvyard_and_openvino():
    rounds = [{"kvyard.batch.tok_s": 300.0, "kvyard.batch1.itl_ms": 10.0, "kvyard-dynamic-quant.batch.tok_s": 390.0,
               "kvyard-dynamic-quant.batch1.itl_ms": 10.0, "openvino-int4.batch.tok_s": 300.0}]
    ratios = offline._ratios(rounds, rounds[0])
    assert ratios["dynamic_quant_batch_throughput"]["median"] == pytest.approx(1.3)
    assert ratios["dynamic_quant_batch_throughput_vs_openvino_int4"]["median"] == pytest.approx(1.3)
    assert ratios["batch_throughput_vs_openvino_int4"]["median"] == pytest.approx(1.0)


def test_logits_come_back_per_sequence_with_the_state_reset(stand_in):
    (stand_in / "openvino_model.xml").write_text("<net/>")
    logits, precision = openvino_peer.logits(stand_in, [[1, 2, 3], [4]], threads=1)
    assert precision == "f32" and [t.shape for t in logits] == [(3, 5), (1, 5)]
    assert logits[0][2].tolist() == [3.0, 4.0, 0.0, 1.0, 2.0] and logits[1][0].tolist() == [4.0, 0.0, 1.0, 2.0, 3.0]


def test_logits_from_a_missing_model_raise_its_reason(stand_in):
    with pytest.raises(RuntimeError, match="openvino_model.xml does not exist"):
        openvino_peer.logits(stand_in, [[1]], threads=1)
