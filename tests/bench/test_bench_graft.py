"""`kvyard bench graft` on a tiny model's graft: a real server subprocess asked held-out easy-VQA questions with
and without their images; the counters show the encoder ran once per new image and the second pass hit its cache."""

import json

from kvyard.cli.main import main
from kvyard.net import free_port
from tests.vision.conftest import graft_dir  # noqa: F401 - the fixture


def test_the_graft_bench_asks_with_and_without_images(graft_dir, tmp_path):  # noqa: F811
    out = tmp_path / "graft.json"
    assert main(["bench", "graft", "--graft", str(graft_dir), "--questions", "6", "--port", str(free_port()),
                 "--startup-timeout", "120", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["graft"]["accuracy"]) >= {"all"} and 0 <= result["graft"]["accuracy"]["all"] <= 1
    cold, warm, text = result["graft"]["counters"], result["graft_warm"]["counters"], result["text_only"]["counters"]
    assert cold["vision_encoder_runs"] + cold["vision_cache_hits"] == 6 and cold["vision_encoder_runs"] >= 1
    assert warm == {**warm, "vision_encoder_runs": 0, "vision_cache_hits": 6}
    assert text["vision_encoder_runs"] == 0 and text["vision_cache_hits"] == 0
    assert warm["prefix_cache_hits"] > cold["prefix_cache_hits"]  # the same images: their KV is reused
