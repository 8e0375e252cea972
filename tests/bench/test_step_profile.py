import json

import pytest

from kvyard.bench.step_profile import category
from kvyard.cli.main import main


def test_operators_fall_into_kinds():
    assert category("kvyard::paged_decode_attention") == category("aten::scaled_dot_product_attention") == "attention"
    assert category("kvyard::dpbf16_linear") == category("aten::addmm") == category("aten::mm") == "matmul"
    assert category("kvyard::rms_norm") == "other kernels"


# 30-130 s on a 2-core AVX2 EPYC (make test took 55 min there, 2026-12-07): run with -m slow
@pytest.mark.slow
def test_a_loaded_step_is_split_and_its_matmuls_counted(tiny_checkpoint, tmp_path):
    out = tmp_path / "profile.json"
    rc = main(["bench", "step-profile", "--model", str(tiny_checkpoint("llama")), "--decodes", "4", "--context", "16",
               "--prompt-chunk", "8", "--steps", "2", "--json-out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["step"]["tokens"] == 12
    assert set(report["phases_ms"]) == {"schedule", "prepare", "forward", "sample", "emit"}
    assert report["phases_ms"]["forward"] > 0 and report["by_kind_ms"]["matmul"] > 0
    matmul = report["matmul"]
    assert matmul["gflop_per_step"] > 0 and matmul["achieved_tflops"] > 0 and matmul["floor_ms"] > 0
    assert matmul["plain_gemm_tflops_step_shape"] > 0 and matmul["plain_gemm_tflops_2048"] > 0
